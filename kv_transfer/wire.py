"""The KV transfer wire format: control frames on the TCP connection, and payload tags.

Owns the bytes both sides exchange: the control frames that travel on the consumer's TCP
connection to the producer's listener (hello, welcome, request, status), their framing,
and the UCX tag each payload message carries. It does not own who sends what when
(``ucx_connector``) or how a payload is cut into messages (``transfer_plan``).

A frame is a 4-byte little-endian length, then that many bytes of UTF-8 JSON carrying
``"v"``, the connection's protocol version, at most ``MAX_FRAME_BYTES`` (which bounds a
request to roughly 30,000 block ids). Worker addresses travel base64-encoded.

Versions (rolling upgrades): the consumer's hello carries the version it speaks, and every
later frame of the connection carries the same one. A producer serves ``SUPPORTED_VERSIONS``
(the current one and the previous); a consumer that finds its hello refused (a producer of
the previous version closes the connection on a version it does not know) says hello again
in the previous version, once, and counts it (``ucx_consumer``).
- 3: every pull starts with a request the producer admits ("ok") before any byte moves; a
  reader (shared memory only) then reads and says ``ReadDone``; the final status follows.
- 4: the producer's memory key and layout come once, in the welcome, on shared memory and on
  TCP alike; a read pull sends nothing before its reads, then one ``ReadConfirm`` (the lease
  and its generation), answered by the final status. Sent pulls are as in 3.

Payload messages travel over UCX, each under its own tag (``payload_tag``): a constant
prefix, the consumer's connection number, the pull's sequence number on that connection,
and the message's index in the pull. Tags are matched by the consumer's UCX worker, which
every connection of that process shares, so a tag names one message of one pull of one
connection: a late message of a pull that failed can never land in another pull's buffer.
"""

from __future__ import annotations

import asyncio
import base64
import json
import struct
from dataclasses import dataclass
from typing import Any, Literal

import torch

from kv_transfer.connector import TRANSFER_FAILURES, KvTransferError
from kv_transfer.rank_layout import RankCache

PROTOCOL_VERSION = 4
PREVIOUS_VERSION = 3
SUPPORTED_VERSIONS: tuple[int, ...] = (PREVIOUS_VERSION, PROTOCOL_VERSION)
MAX_FRAME_BYTES = 256 * 1024
STATUS_OK = "ok"
_LENGTH = struct.Struct("<I")

TransportKind = Literal["shm", "tcp"]
TRANSPORT_KINDS: tuple[TransportKind, ...] = ("shm", "tcp")

_TAG_PREFIX = 0x4B56  # "KV": keeps these tags apart from any other user of the worker
_CONNECTION_BITS, _SEQ_BITS, _INDEX_BITS = 16, 8, 24


def payload_tag(connection_id: int, seq: int, index: int) -> int:
    """The UCX tag of message ``index`` of pull ``seq`` on connection ``connection_id``.

    Connection numbers and sequence numbers wrap (16 and 8 bits): a number comes back
    only after 65,536 connections or 256 pulls, long after its messages settled.
    """
    if not 0 <= index < 1 << _INDEX_BITS:
        raise ValueError(f"message index {index} out of range")
    connection = connection_id & ((1 << _CONNECTION_BITS) - 1)
    return (((_TAG_PREFIX << _CONNECTION_BITS | connection) << _SEQ_BITS
             | seq & ((1 << _SEQ_BITS) - 1)) << _INDEX_BITS) | index


# The producer's wire-up message to a TCP reader: above UCX's rendezvous threshold (ucxx sets
# 8 KiB), see ``UcxKvConsumer._until_wired``.
WIRE_UP_BYTES = 64 * 1024


def wire_up_tag(connection_id: int) -> int:
    """The tag of a version 4 TCP reader's wire-up message (the producer's answer is the
    next one): indexes 0 and 1 of pull 0, numbers no pull uses before the connection's
    256th, long after those messages landed."""
    return payload_tag(connection_id, 0, 0)


