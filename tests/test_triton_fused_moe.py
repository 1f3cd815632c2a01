"""The Triton grouped GEMM of the experts equals the torch path (per-expert ``F.linear``)
on expert-sorted rows: uneven expert loads, an expert with no rows, sizes that are not
multiples of the tiles, float32 (ieee dots) to 1e-4.

Without CUDA the kernel runs in Triton's CPU interpreter, which must be set before triton
is first imported; tests/conftest.py imports transformers (which imports triton), so the
in-process test skips then and ``test_in_fresh_process`` reruns this file with
``TRITON_INTERPRET=1`` in a fresh process's environment.
"""

import os

import torch

_ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
if not _ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton.language as tl  # noqa: E402

from engine_common.model.attention.triton_kernels.kernel_config import (  # noqa: E402
    is_interpreted,
)
from engine_common.model.layers.triton_fused_moe import (  # noqa: E402
    _grouped_gemm_kernel,
    grouped_gemm,
)

_STALE = not _ON_GPU and not (is_interpreted(tl.zeros) and is_interpreted(_grouped_gemm_kernel))
DEVICE = "cuda" if _ON_GPU else "cpu"


@pytest.mark.skipif(_STALE, reason="triton imported without TRITON_INTERPRET; rerun below")
@pytest.mark.parametrize("counts, n, k", [([3, 0, 20, 1], 40, 48), ([17], 64, 32),
                                          ([0, 5, 0, 33, 2, 9], 96, 70)])
def test_grouped_gemm_matches_per_expert_linear(counts, n, k):
    torch.manual_seed(sum(counts) + n)
    rows = torch.randn(sum(counts), k, device=DEVICE)
    weight = torch.randn(len(counts), n, k, device=DEVICE)
    want = torch.empty(sum(counts), n, device=DEVICE)
    start = 0
    for expert, count in enumerate(counts):
        want[start:start + count] = F.linear(rows[start:start + count], weight[expert])
        start += count
    got = grouped_gemm(rows, weight, counts)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not _STALE, reason="the kernel runs in this process")
def test_in_fresh_process():
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        cwd=Path(__file__).resolve().parents[1], env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "4 passed" in result.stdout


@pytest.mark.skipif(_STALE, reason="triton imported without TRITON_INTERPRET; rerun below")
def test_triton_experts_match_the_torch_path():
    """The whole expert computation (both projections, biases, GPT-OSS's activation) through
    the Triton GEMM equals the per-expert torch loop."""
    from engine_common.model.layers import fused_moe

    torch.manual_seed(1)
    rows_per_token, experts = 2, 5
    x = torch.randn(11, 32, device=DEVICE)
    w13, w2 = torch.randn(experts, 48, 32, device=DEVICE), torch.randn(experts, 32, 24, device=DEVICE)
    b13, b2 = torch.randn(experts, 48, device=DEVICE), torch.randn(experts, 32, device=DEVICE)
    ids = torch.stack([torch.randperm(experts)[:rows_per_token] for _ in range(11)]).to(DEVICE)
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    rows = x.index_select(0, order // rows_per_token)
    act = fused_moe.clamped_swiglu(1.702, 7.0)
    want = fused_moe._expert_loop(rows, flat, experts, fused_moe.plain_projection(w13, w2),
                                  act, b13, b2)
    got = fused_moe.triton_experts(rows, flat, experts, w13, w2, act, b13, b2)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


_SM90_SCRIPT = r"""
import json, sys
from dataclasses import asdict
sys.path[:0] = ["tests", "."]
import torch
import triton_sm90_compile as compile_sm90
from engine_common.model.layers import triton_fused_moe
triton_fused_moe.check_launchable = lambda kernel, tensor: None
for dtype in (torch.bfloat16, torch.float32):
    for experts, n, k in ((16, 512, 512), (32, 5760, 2880)):  # Qwen3-MoE-ish, GPT-OSS-120B
        rows, weight = torch.zeros(40, k, dtype=dtype), torch.zeros(experts, n, k, dtype=dtype)
        counts = [10, 30] + [0] * (experts - 2)
        for launch in compile_sm90.record_launches(str(dtype), triton_fused_moe.grouped_gemm,
                                                   rows, weight, counts):
            print(json.dumps(asdict(compile_sm90.compile_launch(launch))))
"""


def test_grouped_gemm_compiles_for_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    run = subprocess.run([sys.executable, "-c", _SM90_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=240, cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 0, run.stderr[-3000:]
    compiled = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(compiled) == 4
    assert all(c["local_bytes"] == 0 and 0 < c["registers"] <= 255 for c in compiled)
