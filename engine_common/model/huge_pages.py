"""A zeroed CPU tensor on transparent huge pages, for the KV cache.

The block-major KV cache (``attention/kv_cache_layout.py``) puts a layer's blocks a whole
block apart (368 KiB for SmolLM2-135M in bf16), so a decode step's attention touches a new
4 KiB page for every (block, layer) it reads: a TLB miss each. Backed by 2 MiB pages, a few
blocks share one TLB entry. Linux gives an anonymous mapping huge pages when asked with
``madvise(MADV_HUGEPAGE)`` before its pages are first touched (the default
``transparent_hugepage`` mode is ``madvise``); measured with the paged decode kernel
(``docs/benchmarks.md``), 64 sequences of 135 tokens: 8-10% less CPU time.

Owns only that allocation. Where madvise is missing or refused (not Linux, THP disabled),
the tensor is an ordinary one, zeroed alike.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import sys

import torch

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6",
                               use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` on the CPU, its memory advised to huge pages
    (2 MiB-aligned: a contiguous view into a slightly larger buffer)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buffer = torch.empty(nbytes + HUGE_PAGE_BYTES, dtype=torch.uint8)
    offset = -buffer.data_ptr() % HUGE_PAGE_BYTES
    tensor = buffer[offset : offset + nbytes].view(dtype).view(shape)
    madvise = _madvise()
    if madvise is not None:
        span = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        madvise(tensor.data_ptr(), min(span, buffer.numel() - offset), _MADV_HUGEPAGE)
    return tensor.zero_()  # the first touch: faults in huge pages where advised
