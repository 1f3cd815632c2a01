"""The thread that stores blocks into the tiers and loads them back, off the step's path.

Owns the queues and the thread. Loads go before stores (a request waits on a load; nobody
waits on a store). The store queue is bounded: when it is full a new store is dropped and
``submit_store`` says so (back-pressure: a saturated tier costs hit rate, never a step).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

logger = logging.getLogger(__name__)

Job = Callable[[], None]


class TierWorker:
    def __init__(self, max_pending_stores: int, name: str = "kv-tiers") -> None:
        self.max_pending_stores = max_pending_stores
        self._loads: deque[Job] = deque()
        self._stores: deque[Job] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._busy = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit_load(self, job: Job) -> None:
        with self._cond:
            self._loads.append(job)
            self._cond.notify()

    def submit_store(self, job: Job) -> bool:
        """Queue a store; False (dropped) when ``max_pending_stores`` are already queued."""
        with self._cond:
            if len(self._stores) >= self.max_pending_stores:
                return False
            self._stores.append(job)
            self._cond.notify()
            return True

    def idle(self) -> bool:
        with self._cond:
            return not self._busy and not self._loads and not self._stores

    def drain(self, timeout: float = 30.0) -> bool:
        """Wait until every queued job has run (tests, shutdown); False on timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not self._busy and not self._loads and not self._stores, timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._loads or self._stores)
                if self._closed and not self._loads and not self._stores:
                    return
                job = self._loads.popleft() if self._loads else self._stores.popleft()
                self._busy = True
            try:
                job()
            except Exception:  # noqa: BLE001 - a tier bug must not kill the thread
                logger.exception("KV tier job failed")
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def close(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
