"""Per-rank KV pulls: every rank of a decode replica reads the KV heads it owns straight from
the prefill rank(s) that hold them, over its own UCX endpoints; nothing is gathered through
one process.

Owns one rank's part of a pull (``RankReader``: its endpoints and unpacked keys, one per
producer rank it reads, and the GETs ``rank_layout.head_reads`` lists), the message rank 0
sends another rank (``RankPull``) and rank 0's coordination of a pull (``RankedPulls``):
it plans which producer rank each consumer rank's heads come from, hands the other ranks
their part (``OtherRanks``: the engine's channel to its workers) and reads its own. The
lease is confirmed once, by rank 0 on its control connection, after every rank's reads
landed (``ucx_consumer``): block ids are the same on every rank, so one lease covers them.

Reads only, over shared memory (cma reads the producer rank's memory) or TCP (UCX serves
the GETs on the producer rank's progress thread; each endpoint is first wired up by
``rank_wire_up``). Per-rank pulls need host memory on both sides; a pairing without it is
refused (``refusal``), with the reason ``tensor_parallel``, and the prompt is recomputed.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from kv_transfer.connector import KvHandle, KvTransferError
from kv_transfer.layout import ITEM_SIZES, KvLayout
from kv_transfer.rank_layout import (
    HeadRead,
    RankCache,
    block_reads,
    head_reads,
    kv_head_range,
    plan_heads,
    producer_layout,
)
from kv_transfer.rank_wire_up import wire_up
from kv_transfer.transfer_plan import DIRECT_MIN_MESSAGE_BYTES
from kv_transfer.ucx_io import abort_endpoint, is_transport_error, open_endpoint
from kv_transfer.ucx_rma import ReadBurst, Reader, RemoteKey
from kv_transfer.ucx_runtime import UcxRuntime

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Bounds a burst of reads (a dead producer rank fails them at once); the pull's timeout
# bounds the whole.
READ_SETTLE_TIMEOUT_S = 5.0
# How long a producer rank's worker may take to answer a TCP wire-up (``rank_wire_up``).
WIRE_UP_TIMEOUT_S = 5.0
# How long rank 0 waits for another rank's report: its reads end within the bound above
# (or its process is gone, which takes the replica down); this bounds a bug.
RANK_REPORT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class RankPull:
    """Rank 0 to another rank of its replica: read ``reads`` of ``producers`` (block
    ``remote[i]`` into local block ``local[i]``), then report ``pull_id`` done.
    ``tcp``: the producers' addresses are network-only (endpoints need a wire-up)."""

    pull_id: int
    producers: tuple[RankCache, ...]
    reads: tuple[HeadRead, ...]
    remote: tuple[int, ...]
    local: tuple[int, ...]
    tcp: bool = False


class OtherRanks(Protocol):
    """Rank 0's channel to the other ranks of its replica (the engine's workers)."""

    def send(self, rank: int, pull: RankPull) -> None:
        """Hand rank ``rank`` its part of a pull (returns at once)."""

    def wait(self, pull_id: int, ranks: Sequence[int], timeout: float) -> None:
        """Block until each of ``ranks`` reported ``pull_id`` done; KvTransferError with
        the first failure, or "timeout"."""


