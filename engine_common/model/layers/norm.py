"""RMSNorm, rounded where each reference model rounds it, and its fused form with the
residual add before it (``add_forward``): one pass of the fused CPU kernel on the CPU
(``cpu_fused``, bit-identical to the torch ops), the torch ops elsewhere."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_common.model.layers.cpu_fused import FusedCpuOps, norm_ops_for
from engine_common.model.layers.linear import empty_param


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device,
                 weight_in_float32: bool = False):
        super().__init__()
        self.weight = empty_param(hidden_size, dtype=dtype, device=device)
        self.eps = eps
        self.normalized_shape = (hidden_size,)
        # GPT-OSS multiplies by the weight before rounding to the model dtype; Llama after.
        self.weight_in_float32 = weight_in_float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = self._fused_ops(x)
        if ops is not None:
            return ops.add_rms_norm(x, None, self.weight, self.eps, self.weight_in_float32)[0]
        return self._torch_forward(x)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``, the sum rounded to x's dtype as the
        model's residual add rounds it; without a residual, ``(norm(x), x)``."""
        ops = self._fused_ops(x)
        if ops is not None:
            return ops.add_rms_norm(x, residual, self.weight, self.eps, self.weight_in_float32)
        if residual is not None:
            x = residual + x
        return self._torch_forward(x), x

    def _fused_ops(self, x: torch.Tensor) -> FusedCpuOps | None:
        if x.dim() != 2 or x.stride(1) != 1 or self.weight.dtype != x.dtype:
            return None  # e.g. per-head q/k norms: [tokens, heads, head] views
        return norm_ops_for(x)

    def _torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_in_float32:
            normed = F.rms_norm(x.float(), self.normalized_shape, eps=self.eps)
            return (self.weight.float() * normed).to(x.dtype)
        # F.rms_norm normalises in float32 and rounds once to x's dtype, which is exactly
        # HF's x.float() * rsqrt(mean(x^2) + eps) then .to(dtype); the weight multiplies
        # after the rounding, in the model dtype, as in HF.
        return self.weight * F.rms_norm(x, self.normalized_shape, eps=self.eps)
