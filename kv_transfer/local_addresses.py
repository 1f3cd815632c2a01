"""This host's network addresses: which KV address a replica may bind, and which peers share its host.

Owns three rules of the KV transfer:

- **Bind what you advertise.** A producer advertises one address in its handles and binds
  exactly that one (``check_bind_address``): an IP literal that is one of this host's
  interface addresses, never a wildcard (``0.0.0.0``, ``::``), which would listen on
  every interface while advertising none of them.
- **Same host.** A peer shares this host when its KV address is one of this host's own
  addresses (``is_local_address``), as seen from this process's network namespace, so a
  peer in another Linux network namespace on the same machine is another host. Only
  same-host peers may use shared memory (``ucx_connector``).
- **Which interface.** UCX's TCP transport listens on every interface it may use;
  ``interface_of`` names the one that carries the bound address, so UCX can be confined
  to it (``UCX_NET_DEVICES``, see ``ucx_runtime``).

Addresses come from ``getifaddrs(3)`` (through ctypes; the standard library has no
binding), which lists every address of every interface, secondary and IPv6 ones included,
of the calling process's network namespace. It does not own any socket.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import ipaddress
import socket
from dataclasses import dataclass

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})


class _SockAddr(ctypes.Structure):
    _fields_ = [("sa_family", ctypes.c_ushort), ("sa_data", ctypes.c_ubyte * 14)]


class _SockAddrIn(ctypes.Structure):
    _fields_ = [("sin_family", ctypes.c_ushort), ("sin_port", ctypes.c_uint16),
                ("sin_addr", ctypes.c_ubyte * 4), ("sin_zero", ctypes.c_ubyte * 8)]


class _SockAddrIn6(ctypes.Structure):
    _fields_ = [("sin6_family", ctypes.c_ushort), ("sin6_port", ctypes.c_uint16),
                ("sin6_flowinfo", ctypes.c_uint32), ("sin6_addr", ctypes.c_ubyte * 16),
                ("sin6_scope_id", ctypes.c_uint32)]


class _IfAddrs(ctypes.Structure):
    pass


_IfAddrs._fields_ = [
    ("ifa_next", ctypes.POINTER(_IfAddrs)),
    ("ifa_name", ctypes.c_char_p),
    ("ifa_flags", ctypes.c_uint),
    ("ifa_addr", ctypes.POINTER(_SockAddr)),
    ("ifa_netmask", ctypes.POINTER(_SockAddr)),
    ("ifa_ifu", ctypes.POINTER(_SockAddr)),
    ("ifa_data", ctypes.c_void_p),
]


@dataclass(frozen=True)
class InterfaceAddress:
    interface: str  # e.g. "lo", "eth0"
    address: IpAddress


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.getifaddrs.argtypes = [ctypes.POINTER(ctypes.POINTER(_IfAddrs))]
    libc.freeifaddrs.argtypes = [ctypes.POINTER(_IfAddrs)]
    return libc


def _address(sockaddr: _SockAddr) -> IpAddress | None:
    pointer = ctypes.pointer(sockaddr)
    if sockaddr.sa_family == socket.AF_INET:
        raw = ctypes.cast(pointer, ctypes.POINTER(_SockAddrIn)).contents.sin_addr
        return ipaddress.IPv4Address(bytes(raw))
    if sockaddr.sa_family == socket.AF_INET6:
        raw6 = ctypes.cast(pointer, ctypes.POINTER(_SockAddrIn6)).contents.sin6_addr
        return ipaddress.IPv6Address(bytes(raw6))
    return None


def interface_addresses() -> list[InterfaceAddress]:
    """Every IPv4 and IPv6 address of every interface of this network namespace."""
    libc = _libc()
    head = ctypes.POINTER(_IfAddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"getifaddrs failed: {errno.errorcode.get(code, code)}")
    found: list[InterfaceAddress] = []
    try:
        node = head
        while node:
            entry = node.contents
            if entry.ifa_addr:
                address = _address(entry.ifa_addr.contents)
                if address is not None:
                    found.append(InterfaceAddress(entry.ifa_name.decode(), address))
            node = entry.ifa_next
    finally:
        libc.freeifaddrs(head)
    return found


def parse_ip(host: str) -> IpAddress | None:
    """``host`` as an IP address, or None when it is not an IP literal (a name, say)."""
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def is_loopback(host: str) -> bool:
    address = parse_ip(host)
    return address is not None and address.is_loopback


def is_local_address(host: str) -> bool:
    """Whether ``host`` is an address of this host (this network namespace)."""
    address = parse_ip(host)
    if address is None:
        return False
    if address.is_loopback:
        return True
    return any(entry.address == address for entry in interface_addresses())


def interface_of(host: str) -> str:
    """The interface that carries ``host``, one of this host's addresses."""
    address = parse_ip(host)
    for entry in interface_addresses():
        if entry.address == address:
            return entry.interface
    if address is not None and address.is_loopback:
        # 127.0.0.2 and friends: the whole 127/8 is on lo, though only 127.0.0.1 is listed.
        return next((e.interface for e in interface_addresses() if e.address.is_loopback), "lo")
    raise ValueError(f"{host!r} is not an address of this host")


def check_bind_address(host: str) -> str:
    """``host`` in canonical form, if a KV listener may bind it; else ValueError saying why.

    Accepted: an IP literal that is one of this host's addresses (loopback included: a
    single-host deployment). Refused: wildcards, names, and addresses of other hosts.
    """
    if host in WILDCARD_HOSTS:
        raise ValueError(
            f"KV address {host!r} is a wildcard: a KV listener binds exactly the address it "
            "advertises to decode replicas; give this replica's routable address (the pod "
            "IP on Kubernetes), or 127.0.0.1 on a single host")
    address = parse_ip(host)
    if address is None:
        shown = host if len(host) <= 64 else host[:64] + "..."
        raise ValueError(f"KV address {shown!r} is not an IP address (the handle advertises it "
                         "and the listener binds it, so it must be an IP literal)")
    if not is_local_address(str(address)):
        raise ValueError(f"KV address {address} is not an address of this host, so nothing "
                         "here can listen on it")
    return str(address)
