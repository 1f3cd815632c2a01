"""The experts of a mixture-of-experts layer computed as a batch: a step's (token, expert)
pairs sorted by expert, one gate/up and one down matrix product per active expert over all
its tokens, the outputs weighted and summed back per token.

With the experts' weights packed for oneDNN (the CPU in bf16: ``moe.SparseMoeBlock.
pack_weight``), one packed matmul pair per active expert; else where torch has a grouped
GEMM (``F.grouped_mm``; on the CPU) both projections are one call each over all experts; on
CUDA, the Triton grouped GEMM (``triton_fused_moe``); otherwise one ``F.linear`` pair per
active expert.

Owns the torch computation of routed experts (the Triton kernel, where there is one, must
agree with it). It does not own routing (``moe``) or the weights' layout on disk.

Numerics follow Hugging Face's expert loop: each expert's rows go through ``x W13^T (+ b)``,
the activation, ``h W2^T (+ b)``, are multiplied by their routing weight, rounded to the
model dtype and added into a zeroed output in ascending expert order (one ``index_add_``
over the expert-sorted rows adds each token's experts in that same order).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine_common.model.packed_linear import packed_linear

Activation = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class PackedExperts:
    """Each expert's gate/up ([2 * intermediate, hidden]) and down ([hidden, intermediate])
    matrices in oneDNN's packed layout (``packed_linear.pack``), by expert."""

    w13: list[torch.Tensor]
    w2: list[torch.Tensor]


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` with gate the first half of the columns, up the second."""
    half = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :half]) * gate_up[..., half:]


def clamped_swiglu(alpha: float, limit: float) -> Activation:
    """GPT-OSS's activation: gate clamped above at ``limit``, up to ``[-limit, limit]``,
    ``(up + 1) * gate * sigmoid(alpha * gate)``; gate first half, up second (the loader
    de-interleaves the checkpoint's alternating columns)."""

    def activation(gate_up: torch.Tensor) -> torch.Tensor:
        half = gate_up.shape[-1] // 2
        gate = gate_up[..., :half].clamp(min=None, max=limit)
        up = gate_up[..., half:].clamp(min=-limit, max=limit)
        glu = gate * torch.sigmoid(gate * alpha)
        return (up + 1) * glu

    return activation


def fused_experts(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]
    w2: torch.Tensor,  # [num_experts, hidden, intermediate]
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int64
    topk_weights: torch.Tensor,  # [num_tokens, top_k]
    activation: Activation,
    b13: torch.Tensor | None = None,  # [num_experts, 2 * intermediate]
    b2: torch.Tensor | None = None,  # [num_experts, hidden]
    packed: PackedExperts | None = None,  # w13 and w2 packed (then both are empty)
) -> torch.Tensor:  # [num_tokens, hidden]
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    sorted_ids, order = torch.sort(flat_ids, stable=True)
    token_of_row = order // top_k
    rows = x.index_select(0, token_of_row)
    num_experts = w13.shape[0] if packed is None else len(packed.w13)
    if packed is not None:
        matrices = (packed.w13, packed.w2)
        out_rows = _expert_loop(
            rows, flat_ids, num_experts,
            lambda h, e, which: packed_linear(h, matrices[which][e], None), activation, b13, b2)
    elif _grouped_mm is not None and x.device.type == "cpu" and _aligned(w13, w2):
        out_rows = _grouped_experts(rows, sorted_ids, num_experts, w13, w2, activation, b13, b2)
    elif x.device.type == "cuda":
        out_rows = triton_experts(rows, flat_ids, num_experts, w13, w2, activation, b13, b2)
    else:
        out_rows = _expert_loop(rows, flat_ids, num_experts, plain_projection(w13, w2),
                                activation, b13, b2)
    weights = topk_weights.reshape(-1).index_select(0, order)
    weighted = (out_rows * weights[:, None]).to(x.dtype)
    out = torch.zeros_like(x)
    out.index_add_(0, token_of_row, weighted)
    return out


# torch's grouped GEMM (one call over every expert's rows), where this torch has it.
_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _aligned(*weights: torch.Tensor) -> bool:
    """Whether the grouped GEMM takes these: every row a multiple of 16 bytes."""
    return all(size * w.element_size() % 16 == 0 for w in weights for size in w.shape[1:])


def _grouped_experts(rows: torch.Tensor, sorted_ids: torch.Tensor, num_experts: int,
                     w13: torch.Tensor, w2: torch.Tensor, activation: Activation,
                     b13: torch.Tensor | None, b2: torch.Tensor | None) -> torch.Tensor:
    """Both projections as grouped GEMMs over the expert-sorted rows (offsets: each
    expert's last row + 1); no host sync. Bitwise the per-expert ``F.linear``s' result on
    the CPU (measured), and ~15% faster at 16 experts."""
    assert _grouped_mm is not None
    counts = torch.bincount(sorted_ids, minlength=num_experts)
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    h = _grouped_mm(rows, w13.transpose(1, 2), offs=offsets)
    if b13 is not None:
        h = h + b13.index_select(0, sorted_ids)
    h = _grouped_mm(activation(h), w2.transpose(1, 2), offs=offsets)
    if b2 is not None:
        h = h + b2.index_select(0, sorted_ids)
    return h


def triton_experts(rows: torch.Tensor, flat_ids: torch.Tensor, num_experts: int,
                   w13: torch.Tensor, w2: torch.Tensor, activation: Activation,
                   b13: torch.Tensor | None, b2: torch.Tensor | None) -> torch.Tensor:
    """Both projections as the Triton grouped GEMM (``triton_fused_moe``) over the
    expert-sorted ``rows``; CUDA, or Triton's interpreter."""
    # NOTE: imported here so that CPU-only runs never import Triton.
    from engine_common.model.layers.triton_fused_moe import grouped_gemm

    sorted_ids = torch.sort(flat_ids, stable=True).values
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    h = grouped_gemm(rows, w13, counts)
    if b13 is not None:
        h = h + b13.index_select(0, sorted_ids)
    h = grouped_gemm(activation(h), w2, counts)
    if b2 is not None:
        h = h + b2.index_select(0, sorted_ids)
    return h


# ``project(x, expert, 0)``: the expert's gate/up projection of x; ``(x, expert, 1)``: down.
Projection = Callable[[torch.Tensor, int, int], torch.Tensor]


def plain_projection(w13: torch.Tensor, w2: torch.Tensor) -> Projection:
    """The experts' projections as ``F.linear`` on the stacked weights."""
    return lambda h, expert, which: F.linear(h, (w13, w2)[which][expert])


def _expert_loop(rows: torch.Tensor, flat_ids: torch.Tensor, num_experts: int,
                 project: Projection,
                 activation: Activation, b13: torch.Tensor | None,
                 b2: torch.Tensor | None) -> torch.Tensor:
    """One matmul pair per active expert over its rows (``rows`` sorted by expert):
    ``project(x, expert, 0)`` is its gate/up projection, ``project(x, expert, 1)`` its down
    projection (``F.linear``, or oneDNN's packed matmul: bitwise the grouped GEMM's result in
    bf16, tested)."""
    # NOTE: one host sync per layer to size the per-expert slices.
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    out_rows = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        # Biases added after, as the other paths do (a fused bias rounds once, not twice).
        h = project(rows[start:end], expert, 0)
        if b13 is not None:
            h = h + b13[expert]
        h = project(activation(h), expert, 1)
        if b2 is not None:
            h = h + b2[expert]
        out_rows[start:end] = h
        start = end
    return out_rows
