"""The KV connector over UCX (``ucxx``): serve pinned blocks, pull them into local blocks.

Owns the wire protocol and the connections. It does not own leases' bookkeeping
(``leases``), the UCX thread and loop (``ucx_runtime``), or block allocation (the engine).

Protocol (one request at a time per endpoint; all messages use the endpoint's default
tag, so UCX's in-order tag matching keeps them paired):

    consumer -> producer   request  : object message (8-byte length, then UTF-8 JSON)
                           {"v": 1, "request_id": str, "block_ids": [int],
                            "fingerprint": str}
    producer -> consumer   status   : object message
                           {"v": 1, "status": "ok" | <failure reason>, "nbytes": int,
                            "detail": str}
    producer -> consumer   payload  : one message of exactly ``nbytes`` bytes, only after
                           an "ok" status and only when ``nbytes`` > 0

The producer checks the layout fingerprint, that the request holds a live lease and that
the asked blocks are among the pinned ones; it then gathers the blocks into one
contiguous staging buffer (``kv_cache[:, :, ids]``, i.e. ``[num_layers, 2, n,
block_size, num_kv_heads, head_size]``), answers "ok" and sends the buffer as one
message. The consumer receives into its own staging buffer of that shape and scatters it
(``kv_cache[:, :, local_ids] = staging``). Bytes travel as uint8 views of the cache
dtype, so bfloat16 (which numpy lacks) needs no conversion. Both sides check the
fingerprint: the consumer before connecting (the handle carries the producer's), the
producer on every request (the consumer sends its own).

Connections: a consumer keeps one endpoint per (host, port) and reuses it; its pulls to
one producer are serialised by a per-endpoint asyncio.Lock (pulls to different producers
run concurrently). A pull's timeout (asyncio.wait_for) covers waiting for that lock,
connecting and the exchange. On a timeout or any transport error the endpoint is closed
and dropped, so the next pull reconnects: that is how a restarted producer on the same
address is picked up. A pull whose reused endpoint turns out dead retries once on a
fresh connection (a pull is a read, so repeating it is harmless). Failures that the
producer answered cleanly (layout mismatch, unknown request, expired lease) keep the
endpoint. The producer serves every connected consumer concurrently, one coroutine per
endpoint, each with its own staging buffer that grows to the largest pull it served.

Copies (gather, scatter) run on the runtime's copy threads, not on the loop, so that one
transfer's memcpy does not stall the others' network progress. On CUDA caches they run on
a side stream and are synchronised before any byte is sent or a pull reports success.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from kv_transfer.connector import (
    TRANSFER_FAILURES,
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

PROTOCOL_VERSION = 1
_STATUS_OK = "ok"
# How long closing an endpoint may wait for UCX to flush it (ns).
_CLOSE_PERIOD_NS = 100_000_000


class _Staging:
    """A reusable contiguous buffer for n blocks, on the cache's device."""

    def __init__(self, kv_cache: torch.Tensor, layout: KvLayout):
        self._device = kv_cache.device
        self._dtype = kv_cache.dtype
        num_layers, _, _, block_size, num_kv_heads, head_size = kv_cache.shape
        self._block_shape = (block_size, num_kv_heads, head_size)
        self._num_layers = num_layers
        self._bytes_per_block = layout.bytes_per_block
        self._flat = torch.empty(0, dtype=torch.uint8, device=self._device)

    def blocks(self, num_blocks: int) -> torch.Tensor:
        """A [num_layers, 2, num_blocks, block_size, heads, head_size] view of the buffer."""
        nbytes = num_blocks * self._bytes_per_block
        if self._flat.numel() < nbytes:
            self._flat = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        return (
            self._flat[:nbytes]
            .view(self._dtype)
            .view(self._num_layers, 2, num_blocks, *self._block_shape)
        )

    def wire(self, nbytes: int) -> Any:
        """The first ``nbytes`` as an object ucxx can send from or receive into."""
        data = self._flat[:nbytes]
        # numpy for host memory (buffer protocol); CUDA tensors expose
        # __cuda_array_interface__, which ucxx reads directly.
        return data if data.is_cuda else data.numpy()


def _copy_stream(kv_cache: torch.Tensor) -> torch.cuda.Stream | None:
    return torch.cuda.Stream(device=kv_cache.device) if kv_cache.is_cuda else None


def _encode(message: dict[str, Any]) -> bytes:
    return json.dumps({"v": PROTOCOL_VERSION, **message}, separators=(",", ":")).encode()


