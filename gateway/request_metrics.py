"""The gateway's per-method request metrics, as a gRPC server interceptor.

Owns counting each finished call of the ``tandem.v1.Generation`` methods that generate, by
method and status code, and timing it from arrival to its last response. Wrapping the
handlers keeps the servicer the replica's own, unchanged. It does not own the metrics'
definitions (``metrics``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import grpc.aio

from gateway.metrics import GatewayMetrics
from services.handler_wrapping import Behaviour, wrap_unary_request

# The methods observed: those that run requests through the engine.
OBSERVED_METHODS = frozenset({
    "Complete", "CompleteStream", "CompleteEvents", "ChatComplete", "ChatCompleteStream",
    "ChatCompleteEvents", "CreateResponse", "CreateResponseStream", "CreateResponseEvents",
})
_SERVICE_PREFIX = "/tandem.v1.Generation/"


class RequestMetricsInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        full_name = handler_call_details.method
        method = full_name.removeprefix(_SERVICE_PREFIX)
        if handler is None or not full_name.startswith(_SERVICE_PREFIX) or (
                method not in OBSERVED_METHODS):
            return handler
        return wrap_unary_request(handler, lambda behaviour: self._observed(method, behaviour))

    def _observed(self, method: str, behaviour: Behaviour) -> Behaviour:
        async def observed(request: Any, context: grpc.aio.ServicerContext) -> Any:
            started, code = time.monotonic(), "OK"
            try:
                return await behaviour(request, context)
            except BaseException as error:
                code = _code_of(error, context)
                raise
            finally:
                self._record(method, code, started)
        return observed

    def _record(self, method: str, code: str, started: float) -> None:
        self.metrics.requests.labels(method, code).inc()
        self.metrics.request_latency.labels(method).observe(time.monotonic() - started)


def _code_of(error: BaseException, context: grpc.aio.ServicerContext) -> str:
    if isinstance(error, asyncio.CancelledError):
        return "CANCELLED"
    status = context.code()
    return status.name if isinstance(status, grpc.StatusCode) else "UNKNOWN"
