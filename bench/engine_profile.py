"""Where a decode step of Tandem's engine spends its time, on the offline benchmark's workload.

Owns one measurement: the offline benchmark's 64 prompts x 128 tokens are prefilled, the
engine decodes a few steps, then ``--steps`` decode steps (batch 64, contexts of 130-140
tokens) are timed one by one without the profiler and profiled with ``torch.profiler``
(operator self times, grouped by input shape so the LM head stands apart from the
projections). The operators are summed into the step's parts (projections, LM head,
attention, copies, elementwise, the rest) and the result is written as JSON and as a text
table. It runs pinned to ``--cpus`` with as many torch threads, like the benchmark's
one-core and two-core runs. It does not compare engines (``offline_throughput`` does).

    .venv/bin/python bench/engine_profile.py --cpus 0 --label before
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import machine  # noqa: E402

# The engine under test: this tree's, or another checkout's (a baseline commit, to compare
# before and after a change in one run); the bench modules above are this tree's either way.
ENGINE_ROOT_VARIABLE = "TANDEM_BENCH_ENGINE_ROOT"
ENGINE_ROOT = Path(os.environ.get(ENGINE_ROOT_VARIABLE, ROOT))
sys.path.insert(0, str(ENGINE_ROOT))
from engine_common.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from engine_common.default_model import ensure_default_model  # noqa: E402
from engine_common.llm import LLM  # noqa: E402
from engine_common.sampling_params import SamplingParams  # noqa: E402

# Operator name -> the part of a step it belongs to; the first matching prefix wins.
_PARTS = (
    ("mkldnn::_linear_pointwise", "linear (projections + LM head)"),
    ("aten::linear", "linear (projections + LM head)"),
    ("aten::addmm", "linear (projections + LM head)"),
    ("aten::mm", "linear (projections + LM head)"),
    ("aten::bmm", "attention: matmuls"),
    ("aten::baddbmm", "attention: matmuls"),
    ("aten::_softmax", "attention: softmax"),
    ("aten::softmax", "attention: softmax"),
    ("aten::_scaled_dot_product", "attention: SDPA"),
    ("tandem::add_rms_norm", "RMSNorm"),  # the fused kernels (model/layers/cpu_fused.py)
    ("tandem::silu_mul", "elementwise (mul/add/silu/...)"),
    ("tandem::rotary", "rotary"),
    ("tandem::onednn_linear", "linear (projections + LM head)"),
    ("tandem::kv_write", "KV cache write"),
    ("tandem::", "attention: paged kernel"),
    ("aten::index_select", "gather (index_select)"),
    ("aten::index_copy_", "KV cache write"),
    ("aten::index_put_", "KV cache write"),
    ("aten::index", "indexing"),
    ("aten::copy_", "copies"),
    ("aten::clone", "copies"),
    ("aten::contiguous", "copies"),
    ("aten::zeros", "allocations + fills"),
    ("aten::zero_", "allocations + fills"),
    ("aten::fill_", "allocations + fills"),
    ("aten::empty", "allocations + fills"),
    ("aten::argmax", "sampling (argmax)"),
    ("aten::_fused_rms_norm", "RMSNorm"),
    ("aten::rms_norm", "RMSNorm"),
    ("aten::mul", "elementwise (mul/add/silu/...)"),
    ("aten::add", "elementwise (mul/add/silu/...)"),
    ("aten::sub", "elementwise (mul/add/silu/...)"),
    ("aten::silu", "elementwise (mul/add/silu/...)"),
    ("aten::pow", "elementwise (mul/add/silu/...)"),
    ("aten::rsqrt", "elementwise (mul/add/silu/...)"),
    ("aten::mean", "elementwise (mul/add/silu/...)"),
)


def part_of(name: str) -> str:
    return next((part for prefix, part in _PARTS if name.startswith(prefix)), "other ops")


def paged_kernel_ran(llm: LLM) -> bool:
    runner = llm.core.model_runner
    kernel = getattr(runner.model.attention_backend, "paged_kernel", None)  # absent before it
    return kernel is not None and kernel(runner.dtype, runner.device) is not None


def build_engine(model: Path, num_prompts: int) -> LLM:
    return LLM(EngineConfig(
        model=str(model), dtype="auto",
        cache=CacheConfig(kv_cache_memory_bytes=1 << 30),
        scheduler=SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=max(256, num_prompts)),
    ))


def timed_step(llm: LLM) -> dict[str, float]:
    """One engine step: wall time, the process's user and system CPU time, page faults."""
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    llm.step()
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    return {"wall_s": wall, "user_s": after.ru_utime - before.ru_utime,
            "system_s": after.ru_stime - before.ru_stime,
            "minor_page_faults": after.ru_minflt - before.ru_minflt}


