"""The gateway's picker and prefix index as pure logic: scoring, filters, the P/D decider,
and applying KV-event batches (gaps, resyncs, removals)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine_common.block_hash import hash_prompt_blocks
from gateway.__main__ import build_parser, options_from_args
from gateway.load import LoadView
from gateway.metrics import GatewayMetrics
from gateway.picker import NoReplicaError, PickerConfig, ReplicaState, pick
from gateway.prefix_index import PrefixIndex
from gateway.role_fallback import RoleFallbacks
from gateway.snapshot import prompt_block_hashes
from protos.tandem.v1 import engine_pb2

BS = 16


def replica(address: str, role: str = "both", *, healthy: bool = True, matched: int = 0,
            running: int = 0, waiting: int = 0, kv: float = 0.0, in_flight: int = 0,
            age: float | None = 0.01) -> ReplicaState:
    load = LoadView(num_running=running, num_waiting=waiting, kv_cache_usage=kv,
                    in_flight=in_flight, age_s=age)
    return ReplicaState(address, role, healthy, load, matched)


def test_an_adapters_requests_go_only_where_it_is_served() -> None:
    """Decode and prefill replicas alike: one without the adapter is no candidate (a
    rolling update that adds an adapter to some replicas first), whatever its load or
    cache; the base model goes anywhere."""
    sql = frozenset({"sql"})
    replicas = [replace(replica("idle", "decode", matched=8), lora_adapters=frozenset()),
                replace(replica("busy", "decode", running=9), lora_adapters=sql),
                replace(replica("p-idle", "prefill"), lora_adapters=frozenset()),
                replace(replica("p-busy", "prefill", running=9), lora_adapters=sql)]
    decision = pick(replicas, 200, BS, lora_name="sql")
    assert (decision.decode.address, decision.prefill and decision.prefill.address) == (
        "busy", "p-busy")
    assert decision.filtered["idle"] == "no LoRA adapter 'sql'"
    assert pick(replicas, 200, BS).decode.address == "idle"
    with pytest.raises(NoReplicaError, match="idle: no LoRA adapter 'poet'"):
        pick(replicas, 200, BS, lora_name="poet")


def test_prefix_wins_over_light_load() -> None:
    replicas = [replica("a", matched=8, running=3), replica("b"), replica("c")]
    decision = pick(replicas, num_prompt_tokens=8 * BS + 5, block_size=BS)
    assert decision.decode.address == "a"
    assert decision.reason == "prefix"
    assert decision.decode.prefix_fraction == pytest.approx(128 / 133)
    assert decision.pd_reason == "no_prefill_replica" and decision.prefill is None


def test_queue_breaks_even_caches_and_in_flight_counts() -> None:
    replicas = [replica("a", running=2), replica("b", waiting=1), replica("c", in_flight=3)]
    decision = pick(replicas, 40, BS)
    assert decision.decode.address == "b"
    assert decision.reason == "load"
    # Our own in-flight streams count when the replica's report has not caught up.
    assert [c.address for c in decision.candidates] == ["b", "a", "c"]


def test_kv_usage_scorer_and_weights() -> None:
    replicas = [replica("a", kv=0.9), replica("b", kv=0.1)]
    assert pick(replicas, 40, BS).decode.address == "b"
    only_queue = PickerConfig(kv_usage_weight=0.0)
    # With the KV scorer off, the tie is broken by tie_break alone.
    assert {pick(replicas, 40, BS, only_queue, tie_break=i).decode.address
            for i in range(2)} == {"a", "b"}


def test_kv_usage_below_the_floor_leaves_ties_to_rotation() -> None:
    """Reports lag a step: the replica mid-prefill reports its usage from before that
    prompt's blocks. Below kv_usage_floor, usage breaks no tie between equally queued
    replicas (rotation does, as with least-load); above it, the emptier cache wins."""
    mid_prefill = replica("mid-prefill", running=1, kv=0.05)  # stale: its prompt's blocks
    decoding = replica("decoding", running=1, kv=0.30)
    chosen = {pick([mid_prefill, decoding], 40, BS, tie_break=i).decode.address
              for i in range(2)}
    assert chosen == {"mid-prefill", "decoding"}
    # The scorer before the floor: the stale-looking report wins every tie.
    no_floor = PickerConfig(kv_usage_floor=0.0)
    assert {pick([mid_prefill, decoding], 40, BS, no_floor, tie_break=i).decode.address
            for i in range(2)} == {"mid-prefill"}
    # Near a full cache usage still counts, linearly from the floor to 0 at full.
    near_full = pick([replica("a", kv=0.95), replica("b", kv=0.7)], 40, BS)
    assert near_full.decode.address == "b"
    assert near_full.decode.scores["kv_usage"] == pytest.approx(0.6)
    assert near_full.candidates[1].scores["kv_usage"] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="kv_usage_floor"):
        PickerConfig(kv_usage_floor=1.0)


def test_ties_rotate_with_tie_break() -> None:
    replicas = [replica(x) for x in "abc"]
    chosen = [pick(replicas, 10, BS, tie_break=i).decode.address for i in range(6)]
    assert chosen == ["a", "b", "c", "a", "b", "c"]


def test_filters_unhealthy_excluded_stale_and_roles() -> None:
    replicas = [
        replica("sick", healthy=False, matched=4),
        replica("failed", matched=4),
        replica("stale", matched=4, age=10.0),
        replica("p", role="prefill", matched=4),
        replica("ok"),
    ]
    decision = pick(replicas, 80, BS, exclude={"failed"})
    assert decision.decode.address == "ok"
    assert decision.filtered == {"sick": "unhealthy", "failed": "excluded",
                                 "stale": "load_stale"}
    assert decision.reason == "only_candidate"


def test_stale_everywhere_still_routes() -> None:
    decision = pick([replica("a", age=9.0), replica("b", age=9.0, running=1)], 10, BS)
    assert decision.decode.address == "a"


def test_no_replica_of_any_role_raises_with_reasons() -> None:
    with pytest.raises(NoReplicaError, match="p: unhealthy, sick: unhealthy"):
        pick([replica("sick", healthy=False), replica("p", role="prefill", healthy=False)],
             10, BS)


def test_with_no_decode_replica_a_prefill_replica_runs_the_request_whole() -> None:
    """Roles are a preference: the dead (or excluded: a resumption) decode replica's
    requests go to the least loaded prefill replica, with no prefill hop, and back to a
    decode replica as soon as one is usable."""
    prefill = [replica("p1", role="prefill", running=3), replica("p2", role="prefill")]
    decision = pick([replica("d", role="decode", healthy=False), *prefill], 10 * BS, BS)
    assert (decision.decode.address, decision.prefill) == ("p2", None)
    assert (decision.pd_reason, decision.missing_role) == ("no_decode_replica", "decode")
    assert decision.filtered == {"d": "unhealthy"}
    resumed = pick([replica("d", role="decode"), *prefill], 10 * BS, BS, exclude={"d"})
    assert resumed.decode.address == "p2" and resumed.missing_role == "decode"
    back = pick([replica("d", role="decode"), *prefill], 10 * BS, BS)
    assert (back.decode.address, back.missing_role, back.pd_reason) == (
        "d", "", "prefill_hop")


def test_with_no_usable_prefill_replica_the_decode_replica_prefills_and_says_so() -> None:
    sick = pick([replica("d", role="decode"), replica("p", role="prefill", healthy=False)],
                10 * BS, BS)
    assert (sick.decode.address, sick.prefill, sick.missing_role) == ("d", None, "prefill")
    # A layout without prefill replicas misses nothing.
    assert pick([replica("d", role="both")], 10 * BS, BS).missing_role == ""


def test_pd_decider() -> None:
    prefill = [replica("p1", role="prefill", running=2), replica("p2", role="prefill", matched=2)]
    cold_decode = [replica("d1", role="decode"), *prefill]
    decision = pick(cold_decode, 10 * BS, BS)
    assert decision.decode.address == "d1"
    assert decision.pd_reason == "prefill_hop"
    assert decision.prefill is not None and decision.prefill.address == "p2"

    # A decode replica holding most of the prompt still leaves its tail (64 tokens here) to a
    # prefill replica, the one holding the prefix too: its compute is its streams'.
    warm_decode = [replica("d1", role="decode", matched=6), *prefill]
    decision = pick(warm_decode, 10 * BS, BS)
    assert decision.pd_reason == "prefill_hop"
    assert decision.prefill is not None and decision.prefill.address == "p2"
    tail = pick(warm_decode, 6 * BS + 20, BS)  # 20 uncached tokens: not worth a hop
    assert tail.pd_reason == "short_prompt" and tail.prefill is None
    whole = pick(warm_decode, 6 * BS, BS)
    assert whole.pd_reason == "cached_on_decode" and whole.prefill is None
    by_fraction = pick(warm_decode, 10 * BS, BS, PickerConfig(prefill_skip_fraction=0.5))
    assert by_fraction.pd_reason == "cached_on_decode" and by_fraction.prefill is None

    short = pick(cold_decode, 20, BS)
    assert short.pd_reason == "short_prompt" and short.prefill is None

    sick_prefill = [replica("d1", role="decode"),
                    replica("p1", role="prefill", healthy=False)]
    decision = pick(sick_prefill, 10 * BS, BS)
    assert decision.pd_reason == "no_prefill_replica"
    assert decision.filtered == {"p1": "unhealthy"}


def measured(address: str, role: str, *, queued: int = 0, rate: float = 0.0,
             share: float = 1.0, running: int = 0, matched: int = 0,
             healthy: bool = True) -> ReplicaState:
    """A replica with what it publishes for time-to-first-token estimates."""
    load = LoadView(num_running=running, age_s=0.01, prefill_tokens_queued=queued,
                    prefill_tokens_per_s=rate, prefill_share=share)
    return ReplicaState(address, role, healthy, load, matched)


def test_the_prompt_goes_to_the_prefill_replica_estimated_to_finish_it_first() -> None:
    """Queued prompt tokens and measured rates, not queue depth: one long prompt queued (4 s
    of work) loses to two short ones (0.1 s), which the queue scorer preferred; a dead one is
    no candidate, however idle; a replica not measured yet (just restarted) is estimated
    with the others' rate; none measured: the scores decide, as before."""
    long_queue = measured("p-long", "prefill", queued=8000, rate=2000.0, running=1)
    short_queue = measured("p-short", "prefill", queued=200, rate=2000.0, running=2)
    decode = measured("d", "decode", rate=2000.0, share=0.5, running=4)
    decision = pick([decode, long_queue, short_queue], 20 * BS, BS)
    assert decision.prefill is not None and decision.prefill.address == "p-short"
    assert decision.prefill.ttft_estimate_s == pytest.approx((200 + 320) / 2000 + 0.05)
    unplaced = pick([decode, long_queue, short_queue], 20 * BS, BS,
                    PickerConfig(estimate_placement=False))
    assert unplaced.prefill is not None and unplaced.prefill.address == "p-long"
    dead_idle = measured("p-dead", "prefill", rate=2000.0, healthy=False)
    assert pick([decode, short_queue, dead_idle], 20 * BS, BS).prefill.address == "p-short"
    restarted = measured("p-new", "prefill")  # no rate yet: the median of the others'
    decision = pick([decode, long_queue, short_queue, restarted], 20 * BS, BS)
    assert decision.prefill is not None and decision.prefill.address == "p-new"
    # Idle replicas are even whatever their rates (a restarted one's was measured cold): the
    # scores decide, here the one with fewer prompts running.
    cold = measured("p-cold", "prefill", rate=20.0)
    warm = measured("p-warm", "prefill", rate=2000.0, running=1)
    assert pick([decode, cold, warm], 20 * BS, BS).prefill.address == "p-cold"
    unknown = [measured("d", "decode"), measured("p1", "prefill", queued=9000, running=0),
               measured("p2", "prefill", running=3)]
    assert pick(unknown, 20 * BS, BS).prefill.address == "p1"  # the queue scorer's choice


