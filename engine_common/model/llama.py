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


class LlamaForCausalLM(CausalLM):
    def __init__(
        self,
        arch: ModelArchConfig,
        attention_backend_cls: type[AttentionBackend],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        device = torch.device(device)

        def mlp(_: int) -> tuple[str, GatedMLP]:
            return "mlp", GatedMLP(arch.hidden_size, arch.intermediate_size, arch.mlp_bias,
                                   dtype, device)

        super().__init__(arch, attention_backend_cls, mlp, dtype, device)
