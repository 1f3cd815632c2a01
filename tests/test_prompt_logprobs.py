"""Prompt logprobs (``SamplingParams.prompt_logprobs``) in the engine, against Hugging Face.

Position i > 0 of a prompt gets the logprob of token i given tokens 0..i-1, its rank and the
top alternatives: the log-softmax of the model's logits at position i - 1, which HF computes
in one forward pass over the prompt. The engine must give the same numbers whether the
prompt runs in one step or in chunks (chunked prefill), whether the prefix cache already
holds it (the request must skip the cache) and when the request is preempted halfway
through its prompt (the recompute must not score a position twice).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_common.config import CacheConfig, EngineConfig, SchedulerConfig
from engine_common.llm import LLM, GenerationResult
from engine_common.request import Request
from engine_common.sampling_params import SamplingParams, SamplingParamsError
from engine_common.scheduler import Scheduler
from tests.hf_reference import random_prompts

TOP = 3
# fp32 on both sides; the engine's attention and matmuls are ordered differently.
ATOL = 1e-4


def engine(model_dir: Path, *, budget: int = 512, num_blocks: int = 256,
           reserve_output_room: bool = True) -> LLM:
    return LLM(EngineConfig(
        model=str(model_dir), dtype="float32",
        cache=CacheConfig(block_size=4, num_gpu_blocks_override=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=16,
                                  reserve_output_room=reserve_output_room),
    ))


def hf_log_softmax(model_dir: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Each prompt's [len, vocab] log-softmax from HF, one forward pass per prompt."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model(torch.tensor([p])).logits[0].float().log_softmax(-1) for p in prompts]


def check_against_hf(result: GenerationResult, prompt: list[int], reference: torch.Tensor,
                     num_top: int = TOP) -> None:
    entries = result.prompt_logprobs
    assert entries is not None and len(entries) == len(prompt)
    assert entries[0] is None
    for position in range(1, len(prompt)):
        entry = entries[position]
        assert entry is not None
        expected = reference[position - 1]
        token = prompt[position]
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(expected[token].item(), abs=ATOL)
        assert entry.rank == int((expected > expected[token]).sum()) + 1
        assert len(entry.top) == num_top
        top_values, _ = expected.topk(num_top)
        for (token_id, logprob), value in zip(entry.top, top_values.tolist(), strict=True):
            assert logprob == pytest.approx(value, abs=ATOL)
            assert expected[token_id].item() == pytest.approx(value, abs=ATOL)


@pytest.fixture(scope="module")
def prompts_and_reference(tiny_llama_dir: Path) -> tuple[list[list[int]], list[torch.Tensor]]:
    vocab = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir)).config.vocab_size
    prompts = random_prompts(vocab, [1, 2, 37, 61], seed=11)
    return prompts, hf_log_softmax(tiny_llama_dir, prompts)


def with_prompt_logprobs(max_tokens: int = 2) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, prompt_logprobs=TOP)


@pytest.mark.parametrize("budget", [512, 16], ids=["one-step", "chunked"])
def test_prompt_logprobs_equal_hf(tiny_llama_dir, prompts_and_reference, budget):
    prompts, reference = prompts_and_reference
    results = engine(tiny_llama_dir, budget=budget).generate(prompts, with_prompt_logprobs())
    for result, prompt, expected in zip(results, prompts, reference, strict=True):
        check_against_hf(result, prompt, expected)
        assert len(result.token_ids) == 2


def test_only_the_asking_request_gets_them_and_zero_top_means_none(tiny_llama_dir,
                                                                   prompts_and_reference):
    prompts, reference = prompts_and_reference
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    zero_top = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0)
    results = engine(tiny_llama_dir).generate(prompts[2:], [plain, zero_top])
    assert results[0].prompt_logprobs is None
    check_against_hf(results[1], prompts[3], reference[3], num_top=0)
    # Asking for prompt logprobs changes nothing in the output.
    assert results[1].token_ids == engine(tiny_llama_dir).generate([prompts[3]], plain)[0].token_ids


def test_a_cached_prompt_is_computed_again(tiny_llama_dir, prompts_and_reference):
    prompts, reference = prompts_and_reference
    llm = engine(tiny_llama_dir)
    warm = llm.generate([prompts[3]], SamplingParams(temperature=0.0, max_tokens=2))[0]
    again = llm.generate([prompts[3]], SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert again.num_cached_tokens > 0  # the cache holds the prompt ...
    scored = llm.generate([prompts[3]], with_prompt_logprobs())[0]
    assert scored.num_cached_tokens == 0  # ... yet the scoring request computes all of it
    check_against_hf(scored, prompts[3], reference[3])
    assert scored.token_ids == warm.token_ids


def test_preemption_halfway_through_the_prompt(tiny_llama_dir, prompts_and_reference,
                                               monkeypatch):
    """Chunks of 8 tokens and 24 blocks of 4 for 4 prompts that decode 40 tokens each: the
    scheduler preempts requests whose prompt is partly scored; each position is still
    scored once, and equal to HF."""
    prompts, reference = prompts_and_reference
    halfway: list[str] = []
    preempt = Scheduler._preempt

    def spy(self: Scheduler, request: Request) -> None:
        if 1 < request.next_prompt_logprob_position < request.num_prompt_tokens:
            halfway.append(request.request_id)
        preempt(self, request)

    monkeypatch.setattr(Scheduler, "_preempt", spy)
    llm = engine(tiny_llama_dir, budget=8, num_blocks=24, reserve_output_room=False)
    long_prompts = [prompts[2], prompts[3], prompts[3][::-1], prompts[2][::-1]]
    results = llm.generate(long_prompts, with_prompt_logprobs(max_tokens=40))
    assert halfway, "no request was preempted with its prompt partly scored"
    for result, prompt, expected in zip(
            results, long_prompts, hf_log_softmax(tiny_llama_dir, long_prompts), strict=True):
        check_against_hf(result, prompt, expected)
    assert llm.core.kv_cache_manager.num_free_blocks == 24


@pytest.mark.parametrize("value", [-1, 21])
def test_out_of_range_is_refused(value):
    with pytest.raises(SamplingParamsError, match="prompt_logprobs must be between 0 and 20"):
        SamplingParams(prompt_logprobs=value)
