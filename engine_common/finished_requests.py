"""The statistics of the requests an engine finished last, by request id, for a while.

Owns a bounded map from request id to its ``FinishedRequestStats`` (queue, prefill, decode
times), filled as requests finish (``EngineMetrics.record_finished``) and read once by whoever
reports on the request afterwards: the replica's tracing turns a request's engine phases
(its wait in the queue, its prefill) into spans, which only the engine's own clocks know. The
oldest entries go first once ``capacity`` are held, so requests nobody asks about cost
nothing lasting. It does not own the metrics.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # metrics holds one of these
    from engine_common.metrics import FinishedRequestStats

DEFAULT_CAPACITY = 4096


class FinishedRequests:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._stats: OrderedDict[str, FinishedRequestStats] = OrderedDict()

    def add(self, stats: FinishedRequestStats) -> None:
        if not stats.request_id:
            return
        self._stats[stats.request_id] = stats
        self._stats.move_to_end(stats.request_id)
        while len(self._stats) > self.capacity:
            self._stats.popitem(last=False)

    def pop(self, request_id: str) -> FinishedRequestStats | None:
        """The request's statistics, forgotten once read (None: unknown or long gone)."""
        return self._stats.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._stats)
