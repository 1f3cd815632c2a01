"""Records that cross the engine's boundaries: model runner -> scheduler, and engine core
<-> frontend.

The model runner hands the scheduler each step's sampled tokens (``ModelRunnerOutput``).
The engine core (scheduler + model runner, in its own process) emits token ids, finish
states and scheduler statistics; the frontend turns them into text (``output_processor``)
and metrics. These are plain picklable dataclasses and own no behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_common.generation_request import GenerationRequest
from engine_common.kv_events import KVEvent
from engine_common.kv_tiers.tier import TierStats
from kv_transfer.connector import KvHandle
from kv_transfer.layout import KvLayout


@dataclass
class TokenLogprobs:
    """The logprob of the sampled token, its rank (1 = most likely) and the top-n."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class RemotePrefill:
    """On a decode replica: where the prompt's KV is and the token its prefill sampled."""

    handle: KvHandle
    first_token_id: int
    first_logprobs: TokenLogprobs | None = None
    # The prompt's logprobs, where the request asked for them (the prefill replica computed
    # the prompt); the frontend streams them with the first token.
    prompt_logprobs: list[TokenLogprobs] | None = None


# Separates a request id from an announcement's first block in the id of the lease an
# announcement pins its blocks under (``remote_kv``); the Engine API refuses request ids
# that contain it.
ANNOUNCEMENT_LEASE_SEPARATOR = "\x1f"


@dataclass(frozen=True)
class RemoteKvChunk:
    """On a decode replica: prompt blocks a prefill replica announced final while it was still
    computing the prompt. ``handle.block_ids`` are the prompt's blocks ``first_block``,
    ``first_block + 1``, ..., pinned under the lease ``handle.request_id``."""

    handle: KvHandle
    first_block: int


class RemotePrefillLost(Exception):
    """The prefill replica's stream ended before its result (it failed, or was unreachable):
    the decode replica computes the prompt itself. ``reason`` goes into the fallback report."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass
class KvTransferReport:
    """How a decode replica got a request's prompt KV."""

    prefill_engine_id: str
    blocks_pulled: int = 0
    blocks_local: int = 0  # prompt blocks this replica already had in its prefix cache
    num_bytes: int = 0
    seconds: float = 0.0
    fallback_reason: str | None = None  # set when the prompt was recomputed here instead
    # What carried the bytes of a pull that worked: "shm", "tcp", "self" (one process)...
    transport: str | None = None
    # Of blocks_pulled, those pulled from announcements, while the prefill replica was still
    # computing the prompt (``RemoteKvChunk``).
    blocks_pulled_early: int = 0


@dataclass
class EngineCoreRequest:
    """A request as the frontend hands it to the engine core (already tokenized)."""

    request_id: str
    request: GenerationRequest
    arrival_time: float
    # P/D: on a prefill replica, keep the blocks pinned for a decode replica after the
    # first token; on a decode replica, the prompt's KV comes from ``remote_prefill``.
    hold_kv: bool = False
    remote_prefill: RemotePrefill | None = None
    # P/D, prefill side (with hold_kv): pin and announce the prompt's blocks as they become
    # final, step by step (outputs with a ``kv_handle`` and no token).
    announce_kv: bool = False
    # P/D, decode side: the prefill replica is still computing the prompt; its announced
    # blocks and then its result come later (``RemoteKvUpdate``).
    stream_kv: bool = False


@dataclass
class RemoteKvUpdate:
    """On a decode replica: news of a request's prefill on a prefill replica, in order: any
    number of ``chunk``s, then either ``result`` (the first token and every block) or
    ``failure`` (a fallback reason: the prompt is computed here)."""

    request_id: str
    chunk: RemoteKvChunk | None = None
    result: RemotePrefill | None = None
    failure: str | None = None


@dataclass
class ModelRunnerOutput:
    """One step's results, by request id: the sampled token (with its logprobs, if asked
    for) of each request whose scheduled tokens reached its end, and the prompt logprobs of
    the positions this step computed, for requests that asked for them."""

    sampled: dict[str, tuple[int, TokenLogprobs | None]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Speculative decoding: the leading drafts the model agreed with, and their logprobs
    # for requests that asked for logprobs; the sampled token follows them.
    accepted_drafts: dict[str, list[int]] = field(default_factory=dict)
    accepted_draft_logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    # On a request's first output token: its prompt's logprobs (positions 1 on), if asked for.
    prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # Prefill side: the pinned blocks: at finish every prompt block; before it (announce_kv,
    # an output without tokens) the blocks that became final since the last announcement.
    kv_handle: KvHandle | None = None
    kv_transfer: KvTransferReport | None = None  # decode side: once the prompt KV is in
    # When the scheduler first ran the request (``time.monotonic``), on its token outputs.
    first_scheduled_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    # Deltas since the previous report (counters in Prometheus).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_pinned_blocks: int = 0  # held for decode replicas (P/D, prefill side)
    num_scheduled_tokens: int = 0  # computed by the step these statistics follow
    num_draft_tokens: int = 0  # speculative decoding: drafts checked
    num_accepted_tokens: int = 0  # and kept
    # LoRA (only when the engine serves adapters or may load some, and max_lora > 0): the
    # adapters of running and of waiting requests, sorted names; max_lora: the adapters one
    # step may batch (ModelSettings.max_loras, or without a cap those served now).
    running_lora_adapters: list[str] = field(default_factory=list)
    waiting_lora_adapters: list[str] = field(default_factory=list)
    max_lora: int = 0
    # KV tiers: prompt tokens loaded from a tier instead of computed, and each tier's
    # counters (by medium: host, disk, shared), deltas since the previous report.
    kv_tier_hit_tokens: int = 0
    kv_tiers: dict[str, TierStats] = field(default_factory=dict)
    # For routers' time-to-first-token estimates (``engine_common.prefill_outlook``).
    num_prefill_tokens_queued: int = 0
    prefill_tokens_per_s: float = 0.0  # 0: not measured yet
    prefill_share: float = 1.0


@dataclass
class EngineCoreOutputs:
    """Everything one engine-core step produced."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    stats: SchedulerStats | None = None
    kv_events: list[KVEvent] = field(default_factory=list)
    timestamp: float = 0.0


@dataclass
class EngineInfo:
    """What the frontend needs to know about the core it talks to."""

    engine_id: str
    model: str
    max_model_len: int
    block_size: int
    num_blocks: int
    dtype: str
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    kv_layout: KvLayout  # what P/D peers must agree on to exchange blocks
    kv_address: tuple[str, int] | None = None  # UCX listener of a prefill (producer) engine
    # The startup log's lines about the model (architecture and layer types, weight memory
    # by kind, KV blocks and concurrency, attention backend): GetInfo reports them.
    model_summary: tuple[str, ...] = ()
    # Tensor-parallel ranks the model is split over (``num_kv_heads`` is the model's, the
    # layout's ``num_kv_heads`` each rank's).
    tensor_parallel_size: int = 1
