"""The paged KV cache's memory layout: its shape, a layer's view of it, writing a step's K/V
into it, and gathering whole (block, KV head) rows out of it.

One tensor per engine, block-major and, within a layer, head-major:

    [num_blocks, num_layers, 2, num_kv_heads, block_size, head_size]

(index 0 of the ``2`` is K, 1 is V). Why this order:

- **block-major**: a block's K and V of every layer are one contiguous stretch of bytes, and
  so are those of a run of consecutive blocks. A KV transfer moves a run as one operation
  (not one per layer and K/V), a tier stores a block as one slice. vLLM's and LMCache's
  cross-layer layouts make the same choice.
- **head-major within a layer**: the ``block_size`` rows of one KV head of a block are
  contiguous. A decode kernel streams them (in the token-major order they were strided by
  ``num_kv_heads * head_size``), and gathering blocks gives SDPA's ``[heads, tokens, head]``
  directly. vLLM-CPU's cache is head-major per block too.

Layer ``i`` sees ``cache[:, i]``: ``[num_blocks, 2, num_kv_heads, block_size, head_size]``,
strided over blocks (a block's stride is the whole block's, every layer's); its K and V are
``[num_blocks, num_kv_heads, block_size, head_size]`` views (``key_value``), which every
attention backend reads through their strides. Token ``t`` of a request lives in block
``block_table[t // block_size]`` at offset ``t % block_size``; its flat slot
``block * block_size + offset`` is what ``slot_mapping`` holds.

Owns only the layout. It does not own allocation (the model runner), block bookkeeping (the
KV cache manager) or the transfer's description of it (``kv_transfer/layout.py``).
"""

from __future__ import annotations

import torch

from engine_common.model.attention.cpu_kv_write import load_kv_write


def kv_cache_shape(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                   head_size: int) -> tuple[int, int, int, int, int, int]:
    """The engine cache's shape (see the module docstring)."""
    return (num_blocks, num_layers, 2, num_kv_heads, block_size, head_size)


def layer_cache(kv_cache: torch.Tensor, layer: int) -> torch.Tensor:
    """Layer ``layer``'s ``[num_blocks, 2, num_kv_heads, block_size, head_size]`` view."""
    return kv_cache[:, layer]


def key_value(layer_kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's K and V caches, each ``[num_blocks, num_kv_heads, block_size, head_size]``."""
    return layer_kv[:, 0], layer_kv[:, 1]


def write_kv(layer_kv: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Stores token ``i``'s K and V (``[tokens, num_kv_heads, head_size]``) at flat slot
    ``slot_mapping[i]`` of the layer's cache, in place: a copy kernel on the CPU
    (``cpu_kv_write``), PyTorch indexing elsewhere or without it."""
    k_cache, v_cache = key_value(layer_kv)
    kernel = load_kv_write() if layer_kv.device.type == "cpu" else None
    if kernel is not None:
        kernel(k_cache, v_cache, key, value, slot_mapping)
    else:
        write_kv_indexed(k_cache, v_cache, key, value, slot_mapping)


def write_kv_indexed(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``write_kv`` by PyTorch ops, any device."""
    block_size = k_cache.shape[2]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping - blocks * block_size
    # Advanced indices on dims 0 and 2, split by the heads' slice: the indexed view is
    # [tokens, num_kv_heads, head_size], the shape of key and value.
    k_cache[blocks, :, offsets] = key
    v_cache[blocks, :, offsets] = value


def head_rows(cache: torch.Tensor) -> torch.Tensor:
    """K or V ``[num_blocks, num_kv_heads, block_size, head_size]`` as rows of
    ``block_size * head_size`` elements, one per (block, KV head): row
    ``block * rows_per_block(cache) + head``. A view of the cache's storage whose rows past
    the last head of a block are other layers' (never selected by ``row_ids``)."""
    num_blocks, num_kv_heads, block_size, head_size = cache.shape
    row = block_size * head_size
    if cache.stride()[1:] != (row, head_size, 1) or cache.stride(0) % row:
        raise ValueError(f"not a head-major KV cache view: strides {cache.stride()}")
    per_block = cache.stride(0) // row
    return cache.as_strided(((num_blocks - 1) * per_block + num_kv_heads, row), (row, 1))


def rows_per_block(cache: torch.Tensor) -> int:
    """The step between one block's rows and the next's in ``head_rows(cache)``."""
    return cache.stride(0) // cache.stride(1)


def row_ids(block_ids: torch.Tensor, num_kv_heads: int, per_block: int) -> torch.Tensor:
    """Rows of ``head_rows`` for every KV head of each of ``block_ids`` (``[..., n]``), in
    ``[..., num_kv_heads, n]`` order, flattened: gathered K is then
    ``[..., num_kv_heads, n * block_size, head_size]``, SDPA's layout."""
    heads = torch.arange(num_kv_heads, device=block_ids.device, dtype=torch.long)
    return (block_ids.long().unsqueeze(-2) * per_block + heads[:, None]).flatten()
