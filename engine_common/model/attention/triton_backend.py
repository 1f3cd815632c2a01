"""Paged attention with Triton kernels: the GPU backend.

Owns sequencing one layer's attention over the Triton kernels: write this step's K/V into
the cache, then run the split-context decode kernel when every sequence has one query
token, else the ragged prefill kernel (which also serves the decode rows of a mixed step).
It does not own the kernels (triton_kernels/) or the cache tensor and block tables.
"""

from __future__ import annotations

import torch

from engine_common.model.attention.backend import AttentionBackend, AttentionMetadata
from engine_common.model.attention.triton_kernels.decode_attention import decode_attention
from engine_common.model.attention.triton_kernels.kv_write import kv_write
from engine_common.model.attention.triton_kernels.prefill_attention import prefill_attention


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        kv_write(key, value, kv_cache, metadata.slot_mapping)
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if metadata.is_pure_decode:
            decode_attention(
                query,
                kv_cache,
                output,
                metadata.block_tables,
                metadata.seq_lens,
                metadata.query_start_loc,
                self.scale,
                metadata.max_seq_len,
            )
        else:
            prefill_attention(
                query,
                kv_cache,
                output,
                metadata.block_tables,
                metadata.seq_lens,
                metadata.query_start_loc,
                self.scale,
                metadata.max_query_len,
            )
        return output
