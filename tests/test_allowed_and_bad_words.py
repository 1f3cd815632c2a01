"""vLLM's ``allowed_token_ids`` and ``bad_words``: validation, the sampler, the engine against
Hugging Face, speculative decoding, and the request path through a real replica and the
gateway.

The sampler sets every logit but the allowed ones to -inf right after the bias, and the last
token of a bad word wherever the output so far ends with its other tokens (a one-token word
everywhere); logprobs see both. The frontend tokenizes each bad word as written and with a
leading space. Greedy generation under either must equal HF ``generate`` with a logits
processor that masks the same way, with and without n-gram drafts (a draft position's output
includes the drafts before it); a request's restrictions must reach the engine through the
public API, the internal Engine API (the P/D prefill replica's too) and the gateway, and bad
values must come back as INVALID_ARGUMENT naming the problem.
"""

from __future__ import annotations

import collections
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from engine_common.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from engine_common.input_processor import InputProcessor, InvalidRequestError
from engine_common.llm import LLM
from engine_common.sampler import (
    Sampler,
    SamplingBatch,
    SamplingRow,
    bad_word_bans,
    is_plain_greedy,
    takes_argmax,
)
from engine_common.sampling_params import SamplingParams, SamplingParamsError
from engine_common.tokenizer import load_tokenizer
from protos.tandem.v1 import engine_pb2 as epb
from protos.tandem.v1 import engine_pb2_grpc as epb_grpc
from services.engine_api.messages import sampling_params_from_pb, sampling_params_to_pb
from tandem.client import Client
from tandem.errors import InvalidRequestError as ClientInvalidRequestError
from tandem.errors import TandemError
from tandem.request_builders import chat_request, completion_request
from tests.hf_reference import hf_greedy, random_prompts
from tests.replica_process import GatewayStack

sampler = Sampler()
VOCAB = 400  # the tiny test models' vocabulary


def row(generator: torch.Generator | None = None, output: list[int] | None = None,
        prompt: list[int] | None = None, **params: object) -> SamplingRow:
    return SamplingRow(params=SamplingParams(**params),  # type: ignore[arg-type]
                       prompt_token_ids=prompt or [], output_token_ids=output or [],
                       generator=generator)


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    return sampler(logits, SamplingBatch.build(rows, logits.shape[1], "cpu")).sampled_token_ids


def occurs(sequence: Sequence[int], tokens: Sequence[int]) -> bool:
    """Whether ``sequence`` is a contiguous run of ``tokens``."""
    n = len(sequence)
    return any(list(tokens[i:i + n]) == list(sequence) for i in range(len(tokens) - n + 1))


@pytest.fixture(scope="module")
def inputs(tiny_llama_dir: Path) -> InputProcessor:
    return InputProcessor(load_tokenizer(str(tiny_llama_dir)), 512, VOCAB)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("params, message", [
    ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
    ({"allowed_token_ids": [3, -1, -7]}, "allowed_token_ids must be non-negative, got [-7, -1]"),
    ({"bad_words_token_ids": [[5], []]}, "bad_words_token_ids must hold non-empty"),
    ({"bad_words_token_ids": [[5, -2]]}, "bad_words_token_ids must be non-negative, got [-2]"),
])
def test_bad_values_are_rejected_with_a_clear_message(params, message) -> None:
    with pytest.raises(SamplingParamsError, match=re.escape(message)):
        SamplingParams(**params)


def test_defaults_restrict_nothing_and_sequences_become_lists() -> None:
    assert SamplingParams().allowed_token_ids is None
    assert SamplingParams().bad_words_token_ids == []
    # Any sequences come in as plain lists (equal to what a round trip gives back).
    sequences: dict = {"allowed_token_ids": (4, 5), "bad_words_token_ids": [(1, 2)]}
    params = SamplingParams(**sequences)
    assert params.allowed_token_ids == [4, 5] and params.bad_words_token_ids == [[1, 2]]


