"""How every Tandem gRPC server (a replica, the gateway) is built.

Owns the server's options, the same in each process (the largest request message it takes,
a port that is not shared with another process), and its interceptors: the trace context of
each call first (``TraceServerInterceptor``: its span encloses everything else), the caller's,
then ``RequestGuard`` last, so that no handler ever sees a request that does not decode or
breaks a limit. It does not own the services added to the server or its life.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc.aio

from services.frontend.request_guard import RequestGuard
from services.frontend.validation import MAX_MESSAGE_BYTES
from services.observability.trace_interceptors import TraceServerInterceptor

SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    # A bigger request fails with RESOURCE_EXHAUSTED before any handler runs.
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Fail loudly when the port is taken instead of sharing it with another process.
    ("grpc.so_reuseport", 0),
    # Suite members ping every 5 s while a call is open (``services.suite_tls``): accept it,
    # never answer pings with GOAWAY.
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 4_000),
    ("grpc.http2.max_ping_strikes", 0),
)


def new_server(interceptors: Sequence[grpc.aio.ServerInterceptor] = ()) -> grpc.aio.Server:
    """A grpc.aio server with Tandem's options, tracing, ``interceptors`` and the request
    guard."""
    return grpc.aio.server(interceptors=[TraceServerInterceptor(), *interceptors, RequestGuard()],
                           options=list(SERVER_OPTIONS))
