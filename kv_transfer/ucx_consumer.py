"""The consumer side of the UCX connector: pull remote blocks into given local blocks.

Owns the consumer's connections (one per producer address, reused, each a TCP control
connection plus a UCX endpoint on the transport chosen for that producer) and running a
pull: the plan, the receives, the scatters, and turning every way it can fail into a
``KvTransferError``. The protocol, transports, copies and failure handling are described
once, in ``ucx_connector``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kv_transfer.block_copy import BlockCopier, StagingBuffer
from kv_transfer.connector import KvConsumer, KvHandle, KvTransferError, TransferResult
from kv_transfer.layout import KvLayout
from kv_transfer.local_addresses import check_bind_address, is_local_address, is_loopback
from kv_transfer.rank_layout import RankCache
from kv_transfer.rank_reader import RankedPulls, refusal
from kv_transfer.transfer_plan import (
    DEFAULT_CHUNK_BYTES,
    DIRECT_MIN_MESSAGE_BYTES,
    TransferPlan,
    plan_transfer,
)
from kv_transfer.ucp_introspection import endpoint_lanes, transport_label
from kv_transfer.ucx_io import (
    abort_endpoint,
    close_writer,
    copy,
    is_transport_error,
    open_endpoint,
    post,
    settle,
    tune_control_socket,
)
from kv_transfer.ucx_rma import ReadBurst, Reader, RemoteKey, coalesce_reads, wake_worker
from kv_transfer.ucx_runtime import UcxRuntime
from kv_transfer.wire import (
    PREVIOUS_VERSION,
    PROTOCOL_VERSION,
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

TRANSPORT_CHOICES = ("auto", "tcp")
# A burst of reads ends by itself (a dead producer fails them at once); this bounds a bug.
READ_SETTLE_TIMEOUT_S = 5.0
# A burst of at most INLINE_READ_BYTES is progressed on the loop's own thread for up to
# INLINE_READ_S (no thread wakes: over cma one progress call copies 512 KiB). Any other is
# progressed by ucxx's progress thread alone, the loop meanwhile watching the control
# connection (a producer that dies or freezes mid-read): see ``ucx_rma``'s threading note.
INLINE_READ_BYTES = 2**20
INLINE_READ_S = 0.002


@dataclass
class _Connection:
    """A live link to one producer: control connection, UCX endpoint, what UCX chose."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    endpoint: Any
    engine_id: str  # the producer that answered
    connection_id: int
    transport: str  # ucp_introspection.transport_label of the endpoint's lanes
    lanes: list[tuple[str, str]]
    readable: ReadableCache | None = None  # the producer's cache, when we read it ourselves
    rkey: RemoteKey | None = None  # readable's key, unpacked on this endpoint
    version: int = PROTOCOL_VERSION  # of the protocol spoken on this connection
    ranks: tuple[RankCache, ...] | None = None  # the producer's ranks, for per-rank pulls
    seq: int = 0

    def broken(self) -> bool:
        """The producer hung up (seen by the loop, even with nobody reading)."""
        return (self.writer.is_closing() or self.reader.at_eof()
                or self.reader.exception() is not None or self.endpoint.closed)

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq


@dataclass
class _Peer:
    """One producer address as a consumer sees it: its connection and staging buffer."""

    staging: StagingBuffer
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    connection: _Connection | None = None


class _StaleConnection(Exception):
    """The request could not even be written: the connection died while idle."""


class _HelloRefused(Exception):
    """The producer closed the connection instead of welcoming us: a producer of the
    previous protocol version does so on a hello of a version it does not know."""


