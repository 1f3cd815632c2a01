"""Engine configuration records: cache, scheduler and model settings.

Owns the plain settings a user chooses; it does not own derived state (the number of
KV blocks is computed by the KV cache sizing in the model runner from the memory budget).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from engine_common.kv_tiers.config import KvTiersConfig

DEFAULT_BLOCK_SIZE = 16
# A CPU KV cache's page policies (engine_common.model.kv_cache_memory).
KV_CACHE_PAGE_POLICIES = ("4k", "huge", "huge-if-free")


@dataclass
class CacheConfig:
    block_size: int = DEFAULT_BLOCK_SIZE
    # Bytes for the paged KV cache on CPU; on GPU, a fraction of free memory is used.
    kv_cache_memory_bytes: int = 1 << 30
    gpu_memory_utilization: float = 0.85
    # A CPU cache's pages: "auto" (huge on a prefill replica, huge while free elsewhere),
    # "huge", "huge-if-free" or "4k" (engine_common.model.kv_cache_memory says why).
    kv_cache_pages: str = "auto"
    # When set, overrides the memory budget (tests use this to force preemption).
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    # Prefills longer than this are chunked even when the budget would allow more,
    # so one long prompt cannot starve the running decodes. 0 disables the limit.
    long_prefill_token_threshold: int = 0
    # While any running request is decoding, the prompt tokens of a step (all prefilling
    # requests together) are capped, so that a long prompt computed here (a P/D fallback, a
    # resumed stream, a new request) runs in chunks between the running streams' tokens:
    # at most this many, and no more than take max_prefill_time_per_decode_step times a
    # decode-only step (measured as the engine runs; at least one block). A stream then waits
    # about (1 + that) decode steps for its next token (docs/reliability.md). 0: no cap,
    # prompts take whatever the decodes leave of max_num_batched_tokens.
    max_prefill_tokens_while_decoding: int = 512
    # Fixed caps only (a decode replica's); 0: the token cap alone.
    max_prefill_time_per_decode_step: float = 1.0
    # An aggregated replica's caps: the token cap times the prompts queued (waiting to start
    # or being computed), up to max_num_batched_tokens, and no time cap. Past its capacity
    # prompts queue behind the decodes: with fixed caps they trickled in (the time cap's
    # chunks shrink to one block a step when no step is decode-only, see
    # Scheduler._prefill_room) while the queue grew, and TTFT and throughput fell far below
    # vLLM's, which fills the budget with prompts after the decodes (issue 27: TTFT p99 3.3x
    # vLLM's); a lone long prompt, chunked by time, waited 1.8x vLLM's TTFT (issue 39). Its
    # running streams then wait at most one token cap's chunk a step, the price of the
    # prompts' TTFT. A decode replica keeps the fixed caps, time cap included: a prompt it
    # computes is a P/D fallback, and its streams must not stall behind it.
    # None: by the engine's role (EngineConfig: fixed on a KV consumer, scaled elsewhere);
    # a Scheduler built without an EngineConfig takes None as fixed.
    prefill_caps_scale_with_queue: bool | None = None
    # Fraction of blocks kept free when admitting new requests, so running ones can grow.
    watermark: float = 0.01
    # Admission also keeps free the blocks the running requests are expected to grow into
    # (the rest of their prompts, and their output up to what recent requests produced,
    # within max_tokens: engine_common/output_room.py), so that a request admitted now does
    # not force a preemption by recompute a few steps later. False: vLLM's admission, which
    # admits into any free block and preempts when the running requests outgrow the pool.
    reserve_output_room: bool = True
    policy: str = "fcfs"  # "fcfs" or "priority"
    enable_chunked_prefill: bool = True

    @property
    def prefill_time_cap(self) -> float:
        """The time cap in force: ``max_prefill_time_per_decode_step`` with fixed caps (a
        decode replica's); 0 (none) on an aggregated replica."""
        return 0.0 if self.prefill_caps_scale_with_queue else self.max_prefill_time_per_decode_step


@dataclass
class SpeculativeConfig:
    """Speculative decoding by n-gram lookup (vLLM's ``ngram`` method): a decode step also
    runs up to ``num_tokens`` drafted tokens and keeps those that match what the model
    samples after them, so the output is the same (greedy, or seeded) or has the same
    distribution (sampled), sometimes several tokens per step."""

    num_tokens: int = 0  # draft tokens per step; 0: off
    ngram_min: int = 2
    ngram_max: int = 4
    # Speculate only while at most this many requests run: checking k drafts costs about
    # k times a decode step once the batch is large enough to be compute-bound (on CPU, a
    # handful of sequences), and nothing extra below that (vLLM's V0 had this knob too).
    max_batch_size: int = 4


@dataclass
class KvTransferConfig:
    """P/D: this engine's side of KV transfer (see ``remote_kv``)."""

    role: str | None = None  # "producer" (prefill replica), "consumer" (decode replica), None
    # This replica's KV address, an IP of this host (never a wildcard): a producer binds its
    # KV listener to exactly it and advertises it in handles; on both roles UCX's TCP
    # transport listens only on its interface, so it must reach the peers (loopback
    # reaches this host only). See kv_transfer.local_addresses.check_bind_address.
    host: str = "127.0.0.1"
    port: int = 0  # KV listener port of a producer; 0 picks a free one
    # "auto": shared memory with producers on this host, TCP with others; "tcp": TCP always.
    transport: str = "auto"
    lease_seconds: float = 30.0  # pinned blocks nobody pulls are freed after this
    pull_timeout_seconds: float = 10.0
    fallback: str = "recompute"  # on a failed pull: "recompute" locally, or "fail" the request


@dataclass(frozen=True)
class ModelSettings:
    """How the model's requests are shaped: its chat template, the syntax of its tool calls
    and its sampling defaults. Every process that resolves requests (a replica; the gateway,
    which renders chats, parses calls and applies defaults itself) must be given the same
    (``services.model_settings`` owns their flags)."""

    # A chat template (a file, or the Jinja text) used instead of the model's own.
    chat_template: str | None = None
    # The tool-call syntax "auto" parses ("hermes", "mistral", "llama3_json"); None: the
    # one the chat template teaches, if Tandem knows it.
    tool_call_parser: str | None = None
    # Requests' sampling defaults: "auto", the model's generation_config.json (as vLLM);
    # "vllm", the library's; or a folder holding a generation_config.json
    # (``sampling_defaults``).
    generation_config: str = "auto"
    # Values set over those defaults, by generation_config.json's keys.
    override_generation_config: dict[str, float | int] = field(default_factory=dict)
    # LoRA adapters served beside the base model, by the name requests give as their model:
    # name -> a PEFT adapter directory (adapter_config.json, adapter_model.safetensors).
    lora_modules: dict[str, str] = field(default_factory=dict)
    # At most this many different adapters in one step (vLLM's max_loras): a waiting
    # request of another adapter waits until one of the running adapters has no request
    # left. None: no cap.
    max_loras: int | None = None
    # Adapters of a higher rank (the largest of any projection) are refused, at start and
    # when loaded at run time (vLLM's max_lora_rank). None: any rank.
    max_lora_rank: int | None = None
    # Adapters may be loaded and unloaded while serving (vLLM's
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING): the API reads a directory the caller names on the
    # server's file system, so it is off unless asked for.
    allow_runtime_lora_updating: bool = False


