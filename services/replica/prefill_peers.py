"""A decode replica's calls to prefill replicas: ``Prefill``, then ``ReleaseKv``.

Owns one gRPC channel per prefill replica (reused across requests), the Prefill stream read as
the engine's records (``RemoteKvChunk`` announcements, then the ``RemotePrefill`` result) and
the fire-and-forget release once the decode side has pulled the blocks (or given up on them).
A channel whose last connection attempt failed gets ``connect_wait_s`` to connect before its
Prefill fails, unless nothing listens at the peer's address any more (a TCP connection there is
refused: the replica is dead, and its Prefill fails at once), and reconnects within a second
of a restart.
It does not move KV: the decode engine core pulls the blocks over UCX with the handles the
stream carries. The call has no deadline; the prefill replica's keepalives show it alive while
the prompt queues, and a silence of ``silence_timeout_s`` ends it. Closing the stream before
its result cancels the call, which aborts the request on the prefill replica, and releases
whatever it pinned.

A release always cancels the request's Prefill call first, if it is still open (``release``):
the prefill replica must hear "give up" (the call's cancellation, which aborts the request
there) before "free the blocks" (ReleaseKv), or a release that overtakes the prompt's end frees
nothing and the result's pin stays until its lease ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator
from typing import Any, cast

import grpc
import grpc.aio

from engine_common.generation_request import GenerationRequest
from engine_common.outputs import RemoteKvChunk, RemotePrefill, RemotePrefillLost
from protos.tandem.v1 import engine_pb2 as epb
from protos.tandem.v1 import engine_pb2_grpc as epb_grpc
from services.engine_api.messages import (
    kv_handle_from_pb,
    sampling_params_to_pb,
    token_logprobs_from_pb,
)
from services.suite_tls import SuiteTls, aio_channel

logger = logging.getLogger(__name__)

# NOTE: gRPC's default reconnect backoff (1 s growing to 120 s) kept a channel to a prefill
# replica that had been down failing for up to tens of seconds after it was back (its calls
# failed fast, and the gateway sent the prompts to be computed here): reconnect as the
# gateway's registry does.
# (Not its minimum: gRPC takes that for the connect timeout too, and a peer that accepts the
# TCP connection but is too stalled to answer must be left to the silence timeout.)
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


async def _refused(peer: str, timeout_s: float) -> bool:
    """Whether a TCP connection to ``peer`` (host:port, [v6]:port) is refused outright. A
    peer that accepts, or does not answer within ``timeout_s`` (a host gone silent), or an
    address this cannot read, is not known to be dead: False."""
    host, sep, port = peer.rpartition(":")
    if not sep or not port.isdigit():
        return False
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(host.strip("[]"), int(port)), timeout_s)
    except ConnectionRefusedError:
        return True
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return False


class PrefillFailed(RemotePrefillLost):
    """The prefill replica could not be used; ``reason`` goes into the fallback metric,
    ``code`` is the status its Prefill call ended with (None: it answered, but wrongly)."""

    def __init__(self, reason: str, detail: str, code: grpc.StatusCode | None = None):
        super().__init__(reason, detail)
        self.code = code


class PrefillPeers:
    def __init__(self, keepalive_s: float = 5.0, silence_timeout_s: float = 30.0,
                 tls: SuiteTls | None = None, announce_kv: bool = False,
                 connect_wait_s: float = 2.0) -> None:
        # NOTE: no deadline on the whole call. Under a queue past capacity a prompt waits at
        # the prefill replica for minutes, and a fixed deadline (it was 120 s) then gave up on
        # prompts about to run and computed them again here, under this replica's small
        # fallback caps (issue 27, workload B: 16-28 of 48 requests). Instead the prefill
        # replica sends a keepalive every ``keepalive_s`` while the prompt waits or computes,
        # and only ``silence_timeout_s`` without any message means it is lost. The client's
        # own deadline still bounds the whole request.
        self.keepalive_s = keepalive_s
        self.silence_timeout_s = silence_timeout_s
        # Ask prefill replicas to announce KV blocks as they become final (--kv-overlap), so
        # that the engine pulls them while later chunks of the prompt are computed.
        self.announce_kv = announce_kv
        # With the suite's mutual TLS, only a suite member's certificate is accepted: a
        # request naming any other address fails its Prefill and falls back.
        self.tls = tls
        # A channel whose last connection attempt failed (its replica just restarted) gets
        # this long to connect before its Prefill fails UNAVAILABLE: a prefill replica the
        # gateway routes to is up, and recomputing here costs far more than the wait.
        self.connect_wait_s = connect_wait_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._releases: set[asyncio.Task[None]] = set()
        # Prefill calls still open, by (peer, request id): ``release`` cancels them first.
        self._open: dict[tuple[str, str], grpc.aio.UnaryStreamCall] = {}

    def _channel(self, peer: str) -> grpc.aio.Channel:
        channel = self._channels.get(peer)
        if channel is None:
            channel = self._channels[peer] = aio_channel(peer, self.tls, CHANNEL_OPTIONS)
        return channel

    def _stub(self, peer: str) -> epb_grpc.EngineStub:
        return epb_grpc.EngineStub(self._channel(peer))

    async def _connected(self, peer: str) -> None:
        """A channel to ``peer`` whose last connection attempt failed (a call on it would
        fail at once) gets up to ``connect_wait_s`` to connect, unless the peer's port
        refuses a TCP connection meanwhile (dead: PrefillFailed "unreachable" at once);
        PrefillFailed UNAVAILABLE when it does not connect in time. Any other state goes
        ahead: the call itself connects, or waits for the attempt under way, and a silent
        peer is the silence timeout's to give up on."""
        channel = self._channel(peer)
        failing = grpc.ChannelConnectivity.TRANSIENT_FAILURE
        if channel.get_state(try_to_connect=True) != failing:
            return
        # NOTE: the probe runs beside the wait, not before it: a peer that drops packets (a
        # partition) would otherwise cost its timeout and then the wait again.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.connect_wait_s
        ready = asyncio.ensure_future(channel.channel_ready())
        probe = asyncio.ensure_future(_refused(peer, self.connect_wait_s))
        waiting: set[asyncio.Future[Any]] = {ready, probe}
        try:
            while not ready.done():
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise PrefillFailed(
                        "prefill_failed", f"{peer} did not accept a connection within "
                        f"{self.connect_wait_s:g} s", grpc.StatusCode.UNAVAILABLE)
                done, waiting = await asyncio.wait(waiting, timeout=remaining,
                                                   return_when=asyncio.FIRST_COMPLETED)
                if probe in done and not ready.done() and probe.result():
                    # Dead, not restarting: waiting out connect_wait_s here cost every
                    # prompt that named a killed prefill replica 2 s before it was handed
                    # back (or computed here), while a replica the gateway routes to again
                    # listens already.
                    raise PrefillFailed("unreachable", f"{peer} refused a connection "
                                        "(nothing listens there)", grpc.StatusCode.UNAVAILABLE)
        finally:
            for task in (ready, probe):
                task.cancel()

    async def prefill(self, peer: str, request_id: str, request: GenerationRequest,
                      announce_kv: bool = False
                      ) -> AsyncGenerator[RemoteKvChunk | RemotePrefill, None]:
        """The prefill replica's stream: with ``announce_kv`` the chunks it announces, then
        its result, the last item. Raises ``PrefillFailed`` when it ends otherwise."""
        message = epb.PrefillRequest(
            request_id=request_id, prompt_token_ids=request.prompt_token_ids,
            sampling_params=sampling_params_to_pb(request.params),
            cache_salt=request.cache_salt or "", priority=request.priority,
            lora_name=request.lora_name or "", announce_kv=announce_kv,
            keepalive_s=self.keepalive_s)
        await self._connected(peer)
        call = self._stub(peer).Prefill(message)
        self._open[(peer, request_id)] = call
        done = False
        try:
            while (response := await self._next(peer, call)) is not None:
                if response.keepalive:
                    continue
                if response.HasField("first_token_id"):
                    result = self._result(peer, request_id, request, response)
                    done = True
                    yield result
                    return
                if not response.HasField("kv_handle"):
                    raise PrefillFailed("prefill_failed", f"{peer} announced no KV handle")
                yield RemoteKvChunk(kv_handle_from_pb(response.kv_handle, request_id),
                                    response.first_block)
        except grpc.aio.AioRpcError as error:
            raise PrefillFailed(
                "prefill_failed", f"{peer} answered {error.code().name}: {error.details()}",
                error.code()) from error
        finally:
            if self._open.get((peer, request_id)) is call:
                del self._open[(peer, request_id)]
            if not done:
                # Given up (cancelled here, or the stream failed): the prefill replica aborts
                # the request when its call ends; what it pinned for it (announced blocks, or
                # every block if its answer crossed the cancellation) is freed now, not when
                # the lease ends.
                call.cancel()
                self.release(peer, request_id, "")
        raise PrefillFailed("prefill_failed", f"{peer} ended the Prefill stream without a result")

    async def _next(self, peer: str, call: grpc.aio.UnaryStreamCall
                    ) -> epb.PrefillResponse | None:
        """The stream's next message (None at its end); PrefillFailed after a silence.

        NOTE: ``asyncio.timeout``, not ``asyncio.wait_for``: Python 3.11's ``wait_for``
        returns the result instead of raising CancelledError when its task is cancelled in
        the same loop iteration as the read completes (an announcement arriving as the client
        cancels), so the reader of a cancelled request read on to the result, which then
        stayed pinned on the prefill replica (issue 34: seen in the decode replica's log, 1
        round in 16-25 of 4 concurrent cancels under load)."""
        try:
            async with asyncio.timeout(self.silence_timeout_s):
                response = await call.read()
        except TimeoutError:
            # A replica that cannot even send a keepalive is as good as gone (hung, or its
            # host unreachable without a reset): UNAVAILABLE, so the request is handed back.
            raise PrefillFailed(
                "prefill_failed", f"{peer} sent nothing, not even a keepalive, for "
                f"{self.silence_timeout_s:g} s", grpc.StatusCode.UNAVAILABLE) from None
        return None if response is grpc.aio.EOF else cast(epb.PrefillResponse, response)

    @staticmethod
    def _result(peer: str, request_id: str, request: GenerationRequest,
                response: epb.PrefillResponse) -> RemotePrefill:
        if not response.HasField("kv_handle"):
            raise PrefillFailed("prefill_failed", f"{peer} returned no KV handle")
        return RemotePrefill(
            handle=kv_handle_from_pb(response.kv_handle, request_id),
            first_token_id=response.first_token_id,
            first_logprobs=token_logprobs_from_pb(response.first_token_logprobs)
            if response.HasField("first_token_logprobs") else None,
            prompt_logprobs=None if request.params.prompt_logprobs is None
            else [token_logprobs_from_pb(p) for p in response.prompt_logprobs])

    def release(self, peer: str, request_id: str, engine_id: str) -> None:
        """Tell the prefill replica it may free the request's blocks; never waits. If this
        is lost, the lease frees them anyway.

        NOTE: a Prefill call of the request still open is cancelled first, here, rather than
        left to the task reading its stream: that task's cancellation is asynchronous (the
        ReleaseKv went out first), and it could be lost altogether (see ``_next``). Then the
        prefill replica, never told to give up, finished the prompt after the ReleaseKv had
        found nothing to free, and the result's pin stayed for its whole lease (issue 34,
        tests/test_pd_overlap.py::test_cancelling_mid_stream_frees_both_sides)."""
        call = self._open.pop((peer, request_id), None)
        if call is not None:
            call.cancel()
        task = asyncio.get_running_loop().create_task(self._release(peer, request_id, engine_id))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, peer: str, request_id: str, engine_id: str) -> None:
        try:
            await self._stub(peer).ReleaseKv(
                epb.ReleaseKvRequest(request_id=request_id, engine_id=engine_id), timeout=10)
        except grpc.aio.AioRpcError as error:
            logger.info("ReleaseKv(%s) on %s failed (%s); its lease will free the blocks",
                        request_id, peer, error.code().name)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
