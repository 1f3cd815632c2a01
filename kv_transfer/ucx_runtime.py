"""The process's UCX runtime: one background thread, one asyncio loop, one ucxx worker.

Owns starting ucxx in a way that suits an engine process: off the engine's thread, idle
when idle, and shareable by every UCX connector in the process. It does not own any
connection or protocol (``ucx_connector`` does).

Why it is shared and process-wide: ucxx keeps a single process-global context
(``ucxx.core._ctx``) whose request completions are delivered on the one asyncio loop it
was created on. A second loop in the same process would never see its completions, so
producers and consumers of one process all run their coroutines here. This is the one
piece of process-global state in ``kv_transfer``, mirroring the library's own.

ucxx settings and why (verified with ucxx 0.52 / UCX 1.21 on a CPU-only machine, where
UCX picks tcp, sysv, posix, cma and self on its own):
- ``enable_python_future=True``: without it every pending send/recv is awaited by a
  ``while not done: await asyncio.sleep(0)`` loop, which burns a whole core while a
  producer merely waits for the next request. With it a notifier thread resolves asyncio
  futures and an idle runtime costs ~nothing.
- ``progress_mode="thread"``: UCX progress on its own thread blocking on epoll (the
  "thread-polling" mode spins).
- ``TCP_CM_REUSEADDR=y``: a restarted producer can listen on its old port at once even
  while the old connections sit in TIME_WAIT.
- ``WARN_UNUSED_ENV_VARS=n``: ucxx exports ``UCX_MEMTYPE_CACHE``, which this UCX build
  no longer knows, and UCX would warn about it in every process.
Environment variables (``UCX_TLS``, ``UCX_NET_DEVICES``, ``UCX_TCP_CM_REUSEADDR``, ...)
take precedence over these options. The runtime's thread is a daemon and ucxx's
notifier thread inherits that, so the process exits without an explicit shutdown.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar, TypeVar

T = TypeVar("T")

UCX_OPTIONS = {"TCP_CM_REUSEADDR": "y", "WARN_UNUSED_ENV_VARS": "n"}
_START_TIMEOUT_S = 60.0


class UcxRuntime:
    _shared: ClassVar[UcxRuntime | None] = None
    _shared_lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def shared(cls) -> UcxRuntime:
        """The process's runtime, started on first use."""
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        # Gathers and scatters run here so the loop keeps serving other transfers
        # meanwhile; torch releases the GIL inside the copy.
        self._copy_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-copy")
        started: Future[None] = Future()
        self._thread = threading.Thread(
            target=self._run, args=(started,), name="tandem-ucx", daemon=True
        )
        self._thread.start()
        started.result(timeout=_START_TIMEOUT_S)

    def _run(self, started: Future[None]) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._init_ucxx())
        except BaseException as exc:  # surface it to the constructor's caller
            started.set_exception(exc)
            return
        started.set_result(None)
        self._loop.run_forever()

    @staticmethod
    async def _init_ucxx() -> None:
        # Imported here: loading UCX costs time and sets UCX_* variables, which only
        # processes that transfer KV should pay for. ucxx must be initialised from a
        # coroutine so that its context binds to this (running) loop.
        import ucxx

        ucxx.init(
            options=UCX_OPTIONS,
            env_takes_precedence=True,
            progress_mode="thread",
            enable_python_future=True,
        )

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Schedule ``coro`` on the runtime's loop; thread-safe."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the runtime's loop and wait for its result (not from the loop)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("UcxRuntime.call would deadlock on the runtime's own thread")
        return self.submit(coro).result(timeout)

    async def run_copy(self, fn: Callable[[], T]) -> T:
        """Run a blocking tensor copy off the loop; await it from the loop."""
        return await self._loop.run_in_executor(self._copy_pool, fn)
