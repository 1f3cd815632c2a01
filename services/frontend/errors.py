"""How a failed request becomes a gRPC status, in one place for every servicer.

Owns ``ServiceError`` (an error that already knows its status code and a message a person can
act on, and may name OpenAI's error code and the field at fault: sent as a
``google.rpc.ErrorInfo`` in the status details) and ``rpc_handler``, the decorator every RPC handler wears: it turns
``ServiceError``, the engine's own input errors (``SamplingParamsError``,
``StructuredOutputError``, ``InvalidRequestError``: INVALID_ARGUMENT) and a dead engine core
(UNAVAILABLE) into the call's status, and anything else into INTERNAL (logged with its
traceback). It also owns keeping what a client sent out of unbounded messages: ``quoted``
shows at most a few dozen characters of a client's value, and every status message is cut to
``MAX_STATUS_MESSAGE_BYTES`` (it travels in the call's trailers, and an HTTP/2 peer that gets
a header block over its limit drops the connection, every other stream on it included). It
does not own deciding when a request is wrong (``validation``, ``request_limits``) or
overloaded (``admission``). Cancellation (client gone, deadline) is never caught here: it must reach the
engine's stream so the request is aborted and its blocks freed. A write that fails because
the call already ended (the client left between two messages) is that same cancellation,
seen from the write's side, and ends the handler as one.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
import grpc.aio
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc._cython.cygrpc import ExecuteBatchError

from engine_common.core_process import EngineDeadError
from engine_common.input_processor import InvalidRequestError
from engine_common.sampling_params import SamplingParamsError
from engine_common.structured_output.spec import StructuredOutputError

logger = logging.getLogger(__name__)

S = TypeVar("S")
Req = TypeVar("Req")
R = TypeVar("R")

# The grpc-message trailer is percent-encoded (up to 3 bytes per byte of UTF-8): 1 KiB of
# message stays under 3 KiB on the wire, far below the 8 KiB gRPC clients and Envoy take
# without complaint in a whole header block.
MAX_STATUS_MESSAGE_BYTES = 1024
# Where gRPC carries a status's details (a google.rpc.Status), and the domain of ours.
STATUS_DETAILS_KEY = "grpc-status-details-bin"
ERROR_DOMAIN = "tandem"
# How many characters of a client's value an error message shows.
QUOTED_CHARS = 64


class ServiceError(Exception):
    """A request failed for a reason the caller should see as ``code`` and ``message``.

    ``reason`` (OpenAI's error code, such as "model_not_found") and ``param`` (the request
    field at fault) travel as a ``google.rpc.ErrorInfo`` in the status's details, which the
    HTTP edge turns into the error body's ``code`` and ``param``."""

    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, *, reason: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.param = param


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class AlreadyExists(ServiceError):
    code = grpc.StatusCode.ALREADY_EXISTS


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class Overloaded(ServiceError):
    """The bounded waiting queue is full; the caller should retry later or elsewhere."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    """The engine is dead or the replica is shutting down; another replica may serve it."""

    code = grpc.StatusCode.UNAVAILABLE


class FailedPrecondition(ServiceError):
    """The RPC does not apply to this replica as configured (e.g. its role)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


def quoted(value: object, limit: int = QUOTED_CHARS) -> str:
    """``value`` as an error message shows it: its repr, cut to ``limit`` characters (and then
    saying how long it was), so that no client's value makes a message unbounded."""
    if not isinstance(value, str):  # a number, None...: as Python shows it
        text = repr(value)
        return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value):,} characters)"


def bounded_message(message: str, limit: int = MAX_STATUS_MESSAGE_BYTES) -> str:
    """``message`` cut to ``limit`` bytes of UTF-8 (on a character boundary), saying so."""
    data = message.encode("utf-8", "replace")
    if len(data) <= limit:
        return message
    note = f"... (cut at {limit} bytes)"
    return data[:limit - len(note)].decode("utf-8", "ignore") + note


def status_of(error: Exception) -> tuple[grpc.StatusCode, str] | None:
    """The status a known failure maps to, or None for an unexpected one (a bug)."""
    if isinstance(error, ServiceError):
        return error.code, error.message
    if isinstance(error, SamplingParamsError | InvalidRequestError | StructuredOutputError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    if isinstance(error, EngineDeadError):
        return grpc.StatusCode.UNAVAILABLE, f"the engine is not running: {error}"
    return None


def _error_details(error: Exception, code: grpc.StatusCode,
                   message: str) -> tuple[tuple[str, bytes], ...]:
    """The trailing metadata that carries ``error``'s reason and param, if it has any."""
    reason = error.reason if isinstance(error, ServiceError) else None
    param = error.param if isinstance(error, ServiceError | SamplingParamsError) else None
    if reason is None and param is None:
        return ()
    info = error_details_pb2.ErrorInfo(reason=reason or code.name.lower(), domain=ERROR_DOMAIN)
    if param is not None:
        info.metadata["param"] = param
    details = any_pb2.Any()
    details.Pack(info)
    status = status_pb2.Status(code=code.value[0], message=message, details=[details])
    return ((STATUS_DETAILS_KEY, status.SerializeToString()),)


def rpc_handler(
    method: Callable[[S, Req, grpc.aio.ServicerContext], Awaitable[R]],
) -> Callable[[S, Req, grpc.aio.ServicerContext], Awaitable[R]]:
    """Decorate an RPC handler (a coroutine; streaming ones write with ``context.write``) so
    that its failure ends the call with the status it maps to."""

    @functools.wraps(method)
    async def handler(self: S, request: Req, context: grpc.aio.ServicerContext) -> R:
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise  # the handler already chose a status
        except ExecuteBatchError as error:
            # NOTE: grpcio raises this from ``context.write`` when the call ended before the
            # write (a client's deadline or cancel racing the handler: the fuzz suite's 2 s
            # watchers hit it); the handler's own cleanup already ran as it propagated.
            logger.debug("%s: the call ended before a write: %s", method.__name__, error)
            raise asyncio.CancelledError from error
        except Exception as error:  # noqa: BLE001 - every failure must become a status
            status = status_of(error)
            if status is None:
                logger.exception("unexpected error in %s", method.__name__)
                status = (grpc.StatusCode.INTERNAL,
                          f"internal error: {type(error).__name__}: {error}")
            message = bounded_message(status[1])
            await context.abort(status[0], message, _error_details(error, status[0], message))
            raise AssertionError("context.abort returned") from error  # it always raises

    return handler
