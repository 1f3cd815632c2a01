"""The inner step of paged attention, shared by the decode and prefill kernels.

Owns one tile of keys: gathering its K and V from the paged cache through the block
table, scoring it against a tile of query rows, and folding it into the running
(online-softmax) output in float32. It does not own which tiles a program visits or how
query rows are laid out: those belong to the kernels that call it.

Scores live in the log2 domain (the softmax scale is premultiplied by log2(e)) so the
exponentials are ``exp2``.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2_E = 1.4426950408889634


@triton.jit
def attend_paged_tile(
    q,  # [BLOCK_M, HEAD_PAD] query rows, already in the dot operand dtype
    acc,  # [BLOCK_M, HEAD_PAD] float32 unnormalised output
    m_i,  # [BLOCK_M] float32 running max of the scores
    l_i,  # [BLOCK_M] float32 running sum of exp2(score - m_i)
    key_cache_ptr,
    value_cache_ptr,
    block_table_ptr,  # this sequence's row of the block table
    tile_start,  # position of the tile's first key in the sequence
    key_end,  # keys at positions >= key_end are outside this program's range
    query_pos,  # [BLOCK_M] absolute position of each query row (read only when CAUSAL)
    kv_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    qk_scale,  # softmax scale * log2(e)
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    WIDEN_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    key_pos = tile_start + tl.arange(0, TILE_N)
    key_mask = key_pos < key_end
    offs_d = tl.arange(0, HEAD_PAD)
    d_mask = offs_d < HEAD_SIZE

    # Per-key block lookup, so a tile may span several cache blocks or part of one.
    block_ids = tl.load(block_table_ptr + key_pos // BLOCK_SIZE, mask=key_mask, other=0)
    slot_offsets = (
        block_ids.to(tl.int64) * stride_cache_block
        + (key_pos % BLOCK_SIZE).to(tl.int64) * stride_cache_slot
        + kv_head * stride_cache_head
    )
    # Masked loads read zeros: slots past the context may hold anything, NaN included.
    k_t = tl.load(
        key_cache_ptr + slot_offsets[None, :] + offs_d[:, None],
        mask=d_mask[:, None] & key_mask[None, :],
        other=0.0,
    )  # [HEAD_PAD, TILE_N]
    v = tl.load(
        value_cache_ptr + slot_offsets[:, None] + offs_d[None, :],
        mask=key_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [TILE_N, HEAD_PAD]
    if WIDEN_DOT:
        k_t = k_t.to(tl.float32)

    scores = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale
    if CAUSAL:
        visible = key_mask[None, :] & (key_pos[None, :] <= query_pos[:, None])
    else:
        visible = key_mask[None, :]
    scores = tl.where(visible, scores, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(scores, 1))
    # A row with no visible key so far keeps m = -inf; exponentiate against 0 instead so
    # it contributes zeros rather than NaN (inf - inf).
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)

    # P is rounded to the cache dtype for the second dot, as flash attention does.
    p_dot = p.to(value_cache_ptr.dtype.element_ty)
    if WIDEN_DOT:
        p_dot = p_dot.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p_dot, v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i
