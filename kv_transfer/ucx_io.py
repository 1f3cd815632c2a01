"""The UCX and socket operations both sides of the UCX connector share.

Owns opening and aborting UCX endpoints (always with peer-failure error handling), posting
bursts of tagged sends and receives, waiting out what a transfer left in flight,
running copies off the loop, and tuning the control connection's socket. It does not own
the protocol (``ucx_producer``, ``ucx_consumer``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kv_transfer.ucx_runtime import UcxRuntime

logger = logging.getLogger(__name__)

# Copies up to this size run on the loop itself: a thread hop costs more than they do.
INLINE_COPY_BYTES = 4 * 2**20
# How long aborting an endpoint may wait for UCX's progress thread (ns).
_CLOSE_PERIOD_NS = 100_000_000
# TCP keepalive of the control connection: a peer host that vanishes without closing its
# sockets (power loss, a partition) is noticed after about IDLE + INTERVAL * COUNT seconds.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 1, 1, 2
# ucxx's pool of Python futures holds 100 and is refilled under 50 (see ``post``).
FUTURES_REFILL_EVERY = 40
# Requests of a closed endpoint complete (cancelled) at once; this only bounds a UCX bug.
SETTLE_TIMEOUT_S = 5.0


def is_transport_error(exc: BaseException) -> bool:
    from ucxx.exceptions import UCXError

    return isinstance(exc, UCXError | ConnectionError | OSError | asyncio.IncompleteReadError)


async def open_endpoint(address: bytes) -> Any:
    """A UCX endpoint to the worker at ``address``, with peer-failure error handling (so
    that a dead peer fails its operations, and aborting it is safe at any time)."""
    import ucxx

    return await ucxx.create_endpoint_from_worker_address(
        ucxx.get_ucx_address_from_buffer(address), endpoint_error_handling=True)


def abort_endpoint(endpoint: Any) -> None:
    """Force-close: UCX cancels whatever is in flight on it."""
    try:
        endpoint.abort(period=_CLOSE_PERIOD_NS)
    except Exception:  # closing a dead endpoint may complain; it is gone either way
        pass


@dataclass
class Posted:
    """Tagged sends or receives in flight: their futures, and what must outlive them."""

    futures: list[asyncio.Future[Any]] = field(default_factory=list)
    _keep: list[Any] = field(default_factory=list)  # the buffers' Array wrappers, requests

    def extend(self, other: Posted) -> None:
        self.futures.extend(other.futures)
        self._keep.extend(other._keep)


def post(endpoint: Any, messages: Sequence[tuple[Any, int]], receive: bool) -> Posted:
    """Start a tagged send (or receive) of each (buffer, tag), in this order, at once.

    This is ucxx's ``Endpoint.send``/``recv`` without the coroutine and Task each costs
    (several times the rest under load: a direct pull posts dozens to hundreds). It reaches
    into ``Endpoint._ep``, ucxx's own low-level endpoint (pinned: ucxx 0.52). A request can
    only be withdrawn by closing its endpoint (``abort_endpoint``), not one by one.

    The returned ``Posted`` must be kept until its futures are done: dropping it drops
    the requests, which ucxx then cancels.

    ucxx hands each request a Python future from a pool that its notifier thread refills
    to 100 whenever it falls under 50; a burst that drains it makes ucxx refill it inline
    with a warning each time ("No Futures available during getFuture()"), so a burst tops
    it up itself every ``FUTURES_REFILL_EVERY`` requests, as ucxx's inline path would.
    """
    import ucxx
    from ucxx._lib.arr import Array
    from ucxx.types import Tag, TagMaskFull

    ep = endpoint._ep
    if ep is None:
        raise ConnectionError("the UCX endpoint is closed")
    ep.raise_on_error()
    posted = Posted()
    worker = ucxx.core._get_ctx().worker
    for i, (buffer, tag) in enumerate(messages):
        if i % FUTURES_REFILL_EVERY == 0:
            worker.populate_python_futures_pool()  # a no-op while the pool holds >= 50
        array = Array(buffer)
        request = (ep.tag_recv(array, Tag(tag), TagMaskFull) if receive
                   else ep.tag_send(array, Tag(tag)))
        posted.futures.append(request.future)
        posted._keep.append((array, request))
    return posted


async def settle(posted: Posted) -> None:
    """Wait until every request of ``posted`` is over, errors swallowed. Callers close the
    endpoint first when the requests may never complete by themselves."""
    if not posted.futures:
        return
    _, pending = await asyncio.wait(posted.futures, timeout=SETTLE_TIMEOUT_S)
    if pending:
        logger.error("%d UCX requests still in flight %ss after their endpoint closed",
                     len(pending), SETTLE_TIMEOUT_S)
    for future in posted.futures:
        if future.done() and not future.cancelled():
            future.exception()  # retrieved: no "exception was never retrieved" noise


async def copy(runtime: UcxRuntime, nbytes: int, fn: Callable[[], None]) -> None:
    if nbytes <= INLINE_COPY_BYTES:
        fn()
    else:
        await runtime.run_copy(fn)


def tune_control_socket(writer: asyncio.StreamWriter) -> None:
    """No Nagle delay on the small control frames; keepalive probes for vanished hosts."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_COUNT)


def close_writer(writer: asyncio.StreamWriter) -> None:
    try:
        writer.close()
    except Exception:  # already closed by the peer
        pass
