"""The pieces of OpenAI's answers that completions and chat share.

Owns the usage block (each prompt counted once, completion and reasoning tokens summed over
choices), logprobs as JSON can carry them (no -inf), token-id lists, vLLM's
``prompt_logprobs`` list and the chat API's logprobs shape. It does not own the legacy
completions logprobs (``completions.response``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from google.protobuf import struct_pb2

from protos.tandem.v1 import generation_pb2 as pb
from services.frontend.engine_seam import GenerationDelta, PositionLogprobs
from services.frontend.reasoning.plan import ReasoningStream

# JSON has no -inf: a logprob that underflowed is reported as this, as vLLM does.
LOGPROB_FLOOR = -9999.0


def usage_of(lasts: Mapping[int, GenerationDelta], choices_per_prompt: int = 1,
           reasoning_tokens: int | None = None) -> pb.Usage:
    """The request's usage from each choice's last delta: each prompt counted once (with its
    cached tokens as its first choice found them), completion tokens summed over choices;
    ``reasoning_tokens`` (summed too) for a chat whose output may think."""
    firsts: dict[int, GenerationDelta] = {}
    for index in sorted(lasts):
        firsts.setdefault(index // choices_per_prompt, lasts[index])
    prompt_tokens = sum(delta.prompt_tokens for delta in firsts.values())
    completion_tokens = sum(delta.completion_tokens for delta in lasts.values())
    usage = pb.Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=pb.PromptTokensDetails(
            cached_tokens=sum(delta.cached_tokens for delta in firsts.values())),
    )
    if reasoning_tokens is not None:
        usage.completion_tokens_details.reasoning_tokens = reasoning_tokens
    return usage


def reasoning_tokens(streams: Iterable[ReasoningStream | None]) -> int:
    return sum(stream.num_tokens for stream in streams if stream is not None)


def set_token_ids(field: struct_pb2.ListValue, token_ids: Sequence[int]) -> None:
    """Fill a message's token-id list; present (``[]``) even when there are none."""
    field.SetInParent()
    field.extend(token_ids)


def json_logprob(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR



def prompt_logprobs_list(positions: Sequence[PositionLogprobs],
                          num_top: int) -> struct_pb2.ListValue:
    """vLLM's prompt_logprobs: null for the first prompt token, then per position the
    prompt's token and the ``num_top`` most likely, each {"<token id>": {"logprob", "rank",
    "decoded_token"}}."""
    out = struct_pb2.ListValue()
    out.append(None)
    for position in positions:
        entries: dict[str, Any] = {}
        for choice in (position.sampled, *position.top[:num_top]):
            entries.setdefault(str(choice.token_id), {
                "logprob": json_logprob(choice.logprob), "rank": choice.rank,
                "decoded_token": choice.token})
        out.add_struct().update(entries)
    return out



def chat_logprobs(positions: Sequence[PositionLogprobs]) -> pb.ChatLogprobs:
    return pb.ChatLogprobs(content=[
        pb.ChatTokenLogprob(
            token=p.sampled.token,
            logprob=json_logprob(p.sampled.logprob),
            top_logprobs=[pb.ChatTopLogprob(token=c.token, logprob=json_logprob(c.logprob))
                          for c in p.top],
        )
        for p in positions
    ])


