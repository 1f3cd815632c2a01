"""The mapping between the public, OpenAI-shaped ``tandem.v1.Generation`` messages and an
engine, independent of where the engine runs.

Owns four things, so that the replica and the gateway serve the public API identically:

- requests in: ``completion_to_engine_request`` / ``chat_to_engine_request`` turn a public
  request into ``EngineRequest``s (prompt token ids, ``SamplingParams``, priority, cache
  salt): a completion's ``CompletionPlan`` has one per prompt and what ``echo`` adds, a
  chat's ``ChatRequest`` its ``ToolPlan`` and ``ReasoningPlan``; they apply OpenAI's
  defaults (completions: ``max_tokens`` 16; chat: unbounded, that is up to the context) and
  reject what cannot be served with an actionable message;
- the engine, behind ``GenerateFn``: any async callable that streams ``GenerationDelta``s
  for an ``EngineRequest`` and aborts the request when its iterator is closed early. The
  replica plugs in its local engine (``local_engine``), the gateway a remote replica's
  ``Engine.Generate``;
- choices: ``generate_choices`` runs the ``n`` choices of each prompt as ``n`` engine
  requests of one choice each (vLLM's parallel sampling: choice i samples with ``seed + i``)
  and merges their streams as they come, each delta tagged with its choice's index (choice
  j of prompt i is i * n + j); one failing or the caller leaving aborts them all;
- responses out: ``completion_chunks`` / ``completion_response`` / ``chat_chunks`` /
  ``chat_response`` fold a stream of deltas into OpenAI's chunk and response shapes
  (ids ``cmpl-<uuid>`` / ``chatcmpl-<uuid>``, usage with cached tokens, logprobs, an echoed
  prompt, prompt logprobs, a forced call's text as ``tool_calls``), one choice per index,
  the usage once for the whole request.

It does not own transport, status codes (``errors``) or admission (``admission``).
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from google.protobuf import struct_pb2

from engine_common.input_processor import InputProcessor, InvalidRequestError
from engine_common.outputs import KvTransferReport
from engine_common.sampling_params import MAX_CHOICES, SamplingParams
from protos.tandem.v1 import generation_pb2 as pb
from services.replica.errors import InvalidArgument, NotFound
from services.replica.reasoning import (
    THINK_CLOSE,
    THINK_OPEN,
    ReasoningPlan,
    ReasoningStream,
    reasoning_plan,
)
from services.replica.served_model import ServedModel
from services.replica.tool_call_parsers import (
    MISTRAL_FORMAT,
    CallStream,
    chat_template_call_format,
    mistral_call_id,
    new_tool_call_id,
)
from services.replica.tool_calls import ToolPlan, template_tool_calls, tool_plan
from services.replica.validation import (
    chat_template_kwargs,
    check_seed_for_choices,
    check_text_length,
    content_from_value,
    prompts_from_value,
    stop_from_value,
    structured_output_from_request,
)

# OpenAI's default for the completions API (the chat API's is "up to the context").
COMPLETION_DEFAULT_MAX_TOKENS = 16
# JSON has no -inf: a logprob that underflowed is reported as this, as vLLM does.
_LOGPROB_FLOOR = -9999.0

# --------------------------------------------------------------------------- records


@dataclass
class EngineRequest:
    """A public request resolved into what an engine runs."""

    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    # P/D: the prefill replica (host:port) a decode replica asks for the prompt's KV.
    prefill_peer: str | None = None
    # A resumed stream: the prompt ends with this many output tokens already streamed.
    num_resumed_tokens: int = 0
    # The LoRA adapter the request's model names; None: the base model.
    lora_name: str | None = None


@dataclass(frozen=True)
class TokenChoice:
    """One candidate token at an output position."""

    token_id: int
    token: str  # the token decoded on its own
    logprob: float
    rank: int  # 1 = most likely


@dataclass(frozen=True)
class PositionLogprobs:
    sampled: TokenChoice
    top: list[TokenChoice]  # best first


@dataclass
class GenerationDelta:
    """What one engine step added to a request, plus its running token counts."""

    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length" or "abort" on the last delta
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    kv_transfer: KvTransferReport | None = None  # P/D: how the prompt's KV got here
    # With the first token, when asked for: prompt positions 1 on ("sampled" is the prompt's
    # own token there).
    prompt_logprobs: list[PositionLogprobs] | None = None


class GenerateFn(Protocol):
    """Streams a request's deltas; closing the iterator early must abort the request."""

    def __call__(self, request_id: str,
                 request: EngineRequest) -> AsyncGenerator[GenerationDelta, None]:
        ...