def test_the_decode_replica_computes_the_prompt_when_that_is_estimated_sooner() -> None:
    """Its own estimate counts its share beside its streams; it must beat the hop by
    ``self_prefill_min_gain_s``: a prefill replica a few prompts behind keeps the prompt, one
    seconds behind (the prompts of a dead prefill replica handed back to it) does not."""
    decode = measured("d", "decode", share=0.5, running=4)  # rate: the prefill replica's
    behind = measured("p", "prefill", queued=12000, rate=2000.0, running=6)
    decision = pick([decode, behind], 20 * BS, BS)
    assert (decision.pd_reason, decision.prefill) == ("self_prefill_sooner", None)
    assert decision.decode.ttft_estimate_s == pytest.approx(320 / 1000)
    assert decision.missing_role == ""
    near = measured("p", "prefill", queued=1000, rate=2000.0, running=2)
    assert pick([decode, near], 20 * BS, BS).pd_reason == "prefill_hop"
    # A busy decode replica (its own prompts queued) keeps the hop even then.
    busy = measured("d", "decode", queued=20000, share=0.5, running=4)
    assert pick([busy, behind], 20 * BS, BS).pd_reason == "prefill_hop"
    # An idle prefill replica keeps the prompt however slow its measured rate: a rate taken
    # over cold first steps was 100x low and sent a healthy suite's prompts to the decode
    # replica (tests/test_moe_serving.py, a fresh make test).
    cold = measured("p", "prefill", rate=20.0)
    fast_decode = measured("d", "decode", rate=5000.0, running=4)
    assert pick([fast_decode, cold], 20 * BS, BS).pd_reason == "prefill_hop"
    with pytest.raises(ValueError, match="self_prefill_min_gain_s must be 0 or more"):
        PickerConfig(self_prefill_min_gain_s=-1.0)


