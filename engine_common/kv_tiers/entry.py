"""The bytes of one stored block: a header with the payload's length and checksum.

Owns the entry format of the tiers that keep bytes outside this process (disk, Redis), so a
corrupted or truncated entry is told from a good one and recomputed instead of read::

    b"TKV1" || uint64 payload length || uint32 crc32(payload) || payload
"""

from __future__ import annotations

import struct
import zlib

_HEADER = struct.Struct("<4sQI")
_MAGIC = b"TKV1"


class CorruptEntry(Exception):
    """A stored entry that does not hold what was stored; ``reason`` says how."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def encode_entry(payload: bytes) -> bytes:
    return _HEADER.pack(_MAGIC, len(payload), zlib.crc32(payload)) + payload


def decode_entry(data: bytes | memoryview, expected_len: int) -> bytes:
    """The payload of ``data``; CorruptEntry("truncated" or "checksum") when it is not whole."""
    if len(data) < _HEADER.size:
        raise CorruptEntry("truncated")
    magic, length, crc = _HEADER.unpack_from(data)
    if magic != _MAGIC:
        raise CorruptEntry("checksum")
    if length != expected_len or len(data) - _HEADER.size != length:
        raise CorruptEntry("truncated")
    payload = bytes(data[_HEADER.size:])
    if zlib.crc32(payload) != crc:
        raise CorruptEntry("checksum")
    return payload
