"""Paged attention for the CPU: a paged decode kernel, and PyTorch ops for the rest.

Owns writing a step's K/V into the paged cache and attending over it. It does not own the
cache tensor or the block tables.

Decode sequences (one query token) of a step are attended together. Where the CPU paged
kernel is available (``cpu_paged_kernel``: float32 or bf16 on the CPU, built with the system
compiler) it reads each sequence's K and V in place through its block table and writes
each query row's output directly. Otherwise (no compiler, another dtype or device, or
``use_paged_kernel=False``) the blocks are gathered from the block tables into one padded
batch (into a reused workspace, since fresh multi-megabyte buffers cost page faults every
layer) and padding is masked. With few KV heads, the scores of all query heads against all
KV heads come from one batched matmul and the matching (query head, KV head) pairs are
kept: ``num_kv_heads`` times the useful FLOPs, but one well-shaped GEMM per sequence beats
``batch * num_kv_heads`` tiny ones (or SDPA's per-head blocking) on CPU by 1.5-2x, and no
K/V is repeated. With many KV heads that waste grows, so those models use one SDPA call
with each KV head's query heads folded into the query length.

Sequences with several query tokens (prefill, chunked prefill, prefix-cache hits): in bf16
on the CPU, where the paged prefill kernel is built with avx512_bf16
(``cpu_prefill_kernel``), all of a step's are attended in one call, K/V read in place
through the block tables; otherwise (float32, whose SDPA path is bit-exact with Hugging
Face's; another device; no compiler; ``use_paged_kernel=False``) one at a time with SDPA and
a causal mask offset by the cached prefix.

On the gather path, padding positions read cache slots that no sequence of the step wrote;
the cache must hold finite values there (the model runner allocates it with zeros), since
a NaN times a zero attention weight is still NaN. The kernel reads only each sequence's
own context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine_common.model.attention.backend import AttentionBackend, AttentionMetadata
from engine_common.model.attention.cpu_paged_kernel import (
    PagedDecodeKernel,
    kernel_supports,
    load_paged_decode,
)
from engine_common.model.attention.cpu_prefill_kernel import (
    PagedPrefillKernel,
    load_paged_prefill,
    prefill_kernel_supports,
    workspace_bytes,
)
from engine_common.model.attention.kv_cache_layout import (
    head_rows,
    key_value,
    row_ids,
    rows_per_block,
    write_kv,
)

# Up to this many KV heads, decode computes scores against all KV heads in one matmul.
_MAX_KV_HEADS_FOR_DENSE_DECODE = 4


@dataclass(frozen=True)
class _Geometry:
    """What a plan needs of the cache: its block size and how its rows are numbered."""

    block_size: int
    num_kv_heads: int
    rows_per_block: int  # kv_cache_layout.rows_per_block of a layer's K (or V) cache

    def rows(self, block_ids: torch.Tensor) -> torch.Tensor:
        """``head_rows`` rows of every KV head of ``block_ids`` ([..., n]): [..., heads, n]."""
        return row_ids(block_ids, self.num_kv_heads, self.rows_per_block)


@dataclass
class _GatherPlan:
    """What the PyTorch-ops decode path needs: which rows to gather, and the mask."""

    # [num_decode * num_kv_heads * num_context_blocks] (block, KV head) rows
    # (``kv_cache_layout.head_rows``), decode row by decode row, head-major in each.
    block_ids: torch.Tensor
    # Padded context length: num_context_blocks * block_size.
    context_len: int
    # [num_decode, 1, 1, context_len] True where a key is in the sequence's context.
    mask: torch.Tensor
    # The same mask as float32 0 / -inf, added to the scores.
    mask_bias: torch.Tensor


@dataclass
class _DecodePlan:
    # [num_decode] token indices in the step's flat batch; None when every token decodes.
    token_indices: torch.Tensor | None
    # [num_decode] int32 indices of the decode sequences; None when every sequence decodes.
    seqs: torch.Tensor | None
    # Only when the paged kernel does not run.
    gather: _GatherPlan | None


@dataclass
class _PrefillSeq:
    query_start: int
    query_end: int
    seq_len: int
    # [num_kv_heads * num_context_blocks] int64 (block, KV head) rows, head-major; None when
    # the whole context is in this step.
    block_ids: torch.Tensor | None
    # [query_len, seq_len] causal mask offset by the cached prefix; None when no prefix, or
    # when the queries are padded instead (``padded_queries``).
    mask: torch.Tensor | None
    # Zero query rows put before this step's queries so that a plain causal pass lines them
    # up with their positions (the cached prefix's length), or 0.
    padded_queries: int = 0


@dataclass
class _KernelPrefill:
    """What the paged prefill kernel needs: which sequences, and its workspace's size."""

    seqs: torch.Tensor  # [n] int32 indices of the step's prefill sequences
    workspace_bytes: int


