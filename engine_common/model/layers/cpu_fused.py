"""Fused CPU kernels for the decoder's elementwise work: residual add + RMSNorm, SiLU(gate) x
up, and the rotary rotation of q/k in place (``cpu_kernels/fused_elementwise.cpp``).

PyTorch runs each of these as three to eight ops, a dispatch and a pass over memory each
(RMSNorm in bf16: a widening copy, pow, mean, add, rsqrt, two muls, a narrowing copy); in a
batch-64 bf16 decode step on one core they took ~29 ms of 193.

The kernels round where those ops round (the model dtype's values at each op's output,
float32 in between) and compute what they compute in the same order, so they are
bit-identical to the torch ops in float32 and bf16 (tested):

- the residual add and the rotary: one rounding per op, as torch's;
- RMSNorm's sum of squares: added in ATen's own order (its CPU sum's 8-float vectors,
  4 accumulators and cascade), then ``/ n``, ``+ eps``, ``1 / sqrt`` like torch's mean and
  rsqrt;
- SiLU's exp: SLEEF's ``expf_u10`` op for op (torch's ``Vectorized<float>::exp``). Torch
  takes that path for whole vectors only (its loop's tail calls ``std::exp``), so in float32
  the kernel runs only where the intermediate size is a multiple of 32, as every model's is.

Should a torch release change its kernels, the greedy tests against Hugging Face float32
(tests/test_engine_greedy.py and others) and tests/test_cpu_fused.py would say so.

Built once per machine (``model/native_build``, with ``-ffp-contract=off``: a multiply and
an add fused into one rounding would break the rotary's bit-equality; and
``-fno-trapping-math``, which changes no value but lets GCC vectorize the selects of SiLU's
exp for AVX2, where it otherwise ran scalar, 7x slower). Where it cannot be
built, ``load_fused_ops`` returns None and the layers keep their torch ops.

Owns the load, the argument checks and the calls. It does not own choosing the path (the
layers: ``norm``, ``mlp``, ``rotary``) or the numerics' reference (the torch ops there).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine_common.model.native_build import entry_point, load_library

SOURCE = Path(__file__).with_name("cpu_kernels") / "fused_elementwise.cpp"
EXTRA_FLAGS = ("-ffp-contract=off", "-fno-trapping-math")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# torch's SiLU computes whole vectors with SLEEF's exp and the rest with std::exp: the
# kernel equals it in float32 where a row is whole vectors (32: bf16's AVX-512 vector).
_SILU_EXACT_MULTIPLE = 32

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I32 = ctypes.c_int
_ARGTYPES: dict[str, list[Any]] = {
    "tandem_add_rms_norm": [_I32, _P, _I64, _P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64,
                            ctypes.c_float, _I32],
    "tandem_silu_mul": [_I32, _P, _I64, _P, _I64, _I64, _I64],
    "tandem_rotary": [_I32, _P, _I64, _I64, _I64, _I64, _I64, _P, _P, _I64],
}


def _profiled(name: str) -> contextlib.AbstractContextManager[Any]:
    """torch.profiler sees no foreign call: name it while a profile is recording."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


