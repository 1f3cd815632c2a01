"""Wrapping a gRPC server handler's behaviour, for the server interceptors that observe calls
(request logs, traces, the gateway's request metrics).

Owns rebuilding the handler of a unary-request method around a wrapped behaviour. The suite's
servicers are coroutines for unary and streaming responses alike (streams write with
``context.write``; gRPC forbids mixing that with yielding), so one wrapper serves both kinds.
Handlers of streamed requests come back unchanged. It does not own what a wrapper does.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import grpc.aio

Behaviour = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]


def wrap_unary_request(handler: grpc.RpcMethodHandler,
                       wrap: Callable[[Behaviour], Behaviour]) -> grpc.RpcMethodHandler:
    """``handler`` with its behaviour replaced by ``wrap(behaviour)``, if it takes a unary
    request; else ``handler`` itself."""
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(
            wrap(handler.unary_unary), handler.request_deserializer, handler.response_serializer)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            wrap(handler.unary_stream), handler.request_deserializer, handler.response_serializer)
    return handler