class UcxKvConsumer(KvConsumer):
    """Pulls blocks from UCX producers into ``kv_cache``.

    ``host`` is this replica's KV address: UCX's TCP transport listens only on its
    interface (``ucx_runtime``), so it must be an address that reaches the producers
    (loopback reaches only producers on this host). ``transport="tcp"`` keeps same-host
    pulls off shared memory (for comparison and as an operator's escape hatch).
    ``chunk_bytes`` bounds a staged payload message; ``direct_min_message_bytes`` is the
    mean message size from which a pull goes cache to cache (``transfer_plan``).
    ``remote_read=False`` has producers send direct pulls instead of letting this consumer
    read them (``ucx_rma``; the labelled fallback, for comparison: reading is faster).
    ``protocol_version``: the version it says hello in (``wire``); a producer that refuses
    it is greeted again in the previous version, once per connection, counted in
    ``num_downgrades``.
    """

    def __init__(
        self,
        kv_cache: torch.Tensor,
        layout: KvLayout,
        host: str = "127.0.0.1",
        connect_timeout: float = 5.0,
        transport: str = "auto",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        direct_min_message_bytes: int = DIRECT_MIN_MESSAGE_BYTES,
        remote_read: bool = True,
        protocol_version: int = PROTOCOL_VERSION,
        ranked: RankedPulls | None = None,
    ):
        if protocol_version not in SUPPORTED_VERSIONS:
            raise ValueError(f"KV protocol version must be one of {SUPPORTED_VERSIONS}")
        if transport not in TRANSPORT_CHOICES:
            raise ValueError(f"transport must be 'auto' or 'tcp', got {transport!r}")
        self._copier = BlockCopier(kv_cache, layout)  # checks the cache against the layout
        self._kv_cache = kv_cache
        self._layout = layout
        self._fingerprint = layout.fingerprint()
        self.host = check_bind_address(host)
        self._connect_timeout = connect_timeout
        self._transport = transport
        self._chunk_bytes = chunk_bytes
        self._direct_min_message_bytes = direct_min_message_bytes
        # Reads need host memory on both sides (GPU caches are sent: see ucx_connector).
        self._remote_read = remote_read and not kv_cache.is_cuda
        self._reader = Reader()
        self._protocol_version = protocol_version
        # Pulls where either side has several tensor-parallel ranks (``rank_reader``);
        # None: only single-rank pairings are served.
        self._ranked = ranked
        # Connections that had to fall back to the previous protocol version (a producer not
        # upgraded yet); each is logged with its reason.
        self.num_downgrades = 0
        self._runtime = UcxRuntime.shared(self.host)
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
        num_blocks = self._kv_cache.shape[0]
        if any(not 0 <= b < num_blocks for b in local) or len(set(local)) != len(local):
            raise ValueError(f"local block ids must be distinct and in [0, {num_blocks})")
        refused_because = refusal(handle, self._ranked, self._kv_cache.is_cuda)
        if refused_because is not None:
            refused: Future[TransferResult] = Future()
            refused.set_exception(KvTransferError("tensor_parallel", refused_because))
            return refused
        if handle.layout_fingerprint != self._expected_fingerprint(handle):
            failed: Future[TransferResult] = Future()
            failed.set_exception(
                KvTransferError("layout_mismatch",
                                self._layout.mismatch(handle.layout_fingerprint, "producer"))
            )
            return failed
        return self._runtime.submit(self._pull(handle, remote, local, timeout))

    def _expected_fingerprint(self, handle: KvHandle) -> str:
        """The producer layout's fingerprint a pull of ``handle`` can read: ours, or for a
        per-rank pull that of a producer of the handle's parallel size."""
        if self._ranked is not None and self._ranked.needed(handle):
            return self._ranked.producer_fingerprint(handle.tensor_parallel_size)
        return self._fingerprint

    @property
    def num_connections(self) -> int:
        """Producers this consumer holds a live connection (and UCX endpoint) to."""
        return self._runtime.call(self._count_connections(), timeout=10)

    def close(self) -> None:
        if not self._closed.is_set():
            self._closed.set()
            self._runtime.call(self._drop_all(), timeout=30)

    # -- the runtime's loop -----------------------------------------------------------

    async def _count_connections(self) -> int:
        return sum(peer.connection is not None for peer in self._peers.values())

    async def _pull(self, handle: KvHandle, remote: list[int], local: list[int],
                    timeout: float) -> TransferResult:
        started = time.perf_counter()
        try:
            transport, plan = await asyncio.wait_for(
                self._pull_from_peer(handle, remote, local), timeout)
        except TimeoutError:
            raise KvTransferError(
                "timeout", f"pull from {handle.host}:{handle.port} exceeded {timeout}s"
            ) from None
        nbytes = (self._ranked.nbytes_read(len(local))
                   if plan.mode == "ranks" and self._ranked is not None
                   else len(local) * self._layout.bytes_per_block)
        return TransferResult(len(local), nbytes, time.perf_counter() - started, transport,
                              plan.mode)

    async def _pull_from_peer(self, handle: KvHandle, remote: list[int], local: list[int]
                              ) -> tuple[str, TransferPlan]:
        key = (handle.host, handle.port)
        peer = self._peers.get(key)
        if peer is None:
            peer = self._peers[key] = _Peer(StagingBuffer(self._kv_cache))
        async with peer.lock:
            if peer.connection is not None and peer.connection.broken():
                self._drop(peer)  # the producer went away (or restarted) since
            for attempt in range(2):
                if peer.connection is None:
                    peer.connection = await self._connect(handle)
                connection = peer.connection
                if connection.engine_id != handle.engine_id:
                    raise KvTransferError(
                        "unreachable", f"{handle.host}:{handle.port} is KV engine "
                        f"{connection.engine_id!r}, not {handle.engine_id!r}")
                try:
                    plan = await self._exchange(peer, handle, remote, local)
                    return connection.transport, plan
                except _StaleConnection:
                    self._drop(peer)
                    if attempt == 1:
                        raise KvTransferError(
                            "unreachable", f"{handle.host}:{handle.port} closed the connection"
                        ) from None
                except KvTransferError:
                    raise  # the connection was dropped
                except BaseException as exc:  # also CancelledError, from the timeout
                    self._drop(peer)
                    if not is_transport_error(exc):
                        raise
                    raise KvTransferError(
                        "unreachable", f"{handle.host}:{handle.port} failed during the pull: "
                        f"{_describe(exc)}") from None
        raise AssertionError("unreachable code")

    async def _connect(self, handle: KvHandle) -> _Connection:
        """A connection in this consumer's protocol version, or the previous one if the
        producer refuses it (a rolling upgrade: the producer is not upgraded yet)."""
        try:
            return await self._connect_version(handle, self._protocol_version)
        except _HelloRefused:
            if self._protocol_version == PREVIOUS_VERSION:
                raise KvTransferError("unreachable", f"{handle.host}:{handle.port} closed "
                                      "the connection at hello") from None
        logger.warning(
            "KV producer %s:%d closed the connection on a hello of protocol version %d (it "
            "may not be upgraded yet): trying version %d", handle.host, handle.port,
            self._protocol_version, PREVIOUS_VERSION)
        try:
            connection = await self._connect_version(handle, PREVIOUS_VERSION)
        except _HelloRefused:
            raise KvTransferError(
                "unreachable", f"{handle.host}:{handle.port} closed the connection at hello "
                f"in protocol versions {self._protocol_version} and {PREVIOUS_VERSION}") from None
        self.num_downgrades += 1
        return connection

    async def _connect_version(self, handle: KvHandle, version: int) -> _Connection:
        """Control connection, hello, and a UCX endpoint on the transport agreed on."""
        host, port = handle.host, handle.port
        prefer: TransportKind = (
            "shm" if self._transport == "auto" and is_local_address(host) else "tcp")
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port),
                                                    self._connect_timeout)
        except (OSError, TimeoutError) as exc:
            raise KvTransferError("unreachable", f"{host}:{port}: {_describe(exc)}"
                                  f"{_loopback_hint(host)}") from None
        try:
            tune_control_socket(writer)
            connection_id = self._runtime.next_connection_id()
            addresses = {kind: self._runtime.worker_address(kind)
                         for kind in (("shm", "tcp") if prefer == "shm" else ("tcp",))}
            writer.write(Hello(handle.engine_id, connection_id, prefer, addresses,
                               self._remote_read, version).encode())
            try:
                welcome = Welcome.decode(await asyncio.wait_for(
                    read_frame(reader, "welcome", (version,)), self._connect_timeout))
            except asyncio.IncompleteReadError:
                raise _HelloRefused() from None
            self._check_welcome(welcome, handle)
            endpoint = await open_endpoint(welcome.address)
            lanes = endpoint_lanes(endpoint.ucp_endpoint)
            readable = welcome.readable if self._remote_read else None
            rkey = None if readable is None else RemoteKey(endpoint.ucp_endpoint, readable.rkey)
            if rkey is not None and welcome.transport == "tcp":
                await self._until_wired(endpoint, connection_id)
        except BaseException as exc:
            close_writer(writer)
            if isinstance(exc, KvTransferError | _HelloRefused) or not (
                    isinstance(exc, TimeoutError) or is_transport_error(exc)):
                raise
            raise KvTransferError(
                "unreachable", f"{host}:{port}: {_describe(exc)} (this replica's KV address "
                f"is {self.host}){_loopback_hint(host)}") from None
        return _Connection(reader, writer, endpoint, welcome.engine_id, connection_id,
                           transport_label(lanes), lanes, readable, rkey, version, welcome.ranks)

    async def _until_wired(self, endpoint: Any, connection_id: int) -> None:
        """A reader over TCP: a small message to the producer and a rendezvous-sized one
        back (``ucx_producer._wire_up``) before any GET. NOTE: UCX 1.21 emulates GETs over
        TCP with active messages, and GETs posted on a fresh endpoint never completed (5 s,
        every try), also after flushing the endpoint or an eager ping-pong both ways; after
        one rendezvous transfer from the producer they complete (measured, issue 34)."""
        ping, pong = np.zeros(8, dtype=np.uint8), np.zeros(WIRE_UP_BYTES, dtype=np.uint8)
        received = post(endpoint, [(pong, wire_up_tag(connection_id) + 1)], receive=True)
        sent = post(endpoint, [(ping, wire_up_tag(connection_id))], receive=False)
        try:
            await asyncio.wait_for(asyncio.gather(*received.futures, *sent.futures),
                                   self._connect_timeout)
        finally:
            await settle(received)
            await settle(sent)

    def _check_welcome(self, welcome: Welcome, handle: KvHandle) -> None:
        """The engine the handle names, and (version 4, once per connection) its layout."""
        if welcome.engine_id != handle.engine_id:
            raise KvTransferError(
                "unreachable", f"{handle.host}:{handle.port} is KV engine {welcome.engine_id!r}, "
                f"not {handle.engine_id!r}{_loopback_hint(handle.host)}")
        if welcome.version >= 4 and welcome.fingerprint != self._expected_fingerprint(handle):
            raise KvTransferError("layout_mismatch",
                                  self._layout.mismatch(welcome.fingerprint, "producer"))

    async def _exchange(self, peer: _Peer, handle: KvHandle, remote: list[int],
                        local: list[int]) -> TransferPlan:
        """One pull on the peer's connection; returns its plan once the bytes are in place.

        The payload's receives are posted before the request leaves, so the producer's
        messages find them waiting; its one status per request comes after the payload
        ("ok": every message was delivered while the lease held), or instead of it (a
        refusal). Anything but "ok" drops the connection, receives posted and all: only
        closing the endpoint withdraws them, and it makes sure UCX writes nothing more
        into the buffers (the local blocks, in a direct pull) once the pull has failed."""
        connection = peer.connection
        assert connection is not None
        seq = connection.next_seq()
        if self._ranked is not None and self._ranked.needed(handle):
            try:
                await self._read_ranks(connection, seq, handle, remote, local)
            except BaseException:
                self._drop(peer)
                raise
            return TransferPlan("ranks")
        plan = plan_transfer(self._layout, remote, local, self._chunk_bytes,
                             self._direct_min_message_bytes)
        if plan.mode == "direct" and connection.rkey is not None:
            try:
                if connection.version >= 4:
                    await self._read_confirmed(connection, seq, handle, remote, local, plan)
                else:
                    await self._read(connection, seq, handle, remote, local, plan)
                return dataclasses.replace(plan, mode="read")
            except BaseException:
                self._drop(peer)
                raise
        staging = peer.staging.blocks(len(local)) if plan.mode == "staged" else None
        receives = post(connection.endpoint, [
            (buffer, payload_tag(connection.connection_id, seq, i))
            for i, buffer in enumerate(self._receive_buffers(plan, staging))], receive=True)
        scatters: list[asyncio.Future[None]] = []
        final: asyncio.Future[dict[str, Any]] | None = None
        try:
            try:
                connection.writer.write(BlockRequest(
                    handle.request_id, remote, self._fingerprint, seq, plan.to_wire())
                    .encode(connection.version))
                await connection.writer.drain()
            except (ConnectionError, OSError) as exc:
                raise _StaleConnection() from exc
            final = asyncio.ensure_future(read_frame(connection.reader, "status",
                                                     (connection.version,)))
            await self._await_payload(plan, receives.futures, final, staging, local, scatters)
            status = TransferStatus.decode(await final)
            await asyncio.gather(*scatters)
            status.raise_for_failure()
            nbytes = len(local) * self._layout.bytes_per_block
            if status.nbytes != nbytes:
                raise KvTransferError("protocol", f"producer sent {status.nbytes} bytes; "
                                      f"expected {nbytes}")
            return plan
        except BaseException:
            self._drop(peer)
            raise
        finally:
            if final is not None:
                final.cancel()
            await settle(receives)
            # A running copy cannot be cancelled, so scatters are waited for, not
            # cancelled: no write into the local blocks may outlive the pull, whose
            # failure lets the engine reuse them.
            await asyncio.gather(*scatters, return_exceptions=True)

    async def _read_confirmed(self, connection: _Connection, seq: int, handle: KvHandle,
                              remote: list[int], local: list[int], plan: TransferPlan) -> None:
        """Version 4: GET the runs at once (the producer's key and layout came with the
        welcome), then confirm the lease's generation; the bytes count only once the
        producer says that lease was in force throughout (``ucx_connector``)."""
        readable = connection.readable
        assert readable is not None
        if max(remote) >= readable.num_blocks:
            raise KvTransferError("protocol", f"block {max(remote)} is beyond the producer's "
                                  f"{readable.num_blocks}")
        await self._read_runs(connection, plan)
        await self._confirm_reads(connection, seq, handle, remote,
                                  len(local) * self._layout.bytes_per_block)

    async def _read_ranks(self, connection: _Connection, seq: int, handle: KvHandle,
                          remote: list[int], local: list[int]) -> None:
        """A pull where either side has several tensor-parallel ranks (``rank_reader``):
        every rank of this replica reads its heads from the producer ranks holding them,
        then the lease is confirmed here, once (one block pool, one lease, every rank)."""
        assert self._ranked is not None
        if connection.ranks is None:  # listed only in version 4, to readers
            raise KvTransferError(
                "tensor_parallel", f"{handle.host}:{handle.port} offers no per-rank reads "
                f"(protocol version {connection.version}, transport {connection.transport}): "
                "per-rank pulls need version 4 and host memory (over TCP, a producer that "
                "answers per-rank wire-ups)")
        if len(connection.ranks) != handle.tensor_parallel_size:
            raise KvTransferError("protocol", f"the producer describes {len(connection.ranks)} "
                                  f"ranks; its handle says {handle.tensor_parallel_size}")
        await self._ranked.pull(connection.ranks, remote, local,
                                tcp=connection.transport != "shm")
        await self._confirm_reads(connection, seq, handle, remote,
                                  self._ranked.nbytes(len(local), handle.tensor_parallel_size))

    @staticmethod
    async def _confirm_reads(connection: _Connection, seq: int, handle: KvHandle,
                             remote: list[int], nbytes: int) -> None:
        """Tell the producer the reads are done and check its final status: the bytes count
        only if the lease held throughout (``ucx_connector``)."""
        try:
            connection.writer.write(ReadConfirm(seq, handle.request_id, remote,
                                                handle.lease_generation).encode())
        except (ConnectionError, OSError) as exc:
            raise KvTransferError("unreachable", f"the producer went away: {exc!r}") from None
        status = TransferStatus.decode(await read_frame(connection.reader, "status"))
        status.raise_for_failure()
        if status.nbytes != nbytes:
            raise KvTransferError("protocol", f"producer confirmed {status.nbytes} bytes; "
                                  f"expected {nbytes}")

    async def _read(self, connection: _Connection, seq: int, handle: KvHandle,
                    remote: list[int], local: list[int], plan: TransferPlan) -> None:
        """Version 3: a direct pull that this consumer reads itself (``ucx_rma``): the
        request, its admission, the GETs, then "read done" and the final status."""
        v3 = (PREVIOUS_VERSION,)
        nbytes = len(local) * self._layout.bytes_per_block
        try:
            connection.writer.write(BlockRequest(
                handle.request_id, remote, self._fingerprint, seq, plan.to_wire(),
                read=True).encode(PREVIOUS_VERSION))
            await connection.writer.drain()
        except (ConnectionError, OSError) as exc:
            raise _StaleConnection() from exc
        TransferStatus.decode(await read_frame(connection.reader, "status", v3)
                              ).raise_for_failure()
        await self._read_runs(connection, plan)
        connection.writer.write(ReadDone(seq).encode())
        status = TransferStatus.decode(await read_frame(connection.reader, "status", v3))
        status.raise_for_failure()
        if status.nbytes != nbytes:
            raise KvTransferError("protocol", f"producer admitted {status.nbytes} bytes; "
                                  f"expected {nbytes}")

    async def _read_runs(self, connection: _Connection, plan: TransferPlan) -> None:
        """GET every run into the local blocks (runs adjacent in both memories merged into
        one GET); returns only once no read is in flight (also when cancelled), since the
        engine may reuse the blocks after a failure."""
        readable, rkey = connection.readable, connection.rkey
        assert readable is not None and rkey is not None
        block_bytes = self._layout.bytes_per_block
        # One GET per run: a run's blocks, every layer's K and V, are one stretch on both
        # sides (block-major caches).
        reads = coalesce_reads(
            [(self._copier.run_view(run.local_start, run.count).data_ptr(),
              run.count * block_bytes, readable.address + run.remote_start * block_bytes)
             for run in plan.runs])
        burst = self._reader.get(connection.endpoint.ucp_endpoint, rkey, reads)
        try:
            # NOTE: a small burst is progressed here, on the loop's thread: waking another
            # thread and back costs 0.1-1 ms on a busy host, more than its reads take.
            over = (sum(nbytes for _, nbytes, _ in reads) <= INLINE_READ_BYTES
                    and burst.wait(_worker_handle(), INLINE_READ_S))
            if not over:
                over = await self._wait_watching(connection, burst)
        finally:
            self._reader.forget(burst)
        if not over:
            logger.error("UCX reads still in flight %ss after they were posted",
                         READ_SETTLE_TIMEOUT_S)
            raise KvTransferError("unreachable", "reads from the producer did not end")
        burst.raise_for_failure()

    async def _wait_watching(self, connection: _Connection, burst: ReadBurst) -> bool:
        """Wake ucxx's progress thread to progress the reads, and wait until they are over
        (True) or READ_SETTLE_TIMEOUT_S passed (False); meanwhile the control connection is
        watched (the producer writes nothing until we confirm, so anything it reads means
        the producer closed it): a producer gone mid-read has its endpoint closed, which
        ends the GETs in flight. Returns only once no read is in flight, or after the
        timeout (logged by the caller)."""
        loop = asyncio.get_running_loop()
        landed: asyncio.Future[None] = loop.create_future()
        burst.when_over(functools.partial(_resolve_threadsafe, loop, landed))
        wake_worker(_worker_handle())
        gone: asyncio.Future[bytes] = asyncio.ensure_future(connection.reader.read(1))
        either: set[asyncio.Future[Any]] = {landed, gone}
        try:
            done, _ = await asyncio.wait(either, timeout=READ_SETTLE_TIMEOUT_S,
                                         return_when=asyncio.FIRST_COMPLETED)
            if gone in done:
                abort_endpoint(connection.endpoint)
                await asyncio.wait({landed}, timeout=READ_SETTLE_TIMEOUT_S)
        except asyncio.CancelledError:
            abort_endpoint(connection.endpoint)  # the pull timed out: stop reading
            await asyncio.wait({landed}, timeout=READ_SETTLE_TIMEOUT_S)
            raise
        finally:
            gone.cancel()
            await asyncio.gather(gone, return_exceptions=True)
        if gone.done() and not gone.cancelled():
            raise KvTransferError("unreachable", "the producer closed the connection mid-read")
        return burst.over

    def _receive_buffers(self, plan: TransferPlan, staging: torch.Tensor | None) -> list[Any]:
        if plan.mode == "direct":
            return [as_wire(self._copier.run_view(run.local_start, run.count))
                    for run in plan.runs]
        assert staging is not None
        return [as_wire(staging[start:stop]) for start, stop in plan.layer_chunks(self._layout)]

    async def _await_payload(self, plan: TransferPlan, receives: list[asyncio.Future[Any]],
                             final: asyncio.Future[dict[str, Any]], staging: torch.Tensor | None,
                             local: list[int], scatters: list[asyncio.Future[None]]) -> None:
        """Until every receive completed (scattering staged chunks as they land), or the
        final status came first: a failure, or the producer hung up (IncompleteReadError)."""
        if staging is None:
            together: asyncio.Future[Any] = asyncio.gather(*receives)
            together.add_done_callback(lambda f: f.cancelled() or f.exception())
            done, _ = await asyncio.wait({together, final}, return_when=asyncio.FIRST_COMPLETED)
            if together not in done and TransferStatus.decode(final.result()).status != STATUS_OK:
                return  # the producer gave up: what is still pending never comes
            await together  # a transport error (the endpoint failed) propagates
            return
        chunks = plan.layer_chunks(self._layout)
        index = {future: i for i, future in enumerate(receives)}
        pending: set[asyncio.Future[Any]] = set(receives)
        while pending:
            waiting = pending if final.done() else pending | {final}
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for future in done & pending:
                pending.discard(future)
                future.result()  # a transport error (the endpoint failed) propagates
                start, stop = chunks[index[future]]
                scatter = functools.partial(self._copier.scatter, staging, local, start, stop)
                scatters.append(asyncio.ensure_future(
                    copy(self._runtime, staging[start:stop].nbytes, scatter)))
            if final in done and TransferStatus.decode(final.result()).status != STATUS_OK:
                return

    def _drop(self, peer: _Peer) -> None:
        connection, peer.connection = peer.connection, None
        if connection is not None:
            close_writer(connection.writer)
            if connection.rkey is not None:
                connection.rkey.destroy()  # before its endpoint; no read is in flight
            abort_endpoint(connection.endpoint)

    async def _drop_all(self) -> None:
        for peer in self._peers.values():
            self._drop(peer)
        self._peers.clear()


def _resolve_threadsafe(loop: asyncio.AbstractEventLoop, future: asyncio.Future[None]) -> None:
    """Resolve ``future`` on ``loop`` from any thread (a loop already closed: nobody waits)."""
    def resolve() -> None:
        if not future.done():
            future.set_result(None)
    try:
        loop.call_soon_threadsafe(resolve)
    except RuntimeError:
        pass


def _worker_handle() -> int:
    """The process's UCX worker (ucxx's one worker, which the runtime started)."""
    import ucxx

    return int(ucxx.get_ucp_worker())


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.IncompleteReadError):
        return "the producer closed the connection"
    return repr(exc)


def _loopback_hint(host: str) -> str:
    if not is_loopback(host):
        return ""
    return (" (the producer advertised a loopback address, which reaches only this host: "
            "a prefill replica on another host must advertise a routable KV address)")
