"""The shared tier: block payloads in Redis, read and written by every replica.

Owns the connection, the key prefix and the back-off after a failure. A Redis that is down,
slow (past ``timeout``) or full (``maxmemory`` with ``noeviction``: writes refused) never
fails a request: a get is a miss, a put is dropped, each counted by reason; after a failure
the tier is skipped for ``backoff`` seconds, so requests do not each wait out a timeout.
Entries carry a checksum (``entry``) and expire after ``ttl`` seconds.
"""

from __future__ import annotations

import time

import redis

from engine_common.kv_tiers.entry import CorruptEntry, decode_entry, encode_entry
from engine_common.kv_tiers.tier import SHARED, TierFailure

_PREFIX = b"tandem:kv:"


class RedisTier:
    medium = SHARED

    def __init__(self, url: str, payload_bytes: int, *, password: str | None = None,
                 tls_ca: str | None = None, timeout: float = 0.05, ttl: int = 86400,
                 backoff: float = 1.0) -> None:
        kwargs: dict[str, object] = {"socket_timeout": timeout,
                                     "socket_connect_timeout": timeout}
        if password is not None:
            kwargs["password"] = password
        if tls_ca is not None:
            kwargs["ssl_ca_certs"] = tls_ca
        self._client = redis.Redis.from_url(url, **kwargs)  # type: ignore[arg-type]
        self.payload_bytes = payload_bytes
        self.ttl = ttl
        self.backoff = backoff
        self._down_until = 0.0

    def _call(self, fn, *args):  # type: ignore[no-untyped-def]
        if time.monotonic() < self._down_until:
            raise TierFailure("backoff")
        try:
            return fn(*args)
        except redis.exceptions.TimeoutError as exc:
            reason, detail = "slow", str(exc)
        except redis.exceptions.ConnectionError as exc:
            reason, detail = "down", str(exc)
        except redis.exceptions.OutOfMemoryError as exc:
            # Reads still work, only stores are refused: no back-off.
            raise TierFailure("full", str(exc)[:200]) from None
        except redis.exceptions.RedisError as exc:
            reason, detail = "error", str(exc)
        self._down_until = time.monotonic() + self.backoff
        raise TierFailure(reason, detail[:200])

    def get(self, key: bytes) -> bytes | None:
        data = self._call(self._client.get, _PREFIX + key)
        if data is None:
            return None
        try:
            return decode_entry(data, self.payload_bytes)
        except CorruptEntry as exc:
            raise TierFailure(exc.reason, f"shared entry {key.hex()[:16]}") from None

    def put(self, key: bytes, payload: bytes) -> list[bytes]:
        self._call(self._client.set, _PREFIX + key, encode_entry(payload), self.ttl)
        return []  # Redis evicts by its own policy, unseen here

    def contains(self, key: bytes) -> bool | None:
        return None

    def close(self) -> None:
        self._client.close()
