"""The producer side of the UCX connector: pin blocks under leases, serve them to consumers.

Owns the producer's control listener (bound to exactly the advertised address), one
served connection per consumer, and serving a pull: admission, the payload, the final
status. The protocol, transports, copies and failure handling are described once, in
``ucx_connector``; lease bookkeeping is ``leases``', block allocation the engine's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kv_transfer.block_copy import BlockCopier, StagingBuffer
from kv_transfer.connector import (
    KvHandle,
    KvProducer,
    KvTransferError,
    ReleaseCallback,
)
from kv_transfer.layout import KvLayout
from kv_transfer.leases import Lease, LeaseTable
from kv_transfer.local_addresses import check_bind_address, is_local_address
from kv_transfer.rank_layout import RankCache
from kv_transfer.rank_wire_up import answer_wire_ups
from kv_transfer.transfer_plan import TransferPlan
from kv_transfer.ucx_io import (
    Posted,
    abort_endpoint,
    close_writer,
    copy,
    is_transport_error,
    open_endpoint,
    post,
    settle,
    tune_control_socket,
)
from kv_transfer.ucx_rma import MappedMemory
from kv_transfer.ucx_runtime import UcxRuntime
from kv_transfer.wire import (
    PREVIOUS_VERSION,
    STATUS_OK,
    SUPPORTED_VERSIONS,
    WIRE_UP_BYTES,
    BlockRequest,
    Hello,
    ReadableCache,
    ReadConfirm,
    ReadDone,
    TransferStatus,
    TransportKind,
    Welcome,
    as_wire,
    payload_tag,
    read_frame,
    wire_up_tag,
)

logger = logging.getLogger(__name__)

# A consumer that connects must say hello within this time, or is dropped.
HELLO_TIMEOUT_S = 10.0


class _ConsumerGone(Exception):
    """The consumer closed its control connection (or broke the protocol) mid-pull."""


class UcxKvProducer(KvProducer):
    """Serves pinned blocks of ``kv_cache`` to consumers over UCX.

    ``host`` is both the address advertised in handles and the only one the listener
    binds: an IP literal of this host, never a wildcard (``local_addresses``; ValueError
    otherwise). ``port=0`` picks a free port (``start`` returns it). ``versions``: the
    protocol versions it serves (``wire``); only the previous one pins it to the previous
    version's behaviour (a rolling upgrade's old producer, and its test), closing the
    connection of a consumer that says hello in another.
    """

    def __init__(
        self,
        kv_cache: torch.Tensor,
        layout: KvLayout,
        engine_id: str,
        host: str = "127.0.0.1",
        port: int = 0,
        on_release: ReleaseCallback | None = None,
        versions: tuple[int, ...] = SUPPORTED_VERSIONS,
    ):
        self._copier = BlockCopier(kv_cache, layout)  # checks the cache against the layout
        self._kv_cache = kv_cache
        self._layout = layout
        self._fingerprint = layout.fingerprint()
        self.engine_id = engine_id
        self.host = check_bind_address(host)
        self.port = port
        self.on_release = on_release
        if not set(versions) <= set(SUPPORTED_VERSIONS) or not versions:
            raise ValueError(f"KV protocol versions must be among {SUPPORTED_VERSIONS}")
        self._versions = tuple(versions)
        self._leases = LeaseTable()
        self._runtime: UcxRuntime | None = None
        # Touched only on the runtime's loop.
        self._server: asyncio.Server | None = None
        self._served: set[asyncio.Task[Any]] = set()
        self._mapped: MappedMemory | None = None  # the cache, for consumers' reads
        # Tensor parallelism: this rank's KV heads (first, count) and the other ranks'
        # caches (mapped by their own processes), offered to readers so that each consumer
        # rank reads its heads itself (``rank_reader``).
        self.heads = (0, layout.num_kv_heads)
        self.other_ranks: list[RankCache] = []

    # -- engine-facing, any thread --------------------------------------------------

    def start(self) -> tuple[str, int]:
        if self._runtime is not None:
            raise RuntimeError("producer already started")
        self._runtime = UcxRuntime.shared(self.host)
        if not self._kv_cache.is_cuda:
            self._mapped = self._runtime.call(self._map_cache(), timeout=30)
            answer_wire_ups(self._runtime)  # per-rank readers over TCP (``rank_wire_up``)
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
        num_blocks = self._kv_cache.shape[0]
        ids = [int(b) for b in block_ids]
        if any(not 0 <= b < num_blocks for b in ids) or len(set(ids)) != len(ids):
            raise ValueError(f"block ids must be distinct and in [0, {num_blocks}): {ids}")
        lease = self._leases.add(request_id, ids, num_tokens, time.time() + lease_seconds)
        return KvHandle(
            engine_id=self.engine_id,
            host=self.host,
            port=self.port,
            request_id=request_id,
            block_ids=tuple(ids),
            num_tokens=num_tokens,
            lease_deadline=lease.deadline,
            layout_fingerprint=self._fingerprint,
            tensor_parallel_size=self._layout.tensor_parallel_size,
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

    @property
    def num_connections(self) -> int:
        """Consumers connected now."""
        return len(self._served)

    def close(self) -> None:
        if self._runtime is not None:
            self._runtime.call(self._shutdown(), timeout=30)
            if self._mapped is not None:
                self._mapped.close()  # no connection is left to read it
                self._mapped = None
            self._runtime = None
        self._leases.clear()

    # -- the runtime's loop -----------------------------------------------------------

    async def _map_cache(self) -> MappedMemory:
        """The whole cache mapped once for reads by consumers on this host (host memory
        only: GPU caches are sent, see ucx_connector)."""
        import ucxx

        context = ucxx.core._get_ctx().context.handle
        return MappedMemory(context, self._kv_cache.data_ptr(),
                            self._kv_cache.numel() * self._kv_cache.element_size())

    def _readable(self, hello: Hello, kind: TransportKind) -> ReadableCache | None:
        """The cache's remote key, to a consumer that asks: in version 4 on either transport
        (over TCP UCX serves the GETs itself, on its progress thread), in version 3 only on
        shared memory, as that version did."""
        if not hello.read or self._mapped is None or (hello.version < 4 and kind != "shm"):
            return None
        return ReadableCache(self._mapped.rkey, self._mapped.address, self._kv_cache.shape[0])

    def _rank_caches(self, readable: ReadableCache | None, kind: TransportKind
                     ) -> tuple[RankCache, ...] | None:
        """Every rank's cache (this one first), each at its worker's address for ``kind``,
        to a reader: per-rank pulls read each rank's memory (``rank_reader``)."""
        if readable is None or self._runtime is None:
            return None
        own = RankCache(0, self.heads[0], self.heads[1], self._runtime.worker_address(kind),
                        readable.rkey, readable.address, readable.num_blocks)
        return (own, *(rank.reached_over(kind) for rank in self.other_ranks))

    async def _listen(self) -> int:
        self._server = await asyncio.start_server(
            self._serve_connection, host=self.host, port=self.port, reuse_address=True)
        return int(self._server.sockets[0].getsockname()[1])

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._served):
            task.cancel()
        await asyncio.gather(*self._served, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def _serve_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None and self._runtime is not None
        self._served.add(task)
        tune_control_socket(writer)
        endpoint = None
        try:
            hello = Hello.decode(await asyncio.wait_for(
                read_frame(reader, "hello", self._versions), HELLO_TIMEOUT_S))
            kind = self._transport_for(hello, writer)
            endpoint = await open_endpoint(hello.addresses[kind])
            readable = self._readable(hello, kind)
            writer.write(Welcome(self.engine_id, kind, self._runtime.worker_address(kind),
                                 readable, self._fingerprint, hello.version,
                                 self._rank_caches(readable, kind)).encode())
            await writer.drain()
            if readable is not None and kind == "tcp":
                await _wire_up(endpoint, hello.connection_id)
            staging = StagingBuffer(self._kv_cache)
            while True:
                frame = await read_frame(reader, "request", (hello.version,))
                if "confirm" in frame and hello.version >= 4:
                    self._serve_confirm(writer, readable is not None, frame)
                elif frame.get("read") is True and hello.version < 4:
                    await self._serve_read(reader, writer, readable is not None, frame)
                else:
                    await self._serve_request(reader, writer, endpoint, hello, frame, staging)
        except (_ConsumerGone, asyncio.IncompleteReadError, TimeoutError):
            pass  # the consumer went away, or never said hello
        except KvTransferError as failure:  # it broke the protocol: drop it
            logger.warning("KV consumer %s dropped: %s", writer.get_extra_info("peername"),
                           failure)
        except Exception as exc:
            if not is_transport_error(exc):
                logger.exception("serving a KV consumer failed")
        finally:
            if endpoint is not None:
                abort_endpoint(endpoint)
            close_writer(writer)
            self._served.discard(task)

    @staticmethod
    def _transport_for(hello: Hello, writer: asyncio.StreamWriter) -> TransportKind:
        """Shared memory only when the consumer asks for it and its connection comes from
        one of this host's own addresses (``local_addresses``): the same rule the
        consumer applied to our address, checked from this side too."""
        peer = writer.get_extra_info("peername")
        local = peer is not None and is_local_address(str(peer[0]))
        return "shm" if hello.prefer == "shm" and "shm" in hello.addresses and local else "tcp"

    def _serve_confirm(self, writer: asyncio.StreamWriter, offered: bool,
                       frame: dict[str, Any]) -> None:
        """Version 4: a consumer read a lease's blocks without asking first; answer whether
        the lease it read (its generation) was in force throughout (``LeaseTable.confirm``).
        Nothing here waits: the producer's whole part in a read pull is this lookup."""
        confirm = ReadConfirm.decode(frame)
        if not offered:
            raise KvTransferError("protocol", "a read confirmation on a connection without reads")
        try:
            self._leases.confirm(confirm.request_id, confirm.block_ids, confirm.generation,
                                time.time())
        except KvTransferError as failure:
            writer.write(TransferStatus(failure.reason, detail=failure.detail).encode())
            return
        nbytes = len(confirm.block_ids) * self._layout.bytes_per_block
        writer.write(TransferStatus(STATUS_OK, nbytes).encode())

    async def _serve_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                             endpoint: Any, hello: Hello, frame: dict[str, Any],
                             staging: StagingBuffer) -> None:
        """A pull the producer sends (the fallback for a consumer that cannot read)."""
        request = BlockRequest.decode(frame)
        try:
            lease, plan = self._admit(request)
        except KvTransferError as failure:  # refused: the status instead of the payload
            writer.write(TransferStatus(failure.reason, detail=failure.detail)
                         .encode(hello.version))
            return
        # The consumer writes nothing until our status: a read that completes means it
        # closed the connection (or broke the protocol).
        gone = asyncio.ensure_future(reader.read(1))
        try:
            final = await self._send_payload(request, plan, lease, endpoint,
                                             hello.connection_id, staging, gone)
        finally:
            gone.cancel()
            # The next read of the stream may start only once this one has let go of it.
            await asyncio.gather(gone, return_exceptions=True)
        if gone.done() and not gone.cancelled():
            raise _ConsumerGone("the consumer closed the connection or wrote out of turn")
        writer.write(final.encode(hello.version))
        await writer.drain()

    async def _serve_read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                          offered: bool, frame: dict[str, Any]) -> None:
        """Version 3: a consumer that reads the runs itself: admit (the status "ok" lets it
        read), then, once it says its reads are over, whether the lease held meanwhile."""
        v3 = PREVIOUS_VERSION
        request = BlockRequest.decode(frame)
        if not offered:
            raise KvTransferError("protocol", "a read request on a connection without reads")
        try:
            lease, plan = self._admit(request)
            if plan.mode != "direct":
                raise KvTransferError("protocol", "a read request must be planned direct")
        except KvTransferError as failure:
            writer.write(TransferStatus(failure.reason, detail=failure.detail).encode(v3))
            return
        nbytes = len(request.block_ids) * self._layout.bytes_per_block
        writer.write(TransferStatus(STATUS_OK, nbytes).encode(v3))
        ReadDone.decode(await read_frame(reader, "read done", (v3,)), request.seq)
        # The consumer read the cache without the lease held (as a direct send does):
        # blocks freed meanwhile may have been rewritten, so it must not keep them.
        final = (TransferStatus(STATUS_OK, nbytes) if self._leases.holds(lease) else
                 TransferStatus("lease_expired", detail="the lease ended during the transfer"))
        writer.write(final.encode(v3))

    def _admit(self, request: BlockRequest) -> tuple[Lease, TransferPlan]:
        """The lease and plan to serve, or the KvTransferError to answer."""
        if request.fingerprint != self._fingerprint:
            raise KvTransferError("layout_mismatch",
                                  self._layout.mismatch(request.fingerprint, "consumer"))
        # Pinned, unexpired, and the asked blocks are among the pinned ones.
        with self._leases.reading(request.request_id, request.block_ids, time.time()) as lease:
            pass
        return lease, TransferPlan.from_wire(request.plan, self._layout, request.block_ids)

    async def _send_payload(self, request: BlockRequest, plan: TransferPlan, lease: Lease,
                            endpoint: Any, connection_id: int, staging: StagingBuffer,
                            gone: asyncio.Future[bytes]) -> TransferStatus:
        """Send every message of the plan; the final status to answer."""
        assert self._runtime is not None
        nbytes = len(request.block_ids) * self._layout.bytes_per_block
        final = TransferStatus(STATUS_OK, nbytes)
        sends = Posted()
        try:
            if plan.mode == "direct":
                messages = [
                    (as_wire(self._copier.run_view(run.remote_start, run.count)),
                     payload_tag(connection_id, request.seq, i))
                    for i, run in enumerate(plan.runs)]
                sends = post(endpoint, messages, receive=False)
            else:
                final = await self._send_staged(request, plan, endpoint, connection_id,
                                                staging, sends)
            await _until_sent(sends.futures, gone)
        except BaseException:
            abort_endpoint(endpoint)  # withdraws the sends: this connection is over
            raise
        finally:
            await settle(sends)
        if final.status == STATUS_OK and not self._leases.holds(lease):
            # A direct send reads the cache without holding the lease: blocks freed
            # meanwhile may have been rewritten, so the consumer must not keep them.
            final = TransferStatus("lease_expired", detail="the lease ended during the transfer")
        return final

    async def _send_staged(self, request: BlockRequest, plan: TransferPlan, endpoint: Any,
                           connection_id: int, staging: StagingBuffer,
                           sends: Posted) -> TransferStatus:
        """Gather chunk i+1 while chunk i is on the wire; sends are appended to ``sends``."""
        assert self._runtime is not None
        out = staging.blocks(len(request.block_ids))
        for i, (start, stop) in enumerate(plan.layer_chunks(self._layout)):
            try:
                await self._gather(request, out, start, stop)
            except KvTransferError as failure:  # the lease ended mid-transfer
                return TransferStatus(failure.reason,
                                      detail=f"the lease ended during the transfer: {failure}")
            tag = payload_tag(connection_id, request.seq, i)
            sends.extend(post(endpoint, [(as_wire(out[start:stop]), tag)],
                              receive=False))
        return TransferStatus(STATUS_OK, out.numel() * out.element_size())

    async def _gather(self, request: BlockRequest, out: torch.Tensor, start: int, stop: int
                      ) -> None:
        """Copy layers [start, stop) of the asked blocks into ``out``."""

        def gather() -> None:
            # Each chunk holds the lease on its own: ending a lease mid-transfer waits
            # for one chunk's copy at most (see ucx_connector).
            with self._leases.reading(request.request_id, request.block_ids, now=None):
                self._copier.gather(request.block_ids, out, start, stop)

        assert self._runtime is not None
        await copy(self._runtime, out[start:stop].nbytes, gather)


