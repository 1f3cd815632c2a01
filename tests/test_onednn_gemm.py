"""The direct oneDNN bf16 GEMM (``engine_common/model/onednn_gemm.py``) against torch, and
the fallback to torch's packed linear where it is unavailable.

Tolerance: each output is the float32 sum of bf16 products rounded once to bf16, as torch's
``F.linear`` in bf16; only the summation order may differ, so an output may be one bf16
step (2**-7 relative) from torch's where the float32 sum lies at a rounding midpoint, and
is within half a step (2**-8 relative, plus float32 noise) of the float32 reference.
"""

from __future__ import annotations

import platform
import sys

import pytest
import torch
import torch.nn.functional as F

from engine_common.model import onednn_gemm
from engine_common.model.onednn_gemm import OnednnGemm, load_onednn_gemm, pack_for_onednn
from engine_common.model.packed_linear import (
    bf16_packing_supported,
    pack_projection,
    packed_linear,
)

# The wheels are dependencies on x86-64 Linux (make setup installs them): there a missing
# library is a failure, not a skip.
_EXPECTED = sys.platform == "linux" and platform.machine() == "x86_64"


@pytest.fixture(scope="module")
def library() -> onednn_gemm.OnednnLibrary:
    if not bf16_packing_supported():
        pytest.skip("this CPU has no oneDNN bf16 matmul (AVX512 or AVX-NE-CONVERT): bf16 "
                    "weights stay plain here, and the direct path is never chosen")
    loaded = load_onednn_gemm()
    if loaded is None and not _EXPECTED:
        pytest.skip("oneDNN's wheels exist for x86-64 Linux only")
    assert loaded is not None, "make setup installs onednn-cpu-gomp; the library must build"
    return loaded


# (M, N, K, bias): decode rows 1 and 64, a prefill's ragged M, odd sizes, SmolLM2's down.
CASES = [(1, 960, 576, False), (64, 3072, 576, False), (37, 576, 1536, True),
         (5, 33, 19, True), (300, 128, 64, False)]


@pytest.mark.parametrize(("m", "n", "k", "bias"), CASES)
def test_matches_torch_within_one_bf16_step(library, m, n, k, bias):
    gen = torch.Generator().manual_seed(m * 7 + n)
    weight = (0.05 * torch.randn(n, k, generator=gen)).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    x = torch.randn(m, k, generator=gen).bfloat16()
    gemm = OnednnGemm(library, weight)
    ours = gemm(x, b)
    assert ours.dtype == torch.bfloat16 and ours.shape == (m, n)
    reference = F.linear(x.float(), weight.float(), None if b is None else b.float())
    # Bias added in float32 before the one rounding (as torch's bf16 F.linear does).
    torch.testing.assert_close(ours.float(), reference, rtol=2**-8, atol=1e-5)
    theirs = F.linear(x, weight, b)
    steps = (ours.float() - theirs.float()).abs() / theirs.float().abs().clamp_min(1e-30)
    assert steps.max() <= 2**-7
    assert (ours != theirs).float().mean() < 1e-3  # near-ties only
    assert gemm.nbytes >= n * k * 2


@pytest.mark.parametrize(("m", "n", "k", "bias"), CASES[:3])
def test_float32_output_is_the_unrounded_sum(library, m, n, k, bias):
    """``out_dtype=torch.float32`` (the LM head's logits): the float32 sums of the bf16
    products, within float32 noise of the reference, finer than any bf16 output; the same
    primitive cache serves both output types of one shape."""
    gen = torch.Generator().manual_seed(m + n)
    weight = (0.05 * torch.randn(n, k, generator=gen)).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    x = torch.randn(m, k, generator=gen).bfloat16()
    gemm = OnednnGemm(library, weight)
    rounded = gemm(x, b)
    ours = gemm(x, b, out_dtype=torch.float32)
    assert ours.dtype == torch.float32 and ours.shape == (m, n)
    reference = F.linear(x.float(), weight.float(), None if b is None else b.float())
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    assert not torch.equal(ours, rounded.float())  # bf16 would round them
    assert torch.equal(gemm(x, b), rounded)


def test_shapes_views_and_bad_input(library):
    """3-D and strided inputs (a view of a fused projection's output), no rows, and the
    arguments the C side would trust are checked here."""
    gen = torch.Generator().manual_seed(1)
    weight = (0.05 * torch.randn(48, 32, generator=gen)).bfloat16()
    gemm = OnednnGemm(library, weight)
    fused = torch.randn(2, 5, 64, generator=gen).bfloat16()
    x = fused[..., 16:48]  # not contiguous
    assert torch.equal(gemm(x, None), gemm(x.contiguous(), None))
    assert gemm(x, None).shape == (2, 5, 48)
    assert gemm(torch.empty(0, 32, dtype=torch.bfloat16), None).shape == (0, 48)
    with pytest.raises(ValueError, match="bf16 input"):
        gemm(torch.randn(3, 32), None)
    with pytest.raises(ValueError, match="bf16 input"):
        gemm(torch.randn(3, 31).bfloat16(), None)
    with pytest.raises(ValueError, match="bias"):
        gemm(x, torch.zeros(47, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out_dtype"):
        gemm(x, None, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="2-D bf16"):
        OnednnGemm(library, weight.float())


def test_projections_take_the_direct_path_and_fall_back_without_it(library, monkeypatch):
    """bf16 weights get the direct path; float32 ones (standing in for bf16) and every
    weight where the library is missing or switched off get torch's packed tensor, with
    the same outputs."""
    gen = torch.Generator().manual_seed(2)
    weight = (0.05 * torch.randn(64, 48, generator=gen)).bfloat16()
    x = torch.randn(9, 48, generator=gen).bfloat16()
    direct = pack_projection(weight)
    assert isinstance(direct, OnednnGemm)
    assert isinstance(pack_projection(weight.float()), torch.Tensor)
    for disable in ("env", "wheels"):
        load_onednn_gemm.cache_clear()
        if disable == "env":
            monkeypatch.setenv("TANDEM_ONEDNN_GEMM", "0")
        else:
            monkeypatch.setattr(onednn_gemm, "_onednn_dirs", lambda: None)
        try:
            assert load_onednn_gemm() is None and pack_for_onednn(weight) is None
            fallback = pack_projection(weight)
            assert isinstance(fallback, torch.Tensor)
            ours, theirs = packed_linear(x, direct, None), packed_linear(x, fallback, None)
            assert (ours.float() - theirs.float()).abs().max() <= 2**-7 * theirs.abs().max()
        finally:
            monkeypatch.undo()
            load_onednn_gemm.cache_clear()
    assert load_onednn_gemm() is not None
