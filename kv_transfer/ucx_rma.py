"""One-sided reads over UCX (RMA GET), which ``ucxx`` 0.52 does not expose: mapping memory,
packing and unpacking its remote key, and reading runs of a peer's mapped memory.

Owns the ctypes binding of ``ucp_mem_map``/``ucp_mem_unmap``, ``ucp_rkey_pack``,
``ucp_ep_rkey_unpack``/``ucp_rkey_destroy`` and ``ucp_get_nbx`` of the libucp that ``ucxx``
loaded, and waiting for a burst of GETs to land. It does not own when a read
is allowed or whether its bytes may be kept (``ucx_producer``, ``ucx_consumer``).

Why: a tagged message costs each side a match and the receiver a round trip to the
sender (rendezvous) per message, and a direct pull is one message per (layer, K/V) run; a
GET is the consumer's alone (over cma one ``process_vm_readv`` from the producer's
memory, nothing for the producer to do), so the producer's work per pull shrinks to
checking its lease. On shared memory UCX reads the peer's memory by itself (cma); over
TCP it emulates a GET with active messages, which still spares the producer's Python a
send per run (version 4 reads there too, once the endpoint is wired up:
``ucx_consumer._until_wired``).

Threading: ucxx's worker runs in UCS_THREAD_MODE_MULTI (``worker_thread_mode`` says so),
so GETs are posted from the runtime's loop. A small burst is progressed right there
(``ReadBurst.wait``: one ``ucp_worker_progress`` performs up to a cma segment, 512 KiB);
a larger one is left to ucxx's own progress thread, woken with ``wake_worker`` (it sleeps
in epoll, and posting a GET writes nothing it watches; once awake it keeps progressing
while cma work is queued, as UCX refuses to arm a worker with copies pending), and the
waiter is told by ``ReadBurst.when_over``. Why not progress a large burst from Python as
well: ucxx's thread then wakes and progresses the same worker too, the two threads take
turns on the worker's lock for each 512 KiB segment and the burst costs twice the CPU time
of a tagged rendezvous of the same bytes (measured by ``bench/kv_get_probe.py``, issue 34:
on a loaded 2-core host that was the connector's 0.3-0.5x of raw UCX on shared memory).
A GET's completion callback runs on whichever thread progressed it and only counts.
NOTE: on ucxx's thread that callback takes the GIL while UCX holds the worker's lock, the
pairing ucxx's docs warn can deadlock against a thread that holds the GIL and waits for that
lock. No thread here does: ctypes releases the GIL around every ``ucp_*`` call, and ucxx's
Cython wrappers (0.52) make their UCX calls under ``nogil``. A call added here that reaches
UCX with the GIL held (a ``PyDLL`` function, a C extension that keeps it) would reopen it.

Struct layouts are those of UCX 1.21's ``ucp.h``; every struct starts with a
``field_mask``, and only fields present since UCX 1.10 are set.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

_MEM_MAP_FIELD_ADDRESS, _MEM_MAP_FIELD_LENGTH, _MEM_MAP_FIELD_PROT = 1 << 0, 1 << 1, 1 << 3
_PROT_LOCAL_READ, _PROT_REMOTE_READ = 1 << 0, 1 << 8
_OP_ATTR_FIELD_CALLBACK, _OP_ATTR_FIELD_USER_DATA = 1 << 1, 1 << 2
_WORKER_ATTR_FIELD_THREAD_MODE = 1 << 0
UCS_THREAD_MODE_MULTI = 2
_UCS_OK = 0
_UCS_ERR_LAST = -100  # status pointers in (-100, 0) are errors (UCS_PTR_IS_ERR)


class _MemMapParams(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("address", ctypes.c_void_p),
        ("length", ctypes.c_size_t),
        ("flags", ctypes.c_uint),
        ("prot", ctypes.c_uint),
        ("memory_type", ctypes.c_int),
        ("exported_memh_buffer", ctypes.c_void_p),
    ]


_SendCallback = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p)


class _RequestParam(ctypes.Structure):
    _fields_ = [
        ("op_attr_mask", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("request", ctypes.c_void_p),
        ("cb", _SendCallback),  # a union of callbacks: all pointer-sized
        ("datatype", ctypes.c_uint64),
        ("user_data", ctypes.c_void_p),
        ("reply_buffer", ctypes.c_void_p),
        ("memory_type", ctypes.c_int),
        ("recv_info", ctypes.c_void_p),
        ("memh", ctypes.c_void_p),
    ]


class _WorkerAttrThreadMode(ctypes.Structure):
    _fields_ = [("field_mask", ctypes.c_uint64), ("thread_mode", ctypes.c_int),
                ("_rest", ctypes.c_ubyte * 128)]


@functools.cache
def _libucp() -> ctypes.CDLL:
    # The same file ucxx loaded (libucx's wheel): dlopen returns the loaded library.
    import libucx

    lib = ctypes.CDLL(os.path.join(os.path.dirname(libucx.__file__), "lib", "libucp.so.0"))
    vp, pvp = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
    signatures: dict[str, tuple[list[Any], Any]] = {
        "ucp_mem_map": ([vp, ctypes.POINTER(_MemMapParams), pvp], ctypes.c_int),
        "ucp_mem_unmap": ([vp, vp], ctypes.c_int),
        "ucp_rkey_pack": ([vp, vp, pvp, ctypes.POINTER(ctypes.c_size_t)], ctypes.c_int),
        "ucp_rkey_buffer_release": ([vp], None),
        "ucp_ep_rkey_unpack": ([vp, vp, pvp], ctypes.c_int),
        "ucp_rkey_destroy": ([vp], None),
        "ucp_get_nbx": ([vp, vp, ctypes.c_size_t, ctypes.c_uint64, vp,
                         ctypes.POINTER(_RequestParam)], ctypes.c_ssize_t),
        "ucp_request_free": ([vp], None),
        "ucp_worker_progress": ([vp], ctypes.c_uint),
        "ucp_worker_query": ([vp, ctypes.POINTER(_WorkerAttrThreadMode)], ctypes.c_int),
        "ucp_worker_signal": ([vp], ctypes.c_int),
    }
    for name, (argtypes, restype) in signatures.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype
    return lib


class RmaError(OSError):
    """A UCX call of this module failed; ``status`` is the UCS status (negative)."""

    def __init__(self, what: str, status: int):
        super().__init__(f"{what} failed with UCS status {status}")
        self.status = status


def _check(status: int, what: str) -> None:
    if status != _UCS_OK:
        raise RmaError(what, status)


def worker_thread_mode(worker_handle: int) -> int:
    attr = _WorkerAttrThreadMode(field_mask=_WORKER_ATTR_FIELD_THREAD_MODE)
    _check(_libucp().ucp_worker_query(worker_handle, ctypes.byref(attr)), "ucp_worker_query")
    return int(attr.thread_mode)


def wake_worker(worker_handle: int) -> None:
    """Wake the thread blocked waiting for the worker's events (ucxx's progress thread), so
    that it progresses what was just posted (any thread)."""
    _check(_libucp().ucp_worker_signal(worker_handle), "ucp_worker_signal")


class MappedMemory:
    """``[address, address + length)`` mapped for remote reads; ``rkey`` is its packed key."""

    def __init__(self, context_handle: int, address: int, length: int):
        lib = _libucp()
        params = _MemMapParams(
            field_mask=_MEM_MAP_FIELD_ADDRESS | _MEM_MAP_FIELD_LENGTH | _MEM_MAP_FIELD_PROT,
            address=address, length=length, prot=_PROT_LOCAL_READ | _PROT_REMOTE_READ)
        memh = ctypes.c_void_p()
        _check(lib.ucp_mem_map(context_handle, ctypes.byref(params), ctypes.byref(memh)),
               "ucp_mem_map")
        self._context, self._memh = context_handle, memh
        buffer, size = ctypes.c_void_p(), ctypes.c_size_t()
        try:
            _check(lib.ucp_rkey_pack(context_handle, memh, ctypes.byref(buffer),
                                     ctypes.byref(size)), "ucp_rkey_pack")
        except RmaError:
            lib.ucp_mem_unmap(context_handle, memh)
            raise
        try:
            self.rkey = ctypes.string_at(buffer, size.value)
        finally:
            lib.ucp_rkey_buffer_release(buffer)
        self.address, self.length = address, length

    def close(self) -> None:
        if self._memh:
            _libucp().ucp_mem_unmap(self._context, self._memh)
            self._memh = ctypes.c_void_p()


class RemoteKey:
    """A peer's packed rkey unpacked on one endpoint (destroy before forgetting it)."""

    def __init__(self, endpoint_handle: int, packed: bytes):
        rkey = ctypes.c_void_p()
        _check(_libucp().ucp_ep_rkey_unpack(endpoint_handle, packed, ctypes.byref(rkey)),
               "ucp_ep_rkey_unpack")
        self.handle = rkey

    def destroy(self) -> None:
        if self.handle:
            _libucp().ucp_rkey_destroy(self.handle)
            self.handle = ctypes.c_void_p()


