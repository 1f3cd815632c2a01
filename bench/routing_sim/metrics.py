"""What a simulated run measured: latency percentiles, throughput, cache hits, balance.

Owns reducing a ``RunRecord`` to the figures the results file reports, with the same
definitions as ``bench/prefix_routing.py``: TTFT from the request's arrival at the gateway
to its first token at the client; throughput over the span from the first arrival to the
last completion; the prefix-cache hit rate as the replicas count it (prompt tokens found in
the cache over prompt tokens looked up, vLLM's ``prefix_cache_hits / prefix_cache_queries``).
It does not own running anything.
"""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np

from bench.routing_sim.driver import RunRecord


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (as bench/prefix_routing.py)."""
    return float(np.percentile(values, 100 * q)) if values else float("nan")


def summarize(run: RunRecord, warmup_fraction: float = 0.0) -> dict[str, Any]:
    out_delay = run.spec.output_delay_s
    done = [r for r in run.requests if r.finished_s is not None and r.first_token_s is not None]
    arrivals = sorted(r.arrival_s for r in run.requests)
    warmup_end = arrivals[int(warmup_fraction * (len(arrivals) - 1))] if warmup_fraction else 0.0
    measured = [r for r in done if r.arrival_s >= warmup_end]
    ttft = [(r.first_token_s or 0.0) + out_delay - r.arrival_s for r in measured]
    e2e = [(r.finished_s or 0.0) + out_delay - r.arrival_s for r in measured]
    later = [(r.first_token_s or 0.0) + out_delay - r.arrival_s for r in measured if r.turn > 0]
    first = min(r.arrival_s for r in run.requests)
    makespan = max(r.finished_s or 0.0 for r in done) + out_delay - first
    queries = sum(r.prefix_cache_queries for r in run.replicas)
    hits = sum(r.prefix_cache_hits for r in run.replicas)
    per_replica = [sum(1 for q in run.requests if q.address == r.address) for r in run.replicas]
    busy = [r.busy_s / makespan for r in run.replicas]
    return {
        "requests": len(run.requests),
        "completed": len(done),
        "measured_requests": len(measured),
        "warmup_s": warmup_end,
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p90_s": percentile(ttft, 0.9),
        "ttft_p99_s": percentile(ttft, 0.99),
        "ttft_mean_s": statistics.fmean(ttft),
        # Multi-turn: the turns after a conversation's first (which is cold for any policy).
        "ttft_p90_later_turns_s": percentile(later, 0.9),
        "e2e_p50_s": percentile(e2e, 0.5),
        "e2e_p90_s": percentile(e2e, 0.9),
        "makespan_s": makespan,
        "throughput_req_per_s": len(done) / makespan,
        "throughput_output_tok_per_s": sum(len(r.output_token_ids) for r in done) / makespan,
        # Of the measured requests: prompt tokens found cached when each was first scheduled.
        "prefix_cache_hit_rate": sum(r.num_cached_tokens for r in measured)
        / max(1, sum(len(r.prompt_token_ids) for r in measured)),
        "prefix_cache_hit_rate_whole_run": hits / max(1, queries),
        "prompt_tokens_cached_per_request": statistics.fmean(
            r.num_cached_tokens for r in measured),
        "requests_per_replica_max_over_mean": max(per_replica) / statistics.fmean(per_replica),
        "busy_fraction_mean": statistics.fmean(busy),
        "busy_fraction_max": max(busy),
        "preemptions": sum(r.num_preemptions for r in run.replicas),
        "pick_reasons": dict(sorted(run.gateway.reasons.items())),
        "kv_event_batches_applied": run.gateway.kv_batches_applied,
        "sim_end_s": run.sim_end_s,
        "sim_wall_s": run.wall_s,
        "sim_events": run.events,
    }
