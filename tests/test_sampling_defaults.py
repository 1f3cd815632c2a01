"""The model creator's sampling defaults (``generation_config.json``), as vLLM applies them.

A request that leaves temperature, top_p, top_k, min_p or repetition_penalty unset gets the
model's value; one that sets it keeps its own; ``--generation-config vllm`` turns the
defaults off; a file with values no request could use stops the server at start with a
message. End to end: a model whose file says temperature 0 answers greedily through the
gateway and the replica, and samples once the defaults are off.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine_common.config import CacheConfig, EngineConfig
from engine_common.input_processor import InputProcessor
from engine_common.llm import LLM
from engine_common.sampling_defaults import load_sampling_defaults
from engine_common.sampling_params import SamplingParams
from engine_common.tokenizer import load_tokenizer
from gateway.server import load_inputs
from protos.tandem.v1 import generation_pb2 as pb
from services.replica.openai_api import chat_to_engine_request, completion_to_engine_request
from tandem.client import Client
from tests.replica_process import replica_behind_gateway, start_replicas

RECOMMENDED = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
               "repetition_penalty": 1.1}


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
    params = chat_to_engine_request(chat, inputs).engine.params
    assert {name: getattr(params, name) for name in RECOMMENDED} == RECOMMENDED
    chat.temperature, chat.top_k = 0.0, 3  # set, even to zero: the request's own
    params = chat_to_engine_request(chat, inputs).engine.params
    assert (params.temperature, params.top_k, params.top_p) == (0.0, 3, 0.9)
    completion = pb.CompletionRequest(max_tokens=4)
    completion.prompt.string_value = "hello"
    params = completion_to_engine_request(completion, inputs).engines[0].params
    assert params.temperature == 0.6 and params.repetition_penalty == 1.1
    # The gateway reads the same file (it resolves requests itself).
    assert load_inputs(str(model)).sampling_defaults == RECOMMENDED
    assert load_inputs(str(model), "vllm").sampling_defaults == {}


def test_unusable_defaults_and_modes_are_refused(tiny_llama_dir, tmp_path) -> None:
    model = model_with_generation_config(tiny_llama_dir, tmp_path / "m", {"top_p": 1.5})
    with pytest.raises(ValueError, match="generation_config.json sets sampling defaults no "
                                         "request could use.*--generation-config vllm"):
        load_sampling_defaults(model)
    assert load_sampling_defaults(model, "vllm") == {}
    with pytest.raises(ValueError, match="must be one of"):
        load_sampling_defaults(model, "mine")


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
    with replica_behind_gateway(model, logs, flags) as stack:
        for target in (stack.gateway, stack.replica.target):
            with Client(target, timeout=60) as client:
                assert client.chat(messages, max_tokens=16, ignore_eos=True).content == greedy
    plain = start_replicas(model, logs, {"vllm": [
        *flags, "--generation-config", "vllm"]})["vllm"]
    try:
        with Client(plain.target, timeout=60) as client:
            sampled = [client.chat(messages, max_tokens=16, ignore_eos=True).content
                       for _ in range(2)]
    finally:
        plain.kill()
    assert greedy not in sampled and sampled[0] != sampled[1]  # temperature 1: sampled