class ReadBurst:
    """GETs posted together; over when every one landed or failed (``wait``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._outstanding = 0
        self._posted = False
        self.error = _UCS_OK
        self._over = threading.Event()
        self._when_over: list[Callable[[], None]] = []

    def _add(self) -> None:
        with self._lock:
            self._outstanding += 1

    def completed(self, status: int) -> None:
        """One GET is over (any thread)."""
        with self._lock:
            self._outstanding -= 1
            if status != _UCS_OK and self.error == _UCS_OK:
                self.error = status
            over = self._posted and self._outstanding == 0
        if over:
            self._set_over()

    def _all_posted(self) -> None:
        with self._lock:
            self._posted = True
            over = self._outstanding == 0
        if over:
            self._set_over()

    def _set_over(self) -> None:
        with self._lock:
            self._over.set()
            callbacks, self._when_over = self._when_over, []
        for callback in callbacks:
            callback()

    def when_over(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once every GET is over: at once if they are, else on the thread
        that completes the last one (keep it short and thread-safe)."""
        with self._lock:
            if not self._over.is_set():
                self._when_over.append(callback)
                return
        callback()

    @property
    def over(self) -> bool:
        return self._over.is_set()

    def wait(self, worker_handle: int, timeout: float) -> bool:
        """Progress the worker on this thread until every GET is over (True), or
        ``timeout`` seconds passed (False): for small bursts (see the module docstring),
        which one or two calls finish without a hop to another thread."""
        lib = _libucp()
        deadline = time.monotonic() + timeout
        while not self._over.is_set():
            if not lib.ucp_worker_progress(worker_handle) and time.monotonic() > deadline:
                return False
        return True

    def raise_for_failure(self) -> None:
        if self.error != _UCS_OK:
            raise RmaError("ucp_get_nbx", self.error)


