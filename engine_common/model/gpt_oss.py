"""GPT-OSS: attention with biases and a learned sink logit per head, alternating
sliding-window and full-attention layers (``layer_types``), YaRN rotary, RMSNorm with the
weight applied in float32, and on every layer a sparse MoE block routed by top-k of the
biased router logits then softmax, with biased experts and the clamped SwiGLU.

Checkpoints store the experts fused, input dim first, gate and up columns alternating
(``mlp.experts.gate_up_proj`` [E, hidden, 2 * I]); MXFP4 checkpoints store them as
``*_blocks``/``*_scales`` pairs, dequantized on the way in (``layers.mxfp4``).
"""

from __future__ import annotations

import re

import torch

from engine_common.model.arch_config import ModelArchConfig
from engine_common.model.attention.backend import AttentionBackend
from engine_common.model.causal_lm import CausalLM, Placement
from engine_common.model.layers.moe import MoeSpec, SparseMoeBlock
from engine_common.parallel.group import SINGLE, TensorParallel
from engine_common.parallel.sharding import rank_arch

_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp)\.(experts\.\w+|router\.weight|router\.bias)$")


def _gate_up_weight(t: torch.Tensor) -> torch.Tensor:
    """[E, hidden, 2I] with gate/up columns alternating -> [E, 2I, hidden], gate rows
    first."""
    t = t.transpose(1, 2)
    return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)


def _gate_up_bias(t: torch.Tensor) -> torch.Tensor:
    return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)


def _down_weight(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)


_EXPERT_TENSORS = {
    "experts.gate_up_proj": ("w13", _gate_up_weight),
    "experts.gate_up_proj_bias": ("b13", _gate_up_bias),
    "experts.down_proj": ("w2", _down_weight),
    "experts.down_proj_bias": ("b2", None),
    "router.weight": ("gate.weight", None),
    "router.bias": ("gate.bias", None),
}


class GptOssForCausalLM(CausalLM):
    def __init__(
        self,
        arch: ModelArchConfig,
        attention_backend_cls: type[AttentionBackend],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        parallel: TensorParallel = SINGLE,
    ):
        device = torch.device(device)
        spec = MoeSpec(arch.num_experts, arch.num_experts_per_tok, arch.hidden_size,
                       rank_arch(arch, parallel.rank, parallel.size).moe_intermediate_size,
                       routing="topk_softmax", bias=True,
                       swiglu_alpha=arch.swiglu_alpha, swiglu_limit=arch.swiglu_limit)

        def moe(_: int) -> tuple[str, SparseMoeBlock]:
            return "mlp", SparseMoeBlock(spec, dtype, device, parallel)

        super().__init__(arch, attention_backend_cls, moe, dtype, device, parallel)

    def placements(self, name: str) -> list[Placement]:
        match = _EXPERTS.match(name)
        if match is None or match.group(2) not in _EXPERT_TENSORS:
            return super().placements(name)
        param, transform = _EXPERT_TENSORS[match.group(2)]
        return [Placement(f"{match.group(1)}.{param}", transform=transform)]
