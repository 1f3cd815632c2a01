"""The CPU paged decode-attention kernel: building it, loading it, calling it.

The kernel (``cpu_kernels/paged_decode.cpp``) reads each decode sequence's K and V where
they lie in the paged cache, through its block table, instead of gathering them into a
padded copy first (what the PyTorch ops path must do, every layer of every step). It is C++
with AVX512 intrinsics where the CPU has them (``vdpbf16ps`` with AVX512_BF16), else AVX2/FMA,
else scalar loops, split among OpenMP threads.

Built once per machine with the system C++ compiler (``model/native_build``: ``-march=native``,
torch's libgomp, cached by a hash of the source, compiler and CPU). Without a compiler, or
if the build fails, ``load_paged_decode`` returns None (logged once) and the backend keeps
its PyTorch path.

Owns the load and the argument checks of one call; it does not own deciding
which tokens are decodes (``torch_backend``) or the cache layout (``kv_cache_layout``).
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

_SOURCE = Path(__file__).with_name("cpu_kernels") / "paged_decode.cpp"
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_PROFILE_NAME = "tandem::paged_decode_attention"

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I32 = ctypes.c_int
_ARGTYPES: list[Any] = [_I32, _P, _I64, _I64, _P, _P, _I64, _I64, _I64, _P, _I64, _P, _P, _P,
                       _I32, _P, _I64, _I64, _I32, _I32, _I32, _I32, ctypes.c_float]


@dataclass(frozen=True)
class PagedDecodeKernel:
    """The loaded library's entry point."""

    function: ctypes._CFuncPtr  # type: ignore[name-defined]

    def __call__(
        self,
        query: torch.Tensor,  # [tokens, num_heads, head_size], rows may be strided
        k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size], strided
        v_cache: torch.Tensor,  # like k_cache, with the same strides
        block_tables: torch.Tensor,  # [num_seqs, width] int32
        seq_lens: torch.Tensor,  # [num_seqs] int32
        query_start_loc: torch.Tensor | None,  # [num_seqs + 1] int32; None: row = sequence
        seqs: torch.Tensor | None,  # [n] int32: the sequences to attend; None: 0 .. n - 1
        num_items: int,
        out: torch.Tensor,  # like query
        scale: float,
    ) -> None:
        """Writes the attention output of each attended sequence's query row into ``out``."""
        _check(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, seqs, out)
        _, num_heads, head_size = query.shape
        num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
        # torch.profiler sees no foreign call: name it while a profile is recording.
        profiling = torch.autograd.profiler._is_profiler_enabled
        with (torch.profiler.record_function(_PROFILE_NAME) if profiling
              else contextlib.nullcontext()):
            code = self.function(
                _DTYPES[query.dtype], query.data_ptr(), query.stride(0), query.stride(1),
                k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
                k_cache.stride(2), block_tables.data_ptr(),
                block_tables.stride(0), seq_lens.data_ptr(),
                None if query_start_loc is None else query_start_loc.data_ptr(),
                None if seqs is None else seqs.data_ptr(), num_items, out.data_ptr(),
                out.stride(0), out.stride(1), num_heads, num_kv_heads, head_size, block_size,
                scale)
        if code != 0:
            raise ValueError(f"paged decode kernel refused its arguments (code {code})")


def _check(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           block_tables: torch.Tensor, seq_lens: torch.Tensor,
           query_start_loc: torch.Tensor | None, seqs: torch.Tensor | None,
           out: torch.Tensor) -> None:
    """The kernel trusts its pointers: every layout it assumes is checked here."""
    check_rows_and_cache(query, out, k_cache, v_cache)
    if k_cache.dtype not in _DTYPES or k_cache.device.type != "cpu":
        raise ValueError(f"the kernel runs float32 or bfloat16 on the CPU, not "
                         f"{k_cache.dtype} on {k_cache.device}")
    indices: dict[str, torch.Tensor | None] = {
        "block_tables": block_tables, "seq_lens": seq_lens,
        "query_start_loc": query_start_loc, "seqs": seqs}
    for name, index in indices.items():
        if index is not None and (index.dtype != torch.int32 or index.stride(-1) != 1):
            raise ValueError(f"{name} must be int32 with unit stride in its last dimension")


def check_rows_and_cache(query: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor) -> None:
    """What every CPU attention kernel (decode, ``cpu_prefill_kernel``'s prefill) assumes of
    its query and output rows and of a layer's K and V caches, or ValueError."""
    for name, t in (("query", query), ("out", out)):
        if t.dim() != 3 or t.stride(2) != 1 or t.dtype != k_cache.dtype:
            raise ValueError(f"{name}: expected [tokens, heads, head_size] rows of the "
                             f"cache's dtype with unit stride, got {tuple(t.shape)} "
                             f"{t.dtype} strides {t.stride()}")
    if not (k_cache.dim() == 4 and k_cache.shape == v_cache.shape
            and k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1):
        raise ValueError("k_cache and v_cache must be of one 4-D shape and strides, with "
                         "unit-stride rows")


def kernel_supports(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype in _DTYPES


@functools.cache
def load_paged_decode(source: Path = _SOURCE,
                      extra_flags: tuple[str, ...] = ()) -> PagedDecodeKernel | None:
    """The kernel, built if needed; None (logged once) where it cannot be built or loaded.
    ``source`` and ``extra_flags`` (after ``-march=native``: ``-mno-avx512f`` builds the
    AVX2 path here) are for tests and benchmarks; the engine takes the defaults."""
    library = load_library(source, "CPU paged-attention kernel",
                           "decode attention gathers K/V with PyTorch ops (slower)", extra_flags)
    if library is None:
        return None
    return PagedDecodeKernel(entry_point(library, "tandem_paged_decode", _ARGTYPES))
