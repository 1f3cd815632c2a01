"""KV tiers in the engine: greedy output is identical with and without them, and the
tiers are really used (a later turn's prefix, evicted from a small KV pool, is loaded from
the host-memory or disk tier and not recomputed).

A tiny random Llama runs turn 1 of a conversation, then other conversations that evict its
blocks from a 24-block pool, then turn 2 (turn 1's prompt, its answer and more tokens).
With tiers, turn 2's prefix comes from a tier (hits counted, ``num_cached_tokens``); its
tokens must equal the run without tiers and Hugging Face's greedy output.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_common.kv_tiers.config import KvTiersConfig
from tests.hf_reference import hf_greedy
from tests.kv_tiers_workload import MAX_TOKENS, TURN2_TIER_BLOCKS, conversation, engine, prompts


@pytest.fixture(scope="module")
def workload(tiny_llama_dir: Path):
    turn1, others, more = prompts()
    baseline = conversation(engine(tiny_llama_dir), turn1, others, more)
    return turn1, others, more, baseline


def test_turn2_without_tiers_is_recomputed(tiny_llama_dir, workload):
    turn1, others, more, (t1, t2, cached) = workload
    # The pool (24 blocks) cannot keep turn 1's 11 blocks through three 12-block prompts.
    assert cached == 0
    expected = hf_greedy(tiny_llama_dir, [turn1, turn1 + t1 + more], MAX_TOKENS)
    assert [t1, t2] == expected


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_turn2_prefix_loads_from_tier_and_output_is_identical(tiny_llama_dir, workload,
                                                              tmp_path, tier):
    turn1, others, more, baseline = workload
    config = (KvTiersConfig(memory_bytes=1 << 20) if tier == "memory"
              else KvTiersConfig(disk_dir=str(tmp_path / "kv"), disk_bytes=1 << 24))
    llm = engine(tiny_llama_dir, config)
    t1, t2, cached = conversation(llm, turn1, others, more)
    assert (t1, t2) == baseline[:2]
    medium = "host" if tier == "memory" else "disk"
    stats = llm.core.kv_tiers.totals()[medium]
    assert stats.hits == TURN2_TIER_BLOCKS
    assert cached == TURN2_TIER_BLOCKS * 4
    assert stats.failures == {}
    llm.core.close()


def test_admission_filter_stores_only_blocks_seen_twice(tiny_llama_dir, workload):
    turn1, others, more, baseline = workload
    llm = engine(tiny_llama_dir, KvTiersConfig(memory_bytes=1 << 20, admit_after=2))
    t1, t2, cached = conversation(llm, turn1, others, more)
    assert (t1, t2) == baseline[:2]
    # Every block was computed once before turn 2: none was stored, none is loaded.
    assert llm.core.kv_tiers.totals()["host"].hits == 0
    assert cached == 0
    # Turn 2 computed turn 1's blocks a second time: now they are stored.
    assert llm.core.kv_tiers.drain()
    assert llm.core.kv_tiers.totals()["host"].stores >= TURN2_TIER_BLOCKS
    llm.core.close()
