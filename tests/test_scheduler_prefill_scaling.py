"""On an aggregated replica the caps on prompt tokens beside running decodes grow with the
prompts queued (``SchedulerConfig.prefill_caps_scale_with_queue``); a decode replica keeps
them fixed (issue 27 goal 2).

Checked here: which engines scale (by their KV role), the property over random workloads
(no model): every decoding request still gets its token in every step, a step's prompt
tokens stay within the cap times the prompts queued, nothing stalls and the KV pool is whole
at the end; the chunk sizes themselves, one prompt queued against several; and on a real
engine (fp32 tiny Llama) prompts queued behind running decodes come out exactly as Hugging
Face's greedy output, in fewer steps than with fixed caps.
"""

from __future__ import annotations

import random
from dataclasses import replace
from functools import partial
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig

from engine_common.config import (
    CacheConfig,
    EngineConfig,
    KvTransferConfig,
    SchedulerConfig,
)
from engine_common.kv_cache_manager import KVCacheManager
from engine_common.llm import LLM
from engine_common.outputs import ModelRunnerOutput
from engine_common.prefill_outlook import prefill_outlook
from engine_common.request import Request
from engine_common.sampling_params import SamplingParams
from engine_common.scheduler import Scheduler, SchedulerOutput
from engine_common.step_costs import StepCosts
from tests.hf_reference import hf_greedy, random_prompts

BLOCK = 4


def test_an_engine_scales_its_caps_unless_it_is_a_decode_replica():
    assert EngineConfig(model="m").scheduler.prefill_caps_scale_with_queue is True
    producer = EngineConfig(model="m", kv_transfer=KvTransferConfig(role="producer"))
    assert producer.scheduler.prefill_caps_scale_with_queue is True
    consumer = EngineConfig(model="m", kv_transfer=KvTransferConfig(role="consumer"))
    assert consumer.scheduler.prefill_caps_scale_with_queue is False
    chosen = EngineConfig(model="m", scheduler=SchedulerConfig(prefill_caps_scale_with_queue=False))
    assert chosen.scheduler.prefill_caps_scale_with_queue is False
    assert SchedulerConfig().prefill_caps_scale_with_queue is None  # a bare one: fixed


def _finish_step(sched: Scheduler, out: SchedulerOutput, rng: random.Random) -> None:
    sampled = ModelRunnerOutput({s.request.request_id: (rng.randrange(50), None)
                                 for s in out.scheduled if s.completes_sequence})
    sched.update_from_output(out, sampled)
    sched.take_finished_unscheduled()


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 60), min_size=2, max_size=10),
    arrivals=st.lists(st.integers(0, 12), min_size=10, max_size=10),
    cap=st.integers(1, 24),
    max_seqs=st.integers(2, 6),
    num_blocks=st.integers(24, 64),
    seed=st.integers(0, 2**16),
)
def test_scaled_caps_still_run_every_decode_each_step(lengths, arrivals, cap, max_seqs,
                                                      num_blocks, seed):
    rng = random.Random(seed)
    budget = 64
    kv = KVCacheManager(num_blocks=num_blocks, block_size=BLOCK, max_model_len=80)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                      max_prefill_tokens_while_decoding=cap,
                                      max_prefill_time_per_decode_step=0,
                                      prefill_caps_scale_with_queue=True), kv)
    pending = [Request(f"r{i}", [rng.randrange(50) for _ in range(n)],
                       SamplingParams(max_tokens=rng.randint(1, 15), ignore_eos=True),
                       max_model_len=80, block_size=BLOCK) for i, n in enumerate(lengths)]
    due = {r.request_id: arrivals[i] for i, r in enumerate(pending)}
    for _ in range(3000):
        for request in [r for r in pending if due[r.request_id] <= _]:
            pending.remove(request)
            sched.add_request(request)
        if not sched.has_unfinished_requests() and not pending:
            break
        remaining = {r.request_id: r.num_tokens - r.num_computed_tokens for r in sched.running}
        decoding = {rid for rid, n in remaining.items() if n == 1}
        queued = len(sched.waiting) + sum(1 for n in remaining.values() if n > 1)
        out = sched.schedule()
        prefill_tokens = sum(s.num_new_tokens for s in out.scheduled
                             if remaining.get(s.request.request_id, 2) > 1)
        if decoding:
            assert prefill_tokens <= min(budget, cap * max(queued, 1))
            still_running = {r.request_id for r in sched.running}
            assert decoding & still_running <= {s.request.request_id for s in out.scheduled}
        _finish_step(sched, out, rng)
    assert not sched.has_unfinished_requests() and not pending, "the scheduler stalled"
    assert kv.num_free_blocks == num_blocks


