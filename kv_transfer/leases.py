"""The producer's table of pinned requests: which blocks are held, for whom, until when.

Owns lease bookkeeping shared by the engine's thread (pin, release, expire) and the
transport's threads (serving reads), and the rule that makes that sharing safe: a lease
being read (its blocks copied into a staging buffer) is never ended under the reader.
``remove`` waits for readers to finish (a memory copy, not a network wait);
``remove_expired`` skips leases being read and takes them on a later call. A reader whose
bytes leave by the network without a copy (a direct transfer, which the peer reads from
the cache itself) does not hold the lease open meanwhile; it asks ``holds`` afterwards
whether the lease stayed in force throughout.

It does not own the blocks themselves or tell the engine anything: the producer calls
its ``on_release`` hook with what this table returns.
"""

from __future__ import annotations

import threading
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
    readers: int = 0


class LeaseTable:
    def __init__(self, remembered_expired: int = 4096):
        self._cond = threading.Condition()
        self._leases: dict[str, Lease] = {}
        # Expired ids are remembered (bounded) so that a late pull hears "lease_expired"
        # rather than the less helpful "unknown_request".
        self._expired: OrderedDict[str, None] = OrderedDict()
        self._remembered_expired = remembered_expired

    def __len__(self) -> int:
        with self._cond:
            return len(self._leases)

    def add(
        self, request_id: str, block_ids: Sequence[int], num_tokens: int, deadline: float
    ) -> Lease:
        lease = Lease(request_id, tuple(int(b) for b in block_ids), num_tokens, deadline)
        with self._cond:
            if request_id in self._leases:
                raise ValueError(f"request {request_id!r} is already pinned")
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

    def clear(self) -> None:
        with self._cond:
            self._leases.clear()

    def _remember_expired(self, request_id: str) -> None:
        self._expired[request_id] = None
        while len(self._expired) > self._remembered_expired:
            self._expired.popitem(last=False)
