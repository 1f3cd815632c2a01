"""The experts' grouped GEMM for the GPU, in Triton (as vLLM's ``fused_moe``): one launch
multiplies every expert's rows by that expert's weight, over rows sorted by expert.

Owns the kernel and its launch: the rows ``[S, K]`` (sorted by expert), the experts'
weights ``[E, N, K]``, and each expert's row range; each program computes a ``BLOCK_M x
BLOCK_N`` tile of one expert's output, ``tl.dot`` over ``K`` in ``BLOCK_K`` steps with a
float32 accumulator. It does not own routing, the activation or the weighted sum back per
token (``fused_moe``, which calls this on CUDA). Tested under ``TRITON_INTERPRET=1``
against the torch path, and compiled for sm_90 without register spills
(``tests/test_triton_fused_moe.py``); not yet run on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_common.model.attention.triton_kernels.kernel_config import check_launchable

BLOCK_M = 16
BLOCK_N = 64
BLOCK_K = 32


@triton.jit
def _grouped_gemm_kernel(
    rows_ptr, weight_ptr, out_ptr,
    tile_expert_ptr, tile_start_ptr, tile_end_ptr,
    N, K,
    stride_row, stride_we, stride_wn, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    n_block = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    start = tl.load(tile_start_ptr + tile).to(tl.int64)
    end = tl.load(tile_end_ptr + tile).to(tl.int64)
    offs_m = start + tl.arange(0, BLOCK_M)
    offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        a = tl.load(rows_ptr + offs_m[:, None] * stride_row + k[None, :],
                    mask=(offs_m[:, None] < end) & (k[None, :] < K), other=0.0)
        # The weight tile transposed: [BLOCK_K, BLOCK_N] of weight[expert, n, k].
        w = tl.load(weight_ptr + expert * stride_we + offs_n[None, :] * stride_wn + k[:, None],
                    mask=(offs_n[None, :] < N) & (k[:, None] < K), other=0.0)
        acc += tl.dot(a, w, input_precision="ieee")
    tl.store(out_ptr + offs_m[:, None] * stride_out + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < end) & (offs_n[None, :] < N))


def _tiles(counts: list[int], device: torch.device) -> tuple[torch.Tensor, ...]:
    """(expert, first row, end row) of each BLOCK_M-row tile of each expert's rows."""
    experts, starts, ends = [], [], []
    start = 0
    for expert, count in enumerate(counts):
        end = start + count
        for tile_start in range(start, end, BLOCK_M):
            experts.append(expert)
            starts.append(tile_start)
            ends.append(end)
        start = end
    return tuple(torch.tensor(v, dtype=torch.int32, device=device)
                 for v in (experts, starts, ends))


def grouped_gemm(rows: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """``out[r] = rows[r] @ weight[e].T`` for each row ``r`` of expert ``e``'s range; the
    rows are sorted by expert, ``counts[e]`` of them for expert ``e``."""
    check_launchable(_grouped_gemm_kernel, rows)
    rows, weight = rows.contiguous(), weight.contiguous()
    num_rows, k = rows.shape
    n = weight.shape[1]
    out = torch.empty((num_rows, n), dtype=rows.dtype, device=rows.device)
    tile_expert, tile_start, tile_end = _tiles(counts, rows.device)
    if tile_expert.numel() == 0:
        return out
    grid = (tile_expert.numel(), triton.cdiv(n, BLOCK_N))
    _grouped_gemm_kernel[grid](
        rows, weight, out, tile_expert, tile_start, tile_end, n, k,
        rows.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out
