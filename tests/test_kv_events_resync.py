"""KV-event resync with a snapshot: a watcher the replica's event ring no longer covers gets
every block hash in the engine's prefix cache, in bounded pieces, at a seq after which the
live batches apply without loss or duplication; the gateway's prefix index replaces its view
of the replica with it and keeps routing to blocks cached before the resync.

One real replica (an in-process gRPC server with every service, around a real engine-core
process on a tiny Llama) serves the module; its event ring holds only ``RING`` batches and a
snapshot piece only ``PIECE`` hashes, so a handful of prompts wrap the ring and make a
snapshot of several pieces. The tests run in file order on the replica's growing cache.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest

from engine_common.async_llm import AsyncLLM
from engine_common.block_hash import BlockHash, hash_prompt_blocks
from engine_common.config import CacheConfig, EngineConfig, SchedulerConfig
from engine_common.kv_events import KVCacheSnapshot
from gateway.cluster import ClusterView
from gateway.picker import pick
from gateway.prefix_index import PrefixIndex
from gateway.snapshot import take_snapshot
from protos.tandem.v1 import engine_pb2 as epb
from protos.tandem.v1 import engine_pb2_grpc as epb_grpc
from services.replica.server import ReplicaOptions, ReplicaServer

pytestmark = pytest.mark.timeout(120)

BS = 16
RING = 8  # KV-event batches the replica keeps
PIECE = 4  # hashes per snapshot piece
NUM_BLOCKS = 32
T = TypeVar("T")


# --------------------------------------------------------------------------- pure logic


def _piece(seq: int, hashes: list[bytes], index: int, count: int) -> epb.KvEventBatch:
    return epb.KvEventBatch(seq=seq, resync=True, snapshot=epb.KvCacheSnapshot(
        block_hashes=hashes, chunk_index=index, num_chunks=count))


def _stored(seq: int, hashes: list[bytes]) -> epb.KvEventBatch:
    batch = epb.KvEventBatch(seq=seq)
    batch.events.add().block_stored.block_hashes.extend(hashes)
    return batch


def test_snapshot_chunks_are_bounded_and_cover_it_once() -> None:
    hashes = [bytes([i]) * 32 for i in range(10)]
    chunks = KVCacheSnapshot(seq=7, timestamp=1.0, block_hashes=hashes).chunks(4)
    assert [len(c.block_hashes) for c in chunks] == [4, 4, 2]
    assert [(c.seq, c.index, c.count) for c in chunks] == [(7, 0, 3), (7, 1, 3), (7, 2, 3)]
    assert [h for c in chunks for h in c.block_hashes] == hashes and chunks[-1].is_last
    empty = KVCacheSnapshot(seq=3, timestamp=1.0, block_hashes=[]).chunks(4)
    assert [(c.block_hashes, c.index, c.count) for c in empty] == [([], 0, 1)]


def test_index_replaces_a_replica_with_the_whole_snapshot() -> None:
    old = hash_prompt_blocks(list(range(64)), BS)
    new = hash_prompt_blocks(list(range(100, 180)), BS)  # 5 blocks
    index = PrefixIndex()
    assert index.apply("a", _stored(1, old))
    assert index.apply("b", _stored(1, old))
    index.expect("a", hash_prompt_blocks(list(range(300, 332)), BS), now=0.0)

    assert index.apply("a", _piece(9, new[:2], 0, 3))
    assert index.apply("a", _piece(9, new[2:4], 1, 3))
    # Until the last piece, the old view stands (a half snapshot would route worse).
    assert index.longest_prefix("a", old, now=1.0) == 4 and index.last_seq("a") == 1
    assert index.apply("a", _piece(9, new[4:], 2, 3))
    assert index.longest_prefix("a", old, now=1.0) == 0  # replaced, not merged
    assert index.longest_prefix("a", new, now=1.0) == 5 and index.num_blocks("a") == 5
    assert (index.last_seq("a"), index.resyncs("a")) == (9, 1)
    assert index.match(old, now=1.0) == {"b": 4}  # other replicas are untouched
    # Blocks the gateway just routed there are still expected.
    assert index.match(hash_prompt_blocks(list(range(300, 332)), BS), now=1.0) == {"a": 2}

    assert index.apply("a", _stored(9, old))  # at or before the snapshot's seq: already in it
    assert index.longest_prefix("a", old, now=1.0) == 0
    removed = epb.KvEventBatch(seq=10)
    removed.events.add().block_removed.block_hashes.append(new[0])
    assert index.apply("a", removed)
    assert index.longest_prefix("a", new, now=1.0) == 0 and index.num_blocks("a") == 4

    # A piece missing, or a live batch before the last piece: the caller must rebuild.
    assert index.apply("a", _piece(20, new[:1], 0, 3))
    assert not index.apply("a", _piece(20, new[2:3], 2, 3))
    assert index.apply("a", _piece(21, new[:1], 0, 2))
    assert not index.apply("a", _stored(22, old))
    assert index.num_blocks("a") == 4  # neither half snapshot was applied


# --------------------------------------------------------------------------- a real replica


@dataclass
class Replica:
    loop: asyncio.AbstractEventLoop
    server: ReplicaServer
    address: str
    vocab_size: int
    # Every prompt sent so far, in order.
    prompts: list[list[int]] = field(default_factory=list)

    def on_loop(self, fn: Callable[[], T], timeout: float = 30.0) -> T:
        """Run ``fn`` on the replica's event loop (where the gateway objects live too)."""
        async def call() -> T:
            return fn()
        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(timeout)


