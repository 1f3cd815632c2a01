"""Structured outputs: xgrammar compiling a request's constraint, the engine enforcing it, and
the request path through a real replica and the gateway.

The engine's greedy output under a grammar must equal HF ``generate`` with the same compiled
grammar's mask applied by a logits processor, token for token, and must parse (JSON), match
(regex) or be one of the choices. Rows without a grammar in the same batch are unaffected;
a grammar's termination ends a request with "stop" (even under ignore_eos, and over a
min_tokens it cannot honour), max_tokens with "length"; P and D together produce what one
engine does. Through the public API, ``response_format`` and ``structured_outputs`` reach
the engine, and a constraint that cannot compile is INVALID_ARGUMENT naming the problem.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
import xgrammar as xgr
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from engine_common.config import CacheConfig, EngineConfig, SchedulerConfig
from engine_common.engine_core import EngineCore
from engine_common.generation_request import GenerationRequest
from engine_common.llm import LLM
from engine_common.outputs import EngineCoreRequest
from engine_common.sampling_params import SamplingParams
from engine_common.structured_output.grammar import GrammarCompiler
from engine_common.structured_output.spec import StructuredOutputError, StructuredOutputSpec
from engine_common.tokenizer import load_tokenizer
from protos.tandem.v1 import engine_pb2 as epb
from protos.tandem.v1 import engine_pb2_grpc as epb_grpc
from services.engine_api.messages import sampling_params_from_pb, sampling_params_to_pb
from tandem.client import Client
from tandem.errors import TandemError
from tests.hf_reference import random_prompts
from tests.replica_process import GatewayStack
from tests.test_pd_engine import decode, make_core, prefill, reference, wait_released

COLORS = ["red", "green", "blue"]
SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": COLORS}, "count": {"type": "integer"}},
    "required": ["color", "count"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-\d{1,3}"
CHOICES = ["yes", "no", "maybe so", 'say "hi"\n']
JSON_SPEC = StructuredOutputSpec.parse("json_schema", json.dumps(SCHEMA))
REGEX_SPEC = StructuredOutputSpec.parse("regex", REGEX)
CHOICE_SPEC = StructuredOutputSpec.parse("choice", json.dumps(CHOICES))
MAX_TOKENS = 48


def engine(model_dir: Path, num_blocks: int = 256, reserve_output_room: bool = True) -> LLM:
    return LLM(EngineConfig(model=str(model_dir), dtype="float32",
                            cache=CacheConfig(block_size=4, num_gpu_blocks_override=num_blocks),
                            scheduler=SchedulerConfig(max_num_batched_tokens=512,
                                                      reserve_output_room=reserve_output_room)))


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return engine(tiny_llama_dir)


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[list[int]]:
    return random_prompts(llm.core.arch.vocab_size, [3, 9, 17, 5, 12, 30], seed=4)


def greedy(spec: StructuredOutputSpec | None, **extra: object) -> SamplingParams:
    fields: dict = {"temperature": 0.0, "max_tokens": MAX_TOKENS, **extra}
    return SamplingParams(structured_output=spec, **fields)


def check_schema(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"color", "count"}, text
    assert value["color"] in COLORS
    assert isinstance(value["count"], int) and not isinstance(value["count"], bool)


def check_output(spec: StructuredOutputSpec, text: str) -> None:
    if spec is JSON_SPEC:
        check_schema(text)
    elif spec is REGEX_SPEC:
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES


# --------------------------------------------------------------------------- compiling


def compiler(model_dir: Path) -> GrammarCompiler:
    tokenizer = load_tokenizer(model_dir)
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


@pytest.mark.parametrize("kind, value, message", [
    ("json_schema", '{"type": "foo"}', 'cannot compile the json schema: Unsupported type "foo"'),
    ("json_schema", '{"properties": {"a": {"$ref": "#/nope"}}}', "Cannot find field nope"),
    ("regex", "[a-z", "cannot compile the regex: Regex parsing error at position 5: Unclosed"),
    ("grammar", 'root ::= item\nitem ::= "a" | other', 'Rule "other" is not defined'),
    ("grammar", 'start ::= "a"', 'The root rule with name "root" is not found'),
])
def test_uncompilable_constraint_names_the_problem(tiny_llama_dir, kind, value, message) -> None:
    with pytest.raises(StructuredOutputError) as error:
        compiler(tiny_llama_dir).compile(StructuredOutputSpec.parse(kind, value))
    assert message in str(error.value)
    assert "/project/cpp" not in str(error.value)  # xgrammar's source position is dropped


def accepts(grammars: GrammarCompiler, spec: StructuredOutputSpec, text: str) -> bool:
    matcher = xgr.GrammarMatcher(grammars.compile(spec))
    return bool(matcher.accept_string(text)) and bool(matcher.is_completed())


def test_each_kind_accepts_what_it_should(tiny_llama_dir) -> None:
    grammars = compiler(tiny_llama_dir)
    tricky = ["yes", 'a "quoted" \\ word', "line\nbreak", "été", "tab\there"]
    choice = StructuredOutputSpec.parse("choice", json.dumps(tricky))
    assert all(accepts(grammars, choice, c) for c in tricky)
    assert not accepts(grammars, choice, "ye") and not accepts(grammars, choice, "yesyes")
    # Compact JSON: no free whitespace, xgrammar's ", " and ": " separators.
    assert accepts(grammars, JSON_SPEC, '{"color": "red", "count": -12}')
    assert not accepts(grammars, JSON_SPEC, '{"color":"red","count":1}')
    assert not accepts(grammars, JSON_SPEC, '{"color": "pink", "count": 1}')
    assert not accepts(grammars, JSON_SPEC, '{"color": "red", "count": 1, "x": 2}')
    any_object = StructuredOutputSpec.parse("json_object", "")
    assert accepts(grammars, any_object, '{"a": [1, {"b": null}], "c": "d"}')
    assert not accepts(grammars, any_object, "[1]")  # an object, not any JSON value
    assert accepts(grammars, REGEX_SPEC, "ab-12") and not accepts(grammars, REGEX_SPEC, "ab12")
    ebnf = StructuredOutputSpec.parse("grammar", 'root ::= "(" [0-9]+ ")"')
    assert accepts(grammars, ebnf, "(42)") and not accepts(grammars, ebnf, "(4")


# --------------------------------------------------------------------------- engine vs HF


class GrammarMask(LogitsProcessor):
    """HF's side of the comparison: the same compiled grammar's matcher, advanced over the
    tokens generated so far, masks each step's scores."""

    def __init__(self, compiled: xgr.CompiledGrammar, prompt_len: int) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self.prompt_len = prompt_len
        self.num_accepted = 0
        self.bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids[0, self.prompt_len:].tolist()
        for token in generated[self.num_accepted:]:
            assert self.matcher.accept_token(token)
        self.num_accepted = len(generated)
        self.matcher.fill_next_token_bitmask(self.bitmask)
        scores = scores.clone()  # type: ignore[assignment]
        xgr.apply_token_bitmask_inplace(scores, self.bitmask)
        return scores


