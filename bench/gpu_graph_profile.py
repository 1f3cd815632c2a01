"""Where a CUDA-graph decode step's time goes, batch by batch, against the same step eager.

A diagnostic for one GPU session (docs/gpu.md, "What ran on a GPU"): on an H200 the engine's
graph-replayed decode ran ~4-13x slower than eager decode at batch 256 while it ran 5x
faster at batch 64. This script builds the synthetic SmolLM2-135M-shape engine as
``bench/gpu_benchmark.py`` does and, with the KV cache as the engine sized it, times one
decode forward per mode and batch (fabricated inputs: every sequence ``--context`` tokens
long in its own blocks; the values in the cache do not change the kernels' work):

- ``graph``: ``DecodeGraphRunner.run`` (host copies + replay), as the engine calls it;
- ``static_eager``: the same static, padded buffers and split plan, run without a graph;
- ``eager``: the engine's eager decode (fresh metadata tensors each step);
- at the largest batch, graphs captured differently: alone in a private pool, and planned
  for the real context instead of ``max_model_len``.

For each: the CPU time to issue the step, the GPU time between CUDA events around it and
the wall time to a synchronize, as medians; then ``torch.profiler`` (CPU and CUDA) over a
few steps, its top kernels by CUDA time written to a text file. Last, the engine end to end
(``LLM.generate``, greedy) at the largest batch with graphs and with them switched off: the
wall time of every ``ModelRunner.execute`` (a timeline of tokens and ms) and a profile of a
few steps. Everything goes to ``--out`` (JSON plus the tables).

Found with it (docs/gpu.md): the replays were fast at every batch; the batch-256 slowdown
was the scheduler's prefill time cap shrinking prompt chunks to one block beside replayed
decodes.

Owns none of the engine; it reaches into the model runner and the graph runner to time
their parts. ``--device cpu --shape tiny`` checks the script's logic off the GPU (no
capture, Triton in its interpreter).

    python3 bench/gpu_graph_profile.py --out /tmp/profile
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

if not torch.cuda.is_available():  # before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench import gpu_benchmark  # noqa: E402
from engine_common.decode_graphs import DecodeGraphRunner, DecodeInputs  # noqa: E402
from engine_common.llm import LLM  # noqa: E402
from engine_common.model.attention.backend import AttentionMetadata  # noqa: E402
from engine_common.model_runner import ModelRunner  # noqa: E402
from engine_common.sampling_params import SamplingParams  # noqa: E402


def decode_inputs(n: int, context: int, block_size: int, vocab: int, seed: int) -> DecodeInputs:
    """``n`` sequences of ``context`` tokens each (this step's token the last), each in its
    own run of blocks from block 1 on."""
    per_seq = -(-context // block_size)
    tables = (1 + np.arange(n * per_seq, dtype=np.int32)).reshape(n, per_seq)
    position = context - 1
    rng = np.random.default_rng(seed)
    slots = tables[:, position // block_size].astype(np.int64) * block_size + position % block_size
    return DecodeInputs(
        token_ids=rng.integers(100, vocab, n).astype(np.int64),
        positions=np.full(n, position, dtype=np.int64),
        slot_mapping=slots,
        seq_lens=[context] * n,
        block_tables=tables,
    )


def eager_step(runner: ModelRunner, inputs: DecodeInputs) -> torch.Tensor:
    """The model runner's eager decode forward, as ``ModelRunner.execute`` builds it."""
    dev = runner.device
    n = len(inputs.seq_lens)
    metadata = AttentionMetadata(
        slot_mapping=torch.from_numpy(inputs.slot_mapping).to(dev),
        query_start_loc=torch.from_numpy(np.arange(n + 1, dtype=np.int32)).to(dev),
        seq_lens=torch.tensor(inputs.seq_lens, dtype=torch.int32, device=dev),
        block_tables=torch.from_numpy(inputs.block_tables).to(dev),
        max_query_len=1,
        max_seq_len=max(inputs.seq_lens),
        query_lens_cpu=[1] * n,
        seq_lens_cpu=inputs.seq_lens,
    )
    return runner.model(torch.from_numpy(inputs.token_ids).to(dev),
                        torch.from_numpy(inputs.positions).to(dev), runner.kv_cache, metadata)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_steps(step: Callable[[], Any], iters: int, warmup: int) -> dict[str, Any]:
    """Medians over ``iters`` steps: CPU time to issue one, GPU time between events around
    it, wall time to a synchronize after it."""
    for _ in range(warmup):
        step()
    _sync()
    cuda = torch.cuda.is_available()
    issue, gpu, wall = [], [], []
    for _ in range(iters):
        start_event = torch.cuda.Event(enable_timing=True) if cuda else None
        end_event = torch.cuda.Event(enable_timing=True) if cuda else None
        t0 = time.perf_counter()
        if start_event is not None:
            start_event.record()
        step()
        if end_event is not None:
            end_event.record()
        t1 = time.perf_counter()
        _sync()
        t2 = time.perf_counter()
        issue.append(1e3 * (t1 - t0))
        wall.append(1e3 * (t2 - t0))
        if start_event is not None and end_event is not None:
            gpu.append(start_event.elapsed_time(end_event))
    return {"issue_cpu_ms": statistics.median(issue), "wall_ms": statistics.median(wall),
            "gpu_event_ms": statistics.median(gpu) if gpu else None,
            "wall_ms_min": min(wall), "wall_ms_max": max(wall), "iters": iters}


def _sort_key(prof: Any) -> str:
    events = prof.key_averages()
    sample = events[0] if len(events) else None
    return "self_device_time_total" if hasattr(sample, "self_device_time_total") \
        else "self_cuda_time_total"


def profile_steps(step: Callable[[], Any], steps: int, out: Path, name: str) -> dict[str, Any]:
    """torch.profiler over ``steps`` steps (each synchronised): the top ops by self CUDA time
    to ``out/name.txt``; returns the top kernels and the totals per step."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    step()
    _sync()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
            _sync()
    key = _sort_key(prof)
    device_attr = key.removeprefix("self_")  # device_time_total or cuda_time_total
    table = prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=90)
    cpu_table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15,
                                          max_name_column_width=90)
    (out / f"{name}.txt").write_text(f"== by {key}\n{table}\n== by self CPU time\n{cpu_table}\n")
    kernels: list[dict[str, Any]] = []
    cpu_ops: list[dict[str, Any]] = []
    for evt in prof.key_averages():
        row = {"name": evt.key[:160], "count": evt.count / steps,
               "device_us_per_step": float(getattr(evt, device_attr, 0.0) or 0.0) / steps,
               "self_cpu_us_per_step": evt.self_cpu_time_total / steps}
        # Kernels and copies are events of their own (device type CUDA); a CPU op's device
        # time repeats its kernels', so only the former are summed.
        on_device = str(getattr(evt, "device_type", "")).endswith("CUDA")
        (kernels if on_device else cpu_ops).append(row)
    kernels.sort(key=lambda r: r["device_us_per_step"], reverse=True)
    cpu_ops.sort(key=lambda r: r["self_cpu_us_per_step"], reverse=True)
    return {"steps": steps,
            "device_ms_per_step": sum(r["device_us_per_step"] for r in kernels) / 1e3,
            "self_cpu_ms_per_step": sum(r["self_cpu_us_per_step"] for r in cpu_ops) / 1e3,
            "top_kernels": kernels[:20], "top_cpu_ops": cpu_ops[:12]}


def build_engine(args: argparse.Namespace) -> LLM:
    bench_args = gpu_benchmark.parse_args([
        "--device", args.device, "--synthetic-shape", args.shape,
        "--max-model-len", str(args.max_model_len),
        "--gpu-memory-utilization", str(args.gpu_memory_utilization),
        "--cuda-graph-max-batch-size", str(max(args.batches)),
        *([] if args.device == "cuda" else ["--cpu-kv-cache-mib", "64"]),
    ])
    model_dir = gpu_benchmark.synthetic_model_dir(args.shape, bench_args.synthetic_dir,
                                                  bench_args.seed, args.device)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    config, _settings = gpu_benchmark.engine_config(
        bench_args, model_dir, dtype, max(args.batches), enforce_eager=False,
        attention_backend="triton")
    return LLM(config)


class Profiler:
    """The run's results, written after every stage."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.out: Path = args.out
        self.out.mkdir(parents=True, exist_ok=True)
        self.data: dict[str, Any] = {"command": [sys.executable, *sys.argv],
                                     "settings": {k: str(v) for k, v in vars(args).items()},
                                     "errors": []}

    def save(self) -> None:
        (self.out / "graph_profile.json").write_text(json.dumps(self.data, indent=2) + "\n")

    def stage(self, name: str, fn: Callable[[], Any]) -> Any:
        print(f"== {name}", flush=True)
        started = time.perf_counter()
        try:
            result = fn()
        except Exception:
            self.data["errors"].append(f"{name}:\n{traceback.format_exc()}")
            print(traceback.format_exc(), flush=True)
            result = None
        self.data.setdefault("stage_seconds", {})[name] = time.perf_counter() - started
        self.save()
        return result


def step_modes(runner: ModelRunner, graphs: DecodeGraphRunner | None,
               static: DecodeGraphRunner, inputs: DecodeInputs) -> dict[str, Callable[[], Any]]:
    modes: dict[str, Callable[[], Any]] = {
        "static_eager": lambda: static.run(inputs),
        "eager": lambda: eager_step(runner, inputs),
    }
    if graphs is not None:
        modes = {"graph": lambda: graphs.run(inputs), **modes}
    return modes


def lm_head_step(runner: ModelRunner, hidden: torch.Tensor) -> Callable[[], Any]:
    """The step's part outside the graph for greedy rows: logits, argmax, to the host."""
    return lambda: runner.model.compute_logits(hidden).argmax(dim=-1).tolist()


def recaptured(runner: ModelRunner, graphs: DecodeGraphRunner, size: int,
               plan_len: int, private_pool: bool, side_stream: bool) -> DecodeGraphRunner:
    """A second graph runner (its own static buffers) with one graph, at ``size``, captured
    alone: in a private pool or in a fresh shared one, planned for ``plan_len`` tokens,
    warmed up on the default stream or (``side_stream``) on the capture stream itself."""
    other = DecodeGraphRunner(runner.model, runner.kv_cache, size, graphs.max_model_len,
                              runner.block_size, capture=False)
    metadata = other._metadata(size, [plan_len] * size)
    stream = torch.cuda.Stream() if side_stream else None
    with torch.inference_mode():
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    other._forward(size, metadata)
        else:
            other._forward(size, metadata)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        pool = None if private_pool else torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            other._outputs[size] = other._forward(size, metadata)
    other._graphs[size] = graph
    return other


def microbenchmarks(prof: Profiler, llm: LLM) -> None:
    args = prof.args
    runner = llm.core.model_runner
    graphs = runner.decode_graphs
    static = runner.static_decode_runner(llm.core.max_model_len, capture=False)
    vocab = runner.arch.vocab_size
    results: dict[str, Any] = {}
    prof.data["decode_forward"] = results
    largest = max(args.batches)
    for n in sorted(set(args.batches) | set(args.timing_only_batches)):
        inputs = decode_inputs(n, args.context, runner.block_size, vocab, seed=n)
        entry: dict[str, Any] = {"batch": n, "context": args.context}
        results[str(n)] = entry
        with torch.inference_mode():
            for mode, step in step_modes(runner, graphs, static, inputs).items():
                entry[mode] = prof.stage(f"time {mode} x{n}",
                                         partial(time_steps, step, args.iters, args.warmup))
                if n in args.batches:
                    entry[f"{mode}_profile"] = prof.stage(
                        f"profile {mode} x{n}",
                        partial(profile_steps, step, args.profile_steps, prof.out,
                                f"profile_{mode}_x{n}"))
            hidden = static.run(inputs)
            entry["lm_head_argmax"] = prof.stage(
                f"time lm head x{n}",
                partial(time_steps, lm_head_step(runner, hidden), args.iters, args.warmup))
            if graphs is None or n != largest:
                continue
            variants = (("alone_private_pool", graphs.max_model_len, True, False),
                        ("alone_planned_for_context", args.context, False, False),
                        ("alone_side_stream_warmup", graphs.max_model_len, True, True))
            for label, plan_len, private, side in variants:
                other = prof.stage(f"capture {label} x{n}",
                                   partial(recaptured, runner, graphs, n, plan_len, private,
                                           side))
                if other is not None:
                    entry[f"graph_{label}"] = prof.stage(
                        f"time graph {label} x{n}",
                        partial(time_steps, partial(other.run, inputs), args.iters,
                                args.warmup))
                    del other
                    gc.collect()


@contextlib.contextmanager
def step_timeline(runner: ModelRunner) -> Iterator[list[tuple[int, float]]]:
    """Records (tokens scheduled, wall ms) of every ``ModelRunner.execute`` inside; a step
    that samples waits for its GPU work (the sampled tokens go to the host)."""
    timeline: list[tuple[int, float]] = []
    execute = runner.execute

    def timed(scheduler_output: Any) -> Any:
        start = time.perf_counter()
        result = execute(scheduler_output)
        tokens = sum(s.num_new_tokens for s in scheduler_output.scheduled)
        timeline.append((tokens, 1e3 * (time.perf_counter() - start)))
        return result

    runner.execute = timed  # type: ignore[method-assign]
    try:
        yield timeline
    finally:
        del runner.execute


def decode_step_medians(timeline: list[tuple[int, float]], batch: int) -> list[float]:
    """Median ms of the full-batch decode steps, 32 consecutive steps at a time."""
    decode = [ms for tokens, ms in timeline if tokens == batch]
    return [statistics.median(decode[i:i + 32]) for i in range(0, len(decode), 32)]


def end_to_end(prof: Profiler, llm: LLM) -> None:
    """``LLM.generate`` at the largest batch: graphs on, then off; time per decode step as
    the difference to a one-token run."""
    args = prof.args
    runner = llm.core.model_runner
    graphs = runner.decode_graphs
    n = max(args.batches)
    vocab = runner.arch.vocab_size
    prompts = gpu_benchmark.make_prompts(n, args.prompt_len, vocab, seed=1)
    warm = gpu_benchmark.make_prompts(n, args.prompt_len, vocab, seed=2)
    result: dict[str, Any] = {"batch": n, "prompt_len": args.prompt_len,
                              "output_len": args.output_len}
    prof.data["end_to_end"] = result

    def generate(batch: list[list[int]], tokens: int) -> float:
        llm.core.kv_cache_manager.reset_prefix_cache()
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        _sync()
        start = time.perf_counter()
        llm.generate(batch, params)
        _sync()
        return time.perf_counter() - start

    modes = {"eager": None} if graphs is None else {"graph": graphs, "eager": None}
    for mode, runner_graphs in modes.items():
        runner.decode_graphs = runner_graphs
        try:
            def measure() -> dict[str, Any]:
                generate(warm, 4)
                before = graphs.num_steps if graphs is not None else 0
                with step_timeline(runner) as timeline:
                    full = generate(prompts, args.output_len)
                one = generate(prompts, 1)
                return {"seconds": full, "one_token_seconds": one,
                        "ms_per_decode_step": 1e3 * (full - one) / (args.output_len - 1),
                        "graph_replays": (graphs.num_steps - before
                                          if graphs is not None else 0),
                        "decode_step_ms_by_32_steps": decode_step_medians(timeline, n),
                        "timeline_tokens_ms": timeline}
            result[mode] = prof.stage(f"end to end {mode} x{n}", measure)
            result[f"{mode}_profile"] = prof.stage(
                f"profile end to end {mode} x{n}",
                partial(profile_steps, partial(generate, prompts, args.profile_tokens), 1,
                        prof.out, f"profile_e2e_{mode}_x{n}"))
        finally:
            runner.decode_graphs = graphs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",") if x]

    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--shape", default="smollm2-135m",
                        choices=sorted(gpu_benchmark.SYNTHETIC_SHAPES))
    parser.add_argument("--batches", type=ints, default=[64, 256],
                        help="decode batches timed and profiled; the largest is the graph limit")
    parser.add_argument("--timing-only-batches", type=ints, default=[128, 192])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=33)
    parser.add_argument("--profile-tokens", type=int, default=6)
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--skip-micro", action="store_true",
                        help="only the end-to-end runs")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prof = Profiler(args)
    if args.device == "cuda":
        prof.data["environment"] = gpu_benchmark.environment("cuda")
        prof.save()
    llm = prof.stage("build engine", lambda: build_engine(args))
    if llm is None:
        return 1
    runner = llm.core.model_runner
    prof.data["engine"] = {"num_kv_blocks": runner.num_blocks,
                           "captured": None if runner.decode_graphs is None
                           else runner.decode_graphs.sizes,
                           "max_model_len": llm.core.max_model_len}
    if not args.skip_micro:
        microbenchmarks(prof, llm)
    if not args.skip_e2e:
        end_to_end(prof, llm)
    prof.save()
    for line in summary(prof.data):
        print(line)
    return 1 if prof.data["errors"] else 0


