"""The plain records the Tandem SDK returns, and their conversion from the wire messages.

Owns ``Completion``, ``CompletionChunk``, ``ChatCompletion``, ``ChatCompletionChunk``, their
choices (``CompletionChoice``, ``ChatChoice``), ``ToolCall``, ``Usage``, ``TokenLogprob``,
``PromptLogprob`` and ``ModelInfo``.
A response's fields are its first choice's (the only one unless the request set ``n``), and
``choices`` holds them all, ordered by index; a streamed chunk carries one choice, named by
``index``. It does not own the requests (``request_builders``) nor the transport (``client``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from google.protobuf import struct_pb2
from google.protobuf.message import Message

from protos.tandem.v1 import generation_pb2 as pb


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    reasoning_tokens: int = 0  # completion tokens of a thinking model's reasoning


@dataclass(frozen=True)
class TokenLogprob:
    """One generated (or echoed prompt) token, its logprob and the best alternatives at its
    position; an echoed prompt's first token has neither (nothing precedes it)."""

    token: str
    logprob: float | None
    top_logprobs: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class PromptLogprob:
    """A token's entry at one prompt position (vLLM's ``prompt_logprobs``)."""

    logprob: float
    rank: int  # 1 = the most likely token there
    decoded_token: str


# One entry per prompt token: None for the first, then {token id: PromptLogprob} for the
# prompt's own token and the most likely ones.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


@dataclass(frozen=True)
class CompletionChoice:
    index: int
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None  # with the request's prompt_logprobs
    # With return_token_ids (streamed: the prompt's on a choice's first chunk only).
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


@dataclass(frozen=True)
class Completion:
    """The usage covers every choice; ``text``, ``finish_reason``, ``logprobs`` and
    ``prompt_logprobs`` are ``choices[0]``'s."""

    id: str
    model: str
    text: str
    finish_reason: str | None
    usage: Usage | None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    choices: list[CompletionChoice] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None


@dataclass(frozen=True)
class CompletionChunk:
    """A piece of a streamed completion, of choice ``index``; the last one may carry only
    ``usage``."""

    id: str
    model: str
    text: str
    finish_reason: str | None
    usage: Usage | None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    index: int = 0
    token_ids: list[int] | None = None  # with return_token_ids
    prompt_token_ids: list[int] | None = None  # with return_token_ids, on the first chunk


@dataclass(frozen=True)
class ToolCall:
    """A function call the model made (``tool_choice``), or in a streamed chunk a piece of
    one: the first piece of call ``index`` has its id and name, later ones add arguments."""

    index: int
    id: str
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class ChatChoice:
    index: int
    role: str
    content: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    # A reasoning model's thinking (its <think> block), apart from the content; None when
    # the model's chat template has no such block.
    reasoning: str | None = None
    token_ids: list[int] | None = None  # with return_token_ids


@dataclass(frozen=True)
class ChatCompletion:
    """The usage covers every choice; the other fields but ``choices`` are ``choices[0]``'s."""

    id: str
    model: str
    role: str
    content: str
    finish_reason: str | None
    usage: Usage | None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    choices: list[ChatChoice] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    reasoning: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # the rendered prompt's, when asked for
    prompt_token_ids: list[int] | None = None  # with return_token_ids


@dataclass(frozen=True)
class ChatCompletionChunk:
    """A piece of a streamed chat completion, of choice ``index``; ``role`` is set on each
    choice's first one only."""

    id: str
    model: str
    role: str | None
    content: str
    finish_reason: str | None
    usage: Usage | None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    index: int = 0
    tool_calls: list[ToolCall] = field(default_factory=list)
    reasoning: str = ""  # the piece of the reasoning this chunk adds
    token_ids: list[int] | None = None  # with return_token_ids
    prompt_token_ids: list[int] | None = None  # with return_token_ids, on the first chunk


@dataclass(frozen=True)
class ModelInfo:
    id: str
    owned_by: str
    created: int
    max_model_len: int
    parent: str | None = None  # a LoRA adapter's base model


def usage_from_pb(
    message: pb.CompletionResponse | pb.ChatCompletionResponse | pb.ChatCompletionChunk,
) -> Usage | None:
    if not message.HasField("usage"):
        return None
    usage = message.usage
    return Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        cached_tokens=usage.prompt_tokens_details.cached_tokens,
        reasoning_tokens=usage.completion_tokens_details.reasoning_tokens,
    )


def _completion_logprobs(logprobs: pb.CompletionLogprobs) -> list[TokenLogprob]:
    values = list(logprobs.token_logprobs.values)
    tops = [{k: v.number_value for k, v in top.struct_value.fields.items()}
            for top in logprobs.top_logprobs.values]
    return [
        TokenLogprob(token=token, logprob=_number_or_none(value), top_logprobs=top)
        for token, value, top in zip(logprobs.tokens, values, tops, strict=True)
    ]


def _ids(message: Message, name: str) -> list[int] | None:
    """A token-id list field, None where the response has none."""
    if not message.HasField(name):
        return None
    return [int(v.number_value) for v in getattr(message, name).values]


def _number_or_none(value: struct_pb2.Value) -> float | None:
    return value.number_value if value.WhichOneof("kind") == "number_value" else None


