"""The sampling fields agree in every place that spells them: the SDK's options
(``tandem.request_builders``), the public request messages, the front end's resolution into
``SamplingParams`` (``services.frontend.request_params``) and the engine message both ways
(``services.engine_api.messages``); and the Responses API's options (``tandem.responses``,
``services.frontend.responses.translate``), which reach the engine through chat's.

Each request is fully populated through the SDK, resolved by the real front end with a tiny
model's tokenizer, and sent through the engine message and back: every field of
``SamplingParams`` must arrive with the value asked for, none left at its default, and every
field of the engine message must be set. A field added to the record or the protos and missed
anywhere on the way fails here; give it a value in ``SHARED_OPTIONS`` to cover it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from engine_common.input_processor import InputProcessor
from engine_common.sampling_params import SamplingParams
from engine_common.tokenizer import load_tokenizer
from protos.tandem.v1 import engine_pb2 as epb
from protos.tandem.v1 import generation_pb2 as pb
from services.engine_api.messages import sampling_params_from_pb, sampling_params_to_pb
from services.frontend.chat.request import chat_to_engine_request
from services.frontend.completions.request import completion_to_engine_request
from services.frontend.request_params import SAMPLING_FIELDS
from services.frontend.responses.translate import COPIED_OPTIONS
from services.frontend.responses.translate import chat_request as translated_chat_request
from tandem.request_builders import GenerationOptions, chat_request, completion_request
from tandem.responses import OUTPUT_TEXT_LOGPROBS, ResponseOptions, response_request

# Every option both requests take, none at its default.
SHARED_OPTIONS: dict[str, Any] = {
    "n": 2, "max_tokens": 7, "temperature": 0.5, "top_p": 0.875, "top_k": 5, "min_p": 0.0625,
    "seed": 11, "stop": ["END", "STOP"], "stop_token_ids": [3, 4], "logit_bias": {5: 1.5},
    "allowed_token_ids": [5, 6, 7, 8, 9, 10], "bad_words": ["hello"],
    "structured_outputs": {"regex": "[ab]+"}, "presence_penalty": 0.25,
    "frequency_penalty": 0.5, "repetition_penalty": 1.125, "min_tokens": 2, "ignore_eos": True,
    "skip_special_tokens": False, "include_stop_str_in_output": True, "cache_salt": "salt",
    "priority": 3, "user": "u", "prompt_logprobs": 2, "truncate_prompt_tokens": 4,
    "return_token_ids": True,
}
COMPLETION_OPTIONS = {**SHARED_OPTIONS, "echo": False}
CHAT_OPTIONS = {
    **SHARED_OPTIONS,
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "tool_choice": "none", "parallel_tool_calls": False,
    "chat_template_kwargs": {"x": 1}, "include_reasoning": False,
    "add_generation_prompt": True, "continue_final_message": False,
}
TOP_LOGPROBS = 3
# Request fields the SDK sets from its methods' own arguments, not from options.
SDK_ARGUMENTS = {"model", "prompt", "messages", "logprobs", "top_logprobs", "stream",
                 "stream_options"}
# Chat's other name for max_tokens: the SDK offers max_tokens only.
NOT_OFFERED = {"max_completion_tokens"}
# At most one output constraint per request: structured_outputs stands for response_format.
LEFT_UNSET = {"response_format", "max_completion_tokens", "stream", "stream_options"}


@pytest.fixture(scope="module")
def inputs(tiny_llama_dir: Path) -> InputProcessor:
    tokenizer = load_tokenizer(tiny_llama_dir)
    return InputProcessor(tokenizer, 512, len(tokenizer))


def check_resolved(params: SamplingParams, options: dict[str, Any],
                   inputs: InputProcessor) -> None:
    """Every field arrived as asked; none kept the record's default."""
    for name in SAMPLING_FIELDS:
        assert getattr(params, name) == options[name], name
    assert (params.max_tokens, params.logprobs) == (options["max_tokens"], TOP_LOGPROBS)
    assert params.prompt_logprobs == options["prompt_logprobs"]
    assert (params.stop, params.stop_token_ids) == (options["stop"], options["stop_token_ids"])
    assert params.logit_bias == options["logit_bias"]
    assert params.allowed_token_ids == options["allowed_token_ids"]
    assert params.bad_words_token_ids == inputs.bad_words_token_ids(options["bad_words"])
    assert params.structured_output is not None
    assert params.structured_output.kind == "regex"
    default = SamplingParams()
    left = [f.name for f in dataclasses.fields(SamplingParams)
            if getattr(params, f.name) == getattr(default, f.name)]
    assert not left, f"not reached from the public request: {left}"


def check_engine_round_trip(params: SamplingParams) -> None:
    message = sampling_params_to_pb(params)
    assert {f.name for f, _ in message.ListFields()} == set(
        epb.SamplingParams.DESCRIPTOR.fields_by_name)
    wire = epb.SamplingParams.FromString(message.SerializeToString())
    assert sampling_params_from_pb(wire) == params


def set_fields(request: pb.CompletionRequest | pb.ChatCompletionRequest) -> set[str]:
    return {f.name for f, _ in request.ListFields()}


