"""Forwarding one tokenized request to the replicas the picker chooses, surviving failures.

Owns the request path below the public API: snapshot, pick, ``Engine.Generate`` on the
chosen decode (or ``both``) replica naming the chosen prefill peer, and streaming its
responses back. A replica that fails before the first token is replaced by another (a
retry); one that fails after it is replaced by another that continues from the prompt plus
the tokens already sent (``resume_output_token_ids``, a resumption), so the client sees every
token once. The streams of one request share a ``RouteAffinity``: the first choice of each
prompt is routed, the prompt's other choices follow it to the same replicas (one prompt, one
prefix cache) unless those failed them; each prompt of a request is routed on its own. The client's cancellation and deadline travel upstream. It does not own the
OpenAI-shaped messages (``services.replica.openai_api``) or the choice itself (``picker``).
"""

from __future__ import annotations

import contextvars
import itertools
import logging
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc
import grpc.aio

from engine_common.block_hash import BlockHash
from gateway.load import LoadTracker
from gateway.metrics import GatewayMetrics
from gateway.picker import NoReplicaError, PickerConfig, RoutingDecision, pick
from gateway.prefix_index import PrefixIndex
from gateway.registry import ReplicaRegistry
from gateway.snapshot import take_snapshot
from protos.tandem.v1 import engine_pb2
from services.replica.engine_messages import delta_from_response, sampling_params_to_pb
from services.replica.errors import ServiceError
from services.replica.openai_api import EngineRequest, GenerationDelta

logger = logging.getLogger(__name__)

# Failures that say "this replica, not this request": another replica may well succeed.
RETRIABLE_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.CANCELLED,  # the replica shut down under us (ours would be CancelledError)
    grpc.StatusCode.RESOURCE_EXHAUSTED,
})


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


