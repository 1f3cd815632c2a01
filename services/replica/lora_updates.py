"""Loading and unloading LoRA adapters in this replica's engine while it serves.

Owns the replica's ``LoraUpdates`` (``services.frontend.lora_updates``), used by both
``Generation.LoadLoraAdapter`` / ``UnloadLoraAdapter`` and the internal ``Engine.LoadLora`` /
``UnloadLora`` the gateway sends every replica: check the request, do it on the local engine,
turn the engine's refusals into statuses and tell the replica's servicers the adapters it now
serves. It does not own reading adapters or running them (``engine_common.lora``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from engine_common.async_llm import AsyncLLM
from engine_common.lora.loaded_adapters import LoraAdapterExists, LoraAdapterNotFound
from services.frontend.errors import AlreadyExists, InvalidArgument, NotFound
from services.frontend.lora_updates import check_load, check_unload
from services.frontend.served_model import ServedModel


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
