"""The KV connector over UCX (``ucxx``): serve pinned blocks, pull them into local blocks.

Owns the wire protocol and the connections. It does not own lease bookkeeping
(``leases``), the UCX thread and loop (``ucx_runtime``), or block allocation (the engine).

Protocol (one request at a time per endpoint; every message uses the endpoint's default
tag, so UCX's in-order tag matching keeps them paired; formats in ``wire``):

    consumer -> producer   BlockRequest   (request_id, block ids, consumer's fingerprint)
    producer -> consumer   TransferStatus ("ok" or a failure reason, nbytes,
                                           layers_per_chunk)
    producer -> consumer   payload        after "ok" for n > 0 blocks: the staging buffer
                           [num_layers, 2, n, block_size, heads, head_size], nbytes in
                           all, as consecutive messages of layers_per_chunk layers each

The producer checks the layout fingerprint, that the request holds a live lease and that
the asked blocks are among the pinned ones, answers the status, then gathers the blocks
(``kv_cache[:, :, ids]``) into one contiguous staging buffer and sends it. The consumer
receives into one staging buffer of the same shape and scatters it
(``kv_cache[:, :, local_ids] = staging``). Bytes travel as uint8 views of the cache
dtype, so bfloat16 (which numpy lacks) needs no conversion. Both sides check the
fingerprint: the consumer before connecting (the handle carries the producer's), the
producer on every request (the consumer sends its own).

Why the payload goes in layer chunks rather than one message: the layer is the outermost
dimension of the staging buffer, so a chunk is a contiguous slice of it, and chunking
lets the producer gather chunk i+1 while chunk i is on the wire and the consumer
scatter chunk i while chunk i+1 arrives; with one message, gather, transfer and scatter
run back to back (``bench/kv_transfer_bandwidth.py`` measures both). ``chunk_bytes``
(the producer's choice, announced in the status) bounds a chunk; one at least the
payload's size gives exactly one message. The consumer posts all the payload's receives
as soon as the status arrives, and the producer does not wait for a send to finish
before gathering the next chunk; the status itself goes out before the first gather.

Leases while serving: the deadline is checked when the request arrives; each chunk's
gather holds the lease open (``LeaseTable.reading``), so the engine can end a lease
mid-transfer and waits at most one chunk's memcpy, never the network. A lease that ends
mid-transfer breaks the stream: the producer drops the connection, and the pull fails
("unknown_request" from its retry on a fresh connection, or "unreachable").

Connections: a consumer keeps one endpoint per (host, port) and reuses it; its pulls to
one producer are serialised by a per-endpoint asyncio.Lock (pulls to different producers
run concurrently). A pull's timeout (asyncio.wait_for) covers waiting for that lock,
connecting and the exchange. On a timeout or any transport error the endpoint is closed
and dropped, so the next pull reconnects: that is how a restarted producer on the same
address is picked up. A pull whose reused endpoint turns out dead retries once on a
fresh connection (a pull is a read, so repeating it is harmless). Failures that the
producer answered cleanly (layout mismatch, unknown request, expired lease) keep the
endpoint. Before connecting, a plain TCP connect probes the address so that a dead
producer fails the pull at once as "unreachable" (see ``_probe_tcp``). The producer
serves every connected consumer concurrently, one coroutine per endpoint, each with its
own staging buffer that grows to the largest pull it served.

Copies (gather, scatter; ``block_copy``) of more than ``INLINE_COPY_BYTES`` run on the
runtime's copy threads so that the loop keeps driving other transfers meanwhile; smaller
ones run on the loop, where they cost less than the thread hop would.

Transports: endpoints are created with UCX error handling (peer-failure detection),
which is what lets a dead producer surface as an error rather than a hang. UCX's
shared-memory transports (posix, sysv) do not support it, so on a CPU-only host two
processes talk over tcp (loopback on one machine); on GPU hosts UCX can pick cuda_ipc /
RDMA for CUDA staging buffers.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kv_transfer.block_copy import BlockCopier, StagingBuffer
from kv_transfer.connector import (
    KvConsumer,
    KvHandle,
    KvProducer,
    KvTransferError,
    ReleaseCallback,
    TransferResult,
)
from kv_transfer.layout import KvLayout
from kv_transfer.leases import LeaseTable
from kv_transfer.ucx_runtime import UcxRuntime
from kv_transfer.wire import (
    STATUS_OK,
    BlockRequest,
    TransferStatus,
    as_wire,
    header_buffer,
    layer_chunks,
    layers_per_chunk,
)

DEFAULT_CHUNK_BYTES = 8 * 2**20
# Copies up to this size run on the loop itself: a thread hop costs more than they do.
INLINE_COPY_BYTES = 4 * 2**20
# How long closing an endpoint may wait for UCX to flush it (ns).
_CLOSE_PERIOD_NS = 100_000_000


class _StreamBroken(Exception):
    """A producer cannot finish a payload it announced; the connection must go."""


def _is_transport_error(exc: BaseException) -> bool:
    from ucxx.exceptions import UCXError

    return isinstance(exc, UCXError | ConnectionError | OSError)


async def _probe_tcp(host: str, port: int, timeout: float) -> None:
    """Fail fast (ConnectionRefusedError) when nothing listens at host:port.

    ucxx's connect reports a refused connection only through the endpoint's error
    callback while its handshake keeps waiting for the full connect timeout, so a dead
    producer would cost every pull its whole timeout. A plain TCP connect to UCX's
    listener socket, closed at once, answers in a round trip and is ignored by UCX.
    """
    _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    writer.close()


def _abort(endpoint: Any) -> None:
    try:
        endpoint.abort(period=_CLOSE_PERIOD_NS)
    except Exception:  # closing a dead endpoint may complain; it is gone either way
        pass


async def _copy(runtime: UcxRuntime, nbytes: int, copy: Callable[[], None]) -> None:
    if nbytes <= INLINE_COPY_BYTES:
        copy()
    else:
        await runtime.run_copy(copy)


async def _settle(futures: list[asyncio.Future[Any]]) -> None:
    """Cancel what is still waiting and wait for all of it, errors swallowed."""
    for future in futures:
        future.cancel()  # no-op for finished ones
    await asyncio.gather(*futures, return_exceptions=True)


class UcxKvProducer(KvProducer):
    """Serves pinned blocks of ``kv_cache`` to consumers over UCX.

    ``host`` is the address advertised in handles; the listener accepts on every
    interface. ``port=0`` lets UCX pick a free port (``start`` returns it).
    ``chunk_bytes`` is the payload message size (see the module docstring).
    """

    def __init__(
        self,
        kv_cache: torch.Tensor,
        layout: KvLayout,
        engine_id: str,
        host: str = "127.0.0.1",
        port: int = 0,
        on_release: ReleaseCallback | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ):
        self._copier = BlockCopier(kv_cache, layout)  # checks the cache against the layout
        self._kv_cache = kv_cache
        self._layout = layout
        self._fingerprint = layout.fingerprint()
        self._chunk_bytes = chunk_bytes
        self.engine_id = engine_id
        self.host = host
        self.port = port
        self.on_release = on_release
        self._leases = LeaseTable()
        self._runtime: UcxRuntime | None = None
        # Touched only on the runtime's loop.
        self._listener: Any = None
        self._endpoints: set[Any] = set()

    # -- engine-facing, any thread --------------------------------------------------

    def start(self) -> tuple[str, int]:
        if self._runtime is not None:
            raise RuntimeError("producer already started")
        self._runtime = UcxRuntime.shared()
        self.port = self._runtime.call(self._listen(), timeout=30)
        return self.host, self.port

    def pin(
        self,
        request_id: str,
        block_ids: Sequence[int],
        num_tokens: int,
        lease_seconds: float,
    ) -> KvHandle:
        if self._runtime is None:
            raise RuntimeError("start() the producer before pinning")
        num_blocks = self._kv_cache.shape[2]
        ids = [int(b) for b in block_ids]
        if any(not 0 <= b < num_blocks for b in ids) or len(set(ids)) != len(ids):
            raise ValueError(f"block ids must be distinct and in [0, {num_blocks}): {ids}")
        deadline = time.time() + lease_seconds
        self._leases.add(request_id, ids, num_tokens, deadline)
        return KvHandle(
            engine_id=self.engine_id,
            host=self.host,
            port=self.port,
            request_id=request_id,
            block_ids=tuple(ids),
            num_tokens=num_tokens,
            lease_deadline=deadline,
            layout_fingerprint=self._fingerprint,
        )

    def release(self, request_id: str) -> list[int]:
        block_ids = self._leases.remove(request_id)
        if block_ids is None:
            return []
        if self.on_release is not None:
            self.on_release(request_id, block_ids)
        return block_ids

    def expire_leases(self, now: float) -> list[tuple[str, list[int]]]:
        expired = self._leases.remove_expired(now)
        if self.on_release is not None:
            for request_id, block_ids in expired:
                self.on_release(request_id, block_ids)
        return expired

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    def close(self) -> None:
        if self._runtime is not None:
            self._runtime.call(self._shutdown(), timeout=30)
            self._runtime = None
        self._leases.clear()

    # -- the runtime's loop -----------------------------------------------------------

    async def _listen(self) -> int:
        import ucxx

        self._listener = ucxx.create_listener(self._serve_endpoint, port=self.port)
        return int(self._listener.port)

    async def _shutdown(self) -> None:
        for endpoint in list(self._endpoints):
            _abort(endpoint)
        self._endpoints.clear()
        if self._listener is not None:
            # Let the aborted endpoints' handlers unwind before the listener goes, or
            # ucxx warns that it is destroyed under live handlers.
            deadline = time.monotonic() + 1.0
            while self._listener.active_clients and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            self._listener.close()
            self._listener = None

    async def _serve_endpoint(self, endpoint: Any) -> None:
        self._endpoints.add(endpoint)
        header = header_buffer()
        staging = StagingBuffer(self._kv_cache)
        try:
            while endpoint in self._endpoints:
                await endpoint.recv(header)
                await self._serve_request(endpoint, header, staging)
        except _StreamBroken:
            pass
        except Exception as exc:
            if not _is_transport_error(exc):  # else: the consumer went away
                raise
        finally:
            self._endpoints.discard(endpoint)
            _abort(endpoint)

    async def _serve_request(
        self, endpoint: Any, header: np.ndarray, staging: StagingBuffer
    ) -> None:
        try:
            request = self._admit(BlockRequest.decode(header))
        except KvTransferError as failure:
            await endpoint.send(TransferStatus(failure.reason, detail=failure.detail).encode())
            return
        num_layers = self._layout.num_layers
        nbytes = len(request.block_ids) * self._layout.bytes_per_block
        per_chunk = layers_per_chunk(num_layers, nbytes, self._chunk_bytes)
        status = TransferStatus(STATUS_OK, nbytes, per_chunk).encode()
        # Sends are awaited together at the end: tag sends arrive in order, so the
        # status's trip and each chunk's trip overlap the gather of the next chunk.
        sends = [asyncio.ensure_future(endpoint.send(status))]
        try:
            if request.block_ids:
                out = staging.blocks(len(request.block_ids))
                for start, stop in layer_chunks(num_layers, per_chunk):
                    await self._gather(request, out, start, stop)
                    sends.append(asyncio.ensure_future(endpoint.send(as_wire(out[start:stop]))))
            await asyncio.gather(*sends)
        except KvTransferError as failure:  # the lease ended mid-transfer
            raise _StreamBroken(failure.detail) from None
        finally:
            await _settle(sends)

    def _admit(self, request: BlockRequest) -> BlockRequest:
        """Raise the KvTransferError to answer, or return the request to serve."""
        if request.fingerprint != self._fingerprint:
            raise KvTransferError(
                "layout_mismatch",
                f"consumer layout {request.fingerprint}, producer {self._fingerprint}",
            )
        with self._leases.reading(request.request_id, request.block_ids, time.time()):
            pass  # pinned, unexpired, and the asked blocks are among the pinned ones
        return request

    async def _gather(
        self, request: BlockRequest, out: torch.Tensor, start: int, stop: int
    ) -> None:
        """Copy layers [start, stop) of the asked blocks into ``out``."""

        def gather() -> None:
            # Each chunk holds the lease on its own: ending a lease mid-transfer waits
            # for one chunk's copy at most (see the module docstring).
            with self._leases.reading(request.request_id, request.block_ids, now=None):
                self._copier.gather(request.block_ids, out, start, stop)

        assert self._runtime is not None
        await _copy(self._runtime, out[start:stop].nbytes, gather)


@dataclass
class _Peer:
    """One producer as a consumer sees it: a reusable endpoint and its buffers."""

    staging: StagingBuffer
    header: np.ndarray = field(default_factory=header_buffer)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    endpoint: Any = None


class UcxKvConsumer(KvConsumer):
    """Pulls blocks from UCX producers into ``kv_cache``."""

    def __init__(self, kv_cache: torch.Tensor, layout: KvLayout, connect_timeout: float = 5.0):
        self._copier = BlockCopier(kv_cache, layout)  # checks the cache against the layout
        self._kv_cache = kv_cache
        self._layout = layout
        self._fingerprint = layout.fingerprint()
        self._connect_timeout = connect_timeout
        self._runtime = UcxRuntime.shared()
        self._closed = threading.Event()
        # Touched only on the runtime's loop.
        self._peers: dict[tuple[str, int], _Peer] = {}

    # -- engine-facing, any thread --------------------------------------------------

    def pull(
        self,
        handle: KvHandle,
        remote_block_ids: Sequence[int],
        local_block_ids: Sequence[int],
        timeout: float,
    ) -> Future[TransferResult]:
        if self._closed.is_set():
            raise RuntimeError("consumer is closed")
        remote = [int(b) for b in remote_block_ids]
        local = [int(b) for b in local_block_ids]
        if len(remote) != len(local):
            raise ValueError(f"{len(remote)} remote blocks for {len(local)} local blocks")
        num_blocks = self._kv_cache.shape[2]
        if any(not 0 <= b < num_blocks for b in local) or len(set(local)) != len(local):
            raise ValueError(f"local block ids must be distinct and in [0, {num_blocks})")
        request = BlockRequest(handle.request_id, remote, self._fingerprint).encode()
        if handle.layout_fingerprint != self._fingerprint:
            failed: Future[TransferResult] = Future()
            failed.set_exception(
                KvTransferError(
                    "layout_mismatch",
                    f"producer layout {handle.layout_fingerprint}, ours {self._fingerprint}",
                )
            )
            return failed
        return self._runtime.submit(self._pull(handle, request, local, timeout))

    def close(self) -> None:
        if not self._closed.is_set():
            self._closed.set()
            self._runtime.call(self._drop_all(), timeout=30)

    # -- the runtime's loop -----------------------------------------------------------

    async def _pull(
        self, handle: KvHandle, request: np.ndarray, local: list[int], timeout: float
    ) -> TransferResult:
        started = time.perf_counter()
        try:
            num_bytes = await asyncio.wait_for(
                self._pull_from_peer(handle, request, local), timeout
            )
        except TimeoutError:
            raise KvTransferError(
                "timeout", f"pull from {handle.host}:{handle.port} exceeded {timeout}s"
            ) from None
        return TransferResult(len(local), num_bytes, time.perf_counter() - started)

    async def _pull_from_peer(self, handle: KvHandle, request: np.ndarray, local: list[int]) -> int:
        key = (handle.host, handle.port)
        peer = self._peers.get(key)
        if peer is None:
            peer = self._peers[key] = _Peer(StagingBuffer(self._kv_cache))
        async with peer.lock:
            if peer.endpoint is not None and peer.endpoint.closed:
                self._drop(peer)  # its error callback already fired
            for attempt in range(2):
                reused = peer.endpoint is not None
                if peer.endpoint is None:
                    peer.endpoint = await self._connect(handle.host, handle.port)
                try:
                    return await self._exchange(peer, request, local)
                except KvTransferError as failure:
                    if failure.reason == "protocol":
                        self._drop(peer)  # the stream may be out of step
                    raise
                except BaseException as exc:  # also CancelledError, from the timeout
                    self._drop(peer)
                    if not _is_transport_error(exc):
                        raise
                    if not (reused and attempt == 0):
                        raise KvTransferError(
                            "unreachable", f"{handle.host}:{handle.port}: {exc!r}"
                        ) from None
        raise AssertionError("unreachable code")

    async def _connect(self, host: str, port: int) -> Any:
        import ucxx

        try:
            await _probe_tcp(host, port, self._connect_timeout)
            return await ucxx.create_endpoint(host, port, connect_timeout=self._connect_timeout)
        except Exception as exc:
            if isinstance(exc, TimeoutError) or _is_transport_error(exc):
                raise KvTransferError("unreachable", f"{host}:{port}: {exc!r}") from None
            raise

    async def _exchange(self, peer: _Peer, request: np.ndarray, local: list[int]) -> int:
        """One request on the peer's endpoint; any exception but a clean refusal leaves
        receives posted, which only dropping the endpoint cancels."""
        endpoint = peer.endpoint
        # The status receive is posted before the request leaves, so it is waiting
        # when the answer comes.
        status_arrived = asyncio.ensure_future(endpoint.recv(peer.header))
        try:
            await endpoint.send(request)
            await status_arrived
        finally:
            await _settle([status_arrived])
        status = TransferStatus.decode(peer.header)
        status.raise_for_failure()
        nbytes = len(local) * self._layout.bytes_per_block
        if status.nbytes != nbytes or status.layers_per_chunk < 1:
            raise KvTransferError(
                "protocol",
                f"producer offers {status.nbytes} bytes in chunks of "
                f"{status.layers_per_chunk} layers; expected {nbytes} bytes",
            )
        if local:
            await self._receive_blocks(peer, local, status.layers_per_chunk)
        return nbytes

    async def _receive_blocks(self, peer: _Peer, local: list[int], per_chunk: int) -> None:
        """Scatter chunk i while chunk i+1 arrives."""
        staging = peer.staging.blocks(len(local))
        chunks = layer_chunks(self._layout.num_layers, per_chunk)
        # Tasks start in creation order, and each posts its receive before its first
        # await, so the receives are posted in chunk order, which tag matching keeps.
        receives = [
            asyncio.ensure_future(peer.endpoint.recv(as_wire(staging[start:stop])))
            for start, stop in chunks
        ]
        scatters: list[asyncio.Future[None]] = []
        try:
            for (start, stop), receive in zip(chunks, receives, strict=True):
                await receive
                scatter = functools.partial(self._copier.scatter, staging, local, start, stop)
                copy = _copy(self._runtime, staging[start:stop].nbytes, scatter)
                scatters.append(asyncio.ensure_future(copy))

            await asyncio.gather(*scatters)
        finally:
            await _settle(receives)
            # A running copy cannot be cancelled, so scatters are waited for, not
            # cancelled: no write into the local blocks may outlive the pull, whose
            # failure lets the engine reuse them.
            await asyncio.gather(*scatters, return_exceptions=True)

    def _drop(self, peer: _Peer) -> None:
        if peer.endpoint is not None:
            _abort(peer.endpoint)
            peer.endpoint = None

    async def _drop_all(self) -> None:
        for peer in self._peers.values():
            self._drop(peer)
        self._peers.clear()
