"""The process's UCX runtime: one background thread, one asyncio loop, one ucxx worker.

Owns starting ucxx in a way that suits an engine process: off the engine's thread, idle
when idle, confined to the network interface of the replica's KV address, and shareable
by every UCX connector in the process; and the worker's two addresses (full, and network
only) that connections hand to peers. It does not own any connection or protocol
(``ucx_connector``).

Why it is shared and process-wide: ucxx keeps a single process-global context
(``ucxx.core._ctx``) whose request completions are delivered on the one asyncio loop it
was created on. A second loop in the same process would never see its completions, so
producers and consumers of one process all run their coroutines here. This is the one
piece of process-global state in ``kv_transfer``, mirroring the library's own. Its
network interface is fixed when it starts (by the first connector's KV address); a later
connector whose address is on another interface is refused.

ucxx/UCX settings and why (ucxx 0.52 / UCX 1.21 on a CPU-only host, where UCX has tcp,
posix and sysv shared memory, cma and self):
- ``enable_python_future=True``: without it every pending send/recv is awaited by a
  ``while not done: await asyncio.sleep(0)`` loop, which burns a whole core while a
  producer merely waits. With it a notifier thread resolves asyncio futures.
- ``progress_mode="thread"``: UCX progress on its own thread blocking on epoll (the
  "thread-polling" mode spins).
- ``MM_ERROR_HANDLING=y``: endpoints ask for peer-failure error handling (so that a dead
  peer's operations fail and a force-close is safe); UCX's posix and sysv shared-memory
  transports support it only when this is on, and then check a peer's liveness by its
  process id (keepalive). Without it, two processes on one host talk over tcp on loopback.
- ``CMA_MEMORY_INVALIDATE=y``: with error handling on, UCX's zero-copy rendezvous over cma
  (one ``process_vm_readv`` from the sender's memory into the receiver's) is offered only
  by a transport that claims it can revoke a peer's access to a buffer whose send failed;
  cma cannot truly revoke. The connector never relies on revocation: a consumer keeps a
  pull's bytes only after the producer's final status says every send completed (that is,
  the consumer finished reading) while the lease held (``ucx_connector``).
- ``KEEPALIVE_INTERVAL=1s``: how often UCX checks peers of shared-memory endpoints; a
  backstop, since the connector's control connection notices a dead peer at once.
- ``NET_DEVICES=<the KV address's interface>`` (and ``TCP_AF_PRIO=inet6`` for an IPv6
  address): UCX's TCP transport listens on every interface it may use; confined, it
  listens only on the interface of the address the replica binds and advertises.
- ``WARN_UNUSED_ENV_VARS=n``: ucxx exports ``UCX_MEMTYPE_CACHE``, which this UCX build
  no longer knows, and UCX would warn about it in every process.
Environment variables (``UCX_TLS``, ``UCX_NET_DEVICES``, ...) take precedence over these
options: an operator's override. The runtime's thread is a daemon and ucxx's notifier
thread inherits that, so the process exits without an explicit shutdown.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar, TypeVar

from kv_transfer.local_addresses import check_bind_address, interface_of, parse_ip
from kv_transfer.wire import TransportKind

T = TypeVar("T")

UCX_OPTIONS = {
    "WARN_UNUSED_ENV_VARS": "n",
    "MM_ERROR_HANDLING": "y",
    "CMA_MEMORY_INVALIDATE": "y",
    "KEEPALIVE_INTERVAL": "1s",
}
_START_TIMEOUT_S = 60.0


def ucx_options(bind_host: str) -> dict[str, str]:
    """The UCX options of a runtime whose KV address is ``bind_host``."""
    options = dict(UCX_OPTIONS, NET_DEVICES=interface_of(bind_host))
    address = parse_ip(bind_host)
    if address is not None and address.version == 6:
        options["TCP_AF_PRIO"] = "inet6"
    return options


class UcxRuntime:
    _shared: ClassVar[UcxRuntime | None] = None
    _shared_lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def shared(cls, bind_host: str) -> UcxRuntime:
        """The process's runtime, started on first use, confined to ``bind_host``'s interface.

        Raises ValueError when ``bind_host`` may not be bound (``check_bind_address``) or
        lies on another interface than the running runtime's.
        """
        host = check_bind_address(bind_host)
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = cls(ucx_options(host))
            runtime = cls._shared
        interface = interface_of(host)
        if runtime.options["NET_DEVICES"] != interface:
            raise ValueError(
                f"KV address {host} is on interface {interface}, but this process's UCX "
                f"runtime serves {runtime.options['NET_DEVICES']}: one process moves KV over "
                "one interface")
        return runtime

    def __init__(self, options: dict[str, str]) -> None:
        self.options = options
        self._loop = asyncio.new_event_loop()
        # Gathers and scatters run here so the loop keeps serving other transfers
        # meanwhile; numpy and torch release the GIL inside the copy.
        self._copy_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-copy")
        self._addresses: dict[TransportKind, bytes] = {}
        self._connections = 0
        self._services: dict[str, Future[Any]] = {}
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

    async def _init_ucxx(self) -> None:
        # Imported here: loading UCX costs time and sets UCX_* variables, which only
        # processes that transfer KV should pay for. ucxx must be initialised from a
        # coroutine so that its context binds to this (running) loop.
        import ucxx

        from kv_transfer.ucp_introspection import net_only_worker_address

        ucxx.init(
            options=self.options,
            env_takes_precedence=True,
            progress_mode="thread",
            enable_python_future=True,
        )
        self._addresses = {
            "shm": ucxx.get_worker_address().tobytes(),
            "tcp": net_only_worker_address(ucxx.get_ucp_worker()),
        }

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def worker_address(self, kind: TransportKind) -> bytes:
        """This process's UCX worker address: full ("shm": every transport, shared memory
        included), or network transports only ("tcp")."""
        return self._addresses[kind]

    def next_connection_id(self) -> int:
        """A number for a new consumer connection, unique in this process (on the loop)."""
        self._connections += 1
        return self._connections

    def start_service(self, name: str, run: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run ``run()`` on the loop for the runtime's life, once per ``name`` however many
        connectors ask (a service of the process's worker, not of one connector)."""
        with self._shared_lock:
            if name not in self._services:
                self._services[name] = self.submit(run())

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
