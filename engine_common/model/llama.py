"""The dense Llama-family network (Llama, Mistral, Qwen2, Qwen3): every layer's
feed-forward is the gated MLP.

Numerics follow Hugging Face's ``LlamaModel`` op for op (RMSNorm in float32 then cast
back before the weight, rotary in the model dtype from float32 cos/sin, SiLU rounded
before the multiply), so greedy outputs match token for token.
"""

from __future__ import annotations

import torch

from engine_common.model.arch_config import ModelArchConfig
from engine_common.model.attention.backend import AttentionBackend
from engine_common.model.causal_lm import CausalLM
from engine_common.model.layers.mlp import GatedMLP
from engine_common.parallel.group import SINGLE, TensorParallel
from engine_common.parallel.sharding import rank_arch


class LlamaForCausalLM(CausalLM):
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

        def mlp(_: int) -> tuple[str, GatedMLP]:
            return "mlp", GatedMLP(local.hidden_size, local.intermediate_size, local.mlp_bias,
                                   dtype, device, parallel)

        super().__init__(arch, attention_backend_cls, mlp, dtype, device, parallel)
