"""OpenAI's ``logit_bias``: validation, the sampler, the engine against Hugging Face, and the
request path through a real replica and the gateway.

The sampler adds each row's bias first, before min-tokens suppression and penalties, and
logprobs see it. Greedy generation with a bias must equal HF ``generate`` with the same bias
added by a logits processor; a request's bias must reach the engine through the public API,
the internal Engine API and the gateway (which forwards through ``engine_messages``), and a bad
bias must come back as INVALID_ARGUMENT naming the problem.
"""

from __future__ import annotations

import math
import random
import re
from pathlib import Path

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from engine_common.config import CacheConfig, EngineConfig, SchedulerConfig
from engine_common.input_processor import InvalidRequestError
from engine_common.llm import LLM
from engine_common.sampler import Sampler, SamplingBatch, SamplingRow, takes_argmax
from engine_common.sampling_params import SamplingParams, SamplingParamsError
from engine_common.tokenizer import load_tokenizer
from protos.tandem.v1 import engine_pb2 as epb
from protos.tandem.v1 import engine_pb2_grpc as epb_grpc
from services.engine_api.messages import sampling_params_from_pb, sampling_params_to_pb
from tandem.client import Client
from tandem.errors import TandemError
from tests.hf_reference import hf_greedy, random_prompts
from tests.replica_process import GatewayStack

sampler = Sampler()


def row(generator: torch.Generator | None = None, output: list[int] | None = None,
        prompt: list[int] | None = None, suppress: frozenset[int] = frozenset(),
        **params: object) -> SamplingRow:
    return SamplingRow(params=SamplingParams(**params),  # type: ignore[arg-type]
                       prompt_token_ids=prompt or [], output_token_ids=output or [],
                       generator=generator, suppress_token_ids=suppress)


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    return sampler(logits, SamplingBatch.build(rows, logits.shape[1], "cpu")).sampled_token_ids


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("bias, message", [
    ({5: 100.5}, "logit_bias values must be in [-100, 100]"),
    ({5: -101.0}, "logit_bias values must be in [-100, 100]"),
    ({5: math.nan}, "logit_bias values must be in [-100, 100]"),
    ({5: math.inf}, "logit_bias values must be in [-100, 100]"),
    ({-1: 1.0}, "logit_bias token ids must be non-negative"),
])
def test_bad_bias_is_rejected_with_a_clear_message(bias, message) -> None:
    with pytest.raises(SamplingParamsError, match=re.escape(message)):
        SamplingParams(logit_bias=bias)
    assert SamplingParams(logit_bias={5: 100, 6: -100.0}).logit_bias == {5: 100, 6: -100.0}


def test_engine_messages_carry_the_bias_both_ways() -> None:
    params = SamplingParams(temperature=0.0, logit_bias={3: 2.5, 399: -100.0})
    message = sampling_params_to_pb(params)
    assert dict(message.logit_bias) == {3: 2.5, 399: -100.0}
    assert sampling_params_from_pb(message) == params
    assert sampling_params_from_pb(sampling_params_to_pb(SamplingParams())).logit_bias == {}


# --------------------------------------------------------------------------- sampler


def test_large_positive_bias_makes_greedy_pick_the_token() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    targets = [int(logits[i].argmin()) for i in range(4)]  # the least likely token of each row
    rows = [row(temperature=0.0, logit_bias={t: 100.0}) for t in targets]
    assert not any(takes_argmax(r.params, 0) for r in rows)
    batch = SamplingBatch.build(rows, 50, "cpu")
    assert not batch.fast_greedy
    assert sampler(logits, batch).sampled_token_ids == targets


def test_minus_100_on_the_argmax_picks_the_second_best() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, 50)
    top2 = logits.topk(2, dim=-1).indices.tolist()
    rows = [row(temperature=0.0, logit_bias={first: -100.0}) for first, _ in top2]
    assert sample(logits, rows) == [second for _, second in top2]


