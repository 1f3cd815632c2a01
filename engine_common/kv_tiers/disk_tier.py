"""The disk tier: block payloads in one LMDB store (a single memory-mapped file), which a
restarted replica opens and reads again.

Owns the store, its size bound and the order its entries are evicted in (least recently
used within a run; after a restart, the order the keys were found in). Every entry carries
a checksum (``entry``): one that does not match, or is cut short, is deleted and reported as
a failure, and its block is recomputed. One replica per directory.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

import lmdb

from engine_common.kv_tiers.entry import CorruptEntry, decode_entry, encode_entry
from engine_common.kv_tiers.tier import DISK, TierFailure

# The share of entries dropped when the store is full (LMDB cannot say how full it is).
_EVICT_FRACTION = 8


class DiskTier:
    medium = DISK

    def __init__(self, directory: str, capacity_bytes: int, payload_bytes: int) -> None:
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.payload_bytes = payload_bytes
        # NOTE: sync=False: a store is in the OS's page cache when put returns and on disk a
        # moment later; a process that dies keeps it, only a machine that loses power may not.
        self._env = lmdb.open(directory, map_size=capacity_bytes, subdir=True, sync=False,
                              metasync=False, readahead=False, max_readers=126)
        self._lock = threading.Lock()
        self._keys: OrderedDict[bytes, None] = OrderedDict()
        with self._env.begin() as txn:
            for key in txn.cursor().iternext(keys=True, values=False):
                self._keys[bytes(key)] = None

    def get(self, key: bytes) -> bytes | None:
        with self._lock:
            if key not in self._keys:
                return None
            self._keys.move_to_end(key)
        with self._env.begin(buffers=True) as txn:
            data = txn.get(key)
            if data is None:
                return None
            try:
                return decode_entry(data, self.payload_bytes)
            except CorruptEntry as exc:
                reason = exc.reason
        self._delete([key])
        raise TierFailure(reason, f"disk entry {key.hex()[:16]}")

    def put(self, key: bytes, payload: bytes) -> list[bytes]:
        entry = encode_entry(payload)
        evicted: list[bytes] = []
        for _ in range(_EVICT_FRACTION + 1):
            try:
                with self._env.begin(write=True) as txn:
                    txn.put(key, entry)
            except lmdb.MapFullError:
                with self._lock:
                    count = max(1, len(self._keys) // _EVICT_FRACTION)
                    victims = [k for k, _ in zip(self._keys, range(count), strict=False)]
                if not victims:
                    raise TierFailure("full", "the disk store cannot hold one block") from None
                self._delete(victims)
                evicted.extend(victims)
                continue
            with self._lock:
                self._keys[key] = None
                self._keys.move_to_end(key)
            return evicted
        raise TierFailure("full", "the disk store stays full")

    def _delete(self, keys: list[bytes]) -> None:
        with self._env.begin(write=True) as txn:
            for key in keys:
                txn.delete(key)
        with self._lock:
            for key in keys:
                self._keys.pop(key, None)

    def keys(self) -> list[bytes]:
        """Every key the store holds (what a restarted replica found)."""
        with self._lock:
            return list(self._keys)

    def contains(self, key: bytes) -> bool | None:
        with self._lock:
            return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def close(self) -> None:
        self._env.sync(True)
        self._env.close()
