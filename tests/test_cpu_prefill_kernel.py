"""The CPU paged prefill-attention kernel (bf16) against a float32 reference, and SDPA's error.

Steps of several prefill sequences (nothing cached, a cached prefix shorter than, equal to
and longer than the new part; 2, 17 and 100+ query tokens) and decode rows, over caches with
shuffled (non-contiguous) block tables, block sizes 16 and 128, GQA groups 1, 3 and 4, head
sizes 64 and 128 (and 16, 80: the kernel's 16-wide tail). The kernel's error against float32
attention of the same bf16 inputs must be no worse than ~1.5x that of today's SDPA path (the
backend with ``use_paged_kernel=False``); decode rows stay the decode kernel's, bit for bit.
Also: the scalar build (``-mno-avx512f``), one thread against two, and float32 left to SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from engine_common.model.attention.backend import AttentionMetadata
from engine_common.model.attention.cpu_paged_kernel import load_paged_decode
from engine_common.model.attention.cpu_prefill_kernel import (
    PagedPrefillKernel,
    load_paged_prefill,
    workspace_bytes,
)
from engine_common.model.attention.kv_cache_layout import key_value, kv_cache_shape, layer_cache
from engine_common.model.attention.torch_backend import TorchAttentionBackend

# (cached, new) per sequence; new == 1 is a decode row.
STEP = [(0, 2), (30, 1), (0, 17), (5, 17), (17, 17), (100, 17), (129, 1), (40, 130), (0, 130)]
SHAPES = [(9, 3, 64, 16), (8, 2, 128, 128), (4, 4, 64, 16), (12, 3, 128, 16), (4, 2, 16, 16),
          (6, 2, 80, 16)]


@dataclass
class PrefillStep:
    query: torch.Tensor  # [tokens, heads, head_size], a strided view like the model's
    key: torch.Tensor  # [tokens, kv_heads, head_size]: this step's K (already in the cache)
    value: torch.Tensor
    layer_kv: torch.Tensor
    tables: list[list[int]]
    metadata: AttentionMetadata


def random_step(shape: tuple[int, int, int, int], step: list[tuple[int, int]],
                dtype: torch.dtype, seed: int) -> PrefillStep:
    num_heads, num_kv_heads, head_size, block_size = shape
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in step]
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()  # non-contiguous tables
    tables = [[order.pop() for _ in range(n)] for n in needed]
    block_tables = torch.zeros(len(step), max(needed), dtype=torch.int32)
    for i, table in enumerate(tables):
        block_tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
    cache = torch.randn(kv_cache_shape(3, num_blocks, block_size, num_kv_heads, head_size),
                        generator=gen).to(dtype)
    layer_kv = layer_cache(cache, 1)
    k_cache, v_cache = key_value(layer_kv)
    slots = [table[p // block_size] * block_size + p % block_size
             for table, (cached, new) in zip(tables, step, strict=True)
             for p in range(cached, cached + new)]
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    tokens = len(slots)
    width = (num_heads + 2 * num_kv_heads) * head_size
    qkv = (3 * torch.randn(tokens, width, generator=gen)).to(dtype)
    query = qkv[:, : num_heads * head_size].view(tokens, num_heads, head_size)
    query_lens = [n for _, n in step]
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    metadata = AttentionMetadata(
        slot_mapping=slot_mapping, query_start_loc=starts,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=block_tables,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens)
    return PrefillStep(query, k_cache[blocks, :, offsets].clone(),
                       v_cache[blocks, :, offsets].clone(), layer_kv, tables, metadata)


def reference(step: PrefillStep, scale: float) -> torch.Tensor:
    """Float32 attention of the same bf16 inputs: each row over keys up to its position."""
    k_cache, v_cache = key_value(step.layer_kv)
    outs = []
    for i, table in enumerate(step.tables):
        ctx = step.metadata.seq_lens_cpu[i]
        start, end = step.metadata.query_start_loc[i : i + 2].tolist()
        # [blocks, heads, block_size, head] -> [heads, tokens, head]
        k = k_cache[table].transpose(0, 1).flatten(1, 2)[:, :ctx].float()
        v = v_cache[table].transpose(0, 1).flatten(1, 2)[:, :ctx].float()
        q = step.query[start:end].transpose(0, 1).float()
        positions = torch.arange(ctx - (end - start), ctx)
        mask = torch.arange(ctx)[None, :] <= positions[:, None]
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                             scale=scale, enable_gqa=True)
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


def backend_forward(shape: tuple[int, int, int, int], step: PrefillStep, use_kernel: bool
                    ) -> torch.Tensor:
    num_heads, num_kv_heads, head_size, _ = shape
    backend = TorchAttentionBackend(num_heads, num_kv_heads, head_size, head_size**-0.5,
                                    use_paged_kernel=use_kernel)
    return backend.forward(step.query, step.key, step.value, step.layer_kv.clone(),
                           step.metadata)


def prefill_rows(step: PrefillStep) -> torch.Tensor:
    starts = step.metadata.query_start_loc.tolist()
    return torch.tensor([r for i, n in enumerate(step.metadata.query_lens_cpu) if n > 1
                         for r in range(starts[i], starts[i] + n)])


@pytest.fixture(scope="module")
def kernel() -> PagedPrefillKernel:
    loaded = load_paged_prefill()
    assert loaded is not None, "the prefill kernel must build on the test machine (g++)"
    return loaded


@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_error_no_worse_than_sdpa(kernel, shape):
    if not kernel.vectorized:
        pytest.skip("no avx512_bf16 here: the backend keeps SDPA (the scalar build is "
                    "tested below)")
    step = random_step(shape, STEP, torch.bfloat16, seed=shape[0] * 100 + shape[2])
    expected = reference(step, shape[2] ** -0.5)
    ours = backend_forward(shape, step, use_kernel=True)
    sdpa = backend_forward(shape, step, use_kernel=False)
    rows = prefill_rows(step)
    ours_error = (ours[rows].float() - expected[rows]).abs().max().item()
    sdpa_error = (sdpa[rows].float() - expected[rows]).abs().max().item()
    assert ours_error <= 1.5 * sdpa_error, (ours_error, sdpa_error)
    # Decode rows are the decode kernel's, bit for bit.
    decode = [i for i, n in enumerate(step.metadata.query_lens_cpu) if n == 1]
    rows_of = step.metadata.query_start_loc[decode].long()
    expected_decode = torch.empty_like(step.query)
    k_cache, v_cache = key_value(step.layer_kv)
    decode_kernel = load_paged_decode()
    assert decode_kernel is not None
    decode_kernel(step.query, k_cache, v_cache, step.metadata.block_tables,
                  step.metadata.seq_lens, step.metadata.query_start_loc,
                  torch.tensor(decode, dtype=torch.int32), len(decode), expected_decode,
                  shape[2] ** -0.5)
    assert torch.equal(ours[rows_of], expected_decode[rows_of])


def call_kernel(kernel: PagedPrefillKernel, step: PrefillStep, shape: tuple[int, ...]
                ) -> torch.Tensor:
    k_cache, v_cache = key_value(step.layer_kv)
    seqs = [i for i, n in enumerate(step.metadata.query_lens_cpu) if n > 1]
    out = torch.full(step.query.shape, float("nan"), dtype=step.query.dtype)
    workspace = torch.empty(workspace_bytes([step.metadata.seq_lens_cpu[i] for i in seqs],
                                            shape[1], shape[2]), dtype=torch.uint8)
    kernel(step.query, k_cache, v_cache, step.metadata.block_tables, step.metadata.seq_lens,
           step.metadata.query_start_loc, torch.tensor(seqs, dtype=torch.int32), out,
           shape[2] ** -0.5, workspace)
    return out


def test_scalar_build_matches_reference():
    """The build for CPUs without avx512_bf16: the same roundings, one element at a time."""
    scalar = load_paged_prefill(("-mno-avx512f",))
    assert scalar is not None and not scalar.vectorized
    shape = (9, 3, 64, 16)
    step = random_step(shape, STEP, torch.bfloat16, seed=5)
    rows = prefill_rows(step)
    expected = reference(step, shape[2] ** -0.5)[rows]
    ours_error = (call_kernel(scalar, step, shape)[rows].float() - expected).abs().max()
    sdpa = backend_forward(shape, step, use_kernel=False)[rows]
    assert ours_error <= 1.5 * (sdpa.float() - expected).abs().max()


def test_threads_do_not_change_the_result(kernel):
    shape = (9, 3, 64, 16)
    step = random_step(shape, [(0, 300), (50, 200)], torch.bfloat16, seed=9)
    outs = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(call_kernel(kernel, step, shape))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


def test_float32_keeps_sdpa():
    """float32 is bit-exact with Hugging Face through SDPA: the kernel never runs there."""
    shape = (9, 3, 64, 16)
    step = random_step(shape, STEP, torch.float32, seed=2)
    rows = prefill_rows(step)
    assert torch.equal(backend_forward(shape, step, use_kernel=True)[rows],
                       backend_forward(shape, step, use_kernel=False)[rows])


def test_kernel_refuses_what_it_cannot_read(kernel):
    shape = (4, 2, 64, 16)
    step = random_step(shape, [(3, 5)], torch.bfloat16, seed=1)
    k_cache, v_cache = key_value(step.layer_kv)
    meta = step.metadata
    args = (meta.block_tables, meta.seq_lens, meta.query_start_loc,
            torch.tensor([0], dtype=torch.int32), torch.empty_like(step.query), 0.125)
    with pytest.raises(ValueError, match="bfloat16"):
        kernel(step.query.float(), k_cache.float(), v_cache.float(), *args,
               torch.empty(1 << 20, dtype=torch.uint8))
    with pytest.raises(ValueError, match="code -4"):  # a workspace too small
        kernel(step.query, k_cache, v_cache, *args, torch.empty(16, dtype=torch.uint8))
