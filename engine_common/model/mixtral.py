"""Mixtral: Llama attention, every layer's feed-forward a sparse MoE block
(``block_sparse_moe``: softmax over all experts in float32, top-k, renormalised; the
weights stay float32 as Hugging Face keeps them). Checkpoints store each expert as
``experts.{e}.w1`` (gate), ``w3`` (up), ``w2`` (down)."""

from __future__ import annotations

import re

import torch

from engine_common.model.arch_config import ModelArchConfig
from engine_common.model.attention.backend import AttentionBackend
from engine_common.model.causal_lm import CausalLM, Placement
from engine_common.model.layers.moe import MoeSpec, SparseMoeBlock
from engine_common.parallel.group import SINGLE, TensorParallel
from engine_common.parallel.sharding import rank_arch

_EXPERT = re.compile(r"^(model\.layers\.\d+\.block_sparse_moe)\.experts\.(\d+)\.(w[123])\.weight$")


class MixtralForCausalLM(CausalLM):
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
                       local.moe_intermediate_size, routing="softmax_topk")

        def moe(_: int) -> tuple[str, SparseMoeBlock]:
            return "block_sparse_moe", SparseMoeBlock(spec, dtype, device, parallel)

        super().__init__(arch, attention_backend_cls, moe, dtype, device, parallel)

    def placements(self, name: str) -> list[Placement]:
        match = _EXPERT.match(name)
        if match is None:
            return super().placements(name)
        return self.expert_placements(match, gate="w1", down="w2")
