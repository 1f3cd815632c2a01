"""The attention backend interface and the per-step metadata every backend reads.

Owns the contract between the model (which computes q, k, v per layer) and the paged KV
cache. It does not own cache allocation (the model runner) or block bookkeeping (the
KV cache manager).

Paged KV cache layout, shared by every backend and by KV transfer (``kv_cache_layout``):
one tensor per engine of shape [num_blocks, num_layers, 2, num_kv_heads, block_size,
head_size]; layer ``i`` receives the view ``cache[:, i]`` of shape [num_blocks, 2,
num_kv_heads, block_size, head_size], strided over blocks.
Token ``t`` of a request lives at slot ``block_table[t // block_size] * block_size +
t % block_size``; ``slot_mapping`` holds that flat slot for every token of this step.

A step's tokens are a ragged batch: sequence ``i`` contributes the query tokens
``query_start_loc[i]:query_start_loc[i+1]`` (flattened over the batch), whose positions are
``seq_lens[i] - query_len_i ... seq_lens[i] - 1``; the earlier ``seq_lens[i] - query_len_i``
tokens are already in the cache (prefix hits, earlier chunks, earlier decode steps).
Attention is causal over the sequence's whole context.

KV cache groups (``engine_common.kv_cache_groups``): when a model's layers of different
attention types keep separate block tables, the cache's layer axis holds one group's layers
and each group has its own metadata (its ``block_tables`` and ``slot_mapping``; the rest is
the step's). ``layer_views[i]`` names layer ``i``'s slot in the layer axis and its group's
metadata; a backend reads only the metadata it is given, so it needs nothing else.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from engine_common.model.attention.kv_cache_layout import write_kv
from engine_common.model.attention.sink_window import SinkWindowAttention


@dataclass
class AttentionMetadata:
    # [num_tokens] int64: flat cache slot for each new token this step.
    slot_mapping: torch.Tensor
    # [num_seqs + 1] int32: prefix sums of query lengths (query_start_loc[0] == 0).
    query_start_loc: torch.Tensor
    # [num_seqs] int32: context length of each sequence after this step (cached + new).
    seq_lens: torch.Tensor
    # [num_seqs, max_blocks_per_seq] int32: block ids, padded with 0 beyond each sequence.
    block_tables: torch.Tensor
    # Python-side copies, so backends need no device sync to plan their work.
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # KV cache groups: per layer, (its slot in the cache's layer axis, its group's
    # metadata); None: one group, layer i at slot i with this metadata.
    layer_views: tuple[tuple[int, AttentionMetadata], ...] | None = None
    # A group's metadata: the step's (the one the model was given); None for that one.
    step: AttentionMetadata | None = None

    @property
    def step_metadata(self) -> AttentionMetadata:
        """The step's metadata, whichever group's this is (backends plan once per step)."""
        return self.step if self.step is not None else self

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(ABC):
    """Computes attention for one layer over the paged cache.

    ``forward`` first writes this step's ``key``/``value`` into ``kv_cache`` at
    ``metadata.slot_mapping``, then attends each query token to its sequence's context
    (causal), and returns the output.
    """

    name: str = "abstract"
    # Whether a decode step's forward can be captured in a CUDA graph: no host syncs, no
    # host-side planning from per-step values (see engine_common/decode_graphs.py).
    supports_cuda_graphs: bool = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, scale: float):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = scale
        self._sink_window: SinkWindowAttention | None = None

    def forward_sinks_window(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        sinks: torch.Tensor | None,  # [num_heads] learned sink logits, or None
        window: int | None,  # attend to the last ``window`` positions; None: all
    ) -> torch.Tensor:
        """``forward`` for a layer with attention sinks and/or a sliding window: PyTorch ops
        on any device (``sink_window``); no backend has a fused kernel for it yet."""
        if self._sink_window is None:
            self._sink_window = SinkWindowAttention(self.num_heads, self.num_kv_heads,
                                                    self.head_size, self.scale)
        write_kv(kv_cache, key, value, metadata.slot_mapping)
        return self._sink_window.forward(query, kv_cache, metadata, sinks, window)

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [num_blocks, 2, num_kv_heads, block_size, head_size]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        ...
