"""Paged decode attention: one query token per sequence, flash-decoding split over the context.

Owns the decode kernels and their launch. Stage 1 runs one program per (sequence, KV head,
split): it attends all query heads that share the KV head at once (grouped-query attention,
so each K/V tile is read once per group) over its slice of the context, and leaves a
normalised partial output with its log-sum-exp, all in float32. Stage 2 merges the splits.
With a single split, stage 1 writes the output itself and stage 2 is skipped.

The number of splits grows when there are too few (sequence, KV head) programs to fill
the GPU, so small batches with long contexts still use every SM. It does not own writing
the cache (kv_write) or sequences with several query tokens (prefill_attention).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_common.model.attention.triton_kernels.kernel_config import (
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

MAX_NUM_SPLITS = 64
# Below this many keys per split, the extra partial-output traffic outweighs the parallelism.
MIN_TOKENS_PER_SPLIT = 128
# Programs per SM the split count aims for, so memory latency is hidden by other programs.
PROGRAMS_PER_SM = 4
# Stand-in SM count off the GPU (interpreter): few programs keep the interpreter fast.
_CPU_NUM_SMS = 1


# Arguments that change from step to step are not specialised on (Triton compiles a variant
# per value of 1 and per divisibility by 16 otherwise): one compiled kernel serves all steps.
@triton.jit(do_not_specialize=["num_splits", "stride_block_table", "stride_part_seq",
                               "stride_part_head", "stride_part_split", "stride_lse_seq",
                               "stride_lse_head"])
def _decode_split_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    output_ptr,
    partial_out_ptr,  # [num_seqs, num_heads, num_splits, head_size] float32
    partial_lse_ptr,  # [num_seqs, num_heads, num_splits] float32, log2 domain
    qk_scale,
    num_splits,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_block_table,
    stride_part_seq,
    stride_part_head,
    stride_part_split,
    stride_lse_seq,
    stride_lse_head,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    WIDEN_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    # Splits are whole tiles; for short sequences the trailing splits are empty.
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), TILE_N) * TILE_N
    split_start = split * split_len
    split_end = tl.minimum(split_start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    head_mask = offs_h < QUERIES_PER_KV
    heads = kv_head * QUERIES_PER_KV + offs_h
    offs_d = tl.arange(0, HEAD_PAD)
    d_mask = offs_d < HEAD_SIZE
    row_mask = head_mask[:, None] & d_mask[None, :]

    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q = tl.load(
        query_ptr + token * stride_q_token + heads[:, None] * stride_q_head + offs_d[None, :],
        mask=row_mask,
        other=0.0,
    )
    if WIDEN_DOT:
        q = q.to(tl.float32)

    acc = tl.zeros([BLOCK_H, HEAD_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    for tile_start in range(split_start, split_end, TILE_N):
        acc, m_i, l_i = attend_paged_tile(
            q,
            acc,
            m_i,
            l_i,
            key_cache_ptr,
            value_cache_ptr,
            block_table_row,
            tile_start,
            split_end,
            offs_h,
            kv_head,
            stride_cache_block,
            stride_cache_slot,
            stride_cache_head,
            qk_scale,
            HEAD_SIZE,
            HEAD_PAD,
            BLOCK_SIZE,
            TILE_N,
            False,
            WIDEN_DOT,
            DOT_PRECISION,
        )

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if SINGLE_SPLIT:
        tl.store(
            output_ptr
            + token * stride_out_token
            + heads[:, None] * stride_out_head
            + offs_d[None, :],
            out.to(output_ptr.dtype.element_ty),
            mask=row_mask,
        )
    else:
        # An empty split leaves output 0 and lse -inf: weight zero in the merge.
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(
            partial_out_ptr
            + seq.to(tl.int64) * stride_part_seq
            + heads[:, None] * stride_part_head
            + split * stride_part_split
            + offs_d[None, :],
            out,
            mask=row_mask,
        )
        tl.store(
            partial_lse_ptr + seq.to(tl.int64) * stride_lse_seq + heads * stride_lse_head + split,
            lse,
            mask=head_mask,
        )


@triton.jit(do_not_specialize=["num_splits", "stride_part_seq", "stride_part_head",
                               "stride_part_split", "stride_lse_seq", "stride_lse_head"])
def _decode_merge_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    output_ptr,
    query_start_loc_ptr,
    num_splits,
    stride_part_seq,
    stride_part_head,
    stride_part_split,
    stride_lse_seq,
    stride_lse_head,
    stride_out_token,
    stride_out_head,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    split_mask = offs_s < num_splits
    offs_d = tl.arange(0, HEAD_PAD)
    d_mask = offs_d < HEAD_SIZE

    lse = tl.load(
        partial_lse_ptr + seq.to(tl.int64) * stride_lse_seq + head * stride_lse_head + offs_s,
        mask=split_mask,
        other=float("-inf"),
    )
    # Split 0 always holds keys (seq_len >= 1), so the max is finite.
    weights = tl.exp2(lse - tl.max(lse, 0))
    parts = tl.load(
        partial_out_ptr
        + seq.to(tl.int64) * stride_part_seq
        + head * stride_part_head
        + offs_s[:, None] * stride_part_split
        + offs_d[None, :],
        mask=split_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    out = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    tl.store(
        output_ptr + token * stride_out_token + head * stride_out_head + offs_d,
        out.to(output_ptr.dtype.element_ty),
        mask=d_mask,
    )


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Splits per (sequence, KV head): enough programs to fill ``num_sms``, a power of two.

    Never more than the longest context can use (MIN_TOKENS_PER_SPLIT keys each) nor
    MAX_NUM_SPLITS, so large batches and short contexts run a single split.
    """
    programs = max(1, num_seqs * num_kv_heads)
    wanted = triton.cdiv(PROGRAMS_PER_SM * num_sms, programs)
    useful = triton.cdiv(max(1, max_seq_len), MIN_TOKENS_PER_SPLIT)
    splits = max(1, min(wanted, useful, MAX_NUM_SPLITS))
    return 1 << (splits.bit_length() - 1)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _CPU_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_size], one token per sequence
    kv_cache: torch.Tensor,  # [num_blocks, 2, num_kv_heads, block_size, head_size]
    output: torch.Tensor,  # [num_seqs, num_heads, head_size], written here
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including this token (>= 1)
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32: sequence i's token index
    scale: float,
    max_seq_len: int,
    *,
    num_splits: int | None = None,
    tile_n: int | None = None,
) -> None:
    """Attends each sequence's single query token to its whole context in the paged cache."""
    check_dtype(query)
    check_launchable(_decode_split_kernel, query)
    num_heads, head_size = query.shape[1], query.shape[2]
    _, _, num_kv_heads, block_size, cache_head_size = kv_cache.shape
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0:
        return
    assert cache_head_size == head_size and num_heads % num_kv_heads == 0
    assert kv_cache.dtype == query.dtype and output.dtype == query.dtype
    assert query.stride(-1) == 1 and output.stride(-1) == 1 and kv_cache.stride(-1) == 1
    assert block_size & (block_size - 1) == 0, "block size must be a power of two"
    queries_per_kv = num_heads // num_kv_heads

    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, _num_sms(query.device))
    assert 1 <= num_splits <= MAX_NUM_SPLITS
    if tile_n is None:
        # Largest tiles that compile for sm_90 without register spills.
        tile_n = 64 if head_size <= 128 else (16 if query.dtype == torch.float32 else 32)
    head_pad = padded_dim(head_size)
    single_split = num_splits == 1

    key_cache, value_cache = kv_cache[:, 0], kv_cache[:, 1]
    if single_split:
        # Not read: the single-split kernel writes the output directly.
        partial_out = partial_lse = output
        part_strides: tuple[int, ...] = (0, 0, 0)
        lse_strides: tuple[int, ...] = (0, 0)
    else:
        partial_out = torch.empty(
            (num_seqs, num_heads, num_splits, head_size), dtype=torch.float32, device=query.device
        )
        partial_lse = torch.empty(
            (num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device
        )
        part_strides = partial_out.stride()[:3]
        lse_strides = partial_lse.stride()[:2]

    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        output,
        partial_out,
        partial_lse,
        scale * LOG2_E,
        num_splits,
        query.stride(0),
        query.stride(1),
        output.stride(0),
        output.stride(1),
        key_cache.stride(0),  # block
        key_cache.stride(2),  # slot
        key_cache.stride(1),  # head
        block_tables.stride(0),
        *part_strides,
        *lse_strides,
        QUERIES_PER_KV=queries_per_kv,
        BLOCK_H=padded_dim(queries_per_kv),
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        SINGLE_SPLIT=single_split,
        WIDEN_DOT=widen_dot_operands(_decode_split_kernel, query.dtype),
        DOT_PRECISION=dot_precision(query.dtype),
        num_warps=4,
    )
    if single_split:
        return
    _decode_merge_kernel[(num_seqs, num_heads)](
        partial_out,
        partial_lse,
        output,
        query_start_loc,
        num_splits,
        *part_strides,
        *lse_strides,
        output.stride(0),
        output.stride(1),
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        SPLITS_PAD=triton.next_power_of_2(num_splits),
        num_warps=4,
    )
