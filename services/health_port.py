"""A plaintext port that answers ``grpc.health.v1`` and nothing else.

With the suite's mutual TLS (``suite_tls``) a replica's port refuses every caller without the
suite's certificate, and a kubelet's gRPC probe presents none. ``--health-port`` gives such
probes a port of their own: the same health service, no other service, no TLS, so it exposes
only whether the process serves. It does not own the health states (the server sets them).
"""

from __future__ import annotations

import grpc.aio
from grpc_health.v1 import health_pb2_grpc
from grpc_health.v1.health import aio as health_aio


class HealthPort:
    def __init__(self, health: health_aio.HealthServicer, host: str, port: int) -> None:
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(health, self.server)
        self.port = self.server.add_insecure_port(f"{host}:{port}")

    async def start(self) -> None:
        await self.server.start()

    async def stop(self) -> None:
        await self.server.stop(0)
