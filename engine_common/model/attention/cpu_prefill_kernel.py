"""The CPU paged prefill-attention kernel (bf16): building it, loading it, calling it.

The kernel (``cpu_kernels/paged_prefill.cpp``) attends every query row of a step's prefill
sequences (query_len > 1, any cached prefix) causally over its sequence's keys, read in
place from the paged cache through the block table, flash style (float32 scores, online
softmax). With avx512_bf16 it multiplies with ``vdpbf16ps``: several times the bf16 speed
of SDPA's CPU flash kernel, which does not use bf16 dot products on this CPU.

Built like the decode kernel (``model/native_build``). The library says whether its
avx512_bf16 path was compiled (``vectorized``); without it the kernel runs a scalar loop,
correct but slower than SDPA, which the backend then keeps. bf16 only: the float32 path is
SDPA, bit-exact with Hugging Face, and stays so.

Owns the load, the workspace size and the argument checks of one call; it does not own
which sequences are prefills (``torch_backend``) or the cache layout (``kv_cache_layout``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine_common.model.attention.cpu_paged_kernel import check_rows_and_cache
from engine_common.model.native_build import entry_point, load_library

_SOURCE = Path(__file__).with_name("cpu_kernels") / "paged_prefill.cpp"
_PROFILE_NAME = "tandem::paged_prefill_attention"
# Keys per packed tile (the kernel's kTile): the workspace holds every prefill sequence's
# K and V, per KV head, padded to whole tiles.
_TILE = 32

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I32 = ctypes.c_int
_ARGTYPES: list[Any] = [_P, _I64, _I64, _P, _P, _I64, _I64, _I64, _P, _I64, _P, _P, _P, _I32,
                       _P, _I64, _I64, _I32, _I32, _I32, _I32, ctypes.c_float, _P, _I64]


def workspace_bytes(seq_lens: Sequence[int], num_kv_heads: int, head_size: int) -> int:
    """Bytes of packed K and V the kernel needs for prefill sequences of these lengths."""
    tiles = sum(-(-n // _TILE) for n in seq_lens)
    return tiles * _TILE * num_kv_heads * head_size * 2 * 2  # K and V, 2 bytes each


def prefill_kernel_supports(dtype: torch.dtype, device: torch.device, head_size: int) -> bool:
    return device.type == "cpu" and dtype == torch.bfloat16 and head_size % 16 == 0


@dataclass(frozen=True)
class PagedPrefillKernel:
    """The loaded library's entry point."""

    function: ctypes._CFuncPtr  # type: ignore[name-defined]
    vectorized: bool  # the avx512_bf16 path was compiled (else a scalar loop)

    def __call__(
        self,
        query: torch.Tensor,  # [tokens, num_heads, head_size] bf16, rows may be strided
        k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size], strided
        v_cache: torch.Tensor,  # like k_cache, with the same strides
        block_tables: torch.Tensor,  # [num_seqs, width] int32
        seq_lens: torch.Tensor,  # [num_seqs] int32: cached + this step's tokens
        query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
        seqs: torch.Tensor,  # [n] int32: the prefill sequences to attend
        out: torch.Tensor,  # like query
        scale: float,
        workspace: torch.Tensor,  # uint8, at least ``workspace_bytes`` of these sequences
    ) -> None:
        """Writes the attention output of every query row of ``seqs`` into ``out``."""
        _check(query, k_cache, v_cache, out, (block_tables, seq_lens, query_start_loc, seqs),
               workspace)
        _, num_heads, head_size = query.shape
        num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
        profiling = torch.autograd.profiler._is_profiler_enabled
        with (torch.profiler.record_function(_PROFILE_NAME) if profiling
              else contextlib.nullcontext()):
            code = self.function(
                query.data_ptr(), query.stride(0), query.stride(1), k_cache.data_ptr(),
                v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(),
                query_start_loc.data_ptr(), seqs.data_ptr(), len(seqs), out.data_ptr(),
                out.stride(0), out.stride(1), num_heads, num_kv_heads, head_size, block_size,
                scale, workspace.data_ptr(), workspace.numel())
        if code != 0:
            raise ValueError(f"paged prefill kernel refused its arguments (code {code})")


def _check(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           out: torch.Tensor, indices: tuple[torch.Tensor, ...], workspace: torch.Tensor
           ) -> None:
    """The kernel trusts its pointers: every layout it assumes is checked here."""
    if not prefill_kernel_supports(k_cache.dtype, k_cache.device, k_cache.shape[-1]):
        raise ValueError(f"the prefill kernel runs bfloat16 on the CPU with a head size "
                         f"that is a multiple of 16, not {k_cache.dtype} on "
                         f"{k_cache.device}, head {k_cache.shape[-1]}")
    check_rows_and_cache(query, out, k_cache, v_cache)
    for index in indices:
        if index.dtype != torch.int32 or index.stride(-1) != 1:
            raise ValueError("block_tables, seq_lens, query_start_loc and seqs must be int32 "
                             "with unit stride in their last dimension")
    if workspace.dtype != torch.uint8 or not workspace.is_contiguous():
        raise ValueError("workspace must be a contiguous uint8 tensor")


@functools.cache
def load_paged_prefill(extra_flags: tuple[str, ...] = ()) -> PagedPrefillKernel | None:
    """The kernel, built if needed (``extra_flags`` after ``-march=native``: tests build the
    scalar path with ``-mno-avx512f``); None (logged once) where it cannot be built."""
    library = load_library(_SOURCE, "CPU paged prefill-attention kernel",
                           "bf16 prefill attention runs SDPA", extra_flags)
    if library is None:
        return None
    return PagedPrefillKernel(entry_point(library, "tandem_paged_prefill", _ARGTYPES),
                              bool(library.tandem_paged_prefill_vectorized()))
