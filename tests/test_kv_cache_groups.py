"""KV cache groups (``kv_cache_groups``, ``hybrid_kv_cache_manager``): how a model's layers
split, when an engine keeps one group, and the multi-group manager's tables, window
releases, prefix hits (a sliding group needs only the window's blocks at the hit point),
all-or-nothing allocation and events (only the first group's hashes are announced)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import invariant

from engine_common.block_hash import group_block_key
from engine_common.config import EngineConfig
from engine_common.hybrid_kv_cache_manager import HybridKVCacheManager
from engine_common.kv_cache_groups import KVCacheGroup, KVCacheGroups, kv_cache_groups
from engine_common.kv_cache_manager import OUT_OF_WINDOW_BLOCK_ID
from engine_common.kv_events import BlockRemoved, BlockStored
from engine_common.model.arch_config import FULL_ATTENTION, SLIDING_ATTENTION, ModelArchConfig
from engine_common.request import Request
from engine_common.sampling_params import SamplingParams
from tests.test_kv_cache_manager import MAX_MODEL_LEN, KVCacheMachine

BS = 4
WINDOW = 8  # a query at p sees (p - 8, p]: at a hit point, the 2 blocks before it
GROUPS = KVCacheGroups((KVCacheGroup((1, 3), None), KVCacheGroup((0, 2), WINDOW)))


def _request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=8), block_size=BS)


def _prefill(kv: HybridKVCacheManager, req: Request) -> int:
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hits, num_hit) is not None
    req.num_computed_tokens = req.num_tokens
    req.append_output_token(7)
    return num_hit


def _arch(layer_types: list[str]) -> ModelArchConfig:
    return ModelArchConfig.from_hf_config(dict(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=64,
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_hidden_layers=len(layer_types), intermediate_size=32, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=WINDOW, layer_types=layer_types,
        max_position_embeddings=128, rms_norm_eps=1e-6))


def test_layers_split_by_type_unless_the_engine_cannot() -> None:
    arch = _arch([SLIDING_ATTENTION, FULL_ATTENTION] * 2)
    groups = kv_cache_groups(arch, EngineConfig(model="x"))
    assert groups == GROUPS
    assert groups.layers_per_block == 2
    assert groups.layer_slots() == ((1, 0), (0, 0), (1, 1), (0, 1))
    assert groups.layout_suffix() == "+kv-groups:full/2,sliding8/2"
    pd = EngineConfig(model="x")
    pd.kv_transfer.role = "producer"
    assert kv_cache_groups(arch, pd) == GROUPS  # P/D moves the pages of every group
    tiers = EngineConfig(model="x")
    tiers.kv_tiers.memory_bytes = 1 << 20  # a tier stores one block per hash: not yet
    single = kv_cache_groups(arch, tiers)
    assert single.is_single and single.layers_per_block == 4 and single.groups[0].window is None
    assert single.layout_suffix() == ""
    # One attention type: one group, its window the one to release behind (all slide).
    sliding = kv_cache_groups(_arch([SLIDING_ATTENTION] * 3), EngineConfig(model="x"))
    assert sliding.is_single and sliding.groups[0].window == WINDOW


def test_the_sliding_group_releases_behind_its_window_the_full_group_keeps_all() -> None:
    kv = HybridKVCacheManager(GROUPS, num_blocks=32, block_size=BS, max_model_len=128)
    req = _request("a", list(range(10, 30)))  # 20 tokens: 5 blocks
    _prefill(kv, req)
    # The prefill's first query is 0: nothing released yet.
    assert kv.held_blocks_per_group("a") == [5, 5]
    for _ in range(6):  # decode to 26 tokens
        assert kv.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        req.append_output_token(7)
    # Next query at 25 sees (17, 25]: blocks 0-3 (tokens < 16) are behind it.
    assert kv.held_blocks_per_group("a") == [7, 3]
    sliding_ids = kv.get_extra_block_ids("a")[0]
    assert sliding_ids[:4] == [OUT_OF_WINDOW_BLOCK_ID] * 4
    assert OUT_OF_WINDOW_BLOCK_ID not in kv.get_block_ids("a")[1:]
    assert kv.num_free_blocks == 32 - 10
    kv.free(req)
    assert kv.num_free_blocks == 32


def test_pd_moves_interleaved_pages_and_a_held_request_hits_whole() -> None:
    kv = HybridKVCacheManager(GROUPS, num_blocks=32, block_size=BS, max_model_len=128)
    assert kv.pages_per_block == 2
    req = _request("a", list(range(10, 30)))
    _prefill(kv, req)
    full, (sliding,) = kv.get_block_ids("a"), kv.get_extra_block_ids("a")
    assert kv.get_transfer_block_ids("a") == [
        b for pair in zip(full, sliding, strict=True) for b in pair]
    assert kv.get_transfer_block_ids("a", 1, 3) == [full[1], sliding[1], full[2], sliding[2]]
    kv.free(req)
    # Evict the sliding group's block 0: a request whose KV a decode replica will pull
    # needs every block of a hit, so its hit stops before it; another one's does not.
    pool = kv.block_pool
    key = group_block_key(req.block_hashes[0], 1)
    pool.cached_block_hash_to_block.pop(key).block_hash = None
    held = Request("h", list(range(10, 30)), SamplingParams(max_tokens=8), block_size=BS,
                   hold_kv=True)
    assert kv.get_computed_blocks(held)[1] == 0
    assert kv.get_computed_blocks(_request("b", list(range(10, 30))))[1] == 16


def test_a_sliding_hit_needs_only_the_window_before_the_hit_point() -> None:
    kv = HybridKVCacheManager(GROUPS, num_blocks=24, block_size=BS, max_model_len=128)
    prompt = list(range(100, 125))  # 25 tokens: 6 full blocks
    first = _request("a", prompt)
    _prefill(kv, first)
    kv.free(first)
    # Evict the sliding group's first 3 blocks from the prefix cache (by key, as their
    # reallocation would).
    pool = kv.block_pool
    sliding_keys = [k for k in pool.cached_block_hash_to_block if len(k) != 32]
    assert len(sliding_keys) == 6
    for key in sorted(sliding_keys, key=lambda k: first.block_hashes.index(k[:32]))[:3]:
        block = pool.cached_block_hash_to_block.pop(key)
        block.block_hash = None
    second = _request("b", prompt)
    # The hit point is 24 (the last token is computed): the window needs blocks 4 and 5.
    assert _prefill(kv, second) == 24
    assert kv.get_extra_block_ids("b")[0][:4] == [OUT_OF_WINDOW_BLOCK_ID] * 4
    assert kv.held_blocks_per_group("b") == [7, 3]
    kv.free(second)
    # Evict block 4 of the sliding group too: no hit point has its window's two blocks
    # cached (block 3 alone is, and blocks 0-2 are gone), so nothing is a hit.
    key = next(k for k in pool.cached_block_hash_to_block
               if k[:32] == first.block_hashes[4] and len(k) != 32)
    pool.cached_block_hash_to_block.pop(key).block_hash = None
    third = _request("c", prompt)
    assert kv.get_computed_blocks(third)[1] == 0


def test_allocation_is_all_groups_or_nothing_and_events_name_chain_hashes() -> None:
    kv = HybridKVCacheManager(GROUPS, num_blocks=9, block_size=BS, max_model_len=128)
    big = _request("big", list(range(200, 220)))  # 5 blocks a group: 10 > 9
    assert kv.allocate_slots(big, 20) is None
    assert kv.num_free_blocks == 9 and kv.get_block_ids("big") == []
    small = _request("small", list(range(300, 308)))
    _prefill(kv, small)
    stored = [e for e in kv.take_events() if isinstance(e, BlockStored)]
    assert [h for e in stored for h in e.block_hashes] == small.block_hashes[:2]
    assert sorted(kv.get_cached_block_hashes()) == sorted(small.block_hashes[:2])


def test_one_group_is_refused() -> None:
    with pytest.raises(ValueError, match="one KV cache group"):
        HybridKVCacheManager(KVCacheGroups((KVCacheGroup((0,), None),)), 4, BS, 64)


# ---- stateful property test ----------------------------------------------------------------

HYBRID_BLOCKS = 14
SLIDING = 6  # a query at p sees (p - 6, p]
HYBRID = KVCacheGroups((KVCacheGroup((0,), None), KVCacheGroup((1,), SLIDING)))


class HybridKVCacheMachine(KVCacheMachine):
    """The single-group machine's random admissions, chunked prefills, decodes, preemptions
    and finishes, on two groups (full, and a 6-token window) sharing a small pool: every
    read a step would make (all earlier tokens in the full group, the window's in the
    sliding one) finds that token's KV, and the pool's counts and events stay consistent."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = HybridKVCacheManager(HYBRID, HYBRID_BLOCKS, BS, MAX_MODEL_LEN)
        self.kv_content = {i: [None] * BS for i in range(HYBRID_BLOCKS)}

    def _tables(self, request_id: str) -> list[list[int]]:
        return [self.kv.get_block_ids(request_id), *self.kv.get_extra_block_ids(request_id)]

    def _compute(self, req: Request, num_new_tokens: int) -> None:
        full, sliding = self._tables(req.request_id)
        start = req.num_computed_tokens
        for table, first in ((full, 0), (sliding, max(0, start - SLIDING + 1))):
            for pos in range(first, start):
                held = self.kv_content[table[pos // BS]][pos % BS]
                assert held == req.all_token_ids[pos], f"{req.request_id} reads stale KV at {pos}"
        blocks = (self.kv.get_blocks(req.request_id),
                  self.kv._extra[0].blocks[req.request_id])
        for pos in range(start, start + num_new_tokens):
            for table, group_blocks in zip((full, sliding), blocks, strict=True):
                assert group_blocks[pos // BS] is not self.kv._placeholder  # never written
                self.kv_content[table[pos // BS]][pos % BS] = req.all_token_ids[pos]
        req.num_computed_tokens += num_new_tokens
        if req.num_computed_tokens == req.num_tokens and req.num_tokens < req.max_total_tokens:
            req.append_output_token(req.num_tokens % 3)

    @invariant()
    def pool_is_consistent(self) -> None:
        kv = self.kv
        pool = kv.block_pool
        free_ids = {b.block_id for b in pool.free_block_queue.get_all_free_blocks()}
        assert len(free_ids) == pool.get_num_free_blocks()
        holders: dict[int, int] = {}
        for rid in kv.req_to_blocks:
            req = self.live[rid]
            for group, held in enumerate(kv.held_blocks_per_group(rid)):
                table = (kv.req_to_blocks[rid] if group == 0
                         else kv._extra[group - 1].blocks[rid])
                released = len(table) - held
                assert all(b is kv._placeholder for b in table[:released])
                for i, block in enumerate(table[released:], released):
                    holders[block.block_id] = holders.get(block.block_id, 0) + 1
                    if block.block_hash is not None:
                        assert block.block_hash == group_block_key(req.block_hashes[i], group)
        for block in pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0)
            assert (block.ref_cnt == 0) == (block.block_id in free_ids)
        assert len(free_ids) + len(holders) == HYBRID_BLOCKS

    @invariant()
    def events_rebuild_the_cache_index(self) -> None:
        for event in self.kv.take_events():
            if isinstance(event, BlockStored):
                self.index.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.index.difference_update(event.block_hashes)
            else:
                self.index.clear()
        assert self.index == set(self.kv.get_cached_block_hashes())

    def teardown(self) -> None:
        for req in list(self.live.values()):
            self.kv.free(req)
        assert self.kv.num_free_blocks == HYBRID_BLOCKS


HybridKVCacheMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_hybrid_kv_cache_machine = HybridKVCacheMachine.TestCase
