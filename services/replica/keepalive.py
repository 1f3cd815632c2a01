"""Keepalives between the items of an async stream: a server stream that may be silent for long
(a Prefill queued behind others) still shows its caller, every so often, that it is alive.

Owns the interleaving only: ``with_keepalives`` yields the stream's items and ``None`` each time
``every_s`` seconds pass without one. What a keepalive message looks like is the caller's.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TypeVar

T = TypeVar("T")


async def with_keepalives(items: AsyncIterator[T], every_s: float
                          ) -> AsyncGenerator[T | None, None]:
    """``items``, with None whenever ``every_s`` seconds pass without one (never, if <= 0).

    The pending read runs as a task, so a keepalive never cancels it (cancelling an async
    generator's ``__anext__`` would end the generator); closing this generator cancels it.
    """
    if every_s <= 0:
        async for item in items:
            yield item
        return
    pending: asyncio.Task[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(items))
            done, _ = await asyncio.wait({pending}, timeout=every_s)
            if not done:
                yield None
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            yield item
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            try:
                await pending
            except (asyncio.CancelledError, StopAsyncIteration):
                pass
