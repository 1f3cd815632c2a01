"""Block pool: the free queue as LRU, lazy eviction, ref counts, KV events and their buffer."""

from __future__ import annotations

import time

import pytest

from engine_common.block_hash import hash_prompt_blocks
from engine_common.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from engine_common.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBuffer,
)

BS = 4


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


# ---- free queue ---------------------------------------------------------------------------


def test_queue_pops_in_order_and_appends_at_back() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.num_free_blocks == 5
    assert q.popleft().block_id == 0
    assert ids(q.popleft_n(2)) == [1, 2]
    q.append(blocks[0])
    q.appendleft(blocks[1])
    assert ids(q.get_all_free_blocks()) == [1, 3, 4, 0]
    assert q.num_free_blocks == 4
    assert ids(q.popleft_n(4)) == [1, 3, 4, 0]
    assert q.num_free_blocks == 0
    with pytest.raises(ValueError):
        q.popleft()
    with pytest.raises(ValueError):
        q.popleft_n(1)
    q.append_n(blocks[2:4])
    assert ids(q.get_all_free_blocks()) == [2, 3]


def test_queue_remove_from_middle_relinks_neighbours() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[2])
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None
    assert blocks[1].next_free_block is blocks[3] and blocks[3].prev_free_block is blocks[1]
    q.remove(blocks[0])
    q.remove(blocks[4])
    assert ids(q.get_all_free_blocks()) == [1, 3]
    assert q.num_free_blocks == 2
    with pytest.raises(RuntimeError):
        q.remove(blocks[2])  # not in the queue


def test_queue_remove_is_constant_time() -> None:
    # 10k removals from the middle of a 200k queue: O(1) each is milliseconds, a scan of the
    # list per removal would be ~10^9 steps.
    blocks = [KVCacheBlock(i) for i in range(200_000)]
    q = FreeKVCacheBlockQueue(blocks)
    start = time.perf_counter()
    for block in blocks[100_000:110_000]:
        q.remove(block)
    assert time.perf_counter() - start < 1.0
    assert q.num_free_blocks == 190_000


# ---- block pool ---------------------------------------------------------------------------