def test_the_record_and_the_engine_message_have_the_same_fields() -> None:
    assert {f.name for f in dataclasses.fields(SamplingParams)} == set(
        epb.SamplingParams.DESCRIPTOR.fields_by_name)


def test_the_sdk_options_are_the_request_fields() -> None:
    """Each option is a field of a public request; each field of either request is an
    option, an argument of the SDK's methods or, knowingly, not offered."""
    completion = set(pb.CompletionRequest.DESCRIPTOR.fields_by_name)
    chat = set(pb.ChatCompletionRequest.DESCRIPTOR.fields_by_name)
    options = set(GenerationOptions.__annotations__)
    assert options <= completion | chat
    assert (completion | chat) - options - SDK_ARGUMENTS == NOT_OFFERED
    assert set(COMPLETION_OPTIONS) == (options & completion) - {"response_format"}
    assert set(CHAT_OPTIONS) == (options & chat) - {"response_format"}


def test_every_completion_option_reaches_the_engine(inputs: InputProcessor) -> None:
    request = completion_request("one two three four five six", model=None,
                                 logprobs=TOP_LOGPROBS, stream=False, include_usage=False,
                                 options=COMPLETION_OPTIONS)
    fields = set(pb.CompletionRequest.DESCRIPTOR.fields_by_name)
    assert set_fields(request) == fields - LEFT_UNSET - {"model"}  # model "": the default
    plan = completion_to_engine_request(request, inputs)
    check_resolved(plan.params, COMPLETION_OPTIONS, inputs)
    check_engine_round_trip(plan.params)


def test_every_chat_option_reaches_the_engine(inputs: InputProcessor) -> None:
    request = chat_request([{"role": "user", "content": "one two three"}], model=None,
                           logprobs=True, top_logprobs=TOP_LOGPROBS, stream=False,
                           include_usage=False, options=CHAT_OPTIONS)
    fields = set(pb.ChatCompletionRequest.DESCRIPTOR.fields_by_name)
    assert set_fields(request) == fields - LEFT_UNSET - {"model"}
    params = chat_to_engine_request(request, inputs).request.params
    check_resolved(params, CHAT_OPTIONS, inputs)
    check_engine_round_trip(params)


# --- The Responses API: its options reach the engine as chat's do --------------------------

# Every option of ``ResponseOptions`` (the SDK's), none at its default.
RESPONSE_OPTIONS: dict[str, Any] = {
    "instructions": "be brief", "max_output_tokens": 7,
    "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
    "tool_choice": "none", "text": {"format": {"type": "json_object"}},
    "include": [OUTPUT_TEXT_LOGPROBS], "top_logprobs": TOP_LOGPROBS, "temperature": 0.5,
    "top_p": 0.875, "top_k": 5, "min_p": 0.0625, "seed": 11, "repetition_penalty": 1.125,
    "parallel_tool_calls": False, "metadata": {"k": "v"}, "user": "u", "cache_salt": "salt",
    "priority": 3, "chat_template_kwargs": {"x": 1}, "previous_response_id": "resp_1",
    "store": True, "background": True,
}
# ResponseRequest fields the SDK's response methods set from their own arguments.
RESPONSE_SDK_ARGUMENTS = {"model", "input", "stream"}


def test_the_sdk_response_options_are_the_request_fields() -> None:
    fields = set(pb.ResponseRequest.DESCRIPTOR.fields_by_name)
    assert set(ResponseOptions.__annotations__) == fields - RESPONSE_SDK_ARGUMENTS
    assert set(RESPONSE_OPTIONS) == set(ResponseOptions.__annotations__)


def test_every_response_option_reaches_the_engine(inputs: InputProcessor) -> None:
    """Through the SDK's ``response_request``, the Responses translation and the chat front
    end: each sampling field the Responses request carries arrives in ``SamplingParams`` as
    asked, and every option chat takes under the same name is set on the chat request."""
    request = response_request("one two three", model=None, options=RESPONSE_OPTIONS)
    assert set_fields(request) == set(pb.ResponseRequest.DESCRIPTOR.fields_by_name) - {
        "model", "stream"}
    chat = translated_chat_request(request)
    shared = set(pb.ResponseRequest.DESCRIPTOR.fields_by_name) & set(
        pb.ChatCompletionRequest.DESCRIPTOR.fields_by_name)
    # Names chat has too, other than those the Responses API means otherwise (stream: the
    # RPC decides) or the translation leaves to the store (model: resolved by the server).
    assert shared - {"stream", "model"} <= set_fields(chat)
    for name in COPIED_OPTIONS:
        assert getattr(chat, name) == RESPONSE_OPTIONS[name], name
    params = chat_to_engine_request(chat, inputs).request.params
    sampling = {f.name for f in dataclasses.fields(SamplingParams)} & set(RESPONSE_OPTIONS)
    assert sampling and sampling <= set(SAMPLING_FIELDS)
    for name in sampling:
        assert getattr(params, name) == RESPONSE_OPTIONS[name], name
    assert (params.max_tokens, params.logprobs) == (RESPONSE_OPTIONS["max_output_tokens"],
                                                    TOP_LOGPROBS)
    assert params.structured_output is not None
    assert params.structured_output.kind == "json_object"
