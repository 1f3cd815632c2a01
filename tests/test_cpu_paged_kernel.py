"""The CPU paged decode-attention kernel against a float64 reference and the PyTorch path.

Random caches with shuffled block tables, contexts that end mid-block and span many blocks
(and several of the kernel's 256-token chunks, merged), group sizes 1 to 8, head sizes on
the vector paths (64, 128, 80, 96, 256) and off them (36, 8), block sizes 4, 5, 16 and 32,
strided query rows (a view of the fused q/k/v projection, as the model passes them), a
subset of a step's sequences (a mixed prefill/decode step), float32 and bf16, one thread
and two, one long sequence. Each instruction set the kernel has that this CPU runs is
built and checked: the native build (AVX512 with AVX512_BF16 on the test machine), AVX512
without AVX512_BF16, and AVX2. Tolerances are the dtype's rounding
(``decode_error_bound``).
"""

from __future__ import annotations

import pytest
import torch

from engine_common.model.attention.cpu_paged_kernel import PagedDecodeKernel, load_paged_decode
from engine_common.model.attention.torch_backend import TorchAttentionBackend
from tests.attention_reference import (
    DecodeStep,
    decode_error_bound,
    decode_metadata,
    decode_reference,
    random_decode_step,
)

# The other instruction sets' builds: the compiler's flags after -march=native (on a CPU
# without a feature, switching it off changes nothing: the build is the native one again).
OTHER_BUILDS = {"avx512-no-bf16": ("-mno-avx512bf16",), "avx2": ("-mno-avx512f",)}


@pytest.fixture(scope="module")
def kernel() -> PagedDecodeKernel:
    loaded = load_paged_decode()
    assert loaded is not None, "the paged kernel must build on the test machine (g++)"
    return loaded


@pytest.fixture(scope="module", params=list(OTHER_BUILDS))
def other_build(request: pytest.FixtureRequest) -> PagedDecodeKernel:
    loaded = load_paged_decode(extra_flags=OTHER_BUILDS[request.param])
    assert loaded is not None, f"the {request.param} build of the paged kernel failed"
    return loaded


# (num_heads, num_kv_heads, head_size, block_size)
SHAPES = [(9, 3, 64, 16), (4, 2, 128, 16), (8, 8, 80, 4), (6, 2, 36, 16), (2, 1, 8, 4),
          (4, 1, 64, 32), (8, 1, 64, 16), (8, 2, 96, 5), (7, 1, 256, 16)]
# The other builds: each of their tiles, tails and scalar fallbacks.
OTHER_SHAPES = [(9, 3, 64, 16), (4, 2, 128, 16), (6, 2, 36, 16), (8, 2, 96, 5)]
SEQ_LENS = [1, 5, 16, 17, 100, 300, 33, 600]


def assert_within_bound(out: torch.Tensor, step: DecodeStep, scale: float) -> None:
    expected = decode_reference(step, scale)
    error = (out.double() - expected).abs()
    bound = decode_error_bound(step, expected)
    worst = int((error / bound).argmax())
    assert torch.all(error <= bound), (
        f"error {error.flatten()[worst]:.3g} > bound {bound.flatten()[worst]:.3g} at "
        f"{torch.unravel_index(torch.tensor(worst), error.shape)}")


def run_kernel(kernel: PagedDecodeKernel, step: DecodeStep, scale: float) -> torch.Tensor:
    out = torch.full(step.query.shape, float("nan"), dtype=step.query.dtype)
    kernel(step.query, step.k_cache, step.v_cache, step.block_tables, step.seq_lens, None,
           None, len(step.seq_lens), out, scale)
    return out


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_size", "block_size"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_float64_reference(kernel, num_heads, num_kv_heads, head_size,
                                          block_size, dtype):
    step = random_decode_step(num_heads, num_kv_heads, head_size, block_size, SEQ_LENS, dtype,
                              seed=num_heads * 100 + head_size)
    assert_within_bound(run_kernel(kernel, step, head_size**-0.5), step, head_size**-0.5)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_size", "block_size"),
                         OTHER_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_other_builds_match_float64_reference(other_build, num_heads, num_kv_heads, head_size,
                                              block_size, dtype):
    step = random_decode_step(num_heads, num_kv_heads, head_size, block_size, SEQ_LENS, dtype,
                              seed=num_heads * 100 + head_size)
    assert_within_bound(run_kernel(other_build, step, head_size**-0.5), step,
                        head_size**-0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_splits_one_long_sequence(kernel, dtype):
    """Batch 1, a long context: chunks (and KV heads) shared by two threads, then merged."""
    step = random_decode_step(9, 3, 64, 16, [2000], dtype, seed=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        out = run_kernel(kernel, step, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert_within_bound(out, step, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_agrees_with_gather_path(dtype):
    """The backend with and without the kernel, against the float64 reference: the kernel
    within the dtype's rounding of it, and in bf16 no further from it than the PyTorch path
    (whose bf16 matmul also rounds the scores)."""
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
    assert_within_bound(outs[0], step, head_size**-0.5)
    expected = decode_reference(step, head_size**-0.5)
    errors = [(out.double() - expected).abs().max() for out in outs]
    if dtype == torch.bfloat16:
        assert errors[0] <= errors[1]


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
    bound = decode_error_bound(step, expected)
    written = query_start_loc[seqs.long()].long()
    error = (out[written].double() - expected[seqs.long()]).abs()
    assert torch.all(error <= bound[seqs.long()])
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