def _prompt_chunks(scale: bool, queued_prompts: int) -> list[int]:
    """One request decoding, then ``queued_prompts`` prompts of 100 tokens: the prompt
    tokens of the next step, per prompt."""
    kv = KVCacheManager(num_blocks=256, block_size=BLOCK, max_model_len=200)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=200,
                                      max_prefill_tokens_while_decoding=16,
                                      max_prefill_time_per_decode_step=0,
                                      prefill_caps_scale_with_queue=scale), kv)
    sched.add_request(Request("running", [1, 2, 3], SamplingParams(max_tokens=50),
                              max_model_len=200, block_size=BLOCK))
    _finish_step(sched, sched.schedule(), random.Random(0))  # its prompt: now it decodes
    for i in range(queued_prompts):
        sched.add_request(Request(f"p{i}", [i] * 100, SamplingParams(max_tokens=2),
                                  max_model_len=200, block_size=BLOCK))
    out = sched.schedule()
    assert out.scheduled[0].request.request_id == "running"
    assert out.scheduled[0].num_new_tokens == 1  # the decode first, as always
    return [s.num_new_tokens for s in out.scheduled[1:]]


def test_each_queued_prompt_adds_a_cap_up_to_the_budget():
    assert _prompt_chunks(scale=False, queued_prompts=1) == [16]
    assert _prompt_chunks(scale=True, queued_prompts=1) == [16]  # light load: as before
    assert _prompt_chunks(scale=False, queued_prompts=4) == [16]
    assert _prompt_chunks(scale=True, queued_prompts=4) == [64]  # FCFS: the first one
    # 12 queued: 192 tokens, the first prompt whole and the next in part; never past the
    # budget less the decode.
    assert _prompt_chunks(scale=True, queued_prompts=12) == [100, 92]
    assert sum(_prompt_chunks(scale=True, queued_prompts=40)) == 199


def _queued_behind_decodes(model_dir: Path, scale: bool) -> tuple[list[list[int]], int]:
    """Two streams decoding, then six prompts at once; every output, and the steps taken."""
    llm = LLM(EngineConfig(
        model=str(model_dir), dtype="float32",
        cache=CacheConfig(block_size=16, num_gpu_blocks_override=256),
        scheduler=SchedulerConfig(max_prefill_tokens_while_decoding=16,
                                  max_prefill_time_per_decode_step=0,
                                  prefill_caps_scale_with_queue=scale)))
    vocab = llm.core.arch.vocab_size
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
    ids = [llm.add_request(p, params)[0] for p in random_prompts(vocab, [7, 19], seed=3)]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    steps = 0
    while llm.outputs.num_unfinished:
        if steps == 2:
            for prompt in random_prompts(vocab, [90, 40, 120, 64, 33, 150], seed=4):
                rid = llm.add_request(prompt, params)[0]
                tokens[rid] = []
        for output in llm.step():
            tokens[output.request_id].extend(output.new_token_ids)
        steps += 1
    return list(tokens.values()), steps


def test_prompts_queued_behind_decodes_match_hf_in_fewer_steps(tiny_llama_dir: Path):
    scaled, scaled_steps = _queued_behind_decodes(tiny_llama_dir, scale=True)
    fixed, fixed_steps = _queued_behind_decodes(tiny_llama_dir, scale=False)
    assert scaled == fixed
    vocab_size = AutoConfig.from_pretrained(tiny_llama_dir).vocab_size
    prompts = (random_prompts(vocab_size, [7, 19], seed=3)
               + random_prompts(vocab_size, [90, 40, 120, 64, 33, 150], seed=4))
    assert scaled == hf_greedy(tiny_llama_dir, prompts, 12)
    # 497 prompt tokens at 16 a step took fixed caps over 30 steps; scaled, a handful.
    assert fixed_steps >= 30 and scaled_steps < fixed_steps - 15, (scaled_steps, fixed_steps)


