"""A completion request resolved: what the engine runs for each of its prompts.

Owns OpenAI's completions defaults (``max_tokens`` 16), the prompts (a string, token ids, or
a list of either), ``echo`` (the prompt before each choice's text, scored with
``max_tokens`` 0) and vLLM's ``return_token_ids`` / ``prompt_logprobs``. It does not own the
answer's shape (``completions.response``) or running the choices (``choices``).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace

from engine_common.generation_request import GenerationRequest
from engine_common.input_processor import InputProcessor, InvalidRequestError
from engine_common.sampling_params import MAX_CHOICES, SamplingParams
from protos.tandem.v1 import generation_pb2 as pb
from services.frontend.errors import InvalidArgument
from services.frontend.request_params import (
    prompt_logprobs_of,
    sampling_params_of,
    truncated_prompt,
)
from services.frontend.validation import check_text_length, prompts_from_value

# OpenAI's default for the completions API (the chat API's is "up to the context").
COMPLETION_DEFAULT_MAX_TOKENS = 16


def new_completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


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

    requests: list[GenerationRequest]
    echoes: list[Echo] | None = None  # one per prompt, with echo
    # vLLM's prompt_logprobs field: each choice's prompt_logprobs, with this many top entries.
    prompt_logprobs: int | None = None
    return_token_ids: bool = False  # vLLM's: token ids in the answer

    @property
    def prompt_token_ids(self) -> list[list[int]] | None:
        """Each prompt's token ids, where the answer carries them."""
        return [e.prompt_token_ids for e in self.requests] if self.return_token_ids else None

    @property
    def params(self) -> SamplingParams:
        """The sampling parameters, the same for every prompt."""
        return self.requests[0].params

    @property
    def lora_name(self) -> str | None:
        """The LoRA adapter, the same for every prompt."""
        return self.requests[0].lora_name

    @property
    def num_choices(self) -> int:
        return len(self.requests) * self.params.n


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
    prompt_logprobs = prompt_logprobs_of(request)
    engine_prompt_logprobs = prompt_logprobs
    if echo and logprobs is not None:
        engine_prompt_logprobs = max(prompt_logprobs or 0, logprobs)
    params = replace(sampling_params_of(request, inputs, 1 if scores_only else max_tokens, logprobs),
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
        prompt_token_ids = truncated_prompt(prompt_token_ids, request, params, inputs)
        try:
            inputs.validate_prompt(prompt_token_ids, params.max_tokens)
        except InvalidRequestError as error:
            if len(prompts) == 1:
                raise
            raise InvalidRequestError(f"{field_name}: {error}") from error
        engines.append(GenerationRequest(prompt_token_ids, params, request.priority,
                                     request.cache_salt or None, lora_name=lora_name))
        if echo:
            text = (prompt if isinstance(prompt, str) and len(prompt_token_ids) == whole
                    else inputs.detokenize(prompt_token_ids))
            echoes.append(Echo(text, inputs.detokenize(prompt_token_ids[:1]), logprobs,
                               scores_only))
    return CompletionPlan(engines, echoes if echo else None, prompt_logprobs,
                          request.return_token_ids)