@dataclass
class _StepPlan:
    decode: _DecodePlan | None
    prefills: list[_PrefillSeq]  # for SDPA, when the prefill kernel does not run
    kernel_prefill: _KernelPrefill | None = None


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, scale: float,
                 use_paged_kernel: bool = True):
        super().__init__(num_heads, num_kv_heads, head_size, scale)
        self.num_queries_per_kv = num_heads // num_kv_heads
        self.dense_decode = num_kv_heads <= _MAX_KV_HEADS_FOR_DENSE_DECODE
        self.use_paged_kernel = use_paged_kernel
        # Every layer of a step shares one plan (one per KV cache group's metadata), rebuilt
        # when a new step's metadata arrives (never mutated once the forward pass starts).
        self._planned_for: AttentionMetadata | None = None
        self._plans: dict[int, _StepPlan] = {}  # by id() of a metadata of that step
        # The last metadata asked for and its plan: one group's steps stop here, as before.
        self._last: tuple[AttentionMetadata, _StepPlan] | None = None
        # Reused buffers for gathered K and V (layers run one after another), and for the
        # prefill kernel's packed K and V.
        self._gather_workspace: torch.Tensor | None = None
        self._prefill_workspace: torch.Tensor | None = None

    def paged_kernel(self, dtype: torch.dtype, device: torch.device) -> PagedDecodeKernel | None:
        """The paged decode kernel for this dtype and device, if it runs here."""
        if not (self.use_paged_kernel and kernel_supports(dtype, device)):
            return None
        return load_paged_decode()

    def prefill_kernel(self, dtype: torch.dtype, device: torch.device
                       ) -> PagedPrefillKernel | None:
        """The paged prefill kernel where it runs here: bf16 only (float32 keeps SDPA, bit-exact
        with Hugging Face), and only its avx512_bf16 build (the scalar one is slower than SDPA)."""
        if not (self.use_paged_kernel
                and prefill_kernel_supports(dtype, device, self.head_size)):
            return None
        kernel = load_paged_prefill()
        return kernel if kernel is not None and kernel.vectorized else None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        write_kv(kv_cache, key, value, metadata.slot_mapping)
        k_cache, v_cache = key_value(kv_cache)
        geometry = _Geometry(kv_cache.shape[3], self.num_kv_heads, rows_per_block(k_cache))

        kernel = self.paged_kernel(kv_cache.dtype, kv_cache.device)
        prefill_kernel = self.prefill_kernel(kv_cache.dtype, kv_cache.device)
        plan = self._plan_step(metadata, geometry, query.device, kernel is None,
                               prefill_kernel is not None)
        decode = plan.decode
        if kernel is None and decode is not None and decode.token_indices is None:
            return self._decode(query, k_cache, v_cache, decode)  # every row decodes
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if decode is not None and kernel is not None:
            # The kernel writes each decode row of the step's flat batch in place.
            num_decode = metadata.num_seqs if decode.seqs is None else len(decode.seqs)
            kernel(query, k_cache, v_cache, metadata.block_tables, metadata.seq_lens,
                   None if decode.seqs is None else metadata.query_start_loc, decode.seqs,
                   num_decode, out, self.scale)
        elif decode is not None:
            indices = decode.token_indices
            out[indices] = self._decode(query[indices], k_cache, v_cache, decode)
        if plan.kernel_prefill is not None and prefill_kernel is not None:
            prefill_kernel(query, k_cache, v_cache, metadata.block_tables, metadata.seq_lens,
                           metadata.query_start_loc, plan.kernel_prefill.seqs, out,
                           self.scale, self._prefill_buffer(plan.kernel_prefill))
        for seq in plan.prefills:
            out[seq.query_start : seq.query_end] = self._prefill(
                query, key, value, k_cache, v_cache, seq
            )
        return out

    def _prefill_buffer(self, plan: _KernelPrefill) -> torch.Tensor:
        """The prefill kernel's workspace, grown when a step needs more (layers share it)."""
        workspace = self._prefill_workspace
        if workspace is None or workspace.numel() < plan.workspace_bytes:
            workspace = torch.empty(plan.workspace_bytes, dtype=torch.uint8)
            self._prefill_workspace = workspace
        return workspace

    def _decode(
        self,
        query: torch.Tensor,  # [batch, num_heads, head_size]
        k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
        v_cache: torch.Tensor,
        decode: _DecodePlan,
    ) -> torch.Tensor:
        """Decode attention from a gathered, padded copy of the context (no kernel)."""
        plan = decode.gather
        assert plan is not None
        batch, context = query.shape[0], plan.context_len
        keys, values = self._gather(k_cache, v_cache, plan.block_ids)
        kv_heads, group, head_size = self.num_kv_heads, self.num_queries_per_kv, self.head_size
        if not self.dense_decode:
            # Gathered head-major, [batch, kv_heads, context, head]; the query heads of one
            # KV head (h = kv * group + g, HF's repeat_kv order) become SDPA's query length,
            # so K/V are not repeated.
            shape = (batch, kv_heads, context, head_size)
            out = F.scaled_dot_product_attention(
                query.view(batch, kv_heads, group, head_size),
                keys.view(shape),
                values.view(shape),
                attn_mask=plan.mask,
                scale=self.scale,
            )
            # NOTE: reshape, not view: on CUDA, SDPA's fused kernels may return a layout whose
            # (kv_heads, group) dimensions cannot be merged in place.
            return out.reshape(batch, self.num_heads, head_size)
        keys = keys.view(batch, kv_heads * context, head_size)
        values = values.view(batch, kv_heads * context, head_size)
        # [batch, heads, kv_heads * context]: every query head against every KV head; keep
        # the pairs where the query head's KV head is the key's KV head.
        all_pairs = torch.bmm(query, keys.transpose(1, 2))
        all_pairs = all_pairs.view(batch, kv_heads, group, kv_heads, context)
        scores = all_pairs.diagonal(dim1=1, dim2=3)  # [batch, group, context, kv_heads]
        scores = scores.permute(0, 3, 1, 2)  # [batch, kv_heads, group, context]
        probs = torch.softmax(scores.float() * self.scale + plan.mask_bias, dim=-1)
        # Back to the all-pairs layout with zero weight on the other KV heads' values.
        weights = torch.zeros_like(all_pairs)
        weights.diagonal(dim1=1, dim2=3).copy_(probs.permute(0, 2, 3, 1))
        out = torch.bmm(weights.view(batch, self.num_heads, kv_heads * context), values)
        return out

    def _gather(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given (block, KV head) rows (``row_ids``), [len(block_ids),
        block_size * head_size]."""
        row = k_cache.shape[2] * k_cache.shape[3]
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
        torch.index_select(head_rows(k_cache), 0, block_ids, out=keys)
        torch.index_select(head_rows(v_cache), 0, block_ids, out=values)
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
            keys = key[start:end].transpose(0, 1)
            values = value[start:end].transpose(0, 1)
        else:
            # One gather of (block, KV head) rows gives [kv_heads, tokens, head_size].
            shape = (self.num_kv_heads, -1, self.head_size)
            keys = head_rows(k_cache).index_select(0, seq.block_ids).view(shape)[:, : seq.seq_len]
            values = head_rows(v_cache).index_select(0, seq.block_ids).view(shape)
            values = values[:, : seq.seq_len]
        queries = query[start:end]
        if seq.padded_queries:
            queries = torch.cat([queries.new_zeros((seq.padded_queries, *queries.shape[1:])),
                                 queries])
        # -> [1, heads, tokens, head_size]: SDPA's fused CPU kernel (the one HF's LlamaModel
        # uses) needs 4-D inputs; 3-D falls back to the slower, differently rounded math path.
        out = F.scaled_dot_product_attention(
            queries[None].transpose(1, 2),
            keys[None],
            values[None],
            attn_mask=seq.mask,
            is_causal=seq.mask is None,
            scale=self.scale,
            enable_gqa=self.num_queries_per_kv > 1,
        )
        return out[0, :, seq.padded_queries:].transpose(0, 1)

    def _plan_step(
        self, metadata: AttentionMetadata, geometry: _Geometry, device: torch.device,
        gather: bool, prefill_kernel: bool
    ) -> _StepPlan:
        last = self._last
        if last is not None and last[0] is metadata:
            return last[1]
        if self._planned_for is not metadata.step_metadata:
            self._planned_for, self._plans = metadata.step_metadata, {}
        plan = self._plans.get(id(metadata))
        if plan is not None:
            self._last = (metadata, plan)
            return plan
        query_lens = metadata.query_lens_cpu
        seq_lens = metadata.seq_lens_cpu
        decode_seqs = [i for i, n in enumerate(query_lens) if n == 1]
        decode = None
        if decode_seqs:
            decode = self._plan_decode(metadata, decode_seqs, geometry, device, gather)
        prefills = []
        kernel_prefill = None
        if prefill_kernel:
            seqs = [i for i, n in enumerate(query_lens) if n > 1]
            if seqs:
                kernel_prefill = _KernelPrefill(
                    torch.tensor(seqs, dtype=torch.int32, device=device),
                    workspace_bytes([seq_lens[i] for i in seqs], self.num_kv_heads,
                                    self.head_size))
        else:
            start = 0
            for i, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
                if query_len > 1:
                    prefills.append(self._plan_prefill(metadata, i, start, query_len, seq_len,
                                                       geometry, device))
                start += query_len
        plan = self._plans[id(metadata)] = _StepPlan(decode, prefills, kernel_prefill)
        self._last = (metadata, plan)
        return plan

    @staticmethod
    def _plan_decode(
        metadata: AttentionMetadata,
        decode_seqs: list[int],
        geometry: _Geometry,
        device: torch.device,
        gather: bool,
    ) -> _DecodePlan:
        if len(decode_seqs) == metadata.num_seqs:
            plan = _DecodePlan(token_indices=None, seqs=None, gather=None)
            if gather:
                plan.gather = _plan_gather(metadata.block_tables, metadata.seq_lens,
                                           metadata.max_seq_len, geometry, device)
            return plan
        seqs = torch.tensor(decode_seqs, dtype=torch.int32, device=device)
        # A decode sequence's query token sits at its query start.
        plan = _DecodePlan(token_indices=metadata.query_start_loc[seqs.long()].long(),
                           seqs=seqs, gather=None)
        if gather:
            rows = seqs.long()
            plan.gather = _plan_gather(
                metadata.block_tables.index_select(0, rows),
                metadata.seq_lens.index_select(0, rows),
                max(metadata.seq_lens_cpu[i] for i in decode_seqs), geometry, device)
        return plan

    @staticmethod
    def _plan_prefill(
        metadata: AttentionMetadata,
        seq: int,
        query_start: int,
        query_len: int,
        seq_len: int,
        geometry: _Geometry,
        device: torch.device,
    ) -> _PrefillSeq:
        cached = seq_len - query_len
        if cached == 0:
            return _PrefillSeq(query_start, query_start + query_len, seq_len, None, None)
        num_context_blocks = -(-seq_len // geometry.block_size)
        block_ids = geometry.rows(metadata.block_tables[seq, :num_context_blocks])
        if cached <= query_len:
            # NOTE: with an explicit mask SDPA's CPU flash kernel computes every (query, key)
            # block and then masks, about twice a causal pass: a 1,664-token prompt with 128
            # tokens cached cost 5.45 CPU-s against 4.13 with none cached. Zero queries for
            # the cached positions make it a causal pass over the whole sequence (each real
            # row computed as a full prompt's would be), at cached^2/2 wasted products:
            # cheaper than the mask while the cached part is at most this step's.
            return _PrefillSeq(query_start, query_start + query_len, seq_len, block_ids, None,
                               padded_queries=cached)
        # Query j sits at position cached + j and sees keys 0 .. cached + j.
        query_positions = torch.arange(cached, seq_len, device=device)
        mask = torch.arange(seq_len, device=device)[None, :] <= query_positions[:, None]
        return _PrefillSeq(query_start, query_start + query_len, seq_len, block_ids, mask)


def _plan_gather(block_tables: torch.Tensor, seq_lens: torch.Tensor, context: int,
                 geometry: _Geometry, device: torch.device) -> _GatherPlan:
    """The rows to gather for decode rows with these block tables, and their mask."""
    num_context_blocks = -(-context // geometry.block_size)
    context_len = num_context_blocks * geometry.block_size
    in_context = torch.arange(context_len, device=device)[None, :] < seq_lens[:, None]
    mask = in_context[:, None, None, :]
    mask_bias = torch.zeros(mask.shape, dtype=torch.float32, device=device)
    mask_bias.masked_fill_(~mask, float("-inf"))
    return _GatherPlan(
        block_ids=geometry.rows(block_tables[:, :num_context_blocks]),
        context_len=context_len,
        mask=mask,
        mask_bias=mask_bias,
    )