def summary(data: dict[str, Any]) -> list[str]:
    """One line per timed thing: median wall, GPU-event and issue times in ms."""
    lines = []
    for n, entry in data.get("decode_forward", {}).items():
        for mode, timing in entry.items():
            if isinstance(timing, dict) and "wall_ms" in timing:
                gpu = timing["gpu_event_ms"]
                lines.append(f"x{n:>4} {mode:<32} wall {timing['wall_ms']:8.2f} ms  gpu "
                             f"{'-' if gpu is None else f'{gpu:8.2f}'} ms  issue "
                             f"{timing['issue_cpu_ms']:8.2f} ms")
            elif isinstance(timing, dict) and "top_kernels" in timing:
                top = ", ".join(f"{r['name'][:48]} {r['device_us_per_step']:.0f}us"
                                for r in timing["top_kernels"][:4])
                lines.append(f"x{n:>4} {mode:<32} device {timing['device_ms_per_step']:.2f} "
                             f"ms/step, self CPU {timing['self_cpu_ms_per_step']:.2f}: {top}")
    for mode, result in data.get("end_to_end", {}).items():
        if isinstance(result, dict) and "top_kernels" in result:
            top = ", ".join(f"{r['name'][:48]} {r['device_us_per_step']:.0f}us"
                            for r in result["top_kernels"][:5])
            lines.append(f"e2e {mode}: device {result['device_ms_per_step']:.1f} ms, self CPU "
                         f"{result['self_cpu_ms_per_step']:.1f} ms per generate: {top}")
        if isinstance(result, dict) and "ms_per_decode_step" in result:
            lines.append(f"e2e {mode}: {result['ms_per_decode_step']:.2f} ms per decode step, "
                         f"{result['graph_replays']} replays; by 32 steps: "
                         + " ".join(f"{ms:.1f}" for ms in result["decode_step_ms_by_32_steps"]))
    lines.append(f"errors: {len(data.get('errors', []))}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
