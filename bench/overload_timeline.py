"""The engine alone under a Poisson overload: a per-request and per-step timeline.

Issue 27 goal 2 asks why an aggregated replica's TTFT tail under overload is long. This
script takes the serving layers away: one in-process engine (``LLM``: the replica's engine
core, torch on ``--threads`` threads as a replica's engine core on its own CPU) is fed
``--num-requests`` random prompts of ``--prompt-tokens`` tokens (``--output-tokens`` each, EOS
ignored) at Poisson ``--rate`` per second, seeded, after the same warm-up requests a served
replica gets (a 1-token probe, a short greedy request). It records, per request, its arrival,
when the scheduler first ran it and when its first token came (seconds from the trace's
start), and per step its prompt tokens, its decodes, its wall time, the waiting queue and the
scheduler's step-cost estimates (``StepCosts``). Variants of the scheduler's settings
(``--variant name:key=value,...``) run the same trace one after the other, interleaved over
``--rounds``; compare their TTFT and inter-token gaps only within one run.

    python bench/overload_timeline.py --variant default: --variant nocap:max_prefill_time_per_decode_step=0
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import write_report  # noqa: E402
from engine_common.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from engine_common.default_model import ensure_default_model  # noqa: E402
from engine_common.llm import LLM  # noqa: E402
from engine_common.sampling_params import SamplingParams  # noqa: E402
from engine_common.scheduler import SchedulerOutput  # noqa: E402


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    name, _, settings = text.partition(":")
    fields: dict[str, Any] = {}
    for item in filter(None, settings.split(",")):
        key, _, value = item.partition("=")
        if value.lower() in ("true", "false"):
            fields[key] = value.lower() == "true"
        else:
            fields[key] = type(getattr(SchedulerConfig(), key))(value)
    return name, fields


def trace(vocab: int, args: argparse.Namespace) -> tuple[list[list[int]], list[float]]:
    rng = random.Random(args.seed)
    prompts, arrivals, t = [], [], 0.0
    for _ in range(args.num_requests):
        prompts.append([rng.randrange(100, vocab) for _ in range(args.prompt_tokens)])
        arrivals.append(t)
        t += rng.expovariate(args.rate)
    return prompts, arrivals


def warm_up(llm: LLM) -> None:
    """What a served replica sees before a benchmark: a 1-token probe, then a short request."""
    for prompt, tokens in (("Hello", 1), ("Warm up the server.", 8)):
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=tokens))


def run_variant(llm: LLM, prompts: list[list[int]], arrivals: list[float],
                output_tokens: int) -> dict[str, object]:
    params = SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True)
    scheduler = llm.core.scheduler
    made_up: dict[str, int] = {}
    schedule = scheduler.schedule

    def observed() -> SchedulerOutput:  # the real schedule, its make-up recorded
        out = schedule()
        made_up["prompt_tokens"] = sum(s.num_new_tokens for s in out.scheduled
                                       if not s.completes_sequence or s.num_new_tokens > 1)
        made_up["decodes"] = sum(1 for s in out.scheduled
                                 if s.completes_sequence and s.num_new_tokens == 1)
        return out

    scheduler.schedule = observed  # type: ignore[method-assign]
    start = time.monotonic()
    pending = list(zip(arrivals, prompts, strict=True))
    requests: dict[str, dict[str, float]] = {}
    last_token: dict[str, float] = {}
    gaps: list[float] = []
    steps: list[dict[str, float]] = []
    while pending or llm.outputs.num_unfinished:
        now = time.monotonic() - start
        while pending and pending[0][0] <= now:
            arrival, prompt = pending.pop(0)
            request_id, _ = llm.add_request(prompt, params)
            requests[request_id] = {"arrival_s": arrival, "added_s": now}
        if not llm.outputs.num_unfinished:
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        waiting = len(scheduler.waiting)
        began = time.monotonic()
        outputs = llm.step()
        ended = time.monotonic()
        costs = scheduler.step_costs
        steps.append({"t_s": began - start, "seconds": ended - began, **made_up,
                      "waiting": waiting, "running": len(scheduler.running),
                      "decode_step_s": costs.decode_step_s or 0.0,
                      "prefill_token_s": costs.prefill_token_s or 0.0})
        for output in outputs:
            if not output.new_token_ids:
                continue
            record = requests[output.request_id]
            if "first_token_s" not in record:
                record["first_token_s"] = ended - start
                scheduled = scheduler.requests.get(output.request_id)
                if scheduled is not None and scheduled.first_scheduled_time is not None:
                    record["first_scheduled_s"] = scheduled.first_scheduled_time - start
            else:
                gaps.append(ended - last_token[output.request_id])
            last_token[output.request_id] = ended
    ttft = [r["first_token_s"] - r["arrival_s"] for r in requests.values()]
    makespan = max(last_token.values()) - start
    return summarize(ttft, gaps, makespan, len(prompts) * output_tokens, steps, requests)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def summarize(ttft: list[float], gaps: list[float], makespan: float, out_tokens: int,
              steps: list[dict[str, float]], requests: dict) -> dict[str, object]:
    return {
        "out_tok_s": out_tokens / makespan, "makespan_s": makespan,
        "ttft_p50_s": quantile(ttft, 0.5), "ttft_p99_s": quantile(ttft, 0.99),
        "itl_p50_s": quantile(gaps, 0.5), "itl_p99_s": quantile(gaps, 0.99),
        "steps": len(steps),
        "prompt_tokens_per_mixed_step_median": statistics.median(
            [s["prompt_tokens"] for s in steps if s["waiting"] and s["decodes"]] or [0]),
        "per_request": list(requests.values()), "per_step": steps,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--rate", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--variant", action="append", default=[],
                   help="name:key=value,... (SchedulerConfig fields); default: the defaults")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "overload_timeline.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    variants = [parse_variant(v) for v in args.variant or ["default:"]]
    results: dict[str, list[dict[str, object]]] = {name: [] for name, _ in variants}
    for round_index in range(args.rounds):
        for name, fields in variants:
            llm = LLM(EngineConfig(model=str(ensure_default_model()), dtype="float32",
                                   cache=CacheConfig(kv_cache_memory_bytes=1 << 30),
                                   scheduler=replace(SchedulerConfig(), **fields)))
            prompts, arrivals = trace(llm.core.arch.vocab_size, args)
            warm_up(llm)
            result = run_variant(llm, prompts, arrivals, args.output_tokens)
            results[name].append(result)
            print(f"round {round_index + 1} {name}: " + json.dumps(
                {k: round(v, 3) for k, v in result.items() if isinstance(v, float | int)}),
                flush=True)
            del llm
    write_report(args.out, "overload_timeline", settings=vars(args) | {"out": str(args.out)},
                 variants=dict(variants), results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
