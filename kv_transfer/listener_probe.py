"""Whether a KV producer's listener answers: a health check for the replica that hosts it.

Owns one probe: a TCP connection to the producer's advertised KV address, closed at once
without a hello (the producer drops such a connection silently, ``ucx_producer``). A
prefill replica reports SERVING only once this answers, so that a decode replica given its
handles can connect. It does not check UCX itself (the endpoint is made per consumer, at its
hello) or the leases. Loads neither torch nor UCX.
"""

from __future__ import annotations

import asyncio


async def kv_listener_answers(host: str, port: int, timeout: float = 1.0) -> bool:
    """True when a TCP connection to ``host:port`` is accepted within ``timeout`` seconds."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, TimeoutError):
        return False
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:  # the producer may close first; it answered all the same
        pass
    return True
