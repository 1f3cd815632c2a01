"""The producer's table of pinned requests: which blocks are held, for whom, until when.

Owns lease bookkeeping shared by the engine's thread (pin, release, expire) and the
transport's threads (serving reads), and the rule that makes that sharing safe: a lease
being read (its blocks copied into a staging buffer) is never ended under the reader.
``remove`` waits for readers to finish (a memory copy, not a network wait);
``remove_expired`` skips leases being read and takes them on a later call. A reader whose
bytes leave by the network without a copy (a direct transfer, which the peer reads from
the cache itself) does not hold the lease open meanwhile; it asks ``holds`` (or, for a
consumer that read without asking first, ``confirm``) afterwards whether the lease stayed in
force throughout.

Generations: every lease gets a number no earlier lease of the same id had, its deadline in
milliseconds (``add`` moves a deadline a millisecond past the previous pin's of that id
when they would meet), so that the handle, which carries the deadline already, names one
pin and never another: a lease of the same id pinned again (a re-pinned announcement, a
request id reused) has another generation, and a consumer that read the old one's blocks
is told so.

It does not own the blocks themselves or tell the engine anything: the producer calls
its ``on_release`` hook with what this table returns.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from kv_transfer.connector import KvTransferError


@dataclass
class Lease:
    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    deadline: float  # unix seconds
    generation: int = 0  # the deadline in ms, unique in its table (see the module docstring)
    readers: int = 0


class LeaseTable:
    def __init__(self, remembered_expired: int = 4096):
        self._cond = threading.Condition()
        self._leases: dict[str, Lease] = {}
        # Expired ids are remembered (bounded) so that a late pull hears "lease_expired"
        # rather than the less helpful "unknown_request".
        self._expired: OrderedDict[str, None] = OrderedDict()
        self._remembered_expired = remembered_expired
        # The last generation of each id pinned, while it may still be met again (until
        # its deadline: a later pin's deadline lies past it anyway).
        self._generations: dict[str, int] = {}

    def __len__(self) -> int:
        with self._cond:
            return len(self._leases)

    def add(
        self, request_id: str, block_ids: Sequence[int], num_tokens: int, deadline: float
    ) -> Lease:
        """Pin; the lease's deadline is ``deadline`` rounded to the millisecond, or a
        millisecond after the previous pin's of this id if that is later (its generation)."""
        with self._cond:
            if request_id in self._leases:
                raise ValueError(f"request {request_id!r} is already pinned")
            generation = max(round(deadline * 1000), self._generations.get(request_id, 0) + 1)
            self._forget_past_generations()
            self._generations[request_id] = generation
            lease = Lease(request_id, tuple(int(b) for b in block_ids), num_tokens,
                          generation / 1000, generation)
            self._expired.pop(request_id, None)
            self._leases[request_id] = lease
        return lease

    @contextmanager
    def reading(
        self, request_id: str, block_ids: Sequence[int], now: float | None
    ) -> Iterator[Lease]:
        """Hold the lease open while its blocks ``block_ids`` are read.

        Raises KvTransferError: "unknown_request", "lease_expired" (also when past its
        deadline at ``now``; None skips that check, for the later reads of a transfer
        that began in time), or "protocol" when ``block_ids`` are not among the pinned.
        """
        with self._cond:
            lease = self._leases.get(request_id)
            if lease is None:
                if request_id in self._expired:
                    raise KvTransferError("lease_expired", f"request {request_id!r}")
                raise KvTransferError("unknown_request", f"request {request_id!r}")
            if now is not None and now > lease.deadline:
                raise KvTransferError("lease_expired", f"request {request_id!r}")
            stray = set(block_ids) - set(lease.block_ids)
            if stray:
                raise KvTransferError(
                    "protocol", f"blocks {sorted(stray)} are not pinned for {request_id!r}"
                )
            lease.readers += 1
        try:
            yield lease
        finally:
            with self._cond:
                lease.readers -= 1
                self._cond.notify_all()

    def holds(self, lease: Lease) -> bool:
        """Whether ``lease`` (as ``reading`` yielded it) is still in force: not released,
        expired or replaced by a new pin of the same request id since."""
        with self._cond:
            return self._leases.get(lease.request_id) is lease

    def confirm(self, request_id: str, block_ids: Sequence[int], generation: int,
                now: float) -> None:
        """Raise KvTransferError unless the lease of ``generation`` is in force at ``now``
        and pins ``block_ids``: asked after reads that began once its handle existed, it
        says that the lease held throughout them (a lease that ends never comes back; a new
        pin of the same id has another generation). Past its deadline it is refused, as an
        admission is, even before ``remove_expired`` collects it."""
        with self._cond:
            lease = self._leases.get(request_id)
            if lease is None:
                if request_id in self._expired:
                    raise KvTransferError("lease_expired", f"request {request_id!r}")
                raise KvTransferError("unknown_request", f"request {request_id!r}")
            if lease.generation != generation:
                raise KvTransferError(
                    "lease_expired", f"request {request_id!r} was pinned again (generation "
                    f"{lease.generation}, read {generation}): its blocks may have been reused")
            if now > lease.deadline:
                raise KvTransferError("lease_expired", f"request {request_id!r}")
            stray = set(block_ids) - set(lease.block_ids)
            if stray:
                raise KvTransferError(
                    "protocol", f"blocks {sorted(stray)} are not pinned for {request_id!r}")

    def remove(self, request_id: str) -> list[int] | None:
        """End a lease once no one reads it; None when there is no such lease."""
        with self._cond:
            lease = self._leases.get(request_id)
            if lease is None:
                return None
            self._cond.wait_for(lambda: lease.readers == 0)
            del self._leases[request_id]
            return list(lease.block_ids)

    def remove_expired(self, now: float) -> list[tuple[str, list[int]]]:
        """End every unread lease whose deadline is before ``now``."""
        ended: list[tuple[str, list[int]]] = []
        with self._cond:
            for request_id, lease in list(self._leases.items()):
                if lease.deadline < now and lease.readers == 0:
                    del self._leases[request_id]
                    self._remember_expired(request_id)
                    ended.append((request_id, list(lease.block_ids)))
        return ended

    def _forget_past_generations(self) -> None:
        """Bound the memory of generations: those past their deadline can never be met
        again (a new pin's deadline is after now). Amortised: only when it has grown."""
        if len(self._generations) < 2 * len(self._leases) + 1024:
            return
        now_ms = time.time() * 1000
        self._generations = {rid: g for rid, g in self._generations.items()
                             if g >= now_ms or rid in self._leases}

    def clear(self) -> None:
        with self._cond:
            self._leases.clear()

    def _remember_expired(self, request_id: str) -> None:
        self._expired[request_id] = None
        while len(self._expired) > self._remembered_expired:
            self._expired.popitem(last=False)
