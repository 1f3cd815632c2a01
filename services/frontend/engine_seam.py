"""The seam between the front end and an engine: what goes in, what comes back.

The front end (the OpenAI-shaped ``tandem.v1.Generation`` API) runs every request through a
``GenerateFn``: an async callable that takes one ``GenerationRequest`` (the engine's own
record, ``engine_common.generation_request``) with the ``CallContext`` of the public call it
belongs to, streams ``GenerationDelta``s, and aborts the request when its iterator is closed
early. A replica plugs in its local engine (``services.replica.local_engine``), the gateway the
replicas behind it (``gateway.remote_engine``). This module holds the records only.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine_common.generation_request import GenerationRequest
from engine_common.outputs import KvTransferReport


@dataclass
class CallContext:
    """What the engine requests of one public call share, passed to the engine explicitly.

    ``deadline``: ``time.monotonic()`` after which the client no longer waits (None: no
    deadline). ``prefill_peer``: P/D, the prefill replica (host:port) a decode replica asks
    for the prompt's KV, chosen outside this process (by the endpoint picker's
    ``x-prefiller-host-port``, or by the gateway). ``routes``: an engine that routes (the
    gateway) remembers here where the call's earlier streams went, so that the ``n`` choices
    of one prompt land on one replica's prefix cache; nothing else reads it.
    ``response_headers``: what the engine has the public call answer in its response
    headers, sent before the first response (``routing_headers``).
    """

    deadline: float | None = None
    prefill_peer: str | None = None
    routes: dict[Hashable, Any] = field(default_factory=dict)
    response_headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def within(cls, seconds: float | None, prefill_peer: str | None = None) -> CallContext:
        """A context whose deadline is ``seconds`` from now (None: none)."""
        deadline = None if seconds is None else time.monotonic() + seconds
        return cls(deadline=deadline, prefill_peer=prefill_peer)

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()


@dataclass(frozen=True)
class TokenChoice:
    """One candidate token at an output position."""

    token_id: int
    token: str  # the token decoded on its own
    logprob: float
    rank: int  # 1 = most likely


@dataclass(frozen=True)
class PositionLogprobs:
    sampled: TokenChoice
    top: list[TokenChoice]  # best first


@dataclass
class GenerationDelta:
    """What one engine step added to a request, plus its running token counts."""

    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length" or "abort" on the last delta
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    kv_transfer: KvTransferReport | None = None  # P/D: how the prompt's KV got here
    # With the first token, when asked for: prompt positions 1 on ("sampled" is the prompt's
    # own token there).
    prompt_logprobs: list[PositionLogprobs] | None = None


class GenerateFn(Protocol):
    """Streams a request's deltas; closing the iterator early must abort the request."""

    def __call__(self, request_id: str, request: GenerationRequest,
                 call: CallContext) -> AsyncGenerator[GenerationDelta, None]:
        ...
