"""A sparse mixture-of-experts block: the router (top-k of the softmax, or softmax of the
top-k) and the stacked expert weights, computed by ``fused_moe``.

Owns the routing rules of each network family and the expert parameters (on the CPU in
bf16, each expert's two matrices kept in oneDNN's packed layout, as the dense projections
are: see ``packed_linear``). It does not own how the checkpoint's per-expert or packed
tensors land in them (the network's weight map).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine_common.lora.step_batch import LoraBatch
from engine_common.model.layers.fused_moe import (
    Activation,
    PackedExperts,
    clamped_swiglu,
    fused_experts,
    silu_and_mul,
)
from engine_common.model.layers.linear import Linear, empty_param
from engine_common.model.packed_linear import can_pack, pack
from engine_common.parallel.group import SINGLE, TensorParallel


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    # "softmax_topk": softmax over all logits in float32, then top-k (Mixtral, Qwen3-MoE);
    # "topk_softmax": top-k of the logits, then softmax over those (GPT-OSS).
    routing: str
    # Renormalise the top-k probabilities to sum to 1 (Mixtral always; Qwen3 per config).
    normalize_topk: bool = True
    # Round the routing weights to the model dtype before use (Qwen3-MoE); Mixtral keeps
    # them in float32.
    weights_in_model_dtype: bool = False
    # Biases on the router and the experts (GPT-OSS).
    bias: bool = False
    # GPT-OSS's clamped SwiGLU; None: silu(gate) * up.
    swiglu_alpha: float | None = None
    swiglu_limit: float | None = None


def route(logits: torch.Tensor, spec: MoeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k expert ids [T, k], their weights [T, k]) from router logits [T, E]."""
    if spec.routing == "topk_softmax":
        values, ids = torch.topk(logits, spec.top_k, dim=-1)
        return ids, torch.softmax(values, dim=1, dtype=values.dtype)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    values, ids = torch.topk(probs, spec.top_k, dim=-1)
    if spec.normalize_topk:
        values = values / values.sum(dim=-1, keepdim=True)
    if spec.weights_in_model_dtype:
        values = values.to(logits.dtype)
    return ids, values


class SparseMoeBlock(nn.Module):
    def __init__(self, spec: MoeSpec, dtype: torch.dtype, device: torch.device,
                 parallel: TensorParallel = SINGLE):
        """``spec.intermediate_size``: this rank's columns of every expert (tensor-parallel
        within each expert: see ``engine_common.parallel.sharding``)."""
        super().__init__()
        self.parallel = parallel
        self.spec = spec
        e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
        self.gate = Linear(h, e, spec.bias, dtype, device)
        self.w13 = empty_param(e, 2 * i, h, dtype=dtype, device=device)
        self.w2 = empty_param(e, h, i, dtype=dtype, device=device)
        self.b13 = empty_param(e, 2 * i, dtype=dtype, device=device) if spec.bias else None
        self.b2 = empty_param(e, h, dtype=dtype, device=device) if spec.bias else None
        self.activation: Activation = (
            silu_and_mul if spec.swiglu_alpha is None
            else clamped_swiglu(spec.swiglu_alpha, spec.swiglu_limit or float("inf")))
        self.packed: PackedExperts | None = None  # see ``pack_weight``

    def pack_weight(self, float32: bool = False) -> None:
        """Keep each expert's matrices only in oneDNN's packed layout, if they can be (as
        ``Linear.pack_weight``; in bf16 the outputs are bitwise the unpacked ones, and the
        experts' matmuls 1.3x faster at 16 experts, batch 64). Call after loading."""
        if not can_pack(self.w13.data[0], float32):
            return
        self.packed = PackedExperts([pack(w) for w in self.w13.data],
                                    [pack(w) for w in self.w2.data])
        self.w13.data = self.w13.data.new_empty(0)
        self.w2.data = self.w2.data.new_empty(0)

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        # LoRA on MoE models is refused when an adapter is loaded (``CausalLM``).
        ids, weights = route(self.gate(x), self.spec)
        return self.parallel.all_reduce(fused_experts(
            x, self.w13, self.w2, ids, weights, self.activation, self.b13, self.b2,
            self.packed))
