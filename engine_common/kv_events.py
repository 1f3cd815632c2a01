"""KV-cache events, the ring buffer that lets watchers catch up on them, and the snapshot
that replaces them when a watcher cannot catch up.

Owns the event records (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``), their
batching into sequence-numbered ``KVEventBatch``es, ``KVEventBuffer``, a bounded ring that
answers "everything after seq N" or says the watcher fell too far behind, with its
incarnation (a random id drawn once per buffer, so once per engine start, that the seqs count
within), and ``KVCacheSnapshot``, every block hash in the prefix cache at one seq, cut into
bounded ``KVCacheSnapshotChunk``s for the wire. It does not own producing events
(``block_pool``), taking a snapshot (the engine core, through ``async_llm``) or streaming
either (the service's WatchKvEvents); it starts no threads and takes no locks, so the caller
serialises access.

A watcher's contract: keep the last seq it applied and the incarnation it came from; ask
``since(seq, incarnation)``; ``None`` means the events in between are gone, or belong to
another incarnation (the engine restarted, perhaps under the same engine id, and counts from
1 again: its seq N is not the seq N the watcher applied). Then the watcher gets a snapshot
taken at some seq S instead: it replaces what it knew about the replica with the snapshot's
hashes, sets its seq to S and applies the batches from S + 1 on, which neither repeat nor
miss anything the snapshot holds.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from dataclasses import dataclass
from itertools import islice

from engine_common.block_hash import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks newly cached, a contiguous run of one chain, in order."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None  # hash of the block before the first one; None at root
    token_ids: list[int]  # len(block_hashes) * block_size tokens (may be empty off device)
    block_size: int
    # Which tier holds them now: "device" (the engine's pool), "host", "disk" or "shared"
    # (engine_common.kv_tiers), as vLLM's events' ``medium``.
    medium: str = "device"


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks evicted from one tier (``medium``, as ``BlockStored``'s): their hashes no
    longer resolve there, though another tier may still hold them."""

    block_hashes: list[BlockHash]
    medium: str = "device"


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was dropped."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    seq: int  # 1, 2, 3, ... per incarnation (KVEventBuffer.incarnation), no gaps
    timestamp: float  # wall clock (time.time()), for display and lag metrics only
    events: list[KVEvent]


class KVEventBuffer:
    """The last ``capacity`` event batches, each with its sequence number, and the
    incarnation those numbers count within."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        # Random, not derived from the engine id: a replica restarted on the same host and port
        # keeps its engine id, and only this tells a watcher that its seqs started over.
        self.incarnation = uuid.uuid4().hex
        self._ring: deque[KVEventBatch] = deque(maxlen=capacity)
        self._last_seq = 0

    @property
    def last_seq(self) -> int:
        """Seq of the newest batch; 0 before the first."""
        return self._last_seq

    def append(self, events: list[KVEvent], timestamp: float | None = None) -> KVEventBatch | None:
        """Record one batch (one engine step's events); an empty list records nothing."""
        if not events:
            return None
        self._last_seq += 1
        batch = KVEventBatch(
            seq=self._last_seq,
            timestamp=time.time() if timestamp is None else timestamp,
            events=list(events),
        )
        self._ring.append(batch)
        return batch

    def since(self, seq: int, incarnation: str = "") -> list[KVEventBatch] | None:
        """Batches with a seq greater than ``seq``, oldest first; ``incarnation`` is the one
        ``seq`` belongs to, empty when the watcher does not know it (taken as this one).

        None when the ring no longer holds all of them (the watcher must resync), or when the
        watcher saw another incarnation of the engine: ``incarnation`` names another one, or
        ``seq`` is ahead of this buffer.
        """
        if incarnation and incarnation != self.incarnation:
            return None
        if seq > self._last_seq or seq < 0:
            return None
        if seq == self._last_seq:
            return []
        oldest = self._ring[0].seq  # non-empty: last_seq > seq >= 0 means something was appended
        if oldest > seq + 1:
            return None
        return list(islice(self._ring, seq + 1 - oldest, None))


@dataclass(frozen=True, slots=True)
class KVCacheSnapshotChunk:
    """One bounded piece of a ``KVCacheSnapshot``; all pieces of one snapshot share its seq."""

    seq: int
    timestamp: float
    block_hashes: list[BlockHash]
    index: int  # 0-based
    count: int  # pieces in the snapshot, at least 1 (an empty cache is one empty piece)

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1


@dataclass(frozen=True, slots=True)
class KVCacheSnapshot:
    """Every block hash in an engine's prefix cache, in no particular order, as it stands
    after the batches up to ``seq`` and before batch ``seq + 1`` (``seq`` 0: before any)."""

    seq: int
    timestamp: float  # wall clock when the engine core answered
    block_hashes: list[BlockHash]

    def chunks(self, max_blocks: int) -> list[KVCacheSnapshotChunk]:
        """The snapshot in pieces of at most ``max_blocks`` hashes each, in order."""
        if max_blocks <= 0:
            raise ValueError(f"max_blocks must be positive, got {max_blocks}")
        hashes = self.block_hashes
        count = max(1, -(-len(hashes) // max_blocks))
        return [
            KVCacheSnapshotChunk(self.seq, self.timestamp,
                                 hashes[i * max_blocks:(i + 1) * max_blocks], i, count)
            for i in range(count)
        ]
