"""The engine's KV tiers: what the engine core and the scheduler call.

Owns the tiers of one engine (fastest first), the copy of blocks out of and into the KV
cache tensor, the admission of stores, the loads in flight, the tiers' KV events and their
counters. It does not decide which request loads (the scheduler, through ``probe``) nor
touch block bookkeeping (``kv_cache_manager``): a finished load is handed back through
``take_finished_loads`` and the scheduler registers the blocks.

Write-through: after each step the blocks it completed are copied out of the cache (one
gather of their bytes, on the step's thread: the block may be reused by the next step) and
queued for the worker, which puts them in every tier. A step never waits on a store.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine_common.block_hash import BlockHash
from engine_common.kv_events import BlockRemoved, BlockStored, KVEvent
from engine_common.kv_tiers.admission import AdmissionFilter
from engine_common.kv_tiers.config import KvTiersConfig
from engine_common.kv_tiers.disk_tier import DiskTier
from engine_common.kv_tiers.key import NAMESPACE_BYTES, layout_namespace, tier_key
from engine_common.kv_tiers.memory_tier import HostMemoryTier
from engine_common.kv_tiers.redis_tier import RedisTier
from engine_common.kv_tiers.tier import HOST, Tier, TierFailure, TierStats
from engine_common.kv_tiers.worker import TierWorker
from kv_transfer.layout import KvLayout

logger = logging.getLogger(__name__)


@dataclass
class BlockToStore:
    """A computed block, as the tiers' KV events describe it."""

    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_ids: list[int]
    block_id: int


@dataclass
class TierLoadResult:
    """A load that ended: the first ``num_blocks`` of the blocks asked for are in the cache."""

    request_id: str
    num_blocks: int
    by_medium: dict[str, int] = field(default_factory=dict)
    fallback_reason: str | None = None  # why it stopped short of a block a tier should hold


