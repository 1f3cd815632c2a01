"""KV tiers in real replica processes: the disk tier survives a restarted replica, and
the shared tier (a real loopback redis-server) serves one replica what another computed.

Turn 1 of a conversation runs on one replica (a restarted one first announces what its disk
holds, before any request); turn 2 (turn 1's prompt, its answer and more)
then runs on the restarted replica, or on the other one, whose KV pool has never seen it:
its prefix must come from the tier (cached tokens and the tier's hit counter asserted) and
its greedy tokens must equal an engine's without tiers.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import lmdb
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from deploy.kv_store import free_port, redis_server
from engine_common.block_hash import hash_prompt_blocks
from gateway.prefix_index import PrefixIndex
from protos.tandem.v1 import engine_pb2 as epb
from protos.tandem.v1 import engine_pb2_grpc as epb_grpc
from tests.kv_tiers_workload import BLOCK, MAX_TOKENS, TURN2_TIER_BLOCKS, conversation, engine
from tests.kv_tiers_workload import prompts as workload_prompts
from tests.replica_process import ReplicaProcess, restart_replica, start_replicas

REPLICA_ARGS = ["--dtype", "float32", "--block-size", str(BLOCK), "--num-kv-blocks", "24",
                "--max-num-seqs", "4"]


@pytest.fixture(scope="module")
def expected(tiny_llama_dir: Path):
    turn1, others, more = workload_prompts()
    first, second, _ = conversation(engine(tiny_llama_dir), turn1, others, more)
    return turn1, more, first, second


def generate(target: str, prompt: list[int]) -> tuple[list[int], int]:
    """Greedy tokens and cached prompt tokens of one request."""
    with grpc.insecure_channel(target) as channel:
        responses = list(epb_grpc.EngineStub(channel).Generate(epb.GenerateRequest(
            prompt_token_ids=prompt,
            sampling_params=epb.SamplingParams(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS,
                                               temperature=0),
            output_options=epb.OutputOptions(return_token_ids=True)), timeout=60))
    assert responses[-1].finish_reason == "length"
    return [t for r in responses for t in r.new_token_ids], responses[-1].cached_tokens


def first_batch_tiers(replica: ReplicaProcess, hashes: list[bytes]) -> list[str]:
    """The tiers a prefix index fed the replica's first KV event batch gives ``hashes``."""
    with grpc.insecure_channel(replica.target) as channel:
        stream = epb_grpc.EngineStub(channel).WatchKvEvents(
            epb.WatchKvEventsRequest(since_seq=0), timeout=30)
        batch = next(iter(stream))
        stream.cancel()
    index = PrefixIndex()
    assert index.apply("replica", batch)
    return index.prefix_tiers("replica", hashes)


def tier_metric(replica: ReplicaProcess, name: str, medium: str) -> float:
    import urllib.request

    with urllib.request.urlopen(replica.metrics_url, timeout=5) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels.get("medium") == medium:
                return sample.value
    return 0.0


def wait_for(condition, what: str, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


def disk_entries(directory: Path) -> int:
    env = lmdb.open(str(directory), readonly=True, subdir=True)
    try:
        return int(env.stat()["entries"])
    finally:
        env.close()


def test_disk_tier_is_read_again_by_a_restarted_replica(tiny_llama_dir, tmp_path, expected):
    turn1, more, first_expected, second_expected = expected
    directory = tmp_path / "kv"
    args = [*REPLICA_ARGS, "--kv-offload-dir", str(directory)]
    replica = start_replicas(tiny_llama_dir, tmp_path, {"disk-a": args})["disk-a"]
    try:
        first, _ = generate(replica.target, turn1)
        assert first == first_expected
        wait_for(lambda: disk_entries(directory) >= TURN2_TIER_BLOCKS, "turn 1's blocks on disk")
        # SIGKILL and a new process on the same ports: nothing but the disk carries over.
        replica = restart_replica(replica, tiny_llama_dir, tmp_path, "disk-a", args)
        # Before any request, a router watching the new process hears what its disk holds.
        turn2 = turn1 + first + more
        hashes = hash_prompt_blocks(turn2, BLOCK)[:(len(turn2) - 1) // BLOCK]
        assert first_batch_tiers(replica, hashes) == ["disk"] * TURN2_TIER_BLOCKS
        second, cached = generate(replica.target, turn2)
        assert second == second_expected
        assert cached == TURN2_TIER_BLOCKS * BLOCK
        assert tier_metric(replica, "tandem:kv_tier_hits_total", "disk") == TURN2_TIER_BLOCKS
    finally:
        replica.stop()


def test_shared_tier_serves_a_prefix_another_replica_computed(tiny_llama_dir, tmp_path,
                                                             expected):
    turn1, more, first_expected, second_expected = expected
    port = free_port()
    with redis_server(port):
        args = [*REPLICA_ARGS, "--kv-store", f"redis://127.0.0.1:{port}/0",
                "--kv-store-timeout", "1"]
        replicas = start_replicas(tiny_llama_dir, tmp_path, {"shared-a": args, "shared-b": args})
        try:
            first, _ = generate(replicas["shared-a"].target, turn1)
            assert first == first_expected
            client = redis.Redis(port=port)
            wait_for(lambda: client.dbsize() >= TURN2_TIER_BLOCKS, "turn 1's blocks in Redis")
            other = replicas["shared-b"]
            second, cached = generate(other.target, turn1 + first + more)
            assert second == second_expected
            assert cached == TURN2_TIER_BLOCKS * BLOCK
            assert tier_metric(other, "tandem:kv_tier_hits_total", "shared") == TURN2_TIER_BLOCKS
        finally:
            for replica in replicas.values():
                replica.stop()
