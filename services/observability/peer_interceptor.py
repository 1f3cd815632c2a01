"""Which replicas served a request, as a client interceptor of the suite's channels.

Owns noting, in the current request's record (``request_record``), the replica each of its
internal calls went to: an ``Engine.Generate`` stream ran on the channel's replica (decode,
or both) and names in ``prefill_peer`` the replica asked to prefill its prompt; an
``Engine.Prefill`` ran on the channel's replica. The gateway's log line then names the
decode and prefill replicas of a request, and a decode replica's the prefill replica it
asked. The calls themselves pass through unchanged. It does not own the channel
(``services.suite_tls``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc.aio

from services.observability.request_record import current_request

_GENERATE = "/tandem.v1.Engine/Generate"
_PREFILL = "/tandem.v1.Engine/Prefill"


def _method(details: grpc.aio.ClientCallDetails) -> str:
    method = details.method
    return method.decode() if isinstance(method, bytes) else str(method)


class _PeerNotes:
    def __init__(self, target: str) -> None:
        self.target = target  # the replica this channel reaches (host:port)

    def _note(self, details: grpc.aio.ClientCallDetails, request: Any) -> None:
        record = current_request()
        if record is None:
            return
        method = _method(details)
        if method == _GENERATE:
            record.note_replica(self.target, "decode")
            if request.HasField("prefill_peer"):
                record.note_replica(request.prefill_peer, "prefill")
        elif method == _PREFILL:
            record.note_replica(self.target, "prefill")


class _UnaryUnary(_PeerNotes, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Callable[..., Any],
                                    client_call_details: grpc.aio.ClientCallDetails,
                                    request: Any) -> Any:
        self._note(client_call_details, request)
        return await continuation(client_call_details, request)


class _UnaryStream(_PeerNotes, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Callable[..., Any],
                                     client_call_details: grpc.aio.ClientCallDetails,
                                     request: Any) -> Any:
        self._note(client_call_details, request)
        return await continuation(client_call_details, request)


def peer_interceptors(target: str) -> list[grpc.aio.ClientInterceptor]:
    """The interceptors for a channel to ``target``: one per call kind (a grpc.aio channel
    files an interceptor under the first kind it implements only)."""
    return [_UnaryUnary(target), _UnaryStream(target)]
