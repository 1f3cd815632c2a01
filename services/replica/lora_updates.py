"""Loading and unloading LoRA adapters while a replica serves (vLLM's runtime LoRA API).

Owns the replica's side of ``Generation.LoadLoraAdapter`` / ``UnloadLoraAdapter`` and of the
internal ``Engine.LoadLora`` / ``UnloadLora`` the gateway sends every replica: checking the
request, doing it on the local engine, turning the engine's refusals into statuses and
telling the replica's servicers the adapters it now serves. Servers started without
``--allow-runtime-lora-updating`` have no ``LoraUpdates`` and refuse these RPCs
(``runtime_updates_off``). It does not own reading adapters or running them
(``engine_common.lora``), or asking every replica (``gateway.lora_rollout``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol

from engine_common.async_llm import AsyncLLM
from engine_common.lora.loaded_adapters import LoraAdapterExists, LoraAdapterNotFound
from services.replica.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from services.replica.served_model import ServedModel


class LoraUpdates(Protocol):
    """Loads and unloads adapters; each call answers a message for a person and the
    adapters served afterwards, or raises a ``ServiceError``."""

    async def load(self, name: str, path: str) -> tuple[str, list[str]]: ...

    async def unload(self, name: str) -> tuple[str, list[str]]: ...


def runtime_updates_off() -> FailedPrecondition:
    return FailedPrecondition(
        "loading and unloading LoRA adapters at run time is off on this server; start it "
        "with --allow-runtime-lora-updating (or serve adapters with --lora-modules NAME=PATH)")


def check_load(model: ServedModel, name: str, path: str) -> None:
    """Refuses a load request no server could carry out: InvalidArgument."""
    if not name:
        raise InvalidArgument("lora_name is required: the name requests will give as model")
    if not path:
        raise InvalidArgument("lora_path is required: a directory on the server holding "
                              "adapter_config.json and adapter_model.safetensors")
    if name == model.name or name in model.aliases:
        raise InvalidArgument(f"{name!r} is the base model's name; name the adapter otherwise")


def check_unload(name: str) -> None:
    if not name:
        raise InvalidArgument("lora_name is required: the adapter to unload")


class LocalLoraUpdates:
    """``LoraUpdates`` on this replica's engine; ``on_change`` is told the adapters served
    after each change."""

    def __init__(self, llm: AsyncLLM, model: Callable[[], ServedModel],
                 on_change: Callable[[frozenset[str]], None]) -> None:
        self.llm = llm
        self.model = model
        self.on_change = on_change

    async def load(self, name: str, path: str) -> tuple[str, list[str]]:
        check_load(self.model(), name, path)
        try:
            await asyncio.shield(self._changed(self.llm.load_lora_adapter(name, path)))
        except LoraAdapterExists as error:
            raise AlreadyExists(str(error)) from error
        except ValueError as error:  # an adapter this engine cannot serve, and why
            raise InvalidArgument(str(error)) from error
        return f"LoRA adapter {name!r} loaded", self.llm.lora_names

    async def unload(self, name: str) -> tuple[str, list[str]]:
        check_unload(name)
        try:
            await asyncio.shield(self._changed(self.llm.unload_lora_adapter(name)))
        except LoraAdapterNotFound as error:
            raise NotFound(str(error)) from error
        return f"LoRA adapter {name!r} unloaded", self.llm.lora_names

    async def _changed(self, change: Awaitable[None]) -> None:
        """Makes the change, then tells the servicers. Shielded by the callers: a caller
        that goes away (deadline, cancel) must not leave them naming the old adapters."""
        try:
            await change
        finally:
            self.on_change(frozenset(self.llm.lora_names))
