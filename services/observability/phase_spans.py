"""Spans for the phases of a request that happen where no code of this process runs.

Owns recording, after the fact, a span for a phase whose start and end are known only from
what the engine reports: its wait in the engine's queue and its prefill (the engine core's
clocks, kept for a while by ``engine_common.finished_requests``), the KV pull of a decode
replica (it runs in the engine core's process, over UCX; the report says how long it took)
and the decode (first token to the last). Each becomes a child of the current span (the request's server span) with its real
start and end times, so the trace shows where a slow request spent its time. Without tracing
they cost nothing. It does not own the interceptors' spans (``trace_interceptors``).
"""

from __future__ import annotations

import time
from typing import Any

from engine_common.finished_requests import FinishedRequests
from services.observability.tracing import tracer, tracing_enabled


def _wall_ns(monotonic: float) -> int:
    """A ``time.monotonic()`` instant as the wall-clock nanoseconds spans carry."""
    return time.time_ns() - int((time.monotonic() - monotonic) * 1e9)


def record_phase(name: str, started: float, ended: float, **attributes: Any) -> None:
    """A finished span ``name`` from ``started`` to ``ended`` (``time.monotonic()``)."""
    if not tracing_enabled():
        return
    span = tracer().start_span(name, start_time=_wall_ns(started), attributes={
        key: value for key, value in attributes.items() if value is not None})
    span.end(end_time=_wall_ns(ended))


def record_kv_pull(seconds: float, num_bytes: int, blocks: int) -> None:
    """The KV pull whose report arrived just now and took ``seconds``."""
    now = time.monotonic()
    record_phase("kv_pull", now - seconds, now, **{
        "tandem.kv.bytes": num_bytes, "tandem.kv.blocks_pulled": blocks})


def record_engine_phases(finished: FinishedRequests | None, request_id: str) -> None:
    """The queue and prefill of engine request ``request_id``, which finished just now, from
    the engine's statistics (when this process has an engine and still holds them)."""
    stats = None if finished is None else finished.pop(request_id)
    if stats is None or not tracing_enabled():
        return
    now = time.monotonic()
    arrival = now - stats.e2e_latency
    if stats.queued_time is None:
        return
    scheduled = arrival + stats.queued_time
    record_phase("queue", arrival, scheduled)
    if stats.prefill_time:  # zero where another replica computed the prompt
        record_phase("prefill", scheduled, scheduled + stats.prefill_time,
                     **{"tandem.prompt_tokens": stats.num_prompt_tokens})


class SequencePhases:
    """The phases of one engine request as its responses arrive: the KV pull when its report
    comes; the queue, the prefill and the decode when it finishes."""

    def __init__(self, request_id: str = "", finished: FinishedRequests | None = None) -> None:
        self.request_id = request_id
        self.finished = finished  # the engine's recent statistics (a replica's), or None
        self.first_token_at: float | None = None

    def observe(self, output_tokens: int, finished: bool, kv_seconds: float | None = None,
                kv_bytes: int = 0, kv_blocks: int = 0) -> None:
        """A response: the running output count, whether it is the last, and a successful
        pull's report when it carries one."""
        if kv_seconds:
            record_kv_pull(kv_seconds, kv_bytes, kv_blocks)
        now = time.monotonic()
        if output_tokens and self.first_token_at is None:
            self.first_token_at = now
        if finished:
            record_engine_phases(self.finished, self.request_id)
        if finished and self.first_token_at is not None:
            record_phase("decode", self.first_token_at, now,
                         **{"tandem.output_tokens": output_tokens})