class RankReader:
    """One process's reads of producer ranks into its own rank's cache."""

    def __init__(self, kv_cache: torch.Tensor, layout: KvLayout, first_head: int, host: str):
        self._kv_cache, self._layout, self._first_head = kv_cache, layout, first_head
        self._runtime = UcxRuntime.shared(host)
        self._reader = Reader()
        # Touched on the runtime's loop only: producer worker address -> (endpoint, keys).
        self._endpoints: dict[bytes, tuple[Any, dict[bytes, RemoteKey]]] = {}

    def start(self, pull: RankPull) -> Any:
        """Run ``pull`` on the runtime's loop; a concurrent Future of its byte count."""
        return self._runtime.submit(self.read(pull.producers, pull.reads, pull.remote,
                                              pull.local, pull.tcp))

    async def read(self, producers: Sequence[RankCache], reads: Sequence[HeadRead],
                   remote: Sequence[int], local: Sequence[int], tcp: bool = False) -> int:
        """Every read into this rank's cache; returns the bytes of the heads read. Each
        read's GETs go straight into the cache when they are whole blocks or large
        stretches, else whole producer blocks into a staging buffer, the heads then copied
        into place (``_whole_blocks``). Every burst is waited for before any failure is
        raised (no GET may outlive the pull); a failed producer rank's endpoint is dropped.
        ``tcp``: the producers are reached over TCP (a new endpoint is wired up first)."""
        by_rank = {p.rank: p for p in producers}
        remote, local = list(remote), list(local)
        posted: list[tuple[RankCache, ReadBurst, Callable[[], None] | None]] = []
        total, failures = 0, []
        try:
            for read in reads:
                source = by_rank[read.producer_rank]
                endpoint, rkey = await self._endpoint(source, tcp)
                place: Callable[[], None] | None
                if _whole_blocks(self._layout, self._first_head, source, read):
                    gets = head_reads(self._layout, self._kv_cache.data_ptr(),
                                      self._first_head, source, read, remote, local)
                    place = None
                else:
                    staging = torch.empty((len(remote), *self._kv_cache.shape[1:3],
                                           source.num_heads, *self._kv_cache.shape[4:]),
                                          dtype=self._kv_cache.dtype)
                    gets = block_reads(self._layout, staging.data_ptr(), source, remote)
                    place = functools.partial(self._place, staging, source, read, local)
                total += read.num_heads * len(local) * self._head_block_bytes()
                posted.append((source, self._reader.get(endpoint.ucp_endpoint, rkey, gets),
                               place))
        except Exception as exc:  # a producer rank gone (reconnecting to it fails too)
            if not isinstance(exc, KvTransferError) and not is_transport_error(exc):
                raise
            failures.append(f"per-rank read from a prefill rank failed: {exc!r}")
        cancelled = False
        for source, burst, place in posted:
            over, interrupted = await _through_cancel(self._runtime.run_copy(functools.partial(
                burst.wait, _worker_handle(), READ_SETTLE_TIMEOUT_S)))
            cancelled |= interrupted
            self._reader.forget(burst)
            if not over or burst.error:
                self._drop(source.address)
                failures.append(f"reads from prefill rank {source.rank} "
                                f"{'failed' if over else 'did not end'}")
            elif place is not None and not failures and not cancelled:
                await self._runtime.run_copy(place)
        if cancelled:
            raise asyncio.CancelledError
        if failures:
            raise KvTransferError("unreachable", "; ".join(failures))
        return total

    def _head_block_bytes(self) -> int:
        """Bytes of one head's K and V of one block, every layer."""
        return self._kv_cache[0, :, :, 0].numel() * self._kv_cache.element_size()

    def _place(self, staging: torch.Tensor, source: RankCache, read: HeadRead,
               local: list[int]) -> None:
        """Copy a read's heads from whole staged producer blocks into the local blocks."""
        theirs = read.first_head - source.first_head
        ours = read.first_head - self._first_head
        index = torch.tensor(local, dtype=torch.long)
        self._kv_cache[index, :, :, ours:ours + read.num_heads] = \
            staging[:, :, :, theirs:theirs + read.num_heads]

    async def _endpoint(self, source: RankCache, tcp: bool) -> tuple[Any, RemoteKey]:
        known = self._endpoints.get(source.address)
        if known is None or known[0].closed:
            if known is not None:
                self._drop(source.address)
            endpoint = await open_endpoint(source.address)
            if tcp:
                try:
                    await wire_up(endpoint, WIRE_UP_TIMEOUT_S)
                except BaseException:
                    abort_endpoint(endpoint)
                    raise
            known = self._endpoints[source.address] = (endpoint, {})
        endpoint, keys = known
        if source.rkey not in keys:  # a producer rank restarted: another key, another cache
            keys[source.rkey] = RemoteKey(endpoint.ucp_endpoint, source.rkey)
        return endpoint, keys[source.rkey]

    def _drop(self, address: bytes) -> None:
        known = self._endpoints.pop(address, None)
        if known is not None:
            for key in known[1].values():
                key.destroy()
            abort_endpoint(known[0])

    def close(self) -> None:
        async def drop_all() -> None:
            for address in list(self._endpoints):
                self._drop(address)
        self._runtime.call(drop_all(), timeout=30)


