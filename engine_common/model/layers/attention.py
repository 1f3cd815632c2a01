"""Self-attention of one decoder layer: fused q/k/v projection, optional per-head q/k norm,
rotary, attention over the paged cache through the shared backend, output projection; and,
where the network has them, attention sinks and a sliding window for this layer.

Owns the projections and the per-layer attention parameters. It does not own the cache or
how attention over it is computed (an ``AttentionBackend``).
"""

from __future__ import annotations

import torch
from torch import nn

from engine_common.lora.step_batch import LoraBatch
from engine_common.model.arch_config import ModelArchConfig
from engine_common.model.attention.backend import AttentionBackend, AttentionMetadata
from engine_common.model.layers.linear import Linear, empty_param
from engine_common.model.layers.norm import RMSNorm
from engine_common.model.layers.rotary import RotaryEmbedding
from engine_common.parallel.group import SINGLE, TensorParallel


class Attention(nn.Module):
    def __init__(
        self,
        arch: ModelArchConfig,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
        layer_idx: int = 0,
        parallel: TensorParallel = SINGLE,
    ):
        """``arch``: this rank's shapes (its heads, ``sharding.rank_arch``)."""
        super().__init__()
        self.parallel = parallel
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_size = arch.head_size
        self.q_size = arch.q_size
        self.kv_size = arch.kv_size
        self.qkv_proj = Linear(
            arch.hidden_size, arch.q_size + 2 * arch.kv_size, arch.qkv_bias, dtype, device
        )
        self.o_proj = Linear(arch.q_size, arch.hidden_size, arch.o_proj_bias, dtype, device)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if arch.qk_norm:
            self.q_norm = RMSNorm(arch.head_size, arch.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(arch.head_size, arch.rms_norm_eps, dtype, device)
        # A learned logit per head in the softmax's denominator (GPT-OSS).
        self.sinks = (empty_param(arch.num_heads, dtype=dtype, device=device)
                      if arch.attention_sinks else None)
        # The keys a query sees on this layer: None, all before it; else the last ``window``.
        self.window = arch.layer_window(layer_idx)
        self.backend = backend

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: RotaryEmbedding,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden, lora)
        # q and k are adjacent in the fused output, so one rotary pass covers both.
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, -1, self.head_size)
        if self.q_norm is not None and self.k_norm is not None:
            qk[:, : self.num_heads] = self.q_norm(qk[:, : self.num_heads])
            qk[:, self.num_heads :] = self.k_norm(qk[:, self.num_heads :])
        rotary.rotate_(qk, cos_sin)
        query = qk[:, : self.num_heads]
        key = qk[:, self.num_heads :]
        value = qkv[:, self.q_size + self.kv_size :].view(num_tokens, -1, self.head_size)
        if self.sinks is None and self.window is None:
            out = self.backend.forward(query, key, value, kv_cache, metadata)
        else:
            out = self.backend.forward_sinks_window(query, key, value, kv_cache, metadata,
                                                    self.sinks, self.window)
        # Row-parallel: each rank's heads give a partial sum of the projection.
        return self.parallel.all_reduce(self.o_proj(out.reshape(num_tokens, self.q_size), lora))