def hf_constrained_greedy(model_dir: Path, prompts: list[list[int]],
                          compiled: xgr.CompiledGrammar, max_tokens: int) -> list[list[int]]:
    """HF greedy ``generate`` under the grammar, one prompt at a time, stopping at EOS."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                do_sample=False, pad_token_id=0,
                logits_processor=LogitsProcessorList([GrammarMask(compiled, len(prompt))]))
            outs.append(out[0, len(prompt):].tolist())
    return outs


@pytest.fixture(scope="module")
def hf_expected(llm: LLM, prompts: list[list[int]], tiny_llama_dir: Path
                ) -> dict[str, list[list[int]]]:
    return {spec.kind: hf_constrained_greedy(tiny_llama_dir, prompts,
                                             llm.core.grammars.compile(spec), MAX_TOKENS)
            for spec in (JSON_SPEC, REGEX_SPEC, CHOICE_SPEC)}


@pytest.mark.parametrize("spec", [JSON_SPEC, REGEX_SPEC, CHOICE_SPEC], ids=lambda s: s.kind)
def test_greedy_under_a_grammar_matches_hf(llm, prompts, hf_expected, spec) -> None:
    expected = hf_expected[spec.kind]
    eos = llm.tokenizer.eos_token_id
    assert all(e[-1] == eos and len(e) < MAX_TOKENS for e in expected)  # all ended by EOS
    results = llm.generate(prompts, greedy(spec))
    assert [r.token_ids for r in results] == expected
    for r in results:
        assert r.finish_reason == "stop"
        check_output(spec, r.text)
    if spec is not JSON_SPEC:
        assert len({r.text for r in results}) > 1  # the prompts matter, not just the grammar
    # Logprobs take the sampler's full path: same tokens, and every top entry with a
    # finite logprob is a token the grammar allowed there.
    with_logprobs = llm.generate(prompts[:2], greedy(spec, logprobs=5))
    assert [r.token_ids for r in with_logprobs] == expected[:2]
    for r in with_logprobs:
        matcher = xgr.GrammarMatcher(llm.core.grammars.compile(spec))
        for token, lp in zip(r.token_ids, r.logprobs, strict=True):
            assert lp is not None and lp.rank == 1 and lp.logprob > float("-inf")
            for other, value in lp.top:
                if value > float("-inf"):
                    assert matcher.fork().accept_token(other)
            assert matcher.accept_token(token)


def test_mixed_batch_keeps_each_row_its_own(llm, prompts, hf_expected) -> None:
    seeded_regex = SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_TOKENS,
                                  structured_output=REGEX_SPEC)
    free_greedy = greedy(None, ignore_eos=True)
    free_seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=MAX_TOKENS,
                                 ignore_eos=True)
    params = [greedy(JSON_SPEC), free_greedy, seeded_regex, free_seeded, greedy(CHOICE_SPEC),
              greedy(None, ignore_eos=True, logprobs=2)]
    mixed = llm.generate(prompts, params)
    alone = [llm.generate([p], [sp])[0] for p, sp in zip(prompts, params, strict=True)]
    assert [r.token_ids for r in mixed] == [r.token_ids for r in alone]
    assert mixed[0].token_ids == hf_expected["json_schema"][0]
    assert mixed[4].token_ids == hf_expected["choice"][4]
    check_schema(mixed[0].text)
    assert re.fullmatch(REGEX, mixed[2].text)
    assert mixed[4].text in CHOICES
    # The free rows really are free: they run to max_tokens and match no grammar.
    for r in (mixed[1], mixed[3], mixed[5]):
        assert r.finish_reason == "length" and len(r.token_ids) == MAX_TOKENS


def test_seeded_sampling_under_a_grammar_stays_valid(llm, prompts) -> None:
    for spec in (JSON_SPEC, REGEX_SPEC, CHOICE_SPEC):
        params = [SamplingParams(temperature=1.2, seed=s, max_tokens=80, structured_output=spec)
                  for s in range(len(prompts))]
        results = llm.generate(prompts, params)
        for r in results:
            assert r.finish_reason == "stop", r.text
            check_output(spec, r.text)


def test_termination_stops_and_max_tokens_cuts(llm, prompts, hf_expected) -> None:
    prompt, full = prompts[1], hf_expected["json_schema"][1]
    eos = llm.tokenizer.eos_token_id
    cut = llm.generate([prompt], greedy(JSON_SPEC, max_tokens=5))[0]
    assert cut.finish_reason == "length" and cut.token_ids == full[:5]
    # ignore_eos: the grammar's end still ends the request (nothing may follow it).
    ignoring = llm.generate([prompt], greedy(JSON_SPEC, ignore_eos=True))[0]
    assert ignoring.finish_reason == "stop" and ignoring.token_ids == full
    # A min_tokens the complete grammar cannot reach: the grammar wins.
    longer = llm.generate([prompt], greedy(JSON_SPEC, min_tokens=len(full) + 5))[0]
    assert longer.finish_reason == "stop" and longer.token_ids == full
    # A grammar that can go on does: min_tokens keeps EOS away as usual.
    words = StructuredOutputSpec.parse("regex", "[a-z]{1,40}")
    short = [r.token_ids for r in llm.generate(prompts, greedy(words))]
    long = llm.generate(prompts, greedy(words, min_tokens=8))
    assert any(len(s) < 8 for s in short)
    for s, r in zip(short, long, strict=True):
        assert r.finish_reason == "stop" and r.token_ids[-1] == eos
        assert len(r.token_ids) >= 8 or r.token_ids == s
        assert re.fullmatch("[a-z]{1,40}", r.text)


def test_preempted_requests_keep_their_grammar_state(tiny_llama_dir, prompts, hf_expected) -> None:
    # 6 prompts need more than 24 blocks of 4 tokens together: preemption by recompute.
    small = engine(tiny_llama_dir, num_blocks=24, reserve_output_room=False)
    results = small.generate(prompts, greedy(JSON_SPEC))
    assert [r.token_ids for r in results] == hf_expected["json_schema"]
    preemptions = small.metrics.registry.get_sample_value(
        "vllm:num_preemptions_total", {"model_name": tiny_llama_dir.name, "engine": "engine-0"})
    assert preemptions is not None and preemptions > 0
    assert small.core.kv_cache_manager.num_free_blocks == 24


def test_bad_constraint_is_refused_before_anything_runs(llm) -> None:
    bad = SamplingParams(structured_output=StructuredOutputSpec.parse("regex", "(a"))
    with pytest.raises(StructuredOutputError, match="cannot compile the regex"):
        llm.generate([[5, 6, 7]], bad)
    assert llm.outputs.num_unfinished == 0 and not llm.core.has_unfinished_requests()
    assert llm.generate([[5, 6, 7]], greedy(CHOICE_SPEC))[0].text in CHOICES


def test_resumed_output_is_accepted_first(llm, prompts, hf_expected) -> None:
    """A stream resumed after k tokens (sent as prompt tail) continues the grammar there."""
    prompt, full = prompts[2], hf_expected["json_schema"][2]
    core = llm.core
    for k in (1, 4):
        params = greedy(JSON_SPEC, max_tokens=MAX_TOKENS - k)
        rest: list[int] = []
        core.add_request(EngineCoreRequest(f"resumed-{k}", GenerationRequest(
            prompt + full[:k], params, num_resumed_tokens=k), time.monotonic()))
        while core.has_unfinished_requests():
            rest += [t for o in core.step().outputs for t in o.new_token_ids]
        assert full[:k] + rest == full
    # Resumed after the grammar's end (EOS, under ignore_eos): it ends at once, with "stop".
    core.add_request(EngineCoreRequest("resumed-done", GenerationRequest(
        prompt + full, greedy(JSON_SPEC, ignore_eos=True), num_resumed_tokens=len(full)),
        time.monotonic()))
    (done,) = core.step().outputs
    assert done.finish_reason == "stop" and done.new_token_ids == []
    assert not core.has_unfinished_requests()
    # Without them, the tokens would restart the grammar: here they are refused.
    bad = load_tokenizer(llm.config.model)("hello", add_special_tokens=False).input_ids
    with pytest.raises(StructuredOutputError, match="does not follow the json schema"):
        core.add_request(EngineCoreRequest("resumed-bad", GenerationRequest(
            prompt + bad, greedy(JSON_SPEC), num_resumed_tokens=len(bad)), time.monotonic()))
    assert not core.has_unfinished_requests()


def test_engine_messages_carry_the_constraint() -> None:
    for spec in (CHOICE_SPEC, StructuredOutputSpec.parse("regex", REGEX, starts_after=(7, 9)),
                 StructuredOutputSpec.parse("regex", REGEX, starts_after=(7,), waits_if_first=0)):
        params = SamplingParams(temperature=0.0, structured_output=spec)
        assert sampling_params_from_pb(sampling_params_to_pb(params)) == params


def test_a_constraint_that_starts_after_a_token_lets_the_output_run_free_until_then(
        llm, prompts) -> None:
    """A reasoning model's answer is constrained only after its end-of-thinking token: until
    that token the output is exactly the unconstrained one, after it the grammar holds (and
    ends the request), also when the trigger came before a resumed stream's cut."""
    prompt = prompts[1]
    free = llm.generate([prompt], greedy(None, max_tokens=12, ignore_eos=True))[0].token_ids
    # A token the model writes by itself, after a few others (not EOS: the run ignores it
    # until the grammar ends, which a grammar does even under ignore_eos).
    start = next(i for i in range(3, len(free))
                 if free[i] not in llm.core.eos_token_ids and free[i] not in free[:i]) + 1
    trigger = free[start - 1]
    spec = StructuredOutputSpec.parse("regex", REGEX, starts_after=(trigger,))
    result = llm.generate([prompt], greedy(spec, max_tokens=40, ignore_eos=True))[0]
    assert result.token_ids[:start] == free[:start]
    answer = llm.tokenizer.decode(result.token_ids[start:], skip_special_tokens=True)
    assert re.fullmatch(REGEX, answer), answer
    assert result.finish_reason == "stop"
    # Two-token trigger: the grammar waits for the pair, in a row.
    spec = StructuredOutputSpec.parse("regex", REGEX, starts_after=(free[start - 2], trigger))
    paired = llm.generate([prompt], greedy(spec, max_tokens=40, ignore_eos=True))[0]
    assert paired.token_ids == result.token_ids
    # A trigger that never comes: the output is the unconstrained one.
    spec = StructuredOutputSpec.parse("regex", REGEX, starts_after=(trigger, trigger, trigger))
    assert llm.generate([prompt], greedy(spec, max_tokens=12, ignore_eos=True))[0].token_ids \
        == free
    # Resumed past the trigger: the matcher replays the tokens and constrains what follows.
    core = llm.core
    k = start + 1
    core.add_request(EngineCoreRequest("resumed-after-trigger", GenerationRequest(
        prompt + result.token_ids[:k],
        greedy(StructuredOutputSpec.parse("regex", REGEX, starts_after=(trigger,)),
               max_tokens=40 - k, ignore_eos=True), num_resumed_tokens=k), time.monotonic()))
    rest: list[int] = []
    while core.has_unfinished_requests():
        rest += [t for o in core.step().outputs for t in o.new_token_ids]
    assert result.token_ids[:k] + rest == result.token_ids


