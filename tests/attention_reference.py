"""Decode-attention test inputs over a paged cache, and their float64 reference output.

Owns building a random decode step (shuffled block tables, strided query rows as the model
passes them), the reference it must produce and how far from it a float32-accumulating
kernel may be; the tests that use them own the checks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_common.model.attention.backend import AttentionMetadata
from engine_common.model.attention.kv_cache_layout import key_value, kv_cache_shape, layer_cache

# The step's layer sits among others, so its cache is strided over blocks as the engine's.
_LAYERS, _LAYER = 3, 1


@dataclass
class DecodeStep:
    query: torch.Tensor  # [n, num_heads, head_size], a strided view like the model's
    layer_kv: torch.Tensor  # [num_blocks, 2, num_kv_heads, block_size, head_size], a layer's
    k_cache: torch.Tensor  # [num_blocks, num_kv_heads, block_size, head_size], its K
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [n, width] int32, zero-padded
    seq_lens: torch.Tensor  # [n] int32
    tables: list[list[int]]


def random_decode_step(num_heads: int, num_kv_heads: int, head_size: int, block_size: int,
                       seq_lens: list[int], dtype: torch.dtype, seed: int) -> DecodeStep:
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[order.pop() for _ in range(n)] for n in needed]
    block_tables = torch.zeros(len(seq_lens), max(needed), dtype=torch.int32)
    for i, table in enumerate(tables):
        block_tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
    shape = kv_cache_shape(_LAYERS, num_blocks, block_size, num_kv_heads, head_size)
    layer_kv = layer_cache(torch.randn(shape, generator=gen).to(dtype), _LAYER)
    k_cache, v_cache = key_value(layer_kv)
    # Rows of a fused q/k/v projection: the query heads are a strided view of them.
    width = (num_heads + 2 * num_kv_heads) * head_size
    qkv = (3 * torch.randn(len(seq_lens), width, generator=gen)).to(dtype)
    query = qkv[:, : num_heads * head_size].view(len(seq_lens), num_heads, head_size)
    return DecodeStep(query, layer_kv, k_cache, v_cache, block_tables,
                      torch.tensor(seq_lens, dtype=torch.int32), tables)


def decode_reference(step: DecodeStep, scale: float) -> torch.Tensor:
    """[n, num_heads, head_size] float64: each query row against its whole context."""
    outs = []
    for i in range(len(step.tables)):
        k, v = _context(step, i)
        q = step.query[i].double().view(k.shape[1], -1, k.shape[2])  # [kv_heads, group, hs]
        weights = torch.einsum("hgd,thd->hgt", q, k) * scale
        outs.append(torch.einsum("hgt,thd->hgd", weights.softmax(-1), v).flatten(0, 1))
    return torch.stack(outs)


def _context(step: DecodeStep, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence i's K and V, [tokens, num_kv_heads, head_size] float64."""
    n, table = int(step.seq_lens[i]), step.tables[i]
    # [blocks, heads, block_size, head] -> [tokens, heads, head]
    k = step.k_cache[table].transpose(1, 2).flatten(0, 1)[:n].double()
    v = step.v_cache[table].transpose(1, 2).flatten(0, 1)[:n].double()
    return k, v


def decode_error_bound(step: DecodeStep, reference: torch.Tensor) -> torch.Tensor:
    """[n, num_heads, head_size]: how far a kernel that accumulates in float32 and rounds the
    softmax weights and its outputs to the cache's dtype may be from ``reference``
    (``decode_reference``'s).

    To first order, with u the dtype's unit roundoff (2^-24 in float32, 2^-8 in bf16) and
    |v|max a head's largest value over its context: rounding each weight and the output to
    the dtype moves the output by at most u * (|out| + |v|max); float32 sums (head_size
    products per score, a term per token in the softmax's and the values' sums) add rounding
    errors that grow like the square root of their terms (Higham's probabilistic bound),
    taken 4 times over: 4 * sqrt(head_size + tokens) * u32 * (|out| + |v|max)."""
    u = torch.finfo(step.k_cache.dtype).eps / 2
    u32 = torch.finfo(torch.float32).eps / 2
    num_heads, head_size = step.query.shape[1:]
    bounds = []
    for i in range(len(step.tables)):
        _, v = _context(step, i)
        group = num_heads // v.shape[1]
        v_max = v.abs().amax(dim=(0, 2)).repeat_interleave(group)[:, None]  # [heads, 1]
        relative = u + 4 * (head_size + v.shape[0]) ** 0.5 * u32
        bounds.append(relative * (reference[i].abs() + v_max))
    return torch.stack(bounds)


def decode_metadata(step: DecodeStep, block_size: int) -> AttentionMetadata:
    """A pure-decode step's metadata: each sequence's last token is this step's."""
    seq_lens = step.seq_lens.tolist()
    slots = [table[(n - 1) // block_size] * block_size + (n - 1) % block_size
             for table, n in zip(step.tables, seq_lens, strict=True)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.arange(len(seq_lens) + 1, dtype=torch.int32),
        seq_lens=step.seq_lens,
        block_tables=step.block_tables,
        max_query_len=1,
        max_seq_len=max(seq_lens),
        query_lens_cpu=[1] * len(seq_lens),
        seq_lens_cpu=seq_lens,
    )