def _stored(seq: int, hashes: list[bytes]) -> engine_pb2.KvEventBatch:
    batch = engine_pb2.KvEventBatch(seq=seq)
    batch.events.add().block_stored.block_hashes.extend(hashes)
    return batch


def test_prefix_index_applies_events_in_order() -> None:
    chain = hash_prompt_blocks(list(range(64)), BS)
    other = hash_prompt_blocks(list(range(100, 132)), BS)
    index = PrefixIndex()
    assert index.apply("a", _stored(1, chain[:3]))
    assert index.apply("b", _stored(1, chain[:1] + other))
    assert index.longest_prefix("a", chain) == 3
    assert index.longest_prefix("b", chain) == 1
    assert index.match(chain) == {"a": 3, "b": 1}
    assert index.match(other) == {"b": 2}

    removed = engine_pb2.KvEventBatch(seq=2)
    removed.events.add().block_removed.block_hashes.append(chain[1])
    assert index.apply("a", removed)
    assert index.longest_prefix("a", chain) == 1  # a chain is broken by its first hole

    assert index.apply("a", _stored(2, chain))  # a replay of an applied seq changes nothing
    assert index.longest_prefix("a", chain) == 1
    assert not index.apply("a", _stored(4, chain))  # seq 3 is missing: caller must rebuild
    assert index.last_seq("a") == 2

    snapshot = engine_pb2.KvEventBatch(seq=9, resync=True, snapshot=engine_pb2.KvCacheSnapshot(
        block_hashes=chain[:2], chunk_index=0, num_chunks=1))
    assert index.apply("a", snapshot)
    assert index.longest_prefix("a", chain) == 2 and index.num_blocks("a") == 2
    cleared = engine_pb2.KvEventBatch(seq=10)
    cleared.events.add().all_blocks_cleared.SetInParent()
    assert index.apply("a", cleared)
    assert index.match(chain) == {"b": 1}


