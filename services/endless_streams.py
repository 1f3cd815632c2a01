"""Ending a server's endless streams (health, load and KV-event watches) when it stops.

Owns ``EndlessStreams``, a grpc.aio server interceptor that runs each call of an endless
method beside the server's "stopping" signal and, once ``end`` gives it, stops the call's
behaviour and closes the stream with UNAVAILABLE ("the server is stopping"), so the watcher
reconnects elsewhere or later. It does not own the watches themselves (the servicers) or
the order of a server's shutdown (the servers call ``end`` before ``grpc.aio.Server.stop``).

NOTE: without it, ``Server.stop(grace)`` leaves such a call waiting on its closing
operation forever; ``asyncio.run`` cancels it at exit and grpc.aio logs an ERROR with a
CancelledError traceback per watcher ("Exception not handled by _handle_exceptions"), at
every clean shutdown of a replica a gateway watched.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import grpc.aio

from services.handler_wrapping import Behaviour, wrap_unary_request

# Server-streaming methods that never end by themselves.
ENDLESS_METHODS = frozenset({
    "/grpc.health.v1.Health/Watch",
    "/tandem.v1.Engine/WatchLoad",
    "/tandem.v1.Engine/WatchKvEvents",
})

STOPPING_MESSAGE = "the server is stopping"


class EndlessStreams(grpc.aio.ServerInterceptor):
    def __init__(self) -> None:
        self._stopping = asyncio.Event()

    def end(self) -> None:
        """Close every endless stream now, and any that opens from here on."""
        self._stopping.set()

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method not in ENDLESS_METHODS:
            return handler
        return wrap_unary_request(handler, self._until_stopping)

    def _until_stopping(self, behaviour: Behaviour) -> Behaviour:
        async def until_stopping(request: Any, context: grpc.aio.ServicerContext) -> Any:
            serving = asyncio.ensure_future(behaviour(request, context))
            stopping = asyncio.ensure_future(self._stopping.wait())
            try:
                await asyncio.wait((serving, stopping), return_when=asyncio.FIRST_COMPLETED)
            finally:
                stopping.cancel()
                if not serving.done():
                    serving.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await serving
            if serving.cancelled():
                await context.abort(grpc.StatusCode.UNAVAILABLE, STOPPING_MESSAGE)
            return serving.result()
        return until_stopping