class RankedPulls:
    """Rank 0 of a consumer replica (of one rank or several): pulls from producers of any
    parallel size, each of its ranks reading its own heads."""

    def __init__(self, layout: KvLayout, total_heads: int, reader: RankReader,
                 others: OtherRanks | None):
        self.layout, self.total_heads = layout, total_heads
        self._reader, self._others = reader, others
        self._ids = itertools.count(1)

    def needed(self, handle: KvHandle) -> bool:
        """A pull of this handle moves per rank (either side has several ranks)."""
        return handle.tensor_parallel_size > 1 or self.layout.tensor_parallel_size > 1

    def producer_fingerprint(self, producer_ranks: int) -> str:
        """The layout fingerprint a producer of ``producer_ranks`` ranks of this model has."""
        return producer_layout(self.layout, self.total_heads, producer_ranks).fingerprint()

    def nbytes(self, num_blocks: int, producer_ranks: int) -> int:
        """The bytes a producer rank 0 confirms for ``num_blocks`` blocks."""
        return num_blocks * producer_layout(self.layout, self.total_heads,
                                            producer_ranks).bytes_per_block

    def nbytes_read(self, num_blocks: int) -> int:
        """The bytes every rank of this replica reads for ``num_blocks`` blocks."""
        size = self.layout.tensor_parallel_size
        heads = sum(kv_head_range(self.total_heads, rank, size)[1] for rank in range(size))
        return num_blocks * self.layout.bytes_per_block // self.layout.num_kv_heads * heads

    async def pull(self, producers: Sequence[RankCache], remote: list[int], local: list[int],
                   tcp: bool = False) -> None:
        """Every rank's reads: the other ranks' handed to them first, rank 0's own read
        meanwhile, then the others' reports awaited (on a thread of its own: the copy
        threads are the reads'). Returns only once every rank's reads are over, also when
        cancelled (the engine may reuse the blocks after a failure), or raises. ``tcp``:
        the producers' addresses are network-only (``RankPull.tcp``)."""
        size = self.layout.tensor_parallel_size
        plans = {rank: plan_heads(list(producers), kv_head_range(self.total_heads, rank, size))
                 for rank in range(size)}
        pull_id = next(self._ids)
        others = [rank for rank in range(1, size)]
        if others:
            assert self._others is not None
            for rank in others:
                self._others.send(rank, RankPull(pull_id, tuple(producers), tuple(plans[rank]),
                                                 tuple(remote), tuple(local), tcp))
        try:
            await self._reader.read(producers, plans[0], remote, local, tcp)
        finally:
            if others:  # waited for even when rank 0 failed: no read may outlive the pull
                assert self._others is not None
                _, cancelled = await _through_cancel(asyncio.to_thread(
                    self._others.wait, pull_id, others, RANK_REPORT_TIMEOUT_S))
                if cancelled:
                    raise asyncio.CancelledError


async def _through_cancel(work: Awaitable[T]) -> tuple[T | None, bool]:
    """``work``'s result, awaited to its end even if this task is cancelled meanwhile
    (blocking work on a thread goes on anyway: what it writes must not outlive the pull);
    and whether it was. Cancelled, a failed ``work``'s result is None, its error dropped."""
    future = asyncio.ensure_future(work)
    cancelled = False
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            cancelled = True
        except Exception:  # noqa: BLE001 - raised below, from the future
            break
    if cancelled and (future.cancelled() or future.exception() is not None):
        return None, True  # its error retrieved: no "never retrieved" noise
    return future.result(), cancelled


def _whole_blocks(layout: KvLayout, first_head: int, source: RankCache, read: HeadRead
                  ) -> bool:
    """Whether a read's GETs go straight into the cache: both sides hold exactly its heads
    (one GET per run of blocks), or its stretches per (block, layer, K/V) are large enough
    that a GET each costs less than staging (``DIRECT_MIN_MESSAGE_BYTES``, the crossover
    ``transfer_plan`` measured). Otherwise whole producer blocks are read into a staging
    buffer, the heads copied into place here: a GET costs ~tens of microseconds (more on a
    loaded host), and a model's heads are a few KiB a block (SmolLM2's: 2 KiB), so 60
    stretches a block lose to reading its other heads too (bench/tp_kv_pull.py)."""
    same = (read.num_heads == source.num_heads == layout.num_kv_heads
            and read.first_head == source.first_head == first_head)
    stretch = read.num_heads * layout.block_size * layout.head_size * ITEM_SIZES[layout.dtype]
    return same or stretch >= DIRECT_MIN_MESSAGE_BYTES


def refusal(handle: KvHandle, ranked: RankedPulls | None, cuda: bool) -> str | None:
    """Why a pull between replicas of these parallel sizes cannot be served (None: it can)."""
    if ranked is None or not ranked.needed(handle):
        return None if handle.tensor_parallel_size == 1 else (
            f"the prefill replica has {handle.tensor_parallel_size} tensor-parallel ranks and "
            "this consumer pulls only single-rank caches")
    if cuda:
        return ("per-rank KV pulls read host memory; this replica's cache is on a GPU "
                "(not built: a GPU cache is sent, and per-rank sends are not)")
    return None


def _worker_handle() -> int:
    import ucxx

    return int(ucxx.get_ucp_worker())
