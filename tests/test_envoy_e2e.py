"""End to end over HTTP: the real ``openai`` SDK and curl -> Envoy -> gateway -> replicas.

One cluster for the module (``tests.openai_http.running_stack``), all real processes on
loopback: a prefill and a decode replica on a tiny model, the gateway in front of them, and
Envoy (``deploy.envoy_runner``) in front of the gateway. Greedy text must equal the offline
engine's (``engine_common.llm.LLM``) on the same model, streamed (server-sent events) or
not; errors must come back with the right HTTP status and OpenAI's error body; gRPC
reflection must work through the same port. The decode replica admits one request at a time
and the gateway tries one replica, so overload is easy to provoke; the last test stops the
decode replica.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

import tandem
from deploy.envoy.filters import MAX_HEADER_BYTES
from deploy.envoy_config import tandem_version
from engine_common.llm import LLM
from engine_common.sampling_params import SamplingParams
from protos.tandem.v1 import generation_pb2, generation_pb2_grpc
from services.frontend.chat.request import chat_to_engine_request
from tandem.client import Client
from tandem.errors import AuthenticationError
from tandem.request_builders import chat_message, chat_request
from tests.openai_http import (
    CITY_SCHEMA,
    CLOCK,
    TOOL_MESSAGES,
    WEATHER,
    Stack,
    expected_tool_text,
    offline_engine,
    running_stack,
)
from tests.replica_process import (
    envoy_answers,
    free_port,
    is_serving,
    spawn_module,
    wait_until,
)

PROMPTS = ["alpha bravo charlie delta", "the tandem project serves models over grpc"]
# Longer than the gateway's prefill_min_uncached_tokens: the gateway adds a prefill hop.
LONG_PROMPT = " ".join(["kilo lima mike november oscar papa quebec romeo"] * 6)
MESSAGES = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": "Tell me a \"story\" about envoy"}]

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tiny_llama_dir, tmp_path_factory.mktemp("envoy-e2e-logs")) as running:
        yield running


@pytest.fixture(scope="module")
def offline(tiny_llama_dir: Path) -> LLM:
    return offline_engine(tiny_llama_dir)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def test_completions_equal_offline_greedy_streamed_or_not(stack: Stack, offline: LLM) -> None:
    client = stack.client()
    prompts = [*PROMPTS, LONG_PROMPT]
    expected = offline.generate(prompts, greedy(12))
    hops = stack.prefill_hops()
    for prompt, want in zip(prompts, expected, strict=True):
        completion = client.completions.create(model="tiny", prompt=prompt, max_tokens=12,
                                               **GREEDY)
        assert completion.object == "text_completion" and completion.id.startswith("cmpl-")
        assert completion.choices[0].text == want.text
        assert completion.choices[0].finish_reason == "length"
        assert completion.usage is not None
        assert completion.usage.prompt_tokens == len(want.prompt_token_ids)
        assert completion.usage.completion_tokens == 12

        chunks = list(client.completions.create(
            model="tiny", prompt=prompt, max_tokens=12, stream=True,
            stream_options={"include_usage": True}, **GREEDY))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    # The long prompt went through the prefill replica first (P/D), the short ones did not.
    assert stack.prefill_hops() > hops


def test_return_token_ids_give_the_prompt_and_output_ids(stack: Stack, offline: LLM) -> None:
    """vLLM's return_token_ids: the prompt's ids and each choice's (streamed: the prompt's
    with the first chunk, each chunk its own), as JSON integers; absent when not asked."""
    client = stack.client()
    ids = {"return_token_ids": True, "ignore_eos": True}
    want = offline.generate([PROMPTS[1]], greedy(6))[0]
    completion = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=6,
                                           temperature=0, extra_body=ids)
    extra = completion.choices[0].model_extra or {}
    assert (extra["prompt_token_ids"], extra["token_ids"]) == (want.prompt_token_ids,
                                                               want.token_ids)
    assert all(type(t) is int for t in extra["prompt_token_ids"] + extra["token_ids"])
    chunks = [c for c in client.completions.create(
        model="tiny", prompt=PROMPTS[1], max_tokens=6, temperature=0, stream=True,
        extra_body=ids) if c.choices]
    assert (chunks[0].choices[0].model_extra or {})["prompt_token_ids"] == want.prompt_token_ids
    streamed = [t for c in chunks for t in (c.choices[0].model_extra or {})["token_ids"]]
    assert streamed == want.token_ids and all(type(t) is int for t in streamed)

    chat_want = offline.generate([offline.inputs.tokenize_chat(MESSAGES)], greedy(5))[0]
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES,  # type: ignore[arg-type]
                                          max_tokens=5, temperature=0, extra_body=ids)
    assert (chat.model_extra or {})["prompt_token_ids"] == chat_want.prompt_token_ids
    assert (chat.choices[0].model_extra or {})["token_ids"] == chat_want.token_ids
    chat_chunks = list(client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=5, temperature=0,  # type: ignore[arg-type]
        stream=True, extra_body=ids))
    assert (chat_chunks[0].model_extra or {})["prompt_token_ids"] == chat_want.prompt_token_ids
    assert [t for c in chat_chunks for t in (c.choices[0].model_extra or {})["token_ids"]] == (
        chat_want.token_ids)

    plain = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=2)
    assert "token_ids" not in (plain.choices[0].model_extra or {})

    # The gRPC SDK, through the gateway.
    with Client(stack.gateway, timeout=60) as sdk:
        answer = sdk.complete(PROMPTS[1], max_tokens=6, temperature=0, ignore_eos=True,
                              return_token_ids=True)
        assert (answer.choices[0].prompt_token_ids, answer.choices[0].token_ids) == (
            want.prompt_token_ids, want.token_ids)
        pieces = list(sdk.chat_stream(MESSAGES, max_tokens=5, temperature=0, ignore_eos=True,
                                      return_token_ids=True))
        assert pieces[0].prompt_token_ids == chat_want.prompt_token_ids
        assert [t for p in pieces for t in p.token_ids or []] == chat_want.token_ids
        assert sdk.complete(PROMPTS[1], max_tokens=2).choices[0].token_ids is None


# Scored through the prefill replica (long enough for the gateway's prefill hop), and
# nothing before has put it in a prefix cache.
SCORED_PROMPT = " ".join(["sierra tango uniform victor whiskey xray yankee zulu"] * 6)


def test_echo_scores_a_prompt_as_evaluation_harnesses_ask(stack: Stack, offline: LLM) -> None:
    """lm-evaluation-harness's loglikelihood request (echo, logprobs, max_tokens 0 or 1, the
    prompt as token ids) through Envoy, the gateway and P/D: the prefill replica scores the
    prompt, the decode replica passes the scores on, equal to the offline engine's."""
    client = stack.client()
    want = offline.generate([SCORED_PROMPT], SamplingParams(
        temperature=0.0, max_tokens=2, prompt_logprobs=2, logprobs=2))[0]
    ids, expected = want.prompt_token_ids, want.prompt_logprobs
    assert expected is not None and expected[0] is None
    prompt_text = offline.inputs.detokenize(ids)

    def check_prompt(logprobs: Any, num_positions: int) -> None:
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        assert len(logprobs.tokens) == num_positions
        for position in range(1, len(ids)):
            entry = expected[position]
            assert entry is not None
            assert logprobs.token_logprobs[position] == pytest.approx(entry.logprob, abs=1e-4)
            # The two most likely and the prompt's token, by text (tokens that decode alike,
            # such as partial characters, share an entry in OpenAI's shape).
            allowed = [entry.logprob, *(logprob for _, logprob in entry.top)]
            for value in logprobs.top_logprobs[position].values():
                assert any(value == pytest.approx(a, abs=1e-4) for a in allowed)
        assert "".join(logprobs.tokens[:len(ids)]) == prompt_text

    hops = stack.prefill_hops()
    scored = client.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True,
                                       logprobs=2, temperature=0)
    assert stack.prefill_hops() > hops  # the prefill replica scored it
    choice = scored.choices[0]
    assert choice.text == prompt_text and choice.finish_reason == "length"
    assert scored.usage is not None and scored.usage.completion_tokens == 0
    check_prompt(choice.logprobs, len(ids))

    # max_tokens 1: the prompt, then the generated token and its logprob.
    one = client.completions.create(model="tiny", prompt=ids, max_tokens=1, echo=True,
                                    logprobs=2, **GREEDY)
    check_prompt(one.choices[0].logprobs, len(ids) + 1)
    assert one.choices[0].text == prompt_text + offline.inputs.detokenize(want.token_ids[:1])
    first = want.logprobs[0]
    assert first is not None
    assert one.choices[0].logprobs.token_logprobs[-1] == pytest.approx(first.logprob, abs=1e-4)

    # Streamed: the first chunk starts with the prompt and carries its logprobs.
    chunks = [c for c in client.completions.create(
        model="tiny", prompt=SCORED_PROMPT, max_tokens=2, echo=True, logprobs=2, stream=True,
        **GREEDY) if c.choices]
    assert chunks[0].choices[0].text.startswith(SCORED_PROMPT)
    assert "".join(c.choices[0].text for c in chunks) == SCORED_PROMPT + want.text
    streamed = [t for c in chunks for t in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and len(streamed) == len(ids) + 2

    # vLLM's prompt_logprobs: per position the prompt's token and the top ones, by token id.
    extra = client.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0,
                                      extra_body={"prompt_logprobs": 1})
    listed = extra.choices[0].model_extra["prompt_logprobs"]
    assert listed[0] is None and len(listed) == len(ids)
    for position in range(1, len(ids)):
        entry = expected[position]
        assert entry is not None
        own = listed[position][str(ids[position])]
        assert own["logprob"] == pytest.approx(entry.logprob, abs=1e-4)
        assert own["rank"] == entry.rank
    with pytest.raises(openai.BadRequestError, match="not available with stream"):
        client.completions.create(model="tiny", prompt=ids, max_tokens=1, stream=True,
                                  extra_body={"prompt_logprobs": 1})
    with pytest.raises(openai.BadRequestError, match="only with echo"):
        client.completions.create(model="tiny", prompt=ids, max_tokens=0)

    # The gRPC SDK reads the same answer, the unscored first token as None.
    with Client(stack.gateway) as sdk:
        answer = sdk.complete(ids, max_tokens=0, echo=True, logprobs=1, prompt_logprobs=0)
    assert answer.logprobs[0].logprob is None and len(answer.logprobs) == len(ids)
    assert answer.logprobs[1].logprob == pytest.approx(expected[1].logprob, abs=1e-4)
    assert answer.prompt_logprobs is not None and answer.prompt_logprobs[0] is None
    assert answer.prompt_logprobs[1] == {ids[1]: tandem.PromptLogprob(
        pytest.approx(expected[1].logprob, abs=1e-4), expected[1].rank,
        offline.inputs.detokenize(ids[1:2]))}


