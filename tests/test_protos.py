"""The wire contracts: generated code is fresh and reproducible, the descriptor set Envoy loads
carries the HTTP routes, and the public messages speak OpenAI's JSON."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from google.api import annotations_pb2
from google.protobuf import descriptor_pb2, json_format

from engine_common.sampling_params import SamplingParams
from protos import generate
from protos.tandem.v1 import engine_pb2
from protos.tandem.v1 import generation_pb2 as pb

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_committed_generated_code_is_fresh() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "protos.generate", "--check"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


def test_generation_is_reproducible_and_check_names_stale_files(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    outputs = generate.generate(first)
    generate.generate(second)
    for path in outputs:
        assert (first / path).read_bytes() == (second / path).read_bytes(), path
    assert generate.stale_files(first) == []

    stale = Path("protos/tandem/v1/engine_pb2.py")
    (first / stale).write_text((first / stale).read_text() + "# edited by hand\n")
    assert generate.stale_files(first) == [stale]


def test_generated_grpc_module_imports_through_the_protos_package() -> None:
    source = (REPO_ROOT / "protos/tandem/v1/engine_pb2_grpc.py").read_text()
    assert "from protos.tandem.v1 import engine_pb2" in source


def _descriptor_set() -> descriptor_pb2.FileDescriptorSet:
    return descriptor_pb2.FileDescriptorSet.FromString(
        (REPO_ROOT / "protos/tandem.binpb").read_bytes()
    )


def test_descriptor_set_is_self_contained_for_envoy() -> None:
    names = {f.name for f in _descriptor_set().file}
    assert {
        "protos/tandem/v1/generation.proto",
        "protos/tandem/v1/engine.proto",
        "google/api/annotations.proto",
        "google/api/http.proto",
        "google/protobuf/struct.proto",
        "google/protobuf/descriptor.proto",
    } <= names
    assert not any(f.HasField("source_code_info") for f in _descriptor_set().file)


def test_descriptor_set_carries_the_openai_http_routes() -> None:
    (generation,) = [
        f for f in _descriptor_set().file if f.name == "protos/tandem/v1/generation.proto"
    ]
    assert generation.package == "tandem.v1"
    (service,) = [s for s in generation.service if s.name == "Generation"]
    routes = {}
    for method in service.method:
        if not method.options.HasExtension(annotations_pb2.http):
            continue  # gRPC only
        rule = method.options.Extensions[annotations_pb2.http]
        verb = rule.WhichOneof("pattern")
        routes[method.name] = (verb, getattr(rule, verb), rule.body)
    assert routes == {
        "Complete": ("post", "/v1/completions", "*"),
        "CompleteEvents": ("post", "/v1/completions:stream", "*"),
        "ChatComplete": ("post", "/v1/chat/completions", "*"),
        "ChatCompleteEvents": ("post", "/v1/chat/completions:stream", "*"),
        "CreateResponse": ("post", "/v1/responses", "*"),
        "CreateResponseEvents": ("post", "/v1/responses:stream", "*"),
        "GetResponse": ("get", "/v1/responses/{response_id}", ""),
        "GetResponseEvents": ("get", "/v1/responses/{response_id}:stream", ""),
        "CancelResponse": ("post", "/v1/responses/{response_id}/cancel", ""),
        "DeleteResponse": ("delete", "/v1/responses/{response_id}", ""),
        "ListResponseInputItems": ("get", "/v1/responses/{response_id}/input_items", ""),
        "ListModels": ("get", "/v1/models", ""),
        "GetModel": ("get", "/v1/models/{model=**}", ""),
        "Tokenize": ("post", "/tokenize", "*"),
        "Detokenize": ("post", "/detokenize", "*"),
        "LoadLoraAdapter": ("post", "/v1/load_lora_adapter", "*"),
        "UnloadLoraAdapter": ("post", "/v1/unload_lora_adapter", "*"),
    }
    streaming = {m.name for m in service.method if m.server_streaming}
    assert streaming == {"CompleteStream", "ChatCompleteStream", "CompleteEvents",
                         "ChatCompleteEvents", "CreateResponseStream", "CreateResponseEvents",
                         "GetResponseStream", "GetResponseEvents"}
    # HTTP clients get server-sent events the server writes (ending in "data: [DONE]").
    assert {m.output_type for m in service.method if m.name.endswith("Events")} == {
        ".google.api.HttpBody"}


@pytest.mark.parametrize(
    ("prompt_json", "stop_json", "prompt", "stop"),
    [
        ('"Hello"', '"\\n"', "Hello", "\n"),
        ("[1, 2, 3]", '["a", "bc"]', [1.0, 2.0, 3.0], ["a", "bc"]),
    ],
)
def test_completion_request_parses_from_openai_json(
    prompt_json: str, stop_json: str, prompt: object, stop: object
) -> None:
    body = (
        f'{{"model": "smollm2", "prompt": {prompt_json}, "stop": {stop_json}, "max_tokens": 8,'
        ' "temperature": 0, "seed": 7, "logprobs": 2, "stream": true,'
        ' "stream_options": {"include_usage": true}, "stop_token_ids": [2], "echo": false}'
    )
    request = json_format.Parse(body, pb.CompletionRequest())
    as_python = json_format.MessageToDict(request.prompt), json_format.MessageToDict(request.stop)
    assert as_python == (prompt, stop)
    assert request.HasField("temperature") and request.temperature == 0.0  # set, even though 0
    assert not request.HasField("top_p")  # unset: the server's default applies
    assert (request.max_tokens, request.seed, request.logprobs) == (8, 7, 2)
    assert request.stream_options.include_usage and list(request.stop_token_ids) == [2]
    assert request.HasField("echo") and not request.echo


def test_chat_request_parses_from_openai_json() -> None:
    body = (
        '{"model": "m", "messages": [{"role": "system", "content": "Be brief."},'
        ' {"role": "user", "content": "Hi", "name": "ann"},'
        ' {"role": "user", "content": [{"type": "text", "text": "and"}]}],'
        ' "max_completion_tokens": 4, "logprobs": true, "top_logprobs": 3}'
    )
    request = json_format.Parse(body, pb.ChatCompletionRequest())
    assert [(m.role, json_format.MessageToDict(m.content), m.name)
            for m in request.messages] == [
        ("system", "Be brief.", ""),
        ("user", "Hi", "ann"),
        ("user", [{"type": "text", "text": "and"}], ""),
    ]
    assert request.max_completion_tokens == 4 and not request.HasField("max_tokens")
    assert request.logprobs and request.top_logprobs == 3


def _openai_json(message: object) -> dict:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)  # type: ignore[arg-type]


def test_responses_print_with_openai_field_names() -> None:
    top = pb.CompletionLogprobs(tokens=["<s>", " a"], text_offset=[0, 3])
    # An echoed prompt's first token has null logprobs, as OpenAI prints them.
    top.token_logprobs.extend([None, -0.5])
    top.top_logprobs.append(None)
    top.top_logprobs.add_struct().update({" a": -0.5, " b": -1.5})
    response = pb.CompletionResponse(
        id="cmpl-1",
        object="text_completion",
        created=1_700_000_000,
        model="m",
        choices=[pb.CompletionChoice(index=0, text=" a", finish_reason="length", logprobs=top)],
        usage=pb.Usage(prompt_tokens=3, completion_tokens=1, total_tokens=4),
    )
    printed = _openai_json(response)
    assert printed["created"] == 1_700_000_000  # a JSON number, not a string
    assert printed["choices"][0]["finish_reason"] == "length"
    assert printed["choices"][0]["logprobs"] == {
        "tokens": ["<s>", " a"],
        "token_logprobs": [None, -0.5],
        "top_logprobs": [None, {" a": -0.5, " b": -1.5}],
        "text_offset": [0, 3],
    }
    assert printed["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}

    chunk = pb.ChatCompletionChunk(
        id="chatcmpl-1",
        object="chat.completion.chunk",
        created=1,
        model="m",
        choices=[pb.ChatChunkChoice(delta=pb.ChatDelta(role="assistant", content="Hi"))],
    )
    printed = _openai_json(chunk)
    assert printed["object"] == "chat.completion.chunk"
    assert printed["choices"][0]["delta"] == {"role": "assistant", "content": "Hi"}
    assert "finish_reason" not in printed["choices"][0]  # unset while the stream goes on

    models = pb.ListModelsResponse(
        object="list", data=[pb.Model(id="m", object="model", owned_by="tandem", max_model_len=8)]
    )
    assert _openai_json(models)["data"][0]["owned_by"] == "tandem"


def test_engine_sampling_params_mirror_the_engine_dataclass() -> None:
    proto_fields = {f.name for f in engine_pb2.SamplingParams.DESCRIPTOR.fields}
    dataclass_fields = {f.name for f in dataclasses.fields(SamplingParams)}
    assert proto_fields == dataclass_fields
