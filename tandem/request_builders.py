"""Builds ``tandem.v1.Generation`` request messages from the SDK's keyword arguments.

Owns ``GenerationOptions`` (the sampling and stopping knobs every generation call takes) and
their mapping onto ``CompletionRequest`` / ``ChatCompletionRequest``: which request takes a
knob, and how it is set, is read off the request messages (a knob is the field of its name),
so only knobs the SDK checks or reshapes have code of their own. A knob left out stays
unset on the wire, so the server applies its own (OpenAI's) default. It does not validate
ranges: the server does, and answers INVALID_ARGUMENT (but for an empty
``allowed_token_ids``, which the wire cannot tell from an unset one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

import grpc
from google.protobuf import json_format, struct_pb2
from google.protobuf.message import Message

from protos.tandem.v1 import generation_pb2 as pb
from tandem.errors import InvalidRequestError


class GenerationOptions(TypedDict, total=False):
    n: int  # choices to generate (1 to 128); each applies max_tokens, stop, logprobs alone
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    stop: str | Sequence[str]
    stop_token_ids: Sequence[int]
    logit_bias: Mapping[int, float]  # token id -> bias in [-100, 100], added to its logit
    # vLLM's: only these token ids may be sampled (not empty: leave it out to allow all).
    allowed_token_ids: Sequence[int]
    # vLLM's: words the output must not contain (each banned as written and after a space).
    bad_words: Sequence[str]
    # OpenAI's {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name": ...,
    # "schema": {...}}}: the output is JSON (following the schema).
    response_format: Mapping[str, object]
    # vLLM's: one of {"json": schema}, {"regex": ...}, {"choice": [...]}, {"grammar": EBNF}.
    structured_outputs: Mapping[str, object]
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_tokens: int
    ignore_eos: bool
    skip_special_tokens: bool
    include_stop_str_in_output: bool
    cache_salt: str
    priority: int
    user: str
    # Chat only: OpenAI's function tools, [{"type": "function", "function": {"name": ...,
    # "description": ..., "parameters": schema}}], and tool_choice: "auto" (models whose chat
    # template uses the Hermes <tool_call> format), "required", {"type": "function",
    # "function": {"name": ...}} to force one, or "none".
    tools: Sequence[Mapping[str, object]]
    tool_choice: str | Mapping[str, object]
    parallel_tool_calls: bool
    # Chat only: extra variables for the model's chat template, e.g. {"enable_thinking":
    # False} for Qwen3.
    chat_template_kwargs: Mapping[str, object]
    # Chat only: False leaves a reasoning model's thinking out of the response.
    include_reasoning: bool
    # Chat only: add_generation_prompt=False with continue_final_message=True makes the
    # model continue the last (assistant) message instead of starting a new turn.
    add_generation_prompt: bool
    continue_final_message: bool
    # The prompt's own logprobs with this many alternatives (0-20), in the result's
    # prompt_logprobs (vLLM's); not with streaming.
    prompt_logprobs: int
    # Completions only: the text (and logprobs) start with the prompt's; with max_tokens=0
    # nothing is generated (scoring a prompt, as evaluation harnesses do).
    echo: bool
    # Keep only the prompt's last this many tokens (-1: as many as leave room for
    # max_tokens).
    truncate_prompt_tokens: int
    # The prompt's token ids and each choice's in the result (token_ids, prompt_token_ids).
    return_token_ids: bool


_OPTION_NAMES = frozenset(GenerationOptions.__annotations__)

# {"role": ..., "content": ..., "name": ...}; content is a string or a list of text parts,
# [{"type": "text", "text": ...}, ...], as in OpenAI's API.
ChatMessages = Sequence[Mapping[str, object]]


# A completion's prompt: text, token ids, or several of either.
Prompts = str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]]


def _value(item: Prompts) -> struct_pb2.Value:
    value = struct_pb2.Value()
    if isinstance(item, str):
        value.string_value = item
    else:
        value.list_value.SetInParent()
        for part in item:
            if isinstance(part, str | int):
                value.list_value.append(part)
            else:  # one of several tokenized prompts
                value.list_value.add_list().extend(list(part))
    return value


def _set_stop(request: pb.CompletionRequest | pb.ChatCompletionRequest, value: Any) -> None:
    request.stop.CopyFrom(_value(value))


def _set_allowed_token_ids(request: pb.CompletionRequest | pb.ChatCompletionRequest,
                           value: Any) -> None:
    if not value:
        # On the wire an empty list reads as unset (every token allowed): refused here as
        # the server refuses an empty list.
        raise InvalidRequestError(
            grpc.StatusCode.INVALID_ARGUMENT,
            "allowed_token_ids must not be empty (leave it unset to allow every token)")
    request.allowed_token_ids.extend(value)


def _set_bad_words(request: pb.CompletionRequest | pb.ChatCompletionRequest,
                   value: Any) -> None:
    if isinstance(value, str):  # one word, not its characters
        raise TypeError("bad_words takes a list of strings, not a string")
    request.bad_words.extend(value)


# The options the SDK checks or reshapes on the way to the wire. Every other option is set by
# its request field's kind (scalar, repeated, map, message from JSON), read off the message:
# an option the proto and GenerationOptions gain needs no edit here.
_SETTERS = {"stop": _set_stop, "allowed_token_ids": _set_allowed_token_ids,
            "bad_words": _set_bad_words}


def set_field(message: Message, name: str, value: Any) -> None:
    """Sets ``message``'s field ``name`` by its kind, read off the message: a scalar, a
    repeated scalar, a map, a message (or repeated messages) from JSON-shaped values."""
    field = message.DESCRIPTOR.fields_by_name[name]
    message_type = field.message_type
    if message_type is not None and message_type.GetOptions().map_entry:
        getattr(message, name).update(value)
    elif field.is_repeated and message_type is not None:
        for item in value:
            json_format.ParseDict(dict(item), getattr(message, name).add())
    elif field.is_repeated:
        getattr(message, name).extend(value)
    elif message_type is not None:
        json_format.ParseDict(value, getattr(message, name))
    else:
        setattr(message, name, value)


def _set_option(request: pb.CompletionRequest | pb.ChatCompletionRequest, name: str,
                value: Any) -> None:
    if name in _SETTERS:
        _SETTERS[name](request, value)
    else:
        set_field(request, name, value)


def _apply_options(
    request: pb.CompletionRequest | pb.ChatCompletionRequest, options: Mapping[str, object]
) -> None:
    """Sets each given option; one this kind of request has no field for (a chat-only one
    on a completion, say) is a TypeError, as an unknown keyword argument is."""
    unknown = set(options) - (_OPTION_NAMES & set(request.DESCRIPTOR.fields_by_name))
    if unknown:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(unknown))}")
    for name, value in options.items():
        if value is not None:  # None means "not given", as in the openai SDK
            _set_option(request, name, value)


def _stream_options(
    request: pb.CompletionRequest | pb.ChatCompletionRequest, stream: bool, include_usage: bool
) -> None:
    request.stream = stream
    if stream and include_usage:
        request.stream_options.include_usage = True


def completion_request(
    prompt: Prompts,
    *,
    model: str | None,
    logprobs: int | None,
    stream: bool,
    include_usage: bool,
    options: Mapping[str, object],
) -> pb.CompletionRequest:
    """A CompletionRequest for a text prompt or a list of prompt token ids."""
    request = pb.CompletionRequest(model=model or "", prompt=_value(prompt))
    if logprobs is not None:
        request.logprobs = logprobs
    _apply_options(request, options)
    _stream_options(request, stream, include_usage)
    return request


def chat_message(message: Mapping[str, object]) -> pb.ChatMessage:
    """A ChatMessage from an OpenAI-style ``{"role": ..., "content": ..., "name": ...}`` (an
    assistant turn may carry ``tool_calls`` and ``reasoning``, a "tool" turn its
    ``tool_call_id``)."""
    unknown = set(message) - {"role", "content", "name", "tool_calls", "tool_call_id",
                              "reasoning"}
    if unknown or "role" not in message:
        raise TypeError(
            "a chat message needs 'role' and 'content' (and maybe 'name', 'tool_calls', "
            f"'tool_call_id', 'reasoning'): {message!r}"
        )
    text_or_parts: Any = message.get("content") or ""
    content = struct_pb2.Value()  # any JSON value: the server checks the parts' shape
    json_format.ParseDict(text_or_parts, content)
    converted = pb.ChatMessage(role=str(message["role"]), content=content,
                               name=str(message.get("name", "")),
                               tool_call_id=str(message.get("tool_call_id", "")),
                               reasoning=str(message.get("reasoning") or ""))
    for call in message.get("tool_calls") or []:  # type: ignore[attr-defined]
        json_format.ParseDict(call, converted.tool_calls.add())
    return converted


def chat_request(
    messages: ChatMessages,
    *,
    model: str | None,
    logprobs: bool,
    top_logprobs: int | None,
    stream: bool,
    include_usage: bool,
    options: Mapping[str, object],
) -> pb.ChatCompletionRequest:
    """A ChatCompletionRequest for OpenAI-style messages."""
    request = pb.ChatCompletionRequest(
        model=model or "", messages=[chat_message(m) for m in messages]
    )
    if logprobs or top_logprobs is not None:
        request.logprobs = True
    if top_logprobs is not None:
        request.top_logprobs = top_logprobs
    _apply_options(request, options)
    _stream_options(request, stream, include_usage)
    return request
