"""The offline engine API's contract: clear errors for bad input, seeded sampling, stops.

Bad sampling values, an over-long prompt and a missing model directory raise errors that
say what to change; seeded sampling through the whole engine is reproducible and seeds
matter; stop strings end generation and are excluded from the text; max_tokens and
min_tokens hold; aborting frees every block.
"""

from __future__ import annotations

import pytest

from engine_common.config import CacheConfig, EngineConfig
from engine_common.input_processor import InvalidRequestError
from engine_common.llm import LLM
from engine_common.sampling_params import SamplingParams, SamplingParamsError


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(EngineConfig(model=str(tiny_llama_dir), cache=CacheConfig(num_gpu_blocks_override=128)))


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"temperature": -0.5}, "temperature must be non-negative"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p must be in (0, 1]"),
    ({"top_p": 1.5}, "top_p must be in (0, 1]"),
    ({"top_k": -3}, "top_k"),
    ({"min_p": 2.0}, "min_p"),
    ({"max_tokens": 0}, "max_tokens must be at least 1"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens (5) must not exceed max_tokens (2)"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"logprobs": 50}, "logprobs"),
    ({"stop": [""]}, "stop strings must be non-empty"),
])
def test_bad_sampling_parameters_raise_clear_errors(kwargs, words):
    with pytest.raises(SamplingParamsError) as error:
        SamplingParams(**kwargs)
    assert words in str(error.value)


def test_prompt_longer_than_the_context_is_refused(llm):
    too_long = [5] * llm.core.max_model_len
    with pytest.raises(InvalidRequestError, match="context length"):
        llm.generate([too_long], SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError, match="lower max_tokens"):
        llm.generate([[5] * 10], SamplingParams(max_tokens=llm.core.max_model_len))
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([""], SamplingParams())


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="local Hugging Face model directory"):
        LLM(EngineConfig(model=str(tmp_path / "no-such-model")))


def test_seeded_sampling_is_reproducible_and_seeds_matter(llm):
    prompts = ["the quick brown fox", "once upon a time"]

    def run(seed: int) -> list[list[int]]:
        params = SamplingParams(temperature=1.0, top_p=0.95, seed=seed, max_tokens=12, ignore_eos=True)
        return [r.token_ids for r in llm.generate(prompts, params)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_stop_string_ends_generation_and_is_excluded(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    [full] = llm.generate(["once upon a time"], greedy)
    # A stop string taken from the middle of the greedy text, spanning whatever tokens it does.
    text = full.text
    stop = text[len(text) // 3 : len(text) // 3 + 4]
    assert stop.strip(), "the tiny model produced blank text; pick another prompt"
    [stopped] = llm.generate(["once upon a time"], SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]))
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == text[: text.index(stop)]
    assert len(stopped.token_ids) < len(full.token_ids)


def test_max_and_min_tokens_hold_and_abort_frees_blocks(llm):
    [r] = llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=5, min_tokens=5))
    assert len(r.token_ids) == 5 and r.finish_reason == "length"
    request_id, _ = llm.add_request("hello there", SamplingParams(max_tokens=50, ignore_eos=True))
    llm.step()
    llm.abort([request_id])
    manager = llm.core.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks
    assert not llm.core.has_unfinished_requests()


def test_request_phases_and_step_tokens_reach_the_metrics(tiny_llama_dir):
    """vLLM's per-phase histograms: every finished request records its queue, prefill,
    decode and inference times, which add up (queue + inference = end to end, prefill +
    decode = inference); the steps' token counts add up to the work done."""
    llm = LLM(EngineConfig(model=str(tiny_llama_dir), cache=CacheConfig(
        num_gpu_blocks_override=128, enable_prefix_caching=False)))
    prompts = [[5 + i] * (10 + 3 * i) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm.generate(prompts, params)

    def sample(name: str) -> float:
        value = llm.metrics.registry.get_sample_value(
            name, {"model_name": tiny_llama_dir.name, "engine": "engine-0"})
        assert value is not None, name
        return value

    for phase in ("queue", "prefill", "decode", "inference"):
        assert sample(f"vllm:request_{phase}_time_seconds_count") == 4
    queue, inference = (sample(f"vllm:request_{p}_time_seconds_sum") for p in ("queue", "inference"))
    prefill, decode = (sample(f"vllm:request_{p}_time_seconds_sum") for p in ("prefill", "decode"))
    assert prefill + decode == pytest.approx(inference, abs=1e-6)
    assert queue + inference == pytest.approx(
        sample("vllm:e2e_request_latency_seconds_sum"), abs=1e-6)
    # Every prompt token once, and every output token but the last (never fed back).
    assert sample("vllm:iteration_tokens_total_sum") == sum(map(len, prompts)) + 4 * 5
    # vLLM's per-request time per output token: the decode time over the tokens after the
    # first; and the max_tokens each request asked for.
    assert sample("vllm:request_time_per_output_token_seconds_count") == 4
    assert sample("vllm:request_time_per_output_token_seconds_sum") == pytest.approx(
        decode / 5, abs=1e-6)
    assert sample("vllm:request_params_max_tokens_count") == 4
    assert sample("vllm:request_params_max_tokens_sum") == 4 * 6
    # Token-count buckets run 1, 2, 5, ... up to the context length, as vLLM's.
    max_model_len = llm.core.max_model_len
    top = max(float(s.labels["le"]) for s in _samples(llm, "vllm:request_prompt_tokens_bucket")
              if s.labels["le"] != "+Inf")
    assert top <= max_model_len < 2.5 * top
    # The process's own metrics, as vLLM's default registry has them.
    assert llm.metrics.registry.get_sample_value("process_cpu_seconds_total") > 0


def _samples(llm: LLM, name: str) -> list:
    return [s for metric in llm.metrics.registry.collect() for s in metric.samples
            if s.name == name]
