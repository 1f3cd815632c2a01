"""A chat's streamed answer: ``ChatCompleteStream``'s chunks, folded from its choices' deltas.

Owns the chunk shape (role first, reasoning as ``reasoning``, content, tool calls as the tool
plan streams them, finish reasons, logprobs, token ids) and the usage chunk last. It does
not own parsing calls (``tools``) or splitting reasoning (``reasoning``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator

from protos.tandem.v1 import generation_pb2 as pb
from services.frontend.choices import ChoiceDelta
from services.frontend.engine_seam import GenerationDelta
from services.frontend.output_fields import chat_logprobs, reasoning_tokens, set_token_ids, usage_of
from services.frontend.reasoning.plan import ReasoningPlan, ReasoningStream
from services.frontend.tools.parsers import CallStream, new_tool_call_id
from services.frontend.tools.plan import ToolPlan


async def chat_chunks(
    choices: AsyncIterator[ChoiceDelta], *, response_id: str, model: str, include_usage: bool,
    tools: ToolPlan | None = None, reasoning: ReasoningPlan | None = None,
    prompt_token_ids: list[int] | None = None,
) -> AsyncGenerator[pb.ChatCompletionChunk, None]:
    """ChatCompleteStream's messages; each choice's first chunk carries the role
    "assistant", and the usage (with ``include_usage``) comes last, once. A reasoning
    model's thinking streams as ``reasoning``, what follows it as the content. A forced named
    function streams as one tool call: its name first, then its arguments as they come;
    ``required`` calls come whole when the choice ends (their list must be parsed first);
    under ``auto`` the content streams up to the first call, then each call as it comes
    (``tool_call_parsers``)."""
    tools = tools or ToolPlan()
    reasoning = reasoning or ReasoningPlan()
    created = int(time.time())
    started: set[int] = set()
    lasts: dict[int, GenerationDelta] = {}
    thinking: dict[int, ReasoningStream | None] = {}
    texts: dict[int, list[str]] = {}  # "required": each choice's text, parsed at its end
    streams: dict[int, CallStream] = {}  # "auto"
    prompt_ids_sent = False
    async for choice_delta in choices:
        index, delta = choice_delta.index, choice_delta.delta
        done_before = lasts[index].completion_tokens if index in lasts else 0
        lasts[index] = delta
        first = index not in started
        thoughts, text = "", delta.text
        if first:
            thinking[index] = reasoning.stream()
        if (split := thinking[index]) is not None:
            thoughts, text = split.feed(delta.text, delta.completion_tokens - done_before)
            if delta.finish_reason is not None:
                more_thoughts, more_text = split.finish()
                thoughts, text = thoughts + more_thoughts, text + more_text
        if not (first or text or thoughts or delta.finish_reason or delta.logprobs
                or (prompt_token_ids is not None and delta.token_ids)):
            continue
        choice = pb.ChatChunkChoice(index=index)
        choice.delta.SetInParent()
        if first:
            choice.delta.role = "assistant"
            started.add(index)
        if thoughts:
            choice.delta.reasoning = thoughts
        made_calls = False
        if tools.mode == "named":
            call = choice.delta.tool_calls.add(index=0)
            call.function.arguments = text
            if first:
                call.id, call.type = new_tool_call_id(), "function"
                call.function.name = tools.function or ""
            made_calls = True
        elif tools.mode in ("required", "auto"):
            if tools.mode == "auto":
                if first:
                    streams[index] = tools.call_stream()
                stream = streams[index]
                content, call_deltas = stream.feed(text)
                if delta.finish_reason is not None:
                    rest, more = stream.finish()
                    content, call_deltas = content + rest, call_deltas + more
                choice.delta.tool_calls.extend(call_deltas)
                made_calls = stream.num_calls > 0
            else:
                texts.setdefault(index, []).append(text)
                content = ""
                if delta.finish_reason is not None:
                    whole, calls = tools.split("".join(texts[index]))
                    content = whole or ""
                    _add_call_deltas(choice.delta, calls)
                    made_calls = bool(calls)
            if content:
                choice.delta.content = content
        elif text or not thoughts:
            choice.delta.content = text
        if delta.finish_reason is not None:
            choice.finish_reason = tools.finish_reason(delta.finish_reason, made_calls)
        if delta.logprobs:
            choice.logprobs.CopyFrom(chat_logprobs(delta.logprobs))
        if prompt_token_ids is not None:
            set_token_ids(choice.token_ids, delta.token_ids)
        # The chunk holds a copy of the choice: the choice is complete by now.
        chunk = pb.ChatCompletionChunk(id=response_id, object="chat.completion.chunk",
                                       created=created, model=model, choices=[choice])
        if prompt_token_ids is not None and not prompt_ids_sent:
            set_token_ids(chunk.prompt_token_ids, prompt_token_ids)
            prompt_ids_sent = True
        yield chunk
    if include_usage and lasts:
        yield pb.ChatCompletionChunk(
            id=response_id, object="chat.completion.chunk", created=created, model=model,
            usage=usage_of(lasts, reasoning_tokens=reasoning_tokens(thinking.values())
                         if reasoning.enabled else None))


def _add_call_deltas(delta: pb.ChatDelta, calls: list[pb.ToolCall]) -> None:
    for i, call in enumerate(calls):
        delta.tool_calls.add(index=i, id=call.id, type=call.type).function.CopyFrom(
            pb.FunctionCallDelta(name=call.function.name, arguments=call.function.arguments))