def _decode(raw: bytes | bytearray, what: str) -> dict[str, Any]:
    try:
        message = json.loads(bytes(raw))
    except ValueError as exc:
        raise KvTransferError("protocol", f"{what} is not JSON: {exc}") from None
    if not isinstance(message, dict) or message.get("v") != PROTOCOL_VERSION:
        raise KvTransferError("protocol", f"{what} has an unknown version or shape")
    return message


@dataclass(frozen=True)
class _BlockRequest:
    request_id: str
    block_ids: list[int]
    fingerprint: str

    @classmethod
    def decode(cls, raw: bytes | bytearray) -> _BlockRequest:
        message = _decode(raw, "request")
        request_id = message.get("request_id")
        block_ids = message.get("block_ids")
        fingerprint = message.get("fingerprint")
        if (
            not isinstance(request_id, str)
            or not isinstance(fingerprint, str)
            or not isinstance(block_ids, list)
            or not all(isinstance(b, int) for b in block_ids)
        ):
            raise KvTransferError("protocol", "malformed request header")
        return cls(request_id, block_ids, fingerprint)

    def encode(self) -> bytes:
        return _encode(
            {
                "request_id": self.request_id,
                "block_ids": self.block_ids,
                "fingerprint": self.fingerprint,
            }
        )


def _is_transport_error(exc: BaseException) -> bool:
    from ucxx.exceptions import UCXError

    return isinstance(exc, UCXError | ConnectionError | OSError)


def _abort(endpoint: Any) -> None:
    try:
        endpoint.abort(period=_CLOSE_PERIOD_NS)
    except Exception:  # closing a dead endpoint may complain; it is gone either way
        pass


class UcxKvProducer(KvProducer):
    """Serves pinned blocks of ``kv_cache`` to consumers over UCX.

    ``host`` is the address advertised in handles; the listener accepts on every
    interface. ``port=0`` lets UCX pick a free port (``start`` returns it).
    """

    def __init__(
        self,
        kv_cache: torch.Tensor,
        layout: KvLayout,
        engine_id: str,
        host: str = "127.0.0.1",
        port: int = 0,
        on_release: ReleaseCallback | None = None,
    ):
        layout.check_cache(kv_cache)
        self._kv_cache = kv_cache
        self._layout = layout
        self._fingerprint = layout.fingerprint()
        self.engine_id = engine_id
        self.host = host
        self.port = port
        self.on_release = on_release
        self._leases = LeaseTable()
        self._copy_stream = _copy_stream(kv_cache)
        self._runtime: UcxRuntime | None = None
        # Touched only on the runtime's loop.
        self._listener: Any = None
        self._endpoints: set[Any] = set()

    # -- engine-facing, any thread --------------------------------------------------

    def start(self) -> tuple[str, int]:
        if self._runtime is not None:
            raise RuntimeError("producer already started")
        self._runtime = UcxRuntime.shared()
        self.port = self._runtime.call(self._listen())
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
            self._runtime.call(self._shutdown())
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
        staging = _Staging(self._kv_cache, self._layout)
        try:
            while endpoint in self._endpoints:
                try:
                    raw = await endpoint.recv_obj()
                except Exception as exc:
                    if _is_transport_error(exc):
                        return  # the consumer went away
                    raise
                await self._serve_request(endpoint, raw, staging)
        except Exception as exc:
            if not _is_transport_error(exc):
                raise
        finally:
            self._endpoints.discard(endpoint)
            _abort(endpoint)

    async def _serve_request(
        self, endpoint: Any, raw: bytes | bytearray, staging: _Staging
    ) -> None:
        assert self._runtime is not None
        try:
            request = _BlockRequest.decode(raw)
            if request.fingerprint != self._fingerprint:
                raise KvTransferError(
                    "layout_mismatch",
                    f"consumer layout {request.fingerprint}, producer {self._fingerprint}",
                )
            nbytes = await self._runtime.run_copy(lambda: self._gather(request, staging))
        except KvTransferError as failure:
            await endpoint.send_obj(
                _encode({"status": failure.reason, "nbytes": 0, "detail": failure.detail})
            )
            return
        await endpoint.send_obj(_encode({"status": _STATUS_OK, "nbytes": nbytes, "detail": ""}))
        if nbytes:
            await endpoint.send(staging.wire(nbytes))

    def _gather(self, request: _BlockRequest, staging: _Staging) -> int:
        """Copy the asked blocks into ``staging``; runs on a copy thread."""
        with self._leases.reading(request.request_id, request.block_ids, time.time()):
            out = staging.blocks(len(request.block_ids))
            ids = torch.tensor(request.block_ids, dtype=torch.long, device=out.device)
            if self._copy_stream is None:
                torch.index_select(self._kv_cache, 2, ids, out=out)
            else:
                with torch.cuda.stream(self._copy_stream):
                    torch.index_select(self._kv_cache, 2, ids, out=out)
                self._copy_stream.synchronize()
        return len(request.block_ids) * self._layout.bytes_per_block


