"""Who computes the prompt when a decode replica's prefill peer is down: the internal API's
contract between a caller that routes (the gateway) and a decode replica.

A caller that can route the request again sets ``HANDBACK_HEADER`` on an ``Engine.Generate``
that names a ``prefill_peer``. When that peer is down, draining or unreachable (its Prefill
fails UNAVAILABLE), the decode replica then ends the call before any output with
``PrefillHandedBack`` (ABORTED, which the replica answers for nothing else), instead of
computing the prompt itself on its decode engine: the caller picks another prefill replica,
or none, and calls again. Without the header (another replica, a test, a call through the
endpoint picker's ``x-prefiller-host-port``, where nobody routes again) the decode replica
falls back to computing the prompt locally, as always. Any other failure of the peer falls
back locally either way. It does not own the decode replica's P/D flow
(``services.replica.local_engine``) or the caller's routing (``gateway.proxy``).
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc

from services.frontend.errors import ServiceError

HANDBACK_HEADER = "x-tandem-prefill-handback"
HANDBACK_CODE = grpc.StatusCode.ABORTED


class PrefillHandedBack(ServiceError):
    """The prefill peer is down: the caller routes the request again."""

    code = HANDBACK_CODE


def handback_metadata() -> tuple[tuple[str, str], ...]:
    """What the caller adds to its ``Engine.Generate`` call to be handed such requests."""
    return ((HANDBACK_HEADER, "1"),)


def caller_takes_handback(metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
    """Whether the call's metadata asks for hand-backs."""
    return any(key == HANDBACK_HEADER and value in ("1", b"1") for key, value in metadata or ())
