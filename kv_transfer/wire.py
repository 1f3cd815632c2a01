"""The KV transfer wire format: header messages and how a payload is cut into messages.

Owns the bytes on the wire: the consumer's request header, the producer's status
header, their framing, and the payload chunking rule both sides must compute alike.
It does not own who sends what when (``ucx_connector``).

Headers are one UCX message each: a 4-byte little-endian length, then that many bytes
of UTF-8 JSON carrying ``"v": PROTOCOL_VERSION``. A receiver posts a buffer of
``HEADER_CAPACITY`` bytes (UCX accepts a message shorter than the posted buffer) and
reads the length, so a header costs one message, not a length message and a body.
``HEADER_CAPACITY`` bounds a request to roughly 30,000 block ids.

The payload is the staging buffer ``[num_layers, 2, n, block_size, heads, head_size]``
sent as consecutive messages of ``layers_per_chunk`` layers each (the last may hold
fewer), ``nbytes`` in all; layers are the outermost dimension, so each chunk is one
contiguous slice.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kv_transfer.connector import TRANSFER_FAILURES, KvTransferError

PROTOCOL_VERSION = 1
HEADER_CAPACITY = 256 * 1024
STATUS_OK = "ok"
_LENGTH = struct.Struct("<I")


def header_buffer() -> np.ndarray:
    """A buffer to receive any header into."""
    return np.empty(HEADER_CAPACITY, dtype=np.uint8)


def _frame(message: dict[str, Any]) -> np.ndarray:
    body = json.dumps({"v": PROTOCOL_VERSION, **message}, separators=(",", ":")).encode()
    if _LENGTH.size + len(body) > HEADER_CAPACITY:
        raise ValueError(f"header of {len(body)} bytes exceeds {HEADER_CAPACITY}")
    return np.frombuffer(_LENGTH.pack(len(body)) + body, dtype=np.uint8)


def _unframe(buffer: np.ndarray, what: str) -> dict[str, Any]:
    (length,) = _LENGTH.unpack(buffer[: _LENGTH.size].tobytes())
    if length > HEADER_CAPACITY - _LENGTH.size:
        raise KvTransferError("protocol", f"{what} claims {length} bytes")
    try:
        message = json.loads(buffer[_LENGTH.size : _LENGTH.size + length].tobytes())
    except ValueError as exc:
        raise KvTransferError("protocol", f"{what} is not JSON: {exc}") from None
    if not isinstance(message, dict) or message.get("v") != PROTOCOL_VERSION:
        raise KvTransferError("protocol", f"{what} has an unknown version or shape")
    return message


@dataclass(frozen=True)
class BlockRequest:
    """Consumer -> producer: send me these blocks of this request."""

    request_id: str
    block_ids: list[int]
    fingerprint: str  # the consumer's KvLayout fingerprint

    def encode(self) -> np.ndarray:
        return _frame(
            {
                "request_id": self.request_id,
                "block_ids": self.block_ids,
                "fingerprint": self.fingerprint,
            }
        )

    @classmethod
    def decode(cls, buffer: np.ndarray) -> BlockRequest:
        message = _unframe(buffer, "request")
        request_id = message.get("request_id")
        block_ids = message.get("block_ids")
        fingerprint = message.get("fingerprint")
        if (
            not isinstance(request_id, str)
            or not isinstance(fingerprint, str)
            or not isinstance(block_ids, list)
            or not all(isinstance(b, int) for b in block_ids)
        ):
            raise KvTransferError("protocol", "malformed request header")
        return cls(request_id, block_ids, fingerprint)


@dataclass(frozen=True)
class TransferStatus:
    """Producer -> consumer: "ok" and how the payload comes, or why it does not."""

    status: str  # STATUS_OK or a KvTransferError reason
    nbytes: int = 0
    layers_per_chunk: int = 0
    detail: str = ""

    def encode(self) -> np.ndarray:
        return _frame(
            {
                "status": self.status,
                "nbytes": self.nbytes,
                "layers_per_chunk": self.layers_per_chunk,
                "detail": self.detail,
            }
        )

    @classmethod
    def decode(cls, buffer: np.ndarray) -> TransferStatus:
        message = _unframe(buffer, "status")
        status = message.get("status")
        nbytes = message.get("nbytes")
        layers_per_chunk = message.get("layers_per_chunk")
        if (
            status not in TRANSFER_FAILURES | {STATUS_OK}
            or not isinstance(nbytes, int)
            or not isinstance(layers_per_chunk, int)
        ):
            raise KvTransferError("protocol", f"malformed status header {message!r}")
        return cls(status, nbytes, layers_per_chunk, str(message.get("detail", "")))

    def raise_for_failure(self) -> None:
        if self.status != STATUS_OK:
            raise KvTransferError(self.status, self.detail)  # type: ignore[arg-type]


def layer_chunks(num_layers: int, layers_per_chunk: int) -> list[tuple[int, int]]:
    """The [start, stop) layer ranges of the payload's messages."""
    return [
        (start, min(num_layers, start + layers_per_chunk))
        for start in range(0, num_layers, layers_per_chunk)
    ]


def layers_per_chunk(num_layers: int, nbytes: int, chunk_bytes: int) -> int:
    """The most whole layers that fit in ``chunk_bytes`` (at least one)."""
    bytes_per_layer = max(1, nbytes // num_layers)
    return max(1, min(num_layers, chunk_bytes // bytes_per_layer))


def as_wire(chunk: torch.Tensor) -> Any:
    """A contiguous tensor as bytes ucxx can send from or receive into, without a copy."""
    flat = chunk.reshape(-1).view(torch.uint8)
    # numpy for host memory (buffer protocol; numpy has no bfloat16, hence uint8); CUDA
    # tensors expose __cuda_array_interface__, which ucxx reads directly.
    return flat if flat.is_cuda else flat.numpy()
