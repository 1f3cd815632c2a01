"""The KV-tier tests' workload: a tiny engine with a 24-block pool, and a conversation whose
second turn's prefix has been evicted from it by three other prompts in between."""

from __future__ import annotations

from pathlib import Path

from engine_common.config import CacheConfig, EngineConfig, SchedulerConfig
from engine_common.kv_tiers.config import KvTiersConfig
from engine_common.llm import LLM
from engine_common.sampling_params import SamplingParams
from tests.hf_reference import random_prompts

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
BLOCK = 4
# Turn 2's prompt: 37 + 8 + 6 = 51 tokens; its first 11 blocks (44 tokens) are turn 1's
# prompt and output so far (the 45th token, turn 1's last output, was never computed).
TURN2_TIER_BLOCKS = 11


def engine(model_dir: Path, tiers: KvTiersConfig | None = None, num_blocks: int = 24) -> LLM:
    return LLM(EngineConfig(
        model=str(model_dir), dtype="float32",
        cache=CacheConfig(block_size=BLOCK, num_gpu_blocks_override=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=4),
        kv_tiers=tiers or KvTiersConfig(),
    ))


def prompts() -> tuple[list[int], list[list[int]], list[int]]:
    """Turn 1's prompt, the three evicting prompts, turn 2's new tokens."""
    turn1, a, b, c, more = random_prompts(256, [37, 40, 40, 40, 6], seed=11)
    return turn1, [a, b, c], more


def turn1_then_evict(llm: LLM, turn1: list[int], others: list[list[int]]) -> list[int]:
    """Turn 1 and the evicting prompts one by one; turn 1's output. Waits for the tiers'
    stores, so that what turn 2 finds does not depend on timing."""
    first = llm.generate([turn1], GREEDY)[0]
    for prompt in others:
        llm.generate([prompt], GREEDY)
    if llm.core.kv_tiers is not None:
        assert llm.core.kv_tiers.drain()
    return first.token_ids


def conversation(llm: LLM, turn1: list[int], others: list[list[int]], more: list[int]
                 ) -> tuple[list[int], list[int], int]:
    """(turn 1's and turn 2's tokens, and turn 2's cached tokens)."""
    first = turn1_then_evict(llm, turn1, others)
    second = llm.generate([turn1 + first + more], GREEDY)[0]
    return first, second.token_ids, second.num_cached_tokens
