"""Loading and unloading LoRA adapters on every replica behind the gateway.

Owns the gateway's side of ``Generation.LoadLoraAdapter`` / ``UnloadLoraAdapter``: asking
each replica in rotation (``Engine.LoadLora`` / ``UnloadLora``) at once, all or nothing for a
load (the replicas that loaded it unload it again when another refused), and keeping the
adapters loaded this way on replicas that join later or come back from a restart (which
forgets them): ``reconcile`` loads each missing one once per replica process. One change
runs at a time. It does not own the replicas' own checks and loading
(``services.replica.lora_updates``, ``engine_common.lora``) or routing by adapter (``picker``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc
import grpc.aio

from gateway.registry import Replica, ReplicaRegistry
from protos.tandem.v1 import engine_pb2
from services.replica.errors import (
    AlreadyExists,
    NotFound,
    ServiceError,
    Unavailable,
)
from services.replica.lora_updates import check_load, check_unload
from services.replica.served_model import ServedModel

logger = logging.getLogger(__name__)

# Loading reads the adapter's files on the replica between two engine steps.
_RPC_TIMEOUT_S = 60.0


class ReplicaRefusal(ServiceError):
    """A replica's refusal, with its status, for the caller."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class ClusterLoraUpdates:
    """``services.replica.lora_updates.LoraUpdates`` over every replica in rotation;
    ``on_change`` is called after each change, once the replicas' adapter lists are
    updated."""

    def __init__(self, registry: ReplicaRegistry, model: Callable[[], ServedModel],
                 on_change: Callable[[], None]) -> None:
        self.registry = registry
        self.model = model
        self.on_change = on_change
        # Adapters loaded through this gateway, which replicas that lack them get: name -> path.
        self.runtime_adapters: dict[str, str] = {}
        # (address, epoch, name): loads ``reconcile`` tried, so it tries each once per
        # replica process (a restart takes a replica out of rotation: a new epoch).
        self._reconciled: set[tuple[str, int, str]] = set()
        self._lock = asyncio.Lock()

    async def load(self, name: str, path: str) -> tuple[str, list[str]]:
        check_load(self.model(), name, path)
        async with self._lock:
            replicas = self._in_rotation()
            request = engine_pb2.LoadLoraRequest(lora_name=name, lora_path=path)
            results = await asyncio.gather(
                *(r.engine.LoadLora(request, timeout=_RPC_TIMEOUT_S) for r in replicas),
                return_exceptions=True)
            loaded, had_it, refusals = [], [], []
            for replica, result in zip(replicas, results, strict=True):
                if isinstance(result, engine_pb2.LoraAdapters):
                    replica.lora_adapters = frozenset(result.names)
                    loaded.append(replica)
                elif _code(result) == grpc.StatusCode.ALREADY_EXISTS:
                    had_it.append(replica)
                else:
                    refusals.append((replica, result))
            if refusals:
                await self._unload_from(loaded, name)
                self.on_change()
                replica, error = refusals[0]
                raise ReplicaRefusal(_code(error) or grpc.StatusCode.INTERNAL,
                                     f"LoRA adapter {name!r} was not loaded: " + "; ".join(
                                         f"replica {r.address}: {_details(e)}"
                                         for r, e in refusals))
            if not loaded:
                raise AlreadyExists(f"LoRA adapter {name!r} is already served by every replica "
                                    f"({', '.join(r.address for r in had_it)})")
            self.runtime_adapters[name] = path
            self.on_change()
            already = f"; {len(had_it)} already had it" if had_it else ""
            return (f"LoRA adapter {name!r} loaded on {len(loaded)} "
                    f"replica{'s' if len(loaded) != 1 else ''}{already}", self._served())

    async def unload(self, name: str) -> tuple[str, list[str]]:
        check_unload(name)
        async with self._lock:
            self.runtime_adapters.pop(name, None)
            holders = [r for r in self._in_rotation() if name in r.lora_adapters]
            if not holders:
                raise NotFound(f"no replica serves LoRA adapter {name!r}; served: "
                               f"{', '.join(self._served()) or 'none'}")
            failures = await self._unload_from(holders, name)
            self.on_change()
            if failures:
                replica, error = failures[0]
                raise ReplicaRefusal(_code(error) or grpc.StatusCode.INTERNAL,
                                     f"LoRA adapter {name!r} stays on " + "; ".join(
                                         f"replica {r.address} ({_details(e)})"
                                         for r, e in failures))
            return (f"LoRA adapter {name!r} unloaded from {len(holders)} "
                    f"replica{'s' if len(holders) != 1 else ''}", self._served())

    async def reconcile(self) -> None:
        """Loads the adapters loaded through this gateway on the replicas in rotation that
        lack them (new ones, restarted ones), once per replica process and adapter."""
        if not self.runtime_adapters or self._lock.locked():
            return
        async with self._lock:
            missing = [(replica, name, path) for replica in self.registry.routable()
                       for name, path in self.runtime_adapters.items()
                       if name not in replica.lora_adapters and
                       (replica.address, replica.epoch, name) not in self._reconciled]
            if not missing:
                return
            for replica, name, _ in missing:
                self._reconciled.add((replica.address, replica.epoch, name))
            results = await asyncio.gather(
                *(replica.engine.LoadLora(engine_pb2.LoadLoraRequest(lora_name=name,
                                                                     lora_path=path),
                                          timeout=_RPC_TIMEOUT_S)
                  for replica, name, path in missing), return_exceptions=True)
            for (replica, name, _), result in zip(missing, results, strict=True):
                if isinstance(result, engine_pb2.LoraAdapters):
                    replica.lora_adapters = frozenset(result.names)
                    logger.info("loaded LoRA adapter %r on replica %s, which lacked it",
                                name, replica.address)
                elif _code(result) != grpc.StatusCode.ALREADY_EXISTS:
                    logger.warning("replica %s lacks LoRA adapter %r and did not load it: %s",
                                   replica.address, name, _details(result))
            self.on_change()

    def _in_rotation(self) -> list[Replica]:
        replicas = self.registry.routable()
        if not replicas:
            raise Unavailable("no replica is in rotation; try again once one is serving")
        return replicas

    def _served(self) -> list[str]:
        return sorted({name for r in self.registry.routable() for name in r.lora_adapters})

    async def _unload_from(self, replicas: list[Replica],
                           name: str) -> list[tuple[Replica, BaseException]]:
        """Unloads ``name`` from each replica; the failures (a replica that no longer has it
        counts as done)."""
        request = engine_pb2.UnloadLoraRequest(lora_name=name)
        results = await asyncio.gather(
            *(r.engine.UnloadLora(request, timeout=_RPC_TIMEOUT_S) for r in replicas),
            return_exceptions=True)
        failures = []
        for replica, result in zip(replicas, results, strict=True):
            if isinstance(result, engine_pb2.LoraAdapters):
                replica.lora_adapters = frozenset(result.names)
            elif _code(result) == grpc.StatusCode.NOT_FOUND:
                replica.lora_adapters = replica.lora_adapters - {name}
            else:
                failures.append((replica, result))
        return failures


def _code(result: object) -> grpc.StatusCode | None:
    return result.code() if isinstance(result, grpc.aio.AioRpcError) else None


def _details(error: BaseException) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return f"{type(error).__name__}: {error}"
