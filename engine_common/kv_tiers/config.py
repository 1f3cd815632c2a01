"""The settings of the KV tiers (the replica's ``--kv-offload-*`` and ``--kv-store`` flags).

Owns the record only; ``tiers.KvTiers`` builds the tiers it names.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class KvTiersConfig:
    # Host-memory tier: bytes of block copies kept per replica; 0: none.
    memory_bytes: int = 0
    # Disk tier: a directory holding one LMDB store; None: none.
    disk_dir: str | None = None
    disk_bytes: int = 4 << 30  # the store's map size: its most bytes on disk
    # Shared tier: "redis://host:port/db" or "rediss://..." (TLS); None: none.
    store_url: str | None = None
    store_password: str | None = None  # else the URL's, else $TANDEM_KV_STORE_PASSWORD
    store_tls_ca: str | None = None  # a CA bundle for rediss://
    store_timeout_seconds: float = 0.05  # one Redis call: slower is a miss ("slow")
    store_ttl_seconds: int = 24 * 3600  # entries expire in Redis after this
    # A block is stored once it has been seen (computed or hit) this many times.
    admit_after: int = 1
    # Block copies waiting for the worker; past this, stores are dropped (back-pressure).
    max_pending_stores: int = 256
    # A load that takes longer than this stops, and the rest of the prompt is recomputed.
    max_load_seconds: float = 1.0

    @property
    def enabled(self) -> bool:
        return self.memory_bytes > 0 or self.disk_dir is not None or self.store_url is not None

    def check(self) -> None:
        if self.memory_bytes < 0 or self.disk_bytes <= 0:
            raise ValueError("KV tier sizes must be positive")
        if self.admit_after < 1:
            raise ValueError(f"admit_after must be at least 1, got {self.admit_after}")
        if self.max_pending_stores < 1 or self.max_load_seconds <= 0:
            raise ValueError("max_pending_stores and max_load_seconds must be positive")
        if self.store_url is not None and not self.store_url.startswith(("redis://",
                                                                         "rediss://")):
            raise ValueError(f"--kv-store must be a redis:// or rediss:// URL, got "
                             f"{self.store_url[:80]!r}")
