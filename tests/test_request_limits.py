"""The limits every request must fit (``request_limits``) and the guard that applies them
before any handler (``request_guard``), on a real grpc.aio server.

Every string field of every request of the two services is either bounded here or bounded
by the context (so that a field added to a proto cannot slip through unbounded); a field over
its limit is refused naming its path and the limit, never echoing the value; JSON deeper than
32 levels, larger than 65,536 values or holding NaN is refused (the too-deep JSON that
protobuf's decoder itself rejects is named by its field); bytes that are no message are
INVALID_ARGUMENT with one log line; the guard keeps every handler kind working (unary and
streaming requests and responses: health, reflection); docs/limits.md lists every limit.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from engine_common.input_processor import InputProcessor
from engine_common.tokenizer import load_tokenizer
from protos.tandem.v1 import engine_pb2, generation_pb2
from services.frontend.chat.request import chat_to_engine_request
from services.frontend.errors import (
    MAX_STATUS_MESSAGE_BYTES,
    InvalidArgument,
    bounded_message,
    quoted,
)
from services.frontend.grpc_server import new_server
from services.frontend.request_guard import Refused, guarded
from services.frontend.request_limits import (
    CONTEXT_BOUNDED,
    FIELD_LIMITS,
    MAX_JSON_DEPTH,
    MAX_JSON_VALUES,
    check_request,
)

DOCS = Path(__file__).resolve().parent.parent / "docs" / "limits.md"


def _request_messages() -> list[Descriptor]:
    seen: dict[str, Descriptor] = {}
    pending = [m.input_type for module in (generation_pb2, engine_pb2)
               for service in module.DESCRIPTOR.services_by_name.values()
               for m in service.methods]
    while pending:
        message = pending.pop()
        if message.full_name in seen or message.full_name.startswith("google.protobuf") or \
                message.GetOptions().map_entry:  # a map's keys and values: its field's limit
            continue
        seen[message.full_name] = message
        pending += [f.message_type for f in message.fields if f.message_type is not None]
    return list(seen.values())


def test_every_string_field_of_every_request_is_bounded() -> None:
    unbounded = [f"{m.full_name}.{f.name}" for m in _request_messages() for f in m.fields
                 if f.type == FieldDescriptor.TYPE_STRING
                 and (FIELD_LIMITS.get(f.name) is None or FIELD_LIMITS[f.name].chars is None)
                 and f.name not in CONTEXT_BOUNDED]
    assert not unbounded, f"give these a limit in request_limits.FIELD_LIMITS: {unbounded}"


def _refusal(request: Any) -> str:
    with pytest.raises(InvalidArgument) as refused:
        check_request(request)
    return refused.value.message


def _chat(**fields: Any) -> generation_pb2.ChatCompletionRequest:
    request = generation_pb2.ChatCompletionRequest()
    json_format.ParseDict({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                           **fields}, request)
    return request


def _deep(levels: int) -> Any:
    """``levels`` objects, each in the one before."""
    value: Any = {"a": 1}
    for _ in range(levels - 1):
        value = {"a": value}
    return value


@pytest.mark.parametrize(("request_", "expected"), [
    (generation_pb2.CompletionRequest(model="m" * 100_000),
     "model is 100,000 characters long; at most 1,024 are allowed"),
    (generation_pb2.ResponseRequest(previous_response_id="r" * 300),
     "previous_response_id is 300 characters long; at most 256 are allowed"),
    (_chat(tools=[{"type": "function", "function": {"name": "f" * 257}}]),
     "tools[0].function.name is 257 characters long; at most 256 are allowed"),
    (_chat(messages=[{"role": "user", "tool_calls": [{"id": "i" * 300}]}]),
     "messages[0].tool_calls[0].id is 300 characters long"),
    (_chat(tools=[{"type": "function"}] * 129), "tools holds 129 entries; at most 128"),
    (_chat(stop_token_ids=list(range(1025))), "stop_token_ids holds 1,025 entries"),
    (_chat(cache_salt="s" * 257), "cache_salt is 257 characters long"),
    (_chat(structured_outputs={"regex": "a" * 65_537}), "structured_outputs.regex is 65,537"),
    (generation_pb2.ResponseRequest(metadata={str(i): "v" for i in range(17)}),
     "metadata holds 17 entries; at most 16"),
    (generation_pb2.ResponseRequest(metadata={"k": "v" * 513}),
     "metadata['k'] is 513 characters long; at most 512"),
    (engine_pb2.GenerateRequest(sampling_params=engine_pb2.SamplingParams(stop=["s"] * 65)),
     "sampling_params.stop holds 65 entries; at most 64"),
    (engine_pb2.AbortRequest(request_ids=["x" * 257]), "request_ids[0] is 257 characters"),
    (engine_pb2.GenerateRequest(sampling_params=engine_pb2.SamplingParams(
        bad_words_token_ids=[engine_pb2.TokenIds(ids=[1])] * 513)),
     "sampling_params.bad_words_token_ids holds 513 entries; at most 512"),
    (_chat(temperature="NaN"), "temperature is nan; give a finite number"),
    (_chat(logit_bias={"5": "Infinity"}), "logit_bias[5] is inf; give a finite number"),
])
def test_a_field_over_its_limit_is_named_without_its_value(request_: Any, expected: str) -> None:
    message = _refusal(request_)
    assert expected in message
    assert len(message) < 200  # the value itself is never in it


def test_json_fields_are_bounded_in_depth_size_and_numbers() -> None:
    check_request(_chat(chat_template_kwargs=_deep(MAX_JSON_DEPTH)))
    assert _refusal(_chat(chat_template_kwargs=_deep(MAX_JSON_DEPTH + 1))) == (
        "chat_template_kwargs nests JSON objects and lists more than 32 levels deep; "
        "flatten it")
    assert "response_format.json_schema.schema nests" in _refusal(
        _chat(response_format={"type": "json_schema", "json_schema": {
            "schema": _deep(MAX_JSON_DEPTH + 1)}}))
    nan = _chat()
    nan.tool_choice.number_value = math.nan
    assert _refusal(nan) == ("tool_choice holds NaN or Infinity, which JSON cannot express; "
                             "send finite numbers")
    infinite = _chat(tools=[{"type": "function", "function": {"name": "f"}}])
    infinite.tools[0].function.parameters.update({"a": [1, {"b": -math.inf}]})
    assert _refusal(infinite).startswith("tools[0].function.parameters holds NaN")
    wide = _chat()
    wide.chat_template_kwargs.update({"a": list(range(MAX_JSON_VALUES))})
    assert "over 65,536 JSON values" in _refusal(wide)
    # A prompt of token ids is the completions validation's to read, however long.
    long_prompt = generation_pb2.CompletionRequest()
    json_format.ParseDict({"prompt": list(range(MAX_JSON_VALUES + 1))}, long_prompt)
    check_request(long_prompt)


def test_what_is_compiled_or_tokenized_is_bounded_before(tiny_llama_dir: Path) -> None:
    """Output constraints compile in time superlinear in their size, and texts are tokenized
    on the event loop: both are refused by their size before either happens."""
    # A template that prints a variable of chat_template_kwargs (as real ones print tools).
    template = "{{ preamble }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer = load_tokenizer(tiny_llama_dir, template)
    inputs = InputProcessor(tokenizer, 512, len(tokenizer), {})
    with pytest.raises(InvalidArgument, match="the chat as rendered by the template .* is "
                                              "4000.* characters long"):
        chat_to_engine_request(_chat(chat_template_kwargs={"preamble": "d" * 4_000_000}), inputs)
    many = _chat(structured_outputs={"choice": ["c" * 200] * 100})
    with pytest.raises(InvalidArgument, match="the output's choice constraint is 20,.* at most "
                                              "16,384"):
        chat_to_engine_request(many, inputs)
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(4000)}}
    with pytest.raises(InvalidArgument, match="the JSON schema the output must follow is"):
        chat_to_engine_request(_chat(response_format={"type": "json_schema", "json_schema": {
            "name": "s", "schema": schema}}), inputs)
    forced = _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}],
                   tool_choice="required")
    with pytest.raises(InvalidArgument, match="the JSON schema the output must follow is"):
        chat_to_engine_request(forced, inputs)
    assert "bad_words holds 257 entries; at most 256" in _refusal(_chat(bad_words=["w"] * 257))


def test_bytes_that_are_no_message_are_refused_naming_the_message(
        caplog: pytest.LogCaptureFixture) -> None:
    decode = guarded(generation_pb2.CompletionRequest.FromString, "/x/Complete")
    with caplog.at_level(logging.INFO, logger="services.frontend.request_guard"):
        refused = decode(b"\x0a\x02\xc3\x28")
        garbage = decode(bytes(range(256)))
    assert isinstance(refused, Refused) and isinstance(garbage, Refused)
    assert refused.message.startswith("the request is not a valid tandem.v1.CompletionRequest "
                                      "(protobuf: 'String field had bad UTF-8')")
    assert "Wire format was corrupt" in garbage.message
    assert len(caplog.records) == 2 and all("\n" not in r.getMessage() for r in caplog.records)
    assert all(r.exc_info is None for r in caplog.records)
    over = decode(generation_pb2.CompletionRequest(model="m" * 2000).SerializeToString())
    assert isinstance(over, Refused) and over.message.startswith("model is 2,000 characters")
    fine = decode(generation_pb2.CompletionRequest(model="tiny").SerializeToString())
    assert fine == generation_pb2.CompletionRequest(model="tiny")


def test_json_too_deep_to_decode_is_named_by_its_field() -> None:
    request = _chat(max_tokens=4)
    json_format.ParseDict({"chat_template_kwargs": _deep(60)}, request, max_recursion_depth=500)
    refused = guarded(generation_pb2.ChatCompletionRequest.FromString, "/x/Chat")(
        request.SerializeToString())
    assert isinstance(refused, Refused)
    assert refused.message == ("chat_template_kwargs nests JSON objects and lists more than 32 "
                               "levels deep; flatten it")
    in_a_message = _chat(messages=[{"role": "user", "content": "hi"}] * 3)
    json_format.ParseDict({"content": [{"type": "text", "text": _deep(60)}]},
                          in_a_message.messages[2], max_recursion_depth=500)
    refused = guarded(generation_pb2.ChatCompletionRequest.FromString, "/x/Chat")(
        in_a_message.SerializeToString())
    assert isinstance(refused, Refused) and refused.message.startswith("messages nests JSON")


def test_echoed_values_and_status_messages_are_bounded() -> None:
    assert quoted("tiny") == "'tiny'"
    assert quoted("x" * 100_000) == f"{'x' * 64!r}... (100,000 characters)"
    assert quoted(None) == "None"
    assert bounded_message("é" * 10_000).endswith(f"... (cut at {MAX_STATUS_MESSAGE_BYTES} "
                                                  "bytes)")
    assert len(bounded_message("é" * 10_000).encode()) <= MAX_STATUS_MESSAGE_BYTES
    assert bounded_message("short") == "short"


def test_docs_list_every_limit() -> None:
    text = DOCS.read_text()
    missing = [name for name in FIELD_LIMITS if f"`{name}`" not in text]
    assert not missing, f"docs/limits.md does not list {missing}"
    for figure in ("32 levels", "65,536 values", "1 KiB", "4 MiB", "64 characters"):
        assert figure in text


# --------------------------------------------------------------------------- on a server


async def _serve_and_call(port_holder: list[int]) -> dict[str, Any]:
    server = new_server()
    health = health_aio.HealthServicer()
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        ("grpc.health.v1.Health", reflection.SERVICE_NAME), server)
    port = server.add_insecure_port("127.0.0.1:0")
    port_holder.append(port)
    await server.start()
    results: dict[str, Any] = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            results["check"] = (await stub.Check(health_pb2.HealthCheckRequest())).status
            watch = stub.Watch(health_pb2.HealthCheckRequest())
            results["watch"] = (await watch.read()).status
            watch.cancel()
            reflect = reflection_pb2_grpc.ServerReflectionStub(channel)

            async def ask() -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
                yield reflection_pb2.ServerReflectionRequest(list_services="")

            async for answer in reflect.ServerReflectionInfo(ask()):
                results["services"] = sorted(s.name for s in answer.list_services_response.service)
            raw = channel.stream_stream("/grpc.reflection.v1alpha.ServerReflection/"
                                        "ServerReflectionInfo")

            async def garbage() -> AsyncIterator[bytes]:
                yield b"\xff\xff\xff"

            try:
                async for _ in raw(garbage()):
                    pass
            except grpc.aio.AioRpcError as error:
                results["garbage"] = (error.code(), error.details())
            try:
                await channel.unary_unary("/grpc.health.v1.Health/Check")(b"\xff\xff")
            except grpc.aio.AioRpcError as error:
                results["unary garbage"] = (error.code(), error.details())
    finally:
        await server.stop(0)
    return results


def test_the_guard_keeps_every_kind_of_handler_working() -> None:
    results = asyncio.run(_serve_and_call([]))
    assert results["check"] == results["watch"] == health_pb2.HealthCheckResponse.SERVING
    assert results["services"] == ["grpc.health.v1.Health", reflection.SERVICE_NAME]
    for kind in ("garbage", "unary garbage"):
        code, details = results[kind]
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert re.match(r"the request is not a valid grpc\.\S+ \(protobuf: ", details), details
