"""``rpc_handler``: a write into a call that already ended is the client's cancellation, not
an internal error (the fuzz suite's watchers, leaving after 2 s, once made a replica log
"unexpected error in WatchLoad" with grpcio's ExecuteBatchError from ``context.write``)."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from grpc._cython.cygrpc import ExecuteBatchError

from services.frontend.errors import rpc_handler


class _EndedCall:
    """The two methods of a servicer context a handler uses, for a call whose client left:
    grpcio's own error from a write, and an abort that records its status."""

    def __init__(self) -> None:
        self.aborted: list[grpc.StatusCode] = []

    async def write(self, message: bytes) -> None:
        raise ExecuteBatchError('Failed "execute_batch": (SendMessageOperation,)')

    async def abort(self, code: grpc.StatusCode, *args: object) -> None:
        self.aborted.append(code)
        raise RuntimeError("aborted")


class _Servicer:
    @rpc_handler
    async def Watch(self, request: bytes, context: _EndedCall) -> None:  # noqa: N802
        await context.write(b"report")

    @rpc_handler
    async def Broken(self, request: bytes, context: _EndedCall) -> None:  # noqa: N802
        raise ValueError("a bug")


def test_a_write_into_an_ended_call_ends_the_handler_as_a_cancellation(
        caplog: pytest.LogCaptureFixture) -> None:
    context = _EndedCall()
    with caplog.at_level(logging.DEBUG), pytest.raises(asyncio.CancelledError):
        asyncio.run(_Servicer().Watch(b"", context))  # type: ignore[arg-type]
    assert context.aborted == []
    assert not [record for record in caplog.records if record.levelno >= logging.WARNING]


def test_any_other_failure_is_still_internal_and_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    context = _EndedCall()
    with pytest.raises(RuntimeError, match="aborted"):
        asyncio.run(_Servicer().Broken(b"", context))  # type: ignore[arg-type]
    assert context.aborted == [grpc.StatusCode.INTERNAL]
    assert any("unexpected error in Broken" in record.message for record in caplog.records)
