"""The admission filter: a block is stored in the tiers once it has been seen N times.

Owns the sighting counts (a bounded LRU of block hashes). With N = 1 every computed block is
stored; with N = 2 a block is stored the second time it is computed or hit, so one-off
prompts do not push reused prefixes out of the tiers (LMCache's and vLLM's users' request).
"""

from __future__ import annotations

from collections import OrderedDict

from engine_common.block_hash import BlockHash


class AdmissionFilter:
    def __init__(self, admit_after: int, capacity: int = 1 << 18) -> None:
        if admit_after < 1:
            raise ValueError(f"admit_after must be at least 1, got {admit_after}")
        self.admit_after = admit_after
        self.capacity = capacity
        self._seen: OrderedDict[BlockHash, int] = OrderedDict()

    def admit(self, block_hash: BlockHash) -> bool:
        """Count one sighting; True when the block has now been seen often enough."""
        if self.admit_after == 1:
            return True
        count = self._seen.pop(block_hash, 0) + 1
        self._seen[block_hash] = count
        if len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
        return count >= self.admit_after
