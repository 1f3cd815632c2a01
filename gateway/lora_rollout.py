"""Loading and unloading LoRA adapters on every replica behind the gateway.

Owns the gateway's side of ``Generation.LoadLoraAdapter`` / ``UnloadLoraAdapter``: asking
each replica in rotation (``Engine.LoadLora`` / ``UnloadLora``) at once, all or nothing for a
load (the replicas that loaded it unload it again when another refused), and holding the
replicas to it: ``reconcile`` loads the adapters loaded this way on replicas that join later
or come back from a restart (which forgets them), and unloads those unloaded this way from a
replica that was out of rotation at the time, once per replica process and adapter. One
change runs at a time. It does not own the replicas' own checks and loading
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
from services.frontend.errors import (
    AlreadyExists,
    NotFound,
    ServiceError,
    Unavailable,
)
from services.frontend.lora_updates import check_load, check_unload
from services.frontend.served_model import ServedModel

logger = logging.getLogger(__name__)

# Loading reads the adapter's files on the replica between two engine steps.
_RPC_TIMEOUT_S = 60.0


class ReplicaRefusal(ServiceError):
    """A replica's refusal, with its status, for the caller."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class ClusterLoraUpdates:
    """``services.frontend.lora_updates.LoraUpdates`` over every replica in rotation;
    ``on_change`` is called after each change, once the replicas' adapter lists are
    updated."""

    def __init__(self, registry: ReplicaRegistry, model: Callable[[], ServedModel],
                 on_change: Callable[[], None]) -> None:
        self.registry = registry
        self.model = model
        self.on_change = on_change
        # Adapters loaded through this gateway, which replicas that lack them get: name -> path.
        self.runtime_adapters: dict[str, str] = {}
        # Adapters unloaded through this gateway (and not loaded since), which replicas that
        # serve them lose.
        self.unloaded: set[str] = set()
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
            self.unloaded.discard(name)
            self.on_change()
            already = f"; {len(had_it)} already had it" if had_it else ""
            return (f"LoRA adapter {name!r} loaded on {len(loaded)} "
                    f"replica{'s' if len(loaded) != 1 else ''}{already}", self._served())

    async def unload(self, name: str) -> tuple[str, list[str]]:
        check_unload(name)
        async with self._lock:
            loaded_here = self.runtime_adapters.pop(name, None) is not None
            holders = [r for r in self._in_rotation() if name in r.lora_adapters]
            # One loaded through here may be only on replicas out of rotation just now: they
            # lose it when they return.
            if not holders and not loaded_here:
                raise NotFound(f"no replica serves LoRA adapter {name!r}; served: "
                               f"{', '.join(self._served()) or 'none'}")
            self.unloaded.add(name)
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

    @property
    def has_targets(self) -> bool:
        """Whether anything was loaded or unloaded through here (``reconcile`` has work)."""
        return bool(self.runtime_adapters or self.unloaded)

    async def reconcile(self) -> None:
        """Brings the replicas in rotation to what was loaded and unloaded through this
        gateway: loads the runtime adapters a replica lacks (a new one, a restarted one)
        and unloads those unloaded here that it serves (it was out of rotation then, or
        its flags load them at start), once per replica process and adapter."""
        if not self.has_targets or self._lock.locked():
            return
        names = {*self.runtime_adapters, *self.unloaded}
        async with self._lock:
            changes = [(replica, name) for replica in self.registry.routable() for name in names
                       if (name in self.runtime_adapters) != (name in replica.lora_adapters)
                       and (replica.address, replica.epoch, name) not in self._reconciled]
            if not changes:
                return
            self._reconciled.update((r.address, r.epoch, name) for r, name in changes)
            results = await asyncio.gather(*(self._reconcile_one(replica, name)
                                             for replica, name in changes),
                                           return_exceptions=True)
            for (replica, name), result in zip(changes, results, strict=True):
                verb = "load" if name in self.runtime_adapters else "unload"
                if isinstance(result, engine_pb2.LoraAdapters):
                    replica.lora_adapters = frozenset(result.names)
                    logger.info("replica %s: %sed LoRA adapter %r, as this gateway did",
                                replica.address, verb, name)
                elif _code(result) not in (grpc.StatusCode.ALREADY_EXISTS,
                                           grpc.StatusCode.NOT_FOUND):
                    logger.warning("replica %s did not %s LoRA adapter %r: %s",
                                   replica.address, verb, name, _details(result))
            self.on_change()

    async def _reconcile_one(self, replica: Replica, name: str) -> engine_pb2.LoraAdapters:
        path = self.runtime_adapters.get(name)
        if path is None:
            return await replica.engine.UnloadLora(engine_pb2.UnloadLoraRequest(lora_name=name),
                                                   timeout=_RPC_TIMEOUT_S)
        return await replica.engine.LoadLora(
            engine_pb2.LoadLoraRequest(lora_name=name, lora_path=path), timeout=_RPC_TIMEOUT_S)

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