def test_chat_prompt_logprobs_score_the_rendered_prompt(stack: Stack, offline: LLM) -> None:
    ids = offline.inputs.tokenize_chat(MESSAGES)
    want = offline.generate([ids], SamplingParams(temperature=0.0, max_tokens=1,
                                                  prompt_logprobs=0))[0]
    assert want.prompt_logprobs is not None
    chat = stack.client().chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=1, extra_body={"prompt_logprobs": 0})
    listed = chat.model_extra["prompt_logprobs"]
    assert len(listed) == len(ids) and listed[0] is None
    for position, entry in enumerate(want.prompt_logprobs[1:], start=1):
        assert entry is not None
        assert listed[position] == {str(ids[position]): {
            "logprob": pytest.approx(entry.logprob, abs=1e-4), "rank": entry.rank,
            "decoded_token": offline.inputs.detokenize(ids[position:position + 1])}}


def test_chat_equals_offline_greedy_streamed_or_not(stack: Stack, offline: LLM) -> None:
    client = stack.client()
    want = offline.generate([offline.inputs.tokenize_chat(MESSAGES)], greedy(10))[0]
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES,  # type: ignore[arg-type]
                                          max_tokens=10, **GREEDY)
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
    message = chat.choices[0].message
    assert (message.role, message.content, chat.choices[0].finish_reason) == (
        "assistant", want.text, "length")
    chunks = list(client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=10, stream=True, **GREEDY))  # type: ignore[arg-type]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    # Content as a list of text parts, as newer clients send it, reads as the same text.
    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]}
             for m in MESSAGES]
    chat = client.chat.completions.create(model="tiny", messages=parts,  # type: ignore[arg-type]
                                          max_tokens=10, **GREEDY)
    assert chat.choices[0].message.content == want.text


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "not-thinking"])
def test_reasoning_is_returned_apart_from_the_content(stack: Stack, offline: LLM,
                                                      thinking: bool) -> None:
    """chat_template_kwargs reach the template (the tiny template's enable_thinking opens a
    <think> block for the answer; by default it closes an empty one); an open block makes the output
    reasoning (the random model never writes </think>), a closed one content. The openai SDK
    through Envoy and the gRPC SDK through the gateway, streamed or not, say the same."""
    kwargs = {"enable_thinking": thinking}
    prompt = offline.inputs.tokenize_chat(MESSAGES, template_kwargs=kwargs)
    assert (prompt != offline.inputs.tokenize_chat(MESSAGES)) == thinking
    want = offline.generate([prompt], greedy(10))[0]
    assert "</think>" not in want.text and want.text.strip()
    reasoning, content = (want.text, None) if thinking else (None, want.text)

    client = stack.client()
    options: dict[str, Any] = {"model": "tiny", "messages": MESSAGES, "max_tokens": 10,
                               "temperature": 0, "extra_body": {
                                   "ignore_eos": True, "chat_template_kwargs": kwargs}}
    chat = client.chat.completions.create(**options)
    message = chat.choices[0].message
    assert chat.usage is not None and chat.usage.prompt_tokens == len(prompt)
    # Every token of an open block is the reasoning's (ignore_eos: all 10 of them).
    details = chat.usage.completion_tokens_details
    assert details is not None and details.reasoning_tokens == (10 if thinking else 0)
    assert (message.content, (message.model_extra or {}).get("reasoning")) == (content, reasoning)
    chunks = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **options)
              if c.choices]
    streamed = "".join((d.model_extra or {}).get("reasoning") or "" for d in chunks)
    assert streamed == (reasoning or "")
    assert "".join(d.content or "" for d in chunks) == (content or "")
    # include_reasoning false (vLLM's): the thinking is split off and left out.
    options["extra_body"]["include_reasoning"] = False
    message = client.chat.completions.create(**options).choices[0].message
    assert ((message.model_extra or {}).get("reasoning"), message.content or "") == (
        None, content or "")

    with Client(stack.gateway, timeout=60) as sdk:
        sdk_options: dict[str, Any] = {"max_tokens": 10, "temperature": 0, "ignore_eos": True,
                                       "chat_template_kwargs": kwargs}
        answer = sdk.chat(MESSAGES, **sdk_options)
        assert (answer.reasoning, answer.content) == (reasoning, content or "")
        assert answer.usage is not None
        assert answer.usage.reasoning_tokens == (10 if thinking else 0)
        pieces = list(sdk.chat_stream(MESSAGES, **sdk_options))
        assert "".join(p.reasoning for p in pieces) == (reasoning or "")
        assert "".join(p.content for p in pieces) == (content or "")
        assert sdk.chat(MESSAGES, include_reasoning=False, **sdk_options).reasoning is None




