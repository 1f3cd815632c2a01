"""A request's ``n`` choices (of each of its prompts) as one stream of tagged deltas.

Owns vLLM's parallel sampling: each choice is an engine request of one sequence (choice i
samples with ``seed + i``), run through the ``GenerateFn`` side by side, their deltas merged as
they come, each tagged with its choice's index (choice j of prompt i is i * n + j); one
failing, or the caller leaving, aborts them all. Also folds a finished stream per choice
(``collect_choices``) for the non-streaming answers. It does not own the answers' shapes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace

from engine_common.generation_request import GenerationRequest
from services.frontend.engine_seam import (
    CallContext,
    GenerateFn,
    GenerationDelta,
    PositionLogprobs,
)
from services.frontend.reasoning.plan import ReasoningPlan, ReasoningStream


@dataclass(frozen=True)
class ChoiceDelta:
    """A delta of one of a request's choices."""

    index: int
    delta: GenerationDelta


def choice_requests(requests: Sequence[GenerationRequest]) -> list[GenerationRequest]:
    """The engine requests behind the ``n`` choices of each prompt of a request, one choice
    each, prompt by prompt. With a seed, choice i of a prompt samples with ``seed + i``
    (vLLM's rule): reproducible, and the choices differ."""
    children = []
    for request in requests:
        params = request.params
        if params.n == 1:
            children.append(request)
            continue
        children.extend(
            replace(request, params=replace(
                params, n=1, seed=None if params.seed is None else params.seed + index))
            for index in range(params.n))
    return children


def choice_request_id(request_id: str, index: int, num_choices: int) -> str:
    """A lone choice keeps the request's id; the ``n`` children of a request are told apart
    (in the engine, its logs and metrics) by their index."""
    return request_id if num_choices == 1 else f"{request_id}-{index}"


async def generate_choices(generate: GenerateFn, request_id: str,
                           requests: Sequence[GenerationRequest],
                           call: CallContext) -> AsyncGenerator[ChoiceDelta, None]:
    """Every choice's deltas, of every prompt's request in ``requests``, interleaved as the
    engine produces them, each run within the public ``call``. A choice that fails fails
    the whole request (its error is raised here) and closing this iterator early (the client
    cancelled) closes every choice's stream, which aborts it in the engine."""
    children = choice_requests(requests)
    if len(children) == 1:  # no tasks, no queue: the stream is pulled as the client reads
        async with aclosing(generate(request_id, children[0], call)) as deltas:
            async for delta in deltas:
                yield ChoiceDelta(0, delta)
        return
    # The engine already buffers each request's outputs without bound, so an unbounded
    # queue here holds no more than it would; None marks a choice that finished.
    merged: asyncio.Queue[tuple[int, GenerationDelta | Exception | None]] = asyncio.Queue()

    async def pump(index: int, child: GenerationRequest) -> None:
        request_id_of_child = choice_request_id(request_id, index, len(children))
        try:
            async with aclosing(generate(request_id_of_child, child, call)) as deltas:
                async for delta in deltas:
                    merged.put_nowait((index, delta))
        except Exception as error:  # noqa: BLE001 - handed to the request, which fails with it
            merged.put_nowait((index, error))
        else:
            merged.put_nowait((index, None))

    # Started in index order: the first child is routed (or admitted) first.
    tasks = [asyncio.create_task(pump(index, child), name=f"{request_id}-choice-{index}")
             for index, child in enumerate(children)]
    try:
        unfinished = len(tasks)
        while unfinished:
            index, item = await merged.get()
            if item is None:
                unfinished -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield ChoiceDelta(index, item)
    finally:
        # Cancelling a child closes its stream inside the engine's GenerateFn: aborted there.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class CollectedChoice:
    text: str = ""
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    last: GenerationDelta = field(default_factory=lambda: GenerationDelta("", []))
    # Its output's reasoning, counting the tokens only (the text is split whole).
    thinking: ReasoningStream | None = None


async def collect_choices(choices: AsyncIterator[ChoiceDelta], num_choices: int,
                   reasoning: ReasoningPlan | None = None) -> list[CollectedChoice]:
    """Each choice's stream folded, by index (with ``reasoning``, its thinking tokens
    counted as a stream counts them)."""
    collected = [CollectedChoice(thinking=reasoning.stream() if reasoning else None)
                 for _ in range(num_choices)]
    parts: list[list[str]] = [[] for _ in range(num_choices)]
    async for choice_delta in choices:
        index, delta = choice_delta.index, choice_delta.delta
        one = collected[index]
        if one.thinking is not None:
            one.thinking.feed(delta.text, delta.completion_tokens - one.last.completion_tokens)
        parts[index].append(delta.text)
        one.logprobs.extend(delta.logprobs)
        one.prompt_logprobs.extend(delta.prompt_logprobs or ())
        one.token_ids.extend(delta.token_ids)
        one.last = delta
    for one, texts in zip(collected, parts, strict=True):
        one.text = "".join(texts)
    return collected