def test_only_a_decode_replica_caps_prompt_chunks_by_time():
    """Measured costs that allow less than a block (a stale decode-step estimate does that
    under load): a decode replica's prompt moves on by a block a step, queue or not; an
    aggregated replica's takes its token caps, a lone prompt too (issue 39: a lone long
    prompt chunked by time waited 1.8x vllm serve's TTFT)."""
    def chunks(scale: bool, queued_prompts: int) -> list[int]:
        kv = KVCacheManager(num_blocks=256, block_size=BLOCK, max_model_len=200)
        sched = Scheduler(SchedulerConfig(max_num_batched_tokens=200,
                                          max_prefill_tokens_while_decoding=64,
                                          max_prefill_time_per_decode_step=1.0,
                                          prefill_caps_scale_with_queue=scale), kv)
        sched.add_request(Request("running", [1, 2, 3], SamplingParams(max_tokens=50),
                                  max_model_len=200, block_size=BLOCK))
        _finish_step(sched, sched.schedule(), random.Random(0))
        sched.step_costs = StepCosts(decode_step_s=0.01, prefill_token_s=1.0)
        for i in range(queued_prompts):
            sched.add_request(Request(f"p{i}", [i] * 100, SamplingParams(max_tokens=2),
                                      max_model_len=200, block_size=BLOCK))
        return [s.num_new_tokens for s in sched.schedule().scheduled[1:]]

    assert chunks(scale=False, queued_prompts=1) == [BLOCK]
    assert chunks(scale=False, queued_prompts=3) == [BLOCK]
    assert chunks(scale=True, queued_prompts=1) == [64]
    assert chunks(scale=True, queued_prompts=2) == [100, 28]
    assert chunks(scale=True, queued_prompts=3) == [100, 92]


def test_what_a_scheduler_publishes_for_time_to_first_token_estimates():
    """``engine_common.prefill_outlook``: the prompt tokens queued (waiting and being
    prefilled), the recent prompt rate (a few prompt tokens beside many decodes, their fixed
    cost charged to them, do not drag it down as they do the chunk-sizing cost) and the step
    share a new prompt gets beside running decodes (1 without them)."""
    costs = StepCosts()
    costs.observe(prefill_tokens=1000, decodes=0, seconds=0.5)
    costs.observe(prefill_tokens=0, decodes=8, seconds=0.05)
    costs.observe(prefill_tokens=2, decodes=8, seconds=0.08)
    assert costs.prefill_token_s == 0.015  # 30 ms for 2 tokens: the chunk sizer's safe side
    assert costs.prefill_tokens_per_s == (0.9 * 1000 + 2) / (0.9 * 0.5 + 0.03)  # ~1879
    config = SchedulerConfig(max_num_batched_tokens=200, max_prefill_tokens_while_decoding=64,
                             max_prefill_time_per_decode_step=1.0)
    kv = KVCacheManager(num_blocks=256, block_size=BLOCK, max_model_len=200)
    sched = Scheduler(config, kv)
    sched.add_request(Request("running", [1, 2, 3], SamplingParams(max_tokens=50),
                              max_model_len=200, block_size=BLOCK))
    assert sched.make_stats().prefill_share == 1.0  # nothing decodes yet
    _finish_step(sched, sched.schedule(), random.Random(0))
    sched.step_costs = StepCosts(decode_step_s=0.01, prefill_token_s=0.001)
    sched.step_costs.observe(prefill_tokens=100, decodes=0, seconds=0.1)
    sched.add_request(Request("queued", [7] * 90, SamplingParams(max_tokens=2),
                              max_model_len=200, block_size=BLOCK))
    stats = sched.make_stats()
    assert stats.num_prefill_tokens_queued == 90
    assert stats.prefill_tokens_per_s == 1000.0
    # Beside the decode, a chunk of 10 tokens (one decode step's time): half of each step.
    assert stats.prefill_share == 0.5


def test_an_aggregated_replica_publishes_its_token_cap_share():
    """No time cap on an aggregated replica: a new prompt's share beside the decodes is the
    token cap's chunk, as its scheduler will give it, not a decode step's worth."""
    costs = StepCosts(decode_step_s=0.01, prefill_token_s=0.001)
    fixed = SchedulerConfig(max_num_batched_tokens=200, max_prefill_tokens_while_decoding=64,
                            max_prefill_time_per_decode_step=1.0)
    scaled = replace(fixed, prefill_caps_scale_with_queue=True)
    outlook = partial(prefill_outlook, costs, queued_tokens=0, decoding=True, block_size=BLOCK)
    assert outlook(fixed).share == 0.5  # 10 tokens, one decode step's time
    assert outlook(scaled).share == 0.064 / (0.01 + 0.064)  # the 64-token cap
