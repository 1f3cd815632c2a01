"""The fused CPU kernels (``engine_common/model/layers/cpu_fused.py``) against the torch ops
they replace, on random inputs, in decode (a few rows) and prefill (many rows, split among
threads) shapes.

No tolerance: each kernel rounds where the torch ops round and computes each value as
torch does (RMSNorm's sum of squares in ATen's order, SiLU's exp as SLEEF's), so the
results must be bit-identical in float32 and bf16, on the engine's build (-march=native)
and on one for an AVX2-only CPU. Odd sizes (not multiples of the vector widths) cover the
loops' tails.
"""

from __future__ import annotations

import ctypes
import platform
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine_common.config import CacheConfig, EngineConfig, SchedulerConfig
from engine_common.llm import LLM
from engine_common.model.layers import cpu_fused
from engine_common.model.layers.cpu_fused import (
    EXTRA_FLAGS,
    SOURCE,
    FusedCpuOps,
    bind,
    load_fused_ops,
)
from engine_common.model.layers.norm import RMSNorm
from engine_common.model.native_build import build, compiler
from engine_common.sampling_params import SamplingParams

DTYPES = (torch.float32, torch.bfloat16)
ROWS = (1, 7, 300)  # a decode row, a few, and enough to run on several threads


@pytest.fixture(scope="module", params=("native", "avx2"))
def ops(request: pytest.FixtureRequest) -> FusedCpuOps:
    """The engine's build (-march=native), and one for an AVX2-only CPU (x86-64-v3: no
    AVX-512), which runs here too: the loops must vectorize and round alike on both."""
    if request.param == "native":
        loaded = load_fused_ops()
        assert loaded is not None, "the fused CPU kernels did not build (is g++ installed?)"
        return loaded
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the AVX2 build is for x86 CPUs")
    cxx = compiler()
    assert cxx is not None
    return bind(ctypes.CDLL(str(build(cxx, SOURCE, (*EXTRA_FLAGS, "-march=x86-64-v3")))))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("weight_first", (False, True))
@pytest.mark.parametrize("hidden", (576, 1000 + 7))
def test_add_rms_norm(ops: FusedCpuOps, dtype: torch.dtype, rows: int,
                      weight_first: bool, hidden: int) -> None:
    torch.manual_seed(rows)
    # x a strided view (a wider tensor's columns), as a projection's output slice can be.
    x = (torch.randn(rows, hidden + 8) * 3).to(dtype)[:, :hidden]
    residual = (torch.randn(rows, hidden) * 10).to(dtype)
    weight = (torch.rand(hidden) + 0.5).to(dtype)
    norm = RMSNorm(hidden, 1e-5, dtype, torch.device("cpu"), weight_in_float32=weight_first)
    norm.weight.data.copy_(weight)
    summed = residual + x
    expected = norm._torch_forward(summed)

    out, new_residual = ops.add_rms_norm(x, residual, weight, 1e-5, weight_first)
    assert torch.equal(new_residual, summed)
    assert torch.equal(out, expected)
    out_alone, same = ops.add_rms_norm(x, None, weight, 1e-5, weight_first)
    assert same is x
    assert torch.equal(out_alone, norm._torch_forward(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul(ops: FusedCpuOps, dtype: torch.dtype, rows: int) -> None:
    torch.manual_seed(rows)
    size = 1536
    gate_up = (torch.randn(rows, 2 * size) * 4).to(dtype)
    gate_up[0, :6] = torch.tensor([-120.0, -101.0, 106.0, 0.0, -88.5, float("nan")])
    out = ops.silu_mul(gate_up, size)
    torch.testing.assert_close(out, F.silu(gate_up[:, :size]) * gate_up[:, size:], rtol=0,
                               atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_rotary_is_bit_identical(ops: FusedCpuOps, dtype: torch.dtype, rows: int) -> None:
    torch.manual_seed(rows)
    heads, kv_heads, head_size = 9, 3, 64
    half = head_size // 2
    # q and k as the attention layer sees them: a view of the fused q/k/v projection.
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_size).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * head_size].view(rows, -1, head_size)
    value = qkv[:, (heads + kv_heads) * head_size :].clone()
    angles = torch.randint(0, 4096, (rows, 1)).float() * torch.rand(half)
    cos, sin = angles.cos().to(dtype).unsqueeze(1), angles.sin().to(dtype).unsqueeze(1)
    expected = qk.clone()
    x1, x2 = expected[..., :half], expected[..., half:]
    first, second = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    x1.copy_(first)
    x2.copy_(second)

    ops.rotate_(qk, cos, sin)
    assert torch.equal(qk, expected)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_size :], value)  # v untouched


def test_refuses_what_it_cannot_read(ops: FusedCpuOps) -> None:
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="unit stride"):
        ops.add_rms_norm(x.t(), None, torch.ones(4, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="weight"):
        ops.add_rms_norm(x, None, torch.ones(64), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        ops.add_rms_norm(x, torch.randn(3, 64, dtype=torch.bfloat16),
                         torch.ones(64, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="2 \\* 40"):
        ops.silu_mul(x, 40)


def _bf16_greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(EngineConfig(model=str(model_dir), dtype="bfloat16",
                           cache=CacheConfig(block_size=4, num_gpu_blocks_override=256),
                           scheduler=SchedulerConfig(max_num_batched_tokens=64)))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    return [r.token_ids for r in llm.generate(prompts, params)]


def test_bf16_engine_decodes_as_with_torch_ops(tiny_llama_dir: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole bf16 engine (prefill in chunks, then decodes) gives the greedy tokens it
    gives with the layers' torch ops: the kernels change where the work runs, not what."""
    prompts = [[(7 * i + 3 * j) % 200 + 1 for j in range(5 + 9 * i)] for i in range(4)]
    fused = _bf16_greedy(tiny_llama_dir, prompts)
    monkeypatch.setattr(cpu_fused, "load_fused_ops", lambda: None)
    assert fused == _bf16_greedy(tiny_llama_dir, prompts)
