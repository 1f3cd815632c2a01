"""The picker's view of the cluster for one prompt: registry + load + prefix index, frozen.

Owns hashing the prompt into the engines' block-hash chain (once per distinct block size
among the replicas) and assembling one ``ReplicaState`` per known replica. It does not own
choosing (``picker``) or keeping the three sources current (their own modules).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from engine_common.block_hash import BlockHash, hash_prompt_blocks, request_extra_keys
from engine_common.config import DEFAULT_BLOCK_SIZE
from gateway.load import LoadTracker
from gateway.picker import ReplicaState
from gateway.prefix_index import PrefixIndex
from gateway.registry import ReplicaRegistry


@dataclass(frozen=True)
class ClusterSnapshot:
    replicas: list[ReplicaState]
    # The block size the prompt was scored with (the replicas', which must agree).
    block_size: int
    block_hashes: list[BlockHash]


def prompt_block_hashes(
    token_ids: Sequence[int], block_size: int, cache_salt: str = "", lora_name: str = ""
) -> list[BlockHash]:
    """The chain an engine computes for this prompt under this salt and LoRA adapter."""
    return hash_prompt_blocks(token_ids, block_size,
                              request_extra_keys(cache_salt or None, lora_name or None))


def take_snapshot(
    registry: ReplicaRegistry,
    loads: LoadTracker,
    index: PrefixIndex,
    prompt_token_ids: Sequence[int],
    cache_salt: str = "",
    lora_name: str = "",
) -> ClusterSnapshot:
    replicas = registry.replicas()
    sizes = {r.block_size for r in replicas if r.block_size > 0}
    # Replicas that disagree on the block size would need one chain each; the cluster is
    # built with one size, so take the most common and score the others as cold.
    block_size = (
        max(sizes, key=lambda s: sum(r.block_size == s for r in replicas))
        if sizes else DEFAULT_BLOCK_SIZE
    )
    hashes = prompt_block_hashes(prompt_token_ids, block_size, cache_salt, lora_name)
    matched = index.match(hashes)
    now = time.monotonic()
    states = [
        ReplicaState(
            address=r.address,
            role=r.role,
            healthy=r.routable,
            load=loads.view(r.address, now),
            matched_blocks=matched.get(r.address, 0) if r.block_size == block_size else 0,
            lora_adapters=r.lora_adapters,
        )
        for r in replicas
    ]
    return ClusterSnapshot(states, block_size, hashes)