def test_a_first_token_may_choose_to_wait_for_the_trigger(llm, prompts) -> None:
    """``waits_if_first``: the output's first token decides. Anything but the opener starts
    the grammar at once (the very output of the grammar alone, here, where the opener does
    not win the first mask); the opener, made the first token by a bias, makes it wait."""
    prompt = prompts[1]
    plain = llm.generate([prompt], greedy(REGEX_SPEC, max_tokens=40))[0]
    free = llm.generate([prompt], greedy(None, max_tokens=12, ignore_eos=True))[0].token_ids
    opener = next(t for t in range(llm.core.arch.vocab_size)
                  if t not in free and t != plain.token_ids[0]
                  and t not in llm.core.eos_token_ids)
    trigger = free[5]
    spec = StructuredOutputSpec.parse("regex", REGEX, starts_after=(trigger,),
                                      waits_if_first=opener)
    assert llm.generate([prompt], greedy(spec, max_tokens=40))[0].token_ids == plain.token_ids
    waited = llm.generate([prompt], greedy(spec, max_tokens=12, ignore_eos=True,
                                           logit_bias={opener: 100.0}))[0]
    assert waited.token_ids[0] == opener
    free_after_opener = llm.generate([prompt + [opener]], greedy(
        None, max_tokens=11, ignore_eos=True, logit_bias={opener: 100.0}))[0].token_ids
    assert waited.token_ids[1:] == free_after_opener  # unconstrained: the trigger never came
    # Token ids outside the vocabulary are refused before the request runs.
    vocab = llm.core.arch.vocab_size
    with pytest.raises(StructuredOutputError, match=rf"must be in \[0, {vocab}\)"):
        llm.core.add_request(EngineCoreRequest("bad-opener", GenerationRequest(prompt, greedy(
            StructuredOutputSpec.parse("regex", REGEX, starts_after=(trigger,),
                                       waits_if_first=vocab))), time.monotonic()))
    assert not llm.core.has_unfinished_requests()


