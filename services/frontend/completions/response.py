"""A completion's answer: streamed chunks or one response, folded from its choices' deltas.

Owns OpenAI's legacy completions shape: ``cmpl-`` ids, choices by index, logprobs with text
offsets, an echoed prompt (and its logprobs, its first token unscored), vLLM's
``prompt_logprobs`` and token ids, the usage once for the whole request. It does not own
running the choices (``choices``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import replace

from protos.tandem.v1 import generation_pb2 as pb
from services.frontend.choices import ChoiceDelta, collect_choices
from services.frontend.completions.request import Echo
from services.frontend.engine_seam import GenerationDelta, PositionLogprobs
from services.frontend.output_fields import (
    json_logprob,
    prompt_logprobs_list,
    set_token_ids,
    usage_of,
)


def _add_completion_logprobs(out: pb.CompletionLogprobs, positions: Sequence[PositionLogprobs],
                             text_offset: int, num_top: int | None = None) -> int:
    """Append ``positions`` in OpenAI's legacy shape (with at most ``num_top`` alternatives
    each); ``text_offset`` counts characters of the tokens before. Returns the offset after."""
    for position in positions:
        sampled = position.sampled
        out.tokens.append(sampled.token)
        out.token_logprobs.append(json_logprob(sampled.logprob))
        top = {choice.token: json_logprob(choice.logprob) for choice in position.top[:num_top]}
        top.setdefault(sampled.token, json_logprob(sampled.logprob))
        out.top_logprobs.add_struct().update(top)
        out.text_offset.append(text_offset)
        text_offset += len(sampled.token)
    return text_offset


def _add_echoed_prompt(out: pb.CompletionLogprobs, echo: Echo,
                       positions: Sequence[PositionLogprobs]) -> int:
    """An echoed prompt's logprobs: its first token unscored (nulls, as OpenAI), then the
    positions the engine scored. Returns the text offset after the prompt."""
    out.tokens.append(echo.first_token)
    out.token_logprobs.append(None)
    out.top_logprobs.append(None)
    out.text_offset.append(0)
    return _add_completion_logprobs(out, positions, len(echo.first_token), echo.num_top)



async def _without_output(choices: AsyncIterator[ChoiceDelta]) -> AsyncGenerator[ChoiceDelta, None]:
    """Echo with max_tokens 0: the token the engine had to sample is not part of the answer,
    which ends at the prompt ("length": no token was allowed)."""
    async for choice_delta in choices:
        delta = choice_delta.delta
        yield ChoiceDelta(choice_delta.index, replace(
            delta, text="", token_ids=[], logprobs=[], completion_tokens=0, stop_reason=None,
            finish_reason=None if delta.finish_reason is None else "length"))



async def completion_chunks(
    choices: AsyncIterator[ChoiceDelta], *, response_id: str, model: str, include_usage: bool,
    choices_per_prompt: int = 1, echoes: Sequence[Echo] | None = None,
    prompt_token_ids: Sequence[list[int]] | None = None,
) -> AsyncGenerator[pb.CompletionResponse, None]:
    """CompleteStream's messages: one chunk per delta that carries anything (its one choice
    carries the choice's index), then (with ``include_usage``) a last chunk with no choices
    and the usage, once every choice finished. With ``echoes`` (one per prompt) each
    choice's first chunk starts with its prompt (and its logprobs, if asked for). With
    ``prompt_token_ids`` (one list per prompt: return_token_ids) a choice's first chunk
    carries its prompt's, and every chunk its own tokens' ids."""
    created = int(time.time())
    text_offsets: dict[int, int] = {}
    lasts: dict[int, GenerationDelta] = {}
    if echoes and echoes[0].scores_only:
        choices = _without_output(choices)
    async for choice_delta in choices:
        index, delta = choice_delta.index, choice_delta.delta
        first = index not in lasts
        echoed = echoes[index // choices_per_prompt] if echoes is not None and first else None
        lasts[index] = delta
        if not (delta.text or delta.finish_reason or delta.logprobs or echoed
                or (prompt_token_ids is not None and (first or delta.token_ids))):
            continue  # tokens whose text is held back (a possible stop string)
        choice = pb.CompletionChoice(index=index, text=delta.text)
        if prompt_token_ids is not None:
            set_token_ids(choice.token_ids, delta.token_ids)
            if first:
                set_token_ids(choice.prompt_token_ids, prompt_token_ids[index // choices_per_prompt])
        if echoed is not None:
            choice.text = echoed.text + delta.text
        if delta.finish_reason is not None:
            choice.finish_reason = delta.finish_reason
        scores_prompt = echoed is not None and echoed.num_top is not None
        if delta.logprobs or scores_prompt:
            offset = text_offsets.get(index, 0)
            if echoed is not None and scores_prompt:
                offset = _add_echoed_prompt(choice.logprobs, echoed, delta.prompt_logprobs or [])
            text_offsets[index] = _add_completion_logprobs(choice.logprobs, delta.logprobs, offset)
        yield pb.CompletionResponse(id=response_id, object="text_completion", created=created,
                                    model=model, choices=[choice])
    if include_usage and lasts:
        yield pb.CompletionResponse(id=response_id, object="text_completion", created=created,
                                    model=model, usage=usage_of(lasts, choices_per_prompt))



async def completion_response(choices: AsyncIterator[ChoiceDelta], *, response_id: str,
                              model: str, logprobs: bool, num_choices: int = 1,
                              choices_per_prompt: int = 1, echoes: Sequence[Echo] | None = None,
                              prompt_logprobs: int | None = None,
                              prompt_token_ids: Sequence[list[int]] | None = None,
                              ) -> pb.CompletionResponse:
    """Complete's answer: each choice's stream folded into one choice, ordered by index;
    with ``echoes`` (one per prompt) each choice's text (and logprobs) starts with its
    prompt's, with ``prompt_logprobs`` each choice carries vLLM's list of them, with
    ``prompt_token_ids`` (one list per prompt) its prompt's token ids and its own."""
    if echoes and echoes[0].scores_only:
        choices = _without_output(choices)
    collected = await collect_choices(choices, num_choices)
    response = pb.CompletionResponse(
        id=response_id, object="text_completion", created=int(time.time()), model=model,
        usage=usage_of({index: one.last for index, one in enumerate(collected)},
                     choices_per_prompt))
    for index, one in enumerate(collected):
        echo = None if echoes is None else echoes[index // choices_per_prompt]
        choice = response.choices.add(
            index=index, text=one.text if echo is None else echo.text + one.text)
        if one.last.finish_reason is not None:
            choice.finish_reason = one.last.finish_reason
        if logprobs:
            choice.logprobs.SetInParent()
            offset = 0 if echo is None else _add_echoed_prompt(
                choice.logprobs, echo, one.prompt_logprobs)
            _add_completion_logprobs(choice.logprobs, one.logprobs, offset)
        if prompt_logprobs is not None:
            choice.prompt_logprobs.CopyFrom(
                prompt_logprobs_list(one.prompt_logprobs, prompt_logprobs))
        if prompt_token_ids is not None:
            set_token_ids(choice.prompt_token_ids, prompt_token_ids[index // choices_per_prompt])
            set_token_ids(choice.token_ids, one.token_ids)
    return response


