"""CUDA graphs for decode steps: static inputs, one captured forward per padded batch size.

A decode step of a small model is bound by kernel launches, not by the GPU: SmolLM2-135M
launches some 400 kernels per step, each a few microseconds of CPU time. Capturing the
model's forward once per batch size of a ladder (1, 2, 4, 8, 16, 24, ... up to the
maximum) and replaying the graph turns those launches into one. A step of ``n`` sequences
replays the smallest captured size of at least ``n``; the padding rows write no KV (slot
-1, which the kv_write kernel skips), attend to one slot of block 0, and their outputs are
dropped.

A graph replays the tensors it was captured with, so every step copies its inputs into
static device buffers (from pinned host buffers, without waiting) instead of building new
tensors. The decode kernel's split count is fixed at capture for the longest context the
engine allows; shorter contexts leave the extra splits empty.

Owns the static buffers, the capture ladder, capture and replay. It does not own deciding
which steps are decodes (the model runner) or sampling, which stays outside the graph
because it branches on per-request parameters. With ``capture=False`` the same static,
padded forward runs eagerly, which is how the padding is tested without a GPU.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from engine_common.model.attention.backend import AttentionMetadata

logger = logging.getLogger(__name__)


def capture_sizes(max_batch_size: int) -> list[int]:
    """The padded batch sizes to capture: 1, 2, 4, then every multiple of 8, then the max."""
    if max_batch_size < 1:
        raise ValueError(f"the CUDA graph batch size limit must be >= 1, got {max_batch_size}")
    sizes = [s for s in (1, 2, 4) if s <= max_batch_size]
    sizes += range(8, max_batch_size + 1, 8)
    if sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


@dataclass
class DecodeInputs:
    """One decode step's inputs, a row per sequence, as the model runner computes them."""

    token_ids: np.ndarray  # [n] int64
    positions: np.ndarray  # [n] int64
    slot_mapping: np.ndarray  # [n] int64
    seq_lens: list[int]  # context length of each sequence after this step
    block_tables: np.ndarray  # [n, width] int32


class DecodeGraphRunner:
    def __init__(
        self,
        model: nn.Module,
        kv_cache: torch.Tensor,
        max_batch_size: int,
        max_model_len: int,
        block_size: int,
        capture: bool,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.sizes = capture_sizes(max_batch_size)
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.num_steps = 0  # decode steps served, for tests and logs
        max_size = self.sizes[-1]
        device = kv_cache.device

        def static(shape: tuple[int, ...], dtype: torch.dtype, fill: int) -> torch.Tensor:
            return torch.full(shape, fill, dtype=dtype, device=device)

        # Padding rows keep these fills: token 0 at position 0, no KV write, context of 1.
        self._token_ids = static((max_size,), torch.int64, 0)
        self._positions = static((max_size,), torch.int64, 0)
        self._slot_mapping = static((max_size,), torch.int64, -1)
        self._seq_lens = static((max_size,), torch.int32, 1)
        self._block_tables = static((max_size, self.max_blocks_per_seq), torch.int32, 0)
        self._query_start_loc = torch.arange(max_size + 1, dtype=torch.int32, device=device)
        # Each step's inputs go host (numpy view of a pinned tensor) -> device buffer.
        self._device = {
            "token_ids": self._token_ids,
            "positions": self._positions,
            "slot_mapping": self._slot_mapping,
            "seq_lens": self._seq_lens,
            "block_tables": self._block_tables,
        }
        pin = device.type == "cuda"
        self._host = {
            name: torch.empty(buf.shape, dtype=buf.dtype, pin_memory=pin)
            for name, buf in self._device.items()
        }
        self._host_np = {name: buf.numpy() for name, buf in self._host.items()}
        # Marks the end of a step's host-to-device copies, which read the pinned buffers
        # after ``run`` returns: a step that samples nothing (only non-final one-token
        # prefill chunks) never syncs, so the next must wait before overwriting them.
        self._inputs_copied = torch.cuda.Event() if pin else None
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture_all()

    def padded_size(self, num_seqs: int) -> int | None:
        """The captured size a step of ``num_seqs`` sequences runs at; None if too many."""
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def can_run(self, num_seqs: int, blocks_per_seq: int) -> bool:
        return self.padded_size(num_seqs) is not None and blocks_per_seq <= self.max_blocks_per_seq

    def _metadata(self, size: int, seq_lens: list[int]) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self._slot_mapping[:size],
            query_start_loc=self._query_start_loc[: size + 1],
            seq_lens=self._seq_lens[:size],
            block_tables=self._block_tables[:size],
            max_query_len=1,
            max_seq_len=max(seq_lens),
            query_lens_cpu=[1] * size,
            seq_lens_cpu=seq_lens,
        )

    def _forward(self, size: int, metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(self._token_ids[:size], self._positions[:size], self.kv_cache, metadata)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        start = time.monotonic()
        pool = torch.cuda.graph_pool_handle()
        # Largest first: smaller graphs then reuse the memory of the larger ones' pool.
        for size in reversed(self.sizes):
            # The split count of the decode kernel is planned from max_seq_len: plan for the
            # longest context so one graph serves them all.
            metadata = self._metadata(size, [self.max_model_len] * size)
            self._forward(size, metadata)  # warm-up: compiles kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[size] = self._forward(size, metadata)
            self._graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for %d decode batch sizes (up to %d) in %.1f s",
                    len(self.sizes), self.sizes[-1], time.monotonic() - start)

    def run(self, inputs: DecodeInputs) -> torch.Tensor:
        """Runs the step's forward; returns the hidden states of its ``n`` sequences, [n, hidden].

        The result lives in the graph's memory: use it before the next ``run``.
        """
        n = len(inputs.seq_lens)
        width = inputs.block_tables.shape[1]
        size = self.padded_size(n)
        if size is None or width > self.max_blocks_per_seq:
            raise ValueError(f"a decode step of {n} sequences x {width} blocks was not captured")
        if self._inputs_copied is not None:
            self._inputs_copied.synchronize()
        host = self._host_np
        host["token_ids"][:n] = inputs.token_ids
        host["token_ids"][n:size] = 0
        host["positions"][:n] = inputs.positions
        host["positions"][n:size] = 0
        host["slot_mapping"][:n] = inputs.slot_mapping
        host["slot_mapping"][n:size] = -1
        host["seq_lens"][:n] = inputs.seq_lens
        host["seq_lens"][n:size] = 1
        host["block_tables"][:n, :width] = inputs.block_tables
        host["block_tables"][n:size, :width] = 0
        # Whole rows, so each copy is one contiguous pinned range (a [:size, :width] slice
        # would be staged through pageable memory). Columns past ``width`` are stale but
        # never read: each row reads only the blocks its own context length covers.
        for name, buf in self._device.items():
            buf[:size].copy_(self._host[name][:size], non_blocking=True)
        if self._inputs_copied is not None:
            self._inputs_copied.record()
        self.num_steps += 1
        graph = self._graphs.get(size)
        if graph is not None:
            graph.replay()
            return self._outputs[size][:n]
        return self._forward(size, self._metadata(size, inputs.seq_lens + [1] * (size - n)))[:n]
