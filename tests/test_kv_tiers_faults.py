"""KV tiers under faults: a corrupted or truncated disk entry, a shared Redis that is down,
slow (paused) or full mid-run, and a saturated tier (back-pressure). Each falls back to
recomputing with output identical to an engine without tiers, no error to the caller, and
the fault counted by reason. A real redis-server on loopback plays the shared tier.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.kv_store import free_port, redis_server
from engine_common.kv_tiers.config import KvTiersConfig
from engine_common.kv_tiers.entry import CorruptEntry, decode_entry, encode_entry
from tests.kv_tiers_workload import (
    GREEDY,
    TURN2_TIER_BLOCKS,
    conversation,
    engine,
    prompts,
    turn1_then_evict,
)


@pytest.fixture(scope="module")
def workload(tiny_llama_dir: Path):
    turn1, others, more = prompts()
    baseline = conversation(engine(tiny_llama_dir), turn1, others, more)
    return turn1, others, more, baseline


_DAMAGE = """
import sys, lmdb
env = lmdb.open(sys.argv[1], subdir=True)
with env.begin(write=True) as txn:
    for key, value in list(txn.cursor()):
        value = bytes(value)
        txn.put(key, value[:-7] if sys.argv[2] == "truncated" else value[:-1] + bytes([value[-1] ^ 0xFF]))
env.close()
"""


@pytest.fixture
def redis_port() -> Iterator[tuple[int, int]]:
    """(port, pid) of a fresh loopback redis-server."""
    port = free_port()
    with redis_server(port, maxmemory="64mb") as process:
        yield port, process.pid


def test_entry_checksum_and_truncation_are_told_apart():
    entry = encode_entry(b"x" * 100)
    assert decode_entry(entry, 100) == b"x" * 100
    with pytest.raises(CorruptEntry) as truncated:
        decode_entry(entry[:-1], 100)
    assert truncated.value.reason == "truncated"
    flipped = bytearray(entry)
    flipped[-1] ^= 1
    with pytest.raises(CorruptEntry) as corrupt:
        decode_entry(bytes(flipped), 100)
    assert corrupt.value.reason == "checksum"


@pytest.mark.parametrize("damage", ["checksum", "truncated"])
def test_damaged_disk_entries_are_recomputed_and_counted(tiny_llama_dir, workload, tmp_path,
                                                         damage):
    turn1, others, more, baseline = workload
    directory = tmp_path / "kv"
    llm = engine(tiny_llama_dir, KvTiersConfig(disk_dir=str(directory), disk_bytes=1 << 24))
    first = turn1_then_evict(llm, turn1, others)
    # Damage every entry behind the tier's back, from another process (LMDB allows one
    # environment per store in a process).
    subprocess.run([sys.executable, "-c", _DAMAGE, str(directory), damage], check=True)
    second = llm.generate([turn1 + first + more], GREEDY)[0]
    assert (first, second.token_ids) == baseline[:2]
    stats = llm.core.kv_tiers.totals()["disk"]
    assert stats.hits == 0 and second.num_cached_tokens == 0
    assert stats.failures.get(damage, 0) >= 1
    llm.core.close()


def test_shared_tier_hit(tiny_llama_dir, workload, redis_port):
    turn1, others, more, baseline = workload
    url = f"redis://127.0.0.1:{redis_port[0]}/0"
    llm = engine(tiny_llama_dir, KvTiersConfig(store_url=url, store_timeout_seconds=1.0))
    first, second, cached = conversation(llm, turn1, others, more)
    assert (first, second) == baseline[:2]
    assert llm.core.kv_tiers.totals()["shared"].hits == TURN2_TIER_BLOCKS
    assert cached == TURN2_TIER_BLOCKS * 4
    llm.core.close()


@pytest.mark.parametrize("fault", ["down", "slow"])
def test_shared_tier_down_or_slow_mid_run_falls_back(tiny_llama_dir, workload, redis_port,
                                                    fault):
    turn1, others, more, baseline = workload
    port, pid = redis_port
    llm = engine(tiny_llama_dir, KvTiersConfig(store_url=f"redis://127.0.0.1:{port}/0",
                                               store_timeout_seconds=0.2))
    first = turn1_then_evict(llm, turn1, others)
    os.kill(pid, signal.SIGKILL if fault == "down" else signal.SIGSTOP)
    try:
        second = llm.generate([turn1 + first + more], GREEDY)[0]
    finally:
        if fault == "slow":
            os.kill(pid, signal.SIGCONT)
    assert (first, second.token_ids) == baseline[:2]
    stats = llm.core.kv_tiers.totals()["shared"]
    assert stats.hits == 0 and second.num_cached_tokens == 0
    assert stats.failures.get(fault, 0) >= 1, stats.failures
    llm.core.close()


def test_shared_tier_full_drops_stores_counted(tiny_llama_dir, workload):
    turn1, others, more, baseline = workload
    port = free_port()
    # noeviction at a cap the server already exceeds: every write is refused with OOM.
    with redis_server(port, maxmemory="1", policy="noeviction"):
        llm = engine(tiny_llama_dir, KvTiersConfig(store_url=f"redis://127.0.0.1:{port}/0",
                                                   store_timeout_seconds=1.0))
        assert conversation(llm, turn1, others, more) == baseline
        stats = llm.core.kv_tiers.totals()["shared"]
        assert stats.stores == 0 and stats.hits == 0
        assert stats.failures.get("full", 0) >= TURN2_TIER_BLOCKS
        assert stats.dropped_stores >= TURN2_TIER_BLOCKS
        llm.core.close()


def test_saturated_tier_drops_stores_and_never_stalls_a_step(tiny_llama_dir, workload,
                                                            redis_port):
    """A paused Redis holds the worker in one store for its timeout; meanwhile the store
    queue (2 deep) fills and the step's further blocks are dropped, counted, not waited on."""
    turn1, others, more, baseline = workload
    port, pid = redis_port
    llm = engine(tiny_llama_dir, KvTiersConfig(store_url=f"redis://127.0.0.1:{port}/0",
                                               store_timeout_seconds=2.0,
                                               max_pending_stores=2))
    os.kill(pid, signal.SIGSTOP)
    try:
        result = llm.generate([turn1], GREEDY)[0]
    finally:
        os.kill(pid, signal.SIGCONT)
    assert result.token_ids == baseline[0]
    assert llm.core.kv_tiers.drain()
    assert llm.core.kv_tiers.totals()["shared"].dropped_stores >= 8
    llm.core.close()


def test_tandem_up_local_store_runs_a_loopback_redis_for_the_suite() -> None:
    import argparse

    import redis

    from deploy.kv_store import local_kv_store
    from services.replica.engine_flags import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--kv-store", "local"])
    with local_kv_store(args):
        assert args.kv_store.startswith("redis://127.0.0.1:")
        client = redis.Redis.from_url(args.kv_store)
        assert client.ping()
    with pytest.raises(redis.exceptions.ConnectionError):
        client.ping()
    with pytest.raises(SystemExit):  # a clear argparse error, not a traceback
        parser.parse_args(["--kv-store", "memcached://x"])
