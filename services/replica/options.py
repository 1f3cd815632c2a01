"""One replica's options (``tandem serve``'s flags as a record) and the roles it may take.

Owns the record and its checks; it imports nothing heavy, so that the command line can
parse, check and answer ``--help`` before torch loads. It does not own the flags
(``main``, ``engine_flags``) or serving (``server``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine_common.config import EngineConfig
from services.frontend.responses.store import DEFAULT_MAX_STORED_RESPONSES
from services.replica.engine_flags import MAX_PINNED_FRACTION, MAX_WAITING, SHUTDOWN_GRACE_S
from services.suite_tls import SuiteTls

ROLES = ("both", "prefill", "decode")


@dataclass
class ReplicaOptions:
    engine: EngineConfig
    role: str = "both"
    # Bind what you advertise: loopback unless told otherwise (a pod binds 0.0.0.0).
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = 9400  # 0: no /metrics endpoint
    # The names clients use (--served-model-name; the first names answers and metrics).
    served_model_name: str | Sequence[str] | None = None
    # Requests admitted beyond engine.scheduler.max_num_seqs before RESOURCE_EXHAUSTED.
    max_waiting: int = MAX_WAITING
    # Responses kept for previous_response_id and GET /v1/responses/{id}; 0: none.
    max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES
    shutdown_grace_s: float = SHUTDOWN_GRACE_S
    # Mutual TLS with the suite's other processes (every caller of this port, and the
    # prefill replicas this one dials); None: plaintext.
    tls: SuiteTls | None = None
    # A prefill replica lets one caller (a decode replica) keep at most this fraction of its
    # KV blocks pinned for pulls.
    max_pinned_fraction: float = MAX_PINNED_FRACTION
    # A plaintext port answering grpc.health.v1 only, for probes without the suite's
    # certificate (a kubelet's); 0: none.
    health_port: int = 0
    # A decode replica asks its prefill replicas to announce KV as it becomes final and pulls
    # it while they compute the rest (--kv-overlap).
    kv_overlap: bool = False

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not 0 < self.max_pinned_fraction <= 1:
            raise ValueError("--kv-max-pinned-fraction must be in (0, 1], got "
                             f"{self.max_pinned_fraction}")
