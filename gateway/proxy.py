"""Forwarding one tokenized request to the replicas the picker chooses, surviving failures.

Owns the request path below the public API: snapshot, pick, ``Engine.Generate`` on the
chosen decode (or ``both``) replica naming the chosen prefill peer, and streaming its
responses back. A replica that fails before the first token is replaced by another (a
retry); one that fails after it is replaced by another that continues from the prompt plus
the tokens already sent (``resume_output_token_ids``, a resumption), so the client sees every
token once. The streams of one public call share its ``CallContext``: its deadline bounds
every attempt, and its ``routes`` remember, per prompt, where the first stream went, so the
prompt's other choices follow it to the same replicas (one prompt, one prefix cache) unless
those failed them; each prompt of a request is routed on its own. It does not own the
OpenAI-shaped messages (``services.frontend``), the seam (``remote_engine``) or the choice
itself (``picker``). A decode replica whose prefill replica is down hands the request back
before its first token (``services.engine_api.prefill_handback``): it is sent again with
another prefill replica, or none (the decode replica computes the prompt); that prefill
replica, and one a decode replica's KV fallback blames, leaves rotation at once. With no
decode replica left, the picker names a prefill replica to run the request (or resume the
stream) whole; ``role_fallback`` counts and logs it. A resumption's outcome is counted once it
is known (``resumed`` when the new replica answers).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

import grpc
import grpc.aio

from engine_common.block_hash import BlockHash
from gateway.load import LoadTracker
from gateway.metrics import GatewayMetrics
from gateway.picker import NoReplicaError, PickerConfig, RoutingDecision, pick
from gateway.prefix_index import PrefixIndex
from gateway.registry import ReplicaRegistry
from gateway.role_fallback import RoleFallbacks
from gateway.snapshot import take_snapshot
from protos.tandem.v1 import engine_pb2
from services.engine_api.prefill_handback import HANDBACK_CODE, handback_metadata
from services.frontend.engine_seam import CallContext

logger = logging.getLogger(__name__)

# How long a finished stream waits for the replica's closing status before it is cancelled.
_STATUS_WAIT_S = 1.0

# Failures that say "this replica, not this request": another replica may well succeed.
RETRIABLE_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.CANCELLED,  # the replica shut down under us (ours would be CancelledError)
    grpc.StatusCode.RESOURCE_EXHAUSTED,
})


# A decode replica's KV fallbacks that say the prefill replica (or the way to it) is broken,
# so other requests should not be sent there for a while. Not: a lease that ran out or a
# request the prefill replica no longer knows (slow, not broken).
PREFILL_FAULTS = frozenset({"prefill_failed", "unreachable", "timeout", "layout_mismatch",
                            "protocol"})


# What a replica answers to a continuation it cannot take (say, one that predates
# resume_output_token_ids): resuming elsewhere would meet the same answer.
REFUSAL_CODES = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
})


class ProxyError(Exception):
    """The request ends with this status; ``message`` tells the caller what happened."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class RetryPolicy:
    # Replicas tried before the first token (the first attempt included).
    max_attempts: int = 3
    # Times a stream broken after its first token is continued elsewhere; 0 ends it with
    # UNAVAILABLE instead.
    max_resumptions: int = 2


@dataclass(frozen=True)
class Route:
    decision: RoutingDecision
    # The prompt's block hashes, as the decision scored them.
    block_hashes: list[BlockHash]

    @property
    def addresses(self) -> list[str]:
        decision = self.decision
        prefill = [] if decision.prefill is None else [decision.prefill.address]
        return [decision.decode.address, *prefill]


# Streams that should land together: the choices of one prompt (and cache salt and adapter).
AffinityKey = tuple[str, str, tuple[int, ...]]


@dataclass
class _Stream:
    """One request's progress across the replicas that serve it."""

    request: engine_pb2.GenerateRequest
    call: CallContext
    started: float = field(default_factory=time.monotonic)
    sent: list[int] = field(default_factory=list)  # output tokens streamed to the client
    failed: set[str] = field(default_factory=set)
    attempts: int = 0  # replicas that failed before the first token
    resumptions: int = 0
    handbacks: int = 0  # attempts a decode replica handed back (its prefill replica down)
    first_token_seen: bool = False
    last_code: grpc.StatusCode | None = None
    # Broken after its first token and being resumed; its outcome is counted once known.
    resuming: bool = False

    @property
    def prompt(self) -> list[int]:
        return list(self.request.prompt_token_ids) + list(self.request.resume_output_token_ids)

    @property
    def affinity_key(self) -> AffinityKey:
        return (self.request.cache_salt, self.request.lora_name, tuple(self.prompt))

    @property
    def tries(self) -> int:
        return self.attempts + self.resumptions