def test_unbiased_rows_are_unchanged_by_biased_neighbours_and_logits_untouched() -> None:
    torch.manual_seed(2)
    logits = torch.randn(6, 300)
    before = logits.clone()
    bias = {int(t): float(b) for t, b in zip(torch.randint(0, 300, (30,)),
                                             torch.empty(30).uniform_(-5, 5), strict=True)}

    def rows(biased: bool) -> list[SamplingRow]:
        extra = {"logit_bias": bias} if biased else {}
        return [
            row(temperature=0.0),
            row(temperature=0.0, **extra),
            row(generator=seeded(7), seed=7, top_k=20),
            row(generator=seeded(8), seed=8, **extra),
            row(generator=seeded(9), seed=9, top_p=0.8, logprobs=2),
            row(temperature=0.0, logprobs=1, **extra),
        ]

    unbiased_rows = [0, 2, 4]
    mixed = sample(logits, rows(biased=True))
    assert torch.equal(logits, before)
    alone = [sample(logits[i:i + 1], [rows(biased=False)[i]])[0] for i in unbiased_rows]
    assert [mixed[i] for i in unbiased_rows] == alone
    # A biased row samples as the unbiased sampler does on logits the bias was added to
    # (same seed): the bias comes before temperature, top-k/top-p and the draw.
    biased_logits = logits.clone()
    for t, b in bias.items():
        biased_logits[:, t] += b
    for i in (1, 3, 5):
        assert mixed[i] == sample(biased_logits[i:i + 1], [rows(biased=False)[i]])[0]
    assert mixed[1] != logits[1].argmax()  # the bias mattered


def test_no_bias_builds_no_bias_tensors() -> None:
    batch = SamplingBatch.build([row(temperature=0.0), row(seed=1)], 50, "cpu")
    assert batch.logit_bias_index is None
    assert takes_argmax(SamplingParams(temperature=0.0), 0)
    assert SamplingBatch.build([row(temperature=0.0)], 50, "cpu").fast_greedy


def test_bias_comes_before_suppression_and_penalties_and_logprobs_see_it() -> None:
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0, 0.0, 3.0]])
    # +100 on a suppressed token (EOS during min_tokens) does not bring it back.
    suppressed = row(temperature=0.0, min_tokens=2, suppress=frozenset({3}),
                     logit_bias={3: 100.0})
    assert sample(logits, [suppressed]) == [5]
    # The repetition penalty sees the biased logit: token 1 (seen) is 2 + 2 = 4, then / 2.
    params = dict(temperature=0.0, logprobs=6, repetition_penalty=2.0, logit_bias={1: 2.0})
    out = sampler(logits, SamplingBatch.build([row(prompt=[1], **params)], 6, "cpu"))
    expected = torch.tensor([1.0, 2.0, 0.5, -1.0, 0.0, 3.0])
    expected[1] = (2.0 + 2.0) / 2.0
    want = expected.log_softmax(-1)
    logprobs = out.logprobs[0]
    assert logprobs is not None and logprobs.token_id == 5
    assert logprobs.logprob == pytest.approx(float(want[5]))
    assert dict(logprobs.top) == pytest.approx({i: float(v) for i, v in enumerate(want)})


# --------------------------------------------------------------------------- engine vs HF

MAX_TOKENS = 10


class AddBias(LogitsProcessor):
    """Adds a fixed bias vector to every step's scores (what OpenAI's logit_bias does)."""

    def __init__(self, bias: dict[int, float], vocab_size: int) -> None:
        self.bias = torch.zeros(vocab_size)
        for t, b in bias.items():
            self.bias[t] = b

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return scores + self.bias.to(scores.device, scores.dtype)  # type: ignore[return-value]


