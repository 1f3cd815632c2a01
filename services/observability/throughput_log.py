"""A replica's periodic throughput and usage line, as vLLM's ``LoggingStatLogger`` prints it.

Owns, every ``interval_s`` (10 s, vLLM's default), the line ``Engine <id>: Avg prompt
throughput: X tokens/s, Avg generation throughput: Y tokens/s, Running: N reqs, Waiting: M
reqs, GPU KV cache usage: Z%, Prefix cache hit rate: W%``, at INFO while the engine works and
at DEBUG once it has been idle for a whole interval (vLLM's rule against log noise). The
numbers are read from the engine's own Prometheus registry, where the scheduler's statistics
already arrive (``EngineMetrics``): throughput is the interval's change of the token counters;
the hit rate is over the last minute's prefix-cache lookups (vLLM's is over its last thousand
requests); the JSON log format carries each as a key. It does not own the metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine_common.metrics import EngineMetrics

logger = logging.getLogger("tandem.stats")

LOG_INTERVAL_S = 10.0
_HIT_RATE_WINDOW = 6  # intervals: a minute at the default interval


@dataclass(frozen=True)
class _Counters:
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0


class ThroughputLog:
    def __init__(self, metrics: EngineMetrics, engine_id: str,
                 interval_s: float = LOG_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.metrics = metrics
        self.engine_id = engine_id
        self.interval_s = interval_s
        self._clock = clock
        self._last_time = clock()
        self._last = self._read()
        self._last_throughput = (0.0, 0.0)
        self._lookups: deque[tuple[float, float]] = deque(maxlen=_HIT_RATE_WINDOW)

    def _sample(self, name: str) -> float:
        return self.metrics.registry.get_sample_value(name, self.metrics.labels) or 0.0

    def _read(self) -> _Counters:
        return _Counters(self._sample("vllm:prompt_tokens_total"),
                         self._sample("vllm:generation_tokens_total"),
                         self._sample("vllm:prefix_cache_queries_total"),
                         self._sample("vllm:prefix_cache_hits_total"))

    def log(self) -> None:
        """Log the interval since the previous call."""
        now, counters = self._clock(), self._read()
        elapsed = max(now - self._last_time, 1e-9)
        prompt = (counters.prompt_tokens - self._last.prompt_tokens) / elapsed
        generation = (counters.generation_tokens - self._last.generation_tokens) / elapsed
        self._lookups.append((counters.prefix_queries - self._last.prefix_queries,
                              counters.prefix_hits - self._last.prefix_hits))
        queries = sum(q for q, _ in self._lookups)
        hit_rate = sum(h for _, h in self._lookups) / queries if queries else 0.0
        idle = not any((prompt, generation, *self._last_throughput))
        self._last_time, self._last, self._last_throughput = now, counters, (prompt, generation)
        running = int(self._sample("vllm:num_requests_running"))
        waiting = int(self._sample("vllm:num_requests_waiting"))
        usage = self._sample("vllm:kv_cache_usage_perc")
        fields = {
            "engine": self.engine_id,
            "prompt_throughput": round(prompt, 1),
            "generation_throughput": round(generation, 1),
            "running": running,
            "waiting": waiting,
            "kv_cache_usage": round(usage, 4),
            "prefix_cache_hit_rate": round(hit_rate, 4),
        }
        logger.log(
            logging.DEBUG if idle else logging.INFO,
            "Engine %s: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: "
            "%.1f tokens/s, Running: %d reqs, Waiting: %d reqs, GPU KV cache usage: %.1f%%, "
            "Prefix cache hit rate: %.1f%%", self.engine_id, prompt, generation,
            running, waiting, usage * 100,
            hit_rate * 100, extra={"fields": fields})

    async def run(self) -> None:
        """Log every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            self.log()