@pytest.fixture(scope="module")
def replica(tiny_llama_dir: Path) -> Iterator[Replica]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    config = EngineConfig(
        model=str(tiny_llama_dir), dtype="float32", max_model_len=512, engine_id="resync",
        cache=CacheConfig(num_gpu_blocks_override=NUM_BLOCKS),
        # Two blocks a step: a prompt's blocks are stored over several steps and batches.
        scheduler=SchedulerConfig(max_num_batched_tokens=2 * BS))

    async def start() -> ReplicaServer:
        llm = await loop.run_in_executor(None, lambda: AsyncLLM(
            config, loop, kv_event_capacity=RING, kv_snapshot_chunk_blocks=PIECE))
        # ReplicaServer.start builds its own AsyncLLM (with the default ring): start this one.
        server = ReplicaServer(ReplicaOptions(engine=config, host="127.0.0.1", port=0,
                                              metrics_port=0), llm)
        await server._start()
        return server

    server = asyncio.run_coroutine_threadsafe(start(), loop).result(120)
    try:
        yield Replica(loop, server, f"127.0.0.1:{server.port}", server.llm.info.vocab_size)
    finally:
        asyncio.run_coroutine_threadsafe(server.shutdown(1.0), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


@pytest.fixture(scope="module")
def engine(replica: Replica) -> Iterator[epb_grpc.EngineStub]:
    with grpc.insecure_channel(replica.address) as channel:
        yield epb_grpc.EngineStub(channel)


def new_prompt(replica: Replica, num_tokens: int, prefix: list[int] | None = None) -> list[int]:
    """``prefix`` and then ``num_tokens`` random tokens, a different draw for each prompt."""
    rng = random.Random(len(replica.prompts))
    return (prefix or []) + [rng.randrange(3, replica.vocab_size) for _ in range(num_tokens)]


def run_prompt(replica: Replica, engine: epb_grpc.EngineStub, prompt: list[int]) -> None:
    """Prefill ``prompt`` (one token out): its full blocks end up in the prefix cache."""
    replica.prompts.append(prompt)
    request = epb.GenerateRequest(prompt_token_ids=prompt,
                                  sampling_params=epb.SamplingParams(max_tokens=1))
    responses = list(engine.Generate(request, timeout=60))
    assert responses[-1].HasField("finish_reason")


def last_seq(engine: epb_grpc.EngineStub) -> int:
    return engine.GetLoad(epb.GetLoadRequest()).kv_events_last_seq


def read_snapshot(stream: Iterator[epb.KvEventBatch], first: epb.KvEventBatch | None = None,
                  ) -> tuple[int, list[epb.KvEventBatch]]:
    """The pieces of the snapshot a stream starts with (or that ``first``, already read,
    starts), checked for shape, and its seq."""
    pieces = [first if first is not None else next(stream)]
    while pieces[-1].snapshot.chunk_index + 1 < pieces[-1].snapshot.num_chunks:
        pieces.append(next(stream))
    seq = pieces[0].seq
    for i, piece in enumerate(pieces):
        assert piece.resync and piece.seq == seq and not piece.events
        assert (piece.snapshot.chunk_index, piece.snapshot.num_chunks) == (i, len(pieces))
        assert len(piece.snapshot.block_hashes) <= PIECE
    return seq, pieces


def snapshot_hashes(pieces: list[epb.KvEventBatch]) -> list[BlockHash]:
    return [bytes(h) for p in pieces for h in p.snapshot.block_hashes]


def fresh_snapshot(engine: epb_grpc.EngineStub) -> tuple[int, set[BlockHash]]:
    """A snapshot asked for now: a since_seq no incarnation reached forces one."""
    stream = engine.WatchKvEvents(epb.WatchKvEventsRequest(since_seq=1 << 60), timeout=30)
    try:
        seq, pieces = read_snapshot(stream)
    finally:
        stream.cancel()
    hashes = snapshot_hashes(pieces)
    assert len(hashes) == len(set(hashes))
    return seq, set(hashes)


class StrictReplayer:
    """Applies a WatchKvEvents stream to a set of hashes, failing on anything that would
    mean loss or duplication: a seq out of order, a block stored twice, a block removed that
    was not held."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream  # a grpc streaming call: an iterator with cancel()
        self.seq, pieces = read_snapshot(stream)
        self.blocks = set(snapshot_hashes(pieces))
        self.snapshots = 1

    def follow_until(self, seq: int) -> None:
        while self.seq < seq:
            batch = next(self.stream)
            if batch.resync:  # the ring wrapped under this watcher: start over
                self.seq, pieces = read_snapshot(self.stream, batch)
                self.blocks = set(snapshot_hashes(pieces))
                self.snapshots += 1
                continue
            assert batch.seq == self.seq + 1, (self.seq, batch.seq)
            for event in batch.events:
                kind = event.WhichOneof("event")
                if kind == "block_stored":
                    for h in map(bytes, event.block_stored.block_hashes):
                        assert h not in self.blocks, f"seq {batch.seq} stores a held block"
                        self.blocks.add(h)
                elif kind == "block_removed":
                    for h in map(bytes, event.block_removed.block_hashes):
                        assert h in self.blocks, f"seq {batch.seq} removes an unknown block"
                        self.blocks.remove(h)
                else:
                    self.blocks.clear()
            self.seq = batch.seq


def wait_for(condition: Callable[[], Any], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


# --------------------------------------------------------------------------- tests


def test_watcher_behind_the_ring_gets_the_whole_cache(replica: Replica, engine) -> None:
    # Six prompts of three full blocks (and a partial one): 18 cached blocks, two batches
    # each, so the ring of 8 no longer starts at seq 1.
    for _ in range(6):
        run_prompt(replica, engine, new_prompt(replica, 3 * BS + 1))
    cached = {h for p in replica.prompts for h in hash_prompt_blocks(p, BS)}
    assert len(cached) == 18
    newest = last_seq(engine)
    assert newest > RING

    stream = engine.WatchKvEvents(epb.WatchKvEventsRequest(since_seq=0), timeout=30)
    try:
        seq, pieces = read_snapshot(stream)
        hashes = snapshot_hashes(pieces)
        assert seq == newest  # the engine is idle: the snapshot is at its newest seq
        assert len(pieces) == 5 and len(hashes) == len(set(hashes)) == 18
        assert set(hashes) == cached
        # The live stream follows the snapshot at seq + 1 with the new blocks only.
        follow_up = new_prompt(replica, 2 * BS + 1)
        run_prompt(replica, engine, follow_up)
        live = next(stream)
        assert live.seq == seq + 1 and not live.resync
        stored = [bytes(h) for e in live.events for h in e.block_stored.block_hashes]
        assert stored and set(stored) <= set(hash_prompt_blocks(follow_up, BS)) - cached
    finally:
        stream.cancel()


def test_gateway_index_routes_to_blocks_cached_before_the_resync(replica: Replica,
                                                                 engine) -> None:
    before = {h for p in replica.prompts for h in hash_prompt_blocks(p, BS)}
    newest, cached = fresh_snapshot(engine)
    assert cached == before
    view = replica.on_loop(lambda: ClusterView.create(
        [replica.address], [], dns_interval_s=60.0, load_interval_s=0.05))
    asyncio.run_coroutine_threadsafe(view.start(), replica.loop).result(30)
    try:
        address = replica.address
        # The gateway asks from seq 0, which the ring no longer holds: a snapshot answers.
        wait_for(lambda: replica.on_loop(lambda: view.index.last_seq(address)) >= newest
                 and replica.on_loop(lambda: view.registry.replicas()[0].routable))
        assert replica.on_loop(lambda: view.index.resyncs(address)) == 1
        assert replica.on_loop(lambda: view.index.num_blocks(address)) == len(cached)

        # A prompt sharing the first prompt's three cached blocks, sent before the resync.
        first = replica.prompts[0]
        shared = new_prompt(replica, 2 * BS, prefix=first[:3 * BS])

        def score() -> tuple[int, str, int]:
            snap = take_snapshot(view.registry, view.loads, view.index, shared)
            decision = pick(snap.replicas, len(shared), snap.block_size)
            return snap.replicas[0].matched_blocks, decision.decode.address, snap.block_size
        assert replica.on_loop(score) == (3, address, BS)
    finally:
        asyncio.run_coroutine_threadsafe(view.stop(), replica.loop).result(30)


def test_events_after_the_snapshot_apply_on_top(replica: Replica, engine) -> None:
    view = replica.on_loop(lambda: ClusterView.create(
        [replica.address], [], dns_interval_s=60.0, load_interval_s=0.05))
    asyncio.run_coroutine_threadsafe(view.start(), replica.loop).result(30)
    address = replica.address
    strict = StrictReplayer(engine.WatchKvEvents(
        epb.WatchKvEventsRequest(since_seq=1 << 60), timeout=60))
    try:
        start_seq = strict.seq
        wait_for(lambda: replica.on_loop(lambda: view.index.last_seq(address)) >= start_seq)
        before = set(strict.blocks)
        oldest = hash_prompt_blocks(replica.prompts[0], BS)
        assert set(oldest) <= before

        # Store then evict: 20 cached blocks, 12 free without a hash; a prompt of 20 full
        # blocks (21 with its partial one) takes those 12 and then the 9 least recently
        # used cached blocks, the first three prompts', over eleven steps.
        big = new_prompt(replica, 20 * BS + 1)
        # Watchers joining while the eviction runs get snapshots taken between its steps;
        # each must continue exactly where its snapshot ends.
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(run_prompt, replica, engine, big)
            racers = []
            while not running.done() and len(racers) < 4:
                racers.append(StrictReplayer(engine.WatchKvEvents(
                    epb.WatchKvEventsRequest(since_seq=1 << 60), timeout=60)))
            running.result()
        end_seq, final = fresh_snapshot(engine)

        assert set(hash_prompt_blocks(big, BS)) <= final
        evicted = before - final
        assert len(before) == 20 and len(evicted) == 9 and set(oldest) <= evicted
        strict.follow_until(end_seq)
        assert strict.blocks == final and strict.snapshots == 1
        for racer in racers:
            racer.follow_until(end_seq)
            assert racer.blocks == final
            racer.stream.cancel()

        wait_for(lambda: replica.on_loop(lambda: view.index.last_seq(address)) >= end_seq)

        def index_view() -> tuple[int, int, int, int]:
            index = view.index
            held = sum(index.longest_prefix(address, [h]) for h in final)
            stale = sum(index.longest_prefix(address, [h]) for h in evicted)
            return held, stale, index.num_blocks(address), index.resyncs(address)
        assert replica.on_loop(index_view) == (len(final), 0, len(final), 1)
    finally:
        strict.stream.cancel()
        asyncio.run_coroutine_threadsafe(view.stop(), replica.loop).result(30)
