"""Paged attention for a ragged batch of query tokens: prefill, chunked prefill, mixed steps.

Owns the prefill kernel and its launch. Each program takes a block of BLOCK_Q consecutive
query tokens of one sequence for one KV head, with all the query heads of that KV head
folded into its rows (BLOCK_M = BLOCK_Q * queries_per_kv, padded), so each K/V tile is
read once per group (grouped-query attention). It walks the sequence's context in the
paged cache from position 0 up to its last query token, causally masked, with an online
softmax in float32. The context is the cached prefix plus this step's tokens, which
kv_write has already stored, so prefix-cache hits, chunked prefill (query_len < seq_len)
and decode rows (query_len 1) in the same batch need no special case.

Programs are numbered over the whole batch: sequence i's query blocks start at
``query_start_loc[i] // BLOCK_Q + i``, a bound that never overlaps the next sequence, so
``num_tokens // BLOCK_Q + num_seqs`` programs cover any batch and each finds its sequence
by binary search. It does not own writing the cache (kv_write).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_common.model.attention.triton_kernels.kernel_config import (
    MIN_DOT_DIM,
    check_dtype,
    check_launchable,
    dot_precision,
    padded_dim,
    widen_dot_operands,
)
from engine_common.model.attention.triton_kernels.paged_attention_tile import (
    LOG2_E,
    attend_paged_tile,
)


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """The last sequence whose first query block is at or before ``q_block``."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# The batch size and the block table's width change from step to step: not specialised on,
# so that one compiled kernel serves every step.
@triton.jit(do_not_specialize=["num_seqs", "stride_block_table"])
def _prefill_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    output_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    qk_scale,
    num_seqs,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_block_table,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    WIDEN_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q)
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    q_block_in_seq = q_block - (query_start // BLOCK_Q + seq)
    if q_block_in_seq * BLOCK_Q >= query_len:
        return  # a spare program of the upper-bound grid

    seq_len = tl.load(seq_lens_ptr + seq)
    num_cached = seq_len - query_len

    # Row r is query token r // QUERIES_PER_KV of this block, head r % QUERIES_PER_KV.
    offs_m = tl.arange(0, BLOCK_M)
    query_index = q_block_in_seq * BLOCK_Q + offs_m // QUERIES_PER_KV
    heads = kv_head * QUERIES_PER_KV + offs_m % QUERIES_PER_KV
    row_valid = (offs_m < BLOCK_Q * QUERIES_PER_KV) & (query_index < query_len)
    query_pos = num_cached + query_index
    offs_d = tl.arange(0, HEAD_PAD)
    d_mask = offs_d < HEAD_SIZE
    io_mask = row_valid[:, None] & d_mask[None, :]
    tokens = (query_start + query_index).to(tl.int64)

    q = tl.load(
        query_ptr
        + tokens[:, None] * stride_q_token
        + heads[:, None] * stride_q_head
        + offs_d[None, :],
        mask=io_mask,
        other=0.0,
    )
    if WIDEN_DOT:
        q = q.to(tl.float32)

    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    # Causal: no row of this block sees past the block's last query token.
    num_keys = num_cached + tl.minimum((q_block_in_seq + 1) * BLOCK_Q, query_len)
    for tile_start in range(0, num_keys, TILE_N):
        acc, m_i, l_i = attend_paged_tile(
            q,
            acc,
            m_i,
            l_i,
            key_cache_ptr,
            value_cache_ptr,
            block_table_row,
            tile_start,
            num_keys,
            query_pos,
            kv_head,
            stride_cache_block,
            stride_cache_slot,
            stride_cache_head,
            qk_scale,
            HEAD_SIZE,
            HEAD_PAD,
            BLOCK_SIZE,
            TILE_N,
            True,
            WIDEN_DOT,
            DOT_PRECISION,
        )

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        output_ptr
        + tokens[:, None] * stride_out_token
        + heads[:, None] * stride_out_head
        + offs_d[None, :],
        out.to(output_ptr.dtype.element_ty),
        mask=io_mask,
    )


def _default_tiling(dtype: torch.dtype, head_size: int, short_queries: bool) -> tuple[int, int]:
    """(block_m, tile_n): the largest tiles that compile for sm_90 without register spills.

    fp32 takes the smaller tiles because its exact (ieee) dot runs on FMA units and
    holds more in registers. Short (decode-like) batches use MIN_DOT_DIM query rows.
    """
    big_head = head_size > 128
    if dtype == torch.float32:
        block_m, tile_n = (16, 16) if big_head else (32, 32)
    else:
        block_m, tile_n = (64, 32) if big_head else (64, 64)
    return (MIN_DOT_DIM if short_queries else block_m), tile_n


def prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    kv_cache: torch.Tensor,  # [num_blocks, 2, num_kv_heads, block_size, head_size]
    output: torch.Tensor,  # [num_tokens, num_heads, head_size], written here
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length after this step
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    max_query_len: int | None = None,
    *,
    block_m: int | None = None,
    tile_n: int | None = None,
) -> None:
    """Causal attention of every query token of the step to its sequence's paged context."""
    check_dtype(query)
    check_launchable(_prefill_kernel, query)
    num_tokens, num_heads, head_size = query.shape
    _, _, num_kv_heads, block_size, cache_head_size = kv_cache.shape
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or num_tokens == 0:
        return
    assert cache_head_size == head_size and num_heads % num_kv_heads == 0
    assert kv_cache.dtype == query.dtype and output.dtype == query.dtype
    assert query.stride(-1) == 1 and output.stride(-1) == 1 and kv_cache.stride(-1) == 1
    assert block_size & (block_size - 1) == 0, "block size must be a power of two"
    queries_per_kv = num_heads // num_kv_heads

    short_queries = max_query_len is not None and max_query_len * queries_per_kv <= MIN_DOT_DIM
    default_block_m, default_tile_n = _default_tiling(query.dtype, head_size, short_queries)
    block_m = max(block_m or default_block_m, padded_dim(queries_per_kv))
    assert block_m & (block_m - 1) == 0, "block_m must be a power of two"
    block_q = block_m // queries_per_kv
    tile_n = tile_n or default_tile_n

    key_cache, value_cache = kv_cache[:, 0], kv_cache[:, 1]
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        query,
        key_cache,
        value_cache,
        output,
        block_tables,
        seq_lens,
        query_start_loc,
        scale * LOG2_E,
        num_seqs,
        query.stride(0),
        query.stride(1),
        output.stride(0),
        output.stride(1),
        key_cache.stride(0),  # block
        key_cache.stride(2),  # slot
        key_cache.stride(1),  # head
        block_tables.stride(0),
        QUERIES_PER_KV=queries_per_kv,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        HEAD_SIZE=head_size,
        HEAD_PAD=padded_dim(head_size),
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        WIDEN_DOT=widen_dot_operands(_prefill_kernel, query.dtype),
        DOT_PRECISION=dot_precision(query.dtype),
        num_warps=4,
    )
