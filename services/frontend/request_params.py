"""What completions and chat share when a public request is resolved for the engine.

Owns the sampling parameters a request asks for (over the model's sampling defaults), the
default ``max_tokens`` once the prompt's length is known, vLLM's ``truncate_prompt_tokens``,
``prompt_logprobs`` and the reading of optional flags. It does not own the shape checks of
loosely typed fields (``validation``) or the sampling-value ranges (``SamplingParams``).
"""

from __future__ import annotations

from dataclasses import fields, replace

from engine_common.input_processor import InputProcessor
from engine_common.sampling_params import SamplingParams
from protos.tandem.v1 import generation_pb2 as pb
from services.frontend.errors import InvalidArgument
from services.frontend.tools.plan import ToolPlan
from services.frontend.validation import (
    check_constraint_size,
    check_seed_for_choices,
    stop_from_value,
    structured_output_from_request,
)

# SamplingParams fields the caller resolves (OpenAI's defaults, the chat's logprobs flag), not
# copied from the request as they stand.
_RESOLVED_BY_CALLER = frozenset({"max_tokens", "logprobs", "prompt_logprobs"})


def _copied_fields() -> tuple[str, ...]:
    """The SamplingParams fields both public requests carry as an optional scalar of the same
    name: copied as they stand where set. The others (``stop``, ``logit_bias``, token-id lists,
    output constraints) take a conversion below. Read off the messages and the record, so a
    new plain sampling field needs no edit here."""
    requests = (pb.CompletionRequest.DESCRIPTOR, pb.ChatCompletionRequest.DESCRIPTOR)
    return tuple(
        f.name for f in fields(SamplingParams)
        if f.name not in _RESOLVED_BY_CALLER
        and all(f.name in request.fields_by_name
                and request.fields_by_name[f.name].has_presence
                and not request.fields_by_name[f.name].is_repeated
                and request.fields_by_name[f.name].message_type is None
                for request in requests))


SAMPLING_FIELDS = _copied_fields()


def sampling_params_of(request: pb.CompletionRequest | pb.ChatCompletionRequest,
                     inputs: InputProcessor, max_tokens: int | None, logprobs: int | None,
                     tools: ToolPlan | None = None) -> SamplingParams:
    """Unset optional fields take the model's sampling defaults (``inputs``), else
    SamplingParams' (OpenAI's, for these fields). The default max_tokens is not one of them:
    ``_default_max_tokens`` applies it once the prompt's length is known. ``bad_words`` are
    tokenized here, where the tokenizer is; allowed ids are checked against the vocabulary
    here too, so that the gateway refuses them as a replica does."""
    chosen = {**{name: value for name, value in inputs.sampling_defaults.items()
                 if name != "max_tokens"},
              **{name: getattr(request, name) for name in SAMPLING_FIELDS
                 if request.HasField(name)}}
    stop = stop_from_value(request.stop if request.HasField("stop") else None)
    if tools is not None and tools.forced:  # the schema of the call: the tools' parameters
        structured_output = tools.constraint()
        if structured_output is not None:
            check_constraint_size(structured_output.kind, structured_output.value)
    else:
        structured_output = structured_output_from_request(request.response_format,
                                                           request.structured_outputs)
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


def default_max_tokens(params: SamplingParams, inputs: InputProcessor,
                        prompt_length: int) -> SamplingParams:
    """A chat that sets no limit gets the model's max_new_tokens, where its generation
    config has one, cut to the room the context leaves (vLLM's rule); else no limit but the
    context."""
    default = inputs.sampling_defaults.get("max_tokens")
    if default is None:
        return params
    room = inputs.max_model_len - prompt_length
    return replace(params, max_tokens=max(1, params.min_tokens, min(int(default), room)))



def truncated_prompt(prompt_token_ids: list[int],
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


def prompt_logprobs_of(request: pb.CompletionRequest | pb.ChatCompletionRequest) -> int | None:
    """The request's prompt_logprobs (SamplingParams checks the range)."""
    return request.prompt_logprobs if request.HasField("prompt_logprobs") else None



def optional_flag(request: pb.ChatCompletionRequest | pb.TokenizeRequest, name: str,
          default: bool) -> bool:
    """An optional bool field of the request, ``default`` where unset."""
    return bool(getattr(request, name)) if request.HasField(name) else default


