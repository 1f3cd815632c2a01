"""One LoRA adapter's low-rank weights for one projection, and adding their delta to a step.

A fused projection (q|k|v, gate|up) holds each adapter's shards at once: the shards' A
matrices stacked on the rank and their B matrices block-diagonal, so one ``(x @ A^T) @ B^T``
gives every shard's delta in its own output columns, and a shard the adapter does not target
gets zeros. The delta is then scaled and added to the base output, in PEFT's order
(``result + lora_B(lora_A(x)) * scaling``), so float32 outputs match Hugging Face + PEFT.

A step with several adapters runs them in one batched matmul over their row groups, padded
to one size (``StackedLoraWeights``: every loaded adapter's weights for the projection,
stacked by slot, ranks zero-padded to the largest): the same products and the same scaling
as one group at a time, in a few operations instead of a few per adapter, which on a CPU is
most of what small-rank adapters cost.

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
from engine_common.lora.step_batch import LoraBatch, StackedRows


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


@dataclass(frozen=True)
class StackedLoraWeights:
    """One projection's weights of every loaded adapter, by slot: A^T [slots, in, rank] and
    B^T [slots, rank, out] (an adapter's unused rank, an adapter that does not target the
    projection, and a freed slot below the largest in use, are zeros), and each output
    column's scaling [slots, 1, out]."""

    a_t: torch.Tensor
    b_t: torch.Tensor
    scaling: torch.Tensor

    @staticmethod
    def stack(adapters: Mapping[int, LoraLinearWeights], num_slots: int,
              in_features: int, out_features: int) -> StackedLoraWeights:
        some = next(iter(adapters.values()))
        rank = max(w.a.shape[0] for w in adapters.values())
        a_t = some.a.new_zeros(num_slots, in_features, rank)
        b_t = some.a.new_zeros(num_slots, rank, out_features)
        scaling = some.a.new_ones(num_slots, 1, out_features)
        for slot, weights in adapters.items():
            r = weights.a.shape[0]
            a_t[slot, :, :r] = weights.a.t()
            b_t[slot, :r] = weights.b.t()
            for start, end, value in weights.scalings:
                scaling[slot, 0, start:end] = value
        return StackedLoraWeights(a_t, b_t, scaling)

    def add_deltas(self, y: torch.Tensor, x: torch.Tensor, groups: StackedRows) -> None:
        """Every group's delta on its rows, in one batched matmul."""
        num_groups = groups.slots.shape[0]
        xg = x.index_select(0, groups.rows).view(num_groups, -1, x.shape[1])
        if groups.pad_mask is not None:
            xg = xg * groups.pad_mask  # a padding row's delta is exactly zero
        # The groups' slots are distinct, ascending and below the stack's size (a freed
        # slot runs no rows), so as many groups as stacked slots means exactly 0..n-1.
        if num_groups == self.a_t.shape[0]:
            a_t, b_t, scaling = self.a_t, self.b_t, self.scaling
        else:
            a_t, b_t, scaling = (self.a_t[groups.slots], self.b_t[groups.slots],
                                 self.scaling[groups.slots])
        delta = torch.bmm(torch.bmm(xg, a_t), b_t) * scaling
        y.index_add_(0, groups.rows, delta.view(-1, y.shape[1]))


def add_lora_deltas(y: torch.Tensor, x: torch.Tensor,
                    adapters: Mapping[int, LoraLinearWeights],
                    stacked: StackedLoraWeights | None, batch: LoraBatch) -> torch.Tensor:
    """Adds to the base output ``y`` (this call's own, modified in place) each adapter's
    delta on its own rows of ``x``; rows of the base model, and of adapters that do not
    target this projection, are left as they are."""
    if stacked is not None and batch.stacked is not None:
        stacked.add_deltas(y, x, batch.stacked)
        return y
    for group in batch.groups:
        weights = adapters.get(group.slot)
        if weights is None:
            continue
        if group.rows is None:
            y += weights.delta(x)
        else:
            y.index_add_(0, group.rows, weights.delta(x.index_select(0, group.rows)))
    return y