def coalesce_reads(reads: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """(local address, nbytes, remote address) reads, each merged with the next while both
    its local and its remote bytes continue where the previous one's end: the fewest GETs
    that move the same bytes (``ucp_get_nbx`` takes one contiguous stretch per call: UCX's
    RMA has no iov datatype). In the order given; a direct plan lists them by address."""
    merged: list[tuple[int, int, int]] = []
    for local, nbytes, remote in reads:
        if merged:
            last_local, last_bytes, last_remote = merged[-1]
            if local == last_local + last_bytes and remote == last_remote + last_bytes:
                merged[-1] = (last_local, last_bytes + nbytes, last_remote)
                continue
        merged.append((local, nbytes, remote))
    return merged


class Reader:
    """Posts bursts of GETs. One per consumer: it holds the C callback every GET names."""

    def __init__(self) -> None:
        self._bursts: dict[int, ReadBurst] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._callback = _SendCallback(self._completed)

    def _completed(self, request: int | None, status: int, user_data: int | None) -> None:
        """On whichever thread progressed the worker: a GET that did not end at once."""
        _libucp().ucp_request_free(request)
        with self._lock:
            burst = self._bursts.get(user_data or 0)
        if burst is not None:
            burst.completed(status)

    def get(self, endpoint_handle: int, rkey: RemoteKey,
            reads: Sequence[tuple[int, int, int]]) -> ReadBurst:
        """Post a GET of each (local address, nbytes, remote address). Call from the
        thread that may close the endpoint (the runtime's loop), so that the endpoint is
        alive while GETs are posted; keep the local memory alive until the burst is over
        (``wait``; closing the endpoint cancels what is in flight)."""
        burst = ReadBurst()
        burst_id = next(self._ids)
        with self._lock:
            self._bursts[burst_id] = burst
        param = _RequestParam(op_attr_mask=_OP_ATTR_FIELD_CALLBACK | _OP_ATTR_FIELD_USER_DATA,
                              cb=self._callback, user_data=burst_id)
        lib = _libucp()
        for local, nbytes, remote in reads:
            burst._add()
            result = lib.ucp_get_nbx(endpoint_handle, local, nbytes, remote, rkey.handle,
                                     ctypes.byref(param))
            if not result:  # completed at once
                burst.completed(_UCS_OK)
            elif _UCS_ERR_LAST < result < 0:
                burst.completed(result)
                break  # the endpoint failed: the rest would fail alike
        burst._all_posted()
        return burst

    def forget(self, burst: ReadBurst) -> None:
        """Drop a burst that is over."""
        with self._lock:
            for burst_id, known in list(self._bursts.items()):
                if known is burst:
                    del self._bursts[burst_id]