def hf_biased_greedy(model_dir: Path, prompts: list[list[int]], bias: dict[int, float],
                     max_tokens: int) -> list[list[int]]:
    """HF greedy ``generate`` with the bias added by a logits processor (no min_new_tokens:
    a -100 bias on EOS keeps it from ending early)."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    processors = LogitsProcessorList([AddBias(bias, model.config.vocab_size)])
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
                                 logits_processor=processors)
            outs.append(out[0, len(prompt):].tolist())
    return outs


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_with_bias_matches_hf(arch, tiny_llama_dir, tiny_qwen2_dir) -> None:
    model_dir = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    llm = LLM(EngineConfig(model=str(model_dir), dtype="float32",
                           cache=CacheConfig(block_size=4, num_gpu_blocks_override=256),
                           scheduler=SchedulerConfig(max_num_batched_tokens=512)))
    vocab = llm.core.arch.vocab_size
    prompts = random_prompts(vocab, [3, 9, 17, 5, 12, 30], seed=4)
    rng = random.Random(5)
    bias = {t: rng.uniform(-3.0, 3.0) for t in rng.sample(range(vocab), 60)}
    # The most likely unbiased first tokens are banned, so the bias must change something;
    # EOS is banned too, so that neither side stops early and no min_tokens is needed
    # (min_tokens would keep the rows off the argmax fast path, which a bias must also do).
    plain = hf_greedy(model_dir, prompts, MAX_TOKENS)
    bias.update({out[0]: -100.0 for out in plain})
    bias[llm.tokenizer.eos_token_id] = -100.0
    expected = hf_biased_greedy(model_dir, prompts, bias, MAX_TOKENS)
    assert all(e != p for e, p in zip(expected, plain, strict=True))
    assert all(len(e) == MAX_TOKENS for e in expected)

    biased = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logit_bias=bias)
    results = llm.generate(prompts, biased)  # an all-greedy, all-biased batch
    assert [r.token_ids for r in results] == expected
    # Biased and unbiased greedy rows in one batch: each gets its own answer.
    unbiased = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    params = [biased if i % 2 else unbiased for i in range(len(prompts))]
    results = llm.generate(prompts, params)
    assert [r.token_ids for r in results] == [
        expected[i] if i % 2 else plain[i] for i in range(len(prompts))]


def test_offline_engine_rejects_out_of_vocab_ids(tiny_llama_dir) -> None:
    llm = LLM(EngineConfig(model=str(tiny_llama_dir), dtype="float32",
                           cache=CacheConfig(block_size=4, num_gpu_blocks_override=64)))
    vocab = llm.core.arch.vocab_size
    with pytest.raises(InvalidRequestError, match=rf"\[{vocab}, {vocab + 7}\].*"):
        llm.generate([[5, 6, 7]], SamplingParams(logit_bias={3: 1.0, vocab: 1.0, vocab + 7: 1.0}))
    with pytest.raises(InvalidRequestError, match=f"vocabulary size is {vocab}"):
        llm.generate([[5, 6, 7]], SamplingParams(logit_bias={vocab: 1.0}))


# --------------------------------------------------------------------------- API


@pytest.fixture(scope="module")
def stack(gateway_stack: GatewayStack) -> GatewayStack:
    return gateway_stack  # the session's (conftest), not one of the module's own


@pytest.fixture(scope="module")
def forced(tiny_llama_dir: Path) -> tuple[int, str]:
    """A plain word token and the text of 6 of it in a row."""
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    (token,) = tokenizer(" the", add_special_tokens=False).input_ids
    return token, tokenizer.decode([token] * 6)


@pytest.mark.parametrize("via", ["replica", "gateway"])
def test_plus_100_forces_the_token_through_the_api(stack, forced, via) -> None:
    token, text = forced
    target = stack.replica.target if via == "replica" else stack.gateway
    with Client(target, timeout=60) as client:
        kwargs: dict = dict(max_tokens=6, temperature=0, ignore_eos=True, logit_bias={token: 100})
        assert client.complete("Once upon a time", **kwargs).text == text
        chat = client.chat([{"role": "user", "content": "Tell me a story"}], **kwargs)
        assert chat.content == text
        assert "".join(c.text for c in client.complete_stream("The fox", **kwargs)) == text
        plain = client.complete("Once upon a time", max_tokens=6, temperature=0, ignore_eos=True)
        assert plain.text != text


def test_engine_generate_carries_the_bias(stack, forced) -> None:
    token, _ = forced
    with grpc.insecure_channel(stack.replica.target) as channel:
        responses = list(epb_grpc.EngineStub(channel).Generate(epb.GenerateRequest(
            request_id="bias-1", prompt_token_ids=[5, 6, 7, 8],
            sampling_params=epb.SamplingParams(max_tokens=5, temperature=0, ignore_eos=True,
                                               logit_bias={token: 100.0}),
            output_options=epb.OutputOptions(return_token_ids=True)), timeout=60))
    assert [t for r in responses for t in r.new_token_ids] == [token] * 5


@pytest.mark.parametrize("via", ["replica", "gateway"])
@pytest.mark.parametrize("bias, message", [
    ({7: 150.0}, "logit_bias values must be in [-100, 100], got {7: 150.0}"),
    ({7: 1.0, 400: 1.0, 1234: -5.0},
     "logit_bias token ids must be in [0, 400) (the vocabulary size is 400); got [400, 1234]"),
])
def test_bad_bias_is_invalid_argument(stack, via, bias, message) -> None:
    target = stack.replica.target if via == "replica" else stack.gateway
    with Client(target, timeout=60) as client:
        with pytest.raises(TandemError) as error:
            client.complete("Once upon a time", max_tokens=4, logit_bias=bias)
        assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert message in error.value.details
        with pytest.raises(TandemError) as error:
            client.chat([{"role": "user", "content": "Hi"}], max_tokens=4, logit_bias=bias)
        assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert message in error.value.details


def test_engine_generate_rejects_out_of_vocab_ids(stack) -> None:
    with grpc.insecure_channel(stack.replica.target) as channel:
        engine = epb_grpc.EngineStub(channel)
        with pytest.raises(grpc.RpcError) as error:
            list(engine.Generate(epb.GenerateRequest(
                request_id="bias-2", prompt_token_ids=[5, 6, 7],
                sampling_params=epb.SamplingParams(max_tokens=2, logit_bias={400: 1.0})),
                timeout=60))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "vocabulary size is 400" in error.value.details()
