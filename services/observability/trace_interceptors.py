"""W3C trace context across every gRPC hop of the suite, as server and client interceptors.

Owns the spans of the calls that carry requests: on the server side, a SERVER span per call
of the public ``tandem.v1.Generation`` methods that generate and of the internal
``Engine.Generate``, ``Prefill``, ``ReleaseKv`` and ``Abort``, a child of the caller's span
named in the call's ``traceparent`` metadata (Envoy passes an HTTP client's header through as
metadata) and current while the handler runs; on the client side (every internal channel), a
CLIENT span per such call with its ``traceparent`` added to the call's metadata. Gateway ->
decode replica -> prefill replica is then one trace. Health checks, load polls and KV-event
watches are not traced (they are not requests). Without tracing both pass calls through
untouched. It does not own where spans go (``tracing``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import grpc.aio
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from services.handler_wrapping import Behaviour, wrap_unary_request
from services.observability.request_log import OBSERVED_METHODS
from services.observability.tracing import tracer, tracing_enabled

_PROPAGATOR = TraceContextTextMapPropagator()
TRACED_METHODS = {
    **OBSERVED_METHODS,
    "tandem.v1.Engine": OBSERVED_METHODS["tandem.v1.Engine"] | {"ReleaseKv", "Abort"},
}


def traced_name(method: str | bytes) -> str | None:
    """``service/method`` of a traced full method name ("/pkg.Service/Method"), else None."""
    text = method.decode() if isinstance(method, bytes) else method
    service, _, name = text.lstrip("/").partition("/")
    return f"{service}/{name}" if name in TRACED_METHODS.get(service, ()) else None


def _rpc_attributes(name: str) -> dict[str, str]:
    service, _, method = name.partition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}


class TraceServerInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        name = traced_name(handler_call_details.method)
        if handler is None or name is None or not tracing_enabled():
            return handler
        return wrap_unary_request(handler, lambda behaviour: _traced(name, behaviour))


def _traced(name: str, behaviour: Behaviour) -> Behaviour:
    async def traced(request: Any, context: grpc.aio.ServicerContext) -> Any:
        carrier = {key: value for key, value in context.invocation_metadata() or ()
                   if isinstance(value, str)}
        parent = _PROPAGATOR.extract(carrier)
        with tracer().start_as_current_span(
                name, context=parent, kind=SpanKind.SERVER, attributes=_rpc_attributes(name),
                record_exception=False, set_status_on_exception=False) as span:
            try:
                return await behaviour(request, context)
            except BaseException as error:
                code = ("CANCELLED" if isinstance(error, asyncio.CancelledError)
                        else _code_name(context.code()))
                span.set_attribute("rpc.grpc.status_code", code)
                span.set_status(Status(StatusCode.ERROR, code))
                raise
    return traced


def _code_name(code: Any) -> str:
    return code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"


class _ClientSpans:
    def __init__(self, target: str) -> None:
        self.target = target  # host:port of the channel's server
        self._ending: set[asyncio.Task[None]] = set()  # held until done (tasks are weak)

    def _start(self, details: grpc.aio.ClientCallDetails, request: Any,
               ) -> tuple[trace.Span | None, grpc.aio.ClientCallDetails]:
        name = traced_name(details.method)
        if name is None or not tracing_enabled():
            return None, details
        attributes: dict[str, str] = {**_rpc_attributes(name), "server.address": self.target}
        prefill_peer = getattr(request, "prefill_peer", "")
        if prefill_peer:
            attributes["tandem.prefill_peer"] = prefill_peer
        span = tracer().start_span(name, kind=SpanKind.CLIENT, attributes=attributes)
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *carrier.items())
        return span, grpc.aio.ClientCallDetails(details.method, details.timeout, metadata,
                                                details.credentials, details.wait_for_ready)

    async def _intercept(self, continuation: Callable[..., Any],
                         client_call_details: grpc.aio.ClientCallDetails, request: Any) -> Any:
        span, details = self._start(client_call_details, request)
        call = await continuation(details, request)
        if span is not None:
            call.add_done_callback(lambda done: self._end_later(span, done))
        return call


    def _end_later(self, span: trace.Span, call: Any) -> None:
        """End the client span of a call that just ended (its status is read
        asynchronously)."""
        task = asyncio.get_running_loop().create_task(_end(span, call))
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)


class _UnaryUnary(_ClientSpans, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Callable[..., Any],
                                    client_call_details: grpc.aio.ClientCallDetails,
                                    request: Any) -> Any:
        return await self._intercept(continuation, client_call_details, request)


class _UnaryStream(_ClientSpans, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Callable[..., Any],
                                     client_call_details: grpc.aio.ClientCallDetails,
                                     request: Any) -> Any:
        return await self._intercept(continuation, client_call_details, request)


def trace_client_interceptors(target: str) -> list[grpc.aio.ClientInterceptor]:
    """The interceptors for a channel to ``target``: one per call kind (a grpc.aio channel
    files an interceptor under the first kind it implements only)."""
    return [_UnaryUnary(target), _UnaryStream(target)]


async def _end(span: trace.Span, call: Any) -> None:
    try:
        code = await call.code()
    except (asyncio.CancelledError, grpc.RpcError):
        code = grpc.StatusCode.CANCELLED
    span.set_attribute("rpc.grpc.status_code", _code_name(code))
    if code != grpc.StatusCode.OK:
        span.set_status(Status(StatusCode.ERROR, _code_name(code)))
    span.end()
