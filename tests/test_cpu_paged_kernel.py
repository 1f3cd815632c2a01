"""The CPU paged decode-attention kernel against a float64 reference and the PyTorch path.

Random caches with shuffled block tables, contexts that end mid-block and span many blocks,
group sizes 1 to 4, head sizes on the vector path (64, 128, 80) and off it (36, 8), strided
query rows (a view of the fused q/k/v projection, as the model passes them), a subset of a
step's sequences (a mixed prefill/decode step), float32 and bf16, one thread and two.
"""

from __future__ import annotations

import pytest
import torch

from engine_common.model.attention.cpu_paged_kernel import PagedDecodeKernel, load_paged_decode
from engine_common.model.attention.torch_backend import TorchAttentionBackend
from tests.attention_reference import decode_metadata, decode_reference, random_decode_step


@pytest.fixture(scope="module")
def kernel() -> PagedDecodeKernel:
    loaded = load_paged_decode()
    assert loaded is not None, "the paged kernel must build on the test machine (g++)"
    return loaded


SHAPES = [(9, 3, 64, 16), (4, 2, 128, 16), (8, 8, 80, 4), (6, 2, 36, 16), (2, 1, 8, 4),
          (4, 1, 64, 32)]
SEQ_LENS = [1, 5, 16, 17, 100, 300, 33]


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_size", "block_size"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_float64_reference(kernel, num_heads, num_kv_heads, head_size,
                                          block_size, dtype):
    step = random_decode_step(num_heads, num_kv_heads, head_size, block_size, SEQ_LENS, dtype,
                              seed=num_heads * 100 + head_size)
    out = torch.full(step.query.shape, float("nan"), dtype=dtype)
    kernel(step.query, step.k_cache, step.v_cache, step.block_tables, step.seq_lens, None,
           None, len(SEQ_LENS), out, head_size**-0.5)
    expected = decode_reference(step, head_size**-0.5)
    # bf16: the scores (|s| up to ~30 here) are rounded to bf16 as torch's matmul rounds them.
    tolerance = 1e-5 if dtype == torch.float32 else 6e-2
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_agrees_with_gather_path(dtype):
    """The backend with and without the kernel: float32 to rounding, bf16 to one bf16 ulp
    of the output's scale (the kernel rounds scores and weights where torch's matmuls do)."""
    num_heads, num_kv_heads, head_size, block_size = 9, 3, 64, 16
    step = random_decode_step(num_heads, num_kv_heads, head_size, block_size, SEQ_LENS, dtype,
                              seed=7)
    metadata = decode_metadata(step, block_size)
    kv_cache = step.layer_kv
    blocks, offsets = metadata.slot_mapping // block_size, metadata.slot_mapping % block_size
    new_k = step.k_cache[blocks, :, offsets].clone()  # [tokens, kv_heads, head_size]
    new_v = step.v_cache[blocks, :, offsets].clone()
    outs = [
        TorchAttentionBackend(num_heads, num_kv_heads, head_size, head_size**-0.5,
                              use_paged_kernel=use).forward(step.query, new_k, new_v,
                                                            kv_cache.clone(), metadata)
        for use in (True, False)
    ]
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=tolerance, rtol=0)


def test_kernel_attends_a_subset_of_rows_in_place(kernel):
    """A mixed step: only the listed sequences are attended, each written at its query
    start; the other rows of ``out`` are left alone."""
    num_heads, num_kv_heads, head_size, block_size = 4, 2, 64, 16
    step = random_decode_step(num_heads, num_kv_heads, head_size, block_size, SEQ_LENS,
                              torch.float32, seed=3)
    seqs = torch.tensor([1, 4, 5], dtype=torch.int32)
    # The step's rows: sequence i's query at row 2 * i (as if each had two query tokens).
    query_start_loc = torch.arange(0, 2 * len(SEQ_LENS) + 1, 2, dtype=torch.int32)
    rows = torch.zeros(2 * len(SEQ_LENS), num_heads, head_size)
    rows[query_start_loc[:-1].long()] = step.query
    out = torch.full_like(rows, 7.0)
    kernel(rows, step.k_cache, step.v_cache, step.block_tables, step.seq_lens,
           query_start_loc, seqs, len(seqs), out, head_size**-0.5)
    expected = decode_reference(step, head_size**-0.5)
    written = query_start_loc[seqs.long()].long()
    torch.testing.assert_close(out[written].double(), expected[seqs.long()], atol=1e-5, rtol=0)
    untouched = torch.ones(len(rows), dtype=torch.bool)
    untouched[written] = False
    assert torch.all(out[untouched] == 7.0)


def test_kernel_threads_do_not_change_the_result(kernel):
    num_heads, num_kv_heads, head_size, block_size = 9, 3, 64, 16
    step = random_decode_step(num_heads, num_kv_heads, head_size, block_size, SEQ_LENS * 4,
                              torch.float32, seed=11)
    outs = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = torch.empty(step.query.shape)
            kernel(step.query, step.k_cache, step.v_cache, step.block_tables, step.seq_lens,
                   None, None, len(step.seq_lens), out, 0.125)
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


def test_kernel_refuses_layouts_it_cannot_read(kernel):
    step = random_decode_step(4, 2, 64, 16, [5, 9], torch.float32, seed=1)
    out = torch.empty(step.query.shape)
    args = (step.block_tables, step.seq_lens, None, None, 2, out, 0.125)
    with pytest.raises(ValueError, match="strides"):
        kernel(step.query, step.k_cache.transpose(1, 2), step.v_cache, *args)
    with pytest.raises(ValueError, match="unit-stride rows"):
        kernel(step.query, step.k_cache.transpose(2, 3), step.v_cache.transpose(2, 3), *args)
    with pytest.raises(ValueError, match="dtype"):
        kernel(step.query.double(), step.k_cache, step.v_cache, *args)
    with pytest.raises(ValueError, match="int32"):
        kernel(step.query, step.k_cache, step.v_cache, step.block_tables.long(),
               *args[1:])