def test_continue_final_message_continues_the_assistant_turn(stack: Stack,
                                                             offline: LLM) -> None:
    """vLLM's continue_final_message: the last (assistant) message stays open and the model
    continues it; through Envoy (openai SDK) and the gateway (gRPC SDK), equal to the
    offline engine on the same rendering."""
    messages = [*MESSAGES, {"role": "assistant", "content": "Once upon a time"}]
    rendered = offline.inputs.render_chat(messages, add_generation_prompt=False,
                                          continue_final_message=True)
    assert rendered.endswith("Once upon a time")  # no end of turn after it
    want = offline.generate([offline.inputs.tokenize_rendered(rendered)], greedy(8))[0]
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    chat = stack.client().chat.completions.create(
        model="tiny", messages=messages, max_tokens=8,  # type: ignore[arg-type]
        temperature=0, extra_body={"ignore_eos": True, **flags})
    assert chat.choices[0].message.content == want.text
    with Client(stack.gateway, timeout=60) as sdk:
        assert sdk.chat(messages, max_tokens=8, temperature=0, ignore_eos=True,
                        **flags).content == want.text  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="set add_generation_prompt to false"):
        stack.client().chat.completions.create(
            model="tiny", messages=messages, max_tokens=2,  # type: ignore[arg-type]
            extra_body={"continue_final_message": True})
    # Tokenize renders the same way.
    with grpc.insecure_channel(stack.gateway) as channel:
        tokens = generation_pb2_grpc.GenerationStub(channel).Tokenize(
            generation_pb2.TokenizeRequest(messages=[chat_message(m) for m in messages],
                                           **flags), timeout=30).tokens
    assert list(tokens) == want.prompt_token_ids