@dataclass
class _Peer:
    """One producer as a consumer sees it: a reusable endpoint and its staging buffer."""

    staging: _Staging
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    endpoint: Any = None


class UcxKvConsumer(KvConsumer):
    """Pulls blocks from UCX producers into ``kv_cache``."""

    def __init__(self, kv_cache: torch.Tensor, layout: KvLayout, connect_timeout: float = 5.0):
        layout.check_cache(kv_cache)
        self._kv_cache = kv_cache
        self._layout = layout
        self._fingerprint = layout.fingerprint()
        self._connect_timeout = connect_timeout
        self._copy_stream = _copy_stream(kv_cache)
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
        if handle.layout_fingerprint != self._fingerprint:
            failed: Future[TransferResult] = Future()
            failed.set_exception(
                KvTransferError(
                    "layout_mismatch",
                    f"producer layout {handle.layout_fingerprint}, ours {self._fingerprint}",
                )
            )
            return failed
        return self._runtime.submit(self._pull(handle, remote, local, timeout))

    def close(self) -> None:
        if not self._closed.is_set():
            self._closed.set()
            self._runtime.call(self._drop_all())

    # -- the runtime's loop -----------------------------------------------------------

    async def _pull(
        self, handle: KvHandle, remote: list[int], local: list[int], timeout: float
    ) -> TransferResult:
        started = time.perf_counter()
        try:
            num_bytes = await asyncio.wait_for(self._pull_from_peer(handle, remote, local), timeout)
        except TimeoutError:
            raise KvTransferError(
                "timeout", f"pull from {handle.host}:{handle.port} exceeded {timeout}s"
            ) from None
        return TransferResult(len(remote), num_bytes, time.perf_counter() - started)

    async def _pull_from_peer(self, handle: KvHandle, remote: list[int], local: list[int]) -> int:
        key = (handle.host, handle.port)
        peer = self._peers.get(key)
        if peer is None:
            peer = self._peers[key] = _Peer(_Staging(self._kv_cache, self._layout))
        async with peer.lock:
            if peer.endpoint is not None and peer.endpoint.closed:
                self._drop(peer)  # its error callback already fired
            for attempt in range(2):
                reused = peer.endpoint is not None
                if peer.endpoint is None:
                    peer.endpoint = await self._connect(handle.host, handle.port)
                try:
                    return await self._exchange(peer, handle, remote, local)
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
            return await ucxx.create_endpoint(host, port, connect_timeout=self._connect_timeout)
        except Exception as exc:
            if isinstance(exc, TimeoutError) or _is_transport_error(exc):
                raise KvTransferError("unreachable", f"{host}:{port}: {exc!r}") from None
            raise

    async def _exchange(
        self, peer: _Peer, handle: KvHandle, remote: list[int], local: list[int]
    ) -> int:
        endpoint = peer.endpoint
        request = _BlockRequest(handle.request_id, remote, self._fingerprint)
        await endpoint.send_obj(request.encode())
        status = _decode(await endpoint.recv_obj(), "status")
        reason = status.get("status")
        if reason != _STATUS_OK:
            if reason in TRANSFER_FAILURES:
                raise KvTransferError(reason, str(status.get("detail", "")))
            raise KvTransferError("protocol", f"unknown status {reason!r}")
        nbytes = len(remote) * self._layout.bytes_per_block
        if status.get("nbytes") != nbytes:
            raise KvTransferError(
                "protocol", f"producer offers {status.get('nbytes')} bytes, expected {nbytes}"
            )
        if not remote:
            return 0
        staging = peer.staging.blocks(len(remote))
        await endpoint.recv(peer.staging.wire(nbytes))
        await self._runtime.run_copy(lambda: self._scatter(staging, local))
        return nbytes

    def _scatter(self, staging: torch.Tensor, local: list[int]) -> None:
        """Copy received blocks to their local ids; runs on a copy thread."""
        ids = torch.tensor(local, dtype=torch.long, device=self._kv_cache.device)
        if self._copy_stream is None:
            self._kv_cache.index_copy_(2, ids, staging)
        else:
            with torch.cuda.stream(self._copy_stream):
                self._kv_cache.index_copy_(2, ids, staging)
            self._copy_stream.synchronize()

    def _drop(self, peer: _Peer) -> None:
        if peer.endpoint is not None:
            _abort(peer.endpoint)
            peer.endpoint = None

    async def _drop_all(self) -> None:
        for peer in self._peers.values():
            self._drop(peer)
        self._peers.clear()
