"""Speculative decoding by n-gram lookup: the drafter, and the engine's output against
Hugging Face and against the engine without speculation.

Greedy speculation must not change a single token: the engine with drafts must equal HF's
greedy ``generate`` (fp32) and the engine without drafts, whatever else runs beside it
(sampled requests, chunked prefills), when a stop token or ``max_tokens`` falls inside a
run of accepted drafts, and under preemption. Seeded sampled requests (with penalties,
logit bias, min_tokens) must keep their tokens too, and logprobs must be each position's own. The drafts must actually be proposed and
accepted (counted in the metrics), or the test proves nothing.
"""

from __future__ import annotations

import argparse
import json
import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deploy.cli import add_suite_args, suite_config
from deploy.suite_plan import plan_suite
from engine_common.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from engine_common.llm import LLM
from engine_common.ngram_drafter import NgramDrafter
from engine_common.sampling_params import SamplingParams
from engine_common.structured_output.spec import StructuredOutputSpec
from services.replica.main import build_parser, options_from_args
from tandem.client import Client
from tests.hf_reference import hf_greedy, random_prompts
from tests.replica_process import start_replicas

SPEC = SpeculativeConfig(num_tokens=4, ngram_min=1, ngram_max=3, max_batch_size=8)


# --------------------------------------------------------------------------- the drafter


def test_drafter_continues_the_latest_longest_match():
    drafter = NgramDrafter(SpeculativeConfig(num_tokens=3, ngram_min=1, ngram_max=3))
    # "7 8 9" occurred twice; the latest occurrence was followed by 4 5 6.
    assert drafter.propose([7, 8, 9, 1, 2, 7, 8, 9, 4, 5, 6, 0, 7, 8, 9], 10) == [4, 5, 6]
    # A longer match wins over a more recent shorter one: "2 3" -> 4, not "3" -> 9.
    assert drafter.propose([2, 3, 4, 1, 3, 9, 5, 2, 3], 10) == [4, 1, 3]
    assert drafter.propose([1, 2, 3, 1, 2, 3, 1, 2], 2) == [3, 1]  # capped by the caller
    # A match near the end continues as an overlapping copy: the loop repeats.
    assert drafter.propose([4, 9, 1, 2, 1, 2], 10) == [1, 2, 1]
    assert drafter.propose([4, 7, 7], 10) == [7, 7, 7]
    assert drafter.propose([1, 2, 3, 4], 5) == []  # nothing repeats
    assert drafter.propose([5], 5) == [] and drafter.propose([5, 5], 0) == []
    with pytest.raises(ValueError, match="ngram_min"):
        NgramDrafter(SpeculativeConfig(num_tokens=2, ngram_min=3, ngram_max=2))


# --------------------------------------------------------------------------- the engine


def engine(model_dir: Path, speculative: SpeculativeConfig | None = None, *,
           budget: int = 512, num_blocks: int = 512, max_num_seqs: int = 16,
           reserve_output_room: bool = True) -> LLM:
    return LLM(EngineConfig(
        model=str(model_dir), dtype="float32",
        cache=CacheConfig(block_size=4, num_gpu_blocks_override=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                  reserve_output_room=reserve_output_room),
        speculative=speculative or SpeculativeConfig()))


def spec_counts(llm: LLM, model_dir: Path) -> tuple[float, float]:
    labels = {"model_name": model_dir.name, "engine": "engine-0"}
    get = llm.metrics.registry.get_sample_value
    return (get("vllm:spec_decode_num_draft_tokens_total", labels) or 0.0,
            get("vllm:spec_decode_num_accepted_tokens_total", labels) or 0.0)


MAX_TOKENS = 40
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def prompts(tiny_llama_dir: Path) -> list[list[int]]:
    # Prompts that repeat themselves, so drafts come from the prompt as well as the output.
    base = random_prompts(390, [6, 9, 12], seed=5)
    return [p * 3 for p in base]


def test_greedy_output_equals_hf_with_drafts_accepted(tiny_llama_dir, prompts):
    llm = engine(tiny_llama_dir, SPEC)
    results = llm.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == hf_greedy(tiny_llama_dir, prompts, MAX_TOKENS)
    drafted, accepted = spec_counts(llm, tiny_llama_dir)
    assert drafted > 0 and accepted > 0, (drafted, accepted)