# Long enough for the gateway's prefill hop: the prefill replica samples the first token
# (grammar waiting), the decode replica the rest (the grammar starts there).
THINKING_MESSAGES = [{"role": "system", "content": " ".join(["think before answering"] * 20)},
                     *MESSAGES[1:]]


@pytest.mark.parametrize("messages", [MESSAGES, THINKING_MESSAGES], ids=["short", "prefill-hop"])
def test_a_thinking_model_reasons_before_its_constrained_answer(
        stack: Stack, offline: LLM, messages: list[dict[str, str]]) -> None:
    """Thinking on (the prompt opens <think>) and a JSON schema: the model thinks freely
    until it writes the </think> token (a bias makes the random model do so soon), then
    answers under the schema; through Envoy and the gateway (with a prefill hop for the
    long prompt), as the offline engine does with the same resolved request."""
    think_end = offline.inputs.single_token("</think>")
    assert think_end is not None
    options: dict[str, Any] = {
        "max_tokens": 48, "temperature": 0, "ignore_eos": True, "logit_bias": {think_end: 3.0},
        "chat_template_kwargs": {"enable_thinking": True},
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "trip", "schema": CITY_SCHEMA}}}
    resolved = chat_to_engine_request(chat_request(
        messages, model=None, logprobs=False, top_logprobs=None, stream=False,
        include_usage=False, options=options), offline.inputs)
    want = offline.generate([resolved.request.prompt_token_ids], resolved.request.params)[0]
    reasoning, content = resolved.reasoning.split(want.text)
    assert reasoning and "</think>" not in reasoning and want.finish_reason == "stop"
    assert json.loads(content)["city"] in ("Oslo", "Lima")  # the grammar ended the answer

    client = stack.client()
    extra = {k: options[k] for k in ("chat_template_kwargs", "ignore_eos")}
    hops = stack.prefill_hops()
    chat = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=48, temperature=0,  # type: ignore[arg-type]
        logit_bias={str(think_end): 3}, response_format=options["response_format"],
        extra_body=extra)
    message = chat.choices[0].message
    assert ((message.model_extra or {}).get("reasoning"), message.content) == (reasoning,
                                                                              content)
    if messages is THINKING_MESSAGES:
        assert stack.prefill_hops() > hops
    with Client(stack.gateway, timeout=60) as sdk:
        answer = sdk.chat(messages, **options)
        assert (answer.reasoning, answer.content) == (reasoning, content)


def test_chat_template_kwargs_may_not_override_the_request(stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError, match="may not set add_generation_prompt"):
        stack.client().chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=2,  # type: ignore[arg-type]
            extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})


def test_a_named_tool_choice_forces_that_call(stack: Stack, offline: LLM) -> None:
    client = stack.client()
    choice = {"type": "function", "function": {"name": "get_weather"}}
    want = expected_tool_text(offline, choice)
    chat = client.chat.completions.create(
        model="tiny", messages=TOOL_MESSAGES, tools=[WEATHER, CLOCK],  # type: ignore[arg-type, list-item]
        tool_choice=choice, max_tokens=48, temperature=0)  # type: ignore[arg-type]
    message, finish = chat.choices[0].message, chat.choices[0].finish_reason
    assert message.content is None and finish == "stop"
    assert message.tool_calls is not None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert call.function.arguments == want  # type: ignore[union-attr]
    arguments = json.loads(want)
    assert arguments["city"] in ("Oslo", "Lima") and 1 <= arguments["days"] <= 7

    # Streamed: the call's id and name first, then its arguments in pieces.
    chunks = list(client.chat.completions.create(
        model="tiny", messages=TOOL_MESSAGES, tools=[WEATHER, CLOCK],  # type: ignore[arg-type, list-item]
        tool_choice=choice, max_tokens=48, temperature=0, stream=True))  # type: ignore[arg-type]
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "get_weather"  # type: ignore[union-attr]
    assert all(d.index == 0 and not d.id for d in deltas[1:])
    assert "".join(d.function.arguments or "" for d in deltas) == want  # type: ignore[union-attr]
    assert chunks[-1].choices[0].finish_reason == "stop"

    # The gRPC SDK through the gateway: the same call (the schema's keys arrive in another
    # order over gRPC than through Envoy, and must not change the grammar).
    with Client(stack.gateway, timeout=60) as sdk:
        answer = sdk.chat(TOOL_MESSAGES, model="tiny", tools=[WEATHER, CLOCK],
                          tool_choice=choice, max_tokens=48, temperature=0)
        assert [(c.name, c.arguments) for c in answer.tool_calls] == [("get_weather", want)]
        assert answer.finish_reason == "stop" and answer.content == ""
        pieces = list(sdk.chat_stream(TOOL_MESSAGES, model="tiny", tools=[WEATHER, CLOCK],
                                      tool_choice=choice, max_tokens=48, temperature=0))
        assert "".join(c.arguments for p in pieces for c in p.tool_calls) == want
        follow_up = sdk.chat([*TOOL_MESSAGES, {"role": "assistant", "content": None,
                                               "tool_calls": [{"id": answer.tool_calls[0].id,
                                                               "type": "function",
                                                               "function": {"name": "get_weather",
                                                                            "arguments": want}}]},
                              {"role": "tool", "tool_call_id": answer.tool_calls[0].id,
                               "content": "sunny"}], model="tiny", max_tokens=4, temperature=0)
        assert follow_up.content and not follow_up.tool_calls