def encode_frame(message: dict[str, Any], version: int = PROTOCOL_VERSION) -> bytes:
    body = json.dumps({"v": version, **message}, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME_BYTES:
        raise ValueError(f"control frame of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    return _LENGTH.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader, what: str,
                     versions: tuple[int, ...] = (PROTOCOL_VERSION,)) -> dict[str, Any]:
    """The next frame, of one of ``versions``; asyncio.IncompleteReadError when the peer
    closed the connection."""
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if length > MAX_FRAME_BYTES:
        raise KvTransferError("protocol", f"{what} claims {length} bytes")
    body = await reader.readexactly(length)
    try:
        message = json.loads(body)
    except ValueError as exc:
        raise KvTransferError("protocol", f"{what} is not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise KvTransferError("protocol", f"{what} is not a JSON object")
    if message.get("v") not in versions:
        version = message.get("v")
        raise KvTransferError("protocol", f"{what} is of KV protocol version "
                              f"{version if isinstance(version, int) else '?'}; this side "
                              f"speaks {', '.join(map(str, versions))}")
    return message


def _field(message: dict[str, Any], name: str, kind: type, what: str) -> Any:
    value = message.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise KvTransferError("protocol", f"{what}: bad or missing {name!r}")
    return value


def _address(text: Any, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (ValueError, TypeError):
        raise KvTransferError("protocol", f"{what}: bad worker address") from None


@dataclass(frozen=True)
class Hello:
    """Consumer -> producer, first frame: who it expects and how it can be reached."""

    engine_id: str  # the producer the consumer's handle names
    connection_id: int
    prefer: TransportKind  # "shm" only when the producer's address is one of ours
    addresses: dict[str, bytes]  # UCX worker address by transport kind ("tcp": network only)
    read: bool = False  # it can read the producer's cache itself (RMA GET; see ucx_rma)
    version: int = PROTOCOL_VERSION  # the connection's protocol version

    def encode(self) -> bytes:
        return encode_frame({
            "hello": self.engine_id, "connection_id": self.connection_id,
            "prefer": self.prefer, "read": self.read,
            "addresses": {k: base64.b64encode(v).decode() for k, v in self.addresses.items()}},
            self.version)

    @classmethod
    def decode(cls, message: dict[str, Any]) -> Hello:
        what = "hello"
        engine_id = _field(message, "hello", str, what)
        connection_id = _field(message, "connection_id", int, what)
        prefer = message.get("prefer")
        addresses = _field(message, "addresses", dict, what)
        if prefer not in TRANSPORT_KINDS or "tcp" not in addresses or not set(
                addresses) <= set(TRANSPORT_KINDS):
            raise KvTransferError("protocol", f"{what}: bad transport offer")
        return cls(engine_id, connection_id, prefer,
                   {k: _address(v, what) for k, v in addresses.items()},
                   message.get("read") is True, int(message["v"]))


@dataclass(frozen=True)
class ReadableCache:
    """Where a consumer may read the producer's cache by itself: the packed remote key
    of the mapped cache, its address and its number of blocks (row offsets follow)."""

    rkey: bytes
    address: int
    num_blocks: int

    def to_wire(self) -> dict[str, Any]:
        return {"rkey": base64.b64encode(self.rkey).decode(), "address": self.address,
                "num_blocks": self.num_blocks}

    @classmethod
    def from_wire(cls, message: Any, what: str) -> ReadableCache | None:
        if message is None:
            return None
        if not isinstance(message, dict):
            raise KvTransferError("protocol", f"{what}: bad readable cache")
        return cls(_address(message.get("rkey"), what), _field(message, "address", int, what),
                   _field(message, "num_blocks", int, what))


@dataclass(frozen=True)
class Welcome:
    """Producer -> consumer, answering the hello: who it is and how to reach it."""

    engine_id: str
    transport: TransportKind
    address: bytes
    # To a consumer that can read: version 3 only on shm, version 4 on shm and TCP.
    readable: ReadableCache | None = None
    fingerprint: str = ""  # version 4: the producer's KvLayout fingerprint, once per peer
    version: int = PROTOCOL_VERSION
    # Version 4, to a reader: every rank's cache (at its worker's address for this
    # transport), for per-rank pulls (``rank_reader``); an older producer leaves it out,
    # and one from before per-rank TCP reads leaves it out on TCP.
    ranks: tuple[RankCache, ...] | None = None

    def encode(self) -> bytes:
        message: dict[str, Any] = {"welcome": self.engine_id, "transport": self.transport,
                                   "address": base64.b64encode(self.address).decode(),
                                   "readable": self.readable and self.readable.to_wire()}
        if self.version >= 4:
            message["fingerprint"] = self.fingerprint
            if self.ranks is not None:
                message["ranks"] = [rank.to_wire() for rank in self.ranks]
        return encode_frame(message, self.version)

    @classmethod
    def decode(cls, message: dict[str, Any]) -> Welcome:
        what = "welcome"
        transport = message.get("transport")
        if transport not in TRANSPORT_KINDS:
            raise KvTransferError("protocol", f"{what}: bad transport")
        version = int(message["v"])
        fingerprint = _field(message, "fingerprint", str, what) if version >= 4 else ""
        ranks = message.get("ranks") if version >= 4 else None
        if ranks is not None and (not isinstance(ranks, list) or not 1 <= len(ranks) <= 64):
            raise KvTransferError("protocol", f"{what}: bad ranks")
        return cls(_field(message, "welcome", str, what), transport,
                   _address(message.get("address"), what),
                   ReadableCache.from_wire(message.get("readable"), what), fingerprint, version,
                   None if ranks is None else tuple(RankCache.from_wire(r) for r in ranks))


@dataclass(frozen=True)
class BlockRequest:
    """Consumer -> producer: send me these blocks of this request, cut as planned."""

    request_id: str
    block_ids: list[int]
    fingerprint: str  # the consumer's KvLayout fingerprint
    seq: int  # this pull's number on the connection (its payload tags carry it)
    plan: dict[str, Any]  # TransferPlan.to_wire()
    read: bool = False  # version 3: the consumer reads the runs itself (see ReadDone)

    def encode(self, version: int = PROTOCOL_VERSION) -> bytes:
        return encode_frame({"request_id": self.request_id, "block_ids": self.block_ids,
                             "fingerprint": self.fingerprint, "seq": self.seq,
                             "plan": self.plan, "read": self.read}, version)

    @classmethod
    def decode(cls, message: dict[str, Any]) -> BlockRequest:
        what = "request"
        block_ids = _field(message, "block_ids", list, what)
        if not all(isinstance(b, int) and not isinstance(b, bool) for b in block_ids):
            raise KvTransferError("protocol", f"{what}: block ids must be integers")
        return cls(_field(message, "request_id", str, what), block_ids,
                   _field(message, "fingerprint", str, what), _field(message, "seq", int, what),
                   _field(message, "plan", dict, what), message.get("read") is True)


@dataclass(frozen=True)
class ReadDone:
    """Version 3, consumer -> producer, after a read request was admitted: its reads are
    over (they all landed, or ``failed``); the producer answers with the final status."""

    seq: int
    failed: bool = False

    def encode(self) -> bytes:
        return encode_frame({"read_done": self.seq, "failed": self.failed}, PREVIOUS_VERSION)

    @classmethod
    def decode(cls, message: dict[str, Any], seq: int) -> ReadDone:
        done = cls(_field(message, "read_done", int, "read done"), message.get("failed") is True)
        if done.seq != seq:
            raise KvTransferError("protocol", f"read done for pull {done.seq}, not {seq}")
        return done


@dataclass(frozen=True)
class ReadConfirm:
    """Version 4, consumer -> producer, after its reads of a lease's blocks all landed (no
    frame came before them): was the lease of this ``generation`` in force throughout? The
    producer answers with the final status ("ok", or why the bytes must not be kept)."""

    seq: int
    request_id: str  # the lease read (a handle's request id)
    block_ids: list[int]
    generation: int  # KvHandle.lease_generation of the handle read

    def encode(self) -> bytes:
        return encode_frame({"confirm": self.seq, "request_id": self.request_id,
                             "block_ids": self.block_ids, "generation": self.generation})

    @classmethod
    def decode(cls, message: dict[str, Any]) -> ReadConfirm:
        what = "read confirmation"
        block_ids = _field(message, "block_ids", list, what)
        if not all(isinstance(b, int) and not isinstance(b, bool) for b in block_ids):
            raise KvTransferError("protocol", f"{what}: block ids must be integers")
        return cls(_field(message, "confirm", int, what), _field(message, "request_id", str, what),
                   block_ids, _field(message, "generation", int, what))


@dataclass(frozen=True)
class TransferStatus:
    """Producer -> consumer, once per request: "ok" after every payload message of the pull
    was delivered while the lease held, or why the pull failed."""

    status: str  # STATUS_OK or a KvTransferError reason
    nbytes: int = 0
    detail: str = ""

    def encode(self, version: int = PROTOCOL_VERSION) -> bytes:
        return encode_frame({"status": self.status, "nbytes": self.nbytes,
                             "detail": self.detail[:1000]}, version)

    @classmethod
    def decode(cls, message: dict[str, Any]) -> TransferStatus:
        status = message.get("status")
        if status not in TRANSFER_FAILURES | {STATUS_OK}:
            raise KvTransferError("protocol", "status: unknown status")
        return cls(status, _field(message, "nbytes", int, "status"),
                   str(message.get("detail", ""))[:1000])

    def raise_for_failure(self) -> None:
        if self.status != STATUS_OK:
            raise KvTransferError(self.status, self.detail)  # type: ignore[arg-type]


def as_wire(chunk: torch.Tensor) -> Any:
    """A contiguous tensor as bytes ucxx can send from or receive into, without a copy."""
    flat = chunk.reshape(-1).view(torch.uint8)
    # numpy for host memory (buffer protocol; numpy has no bfloat16, hence uint8); CUDA
    # tensors expose __cuda_array_interface__, which ucxx reads directly.
    return flat if flat.is_cuda else flat.numpy()