@dataclass
class RouteAffinity:
    """Streams that should land together (the choices of one prompt of a request): per
    prompt (and cache salt), the first one's route, which the others take while its replicas
    are still routable and have not failed them."""

    # By (cache salt, LoRA adapter, prompt).
    routes: dict[tuple[str, str, tuple[int, ...]], Route] = field(default_factory=dict)


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
        self.metrics.picks.labels(decision.decode.address, "decode").inc()
        self.index.expect(decision.decode.address, snapshot.block_hashes)
        if decision.prefill is not None:
            self.metrics.picks.labels(decision.prefill.address, "prefill").inc()
            self.index.expect(decision.prefill.address, snapshot.block_hashes)
        self.metrics.prefix_match_fraction.observe(decision.decode.prefix_fraction)
        self.metrics.routing_latency.observe(time.perf_counter() - started)
        return Route(decision, snapshot.block_hashes)

    def _follow(self, affinity: RouteAffinity | None, key: tuple[str, str, tuple[int, ...]],
                failed: set[str]) -> Route | None:
        """The route a sibling stream took, when its replicas can still take this one."""
        route = None if affinity is None else affinity.routes.get(key)
        if route is None:
            return None
        decision = route.decision
        addresses = [decision.decode.address]
        if decision.prefill is not None:
            addresses.append(decision.prefill.address)
        for address in addresses:
            replica = self.registry.get(address)
            if address in failed or replica is None or not replica.routable:
                return None
        self.metrics.picks.labels(decision.decode.address, "decode").inc()
        if decision.prefill is not None:
            self.metrics.picks.labels(decision.prefill.address, "prefill").inc()
        return route

    async def generate(
        self, request: engine_pb2.GenerateRequest, timeout: float | None = None
    ) -> AsyncGenerator[engine_pb2.GenerateResponse, None]:
        """Stream ``request``'s responses from whichever replicas serve it.

        ``request.output_options.return_token_ids`` decides whether responses carry token
        ids (the gateway always asks for them upstream: it needs them to resume). Raises
        ``ProxyError`` when the request cannot be completed.
        """
        policy = self.retry_policy
        affinity = route_affinity.get()
        deadline = None if timeout is None else time.monotonic() + timeout
        started = time.monotonic()
        client_wants_ids = request.output_options.return_token_ids
        prompt = list(request.prompt_token_ids) + list(request.resume_output_token_ids)
        affinity_key = (request.cache_salt, request.lora_name, tuple(prompt))
        sent: list[int] = []  # output tokens already streamed to the client
        failed: set[str] = set()
        attempts = resumptions = 0
        first_token_seen = False
        last_code: grpc.StatusCode | None = None
        while True:
            # A retry or a resumption picks afresh: the shared replicas may be the trouble.
            followed = (self._follow(affinity, affinity_key, failed)
                        if attempts + resumptions == 0 else None)
            try:
                route = followed or self.route(prompt + sent, request.cache_salt,
                                               frozenset(failed), request.lora_name)
            except NoReplicaError as e:
                self.metrics.no_replica.inc()
                if not sent and last_code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    # Every replica that could serve it is full: that is overload (429 over
                    # HTTP), not an outage.
                    raise ProxyError(grpc.StatusCode.RESOURCE_EXHAUSTED, (
                        f"every eligible replica is at capacity ({len(failed)} tried); "
                        "retry later")) from e
                if sent:
                    self.metrics.resumptions.labels("no_replica").inc()
                    raise ProxyError(grpc.StatusCode.UNAVAILABLE, (
                        f"the replica serving this stream failed after {len(sent)} tokens and "
                        f"no other replica can continue it: {e}")) from e
                raise ProxyError(grpc.StatusCode.UNAVAILABLE, str(e)) from e
            if affinity is not None:
                affinity.routes.setdefault(affinity_key, route)
            decision = route.decision
            upstream = engine_pb2.GenerateRequest()
            upstream.CopyFrom(request)
            upstream.request_id = (
                request.request_id if attempts + resumptions == 0
                else f"{request.request_id}.{attempts + resumptions}")
            upstream.output_options.return_token_ids = True
            if decision.prefill is not None:
                upstream.prefill_peer = decision.prefill.address
            else:
                upstream.ClearField("prefill_peer")
            del upstream.resume_output_token_ids[:]
            upstream.resume_output_token_ids.extend(list(request.resume_output_token_ids) + sent)
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise ProxyError(grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed")
            decode = decision.decode.address
            replica = self.registry.get(decode)
            if replica is None:  # removed between the snapshot and now
                failed.add(decode)
                continue
            resuming = bool(sent)
            sent_before = len(sent)
            self.loads.stream_started(decode)
            prefill = decision.prefill.address if decision.prefill is not None else None
            if prefill is not None:
                self.loads.stream_started(prefill)
            call = replica.engine.Generate(upstream, timeout=remaining)
            got_response = False
            error: grpc.aio.AioRpcError | None = None
            try:
                async for response in call:
                    if not got_response and prefill is not None:
                        self.loads.stream_finished(prefill)
                        prefill = None
                    got_response = True
                    tokens = list(response.new_token_ids)
                    if tokens and not first_token_seen:
                        first_token_seen = True
                        self.metrics.time_to_first_token.observe(time.monotonic() - started)
                    sent.extend(tokens)
                    # Counts as the client sees them, whichever replicas produced the tokens.
                    response.prompt_tokens = len(prompt)
                    response.completion_tokens = len(sent)
                    response.cached_tokens = min(response.cached_tokens, len(prompt))
                    if not client_wants_ids:
                        del response.new_token_ids[:]
                    yield response
                    if response.HasField("finish_reason"):
                        return
            except grpc.aio.AioRpcError as e:
                error = e
            finally:
                call.cancel()
                self.loads.stream_finished(decode)
                if prefill is not None:
                    self.loads.stream_finished(prefill)
            failed.add(decode)
            if affinity is not None and affinity.routes.get(affinity_key) is route:
                del affinity.routes[affinity_key]  # the siblings still to start pick afresh
            if not got_response and followed is None:  # the blocks the pick expected
                self.index.retract(decode, route.block_hashes)
            if error is not None:
                code, details = error.code(), error.details() or ""
            else:
                code, details = grpc.StatusCode.UNAVAILABLE, "the stream ended without a finish"
            last_code = code
            if resuming and len(sent) == sent_before and code in REFUSAL_CODES:
                # The replica refused the continuation itself (e.g. it does not support
                # resume_output_token_ids): say so rather than pass on a confusing status.
                self.metrics.resumptions.labels("refused").inc()
                raise ProxyError(grpc.StatusCode.UNAVAILABLE, (
                    f"the stream broke after {len(sent)} tokens and replica {decode} refused "
                    f"to resume it: {code.name}: {details}"))
            if code not in RETRIABLE_CODES:
                raise ProxyError(code, details)
            if not sent:
                attempts += 1
                if attempts >= policy.max_attempts:
                    raise ProxyError(code, (
                        f"{attempts} replicas failed this request; the last one, {decode}, "
                        f"said: {details}"))
                self.metrics.retries.labels(code.name).inc()
                logger.info("request %s: %s failed before the first token (%s); retrying",
                            request.request_id, decode, code.name)
                continue
            if resumptions >= policy.max_resumptions:
                self.metrics.resumptions.labels("gave_up").inc()
                raise ProxyError(grpc.StatusCode.UNAVAILABLE, (
                    f"replica {decode} failed after {len(sent)} tokens of this stream "
                    f"({code.name}: {details}); not resumed"))
            resumptions += 1
            self.metrics.resumptions.labels("resumed").inc()
            logger.info("request %s: %s failed after %d tokens (%s); resuming elsewhere",
                        request.request_id, decode, len(sent), code.name)


class ProxiedServiceError(ServiceError):
    """A ``ProxyError`` in the shape the public servicer turns into a status."""

    def __init__(self, error: ProxyError) -> None:
        super().__init__(error.message)
        self.code = error.code


# The public call's remaining time, set by the servicer for the request it is handling (each
# RPC runs in its own task, so each sees its own value).
call_timeout: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "call_timeout", default=None)
# The public call's affinity, set by the servicer likewise: the streams of its choices (tasks
# that inherit the call's context) all see the same one.
route_affinity: contextvars.ContextVar[RouteAffinity | None] = contextvars.ContextVar(
    "route_affinity", default=None)


class RemoteEngine:
    """A ``GenerateFn`` (``services.replica.openai_api``) over the replicas: the public
    ``tandem.v1.Generation`` servicer runs on it exactly as it runs on a local engine."""

    def __init__(self, proxy: EngineProxy) -> None:
        self.proxy = proxy

    async def generate(self, request_id: str,
                       request: EngineRequest) -> AsyncGenerator[GenerationDelta, None]:
        message = engine_pb2.GenerateRequest(
            request_id=request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=sampling_params_to_pb(request.params),
            cache_salt=request.cache_salt or "",
            priority=request.priority,
            lora_name=request.lora_name or "",
            # The deltas carry token ids, as a local engine's do (return_token_ids needs them).
            output_options=engine_pb2.OutputOptions(return_token_ids=True),
        )
        responses = self.proxy.generate(message, timeout=call_timeout.get())
        async with aclosing(responses):
            try:
                async for response in responses:
                    yield delta_from_response(response)
            except ProxyError as error:
                raise ProxiedServiceError(error) from error