def test_required_tool_calls_parse_into_calls(stack: Stack, offline: LLM) -> None:
    client = stack.client()
    # One call (parallel_tool_calls=false): the random model would keep adding calls.
    want = [(c["name"], c["parameters"]) for c in json.loads(
        expected_tool_text(offline, "required", 64, parallel_tool_calls=False))]
    assert len(want) == 1 and want[0][0] in ("get_weather", "get_time")
    for stream in (False, True):
        response = client.chat.completions.create(
            model="tiny", messages=TOOL_MESSAGES, tools=[WEATHER, CLOCK],  # type: ignore[arg-type, list-item]
            tool_choice="required", parallel_tool_calls=False, max_tokens=64, temperature=0,
            stream=stream)
        if stream:
            chunks = list(response)  # type: ignore[arg-type]
            calls = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
            assert [d.index for d in calls] == [0]
            finish = chunks[-1].choices[0].finish_reason
        else:
            calls = response.choices[0].message.tool_calls or []  # type: ignore[union-attr]
            finish = response.choices[0].finish_reason  # type: ignore[union-attr]
        assert finish == "tool_calls"
        assert [(c.function.name, json.loads(c.function.arguments))  # type: ignore[union-attr]
                for c in calls] == want
        assert calls[0].id.startswith("call_")  # type: ignore[union-attr]
    # Cut off by max_tokens before the list closes: no calls, the text as content.
    cut = client.chat.completions.create(
        model="tiny", messages=TOOL_MESSAGES, tools=[WEATHER, CLOCK],  # type: ignore[arg-type, list-item]
        tool_choice="required", max_tokens=5, temperature=0)
    assert cut.choices[0].finish_reason == "length" and not cut.choices[0].message.tool_calls
    assert cut.choices[0].message.content == expected_tool_text(offline, "required", 5)


def test_tool_conversations_and_unservable_tool_choices(stack: Stack, offline: LLM) -> None:
    client = stack.client()
    # A whole function-calling turn comes back as messages: the call, then its result.
    history = [*TOOL_MESSAGES,
               {"role": "assistant", "content": None, "tool_calls": [{
                   "id": "call_1", "type": "function",
                   "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    chat = client.chat.completions.create(model="tiny", messages=history,  # type: ignore[arg-type]
                                          tools=[WEATHER], tool_choice="none", max_tokens=6,
                                          **GREEDY)
    rendered = [{k: v for k, v in m.items() if k != "tool_calls"} for m in history]
    rendered[1]["content"] = ""
    want = offline.generate([offline.inputs.tokenize_chat(rendered)], greedy(6))[0]
    assert chat.choices[0].message.content == want.text and not chat.choices[0].message.tool_calls
    for options, message in [
        ({"tools": [WEATHER]}, 'tool_choice "auto"'),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "not among the tools (get_weather)"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "more than once"),
        ({"tools": [WEATHER], "tool_choice": "required",
          "response_format": {"type": "json_object"}}, "already constrains the output"),
    ]:
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(model="tiny", messages=TOOL_MESSAGES,  # type: ignore[arg-type]
                                           max_tokens=4, **options)
        assert message in raised.value.message


def test_curl_gets_server_sent_events(stack: Stack, offline: LLM) -> None:
    want = offline.generate([PROMPTS[1]], greedy(8))[0]
    body = json.dumps({"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 8,
                       "temperature": 0, "ignore_eos": True, "stream": True})
    result = subprocess.run(
        ["curl", "-sS", "-N", "-i", f"{stack.base_url}/completions",
         "-H", "content-type: application/json", "-d", body],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    head, _, events = result.stdout.replace("\r\n", "\n").partition("\n\n")
    assert head.startswith("HTTP/1.1 200")
    headers = {line.split(":", 1)[0].lower(): line.split(":", 1)[1].strip()
               for line in head.splitlines()[1:]}
    assert headers["content-type"] == "text/event-stream"
    assert "grpc-status" not in headers
    assert events.endswith("\n\ndata: [DONE]\n\n")  # OpenAI's end of stream, once
    frames = [frame for frame in events.split("\n\n") if frame.strip()]
    assert frames and all(frame.startswith("data: ") for frame in frames)
    assert frames.count("data: [DONE]") == 1
    chunks = [json.loads(frame[len("data: "):]) for frame in frames[:-1]]
    assert all(c["object"] == "text_completion" and c["choices"][0]["index"] == 0
               for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == want.text


STREAM_IN_TEXT = ['say "stream": true', 'escaped \\"stream\\": true\\"', '{"stream":true}',
                  '"stream" : true, "stream": true']
STREAM_SCHEMA = {"type": "object", "properties": {"stream": {"type": "boolean", "default": True}},
                 "required": ["stream"], "additionalProperties": False, "stream": True}


def test_only_the_top_level_stream_field_streams(stack: Stack, offline: LLM) -> None:
    """Envoy reads "stream" from the parsed JSON body: the word with a true after it in a
    prompt (quoted, escaped), in a nested object (chat_template_kwargs) or in a JSON schema
    (a property named stream, with "default": true and "stream": true inside) leaves the
    request non-streaming, and the openai SDK gets its object back; the top-level field
    still streams."""
    client = stack.client()
    for prompt in STREAM_IN_TEXT:
        want = offline.generate([prompt], greedy(6))[0]
        completion = client.completions.create(model="tiny", prompt=prompt, max_tokens=6,
                                               **GREEDY)
        assert completion.object == "text_completion", prompt  # not a string of events
        assert completion.choices[0].text == want.text, prompt
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=6,
                                                stream=True, **GREEDY))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text

    nested = {"ignore_eos": True, "chat_template_kwargs": {"stream": True, "note": '"stream": true'}}
    want_chat = offline.generate([offline.inputs.tokenize_chat(
        MESSAGES, template_kwargs=nested["chat_template_kwargs"])], greedy(6))[0]
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES,  # type: ignore[arg-type]
                                          max_tokens=6, temperature=0, extra_body=nested)
    assert chat.object == "chat.completion" and chat.choices[0].message.content == want_chat.text

    response_format = {"type": "json_schema",
                       "json_schema": {"name": "flags", "schema": STREAM_SCHEMA}}
    options: dict[str, Any] = {"max_tokens": 24, "temperature": 0,
                               "response_format": response_format}
    resolved = chat_to_engine_request(chat_request(
        MESSAGES, model=None, logprobs=False, top_logprobs=None, stream=False,
        include_usage=False, options=options), offline.inputs)
    want = offline.generate([resolved.request.prompt_token_ids], resolved.request.params)[0]
    for stream in (False, True):
        answer = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=24, temperature=0,  # type: ignore[arg-type]
            response_format=response_format, stream=stream)  # type: ignore[call-overload]
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in answer if c.choices)
        else:
            assert answer.object == "chat.completion"
            text = answer.choices[0].message.content
        assert text == want.text, stream


