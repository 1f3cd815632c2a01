"""One LoRA adapter's low-rank weights for one projection, and adding their delta to a step.

A fused projection (q|k|v, gate|up) holds each adapter's shards at once: the shards' A
matrices stacked on the rank and their B matrices block-diagonal, so one ``(x @ A^T) @ B^T``
gives every shard's delta in its own output columns, and a shard the adapter does not target
gets zeros. The delta is then scaled and added to the base output, in PEFT's order
(``result + lora_B(lora_A(x)) * scaling``), so float32 outputs match Hugging Face + PEFT.

Owns the fused layout and the per-row application. It does not own reading adapters
(``adapter_weights``), where shards sit in a fused projection (the model) or which rows run
which adapter (``step_batch``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine_common.lora.adapter_weights import LoraModuleWeights
from engine_common.lora.step_batch import LoraBatch


@dataclass(frozen=True)
class LoraLinearWeights:
    a: torch.Tensor  # [total rank, in_features]: the shards' A matrices, stacked
    b: torch.Tensor  # [out_features, total rank]: the shards' B matrices, block-diagonal
    # (first column, end column, scaling) of each run of targeted output columns; shards
    # may scale differently (rank_pattern, alpha_pattern).
    scalings: tuple[tuple[int, int, float], ...]

    @staticmethod
    def fuse(shards: Sequence[tuple[int, LoraModuleWeights]], out_features: int,
             dtype: torch.dtype, device: torch.device) -> LoraLinearWeights:
        """One projection's weights from its targeted shards, each with the first output
        column of its shard in the (fused) projection."""
        total_rank = sum(w.a.shape[0] for _, w in shards)
        in_features = shards[0][1].a.shape[1]
        a = torch.zeros(total_rank, in_features, dtype=dtype)
        b = torch.zeros(out_features, total_rank, dtype=dtype)
        scalings: list[tuple[int, int, float]] = []
        rank_start = 0
        for column, weights in sorted(shards, key=lambda shard: shard[0]):
            r, width = weights.a.shape[0], weights.b.shape[0]
            a[rank_start:rank_start + r] = weights.a
            b[column:column + width, rank_start:rank_start + r] = weights.b
            if scalings and scalings[-1][1] == column and scalings[-1][2] == weights.scaling:
                scalings[-1] = (scalings[-1][0], column + width, weights.scaling)
            else:
                scalings.append((column, column + width, weights.scaling))
            rank_start += r
        return LoraLinearWeights(a.to(device), b.to(device), tuple(scalings))

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """``((x @ A^T) @ B^T) * scaling`` per shard, [rows, out_features]."""
        delta = F.linear(F.linear(x, self.a), self.b)
        for start, end, scaling in self.scalings:
            # In place on the shard's columns: the same multiply as PEFT's on the shard.
            delta[:, start:end].mul_(scaling)
        return delta


def add_lora_deltas(y: torch.Tensor, x: torch.Tensor,
                    adapters: Mapping[int, LoraLinearWeights], batch: LoraBatch) -> torch.Tensor:
    """Adds to the base output ``y`` (this call's own, modified in place) each adapter's
    delta on its own rows of ``x``; rows of the base model, and of adapters that do not
    target this projection, are left as they are."""
    for group in batch.groups:
        weights = adapters.get(group.slot)
        if weights is None:
            continue
        if group.rows is None:
            y += weights.delta(x)
        else:
            y.index_add_(0, group.rows, weights.delta(x.index_select(0, group.rows)))
    return y
