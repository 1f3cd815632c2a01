"""Qwen3-MoE: Qwen3 attention (q/k norm), sparse MoE blocks on the layers
``decoder_sparse_step`` selects and ``mlp_only_layers`` leaves out, the dense gated MLP on
the rest. Routing: softmax in float32, top-k, renormalised when ``norm_topk_prob``, then
rounded to the model dtype as Hugging Face does. Experts are stored as
``mlp.experts.{e}.gate_proj|up_proj|down_proj``."""

from __future__ import annotations

import re

import torch
from torch import nn

from engine_common.model.arch_config import ModelArchConfig
from engine_common.model.attention.backend import AttentionBackend
from engine_common.model.causal_lm import CausalLM, Placement
from engine_common.model.layers.mlp import GatedMLP
from engine_common.model.layers.moe import MoeSpec, SparseMoeBlock
from engine_common.parallel.group import SINGLE, TensorParallel
from engine_common.parallel.sharding import rank_arch

_EXPERT = re.compile(
    r"^(model\.layers\.\d+\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class Qwen3MoeForCausalLM(CausalLM):
    def __init__(
        self,
        arch: ModelArchConfig,
        attention_backend_cls: type[AttentionBackend],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        parallel: TensorParallel = SINGLE,
    ):
        device = torch.device(device)
        local = rank_arch(arch, parallel.rank, parallel.size)
        spec = MoeSpec(arch.num_experts, arch.num_experts_per_tok, arch.hidden_size,
                       local.moe_intermediate_size, routing="softmax_topk",
                       normalize_topk=arch.norm_topk_prob, weights_in_model_dtype=True)

        def feed_forward(layer: int) -> tuple[str, nn.Module]:
            if arch.is_sparse_layer(layer):
                return "mlp", SparseMoeBlock(spec, dtype, device, parallel)
            return "mlp", GatedMLP(arch.hidden_size, local.intermediate_size, False, dtype,
                                   device, parallel)

        super().__init__(arch, attention_backend_cls, feed_forward, dtype, device, parallel)

    def placements(self, name: str) -> list[Placement]:
        match = _EXPERT.match(name)
        if match is None:
            return super().placements(name)
        return self.expert_placements(match, gate="gate_proj", down="down_proj")
