"""The scale comparison: every workload x cluster size x policy x seed, and the issue's goals.

Owns the matrix of runs and reading the goals off it (issue 24, goal 4): at 16 replicas,
Tandem's scorer at least 3x lower TTFT p90 than round-robin on the shared-prefix and
multi-turn workloads, and no worse than least-load on the no-sharing control. Each cell is
the median over seeds of each figure, each seed its own arrivals and prompts (the same for
every policy). It does not own a run (``driver``) or the workloads'
shapes (``workloads``).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.routing_sim import workloads as wl
from bench.routing_sim.cost_model import StepCostModel
from bench.routing_sim.driver import ClusterRun, ClusterSpec
from bench.routing_sim.gateway_view import POLICIES
from bench.routing_sim.metrics import summarize
from bench.routing_sim.replica import ReplicaSpec

GOAL_REPLICAS = 16
GOAL_TTFT_P90_RATIO = 3.0
# Latencies and hit rates leave out the requests of the first fifth of the arrivals: the
# run starts with every cache cold (see ``metrics``).
WARMUP_FRACTION = 0.2
MEDIAN_KEYS = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "ttft_p90_later_turns_s",
               "e2e_p50_s", "e2e_p90_s",
               "throughput_req_per_s", "throughput_output_tok_per_s", "prefix_cache_hit_rate",
               "requests_per_replica_max_over_mean", "busy_fraction_mean",
               "busy_fraction_max", "preemptions")


@dataclass(frozen=True)
class WorkloadSettings:
    shared_prefix: wl.SharedPrefixSettings = field(default_factory=wl.SharedPrefixSettings)
    multi_turn: wl.MultiTurnSettings = field(default_factory=wl.MultiTurnSettings)
    no_sharing: wl.NoSharingSettings = field(default_factory=wl.NoSharingSettings)

    def builder(self, name: str) -> Callable[[random.Random, int], wl.Workload]:
        if name == "shared_prefix":
            return lambda rng, n: wl.shared_prefix(rng, n, self.shared_prefix)
        if name == "multi_turn":
            return lambda rng, n: wl.multi_turn(rng, n, self.multi_turn)
        if name == "no_sharing":
            return lambda rng, n: wl.no_sharing(rng, n, self.no_sharing)
        raise ValueError(f"unknown workload {name!r}")


def run_cell(workload: str, replicas: int, policy: str, seeds: Sequence[int],
             settings: WorkloadSettings, cost: StepCostModel,
             replica: ReplicaSpec) -> dict[str, Any]:
    """One workload on one cluster size under one policy, once per seed (each seed its own
    arrivals and prompts, the same for every policy)."""
    per_seed = []
    for seed in seeds:
        built = settings.builder(workload)(random.Random(seed), replicas)
        run = ClusterRun(built, POLICIES[policy], cost, ClusterSpec(replicas, replica),
                         seed).run()
        per_seed.append(summarize(run, WARMUP_FRACTION))
    cell: dict[str, Any] = {k: statistics.median(float(s[k]) for s in per_seed)
                            for k in MEDIAN_KEYS}
    cell["seeds"] = list(seeds)
    cell["requests"] = per_seed[0]["requests"]
    cell["pick_reasons"] = per_seed[0]["pick_reasons"]
    cell["per_seed"] = per_seed
    return cell


def goals(results: dict[str, dict[str, dict[str, dict[str, Any]]]]) -> dict[str, Any]:
    """results[workload][replicas][policy] -> the goal checks at GOAL_REPLICAS."""
    out: dict[str, Any] = {}
    key = str(GOAL_REPLICAS)
    for workload in ("shared_prefix", "multi_turn"):
        cell = results.get(workload, {}).get(key)
        if cell and "round_robin" in cell and "tandem" in cell:
            ratio = cell["round_robin"]["ttft_p90_s"] / cell["tandem"]["ttft_p90_s"]
            out[workload] = {"ttft_p90_round_robin_over_tandem": ratio,
                             "goal": f">= {GOAL_TTFT_P90_RATIO}",
                             "met": ratio >= GOAL_TTFT_P90_RATIO}
    cell = results.get("no_sharing", {}).get(key)
    if cell and "least_load" in cell and "tandem" in cell:
        ratio = cell["tandem"]["ttft_p90_s"] / cell["least_load"]["ttft_p90_s"]
        out["no_sharing"] = {"ttft_p90_tandem_over_least_load": ratio, "goal": "<= 1.0",
                             "met": ratio <= 1.0}
    return out