def _prompt_logprobs(message: pb.CompletionChoice | pb.ChatCompletionResponse,
                     ) -> PromptLogprobs | None:
    if not message.HasField("prompt_logprobs"):
        return None
    positions: PromptLogprobs = []
    for position in message.prompt_logprobs.values:
        if position.WhichOneof("kind") != "struct_value":
            positions.append(None)
            continue
        entries = {}
        for token_id, entry in position.struct_value.fields.items():
            fields = entry.struct_value.fields
            entries[int(token_id)] = PromptLogprob(
                fields["logprob"].number_value, int(fields["rank"].number_value),
                fields["decoded_token"].string_value)
        positions.append(entries)
    return positions


def _chat_logprobs(logprobs: pb.ChatLogprobs) -> list[TokenLogprob]:
    return [
        TokenLogprob(
            token=entry.token,
            logprob=entry.logprob,
            top_logprobs={top.token: top.logprob for top in entry.top_logprobs},
        )
        for entry in logprobs.content
    ]


def _finish_reason(choice: pb.CompletionChoice | pb.ChatChoice | pb.ChatChunkChoice) -> str | None:
    return choice.finish_reason if choice.HasField("finish_reason") else None


def _completion_choice(choice: pb.CompletionChoice) -> CompletionChoice:
    return CompletionChoice(
        index=choice.index,
        text=choice.text,
        finish_reason=_finish_reason(choice),
        logprobs=_completion_logprobs(choice.logprobs),
        prompt_logprobs=_prompt_logprobs(choice),
        token_ids=_ids(choice, "token_ids"),
        prompt_token_ids=_ids(choice, "prompt_token_ids"),
    )


def completion_from_pb(response: pb.CompletionResponse) -> Completion:
    if not response.choices:
        raise ValueError(f"completion {response.id!r} has no choices")
    choices = sorted((_completion_choice(c) for c in response.choices), key=lambda c: c.index)
    first = choices[0]
    return Completion(
        response.id, response.model, first.text, first.finish_reason, usage_from_pb(response),
        first.logprobs, choices, first.prompt_logprobs,
    )


def completion_chunk_from_pb(response: pb.CompletionResponse) -> CompletionChunk:
    if not response.choices:  # the usage-only last chunk of a stream
        return CompletionChunk(response.id, response.model, "", None, usage_from_pb(response))
    choice = _completion_choice(response.choices[0])
    return CompletionChunk(
        id=response.id,
        model=response.model,
        text=choice.text,
        finish_reason=choice.finish_reason,
        usage=usage_from_pb(response),
        logprobs=choice.logprobs,
        index=choice.index,
        token_ids=choice.token_ids,
        prompt_token_ids=choice.prompt_token_ids,
    )


def _chat_choice(choice: pb.ChatChoice) -> ChatChoice:
    return ChatChoice(
        index=choice.index,
        role=choice.message.role,
        content=choice.message.content,
        finish_reason=_finish_reason(choice),
        logprobs=_chat_logprobs(choice.logprobs),
        tool_calls=[ToolCall(i, c.id, c.function.name, c.function.arguments)
                    for i, c in enumerate(choice.message.tool_calls)],
        reasoning=(choice.message.reasoning if choice.message.HasField("reasoning")
                   else None),
        token_ids=_ids(choice, "token_ids"),
    )


def chat_completion_from_pb(response: pb.ChatCompletionResponse) -> ChatCompletion:
    if not response.choices:
        raise ValueError(f"chat completion {response.id!r} has no choices")
    choices = sorted((_chat_choice(c) for c in response.choices), key=lambda c: c.index)
    first = choices[0]
    return ChatCompletion(
        id=response.id,
        model=response.model,
        role=first.role,
        content=first.content,
        finish_reason=first.finish_reason,
        usage=usage_from_pb(response),
        logprobs=first.logprobs,
        choices=choices,
        tool_calls=first.tool_calls,
        reasoning=first.reasoning,
        prompt_logprobs=_prompt_logprobs(response),
        prompt_token_ids=_ids(response, "prompt_token_ids"),
    )


def chat_chunk_from_pb(chunk: pb.ChatCompletionChunk) -> ChatCompletionChunk:
    if not chunk.choices:
        return ChatCompletionChunk(chunk.id, chunk.model, None, "", None, usage_from_pb(chunk))
    choice = chunk.choices[0]
    delta = choice.delta
    return ChatCompletionChunk(
        id=chunk.id,
        model=chunk.model,
        role=delta.role if delta.HasField("role") else None,
        content=delta.content,
        finish_reason=_finish_reason(choice),
        usage=usage_from_pb(chunk),
        logprobs=_chat_logprobs(choice.logprobs),
        index=choice.index,
        tool_calls=[ToolCall(c.index, c.id, c.function.name, c.function.arguments)
                    for c in delta.tool_calls],
        reasoning=delta.reasoning,
        token_ids=_ids(choice, "token_ids"),
        prompt_token_ids=_ids(chunk, "prompt_token_ids"),
    )


def model_from_pb(model: pb.Model) -> ModelInfo:
    return ModelInfo(
        id=model.id,
        owned_by=model.owned_by,
        created=model.created,
        max_model_len=model.max_model_len,
        parent=model.parent if model.HasField("parent") else None,
    )
