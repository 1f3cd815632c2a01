"""OpenAI's Responses API end to end: the real ``openai`` SDK -> Envoy -> gateway -> P/D.

The same kind of cluster as ``test_envoy_e2e``'s (``tests.openai_http``), shared with
``test_background_responses`` (``conftest.openai_stack``). A response must say what the offline engine says for the equivalent chat (greedy,
float32), streamed or not; the stream's events must come in OpenAI's order and build, in the
SDK's own accumulator (``client.responses.stream``), the same text; function tools, earlier calls
and their outputs in the input, structured output and reasoning must come back as their
items; what cannot be served must be a 400 that names the field, streamed or not. Responses
are stored (unless ``store`` is false): ``previous_response_id`` continues one's conversation
as the offline engine continues the same chat, ``GET`` / ``DELETE /v1/responses/{id}`` read
and drop them, and ``GET /v1/responses/{id}/input_items`` lists their input items (the
conversation's first) a page at a time, with ids that stay the same.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import grpc
import openai
import pytest
from google.protobuf import json_format, struct_pb2

from engine_common.llm import LLM
from engine_common.output_processor import RequestOutput
from engine_common.sampling_params import SamplingParams
from gateway.endpoint_picker import read_request
from protos.tandem.v1 import generation_pb2, generation_pb2_grpc
from services.frontend.errors import InvalidArgument, NotFound
from services.frontend.generation_servicer import GenerationServicer
from services.frontend.responses.input_items import identified
from services.frontend.responses.store import ResponseStore, StoredResponse
from services.frontend.responses.translate import chat_request, input_items
from services.frontend.served_model import ServedModel
from tandem import InvalidRequestError
from tandem.client import AsyncClient, Client
from tests.openai_http import (
    CITY_SCHEMA,
    CLOCK,
    TOOL_MESSAGES,
    WEATHER,
    Stack,
    expected_tool_text,
    offline_engine,
)

INSTRUCTIONS = "be brief"
QUESTION = "Tell me a \"story\" about envoy"
MESSAGES = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def offline(tiny_llama_dir: Path) -> LLM:
    return offline_engine(tiny_llama_dir)


def offline_chat(offline: LLM, messages: list[dict[str, Any]], max_tokens: int,
                 **template: Any) -> tuple[RequestOutput, int]:
    """The offline engine's greedy answer to a chat, and the rendered prompt's length."""
    prompt = offline.inputs.tokenize_chat(messages, **template)
    want = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens))[0]
    return want, len(prompt)


def event_types(events: list[Any]) -> list[str]:
    return [e.type.removeprefix("response.") for e in events]


def test_a_response_says_what_the_chat_says_streamed_or_not(openai_stack: Stack,
                                                           offline: LLM) -> None:
    want, prompt_len = offline_chat(offline, MESSAGES, 10)
    text = want.text
    status = "incomplete" if want.finish_reason == "length" else "completed"
    client = openai_stack.client()
    response = client.responses.create(model="tiny", instructions=INSTRUCTIONS, input=QUESTION,
                                       max_output_tokens=10, temperature=0,
                                       metadata={"ticket": "42"})
    assert response.object == "response" and response.id.startswith("resp_")
    assert (response.output_text, response.status) == (text, status)
    if status == "incomplete":
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.status == status
    assert response.usage is not None and response.usage.input_tokens == prompt_len
    assert response.usage.output_tokens == len(want.token_ids)
    assert response.usage.total_tokens == prompt_len + response.usage.output_tokens
    assert (response.store, response.metadata, response.max_output_tokens) == (
        True, {"ticket": "42"}, 10)
    # The same conversation as input items (system as "developer", content as parts).
    items = [{"role": "developer", "content": INSTRUCTIONS},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": QUESTION}]}]
    assert client.responses.create(model="tiny", input=items, max_output_tokens=10,  # type: ignore[arg-type]
                                   temperature=0).output_text == text

    events = list(client.responses.create(model="tiny", instructions=INSTRUCTIONS,
                                          input=QUESTION, max_output_tokens=10, temperature=0,
                                          stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert event_types(events) == [
        "created", "in_progress", "output_item.added", "content_part.added",
        *["output_text.delta"] * len(deltas), "output_text.done", "content_part.done",
        "output_item.done", status]
    assert events[0].response.status == "in_progress" and not events[0].response.output  # type: ignore[union-attr]
    assert "".join(d.delta for d in deltas) == text  # type: ignore[attr-defined]
    assert events[-1].response.output_text == text  # type: ignore[union-attr]
    assert events[-1].response.usage.input_tokens == prompt_len  # type: ignore[union-attr]
    # The SDK's own accumulator rebuilds the text from the events (its final response
    # exists only for a response.completed, as with OpenAI's own incomplete responses).
    with client.responses.stream(model="tiny", instructions=INSTRUCTIONS, input=QUESTION,
                                 max_output_tokens=10, temperature=0) as stream:
        accumulated = list(stream)
    assert [e.snapshot for e in accumulated  # type: ignore[union-attr]
            if e.type == "response.output_text.delta"][-1] == text
    assert accumulated[-1].type == f"response.{status}"


def test_function_calls_and_their_outputs(openai_stack: Stack, offline: LLM) -> None:
    """A named tool choice forces that call, as the chat API's does; the call and its output
    sent back as input items continue the conversation as tool messages do."""
    tools = [{"type": "function", **tool["function"]} for tool in (WEATHER, CLOCK)]
    want = expected_tool_text(offline, {"type": "function", "function": {"name": "get_weather"}})
    client = openai_stack.client()
    options: dict[str, Any] = {"model": "tiny", "input": TOOL_MESSAGES, "tools": tools,
                               "tool_choice": {"type": "function", "name": "get_weather"},
                               "max_output_tokens": 48, "temperature": 0}
    response = client.responses.create(**options)
    [call] = response.output
    assert call.type == "function_call" and call.id.startswith("fc_")
    assert call.call_id.startswith("call_") and call.status == "completed"
    assert (call.name, call.arguments) == ("get_weather", want)
    assert response.status == "completed" and response.output_text == ""

    events = list(client.responses.create(stream=True, **options))
    pieces = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert event_types(events) == [
        "created", "in_progress", "output_item.added",
        *["function_call_arguments.delta"] * len(pieces), "function_call_arguments.done",
        "output_item.done", "completed"]
    assert events[2].item.name == "get_weather"  # type: ignore[union-attr]
    assert "".join(p.delta for p in pieces) == want  # type: ignore[attr-defined]
    assert events[-3].arguments == want  # type: ignore[union-attr]

    # The call and its result as input items: the chat's assistant turn and tool turn.
    follow_up = [*TOOL_MESSAGES,
                 {"type": "function_call", "call_id": call.call_id, "name": "get_weather",
                  "arguments": want},
                 {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    rendered = [*TOOL_MESSAGES, {"role": "assistant", "content": ""},
                {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]
    text = offline_chat(offline, rendered, 6)[0].text
    answer = client.responses.create(model="tiny", input=follow_up, tools=tools,  # type: ignore[arg-type]
                                     tool_choice="none", max_output_tokens=6, temperature=0)
    assert answer.output_text == text


def test_structured_output_and_reasoning_items(openai_stack: Stack, offline: LLM) -> None:
    client = openai_stack.client()
    # text.format json_schema is the chat's response_format json_schema.
    chat = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=40, temperature=0,  # type: ignore[arg-type]
        response_format={"type": "json_schema",
                         "json_schema": {"name": "city", "schema": CITY_SCHEMA}})
    response = client.responses.create(
        model="tiny", instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=40,
        temperature=0, text={"format": {"type": "json_schema", "name": "city",
                                        "schema": CITY_SCHEMA}})
    assert response.output_text == chat.choices[0].message.content
    assert json.loads(response.output_text)["city"] in ("Oslo", "Lima")

    # An open <think> block (the tiny template's enable_thinking) makes a reasoning item.
    kwargs = {"enable_thinking": True}
    text = offline_chat(offline, MESSAGES, 8, template_kwargs=kwargs)[0].text
    options: dict[str, Any] = {"model": "tiny", "instructions": INSTRUCTIONS, "input": QUESTION,
                               "max_output_tokens": 8, "temperature": 0,
                               "extra_body": {"chat_template_kwargs": kwargs}}
    response = client.responses.create(**options)
    [reasoning] = response.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert response.usage is not None and response.usage.output_tokens > 0
    assert response.usage.output_tokens_details.reasoning_tokens == response.usage.output_tokens
    assert [part.text for part in reasoning.content or []] == [text]
    assert reasoning.summary == [] and response.output_text == ""
    events = list(client.responses.create(stream=True, **options))
    assert "".join(e.delta for e in events  # type: ignore[union-attr]
                   if e.type == "response.reasoning_text.delta") == text
    assert event_types(events)[2:4] == ["output_item.added", "content_part.added"]


def test_the_grpc_stream_and_the_endpoint_picker(openai_stack: Stack, offline: LLM) -> None:
    """gRPC clients get the same events as messages; the endpoint picker reads a responses
    body as the chat it stands for."""
    request = json_format.ParseDict({"model": "tiny", "instructions": INSTRUCTIONS,
                                     "input": QUESTION, "max_output_tokens": 6,
                                     "temperature": 0}, generation_pb2.ResponseRequest())
    text = offline_chat(offline, MESSAGES, 6)[0].text
    with grpc.insecure_channel(openai_stack.gateway) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        events = list(stub.CreateResponseStream(request, timeout=60))
        assert events[-1].response.output[0].content[0].text == text
        assert stub.CreateResponse(request, timeout=60).output[0].content[0].text == text

    features = read_request("/v1/responses", "application/json",
                            json_format.MessageToJson(request).encode(), offline.inputs)
    assert features is not None
    assert features.prompt_token_ids == offline.inputs.tokenize_chat(MESSAGES)


def test_the_grpc_sdk_responds_as_the_openai_sdk(openai_stack: Stack) -> None:
    """``tandem.Client.respond`` over gRPC gives the text, status and usage the openai SDK
    gets over HTTP; ``respond_stream``'s deltas join to that text and its last event carries
    the same response."""
    options: dict[str, Any] = {"instructions": INSTRUCTIONS, "max_output_tokens": 8,
                               "temperature": 0}
    want = openai_stack.client().responses.create(model="tiny", input=QUESTION, **options)
    assert want.usage is not None and want.output_text
    want_reason = want.incomplete_details.reason if want.incomplete_details else None
    # Not cached_tokens: the prefix cache may serve a later request's prompt.
    want_tokens = (want.usage.input_tokens, want.usage.output_tokens, want.usage.total_tokens)
    with Client(openai_stack.gateway, timeout=60) as client:
        response = client.respond(QUESTION, model="tiny", **options)
        events = list(client.respond_stream(QUESTION, model="tiny", **options))

    def same_as_want(got: Any) -> None:
        assert (got.output_text, got.status, got.incomplete_reason) == (
            want.output_text, want.status, want_reason)
        assert (got.reasoning, got.function_calls) == (None, [])
        assert got.id.startswith("resp_") and got.model == want.model
        assert got.usage is not None
        assert (got.usage.input_tokens, got.usage.output_tokens,
                got.usage.total_tokens) == want_tokens

    same_as_want(response)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events
                   if e.type == "response.output_text.delta") == want.output_text
    assert events[-1].type == f"response.{want.status}"
    same_as_want(events[-1].response)


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_what_cannot_be_served_is_a_400_naming_the_field(openai_stack: Stack, stream: bool) -> None:
    client = openai_stack.client()
    for options, message in [
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0] has type 'input_image'"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0] has type"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        ({"input": []}, "non-empty list"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "function tools only"),
        ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"input": "hi", "temperature": -1}, "temperature must be non-negative"),
    ]:
        with pytest.raises(openai.BadRequestError) as raised:
            result = client.responses.create(model="tiny", stream=stream, **options)
            list(result)  # type: ignore[call-overload]
        assert raised.value.status_code == 400 and message in raised.value.message, (
            options, raised.value.message)


def test_the_request_translation_keeps_every_setting() -> None:
    request = json_format.ParseDict({
        "model": "tiny", "instructions": "sys", "input": "hi", "max_output_tokens": 5,
        "temperature": 0.5, "top_p": 0.9, "seed": 3, "top_k": 7, "parallel_tool_calls": False,
        "cache_salt": "tenant", "priority": 2, "user": "u",
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"},
                   "strict": True}],
        "tool_choice": {"type": "function", "name": "f"},
        "text": {"format": {"type": "json_object"}}}, generation_pb2.ResponseRequest())
    chat = json_format.MessageToDict(chat_request(request), preserving_proto_field_name=True)
    assert chat == {
        "model": "tiny", "user": "u", "cache_salt": "tenant", "priority": 2,
        "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}],
        "max_completion_tokens": 5, "temperature": 0.5, "top_p": 0.9, "seed": "3",
        "top_k": 7, "parallel_tool_calls": False,
        "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object"}, "strict": True}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "response_format": {"type": "json_object"},
        "stream_options": {"include_usage": True}}


def test_output_text_logprobs_are_the_chats(openai_stack: Stack) -> None:
    """include "message.output_text.logprobs" (with top_logprobs) gives the output text's
    tokens with the logprobs the chat API gives for the same request, on the part and on
    the deltas; without it, there are none."""
    client = openai_stack.client()
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6,  # type: ignore[arg-type]
                                          temperature=0, logprobs=True, top_logprobs=2)
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content
    want = [(t.token, round(t.logprob, 4), [(x.token, round(x.logprob, 4))
                                            for x in t.top_logprobs])
            for t in chat.choices[0].logprobs.content]
    options: dict[str, Any] = {"model": "tiny", "instructions": INSTRUCTIONS, "input": QUESTION,
                               "max_output_tokens": 6, "temperature": 0, "top_logprobs": 2,
                               "include": ["message.output_text.logprobs"]}

    def entries(logprobs: Any) -> list[Any]:
        return [(e.token, round(e.logprob, 4), [(x.token, round(x.logprob, 4))
                                                for x in e.top_logprobs]) for e in logprobs]

    response = client.responses.create(**options)
    part = response.output[0].content[0]  # type: ignore[union-attr]
    assert entries(part.logprobs) == want  # type: ignore[union-attr]
    assert "".join(e.token for e in part.logprobs) == part.text  # type: ignore[union-attr]
    assert part.logprobs[0].bytes == list(part.logprobs[0].token.encode())  # type: ignore[union-attr]
    events = list(client.responses.create(stream=True, **options))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert entries([x for e in deltas for x in e.logprobs]) == want  # type: ignore[union-attr]
    options.pop("include")
    plain = client.responses.create(**options).output[0].content[0]  # type: ignore[union-attr]
    assert not getattr(plain, "logprobs", None)


def test_previous_response_id_continues_the_stored_conversation(openai_stack: Stack,
                                                                offline: LLM) -> None:
    """Each response continues the chat of the ones before it (their input, then their
    output as the assistant's turn; not their instructions), as the offline engine continues
    that chat; retrieve and delete act on the store, which the chain then misses."""
    client = openai_stack.client()
    options: dict[str, Any] = {"model": "tiny", "max_output_tokens": 8, "temperature": 0}
    first = client.responses.create(instructions=INSTRUCTIONS, input=QUESTION, **options)
    assert first.store
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION},
                                      {"role": "assistant", "content": first.output_text}]
    previous = first
    for follow_up in ("And then?", "How does it end?"):
        messages.append({"role": "user", "content": follow_up})
        want, prompt_len = offline_chat(offline, messages, 8)
        response = client.responses.create(previous_response_id=previous.id, input=follow_up,
                                           **options)
        assert (response.output_text, response.previous_response_id) == (want.text,
                                                                         previous.id)
        assert response.usage is not None and response.usage.input_tokens == prompt_len
        streamed = list(client.responses.create(previous_response_id=previous.id,
                                                input=follow_up, stream=True, **options))
        assert streamed[-1].response.output_text == want.text  # type: ignore[union-attr]
        messages.append({"role": "assistant", "content": want.text})
        previous = response

    retrieved = client.responses.retrieve(first.id)
    assert (retrieved.id, retrieved.output_text, retrieved.instructions) == (
        first.id, first.output_text, INSTRUCTIONS)
    # The SDK's retrieve parameters are taken (Envoy refuses a parameter no field takes).
    assert client.responses.retrieve(first.id, include=["message.output_text.logprobs"],
                                     include_obfuscation=False).id == first.id
    with pytest.raises(openai.BadRequestError, match="include has 'bogus'"):
        client.responses.retrieve(first.id, include=["bogus"])  # type: ignore[list-item]
    client.responses.delete(first.id)
    for missing in (lambda: client.responses.retrieve(first.id),
                    lambda: client.responses.delete(first.id),
                    # The chain of the latest response reaches the deleted one.
                    lambda: client.responses.create(previous_response_id=previous.id,
                                                    input="hi", **options)):
        with pytest.raises(openai.NotFoundError, match=f"no stored response '{first.id}'"):
            missing()

    kept_back = client.responses.create(input=QUESTION, store=False, **options)
    assert not kept_back.store
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept_back.id)
    for stream in (False, True):
        with pytest.raises(openai.NotFoundError, match="no stored response 'resp_1'"):
            list(client.responses.create(previous_response_id="resp_1", input="hi",  # type: ignore[call-overload]
                                         stream=stream, **options))
    # The gRPC SDK reads and drops them too.
    with Client(openai_stack.gateway, timeout=60) as sdk:
        opening = sdk.respond(QUESTION, model="tiny", max_output_tokens=8, temperature=0)
        response = sdk.respond("And then?", model="tiny", previous_response_id=opening.id,
                               max_output_tokens=8, temperature=0)
        assert response.stored and response.previous_response_id == opening.id
        assert response.output_text == offline_chat(offline, [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": opening.output_text},
            {"role": "user", "content": "And then?"}], 8)[0].text
        assert sdk.get_response(response.id).output_text == response.output_text
        sdk.delete_response(response.id)
        with pytest.raises(InvalidRequestError, match="NOT_FOUND"):
            sdk.get_response(response.id)


def test_a_stored_function_call_is_replayed_as_the_call_it_was() -> None:
    """The conversation of a response that called a tool: its input, the call as the
    assistant's tool_calls, then the new input (the tool's output), in the chat shape."""
    store = ResponseStore(2)
    first = json_format.ParseDict({"input": "weather in Paris?"},
                                  generation_pb2.ResponseRequest())
    response = json_format.ParseDict({"id": "resp_a", "output": [
        {"type": "reasoning", "id": "rs_1", "content": [{"type": "reasoning_text",
                                                         "text": "hmm"}]},
        {"type": "message", "id": "msg_1", "role": "assistant",
         "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "weather",
         "arguments": '{"city": "Paris"}'}]}, generation_pb2.Response())
    store.put(StoredResponse(response, input_items(first)))
    follow_up = json_format.ParseDict(
        {"previous_response_id": "resp_a",
         "input": [{"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]},
        generation_pb2.ResponseRequest())
    chat = json_format.MessageToDict(chat_request(follow_up, store.conversation("resp_a")),
                                     preserving_proto_field_name=True)
    assert chat["messages"] == [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    # Bounded: the oldest goes first.
    for name in ("resp_b", "resp_c"):
        store.put(StoredResponse(generation_pb2.Response(id=name), []))
    assert len(store) == 2
    with pytest.raises(NotFound, match="keeps the latest 2"):
        store.conversation("resp_a")


def test_a_server_that_keeps_no_responses_says_so(offline: LLM) -> None:
    """--max-stored-responses 0: nothing is kept, and a continuation is refused with what to
    do instead."""
    assert ResponseStore.sized(0) is None
    with pytest.raises(ValueError, match="0 or more"):
        ResponseStore.sized(-1)
    servicer = GenerationServicer(ServedModel("tiny", 256), offline.inputs, generate=None,  # type: ignore[arg-type]
                                  responses=None)
    follow_up = generation_pb2.ResponseRequest(input=json_format.ParseDict(
        "hi", struct_pb2.Value()), previous_response_id="resp_1")
    with pytest.raises(InvalidArgument, match="keeps none .* send the conversation so far"):
        servicer._history(follow_up)
    with pytest.raises(NotFound, match="keeps no responses"):
        servicer._stored()


# A conversation's worth of input items: each kind the Responses API takes, one with an id of
# the client's and one that repeats it.
LISTED_INPUT: list[dict[str, Any]] = [
    {"role": "developer", "content": "be brief"},
    {"role": "user", "content": "What is the weather in Oslo?", "id": "msg_client_1"},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather",
     "arguments": '{"city": "Oslo", "days": 1}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    {"role": "assistant", "content": "It is sunny."},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Lima?"}]},
    {"role": "user", "content": "Thanks", "id": "msg_client_1"},
]
LISTED_TOOLS: list[dict[str, Any]] = [{"type": "function", **WEATHER["function"]}]  # type: ignore[dict-item]
# The same items as OpenAI lists them, ids aside.
LISTED_ITEMS: list[dict[str, Any]] = [
    {"type": "message", "role": "developer", "status": "completed",
     "content": [{"type": "input_text", "text": "be brief"}]},
    {"type": "message", "role": "user", "status": "completed",
     "content": [{"type": "input_text", "text": "What is the weather in Oslo?"}]},
    {"type": "function_call", "status": "completed", "call_id": "call_1",
     "name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'},
    {"type": "function_call_output", "status": "completed", "call_id": "call_1",
     "output": "sunny"},
    {"type": "message", "role": "assistant", "status": "completed",
     "content": [{"type": "output_text", "text": "It is sunny.", "annotations": []}]},
    {"type": "message", "role": "user", "status": "completed",
     "content": [{"type": "input_text", "text": "Lima?"}]},
    {"type": "message", "role": "user", "status": "completed",
     "content": [{"type": "input_text", "text": "Thanks"}]},
]


def without_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in item.items() if k != "id"} for item in items]


# One page: its items' ids, first_id, last_id, has_more.
Page = tuple[list[str], str | None, str | None, bool]


def pages(list_page: Callable[..., Page], order: str, limit: int) -> tuple[list[str], int]:
    """Every id of a listing, following ``after`` from page to page as a client does; and
    how many pages it took. Each page but the last says ``has_more``."""
    ids: list[str] = []
    after = None
    for count in range(1, 100):
        got, first_id, last_id, has_more = list_page(after=after, limit=limit, order=order)
        assert 1 <= len(got) <= limit
        assert (first_id, last_id) == (got[0], got[-1])
        ids += got
        if not has_more:
            return ids, count
        after = got[-1]
    raise AssertionError("the pages never end")


def test_input_items_are_listed_as_openai_lists_them(openai_stack: Stack) -> None:
    """GET /v1/responses/{id}/input_items through Envoy with the openai SDK: the request's
    items in OpenAI's listed shape, each with an id (a client's own kept, unless it repeats
    one) that stays the same from call to call; newest first by default; pages of ``limit``
    after ``after``, in either order, by hand and by the SDK's auto-pagination."""
    client = openai_stack.client()
    options: dict[str, Any] = {"model": "tiny", "input": LISTED_INPUT, "tools": LISTED_TOOLS,
                               "tool_choice": "none", "max_output_tokens": 4,
                               "temperature": 0}
    response = client.responses.create(**options)
    raw = client.responses.input_items.with_raw_response.list(response.id, order="asc")
    listing = raw.http_response.json()
    items = listing["data"]
    assert without_ids(items) == LISTED_ITEMS
    ids = [item["id"] for item in items]
    assert [i.split("_", 1)[0] for i in ids] == ["msg", "msg", "fc", "fco", "msg", "msg", "msg"]
    assert ids[1] == "msg_client_1" and len(set(ids)) == len(ids)
    assert listing == {"object": "list", "data": items, "first_id": ids[0],
                       "last_id": ids[-1], "has_more": False}

    newest_first = client.responses.input_items.list(response.id)
    assert [item.id for item in newest_first.data] == ids[::-1]  # the same ids, again
    assert newest_first.data[0].type == "message" and not newest_first.has_more

    def list_page(**query: Any) -> Page:
        raw = client.responses.input_items.with_raw_response.list(response.id, **query)
        page = raw.http_response.json()
        return ([item["id"] for item in page["data"]], page.get("first_id"),
                page.get("last_id"), page["has_more"])

    orders: list[tuple[Literal["asc", "desc"], list[str]]] = [("asc", ids),
                                                              ("desc", ids[::-1])]
    for order, want in orders:
        for limit in (1, 2, 3, 7, 100):
            got, count = pages(list_page, order, limit)
            assert got == want and count == -(-len(ids) // limit), (order, limit)
        auto = client.responses.input_items.list(response.id, limit=2, order=order)
        assert [item.id for item in auto] == want, order
    # After the last item: an empty page.
    empty = client.responses.input_items.with_raw_response.list(
        response.id, after=ids[-1], order="asc").http_response.json()
    assert (empty["data"], empty["has_more"]) == ([], False)
    assert empty.get("first_id") is None and empty.get("last_id") is None


def test_a_continued_responses_input_items_begin_with_its_conversation(openai_stack: Stack) -> None:
    """A response that continued another lists the conversation first, as OpenAI does:
    the earlier response's input items (same ids), its output items (as GET gives them,
    their logprobs only with include), then its own input. Taken when it was created: the
    listing outlives the earlier response."""
    client = openai_stack.client()
    options: dict[str, Any] = {"model": "tiny", "max_output_tokens": 4, "temperature": 0}
    first = client.responses.create(input=QUESTION, include=["message.output_text.logprobs"],
                                    top_logprobs=1, **options)
    second = client.responses.create(input="And then?", previous_response_id=first.id,
                                      **options)
    first_items = client.responses.input_items.with_raw_response.list(
        first.id).http_response.json()["data"]
    first_output = client.responses.with_raw_response.retrieve(
        first.id).http_response.json()["output"]
    assert first_output[0]["content"][0]["logprobs"]

    def listed(response_id: str, **query: Any) -> list[dict[str, Any]]:
        raw = client.responses.input_items.with_raw_response.list(response_id, order="asc",
                                                                   **query)
        return list(raw.http_response.json()["data"])

    plain_output = [{**item, "content": [{k: v for k, v in part.items() if k != "logprobs"}
                                         for part in item["content"]]}
                    for item in first_output]
    conversation = listed(second.id)
    assert conversation[:-1] == first_items + plain_output
    assert without_ids(conversation[-1:]) == [{
        "type": "message", "role": "user", "status": "completed",
        "content": [{"type": "input_text", "text": "And then?"}]}]
    with_logprobs = listed(second.id, include=["message.output_text.logprobs"])
    assert with_logprobs[:-1] == first_items + first_output
    # OpenAI's other include values name items Tandem never makes: nothing to add.
    assert listed(second.id, include=["reasoning.encrypted_content"]) == conversation

    client.responses.delete(first.id)
    assert listed(second.id) == conversation
    with pytest.raises(openai.NotFoundError, match=f"no stored response '{first.id}'"):
        client.responses.input_items.list(first.id)


def test_input_items_queries_that_cannot_be_served_say_why(openai_stack: Stack) -> None:
    """A limit outside 1..100, an unknown order or include value and an ``after`` that is
    not one of the response's items are 400s naming the parameter; a response that is not
    stored is a 404, as GET's."""
    client = openai_stack.client()
    options: dict[str, Any] = {"model": "tiny", "max_output_tokens": 2, "temperature": 0}
    response = client.responses.create(input="alpha", **options)
    other = client.responses.create(input="bravo", **options)
    [others_item] = client.responses.input_items.list(other.id).data
    cases: list[tuple[dict[str, Any], str]] = [
        ({"limit": 0}, "limit must be between 1 and 100 (default 20); got 0"),
        ({"limit": 101}, "limit must be between 1 and 100 (default 20); got 101"),
        ({"order": "sideways"}, 'order must be "asc"'),
        ({"include": ["everything"]}, "include has 'everything'"),
        ({"after": "msg_nope"},
         f"after 'msg_nope' is not an item of response '{response.id}'"),
        # An item of another response is no cursor here either.
        ({"after": others_item.id}, f"after '{others_item.id}' is not an item of response"),
    ]
    for query, message in cases:
        with pytest.raises(openai.BadRequestError) as raised:
            client.responses.input_items.list(response.id, **query)
        assert message in raised.value.message, (query, raised.value.message)
    unstored = client.responses.create(input="charlie", store=False, **options)
    for missing in ("resp_1", unstored.id):
        with pytest.raises(openai.NotFoundError, match=f"no stored response '{missing}'"):
            client.responses.input_items.list(missing)


def test_the_grpc_sdk_lists_input_items_as_the_openai_sdk(openai_stack: Stack) -> None:
    """``Client.list_response_input_items`` (and ``AsyncClient``'s) over gRPC: the items and
    pages the openai SDK gets over HTTP; failures as INVALID_ARGUMENT and NOT_FOUND."""
    with Client(openai_stack.gateway, timeout=60) as sdk:
        response = sdk.respond(LISTED_INPUT, model="tiny", tools=LISTED_TOOLS,
                               tool_choice="none", max_output_tokens=4, temperature=0)
        first = sdk.list_response_input_items(response.id, order="asc")
        assert without_ids(first.items) == LISTED_ITEMS and not first.has_more
        ids = [item["id"] for item in first.items]
        assert (first.first_id, first.last_id) == (ids[0], ids[-1])
        over_http = openai_stack.client().responses.input_items.list(response.id, order="asc")
        assert [item.id for item in over_http.data] == ids

        def list_page(**query: Any) -> Page:
            page = sdk.list_response_input_items(response.id, **query)
            return [item["id"] for item in page.items], page.first_id, page.last_id, \
                page.has_more

        assert pages(list_page, "desc", 3) == (ids[::-1], 3)
        empty = sdk.list_response_input_items(response.id, after=ids[0])  # newest first
        assert (empty.items, empty.first_id, empty.last_id, empty.has_more) == (
            [], None, None, False)
        with pytest.raises(InvalidRequestError, match="limit must be between 1 and 100"):
            sdk.list_response_input_items(response.id, limit=0)
        with pytest.raises(InvalidRequestError, match="NOT_FOUND"):
            sdk.list_response_input_items("resp_1")

    async def newest_two() -> list[str]:
        async with AsyncClient(openai_stack.gateway, timeout=60) as client:
            page = await client.list_response_input_items(response.id, limit=2)
            assert page.has_more
            return [item["id"] for item in page.items]

    assert asyncio.run(newest_two()) == ids[:-3:-1]


def test_listed_items_replay_as_the_items_they_were() -> None:
    """The stored items (ids, listed shape) render the same chat as the client's own: a
    continuation's prompt does not change because its items were listed. A repeated or
    non-string id is replaced; ids of the conversation before them count as taken."""
    request = json_format.ParseDict({"input": LISTED_INPUT}, generation_pb2.ResponseRequest())
    listed = identified(input_items(request), taken=["msg_earlier"])
    relisted = generation_pb2.ResponseRequest()
    relisted.input.list_value.values.extend(listed)
    assert chat_request(relisted) == chat_request(request)
    assert [json_format.MessageToDict(item) for item in listed][1]["id"] == "msg_client_1"
    odd = json_format.ParseDict([{"role": "user", "content": "a", "id": "msg_earlier"},  # type: ignore[arg-type]  # a JSON list
                                 {"role": "user", "content": "b", "id": 7},
                                 {"type": "reasoning", "id": "rs_1", "summary": []}],
                                struct_pb2.Value())
    ids = [json_format.MessageToDict(item)["id"]
           for item in identified(odd.list_value.values, taken=["msg_earlier"])]
    assert ids[0] not in ("msg_earlier", "") and ids[0].startswith("msg_")
    assert ids[1].startswith("msg_") and ids[2] == "rs_1"
