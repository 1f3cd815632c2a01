"""A chat request resolved: the rendered prompt, and what its tools and reasoning make of
the output.

Owns turning the messages into the chat template's dicts (tool calls, reasoning and call ids
kept), rendering them, the chat's default ``max_tokens`` and the plans for tool calls
(``tools.plan``) and reasoning (``reasoning.plan``), which also shape a structured output
that must start after the model's thinking. It does not own the answer's shape
(``chat.stream``, ``chat.response``).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from engine_common.generation_request import GenerationRequest
from engine_common.input_processor import InputProcessor
from protos.tandem.v1 import generation_pb2 as pb
from services.frontend.errors import InvalidArgument
from services.frontend.reasoning.plan import THINK_CLOSE, THINK_OPEN, ReasoningPlan, reasoning_plan
from services.frontend.request_params import (
    default_max_tokens,
    optional_flag,
    prompt_logprobs_of,
    sampling_params_of,
    truncated_prompt,
)
from services.frontend.tools.parsers import (
    MISTRAL_FORMAT,
    chat_template_call_format,
    mistral_call_id,
)
from services.frontend.tools.plan import ToolPlan, template_tool_calls, tool_plan
from services.frontend.validation import (
    RENDERED_CHAT,
    chat_template_kwargs,
    check_text_length,
    content_from_value,
)


def new_chat_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def chat_messages(messages: Sequence[pb.ChatMessage], max_model_len: int,
                  call_format: str | None = None) -> list[dict[str, Any]]:
    """OpenAI-style message dicts for the chat template, their contents as plain strings (an
    assistant turn's tool calls and reasoning, a tool turn's call id kept; for a Mistral
    template, call ids cut to the 9 letters and digits it accepts); rejects contents too long
    to fit the context before the template runs over them."""
    call_id = mistral_call_id if call_format == MISTRAL_FORMAT else str
    converted = []
    for i, message in enumerate(messages):
        entry: dict[str, Any] = {
            "role": message.role,
            "content": content_from_value(message.content, f"messages[{i}].content")}
        if message.name:
            entry["name"] = message.name
        if message.tool_calls:
            entry["tool_calls"] = template_tool_calls(list(message.tool_calls))
            for call in entry["tool_calls"]:
                call["id"] = call_id(call["id"])
        if message.tool_call_id:
            entry["tool_call_id"] = call_id(message.tool_call_id)
        if message.reasoning or message.reasoning_content:
            entry["reasoning_content"] = message.reasoning or message.reasoning_content
        converted.append(entry)
    check_text_length(sum(len(m["content"]) for m in converted), max_model_len, "messages")
    return converted


@dataclass(frozen=True)
class ChatRequest:
    """A chat request resolved: what the engine runs, and what its reasoning block and its
    tools make of the output."""

    request: GenerationRequest
    tools: ToolPlan
    reasoning: ReasoningPlan = ReasoningPlan()
    return_token_ids: bool = False  # vLLM's: token ids in the answer


def chat_to_engine_request(request: pb.ChatCompletionRequest, inputs: InputProcessor,
                           lora_name: str | None = None) -> ChatRequest:
    if request.HasField("max_completion_tokens"):
        max_tokens: int | None = request.max_completion_tokens
    elif request.HasField("max_tokens"):
        max_tokens = request.max_tokens
    else:
        max_tokens = None
    if request.HasField("top_logprobs") and not request.logprobs:
        raise InvalidArgument("top_logprobs needs logprobs=true")
    logprobs: int | None = None
    if request.logprobs:
        logprobs = request.top_logprobs if request.HasField("top_logprobs") else 0
    call_format = call_format_of(inputs)
    tools = tool_plan(request, call_format)
    params = replace(sampling_params_of(request, inputs, max_tokens, logprobs, tools),
                     prompt_logprobs=prompt_logprobs_of(request))
    if (call_format == MISTRAL_FORMAT and tools.mode == "auto"
            and not request.HasField("skip_special_tokens")):
        # Mistral's call tags are special tokens: the parser must see them.
        params = replace(params, skip_special_tokens=False)
    prompt = inputs.render_chat(
        chat_messages(request.messages, inputs.max_model_len, call_format), tools.tools,
        chat_template_kwargs(request),
        add_generation_prompt=optional_flag(request, "add_generation_prompt", True),
        continue_final_message=optional_flag(request, "continue_final_message", False))
    check_text_length(len(prompt), inputs.max_model_len, RENDERED_CHAT)  # before tokenizing
    prompt_token_ids = truncated_prompt(inputs.tokenize_rendered(prompt), request, params, inputs)
    inputs.validate_prompt(prompt_token_ids, params.max_tokens)
    if max_tokens is None:
        params = default_max_tokens(params, inputs, len(prompt_token_ids))
    reasoning = reasoning_plan(
        getattr(inputs.tokenizer, "chat_template", None), prompt,
        constrained=params.structured_output is not None,
        include=optional_flag(request, "include_reasoning", True),
        think_tokens=think_tokens_of(inputs) if params.structured_output is not None else None)
    if params.structured_output is not None and reasoning.think_tokens is not None:
        opener, closer = reasoning.think_tokens
        params = replace(params, structured_output=replace(
            params.structured_output, starts_after=(closer,),
            waits_if_first=None if reasoning.opened else opener))
    return ChatRequest(
        GenerationRequest(prompt_token_ids, params, request.priority, request.cache_salt or None,
                      lora_name=lora_name),
        tools, reasoning, request.return_token_ids)


def call_format_of(inputs: InputProcessor) -> str | None:
    """The tool-call syntax the server was told of, else the one the template teaches."""
    return inputs.tool_call_parser or chat_template_call_format(
        getattr(inputs.tokenizer, "chat_template", None))



def think_tokens_of(inputs: InputProcessor) -> tuple[int, int] | None:
    """The ids of ``<think>`` and ``</think>`` where each is one token, else None."""
    opener, closer = inputs.single_token(THINK_OPEN), inputs.single_token(THINK_CLOSE)
    return None if opener is None or closer is None else (opener, closer)


