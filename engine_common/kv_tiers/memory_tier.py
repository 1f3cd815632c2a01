"""The host-memory tier: block payloads in this process's memory, least recently used out.

Owns the byte budget and the LRU order. Nothing here survives the process.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from engine_common.kv_tiers.tier import HOST


class HostMemoryTier:
    medium = HOST

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"the host-memory tier needs a positive size, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._entries: OrderedDict[bytes, bytes] = OrderedDict()
        # NOTE: contains() is called from the scheduler's thread, the rest from the worker's.
        self._lock = threading.Lock()

    def get(self, key: bytes) -> bytes | None:
        with self._lock:
            payload = self._entries.get(key)
            if payload is not None:
                self._entries.move_to_end(key)
            return payload

    def put(self, key: bytes, payload: bytes) -> list[bytes]:
        if len(payload) > self.capacity_bytes:
            return []
        evicted = []
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.used_bytes -= len(old)
            while self.used_bytes + len(payload) > self.capacity_bytes:
                victim, data = self._entries.popitem(last=False)
                self.used_bytes -= len(data)
                evicted.append(victim)
            self._entries[key] = payload
            self.used_bytes += len(payload)
        return evicted

    def contains(self, key: bytes) -> bool | None:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self.used_bytes = 0