def test_ids_must_be_in_the_vocabulary(inputs) -> None:
    inputs.check_allowed_token_ids(None)
    inputs.check_allowed_token_ids([0, VOCAB - 1])
    with pytest.raises(InvalidRequestError, match=re.escape(
            f"allowed_token_ids must be in [0, {VOCAB}) (the vocabulary size is {VOCAB}); "
            f"got [{VOCAB}, {VOCAB + 9}]")):
        inputs.check_allowed_token_ids([3, VOCAB + 9, VOCAB])
    # Every id a request names, for the entry points that take SamplingParams as they are.
    inputs.check_sampling_token_ids(SamplingParams(
        logit_bias={3: 1.0}, allowed_token_ids=[4], bad_words_token_ids=[[5, 6]]))
    for params, name in [(SamplingParams(logit_bias={VOCAB: 1.0}), "logit_bias"),
                         (SamplingParams(allowed_token_ids=[VOCAB]), "allowed_token_ids"),
                         (SamplingParams(bad_words_token_ids=[[5, VOCAB]]),
                          "bad_words_token_ids")]:
        with pytest.raises(InvalidRequestError, match=f"{name} token ids must be in|"
                                                      f"{name} must be in"):
            inputs.check_sampling_token_ids(params)


def test_bad_words_are_tokenized_as_written_and_after_a_space(inputs) -> None:
    def ids(text: str) -> list[int]:
        return list(inputs.tokenizer(text, add_special_tokens=False).input_ids)

    # Byte-level BPE spells "the" at the start and " the" after a space differently.
    assert ids("the") != ids(" the")
    assert inputs.bad_words_token_ids(["the"]) == [ids("the"), ids(" the")]
    # Leading whitespace is stripped first; each distinct sequence is kept once.
    assert inputs.bad_words_token_ids(["  the", " the", "hello"]) == [
        ids("the"), ids(" the"), ids("hello"), ids(" hello")]
    assert inputs.bad_words_token_ids([]) == []
    with pytest.raises(InvalidRequestError,
                       match=re.escape("bad_words must be non-empty strings; bad_words[1] is "
                                       "empty")):
        inputs.bad_words_token_ids(["the", ""])


def test_engine_messages_carry_them_both_ways() -> None:
    params = SamplingParams(temperature=0.0, allowed_token_ids=[7, 3, 399],
                            bad_words_token_ids=[[5], [6, 7, 8]])
    message = sampling_params_to_pb(params)
    assert list(message.allowed_token_ids) == [7, 3, 399]
    assert [list(s.ids) for s in message.bad_words_token_ids] == [[5], [6, 7, 8]]
    assert sampling_params_from_pb(message) == params
    # Through the wire, as the gateway and a decode replica's Prefill call send it.
    assert sampling_params_from_pb(epb.SamplingParams.FromString(
        message.SerializeToString())) == params
    plain = sampling_params_from_pb(sampling_params_to_pb(SamplingParams()))
    assert plain.allowed_token_ids is None and plain.bad_words_token_ids == []


def test_sdk_sets_the_request_fields() -> None:
    request = completion_request("hi", model=None, logprobs=None, stream=False,
                                 include_usage=False,
                                 options={"allowed_token_ids": [4, 5], "bad_words": ["a b"]})
    assert list(request.allowed_token_ids) == [4, 5] and list(request.bad_words) == ["a b"]
    chat = chat_request([{"role": "user", "content": "hi"}], model=None, logprobs=False,
                        top_logprobs=None, stream=False, include_usage=False,
                        options={"allowed_token_ids": [4], "bad_words": ["x"]})
    assert list(chat.allowed_token_ids) == [4] and list(chat.bad_words) == ["x"]
    # The wire cannot tell an empty list from an unset one: refused before it is sent.
    with pytest.raises(ClientInvalidRequestError, match="allowed_token_ids must not be empty"):
        completion_request("hi", model=None, logprobs=None, stream=False,
                           include_usage=False, options={"allowed_token_ids": []})
    with pytest.raises(TypeError, match="list of strings"):
        completion_request("hi", model=None, logprobs=None, stream=False,
                           include_usage=False, options={"bad_words": "word"})


# --------------------------------------------------------------------------- sampler


def test_greedy_picks_the_argmax_of_the_allowed_set() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 60)
    before = logits.clone()
    rng = random.Random(0)
    allowed = [rng.sample(range(60), k) for k in (1, 3, 10, 40)]
    rows = [row(temperature=0.0, allowed_token_ids=a) for a in allowed]
    rows.insert(2, row(temperature=0.0))  # an unrestricted neighbour
    assert not any(takes_argmax(r.params, 0) for r in rows if r.params.allowed_token_ids)
    batch = SamplingBatch.build(rows, 60, "cpu")
    assert not batch.fast_greedy
    want = [a[int(logits[i, a].argmax())] for i, a in zip([0, 1, 3, 4], allowed, strict=True)]
    got = sampler(logits, batch).sampled_token_ids
    assert [got[i] for i in (0, 1, 3, 4)] == want
    assert got[2] == int(logits[2].argmax())
    assert torch.equal(logits, before)
    # The restriction mattered: the plain argmax of some row is not allowed.
    assert any(int(logits[i].argmax()) not in a
               for i, a in zip([0, 1, 3, 4], allowed, strict=True))


