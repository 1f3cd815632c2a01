"""The dense gated MLP: ``down(silu(gate(x)) * up(x))`` with gate and up fused, and SiLU x
up one fused CPU kernel (``cpu_fused``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_common.lora.step_batch import LoraBatch
from engine_common.model.layers.cpu_fused import silu_ops_for
from engine_common.model.layers.linear import Linear
from engine_common.parallel.group import SINGLE, TensorParallel


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool,
                 dtype: torch.dtype, device: torch.device, parallel: TensorParallel = SINGLE):
        """``intermediate_size``: this rank's columns (gate/up column-, down row-parallel)."""
        super().__init__()
        self.parallel = parallel
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias, dtype, device)
        self.down_proj = Linear(intermediate_size, hidden_size, bias, dtype, device)

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, lora)
        fits = gate_up.dim() == 2 and gate_up.stride(1) == 1
        ops = silu_ops_for(gate_up, self.intermediate_size) if fits else None
        if ops is not None:
            hidden = ops.silu_mul(gate_up, self.intermediate_size)
        else:
            gate = gate_up[:, : self.intermediate_size]
            up = gate_up[:, self.intermediate_size :]
            hidden = F.silu(gate) * up
        return self.parallel.all_reduce(self.down_proj(hidden, lora))
