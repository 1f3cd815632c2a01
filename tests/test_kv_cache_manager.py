"""KV cache manager: prefix hits, slot allocation, watermark, freeing; and a stateful property
test that drives it the way a scheduler does and checks the pool's invariants and the KV
content every prefix hit would read."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from engine_common.block_hash import BlockHash
from engine_common.kv_cache_manager import KVCacheManager
from engine_common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from engine_common.request import Request
from engine_common.sampling_params import SamplingParams

BS = 4


def make_request(
    rid: str, prompt: list[int], max_tokens: int = 16, salt: str | None = None
) -> Request:
    return Request(
        rid, prompt, SamplingParams(max_tokens=max_tokens), cache_salt=salt, block_size=BS
    )


def run_prefill(kv: KVCacheManager, req: Request) -> int:
    """Admit ``req`` with its prefix hits and compute its whole prompt, then sample a token.
    Returns the number of prefix-hit tokens."""
    hits, num_hit_tokens = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit_tokens, hits, num_hit_tokens) is not None
    req.num_computed_tokens = req.num_tokens
    req.append_output_token(1000 + req.num_tokens)
    return num_hit_tokens


def decode(kv: KVCacheManager, req: Request) -> None:
    assert kv.allocate_slots(req, 1) is not None
    req.num_computed_tokens += 1
    req.append_output_token(1000 + req.num_tokens)



def test_a_sliding_window_releases_only_registered_blocks_behind_it() -> None:
    """Window 8, blocks of 4: a query at p sees (p - 8, p]. Blocks wholly behind the next
    query's window are released (placeholders in the table, cached hashes kept, the pool's
    free count up); KV a decode replica will pull is kept; a request whose KV arrives later
    keeps its blocks until they are registered."""
    from engine_common.kv_cache_manager import OUT_OF_WINDOW_BLOCK_ID

    kv = KVCacheManager(num_blocks=16, block_size=BS, max_model_len=128, sliding_window=8)
    a = make_request("a", list(range(20)))
    run_prefill(kv, a)  # 5 blocks, the next query at 20 sees 13..20: none released yet
    assert kv.num_held_blocks("a") == 5
    decode(kv, a)  # next query at 20 (allocated before computing it): 20 - 8 + 1 = 13
    assert kv.get_block_ids("a")[:3] == [OUT_OF_WINDOW_BLOCK_ID] * 3
    assert kv.num_held_blocks("a") == 3 and kv.num_free_blocks == 16 - 3
    # Released, still cached: a prompt with the same prefix hits them.
    b = make_request("b", list(range(20)) + [99])
    assert run_prefill(kv, b) == 20
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 16

    held = make_request("held", list(range(100, 120)))
    held.hold_kv = True
    run_prefill(kv, held)
    decode(kv, held)
    assert kv.num_held_blocks("held") == 6  # the whole prompt stays for the transfer
    kv.free(held)

    late = make_request("late", list(range(200, 224)))
    assert kv.allocate_slots(late, 24, delay_caching=True) is not None
    late.num_computed_tokens = 24
    assert kv.allocate_slots(late, 1, delay_caching=True) is not None
    assert kv.num_held_blocks("late") == 7  # none registered: none released
    kv.cache_blocks(late, 24)  # the pull arrived
    assert kv.allocate_slots(late, 1) is not None
    assert kv.num_held_blocks("late") == 7 - 4

def test_prefix_hit_after_free_and_last_token_recomputed() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS, max_model_len=128)
    prompt = list(range(12))  # exactly 3 full blocks
    a = make_request("a", prompt)
    assert run_prefill(kv, a) == 0
    a_blocks = kv.get_block_ids("a")
    assert len(a_blocks) == 3
    kv.free(a)
    assert kv.num_free_blocks == 16 and kv.get_block_ids("a") == []

    b = make_request("b", prompt)
    hits, n = kv.get_computed_blocks(b)
    # The whole prompt is cached, but its last token must run to produce logits.
    assert n == 8 and [blk.block_id for blk in hits] == a_blocks[:2]
    new = kv.allocate_slots(b, b.num_tokens - n, hits, n)
    assert new is not None and len(new) == 1
    assert kv.get_block_ids("b")[:2] == a_blocks[:2]

    c = make_request("c", prompt + [99])  # one more token: all 3 blocks are hits
    assert kv.get_computed_blocks(c)[1] == 12


def test_hits_stop_at_first_miss_and_salt_separates_chains() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS, max_model_len=128)
    run_prefill(kv, make_request("a", list(range(16)) + [7]))
    assert kv.get_computed_blocks(make_request("b", list(range(16)) + [8]))[1] == 16
    diverged = list(range(4)) + [50] + list(range(5, 17))
    assert kv.get_computed_blocks(make_request("c", diverged))[1] == 4
    assert kv.get_computed_blocks(make_request("d", list(range(17)), salt="tenant-2"))[1] == 0
    run_prefill(kv, make_request("e", list(range(17)), salt="tenant-2"))
    assert kv.get_computed_blocks(make_request("f", list(range(17)), salt="tenant-2"))[1] == 16
    assert kv.get_computed_blocks(make_request("g", list(range(17)), salt="tenant-3"))[1] == 0


def test_prefix_cache_stats_count_tokens_and_reset() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS, max_model_len=128)
    run_prefill(kv, make_request("a", list(range(10))))
    run_prefill(kv, make_request("b", list(range(10))))
    stats = kv.take_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 20, 8)
    assert kv.take_prefix_cache_stats().queries == 0
    # A request that cannot be admitted yet (no room) is looked up again every step: it
    # counts once, when it is admitted.
    tight = KVCacheManager(num_blocks=3, block_size=BS, max_model_len=128)
    waiting = make_request("w", list(range(20)))
    for _ in range(3):
        blocks, hits = tight.get_computed_blocks(waiting)
        assert tight.allocate_slots(waiting, 20 - hits, blocks, hits) is None
    assert tight.take_prefix_cache_stats().requests == 0
    off = KVCacheManager(num_blocks=16, block_size=BS, max_model_len=128, enable_caching=False)
    run_prefill(off, make_request("a", list(range(10))))
    assert off.get_computed_blocks(make_request("b", list(range(10)))) == ([], 0)
    assert off.take_prefix_cache_stats().queries == 0
    assert off.take_events() == []


def test_decode_allocates_a_block_only_at_boundaries_and_caches_filled_blocks() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, max_model_len=64)
    req = make_request("r", list(range(6)))
    run_prefill(kv, req)  # 6 prompt tokens computed, token 7 sampled: 2 blocks
    assert len(kv.get_block_ids("r")) == 2
    events = kv.take_events()
    assert [type(e) for e in events] == [BlockStored] and len(events[0].block_hashes) == 1
    decode(kv, req)  # computes token 7: 7 slots, still 2 blocks
    assert len(kv.get_block_ids("r")) == 2 and kv.take_events() == []
    decode(kv, req)  # computes token 8: block 1 is full now and cached
    [stored] = kv.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [req.block_hashes[1]]
    assert stored.parent_block_hash == req.block_hashes[0]
    assert stored.token_ids == req.all_token_ids[4:8]
    decode(kv, req)  # token 9 needs a third block
    assert len(kv.get_block_ids("r")) == 3


def test_chunked_prefill_caches_only_computed_blocks() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, max_model_len=64)
    req = make_request("r", list(range(14)))
    assert kv.allocate_slots(req, 6) is not None  # chunk 1: tokens 0..5
    assert len(kv.get_block_ids("r")) == 2
    assert len(kv.block_pool.cached_block_hash_to_block) == 1
    req.num_computed_tokens = 6
    # Another request may already hit the first chunk's full block.
    assert kv.get_computed_blocks(make_request("s", list(range(14))))[1] == 4
    assert kv.allocate_slots(req, 8) is not None  # chunk 2: tokens 6..13
    assert len(kv.get_block_ids("r")) == 4
    assert len(kv.block_pool.cached_block_hash_to_block) == 3


def test_delayed_caching_registers_blocks_only_when_asked() -> None:
    # P/D decode side: the prompt's KV arrives from a prefill replica after allocation.
    kv = KVCacheManager(num_blocks=8, block_size=BS, max_model_len=64)
    run_prefill(kv, make_request("local", list(range(4)) + [9]))
    kv.take_events()
    req = make_request("remote", list(range(13)))
    hits, n = kv.get_computed_blocks(req)
    assert n == 4
    new = kv.allocate_slots(req, req.num_tokens - n, hits, n, delay_caching=True)
    assert new is not None and len(new) == 3
    assert kv.take_events() == [] and len(kv.block_pool.cached_block_hash_to_block) == 1
    assert kv.get_computed_blocks(make_request("peek", list(range(13))))[1] == 4
    kv.cache_blocks(req, req.num_tokens)  # the pull finished
    [stored] = kv.take_events()
    assert isinstance(stored, BlockStored)
    assert (
        stored.block_hashes == req.block_hashes[1:3]
        and stored.parent_block_hash == req.block_hashes[0]
    )
    assert kv.get_computed_blocks(make_request("peek", list(range(13))))[1] == 12
    kv.cache_blocks(req, req.num_tokens)  # idempotent
    kv.cache_blocks(make_request("nobody", list(range(13))), 13)  # holds nothing: no-op
    assert kv.take_events() == []


def test_allocation_failure_changes_nothing_and_watermark_is_respected() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS, max_model_len=64)
    a = make_request("a", list(range(8)))
    run_prefill(kv, a)
    kv.free(a)  # 2 free cached blocks + 2 never used
    kv.take_events()
    b = make_request("b", list(range(8)) + [50] * 9)  # 17 tokens: 5 blocks
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    before = [(blk.ref_cnt, blk.block_hash) for blk in kv.block_pool.blocks]
    assert kv.allocate_slots(b, b.num_tokens - n, hits, n) is None
    assert [(blk.ref_cnt, blk.block_hash) for blk in kv.block_pool.blocks] == before
    assert kv.get_block_ids("b") == [] and kv.num_free_blocks == 4 and kv.take_events() == []

    c = make_request("c", list(range(8)) + [60] * 4)  # 12 tokens: 2 hit blocks + 1 new
    hits, n = kv.get_computed_blocks(c)
    # Hits sitting in the free queue count against the free blocks, as do new ones.
    assert kv.allocate_slots(c, c.num_tokens - n, hits, n, num_reserved_blocks=2) is None
    assert kv.allocate_slots(c, c.num_tokens - n, hits, n, num_reserved_blocks=1) is not None
    assert kv.num_free_blocks == 1 and kv.usage == pytest.approx(0.75)


def test_shared_blocks_are_freed_only_by_the_last_holder() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, max_model_len=64)
    a, b = make_request("a", list(range(9))), make_request("b", list(range(9)))
    run_prefill(kv, a)
    assert run_prefill(kv, b) == 8
    shared = kv.get_blocks("a")[:2]
    assert kv.get_blocks("b")[:2] == shared and all(blk.ref_cnt == 2 for blk in shared)
    kv.free(a)
    assert all(blk.ref_cnt == 1 for blk in shared) and kv.num_free_blocks == 5
    kv.free(b)
    kv.free(b)  # freeing twice (abort after finish) is harmless
    assert kv.num_free_blocks == 8


def test_reset_and_bad_arguments() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, max_model_len=16)
    a = make_request("a", list(range(9)))
    run_prefill(kv, a)
    assert kv.reset_prefix_cache() is False
    with pytest.raises(ValueError):
        kv.allocate_slots(a, 8)  # 18 slots > max_model_len
    with pytest.raises(ValueError):
        kv.allocate_slots(a, -1)
    hits, n = kv.get_computed_blocks(make_request("b", list(range(9))))
    with pytest.raises(ValueError):
        kv.allocate_slots(a, 1, hits, n)  # a already holds blocks
    kv.free(a)
    kv.take_events()
    assert kv.reset_prefix_cache() is True
    assert kv.take_events() == [AllBlocksCleared()]
    assert kv.get_computed_blocks(make_request("c", list(range(9))))[1] == 0


# ---- stateful property test ---------------------------------------------------------------

NUM_BLOCKS = 8
MAX_MODEL_LEN = 40
# A few shared stems so that prompts share prefixes often.
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5]]


class KVCacheMachine(RuleBasedStateMachine):
    """Random admissions (with prefix hits and chunked prefill), decode steps, preemptions,
    finishes and aborts, on a pool small enough to run out."""

    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BS, MAX_MODEL_LEN)
        self.live: dict[str, Request] = {}
        self.next_id = 0
        # What each physical block holds: the token at each slot whose KV was "computed".
        self.kv_content: dict[int, list[int | None]] = {i: [None] * BS for i in range(NUM_BLOCKS)}
        self.index: set[BlockHash] = set()  # a watcher's view, rebuilt from KV events only

    @rule(
        target=requests,
        stem=st.sampled_from(STEMS),
        tail=st.lists(st.integers(0, 3), max_size=10),
        salt=st.sampled_from([None, None, "s"]),
        max_tokens=st.integers(1, 12),
    )
    def add_request(self, stem: list[int], tail: list[int], salt: str | None, max_tokens: int):
        rid = f"r{self.next_id}"
        self.next_id += 1
        req = Request(
            rid,
            stem + tail,
            SamplingParams(max_tokens=max_tokens),
            cache_salt=salt,
            block_size=BS,
            max_model_len=MAX_MODEL_LEN,
        )
        self.live[rid] = req
        return req

    def _compute(self, req: Request, num_new_tokens: int) -> None:
        """Pretend to run the model: first check the KV every earlier token reads, then write
        this step's tokens into their slots, then sample if the request caught up."""
        blocks = self.kv.get_blocks(req.request_id)
        start = req.num_computed_tokens
        for pos in range(start):
            held = self.kv_content[blocks[pos // BS].block_id][pos % BS]
            assert held == req.all_token_ids[pos], f"{req.request_id} reads stale KV at {pos}"
        for pos in range(start, start + num_new_tokens):
            self.kv_content[blocks[pos // BS].block_id][pos % BS] = req.all_token_ids[pos]
        req.num_computed_tokens += num_new_tokens
        if req.num_computed_tokens == req.num_tokens and req.num_tokens < req.max_total_tokens:
            req.append_output_token(req.num_tokens % 3)

    @rule(req=requests, chunk=st.integers(1, 12), reserved=st.integers(0, 2))
    def step_one(self, req: Request, chunk: int, reserved: int) -> None:
        self.step(req, chunk, reserved)

    def step(self, req: Request, chunk: int, reserved: int) -> None:
        """Schedule one step of ``req``: admit it (with prefix hits) if it holds no blocks,
        else continue its prefill or decode. Out of blocks: a running request is preempted."""
        if req.request_id not in self.live:
            return
        kv = self.kv
        holds = bool(kv.get_blocks(req.request_id))
        if not holds and req.num_computed_tokens == 0:
            hits, num_hit_tokens = kv.get_computed_blocks(req)
            assert num_hit_tokens < req.num_tokens
            num_new = min(chunk, req.num_tokens - num_hit_tokens)
            free_before = kv.num_free_blocks
            new = kv.allocate_slots(
                req, num_new, hits, num_hit_tokens, num_reserved_blocks=reserved
            )
            if new is None:
                assert kv.num_free_blocks == free_before and not kv.get_blocks(req.request_id)
                return
            assert kv.num_free_blocks >= reserved
            req.num_computed_tokens = num_hit_tokens
            self._compute(req, num_new)
            return
        num_new = min(chunk, req.num_tokens - req.num_computed_tokens)
        if req.num_computed_tokens + num_new > MAX_MODEL_LEN or num_new == 0:
            return  # finished by length; the finish rule frees it
        if kv.allocate_slots(req, num_new) is None:
            kv.free(req)  # preempt by recompute
            req.num_computed_tokens = 0
            req.num_preemptions += 1
            return
        self._compute(req, num_new)

    @rule(chunk=st.integers(1, 12))
    def schedule_all(self, chunk: int) -> None:
        """One engine step over every live request, oldest first."""
        for req in list(self.live.values()):
            self.step(req, chunk, reserved=0)

    @rule(req=consumes(requests))
    def finish_or_abort(self, req: Request) -> None:
        self.kv.free(req)
        self.live.pop(req.request_id, None)

    @precondition(lambda self: not self.live)
    @rule()
    def reset_when_idle(self) -> None:
        assert self.kv.reset_prefix_cache() is True

    @rule()
    def reset_refused_while_held(self) -> None:
        held = any(self.kv.get_blocks(rid) for rid in self.live)
        assert self.kv.reset_prefix_cache() is not held

    @invariant()
    def pool_is_consistent(self) -> None:
        pool = self.kv.block_pool
        free = pool.free_block_queue.get_all_free_blocks()
        free_ids = {b.block_id for b in free}
        assert len(free_ids) == len(free) == pool.get_num_free_blocks()
        holders: dict[int, int] = {}
        for rid, blocks in self.kv.req_to_blocks.items():
            assert rid in self.live
            req = self.live[rid]
            assert len({b.block_id for b in blocks}) == len(blocks)
            assert self.kv.get_block_ids(rid) == [b.block_id for b in blocks]
            for i, block in enumerate(blocks):
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
                # A cached block a request holds at position i holds that request's block i.
                if block.block_hash is not None:
                    assert block.block_hash == req.block_hashes[i]
        for block in pool.blocks:
            assert block.ref_cnt >= 0
            assert block.ref_cnt == holders.get(block.block_id, 0)
            assert (block.ref_cnt == 0) == (block.block_id in free_ids)
            if block.block_hash is not None:
                assert pool.cached_block_hash_to_block[block.block_hash] is block
        assert len(free_ids) + len(holders) == NUM_BLOCKS
        assert self.kv.req_to_block_ids.keys() == self.kv.req_to_blocks.keys()
        for block_hash, block in pool.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash

    @invariant()
    def events_rebuild_the_cache_index(self) -> None:
        events: list[KVEvent] = self.kv.take_events()
        for event in events:
            if isinstance(event, BlockStored):
                assert len(event.token_ids) == len(event.block_hashes) * BS
                for h in event.block_hashes:
                    assert h not in self.index
                    self.index.add(h)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    self.index.remove(h)
            else:
                self.index.clear()
        assert self.index == set(self.kv.block_pool.cached_block_hash_to_block)

    def teardown(self) -> None:
        for req in list(self.live.values()):
            self.kv.free(req)
        assert self.kv.num_free_blocks == NUM_BLOCKS
        assert all(b.ref_cnt == 0 for b in self.kv.block_pool.blocks)


KVCacheMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_kv_cache_machine = KVCacheMachine.TestCase