def _rows(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    """The kernels trust their pointers: a 2-D tensor of rows with unit stride."""
    if t.dim() != 2 or t.stride(1) != 1 or t.dtype != dtype or not t.is_cpu:
        raise ValueError(f"{name}: expected CPU rows of {dtype} with unit stride, got "
                         f"{tuple(t.shape)} {t.dtype} strides {t.stride()} on {t.device}")


@dataclass(frozen=True)
class FusedCpuOps:
    """The loaded library's entry points."""

    library: ctypes.CDLL

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None,
                     weight: torch.Tensor, eps: float, weight_first: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(x + residual) * weight, x + residual)``; without a residual,
        ``(rms_norm(x) * weight, x)``. ``x``, ``residual``: [tokens, hidden]."""
        _rows("x", x, x.dtype)
        if x.dtype not in _DTYPES or weight.shape != x.shape[1:] or weight.stride() != (1,) \
                or weight.dtype != x.dtype:
            raise ValueError(f"add_rms_norm: {x.dtype} rows of {x.shape[1]} with a weight of "
                             f"{tuple(weight.shape)} {weight.dtype}")
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        if residual is None:
            new_residual, residual_ptr, residual_stride = x, None, 0
        else:
            _rows("residual", residual, x.dtype)
            if residual.shape != x.shape:
                raise ValueError(f"residual {tuple(residual.shape)} != x {tuple(x.shape)}")
            new_residual = torch.empty_like(out)
            residual_ptr, residual_stride = residual.data_ptr(), residual.stride(0)
        with _profiled("tandem::add_rms_norm"):
            code = self.library.tandem_add_rms_norm(
                _DTYPES[x.dtype], x.data_ptr(), x.stride(0), residual_ptr, residual_stride,
                new_residual.data_ptr(), new_residual.stride(0), weight.data_ptr(),
                out.data_ptr(), out.stride(0), x.shape[0], x.shape[1], eps, weight_first)
        _raise_on(code, "add_rms_norm")
        return out, new_residual

    def silu_mul(self, gate_up: torch.Tensor, size: int) -> torch.Tensor:
        """``silu(gate_up[:, :size]) * gate_up[:, size:]`` of a [tokens, 2 * size] tensor."""
        _rows("gate_up", gate_up, gate_up.dtype)
        if gate_up.dtype not in _DTYPES or gate_up.shape[1] != 2 * size:
            raise ValueError(f"silu_mul: {gate_up.dtype} {tuple(gate_up.shape)} is not "
                             f"[tokens, 2 * {size}]")
        out = torch.empty((gate_up.shape[0], size), dtype=gate_up.dtype)
        with _profiled("tandem::silu_mul"):
            code = self.library.tandem_silu_mul(
                _DTYPES[gate_up.dtype], gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(),
                out.stride(0), gate_up.shape[0], size)
        _raise_on(code, "silu_mul")
        return out

    def rotate_(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotates ``qk`` [tokens, heads, head_size] in place by ``cos``/``sin`` [tokens, 1,
        head_size // 2] (neox style: the first half against the second)."""
        tokens, heads, head_size = qk.shape
        half = head_size // 2
        if (qk.dtype not in _DTYPES or qk.stride(2) != 1 or head_size % 2 or qk.device.type
                != "cpu"):
            raise ValueError(f"rotary: expected CPU [tokens, heads, head] rows with unit "
                             f"stride, got {tuple(qk.shape)} {qk.dtype} {qk.stride()}")
        for name, t in (("cos", cos), ("sin", sin)):
            _rows(name, t.view(tokens, half), qk.dtype)
        if cos.stride() != sin.stride():
            raise ValueError("rotary: cos and sin must share their strides")
        with _profiled("tandem::rotary"):
            code = self.library.tandem_rotary(
                _DTYPES[qk.dtype], qk.data_ptr(), qk.stride(0), qk.stride(1), tokens, heads,
                half, cos.data_ptr(), sin.data_ptr(), cos.stride(0))
        _raise_on(code, "rotary")


def _raise_on(code: int, what: str) -> None:
    if code != 0:
        raise ValueError(f"fused CPU kernel {what} refused its arguments (code {code})")


@functools.cache
def load_fused_ops() -> FusedCpuOps | None:
    """The kernels, built if needed; None (logged once) where they cannot be built or loaded."""
    library = load_library(SOURCE, "fused CPU kernels (norm, SiLU x up, rotary)",
                           "the layers run their PyTorch ops (slower)", EXTRA_FLAGS)
    return None if library is None else bind(library)


def bind(library: ctypes.CDLL) -> FusedCpuOps:
    """The entry points of a library built from ``SOURCE`` (tests build it for other CPUs)."""
    for name, argtypes in _ARGTYPES.items():
        entry_point(library, name, argtypes)
    return FusedCpuOps(library)


def _ops_if(t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> FusedCpuOps | None:
    if t.device.type != "cpu" or t.dtype not in dtypes:
        return None
    return load_fused_ops()


def norm_ops_for(t: torch.Tensor) -> FusedCpuOps | None:
    """The kernels for RMSNorm (and its residual add) of ``t``, or None: torch ops."""
    return _ops_if(t, _KERNEL_DTYPES)


def silu_ops_for(t: torch.Tensor, size: int) -> FusedCpuOps | None:
    """The kernels for SiLU x up of ``t`` (gate and up of ``size`` each), or None: torch
    ops (float32 rows of a size torch's SiLU finishes with ``std::exp``)."""
    if t.dtype == torch.float32 and size % _SILU_EXACT_MULTIPLE:
        return None
    return _ops_if(t, _KERNEL_DTYPES)


def rotary_ops_for(t: torch.Tensor) -> FusedCpuOps | None:
    """The kernels for the rotary rotation of ``t``, or None: torch ops."""
    return _ops_if(t, _KERNEL_DTYPES)
