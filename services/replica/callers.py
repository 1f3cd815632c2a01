"""Who started which work on this replica, so that one caller cannot undo or crowd out
another's.

Every call of the internal Engine API comes from a suite member (mutual TLS,
``services.suite_tls``), and every member holds the same suite certificate, so a caller is
told apart by its network address. This module owns three rules over that identity:
``Abort`` stops only requests the same caller started with ``Generate``; ``ReleaseKv`` frees
only blocks prefilled for the same caller; and one caller keeps at most ``max_pinned_blocks``
of a prefill replica's blocks pinned at once (leases it did not release count until they
end), so that no decode replica, misbehaving or not, pins the whole cache. It does not own
the blocks (the engine core's leases free them) or the RPCs (``engine_servicer``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc

from services.frontend.errors import AlreadyExists, Overloaded, ServiceError
from services.replica.kv_address import caller_host

LOCAL_CALLER = "local"


class PermissionDenied(ServiceError):
    code = grpc.StatusCode.PERMISSION_DENIED


def caller_of(peer: str) -> str:
    """A caller's identity from ``ServicerContext.peer()``: its host (a Unix socket: local)."""
    return caller_host(peer) or LOCAL_CALLER


@dataclass
class _Pinned:
    caller: str
    blocks: int
    lease_deadline: float  # unix seconds, as the KV handle says


class CallerScopes:
    def __init__(self, max_pinned_blocks: int) -> None:
        self.max_pinned_blocks = max_pinned_blocks
        self._generating: dict[str, str] = {}  # request id -> its caller
        self._pinned: dict[str, _Pinned] = {}  # request id -> what its Prefill pinned

    # ----------------------------------------------------------------- Generate / Abort
    def started(self, request_id: str, caller: str) -> None:
        self._generating[request_id] = caller

    def finished(self, request_id: str) -> None:
        self._generating.pop(request_id, None)

    def abortable(self, request_ids: list[str], caller: str) -> list[str]:
        """The ids among ``request_ids`` that ``caller`` itself started."""
        return [rid for rid in request_ids if self._generating.get(rid) == caller]

    # ----------------------------------------------------------------- Prefill / ReleaseKv
    def pinned_by(self, caller: str, now: float | None = None) -> int:
        now = time.time() if now is None else now
        self._pinned = {rid: p for rid, p in self._pinned.items() if p.lease_deadline > now}
        return sum(p.blocks for p in self._pinned.values() if p.caller == caller)

    def check_pin(self, caller: str, blocks: int) -> None:
        """Refuse (RESOURCE_EXHAUSTED) a prefill that would take ``caller`` over its cap."""
        held = self.pinned_by(caller)
        if held + blocks > self.max_pinned_blocks:
            raise Overloaded(
                f"this caller holds {held} pinned KV blocks on this prefill replica and the "
                f"prompt needs {blocks} more; one caller may hold {self.max_pinned_blocks} "
                "(release pulled blocks with ReleaseKv, or retry later)")

    def check_new(self, request_id: str) -> None:
        """Refuse (ALREADY_EXISTS) a prefill under an id whose blocks are still pinned."""
        pinned = self._pinned.get(request_id)
        if pinned is not None and pinned.lease_deadline > time.time():
            raise AlreadyExists("this request id's blocks are still pinned here; release them "
                                "(ReleaseKv) or use a new id")

    def pin(self, request_id: str, caller: str, blocks: int, lease_deadline: float) -> None:
        self._pinned[request_id] = _Pinned(caller, blocks, lease_deadline)

    def check_release(self, request_id: str, caller: str) -> None:
        """Refuse (PERMISSION_DENIED) a release of blocks prefilled for another caller."""
        pinned = self._pinned.get(request_id)
        if pinned is not None and pinned.caller != caller:
            raise PermissionDenied("these blocks were prefilled for another caller; only it "
                                   "may release them (or their lease ends)")

    def released(self, request_id: str) -> None:
        self._pinned.pop(request_id, None)
