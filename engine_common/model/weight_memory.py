"""What a loaded model's weights take, by kind: the experts of MoE blocks, everything else
(dense), and what MXFP4 expert tensors took packed in the checkpoint."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine_common.model.layers.moe import SparseMoeBlock
from engine_common.model.onednn_gemm import OnednnGemm


def _packed_bytes(packed: object) -> int:
    if isinstance(packed, torch.Tensor):
        return packed.numel() * packed.element_size()
    return packed.nbytes if isinstance(packed, OnednnGemm) else 0


@dataclass(frozen=True)
class WeightMemory:
    dense_bytes: int
    expert_bytes: int
    # The MXFP4 blocks and scales as read (0 when none); they are dequantized at load, so
    # ``expert_bytes`` holds them in the model dtype.
    mxfp4_packed_bytes: int

    @classmethod
    def of(cls, model: nn.Module, mxfp4_packed_bytes: int) -> WeightMemory:
        expert_ids = {id(p) for m in model.modules() if isinstance(m, SparseMoeBlock)
                      for n, p in m.named_parameters() if not n.startswith("gate.")}
        dense = experts = 0
        for param in model.parameters():
            size = param.numel() * param.element_size()
            if id(param) in expert_ids:
                experts += size
            else:
                dense += size
        for module in model.modules():  # packed copies replace plain weights
            dense += _packed_bytes(getattr(module, "packed_weight", None))
            if isinstance(module, SparseMoeBlock) and module.packed is not None:
                experts += sum(w.numel() * w.element_size()
                               for w in module.packed.w13 + module.packed.w2)
        dense += _packed_bytes(getattr(model, "packed_lm_head", None))
        return cls(dense, experts, mxfp4_packed_bytes)

    def describe(self) -> str:
        gib = 1 << 30
        text = f"dense {self.dense_bytes / gib:.3f} GiB, experts {self.expert_bytes / gib:.3f} GiB"
        if self.mxfp4_packed_bytes:
            text += f" (MXFP4 packed in the checkpoint: {self.mxfp4_packed_bytes / gib:.3f} GiB)"
        return text
