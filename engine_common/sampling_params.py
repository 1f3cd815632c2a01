"""Per-request sampling and stopping parameters, with validation.

Owns what a caller may ask for and the checks that turn a bad value into a clear error.
It does not own how sampling is done (``sampler``) or how stopping is detected
(``detokenizer`` for stop strings, ``request`` for token-level stops).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from engine_common.structured_output.spec import StructuredOutputSpec

# OpenAI's (and vLLM's) ceiling on the choices one request may ask for.
MAX_CHOICES = 128
# OpenAI's range for a logit_bias value: -100 bans a token in practice, +100 forces it.
MAX_LOGIT_BIAS = 100.0
# OpenAI's ceiling on the top alternatives returned per position.
MAX_LOGPROBS = 20


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message says which and why, and ``param``
    names the field (an API's error body reports it)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per token; 0 = sampled only
    # Logprobs of the prompt's own tokens (each given the ones before it), with this many top
    # alternatives per position; None: none. Raw model logprobs: no temperature, penalties
    # or bias. The request then skips the prefix cache (cached positions have no logits).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    n: int = 1  # choices per request; the public API fans them out, an engine runs one
    # Token id -> value added to its logit before anything else (OpenAI's logit_bias). Ids
    # are checked against the vocabulary where it is known (``InputProcessor``).
    logit_bias: dict[int, float] = field(default_factory=dict)
    # vLLM's allowed_token_ids: only these ids may be sampled (every other logit is -inf,
    # right after the bias); None: every token. Checked against the vocabulary as logit_bias.
    allowed_token_ids: list[int] | None = None
    # vLLM's bad_words, tokenized (``InputProcessor.bad_words_token_ids``: the engine has no
    # tokenizer): a one-token sequence bans its token at every step, a longer one bans its
    # last token where the output so far ends with the tokens before it.
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # The grammar the output must follow (JSON schema, regex, ...); None: free text.
    structured_output: StructuredOutputSpec | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        self.logit_bias = dict(self.logit_bias)  # a plain dict, whatever mapping came in
        # Plain lists, whatever sequences came in (a tuple would break equality with a round
        # trip through the engine messages).
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        self.bad_words_token_ids = [list(ids) for ids in self.bad_words_token_ids]
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def validate(self) -> None:
        def fail(msg: str) -> None:
            # Every message starts with the field it is about.
            first_word = msg.split(" ", 1)[0]
            raise SamplingParamsError(msg, first_word if first_word in _FIELD_NAMES else None)

        if self.max_tokens is not None and self.max_tokens < 1:
            fail(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            fail(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if not self.temperature >= 0.0:  # also rejects NaN
            fail(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            fail(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            fail(f"top_k must be -1 (disabled), 0 (disabled) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            fail(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not self.repetition_penalty > 0.0:
            fail(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            fail(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            fail(f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, "
                 f"got {self.prompt_logprobs}")
        if not 1 <= self.n <= MAX_CHOICES:
            fail(f"n (choices per request) must be between 1 and {MAX_CHOICES}, got {self.n}")
        if any(not s for s in self.stop):
            fail("stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids must be non-negative")
        bad_ids = sorted(t for t in self.logit_bias if t < 0)
        if bad_ids:
            fail(f"logit_bias token ids must be non-negative, got {bad_ids[:5]}")
        bad_values = [(t, b) for t, b in self.logit_bias.items()
                      if not (math.isfinite(b) and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS)]
        if bad_values:
            fail(f"logit_bias values must be in [-100, 100], got {dict(bad_values[:5])}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                fail("allowed_token_ids must not be empty (leave it unset to allow every token)")
            negative = sorted({t for t in self.allowed_token_ids if t < 0})
            if negative:
                fail(f"allowed_token_ids must be non-negative, got {negative[:5]}")
        if any(not ids for ids in self.bad_words_token_ids):
            fail("bad_words_token_ids must hold non-empty token id sequences")
        negative = sorted({t for ids in self.bad_words_token_ids for t in ids if t < 0})
        if negative:
            fail(f"bad_words_token_ids must be non-negative, got {negative[:5]}")


# The fields an error names as its ``param``: those the APIs call by the same name (the
# public API's bad words are text, tokenized into ``bad_words_token_ids``).
_FIELD_NAMES = frozenset(f.name for f in fields(SamplingParams)) - {"bad_words_token_ids"}
