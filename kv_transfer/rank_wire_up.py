"""Wiring up a per-rank reader's UCX endpoint over TCP before it reads.

Owns the exchange that makes GETs complete on an endpoint that a consumer rank opened to a
producer rank's worker over TCP: one rendezvous-sized message from the consumer rank on
that endpoint (``wire_up``), which the producer process's worker receives (``answer_wire_ups``,
one service per process, for every cache the process maps). It does not own the reads
(``rank_reader``) or the connector's own wire-up of its control endpoint (``ucx_consumer``,
``ucx_producer``: that one rides on the connection's hello).

NOTE (measured on UCX 1.21, ``bench/tcp_get_wire_up.py``): UCX emulates GETs over TCP
with active messages, and a GET posted on a fresh endpoint never completed (5 s) until a
rendezvous transfer had crossed the endpoint's pair. The connector's control endpoint has
the producer send one (``_until_wired``); for a per-rank reader that did not do: a producer
rank's endpoint back to the consumer is paired with the consumer's only when both are
their worker's same-numbered endpoint to the other (UCX's endpoint matching), and a
consumer process that had reached that rank before (over shared memory, another
connector) is ahead: its GETs still hung (5 s, every try). A rendezvous message the
consumer sends on its own endpoint crosses that endpoint's pair whatever the numbering
(the producer's acknowledgement comes back on it): GETs after it completed with the right
bytes, every try, with and without an endpoint opened before. Only TCP readers send it:
over shared memory GETs are cma reads and need nothing.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np

from kv_transfer.connector import KvTransferError
from kv_transfer.ucx_io import abort_endpoint, post, settle
from kv_transfer.ucx_runtime import UcxRuntime
from kv_transfer.wire import WIRE_UP_BYTES

logger = logging.getLogger(__name__)

# "RW": apart from the connector's tags ("KV", ``wire.payload_tag``); the producer's worker
# receives it from any consumer.
WIRE_UP_TAG = 0x5257 << 48
SERVICE_NAME = "rank-wire-up"
# After a failed receive (the worker closing, a bug): no spinning on the next.
FAILURE_PAUSE_S = 0.1


async def wire_up(endpoint: Any, timeout: float) -> None:
    """Send the wire-up message on ``endpoint`` (opened over TCP to a producer rank's
    worker) and wait until the producer's worker received it; KvTransferError
    ("unreachable") if it does not within ``timeout``."""
    message = np.zeros(WIRE_UP_BYTES, dtype=np.uint8)
    sent = post(endpoint, [(message, WIRE_UP_TAG)], receive=False)
    try:
        await asyncio.wait_for(asyncio.gather(*sent.futures), timeout)
    except TimeoutError:
        abort_endpoint(endpoint)  # withdraws the send
        raise KvTransferError("unreachable", f"the prefill rank did not take the TCP "
                              f"wire-up within {timeout:g} s") from None
    finally:
        await settle(sent)


def answer_wire_ups(runtime: UcxRuntime) -> None:
    """Start this process's receiving service (once; it lives as long as the runtime)."""
    runtime.start_service(SERVICE_NAME, _receive_forever)


async def _receive_forever() -> None:
    """One receive posted at a time: a consumer's message that comes meanwhile waits in
    UCX's unexpected queue (a rendezvous message is held there, not dropped)."""
    import ucxx
    from ucxx._lib.arr import Array
    from ucxx.types import Tag, TagMaskFull

    worker = ucxx.core._get_ctx().worker
    message = np.zeros(WIRE_UP_BYTES, dtype=np.uint8)
    buffer = Array(message)  # kept, with each request, until it completes
    while True:
        request = worker.tag_recv(buffer, Tag(WIRE_UP_TAG), TagMaskFull)
        try:
            await request.future
        except Exception as exc:  # noqa: BLE001 - a consumer gone mid-message; take the next
            logger.warning("a per-rank KV wire-up message failed: %r", exc)
            await asyncio.sleep(FAILURE_PAUSE_S)
