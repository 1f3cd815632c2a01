"""Linear layers on the CPU through oneDNN, with each weight packed once at load time.

``F.linear`` takes the weight in its plain [out, in] layout on every call; oneDNN's
matmul on a weight reordered once into its own blocked layout is ~2x faster at decode batch
sizes (SmolLM2-135M, bf16, one core: all projections and the LM head of a step, ~50 ms plain
against ~25 ms packed) and a little faster for prefill. vLLM-CPU packs its weights too. Packing changes the layout, not the arithmetic: in bf16 the outputs are bitwise
equal to ``F.linear``'s (``tests/test_model_forward.py`` checks the logits), which is why
packing is limited to bf16 here (a packed float32 matmul differs in the last bits, and float32
is the dtype the token-for-token tests against Hugging Face run in). oneDNN's bf16 matmul
needs a CPU with AVX512 (BW, VL, DQ) or AVX-NE-CONVERT; on others (AVX2-only machines) the
weights stay plain and ``F.linear`` runs them.

Owns only the packing decision and the packed matmul; the layers that hold the weights are
in ``llama``.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def bf16_packing_supported() -> bool:
    """Whether this torch has oneDNN's packed linear and this CPU can run it in bf16: torch
    says so only by raising when asked to pack, so ask once, with a small matrix."""
    if not (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        pack(torch.zeros(16, 16, dtype=torch.bfloat16))
    except RuntimeError:  # "bf16 path needs the cpu support avx_ne_convert or avx512bw, ..."
        return False
    return True


def can_pack(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a CPU bf16 matrix that this machine can pack."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and bf16_packing_supported())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A copy of ``weight`` ([out, in]) in oneDNN's layout, usable only by ``packed_linear``."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the weight ``pack`` made."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")
