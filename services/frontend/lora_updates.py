"""Loading and unloading LoRA adapters while serving (vLLM's runtime LoRA API), as the public
API sees it.

Owns the ``LoraUpdates`` protocol that ``Generation.LoadLoraAdapter`` /
``UnloadLoraAdapter`` are served through, the checks any server makes before acting on such a
request, and the refusal of a server started without ``--allow-runtime-lora-updating``. It
does not own doing it: a replica loads into its own engine (``services.replica.lora_updates``),
the gateway asks every replica (``gateway.lora_rollout``).
"""

from __future__ import annotations

from typing import Protocol

from services.frontend.errors import FailedPrecondition, InvalidArgument
from services.frontend.served_model import ServedModel


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
