"""The one record of a sequence to generate, from the front end to the scheduler.

``GenerationRequest`` is what a public request resolves into (the front end builds it once,
validated), what ``AsyncLLM.generate`` takes, what the engine core receives inside an
``EngineCoreRequest`` and what the scheduler's ``Request`` is built from
(``Request.of``). Its fields are spelled here and nowhere else. It does not carry where the
request runs or by when (the front end's ``CallContext``), nor P/D state (``hold_kv``,
``remote_prefill``: the engine's, set per role).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_common.sampling_params import SamplingParams


@dataclass(frozen=True)
class GenerationRequest:
    """One sequence: its prompt's token ids and how to sample after them."""

    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower value = served first (vLLM's convention)
    # Mixed into the prompt's block hashes: requests with different salts share no cache.
    cache_salt: str | None = None
    # The LoRA adapter to run with (one the engine serves); None: the base model.
    lora_name: str | None = None
    # A resumed stream: the prompt ends with this many output tokens already streamed (by a
    # replica that failed); they count as output, and the grammar starts after them.
    num_resumed_tokens: int = 0