def test_health_ping_version_and_metrics(stack: Stack) -> None:
    """vLLM's probe routes on the HTTP port: /health and /ping are 200 while the gateway
    reports SERVING (a decode replica is ready), /version is Tandem's, /metrics is the
    gateway's Prometheus text (the same families as its own metrics port)."""
    for path in ("/health", "/ping"):
        status, _, body = get_bytes(stack, path)
        assert (status, body) == (200, b""), path
    status, _, body = get_bytes(stack, "/version")
    assert status == 200 and json.loads(body) == {"version": tandem_version()}
    status, headers, body = get_bytes(stack, "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    families = {f.name for f in text_string_to_metric_families(body.decode())}
    assert {"tandem:gateway_routing_decisions", "tandem:gateway_replicas"} <= families
    direct = f"http://127.0.0.1:{stack.gateway_metrics_port}/metrics"
    with urllib.request.urlopen(direct, timeout=10) as response:
        assert families == {f.name for f in text_string_to_metric_families(
            response.read().decode())}


def test_edge_statuses_with_the_real_gateway(stack: Stack, offline: LLM) -> None:
    """Headers the edge accepts fit what the gateway accepts (a request just under the
    limit is served, over HTTP and gRPC); over it, 431 from the edge, not the gateway's
    RESOURCE_EXHAUSTED (a 429 telling the client to retry); a wrong method is a 405 and JSON
    on the gRPC path a 415, not the 503 of a request the gateway cannot read."""
    want = offline.generate([PROMPTS[0]], greedy(4))[0]
    body = json.dumps({"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 4,
                       "temperature": 0, "ignore_eos": True}).encode()
    near = {"x-padding": "p" * (MAX_HEADER_BYTES - 1000)}
    status, _, payload = post_raw(stack, "/v1/completions", body, near)
    assert status == 200 and payload["choices"][0]["text"] == want.text
    with grpc.insecure_channel(f"127.0.0.1:{stack.http_port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        models = stub.ListModels(generation_pb2.ListModelsRequest(),
                                 metadata=list(near.items()), timeout=30)
        assert [m.id for m in models.data] == ["tiny"]
        with pytest.raises(grpc.RpcError) as raised:
            stub.ListModels(generation_pb2.ListModelsRequest(),
                            metadata=[("x-padding", "p" * 50_000)], timeout=30)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status, _, payload = post_raw(stack, "/v1/completions", body, {"x-padding": "p" * 50_000})
    assert status == 431 and payload["error"]["type"] == "invalid_request_error"
    status, headers, payload = get_raw(stack, "/v1/completions")
    assert (status, headers["allow"]) == (405, "POST")
    status, _, payload = post_raw(stack, "/tandem.v1.Generation/Complete", body)
    assert status == 415 and payload["error"]["type"] == "invalid_request_error"


def test_a_refused_header_list_never_cuts_the_callers_other_streams(
        stack: Stack, offline: LLM) -> None:
    """Through Envoy's gRPC port, on one HTTP/2 connection: a stream is running when the same
    caller sends a call with a 104 KB header list, then one with 200 header fields. Each gets
    INVALID_ARGUMENT naming the limit (the edge filter's answer: the codec's limits are far
    above), and the stream runs to its end: no GOAWAY cut the connection."""
    want = offline.generate([PROMPTS[1]], greedy(200))[0]
    request = generation_pb2.CompletionRequest(model="tiny", max_tokens=200, temperature=0,
                                               ignore_eos=True)
    request.prompt.string_value = PROMPTS[1]
    with grpc.insecure_channel(f"127.0.0.1:{stack.http_port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        stream = stub.CompleteStream(request, timeout=120)
        pieces = [next(stream).choices[0].text]
        for metadata, says in (([(f"x-b{i}", "b" * 8_000) for i in range(13)], "bytes"),
                               ([(f"x-h{i}", "v") for i in range(200)], "header fields")):
            with pytest.raises(grpc.RpcError) as raised:
                stub.ListModels(generation_pb2.ListModelsRequest(), metadata=metadata,
                                timeout=30)
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value
            assert says in (raised.value.details() or "")
        pieces += [c.choices[0].text for c in stream if c.choices]
    assert "".join(pieces) == want.text


def test_models_tokenize_and_detokenize(stack: Stack, offline: LLM) -> None:
    client = stack.client()
    listed = client.models.list().data
    assert [m.id for m in listed] == ["tiny"]
    assert client.models.retrieve("tiny") == listed[0]
    # The SDK escapes a slash in the id (org%2Fname); curl sends it as it is.
    for missing in ("nope", "org/nope"):
        with pytest.raises(openai.NotFoundError, match=f"The model '{missing}' does not exist"):
            client.models.retrieve(missing)
    status, _, body = get_raw(stack, "/v1/models/org/nope")
    assert status == 404 and body["error"]["message"] == "The model 'org/nope' does not exist"
    assert (body["error"]["code"], body["error"]["param"]) == ("model_not_found", "model")

    def post(path: str, payload: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            f"http://127.0.0.1:{stack.http_port}{path}", data=json.dumps(payload).encode(),
            headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return dict(json.loads(response.read()))

    tokens = post("/tokenize", {"prompt": PROMPTS[0]})
    assert tokens["tokens"] == offline.inputs.tokenize(PROMPTS[0])
    assert tokens["count"] == len(tokens["tokens"])
    assert post("/detokenize", {"tokens": tokens["tokens"]})["prompt"].strip() == PROMPTS[0]


def get_bytes(stack: Stack, path: str) -> tuple[int, dict[str, str], bytes]:
    """Status, headers (lower-case names) and body of ``GET path`` on Envoy."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{stack.http_port}{path}",
                                    timeout=30) as response:
            status, headers, body = response.status, response.headers, response.read()
    except urllib.error.HTTPError as error:
        status, headers, body = error.code, error.headers, error.read()
    return status, {k.lower(): v for k, v in headers.items()}, body


def get_raw(stack: Stack, path: str) -> tuple[int, dict[str, str], Any]:
    status, headers, body = get_bytes(stack, path)
    return status, headers, json.loads(body)


def post_raw(stack: Stack, path: str, body: bytes, headers: dict[str, str] | None = None,
             port: int | None = None) -> tuple[int, dict[str, str], Any]:
    request = urllib.request.Request(f"http://127.0.0.1:{port or stack.http_port}{path}",
                                     data=body, headers={"content-type": "application/json",
                                                         **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            status, answer, raw = response.status, response.headers, response.read()
    except urllib.error.HTTPError as error:
        status, answer, raw = error.code, error.headers, error.read()
    return status, {k.lower(): v for k, v in answer.items()}, json.loads(raw)


def test_bad_requests_get_openai_errors(stack: Stack) -> None:
    client = stack.client()
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model="tiny", prompt="alpha", temperature=-1)
    assert raised.value.status_code == 400
    assert "temperature must be non-negative" in raised.value.message
    assert raised.value.body == {"message": raised.value.body["message"],  # type: ignore[index]
                                 "type": "invalid_request_error", "param": "temperature",
                                 "code": "invalid_argument"}
    with pytest.raises(openai.NotFoundError, match="not served here") as missing:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)  # type: ignore[arg-type]
    assert missing.value.status_code == 404  # as OpenAI and vLLM answer
    assert missing.value.body["code"] == "model_not_found"  # type: ignore[index]
    assert missing.value.body["param"] == "model"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model="tiny", prompt="alpha " * 5000, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="non-negative"):  # also when streaming
        client.completions.create(model="tiny", prompt="alpha", temperature=-1, stream=True)
    status, headers, payload = post_raw(stack, "/v1/chat/completions", b'{"messages": [')
    assert status == 400 and headers["content-type"] == "application/json"
    assert payload["error"]["type"] == "invalid_request_error"
    status, _, payload = post_raw(stack, "/v1/embeddings", b"{}")
    assert status == 404 and payload["error"]["type"] == "not_found_error"


def test_overload_is_a_429(stack: Stack) -> None:
    client = stack.client()
    # The decode replica runs one request and queues none: hold its slot with a long stream.
    holder = client.completions.create(model="tiny", prompt="alpha", max_tokens=400,
                                       stream=True, **GREEDY)
    try:
        next(iter(holder))
        with pytest.raises(openai.RateLimitError) as raised:
            client.completions.create(model="tiny", prompt="bravo", max_tokens=2)
        assert raised.value.status_code == 429
        assert "queue is full" in raised.value.message
        assert raised.value.body["type"] == "rate_limit_error"  # type: ignore[index]
        assert raised.value.body["code"] == "resource_exhausted"  # type: ignore[index]
    finally:
        holder.close()


def test_api_keys_guard_every_route_but_health(stack: Stack, offline: LLM,
                                               tmp_path: Path) -> None:
    """A second Envoy with API keys in front of the same gateway: the openai SDK and the gRPC
    SDK get in with a key (Bearer or x-api-key) and get a 401 / UNAUTHENTICATED without one;
    health checks need none."""
    key_file = tmp_path / "api-keys"
    key_file.write_text("# one key per line\nkey-alpha\n\nkey-bravo\n")
    port = free_port()
    envoy = spawn_module(stack.logs, "envoy-keys", [
        "deploy.envoy_runner", "--http-port", str(port), "--upstream", stack.gateway,
        "--concurrency", "1", "--api-key-file", str(key_file)])
    try:
        wait_until(lambda: envoy_answers(port), time.monotonic() + 60, "envoy-keys", stack.logs)
        base_url = f"http://127.0.0.1:{port}/v1"
        want = offline.generate([PROMPTS[0]], greedy(6))[0]
        with pytest.raises(openai.AuthenticationError) as raised:
            openai.OpenAI(base_url=base_url, api_key="key-wrong", max_retries=0).completions \
                .create(model="tiny", prompt=PROMPTS[0], max_tokens=6)
        assert raised.value.status_code == 401
        assert raised.value.body["type"] == "authentication_error"  # type: ignore[index]
        assert raised.value.body["code"] == "invalid_api_key"  # type: ignore[index]
        client = openai.OpenAI(base_url=base_url, api_key="key-bravo", max_retries=0)
        completion = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6,
                                               **GREEDY)
        assert completion.choices[0].text == want.text
        streamed = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6,
                                             stream=True, **GREEDY)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == want.text
        request = urllib.request.Request(f"{base_url}/models",
                                         headers={"x-api-key": "key-alpha"})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert json.loads(response.read())["data"][0]["id"] == "tiny"

        # The scheme is case-insensitive; a bare key is no key (as OpenAI and vLLM read it).
        body = json.dumps({"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 6,
                           "temperature": 0, "ignore_eos": True}).encode()
        for authorization, status in (("key-alpha", 401), ("bearer key-alpha", 200),
                                      ("BEARER key-bravo", 200)):
            answer = post_raw(stack, "/v1/completions", body, {"authorization": authorization},
                              port=port)
            assert answer[0] == status, authorization
            if status == 200:
                assert answer[2]["choices"][0]["text"] == want.text

        target = f"127.0.0.1:{port}"
        with Client(target, timeout=60) as anonymous:
            with pytest.raises(AuthenticationError):
                anonymous.complete(PROMPTS[0], max_tokens=6, temperature=0, ignore_eos=True)
        with Client(target, api_key="key-alpha", timeout=60) as keyed:
            assert keyed.complete(PROMPTS[0], max_tokens=6, temperature=0,
                                  ignore_eos=True).text == want.text
        # A plain gRPC client: the key as metadata, UNAUTHENTICATED (16) without it.
        request = generation_pb2.CompletionRequest(model="tiny", max_tokens=6, temperature=0,
                                                   ignore_eos=True)
        request.prompt.string_value = PROMPTS[0]
        with grpc.insecure_channel(target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            for metadata in ((), (("authorization", "key-alpha"),), (("x-api-key", "nope"),)):
                with pytest.raises(grpc.RpcError) as refused:
                    stub.Complete(request, metadata=metadata, timeout=60)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
                assert refused.value.code().value[0] == 16
            for metadata in ((("authorization", "bearer key-bravo"),),
                             (("x-api-key", "key-alpha"),)):
                reply = stub.Complete(request, metadata=metadata, timeout=60)
                assert reply.choices[0].text == want.text, metadata
        assert is_serving(target)  # gRPC health: no key
    finally:
        os.killpg(envoy.pid, signal.SIGTERM)
        envoy.wait(30)


def test_reflection_lists_the_services_through_envoy(stack: Stack) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{stack.http_port}") as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=30)
        services = {s.name for reply in replies
                    for s in reply.list_services_response.service}
    assert {"tandem.v1.Generation", "grpc.health.v1.Health"} <= services


def test_a_stream_broken_midway_ends_with_an_error_event(stack: Stack) -> None:
    """The decode replica dies after the stream began and no replica is left to continue it
    (the prefill replica, which would run it whole, died first): the client gets an OpenAI
    error event, then [DONE], not a silently truncated stream."""
    body = json.dumps({"model": "tiny", "prompt": "alpha", "max_tokens": 400, "stream": True,
                       "temperature": 0, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"{stack.base_url}/completions", data=body,
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200
        first = response.readline().decode()
        assert first.startswith("data: {") and '"text_completion"' in first
        stack.replicas["prefill"].kill()
        stack.replicas["decode"].kill()
        events = [e.strip() for e in response.read().decode().split("\n\n") if e.strip()]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "unavailable" and error["type"] == "server_error"
    assert error["message"]  # says why (the replica is gone and the stream was not resumed)
    assert all(json.loads(e.removeprefix("data: "))["object"] == "text_completion"
               for e in events[:-2])


def test_no_replica_is_a_503(stack: Stack) -> None:
    stack.replicas["decode"].stop()
    client = stack.client()
    deadline = time.monotonic() + 30
    while True:  # until the gateway has seen the replica leave
        try:
            client.completions.create(model="tiny", prompt="alpha", max_tokens=1)
        except openai.InternalServerError as error:
            assert error.status_code == 503
            assert error.body["code"] == "unavailable"  # type: ignore[index]
            assert "no decode-capable replica" in error.message
            return
        assert time.monotonic() < deadline, "the gateway kept routing to a stopped replica"
        time.sleep(0.2)
