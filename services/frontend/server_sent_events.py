"""A stream of response chunks written as server-sent events, for OpenAI's HTTP clients.

Owns the bytes of the ``*Events`` streams: each chunk as one ``data: {json}`` event (with an
``event:`` name for the Responses API's typed events) in a ``google.api.HttpBody`` (which
Envoy's transcoder passes through as is), the JSON printed as the transcoder prints messages (OpenAI's snake_case names,
zero values included), an OpenAI-shaped error event when the stream fails after its first
event, and ``data: [DONE]`` last, as OpenAI and vLLM end their streams.

A failure before the first event is raised instead, so that the call ends with its gRPC
status and the HTTP client gets a proper error status (Envoy's ``convert_grpc_status``).
It does not own the chunks themselves (``openai_api``) or the mapping of failures to
statuses (``errors``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import TypeVar

import grpc
import grpc.aio
from google.api import httpbody_pb2
from google.protobuf import json_format
from google.protobuf.message import Message

from services.frontend.errors import status_of

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)

CONTENT_TYPE = "text/event-stream"
DONE = b"data: [DONE]\n\n"

# OpenAI's error "type" for the statuses a stream can end with after it began.
_ERROR_TYPES = {
    grpc.StatusCode.INVALID_ARGUMENT: "invalid_request_error",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "rate_limit_error",
}


# Lists of numbers (google.protobuf.ListValue) whose numbers are integers (token ids, a
# token's UTF-8 bytes): printed as integers, as Envoy's transcoder prints them (Python's
# printer writes 5.0).
_INTEGER_LISTS = frozenset({"token_ids", "prompt_token_ids", "bytes"})


def event(chunk: Message, name: str | None = None) -> bytes:
    """One chunk as one event (named ``name``, if given); the JSON is a single line, as SSE
    requires."""
    body = json_format.MessageToDict(chunk, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)
    text = json.dumps(_integer_lists(body), ensure_ascii=False)
    data = b"data: " + text.encode() + b"\n\n"
    return data if name is None else b"event: " + name.encode() + b"\n" + data


def _integer_lists(value: object) -> object:
    if isinstance(value, dict):
        return {key: [int(t) for t in item] if key in _INTEGER_LISTS and isinstance(item, list)
                else _integer_lists(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_integer_lists(item) for item in value]
    return value


def error_event(error: Exception) -> bytes:
    """``{"error": {...}}`` in OpenAI's shape (the ``openai`` SDK raises it as an APIError)."""
    status = status_of(error)
    if status is None:
        logger.exception("unexpected error in an event stream", exc_info=error)
        status = (grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}")
    code, message = status
    body = {"error": {"message": message, "type": _ERROR_TYPES.get(code, "server_error"),
                      "param": None, "code": code.name.lower()}}
    return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"


async def write_events(chunks: AsyncGenerator[M, None], context: grpc.aio.ServicerContext,
                       name: Callable[[M], str] | None = None) -> None:
    """Writes every chunk as an event (named by ``name``, as the Responses API's events
    are), then ``[DONE]``; closes ``chunks`` on the way out (a client that went away cancels
    this call, which must abort the generation)."""
    started = False
    async with aclosing(chunks):
        try:
            async for chunk in chunks:
                await context.write(_body(event(chunk, None if name is None else name(chunk))))
                started = True
        except Exception as error:  # noqa: BLE001 - after the first event it must be an event
            if not started:
                raise
            await context.write(_body(error_event(error)))
    await context.write(_body(DONE))


def _body(data: bytes) -> httpbody_pb2.HttpBody:
    return httpbody_pb2.HttpBody(content_type=CONTENT_TYPE, data=data)
