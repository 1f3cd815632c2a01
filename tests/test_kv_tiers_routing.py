"""The router knows the KV tiers: the engine's events carry the tier (``medium``) of every
store and removal, and the gateway's prefix index, fed those very events, weighs a match by
tier, reaches the shared tier from every replica, and predicts per tier what the engine then
loads (within one block)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from deploy.cli import add_suite_args, suite_config
from deploy.k8s import K8sOptions, render_k8s_manifests
from deploy.suite_plan import plan_suite
from engine_common.block_hash import hash_prompt_blocks
from engine_common.kv_events import BlockRemoved, BlockStored, KVEventBatch
from engine_common.kv_tiers.config import KvTiersConfig
from gateway.__main__ import build_parser as gateway_parser
from gateway.__main__ import options_from_args as gateway_options
from gateway.cluster import ClusterView
from gateway.endpoint_picker_main import build_parser as picker_parser
from gateway.endpoint_picker_main import options_from_args as picker_options
from gateway.load import LoadView
from gateway.picker import ReplicaState, pick
from gateway.prefix_index import PrefixIndex
from gateway.tier_weights import parse_tier_weights
from protos.tandem.v1 import engine_pb2 as epb
from services.engine_api.messages import kv_event_batch_to_pb
from tests.kv_tiers_workload import BLOCK, GREEDY, TURN2_TIER_BLOCKS, engine, prompts

BS = 4


def _batch(seq: int, events: list) -> epb.KvEventBatch:  # type: ignore[type-arg]
    return kv_event_batch_to_pb(KVEventBatch(seq, 0.0, events))


def test_match_weighs_tiers_and_the_shared_tier_reaches_every_replica() -> None:
    chain = hash_prompt_blocks(list(range(40)), BS)  # 10 blocks
    index = PrefixIndex(tier_weights={"host": 0.5, "shared": 0.25})
    index.apply("a", _batch(1, [BlockStored(chain[:4], None, [], BS)]))
    index.apply("a", _batch(2, [BlockStored(chain[4:8], chain[3], [], BS, medium="host")]))
    index.apply("b", _batch(1, [BlockStored(chain[:2], None, [], BS)]))
    index.apply("c", _batch(1, []))  # a replica with nothing of it
    assert index.prefix_tiers("a", chain) == ["device"] * 4 + ["host"] * 4
    assert index.match(chain) == {"a": 6, "b": 2}  # 4 + 4 * 0.5
    # The shared tier holds the whole chain: every replica reaches all of it.
    index.apply("a", _batch(3, [BlockStored(chain, None, [], BS, medium="shared")]))
    assert index.prefix_tiers("c", chain) == ["shared"] * 10
    assert index.match(chain) == {"a": 7, "b": 4, "c": 3}  # 4+2+0.5, 2+2, 2.5: rounded half up
    # A tier's removal is that tier's only: device blocks stay.
    index.apply("a", _batch(4, [BlockRemoved(chain[4:8], medium="host"),
                                BlockRemoved(chain, medium="shared")]))
    assert index.prefix_tiers("a", chain) == ["device"] * 4
    assert index.match(chain) == {"a": 4, "b": 2}
    # Old replicas send no medium: device.
    removed = epb.KvEventBatch(seq=5)
    removed.events.add().block_removed.block_hashes.extend(chain[:4])
    assert index.apply("a", removed)
    assert index.prefix_tiers("a", chain) == []


def test_router_predicts_per_tier_what_the_engine_loads(tiny_llama_dir: Path) -> None:
    """The engine's own events, through the wire format, into the gateway's index: before
    turn 2 the index must say its prefix is in the host tier, 11 blocks, as the engine then
    loads."""
    turn1, others, more = prompts()
    llm = engine(tiny_llama_dir, KvTiersConfig(memory_bytes=1 << 20))
    index = PrefixIndex()
    seq = 0
    step = llm.core.step

    def step_and_index():  # type: ignore[no-untyped-def]
        nonlocal seq
        outputs = step()
        if outputs.kv_events:
            seq += 1
            assert index.apply("replica", _batch(seq, outputs.kv_events))
        return outputs

    llm.core.step = step_and_index  # type: ignore[method-assign]
    first = llm.generate([turn1], GREEDY)[0].token_ids
    for prompt in others:
        llm.generate([prompt], GREEDY)
    assert llm.core.kv_tiers.drain()
    llm.generate([[1, 2, 3]], GREEDY)  # one more step carries the last stores' events
    turn2 = turn1 + first + more
    hashes = hash_prompt_blocks(turn2, BLOCK)
    predicted = index.prefix_tiers("replica", hashes[:(len(turn2) - 1) // BLOCK])
    loaded_before = llm.core.kv_tiers.totals()["host"].hits
    second = llm.generate([turn2], GREEDY)[0]
    loaded = llm.core.kv_tiers.totals()["host"].hits - loaded_before
    assert loaded == TURN2_TIER_BLOCKS and second.num_cached_tokens == loaded * BLOCK
    assert abs(predicted.count("host") - loaded) <= 1 and "device" not in predicted
    llm.core.close()


def test_a_restarted_replica_announces_what_its_disk_tier_holds(tiny_llama_dir: Path,
                                                               tmp_path: Path) -> None:
    turn1, others, more = prompts()
    config = KvTiersConfig(disk_dir=str(tmp_path / "kv"), disk_bytes=1 << 24)
    llm = engine(tiny_llama_dir, config)
    first = llm.generate([turn1], GREEDY)[0].token_ids
    assert llm.core.kv_tiers.drain()
    llm.core.close()
    restarted = engine(tiny_llama_dir, config)
    events = restarted.core.step().kv_events  # the first step, with no request at all
    index = PrefixIndex()
    assert index.apply("replica", _batch(1, events))
    turn2 = turn1 + first + more
    hashes = hash_prompt_blocks(turn2, BLOCK)[:(len(turn2) - 1) // BLOCK]
    assert index.prefix_tiers("replica", hashes) == ["disk"] * TURN2_TIER_BLOCKS
    restarted.core.close()


def test_tier_weights_flag_is_validated_and_changes_the_routing_decision(
        tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--kv-tier-weights`` on the gateway (and the endpoint picker, ``tandem up``, ``tandem
    render k8s``, which pass it on): a replica holding 8 blocks in its host tier beats one
    holding 5 in its pool at host=0.8 (6.4 blocks), loses at host=0.5 (4)."""
    for bad, said in [("host=2", "must be in [0, 1], got 2"), ("tape=0.1", "unknown KV tier"),
                      ("host=x", "must be a number"), ("host", "expected TIER=WEIGHT"),
                      ("host=0.1,host=0.2", "given twice"), ("disk=nan", "in [0, 1]")]:
        with pytest.raises(ValueError, match=re.escape(said)):
            parse_tier_weights(bad)
    with pytest.raises(SystemExit) as exit_:
        gateway_parser().parse_args(["--replica", "h:1", "--kv-tier-weights", "tape=1"])
    assert exit_.value.code == 2
    assert "--kv-tier-weights: unknown KV tier 'tape'" in capsys.readouterr().err

    def decision(flags: list[str]) -> str:
        options = gateway_options(gateway_parser().parse_args(
            ["--model", str(tiny_llama_dir), "--replica", "h:1", *flags]))
        index = ClusterView.create(["h:1"], [], dns_interval_s=5, load_interval_s=0.05,
                                   tier_weights=options.kv_tier_weights).index
        chain = hash_prompt_blocks(list(range(40)), BS)
        index.apply("host-tier", _batch(1, [BlockStored(chain[:8], None, [], BS,
                                                        medium="host")]))
        index.apply("pool", _batch(1, [BlockStored(chain[:5], None, [], BS)]))
        matched = index.match(chain)
        states = [ReplicaState(a, "both", True, LoadView(age_s=0.0), matched.get(a, 0))
                  for a in ("host-tier", "pool")]
        return pick(states, len(chain) * BS, BS).decode.address

    assert decision([]) == "host-tier"
    assert decision(["--kv-tier-weights", "host=0.5"]) == "pool"
    picker = picker_options(picker_parser().parse_args(
        ["--replica", "h:1", "--kv-tier-weights", "device=1,shared=0.3"]))
    assert picker.kv_tier_weights == {"device": 1.0, "shared": 0.3}
    # Passed on: tandem up to its gateway, tandem render k8s to the endpoint picker.
    parser = argparse.ArgumentParser()
    add_suite_args(parser)
    suite = plan_suite(suite_config(parser.parse_args(["--kv-tier-weights", "host=0.5"])))
    [gateway_argv] = [s.argv for s in suite.specs if s.name == "gateway"]
    assert gateway_argv[-2:] == ["--kv-tier-weights", "host=0.5"]
    objects = render_k8s_manifests(K8sOptions(kv_tier_weights={"disk": 0.4}))
    [epp] = [o for o in objects if o["kind"] == "Deployment"
             and o["metadata"]["name"].endswith("-epp")]
    args = epp["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--kv-tier-weights") + 1] == "disk=0.4"
