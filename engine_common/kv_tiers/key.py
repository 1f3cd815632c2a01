"""The key of a block in a tier: a namespace of the KV layout, then the block's hash.

Owns the namespace derivation. The block hash already chains every token before the block
(and the adapter and cache salt, ``block_hash``); the namespace adds what the hash does not
say, the model, dtype and geometry of the bytes (``KvLayout.fingerprint``), so that no
replica ever reads a block of a foreign layout from a shared tier.
"""

from __future__ import annotations

import hashlib

from engine_common.block_hash import BlockHash
from kv_transfer.layout import KvLayout

NAMESPACE_BYTES = 16


def layout_namespace(layout: KvLayout) -> bytes:
    """16 bytes naming the layout, the same in every process that has it."""
    digest = hashlib.sha256(b"tandem/kv-tier/v1\0" + layout.fingerprint().encode()).digest()
    return digest[:NAMESPACE_BYTES]


def tier_key(namespace: bytes, block_hash: BlockHash) -> bytes:
    return namespace + block_hash
