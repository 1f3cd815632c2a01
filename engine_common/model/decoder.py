"""The pre-norm decoder stack every supported network shares: embeddings, layers of
(RMSNorm, attention, residual, RMSNorm, feed-forward, residual), the final norm. Each
residual add is done by the norm after it (``RMSNorm.add_forward``: one fused pass on the
CPU), so a layer hands on its output and the residual stream unsummed.

Owns the stack's wiring. The feed-forward of each layer (dense MLP or sparse MoE block) and
its attribute name are the network's choice (``FeedForwardFactory``), so checkpoint names
map onto parameters one to one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine_common.lora.step_batch import LoraBatch
from engine_common.model.arch_config import ModelArchConfig
from engine_common.model.attention.backend import AttentionBackend, AttentionMetadata
from engine_common.model.attention.kv_cache_layout import layer_cache
from engine_common.model.layers.attention import Attention
from engine_common.model.layers.linear import Embedding
from engine_common.model.layers.norm import RMSNorm
from engine_common.model.layers.rotary import RotaryEmbedding
from engine_common.parallel.group import SINGLE, TensorParallel
from engine_common.parallel.vocab_embedding import VocabParallelEmbedding

# (layer index) -> (attribute name, module): the layer's MLP or MoE block.
FeedForwardFactory = Callable[[int], tuple[str, nn.Module]]


class DecoderLayer(nn.Module):
    ffn: nn.Module
    def __init__(
        self,
        arch: ModelArchConfig,
        backend: AttentionBackend,
        feed_forward: tuple[str, nn.Module],
        layer_idx: int,
        dtype: torch.dtype,
        device: torch.device,
        parallel: TensorParallel = SINGLE,
    ):
        super().__init__()
        norm_in_float32 = arch.norm_weight_in_float32
        self.self_attn = Attention(arch, backend, dtype, device, layer_idx, parallel)
        self.ffn_name, ffn = feed_forward
        self.add_module(self.ffn_name, ffn)
        # NOTE: a plain reference besides the registered one, so forward needs no name
        # lookup and the parameters are registered (and named) once.
        object.__setattr__(self, "ffn", ffn)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device,
                                       norm_in_float32)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype,
                                                device, norm_in_float32)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryEmbedding,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        lora: LoraBatch | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, residual)``: the layer's output is ``residual + out``, left unsummed so
        that the next norm adds it in the same pass (``RMSNorm.add_forward``); ``residual``
        None on the first layer, whose input is ``hidden`` alone."""
        normed, residual = self.input_layernorm.add_forward(hidden, residual)
        attn = self.self_attn(normed, rotary, cos_sin, kv_cache, metadata, lora)
        normed, residual = self.post_attention_layernorm.add_forward(attn, residual)
        return self.ffn(normed, lora), residual


class DecoderModel(nn.Module):
    def __init__(
        self,
        arch: ModelArchConfig,
        backend: AttentionBackend,
        feed_forward: FeedForwardFactory,
        dtype: torch.dtype,
        device: torch.device,
        parallel: TensorParallel = SINGLE,
    ):
        """``arch``: this rank's shapes (``sharding.rank_arch``; the model's when alone)."""
        super().__init__()
        self.embed_tokens = (
            VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, dtype, device, parallel)
            if parallel.is_parallel else Embedding(arch.vocab_size, arch.hidden_size, dtype, device))
        self.layers = nn.ModuleList(
            DecoderLayer(arch, backend, feed_forward(i), i, dtype, device, parallel)
            for i in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device,
                            arch.norm_weight_in_float32)
        self.rotary = RotaryEmbedding(arch, dtype, device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        cos_sin = self.rotary.cos_sin(positions)
        views = metadata.layer_views
        for i, layer in enumerate(self.layers):
            if views is None:
                hidden, residual = layer(hidden, residual, self.rotary, cos_sin,
                                         layer_cache(kv_cache, i), metadata, lora)
            else:  # KV cache groups: the layer's slot and its group's block tables
                slot, group_metadata = views[i]
                hidden, residual = layer(hidden, residual, self.rotary, cos_sin,
                                         layer_cache(kv_cache, slot), group_metadata, lora)
        return self.norm.add_forward(hidden, residual)[0]
