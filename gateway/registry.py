"""The set of replicas the gateway may route to: where they are, what role they serve, and
whether they are healthy right now.

Owns discovery (a static ``host:port`` list, or the addresses a DNS name resolves to, such as a
Kubernetes headless Service, re-resolved periodically), one gRPC channel per replica, the
replica's identity and role (``Engine.GetInfo``) and its health (a ``grpc.health.v1`` Watch
stream per replica). A replica whose stream breaks or reports anything but SERVING is out of
rotation at once; it comes back when it answers SERVING again. A replica a peer reports
failing (``report_failure``: a decode replica could not prefill or pull there) is out of
rotation at once for a few seconds, or until it comes back after a drop. It does not own load
(``load``), cached prefixes (``prefix_index``) or choosing (``picker``): those follow the
registry through ``ReplicaListener`` callbacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.tandem.v1 import engine_pb2, engine_pb2_grpc
from services.suite_tls import SuiteTls, aio_channel

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "both")

# Reconnect fast: a restarted replica must be back in rotation within seconds, and gRPC's
# default backoff (1 s growing to 120 s) would keep the channel failing long after that.
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
)


@dataclass
class Replica:
    """One replica as the gateway knows it. ``role`` and ``engine_id`` are learned from GetInfo
    and may change when the process behind the address restarts."""

    address: str
    channel: grpc.aio.Channel
    engine: engine_pb2_grpc.EngineStub
    role: str = ""
    engine_id: str = ""
    model: str = ""
    block_size: int = 0
    max_model_len: int = 0
    # Tensor-parallel ranks (GetInfo): one replica for routing whatever its ranks, its load
    # and KV figures the replica's own.
    tensor_parallel_size: int = 1
    lora_adapters: frozenset[str] = frozenset()
    healthy: bool = False
    # Counts the times the replica dropped out of rotation. Whatever watched it across such a
    # drop (its KV events) may have watched a process that since restarted behind the same
    # address and engine id, with its sequence numbers starting over.
    epoch: int = 0
    # time.monotonic() of the last health change, for logs and tests.
    changed_at: float = field(default_factory=time.monotonic)
    # Out of rotation until this time.monotonic(), though its health says SERVING: a peer
    # saw it fail (``ReplicaRegistry.report_failure``).
    suspect_until: float = 0.0

    @property
    def routable(self) -> bool:
        return (self.healthy and self.role in ROLES
                and (not self.suspect_until or time.monotonic() >= self.suspect_until))


class ReplicaListener(Protocol):
    """Told when a replica joins or leaves the registry (not on health changes)."""

    def replica_added(self, replica: Replica) -> None: ...

    def replica_removed(self, replica: Replica) -> None: ...


@dataclass(frozen=True)
class DnsTarget:
    """A DNS name whose A/AAAA records are replicas (a headless Service), and their port."""

    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> DnsTarget:
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"expected name:port for a DNS target, got {text!r}")
        return cls(host, int(port))


def _join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class ReplicaRegistry:
    def __init__(
        self,
        static_addresses: Sequence[str] = (),
        dns_targets: Sequence[DnsTarget] = (),
        *,
        dns_interval_s: float = 5.0,
        health_service: str = "",
        retry_interval_s: float = 0.2,
        tls: SuiteTls | None = None,
        suspect_s: float = 5.0,
    ) -> None:
        self._suspect_s = suspect_s  # how long a replica reported failing stays out
        self._tls = tls  # the suite's mutual TLS for every replica channel; None: plaintext
        self._static = list(dict.fromkeys(static_addresses))
        self._dns_targets = list(dns_targets)
        self._dns_interval_s = dns_interval_s
        self._health_service = health_service
        self._retry_interval_s = retry_interval_s
        self._replicas: dict[str, Replica] = {}
        self._monitors: dict[str, asyncio.Task[None]] = {}
        self._listeners: list[ReplicaListener] = []
        self._dns_task: asyncio.Task[None] | None = None
        self._removals: set[asyncio.Task[None]] = set()  # referenced until done
        # Set on every health or role change, so waiters (tests, startup) need not poll.
        self._changed = asyncio.Event()

    # ----------------------------------------------------------------- queries
    def add_listener(self, listener: ReplicaListener) -> None:
        self._listeners.append(listener)
        for replica in self._replicas.values():
            listener.replica_added(replica)

    def replicas(self) -> list[Replica]:
        return list(self._replicas.values())

    def get(self, address: str) -> Replica | None:
        return self._replicas.get(address)

    def routable(self) -> list[Replica]:
        return [r for r in self._replicas.values() if r.routable]

    async def wait_until(
        self, predicate: Callable[[ReplicaRegistry], bool], timeout: float
    ) -> bool:
        """Wait until ``predicate(registry)`` is true (re-checked on each change)."""
        deadline = time.monotonic() + timeout
        while not predicate(self):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(remaining, 0.5)):  # not wait_for: see load.py
                    await self._changed.wait()
        return True

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self._set_addresses(self._static)
        if self._dns_targets:
            await self._resolve_once()
            self._dns_task = asyncio.create_task(self._resolve_forever(), name="dns-resolve")

    async def stop(self) -> None:
        if self._dns_task is not None:
            self._dns_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._dns_task
        for address in list(self._replicas):
            await self._remove(address)

    # ----------------------------------------------------------------- discovery
    def _set_addresses(self, addresses: Iterable[str]) -> None:
        wanted = list(dict.fromkeys(addresses))
        for address in wanted:
            if address not in self._replicas:
                self._add(address)
        for address in list(self._replicas):
            if address not in wanted:
                task = asyncio.get_running_loop().create_task(self._remove(address))
                self._removals.add(task)
                task.add_done_callback(self._removals.discard)

    async def _resolve_once(self) -> None:
        loop = asyncio.get_running_loop()
        addresses = list(self._static)
        for target in self._dns_targets:
            try:
                infos = await loop.getaddrinfo(
                    target.host, target.port, type=socket.SOCK_STREAM)
            except OSError as e:
                # Keep what we had: a DNS hiccup must not empty the pool.
                logger.warning("resolving %s failed (%s); keeping the known replicas",
                               target.host, e)
                addresses.extend(
                    a for a in self._replicas if a not in addresses)
                continue
            for info in infos:
                host = str(info[4][0])
                addresses.append(_join_host_port(host, target.port))
        self._set_addresses(addresses)

    async def _resolve_forever(self) -> None:
        while True:
            await asyncio.sleep(self._dns_interval_s)
            await self._resolve_once()

    def _add(self, address: str) -> None:
        channel = aio_channel(address, self._tls, CHANNEL_OPTIONS)
        replica = Replica(address, channel, engine_pb2_grpc.EngineStub(channel))
        self._replicas[address] = replica
        self._monitors[address] = asyncio.create_task(
            self._monitor(replica), name=f"health-{address}")
        logger.info("replica %s added", address)
        for listener in self._listeners:
            listener.replica_added(replica)

    async def _remove(self, address: str) -> None:
        replica = self._replicas.pop(address, None)
        task = self._monitors.pop(address, None)
        if replica is None:
            return
        logger.info("replica %s removed", address)
        for listener in self._listeners:
            listener.replica_removed(replica)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._changed.set()
        await replica.channel.close()

    # ----------------------------------------------------------------- health
    def report_failure(self, address: str, why: str) -> None:
        """A peer saw this replica fail (a decode replica could not prefill or pull there):
        out of rotation for ``suspect_s`` at once, without waiting for its health watch to
        notice (a host that vanished keeps a watch open until keepalive gives up), or until
        the watch sees it come back SERVING after a drop (a restart), whichever is first."""
        replica = self._replicas.get(address)
        if replica is None:
            return
        fresh = not replica.suspect_until or time.monotonic() >= replica.suspect_until
        replica.suspect_until = time.monotonic() + self._suspect_s
        if fresh:
            logger.warning("replica %s (%s) out of rotation for %.0f s: %s", address,
                           replica.role or "?", self._suspect_s, why)
        self._changed.set()

    def _set_healthy(self, replica: Replica, healthy: bool) -> None:
        if replica.healthy != healthy:
            replica.healthy = healthy
            if healthy:
                replica.suspect_until = 0.0  # back after a drop: whatever failed was before
            else:
                replica.epoch += 1
            replica.changed_at = time.monotonic()
            logger.info("replica %s (%s) is %s", replica.address, replica.role or "?",
                        "healthy" if healthy else "out of rotation")
            self._changed.set()

    async def _refresh_info(self, replica: Replica) -> None:
        info: engine_pb2.EngineInfo = await replica.engine.GetInfo(
            engine_pb2.GetInfoRequest(), timeout=5.0)
        if info.role not in ROLES:
            raise ValueError(f"replica {replica.address} reports unknown role {info.role!r}")
        replica.role = info.role
        replica.engine_id = info.engine_id
        replica.model = info.model
        replica.block_size = info.block_size
        replica.max_model_len = info.max_model_len
        replica.tensor_parallel_size = info.tensor_parallel_size or 1
        replica.lora_adapters = frozenset(info.lora_adapters)

    async def _monitor(self, replica: Replica) -> None:
        """Watch health for as long as the replica is registered, reconnecting on failure."""
        health = health_pb2_grpc.HealthStub(replica.channel)
        request = health_pb2.HealthCheckRequest(service=self._health_service)
        serving = health_pb2.HealthCheckResponse.SERVING
        while True:
            try:
                info_known = False
                call = health.Watch(request)
                async for response in call:
                    if response.status == serving:
                        if not info_known:
                            # Learn (or re-learn, after a restart) the role before routing.
                            await self._refresh_info(replica)
                            info_known = True
                        self._set_healthy(replica, True)
                    else:
                        self._set_healthy(replica, False)
                        info_known = False
                self._set_healthy(replica, False)
            except asyncio.CancelledError:
                raise
            except (grpc.aio.AioRpcError, ValueError) as e:
                self._set_healthy(replica, False)
                logger.debug("health watch of %s failed: %s", replica.address, e)
            await asyncio.sleep(self._retry_interval_s)
