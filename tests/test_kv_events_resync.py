"""KV-event resync with a snapshot: a watcher the replica's event ring no longer covers gets
every block hash in the engine's prefix cache, in bounded pieces, at a seq after which the
live batches apply without loss or duplication; the gateway's prefix index replaces its view
of the replica with it and keeps routing to blocks cached before the resync. The same holds
for a watcher whose seq belongs to an earlier incarnation of a replica that restarted under
the same engine id and port.

One real replica (an in-process gRPC server with every service, around a real engine-core
process on a tiny Llama) serves most of the module; its event ring holds only ``RING``
batches and a snapshot piece only ``PIECE`` hashes, so a handful of prompts wrap the ring and
make a snapshot of several pieces. The tests run in file order on the replica's growing
cache. The restart tests share a second replica that is stopped and started again.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import grpc.aio
import pytest

from engine_common.async_llm import AsyncLLM
from engine_common.block_hash import BlockHash, hash_prompt_blocks
from engine_common.config import CacheConfig, EngineConfig, SchedulerConfig
from engine_common.generation_request import GenerationRequest
from engine_common.kv_events import AllBlocksCleared, KVCacheSnapshot, KVEventBuffer
from engine_common.sampling_params import SamplingParams
from gateway import registry
from gateway.cluster import ClusterView
from gateway.picker import pick
from gateway.prefix_index import PrefixIndex
from gateway.snapshot import take_snapshot
from protos.tandem.v1 import engine_pb2 as epb
from protos.tandem.v1 import engine_pb2_grpc as epb_grpc
from services.replica.options import ReplicaOptions
from services.replica.server import ReplicaServer

pytestmark = pytest.mark.timeout(120)

BS = 16
RING = 8  # KV-event batches the replica keeps
PIECE = 4  # hashes per snapshot piece
NUM_BLOCKS = 32
T = TypeVar("T")


# --------------------------------------------------------------------------- pure logic


def _piece(seq: int, hashes: list[bytes], index: int, count: int,
           incarnation: str = "") -> epb.KvEventBatch:
    return epb.KvEventBatch(seq=seq, resync=True, incarnation=incarnation,
                            snapshot=epb.KvCacheSnapshot(block_hashes=hashes,
                                                         chunk_index=index, num_chunks=count))


def _stored(seq: int, hashes: list[bytes], incarnation: str = "") -> epb.KvEventBatch:
    batch = epb.KvEventBatch(seq=seq, incarnation=incarnation)
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


def test_event_log_answers_only_the_seqs_of_its_own_incarnation() -> None:
    log, other = KVEventBuffer(4), KVEventBuffer(4)
    assert log.incarnation != other.incarnation and len(log.incarnation) == 32
    first = log.append([AllBlocksCleared()])
    assert log.since(0) == [first] and log.since(0, log.incarnation) == [first]
    assert log.since(0, other.incarnation) is None  # seq 0 of another process means nothing
    assert log.since(1, other.incarnation) is None


def test_index_takes_a_batch_of_another_incarnation_as_a_gap() -> None:
    old = hash_prompt_blocks(list(range(64)), BS)
    new = hash_prompt_blocks(list(range(100, 164)), BS)
    index = PrefixIndex()
    assert index.apply("a", _stored(1, old[:2], "A")) and index.incarnation("a") == "A"
    assert index.apply("a", _stored(2, old[2:], "A"))
    # Seq 3 of B follows seq 2 of A in number only; an "already applied" seq 1 is no replay.
    assert not index.apply("a", _stored(3, new, "B"))
    assert not index.apply("a", _stored(1, new, "B"))
    assert index.longest_prefix("a", new, now=0.0) == 0 and index.last_seq("a") == 2

    # A snapshot replaces the state whatever incarnation it came from, and adopts its own;
    # its pieces must all be of one incarnation.
    assert index.apply("a", _piece(5, new[:2], 0, 2, "B"))
    assert not index.apply("a", _piece(5, new[2:], 1, 2, "A"))
    assert index.apply("a", _piece(5, new[:2], 0, 2, "B"))
    assert index.apply("a", _piece(5, new[2:], 1, 2, "B"))
    assert (index.incarnation("a"), index.last_seq("a"), index.resyncs("a")) == ("B", 5, 1)
    assert index.longest_prefix("a", old, now=0.0) == 0
    assert index.longest_prefix("a", new, now=0.0) == 4
    assert index.apply("a", _stored(6, old[:1], "B")) and index.last_seq("a") == 6
    # A fresh state takes the incarnation of its first batch.
    assert index.apply("b", _stored(1, old[:1], "C")) and index.incarnation("b") == "C"


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


def engine_config(model_dir: Path, engine_id: str) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir), dtype="float32", max_model_len=512, engine_id=engine_id,
        cache=CacheConfig(num_gpu_blocks_override=NUM_BLOCKS),
        # Two blocks a step: a prompt's blocks are stored over several steps and batches.
        scheduler=SchedulerConfig(max_num_batched_tokens=2 * BS))


async def start_engine(config: EngineConfig, ring: int = 65536) -> AsyncLLM:
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(None, lambda: AsyncLLM(
        config, loop, kv_event_capacity=ring, kv_snapshot_chunk_blocks=PIECE))


async def serve(llm: AsyncLLM, port: int = 0) -> ReplicaServer:
    # ReplicaServer.start builds its own AsyncLLM (with the default ring): serve this one.
    server = ReplicaServer(ReplicaOptions(engine=llm.config, host="127.0.0.1", port=port,
                                          metrics_port=0), llm)
    await server._start()
    return server


def start_loop() -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    return loop, thread


@pytest.fixture(scope="module")
def replica(tiny_llama_dir: Path) -> Iterator[Replica]:
    loop, thread = start_loop()

    async def start() -> ReplicaServer:
        return await serve(await start_engine(engine_config(tiny_llama_dir, "resync"), RING))

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


# --------------------------------------------------------------------------- a restart


@dataclass
class Restarted:
    """Incarnation A of engine "restart" stored ``blocks_a`` over batches 1..``seq_a`` and
    stopped; incarnation B, the same engine id on the same port, then stored ``blocks_b`` over
    more than ``seq_a`` batches before it listened again. ``index`` watched throughout."""

    loop: asyncio.AbstractEventLoop
    address: str
    llm_b: AsyncLLM
    incarnation_a: str
    seq_a: int
    blocks_a: set[BlockHash]
    blocks_b: set[BlockHash]
    index: PrefixIndex

    def run(self, coro: Any, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def on_loop(self, fn: Callable[[], T]) -> T:
        return self.run(_call(fn))


async def _call(fn: Callable[[], T]) -> T:
    return fn()


async def prefill(llm: AsyncLLM, prompt: list[int]) -> None:
    """Compute ``prompt`` (one token out) on ``llm`` directly: its full blocks get cached."""
    async for _ in llm.generate(uuid.uuid4().hex,
                                GenerationRequest(prompt, SamplingParams(max_tokens=1))):
        pass


@pytest.fixture(scope="module")
def restarted(tiny_llama_dir: Path) -> Iterator[Restarted]:
    loop, thread = start_loop()

    def run(coro: Any, timeout: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    config = engine_config(tiny_llama_dir, "restart")
    server = run(serve(run(start_engine(config))))
    port = server.port
    address = f"127.0.0.1:{port}"

    async def watch() -> tuple[PrefixIndex, registry.Replica]:
        # Its own channel, not a registry's: nothing but the KV events can tell it of the
        # restart (no health stream to bump the replica's epoch), as when the process comes
        # back faster than anything notices.
        channel = grpc.aio.insecure_channel(address, options=registry.CHANNEL_OPTIONS)
        watched = registry.Replica(address, channel, epb_grpc.EngineStub(channel))
        index = PrefixIndex(reconnect_interval_s=0.05)
        index.replica_added(watched)
        return index, watched

    index, watched = run(watch())
    rng = random.Random(11)
    vocab = server.llm.info.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(3 * BS + 1)] for _ in range(5)]
    server_b = None
    try:
        for prompt in prompts[:2]:
            run(prefill(server.llm, prompt))
        seq_a = server.llm.kv_events.last_seq
        # A watcher that applied every batch of incarnation A, each stamped with it.
        with grpc.insecure_channel(address) as channel:
            stream = epb_grpc.EngineStub(channel).WatchKvEvents(
                epb.WatchKvEventsRequest(since_seq=0), timeout=30)
            applied = [next(stream) for _ in range(seq_a)]
            stream.cancel()
        incarnation_a = applied[0].incarnation
        assert incarnation_a == server.llm.kv_events.incarnation
        assert [(b.seq, b.incarnation) for b in applied] == [
            (s, incarnation_a) for s in range(1, seq_a + 1)]
        blocks_a = {h for p in prompts[:2] for h in hash_prompt_blocks(p, BS)}
        wait_for(lambda: run(_call(lambda: index.last_seq(address))) == seq_a)
        assert run(_call(lambda: index.num_blocks(address))) == len(blocks_a)

        server.force_stop()
        run(server.shutdown(0.0))
        llm_b = run(start_engine(config))
        for prompt in prompts[2:]:
            run(prefill(llm_b, prompt))
        assert llm_b.kv_events.last_seq > seq_a  # the replay after seq_a would skip some
        server_b = run(serve(llm_b, port))
        yield Restarted(loop, address, llm_b, incarnation_a, seq_a, blocks_a,
                        {h for p in prompts[2:] for h in hash_prompt_blocks(p, BS)}, index)
    finally:
        run(index.stop())
        run(watched.channel.close())
        (server_b or server).force_stop()
        run((server_b or server).shutdown(0.0), 30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_watcher_of_the_previous_incarnation_gets_a_snapshot(restarted: Restarted) -> None:
    r = restarted
    incarnation_b = r.llm_b.kv_events.incarnation
    assert incarnation_b != r.incarnation_a
    with grpc.insecure_channel(r.address) as channel:
        engine = epb_grpc.EngineStub(channel)
        newest = last_seq(engine)
        assert newest > r.seq_a
        stream = engine.WatchKvEvents(epb.WatchKvEventsRequest(
            since_seq=r.seq_a, incarnation=r.incarnation_a), timeout=30)
        try:
            seq, pieces = read_snapshot(stream)
            hashes = set(snapshot_hashes(pieces))
            assert {p.incarnation for p in pieces} == {incarnation_b}
            assert seq == newest and hashes == r.blocks_b and not hashes & r.blocks_a
            # Then the live batches of B, from seq + 1.
            follow_up = [7 + i for i in range(2 * BS + 1)]
            r.run(prefill(r.llm_b, follow_up))
            live = next(stream)
            assert (live.seq, live.resync, live.incarnation) == (seq + 1, False, incarnation_b)
            stored = {bytes(h) for e in live.events for h in e.block_stored.block_hashes}
            assert stored and stored <= set(hash_prompt_blocks(follow_up, BS))
        finally:
            stream.cancel()


def test_watcher_naming_this_incarnation_gets_a_plain_replay(restarted: Restarted) -> None:
    r = restarted
    incarnation_b = r.llm_b.kv_events.incarnation
    with grpc.insecure_channel(r.address) as channel:
        engine = epb_grpc.EngineStub(channel)
        newest = last_seq(engine)
        # Empty: a watcher that does not know the incarnation keeps the old behaviour.
        for incarnation in (incarnation_b, ""):
            stream = engine.WatchKvEvents(epb.WatchKvEventsRequest(
                since_seq=r.seq_a, incarnation=incarnation), timeout=30)
            try:
                replay = [next(stream) for _ in range(newest - r.seq_a)]
            finally:
                stream.cancel()
            assert [(b.seq, b.resync, b.incarnation) for b in replay] == [
                (s, False, incarnation_b) for s in range(r.seq_a + 1, newest + 1)]


def test_gateway_index_holds_exactly_the_new_incarnations_blocks(
        restarted: Restarted) -> None:
    r = restarted
    with grpc.insecure_channel(r.address) as channel:
        end_seq, cached = fresh_snapshot(epb_grpc.EngineStub(channel))
    assert r.blocks_b <= cached and not cached & r.blocks_a
    index, address = r.index, r.address
    wait_for(lambda: r.on_loop(lambda: index.last_seq(address)) >= end_seq, timeout=10)

    def index_view() -> tuple[int, int, int, str]:
        held = sum(index.longest_prefix(address, [h]) for h in cached)
        stale = sum(index.longest_prefix(address, [h]) for h in r.blocks_a)
        return held, stale, index.num_blocks(address), index.incarnation(address)
    assert r.on_loop(index_view) == (len(cached), 0, len(cached), r.llm_b.kv_events.incarnation)
    assert r.on_loop(lambda: index.resyncs(address)) == 1
