"""The LoRA adapters an engine serves: loaded once, at start, each under a slot.

Owns the names requests use (``ModelSettings.lora_modules``), the slot each adapter's
weights have in the model's projections, refusing a name that was not loaded, and each
step's ``LoraBatch`` from its requests' names. It does not own reading the files
(``adapter_config``, ``adapter_weights``) or the arithmetic (``linear_delta``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine_common.lora.adapter_config import read_adapter_config
from engine_common.lora.adapter_weights import load_adapter_weights
from engine_common.lora.step_batch import BASE_MODEL_SLOT, LoraBatch

if TYPE_CHECKING:
    from engine_common.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


class LoadedLoraAdapters:
    def __init__(self, slots: Mapping[str, int] | None = None):
        self._slots = dict(slots or {})

    @classmethod
    def load(cls, lora_modules: Mapping[str, str], model: LlamaForCausalLM) -> LoadedLoraAdapters:
        """Reads every adapter (name -> PEFT directory) and gives its weights to ``model``;
        ValueError names the adapter that cannot be served and why."""
        shapes = model.lora_projection_shapes()
        slots: dict[str, int] = {}
        for slot, (name, adapter_dir) in enumerate(lora_modules.items()):
            if not name:
                raise ValueError(f"a LoRA adapter needs a name (the one at {adapter_dir!r})")
            config = read_adapter_config(name, adapter_dir)
            adapter = load_adapter_weights(config, adapter_dir, shapes, model.arch.num_layers)
            model.add_lora_adapter(slot, adapter)
            slots[name] = slot
            logger.info("LoRA adapter %r: %d projections from %s", name, len(adapter.modules),
                        adapter_dir)
        model.stack_lora_adapters(len(slots))
        return cls(slots)

    @property
    def names(self) -> list[str]:
        return list(self._slots)

    def __len__(self) -> int:
        return len(self._slots)

    def check(self, lora_name: str | None) -> None:
        """Raises ValueError if a request may not run with ``lora_name`` here."""
        if not lora_name or lora_name in self._slots:
            return
        if not self._slots:
            raise ValueError(f"unknown LoRA adapter {lora_name!r}: this engine serves no "
                             "LoRA adapters (load them with lora_modules / --lora-modules)")
        raise ValueError(f"unknown LoRA adapter {lora_name!r}; this engine serves: "
                         f"{', '.join(self._slots)}")

    def step_batch(self, lora_names: Sequence[str | None], query_lens: np.ndarray,
                   device: torch.device, dtype: torch.dtype) -> LoraBatch | None:
        """The step's ``LoraBatch`` from each scheduled request's adapter and token count;
        None when no request of the step has an adapter."""
        if not any(lora_names):
            return None
        slots = [self._slots[name] if name else BASE_MODEL_SLOT for name in lora_names]
        return LoraBatch.build(slots, query_lens, device, dtype)
