"""What a replica checks before it reports SERVING, beyond its own gRPC server.

Owns waiting for a prefill replica's KV listener: the connector's probe
(``kv_transfer.listener_probe``: a TCP connection to the address and port the replica
advertises to decode replicas in its KV handles, as a peer dials it) until it answers. It
does not own the listener (``kv_transfer``, in the engine core) or the health service
(``server``).
"""

from __future__ import annotations

import asyncio
import time

from kv_transfer.listener_probe import kv_listener_answers

_RETRY_S = 0.1


class NotReady(RuntimeError):
    """A listener the replica's role needs did not answer in time."""


async def wait_listening(host: str, port: int, timeout_s: float) -> float:
    """Wait until ``host:port`` accepts a TCP connection; returns the seconds it took, or
    raises ``NotReady`` after ``timeout_s``."""
    started = time.monotonic()
    while not await kv_listener_answers(host, port, timeout=1.0):
        if time.monotonic() - started > timeout_s:
            raise NotReady(f"the KV listener {host}:{port} does not accept connections "
                           f"after {timeout_s:g} s")
        await asyncio.sleep(_RETRY_S)
    return time.monotonic() - started
