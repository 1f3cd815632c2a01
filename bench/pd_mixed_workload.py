"""P/D vs aggregated under a mixed workload: steady decodes while long prompts arrive.

Disaggregation exists to keep inter-token latency flat when long prefills arrive: on an
aggregated replica a long prompt's prefill shares the step (and the cores) with the running
decodes. This script starts, one after the other on this machine, (a) one prefill + one
decode replica behind the gateway and (b) two `both` replicas behind the gateway, runs the
same workload through the gateway with the SDK — ``--steady`` streams of short prompts
decoding ``--steady-tokens`` tokens, plus a long prompt every ``--long-interval`` seconds —
and reports TTFT of the long prompts and inter-token latency of the steady streams (p50 to max)
for both layouts, with the machine and the settings, to bench/results/pd_mixed_workload.json.

``--cpu-layout`` is `tandem up`'s, for both layouts (``auto``: by-role for P/D, shared for
two ``both`` replicas); ``even`` gives each replica its own share of the CPUs in both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import write_report  # noqa: E402
from deploy.cpu_layout import LAYOUTS  # noqa: E402
from deploy.suite_plan import SuiteConfig, plan_suite  # noqa: E402
from deploy.supervisor import Supervisor  # noqa: E402
from engine_common.default_model import ensure_default_model  # noqa: E402
from tandem.client import AsyncClient  # noqa: E402

WORDS = ("train platform ticket station airport schedule morning evening city river bridge "
         "window coffee market garden museum harbour").split()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def steady_stream(client: AsyncClient, prompt: str, tokens: int, gaps: list[float]) -> None:
    last = None
    async for chunk in client.complete_stream(prompt, max_tokens=tokens, temperature=0.0,
                                              ignore_eos=True, include_usage=False):
        now = time.perf_counter()
        if chunk.text and last is not None:
            gaps.append(now - last)
        if chunk.text:
            last = now


async def long_request(client: AsyncClient, prompt: str, ttfts: list[float]) -> None:
    start = time.perf_counter()
    async for chunk in client.complete_stream(prompt, max_tokens=4, temperature=0.0,
                                              include_usage=False):
        if chunk.text or chunk.finish_reason:
            ttfts.append(time.perf_counter() - start)
            break


async def workload(target: str, args: argparse.Namespace) -> dict[str, object]:
    rng = random.Random(args.seed)
    gaps: list[float] = []
    ttfts: list[float] = []
    async with AsyncClient(target, timeout=600) as client:
        steady = [asyncio.create_task(steady_stream(
            client, f"Count slowly, request {i}:", args.steady_tokens, gaps))
            for i in range(args.steady)]
        await asyncio.sleep(args.warmup)
        longs = []
        for _ in range(args.long_prompts):
            prompt = " ".join(rng.choice(WORDS) for _ in range(args.long_words)) + " Summary:"
            longs.append(asyncio.create_task(long_request(client, prompt, ttfts)))
            await asyncio.sleep(args.long_interval)
        await asyncio.gather(*longs)
        for task in steady:
            task.cancel()
        await asyncio.gather(*steady, return_exceptions=True)
    return {
        "long_prompt_ttft_s": {"p50": percentile(ttfts, 0.5), "p99": percentile(ttfts, 0.99),
                               "n": len(ttfts)},
        # A long prefill stalls the streams beside it a few times per prompt: rare among
        # thousands of gaps, so the tail shows in p99.9, the max and the count of stalls.
        "steady_itl_s": {"p50": percentile(gaps, 0.5), "p99": percentile(gaps, 0.99),
                         "p99.9": percentile(gaps, 0.999), "max": max(gaps, default=math.nan),
                         "n": len(gaps)},
        "steady_stalls_over_0.5s": sum(gap > 0.5 for gap in gaps),
    }


def gateway_picks(metrics_url: str) -> dict[str, dict[str, float]]:
    """How often the gateway picked each replica, by the part it played (decode, prefill)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    picks: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tandem:gateway_picks_total":
                picks.setdefault(sample.labels["replica"], {})[sample.labels["as_role"]] = (
                    sample.value)
    return picks


def run_layout(name: str, cfg: SuiteConfig, args: argparse.Namespace) -> dict[str, object]:
    suite = plan_suite(cfg)
    supervisor = Supervisor(suite, Path(tempfile.mkdtemp(prefix=f"pd-bench-{name}-")))
    supervisor.start()
    try:
        result = asyncio.run(workload(f"{cfg.host}:{cfg.gateway_port}", args))
        # Where the requests went: with two ``both`` replicas, whether the gateway put the
        # long prompts beside the steady streams or apart from them.
        result["gateway_picks"] = gateway_picks(suite.endpoints["gateway (metrics)"])
    finally:
        supervisor.stop()
    print(f"{name}: {json.dumps(result)}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--steady", type=int, default=8, help="steady decode streams")
    parser.add_argument("--steady-tokens", type=int, default=2000)
    parser.add_argument("--long-prompts", type=int, default=6)
    parser.add_argument("--long-words", type=int, default=900, help="words per long prompt")
    parser.add_argument("--long-interval", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu-layout", choices=LAYOUTS, default="auto",
                        help="tandem up's --cpu-layout, for both layouts")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "pd_mixed_workload.json")
    args = parser.parse_args()
    model = args.model or str(ensure_default_model())
    common = dict(model=model, base_port=50300, gateway_port=50350, metrics_base_port=9300,
                  kv_cache_memory="512MiB", cpu_layout=args.cpu_layout)
    results = {
        "pd_1p_1d": run_layout("1 prefill + 1 decode", SuiteConfig(
            num_prefill=1, num_decode=1, num_both=0, **common), args),  # type: ignore[arg-type]
        "both_x2": run_layout("2 both", SuiteConfig(
            num_prefill=0, num_decode=0, num_both=2, **common), args),  # type: ignore[arg-type]
    }
    pd, both = results["pd_1p_1d"], results["both_x2"]
    ratios = {
        f"itl_{q}_pd_over_both": pd["steady_itl_s"][q] / both["steady_itl_s"][q]  # type: ignore[index]
        for q in ("p50", "p99", "p99.9", "max")
    } | {
        f"ttft_{q}_pd_over_both": pd["long_prompt_ttft_s"][q] / both["long_prompt_ttft_s"][q]  # type: ignore[index]
        for q in ("p50", "p99")
    }
    print(json.dumps(ratios, indent=2))
    write_report(args.out, "pd_mixed_workload",
                 settings={k: v for k, v in vars(args).items() if k != "out"} | {"model": model},
                 results=results, ratios=ratios)


if __name__ == "__main__":
    main()
