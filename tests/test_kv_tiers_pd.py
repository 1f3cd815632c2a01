"""P/D with KV tiers: a decode replica that finds the prompt's prefix in its tier loads it
instead of pulling it, and pulls only the rest (over real UCX), with output equal to an
aggregated engine's.

The decode core decodes a first request (its blocks are written through to its host tier),
forgets its prefix cache, then gets a second request sharing that prompt: the shared blocks
come from the tier (counted as the pull's local blocks), the rest from the prefill core.
"""

from __future__ import annotations

import random

from engine_common.config import CacheConfig, EngineConfig, KvTransferConfig, SchedulerConfig
from engine_common.engine_core import EngineCore
from engine_common.kv_tiers.config import KvTiersConfig
from tests.test_pd_engine import decode, make_core, prefill, reference, wait_released


def test_decode_replica_loads_the_prefix_from_its_tier_and_pulls_the_rest(tiny_llama_dir):
    p = make_core(tiny_llama_dir, "prefill-t", "producer", lease_seconds=5.0)
    d = EngineCore(EngineConfig(
        model=str(tiny_llama_dir), dtype="float32", engine_id="decode-t",
        cache=CacheConfig(block_size=4, num_gpu_blocks_override=128),
        scheduler=SchedulerConfig(max_num_batched_tokens=256),
        kv_transfer=KvTransferConfig(role="consumer", pull_timeout_seconds=5.0),
        kv_tiers=KvTiersConfig(memory_bytes=1 << 20)))
    both = make_core(tiny_llama_dir, "both-t", None)
    try:
        rng = random.Random(7)
        shared = [rng.randrange(3, 300) for _ in range(24)]  # 6 full blocks of 4
        prompts = [shared + [rng.randrange(3, 300) for _ in range(k)] for k in (2, 9)]
        first, handle = prefill(p, "t0", prompts[0])
        tokens, report = decode(d, "t0", prompts[0], first, handle)
        assert tokens == reference(both, "t0", prompts[0])
        p.release_kv(["t0"])
        assert d.kv_tiers.drain()
        # The decode replica's pool forgets the prompt: only its host tier has it now.
        assert d.kv_cache_manager.evict_cached_free_blocks() > 0
        first, handle = prefill(p, "t1", prompts[1])
        hits_before = d.kv_tiers.totals()["host"].hits
        tokens, report = decode(d, "t1", prompts[1], first, handle)
        loaded = d.kv_tiers.totals()["host"].hits - hits_before
        assert tokens == reference(both, "t1", prompts[1])
        assert report.fallback_reason is None
        assert loaded == 6 and report.blocks_local == 6
        assert report.blocks_pulled == len(handle.block_ids) - 6
        p.release_kv(["t1"])
        wait_released(p)
        assert d.kv_cache_manager.num_free_blocks == d.kv_cache_manager.num_blocks
    finally:
        p.remote_kv.close()
        d.remote_kv.close()
        d.close()


