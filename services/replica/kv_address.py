"""The address a prefill replica advertises for its KV blocks, and who may be given it.

A prefill replica's KV handle names the address its UCX listener is bound to; decode replicas
pull from there. It must be one they can reach: ``--kv-host`` when given, else the gRPC bind
address (``--host``) when that is one address. A replica bound to a wildcard (``0.0.0.0``,
``::``) cannot tell which of its addresses its peers reach, so a prefill replica refuses to
start without ``--kv-host`` (in Kubernetes, the pod IP from the downward API). A KV address on
loopback serves only peers on this host: ``Prefill`` from a remote caller is refused
(``may_advertise``) rather than answered with an address the caller would dial on itself.
It does not own the listener (``kv_transfer``) or the flags (``main``).
"""

from __future__ import annotations

import ipaddress

WILDCARDS = frozenset({"0.0.0.0", "::", "[::]", ""})


class KvAddressError(ValueError):
    """The replica's flags give no address its KV peers could reach."""


def resolve_kv_host(kv_host: str | None, host: str, role: str) -> str:
    """The KV address a replica in ``role`` advertises (only a prefill replica listens)."""
    if kv_host:
        if kv_host in WILDCARDS:
            raise KvAddressError(f"--kv-host {kv_host} is a wildcard; give the one address "
                                 "decode replicas reach this replica at")
        return kv_host
    if host not in WILDCARDS:
        return host
    if role == "prefill":
        raise KvAddressError(
            f"--host {host} binds every interface, so this prefill replica cannot tell which "
            "address decode replicas reach its KV blocks at: give --kv-host ADDRESS (in "
            "Kubernetes, the pod IP: --kv-host $(POD_IP))")
    return "127.0.0.1"  # never advertised: only a prefill replica serves KV


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return address == "localhost"


def caller_host(peer: str) -> str | None:
    """The address of a gRPC caller, from ``ServicerContext.peer()`` (``ipv4:1.2.3.4:5``,
    ``ipv6:[::1]:5``, ``unix:...``); None for a Unix socket (the same host)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    return rest.rpartition(":")[0].strip("[]")


def may_advertise(kv_host: str, peer: str) -> bool:
    """Whether a caller at ``peer`` can reach KV blocks at ``kv_host``: a loopback address
    only serves callers on this host (themselves on loopback)."""
    if not is_loopback(kv_host):
        return True
    caller = caller_host(peer)
    return caller is None or is_loopback(caller)
