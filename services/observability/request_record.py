"""What one request did, as its log line says it: the record and the request it belongs to.

Owns ``RequestRecord`` (the request's id, RPC method, the replicas that served it, prompt and
output tokens, time to first token, total time, finish reason, status), its log fields and
message, and which record the code running now belongs to. A server interceptor
(``request_log``) opens a record per request and logs it when the request ends; the layers
beneath fill it in without a reference being passed down: the engine seam (``observed_engine``)
with tokens and timings, the client interceptor of suite channels (``peer_interceptor``) with
the replicas a request went to. The current record is a context variable, as OpenTelemetry's
current span is: asyncio tasks created while a request is handled (its choices, its upstream
calls) inherit it, and nothing outside the request sees it. It does not own logging the line.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

_current: ContextVar[RequestRecord | None] = ContextVar("tandem_request_record", default=None)


@dataclass
class _Sequence:
    """One engine request (a choice) of the request."""

    prompt_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str | None = None


@dataclass
class RequestRecord:
    method: str  # the RPC: "tandem.v1.Generation/ChatCompleteStream", "tandem.v1.Engine/Prefill"
    started: float = field(default_factory=time.monotonic)
    request_ids: list[str] = field(default_factory=list)  # of its engine requests
    decode_replicas: list[str] = field(default_factory=list)  # where its streams ran
    prefill_replicas: list[str] = field(default_factory=list)  # where their prompts ran (P/D)
    kv_transfer: str | None = None  # P/D: "remote" (pulled) or "fallback:<reason>"
    first_token_at: float | None = None
    code: str = "OK"  # the call's gRPC status
    _sequences: dict[str, _Sequence] = field(default_factory=dict)
    _prompts: dict[int, int] = field(default_factory=dict)  # prompt identity -> its tokens

    def add_sequence(self, request_id: str, prompt: list[int]) -> None:
        """An engine request began; its choices share a prompt, which counts once."""
        self.request_ids.append(request_id)
        self._sequences[request_id] = _Sequence(prompt_tokens=len(prompt))
        self._prompts.setdefault(id(prompt), len(prompt))

    def observe(self, request_id: str, output_tokens: int, prompt_tokens: int = 0,
                finish_reason: str | None = None) -> None:
        """What a response of engine request ``request_id`` said (running counts)."""
        sequence = self._sequences.get(request_id)
        if sequence is None:
            sequence = self._sequences[request_id] = _Sequence()
            self.request_ids.append(request_id)
        if output_tokens and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        if prompt_tokens:
            sequence.prompt_tokens = prompt_tokens
        sequence.output_tokens = max(sequence.output_tokens, output_tokens)
        if finish_reason:
            sequence.finish_reason = finish_reason

    def note_kv_transfer(self, fallback_reason: str) -> None:
        """P/D: how the prompt's KV reached the decode replica (empty: pulled)."""
        self.kv_transfer = f"fallback:{fallback_reason}" if fallback_reason else "remote"

    def note_replica(self, address: str, part: str) -> None:
        """A replica served part of the request: "decode" (a stream) or "prefill"."""
        replicas = self.decode_replicas if part == "decode" else self.prefill_replicas
        if address and address not in replicas:
            replicas.append(address)

    @property
    def request_id(self) -> str:
        """The request's id: its engine request's, or what its choices' ids (``<id>-<i>``)
        share."""
        ids = self.request_ids
        if len(ids) <= 1:
            return ids[0] if ids else ""
        bases = {rid.rpartition("-")[0] for rid in ids}
        return bases.pop() if len(bases) == 1 and "" not in bases else ",".join(ids)

    def fields(self, now: float | None = None) -> dict[str, Any]:
        """The log line's fields (JSON keys), in the order a reader wants them."""
        now = time.monotonic() if now is None else now
        sequences = self._sequences.values()
        prompt_tokens = (sum(self._prompts.values()) if self._prompts
                         else sum(s.prompt_tokens for s in sequences))
        reasons = sorted({s.finish_reason for s in sequences if s.finish_reason})
        return {
            "request_id": self.request_id,
            "method": self.method,
            "status": self.code,
            "decode_replicas": list(self.decode_replicas),
            "prefill_replicas": list(self.prefill_replicas),
            "kv_transfer": self.kv_transfer,
            "sequences": len(self._sequences),
            "prompt_tokens": prompt_tokens,
            "output_tokens": sum(s.output_tokens for s in sequences),
            "ttft_s": None if self.first_token_at is None
            else round(self.first_token_at - self.started, 6),
            "total_s": round(now - self.started, 6),
            "finish_reason": ",".join(reasons) or None,
        }

    def message(self, fields: dict[str, Any]) -> str:
        """The text line: every field as key=value (lists comma-joined, absent ones left
        out), so the text format carries what the JSON one does."""
        parts = []
        for key, value in fields.items():
            if value is None or value == []:
                continue
            if isinstance(value, list):
                value = ",".join(value)
            parts.append(f"{key}={value}")
        return "request " + " ".join(parts)


def current_request() -> RequestRecord | None:
    """The record of the request the running code serves, if any."""
    return _current.get()


@contextmanager
def request_scope(record: RequestRecord) -> Iterator[RequestRecord]:
    """Make ``record`` the current one for the code run inside (and the tasks it starts)."""
    token = _current.set(record)
    try:
        yield record
    finally:
        _current.reset(token)
