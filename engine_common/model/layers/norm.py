"""RMSNorm, rounded where each reference model rounds it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

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
        if self.weight_in_float32:
            normed = F.rms_norm(x.float(), self.normalized_shape, eps=self.eps)
            return (self.weight.float() * normed).to(x.dtype)
        # F.rms_norm normalises in float32 and rounds once to x's dtype, which is exactly
        # HF's x.float() * rsqrt(mean(x^2) + eps) then .to(dtype); the weight multiplies
        # after the rounding, in the model dtype, as in HF.
        return self.weight * F.rms_norm(x, self.normalized_shape, eps=self.eps)