def new_completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def new_chat_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


# --------------------------------------------------------------------------- requests in

_SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "min_tokens", "ignore_eos", "skip_special_tokens",
    "include_stop_str_in_output", "n",
)


def _sampling_params(request: pb.CompletionRequest | pb.ChatCompletionRequest,
                     inputs: InputProcessor, max_tokens: int | None, logprobs: int | None,
                     tools: ToolPlan | None = None) -> SamplingParams:
    """Unset optional fields take the model's sampling defaults (``inputs``), else
    SamplingParams' (OpenAI's, for these fields). The default max_tokens is not one of them:
    ``_default_max_tokens`` applies it once the prompt's length is known. ``bad_words`` are
    tokenized here, where the tokenizer is; allowed ids are checked against the vocabulary
    here too, so that the gateway refuses them as a replica does."""
    chosen = {**{name: value for name, value in inputs.sampling_defaults.items()
                 if name != "max_tokens"},
              **{name: getattr(request, name) for name in _SAMPLING_FIELDS
                 if request.HasField(name)}}
    stop = stop_from_value(request.stop if request.HasField("stop") else None)
    structured_output = (tools.constraint() if tools is not None and tools.forced else
                         structured_output_from_request(request.response_format,
                                                        request.structured_outputs))
    params = SamplingParams(
        max_tokens=max_tokens, logprobs=logprobs, stop=stop,
        stop_token_ids=list(request.stop_token_ids),
        logit_bias=dict(request.logit_bias),
        # An empty repeated field is an unset one: no restriction.
        allowed_token_ids=list(request.allowed_token_ids) or None,
        bad_words_token_ids=inputs.bad_words_token_ids(request.bad_words),
        structured_output=structured_output,
        **chosen)
    inputs.check_allowed_token_ids(params.allowed_token_ids)
    check_seed_for_choices(params.seed, params.n)
    return params


def _default_max_tokens(params: SamplingParams, inputs: InputProcessor,
                        prompt_length: int) -> SamplingParams:
    """A chat that sets no limit gets the model's max_new_tokens, where its generation
    config has one, cut to the room the context leaves (vLLM's rule); else no limit but the
    context."""
    default = inputs.sampling_defaults.get("max_tokens")
    if default is None:
        return params
    room = inputs.max_model_len - prompt_length
    return replace(params, max_tokens=max(1, params.min_tokens, min(int(default), room)))


@dataclass(frozen=True)
class Echo:
    """What an echoing completion puts before each choice's own text and logprobs."""

    text: str  # the prompt as given (decoded, when it came as token ids)
    first_token: str  # the prompt's first token on its own: nothing precedes it to score it
    num_top: int | None  # the request's logprobs: the prompt's positions get as many
    scores_only: bool  # max_tokens 0: the engine samples one token, which is dropped


@dataclass(frozen=True)
class CompletionPlan:
    """A completion request resolved: what the engine runs for each of its prompts (whose
    choices are numbered prompt by prompt: choice j of prompt i is i * n + j) and what the
    answer adds."""

    engines: list[EngineRequest]
    echoes: list[Echo] | None = None  # one per prompt, with echo
    # vLLM's prompt_logprobs field: each choice's prompt_logprobs, with this many top entries.
    prompt_logprobs: int | None = None
    return_token_ids: bool = False  # vLLM's: token ids in the answer

    @property
    def prompt_token_ids(self) -> list[list[int]] | None:
        """Each prompt's token ids, where the answer carries them."""
        return [e.prompt_token_ids for e in self.engines] if self.return_token_ids else None

    @property
    def params(self) -> SamplingParams:
        """The sampling parameters, the same for every prompt."""
        return self.engines[0].params

    @property
    def lora_name(self) -> str | None:
        """The LoRA adapter, the same for every prompt."""
        return self.engines[0].lora_name

    @property
    def num_choices(self) -> int:
        return len(self.engines) * self.params.n


