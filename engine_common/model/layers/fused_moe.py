"""The experts of a mixture-of-experts layer computed as a batch: a step's (token, expert)
pairs sorted by expert, one gate/up and one down matrix product per active expert over all
its tokens, the outputs weighted and summed back per token.

Owns the torch computation of routed experts (the Triton kernel, where there is one, must
agree with it). It does not own routing (``moe``) or the weights' layout on disk.

Numerics follow Hugging Face's expert loop: each expert's rows go through ``x W13^T (+ b)``,
the activation, ``h W2^T (+ b)``, are multiplied by their routing weight, rounded to the
model dtype and added into a zeroed output in ascending expert order (one ``index_add_``
over the expert-sorted rows adds each token's experts in that same order).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

Activation = Callable[[torch.Tensor], torch.Tensor]


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
) -> torch.Tensor:  # [num_tokens, hidden]
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    token_of_row = order // top_k
    # NOTE: one host sync per layer to size the per-expert slices; the CPU path has no
    # device to wait for, and the GPU path takes the Triton kernel.
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    rows = x.index_select(0, token_of_row)
    out_rows = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        h = F.linear(rows[start:end], w13[expert])
        if b13 is not None:
            h = h + b13[expert]
        h = F.linear(activation(h), w2[expert])
        if b2 is not None:
            h = h + b2[expert]
        out_rows[start:end] = h
        start = end
    weights = topk_weights.reshape(-1).index_select(0, order)
    weighted = (out_rows * weights[:, None]).to(x.dtype)
    out = torch.zeros_like(x)
    out.index_add_(0, token_of_row, weighted)
    return out