def summarize(prof: torch.profiler.profile, steps: int) -> dict[str, object]:
    """Operator self times per step, summed into the step's parts, and the top operators."""
    events = prof.key_averages(group_by_input_shape=True)
    total_us = sum(e.self_cpu_time_total for e in events)
    parts: dict[str, float] = {}
    ops = []
    for e in events:
        parts[part_of(e.key)] = parts.get(part_of(e.key), 0.0) + e.self_cpu_time_total
        ops.append({"op": e.key, "input_shapes": str(e.input_shapes)[:160],
                    "calls_per_step": e.count / steps,
                    "self_ms_per_step": e.self_cpu_time_total / 1000 / steps,
                    "percent": 100 * e.self_cpu_time_total / total_us})
    ops.sort(key=lambda op: -float(op["self_ms_per_step"]))  # type: ignore[arg-type]
    return {
        "profiled_self_ms_per_step": total_us / 1000 / steps,
        "parts_percent": {k: round(100 * v / total_us, 1)
                          for k, v in sorted(parts.items(), key=lambda kv: -kv[1])},
        "top_ops": ops[:25],
        "table": prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20),
    }


def profile(llm: LLM, prompts: list[list[int]], steps: int) -> dict[str, object]:
    """The prefill step and ``steps`` decode steps timed unprofiled, then profiled."""
    params = SamplingParams(temperature=0.0, max_tokens=10 + 2 * steps, ignore_eos=True)
    ids = [llm.add_request(p, params)[0] for p in prompts]
    prefill = timed_step(llm)  # the whole prompt batch in one step at this budget
    for _ in range(3):
        llm.step()
    decode = [timed_step(llm) for _ in range(steps)]
    step_ms = [1000 * d["wall_s"] for d in decode]
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        for _ in range(steps):
            llm.step()
    llm.abort(ids)
    llm.core.kv_cache_manager.reset_prefix_cache()
    ids = [llm.add_request(p, params)[0] for p in prompts]
    with torch.profiler.profile(activities=activities, record_shapes=True) as prefill_prof:
        llm.step()
    llm.abort(ids)
    return {
        "prefill_step": prefill,
        "decode_steps_unprofiled": decode,
        "step_ms_unprofiled": {"median": statistics.median(step_ms), "all": step_ms},
        "step_cpu_ms_unprofiled_median": 1000 * statistics.median(
            d["user_s"] + d["system_s"] for d in decode),
        **summarize(prof, steps),
        "prefill_profile": summarize(prefill_prof, 1),
    }


def linear_flops_per_token(llm: LLM) -> float:
    """FLOPs of the projections and the LM head for one token (2 per multiply-add)."""
    a = llm.core.arch
    q, kv = a.num_heads * a.head_size, a.num_kv_heads * a.head_size
    per_layer = a.hidden_size * (q + 2 * kv) + q * a.hidden_size \
        + 3 * a.hidden_size * a.intermediate_size
    return 2.0 * (a.num_layers * per_layer + a.hidden_size * a.vocab_size)


