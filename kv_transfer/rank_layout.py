"""Which KV heads each tensor-parallel rank holds, and the reads that move them between two
replicas of different parallel sizes.

Owns the split of a model's KV heads over ranks (``kv_head_range``, which the model's
sharding uses too, so cache and transfer agree), a producer rank's cache as a consumer
reads it (``RankCache``, sent in the welcome), the plan that says which producer rank each
of a consumer rank's heads comes from (``plan_heads``), the producer layout a consumer
expects (``producer_layout``) and the byte ranges of one rank's pull (``head_reads``). It
does not own moving the bytes (``rank_reader``) or the lease (``ucx_producer``).

Every rank's cache is block-major, head-major ``[blocks, layers, 2, heads, block_size,
head]`` over its own heads, with the same block ids on every rank of a replica (one block
pool). So a run of heads ``[h0, h1)`` that a consumer rank takes from one producer rank is
one contiguous stretch per (block, layer, K/V) on both sides: ``2 x layers`` reads a block,
strided by each side's own head count. Where both sides hold the same heads (the same
split, or one rank each) those stretches join into one read per run of blocks
(``ucx_rma.coalesce_reads``), the single-rank pull's count. UCX's RMA takes one contiguous
stretch per GET (no strided or iov datatype in 1.21), and a stretch is a few KiB, so
otherwise a reader reads the producer rank's whole blocks (one GET per run, ``block_reads``)
and copies its heads into place itself (``rank_reader``): more bytes, far fewer
operations, and still no gather on the producer.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, replace
from typing import Any

from kv_transfer.connector import KvTransferError
from kv_transfer.layout import ITEM_SIZES, KvLayout
from kv_transfer.ucx_rma import coalesce_reads


def kv_head_range(num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """(first KV head, count) in rank ``rank``'s cache of ``size``: whole heads, as even as
    they go (the first ``KV % N`` ranks one more); one replicated head when ranks outnumber
    them (``N / KV`` ranks share each)."""
    if num_kv_heads < size:
        return rank * num_kv_heads // size, 1
    per_rank, extra = divmod(num_kv_heads, size)
    return rank * per_rank + min(rank, extra), per_rank + (rank < extra)


def total_kv_heads(layout: KvLayout) -> int:
    """A replica's KV heads from one rank's layout (rank 0 holds the most)."""
    size, per_rank = layout.tensor_parallel_size, layout.num_kv_heads
    for total in range(max(1, (per_rank - 1) * size + 1), per_rank * size + 1):
        if kv_head_range(total, 0, size)[1] == per_rank:
            return total
    return per_rank  # replicated: one head per rank


def producer_layout(consumer: KvLayout, total_heads: int, producer_ranks: int) -> KvLayout:
    """The per-rank layout a producer of ``producer_ranks`` ranks of the same model has (its
    rank 0's, whose fingerprint its handles carry)."""
    return replace(consumer, num_kv_heads=kv_head_range(total_heads, 0, producer_ranks)[1],
                   tensor_parallel_size=producer_ranks)


@dataclass(frozen=True)
class RankCache:
    """One producer rank's cache, as consumer ranks read it: its heads, its UCX worker's
    address (the one the welcome's transport reaches: full, shared memory included, or
    network only), the cache's remote key, address and block count. ``tcp_address``: the
    network-only one, which the producer keeps to offer TCP readers (not on the wire)."""

    rank: int
    first_head: int
    num_heads: int
    address: bytes
    rkey: bytes
    base: int
    num_blocks: int
    tcp_address: bytes = b""

    def reached_over(self, kind: str) -> RankCache:
        """This cache as a reader over ``kind`` ("shm" or "tcp") is offered it."""
        return self if kind == "shm" else replace(self, address=self.tcp_address,
                                                  tcp_address=b"")

    def to_wire(self) -> dict[str, Any]:
        return {"rank": self.rank, "first_head": self.first_head, "num_heads": self.num_heads,
                "address": base64.b64encode(self.address).decode(),
                "rkey": base64.b64encode(self.rkey).decode(), "base": self.base,
                "num_blocks": self.num_blocks}

    @classmethod
    def from_wire(cls, message: Any) -> RankCache:
        try:
            ints = [message[k] for k in ("rank", "first_head", "num_heads", "base", "num_blocks")]
            if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ints):
                raise ValueError("negative or not an integer")
            return cls(ints[0], ints[1], ints[2], base64.b64decode(message["address"], validate=True),
                       base64.b64decode(message["rkey"], validate=True), ints[3], ints[4])
        except (KeyError, TypeError, ValueError) as exc:
            raise KvTransferError("protocol", f"welcome: bad rank cache ({exc})") from None


