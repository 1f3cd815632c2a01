"""KV cache groups: which layers share one block table, as vLLM's hybrid KV cache manager.

Owns the partition of a model's attention layers into groups by attention type (full, or a
sliding window of a given size), each layer's slot in the cache's layer axis, and the
decision whether an engine splits its cache into groups at all. It does not allocate blocks
(``kv_cache_manager`` / ``hybrid_kv_cache_manager``) or attend (``model/attention``).

Why groups: the cache is block-major (``kv_cache_layout``); with one group a block holds a
run of tokens for every layer, so a model whose layers alternate between a 128-token window
and the whole context (GPT-OSS) keeps every block for as long as the request lives, though
half its layers never read a token 128 positions back again. With groups, each group has a
block table of its own per request and its own rule: a full-attention group keeps every
block, a sliding group only the blocks inside the window of the next query (plus the one it
is in); the blocks wholly behind the window return to the pool (and stay prefix-cache hits
until evicted).

The decision: ONE shared block pool of equal-size pages, vLLM's choice, not a pool per
group sized by a fixed memory split. The cache is one tensor
``[num_blocks, layers_per_block, 2, kv_heads, block_size, head]`` whose layer axis has the
size of the largest group; layer ``l`` of group ``g`` uses the slot ``layer_slots[l]`` of
whichever blocks group ``g``'s tables name. Every block is one group's at a time. Why:

- no split to guess: how many blocks a sliding group needs depends on the mix of prompt
  lengths (a 100-token chat needs as many as the full group, a 100k-token document a
  thousandth); one pool lets each group take what its requests need now;
- one LRU and one free count: preemption, the admission watermark and the prefix cache's
  eviction order work unchanged across groups;
- equal pages: a block is a block, so P/D moves any group's with the same code: a request's
  logical block i is its pages ``[G * i, G * (i + 1))`` in ``get_transfer_block_ids``'s
  interleaved list, and every P/D block index counts pages (``RemoteKv.pages_per_block``).
  A prefill replica keeps a held request's every page (no release, no window-only hits:
  the whole prompt moves); the decode replica releases behind the window once it arrived.
  The KV layout's model name carries the groups (``layout_suffix``), so a peer that splits
  otherwise is refused by the fingerprint.

The price: groups of unequal sizes (say 5 sliding layers per full one) waste the unused
slots of the smaller group's pages; vLLM splits the larger type into several groups of
equal size instead. Tandem's multi-group models so far (GPT-OSS) alternate one to one, so
nothing is wasted; a model that would waste is still correct.

One group is today's cache exactly (every layer in every block, one table, the single
KV cache manager's rules, including all-sliding models that release behind their window),
and so are engines that cannot split yet (``why_not_split`` says which, and the log why):
a replica with KV tiers (a tier stores one block per block hash) and CUDA-graph capture
(the static decode inputs have one table; multi-type models are never captured).
Tensor-parallel workers get every group's tables in the step message and split alike.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from engine_common.config import EngineConfig
from engine_common.model.arch_config import ModelArchConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers of one attention type, sharing one block table per request."""

    layers: tuple[int, ...]  # the model's layer indices, ascending
    window: int | None  # the sliding window of these layers; None: the whole context


@dataclass(frozen=True)
class KVCacheGroups:
    """A model's layers partitioned into groups; ``groups[0]`` is the full-attention group
    when there is one (its table is the one the single-group code paths already carry)."""

    groups: tuple[KVCacheGroup, ...]

    @property
    def is_single(self) -> bool:
        return len(self.groups) == 1

    @property
    def layers_per_block(self) -> int:
        """The cache's layer axis: the largest group's size."""
        return max(len(group.layers) for group in self.groups)

    @property
    def num_layers(self) -> int:
        return sum(len(group.layers) for group in self.groups)

    def layer_slots(self) -> tuple[tuple[int, int], ...]:
        """Per model layer, (its group, its slot in the cache's layer axis)."""
        slots: dict[int, tuple[int, int]] = {}
        for g, group in enumerate(self.groups):
            for slot, layer in enumerate(group.layers):
                slots[layer] = (g, slot)
        return tuple(slots[layer] for layer in range(len(slots)))

    def layout_suffix(self) -> str:
        """What the KV layout's model name gains with several groups (nothing with one):
        ``+kv-groups:full/12,sliding128/12``."""
        if self.is_single:
            return ""
        return "+kv-groups:" + ",".join(
            f"{'full' if g.window is None else f'sliding{g.window}'}/{len(g.layers)}"
            for g in self.groups)

    def describe(self) -> str:
        """``full attention: 12 layers; sliding window 128: 12 layers`` (logs, summaries)."""
        return "; ".join(
            f"{'full attention' if g.window is None else f'sliding window {g.window}'}: "
            f"{len(g.layers)} layer{'s' if len(g.layers) != 1 else ''}" for g in self.groups)


def single_group(arch: ModelArchConfig) -> KVCacheGroups:
    """Every layer in one group: today's cache. Its window is set only when every layer
    slides (``arch.kv_window``: the blocks behind it may be released)."""
    return KVCacheGroups((KVCacheGroup(tuple(range(arch.num_layers)), arch.kv_window),))


def split_by_type(arch: ModelArchConfig) -> KVCacheGroups:
    """One group per distinct window: full attention first, then windows ascending."""
    by_window: dict[int | None, list[int]] = {}
    for layer in range(arch.num_layers):
        by_window.setdefault(arch.layer_window(layer), []).append(layer)
    order = sorted(by_window, key=lambda w: -1 if w is None else w)
    return KVCacheGroups(tuple(KVCacheGroup(tuple(by_window[w]), w) for w in order))


def why_not_split(config: EngineConfig) -> str | None:
    """Why this engine keeps one group for a model with several attention types, or None
    when it may split (see the module docstring)."""
    if config.kv_tiers.enabled:
        return "KV tiers store one block per block hash"
    return None


def kv_cache_groups(arch: ModelArchConfig, config: EngineConfig) -> KVCacheGroups:
    """The groups this engine's cache uses for ``arch``."""
    split = split_by_type(arch)
    if split.is_single:
        return single_group(arch)
    reason = why_not_split(config)
    if reason is not None:
        logger.info("KV cache: one group for every layer (%s), not %s: every block is kept "
                    "for the sliding-window layers too", reason, split.describe())
        return single_group(arch)
    return split
