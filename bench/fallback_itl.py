"""How long running streams wait for their next token while a long prompt is computed on the
same engine (a decode replica's P/D fallback), by how the scheduler caps prompt tokens beside
running decodes.

The default model (SmolLM2-135M-Instruct) in the offline ``LLM``, torch on ``--threads``
threads (1: a serving replica's engine core owns one CPU); ``--decodes`` greedy streams run
until each has ``--warmup`` tokens, then one ``--prompt-len``-token prompt (random tokens, a
new one each run so that no prefix cache helps) joins them, as a fallback recompute does.
Measured per engine step (every running stream gets one token per step, so a step's wall
time is their inter-token gap): the median step of the decodes alone (the median ITL), the
longest step while the long prompt is computed (the longest gap), their ratio (by wall time,
and by the CPU time of the computing thread, which is the wall time on a machine of one's
own), and the long prompt's time to its first token. Variants: "none" (no cap: the prompt takes what the decodes
leave of the 2048-token step budget), "tokens_N" (at most N prompt tokens a step, the time
cap off) and "default" (the shipped ``SchedulerConfig``: at most 512 tokens and about one
decode step's time, measured as the engine runs). Every variant runs once per round, rounds
interleaved; each one's figures are also given as ratios over "none".
Results: ``bench/results/fallback_itl.json``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import write_report  # noqa: E402
from engine_common.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from engine_common.default_model import ensure_default_model  # noqa: E402
from engine_common.llm import LLM  # noqa: E402
from engine_common.sampling_params import SamplingParams  # noqa: E402


def configure(llm: LLM, variant: str) -> None:
    config, defaults = llm.core.scheduler.config, SchedulerConfig()
    if variant == "none":
        config.max_prefill_tokens_while_decoding = 0
    elif variant == "default":
        config.max_prefill_tokens_while_decoding = defaults.max_prefill_tokens_while_decoding
        config.max_prefill_time_per_decode_step = defaults.max_prefill_time_per_decode_step
    else:
        config.max_prefill_tokens_while_decoding = int(variant.removeprefix("tokens_"))
        config.max_prefill_time_per_decode_step = 0.0


def one_run(llm: LLM, variant: str, args: argparse.Namespace,
            rng: random.Random) -> dict[str, float]:
    configure(llm, variant)
    vocab = llm.core.arch.vocab_size
    decode_params = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)
    streams = [llm.add_request([rng.randrange(10, vocab) for _ in range(32)], decode_params)[0]
               for _ in range(args.decodes)]
    alone: list[tuple[float, float]] = []  # (wall, CPU) seconds of a step
    tokens = 0
    while tokens < args.warmup * args.decodes:
        started, cpu = time.perf_counter(), time.thread_time()
        outputs = llm.step()
        if all(out.request_id in streams for out in outputs) and len(outputs) == len(streams):
            alone.append((time.perf_counter() - started, time.thread_time() - cpu))
        tokens += sum(len(out.new_token_ids) for out in outputs if out.request_id in streams)
    long_id, _ = llm.add_request([rng.randrange(10, vocab) for _ in range(args.prompt_len)],
                                 SamplingParams(temperature=0, max_tokens=1))
    added = time.perf_counter()
    during: list[tuple[float, float]] = []
    while True:
        started, cpu = time.perf_counter(), time.thread_time()
        outputs = llm.step()
        during.append((time.perf_counter() - started, time.thread_time() - cpu))
        if any(out.request_id == long_id for out in outputs):
            ttft = time.perf_counter() - added
            break
    llm.abort(streams)
    # The first steps include the short prefills.
    median_itl = statistics.median(wall for wall, _ in alone[2:])
    median_cpu = statistics.median(cpu for _, cpu in alone[2:])
    return {"median_itl_s": median_itl, "max_gap_s": max(wall for wall, _ in during),
            "max_gap_over_median_itl": max(wall for wall, _ in during) / median_itl,
            # The same by the computing thread's CPU time: what the wall time is on a
            # machine of one's own (on a shared one, other tenants' load adds to the wall).
            "max_gap_over_median_itl_cpu": max(cpu for _, cpu in during) / median_cpu,
            "median_gap_over_median_itl_cpu": statistics.median(
                cpu for _, cpu in during) / median_cpu,
            "long_prompt_ttft_s": ttft, "steps_for_long_prompt": len(during)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+",
                        default=["none", "tokens_64", "tokens_256", "default"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decodes", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=12)
    parser.add_argument("--prompt-len", type=int, default=1500)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/fallback_itl.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(EngineConfig(model=str(ensure_default_model()),
                           cache=CacheConfig(num_gpu_blocks_override=1024)))
    rng = random.Random(0)
    one_run(llm, "default", args, rng)  # warm up (and the step costs seen once)
    runs: dict[str, list[dict[str, float]]] = {variant: [] for variant in args.variants}
    for _ in range(args.rounds):
        for variant in args.variants:
            runs[variant].append(one_run(llm, variant, args, rng))
    results: dict[str, object] = {}
    base = runs.get("none")
    for variant, per_round in runs.items():
        summary: dict[str, object] = {
            key: statistics.median(r[key] for r in per_round) for key in per_round[0]}
        if base is not None:
            summary["max_gap_over_none_per_round"] = [
                r["max_gap_s"] / b["max_gap_s"] for r, b in zip(per_round, base, strict=True)]
            summary["ttft_over_none_per_round"] = [
                r["long_prompt_ttft_s"] / b["long_prompt_ttft_s"]
                for r, b in zip(per_round, base, strict=True)]
        summary["rounds"] = per_round
        results[variant] = summary
        print(f"{variant:>10}: max gap / median ITL {summary['max_gap_over_median_itl']:.2f} "
              f"(CPU time: {summary['max_gap_over_median_itl_cpu']:.2f}), "
              f"long-prompt TTFT {summary['long_prompt_ttft_s']:.2f} s "
              f"({summary['steps_for_long_prompt']:.0f} steps)", flush=True)
    write_report(args.out, "fallback_itl",
                 settings={k: v for k, v in vars(args).items() if k != "out"},
                 results=results)


if __name__ == "__main__":
    main()