def test_salt_changes_the_chain() -> None:
    tokens = list(range(40))
    assert prompt_block_hashes(tokens, BS) == hash_prompt_blocks(tokens, BS)
    salted = prompt_block_hashes(tokens, BS, "tenant-a")
    assert salted == hash_prompt_blocks(tokens, BS, ("tenant-a",))
    assert salted[0] != prompt_block_hashes(tokens, BS)[0]


def test_routed_blocks_count_until_confirmed_or_expired() -> None:
    chain = hash_prompt_blocks(list(range(48)), BS)
    index = PrefixIndex(expect_ttl_s=5.0)
    assert index.apply("a", engine_pb2.KvEventBatch(seq=1))  # "a" is known, holds nothing
    assert index.apply("b", engine_pb2.KvEventBatch(seq=1))
    index.expect("a", chain, now=100.0)
    assert index.match(chain, now=101.0) == {"a": 3}
    assert index.match(chain, now=106.0) == {}  # expired: it never confirmed them
    index.expect("b", chain, now=200.0)
    index.retract("b", chain)  # the request failed there before any work
    assert index.match(chain, now=200.5) == {}

    index.expect("a", chain, now=300.0)
    assert index.apply("a", _stored(2, chain[:2]))  # events confirm two of the three blocks
    assert index.match(chain, now=301.0) == {"a": 3}
    assert index.match(chain, now=400.0) == {"a": 2}  # confirmed ones do not expire


def test_round_robin_policy_ignores_caches_and_load() -> None:
    args = build_parser().parse_args(
        ["--model", "m", "--replica", "a:1", "--policy", "round_robin", "--prefix-weight", "5"])
    config = options_from_args(args).picker
    replicas = [replica("a", matched=9, running=0), replica("b", running=7), replica("c", kv=0.9)]
    chosen = [pick(replicas, 10 * BS, BS, config, tie_break=i).decode.address for i in range(3)]
    assert chosen == ["a", "b", "c"]
    scored = options_from_args(build_parser().parse_args(["--model", "m", "--replica", "a:1"]))
    assert pick(replicas, 10 * BS, BS, scored.picker).decode.address == "a"


def test_role_fallbacks_are_counted_per_decision_and_logged_once_per_change(
        caplog: pytest.LogCaptureFixture) -> None:
    metrics = GatewayMetrics()
    fallbacks = RoleFallbacks(metrics)
    no_decode = pick([replica("d", role="decode", healthy=False),
                      replica("p", role="prefill")], 10 * BS, BS)
    no_prefill = pick([replica("d", role="decode"),
                       replica("p", role="prefill", healthy=False)], 10 * BS, BS)
    both = pick([replica("d", role="decode"), replica("p", role="prefill")], 10 * BS, BS)
    with caplog.at_level("WARNING", logger="gateway.role_fallback"):
        for decision in (no_decode, no_decode, no_decode, no_prefill, both, both):
            fallbacks.observe(decision)
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "no decode replica is usable: prefill replicas run requests whole (first: p)",
        "decode replicas are usable again: roles as configured",
        "no prefill replica is usable: decode replicas compute prompts themselves (first: d)",
        "prefill replicas are usable again: roles as configured"]
    counted = {r: metrics.role_fallbacks.labels(r)._value.get() for r in ("decode", "prefill")}
    assert counted == {"decode": 3, "prefill": 1}