def completion_to_engine_request(request: pb.CompletionRequest, inputs: InputProcessor,
                                 lora_name: str | None = None) -> CompletionPlan:
    echo = request.echo
    max_tokens = (request.max_tokens if request.HasField("max_tokens")
                  else COMPLETION_DEFAULT_MAX_TOKENS)
    scores_only = echo and max_tokens == 0
    if max_tokens == 0 and not echo:
        raise InvalidArgument("max_tokens must be at least 1; 0 is allowed only with "
                              "echo=true, which scores the prompt without generating")
    logprobs = request.logprobs if request.HasField("logprobs") else None
    prompt_logprobs = _prompt_logprobs(request)
    engine_prompt_logprobs = prompt_logprobs
    if echo and logprobs is not None:
        engine_prompt_logprobs = max(prompt_logprobs or 0, logprobs)
    params = replace(_sampling_params(request, inputs, 1 if scores_only else max_tokens, logprobs),
                     prompt_logprobs=engine_prompt_logprobs)
    prompts = prompts_from_value(request.prompt if request.HasField("prompt") else None)
    if len(prompts) * params.n > MAX_CHOICES:
        raise InvalidArgument(
            f"{len(prompts)} prompts x n={params.n} is {len(prompts) * params.n} sequences; a "
            f"request runs at most {MAX_CHOICES}: send fewer prompts per request")
    engines, echoes = [], []
    for i, prompt in enumerate(prompts):
        field_name = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if isinstance(prompt, str):
            check_text_length(len(prompt), inputs.max_model_len, field_name)
            prompt_token_ids = inputs.tokenize(prompt)
        else:
            prompt_token_ids = prompt
        whole = len(prompt_token_ids)
        prompt_token_ids = _truncated(prompt_token_ids, request, params, inputs)
        try:
            inputs.validate_prompt(prompt_token_ids, params.max_tokens)
        except InvalidRequestError as error:
            if len(prompts) == 1:
                raise
            raise InvalidRequestError(f"{field_name}: {error}") from error
        engines.append(EngineRequest(prompt_token_ids, params, request.priority,
                                     request.cache_salt or None, lora_name=lora_name))
        if echo:
            text = (prompt if isinstance(prompt, str) and len(prompt_token_ids) == whole
                    else inputs.detokenize(prompt_token_ids))
            echoes.append(Echo(text, inputs.detokenize(prompt_token_ids[:1]), logprobs,
                               scores_only))
    return CompletionPlan(engines, echoes if echo else None, prompt_logprobs,
                          request.return_token_ids)