def test_drafts_change_nothing_beside_sampling_chunking_and_stops(tiny_llama_dir, prompts):
    """One batch: greedy requests (some with a stop token, one cut by max_tokens inside a
    run of drafts, one with a stop string that several kept drafts reach at once), a seeded
    sampled request and a long prompt chunked by a small budget; with and without
    speculation, every output is the same."""
    plain = engine(tiny_llama_dir, budget=24).generate(prompts, GREEDY)
    # A token the first output produces late: the stop falls mid-stream.
    stop_token = plain[0].token_ids[25]
    # Two tokens that alternate (see test_sampled_requests_keep_their_seeded_tokens), so
    # that drafts are kept, and a stop string spanning a few of them, late in the text.
    x, y = plain[2].token_ids[3], plain[2].token_ids[5]
    pattern = {"logit_bias": {x: 20.0, y: 20.0}, "frequency_penalty": 1.0}
    looped = engine(tiny_llama_dir).generate(
        [prompts[2]], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, **pattern))[0]
    stop_text = looped.text[-12:-5]
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=3, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[stop_text], **pattern),
    ]
    batch = [*prompts, prompts[0] * 4, prompts[2]]

    def run(speculative: SpeculativeConfig | None) -> list[tuple[list[int], str, str | None]]:
        llm = engine(tiny_llama_dir, speculative, budget=24)
        results = llm.generate(batch, params)
        if speculative is not None:
            assert spec_counts(llm, tiny_llama_dir)[1] > 0
        return [(r.token_ids, r.text, r.finish_reason) for r in results]

    outputs = run(SPEC)
    assert outputs == run(None)
    assert outputs[-1][2] == "stop" and stop_text not in outputs[-1][1]


def test_logprobs_of_kept_drafts_are_their_positions_own(tiny_llama_dir, prompts):
    """A request with logprobs speculates too: every token, kept draft or not, carries the
    logprob, rank and top tokens one token per step gives it (float32: equal to rounding)."""
    plain = engine(tiny_llama_dir).generate(prompts[2:], GREEDY)[0]
    # Two tokens that alternate (see the test above), so that drafts are kept; the logprobs
    # see the bias and the penalty, which counts the kept drafts before each position.
    pattern = {"logit_bias": {plain.token_ids[3]: 20.0, plain.token_ids[5]: 20.0},
               "frequency_penalty": 1.0}
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS,
                             logprobs=3),
              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS,
                             logprobs=3, **pattern),
              SamplingParams(temperature=0.5, seed=21, max_tokens=MAX_TOKENS, ignore_eos=True,
                             logprobs=0, **pattern)]
    batch = [prompts[0], prompts[2], prompts[2]]

    def run(speculative: SpeculativeConfig | None) -> list[tuple[list[int], list[Any]]]:
        llm = engine(tiny_llama_dir, speculative)
        results = llm.generate(batch, params)
        if speculative is not None:
            assert spec_counts(llm, tiny_llama_dir)[1] > 10
        return [(r.token_ids, r.logprobs) for r in results]

    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(run(SPEC), run(None),
                                                                strict=True):
        assert tokens == want_tokens and len(logprobs) == len(tokens)
        for got, want in zip(logprobs, want_logprobs, strict=True):
            assert (got.token_id, got.rank) == (want.token_id, want.rank)
            assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
            assert [t for t, _ in got.top] == [t for t, _ in want.top]


def test_preemption_with_drafts(tiny_llama_dir, prompts):
    llm = engine(tiny_llama_dir, SPEC, num_blocks=40, reserve_output_room=False)
    results = llm.generate(prompts * 2, GREEDY)
    assert [r.token_ids for r in results] == hf_greedy(tiny_llama_dir, prompts, MAX_TOKENS) * 2
    assert llm.core.kv_cache_manager.num_free_blocks == 40


def test_no_drafts_above_the_batch_limit(tiny_llama_dir, prompts):
    llm = engine(tiny_llama_dir, SpeculativeConfig(num_tokens=4, ngram_min=1, max_batch_size=2))
    llm.generate(prompts, GREEDY)  # three at once: above the limit until one finishes
    narrow = spec_counts(llm, tiny_llama_dir)[0]
    wide = engine(tiny_llama_dir, SPEC)
    wide.generate(prompts, GREEDY)
    assert narrow < spec_counts(wide, tiny_llama_dir)[0]


def test_a_replica_started_with_speculation_serves_the_same_text(tiny_llama_dir, prompts,
                                                                 tmp_path):
    """``--speculative-ngram`` reaches the engine of a real replica process: its greedy
    output equals the offline engine's without speculation, and its metrics count the drafts
    it checked."""
    replica = start_replicas(tiny_llama_dir, tmp_path, {"spec": [
        "--dtype", "float32", "--kv-cache-memory", "16MiB", "--speculative-ngram", "4"]})["spec"]
    try:
        with Client(replica.target, timeout=60) as client:
            texts = [client.complete(p, max_tokens=MAX_TOKENS, temperature=0,
                                     min_tokens=MAX_TOKENS).text for p in prompts]
        body = urllib.request.urlopen(replica.metrics_url, timeout=10).read().decode()
    finally:
        replica.kill()
    assert texts == [r.text for r in engine(tiny_llama_dir).generate(prompts, GREEDY)]
    drafted = sum(sample.value for family in text_string_to_metric_families(body)
                  for sample in family.samples
                  if sample.name == "vllm:spec_decode_num_draft_tokens_total")
    assert drafted > 0


def test_tandem_up_passes_speculation_to_its_replicas():
    parser = argparse.ArgumentParser()
    add_suite_args(parser)
    suite = plan_suite(suite_config(parser.parse_args(["--speculative-ngram", "3"])))
    replicas = [spec.argv for spec in suite.specs if "services.replica" in spec.argv]
    assert replicas and all(
        argv[argv.index("--speculative-ngram") + 1] == "3" for argv in replicas)
    plain = plan_suite(suite_config(parser.parse_args([])))
    assert all("--speculative-ngram" not in spec.argv for spec in plain.specs)


