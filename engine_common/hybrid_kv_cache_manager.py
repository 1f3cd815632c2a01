"""Which KV blocks each request holds when the cache has several KV cache groups.

Owns, for the groups after the first (``kv_cache_groups``), each request's table, how many of
its blocks are registered in the prefix cache and how many leading ones were released, and
the rule that combines the groups' prefix hits; the first group is ``KVCacheManager``'s own
bookkeeping, unchanged. Like the base class it does not decide scheduling or own blocks.

All groups share one ``BlockPool`` (see ``kv_cache_groups`` for why): a request needs, for a
step, room for every group's new blocks at once, or it gets none. Per group:

- a full-attention group keeps every block, as the single-group manager does;
- a sliding group of window W releases the blocks wholly behind the window of the step's
  first query (a query at p sees (p - W, p]) back to the pool, where a registered one stays
  a prefix-cache hit until evicted; the table keeps the placeholder block there. During a
  step it holds at most ceil((W - 1) / block_size) + 1 blocks before the step's own.

Prefix cache: every group uses the same block-hash chain; a group's block is registered
under ``group_block_key(hash, group)`` (only group 0's keys reach KV events, so a router
sees the full-attention group's hashes). A hit needs, at the hit point p (a block
boundary), every block before p in a full-attention group, but in a sliding group only the
ceil((W - 1) / block_size) blocks before p (vLLM's ``SlidingWindowManager``
``find_longest_cache_hit``): the query at p needs nothing older. The request's hit is the
longest p every group accepts (shortest over groups, repeated until stable).

P/D (``kv_cache_groups``): a request's KV moves as pages interleaved by group
(``get_transfer_block_ids``). A request whose KV a decode replica will pull (``hold_kv``)
releases nothing and takes only whole hits in every group: each of its pages moves, and a
placeholder would move another request's KV under this one's hashes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine_common.block_hash import BlockHash, group_block_key
from engine_common.block_pool import KVCacheBlock
from engine_common.kv_cache_groups import KVCacheGroups
from engine_common.kv_cache_manager import KVCacheManager
from engine_common.request import Request


class GroupedHit(list[KVCacheBlock]):
    """A prefix hit: group 0's blocks (the list) and each later group's (``extra``,
    placeholders where a sliding group needs nothing), all of the same length."""

    def __init__(self, first: list[KVCacheBlock], extra: list[list[KVCacheBlock]]) -> None:
        super().__init__(first)
        self.extra = extra


@dataclass
class _GroupTables:
    """One group's (after the first) per-request bookkeeping."""

    group: int
    window: int | None
    blocks: dict[str, list[KVCacheBlock]] = field(default_factory=dict)
    block_ids: dict[str, list[int]] = field(default_factory=dict)
    num_cached: dict[str, int] = field(default_factory=dict)
    num_released: dict[str, int] = field(default_factory=dict)


class _GroupKeys(Sequence[BlockHash]):
    """A request's block hashes as one group's prefix-cache keys (computed when read)."""

    def __init__(self, hashes: Sequence[BlockHash], group: int) -> None:
        self._hashes, self._group = hashes, group

    def __len__(self) -> int:
        return len(self._hashes)

    def __getitem__(self, index):  # type: ignore[no-untyped-def, override]
        if isinstance(index, slice):
            return [group_block_key(h, self._group) for h in self._hashes[index]]
        return group_block_key(self._hashes[index], self._group)