# --------------------------------------------------------------------------- P/D


@pytest.fixture(scope="module")
def cores(tiny_llama_dir) -> Iterator[tuple[EngineCore, EngineCore, EngineCore]]:
    p = make_core(tiny_llama_dir, "so-prefill", "producer", lease_seconds=2.0)
    d = make_core(tiny_llama_dir, "so-decode", "consumer", pull_timeout_seconds=3.0)
    both = make_core(tiny_llama_dir, "so-both", None)
    yield p, d, both
    assert p.remote_kv is not None and d.remote_kv is not None
    p.remote_kv.close()
    d.remote_kv.close()


@pytest.mark.parametrize("params", [
    greedy(JSON_SPEC),
    SamplingParams(temperature=1.0, seed=3, max_tokens=MAX_TOKENS, structured_output=JSON_SPEC),
    greedy(REGEX_SPEC, ignore_eos=True),
], ids=["greedy-json", "seeded-json", "regex-ignore-eos"])
def test_pd_split_equals_one_engine(cores, prompts, params) -> None:
    """P samples the first token under the grammar; D's matcher starts after it."""
    p, d, both = cores
    for i, prompt in enumerate(prompts[:3]):
        request_id = f"so-pd-{i}-{params.seed}-{params.ignore_eos}"
        expected = reference(both, request_id, prompt, params)
        first, handle = prefill(p, request_id, prompt, params)
        tokens, report = decode(d, request_id, prompt, first, handle, params)
        assert report.fallback_reason is None
        assert tokens == expected
        text = load_tokenizer(both.config.model).decode(tokens, skip_special_tokens=True)
        check_output(params.structured_output, text)  # type: ignore[arg-type]
        p.release_kv([request_id])
    wait_released(p)
    assert d.kv_cache_manager.num_free_blocks == d.kv_cache_manager.num_blocks


