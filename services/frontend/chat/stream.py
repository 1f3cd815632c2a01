"""A chat's streamed answer: ``ChatCompleteStream``'s chunks, folded from its choices' deltas.

Owns the chunk shape (role first, reasoning as ``reasoning``, content, tool calls as the tool
plan streams them, finish reasons, logprobs, token ids) and the usage chunk last. It does
not own parsing calls (``tools``) or splitting reasoning (``reasoning``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

from protos.tandem.v1 import generation_pb2 as pb
from services.frontend.choices import ChoiceDelta
from services.frontend.engine_seam import GenerationDelta
from services.frontend.output_fields import chat_logprobs, reasoning_tokens, set_token_ids, usage_of
from services.frontend.reasoning.plan import ReasoningPlan, ReasoningStream
from services.frontend.tools.parsers import CallStream, new_tool_call_id
from services.frontend.tools.plan import ToolPlan


@dataclass
class _ChoiceStream:
    """One choice's stream: its reasoning split off the text, its tool calls parsed out of
    what follows (as the tool plan says), and its last delta."""

    tools: ToolPlan
    thinking: ReasoningStream | None
    calls: CallStream | None  # "auto": calls parsed as they stream
    texts: list[str] = field(default_factory=list)  # "required": parsed at the end
    last: GenerationDelta | None = None
    started: bool = False

    @classmethod
    def open(cls, tools: ToolPlan, reasoning: ReasoningPlan) -> _ChoiceStream:
        return cls(tools, reasoning.stream(),
                   tools.call_stream() if tools.mode == "auto" else None)

    def split(self, delta: GenerationDelta) -> tuple[str, str]:
        """The delta's thinking and the text after it."""
        done_before = self.last.completion_tokens if self.last is not None else 0
        self.last = delta
        if self.thinking is None:
            return "", delta.text
        thoughts, text = self.thinking.feed(delta.text, delta.completion_tokens - done_before)
        if delta.finish_reason is not None:
            more_thoughts, more_text = self.thinking.finish()
            thoughts, text = thoughts + more_thoughts, text + more_text
        return thoughts, text

    def fill(self, out: pb.ChatDelta, text: str, thoughts: str, finishing: bool) -> bool:
        """Put ``text`` into ``out`` as the tool plan streams it; whether calls were made."""
        mode = self.tools.mode
        if mode == "named":
            call = out.tool_calls.add(index=0)
            call.function.arguments = text
            if not self.started:
                call.id, call.type = new_tool_call_id(), "function"
                call.function.name = self.tools.function or ""
            return True
        if mode == "auto":
            assert self.calls is not None
            content, call_deltas = self.calls.feed(text)
            if finishing:
                rest, more = self.calls.finish()
                content, call_deltas = content + rest, call_deltas + more
            out.tool_calls.extend(call_deltas)
            if content:
                out.content = content
            return self.calls.num_calls > 0
        if mode == "required":
            self.texts.append(text)
            if not finishing:
                return False
            whole, calls = self.tools.split("".join(self.texts))
            if whole:
                out.content = whole
            _add_call_deltas(out, calls)
            return bool(calls)
        if text or not thoughts:
            out.content = text
        return False


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
    (``tools.parsers``)."""
    tools, reasoning = tools or ToolPlan(), reasoning or ReasoningPlan()
    created = int(time.time())
    streams: dict[int, _ChoiceStream] = {}
    prompt_ids_pending = prompt_token_ids is not None
    async for choice_delta in choices:
        index, delta = choice_delta.index, choice_delta.delta
        if index not in streams:
            streams[index] = _ChoiceStream.open(tools, reasoning)
        stream = streams[index]
        choice = _chunk_choice(index, stream, delta, with_ids=prompt_token_ids is not None)
        if choice is None:
            continue
        # The chunk holds a copy of the choice: the choice is complete by now.
        chunk = pb.ChatCompletionChunk(id=response_id, object="chat.completion.chunk",
                                       created=created, model=model, choices=[choice])
        if prompt_ids_pending and prompt_token_ids is not None:
            set_token_ids(chunk.prompt_token_ids, prompt_token_ids)
            prompt_ids_pending = False
        yield chunk
    if include_usage and streams:
        lasts = {i: s.last for i, s in streams.items() if s.last is not None}
        yield pb.ChatCompletionChunk(
            id=response_id, object="chat.completion.chunk", created=created, model=model,
            usage=usage_of(lasts, reasoning_tokens=reasoning_tokens(
                s.thinking for s in streams.values()) if reasoning.enabled else None))


def _chunk_choice(index: int, stream: _ChoiceStream, delta: GenerationDelta,
                  with_ids: bool) -> pb.ChatChunkChoice | None:
    """The chunk's choice for one delta, or None when it carries nothing to send yet (text
    held back: a possible stop string or tag)."""
    first = not stream.started
    thoughts, text = stream.split(delta)
    finishing = delta.finish_reason is not None
    if not (first or text or thoughts or finishing or delta.logprobs
            or (with_ids and delta.token_ids)):
        return None
    choice = pb.ChatChunkChoice(index=index)
    choice.delta.SetInParent()
    if first:
        choice.delta.role = "assistant"
    if thoughts:
        choice.delta.reasoning = thoughts
    made_calls = stream.fill(choice.delta, text, thoughts, finishing)
    stream.started = True
    if delta.finish_reason is not None:
        choice.finish_reason = stream.tools.finish_reason(delta.finish_reason, made_calls)
    if delta.logprobs:
        choice.logprobs.CopyFrom(chat_logprobs(delta.logprobs))
    if with_ids:
        set_token_ids(choice.token_ids, delta.token_ids)
    return choice


def _add_call_deltas(delta: pb.ChatDelta, calls: list[pb.ToolCall]) -> None:
    for i, call in enumerate(calls):
        delta.tool_calls.add(index=i, id=call.id, type=call.type).function.CopyFrom(
            pb.FunctionCallDelta(name=call.function.name, arguments=call.function.arguments))