def fill_and_cache(pool: BlockPool, tokens: list[int], salt: str | None = None):
    """Allocate blocks for ``tokens`` and register their full blocks, like one request."""
    keys = (salt,) if salt else None
    hashes = hash_prompt_blocks(tokens, BS, keys)
    blocks = pool.get_new_blocks(-(-len(tokens) // BS))
    pool.cache_full_blocks(blocks, hashes, 0, len(hashes), tokens, BS)
    return blocks, hashes


def test_new_blocks_come_out_in_lru_order_with_ref_one() -> None:
    pool = BlockPool(6, enable_caching=True, enable_kv_events=True)
    a = pool.get_new_blocks(2)
    b = pool.get_new_blocks(2)
    assert ids(a) == [0, 1] and ids(b) == [2, 3]
    assert all(blk.ref_cnt == 1 for blk in a + b)
    assert pool.get_num_free_blocks() == 2
    assert pool.get_usage() == pytest.approx(4 / 6)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)


def test_cache_full_blocks_records_stored_with_parent_and_tokens() -> None:
    pool = BlockPool(8, enable_caching=True, enable_kv_events=True)
    tokens = list(range(10))  # 2 full blocks + 2 tokens
    blocks, hashes = fill_and_cache(pool, tokens)
    assert [pool.get_cached_block(h) for h in hashes] == blocks[:2]
    assert blocks[2].block_hash is None
    assert pool.take_events() == [
        BlockStored(
            block_hashes=hashes, parent_block_hash=None, token_ids=tokens[:8], block_size=BS
        )
    ]
    assert pool.take_events() == []
    # Later blocks of the same request chain to the last cached one.
    tokens += [10, 11]
    hashes = hash_prompt_blocks(tokens, BS)
    pool.cache_full_blocks(blocks, hashes, 2, 3, tokens, BS)
    [event] = pool.take_events()
    assert event == BlockStored([hashes[2]], hashes[1], [8, 9, 10, 11], BS)


def test_freed_cached_blocks_stay_hits_until_reallocated_then_emit_removed() -> None:
    pool = BlockPool(4, enable_caching=True, enable_kv_events=True)
    blocks, hashes = fill_and_cache(pool, list(range(12)))  # 3 full blocks
    pool.take_events()
    pool.free_blocks(reversed(blocks))
    assert pool.get_num_free_blocks() == 4
    assert all(pool.get_cached_block(h) is b for h, b in zip(hashes, blocks, strict=True))
    # Free order: never-used block 3 first, then the chain tail to head.
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [3, 2, 1, 0]
    first = pool.get_new_blocks(1)
    assert ids(first) == [3] and pool.take_events() == []  # uncached: nothing evicted
    two = pool.get_new_blocks(2)
    assert ids(two) == [2, 1]
    assert pool.take_events() == [BlockRemoved(block_hashes=[hashes[2], hashes[1]])]
    assert pool.get_cached_block(hashes[2]) is None and pool.get_cached_block(hashes[1]) is None
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    assert all(b.block_hash is None for b in two)


def test_uncached_freed_blocks_are_reused_before_cached_ones() -> None:
    pool = BlockPool(4, enable_caching=True, enable_kv_events=False)
    cached, hashes = fill_and_cache(pool, list(range(4)))
    scratch = pool.get_new_blocks(1)
    pool.free_blocks(cached)
    pool.free_blocks(scratch)  # freed later, but holds nothing worth keeping
    assert pool.get_new_blocks(3)[0] is scratch[0]
    assert pool.get_cached_block(hashes[0]) is cached[0]


def test_touch_takes_free_cached_block_out_of_the_queue() -> None:
    pool = BlockPool(4, enable_caching=True, enable_kv_events=True)
    blocks, hashes = fill_and_cache(pool, list(range(8)))
    pool.free_blocks(reversed(blocks))
    hit = pool.get_cached_block(hashes[0])
    assert hit is blocks[0] and hit.ref_cnt == 0
    pool.touch([hit])
    assert hit.ref_cnt == 1 and hit not in pool.free_block_queue.get_all_free_blocks()
    pool.touch([hit])  # a second holder does not touch the queue
    assert hit.ref_cnt == 2 and pool.get_num_free_blocks() == 3
    # Everything else can be taken without evicting the held hit.
    pool.get_new_blocks(3)
    assert pool.get_cached_block(hashes[0]) is hit
    pool.free_blocks([hit])
    assert hit.ref_cnt == 1 and pool.get_num_free_blocks() == 0


def test_double_free_is_an_error() -> None:
    pool = BlockPool(2, enable_caching=True)
    [block] = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(RuntimeError):
        pool.free_blocks([block])
    assert block.ref_cnt == 0


def test_duplicate_content_keeps_one_block_per_hash_and_splits_the_stored_run() -> None:
    pool = BlockPool(8, enable_caching=True, enable_kv_events=True)
    tokens = list(range(12))
    first, hashes = fill_and_cache(pool, tokens[:4])  # block 0 cached by another request
    pool.take_events()
    blocks = pool.get_new_blocks(3)
    hashes = hash_prompt_blocks(tokens, BS)
    pool.cache_full_blocks(blocks, hashes, 0, 3, tokens, BS)
    assert blocks[0].block_hash is None  # duplicate of first[0]: not registered
    assert pool.get_cached_block(hashes[0]) is first[0]
    assert pool.take_events() == [BlockStored(hashes[1:], hashes[0], tokens[4:], BS)]
    # Freeing the duplicate evicts nothing the cache relies on.
    pool.free_blocks(reversed(blocks))
    assert pool.get_cached_block(hashes[0]) is first[0]


def test_reset_prefix_cache_only_when_nothing_is_held() -> None:
    pool = BlockPool(4, enable_caching=True, enable_kv_events=True)
    blocks, hashes = fill_and_cache(pool, list(range(8)))
    pool.take_events()
    assert pool.reset_prefix_cache() is False
    assert pool.take_events() == [] and pool.get_cached_block(hashes[0]) is blocks[0]
    pool.free_blocks(reversed(blocks))
    assert pool.reset_prefix_cache() is True
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in pool.blocks)
    # Reallocating after the reset evicts nothing (no BlockRemoved for cleared hashes).
    pool.get_new_blocks(4)
    assert pool.take_events() == []


def test_caching_and_events_can_be_disabled() -> None:
    pool = BlockPool(4, enable_caching=False, enable_kv_events=True)
    blocks, hashes = fill_and_cache(pool, list(range(8)))
    assert pool.get_cached_block(hashes[0]) is None and blocks[0].block_hash is None
    assert pool.take_events() == []
    quiet = BlockPool(4, enable_caching=True, enable_kv_events=False)
    blocks, hashes = fill_and_cache(quiet, list(range(8)))
    quiet.free_blocks(blocks)
    quiet.get_new_blocks(4)
    assert quiet.reset_prefix_cache() is False
    assert quiet.take_events() == []


# ---- event buffer -------------------------------------------------------------------------


def test_event_buffer_assigns_seq_and_skips_empty_batches() -> None:
    buf = KVEventBuffer(capacity=3)
    assert buf.last_seq == 0 and buf.since(0) == []
    assert buf.append([]) is None and buf.last_seq == 0
    b1 = buf.append([AllBlocksCleared()], timestamp=1.0)
    b2 = buf.append([BlockRemoved([b"x" * 32])])
    assert b1 is not None and b2 is not None
    assert (b1.seq, b1.timestamp, b2.seq) == (1, 1.0, 2)
    assert buf.since(0) == [b1, b2]
    assert buf.since(1) == [b2]
    assert buf.since(2) == []


def test_event_buffer_reports_gaps_as_resync() -> None:
    buf = KVEventBuffer(capacity=2)
    for i in range(5):
        buf.append([BlockRemoved([bytes([i]) * 32])])
    assert buf.last_seq == 5
    assert buf.since(2) is None  # batch 3 would be needed, ring holds only 4 and 5
    assert [b.seq for b in buf.since(3) or []] == [4, 5]
    assert [b.seq for b in buf.since(4) or []] == [5]
    assert buf.since(5) == []
    assert buf.since(6) is None  # a watcher ahead of us saw another incarnation
    with pytest.raises(ValueError):
        KVEventBuffer(0)