def test_replica_flags_configure_speculation(tiny_llama_dir):
    parser = build_parser()
    options = options_from_args(parser.parse_args([
        "--model", str(tiny_llama_dir), "--speculative-ngram", "3",
        "--speculative-ngram-range", "1:5", "--speculative-max-batch", "2"]))
    assert options.engine.speculative == SpeculativeConfig(
        num_tokens=3, ngram_min=1, ngram_max=5, max_batch_size=2)
    assert options_from_args(parser.parse_args(["--model", str(tiny_llama_dir)])).engine \
        .speculative.num_tokens == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-ngram-range", "4:2"])


def test_sampled_requests_keep_their_seeded_tokens(tiny_llama_dir, prompts):
    """Sampled requests speculate too: a draft is kept when the token sampled before it
    equals it. Seeded, each request's tokens are the same with drafts as without: the
    penalties and ``min_tokens`` see the drafts as output, and the generator is rewound to
    one draw per kept token (without the rewind, the next step's draw is off)."""
    plain = engine(tiny_llama_dir).generate(prompts, GREEDY)
    # Two tokens biased far above the rest, with a frequency penalty: which of the two comes
    # next depends on how often each came before, drafts kept in this step included.
    biased = {plain[2].token_ids[3]: 20.0, plain[2].token_ids[5]: 20.0}
    params = [
        SamplingParams(temperature=0.3, seed=11, max_tokens=MAX_TOKENS, top_p=0.9,
                       ignore_eos=True),
        SamplingParams(temperature=0.5, seed=12, max_tokens=MAX_TOKENS, top_k=20, min_p=0.05,
                       repetition_penalty=1.1, presence_penalty=0.2, min_tokens=30,
                       stop_token_ids=[plain[1].token_ids[10]]),
        SamplingParams(temperature=0.4, seed=13, max_tokens=MAX_TOKENS, ignore_eos=True,
                       logit_bias=biased, frequency_penalty=1.0),
        # The same, with one of the two a stop token under min_tokens: it ends the request
        # at the first position min_tokens allows, inside a step of drafts or not.
        *(SamplingParams(temperature=0.4, seed=14, max_tokens=MAX_TOKENS, min_tokens=n,
                         stop_token_ids=[plain[2].token_ids[3]], logit_bias=biased,
                         frequency_penalty=1.0) for n in (6, 7)),
    ]

    def run(speculative: SpeculativeConfig | None) -> list[list[int]]:
        llm = engine(tiny_llama_dir, speculative)
        results = [r.token_ids for r in llm.generate(prompts + [prompts[2]] * 2, params)]
        if speculative is not None:
            drafted, accepted = spec_counts(llm, tiny_llama_dir)
            assert accepted > 0 and accepted < drafted, (drafted, accepted)
        return results

    assert run(SPEC) == run(None)


REPEAT = "(alpha bravo )+charlie"


def test_grammar_requests_speculate_inside_their_grammar(tiny_llama_dir, prompts):
    """Structured outputs speculate: only the drafts the grammar allows are run, each
    position is masked with the grammar's state after the drafts before it, and the kept
    drafts advance the request's grammar. Greedy, seeded and deferred (the grammar starts
    after a trigger token) outputs are the same as without drafts, and valid."""
    free = engine(tiny_llama_dir).generate(
        [prompts[0]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    trigger = free.token_ids[4]
    array = {"type": "array", "items": {"enum": ["alpha", "bravo"]}, "minItems": 4,
             "maxItems": 4}
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                       structured_output=StructuredOutputSpec.parse("regex", REPEAT)),
        SamplingParams(temperature=0.7, seed=9, max_tokens=MAX_TOKENS,
                       structured_output=StructuredOutputSpec.parse("json_schema",
                                                                    json.dumps(array))),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                       structured_output=StructuredOutputSpec.parse(
                           "regex", REPEAT, starts_after=(trigger,))),
    ]

    def run(speculative: SpeculativeConfig | None) -> list[tuple[list[int], str]]:
        # Three sequences, up to 15 masked rows a step: more than the bitmask's first size.
        llm = engine(tiny_llama_dir, speculative, max_num_seqs=3)
        results = llm.generate([prompts[0]] * 3, params)
        if speculative is not None:
            assert spec_counts(llm, tiny_llama_dir)[1] > 10
        return [(r.token_ids, r.text) for r in results]

    outputs = run(SPEC)
    assert outputs == run(None)
    (_, repeated), (_, listed), (deferred_ids, _) = outputs
    assert re.fullmatch(REPEAT, repeated) or len(outputs[0][0]) == MAX_TOKENS, repeated
    assert json.loads(listed) and set(json.loads(listed)) <= {"alpha", "bravo"}
    start = deferred_ids.index(trigger) + 1
    assert deferred_ids[:start] == free.token_ids[:start]
