"""Block hashes for the prefix cache: one chained digest per full block of tokens.

Owns the hash function and its byte encoding. Every process of the cluster (each engine and
the gateway, on any machine) must compute the same chain, so the hash is sha256 over a
canonical encoding, never Python's ``hash()`` or pickle. It does not own which blocks are
cached (``block_pool``) or when hashes are computed (``request``).

Encoding (version 1), all integers little-endian::

    ROOT         = sha256(b"tandem/kv-block/v1").digest()
    block_hash   = sha256(
        (parent if parent is not None else ROOT)     # 32 bytes
        || uint32(len(token_ids))
        || int32(token_ids[0]) || ... || int32(token_ids[-1])
        || for each key in extra_keys: uint32(len(utf8(key))) || utf8(key)
    ).digest()

``extra_keys`` of ``None`` and ``()`` encode the same. Every field is length-prefixed, so two
different (parent, tokens, keys) triples never share an encoding. Changing any of this
changes every digest: bump the version string in ``ROOT`` and the pinned digest in the tests.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes  # a 32-byte sha256 digest

ROOT_BLOCK_HASH: BlockHash = hashlib.sha256(b"tandem/kv-block/v1").digest()

_UINT32 = struct.Struct("<I")


def group_block_key(block_hash: BlockHash, group: int) -> BlockHash:
    """The prefix-cache key of a block of KV cache group ``group`` (``kv_cache_groups``):
    the chain's hash itself for group 0, the hash and the group's number for the others. A
    block of each group holds other layers' KV for the same tokens, so each is its own
    entry; only group 0's are announced in KV events (``is_group_key``)."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")


def is_group_key(key: BlockHash) -> bool:
    """Whether a prefix-cache key is another group's than 0 (not a chain hash)."""
    return len(key) != len(ROOT_BLOCK_HASH)


def encode_extra_keys(extra_keys: tuple[str, ...] | None) -> bytes:
    """The trailing bytes of a block's encoding for these extra keys (e.g. a cache salt)."""
    if not extra_keys:
        return b""
    parts = []
    for key in extra_keys:
        data = key.encode("utf-8")
        parts.append(_UINT32.pack(len(data)))
        parts.append(data)
    return b"".join(parts)


def request_extra_keys(cache_salt: str | None,
                       lora_name: str | None = None) -> tuple[str, ...] | None:
    """The extra keys of every block of a request: its LoRA adapter (the same tokens have
    other KV under another adapter) and its cache salt. Engines and the gateway must agree.
    A salt alone is a 1-tuple (as before adapters existed), an adapter always a 3-tuple, so
    no salt can pass for an adapter."""
    if lora_name:
        return ("lora", lora_name, cache_salt or "")
    return (cache_salt,) if cache_salt else None


def hash_block_tokens(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[str, ...] | None = None,
) -> BlockHash:
    """The digest of one block, chained to its parent block's digest (None for the first)."""
    n = len(token_ids)
    h = hashlib.sha256(ROOT_BLOCK_HASH if parent is None else parent)
    # One pack call for the count and all tokens: much faster than per-token formatting.
    h.update(struct.pack(f"<I{n}i", n, *token_ids))
    if extra_keys:
        h.update(encode_extra_keys(extra_keys))
    return h.digest()


def hash_prompt_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple[str, ...] | None = None,
) -> list[BlockHash]:
    """The chained digests of every full block of ``token_ids`` (a trailing partial block is
    not hashed). Same result as calling ``hash_block_tokens`` block by block."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num_full_blocks = len(token_ids) // block_size
    if num_full_blocks == 0:
        return []
    num_tokens = num_full_blocks * block_size
    # Pack every token once, then hash byte slices of the packed buffer.
    packed = memoryview(struct.pack(f"<{num_tokens}i", *token_ids[:num_tokens]))
    count = _UINT32.pack(block_size)
    suffix = encode_extra_keys(extra_keys)
    stride = 4 * block_size
    hashes: list[BlockHash] = []
    parent = ROOT_BLOCK_HASH
    for start in range(0, 4 * num_tokens, stride):
        h = hashlib.sha256(parent)
        h.update(count)
        h.update(packed[start : start + stride])
        if suffix:
            h.update(suffix)
        parent = h.digest()
        hashes.append(parent)
    return hashes