def test_random_draws_stay_in_the_allowed_set_and_logprobs_show_it() -> None:
    torch.manual_seed(1)
    logits = torch.randn(1, 20).repeat(300, 1)
    allowed = [2, 11, 17, 19]
    rows = [row(generator=torch.Generator().manual_seed(i), seed=i, allowed_token_ids=allowed)
            for i in range(300)]
    drawn = sample(logits, rows)
    assert set(drawn) == set(allowed)  # all of them, none else
    # After the bias: +50 on a disallowed token does not bring it back, and greedy picks
    # the biased allowed one.
    params: dict[str, Any] = dict(temperature=0.0, logprobs=20, allowed_token_ids=allowed,
                                  logit_bias={5: 50.0, 11: 20.0})
    out = sampler(logits[:1], SamplingBatch.build([row(**params)], 20, "cpu"))
    assert out.sampled_token_ids == [11]
    entry = out.logprobs[0]
    assert entry is not None
    top = dict(entry.top)
    biased = logits[0].clone()
    biased[11] += 20.0
    want = biased[allowed].log_softmax(-1)
    assert [top[t] for t in allowed] == pytest.approx(want.tolist(), abs=1e-5)
    assert all(top[t] == float("-inf") for t in range(20) if t not in allowed)


def test_bad_word_bans_follow_the_output_only() -> None:
    words = [[9], [1, 2], [1, 2, 3], [4, 2]]
    assert bad_word_bans(words, []) == {9}
    assert bad_word_bans(words, [7, 1]) == {9, 2}
    assert bad_word_bans(words, [1, 2]) == {9, 3}
    assert bad_word_bans(words, [4]) == {9, 2}
    assert bad_word_bans(words, [1, 4, 7]) == {9}


def test_a_multi_token_word_bans_its_last_token_after_its_prefix() -> None:
    torch.manual_seed(2)
    logits = torch.randn(1, 40)
    first, second, third = logits[0].topk(3).indices.tolist()
    word = [[11, 12, first]]  # its last token is the argmax
    rows = [
        row(temperature=0.0, output=[5, 11, 12], bad_words_token_ids=word),  # prefix: banned
        row(temperature=0.0, output=[11, 5, 12], bad_words_token_ids=word),  # not the prefix
        row(temperature=0.0, output=[12], prompt=[11], bad_words_token_ids=word),  # prompt
        row(temperature=0.0, output=[], bad_words_token_ids=[[first], [second]]),  # one-token
        row(temperature=0.0, output=[11, 12]),  # no words
    ]
    assert all(is_plain_greedy(r.params) == (not r.params.bad_words_token_ids) for r in rows)
    assert sample(logits.repeat(5, 1), rows) == [second, first, first, third, first]
    # A row whose words ban nothing this step takes the plain argmax path.
    assert SamplingBatch.build(rows[1:3], 40, "cpu").fast_greedy
    out = sampler(logits, SamplingBatch.build(
        [row(temperature=0.0, logprobs=2, output=[11, 12], bad_words_token_ids=word)], 40,
        "cpu"))
    entry = out.logprobs[0]
    assert entry is not None and entry.token_id == second
    assert [t for t, _ in entry.top] == [second, third]
    # Every logprob of a narrow row: the banned token's is -inf, the rest renormalised.
    narrow = logits[:, :20]
    top20 = int(narrow[0].argmax())
    banned = sampler(narrow, SamplingBatch.build(
        [row(temperature=0.0, logprobs=20, output=[11, 12], bad_words_token_ids=[[12, top20]])],
        20, "cpu")).logprobs[0]
    assert banned is not None and banned.token_id != top20
    masked = narrow[0].clone()
    masked[top20] = float("-inf")
    assert dict(banned.top) == pytest.approx(dict(enumerate(masked.log_softmax(-1).tolist())))


def test_sampled_rows_never_draw_a_bad_word() -> None:
    logits = torch.zeros(200, 10)  # uniform: without the ban, every token comes up
    rows = [row(generator=torch.Generator().manual_seed(i), seed=i, output=[1],
                bad_words_token_ids=[[3], [1, 4], [2, 5]]) for i in range(200)]
    drawn = set(sample(logits, rows))
    assert drawn == set(range(10)) - {3, 4}


