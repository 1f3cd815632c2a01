"""What a replica checks before it reports SERVING, beyond its own gRPC server.

Owns the check of a prefill replica's KV listener: a TCP connection to the address and port
it advertises to decode replicas (in its KV handles), from this host, as a peer dials it
(UCX's listener takes its connection requests over TCP). It does not own the listener
(``kv_transfer``, in the engine core) or the health service (``server``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

_RETRY_S = 0.1


class NotReady(RuntimeError):
    """A listener the replica's role needs did not answer in time."""


async def wait_listening(host: str, port: int, timeout_s: float) -> float:
    """Wait until ``host:port`` accepts a TCP connection; returns the seconds it took, or
    raises ``NotReady`` after ``timeout_s``."""
    started = time.monotonic()
    while True:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 1.0)
        except (OSError, TimeoutError) as error:
            if time.monotonic() - started > timeout_s:
                raise NotReady(f"the KV listener {host}:{port} does not accept connections "
                               f"after {timeout_s:g} s: {error}") from error
            await asyncio.sleep(_RETRY_S)
            continue
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return time.monotonic() - started
