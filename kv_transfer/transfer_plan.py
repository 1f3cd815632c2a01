"""How one pull's bytes are cut into UCX messages: straight between the two caches, or staged.

Owns the choice between the two ways a pull moves and the list of messages each implies,
which producer and consumer must compute identically (message i of a pull travels under
tag ``wire.payload_tag(connection, seq, i)``):

- **direct**: every run of blocks consecutive in both caches is one contiguous stretch of
  bytes in each (the cache is block-major: a block holds every layer's K and V), and is
  moved from the producer's cache straight into the consumer's: one message (or one read)
  per run, however many layers, no staging buffer, no copy but the transport's own.
- **staged**: otherwise, the producer gathers the blocks into a contiguous staging buffer
  ``[num_layers, 2, n, heads, block_size, head_size]``, sends it in layer chunks, and the
  consumer scatters each chunk into its blocks as it arrives.

Why not always direct: a message costs a fixed ~tens of microseconds of Python and UCX
bookkeeping on each side, so direct pays only while a message is large; with blocks of a
few KiB (tiny models) scattered blocks make many small messages, and then two memcpys are
cheaper. A block of the default model is 360 KiB, so its pulls always go direct
(``bench/kv_transfer_bandwidth.py`` measures both). It does not own the copies
(``block_copy``) or the sending (``ucx_connector``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kv_transfer.connector import KvTransferError
from kv_transfer.layout import KvLayout

# "read": a direct plan that the consumer reads itself (ucx_rma), as pulls report it;
# "ranks": every tensor-parallel rank read its own heads (rank_reader).
Mode = Literal["direct", "staged", "read", "ranks"]

# A pull goes direct when its messages average at least this many bytes (see the module
# docstring; the crossover measured by bench/kv_transfer_bandwidth.py).
DIRECT_MIN_MESSAGE_BYTES = 128 * 1024
# Staged chunks: at most this many bytes per message.
DEFAULT_CHUNK_BYTES = 8 * 2**20
# Bounds what a consumer may ask of a producer (tags leave 20 bits for the index).
MAX_MESSAGES = 2**20


@dataclass(frozen=True)
class Run:
    """``count`` blocks consecutive in both caches: remote ``remote_start..`` into local
    ``local_start..``."""

    remote_start: int
    local_start: int
    count: int


@dataclass(frozen=True)
class TransferPlan:
    mode: Mode
    runs: tuple[Run, ...] = ()  # direct
    layers_per_chunk: int = 0  # staged


    def layer_chunks(self, layout: KvLayout) -> list[tuple[int, int]]:
        """The [start, stop) layer ranges of a staged payload's messages."""
        step = self.layers_per_chunk
        return [(start, min(layout.num_layers, start + step))
                for start in range(0, layout.num_layers, step)]

    def num_messages(self, layout: KvLayout) -> int:
        if self.mode == "direct":
            return len(self.runs)  # message i is runs[i]
        return len(self.layer_chunks(layout))

    def to_wire(self) -> dict[str, Any]:
        if self.mode == "direct":
            return {"mode": "direct",
                    "runs": [[r.remote_start, r.local_start, r.count] for r in self.runs]}
        return {"mode": "staged", "layers_per_chunk": self.layers_per_chunk}

    @classmethod
    def from_wire(cls, message: object, layout: KvLayout, block_ids: Sequence[int]) -> TransferPlan:
        """The plan a consumer asked for, checked against the blocks it asked for."""
        if not isinstance(message, dict):
            raise KvTransferError("protocol", "the request has no transfer plan")
        if message.get("mode") == "staged":
            per_chunk = message.get("layers_per_chunk")
            if not isinstance(per_chunk, int) or not 1 <= per_chunk <= layout.num_layers:
                raise KvTransferError("protocol", f"bad layers_per_chunk {per_chunk!r}")
            return cls("staged", layers_per_chunk=per_chunk)
        if message.get("mode") != "direct":
            raise KvTransferError("protocol", "unknown transfer mode")
        raw = message.get("runs")
        if not isinstance(raw, list) or not all(
                isinstance(r, list) and len(r) == 3 and all(isinstance(x, int) for x in r)
                for r in raw):
            raise KvTransferError("protocol", "malformed runs")
        plan = cls("direct", runs=tuple(Run(*r) for r in raw))
        covered = [r.remote_start + i for r in plan.runs for i in range(r.count)]
        if covered != list(block_ids) or any(r.count < 1 for r in plan.runs):
            raise KvTransferError("protocol", "the runs do not cover the asked blocks")
        if plan.num_messages(layout) > MAX_MESSAGES:
            raise KvTransferError("protocol", "too many messages")
        return plan


def joint_runs(remote: Sequence[int], local: Sequence[int]) -> list[Run]:
    """Maximal runs of pairs consecutive on both sides, in the given order."""
    runs: list[Run] = []
    for theirs, ours in zip(remote, local, strict=True):
        last = runs[-1] if runs else None
        if last is not None and theirs == last.remote_start + last.count and \
                ours == last.local_start + last.count:
            runs[-1] = Run(last.remote_start, last.local_start, last.count + 1)
        else:
            runs.append(Run(theirs, ours, 1))
    return runs


def layers_per_chunk(layout: KvLayout, num_blocks: int, chunk_bytes: int) -> int:
    """The most whole layers that fit in ``chunk_bytes`` (at least one)."""
    bytes_per_layer = max(1, num_blocks * layout.bytes_per_block // layout.num_layers)
    return max(1, min(layout.num_layers, chunk_bytes // bytes_per_layer))


def plan_transfer(
    layout: KvLayout,
    remote: Sequence[int],
    local: Sequence[int],
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    direct_min_message_bytes: int = DIRECT_MIN_MESSAGE_BYTES,
    allow_direct: bool = True,
) -> TransferPlan:
    """Direct when the runs make messages of ``direct_min_message_bytes`` on average."""
    if allow_direct and remote:
        runs = joint_runs(remote, local)
        nbytes = len(remote) * layout.bytes_per_block
        plan = TransferPlan("direct", runs=tuple(runs))
        messages = plan.num_messages(layout)
        if nbytes >= direct_min_message_bytes * messages and messages <= MAX_MESSAGES:
            return plan
    return TransferPlan("staged", layers_per_chunk=layers_per_chunk(layout, len(remote),
                                                                    chunk_bytes))
