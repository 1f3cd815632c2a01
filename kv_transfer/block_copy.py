"""The paged KV cache as a transfer sees it: stretches sent in place, or copies through staging.

Owns the two copies of a staged transfer: gather (``staging = kv_cache[:, :, ids]``) on
the producer and scatter (``kv_cache[:, :, ids] = staging``) on the consumer, each over a
range of layers so that transfers can be pipelined, and the reusable staging buffer; and
the in-place views a direct transfer sends from and receives into (``run_view``: the
rows of consecutive blocks of one layer's K or V, one contiguous stretch of the cache).
It does not own what is copied when (``ucx_connector``, ``transfer_plan``) or which
blocks are valid (``leases`` and the engine).

Shapes: the cache is ``[num_layers, 2, num_blocks, block_size, heads, head_size]`` and
the staging buffer ``[num_layers, 2, n, block_size, heads, head_size]``; layers are the
outermost dimension, so a layer range of either is one contiguous slice.

Why numpy on the host: torch's index_select / index_copy_ parallelise with OpenMP. Run
from a copy thread inside an engine process they start a second thread team that
competes with the engine's own, and on a busy host a team waiting for a descheduled
member stalls: 8-block scatters measured 14-80 ms where a single thread takes 0.5 ms.
numpy copies on the calling thread only. Each (layer, K/V, block) row is
``block_size * heads * head_size`` contiguous elements, so viewing rows as one opaque
numpy element (``np.void`` of the row's byte size) turns a gather into one ``np.take``
of whole rows and a scatter into one fancy-indexed assignment, dtype-agnostic (bfloat16
included). On CUDA, torch's index ops run on a side stream that is synchronised before
returning, so the bytes are in place when the caller sends or reports them.
"""

from __future__ import annotations

import numpy as np
import torch

from kv_transfer.layout import KvLayout


class StagingBuffer:
    """A reusable contiguous buffer for n blocks, on the cache's device; grows on demand."""

    def __init__(self, kv_cache: torch.Tensor):
        self._device = kv_cache.device
        self._dtype = kv_cache.dtype
        num_layers, _, _, block_size, num_kv_heads, head_size = kv_cache.shape
        self._shape = (num_layers, 2, block_size, num_kv_heads, head_size)
        self._bytes_per_block = 2 * num_layers * block_size * num_kv_heads * head_size
        self._bytes_per_block *= kv_cache.element_size()
        self._flat = torch.empty(0, dtype=torch.uint8, device=self._device)

    def blocks(self, num_blocks: int) -> torch.Tensor:
        """A [num_layers, 2, num_blocks, block_size, heads, head_size] view of the buffer."""
        nbytes = num_blocks * self._bytes_per_block
        if self._flat.numel() < nbytes:
            self._flat = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        num_layers, two, *block_shape = self._shape
        return self._flat[:nbytes].view(self._dtype).view(num_layers, two, num_blocks, *block_shape)


class BlockCopier:
    def __init__(self, kv_cache: torch.Tensor, layout: KvLayout):
        layout.check_cache(kv_cache)
        self._kv_cache = kv_cache
        self._row_bytes = layout.bytes_per_block // (2 * layout.num_layers)
        num_layers, _, num_blocks = kv_cache.shape[:3]
        # [num_layers * 2, num_blocks, row elements]: a (layer, K/V) group's rows in order
        self._groups = kv_cache.view(num_layers * 2, num_blocks, -1)
        self._stream = torch.cuda.Stream(kv_cache.device) if kv_cache.is_cuda else None
        self._cache_rows = None if kv_cache.is_cuda else self._rows(kv_cache)

    def _rows(self, blocks: torch.Tensor) -> np.ndarray:
        """[num_layers * 2, num_blocks] numpy view whose elements are whole block rows."""
        rows = blocks.shape[0] * 2
        raw = blocks.view(torch.uint8).numpy().reshape(rows, -1)
        return raw.view(np.dtype((np.void, self._row_bytes)))

    def run_view(self, group: int, start: int, count: int) -> torch.Tensor:
        """Blocks ``[start, start + count)`` of (layer, K/V) group ``group`` (layer * 2 + kv),
        in place: one contiguous stretch of the cache."""
        return self._groups[group, start : start + count]

    def gather(self, block_ids: list[int], staging: torch.Tensor, start: int, stop: int) -> None:
        """staging[start:stop] = kv_cache[start:stop, :, block_ids]."""
        if self._cache_rows is not None:
            ids = np.asarray(block_ids, dtype=np.intp)
            out = self._rows(staging[start:stop])
            # mode="clip" skips numpy's buffered copy of `out` (ids are validated by
            # the caller); it is several times faster than the default "raise".
            np.take(self._cache_rows[2 * start : 2 * stop], ids, axis=1, out=out, mode="clip")
            return
        ids_t = torch.tensor(block_ids, dtype=torch.long, device=self._kv_cache.device)
        assert self._stream is not None
        with torch.cuda.stream(self._stream):
            torch.index_select(self._kv_cache[start:stop], 2, ids_t, out=staging[start:stop])
        self._stream.synchronize()

    def scatter(self, staging: torch.Tensor, block_ids: list[int], start: int, stop: int) -> None:
        """kv_cache[start:stop, :, block_ids] = staging[start:stop]."""
        if self._cache_rows is not None:
            ids = np.asarray(block_ids, dtype=np.intp)
            self._cache_rows[2 * start : 2 * stop, ids] = self._rows(staging[start:stop])
            return
        ids_t = torch.tensor(block_ids, dtype=torch.long, device=self._kv_cache.device)
        assert self._stream is not None
        with torch.cuda.stream(self._stream):
            self._kv_cache[start:stop].index_copy_(2, ids_t, staging[start:stop])
        self._stream.synchronize()
