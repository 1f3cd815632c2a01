"""What every tier offers the worker, and the per-tier counters.

Owns the ``Tier`` protocol and ``TierStats``. A tier stores and returns a block's payload by
key; ``get`` returns None on a miss and raises ``TierFailure`` (with its reason) when the
entry exists but cannot be used or the tier cannot be reached; ``put`` returns the keys it
evicted to make room. Tiers are called from the worker's thread only, except ``contains``
(the scheduler's cheap probe), which must be safe from any thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

# The media in KV events and metrics, fastest first (vLLM names its tiers "GPU" and "CPU").
DEVICE, HOST, DISK, SHARED = "device", "host", "disk", "shared"


class TierFailure(Exception):
    """A tier could not serve or take a block; ``reason`` is a metric label."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class Tier(Protocol):
    medium: str

    def get(self, key: bytes) -> bytes | None: ...

    def put(self, key: bytes, payload: bytes) -> list[bytes]: ...

    def contains(self, key: bytes) -> bool | None:
        """True or False when known cheaply; None when only a get can tell (a remote tier)."""
        ...

    def close(self) -> None: ...


@dataclass
class TierStats:
    """One tier's counters since the last ``KvTiers.take_stats`` (blocks, bytes, seconds)."""

    hits: int = 0  # blocks loaded from this tier
    bytes_loaded: int = 0
    load_seconds: float = 0.0
    stores: int = 0
    bytes_stored: int = 0
    store_seconds: float = 0.0
    evictions: int = 0
    dropped_stores: int = 0  # back-pressure: the worker's queue was full
    failures: dict[str, int] = field(default_factory=dict)  # by reason

    def fail(self, reason: str) -> None:
        self.failures[reason] = self.failures.get(reason, 0) + 1

    def add(self, other: TierStats) -> None:
        for name in ("hits", "bytes_loaded", "load_seconds", "stores", "bytes_stored",
                     "store_seconds", "evictions", "dropped_stores"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for reason, count in other.failures.items():
            self.failures[reason] = self.failures.get(reason, 0) + count