def _truncated(prompt_token_ids: list[int],
               request: pb.CompletionRequest | pb.ChatCompletionRequest,
               params: SamplingParams, inputs: InputProcessor) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last ``k`` tokens; -1 keeps as many as
    leave room for max_tokens (at least one output token)."""
    if not request.HasField("truncate_prompt_tokens"):
        return prompt_token_ids
    keep = request.truncate_prompt_tokens
    if keep == -1:
        keep = max(1, inputs.max_model_len - (params.max_tokens or 1))
    elif not 1 <= keep < inputs.max_model_len:
        raise InvalidArgument(
            f"truncate_prompt_tokens must be -1 or between 1 and {inputs.max_model_len - 1} "
            f"(the context length less one output token), got {keep}")
    return prompt_token_ids[-keep:]


def _prompt_logprobs(request: pb.CompletionRequest | pb.ChatCompletionRequest) -> int | None:
    """The request's prompt_logprobs (SamplingParams checks the range)."""
    return request.prompt_logprobs if request.HasField("prompt_logprobs") else None


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

    engine: EngineRequest
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
    call_format = _call_format(inputs)
    tools = tool_plan(request, call_format)
    params = replace(_sampling_params(request, inputs, max_tokens, logprobs, tools),
                     prompt_logprobs=_prompt_logprobs(request))
    if (call_format == MISTRAL_FORMAT and tools.mode == "auto"
            and not request.HasField("skip_special_tokens")):
        # Mistral's call tags are special tokens: the parser must see them.
        params = replace(params, skip_special_tokens=False)
    prompt = inputs.render_chat(
        chat_messages(request.messages, inputs.max_model_len, call_format), tools.tools,
        chat_template_kwargs(request),
        add_generation_prompt=_flag(request, "add_generation_prompt", True),
        continue_final_message=_flag(request, "continue_final_message", False))
    prompt_token_ids = _truncated(inputs.tokenize_rendered(prompt), request, params, inputs)
    inputs.validate_prompt(prompt_token_ids, params.max_tokens)
    if max_tokens is None:
        params = _default_max_tokens(params, inputs, len(prompt_token_ids))
    reasoning = reasoning_plan(
        getattr(inputs.tokenizer, "chat_template", None), prompt,
        constrained=params.structured_output is not None,
        include=_flag(request, "include_reasoning", True),
        think_tokens=_think_tokens(inputs) if params.structured_output is not None else None)
    if params.structured_output is not None and reasoning.think_tokens is not None:
        opener, closer = reasoning.think_tokens
        params = replace(params, structured_output=replace(
            params.structured_output, starts_after=(closer,),
            waits_if_first=None if reasoning.opened else opener))
    return ChatRequest(
        EngineRequest(prompt_token_ids, params, request.priority, request.cache_salt or None,
                      lora_name=lora_name),
        tools, reasoning, request.return_token_ids)


def _call_format(inputs: InputProcessor) -> str | None:
    """The tool-call syntax the server was told of, else the one the template teaches."""
    return inputs.tool_call_parser or chat_template_call_format(
        getattr(inputs.tokenizer, "chat_template", None))


def _flag(request: pb.ChatCompletionRequest | pb.TokenizeRequest, name: str,
          default: bool) -> bool:
    """An optional bool field of the request, ``default`` where unset."""
    return bool(getattr(request, name)) if request.HasField(name) else default


def _think_tokens(inputs: InputProcessor) -> tuple[int, int] | None:
    """The ids of ``<think>`` and ``</think>`` where each is one token, else None."""
    opener, closer = inputs.single_token(THINK_OPEN), inputs.single_token(THINK_CLOSE)
    return None if opener is None or closer is None else (opener, closer)


# --------------------------------------------------------------------------- choices (n)


@dataclass(frozen=True)
class ChoiceDelta:
    """A delta of one of a request's choices."""

    index: int
    delta: GenerationDelta


def choice_requests(requests: Sequence[EngineRequest]) -> list[EngineRequest]:
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
                           requests: Sequence[EngineRequest]) -> AsyncGenerator[ChoiceDelta, None]:
    """Every choice's deltas, of every prompt's request in ``requests``, interleaved as the
    engine produces them. A choice that fails fails the whole request (its error is raised
    here) and closing this iterator early (the client cancelled) closes every choice's
    stream, which aborts it in the engine."""
    children = choice_requests(requests)
    if len(children) == 1:  # no tasks, no queue: the stream is pulled as the client reads
        async with aclosing(generate(request_id, children[0])) as deltas:
            async for delta in deltas:
                yield ChoiceDelta(0, delta)
        return
    # The engine already buffers each request's outputs without bound, so an unbounded
    # queue here holds no more than it would; None marks a choice that finished.
    merged: asyncio.Queue[tuple[int, GenerationDelta | Exception | None]] = asyncio.Queue()

    async def pump(index: int, child: EngineRequest) -> None:
        request_id_of_child = choice_request_id(request_id, index, len(children))
        try:
            async with aclosing(generate(request_id_of_child, child)) as deltas:
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


# --------------------------------------------------------------------------- responses out


