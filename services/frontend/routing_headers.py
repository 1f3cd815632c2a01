"""The call metadata a disaggregated route travels in, outside the request message.

Behind Envoy and the endpoint picker (Kubernetes), the picker names the prefill replica of a
P/D pick in the request header ``x-prefiller-host-port`` (llm-d's name), and the decode
replica answers, in its response headers, how the prompt's KV got there
(``x-tandem-prefill``: ``remote`` when the prefill replica computed it, ``fallback:<reason>``
when this replica recomputed it), so that the picker credits the prefill replica's prefix
index only for prefills that really ran there. This module owns the names and reading the
request header; what is done with them belongs to the replica and the picker.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable

from services.frontend.errors import InvalidArgument

PREFILL_PEER_HEADER = "x-prefiller-host-port"
PREFILL_OUTCOME_HEADER = "x-tandem-prefill"
PREFILL_REMOTE = "remote"
PREFILL_FALLBACK = "fallback"

# A DNS name (RFC 1123 labels) or an IPv4 address; IPv6 goes in brackets.
_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")
_MAX_LENGTH = 261  # 253 for a name, ":" and 5 digits, and brackets


def prefill_peer_of(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The prefill replica the request's metadata names, as HOST:PORT; None when it names
    none. A malformed value is the picker's (or a client's) mistake, refused with
    INVALID_ARGUMENT rather than dialed."""
    values = [value for key, value in metadata or () if key.lower() == PREFILL_PEER_HEADER]
    if not values:
        return None
    if len(values) > 1:
        raise InvalidArgument(f"{PREFILL_PEER_HEADER} is given {len(values)} times; give one "
                              "HOST:PORT")
    value = values[0]
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    if not text:
        return None
    if len(text) > _MAX_LENGTH or not _is_host_port(text):
        shown = text[:64] + ("..." if len(text) > 64 else "")
        raise InvalidArgument(f"{PREFILL_PEER_HEADER} must be HOST:PORT (an IPv4 address or "
                              f"DNS name, or [IPv6]:PORT), got {shown!r}")
    return text


def _is_host_port(text: str) -> bool:
    host, separator, port = text.rpartition(":")
    if not separator or not port.isdigit() or not 0 < int(port) < 65536:
        return False
    if host.startswith("[") and host.endswith("]"):
        try:
            return ipaddress.ip_address(host[1:-1]).version == 6
        except ValueError:
            return False
    return bool(_HOST.match(host))


def prefill_outcome(fallback_reason: str | None) -> str:
    """The ``x-tandem-prefill`` value for a decode replica's prefill."""
    return PREFILL_REMOTE if fallback_reason is None else f"{PREFILL_FALLBACK}:{fallback_reason}"
