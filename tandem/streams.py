"""Iterators over server-streaming calls that convert each message and own the call's end.

Owns ``ResponseStream`` (sync) and ``AsyncResponseStream`` (grpc.aio): each yields converted
messages, turns a failed call into a ``TandemError``, and cancels the RPC when the caller
stops early, whether by ``close()``/``aclose()``, leaving a ``with`` block, cancelling the
awaiting task, or dropping the iterator (``break`` out of a ``for`` loop). It does not own
what the messages mean (``results``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import TracebackType
from typing import Any, Generic, TypeVar

import grpc

from tandem.errors import error_from_rpc

T = TypeVar("T")


class ResponseStream(Generic[T]):
    """A sync iterator over one server-streaming call."""

    def __init__(self, call: Any, convert: Callable[[Any], T]) -> None:
        self._call = call  # grpc's _MultiThreadedRendezvous: an iterator and a grpc.Future
        self._convert = convert
        self._done = False

    def __iter__(self) -> ResponseStream[T]:
        return self

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        try:
            message = next(self._call)
        except StopIteration:
            self._done = True
            raise
        except grpc.RpcError as error:
            self._done = True
            raise error_from_rpc(error) from error
        return self._convert(message)

    def cancel(self) -> None:
        """Cancels the RPC if it is still running; iteration then stops."""
        if not self._done:
            self._done = True
            self._call.cancel()

    close = cancel

    def __enter__(self) -> ResponseStream[T]:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cancel()

    def __del__(self) -> None:
        # A `break` out of a for loop drops the last reference: the RPC must not live on.
        if getattr(self, "_done", True) is False:
            self.cancel()


class AsyncResponseStream(Generic[T]):
    """An async iterator over one grpc.aio server-streaming call."""

    def __init__(self, call: Any, convert: Callable[[Any], T]) -> None:
        self._call = call  # grpc.aio.UnaryStreamCall
        self._convert = convert
        self._done = False

    def __aiter__(self) -> AsyncResponseStream[T]:
        return self

    async def __anext__(self) -> T:
        if self._done:
            raise StopAsyncIteration
        try:
            message = await self._call.read()
        except grpc.RpcError as error:  # grpc.aio.AioRpcError
            self._done = True
            raise error_from_rpc(error) from error
        except asyncio.CancelledError:
            self.cancel()
            raise
        if message is grpc.aio.EOF:
            self._done = True
            raise StopAsyncIteration
        return self._convert(message)

    def cancel(self) -> None:
        """Cancels the RPC if it is still running; iteration then stops."""
        if not self._done:
            self._done = True
            self._call.cancel()

    async def aclose(self) -> None:
        self.cancel()

    async def __aenter__(self) -> AsyncResponseStream[T]:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cancel()

    def __del__(self) -> None:
        if getattr(self, "_done", True) is False:
            try:
                self.cancel()
            except RuntimeError:  # the event loop is already closed: the call died with it
                pass
