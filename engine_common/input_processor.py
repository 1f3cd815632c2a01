"""Prompts in, validated token ids out: tokenization, chat templates and request checks.

Owns the rules a request must pass before it reaches an engine (non-empty prompt, fits the
context, token ids in the vocabulary) and the one way prompts and chat messages become token
ids, so that the gateway (which hashes prompts to route them) and the replicas tokenize
identically (vLLM's ``bad_words`` too, which the engine bans as token ids); it carries the
serving choices that shape requests the same way in both (sampling defaults, the tool-call
syntax). It does not own sampling-parameter ranges (``SamplingParams.validate``).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from jinja2 import TemplateError

from engine_common.sampling_params import SamplingParams


class InvalidRequestError(ValueError):
    """The request cannot be served as given; the message tells the caller what to change."""


class InputProcessor:
    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int,
                 sampling_defaults: Mapping[str, float | int] | None = None,
                 tool_call_parser: str | None = None):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        # The model's recommended sampling settings (``sampling_defaults``), for requests
        # that leave them unset.
        self.sampling_defaults = dict(sampling_defaults or {})
        # The tool-call syntax the server was told the model writes (None: read it off the
        # chat template).
        self.tool_call_parser = tool_call_parser

    def tokenize(self, prompt: str | Sequence[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty")
            return list(self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids)
        return list(prompt)

    def tokenize_chat(self, messages: Sequence[Mapping[str, Any]],
                      tools: list[dict[str, Any]] | None = None,
                      template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """The prompt of a chat: the model's template over ``messages`` (OpenAI's dicts) and,
        where the template renders them, ``tools``, with the assistant's turn opened."""
        return self.tokenize_rendered(self.render_chat(messages, tools, template_kwargs))

    def tokenize_rendered(self, text: str) -> list[int]:
        """A rendered chat's token ids (the template wrote its special tokens itself)."""
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def render_chat(self, messages: Sequence[Mapping[str, Any]],
                    tools: list[dict[str, Any]] | None = None,
                    template_kwargs: Mapping[str, Any] | None = None,
                    add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> str:
        """The chat template's text over ``messages``; ``template_kwargs`` are extra template
        variables (``enable_thinking``, ...), never the ones this call sets itself.
        ``continue_final_message`` leaves the last message open for the model to continue
        (no end-of-turn after it)."""
        if not messages:
            raise InvalidRequestError("messages must contain at least one message")
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError(
                "continue_final_message continues the last message, add_generation_prompt "
                "starts a new one: set add_generation_prompt to false")
        for i, message in enumerate(messages):
            if message.get("role") not in ("system", "user", "assistant", "tool"):
                raise InvalidRequestError(
                    f"messages[{i}].role must be one of system, user, assistant, tool; "
                    f"got {message.get('role')!r}")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidRequestError("this model has no chat template; use the completions "
                                      "API, or serve it with --chat-template")
        template_kwargs = dict(template_kwargs or {})
        reserved = sorted(template_kwargs.keys() & self._reserved_template_names())
        if reserved:
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {', '.join(reserved)}: the server sets "
                "them from the request")
        try:
            return str(self.tokenizer.apply_chat_template(
                list(messages), tools=tools or None, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tokenize=False,
                **template_kwargs))
        except TemplateError as error:
            # The template's own checks (e.g. "roles must alternate") speak to the caller.
            raise InvalidRequestError(f"the model's chat template refused the messages: "
                                      f"{error}") from error
        except (TypeError, ValueError, KeyError, AttributeError) as error:
            # The template ran into a value of the request it cannot handle (a
            # chat_template_kwargs value of the wrong type, say).
            raise InvalidRequestError(f"the model's chat template failed on this request: "
                                      f"{type(error).__name__}: {error}") from error

    def _reserved_template_names(self) -> set[str]:
        """``apply_chat_template``'s own parameters and the variables it fills in."""
        parameters = inspect.signature(self.tokenizer.apply_chat_template).parameters
        named = {name for name, p in parameters.items() if p.kind is not p.VAR_KEYWORD}
        return named | {"messages"}

    def single_token(self, text: str) -> int | None:
        """The id of the one token ``text`` encodes to, or None if it takes several."""
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        return int(ids[0]) if len(ids) == 1 else None

    def detokenize(self, token_ids: Sequence[int]) -> str:
        self.check_token_ids(token_ids)
        return str(self.tokenizer.decode(list(token_ids)))

    def check_token_ids(self, token_ids: Sequence[int]) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token ids must be in [0, {self.vocab_size}); got {bad[:5]}")

    def check_logit_bias(self, logit_bias: Mapping[int, float]) -> None:
        """Every biased token id must be in the vocabulary (the logits' width): the sampler
        indexes the logits with them."""
        bad = sorted(t for t in logit_bias if not 0 <= t < self.vocab_size)
        if bad:
            raise InvalidRequestError(
                f"logit_bias token ids must be in [0, {self.vocab_size}) (the vocabulary "
                f"size is {self.vocab_size}); got {bad[:5]}")

    def check_allowed_token_ids(self, allowed_token_ids: Sequence[int] | None) -> None:
        """Every allowed token id must be in the vocabulary: the sampler keeps the logits at
        them (None: no restriction)."""
        bad = sorted({t for t in allowed_token_ids or () if not 0 <= t < self.vocab_size})
        if bad:
            raise InvalidRequestError(
                f"allowed_token_ids must be in [0, {self.vocab_size}) (the vocabulary size is "
                f"{self.vocab_size}); got {bad[:5]}")

    def check_sampling_token_ids(self, params: SamplingParams) -> None:
        """The token ids a request's sampling parameters name (``logit_bias``,
        ``allowed_token_ids``, ``bad_words_token_ids``) are all in the vocabulary."""
        self.check_logit_bias(params.logit_bias)
        self.check_allowed_token_ids(params.allowed_token_ids)
        bad = sorted({t for ids in params.bad_words_token_ids for t in ids
                      if not 0 <= t < self.vocab_size})
        if bad:
            raise InvalidRequestError(
                f"bad_words_token_ids must be in [0, {self.vocab_size}) (the vocabulary size "
                f"is {self.vocab_size}); got {bad[:5]}")

    def bad_words_token_ids(self, bad_words: Sequence[str]) -> list[list[int]]:
        """vLLM's ``bad_words`` as the token-id sequences the sampler bans: each word
        tokenized (no special tokens) as written without leading whitespace and with one
        leading space, so that it is banned at the start of the text and after a space
        (byte-level BPE vocabularies spell the two differently); each distinct sequence once."""
        sequences: list[list[int]] = []
        for i, word in enumerate(bad_words):
            if not word:
                raise InvalidRequestError(f"bad_words must be non-empty strings; bad_words[{i}] "
                                          "is empty")
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = [int(t) for t in self.tokenizer(text, add_special_tokens=False).input_ids]
                if ids and ids not in sequences:
                    sequences.append(ids)
        bad = sorted({t for ids in sequences for t in ids if not 0 <= t < self.vocab_size})
        if bad:  # a tokenizer with added tokens past the model's vocabulary
            raise InvalidRequestError(
                f"bad_words encode to token ids outside the vocabulary of {self.vocab_size}: "
                f"{bad[:5]}")
        return sequences

    def validate_prompt(self, prompt_token_ids: Sequence[int], max_tokens: int | None) -> None:
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty")
        self.check_token_ids(prompt_token_ids)
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt is {n} tokens long but this model's context length is "
                f"{self.max_model_len} tokens; shorten the prompt")
        if max_tokens is not None and n + max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"the prompt ({n} tokens) plus max_tokens ({max_tokens}) exceeds the context "
                f"length of {self.max_model_len} tokens; lower max_tokens to at most "
                f"{self.max_model_len - n}")
