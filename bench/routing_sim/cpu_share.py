"""Replicas sharing fewer CPU cores than there are replicas: processor sharing of steps.

Owns the progress of every engine step in flight when ``cores`` cores serve all replicas
(the real 3-replica benchmark runs three one-thread replicas on a 2-core machine): while
``n`` steps run, each advances at ``min(1, cores / n)`` of its one-core speed. It does not
own how long a step takes on a core of its own (``cost_model``). A cluster where every
replica has its own cores (the scale runs) uses no ``CpuShare``: steps take their time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from bench.routing_sim.events import EventLoop, Timer


@dataclass
class _Job:
    remaining_s: float  # one-core seconds of work left
    done: Callable[[], None]


class CpuShare:
    def __init__(self, loop: EventLoop, cores: float) -> None:
        if cores <= 0:
            raise ValueError(f"cores must be positive, got {cores}")
        self.loop = loop
        self.cores = cores
        self._jobs: list[_Job] = []
        self._last = 0.0
        self._next: Timer | None = None

    def run(self, work_s: float, done: Callable[[], None]) -> None:
        """Run ``work_s`` one-core seconds of work; call ``done`` when it is finished."""
        self._advance()
        self._jobs.append(_Job(work_s, done))
        self._reschedule()

    def _rate(self) -> float:
        return min(1.0, self.cores / len(self._jobs)) if self._jobs else 1.0

    def _advance(self) -> None:
        elapsed = self.loop.now - self._last
        self._last = self.loop.now
        if elapsed > 0 and self._jobs:
            rate = self._rate()
            for job in self._jobs:
                job.remaining_s -= elapsed * rate

    def _reschedule(self) -> None:
        if self._next is not None:
            self._next.cancel()
            self._next = None
        if self._jobs:
            first = min(job.remaining_s for job in self._jobs)
            self._next = self.loop.after(max(first, 0.0) / self._rate(), self._finish)

    def _finish(self) -> None:
        self._next = None
        self._advance()
        finished = [job for job in self._jobs if job.remaining_s <= 1e-9]
        self._jobs = [job for job in self._jobs if job.remaining_s > 1e-9]
        self._reschedule()
        for job in finished:
            job.done()
