"""The CPU kernel that writes a step's K and V into a layer's paged cache: building it,
loading it, calling it.

``kv_cache_layout.write_kv`` calls it on the CPU (any dtype); elsewhere, or where it cannot
be built, that function's PyTorch indexing does the same. The kernel
(``cpu_kernels/kv_write.cpp``) copies each (token, KV head) row to its slot, so the write
costs its copies instead of PyTorch's advanced-index setup (~60 us a call, two calls a
layer: 2.3% of a one-core decode step at batch 64).

Owns the load and the argument checks of one call; it does not own the layout
(``kv_cache_layout``).
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

_SOURCE = Path(__file__).with_name("cpu_kernels") / "kv_write.cpp"
_PROFILE_NAME = "tandem::kv_write"

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I32 = ctypes.c_int
_ARGTYPES: list[Any] = [_P, _I64, _I64, _P, _I64, _I64, _P, _I64, _P, _P, _I64, _I64, _I64,
                        _I64, _I32, _I32, _I32, _I32]


@dataclass(frozen=True)
class KvWriteKernel:
    """The loaded library's entry point."""

    function: ctypes._CFuncPtr  # type: ignore[name-defined]

    def __call__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """``kv_cache_layout.write_kv`` for a layer's K and V caches
        (``[num_blocks, num_kv_heads, block_size, head_size]`` views, one set of strides)."""
        _check(k_cache, v_cache, key, value, slot_mapping)
        num_blocks, num_kv_heads, block_size, head_size = k_cache.shape
        profiling = torch.autograd.profiler._is_profiler_enabled
        with (torch.profiler.record_function(_PROFILE_NAME) if profiling
              else contextlib.nullcontext()):
            code = self.function(
                key.data_ptr(), key.stride(0), key.stride(1), value.data_ptr(),
                value.stride(0), value.stride(1), slot_mapping.data_ptr(), len(slot_mapping),
                k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
                k_cache.stride(2), num_blocks, num_kv_heads, head_size, block_size,
                k_cache.element_size())
        if code != 0:
            raise IndexError(f"a slot of slot_mapping lies past the cache's "
                             f"{num_blocks * block_size} slots")


def _check(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor,
           value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The kernel trusts its pointers: every layout it assumes is checked here."""
    if not (k_cache.dim() == 4 and k_cache.shape == v_cache.shape
            and k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1):
        raise ValueError("k_cache and v_cache must be of one 4-D shape and strides, with "
                         "unit-stride rows")
    rows = (len(slot_mapping), k_cache.shape[1], k_cache.shape[3])
    for name, t in (("key", key), ("value", value)):
        if tuple(t.shape) != rows or t.stride(2) != 1 or t.dtype != k_cache.dtype:
            raise ValueError(f"{name}: expected {rows} rows of the cache's dtype with unit "
                             f"stride, got {tuple(t.shape)} {t.dtype} strides {t.stride()}")
    if slot_mapping.dtype != torch.int64 or slot_mapping.dim() != 1 or \
            slot_mapping.stride(0) != 1:
        raise ValueError("slot_mapping must be a contiguous 1-D int64 tensor")


@functools.cache
def load_kv_write() -> KvWriteKernel | None:
    """The kernel, built if needed; None (logged once) where it cannot be built or loaded."""
    library = load_library(_SOURCE, "CPU KV-write kernel",
                           "KV is written by PyTorch indexing (slower)")
    if library is None:
        return None
    return KvWriteKernel(entry_point(library, "tandem_write_kv", _ARGTYPES))
