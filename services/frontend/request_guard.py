"""What stands between the wire and every RPC handler: a request that does not decode, or
breaks a limit, is refused with INVALID_ARGUMENT before any handler sees it.

Owns ``RequestGuard``, a grpc.aio server interceptor. It wraps each method's request
deserializer: bytes that are not the method's protobuf message (random bytes, a bit flip,
invalid UTF-8 in a string, JSON nested past what the decoder takes) and a decoded request
over a limit of ``request_limits`` become a ``Refused`` record instead of raising (grpc.aio
would answer UNKNOWN, echo the decoder's error and log a traceback for each); the wrapped
handler then aborts the call with INVALID_ARGUMENT and the refusal's message. An undecodable
request is logged in one line. It does not own the limits (``request_limits``) or the
statuses of failures inside handlers (``errors.rpc_handler``).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
from google.protobuf.message import Message

from services.frontend.errors import InvalidArgument, bounded_message, quoted
from services.frontend.request_limits import MAX_JSON_DEPTH, check_request

logger = logging.getLogger(__name__)

_TOO_DEEP = "MaxDepth"


@dataclass(frozen=True)
class Refused:
    """A request refused before its handler: what the caller is told."""

    message: str


Deserializer = Callable[[bytes], Any]


def guarded(deserialize: Deserializer, method: str) -> Deserializer:
    """``deserialize`` that returns a ``Refused`` rather than raise, and checks the limits of
    what it decodes."""

    def decode(raw: bytes) -> Any:
        try:
            request = deserialize(raw)
        except Exception as error:  # noqa: BLE001 - a deserializer's failure is the client's
            message = undecodable(raw, deserialize, error)
            logger.info("refused a request to %s (%d bytes) that does not decode: %s",
                        method, len(raw), quoted(str(error), 200))
            return Refused(message)
        if isinstance(request, Message):
            try:
                check_request(request)
            except InvalidArgument as error:
                return Refused(error.message)
        return request

    return decode


def undecodable(raw: bytes, deserialize: Deserializer, error: Exception) -> str:
    """What to tell the sender of bytes that do not decode."""
    owner = getattr(deserialize, "__self__", None)
    name = owner.DESCRIPTOR.full_name if owner is not None and hasattr(
        owner, "DESCRIPTOR") else "the method's request message"
    if _TOO_DEEP in str(error):
        field = _too_deep_field(raw, deserialize)
        return (f"{field or 'a JSON value of the request'} nests JSON objects and lists more "
                f"than {MAX_JSON_DEPTH} levels deep; flatten it")
    reason = str(error).rpartition(": ")[2] or type(error).__name__
    return (f"the request is not a valid {name} (protobuf: {quoted(reason, 80)}); "
            "serialize it from tandem.v1's protos, with valid UTF-8 in every string")


def _too_deep_field(raw: bytes, deserialize: Deserializer) -> str | None:
    """The top-level field that does not decode alone for its depth: each message-typed
    field's bytes are decoded on their own, so the whole request is read once more at most."""
    owner = getattr(deserialize, "__self__", None)
    descriptor = getattr(owner, "DESCRIPTOR", None)
    if descriptor is None:
        return None
    fields = _top_level_fields(raw)
    for number in dict.fromkeys(number for number, _, _ in fields):
        field = descriptor.fields_by_number.get(number)
        if field is None or field.message_type is None:
            continue
        try:
            deserialize(b"".join(raw[start:end] for n, start, end in fields if n == number))
        except Exception as error:  # noqa: BLE001 - the decoder's reason is all we want
            if _TOO_DEEP in str(error):
                return str(field.name)
    return None


def _top_level_fields(raw: bytes) -> list[tuple[int, int, int]]:
    """(field number, start, end) of each top-level field of protobuf bytes; [] where they
    do not parse (groups are not used by tandem.v1)."""
    fields, at = [], 0
    try:
        while at < len(raw):
            start = at
            tag, at = _varint(raw, at)
            wire_type = tag & 7
            if wire_type == 0:
                _, at = _varint(raw, at)
            elif wire_type == 1:
                at += 8
            elif wire_type == 2:
                length, at = _varint(raw, at)
                at += length
            elif wire_type == 5:
                at += 4
            else:
                return []
            if at > len(raw):
                return []
            fields.append((tag >> 3, start, at))
    except IndexError:
        return []
    return fields


def _varint(raw: bytes, at: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = raw[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7


async def _refuse(context: grpc.aio.ServicerContext, refused: Refused) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bounded_message(refused.message))


def _guard_unary_request(behaviour: Callable[..., Any]) -> Callable[..., Any]:
    """A handler taking one request: refused ones are aborted before ``behaviour`` runs."""
    if inspect.isasyncgenfunction(behaviour):
        async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, Refused):
                await _refuse(context, request)
            async for response in behaviour(request, context):
                yield response
        return streaming

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Refused):
            await _refuse(context, request)
        result = behaviour(request, context)
        return await result if inspect.isawaitable(result) else result
    return unary


def _guard_stream_request(behaviour: Callable[..., Any]) -> Callable[..., Any]:
    """A handler reading a stream of requests: the call is aborted at a refused one."""
    def checked(requests: AsyncIterator[Any],
                context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async def each() -> AsyncIterator[Any]:
            async for request in requests:
                if isinstance(request, Refused):
                    await _refuse(context, request)
                yield request
        return each()

    if inspect.isasyncgenfunction(behaviour):
        async def streaming(requests: AsyncIterator[Any],
                            context: grpc.aio.ServicerContext) -> Any:
            async for response in behaviour(checked(requests, context), context):
                yield response
        return streaming

    async def unary(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        result = behaviour(checked(requests, context), context)
        return await result if inspect.isawaitable(result) else result
    return unary


_KINDS = {
    "unary_unary": (grpc.unary_unary_rpc_method_handler, _guard_unary_request),
    "unary_stream": (grpc.unary_stream_rpc_method_handler, _guard_unary_request),
    "stream_unary": (grpc.stream_unary_rpc_method_handler, _guard_stream_request),
    "stream_stream": (grpc.stream_stream_rpc_method_handler, _guard_stream_request),
}


class RequestGuard(grpc.aio.ServerInterceptor):
    """Refuses undecodable requests and requests over a limit with INVALID_ARGUMENT (see the
    module docstring). Put it last among a server's interceptors: the others then see the
    refusal as the call's status."""

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        for kind, (build, guard) in _KINDS.items():
            behaviour = getattr(handler, kind)
            if behaviour is not None:
                return build(guard(behaviour),
                             request_deserializer=guarded(handler.request_deserializer,
                                                          handler_call_details.method),
                             response_serializer=handler.response_serializer)
        return handler
