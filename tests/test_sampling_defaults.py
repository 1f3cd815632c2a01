"""The model creator's sampling defaults (``generation_config.json``), as vLLM applies them.

A request that leaves temperature, top_p, top_k, min_p or a penalty unset gets the model's
value; one that sets it keeps its own; a chat without max_tokens gets max_new_tokens, cut to
the room the context leaves; ``--generation-config vllm`` turns the defaults off, a folder
path reads another file, ``--override-generation-config`` sets values over them; a file or
override with values no request could use stops the server at start with a message. End to
end: a model whose file says temperature 0 answers greedily through the gateway and the
replica, and samples once the defaults are off.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from google.protobuf import struct_pb2

from engine_common.config import CacheConfig, EngineConfig, ModelSettings
from engine_common.input_processor import InputProcessor
from engine_common.llm import LLM
from engine_common.sampling_defaults import load_sampling_defaults
from engine_common.sampling_params import SamplingParams
from engine_common.tokenizer import load_tokenizer
from gateway.server import load_inputs
from protos.tandem.v1 import generation_pb2 as pb
from services.frontend.chat.request import chat_to_engine_request
from services.frontend.completions.request import completion_to_engine_request
from services.frontend.responses import translate as responses_api
from services.replica.main import build_parser as replica_parser
from tandem.client import Client
from tests.replica_process import (
    gateway_started,
    is_serving,
    launch_replicas,
    wait_serving,
    wait_until,
)

RECOMMENDED = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
               "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.25}


def model_with_generation_config(source: Path, target: Path, config: dict[str, object]) -> Path:
    """A copy of ``source`` whose generation_config.json also says ``config``."""
    shutil.copytree(source, target)
    path = target / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return target


def test_the_file_sets_the_defaults_a_request_leaves_unset(tiny_llama_dir, tmp_path) -> None:
    model = model_with_generation_config(
        tiny_llama_dir, tmp_path / "m", {**RECOMMENDED, "do_sample": True, "max_length": 20})
    defaults = load_sampling_defaults(model)
    assert defaults == RECOMMENDED  # only the sampling fields, eos and the rest ignored
    assert load_sampling_defaults(model, "vllm") == {}
    assert load_sampling_defaults(tiny_llama_dir) == {}  # a file without them

    tokenizer = load_tokenizer(model)
    inputs = InputProcessor(tokenizer, 512, len(tokenizer), defaults)
    chat = pb.ChatCompletionRequest(messages=[pb.ChatMessage(role="user")])
    chat.messages[0].content.string_value = "hi"
    params = chat_to_engine_request(chat, inputs).request.params
    assert {name: getattr(params, name) for name in RECOMMENDED} == RECOMMENDED
    chat.temperature, chat.top_k = 0.0, 3  # set, even to zero: the request's own
    params = chat_to_engine_request(chat, inputs).request.params
    assert (params.temperature, params.top_k, params.top_p) == (0.0, 3, 0.9)
    completion = pb.CompletionRequest(max_tokens=4)
    completion.prompt.string_value = "hello"
    params = completion_to_engine_request(completion, inputs).requests[0].params
    assert params.temperature == 0.6 and params.repetition_penalty == 1.1
    # The gateway reads the same file (it resolves requests itself).
    assert load_inputs(str(model)).sampling_defaults == RECOMMENDED
    assert load_inputs(str(model), ModelSettings(generation_config="vllm")
                       ).sampling_defaults == {}


def chat(content: str, **fields: object) -> pb.ChatCompletionRequest:
    request = pb.ChatCompletionRequest(messages=[pb.ChatMessage(role="user")], **fields)
    request.messages[0].content.string_value = content
    return request


def test_max_new_tokens_limits_chats_that_set_no_limit(tiny_llama_dir, tmp_path) -> None:
    """vLLM's rule: the default is the fallback for a chat (or response) without max_tokens,
    cut to what the context leaves; a request's own limit wins; completions keep OpenAI's
    16."""
    model = model_with_generation_config(tiny_llama_dir, tmp_path / "m", {"max_new_tokens": 40})
    defaults = load_sampling_defaults(model)
    assert defaults == {"max_tokens": 40}
    tokenizer = load_tokenizer(model)
    inputs = InputProcessor(tokenizer, 512, len(tokenizer), defaults)
    assert chat_to_engine_request(chat("hi"), inputs).request.params.max_tokens == 40
    assert chat_to_engine_request(chat("hi", max_tokens=90), inputs).request.params.max_tokens == 90
    assert chat_to_engine_request(chat("hi", min_tokens=60), inputs  # never below min_tokens
                                  ).request.params.max_tokens == 60
    long = chat_to_engine_request(chat("word " * 158), inputs).request
    assert long.params.max_tokens == 512 - len(long.prompt_token_ids) < 40
    response = pb.ResponseRequest(input=struct_pb2.Value(string_value="hi"))
    assert chat_to_engine_request(responses_api.chat_request(response), inputs
                                  ).request.params.max_tokens == 40
    completion = pb.CompletionRequest()
    completion.prompt.string_value = "hello"
    assert completion_to_engine_request(completion, inputs).requests[0].params.max_tokens == 16
    # Without the default, a chat runs up to the context.
    plain = InputProcessor(tokenizer, 512, len(tokenizer), {})
    assert chat_to_engine_request(chat("hi"), plain).request.params.max_tokens is None


def test_a_folder_or_overrides_give_the_defaults_instead(tiny_llama_dir, tmp_path) -> None:
    elsewhere = tmp_path / "configs"
    elsewhere.mkdir()
    (elsewhere / "generation_config.json").write_text(json.dumps({"top_k": 7, "top_p": 0.5}))
    assert load_sampling_defaults(tiny_llama_dir, str(elsewhere)) == {"top_k": 7, "top_p": 0.5}
    assert load_sampling_defaults(tiny_llama_dir, str(elsewhere), {"top_p": 0.8}) == {
        "top_k": 7, "top_p": 0.8}
    model = model_with_generation_config(tiny_llama_dir, tmp_path / "m", {"temperature": 0.6})
    assert load_sampling_defaults(model, "auto", {"max_new_tokens": 9}) == {
        "temperature": 0.6, "max_tokens": 9}
    assert load_sampling_defaults(model, "vllm", {"min_p": 0.1}) == {"min_p": 0.1}
    settings = ModelSettings(generation_config=str(elsewhere),
                             override_generation_config={"repetition_penalty": 1.2})
    assert load_inputs(str(model), settings).sampling_defaults == {
        "top_k": 7, "top_p": 0.5, "repetition_penalty": 1.2}


def test_unusable_defaults_and_modes_are_refused(tiny_llama_dir, tmp_path) -> None:
    model = model_with_generation_config(tiny_llama_dir, tmp_path / "m", {"top_p": 1.5})
    with pytest.raises(ValueError, match="generation_config.json sets sampling defaults no "
                                         "request could use.*--generation-config vllm"):
        load_sampling_defaults(model)
    assert load_sampling_defaults(model, "vllm") == {}
    with pytest.raises(ValueError, match="auto or vllm or a folder holding a "
                                         "generation_config.json; .*mine.* is not a file"):
        load_sampling_defaults(model, str(tmp_path / "mine"))
    with pytest.raises(ValueError, match=r"\['do_sample', 'top_q'\] are not numeric request "
                                         "defaults"):
        load_sampling_defaults(tiny_llama_dir, "auto", {"top_q": 0.5, "do_sample": True,
                                                        "top_k": 5})
    with pytest.raises(ValueError, match="--override-generation-config sets sampling defaults "
                                         "no request could use.*max_tokens"):
        load_sampling_defaults(tiny_llama_dir, "vllm", {"max_new_tokens": 0})
    with pytest.raises(SystemExit):  # the flag itself wants a JSON object
        replica_parser().parse_args(["--override-generation-config", "[1]"])


def test_a_model_that_recommends_greedy_is_served_greedy(tiny_llama_dir, tmp_path) -> None:
    model = model_with_generation_config(tiny_llama_dir, tmp_path / "m", {"temperature": 0.0})
    offline = LLM(EngineConfig(model=str(model), dtype="float32",
                               cache=CacheConfig(num_gpu_blocks_override=256)))
    messages = [{"role": "user", "content": "tell me about the sea"}]
    greedy = offline.generate([offline.inputs.tokenize_chat(messages)],
                              SamplingParams(temperature=0.0, max_tokens=16,
                                             ignore_eos=True))[0].text
    flags = ["--dtype", "float32", "--kv-cache-memory", "16MiB"]
    logs = tmp_path / "logs"
    logs.mkdir()
    # The gateway starts with the replicas (it retries them until they answer).
    replicas = launch_replicas(model, logs, {
        "auto": [*flags, "--served-model-name", "tiny"],
        # The file off, one value set by hand: sampled at temperature 1, 16 tokens by default.
        "vllm": [*flags, "--generation-config", "vllm",
                 "--override-generation-config", '{"max_new_tokens": 16}']})
    try:
        with gateway_started(model, logs, [replicas["auto"].target]) as gateway:
            wait_serving(replicas)
            wait_until(lambda: is_serving(gateway), time.monotonic() + 60, "gateway", logs)
            for target in (gateway, replicas["auto"].target):
                with Client(target, timeout=60) as client:
                    assert client.chat(messages, max_tokens=16,
                                       ignore_eos=True).content == greedy
        with Client(replicas["vllm"].target, timeout=60) as client:
            answers = [client.chat(messages, ignore_eos=True) for _ in range(2)]
    finally:
        for replica in replicas.values():
            replica.kill()
    sampled = [answer.content for answer in answers]
    assert greedy not in sampled and sampled[0] != sampled[1]
    assert [answer.usage.completion_tokens for answer in answers if answer.usage] == [16, 16]

