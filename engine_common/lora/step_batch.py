"""Which rows of one step's tokens run with which LoRA adapter.

Owns the per-step record the model's projections read, built once per step from each
scheduled request's adapter slot (like the attention metadata) and passed down the forward
call, so no layer keeps per-step state: the adapters' row groups and, when a step has more
than one adapter, the same groups padded to one size for a batched matmul
(``StackedRows``). It does not own the adapters' weights (``linear_delta``) or the names
(``loaded_adapters``).
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
class StackedRows:
    """Every group's rows, each padded to the largest group's count with its own last row
    (``pad_mask`` zeroes the copies, so they add exactly nothing), group after group."""

    rows: torch.Tensor  # int64 [groups * rows per group]
    slots: torch.Tensor  # int64 [groups]: the adapters' slots, ascending
    pad_mask: torch.Tensor | None  # [groups, rows per group, 1] of 1 and 0; None: no padding


@dataclass(frozen=True)
class LoraBatch:
    """The adapters of a step that has adapter tokens, each with its token rows; tokens of
    the base model are in no group and get nothing added."""

    groups: tuple[LoraRows, ...]
    stacked: StackedRows | None = None  # with two groups or more

    @staticmethod
    def build(request_slots: Sequence[int], query_lens: np.ndarray, device: torch.device,
              dtype: torch.dtype) -> LoraBatch | None:
        """From each request's slot and token count (drafts included); None when every
        token is the base model's, so a base-only step runs exactly as without LoRA."""
        slots = np.asarray(request_slots, dtype=np.int64)
        if not (slots != BASE_MODEL_SLOT).any():
            return None
        token_slots = np.repeat(slots, query_lens)
        groups, group_rows = [], []
        for slot in np.unique(slots[slots != BASE_MODEL_SLOT]).tolist():
            rows = np.flatnonzero(token_slots == slot)
            group_rows.append(rows)
            whole = len(rows) == len(token_slots)
            groups.append(LoraRows(slot, None if whole else torch.from_numpy(rows).to(device)))
        stacked = None
        if len(groups) > 1:
            size = max(len(rows) for rows in group_rows)
            padded = np.stack([np.pad(rows, (0, size - len(rows)), mode="edge")
                               for rows in group_rows])
            mask = None
            if any(len(rows) < size for rows in group_rows):
                valid = np.arange(size)[None, :] < np.array([len(r) for r in group_rows])[:, None]
                mask = torch.from_numpy(valid[:, :, None]).to(device=device, dtype=dtype)
            stacked = StackedRows(torch.from_numpy(padded.reshape(-1)).to(device),
                                  torch.tensor([g.slot for g in groups], device=device), mask)
        return LoraBatch(tuple(groups), stacked)
