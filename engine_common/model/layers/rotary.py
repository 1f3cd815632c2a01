"""Rotary position embeddings: the inverse frequencies of each scaling type (default,
linear, llama3, YaRN) and the neox-style rotation over precomputed cos/sin.

Owns the frequencies and the rotation (one fused CPU kernel pass where ``cpu_fused`` has
one, bit-identical to the torch ops). The scaling parameters come from ``arch_config``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine_common.model.arch_config import ModelArchConfig
from engine_common.model.layers.cpu_fused import rotary_ops_for


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: dict[str, float]) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_attention_factor(scaling: dict[str, float]) -> float:
    factor = scaling["factor"]
    if "attention_factor" in scaling:
        return scaling["attention_factor"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
    return mscale(factor)


def _yarn_frequencies(arch: ModelArchConfig) -> torch.Tensor:
    """YaRN's blend of interpolated and extrapolated frequencies (as HF's
    ``_compute_yarn_parameters``, op for op in float32)."""
    scaling, dim, base = arch.rope_scaling, arch.head_size, arch.rope_theta
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32.0
    beta_slow = scaling.get("beta_slow") or 1.0

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", 1.0):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # NOTE: HF's guard against a zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def inverse_frequencies(arch: ModelArchConfig) -> tuple[torch.Tensor, float]:
    """The rotary inverse frequencies and the factor cos/sin are multiplied by."""
    if arch.rope_type == "yarn":
        return _yarn_frequencies(arch), _yarn_attention_factor(arch.rope_scaling)
    dim = arch.head_size
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (arch.rope_theta**exponents)
    if arch.rope_type == "linear":
        inv_freq = inv_freq / arch.rope_scaling["factor"]
    elif arch.rope_type == "llama3":
        inv_freq = _llama3_frequencies(inv_freq, arch.rope_scaling)
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding with cos/sin precomputed for every position.

    HF builds ``cos = cat(freqs, freqs).cos()``, so both halves of a head share the same
    cos/sin; storing one half and rotating the halves separately gives bit-identical results
    (``a*c + (-b)*s`` rounds exactly like ``a*c - b*s``).
    """

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        inv_freq, attention_factor = inverse_frequencies(arch)
        inv_freq = inv_freq.to(device)
        positions = torch.arange(arch.max_position_embeddings, dtype=torch.int64,
                                 device=device).float()
        # float32 like HF, rounded to the model dtype only at the end; on the model's device,
        # as HF computes cos/sin there (a GPU's cos may differ from the CPU's in the last bit).
        freqs = positions[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        if attention_factor != 1.0:
            cos, sin = cos * attention_factor, sin * attention_factor
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", cos.to(dtype), persistent=False)
        self.register_buffer("sin", sin.to(dtype), persistent=False)
        self.half_size = arch.head_size // 2

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for ``positions``, [num_tokens, 1, head_size // 2]; looked up once per
        step and shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def rotate_(self, qk: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Rotates ``qk`` [num_tokens, num_heads, head_size] in place."""
        cos, sin = cos_sin
        fits = (qk.dim() == 3 and qk.stride(2) == 1 and cos.dtype == qk.dtype
                and cos.is_contiguous() and sin.is_contiguous())
        ops = rotary_ops_for(qk) if fits else None
        if ops is not None:
            ops.rotate_(qk, cos, sin)
            return
        x1 = qk[..., : self.half_size]
        x2 = qk[..., self.half_size :]
        first = x1 * cos - x2 * sin
        second = x2 * cos + x1 * sin
        x1.copy_(first)
        x2.copy_(second)