def _usage(lasts: Mapping[int, GenerationDelta], choices_per_prompt: int = 1,
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


def _reasoning_tokens(streams: Iterable[ReasoningStream | None]) -> int:
    return sum(stream.num_tokens for stream in streams if stream is not None)


def _set_ids(field: struct_pb2.ListValue, token_ids: Sequence[int]) -> None:
    """Fill a message's token-id list; present (``[]``) even when there are none."""
    field.SetInParent()
    field.extend(token_ids)


def _json_logprob(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _LOGPROB_FLOOR


def _add_completion_logprobs(out: pb.CompletionLogprobs, positions: Sequence[PositionLogprobs],
                             text_offset: int, num_top: int | None = None) -> int:
    """Append ``positions`` in OpenAI's legacy shape (with at most ``num_top`` alternatives
    each); ``text_offset`` counts characters of the tokens before. Returns the offset after."""
    for position in positions:
        sampled = position.sampled
        out.tokens.append(sampled.token)
        out.token_logprobs.append(_json_logprob(sampled.logprob))
        top = {choice.token: _json_logprob(choice.logprob) for choice in position.top[:num_top]}
        top.setdefault(sampled.token, _json_logprob(sampled.logprob))
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


def _prompt_logprobs_list(positions: Sequence[PositionLogprobs],
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
                "logprob": _json_logprob(choice.logprob), "rank": choice.rank,
                "decoded_token": choice.token})
        out.add_struct().update(entries)
    return out


async def _without_output(choices: AsyncIterator[ChoiceDelta]) -> AsyncGenerator[ChoiceDelta, None]:
    """Echo with max_tokens 0: the token the engine had to sample is not part of the answer,
    which ends at the prompt ("length": no token was allowed)."""
    async for choice_delta in choices:
        delta = choice_delta.delta
        yield ChoiceDelta(choice_delta.index, replace(
            delta, text="", token_ids=[], logprobs=[], completion_tokens=0, stop_reason=None,
            finish_reason=None if delta.finish_reason is None else "length"))


def _chat_logprobs(positions: Sequence[PositionLogprobs]) -> pb.ChatLogprobs:
    return pb.ChatLogprobs(content=[
        pb.ChatTokenLogprob(
            token=p.sampled.token,
            logprob=_json_logprob(p.sampled.logprob),
            top_logprobs=[pb.ChatTopLogprob(token=c.token, logprob=_json_logprob(c.logprob))
                          for c in p.top],
        )
        for p in positions
    ])


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
            _set_ids(choice.token_ids, delta.token_ids)
            if first:
                _set_ids(choice.prompt_token_ids, prompt_token_ids[index // choices_per_prompt])
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
                                    model=model, usage=_usage(lasts, choices_per_prompt))


@dataclass
class _Collected:
    text: str = ""
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    last: GenerationDelta = field(default_factory=lambda: GenerationDelta("", []))
    # Its output's reasoning, counting the tokens only (the text is split whole).
    thinking: ReasoningStream | None = None


async def _collect(choices: AsyncIterator[ChoiceDelta], num_choices: int,
                   reasoning: ReasoningPlan | None = None) -> list[_Collected]:
    """Each choice's stream folded, by index (with ``reasoning``, its thinking tokens
    counted as a stream counts them)."""
    collected = [_Collected(thinking=reasoning.stream() if reasoning else None)
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
    collected = await _collect(choices, num_choices)
    response = pb.CompletionResponse(
        id=response_id, object="text_completion", created=int(time.time()), model=model,
        usage=_usage({index: one.last for index, one in enumerate(collected)},
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
                _prompt_logprobs_list(one.prompt_logprobs, prompt_logprobs))
        if prompt_token_ids is not None:
            _set_ids(choice.prompt_token_ids, prompt_token_ids[index // choices_per_prompt])
            _set_ids(choice.token_ids, one.token_ids)
    return response


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
            choice.logprobs.CopyFrom(_chat_logprobs(delta.logprobs))
        if prompt_token_ids is not None:
            _set_ids(choice.token_ids, delta.token_ids)
        # The chunk holds a copy of the choice: the choice is complete by now.
        chunk = pb.ChatCompletionChunk(id=response_id, object="chat.completion.chunk",
                                       created=created, model=model, choices=[choice])
        if prompt_token_ids is not None and not prompt_ids_sent:
            _set_ids(chunk.prompt_token_ids, prompt_token_ids)
            prompt_ids_sent = True
        yield chunk
    if include_usage and lasts:
        yield pb.ChatCompletionChunk(
            id=response_id, object="chat.completion.chunk", created=created, model=model,
            usage=_usage(lasts, reasoning_tokens=_reasoning_tokens(thinking.values())
                         if reasoning.enabled else None))


def _add_call_deltas(delta: pb.ChatDelta, calls: list[pb.ToolCall]) -> None:
    for i, call in enumerate(calls):
        delta.tool_calls.add(index=i, id=call.id, type=call.type).function.CopyFrom(
            pb.FunctionCallDelta(name=call.function.name, arguments=call.function.arguments))


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
    collected = await _collect(choices, num_choices, reasoning)
    response = pb.ChatCompletionResponse(
        id=response_id, object="chat.completion", created=int(time.time()), model=model,
        usage=_usage({index: one.last for index, one in enumerate(collected)},
                     reasoning_tokens=_reasoning_tokens(one.thinking for one in collected)
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
            choice.logprobs.CopyFrom(_chat_logprobs(one.logprobs))
        if prompt_token_ids is not None:
            _set_ids(choice.token_ids, one.token_ids)
    if prompt_token_ids is not None:
        _set_ids(response.prompt_token_ids, prompt_token_ids)
    if prompt_logprobs is not None:
        response.prompt_logprobs.CopyFrom(
            _prompt_logprobs_list(collected[0].prompt_logprobs, prompt_logprobs))
    return response


# --------------------------------------------------------------------------- models, tokens


def models_response(model: ServedModel) -> pb.ListModelsResponse:
    """The base model, then its LoRA adapters with it as their parent (as vLLM lists them)."""
    base = pb.Model(id=model.name, object="model", created=model.created,
                    owned_by=model.owned_by, max_model_len=model.max_model_len)
    adapters = [pb.Model(id=name, object="model", created=model.created,
                         owned_by=model.owned_by, max_model_len=model.max_model_len,
                         parent=model.name) for name in sorted(model.lora_names)]
    return pb.ListModelsResponse(object="list", data=[base, *adapters])


def model_card(model: ServedModel, requested: str) -> pb.Model:
    """The card ``models_response`` lists for ``requested`` (an alias names the base
    model's); NotFound, in OpenAI's words, for a model not served here."""
    base = model.name if requested in model.aliases else requested
    for card in models_response(model).data:
        if card.id == base:
            return card
    raise NotFound(f"The model {requested!r} does not exist")


def tokenize_response(request: pb.TokenizeRequest, inputs: InputProcessor) -> pb.TokenizeResponse:
    if request.prompt and request.messages:
        raise InvalidArgument("give either prompt or messages, not both")
    if request.messages:
        messages = chat_messages(request.messages, inputs.max_model_len, _call_format(inputs))
        # Counting a conversation as it stands needs the template without the assistant's
        # turn header that generation appends.
        tokens = inputs.tokenize_rendered(inputs.render_chat(
            messages, template_kwargs=chat_template_kwargs(request),
            add_generation_prompt=_flag(request, "add_generation_prompt", True),
            continue_final_message=_flag(request, "continue_final_message", False)))
    elif request.prompt:
        check_text_length(len(request.prompt), inputs.max_model_len, "prompt")
        add_special_tokens = (request.add_special_tokens
                              if request.HasField("add_special_tokens") else True)
        tokens = inputs.tokenize(request.prompt, add_special_tokens=add_special_tokens)
    else:
        raise InvalidArgument("give a prompt or messages to tokenize")
    return pb.TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=inputs.max_model_len)


def detokenize_response(request: pb.DetokenizeRequest,
                        inputs: InputProcessor) -> pb.DetokenizeResponse:
    try:
        return pb.DetokenizeResponse(prompt=inputs.detokenize(list(request.tokens)))
    except InvalidRequestError as error:
        raise InvalidArgument(f"tokens: {error}") from error