class KvTiers:
    def __init__(self, config: KvTiersConfig, kv_cache: torch.Tensor, layout: KvLayout) -> None:
        config.check()
        self.config = config
        self._kv_cache = kv_cache
        self.block_size = layout.block_size
        self.payload_bytes = layout.bytes_per_block
        self.namespace = layout_namespace(layout)
        self.tiers = self._open_tiers(config)
        self.stats = {tier.medium: TierStats() for tier in self.tiers}
        self._totals = {tier.medium: TierStats() for tier in self.tiers}
        self._admission = AdmissionFilter(config.admit_after)
        # Hashes recently queued for storing: a block hit by many requests is copied once.
        self._queued: OrderedDict[BlockHash, None] = OrderedDict()
        self._lock = threading.Lock()  # events, stats and results, shared with the worker
        self._load_ended = threading.Condition(self._lock)
        self._events: list[KVEvent] = []
        self._finished: list[TierLoadResult] = []
        self._loads_in_flight = 0
        self._worker = TierWorker(config.max_pending_stores)
        self._announce_found_blocks()

    def _announce_found_blocks(self) -> None:
        """A disk tier opened with blocks in it (a restarted replica): say so in the next KV
        events taken (a replica's core process sends them at its start, an offline engine
        with its first step), so the router knows them before any is stored again."""
        for tier in self.tiers:
            if isinstance(tier, DiskTier):
                found = [key[NAMESPACE_BYTES:] for key in tier.keys()
                         if key.startswith(self.namespace)]
                if found:
                    self._events.append(BlockStored(found, None, [], self.block_size,
                                                    medium=tier.medium))

    def _open_tiers(self, config: KvTiersConfig) -> list[Tier]:
        tiers: list[Tier] = []
        if config.memory_bytes > 0:
            tiers.append(HostMemoryTier(config.memory_bytes))
        if config.disk_dir is not None:
            tiers.append(DiskTier(config.disk_dir, config.disk_bytes, self.payload_bytes))
        if config.store_url is not None:
            password = config.store_password or os.environ.get("TANDEM_KV_STORE_PASSWORD")
            tiers.append(RedisTier(config.store_url, self.payload_bytes, password=password,
                                   tls_ca=config.store_tls_ca,
                                   timeout=config.store_timeout_seconds,
                                   ttl=config.store_ttl_seconds))
        return tiers

    # ------------------------------------------------------------------ the scheduler's
    def probe(self, block_hash: BlockHash) -> bool:
        """Whether a tier may hold this block: known for host and disk, assumed for a shared
        tier (only a get can tell: the load finds out, one round trip)."""
        key = tier_key(self.namespace, block_hash)
        return any(tier.contains(key) is not False for tier in self.tiers)

    # ------------------------------------------------------------------ stores
    def store(self, blocks: Sequence[BlockToStore]) -> None:
        """Write computed blocks through to the tiers (those admitted and not queued yet)."""
        todo = [b for b in blocks if b.block_hash not in self._queued
                and self._admission.admit(b.block_hash)]
        if not todo:
            return
        ids = torch.tensor([b.block_id for b in todo], device=self._kv_cache.device)
        # The cache is block-major: a block's payload (every layer's K and V) is one slice.
        copied = self._kv_cache.index_select(0, ids).cpu()
        raw = copied.view(torch.uint8).reshape(len(todo), -1).numpy()
        for i, block in enumerate(todo):
            payload = raw[i].tobytes()
            if not self._worker.submit_store(functools.partial(self._store_one, block, payload)):
                with self._lock:
                    for stats in self.stats.values():
                        stats.dropped_stores += 1
                continue
            self._queued[block.block_hash] = None
            if len(self._queued) > 1 << 16:
                self._queued.popitem(last=False)

    def _store_one(self, block: BlockToStore, payload: bytes) -> None:
        key = tier_key(self.namespace, block.block_hash)
        for tier in self.tiers:
            started = time.perf_counter()
            try:
                evicted = tier.put(key, payload)
            except TierFailure as exc:
                with self._lock:
                    self.stats[tier.medium].fail(exc.reason)
                    self.stats[tier.medium].dropped_stores += 1
                continue
            self._note_stored(tier.medium, block, evicted, time.perf_counter() - started)

    def _note_stored(self, medium: str, block: BlockToStore, evicted: list[bytes],
                     seconds: float) -> None:
        with self._lock:
            stats = self.stats[medium]
            stats.stores += 1
            stats.bytes_stored += self.payload_bytes
            stats.store_seconds += seconds
            stats.evictions += len(evicted)
            if evicted:
                self._events.append(BlockRemoved(
                    [key[NAMESPACE_BYTES:] for key in evicted], medium=medium))
            self._events.append(BlockStored([block.block_hash], block.parent_hash,
                                            block.token_ids, self.block_size, medium=medium))

    # ------------------------------------------------------------------ loads
    def start_load(self, request_id: str, block_hashes: Sequence[BlockHash],
                   block_ids: Sequence[int]) -> None:
        """Load the longest run of ``block_hashes`` the tiers hold into ``block_ids``."""
        with self._lock:
            self._loads_in_flight += 1
        hashes, ids = list(block_hashes), list(block_ids)
        self._worker.submit_load(lambda: self._load(request_id, hashes, ids))

    def _load(self, request_id: str, hashes: list[BlockHash], ids: list[int]) -> None:
        result = TierLoadResult(request_id, 0)
        deadline = time.monotonic() + self.config.max_load_seconds
        try:
            for block_hash, block_id in zip(hashes, ids, strict=True):
                if time.monotonic() > deadline:
                    result.fallback_reason = "slow"
                    break
                if not self._load_one(block_hash, block_id, result):
                    break
                result.num_blocks += 1
        finally:
            with self._lock:
                self._loads_in_flight -= 1
                self._finished.append(result)
                self._load_ended.notify_all()

    def _load_one(self, block_hash: BlockHash, block_id: int, result: TierLoadResult) -> bool:
        key = tier_key(self.namespace, block_hash)
        for tier in self.tiers:
            started = time.perf_counter()
            try:
                payload = tier.get(key)
            except TierFailure as exc:
                with self._lock:
                    self.stats[tier.medium].fail(exc.reason)
                result.fallback_reason = exc.reason
                continue
            if payload is None:
                continue
            block = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            self._kv_cache[block_id].copy_(
                block.view(self._kv_cache.dtype).view(self._kv_cache.shape[1:]))
            with self._lock:
                stats = self.stats[tier.medium]
                stats.hits += 1
                stats.bytes_loaded += len(payload)
                stats.load_seconds += time.perf_counter() - started
            result.by_medium[tier.medium] = result.by_medium.get(tier.medium, 0) + 1
            if tier.medium != HOST and self.tiers[0].medium == HOST:
                self._promote(block_hash, key, payload)
            return True
        return False

    def _promote(self, block_hash: BlockHash, key: bytes, payload: bytes) -> None:
        """A block loaded from disk or the shared tier is kept in host memory too."""
        host = self.tiers[0]
        evicted = host.put(key, payload)
        self._note_stored(HOST, BlockToStore(block_hash, None, [], -1), evicted, 0.0)

    @property
    def has_loads_running(self) -> bool:
        with self._lock:
            return self._loads_in_flight > 0 or bool(self._finished)

    def wait_for_loads(self, timeout: float) -> None:
        """Return once a load has ended (or none runs), or after ``timeout`` seconds."""
        with self._load_ended:
            self._load_ended.wait_for(
                lambda: bool(self._finished) or self._loads_in_flight == 0, timeout)

    def take_finished_loads(self) -> list[TierLoadResult]:
        with self._lock:
            finished, self._finished = self._finished, []
        return finished

    # ------------------------------------------------------------------ reporting
    def take_events(self) -> list[KVEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def take_stats(self) -> dict[str, TierStats]:
        """Each tier's counters since the last call (the engine's statistics report them)."""
        with self._lock:
            stats = self.stats
            self.stats = {tier.medium: TierStats() for tier in self.tiers}
            for medium, taken in stats.items():
                self._totals[medium].add(taken)
        return stats

    def totals(self) -> dict[str, TierStats]:
        """Each tier's counters since the start, taken or not."""
        with self._lock:
            totals = {medium: TierStats() for medium in self.stats}
            for medium, total in totals.items():
                total.add(self._totals[medium])
                total.add(self.stats[medium])
        return totals

    def drain(self, timeout: float = 30.0) -> bool:
        return self._worker.drain(timeout)

    def close(self) -> None:
        self._worker.close()
        for tier in self.tiers:
            tier.close()
