"""Admission control: a bounded number of requests in the engine, and draining.

Owns the count of admitted, unfinished requests and the two reasons to turn one away: the
engine can run ``max_num_seqs`` at once and keep ``max_waiting`` more queued, beyond which a
request is answered RESOURCE_EXHAUSTED at once rather than queued without bound (callers and
the gateway retry elsewhere); and a draining replica takes no new work (UNAVAILABLE). It does
not own scheduling inside the engine: queued requests wait in the engine's own scheduler.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

from services.frontend.errors import AlreadyExists, Overloaded, Unavailable


class Admission:
    def __init__(self, max_num_seqs: int, max_waiting: int) -> None:
        if max_num_seqs < 1 or max_waiting < 0:
            raise ValueError("max_num_seqs must be at least 1 and max_waiting non-negative")
        self.max_num_seqs = max_num_seqs
        self.max_waiting = max_waiting
        self._active: set[str] = set()
        self._draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def capacity(self) -> int:
        return self.max_num_seqs + self.max_waiting

    @property
    def draining(self) -> bool:
        return self._draining

    def is_active(self, request_id: str) -> bool:
        return request_id in self._active

    @contextmanager
    def admit(self, request_id: str) -> Iterator[None]:
        """Hold a slot for ``request_id`` while the body runs, or raise at once."""
        if self._draining:
            raise Unavailable("this replica is shutting down; send the request to another one")
        if request_id in self._active:
            raise AlreadyExists(f"request id {request_id!r} is already running on this replica")
        if len(self._active) >= self.capacity:
            raise Overloaded(
                f"this replica's queue is full ({self.max_num_seqs} running and "
                f"{self.max_waiting} waiting at most); retry later or on another replica")
        self._active.add(request_id)
        self._idle.clear()
        try:
            yield
        finally:
            self._active.discard(request_id)
            if not self._active:
                self._idle.set()

    def start_draining(self) -> None:
        self._draining = True

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no admitted request is left; False if ``timeout`` ran out first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True
