"""The paged KV cache as a transfer sees it: runs sent in place, or copies through staging.

Owns the two copies of a staged transfer: gather (``staging[l, kv, i] = kv_cache[ids[i], l,
kv]``) on the producer and scatter (the reverse) on the consumer, each over a range of
layers so that transfers can be pipelined, and the reusable staging buffer; and the
in-place views a direct transfer sends from, receives into and reads into (``run_view``:
consecutive blocks, every layer's K and V, one contiguous stretch of the cache). It does
not own what is copied when (``ucx_connector``, ``transfer_plan``) or which blocks are
valid (``leases`` and the engine).

Shapes: the cache is block-major, ``[num_blocks, num_layers, 2, heads, block_size,
head_size]`` (``engine_common/model/attention/kv_cache_layout.py``), so a run of
consecutive blocks is one slice; the staging buffer is layer-major, ``[num_layers, 2, n,
heads, block_size, head_size]``, so that a layer range of it is one contiguous slice and a
staged pull's chunks can be sent and scattered while the next are gathered.

Why numpy on the host: torch's index_select / index_copy_ parallelise with OpenMP. Run
from a copy thread inside an engine process they start a second thread team that
competes with the engine's own, and on a busy host a team waiting for a descheduled
member stalls: 8-block scatters measured 14-80 ms where a single thread takes 0.5 ms.
numpy copies on the calling thread only. Each (block, layer, K/V) row is
``heads * block_size * head_size`` contiguous elements in both buffers, so viewing rows as
one opaque numpy element (``np.void`` of the row's byte size) turns a gather into one
``np.take`` of whole rows and a scatter into one fancy-indexed assignment, dtype-agnostic
(bfloat16 included). On CUDA, torch's index ops run on a side stream that is synchronised
before returning, so the bytes are in place when the caller sends or reports them.
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
        _, num_layers, two, *row_shape = kv_cache.shape
        self._shape = (num_layers, two, *row_shape)
        self._bytes_per_block = kv_cache[0].numel() * kv_cache.element_size()
        self._flat = torch.empty(0, dtype=torch.uint8, device=self._device)

    def blocks(self, num_blocks: int) -> torch.Tensor:
        """A [num_layers, 2, num_blocks, heads, block_size, head_size] view of the buffer."""
        nbytes = num_blocks * self._bytes_per_block
        if self._flat.numel() < nbytes:
            self._flat = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        num_layers, two, *row_shape = self._shape
        return self._flat[:nbytes].view(self._dtype).view(num_layers, two, num_blocks, *row_shape)


class BlockCopier:
    def __init__(self, kv_cache: torch.Tensor, layout: KvLayout):
        layout.check_cache(kv_cache)
        self._kv_cache = kv_cache
        self._row_bytes = layout.bytes_per_block // (2 * layout.num_layers)
        self._stream = torch.cuda.Stream(kv_cache.device) if kv_cache.is_cuda else None
        # [num_blocks, num_layers * 2]: a block's (layer, K/V) rows in order
        self._cache_rows = None if kv_cache.is_cuda else self._rows(kv_cache, kv_cache.shape[0])

    def _rows(self, buffer: torch.Tensor, rows: int) -> np.ndarray:
        """[rows, -1] numpy view of a contiguous buffer whose elements are whole
        (block, layer, K/V) rows."""
        raw = buffer.view(torch.uint8).numpy().reshape(rows, -1)
        return raw.view(np.dtype((np.void, self._row_bytes)))

    def run_view(self, start: int, count: int) -> torch.Tensor:
        """Blocks ``[start, start + count)``, every layer's K and V, in place: one contiguous
        stretch of the cache."""
        return self._kv_cache[start : start + count]

    def gather(self, block_ids: list[int], staging: torch.Tensor, start: int, stop: int) -> None:
        """staging[start:stop, :, i] = kv_cache[block_ids[i], start:stop]."""
        if self._cache_rows is not None:
            ids = np.asarray(block_ids, dtype=np.intp)
            # [n, (stop - start) * 2] rows of the blocks, written transposed into the
            # staging's [(stop - start) * 2, n] rows
            out = self._rows(staging[start:stop], 2 * (stop - start)).T
            # mode="clip" skips numpy's buffered copy of `out` (ids are validated by
            # the caller); it is several times faster than the default "raise".
            np.take(self._cache_rows[:, 2 * start : 2 * stop], ids, axis=0, out=out, mode="clip")
            return
        ids_t = torch.tensor(block_ids, dtype=torch.long, device=self._kv_cache.device)
        assert self._stream is not None
        with torch.cuda.stream(self._stream):
            blocks = self._kv_cache[:, start:stop].index_select(0, ids_t)
            staging[start:stop].copy_(blocks.movedim(0, 2))
        self._stream.synchronize()

    def scatter(self, staging: torch.Tensor, block_ids: list[int], start: int, stop: int) -> None:
        """kv_cache[block_ids[i], start:stop] = staging[start:stop, :, i]."""
        if self._cache_rows is not None:
            ids = np.asarray(block_ids, dtype=np.intp)
            rows = self._rows(staging[start:stop], 2 * (stop - start))
            self._cache_rows[ids, 2 * start : 2 * stop] = rows.T
            return
        ids_t = torch.tensor(block_ids, dtype=torch.long, device=self._kv_cache.device)
        assert self._stream is not None
        with torch.cuda.stream(self._stream):
            self._kv_cache[ids_t, start:stop] = staging[start:stop].movedim(2, 0)
        self._stream.synchronize()
