"""Attention with a sliding window and/or attention sinks, over the paged cache, in PyTorch
ops on any device.

Owns reading only the keys a layer may see (the last ``window`` positions of a sliding
layer, all of them for a full layer) through the block tables, and the softmax with one
extra learned logit per head (the sink) in its denominator, as GPT-OSS defines it. It does
not own writing K/V into the cache (the backend, before calling this) or the cache itself.

Decode rows (one query token) of a step are attended as one padded batch; sequences with
several query tokens one at a time. Numerics follow Hugging Face's GPT-OSS eager attention:
``q k^T * scale + mask``, the sink logit appended, the row maximum subtracted, softmax in
the model dtype, the sink's column dropped, times V.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine_common.model.attention.kv_cache_layout import key_value

if TYPE_CHECKING:
    from engine_common.model.attention.backend import AttentionMetadata


@dataclass
class _Rows:
    """One attention call's inputs: ``tokens`` rows of the step, their visible keys."""

    # Token indices in the step's flat batch, [num_seqs * query_len] (decode: one each).
    tokens: torch.Tensor
    num_seqs: int
    query_len: int
    # [num_seqs, context] cache blocks and offsets in them of the visible keys (padding: any
    # valid slot).
    blocks: torch.Tensor
    offsets: torch.Tensor
    # [num_seqs, query_len, context] 0 where visible, -inf elsewhere.
    bias: torch.Tensor


def _plan_rows(metadata: AttentionMetadata, seqs: list[int], query_len: int,
               window: int | None, block_size: int, device: torch.device) -> _Rows:
    """The rows of ``seqs`` (each with ``query_len`` query tokens) and the keys they see."""
    seq_lens = [metadata.seq_lens_cpu[i] for i in seqs]
    firsts = [n - query_len for n in seq_lens]  # position of each sequence's first query
    lows = [max(0, f - window + 1) if window else 0 for f in firsts]
    context = max(n - lo for n, lo in zip(seq_lens, lows, strict=True))
    rows = torch.tensor(seqs, dtype=torch.long, device=device)
    low = torch.tensor(lows, dtype=torch.long, device=device)
    first = torch.tensor(firsts, dtype=torch.long, device=device)
    positions = low[:, None] + torch.arange(context, device=device)[None, :]  # [S, C]
    query_pos = first[:, None] + torch.arange(query_len, device=device)[None, :]  # [S, L]
    visible = positions[:, None, :] <= query_pos[:, :, None]
    if window:
        visible &= positions[:, None, :] > query_pos[:, :, None] - window
    positions = torch.minimum(positions, query_pos[:, -1:])  # padding reads a real slot
    tables = metadata.block_tables.index_select(0, rows.to(metadata.block_tables.device))
    blocks = tables.long().gather(1, positions // block_size)
    bias = torch.zeros(visible.shape, dtype=torch.float32, device=device)
    bias.masked_fill_(~visible, float("-inf"))
    starts = metadata.query_start_loc.index_select(0, rows.to(metadata.query_start_loc.device))
    tokens = (starts.long()[:, None] + torch.arange(query_len, device=device)[None, :]).flatten()
    return _Rows(tokens, len(seqs), query_len, blocks, positions % block_size, bias)


class SinkWindowAttention:
    """One per backend: plans a step once per window size, for every layer with it (with KV
    cache groups each window is one group's, whose metadata its layers all get)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, scale: float):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = scale
        self._planned_for: AttentionMetadata | None = None
        self._plans: dict[int | None, list[_Rows]] = {}

    def _plan(self, metadata: AttentionMetadata, window: int | None, block_size: int,
              device: torch.device) -> list[_Rows]:
        if self._planned_for is not metadata.step_metadata:
            self._planned_for, self._plans = metadata.step_metadata, {}
        plan = self._plans.get(window)
        if plan is None:
            query_lens = metadata.query_lens_cpu
            decode = [i for i, n in enumerate(query_lens) if n == 1]
            plan = [_plan_rows(metadata, decode, 1, window, block_size, device)] if decode else []
            plan += [_plan_rows(metadata, [i], n, window, block_size, device)
                     for i, n in enumerate(query_lens) if n > 1]
            self._plans[window] = plan
        return plan

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        kv_cache: torch.Tensor,  # [num_blocks, 2, num_kv_heads, block_size, head_size], written
        metadata: AttentionMetadata,
        sinks: torch.Tensor | None,  # [num_heads]
        window: int | None,
    ) -> torch.Tensor:
        block_size = kv_cache.shape[3]
        k_cache, v_cache = key_value(kv_cache)
        heads = torch.arange(self.num_kv_heads, device=query.device)[None, :, None]
        out = torch.empty_like(query)
        for rows in self._plan(metadata, window, block_size, query.device):
            # The head-major cache gathers straight into [S, kv_heads, C, head].
            blocks, offsets = rows.blocks[:, None, :], rows.offsets[:, None, :]
            keys = k_cache[blocks, heads, offsets]
            values = v_cache[blocks, heads, offsets]
            out[rows.tokens] = self._attend(query[rows.tokens], keys, values, rows, sinks)
        return out

    def _attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                rows: _Rows, sinks: torch.Tensor | None) -> torch.Tensor:
        seqs, length = rows.num_seqs, rows.query_len
        kv_heads, head = self.num_kv_heads, self.head_size
        group = self.num_heads // kv_heads
        # [S, L, kv, g, d] -> [S, kv, g * L, d]: a KV head's query heads share its keys.
        q = query.view(seqs, length, kv_heads, group, head).permute(0, 2, 3, 1, 4)
        q = q.reshape(seqs, kv_heads, group * length, head)
        scores = torch.matmul(q, keys.transpose(2, 3)) * self.scale  # keys: [S, kv, C, d]
        context = scores.shape[-1]
        scores = scores.view(seqs, kv_heads, group, length, context)
        scores = scores + rows.bias[:, None, None].to(scores.dtype)
        if sinks is not None:
            sink = sinks.view(1, kv_heads, group, 1, 1).expand(seqs, -1, -1, length, 1)
            scores = torch.cat((scores, sink.to(scores.dtype)), dim=-1)
        scores = scores - scores.max(dim=-1, keepdim=True).values
        probs = torch.softmax(scores, dim=-1, dtype=scores.dtype)
        if sinks is not None:
            probs = probs[..., :-1]
        out = torch.matmul(probs.reshape(seqs, kv_heads, group * length, context), values)
        out = out.view(seqs, kv_heads, group, length, head).permute(0, 3, 1, 2, 4)
        return out.reshape(seqs * length, self.num_heads, head)
