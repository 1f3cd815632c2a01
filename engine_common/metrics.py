"""Prometheus metrics of one engine, under the names vLLM uses.

Owns the collectors (in a registry per engine, never the process-global one) and how the
engine's statistics map onto them. Stock routers and the gateway-api-inference-extension
picker read ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` and friends (and,
for LoRA affinity, ``vllm:lora_requests_info``), so the names and label sets follow vLLM's
V1 engine (``vllm/v1/metrics/loggers.py``): the same names, types, label names and buckets;
``model_name`` is the served name (``--served-model-name``, the first of several), not the
model's path. Each registry also carries the process's own collectors (CPU, memory, file
descriptors, GC), as vLLM's default registry does. It does not own the HTTP endpoint
(services) or where the numbers come from (the scheduler's ``SchedulerStats`` and the output
processor).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector

from engine_common.config import CacheConfig
from engine_common.finished_requests import FinishedRequests
from engine_common.outputs import KvTransferReport, SchedulerStats

# vLLM's buckets, metric by metric (vllm/v1/metrics/loggers.py).
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
# Inter-token latency and a request's mean time per output token.
_TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
_N_BUCKETS = (1, 2, 5, 10, 20)
# Tandem's own: a KV pull takes from well under a millisecond (same host) to seconds.
_ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
)
# Without a context length, token-count buckets go this far.
_DEFAULT_MAX_TOKENS_BUCKET = 20000
# vLLM's buckets for a request's latency and its phases, and for the tokens of one step.
_PHASE_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)
_STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets, sized by the
    context length)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


def served_model_label(model: str, served_model_name: str | Sequence[str] | None) -> str:
    """The ``model_name`` label: the name clients use, as vLLM labels its metrics: the
    served name (the first of several), else the model directory's name (what the API
    answers to by default)."""
    if isinstance(served_model_name, str):
        served_model_name = [served_model_name] if served_model_name else []
    names = [name for name in served_model_name or () if name]
    return names[0] if names else Path(model).name


def register_process_collectors(registry: CollectorRegistry) -> None:
    """The process's CPU, memory, file descriptors and start time (``process_*``), the
    Python version (``python_info``) and garbage collections (``python_gc_*``) on
    ``registry``, as prometheus_client's default registry carries them."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)


def request_params_n(registry: CollectorRegistry, model_name: str,
                     engine_id: str) -> Histogram:
    """vLLM's ``vllm:request_params_n``: a request's ``n`` (choices), observed once per
    request by the front end that fans its choices out (an engine runs one choice each)."""
    return Histogram("vllm:request_params_n", "Histogram of the n request parameter.",
                     ["model_name", "engine"], buckets=_N_BUCKETS, registry=registry).labels(
        model_name=model_name, engine=engine_id)


@dataclass(frozen=True)
class FinishedRequestStats:
    """What a finished request adds to the metrics; its phases are None where it never got
    that far (aborted while waiting, say)."""

    finish_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_latency: float  # arrival to finish
    max_tokens_param: int | None = None  # the request's max_tokens (None: up to the context)
    request_id: str = ""
    queued_time: float | None = None  # arrival to first scheduled
    prefill_time: float | None = None  # first scheduled to first token
    decode_time: float | None = None  # first token to finish
    inference_time: float | None = None  # first scheduled to finish

    @property
    def mean_time_per_output_token(self) -> float:
        """vLLM's: the decode time over the tokens after the first (0 for one token)."""
        if self.decode_time is None or self.num_generation_tokens < 2:
            return 0.0
        return self.decode_time / (self.num_generation_tokens - 1)


# The KV tiers' counters, by ``TierStats`` field: tandem:kv_tier_<field>{medium}.
_KV_TIER_COUNTERS = {
    "hits": "Blocks loaded from a KV tier.",
    "bytes_loaded": "Bytes loaded from a KV tier.",
    "load_seconds": "Seconds spent loading blocks from a KV tier.",
    "stores": "Blocks stored in a KV tier.",
    "bytes_stored": "Bytes stored in a KV tier.",
    "store_seconds": "Seconds spent storing blocks in a KV tier.",
    "evictions": "Blocks a KV tier evicted to make room.",
    "dropped_stores": "Block stores dropped: the worker's queue was full, or the tier refused.",
}