def gemm_roof_gflops(size: int = 1024, repeats: int = 10) -> float:
    """What a large float32 matmul reaches on these cores and threads (best of ``repeats``):
    the practical roof the linear layers' GEMMs can be held against."""
    x, w = torch.randn(size, size), torch.randn(size, size)
    torch.mm(x, w)
    best = min(_timed(lambda: torch.mm(x, w)) for _ in range(repeats))
    return 2 * size ** 3 / best / 1e9


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def linear_bound(llm: LLM, result: dict[str, object], batch: int, prompt_len: int
                 ) -> dict[str, float]:
    """The linear layers' achieved GFLOPS in a decode step and in the prefill step, against
    the GEMM roof on the same cores, and how fast the engine could be if everything but the
    linear layers took no time (the bound on any gain that leaves the GEMMs as they are)."""
    flops = linear_flops_per_token(llm)
    parts = result["parts_percent"]
    prefill_parts = result["prefill_profile"]["parts_percent"]  # type: ignore[index]
    decode_s = result["step_ms_unprofiled"]["median"] / 1000  # type: ignore[index]
    prefill_s = result["prefill_step"]["wall_s"]  # type: ignore[index]
    decode_linear = parts["linear (projections + LM head)"] / 100  # type: ignore[index]
    prefill_linear = prefill_parts["linear (projections + LM head)"] / 100
    # The LM head runs on each prompt's last position only.
    prefill_flops = batch * (prompt_len * flops - (prompt_len - 1) * 2 * llm.core.arch.hidden_size
                             * llm.core.arch.vocab_size)
    return {
        "gemm_roof_gflops": gemm_roof_gflops(),
        "decode_linear_gflops": batch * flops / (decode_s * decode_linear) / 1e9,
        "prefill_linear_gflops": prefill_flops / (prefill_s * prefill_linear) / 1e9,
        "decode_linear_share": decode_linear,
        "prefill_linear_share": prefill_linear,
        "max_speedup_decode_if_only_linear": 1 / decode_linear,
        "max_speedup_prefill_if_only_linear": 1 / prefill_linear,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpus", default="0", help="comma-separated CPU ids to run on")
    parser.add_argument("--label", default="before")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    cpus = [int(c) for c in args.cpus.split(",")]
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))

    from bench.offline_throughput import make_prompts

    model = ensure_default_model()
    prompts = make_prompts(args.num_prompts, args.prompt_len, 49152, seed=0)
    llm = build_engine(model, args.num_prompts)
    result = profile(llm, prompts, args.steps)
    result["linear_bound"] = linear_bound(llm, result, args.num_prompts, args.prompt_len)
    runner = llm.core.model_runner
    name = f"engine_profile_{args.label}_{len(cpus)}core"
    report = {
        "benchmark": "engine_profile", "machine": machine(),
        "settings": {"cpus": cpus, "torch_threads": torch.get_num_threads(),
                     "batch": args.num_prompts, "prompt_len": args.prompt_len,
                     "profiled_decode_steps": args.steps, "dtype_requested": "auto",
                     "dtype_run": str(runner.dtype).removeprefix("torch."),
                     "weights_packed": runner.model.packed_lm_head is not None,
                     "attention_backend": runner.model.attention_backend.name,
                     "paged_decode_kernel": paged_kernel_ran(llm),
                     "engine_root": str(ENGINE_ROOT)},
        **{k: v for k, v in result.items() if k != "table"},
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    prefill_profile = result["prefill_profile"]
    assert isinstance(prefill_profile, dict)
    prefill_parts = prefill_profile["parts_percent"]
    report["prefill_profile"] = {k: v for k, v in prefill_profile.items() if k != "table"}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{name}.json").write_text(json.dumps(report, indent=2))
    summary = (f"{name}: decode step, batch {args.num_prompts}, {len(cpus)} core(s), dtype "
               f"{report['settings']['dtype_run']} (packed: "
               f"{report['settings']['weights_packed']})\n"
               f"unprofiled decode step: median {result['step_ms_unprofiled']['median']:.1f} ms"
               f" wall, {result['step_cpu_ms_unprofiled_median']:.1f} ms CPU"
               f"\nprefill step (64 x 128 tokens): {result['prefill_step']}\n"
               f"parts (% of profiled self time):\n" +
               "".join(f"  {k:34s} {v:5.1f}\n" for k, v in result["parts_percent"].items()) +
               "\n" + str(result["table"]) +
               "\n\nlinear layers against the GEMM roof: " + json.dumps(
                   {k: round(v, 2) for k, v in result["linear_bound"].items()}) +  # type: ignore[union-attr]
               "\n\nprefill step, parts (% of profiled self time):\n" +
               "".join(f"  {k:34s} {v:5.1f}\n" for k, v in prefill_parts.items()) +
               "\n" + str(prefill_profile["table"]))
    (args.out_dir / f"{name}.txt").write_text(summary)
    print(summary)


if __name__ == "__main__":
    main()
