"""The simulation's clock and event queue.

Owns simulated time (seconds from 0) and the callbacks due at future times, run in time
order (ties in the order they were scheduled, so a run is deterministic). It does not own
what the callbacks do (replicas, the gateway, the workload driver).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Timer:
    """A scheduled callback; ``cancel`` makes it a no-op."""

    at: float
    callback: Callable[[], None]
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        # (time, seq, timer): tuples compare fast, and seq keeps ties in scheduling order.
        self._queue: list[tuple[float, int, Timer]] = []
        self._seq = itertools.count()
        self.events_run = 0

    def at(self, when: float, callback: Callable[[], None]) -> Timer:
        """Run ``callback`` at time ``when`` (not before now)."""
        timer = Timer(max(when, self.now), callback)
        heapq.heappush(self._queue, (timer.at, next(self._seq), timer))
        return timer

    def after(self, delay: float, callback: Callable[[], None]) -> Timer:
        return self.at(self.now + delay, callback)

    def run(self, until: float | None = None) -> None:
        """Run events in order until none is left (or the next is after ``until``)."""
        queue = self._queue
        while queue:
            if until is not None and queue[0][0] > until:
                self.now = until
                return
            _, _, timer = heapq.heappop(queue)
            if timer.cancelled:
                continue
            self.now = timer.at
            self.events_run += 1
            timer.callback()
