"""Which rows of one step's tokens run with which LoRA adapter.

Owns the per-step record the model's projections read, built once per step from each
scheduled request's adapter slot (like the attention metadata) and passed down the forward
call, so no layer keeps per-step state. It does not own the adapters' weights
(``linear_delta``) or the names (``loaded_adapters``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

BASE_MODEL_SLOT = -1  # a request without an adapter


@dataclass(frozen=True)
class LoraRows:
    slot: int  # the adapter's slot in every projection's ``lora`` weights
    rows: torch.Tensor | None  # int64 token rows of the step; None: all of them


@dataclass(frozen=True)
class LoraBatch:
    """The adapters of a step that has adapter tokens, each with its token rows; tokens of
    the base model are in no group and get nothing added."""

    groups: tuple[LoraRows, ...]

    @staticmethod
    def build(request_slots: Sequence[int], query_lens: np.ndarray,
              device: torch.device) -> LoraBatch | None:
        """From each request's slot and token count (drafts included); None when every
        token is the base model's, so a base-only step runs exactly as without LoRA."""
        slots = np.asarray(request_slots, dtype=np.int64)
        if not (slots != BASE_MODEL_SLOT).any():
            return None
        token_slots = np.repeat(slots, query_lens)
        groups = []
        for slot in np.unique(slots[slots != BASE_MODEL_SLOT]).tolist():
            mask = token_slots == slot
            if mask.all():
                groups.append(LoraRows(slot, None))
            else:
                groups.append(LoraRows(slot, torch.from_numpy(np.flatnonzero(mask)).to(device)))
        return LoraBatch(tuple(groups))
