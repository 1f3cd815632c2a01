"""Which replica holds which cached KV blocks, from the KV events every replica publishes.

Owns one ``Engine.WatchKvEvents`` subscription per registered replica and the index it feeds:
block hash -> the replicas that hold it. Batches carry consecutive sequence numbers within
an incarnation (a random id the replica's engine draws at every start); the watcher remembers
the last seq it applied and the incarnation its state came from, and reconnects naming both,
so a dropped connection loses nothing. When the replica no longer holds the batches after that
seq (the watcher fell behind), or the named incarnation is not its own (the process behind the
address restarted, even under the same engine id and port, and counts from seq 1 again), it
sends a ``resync`` snapshot of its whole cache instead, in pieces: they are kept aside until
the last one, which then replaces everything known about that replica and sets its seq and
incarnation. A gap, ``AllBlocksCleared`` or a new engine id drops everything known about that
replica.

A live batch of another incarnation than the state's is treated as a gap. A replica that
honours the request never sends one (it answers with a snapshot first); the check is what
keeps the index right should one replay another process's seqs anyway. The state then came
from a process that is gone, so it is dropped at once, and the watcher resubscribes from seq 0
with no incarnation, which the replica answers with its log from seq 1 or a snapshot.
Dropping rather than waiting for a snapshot over the old state keeps the index from routing to
blocks of a dead process; the cost is a moment with no prefix hits there, which a restarted
replica has few of anyway.

Events arrive only once a replica has computed a prompt's blocks, seconds later for a long
prompt on a busy replica; requests sharing that prefix in the meantime would scatter. So the
index also records what the gateway has just routed (``expect``): the prompt's blocks count
as held by the chosen replica until the events confirm them or ``expect_ttl_s`` passes. It
does not own hashing prompts (``engine_common.block_hash``, which the engines use too) or
scoring.

KV tiers (``engine_common.kv_tiers``): events carry the tier (``medium``) that stored or
removed blocks. Device blocks are the replica's as above; "host" and "disk" blocks are kept
per replica apart from them; "shared" blocks (a Redis every replica reads) are one set
reachable from every replica (bounded, least recently stored out: Redis evicts unseen). A
match walks the chain with the best tier each block is in for that replica and weighs each
block by its tier (``tier_weights``: device > host > disk > shared, since a load costs more
the lower the tier), so ``match`` returns weighted blocks. Snapshots carry device blocks
only: after a resync, tier blocks are known again as they are stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import grpc.aio

from engine_common.block_hash import BlockHash
from gateway.registry import Replica
from gateway.tier_weights import DEFAULT_TIER_WEIGHTS, DEVICE, SHARED
from protos.tandem.v1 import engine_pb2

logger = logging.getLogger(__name__)


@dataclass
class _ReplicaBlocks:
    blocks: set[BlockHash] = field(default_factory=set)
    last_seq: int = 0
    # The incarnation of the batches (or snapshot) this state was built from; "" before any.
    incarnation: str = ""
    engine_id: str = ""
    # The registry's Replica.epoch when this state was built (see there).
    epoch: int = 0
    # True while a subscription is open.
    connected: bool = False
    resyncs: int = 0
    # A resync snapshot whose pieces are still arriving: its seq, the hashes so far and the
    # next piece's index. None outside one.
    snapshot_seq: int = 0
    snapshot_incarnation: str = ""
    snapshot_blocks: set[BlockHash] | None = None
    snapshot_next_chunk: int = 0
    # This replica's own KV tiers' blocks, by medium ("host", "disk").
    tiers: dict[str, set[BlockHash]] = field(default_factory=dict)
    # Blocks routed here but not confirmed by events yet -> time.monotonic() they expire at.
    expected: dict[BlockHash, float] = field(default_factory=dict)
    task: asyncio.Task[None] | None = None

    def holds(self, block_hash: BlockHash, now: float) -> bool:
        if block_hash in self.blocks:
            return True
        expiry = self.expected.get(block_hash)
        return expiry is not None and expiry > now


_REPLICA_TIERS = ("host", "disk")  # a replica's own tiers, fastest first


class PrefixIndex:
    """A ``ReplicaListener``: subscribes to each replica's KV events as the registry adds it."""

    def __init__(self, reconnect_interval_s: float = 0.2, expect_ttl_s: float = 30.0,
                 tier_weights: Mapping[str, float] | None = None,
                 max_shared_blocks: int = 1 << 20) -> None:
        self.reconnect_interval_s = reconnect_interval_s
        self.expect_ttl_s = expect_ttl_s
        self.tier_weights = dict(DEFAULT_TIER_WEIGHTS)
        self.tier_weights.update(tier_weights or {})
        self.max_shared_blocks = max_shared_blocks
        self._replicas_by_block: dict[BlockHash, set[str]] = {}
        self._state: dict[str, _ReplicaBlocks] = {}
        # Blocks in the shared tier, reachable from every replica.
        self._shared: OrderedDict[BlockHash, None] = OrderedDict()

    # ----------------------------------------------------------------- queries
    def longest_prefix(self, address: str, block_hashes: Sequence[BlockHash],
                       now: float | None = None) -> int:
        """How many leading blocks of the chain ``address`` holds (or was just sent). Hashes
        are chained, so the first block it lacks ends the match."""
        state = self._state.get(address)
        if state is None:
            return 0
        now = time.monotonic() if now is None else now
        n = 0
        for block_hash in block_hashes:
            if not state.holds(block_hash, now):
                break
            n += 1
        return n

    def prefix_tiers(self, address: str, block_hashes: Sequence[BlockHash],
                     now: float | None = None) -> list[str]:
        """The best tier each leading block of the chain is in for ``address`` (device, its
        host or disk tier, the shared tier), up to the first block none holds."""
        state = self._state.get(address)
        if state is None:
            return []
        now = time.monotonic() if now is None else now
        tiers = []
        for block_hash in block_hashes:
            medium = self._tier_of(state, block_hash, now)
            if medium is None:
                break
            tiers.append(medium)
        return tiers

    def _tier_of(self, state: _ReplicaBlocks, block_hash: BlockHash, now: float) -> str | None:
        if state.holds(block_hash, now):
            return DEVICE
        for medium in _REPLICA_TIERS:
            held = state.tiers.get(medium)
            if held is not None and block_hash in held:
                return medium
        return SHARED if block_hash in self._shared else None

    def match(self, block_hashes: Sequence[BlockHash], now: float | None = None) -> dict[str, int]:
        """Longest cached prefix of every replica holding at least the first block in any
        tier, in blocks weighted by the tier each is in (``tier_weights``; rounded): device
        blocks alone count whole, as without tiers."""
        if not block_hashes:
            return {}
        now = time.monotonic() if now is None else now
        first = block_hashes[0]
        if first in self._shared:
            candidates = set(self._state)
        else:
            candidates = set(self._replicas_by_block.get(first, ()))
            candidates.update(a for a, s in self._state.items()
                              if s.expected.get(first, 0.0) > now
                              or any(first in held for held in s.tiers.values()))
        if not self._shared and not any(s.tiers for s in self._state.values()):
            return {a: self.longest_prefix(a, block_hashes, now) for a in candidates}
        weights = self.tier_weights
        # NOTE: half up, not Python's round-half-even: 2.5 weighted blocks are 3, as 3.5 are 4.
        return {a: int(sum(weights.get(t, 0.0) for t in self.prefix_tiers(a, block_hashes, now))
                       + 0.5) for a in candidates}

    def expect(self, address: str, block_hashes: Sequence[BlockHash],
               now: float | None = None) -> None:
        """The gateway just sent a prompt with these blocks to ``address``: count them as held
        there until its events confirm them or ``expect_ttl_s`` passes."""
        state = self._state.get(address)
        if state is None or not block_hashes:
            return
        now = time.monotonic() if now is None else now
        if len(state.expected) > 4 * len(block_hashes) + 1024:
            state.expected = {h: t for h, t in state.expected.items() if t > now}
        expiry = now + self.expect_ttl_s
        for block_hash in block_hashes:
            if block_hash not in state.blocks:
                state.expected[block_hash] = expiry

    def retract(self, address: str, block_hashes: Sequence[BlockHash]) -> None:
        """Undo ``expect``: the request failed there before computing anything."""
        state = self._state.get(address)
        if state is not None:
            for block_hash in block_hashes:
                state.expected.pop(block_hash, None)

    def num_blocks(self, address: str) -> int:
        state = self._state.get(address)
        return 0 if state is None else len(state.blocks)

    def last_seq(self, address: str) -> int:
        state = self._state.get(address)
        return 0 if state is None else state.last_seq

    def resyncs(self, address: str) -> int:
        state = self._state.get(address)
        return 0 if state is None else state.resyncs

    def incarnation(self, address: str) -> str:
        """The incarnation of the replica's engine that its known blocks come from."""
        state = self._state.get(address)
        return "" if state is None else state.incarnation

    # ----------------------------------------------------------------- listener
    def replica_added(self, replica: Replica) -> None:
        state = self._state.setdefault(replica.address, _ReplicaBlocks())
        state.task = asyncio.get_running_loop().create_task(
            self._watch(replica, state), name=f"kv-events-{replica.address}")

    def replica_removed(self, replica: Replica) -> None:
        self._drop(replica.address)
        state = self._state.pop(replica.address, None)
        if state is not None and state.task is not None:
            state.task.cancel()

    async def stop(self) -> None:
        tasks = [s.task for s in self._state.values() if s.task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # ----------------------------------------------------------------- applying events
    def apply(self, address: str, batch: engine_pb2.KvEventBatch) -> bool:
        """Apply one batch, or keep one snapshot piece aside; False (and nothing applied)
        when it does not follow the last one (a gap, a snapshot piece missing, or a batch of
        another incarnation than the state's), in which case the caller must drop the
        replica's state and resubscribe from seq 0."""
        state = self._state.setdefault(address, _ReplicaBlocks())
        if batch.resync:
            return self._apply_snapshot_piece(address, state, batch)
        if state.snapshot_blocks is not None:
            return False  # the snapshot's pieces are back to back: one is missing
        if batch.incarnation != state.incarnation and (state.incarnation or state.last_seq):
            return False  # another process's seqs: they say nothing about what we applied
        if batch.seq <= state.last_seq:
            return True  # a replayed batch we already applied
        elif batch.seq != state.last_seq + 1:
            return False
        self._apply_events(address, state, batch)
        state.last_seq = batch.seq
        state.incarnation = batch.incarnation  # the first batch of a fresh state sets it
        return True

    def _apply_snapshot_piece(self, address: str, state: _ReplicaBlocks,
                              batch: engine_pb2.KvEventBatch) -> bool:
        piece = batch.snapshot
        if piece.chunk_index == 0:
            state.snapshot_seq, state.snapshot_blocks = batch.seq, set()
            state.snapshot_incarnation = batch.incarnation
        elif (state.snapshot_blocks is None or piece.chunk_index != state.snapshot_next_chunk
              or batch.seq != state.snapshot_seq
              or batch.incarnation != state.snapshot_incarnation):
            state.snapshot_blocks = None
            return False
        assert state.snapshot_blocks is not None
        state.snapshot_blocks.update(piece.block_hashes)
        state.snapshot_next_chunk = piece.chunk_index + 1
        if state.snapshot_next_chunk < piece.num_chunks:
            return True
        # The last piece (or a replica that sent none: num_chunks 0 reads as an empty cache).
        self._replace(address, state, state.snapshot_blocks)
        state.snapshot_blocks = None
        state.resyncs += 1
        self._apply_events(address, state, batch)  # none are sent with a snapshot
        # Whatever incarnation the old state came from, the snapshot replaced all of it.
        state.last_seq, state.incarnation = batch.seq, state.snapshot_incarnation
        return True

    def _apply_events(self, address: str, state: _ReplicaBlocks,
                      batch: engine_pb2.KvEventBatch) -> None:
        for event in batch.events:
            kind = event.WhichOneof("event")
            if kind == "block_stored":
                medium = event.block_stored.medium or DEVICE
                for block_hash in event.block_stored.block_hashes:
                    if medium == DEVICE:
                        self._add_block(address, state, block_hash)
                    else:
                        self._add_tier_block(state, medium, block_hash)
            elif kind == "block_removed":
                medium = event.block_removed.medium or DEVICE
                for block_hash in event.block_removed.block_hashes:
                    if medium == DEVICE:
                        self._remove_block(address, state, block_hash)
                    elif medium == SHARED:
                        self._shared.pop(block_hash, None)
                    else:
                        state.tiers.get(medium, set()).discard(block_hash)
            elif kind == "all_blocks_cleared":
                self._drop(address)

    def _add_block(self, address: str, state: _ReplicaBlocks, block_hash: BlockHash) -> None:
        state.blocks.add(block_hash)
        state.expected.pop(block_hash, None)
        self._replicas_by_block.setdefault(block_hash, set()).add(address)

    def _add_tier_block(self, state: _ReplicaBlocks, medium: str, block_hash: BlockHash) -> None:
        if medium == SHARED:
            self._shared[block_hash] = None
            self._shared.move_to_end(block_hash)
            if len(self._shared) > self.max_shared_blocks:
                self._shared.popitem(last=False)
        else:
            state.tiers.setdefault(medium, set()).add(block_hash)

    def _remove_block(self, address: str, state: _ReplicaBlocks, block_hash: BlockHash) -> None:
        state.blocks.discard(block_hash)
        state.expected.pop(block_hash, None)
        holders = self._replicas_by_block.get(block_hash)
        if holders is not None:
            holders.discard(address)
            if not holders:
                del self._replicas_by_block[block_hash]

    def _replace(self, address: str, state: _ReplicaBlocks, blocks: set[BlockHash]) -> None:
        """Make ``blocks`` all that ``address`` holds. Routed blocks not confirmed yet stay
        expected: the requests that will compute them may still be queued there."""
        for block_hash in state.blocks - blocks:
            self._remove_block(address, state, block_hash)
        for block_hash in blocks - state.blocks:
            self._add_block(address, state, block_hash)

    def _drop(self, address: str) -> None:
        """Forget every block of ``address`` (keeps its seq, incarnation and engine id)."""
        state = self._state.get(address)
        if state is None:
            return
        state.expected = {}
        for block_hash in state.blocks:
            holders = self._replicas_by_block.get(block_hash)
            if holders is not None:
                holders.discard(address)
                if not holders:
                    del self._replicas_by_block[block_hash]
        state.blocks = set()
        state.tiers = {}
        state.snapshot_blocks = None

    # ----------------------------------------------------------------- subscription
    async def _watch(self, replica: Replica, state: _ReplicaBlocks) -> None:
        while True:
            try:
                await self._subscribe_once(replica, state)
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as e:
                logger.debug("KV events of %s: %s", replica.address, e.code())
            state.connected = False
            await asyncio.sleep(self.reconnect_interval_s)

    async def _subscribe_once(self, replica: Replica, state: _ReplicaBlocks) -> None:
        info = await replica.engine.GetInfo(engine_pb2.GetInfoRequest(), timeout=5.0)
        if info.engine_id != state.engine_id or replica.epoch != state.epoch:
            # Perhaps another incarnation behind the address, whose seqs started over: a
            # replay from our last seq could skip its first batches. Rebuild from scratch.
            self._drop(replica.address)
            state.engine_id = info.engine_id
            state.epoch = replica.epoch
            state.last_seq, state.incarnation = 0, ""
        # The replica answers an incarnation other than its own with a snapshot: a process
        # restarted behind the same engine id counts from seq 1 again.
        call = replica.engine.WatchKvEvents(engine_pb2.WatchKvEventsRequest(
            since_seq=state.last_seq, incarnation=state.incarnation))
        try:
            state.connected = True
            async for batch in call:
                if not self.apply(replica.address, batch):
                    logger.info("KV events of %s: seq %d of incarnation %s does not follow "
                                "seq %d of incarnation %s; rebuilding", replica.address,
                                batch.seq, batch.incarnation or "?", state.last_seq,
                                state.incarnation or "?")
                    self._drop(replica.address)
                    state.last_seq, state.incarnation = 0, ""
                    state.resyncs += 1
                    return
        finally:
            call.cancel()
            # A snapshot cut off midway is of no use: the next subscription, from the last
            # applied seq, gets a whole one again.
            state.snapshot_blocks = None
