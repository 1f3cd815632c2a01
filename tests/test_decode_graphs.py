"""The GPU step path off the GPU: the Triton backend inside the engine, and padded static decode.

The engine runs with ``attention_backend="triton"`` (its kernels in Triton's interpreter,
conftest sets TRITON_INTERPRET=1 without CUDA; compiled, on the GPU, where there is one) and
must give Hugging Face's greedy tokens,
through chunked prefill and prefix-cache hits. Then decode steps go through
``DecodeGraphRunner`` with ``capture=False``: the same static buffers, padded batch sizes
and fixed split plan that CUDA graph replay uses, run eagerly. Padding rows must write no
KV and change no real sequence's tokens.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from engine_common.config import CacheConfig, EngineConfig, SchedulerConfig
from engine_common.decode_graphs import DecodeInputs, capture_sizes
from engine_common.llm import LLM
from engine_common.sampling_params import SamplingParams
from tests.hf_reference import hf_greedy, random_prompts

MAX_TOKENS = 6
# The reference runs longer, for the requests that generate past MAX_TOKENS.
REFERENCE_TOKENS = MAX_TOKENS + 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
# Compiled Triton kernels take CUDA tensors only: on a GPU host these tests run there (still
# uncaptured; tests/test_gpu_engine.py replays real CUDA graphs).
DEVICE = ("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
          else "cpu")


def triton_engine(model_dir: Path, *, static_decode: bool, budget: int = 512,
                  max_batch_size: int = 256) -> LLM:
    llm = LLM(EngineConfig(
        model=str(model_dir), dtype="float32", device=DEVICE, attention_backend="triton",
        cuda_graph_max_batch_size=max_batch_size,
        cache=CacheConfig(block_size=4, num_gpu_blocks_override=256),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=16),
    ))
    assert llm.core.model_runner.model.attention_backend.name == "triton"
    if static_decode:
        runner = llm.core.model_runner
        runner.decode_graphs = runner.static_decode_runner(llm.core.max_model_len, capture=False)
    return llm


@pytest.fixture(scope="module")
def prompts_and_expected(tiny_llama_dir):
    shared = random_prompts(128, [13], seed=7)[0]
    prompts = random_prompts(128, [1, 6, 17, 9, 30], seed=5)
    prompts += [shared + tail for tail in random_prompts(128, [2, 5], seed=6)]
    return prompts, hf_greedy(tiny_llama_dir, prompts, REFERENCE_TOKENS)


def test_capture_ladder():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(24) == [1, 2, 4, 8, 16, 24]
    assert capture_sizes(30) == [1, 2, 4, 8, 16, 24, 30]
    with pytest.raises(ValueError, match=">= 1"):
        capture_sizes(0)


def test_triton_backend_engine_matches_hf(tiny_llama_dir, prompts_and_expected):
    prompts, expected = prompts_and_expected
    llm = triton_engine(tiny_llama_dir, static_decode=False, budget=8)  # every prompt > 8 chunks
    results = llm.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == [e[:MAX_TOKENS] for e in expected]
    assert results[-1].num_cached_tokens > 0  # the shared prefix was a cache hit


def test_padded_static_decode_matches_hf(tiny_llama_dir, prompts_and_expected):
    prompts, expected = prompts_and_expected
    llm = triton_engine(tiny_llama_dir, static_decode=True)
    graphs = llm.core.model_runner.decode_graphs
    assert graphs is not None
    # 7 sequences decode together at padded size 8; submitted one by one, the batch also
    # runs at sizes 1, 2, 4 and 8 with different numbers of padding rows.
    results = llm.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == [e[:MAX_TOKENS] for e in expected]
    assert graphs.num_steps >= MAX_TOKENS - 1


def test_batches_above_the_limit_run_eagerly(tiny_llama_dir, prompts_and_expected):
    prompts, expected = prompts_and_expected
    llm = triton_engine(tiny_llama_dir, static_decode=True, max_batch_size=2)
    graphs = llm.core.model_runner.decode_graphs
    assert graphs is not None and graphs.sizes == [1, 2]
    # Shorter requests finish early, so the tail of the run decodes 1-2 sequences.
    lengths = [MAX_TOKENS] * 5 + [REFERENCE_TOKENS - 1, REFERENCE_TOKENS]
    params = [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n) for n in lengths]
    results = llm.generate(prompts, params)
    assert [r.token_ids for r in results] == [e[:n] for e, n in zip(expected, lengths, strict=True)]
    assert graphs.num_steps >= 3


def test_padding_rows_write_no_kv(tiny_llama_dir):
    llm = triton_engine(tiny_llama_dir, static_decode=False)
    runner = llm.core.model_runner
    graphs = runner.static_decode_runner(llm.core.max_model_len, capture=False)
    cache = runner.kv_cache
    cache.normal_()
    before = cache.clone()
    block_size = runner.block_size
    # Three sequences (padded to 4) with contexts of 5, 1 and 9 tokens.
    seq_lens = [5, 1, 9]
    block_tables = np.array([[3, 4, 0], [7, 0, 0], [10, 11, 12]], dtype=np.int32)
    positions = np.array([n - 1 for n in seq_lens], dtype=np.int64)
    slots = np.array([block_tables[i, p // block_size] * block_size + p % block_size
                      for i, p in enumerate(positions)], dtype=np.int64)
    hidden = graphs.run(DecodeInputs(np.array([5, 6, 7], dtype=np.int64), positions, slots,
                                     seq_lens, block_tables))
    assert hidden.shape[0] == 3 and torch.isfinite(hidden).all()
    # [blocks, layers, 2, kv_heads, block_size, head] -> written slots (block * size + offset)
    changed = (cache != before).any(dim=-1).any(dim=3).any(dim=2).any(dim=1)
    written = changed.flatten().nonzero().flatten().tolist()
    assert written == sorted(slots.tolist())


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_warm_up_runs_both_prefill_tilings_and_leaves_the_cache_zeroed(tiny_llama_dir, backend):
    llm = LLM(EngineConfig(model=str(tiny_llama_dir), dtype="float32", device=DEVICE,
                           attention_backend=backend,
                           cache=CacheConfig(block_size=4, num_gpu_blocks_override=64)))
    runner = llm.core.model_runner
    steps = []
    execute = runner.execute
    runner.execute = lambda out, **kw: steps.append(
        [s.num_new_tokens for s in out.scheduled]) or execute(out, **kw)
    runner.kv_cache.normal_()
    runner.warm_up()
    assert steps == [[64, 1], [2, 1]]
    assert not runner.kv_cache.any()
