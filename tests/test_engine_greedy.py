"""The engine's greedy output is token-identical to Hugging Face transformers.

Tiny random Llama and Qwen2 models (built by the tests) run through ``LLM.generate`` on a
batch of prompts of mixed lengths, and again with (a) a token budget small enough to chunk
every prefill, (b) prompts sharing prefixes (prefix-cache hits asserted), (c) a KV pool small
enough to force preemptions (asserted). Every run must equal HF's greedy ``generate``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_common.config import CacheConfig, EngineConfig, SchedulerConfig
from engine_common.llm import LLM
from engine_common.sampling_params import SamplingParams
from tests.hf_reference import hf_greedy, random_prompts

MAX_TOKENS = 12


def engine(model_dir: Path, *, budget: int = 512, num_blocks: int | None = None,
           max_num_seqs: int = 64, reserve_output_room: bool = True) -> LLM:
    return LLM(EngineConfig(
        model=str(model_dir), dtype="float32",
        cache=CacheConfig(block_size=4, num_gpu_blocks_override=num_blocks or 512),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                  reserve_output_room=reserve_output_room),
    ))


# min_tokens suppresses EOS as HF's min_new_tokens does (ignore_eos alone would not).
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def model_and_prompts(request):
    model_dir = request.getfixturevalue(f"tiny_{request.param}_dir")
    llm = engine(model_dir)
    vocab = llm.core.arch.vocab_size
    prompts = random_prompts(vocab, [1, 3, 7, 16, 17, 33, 50, 5], seed=1)
    shared = random_prompts(vocab, [24], seed=2)[0]
    prefixed = [shared + tail for tail in random_prompts(vocab, [3, 9, 1, 14], seed=3)]
    expected = hf_greedy(model_dir, prompts + prefixed, MAX_TOKENS)
    return model_dir, llm, prompts, prefixed, expected


def test_mixed_lengths_match_hf(model_and_prompts):
    _, llm, prompts, _, expected = model_and_prompts
    results = llm.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == expected[: len(prompts)]
    assert all(r.finish_reason == "length" for r in results)


def test_chunked_prefill_matches_hf(model_and_prompts):
    model_dir, _, prompts, _, expected = model_and_prompts
    llm = engine(model_dir, budget=5)  # every prompt longer than 5 tokens is chunked
    results = llm.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == expected[: len(prompts)]


def test_prefix_cache_hits_match_hf(model_and_prompts):
    model_dir, _, prompts, prefixed, expected = model_and_prompts
    llm = engine(model_dir)
    first = llm.generate(prefixed[:1], GREEDY)
    results = llm.generate(prefixed[1:], GREEDY)
    assert [r.token_ids for r in first + results] == expected[len(prompts):]
    # The 24-token shared prefix is 6 blocks of 4: every later request reuses all of them.
    assert [r.num_cached_tokens for r in results] == [24, 24, 24]
    hits = llm.metrics.registry.get_sample_value(
        "vllm:prefix_cache_hits_total", {"model_name": model_dir.name, "engine": "engine-0"})
    assert hits == 24 * 3


def test_a_prefix_hit_shorter_than_the_new_part_matches_hf(model_and_prompts):
    """The torch backend pads the queries instead of masking when no more is cached than
    computed (``torch_backend._plan_prefill``): both sides of that rule, against HF."""
    model_dir, _, _, prefixed, _ = model_and_prompts
    llm = engine(model_dir)
    vocab = llm.core.arch.vocab_size
    shared = prefixed[0][:24]
    long_tails = [shared + tail for tail in random_prompts(vocab, [40, 24, 23], seed=4)]
    llm.generate([shared + [1]], GREEDY)  # caches the 24-token prefix
    results = llm.generate(long_tails, GREEDY)
    assert [r.num_cached_tokens for r in results] == [24, 24, 24]
    assert [r.token_ids for r in results] == hf_greedy(model_dir, long_tails, MAX_TOKENS)


def test_preemption_matches_hf(model_and_prompts):
    model_dir, _, prompts, _, expected = model_and_prompts
    # 8 prompts need far more than 24 blocks of 4 tokens together: the scheduler must
    # preempt by recompute and still produce HF's tokens. (Admission's output reserve
    # would avoid the preemptions this test is about: off.)
    llm = engine(model_dir, num_blocks=24, reserve_output_room=False)
    results = llm.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == expected[: len(prompts)]
    preemptions = llm.metrics.registry.get_sample_value(
        "vllm:num_preemptions_total", {"model_name": model_dir.name, "engine": "engine-0"})
    assert preemptions is not None and preemptions > 0
    assert llm.core.kv_cache_manager.num_free_blocks == 24


def test_output_reserve_admits_without_preempting(model_and_prompts):
    """The same pool with admission's output reserve on (the default): requests wait for
    room instead of being admitted into blocks the running ones grow into, so none is
    preempted, and the tokens are still HF's."""
    model_dir, _, prompts, _, expected = model_and_prompts
    llm = engine(model_dir, num_blocks=24)
    results = llm.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == expected[: len(prompts)]
    preemptions = llm.metrics.registry.get_sample_value(
        "vllm:num_preemptions_total", {"model_name": model_dir.name, "engine": "engine-0"})
    assert preemptions == 0
    assert llm.core.kv_cache_manager.num_free_blocks == 24