class HybridKVCacheManager(KVCacheManager):
    def __init__(
        self,
        groups: KVCacheGroups,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = True,
        enable_kv_events: bool = True,
    ) -> None:
        if groups.is_single:
            raise ValueError("one KV cache group: use KVCacheManager")
        super().__init__(num_blocks, block_size, max_model_len, enable_caching,
                         enable_kv_events, sliding_window=groups.groups[0].window)
        self.groups = groups
        self.pages_per_block = len(groups.groups)
        self._extra = [_GroupTables(g, group.window)
                       for g, group in enumerate(groups.groups) if g > 0]

    # ------------------------------------------------------------------ prefix hits
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest prefix every group holds (see the module docstring)."""
        first, _ = super().get_computed_blocks(request)
        num_hit = len(first)
        extra: list[list[KVCacheBlock]] = []
        # KV a decode replica will pull moves whole: no placeholder may stand in a block.
        whole = request.hold_kv
        while num_hit > 0:
            extra = [self._group_hit(t, request.block_hashes, num_hit, whole)
                     for t in self._extra]
            shortest = min(len(hit) for hit in extra)
            if shortest == num_hit:
                break
            num_hit = shortest
        if num_hit == 0:
            return GroupedHit([], [[] for _ in self._extra]), 0
        return GroupedHit(first[:num_hit], extra), num_hit * self.block_size

    def _group_hit(self, tables: _GroupTables, hashes: Sequence[BlockHash],
                   max_blocks: int, whole: bool = False) -> list[KVCacheBlock]:
        """The group's longest hit of at most ``max_blocks`` blocks (``whole``: every block
        of it, whatever the group's window)."""
        get = self.block_pool.get_cached_block
        if tables.window is None or whole:
            hit: list[KVCacheBlock] = []
            for block_hash in hashes[:max_blocks]:
                block = get(group_block_key(block_hash, tables.group))
                if block is None:
                    break
                hit.append(block)
            return hit
        needed = -(-(tables.window - 1) // self.block_size)
        found: list[KVCacheBlock] = []  # the run ending at the candidate hit point, reversed
        for i in range(max_blocks - 1, -1, -1):
            if len(found) >= needed:
                break
            block = get(group_block_key(hashes[i], tables.group))
            if block is None:
                found = []
                max_blocks = i  # a hit can end at i at the latest now
            else:
                found.append(block)
        # Either a full window's run ending at max_blocks, or a run from block 0 on.
        return [self._placeholder] * (max_blocks - len(found)) + found[::-1]

    # ------------------------------------------------------------------ allocation
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_new_computed_tokens: int = 0,
        num_reserved_blocks: int = 0,
        delay_caching: bool = False,
    ) -> list[KVCacheBlock] | None:
        """The base class's contract, for every group: room for all of them, or None.

        The later groups' hits are taken first: the first group's new blocks, taken from
        the free queue by the base class, must not evict them."""
        if new_computed_blocks and not isinstance(new_computed_blocks, GroupedHit):
            raise ValueError("prefix hits of a multi-group cache come from get_computed_blocks")
        hits = (new_computed_blocks.extra if isinstance(new_computed_blocks, GroupedHit)
                else [[] for _ in self._extra])
        request_id = request.request_id
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_required = -(-(num_computed + num_new_tokens) // self.block_size)
        first_held = len(self.req_to_blocks.get(request_id, ()))
        needed = max(0, num_required - first_held - len(new_computed_blocks)) + sum(
            1 for block in new_computed_blocks if block.ref_cnt == 0)
        extra_new = 0
        held_hits: list[list[KVCacheBlock]] = []
        for tables, hit in zip(self._extra, hits, strict=True):
            held_hits.append([block for block in hit if block is not self._placeholder])
            group_new = max(0, num_required - len(tables.blocks.get(request_id, ())) - len(hit))
            extra_new += group_new
            needed += group_new + sum(1 for block in held_hits[-1] if block.ref_cnt == 0)
        if needed > self.block_pool.get_num_free_blocks() - num_reserved_blocks:
            return None
        for held in held_hits:
            self.block_pool.touch(held)
        new_blocks = super().allocate_slots(
            request, num_new_tokens, new_computed_blocks, num_new_computed_tokens,
            num_reserved_blocks + extra_new, delay_caching)
        assert new_blocks is not None, "room was checked for every group"
        for tables, hit in zip(self._extra, hits, strict=True):
            self._grow(tables, request, hit, num_required)
            if not delay_caching:
                self._cache_group(tables, request, num_computed + num_new_tokens)
            if tables.window is not None and not (request.hold_kv or request.announce_kv):
                self._release_group(tables, request_id, num_computed)
        return new_blocks

    def _grow(self, tables: _GroupTables, request: Request, hit: list[KVCacheBlock],
              num_required: int) -> None:
        request_id = request.request_id
        blocks = tables.blocks.get(request_id)
        if blocks is None:
            blocks = tables.blocks[request_id] = []
            tables.block_ids[request_id] = []
            tables.num_cached[request_id] = 0
        block_ids = tables.block_ids[request_id]
        if hit:  # taken (touched) by allocate_slots already
            held = [block for block in hit if block is not self._placeholder]
            blocks.extend(hit)
            block_ids.extend(block.block_id for block in hit)
            tables.num_cached[request_id] = len(blocks)
            tables.num_released[request_id] = len(hit) - len(held)
        if num_required > len(blocks):
            new_blocks = self.block_pool.get_new_blocks(num_required - len(blocks))
            blocks.extend(new_blocks)
            block_ids.extend(block.block_id for block in new_blocks)

    def _release_group(self, tables: _GroupTables, request_id: str, first_query: int) -> None:
        assert tables.window is not None
        self._release_behind(request_id, first_query, tables.window, tables.blocks[request_id],
                             tables.block_ids[request_id], tables.num_cached, tables.num_released)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        super().cache_blocks(request, num_computed_tokens)
        for tables in self._extra:
            self._cache_group(tables, request, num_computed_tokens)

    def _cache_group(self, tables: _GroupTables, request: Request,
                     num_computed_tokens: int) -> None:
        if not self.enable_caching:
            return
        request_id = request.request_id
        num_cached = tables.num_cached.get(request_id)
        if num_cached is None:
            return
        blocks = tables.blocks[request_id]
        num_full = min(min(num_computed_tokens, request.num_tokens) // self.block_size,
                       len(blocks))
        if num_full > num_cached:
            self.block_pool.cache_full_blocks(
                blocks, _GroupKeys(request.block_hashes, tables.group), num_cached, num_full,
                request.all_token_ids, self.block_size, record_events=False)
            tables.num_cached[request_id] = num_full

    # ------------------------------------------------------------------ freeing, reading
    def free(self, request: Request) -> None:
        super().free(request)
        request_id = request.request_id
        for tables in self._extra:
            blocks = tables.blocks.pop(request_id, None)
            tables.block_ids.pop(request_id, None)
            tables.num_cached.pop(request_id, None)
            num_released = tables.num_released.pop(request_id, 0)
            if blocks:
                self.block_pool.free_blocks(reversed(blocks[num_released:]))

    def num_held_blocks(self, request_id: str) -> int:
        return sum(self.held_blocks_per_group(request_id))

    def held_blocks_per_group(self, request_id: str) -> list[int]:
        """Blocks the request holds in the pool, per group (released ones excluded)."""
        return [super().num_held_blocks(request_id)] + [
            len(t.blocks.get(request_id, ())) - t.num_released.get(request_id, 0)
            for t in self._extra]

    def get_extra_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple(list(t.block_ids.get(request_id, ())) for t in self._extra)

    def get_transfer_block_ids(self, request_id: str, first: int = 0,
                               last: int | None = None) -> list[int]:
        """Interleaved: logical block i is pages ``[G * i, G * (i + 1))``, one per group in
        group order. A page is the same size in every group, so P/D moves them as blocks;
        both sides split alike (the layout's fingerprint covers the groups)."""
        tables = [self.req_to_block_ids.get(request_id, [])[first:last]] + [
            t.block_ids.get(request_id, [])[first:last] for t in self._extra]
        return [block_id for blocks in zip(*tables, strict=True) for block_id in blocks]