# --------------------------------------------------------------------------- API


@pytest.fixture(scope="module")
def stack(gateway_stack: GatewayStack) -> GatewayStack:
    return gateway_stack  # the session's (conftest), not one of the module's own


RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}


@pytest.mark.parametrize("via", ["replica", "gateway"])
def test_response_format_gives_json_through_the_api(stack, via) -> None:
    target = stack.replica.target if via == "replica" else stack.gateway
    with Client(target, timeout=60) as client:
        kwargs: dict = dict(max_tokens=60, temperature=0, response_format=RESPONSE_FORMAT)
        completion = client.complete("Once upon a time", **kwargs)
        assert completion.finish_reason == "stop"
        check_schema(completion.text)
        chat = client.chat([{"role": "user", "content": "Describe a thing"}], **kwargs)
        assert chat.finish_reason == "stop"
        check_schema(chat.content)
        streamed = "".join(c.text for c in client.complete_stream("Once upon a time", **kwargs))
        assert streamed == completion.text
        obj = client.chat([{"role": "user", "content": "Hi"}], max_tokens=60, temperature=0,
                          response_format={"type": "json_object"})
        assert isinstance(json.loads(obj.content), dict)
        choice = client.complete("The fox", max_tokens=20, temperature=1.0, seed=5,
                                 structured_outputs={"choice": CHOICES})
        assert choice.text in CHOICES
        regex = client.complete("The fox", max_tokens=20, temperature=0,
                                structured_outputs={"regex": REGEX})
        assert re.fullmatch(REGEX, regex.text)
        plain = client.complete("Once upon a time", max_tokens=20, temperature=0)
        assert plain.text != completion.text[:len(plain.text)]  # the constraint mattered


