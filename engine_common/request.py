"""A request inside the engine: its tokens, its progress and its state machine.

Owns ``num_computed_tokens`` and the token ids (prompt + output), the request's chained
block hashes (extended as tokens arrive) and the status transitions. There is no prefill or
decode phase: the scheduler only looks at how many tokens are still to compute. It does not
own blocks (``kv_cache_manager``) or text (``detokenizer``).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine_common.block_hash import BlockHash, hash_block_tokens, request_extra_keys
from engine_common.outputs import EngineCoreRequest, RemoteKvChunk, RemotePrefill, TokenLogprobs
from engine_common.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine_common.structured_output.grammar import RequestGrammar


def tokens_sampled_elsewhere(prompt_token_ids: list[int], num_resumed_tokens: int,
                             remote_prefill: RemotePrefill | None) -> list[int]:
    """The output tokens a request arrives with: those resumed at the end of its prompt, then
    a prefill replica's first token."""
    resumed = prompt_token_ids[len(prompt_token_ids) - num_resumed_tokens:]
    return resumed + ([remote_prefill.first_token_id] if remote_prefill is not None else [])


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KV = enum.auto()
    # Its prefix is loading from a KV tier (engine_common.kv_tiers) into its blocks.
    WAITING_FOR_TIER_KV = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower value = served first (vLLM's convention)
    cache_salt: str | None = None
    # The LoRA adapter this request runs with (one the engine loaded); None: the base model.
    lora_name: str | None = None
    max_model_len: int = 1 << 30
    block_size: int = 16
    # P/D: on a prefill replica, keep the blocks pinned for a decode replica after the
    # first token; on a decode replica, the prompt's KV comes from ``remote_prefill``.
    hold_kv: bool = False
    remote_prefill: RemotePrefill | None = None
    # P/D, prefill side: announce blocks as they become final; how many are announced.
    announce_kv: bool = False
    num_announced_blocks: int = 0
    # P/D, decode side: the prefill replica is still computing the prompt (``remote_prefill``
    # comes later, or a failure); the blocks it announced meanwhile, not pulled yet.
    stream_kv: bool = False
    kv_chunks: list[RemoteKvChunk] = field(default_factory=list)
    # Output tokens at the end of the prompt that another replica sampled.
    num_resumed_tokens: int = 0
    # ``sampling_params.structured_output`` compiled (by the engine core), at the position
    # of the output so far; it advances as the scheduler accepts sampled tokens.
    grammar: RequestGrammar | None = None

    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    # Tokens found in the prefix cache when the request was first scheduled.
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    # KV tiers: leading blocks already offered to the tiers (written through); whether its
    # prefix was looked for in the tiers (once: a partial load is not tried again).
    num_offered_blocks: int = 0
    tiers_probed: bool = False
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    stop_reason: int | str | None = None
    # When the scheduler first ran it (``time.monotonic``, the clock of ``arrival_time``).
    first_scheduled_time: float | None = None
    # ``sampling_params.prompt_logprobs``: the next prompt position owed its logprobs
    # (position 0 has none: nothing precedes it), and those computed but not emitted yet
    # (they go out with the first output token).
    next_prompt_logprob_position: int = 1
    pending_prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)

    @classmethod
    def of(cls, core_request: EngineCoreRequest, *, eos_token_ids: frozenset[int],
           max_model_len: int, block_size: int) -> Request:
        """The engine's state for a request the frontend handed over."""
        request = core_request.request
        return cls(
            request_id=core_request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            sampling_params=request.params,
            eos_token_ids=eos_token_ids,
            arrival_time=core_request.arrival_time,
            priority=request.priority,
            cache_salt=request.cache_salt,
            lora_name=request.lora_name or None,
            max_model_len=max_model_len,
            block_size=block_size,
            hold_kv=core_request.hold_kv,
            remote_prefill=core_request.remote_prefill,
            announce_kv=core_request.announce_kv,
            stream_kv=core_request.stream_kv and core_request.remote_prefill is None,
            num_resumed_tokens=request.num_resumed_tokens,
        )

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self._update_block_hashes()
        if self.remote_prefill is not None:
            # The prefill replica sampled the first token (and computed any prompt
            # logprobs); its KV is computed here.
            self.append_output_token(self.remote_prefill.first_token_id)
            self.next_prompt_logprob_position = self.num_prompt_tokens

    def take_remote_result(self, result: RemotePrefill) -> None:
        """The prefill replica's result arrived (stream_kv): its first token joins the output."""
        self.stream_kv = False
        self.remote_prefill = result
        self.append_output_token(result.first_token_id)
        self.next_prompt_logprob_position = self.num_prompt_tokens

    @property
    def kv_from_peer(self) -> bool:
        """The prompt's KV comes from a prefill replica (now, or once it has computed it)."""
        return self.remote_prefill is not None or self.stream_kv

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt positions still owe their logprobs: the prompt must be computed here,
        not taken from the prefix cache."""
        return (self.sampling_params.prompt_logprobs is not None
                and self.next_prompt_logprob_position < self.num_prompt_tokens)

    @property
    def num_sampled_elsewhere(self) -> int:
        """Tokens of this request's output that another replica sampled: a seeded sampler
        here continues that replica's random stream after as many draws."""
        return self.num_resumed_tokens + (1 if self.remote_prefill is not None else 0)

    @property
    def extra_keys(self) -> tuple[str, ...] | None:
        return request_extra_keys(self.cache_salt, self.lora_name)

    @property
    def max_total_tokens(self) -> int:
        """The most tokens (prompt + output) this request may ever hold."""
        limit = self.max_model_len
        if self.sampling_params.max_tokens is not None:
            limit = min(limit, self.num_prompt_tokens + self.sampling_params.max_tokens)
        return limit

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        """Hash every newly completed full block, chained to the previous one."""
        bs = self.block_size
        while (len(self.block_hashes) + 1) * bs <= len(self.all_token_ids):
            start = len(self.block_hashes) * bs
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes.append(
                hash_block_tokens(parent, self.all_token_ids[start : start + bs], self.extra_keys)
            )

    def check_stop(self) -> bool:
        """Token-level stop checks after a new output token: length, a terminated grammar,
        EOS, stop ids.

        A grammar terminates when it accepts a stop token (EOS) after a complete match; the
        request stops then even under ``ignore_eos`` or ``min_tokens``, since the grammar
        allows no further token. Stop strings are the detokenizer's job, since they need text.
        """
        params = self.sampling_params
        if self.num_tokens >= self.max_total_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        if self.grammar is not None and self.grammar.is_terminated:
            self.status = RequestStatus.FINISHED_STOPPED
            return True
        if self.num_output_tokens < params.min_tokens:
            return False
        last = self.output_token_ids[-1]
        if not params.ignore_eos and last in self.eos_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
            return True
        if last in params.stop_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
            self.stop_reason = last
            return True
        return False
