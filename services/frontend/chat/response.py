"""A chat's whole answer: ``ChatComplete``'s response, folded from its choices' deltas.

Owns the message of each choice (reasoning, content, tool calls), finish reasons, logprobs,
vLLM's prompt logprobs and token ids, and the usage. It does not own streaming
(``chat.stream``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from protos.tandem.v1 import generation_pb2 as pb
from services.frontend.choices import ChoiceDelta, collect_choices
from services.frontend.output_fields import (
    chat_logprobs,
    prompt_logprobs_list,
    reasoning_tokens,
    set_token_ids,
    usage_of,
)
from services.frontend.reasoning.plan import ReasoningPlan
from services.frontend.tools.plan import ToolPlan


async def chat_response(choices: AsyncIterator[ChoiceDelta], *, response_id: str,
                        model: str, logprobs: bool, num_choices: int = 1,
                        tools: ToolPlan | None = None,
                        reasoning: ReasoningPlan | None = None,
                        prompt_logprobs: int | None = None,
                        prompt_token_ids: list[int] | None = None) -> pb.ChatCompletionResponse:
    """ChatComplete's answer; with ``prompt_logprobs``, vLLM's list of the rendered prompt's
    logprobs (the prompt is the same for every choice: the first one's); with
    ``prompt_token_ids`` those ids, and each choice its tokens' ids."""
    tools = tools or ToolPlan()
    reasoning = reasoning or ReasoningPlan()
    collected = await collect_choices(choices, num_choices, reasoning)
    response = pb.ChatCompletionResponse(
        id=response_id, object="chat.completion", created=int(time.time()), model=model,
        usage=usage_of({index: one.last for index, one in enumerate(collected)},
                     reasoning_tokens=reasoning_tokens(one.thinking for one in collected)
                     if reasoning.enabled else None))
    for index, one in enumerate(collected):
        thoughts, text = reasoning.split(one.text)
        content, calls = tools.split(text)
        message = pb.ChatResponseMessage(role="assistant", tool_calls=calls)
        if thoughts is not None:
            message.reasoning = thoughts
        if content is not None and (content or thoughts is None):
            message.content = content
        choice = response.choices.add(index=index, message=message)
        if one.last.finish_reason is not None:
            choice.finish_reason = tools.finish_reason(one.last.finish_reason, bool(calls))
        if logprobs:
            choice.logprobs.CopyFrom(chat_logprobs(one.logprobs))
        if prompt_token_ids is not None:
            set_token_ids(choice.token_ids, one.token_ids)
    if prompt_token_ids is not None:
        set_token_ids(response.prompt_token_ids, prompt_token_ids)
    if prompt_logprobs is not None:
        response.prompt_logprobs.CopyFrom(
            prompt_logprobs_list(collected[0].prompt_logprobs, prompt_logprobs))
    return response


