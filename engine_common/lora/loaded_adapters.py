"""The LoRA adapters an engine serves, by name, each under a slot: those of
``ModelSettings.lora_modules``, loaded at start, and those loaded and unloaded while it serves
(vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter).

Owns the names requests use, the slot each adapter's weights have in the model's projections
(a new adapter takes the lowest free slot), refusing a name that is not served, and each
step's ``LoraBatch`` from its requests' names. An unloaded adapter stops being served at
once but drains: requests already in the engine keep running with its weights to their end,
and only once the engine core reports that none is left (``reap``) are its weights deleted
and its slot freed. It does not own reading the files (``adapter_config``,
``adapter_weights``), the arithmetic (``linear_delta``), which requests are in the engine
(the scheduler), or the prefix cache's blocks of a name loaded again (the engine core).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine_common.lora.adapter_config import read_adapter_config
from engine_common.lora.adapter_weights import load_adapter_weights
from engine_common.lora.errors import LoraAdapterExists, LoraAdapterNotFound
from engine_common.lora.step_batch import BASE_MODEL_SLOT, LoraBatch

if TYPE_CHECKING:
    from engine_common.model.causal_lm import CausalLM

logger = logging.getLogger(__name__)

__all__ = ["LoadedLoraAdapters", "LoraAdapterExists", "LoraAdapterNotFound"]


@dataclass
class _Draining:
    """An unloaded adapter whose weights requests still run with."""

    slot: int
    # How many unfinished requests used it at the latest ``reap``; None before the first.
    users: int | None = None


class LoadedLoraAdapters:
    def __init__(self, max_rank: int | None = None) -> None:
        self.max_rank = max_rank  # adapters of a higher rank are refused; None: any
        self._slots: dict[str, int] = {}  # served: name -> slot, in the order loaded
        self._draining: dict[str, _Draining] = {}
        # Every name served in this engine's life: the prefix cache keys blocks by name, so
        # a name served again may meet blocks computed with the adapter it named before.
        self._ever_served: set[str] = set()

    @classmethod
    def load(cls, lora_modules: Mapping[str, str], model: CausalLM,
             max_rank: int | None = None) -> LoadedLoraAdapters:
        """Reads every adapter (name -> PEFT directory) and gives its weights to ``model``;
        ValueError names the adapter that cannot be served and why."""
        adapters = cls(max_rank)
        for name, adapter_dir in lora_modules.items():
            adapters._place(name, adapter_dir, model)
        model.stack_lora_adapters(adapters._num_slots())
        return adapters

    # ----------------------------------------------------------------- what is served
    @property
    def names(self) -> list[str]:
        """The served adapters, in the order they were loaded (not the draining ones)."""
        return list(self._slots)

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def slots(self) -> dict[str, int]:
        """Each served adapter's slot in the model's projections (a copy)."""
        return dict(self._slots)

    @property
    def draining(self) -> list[str]:
        """Unloaded adapters that requests may still run with."""
        return list(self._draining)

    @property
    def has_weights(self) -> bool:
        """Whether any adapter's weights are in the model: served, or draining (a step may
        still have rows of a draining adapter)."""
        return bool(self._slots or self._draining)

    def served_before(self, name: str) -> bool:
        """Whether ``name`` was served at some time in this engine's life (loaded at start or
        at runtime), whatever it is now."""
        return name in self._ever_served

    def check(self, lora_name: str | None) -> None:
        """Raises ValueError if a request may not run with ``lora_name`` here."""
        if not lora_name or lora_name in self._slots:
            return
        if not self._slots:
            raise ValueError(f"unknown LoRA adapter {lora_name!r}: this engine serves no "
                             "LoRA adapters (load them with lora_modules / --lora-modules)")
        raise ValueError(f"unknown LoRA adapter {lora_name!r}; this engine serves: "
                         f"{', '.join(sorted(self._slots))}")

    # ----------------------------------------------------------------- runtime changes
    def add(self, name: str, adapter_dir: str | Path, model: CausalLM) -> None:
        """Reads and checks the adapter in ``adapter_dir`` as at start, gives its weights to
        ``model`` under the lowest free slot and serves it as ``name``. Raises
        ``LoraAdapterExists`` when the name is served or still draining, ValueError (naming
        the adapter) when it cannot be served; then nothing changed."""
        if name in self._slots:
            raise LoraAdapterExists(f"LoRA adapter {name!r} is already loaded")
        draining = self._draining.get(name)
        if draining is not None:
            users = ("" if draining.users is None
                     else f": {draining.users} request(s) still run with it")
            raise LoraAdapterExists(f"LoRA adapter {name!r} is still being unloaded{users}; "
                                    "try again once they finish")
        self._place(name, adapter_dir, model)
        model.stack_lora_adapters(self._num_slots())

    def remove(self, name: str) -> None:
        """Stops serving ``name`` at once: ``check`` refuses it from now on. Requests already
        running with it keep its weights until ``reap`` finds none left. Raises
        ``LoraAdapterNotFound`` when no adapter is served under the name."""
        slot = self._slots.pop(name, None)
        if slot is None:
            served = (f"this engine serves: {', '.join(sorted(self._slots))}" if self._slots
                      else "this engine serves no LoRA adapters")
            being = " (it is being unloaded already)" if name in self._draining else ""
            raise LoraAdapterNotFound(f"LoRA adapter {name!r} is not loaded{being}; {served}")
        self._draining[name] = _Draining(slot)
        logger.info("LoRA adapter %r unloaded: it drains from slot %d", name, slot)

    def reap(self, users: Mapping[str, int], model: CausalLM) -> list[str]:
        """Frees the slot of every draining adapter no unfinished request uses (``users``:
        how many requests use each adapter): its weights leave every projection. Returns
        the names freed."""
        freed = [name for name in self._draining if not users.get(name)]
        for name, draining in self._draining.items():
            draining.users = users.get(name, 0)
        for name in freed:
            slot = self._draining.pop(name).slot
            model.remove_lora_adapter(slot)
            logger.info("LoRA adapter %r drained: slot %d is free", name, slot)
        if freed:
            model.stack_lora_adapters(self._num_slots())
        return freed

    # ----------------------------------------------------------------- steps
    def step_batch(self, lora_names: Sequence[str | None], query_lens: np.ndarray,
                   device: torch.device, dtype: torch.dtype) -> LoraBatch | None:
        """The step's ``LoraBatch`` from each scheduled request's adapter (served or
        draining) and token count; None when no request of the step has an adapter."""
        if not any(lora_names):
            return None
        slots = [self._slot_of(name) if name else BASE_MODEL_SLOT for name in lora_names]
        return LoraBatch.build(slots, query_lens, device, dtype)

    # ----------------------------------------------------------------- slots
    def _slot_of(self, name: str) -> int:
        slot = self._slots.get(name)
        return slot if slot is not None else self._draining[name].slot

    def _used_slots(self) -> set[int]:
        return {*self._slots.values(), *(d.slot for d in self._draining.values())}

    def _num_slots(self) -> int:
        """The slots the model stacks: up to the largest in use (a freed one below it stays
        a hole of zeros; none in use: 0, and the projections run as the base model's)."""
        return max(self._used_slots(), default=-1) + 1

    def _place(self, name: str, adapter_dir: str | Path, model: CausalLM) -> None:
        """Reads the adapter and gives its weights to ``model`` under the lowest free slot,
        without restacking."""
        if not name:
            raise ValueError(f"a LoRA adapter needs a name (the one at {str(adapter_dir)!r})")
        config = read_adapter_config(name, adapter_dir)
        if self.max_rank is not None and config.max_rank > self.max_rank:
            raise ValueError(f"LoRA adapter {name!r} has rank {config.max_rank}, above "
                             f"--max-lora-rank {self.max_rank}")
        adapter = load_adapter_weights(config, adapter_dir, model.lora_projection_shapes(),
                                       model.arch.num_layers)
        used = self._used_slots()
        slot = next(s for s in range(len(used) + 1) if s not in used)
        try:
            model.add_lora_adapter(slot, adapter)
        except BaseException:
            # Out of memory midway, say: no projection may keep a part of it.
            model.remove_lora_adapter(slot)
            raise
        self._slots[name] = slot
        self._ever_served.add(name)
        logger.info("LoRA adapter %r: %d projections from %s, slot %d", name,
                    len(adapter.modules), adapter_dir, slot)