@dataclass
class _Attempt:
    """One upstream call and how it ended."""

    route: Route
    followed: bool  # the route a sibling stream took, not a fresh pick
    sent_before: int = 0  # output tokens the client had when it began: > 0, a resumption
    got_response: bool = False
    finished: bool = False
    error: grpc.aio.AioRpcError | None = None

    @property
    def decode(self) -> str:
        return self.route.decision.decode.address


class EngineProxy:
    def __init__(
        self,
        registry: ReplicaRegistry,
        loads: LoadTracker,
        index: PrefixIndex,
        metrics: GatewayMetrics,
        picker_config: PickerConfig | None = None,
        retry_policy: RetryPolicy | None = None,
    ) -> None:
        self.registry = registry
        self.loads = loads
        self.index = index
        self.metrics = metrics
        self.picker_config = picker_config or PickerConfig()
        self.retry_policy = retry_policy or RetryPolicy()
        self._tie_breaks = itertools.count()
        self._closing: set[asyncio.Task[None]] = set()  # finished calls awaiting their status
        self.role_fallbacks = RoleFallbacks(metrics)

    def route(
        self, prompt_token_ids: list[int], cache_salt: str = "",
        exclude: frozenset[str] = frozenset(), lora_name: str = "",
    ) -> Route:
        """Pick replicas for a prompt, count the pick and note where its blocks will be
        (raises ``NoReplicaError``)."""
        started = time.perf_counter()
        snapshot = take_snapshot(
            self.registry, self.loads, self.index, prompt_token_ids, cache_salt, lora_name)
        decision = pick(
            snapshot.replicas, len(prompt_token_ids), snapshot.block_size, self.picker_config,
            exclude=exclude, tie_break=next(self._tie_breaks), lora_name=lora_name)
        self.metrics.routing_decisions.labels(decision.reason, decision.pd_reason).inc()
        self.role_fallbacks.observe(decision)
        self.metrics.picks.labels(decision.decode.address, "decode").inc()
        self.index.expect(decision.decode.address, snapshot.block_hashes)
        if decision.prefill is not None:
            self.metrics.picks.labels(decision.prefill.address, "prefill").inc()
            self.index.expect(decision.prefill.address, snapshot.block_hashes)
        self.metrics.prefix_match_fraction.observe(decision.decode.prefix_fraction)
        self.metrics.routing_latency.observe(time.perf_counter() - started)
        return Route(decision, snapshot.block_hashes)

    async def generate(self, request: engine_pb2.GenerateRequest,
                       call: CallContext) -> AsyncGenerator[engine_pb2.GenerateResponse, None]:
        """Stream ``request``'s responses from whichever replicas serve it, within ``call``
        (its deadline; its routes, shared with the call's other streams).

        ``request.output_options.return_token_ids`` decides whether responses carry token
        ids (the gateway always asks for them upstream: it needs them to resume). Raises
        ``ProxyError`` when the request cannot be completed.
        """
        stream = _Stream(request, call)
        try:
            while True:
                attempt = self._choose(stream)
                if self.registry.get(attempt.decode) is None:  # removed since the snapshot
                    stream.failed.add(attempt.decode)
                    continue
                attempt.sent_before = len(stream.sent)
                async for response in self._forward(stream, attempt):
                    yield response
                if attempt.finished:
                    return
                self._after_failure(stream, attempt)
        finally:
            # Ended while a resumption was under way: a status, a deadline or the client.
            self._resumption_outcome(stream, "failed")

    def _resumption_outcome(self, stream: _Stream, outcome: str) -> None:
        """Count how the stream's resumption ended, once: when it is known, not when the
        resumption begins (no replica may take it)."""
        if stream.resuming:
            stream.resuming = False
            self.metrics.resumptions.labels(outcome).inc()

    def _choose(self, stream: _Stream) -> _Attempt:
        """The route of the next attempt: a sibling's, on the first try, while its
        replicas can take it; else a fresh pick (a retry or a resumption picks afresh: the
        shared replicas may be the trouble)."""
        key = stream.affinity_key
        if stream.tries == 0:
            followed = stream.call.routes.get(key)
            if followed is not None and self._can_follow(followed, stream.failed):
                return _Attempt(followed, followed=True)
        try:
            route = self.route(stream.prompt + stream.sent, stream.request.cache_salt,
                               frozenset(stream.failed), stream.request.lora_name)
        except NoReplicaError as error:
            raise self._no_replica(stream, error) from error
        stream.call.routes.setdefault(key, route)
        return _Attempt(route, followed=False)

    def _can_follow(self, route: Route, failed: set[str]) -> bool:
        for address in route.addresses:
            replica = self.registry.get(address)
            if address in failed or replica is None or not replica.routable:
                return False
        decision = route.decision
        self.metrics.picks.labels(decision.decode.address, "decode").inc()
        if decision.prefill is not None:
            self.metrics.picks.labels(decision.prefill.address, "prefill").inc()
        return True

    def _no_replica(self, stream: _Stream, error: NoReplicaError) -> ProxyError:
        self.metrics.no_replica.inc()
        if not stream.sent and stream.last_code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            # Every replica that could serve it is full: that is overload (429 over HTTP),
            # not an outage.
            return ProxyError(grpc.StatusCode.RESOURCE_EXHAUSTED, (
                f"every eligible replica is at capacity ({len(stream.failed)} tried); "
                "retry later"))
        if stream.sent:
            self._resumption_outcome(stream, "no_replica")
            return ProxyError(grpc.StatusCode.UNAVAILABLE, (
                f"the replica serving this stream failed after {len(stream.sent)} tokens and "
                f"no other replica can continue it: {error}"))
        return ProxyError(grpc.StatusCode.UNAVAILABLE, str(error))

    def _upstream(self, stream: _Stream, route: Route) -> engine_pb2.GenerateRequest:
        """The request as the replica gets it: its own id per try, token ids always (to
        resume), the chosen prefill peer, and every output token already sent."""
        request = stream.request
        upstream = engine_pb2.GenerateRequest()
        upstream.CopyFrom(request)
        if stream.tries + stream.handbacks:
            upstream.request_id = f"{request.request_id}.{stream.tries + stream.handbacks}"
        upstream.output_options.return_token_ids = True
        if route.decision.prefill is not None:
            upstream.prefill_peer = route.decision.prefill.address
        else:
            upstream.ClearField("prefill_peer")
        upstream.resume_output_token_ids.extend(stream.sent)
        return upstream

    async def _forward(self, stream: _Stream,
                       attempt: _Attempt) -> AsyncGenerator[engine_pb2.GenerateResponse, None]:
        """One upstream call, its responses relayed; how it ended is left in ``attempt``."""
        remaining = stream.call.time_remaining()
        if remaining is not None and remaining <= 0:
            raise ProxyError(grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed")
        decision = attempt.route.decision
        replica = self.registry.get(attempt.decode)
        assert replica is not None  # checked by the caller, on this event-loop turn
        prefill = decision.prefill.address if decision.prefill is not None else None
        for address in (attempt.decode, prefill):
            if address is not None:
                self.loads.stream_started(address)
        # The prompt tokens this sends to be computed, until the first token shows them done
        # (the replica's report has them only after its next step).
        computing = decision.prefill or decision.decode
        pending = round(len(stream.prompt) * (1.0 - computing.prefix_fraction))
        self.loads.prefill_sent(computing.address, pending)
        # The replica hands back a request whose prefill replica is down: this picks again.
        call = replica.engine.Generate(self._upstream(stream, attempt.route), timeout=remaining,
                                       metadata=handback_metadata())
        try:
            async for response in call:
                if not attempt.got_response:
                    self.loads.prefill_done(computing.address, pending)
                    pending = 0
                if not attempt.got_response and prefill is not None:
                    self.loads.stream_finished(prefill)  # its part ends with the first token
                    prefill = None
                if response.HasField("kv_transfer"):  # once the KV came, or did not
                    self._check_prefill(attempt, response)
                attempt.got_response = True
                if attempt.sent_before:
                    self._resumption_outcome(stream, "resumed")
                yield self._relay(stream, response)
                if response.HasField("finish_reason"):
                    attempt.finished = True
                    return
        except grpc.aio.AioRpcError as error:
            attempt.error = error
        finally:
            if attempt.finished:
                self._close_after_status(call)
            else:
                call.cancel()
            for address in (attempt.decode, prefill):
                if address is not None:
                    self.loads.stream_finished(address)
            self.loads.prefill_done(computing.address, pending)

    def _close_after_status(self, call: grpc.aio.UnaryStreamCall) -> None:
        """End a call whose last message came: once the replica's status arrives (it follows
        at once), or after ``_STATUS_WAIT_S``.

        NOTE: cancelling at once made the replica log the call as CANCELLED at random, not
        as served; the wait runs beside the request, so the client's stream ends without it.
        """
        task = asyncio.create_task(_cancel_after_status(call))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _check_prefill(self, attempt: _Attempt,
                       response: engine_pb2.GenerateResponse) -> None:
        """How the prompt's KV got to the decode replica (on the first response for a failed
        Prefill, on a later one for a failed pull): a fallback that blames the prefill
        replica takes it out of rotation at once."""
        prefill = attempt.route.decision.prefill
        reason = response.kv_transfer.fallback_reason
        if prefill is not None and reason in PREFILL_FAULTS:
            self.registry.report_failure(
                prefill.address, f"decode replica {attempt.decode} fell back ({reason})")

    def _relay(self, stream: _Stream,
               response: engine_pb2.GenerateResponse) -> engine_pb2.GenerateResponse:
        """The response as the client sees it: counts over every replica that served the
        stream, token ids only where the client asked for them."""
        tokens = list(response.new_token_ids)
        if tokens and not stream.first_token_seen:
            stream.first_token_seen = True
            self.metrics.time_to_first_token.observe(time.monotonic() - stream.started)
        stream.sent.extend(tokens)
        response.prompt_tokens = len(stream.prompt)
        response.completion_tokens = len(stream.sent)
        response.cached_tokens = min(response.cached_tokens, len(stream.prompt))
        if not stream.request.output_options.return_token_ids:
            del response.new_token_ids[:]
        return response

    def _after_failure(self, stream: _Stream, attempt: _Attempt) -> None:
        """Account for a failed attempt; raises ``ProxyError`` unless another may follow."""
        if self._handed_back(stream, attempt):
            return
        decode, route = attempt.decode, attempt.route
        stream.failed.add(decode)
        if stream.call.routes.get(stream.affinity_key) is route:
            del stream.call.routes[stream.affinity_key]  # the siblings still to start pick afresh
        if not attempt.got_response and not attempt.followed:  # the blocks the pick expected
            self.index.retract(decode, route.block_hashes)
        if attempt.error is not None:
            code, details = attempt.error.code(), attempt.error.details() or ""
        else:
            code, details = grpc.StatusCode.UNAVAILABLE, "the stream ended without a finish"
        stream.last_code = code
        refused = attempt.sent_before and len(stream.sent) == attempt.sent_before
        if refused and code in REFUSAL_CODES:
            # The replica refused the continuation itself (e.g. it does not support
            # resume_output_token_ids): say so rather than pass on a confusing status.
            self._resumption_outcome(stream, "refused")
            raise ProxyError(grpc.StatusCode.UNAVAILABLE, (
                f"the stream broke after {len(stream.sent)} tokens and replica {decode} "
                f"refused to resume it: {code.name}: {details}"))
        if code not in RETRIABLE_CODES:
            raise ProxyError(code, details)
        if not stream.sent:
            self._retry(stream, decode, code, details)
        else:
            self._resume(stream, decode, code, details)

    def _handed_back(self, stream: _Stream, attempt: _Attempt) -> bool:
        """The decode replica handed the request back because its prefill replica is down
        (``prefill_handback``): that one is out (for this request, and of rotation for a
        while), the decode replica is fine, and the next attempt picks again without it. Each
        hand-back excludes one more prefill replica, so this ends."""
        prefill = attempt.route.decision.prefill
        if (attempt.error is None or attempt.error.code() != HANDBACK_CODE
                or attempt.got_response or prefill is None):
            return False
        stream.failed.add(prefill.address)
        stream.handbacks += 1
        if stream.call.routes.get(stream.affinity_key) is attempt.route:
            del stream.call.routes[stream.affinity_key]
        if not attempt.followed:
            for address in attempt.route.addresses:
                self.index.retract(address, attempt.route.block_hashes)
        self.registry.report_failure(
            prefill.address, f"decode replica {attempt.decode} could not reach it")
        self.metrics.retries.labels("prefill_handback").inc()
        logger.info("request %s: prefill replica %s is down; routing it again",
                    stream.request.request_id, prefill.address)
        return True

    def _retry(self, stream: _Stream, decode: str, code: grpc.StatusCode, details: str) -> None:
        stream.attempts += 1
        if stream.attempts >= self.retry_policy.max_attempts:
            raise ProxyError(code, (
                f"{stream.attempts} replicas failed this request; the last one, {decode}, "
                f"said: {details}"))
        self.metrics.retries.labels(code.name).inc()
        logger.info("request %s: %s failed before the first token (%s); retrying",
                    stream.request.request_id, decode, code.name)

    def _resume(self, stream: _Stream, decode: str, code: grpc.StatusCode, details: str) -> None:
        stream.resuming = True
        if stream.resumptions >= self.retry_policy.max_resumptions:
            self._resumption_outcome(stream, "gave_up")
            raise ProxyError(grpc.StatusCode.UNAVAILABLE, (
                f"replica {decode} failed after {len(stream.sent)} tokens of this stream "
                f"({code.name}: {details}); not resumed"))
        stream.resumptions += 1
        logger.info("request %s: %s failed after %d tokens (%s); resuming elsewhere",
                    stream.request.request_id, decode, len(stream.sent), code.name)


async def _cancel_after_status(call: grpc.aio.UnaryStreamCall) -> None:
    with contextlib.suppress(asyncio.TimeoutError, grpc.aio.AioRpcError):
        await asyncio.wait_for(call.code(), _STATUS_WAIT_S)
    call.cancel()
