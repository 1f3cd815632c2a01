"""Exceptions the Tandem SDK raises, one per kind of failure a caller handles differently.

Owns the mapping from a gRPC status to an exception class. It does not own retries (callers
decide: ``OverloadedError`` and ``UnavailableError`` are the retryable ones) nor the servers'
choice of status codes.
"""

from __future__ import annotations

import grpc


class TandemError(Exception):
    """A failed call; ``code`` is the gRPC status, ``details`` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}" if details else code.name)
        self.code = code
        self.details = details


class InvalidRequestError(TandemError):
    """The request was rejected as malformed, or names something that does not exist."""


class AuthenticationError(TandemError):
    """No API key, or a wrong one (``Client(..., api_key=...)`` sends it)."""


class OverloadedError(TandemError):
    """The service is at capacity; retry later, ideally with backoff."""


class UnavailableError(TandemError):
    """No replica could be reached, or one died mid-request."""


class DeadlineExceededError(TandemError):
    """The call's timeout ran out before it finished."""


class CancelledError(TandemError):
    """The call was cancelled (by this client, or by the server on shutdown)."""


_ERROR_BY_CODE: dict[grpc.StatusCode, type[TandemError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.NOT_FOUND: InvalidRequestError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: AuthenticationError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: OverloadedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: CancelledError,
}


def error_from_status(code: grpc.StatusCode, details: str | None) -> TandemError:
    """The exception for a gRPC status; codes without a class of their own give ``TandemError``."""
    return _ERROR_BY_CODE.get(code, TandemError)(code, details or "")


def error_from_rpc(error: grpc.RpcError) -> TandemError:
    """The exception for a failed call (``grpc.RpcError`` or ``grpc.aio.AioRpcError``)."""
    # Both the sync call objects and AioRpcError expose code() and details().
    code = error.code() if callable(getattr(error, "code", None)) else grpc.StatusCode.UNKNOWN  # type: ignore[attr-defined]
    details = error.details() if callable(getattr(error, "details", None)) else str(error)  # type: ignore[attr-defined]
    return error_from_status(code, details)
