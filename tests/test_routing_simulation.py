"""The routing simulator (bench/routing_sim): small runs through the gateway's real picker,
prefix index and load tracker onto replicas built from the engine's real scheduler and
block pool. Seconds, not minutes: a fixed cost model, a few replicas, tens of requests."""

from __future__ import annotations

import random

import pytest

from bench.routing_sim import workloads as wl
from bench.routing_sim.cost_model import StepCostModel, StepShape, fit, relative_errors
from bench.routing_sim.cpu_share import CpuShare
from bench.routing_sim.driver import ClusterRun, ClusterSpec
from bench.routing_sim.events import EventLoop
from bench.routing_sim.gateway_view import POLICIES
from bench.routing_sim.metrics import summarize
from bench.routing_sim.replica import ReplicaSpec
from engine_common.block_hash import hash_prompt_blocks

# Roughly this machine's engine on one core (the fitted file is not needed here).
COST = StepCostModel(step_s=0.03, token_s=0.0015, sampled_s=0.004,
                     context_token_s=5e-6, pair_s=1e-7)
SHARED = wl.SharedPrefixSettings(groups_per_replica=2, system_tokens=512,
                                 question_tokens=(16, 48), output_tokens=(4, 12),
                                 rate_per_replica=0.5, requests_per_replica=25)


def _run(workload: wl.Workload, policy: str, replicas: int = 4, num_blocks: int = 200):
    run = ClusterRun(workload, POLICIES[policy], COST,
                     ClusterSpec(replicas, ReplicaSpec(num_blocks=num_blocks)), seed=0).run()
    return run, summarize(run)


def test_prefix_aware_routing_beats_round_robin_on_shared_prompts() -> None:
    """8 system prompts of 512 tokens over 4 replicas whose caches hold ~6 each: spread
    round-robin, every replica sees every group and evicts; Tandem's scorer keeps each group
    where its prompt is cached."""
    workload = wl.shared_prefix(random.Random(1), 4, SHARED)
    _, rr = _run(workload, "round_robin")
    _, tandem = _run(workload, "tandem")
    assert rr["completed"] == tandem["completed"] == workload.num_requests
    assert tandem["prefix_cache_hit_rate"] > rr["prefix_cache_hit_rate"] + 0.2
    assert tandem["ttft_p90_s"] < rr["ttft_p90_s"] / 2
    assert tandem["pick_reasons"].get("prefix", 0) > workload.num_requests / 2


def test_kv_events_reach_the_real_prefix_index() -> None:
    """After a run, the gateway's index holds exactly what each replica's block pool caches,
    at the replica's last KV-event seq: the events went through ``PrefixIndex.apply``, the
    evictions (BlockRemoved) as well as the stores."""
    run, summary = _run(wl.shared_prefix(random.Random(2), 4, SHARED), "tandem", num_blocks=60)
    assert summary["kv_event_batches_applied"] > 0
    index = run.gateway.index
    for replica in run.replicas:
        cached = replica.kv.get_cached_block_hashes()
        assert cached, replica.address
        assert index.num_blocks(replica.address) == len(cached) <= 60
        assert index.longest_prefix(replica.address, cached[:1]) == 1
        assert index.last_seq(replica.address) == replica.kv_events.last_seq > 0
        routed = {h for r in run.requests if r.address == replica.address
                  for h in hash_prompt_blocks(r.prompt_token_ids, 16)}
        assert len(routed) > 60  # more than its cache holds: it evicted, and the index knows


def test_a_conversation_follows_its_cache() -> None:
    """Multi-turn: under Tandem's scorer each later turn goes where the previous turn (its
    prompt and the answer's tokens) is cached; round-robin scatters them."""
    settings = wl.MultiTurnSettings(first_tokens=(128, 256), user_tokens=(16, 32),
                                    output_tokens=(16, 32), turns=(3, 4), think_s=1.0,
                                    conversations_per_replica=3, start_rate_per_replica=0.2)
    workload = wl.multi_turn(random.Random(3), 4, settings)
    run, tandem = _run(workload, "tandem", num_blocks=400)
    _, rr = _run(workload, "round_robin", num_blocks=400)
    later = [r for r in run.requests if r.num_cached_tokens > 0]
    first_turns = len(workload.sessions)
    assert len(later) >= workload.num_requests - first_turns - 1
    assert tandem["prefix_cache_hit_rate"] > 2 * rr["prefix_cache_hit_rate"]


def test_no_sharing_has_no_hits_and_balances_load() -> None:
    workload = wl.no_sharing(random.Random(4), 4, wl.NoSharingSettings(
        prompt_tokens=(64, 256), output_tokens=(4, 8), rate_per_replica=0.5,
        requests_per_replica=15))
    _, least = _run(workload, "least_load")
    _, tandem = _run(workload, "tandem")
    assert least["prefix_cache_hit_rate"] == tandem["prefix_cache_hit_rate"] == 0.0
    assert tandem["requests_per_replica_max_over_mean"] < 1.5


def test_fit_recovers_a_known_cost_model() -> None:
    """Prefill chunks after cached prefixes and decode batches, as fit_costs measures them,
    with 3% noise: the fit finds the coefficients again."""
    truth = StepCostModel(0.02, 0.002, 0.01, 2e-5, 2e-6)
    rng = random.Random(0)
    shapes = [StepShape.of([(p, c, True)]) for p in (0, 512, 2048) for c in (16, 64, 256, 1024)]
    shapes += [StepShape.of([(L, 1, True)] * b) for L in (128, 1024, 2048) for b in (1, 4, 16, 64)]
    seconds = [truth.step_time(s) * rng.uniform(0.97, 1.03) for s in shapes]
    model = fit(shapes, seconds)
    assert max(abs(e) for e in relative_errors(model, shapes, seconds)) < 0.05
    for name in ("token_s", "sampled_s", "context_token_s", "pair_s"):
        assert getattr(model, name) == pytest.approx(getattr(truth, name), rel=0.25), name


def test_cpu_share_slows_steps_when_replicas_outnumber_cores() -> None:
    loop = EventLoop()
    cpu = CpuShare(loop, cores=2)
    done: dict[str, float] = {}
    for name, work in (("a", 1.0), ("b", 1.0), ("c", 1.0)):
        cpu.run(work, lambda n=name: done.__setitem__(n, loop.now))
    loop.run()
    # Three one-second steps on two cores: all progress at 2/3 speed, finishing at 1.5 s.
    assert done == pytest.approx({"a": 1.5, "b": 1.5, "c": 1.5})
