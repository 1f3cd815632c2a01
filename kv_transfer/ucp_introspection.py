"""Two UCP queries that ``ucxx`` does not expose: a network-only worker address, and the
transports an endpoint really uses.

Owns the ctypes binding of ``ucp_worker_query`` (with ``UCP_WORKER_ADDRESS_FLAG_NET_ONLY``)
and ``ucp_ep_query`` (``UCP_EP_ATTR_FIELD_TRANSPORTS``) of the libucp that ``ucxx`` itself
loaded, and the rule that names a transport from an endpoint's lanes. It does not own any
UCX object: callers pass the raw handles of ``ucxx``'s worker and endpoints.

Why a network-only address: a worker's full address lists every transport it has, shared
memory included, and UCX picks shared memory whenever it finds the peer on the same
machine and IPC namespace. Peers that Tandem counts as other hosts (another network
namespace on the same machine, say) must use TCP, so they are handed this address, from
which UCX can only build network lanes.

Why ask the endpoint: which transport carries the bytes is UCX's choice; the label on the
KV-transfer metrics is what UCX chose, not what was hoped for.

Struct layouts are those of UCX 1.21's ``ucp.h``; every struct used here starts with a
``field_mask`` (UCP's ABI rule for extensible structs), and only fields present in every
UCX since 1.14 are set or read.
"""

from __future__ import annotations

import ctypes
import functools
import os

_ENTITY_NAME_MAX = 32
_WORKER_ATTR_FIELD_ADDRESS = 1 << 1
_WORKER_ATTR_FIELD_ADDRESS_FLAGS = 1 << 2
_WORKER_ADDRESS_FLAG_NET_ONLY = 1 << 0
_EP_ATTR_FIELD_TRANSPORTS = 1 << 3
_MAX_LANES = 32  # UCP_MAX_LANES is 64 in 1.21; an endpoint uses a handful

SHM_TRANSPORTS = frozenset({"posix", "sysv", "cma", "xpmem", "knem"})
RDMA_TRANSPORTS = frozenset({"rc_verbs", "rc_mlx5", "dc_mlx5", "ud_verbs", "ud_mlx5", "rc", "ud",
                             "dc"})
GPU_TRANSPORTS = frozenset({"cuda_ipc", "rocm_ipc"})


class _WorkerAttr(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("thread_mode", ctypes.c_int),
        ("address_flags", ctypes.c_uint32),
        ("address", ctypes.c_void_p),
        ("address_length", ctypes.c_size_t),
        ("max_am_header", ctypes.c_size_t),
        ("name", ctypes.c_char * _ENTITY_NAME_MAX),
        ("max_debug_string", ctypes.c_size_t),
    ]


class _TransportEntry(ctypes.Structure):
    _fields_ = [("transport_name", ctypes.c_char_p), ("device_name", ctypes.c_char_p)]


class _Transports(ctypes.Structure):
    _fields_ = [
        ("entries", ctypes.POINTER(_TransportEntry)),
        ("num_entries", ctypes.c_uint),
        ("entry_size", ctypes.c_size_t),
    ]


class _EpAttr(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("name", ctypes.c_char * _ENTITY_NAME_MAX),
        ("local_sockaddr", ctypes.c_ubyte * 128),  # struct sockaddr_storage
        ("remote_sockaddr", ctypes.c_ubyte * 128),
        ("transports", _Transports),
        ("user_data", ctypes.c_void_p),
    ]


@functools.cache
def _libucp() -> ctypes.CDLL:
    # The same file ucxx loaded (libucx's wheel): dlopen returns the loaded library.
    import libucx

    lib = ctypes.CDLL(os.path.join(os.path.dirname(libucx.__file__), "lib", "libucp.so.0"))
    lib.ucp_worker_query.argtypes = [ctypes.c_void_p, ctypes.POINTER(_WorkerAttr)]
    lib.ucp_worker_query.restype = ctypes.c_int
    lib.ucp_worker_release_address.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.ucp_worker_release_address.restype = None
    lib.ucp_ep_query.argtypes = [ctypes.c_void_p, ctypes.POINTER(_EpAttr)]
    lib.ucp_ep_query.restype = ctypes.c_int
    return lib


def net_only_worker_address(worker_handle: int) -> bytes:
    """The worker's address restricted to network transports (no shared memory)."""
    lib = _libucp()
    attr = _WorkerAttr(
        field_mask=_WORKER_ATTR_FIELD_ADDRESS | _WORKER_ATTR_FIELD_ADDRESS_FLAGS,
        address_flags=_WORKER_ADDRESS_FLAG_NET_ONLY,
    )
    status = lib.ucp_worker_query(worker_handle, ctypes.byref(attr))
    if status != 0:
        raise RuntimeError(f"ucp_worker_query failed with UCS status {status}")
    try:
        return ctypes.string_at(attr.address, attr.address_length)
    finally:
        lib.ucp_worker_release_address(worker_handle, attr.address)


def endpoint_lanes(endpoint_handle: int) -> list[tuple[str, str]]:
    """(transport, device) of each lane of a connected endpoint, e.g. ("cma", "memory")."""
    entries = (_TransportEntry * _MAX_LANES)()
    attr = _EpAttr(field_mask=_EP_ATTR_FIELD_TRANSPORTS)
    attr.transports.entries = entries
    attr.transports.num_entries = _MAX_LANES
    attr.transports.entry_size = ctypes.sizeof(_TransportEntry)
    status = _libucp().ucp_ep_query(endpoint_handle, ctypes.byref(attr))
    if status != 0:
        raise RuntimeError(f"ucp_ep_query failed with UCS status {status}")
    lanes = []
    for entry in entries[: attr.transports.num_entries]:
        transport = (entry.transport_name or b"?").decode()
        device = (entry.device_name or b"?").decode()
        if (transport, device) not in lanes:
            lanes.append((transport, device))
    return lanes


def transport_label(lanes: list[tuple[str, str]]) -> str:
    """One word for the transport that carries an endpoint's bulk data.

    UCX sends bulk data over the fastest lanes an endpoint has: GPU IPC, then shared
    memory (posix/sysv for messages, cma for zero-copy reads), then RDMA, then TCP;
    "self" is a loopback within one process.
    """
    names = {transport for transport, _ in lanes}
    for label, members in (("cuda_ipc", GPU_TRANSPORTS), ("shm", SHM_TRANSPORTS),
                           ("rdma", RDMA_TRANSPORTS), ("tcp", frozenset({"tcp"})),
                           ("self", frozenset({"self"}))):
        if names & members:
            return label
    return "+".join(sorted(names)) or "unknown"