# --------------------------------------------------------------------------- engine vs HF

MAX_TOKENS = 12


class AllowOnly(LogitsProcessor):
    """Every score but the allowed tokens' is -inf (vLLM's allowed_token_ids)."""

    def __init__(self, allowed: Sequence[int], vocab_size: int) -> None:
        self.banned = torch.ones(vocab_size, dtype=torch.bool)
        self.banned[list(allowed)] = False

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        banned = self.banned.to(scores.device)
        return scores.masked_fill(banned, float("-inf"))  # type: ignore[return-value]


class BanBadWords(LogitsProcessor):
    """vLLM's bad words over the generated tokens only (HF's NoBadWordsLogitsProcessor also
    matches the prompt's tail): a sequence's last token is -inf where the output ends with
    its other tokens."""

    def __init__(self, sequences: list[list[int]], prompt_length: int) -> None:
        self.sequences = sequences
        self.prompt_length = prompt_length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()  # type: ignore[assignment]
        for i, ids in enumerate(input_ids.tolist()):
            output = ids[self.prompt_length:]
            for sequence in self.sequences:
                *prefix, last = sequence
                if len(prefix) <= len(output) and output[len(output) - len(prefix):] == prefix:
                    scores[i, last] = float("-inf")
        return scores


def hf_masked_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int,
                     allowed: Sequence[int] | None = None,
                     bad_words: list[list[int]] | None = None) -> list[list[int]]:
    """HF greedy ``generate`` with the same masks, EOS suppressed (``min_new_tokens``)."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            processors = LogitsProcessorList()
            if allowed is not None:
                processors.append(AllowOnly(allowed, model.config.vocab_size))
            if bad_words is not None:
                processors.append(BanBadWords(bad_words, len(prompt)))
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=0, logits_processor=processors)
            outs.append(out[0, len(prompt):].tolist())
    return outs


def words_in(inputs: InputProcessor, output: list[int]) -> list[tuple[str, int]]:
    """Words ``output`` contains as ``bad_words`` tokenizes them, each with the length of
    its longest sequence that occurs there, longest first."""
    words: dict[str, int] = {}
    for length in (3, 2, 1):
        for i in range(len(output) - length + 1):
            text = inputs.tokenizer.decode(output[i:i + length])
            if not text.strip() or "\ufffd" in text:
                continue  # no word, or a piece of a multi-byte character
            found = [len(s) for s in inputs.bad_words_token_ids([text]) if occurs(s, output)]
            if found:
                words.setdefault(text, max(found))
    return sorted(words.items(), key=lambda item: -item[1])


def pick_bad_words(inputs: InputProcessor, outputs: list[list[int]]) -> list[str]:
    """Two words the outputs contain: one whose occurring sequence takes several tokens and
    one of a single token, from different outputs."""
    candidates = [words_in(inputs, out) for out in outputs]
    n, multi = next((n, w) for n, words in enumerate(candidates) for w, k in words if k > 1)
    single = next(w for m, words in enumerate(candidates) if m != n for w, k in words if k == 1)
    return [multi, single]


def make_llm(model_dir: Path, speculative: SpeculativeConfig | None = None) -> LLM:
    return LLM(EngineConfig(model=str(model_dir), dtype="float32",
                            cache=CacheConfig(block_size=4, num_gpu_blocks_override=256),
                            scheduler=SchedulerConfig(max_num_batched_tokens=512),
                            speculative=speculative or SpeculativeConfig()))


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return make_llm(tiny_llama_dir)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(VOCAB, [3, 9, 17, 5, 12], seed=4)


@pytest.fixture(scope="module")
def plain(tiny_llama_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    return hf_greedy(tiny_llama_dir, prompts, MAX_TOKENS)


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)


def test_greedy_with_allowed_ids_matches_hf(llm, tiny_llama_dir, prompts, plain) -> None:
    rng = random.Random(6)
    # A fifth of the vocabulary, without the tokens the unrestricted outputs start with (so
    # that every output changes) and without EOS.
    excluded = {out[0] for out in plain} | {llm.tokenizer.eos_token_id}
    allowed = rng.sample(sorted(set(range(VOCAB)) - excluded), 80)
    expected = hf_masked_greedy(tiny_llama_dir, prompts, MAX_TOKENS, allowed=allowed)
    assert all(e != p for e, p in zip(expected, plain, strict=True))
    assert all(set(e) <= set(allowed) for e in expected)

    restricted = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS,
                                allowed_token_ids=allowed)
    assert [r.token_ids for r in llm.generate(prompts, restricted)] == expected
    # Restricted and unrestricted rows in one batch: each gets its own answer.
    params = [restricted if i % 2 else GREEDY for i in range(len(prompts))]
    assert [r.token_ids for r in llm.generate(prompts, params)] == [
        expected[i] if i % 2 else plain[i] for i in range(len(prompts))]


def test_greedy_with_bad_words_matches_hf(llm, tiny_llama_dir, prompts, plain) -> None:
    words = pick_bad_words(llm.inputs, plain)
    sequences = llm.inputs.bad_words_token_ids(words)
    assert any(len(s) > 1 and occurs(s, out) for s in sequences for out in plain)
    expected = hf_masked_greedy(tiny_llama_dir, prompts, MAX_TOKENS, bad_words=sequences)
    assert not any(occurs(s, out) for s in sequences for out in expected)
    assert sum(e != p for e, p in zip(expected, plain, strict=True)) >= 2

    banned = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS,
                            bad_words_token_ids=sequences)
    assert [r.token_ids for r in llm.generate(prompts, banned)] == expected
    params = [banned if i % 2 == 0 else GREEDY for i in range(len(prompts))]
    assert [r.token_ids for r in llm.generate(prompts, params)] == [
        expected[i] if i % 2 == 0 else plain[i] for i in range(len(prompts))]


def test_the_offline_engine_refuses_ids_outside_the_vocabulary(llm, prompts) -> None:
    """``LLM`` takes SamplingParams as they are: it checks the ids itself (so do AsyncLLM
    and the Engine API), rather than letting the sampler drop them."""
    for params in (SamplingParams(max_tokens=2, allowed_token_ids=[VOCAB]),
                   SamplingParams(max_tokens=2, bad_words_token_ids=[[3, VOCAB + 1]])):
        with pytest.raises(InvalidRequestError, match=f"must be in \\[0, {VOCAB}\\)"):
            llm.generate(prompts[:1], params)


# --------------------------------------------------------------------------- speculation

SPEC = SpeculativeConfig(num_tokens=4, ngram_min=1, ngram_max=3, max_batch_size=8)
SPEC_TOKENS = 40


def accepted_drafts(llm: LLM, model_dir: Path) -> float:
    labels = {"model_name": model_dir.name, "engine": "engine-0"}
    return llm.metrics.registry.get_sample_value(
        "vllm:spec_decode_num_accepted_tokens_total", labels) or 0.0


def test_speculation_keeps_the_restricted_output(tiny_llama_dir, llm, prompts, plain) -> None:
    """Few allowed tokens make the output loop, so n-gram drafts are proposed and kept; a
    bad word made of the loop's most common pair must then be banned at a draft position
    after a draft of its first token (the drafts before a position are its output)."""
    allowed = sorted({t for out in plain[:2] for t in out[:3]} - {llm.tokenizer.eos_token_id})
    looping = SamplingParams(temperature=0.0, max_tokens=SPEC_TOKENS, allowed_token_ids=allowed)
    loops = [r.token_ids for r in llm.generate(prompts[:3], looping)]
    pairs = collections.Counter(
        (a, b) for out in loops for a, b in zip(out, out[1:], strict=False))
    (first, second), count = pairs.most_common(1)[0]
    assert count >= 3, loops  # the pair recurs: drafts will propose it
    words = [[first, second], [loops[0][-1]]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=SPEC_TOKENS, allowed_token_ids=allowed,
                       bad_words_token_ids=words),
        SamplingParams(temperature=0.0, max_tokens=SPEC_TOKENS, allowed_token_ids=allowed,
                       bad_words_token_ids=words, logprobs=2),
        SamplingParams(temperature=0.7, seed=9, max_tokens=SPEC_TOKENS,
                       allowed_token_ids=allowed, bad_words_token_ids=words),
    ]
    want = [r.token_ids for r in llm.generate(prompts[:3], params)]
    assert not any(occurs(w, out) for w in words for out in want)
    assert all(set(out) <= set(allowed) for out in want)
    speculating = make_llm(tiny_llama_dir, SPEC)
    assert [r.token_ids for r in speculating.generate(prompts[:3], params)] == want
    assert accepted_drafts(speculating, tiny_llama_dir) > 0


# --------------------------------------------------------------------------- API


@pytest.fixture(scope="module")
def stack(gateway_stack: GatewayStack) -> GatewayStack:
    return gateway_stack  # the session's (conftest), not one of the module's own


def target_of(stack: GatewayStack, via: str) -> str:
    return stack.replica.target if via == "replica" else stack.gateway


PROMPT = "Once upon a time"
CHAT = [{"role": "user", "content": "Tell me a story"}]
API_OPTIONS: dict = dict(max_tokens=8, temperature=0, ignore_eos=True, return_token_ids=True)


@pytest.mark.parametrize("via", ["replica", "gateway"])
def test_only_allowed_tokens_come_through_the_api(stack, via) -> None:
    with Client(target_of(stack, via), timeout=60) as client:
        plain = client.complete(PROMPT, **API_OPTIONS).choices[0].token_ids
        assert plain is not None
        allowed = sorted(set(range(3, 60, 3)) - set(plain))
        out = client.complete(PROMPT, allowed_token_ids=allowed, **API_OPTIONS)
        ids = out.choices[0].token_ids
        assert ids is not None and len(ids) == 8 and set(ids) <= set(allowed)
        chat = client.chat(CHAT, allowed_token_ids=allowed, **API_OPTIONS).choices[0].token_ids
        assert chat is not None and set(chat) <= set(allowed)
        streamed = [t for c in client.complete_stream(PROMPT, allowed_token_ids=allowed,
                                                      **API_OPTIONS) for t in c.token_ids or ()]
        assert streamed == ids


@pytest.mark.parametrize("via", ["replica", "gateway"])
def test_bad_words_are_not_generated_through_the_api(stack, inputs, via) -> None:
    with Client(target_of(stack, via), timeout=60) as client:
        plain = client.complete(PROMPT, **API_OPTIONS).choices[0].token_ids
        plain_chat = client.chat(CHAT, **API_OPTIONS).choices[0].token_ids
        assert plain is not None and plain_chat is not None
        for chat, before in [(False, plain), (True, plain_chat)]:
            word = words_in(inputs, before)[0][0]
            sequences = inputs.bad_words_token_ids([word])
            assert any(occurs(s, before) for s in sequences)
            answer = (client.chat(CHAT, bad_words=[word], **API_OPTIONS) if chat
                      else client.complete(PROMPT, bad_words=[word], **API_OPTIONS))
            after = answer.choices[0].token_ids
            assert after is not None and after != before
            assert not any(occurs(s, after) for s in sequences)


def test_engine_generate_carries_them(stack) -> None:
    """The internal Engine API (what the gateway and a decode replica's Prefill call send)."""
    with grpc.insecure_channel(stack.replica.target) as channel:
        engine = epb_grpc.EngineStub(channel)

        def generate(**restrictions: Any) -> list[int]:
            responses = engine.Generate(epb.GenerateRequest(
                request_id=f"restricted-{'-'.join(restrictions)}",
                prompt_token_ids=[5, 6, 7, 8],
                sampling_params=epb.SamplingParams(max_tokens=6, temperature=0,
                                                   ignore_eos=True, **restrictions),
                output_options=epb.OutputOptions(return_token_ids=True)), timeout=60)
            return [t for r in responses for t in r.new_token_ids]

        plain = generate()
        assert generate(allowed_token_ids=[plain[1]]) == [plain[1]] * 6
        banned = generate(bad_words_token_ids=[epb.TokenIds(ids=[plain[0]])])
        assert banned[0] != plain[0] and plain[0] not in banned


@pytest.mark.parametrize("via", ["replica", "gateway"])
@pytest.mark.parametrize("options, message", [
    ({"allowed_token_ids": [7, 400, 1234]},
     "allowed_token_ids must be in [0, 400) (the vocabulary size is 400); got [400, 1234]"),
    ({"allowed_token_ids": [7, -3]}, "allowed_token_ids must be non-negative, got [-3]"),
    ({"bad_words": ["fox", ""]}, "bad_words must be non-empty strings; bad_words[1] is empty"),
])
def test_bad_values_are_invalid_argument(stack, via, options, message) -> None:
    with Client(target_of(stack, via), timeout=60) as client:
        with pytest.raises(TandemError) as error:
            client.complete(PROMPT, max_tokens=4, **options)
        assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert message in error.value.details
        with pytest.raises(TandemError) as error:
            client.chat([{"role": "user", "content": "Hi"}], max_tokens=4, **options)
        assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert message in error.value.details
