"""The KV connector interface: what a prefill replica offers and a decode replica pulls.

Owns the contract between the engine and any transport: the producer side pins a
finished prefill's blocks under a lease and serves them until the lease ends; the
consumer side pulls given remote blocks into given local blocks. It owns the records that
cross the engine/transport boundary (``KvHandle``, ``TransferResult``) and the one error
type (``KvTransferError``, whose ``reason`` the engine turns into a fallback decision).

It does not own block allocation or freeing: the engine does. The producer only tells the
engine, through ``on_release``, that a lease has ended and the blocks may be freed.

Threading: every method is synchronous and thread-safe and never waits on the network;
work that does (serving, pulling) runs on the transport's own thread, and ``pull`` hands
back a ``concurrent.futures.Future``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Literal, get_args

TransferFailure = Literal[
    "unreachable",  # no connection to the producer, or it dropped mid-transfer
    "timeout",  # the pull did not finish within its timeout
    "layout_mismatch",  # the two sides' KvLayout fingerprints differ
    "tensor_parallel",  # a side has several ranks and per-rank pulls cannot serve the pairing
    "unknown_request",  # the producer holds no lease for the request (never pinned, or released)
    "lease_expired",  # the lease ran out before the pull
    "protocol",  # a malformed or unexpected message
]
TRANSFER_FAILURES: frozenset[str] = frozenset(get_args(TransferFailure))

# Called with (request_id, block_ids) when a lease ends, by release or by expiry.
ReleaseCallback = Callable[[str, list[int]], None]


class KvTransferError(Exception):
    """A pull that failed; ``reason`` is one of ``TRANSFER_FAILURES``."""

    def __init__(self, reason: TransferFailure, detail: str = ""):
        if reason not in TRANSFER_FAILURES:
            raise ValueError(f"unknown KV transfer failure reason {reason!r}")
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason: TransferFailure = reason
        self.detail = detail


@dataclass(frozen=True)
class KvHandle:
    """Everything a consumer needs to pull a pinned request's blocks."""

    engine_id: str
    host: str
    port: int
    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    lease_deadline: float  # unix seconds
    layout_fingerprint: str
    # The producer replica's tensor-parallel ranks (its layout's; the handshake carries it).
    tensor_parallel_size: int = 1

    @property
    def lease_generation(self) -> int:
        """The lease's generation: its deadline in ms, unique per pin on its producer
        (``leases``); a reader confirms it after reading (``ucx_connector``)."""
        return round(self.lease_deadline * 1000)


@dataclass(frozen=True)
class TransferResult:
    num_blocks: int
    num_bytes: int
    seconds: float
    transport: str = ""  # what carried the bytes, e.g. "shm", "tcp" (see ucp_introspection)
    mode: str = ""  # how: "direct" (cache to cache) or "staged" (see transfer_plan)


class KvProducer(ABC):
    """The prefill side: pins blocks under leases and serves them to consumers.

    ``on_release`` is called exactly once per lease, on the thread that ends it (the
    caller of ``release`` or ``expire_leases``), after the lease is gone and no transfer
    reads its blocks any more. The engine frees blocks there and nowhere else; the lists
    that ``release`` and ``expire_leases`` return are the same blocks, for logging and
    tests, not to be freed a second time.
    """

    on_release: ReleaseCallback | None = None

    @abstractmethod
    def start(self) -> tuple[str, int]:
        """Start serving; return the (host, port) consumers connect to."""

    @abstractmethod
    def pin(
        self,
        request_id: str,
        block_ids: Sequence[int],
        num_tokens: int,
        lease_seconds: float,
    ) -> KvHandle:
        """Hold ``block_ids`` for ``request_id`` until released or ``lease_seconds`` pass."""

    @abstractmethod
    def release(self, request_id: str) -> list[int]:
        """End the request's lease; return its block ids ([] when it holds none)."""

    @abstractmethod
    def expire_leases(self, now: float) -> list[tuple[str, list[int]]]:
        """End every lease whose deadline is before ``now`` (unix seconds)."""

    @abstractmethod
    def close(self) -> None:
        """Stop serving. Leases still held are dropped without ``on_release``."""


class KvConsumer(ABC):
    """The decode side: pulls remote blocks into local blocks the engine allocated."""

    @abstractmethod
    def pull(
        self,
        handle: KvHandle,
        remote_block_ids: Sequence[int],
        local_block_ids: Sequence[int],
        timeout: float,
    ) -> Future[TransferResult]:
        """Copy ``remote_block_ids[i]`` of the handle's producer into ``local_block_ids[i]``.

        The future fails with ``KvTransferError``; the local blocks' contents are then
        undefined. Raises ValueError at once for ids that cannot be valid.
        """

    @abstractmethod
    def close(self) -> None:
        """Drop every connection; pulls still running fail."""