@pytest.mark.parametrize("via", ["replica", "gateway"])
@pytest.mark.parametrize("options, message", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     'cannot compile the json schema: Unsupported type "foo"'),
    ({"structured_outputs": {"regex": "[a-z"}},
     "cannot compile the regex: Regex parsing error at position 5: Unclosed '['"),
    ({"structured_outputs": {"grammar": "root ::= nothing"}},
     'cannot compile the grammar: EBNF parser error at line 1, column 10: Rule "nothing" is '
     "not defined"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}},
     "give one output constraint"),
])
def test_bad_constraint_is_invalid_argument(stack, via, options, message) -> None:
    target = stack.replica.target if via == "replica" else stack.gateway
    with Client(target, timeout=60) as client:
        with pytest.raises(TandemError) as error:
            client.complete("Once upon a time", max_tokens=4, **options)
        assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert message in error.value.details
        with pytest.raises(TandemError) as error:
            client.chat([{"role": "user", "content": "Hi"}], max_tokens=4, **options)
        assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert message in error.value.details


def test_engine_generate_enforces_and_refuses(stack) -> None:
    with grpc.insecure_channel(stack.replica.target) as channel:
        engine_stub = epb_grpc.EngineStub(channel)
        responses = list(engine_stub.Generate(epb.GenerateRequest(
            request_id="so-1", prompt_token_ids=[5, 6, 7, 8],
            sampling_params=sampling_params_to_pb(greedy(CHOICE_SPEC)),
            output_options=epb.OutputOptions(return_token_ids=True)), timeout=60))
        assert "".join(r.delta_text for r in responses) in CHOICES
        with pytest.raises(grpc.RpcError) as error:
            list(engine_stub.Generate(epb.GenerateRequest(
                request_id="so-2", prompt_token_ids=[5, 6, 7],
                sampling_params=sampling_params_to_pb(SamplingParams(
                    structured_output=StructuredOutputSpec.parse("regex", "(a")))), timeout=60))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cannot compile the regex" in error.value.details()