@dataclass
class EngineConfig:
    model: str
    # "auto" (the checkpoint's; float32 for bf16 on a CPU without a bf16 matmul), "bfloat16",
    # "float16", "float32"
    dtype: str = "auto"
    device: str = "cpu"
    max_model_len: int | None = None
    seed: int = 0
    attention_backend: str = "auto"  # "auto", "torch", "triton"
    # On CUDA, decode steps replay CUDA graphs captured for padded batch sizes up to
    # ``cuda_graph_max_batch_size``; ``enforce_eager`` turns that off (as in vLLM).
    enforce_eager: bool = False
    cuda_graph_max_batch_size: int = 256
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_transfer: KvTransferConfig = field(default_factory=KvTransferConfig)
    # Host-memory, disk and shared tiers behind the KV pool (off by default).
    kv_tiers: KvTiersConfig = field(default_factory=KvTiersConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    # Stable identity of this engine instance (used in KV events and KV handles).
    engine_id: str = "engine-0"
    model_settings: ModelSettings = field(default_factory=ModelSettings)
    # CPUs the engine core process runs on, one torch thread each (None: its parent's CPUs
    # and threads). Keeping the frontend off them stops it from stalling the model's threads.
    cpus: list[int] | None = None
    # Tensor-parallel ranks of this replica's model (engine_common.parallel): one process
    # each, on its own share of ``cpus`` (the CPU) or its own device (cuda:0 to N-1).
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.scheduler.prefill_caps_scale_with_queue is None:
            # A decode replica (KV consumer) computes prompts only as P/D fallbacks, beside
            # streams that must not stall: fixed caps there (SchedulerConfig).
            self.scheduler = replace(self.scheduler, prefill_caps_scale_with_queue=(
                self.kv_transfer.role != "consumer"))
