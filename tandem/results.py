"""The plain records the Tandem SDK returns, and their conversion from the wire messages.

Owns ``Completion``, ``CompletionChunk``, ``ChatCompletion``, ``ChatCompletionChunk``,
``Usage``, ``TokenLogprob`` and ``ModelInfo``. A request asks for one completion, so each
record holds the first choice of its response. It does not own the requests (``request_builders``)
nor the transport (``client``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protos.tandem.v1 import generation_pb2 as pb


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token, its logprob and the best alternatives at its position."""

    token: str
    logprob: float
    top_logprobs: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Completion:
    id: str
    model: str
    text: str
    finish_reason: str | None
    usage: Usage | None
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class CompletionChunk:
    """A piece of a streamed completion; the last one may carry only ``usage``."""

    id: str
    model: str
    text: str
    finish_reason: str | None
    usage: Usage | None
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class ChatCompletion:
    id: str
    model: str
    role: str
    content: str
    finish_reason: str | None
    usage: Usage | None
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class ChatCompletionChunk:
    """A piece of a streamed chat completion; ``role`` is set on the first one only."""

    id: str
    model: str
    role: str | None
    content: str
    finish_reason: str | None
    usage: Usage | None
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class ModelInfo:
    id: str
    owned_by: str
    created: int
    max_model_len: int


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
    )


def _completion_logprobs(logprobs: pb.CompletionLogprobs) -> list[TokenLogprob]:
    tops = [{k: v.number_value for k, v in top.fields.items()} for top in logprobs.top_logprobs]
    tops += [{}] * (len(logprobs.tokens) - len(tops))
    return [
        TokenLogprob(token=token, logprob=logprob, top_logprobs=top)
        for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, tops, strict=False)
    ]


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


def completion_from_pb(response: pb.CompletionResponse) -> Completion:
    if not response.choices:
        raise ValueError(f"completion {response.id!r} has no choices")
    chunk = completion_chunk_from_pb(response)
    return Completion(
        chunk.id, chunk.model, chunk.text, chunk.finish_reason, chunk.usage, chunk.logprobs
    )


def completion_chunk_from_pb(response: pb.CompletionResponse) -> CompletionChunk:
    if not response.choices:  # the usage-only last chunk of a stream
        return CompletionChunk(response.id, response.model, "", None, usage_from_pb(response))
    choice = response.choices[0]
    return CompletionChunk(
        id=response.id,
        model=response.model,
        text=choice.text,
        finish_reason=_finish_reason(choice),
        usage=usage_from_pb(response),
        logprobs=_completion_logprobs(choice.logprobs),
    )


def chat_completion_from_pb(response: pb.ChatCompletionResponse) -> ChatCompletion:
    if not response.choices:
        raise ValueError(f"chat completion {response.id!r} has no choices")
    choice = response.choices[0]
    return ChatCompletion(
        id=response.id,
        model=response.model,
        role=choice.message.role,
        content=choice.message.content,
        finish_reason=_finish_reason(choice),
        usage=usage_from_pb(response),
        logprobs=_chat_logprobs(choice.logprobs),
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
    )


def model_from_pb(model: pb.Model) -> ModelInfo:
    return ModelInfo(
        id=model.id,
        owned_by=model.owned_by,
        created=model.created,
        max_model_len=model.max_model_len,
    )