class EngineMetrics:
    def __init__(self, model_name: str, engine_id: str, registry: CollectorRegistry | None = None,
                 max_model_len: int | None = None):
        """``model_name``: the served name (``served_model_label``); ``max_model_len`` sizes
        the token-count buckets, as in vLLM."""
        self.registry = registry if registry is not None else CollectorRegistry()
        register_process_collectors(self.registry)
        token_buckets = build_1_2_5_buckets(max_model_len or _DEFAULT_MAX_TOKENS_BUCKET)
        labels = {"model_name": model_name, "engine": engine_id}
        names = list(labels)
        reg = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=reg).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=reg).labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=reg).labels(**labels)

        self.num_requests_running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("vllm:kv_cache_usage_perc", "KV cache usage, 0 to 1.")
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("vllm:num_preemptions", "Preemptions by recompute.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of requests that started.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds", "Time between consecutive output tokens.",
            _TOKEN_LATENCY_BUCKETS)
        self.request_time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Per finished request: its decode time over its output tokens after the first.",
            _TOKEN_LATENCY_BUCKETS)
        self.e2e_request_latency = histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to finish.", _PHASE_BUCKETS)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Prompt length per request.", token_buckets)
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Output length per request.", token_buckets)
        self.request_params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
            token_buckets)
        self.request_params_n = request_params_n(reg, model_name, engine_id)
        self.request_queue_time = histogram(
            "vllm:request_queue_time_seconds", "Time a request waited before it first ran.",
            _PHASE_BUCKETS)
        self.request_prefill_time = histogram(
            "vllm:request_prefill_time_seconds", "First run to first token.", _PHASE_BUCKETS)
        self.request_decode_time = histogram(
            "vllm:request_decode_time_seconds", "First token to finish.", _PHASE_BUCKETS)
        self.request_inference_time = histogram(
            "vllm:request_inference_time_seconds", "First run to finish.", _PHASE_BUCKETS)
        self.spec_decode_num_draft_tokens = counter(
            "vllm:spec_decode_num_draft_tokens", "Speculative decoding: draft tokens checked.")
        self.spec_decode_num_accepted_tokens = counter(
            "vllm:spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens kept.")
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total", "Tokens computed by one engine step.",
            _STEP_TOKEN_BUCKETS)
        self._request_success = Counter(
            "vllm:request_success", "Finished requests by reason.", [*names, "finished_reason"],
            registry=reg)
        self._labels = labels
        # Each finished request's phases, for a while: tracing reads them (by request id).
        self.finished_requests = FinishedRequests()
        # P/D KV transfer (Tandem's own).
        # Pulls that worked, by the transport UCX used ("shm" on one host, "tcp", ...).
        self._kv_transfer_bytes = Counter(
            "tandem:kv_transfer_bytes", "KV bytes pulled from prefill replicas, by transport.",
            [*names, "transport"], registry=reg)
        self._kv_transfer_seconds = Histogram(
            "tandem:kv_transfer_seconds", "Duration of one KV pull, by transport.",
            [*names, "transport"], buckets=_ITL_BUCKETS, registry=reg)
        self.kv_transfer_blocks_local = counter(
            "tandem:kv_transfer_blocks_local",
            "Prompt blocks a decode replica already held and did not pull.")
        self.kv_transfer_fallbacks = counter(
            "tandem:kv_transfer_fallbacks", "Requests whose prompt was recomputed after a failed pull.")
        self._kv_transfer_failures = Counter(
            "tandem:kv_transfer_failures", "Failed KV pulls by reason.", [*names, "reason"],
            registry=reg)
        self.kv_pinned_blocks = gauge(
            "tandem:kv_pinned_blocks", "Blocks a prefill replica holds for decode replicas.")
        # KV tiers (engine_common.kv_tiers), by medium: host, disk, shared.
        self.kv_tier_hit_tokens = counter(
            "tandem:kv_tier_hit_tokens", "Prompt tokens loaded from a KV tier, not computed.")
        self._kv_tier = {
            name: Counter(f"tandem:kv_tier_{name}", doc, [*names, "medium"], registry=reg)
            for name, doc in _KV_TIER_COUNTERS.items()}
        self._kv_tier_failures = Counter(
            "tandem:kv_tier_failures", "KV tier loads or stores that failed, by reason "
            "(down, slow, full, checksum, truncated, backoff).", [*names, "medium", "reason"],
            registry=reg)
        # Registered by the first statistics of an engine serving LoRA adapters: an engine
        # without adapters has no such metric, as in vLLM.
        self._lora_requests_info: Gauge | None = None
        self._lora_label_values: tuple[str, ...] | None = None  # of its one sample

    @property
    def labels(self) -> dict[str, str]:
        """The labels every sample of this engine carries (``model_name``, ``engine``)."""
        return dict(self._labels)

    def set_cache_config(self, cache: CacheConfig, num_blocks: int) -> None:
        info = {
            "block_size": str(cache.block_size),
            "num_gpu_blocks": str(num_blocks),
            "enable_prefix_caching": str(cache.enable_prefix_caching),
        }
        Gauge("vllm:cache_config_info", "Information of the KV cache config.", list(info),
              registry=self.registry).labels(**info).set(1)

    def record_scheduler_stats(self, stats: SchedulerStats) -> None:
        self.num_requests_running.set(stats.num_running_reqs)
        self.num_requests_waiting.set(stats.num_waiting_reqs)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        self.prefix_cache_queries.inc(stats.prefix_cache_queries)
        self.prefix_cache_hits.inc(stats.prefix_cache_hits)
        self.num_preemptions.inc(stats.num_preemptions)
        self.kv_pinned_blocks.set(stats.num_pinned_blocks)
        if stats.num_scheduled_tokens:
            self.iteration_tokens.observe(stats.num_scheduled_tokens)
        self.spec_decode_num_draft_tokens.inc(stats.num_draft_tokens)
        self.spec_decode_num_accepted_tokens.inc(stats.num_accepted_tokens)
        if stats.max_lora:
            self._record_lora(stats)
        self.kv_tier_hit_tokens.inc(stats.kv_tier_hit_tokens)
        for medium, tier in stats.kv_tiers.items():
            for name in _KV_TIER_COUNTERS:
                value = getattr(tier, name)
                if value:
                    self._kv_tier[name].labels(**self._labels, medium=medium).inc(value)
            for reason, count in tier.failures.items():
                self._kv_tier_failures.labels(**self._labels, medium=medium,
                                              reason=reason).inc(count)

    def _record_lora(self, stats: SchedulerStats) -> None:
        """vLLM's ``vllm:lora_requests_info``: the adapters of running and waiting requests
        (comma-separated) as labels, the time they were seen as the value. Readers (the
        inference extension's endpoint picker) take the sample with the latest value; vLLM
        keeps a sample per label set ever seen, this keeps only the current one."""
        gauge = self._lora_requests_info
        if gauge is None:
            gauge = self._lora_requests_info = Gauge(
                "vllm:lora_requests_info", "Running stats on LoRA requests.",
                [*self._labels, "max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                registry=self.registry)
        values = (*self._labels.values(), str(stats.max_lora),
                  ",".join(stats.waiting_lora_adapters), ",".join(stats.running_lora_adapters))
        if self._lora_label_values is not None and self._lora_label_values != values:
            gauge.remove(*self._lora_label_values)
        self._lora_label_values = values
        gauge.labels(*values).set_to_current_time()

    def record_kv_transfer(self, report: KvTransferReport) -> None:
        self.kv_transfer_blocks_local.inc(report.blocks_local)
        if report.fallback_reason is not None:
            self._kv_transfer_failures.labels(**self._labels, reason=report.fallback_reason).inc()
            self.kv_transfer_fallbacks.inc()
            return
        transport = report.transport or "unknown"
        self._kv_transfer_bytes.labels(**self._labels, transport=transport).inc(report.num_bytes)
        self._kv_transfer_seconds.labels(**self._labels, transport=transport).observe(
            report.seconds)

    def record_finished(self, stats: FinishedRequestStats) -> None:
        self._request_success.labels(**self._labels, finished_reason=stats.finish_reason).inc()
        self.finished_requests.add(stats)
        self.request_prompt_tokens.observe(stats.num_prompt_tokens)
        self.request_generation_tokens.observe(stats.num_generation_tokens)
        self.e2e_request_latency.observe(stats.e2e_latency)
        self.request_time_per_output_token.observe(stats.mean_time_per_output_token)
        if stats.max_tokens_param:
            self.request_params_max_tokens.observe(stats.max_tokens_param)
        for histogram, seconds in ((self.request_queue_time, stats.queued_time),
                                   (self.request_prefill_time, stats.prefill_time),
                                   (self.request_decode_time, stats.decode_time),
                                   (self.request_inference_time, stats.inference_time)):
            if seconds is not None:
                histogram.observe(seconds)
