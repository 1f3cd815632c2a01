"""The CPU KV-write kernel (``engine_common.model.attention.cpu_kv_write``) against PyTorch
indexing (``kv_cache_layout.write_kv_indexed``): the same bytes in every slot, for each
dtype and row width, a layer's strided view of the engine cache, K and V strided out of one
projection, padding slots skipped, and bad arguments refused before anything is written."""

from __future__ import annotations

import pytest
import torch

from engine_common.model.attention.cpu_kv_write import load_kv_write
from engine_common.model.attention.kv_cache_layout import (
    key_value,
    kv_cache_shape,
    layer_cache,
    write_kv,
    write_kv_indexed,
)

LAYERS, BLOCKS, KV_HEADS, BLOCK, HEAD = 3, 12, 3, 16, 64


@pytest.fixture(scope="module")
def kernel():
    loaded = load_kv_write()
    assert loaded is not None, "the KV-write kernel must build here (g++ is installed)"
    return loaded


def _step(dtype: torch.dtype, tokens: int, seed: int):
    """K and V as the model has them: views into one fused QKV output, token-strided."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (9 + 2 * KV_HEADS) * HEAD, generator=g).to(dtype)
    key = qkv[:, 9 * HEAD:(9 + KV_HEADS) * HEAD].view(tokens, KV_HEADS, HEAD)
    value = qkv[:, (9 + KV_HEADS) * HEAD:].view(tokens, KV_HEADS, HEAD)
    slots = torch.randperm(BLOCKS * BLOCK, generator=g)[:tokens]
    return key, value, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 64, 150])
def test_the_kernel_writes_what_indexing_writes(kernel, dtype, tokens):
    key, value, slots = _step(dtype, tokens, seed=tokens)
    expected = torch.randn(kv_cache_shape(LAYERS, BLOCKS, BLOCK, KV_HEADS, HEAD)).to(dtype)
    written = expected.clone()
    write_kv_indexed(*key_value(layer_cache(expected, 1)), key, value, slots)
    kernel(*key_value(layer_cache(written, 1)), key, value, slots)
    assert torch.equal(written.view(torch.uint8), expected.view(torch.uint8))
    # And the layout's own entry point takes the kernel on the CPU: the same again.
    again = expected.clone()
    write_kv(layer_cache(again, 1), key, value, slots)
    assert torch.equal(again.view(torch.uint8), expected.view(torch.uint8))


def test_padding_slots_are_skipped(kernel):
    key, value, slots = _step(torch.bfloat16, 8, seed=1)
    slots[3] = -1
    cache = torch.zeros(kv_cache_shape(1, BLOCKS, BLOCK, KV_HEADS, HEAD), dtype=torch.bfloat16)
    k_cache, v_cache = key_value(layer_cache(cache, 0))
    kernel(k_cache, v_cache, key, value, slots)
    blocks, offsets = slots // BLOCK, slots % BLOCK
    for t in (0, 1, 2, 4, 5, 6, 7):
        assert torch.equal(k_cache[blocks[t], :, offsets[t]], key[t])
        assert torch.equal(v_cache[blocks[t], :, offsets[t]], value[t])
    assert int((cache != 0).sum()) == 7 * 2 * KV_HEADS * HEAD  # nothing else written


def test_bad_arguments_are_refused_before_any_write(kernel):
    key, value, slots = _step(torch.float32, 4, seed=2)
    cache = torch.zeros(kv_cache_shape(1, BLOCKS, BLOCK, KV_HEADS, HEAD))
    k_cache, v_cache = key_value(layer_cache(cache, 0))
    past_the_end = slots.clone()
    past_the_end[2] = BLOCKS * BLOCK
    with pytest.raises(IndexError, match="past the cache"):
        kernel(k_cache, v_cache, key, value, past_the_end)
    with pytest.raises(ValueError, match="int64"):
        kernel(k_cache, v_cache, key, value, slots.int())
    with pytest.raises(ValueError, match="key"):
        kernel(k_cache, v_cache, key.bfloat16(), value, slots)
    with pytest.raises(ValueError, match="value"):
        kernel(k_cache, v_cache, key, value[:3], slots)
    assert not cache.any()


def test_rows_that_are_not_whole_cache_lines(kernel):
    """A 40-wide bf16 head (80-byte rows, not 64-byte aligned) takes the plain copy."""
    g = torch.Generator().manual_seed(5)
    key = torch.randn(20, KV_HEADS, 40, generator=g).bfloat16()
    value = torch.randn(20, KV_HEADS, 40, generator=g).bfloat16()
    slots = torch.randperm(BLOCKS * BLOCK, generator=g)[:20]
    expected = torch.randn(kv_cache_shape(2, BLOCKS, BLOCK, KV_HEADS, 40)).bfloat16()
    written = expected.clone()
    write_kv_indexed(*key_value(layer_cache(expected, 1)), key, value, slots)
    kernel(*key_value(layer_cache(written, 1)), key, value, slots)
    assert torch.equal(written.view(torch.uint8), expected.view(torch.uint8))
