"""Writing a step's keys and values into the paged KV cache.

Owns the kv_write kernel: token ``t`` of the step goes to flat slot ``slot_mapping[t]``
(block ``slot // block_size``, offset ``slot % block_size``), every KV head at once; a
negative slot marks a padding token and is skipped. It does not own computing the slots
(the model runner) or reading the cache (the attention kernels).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_common.model.attention.triton_kernels.kernel_config import (
    check_dtype,
    check_launchable,
)


@triton.jit
def _kv_write_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return  # padding token
    block = slot // BLOCK_SIZE
    offset_in_block = slot % BLOCK_SIZE

    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_SIZE)
    cache_offsets = (
        block * stride_cache_block
        + offset_in_block * stride_cache_slot
        + offs_h[:, None] * stride_cache_head
        + offs_d[None, :]
    )
    key = tl.load(
        key_ptr + token * stride_key_token + offs_h[:, None] * stride_key_head + offs_d[None, :],
        mask=mask,
    )
    tl.store(key_cache_ptr + cache_offsets, key, mask=mask)
    value = tl.load(
        value_ptr
        + token * stride_value_token
        + offs_h[:, None] * stride_value_head
        + offs_d[None, :],
        mask=mask,
    )
    tl.store(value_cache_ptr + cache_offsets, value, mask=mask)


def kv_write(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    kv_cache: torch.Tensor,  # [num_blocks, 2, num_kv_heads, block_size, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; < 0 skips the token
) -> None:
    """Stores each token's K and V at its slot of the paged cache, in place."""
    check_dtype(key)
    check_launchable(_kv_write_kernel, key)
    num_tokens, num_kv_heads, head_size = key.shape
    _, _, cache_kv_heads, block_size, cache_head_size = kv_cache.shape
    if num_tokens == 0:
        return
    assert (cache_kv_heads, cache_head_size) == (num_kv_heads, head_size)
    assert value.shape == key.shape and slot_mapping.shape[0] == num_tokens
    assert key.dtype == value.dtype == kv_cache.dtype
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and kv_cache.stride(-1) == 1
    assert block_size & (block_size - 1) == 0, "block size must be a power of two"

    key_cache, value_cache = kv_cache[:, 0], kv_cache[:, 1]
    _kv_write_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),  # block
        key_cache.stride(2),  # slot
        key_cache.stride(1),  # head
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=triton.next_power_of_2(head_size),
        BLOCK_SIZE=block_size,
        num_warps=1 if num_kv_heads * head_size <= 1024 else 4,
    )
