"""Projections and embedding tables: ``Linear`` (packed for oneDNN where it pays, LoRA deltas
on top) and ``Embedding`` (the token table, and the LM head's weight).

Owns the parameters and the matmul of one projection. It does not own which checkpoint
tensors fill it (the network's weight mapping) or LoRA adapter files (``engine_common.lora``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_common.lora.linear_delta import (
    LoraLinearWeights,
    StackedLoraWeights,
    add_lora_deltas,
)
from engine_common.lora.step_batch import LoraBatch
from engine_common.model.packed_linear import (
    PackedWeight,
    can_pack,
    pack_projection,
    packed_linear,
)


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    # Uninitialised: every parameter is overwritten by the checkpoint.
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """``y = x W^T (+ b)`` whose weight may be several checkpoint tensors stacked on dim 0,
    plus, for the rows of a step's ``LoraBatch``, their LoRA adapter's delta."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = empty_param(out_features, in_features, dtype=dtype, device=device)
        self.bias = empty_param(out_features, dtype=dtype, device=device) if bias else None
        self.packed_weight: PackedWeight | None = None  # see ``pack_weight``
        # LoRA adapters' weights by adapter slot; plain tensors, not parameters, as the
        # checkpoint holds none of them.
        self.lora: dict[int, LoraLinearWeights] = {}
        self.lora_stacked: StackedLoraWeights | None = None  # see ``stack_lora``

    def pack_weight(self, float32: bool = False) -> None:
        """Keep the weight only in oneDNN's packed layout, if it can be (see
        ``packed_linear``; ``float32``: float32 stands in for bf16); the plain copy is
        dropped, or the model would take twice the memory. Call after the checkpoint is
        loaded."""
        if can_pack(self.weight, float32):
            self.packed_weight = pack_projection(self.weight.data)
            self.weight.data = self.weight.data.new_empty(0)

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        if self.packed_weight is not None:
            y = packed_linear(x, self.packed_weight, self.bias)
        else:
            y = F.linear(x, self.weight, self.bias)
        if lora is None:
            return y
        # After the base output, packed or not: base rows stay bitwise what they were.
        return add_lora_deltas(y, x, self.lora, self.lora_stacked, lora) if self.lora else y

    def stack_lora(self, num_slots: int) -> None:
        """Stack the adapters' weights for steps that run several at once (restacked when
        adapters come and go; with none left, the projection is the base model's)."""
        self.lora_stacked = (
            StackedLoraWeights.stack(self.lora, num_slots, self.in_features, self.out_features)
            if self.lora else None)


class Embedding(nn.Module):
    """A [vocab_size, hidden_size] table: the token embedding, and the LM head's weight."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = empty_param(vocab_size, hidden_size, dtype=dtype, device=device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)