async def _wire_up(endpoint: Any, connection_id: int) -> None:
    """Version 4, a reader over TCP: its small message, then a rendezvous-sized one back,
    before it reads (``UcxKvConsumer._until_wired`` says why)."""
    ping = np.zeros(8, dtype=np.uint8)
    received = post(endpoint, [(ping, wire_up_tag(connection_id))], receive=True)
    await asyncio.gather(*received.futures)
    pong = np.zeros(WIRE_UP_BYTES, dtype=np.uint8)
    sent = post(endpoint, [(pong, wire_up_tag(connection_id) + 1)], receive=False)
    await asyncio.gather(*sent.futures)


async def _until_sent(sends: list[asyncio.Future[Any]], gone: asyncio.Future[bytes]) -> None:
    """Wait for every send, or raise _ConsumerGone as soon as the consumer hangs up."""
    if not sends:
        return
    together: asyncio.Future[Any] = asyncio.gather(*sends)
    # Whoever loses the race below, its outcome is retrieved (no "never retrieved" noise).
    together.add_done_callback(lambda f: f.cancelled() or f.exception())
    waiting: set[asyncio.Future[Any]] = {together, gone}
    done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    if together in done:
        together.result()
        return
    raise _ConsumerGone("the consumer closed the connection during the transfer")
