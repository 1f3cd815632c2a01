"""Replaying the real 3-replica benchmark (``bench/prefix_routing.py``) in the simulator.

Owns turning a prefix-routing results file back into the very requests that run sent (its
settings and seed through the benchmark's own ``build_schedule`` / ``build_workload``, in
the order its ``main`` calls them, tokenized with the model's tokenizer as the gateway
does), simulating them on a cluster shaped like the one measured (its replica count, KV
capacity, the machine's cores shared by all replicas, and the fixed per-request overhead
the run measured on its direct probe), and comparing the round-robin over Tandem-scorer
ratios the simulation gives with those the run measured. It does not own the scale runs.

The machine is shared: how fast an engine step ran during a given benchmark run depends on
what else ran then, and the cost model was fitted at another moment. So each run is
simulated twice: with the fitted costs as they are, and with them scaled by the one factor
(``speed_factor``) that makes the simulated decode time match the run's own (the Poisson
phases' e2e p50 less TTFT p50: eight output tokens, steps of decodes at small batches).
That calibrates the speed on an observable apart from the ratios compared, which depend
on prefill, queueing and routing; both comparisons are reported.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.routing_sim.cost_model import StepCostModel, StepShape
from bench.routing_sim.driver import ClusterRun, ClusterSpec
from bench.routing_sim.gateway_view import POLICIES
from bench.routing_sim.metrics import summarize
from bench.routing_sim.replica import ReplicaSpec
from bench.routing_sim.workloads import Session, Turn, Workload

# The benchmark's policy names -> the simulation's.
BENCH_POLICIES = {"round_robin": "round_robin", "score": "tandem"}
RATIO_KEYS = ("ttft_p50_s", "ttft_p90_s", "makespan_s")
OVERHEAD_PROBE = "Overhead probe: the quick brown fox"  # bench/prefix_routing.py's


@dataclass(frozen=True)
class MeasuredRun:
    path: str
    report: dict[str, Any]

    @property
    def settings(self) -> dict[str, Any]:
        return dict(self.report["settings"])


def bench_workloads(settings: dict[str, Any], tokenize: Any) -> dict[str, dict[str, Workload]]:
    """workload ("poisson", "burst") -> bench policy -> the requests that phase sent."""
    from bench import prefix_routing as bench
    args = argparse.Namespace(**{**vars(bench.parse_args([])), **settings})
    rng = random.Random(args.seed)
    schedules = {"poisson": bench.build_schedule(rng, args.requests, args.rate, args),
                 "burst": bench.build_schedule(rng, args.burst_requests, None, args)}
    out: dict[str, dict[str, Workload]] = {}
    policies = args.policies.split(",")
    for name, schedule in schedules.items():
        if not schedule.at_s:
            continue
        for policy in policies:
            arrivals = bench.build_workload(rng, schedule, args.system_words, args.groups)
            sessions = [Session(a.at_s, [Turn(tokenize(a.prompt), [1000 + i % 7
                                                                for i in range(args.max_tokens)])],
                                a.group) for a in arrivals]
            out.setdefault(name, {})[policy] = Workload(f"bench_{name}", sessions, {})
    return out


def overhead_s(report: dict[str, Any], cost: StepCostModel, probe_tokens: int) -> float:
    """The run's fixed cost per request outside the engine's steps: its direct probe's
    median latency less the modelled step of that probe, plus the gateway hop it measured."""
    hop = report.get("gateway_overhead", {})
    if "direct_p50_ms" not in hop:
        return 0.0
    step = cost.step_time(StepShape.of([(0, probe_tokens, True)]))
    return max(0.0, hop["direct_p50_ms"] / 1000 - step) + max(0.0, hop["added_p50_ms"] / 1000)


def simulate(measured: MeasuredRun, cost: StepCostModel, tokenize: Any, bytes_per_block: int,
             cores: float, seed: int = 0, speed_factor: float = 1.0) -> dict[str, Any]:
    settings = measured.settings
    cost = cost.scaled(speed_factor)
    num_blocks = parse_mib(settings["kv_cache_memory"]) // bytes_per_block
    delay = overhead_s(measured.report, cost, len(tokenize(OVERHEAD_PROBE)))
    spec = ClusterSpec(int(settings["replicas"]), ReplicaSpec(num_blocks=num_blocks),
                       cores=cores, request_delay_s=delay, output_delay_s=0.0)
    results: dict[str, dict[str, Any]] = {}
    for name, by_policy in bench_workloads(settings, tokenize).items():
        for policy, workload in by_policy.items():
            run = ClusterRun(workload, POLICIES[BENCH_POLICIES[policy]], cost, spec, seed).run()
            results.setdefault(name, {})[policy] = summarize(run)
    return {"cluster": {"replicas": spec.replicas, "num_blocks": num_blocks, "cores": cores,
                        "request_overhead_s": delay, "speed_factor": speed_factor},
            "results": results, "summary": ratios(results),
            "decode_time_s": decode_time(results)}


def decode_time(results: dict[str, dict[str, Any]]) -> float:
    """The calibration observable: e2e p50 less TTFT p50, averaged over the Poisson phases."""
    phases = results.get("poisson", {}).values()
    return sum(float(r["e2e_p50_s"]) - float(r["ttft_p50_s"]) for r in phases) / max(
        1, len(phases))


def calibrate(measured: MeasuredRun, cost: StepCostModel, tokenize: Any, bytes_per_block: int,
              cores: float, iterations: int = 12) -> dict[str, Any]:
    """The simulation at the speed factor whose decode time matches the run's (bisection on
    its logarithm; the simulated decode time grows with the factor)."""
    target = decode_time(measured.report["results"])
    low, high = 0.05, 50.0
    best: dict[str, Any] = {}
    for _ in range(iterations):
        factor = (low * high) ** 0.5
        best = simulate(measured, cost, tokenize, bytes_per_block, cores, speed_factor=factor)
        if best["decode_time_s"] < target:
            low = factor
        else:
            high = factor
    best["calibration"] = {"measured_decode_time_s": target,
                           "simulated_decode_time_s": best["decode_time_s"]}
    return best


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """The benchmark's summary: round-robin over score, per workload."""
    out: dict[str, dict[str, float]] = {}
    for name, by_policy in results.items():
        rr, sc = by_policy.get("round_robin"), by_policy.get("score")
        if rr is None or sc is None:
            continue
        out[name] = {f"{k}_round_robin_over_score": float(rr[k]) / float(sc[k])
                     for k in RATIO_KEYS}
        out[name]["hit_rate_round_robin"] = float(rr["prefix_cache_hit_rate"])
        out[name]["hit_rate_score"] = float(sc["prefix_cache_hit_rate"])
    return out


def compare(simulated: dict[str, dict[str, float]], measured: dict[str, dict[str, float]],
            tolerance: float = 0.25) -> dict[str, dict[str, Any]]:
    """Per ratio: simulated, measured, simulated / measured, and whether within tolerance."""
    out: dict[str, dict[str, Any]] = {}
    for name, sim in simulated.items():
        for key, value in sim.items():
            real = measured.get(name, {}).get(key)
            if real is None or not key.endswith("_over_score"):
                continue
            out.setdefault(name, {})[key] = {
                "simulated": value, "measured": real, "simulated_over_measured": value / real,
                "within_tolerance": abs(value / real - 1) <= tolerance}
    return out


def parse_mib(text: str) -> int:
    """The benchmark's ``--kv-cache-memory`` ("256MiB", "1GiB") in bytes."""
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, scale in units.items():
        if text.endswith(unit):
            return int(float(text[:-len(unit)]) * scale)
    return int(text)


def load_measured(paths: list[Path]) -> list[MeasuredRun]:
    return [MeasuredRun(str(p), json.loads(p.read_text())) for p in paths]