@dataclass(frozen=True)
class HeadRead:
    """A consumer rank's heads ``[first_head, first_head + num_heads)`` from producer rank
    ``producer_rank`` (global head numbers)."""

    producer_rank: int
    first_head: int
    num_heads: int


def plan_heads(producers: list[RankCache], heads: tuple[int, int]) -> list[HeadRead]:
    """Where each of a consumer rank's ``heads`` (first, count) comes from: the first
    producer rank that holds it (a replicated head is read once), consecutive heads of one
    producer rank in one ``HeadRead``. KvTransferError if a head is held by none."""
    reads: list[HeadRead] = []
    first, count = heads
    for head in range(first, first + count):
        source = next((p for p in producers if p.first_head <= head < p.first_head + p.num_heads),
                      None)
        if source is None:
            raise KvTransferError("tensor_parallel", f"no prefill rank holds KV head {head}")
        last = reads[-1] if reads else None
        if last is not None and last.producer_rank == source.rank and \
                last.first_head + last.num_heads == head:
            reads[-1] = replace(last, num_heads=last.num_heads + 1)
        else:
            reads.append(HeadRead(source.rank, head, 1))
    return reads


def head_reads(layout: KvLayout, local_base: int, local_first_head: int, source: RankCache,
               read: HeadRead, remote: list[int], local: list[int]
               ) -> list[tuple[int, int, int]]:
    """The (local address, bytes, remote address) GETs of one ``HeadRead``: block
    ``remote[i]`` of ``source`` into block ``local[i]`` of the local cache at ``local_base``
    (``layout``: the local rank's), fewest first (``coalesce_reads``)."""
    if remote and max(remote) >= source.num_blocks:
        raise KvTransferError("protocol", f"block {max(remote)} is beyond prefill rank "
                              f"{source.rank}'s {source.num_blocks}")
    head_bytes = layout.block_size * layout.head_size * ITEM_SIZES[layout.dtype]
    groups = 2 * layout.num_layers  # (layer, K/V) pairs in a block
    local_group, remote_group = layout.num_kv_heads * head_bytes, source.num_heads * head_bytes
    nbytes = read.num_heads * head_bytes
    local_offset = (read.first_head - local_first_head) * head_bytes
    remote_offset = (read.first_head - source.first_head) * head_bytes
    reads: list[tuple[int, int, int]] = []
    for theirs, ours in zip(remote, local, strict=True):
        local_block = local_base + ours * groups * local_group + local_offset
        remote_block = source.base + theirs * groups * remote_group + remote_offset
        reads.extend((local_block + g * local_group, nbytes, remote_block + g * remote_group)
                     for g in range(groups))
    return coalesce_reads(reads)


def block_reads(layout: KvLayout, staging_base: int, source: RankCache, remote: list[int]
                ) -> list[tuple[int, int, int]]:
    """The GETs of whole blocks ``remote`` of ``source`` (``layout``: the reader's, of the
    same model) into consecutive blocks of a staging buffer at ``staging_base``: one GET
    per run of consecutive remote blocks."""
    if remote and max(remote) >= source.num_blocks:
        raise KvTransferError("protocol", f"block {max(remote)} is beyond prefill rank "
                              f"{source.rank}'s {source.num_blocks}")
    block = replace(layout, num_kv_heads=source.num_heads).bytes_per_block
    return coalesce_reads([(staging_base + i * block, block, source.base + theirs * block)
                           for i, theirs in enumerate(remote)])
