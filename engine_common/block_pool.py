"""The pool of physical KV-cache blocks: ref counts, the free queue (the LRU) and the
hash -> block map that is the prefix cache.

Owns every ``KVCacheBlock``, which of them are free, which carry a cached content hash, and
the KV events those changes produce. It does not own which request holds which blocks, nor
the decision how many blocks a request needs (``kv_cache_manager``).

Invariants (checked by the property tests):
  * a block is in the free queue exactly when its ref_cnt is 0;
  * a block with a hash is the value of that hash in ``cached_block_hash_to_block``, and the
    map holds no other block, so every cached hash has exactly one BlockStored event before
    its one BlockRemoved event;
  * a freed block keeps its hash (it stays a prefix-cache hit) until it is handed out again
    by ``get_new_blocks``: eviction is lazy and in LRU order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from engine_common.block_hash import BlockHash, is_group_key
from engine_common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class KVCacheBlock:
    """One physical block: its id, how many requests hold it, its cached content hash."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set once the block is full and registered in the prefix cache; cleared on eviction.
        self.block_hash: BlockHash | None = None
        # Links of the free queue; both None when the block is not in it.
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks, least recently freed at the front.

    A hand-made list (not a deque) because a prefix hit must take a block out of the middle
    in O(1). Two sentinel blocks remove the empty-list special cases.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.fake_head = KVCacheBlock(-1)
        self.fake_tail = KVCacheBlock(-1)
        prev = self.fake_head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        block = self.fake_head.next_free_block
        if block is self.fake_tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} free")
        out: list[KVCacheBlock] = []
        block = self.fake_head.next_free_block
        for _ in range(n):
            assert block is not None
            out.append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        assert block is not None
        self.fake_head.next_free_block = block
        block.prev_free_block = self.fake_head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self.fake_tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = block
        self.num_free_blocks += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        first = self.fake_head.next_free_block
        assert first is not None
        first.prev_free_block = block
        block.next_free_block = first
        block.prev_free_block = self.fake_head
        self.fake_head.next_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Front (next to be reused) to back. O(n): for tests and debugging."""
        out = []
        block = self.fake_head.next_free_block
        while block is not None and block is not self.fake_tail:
            out.append(block)
            block = block.next_free_block
        return out


class BlockPool:
    """All KV blocks of one engine, handed out and taken back by the KV cache manager."""

    def __init__(
        self, num_blocks: int, enable_caching: bool = True, enable_kv_events: bool = False
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_kv_events = enable_kv_events
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self._events: list[KVEvent] = []

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_cached_block_hashes(self) -> list[BlockHash]:
        """Every hash in the prefix cache, each once (a snapshot for KV-event watchers): the
        state that the events recorded so far, taken or not, lead to. Keys of KV cache
        groups other than the first are not chain hashes and are left out."""
        return [key for key in self.cached_block_hash_to_block if not is_group_key(key)]

    def cache_full_blocks(
        self,
        request_blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        token_ids: Sequence[int],
        block_size: int,
        record_events: bool = True,
    ) -> None:
        """Register ``request_blocks[num_cached_blocks:num_full_blocks]`` in the prefix cache.

        ``block_hashes[i]`` is the hash of the request's i-th block; ``token_ids`` are the
        request's tokens. A block whose hash is already cached by another block (two requests
        that computed the same content at once) stays unregistered: the cache keeps one
        block per hash and the duplicate is simply reused when freed. ``record_events``
        False: a KV cache group's keys other than the first's (``group_block_key``), which
        no watcher knows.
        """
        if not self.enable_caching or num_cached_blocks >= num_full_blocks:
            return
        if not record_events:
            self._register_silently(request_blocks, block_hashes, num_cached_blocks,
                                    num_full_blocks)
            return
        hash_to_block = self.cached_block_hash_to_block
        run_start = -1  # first block index of the current run of newly cached blocks
        for i in range(num_cached_blocks, num_full_blocks):
            block = request_blocks[i]
            block_hash = block_hashes[i]
            registered = False
            if block.block_hash is None:
                if block_hash not in hash_to_block:
                    block.block_hash = block_hash
                    hash_to_block[block_hash] = block
                    registered = True
            elif block.block_hash != block_hash:
                raise RuntimeError(f"{block} at position {i} already holds another hash")
            if registered:
                if run_start < 0:
                    run_start = i
            elif run_start >= 0:
                self._record_stored(block_hashes, run_start, i, token_ids, block_size)
                run_start = -1
        if run_start >= 0:
            self._record_stored(block_hashes, run_start, num_full_blocks, token_ids, block_size)

    def _register_silently(self, request_blocks: Sequence[KVCacheBlock],
                           keys: Sequence[BlockHash], start: int, end: int) -> None:
        hash_to_block = self.cached_block_hash_to_block
        for i in range(start, end):
            block, key = request_blocks[i], keys[i]
            if block.block_hash is None:
                if key not in hash_to_block:
                    block.block_hash = key
                    hash_to_block[key] = block
            elif block.block_hash != key:
                raise RuntimeError(f"{block} at position {i} already holds another hash")

    def _record_stored(
        self,
        block_hashes: Sequence[BlockHash],
        start: int,
        end: int,
        token_ids: Sequence[int],
        block_size: int,
    ) -> None:
        if not self.enable_kv_events:
            return
        self._events.append(
            BlockStored(
                block_hashes=list(block_hashes[start:end]),
                parent_block_hash=block_hashes[start - 1] if start > 0 else None,
                token_ids=list(token_ids[start * block_size : end * block_size]),
                block_size=block_size,
            )
        )

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` free blocks, least recently freed first, each with ref_cnt 1.

        A block that still carries a cached hash is evicted from the prefix cache here.
        """
        blocks = self.free_block_queue.popleft_n(num_blocks)
        evicted: list[BlockHash] = []
        hash_to_block = self.cached_block_hash_to_block
        for block in blocks:
            block.ref_cnt = 1
            if block.block_hash is not None:
                del hash_to_block[block.block_hash]
                evicted.append(block.block_hash)
                block.block_hash = None
        if evicted and self.enable_kv_events:
            self._record_removed(evicted)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (prefix hits), pulling free ones out of the
        free queue so they cannot be evicted while held."""
        queue = self.free_block_queue
        for block in blocks:
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; blocks reaching 0 become free.

        Pass a request's blocks tail first: freed cached blocks join the back of the LRU in
        that order, so a chain's tail is evicted before its head. Blocks with no hash hold
        nothing reusable and go to the front, to be reused before any cached block.
        """
        queue = self.free_block_queue
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    queue.appendleft(block)
                else:
                    queue.append(block)

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1] (free cached blocks count as free)."""
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_blocks

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is held by a request."""
        if self.free_block_queue.num_free_blocks != self.num_blocks:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        if self.enable_kv_events:
            self._events.append(AllBlocksCleared())
        return True

    def evict_cached_free_blocks(self) -> int:
        """Forget the hash of every free cached block, with one BlockRemoved event for them;
        blocks held by requests keep theirs. For when cached content may no longer match
        its hash (a LoRA adapter's name served again with other weights). Returns how many
        blocks were evicted."""
        queue = self.free_block_queue
        hash_to_block = self.cached_block_hash_to_block
        evicted = [h for h, block in hash_to_block.items() if block.ref_cnt == 0]
        for block_hash in evicted:
            block = hash_to_block.pop(block_hash)
            block.block_hash = None
            # It holds nothing reusable now: to the front, reused before any cached block.
            queue.remove(block)
            queue.appendleft(block)
        if evicted and self.enable_kv_events:
            self._record_removed(evicted)
        return len(evicted)

    def _record_removed(self, keys: list[BlockHash]) -> None:
        """One BlockRemoved for the chain hashes among ``keys`` (other KV cache groups'
        keys were never announced)."""
        announced = [key for key in keys if not is_group_key(key)]
        if announced:
            self._events.append(BlockRemoved(block_hashes=announced))

    def take_events(self) -> list[KVEvent]:
        """The events recorded since the last call, oldest first."""
        events, self._events = self._events, []
        return events
