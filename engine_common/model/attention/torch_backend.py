"""Paged attention in plain PyTorch: the CPU backend.

Owns writing a step's K/V into the paged cache and attending over it with PyTorch ops. It
does not own the cache tensor or the block tables.

Decode sequences (one query token) of a step are attended together: their blocks are
gathered from the block tables into one padded batch (into a reused workspace, since fresh
multi-megabyte buffers cost page faults every layer) and padding is masked. With few KV
heads, the scores of all query heads against all KV heads come from one batched matmul and
the matching (query head, KV head) pairs are kept: ``num_kv_heads`` times the useful FLOPs,
but one well-shaped GEMM per sequence beats ``batch * num_kv_heads`` tiny ones (or SDPA's
per-head blocking) on CPU by 1.5-2x, and no K/V is repeated. With many KV heads that waste
grows, so those models use one SDPA call with each KV head's query heads folded into the
query length.

Sequences with several query tokens (prefill, chunked prefill, prefix-cache hits) are
attended one at a time with SDPA and a causal mask offset by the cached prefix.

Padding positions read cache slots that no sequence of the step wrote; the cache must hold
finite values there (the model runner allocates it with zeros), since a NaN times a zero
attention weight is still NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine_common.model.attention.backend import AttentionBackend, AttentionMetadata

# Up to this many KV heads, decode computes scores against all KV heads in one matmul.
_MAX_KV_HEADS_FOR_DENSE_DECODE = 4


@dataclass
class _DecodePlan:
    # [num_decode] token indices in the step's flat batch; None when every token decodes.
    token_indices: torch.Tensor | None
    # [num_decode * num_context_blocks] block ids, row by row.
    block_ids: torch.Tensor
    # Padded context length: num_context_blocks * block_size.
    context_len: int
    # [num_decode, 1, 1, context_len] True where a key is in the sequence's context.
    mask: torch.Tensor
    # The same mask as float32 0 / -inf, added to the scores.
    mask_bias: torch.Tensor


@dataclass
class _PrefillSeq:
    query_start: int
    query_end: int
    seq_len: int
    # [num_context_blocks] int64 block ids; None when the whole context is in this step.
    block_ids: torch.Tensor | None
    # [query_len, seq_len] causal mask offset by the cached prefix; None when no prefix.
    mask: torch.Tensor | None


@dataclass
class _StepPlan:
    decode: _DecodePlan | None
    prefills: list[_PrefillSeq]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, scale: float):
        super().__init__(num_heads, num_kv_heads, head_size, scale)
        self.num_queries_per_kv = num_heads // num_kv_heads
        self.dense_decode = num_kv_heads <= _MAX_KV_HEADS_FOR_DENSE_DECODE
        # Every layer of a step shares one plan, rebuilt when a new metadata object arrives
        # (a step's metadata is never mutated once the forward pass starts).
        self._planned_for: AttentionMetadata | None = None
        self._plan: _StepPlan | None = None
        # Reused buffers for gathered K and V (layers run one after another).
        self._gather_workspace: torch.Tensor | None = None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        flat_shape = (num_blocks * block_size, self.num_kv_heads, self.head_size)
        k_cache.view(flat_shape).index_copy_(0, metadata.slot_mapping, key)
        v_cache.view(flat_shape).index_copy_(0, metadata.slot_mapping, value)

        plan = self._plan_step(metadata, block_size, query.device)
        if plan.decode is not None and not plan.prefills and plan.decode.token_indices is None:
            return self._decode(query, k_cache, v_cache, plan.decode)

        out = torch.empty_like(query)
        if plan.decode is not None:
            indices = plan.decode.token_indices
            assert indices is not None
            out[indices] = self._decode(query[indices], k_cache, v_cache, plan.decode)
        for seq in plan.prefills:
            out[seq.query_start : seq.query_end] = self._prefill(
                query, key, value, k_cache, v_cache, seq
            )
        return out

    def _decode(
        self,
        query: torch.Tensor,  # [batch, num_heads, head_size]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
        v_cache: torch.Tensor,
        plan: _DecodePlan,
    ) -> torch.Tensor:
        batch, context = query.shape[0], plan.context_len
        keys, values = self._gather(k_cache, v_cache, plan.block_ids)
        kv_heads, group, head_size = self.num_kv_heads, self.num_queries_per_kv, self.head_size
        if not self.dense_decode:
            # [batch, context, kv_heads, head] viewed as [batch, kv_heads, context, head]; the
            # query heads of one KV head (h = kv * group + g, HF's repeat_kv order) become
            # SDPA's query length, so K/V are not repeated.
            shape = (batch, context, kv_heads, head_size)
            out = F.scaled_dot_product_attention(
                query.view(batch, kv_heads, group, head_size),
                keys.view(shape).transpose(1, 2),
                values.view(shape).transpose(1, 2),
                attn_mask=plan.mask,
                scale=self.scale,
            )
            return out.view(batch, self.num_heads, head_size)
        keys = keys.view(batch, context * kv_heads, head_size)
        values = values.view(batch, context * kv_heads, head_size)
        # [batch, heads, context * kv_heads]: every query head against every KV head; keep
        # the pairs where the query head's KV head is the key's KV head.
        all_pairs = torch.bmm(query, keys.transpose(1, 2))
        all_pairs = all_pairs.view(batch, kv_heads, group, context, kv_heads)
        scores = all_pairs.diagonal(dim1=1, dim2=4)  # [batch, group, context, kv_heads]
        scores = scores.permute(0, 3, 1, 2)  # [batch, kv_heads, group, context]
        probs = torch.softmax(scores.float() * self.scale + plan.mask_bias, dim=-1)
        # Back to the all-pairs layout with zero weight on the other KV heads' values.
        weights = torch.zeros_like(all_pairs)
        weights.diagonal(dim1=1, dim2=4).copy_(probs.permute(0, 2, 3, 1))
        out = torch.bmm(weights.view(batch, self.num_heads, context * kv_heads), values)
        return out

    def _gather(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given blocks, [len(block_ids), block_size * kv_heads * head_size]."""
        row = k_cache[0].numel()
        size = block_ids.numel() * row
        workspace = self._gather_workspace
        if (
            workspace is None
            or workspace.shape[1] < size
            or workspace.dtype != k_cache.dtype
            or workspace.device != k_cache.device
        ):
            workspace = torch.empty((2, size), dtype=k_cache.dtype, device=k_cache.device)
            self._gather_workspace = workspace
        keys = workspace[0, :size].view(-1, row)
        values = workspace[1, :size].view(-1, row)
        torch.index_select(k_cache.view(-1, row), 0, block_ids, out=keys)
        torch.index_select(v_cache.view(-1, row), 0, block_ids, out=values)
        return keys, values

    def _prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        seq: _PrefillSeq,
    ) -> torch.Tensor:
        start, end = seq.query_start, seq.query_end
        if seq.block_ids is None:
            # The whole context is this step's tokens: use them directly.
            keys, values = key[start:end], value[start:end]
        else:
            keys = k_cache[seq.block_ids].flatten(0, 1)[: seq.seq_len]
            values = v_cache[seq.block_ids].flatten(0, 1)[: seq.seq_len]
        # [tokens, heads, head_size] -> [1, heads, tokens, head_size]: SDPA's fused CPU
        # kernel (the one HF's LlamaModel uses) needs 4-D inputs; 3-D falls back to the
        # slower, differently rounded math path.
        out = F.scaled_dot_product_attention(
            query[None, start:end].transpose(1, 2),
            keys[None].transpose(1, 2),
            values[None].transpose(1, 2),
            attn_mask=seq.mask,
            is_causal=seq.mask is None,
            scale=self.scale,
            enable_gqa=self.num_queries_per_kv > 1,
        )
        return out[0].transpose(0, 1)

    def _plan_step(
        self, metadata: AttentionMetadata, block_size: int, device: torch.device
    ) -> _StepPlan:
        if self._planned_for is metadata and self._plan is not None:
            return self._plan
        query_lens = metadata.query_lens_cpu
        seq_lens = metadata.seq_lens_cpu
        decode_seqs = [i for i, n in enumerate(query_lens) if n == 1]
        decode = None
        if decode_seqs:
            decode = self._plan_decode(metadata, decode_seqs, block_size, device)
        prefills = []
        start = 0
        for i, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
            if query_len > 1:
                prefills.append(
                    self._plan_prefill(metadata, i, start, query_len, seq_len, block_size, device)
                )
            start += query_len
        self._planned_for, self._plan = metadata, _StepPlan(decode, prefills)
        return self._plan

    @staticmethod
    def _plan_decode(
        metadata: AttentionMetadata,
        decode_seqs: list[int],
        block_size: int,
        device: torch.device,
    ) -> _DecodePlan:
        all_decode = len(decode_seqs) == metadata.num_seqs
        if all_decode:
            context = metadata.max_seq_len
            block_tables = metadata.block_tables
            seq_lens = metadata.seq_lens
            token_indices = None
        else:
            context = max(metadata.seq_lens_cpu[i] for i in decode_seqs)
            rows = torch.tensor(decode_seqs, dtype=torch.int64, device=device)
            block_tables = metadata.block_tables.index_select(0, rows)
            seq_lens = metadata.seq_lens.index_select(0, rows)
            # A decode sequence's query token sits at its query start.
            token_indices = metadata.query_start_loc.index_select(0, rows).long()
        num_context_blocks = -(-context // block_size)
        context_len = num_context_blocks * block_size
        in_context = torch.arange(context_len, device=device)[None, :] < seq_lens[:, None]
        mask = in_context[:, None, None, :]
        mask_bias = torch.zeros(mask.shape, dtype=torch.float32, device=device)
        mask_bias.masked_fill_(~mask, float("-inf"))
        return _DecodePlan(
            token_indices=token_indices,
            block_ids=block_tables[:, :num_context_blocks].flatten().long(),
            context_len=context_len,
            mask=mask,
            mask_bias=mask_bias,
        )

    @staticmethod
    def _plan_prefill(
        metadata: AttentionMetadata,
        seq: int,
        query_start: int,
        query_len: int,
        seq_len: int,
        block_size: int,
        device: torch.device,
    ) -> _PrefillSeq:
        cached = seq_len - query_len
        if cached == 0:
            return _PrefillSeq(query_start, query_start + query_len, seq_len, None, None)
        num_context_blocks = -(-seq_len // block_size)
        block_ids = metadata.block_tables[seq, :num_context_blocks].long()
        # Query j sits at position cached + j and sees keys 0 .. cached + j.
        query_positions = torch.arange(cached, seq_len, device=device)
        mask = torch.arange(seq_len, device=device)[None, :] <= query_positions[:, None]
        return _PrefillSeq(query_start, query_start + query_len, seq_len, block_ids, mask)
