"""The engine core's side of P/D KV transfer: pin on the prefill side, pull on the decode side.

Owns this engine's KV connector (a UCX producer on a prefill replica, a UCX consumer on a
decode replica), the leases of each prefilled request, the pulls in flight, and the hand-off
of lease ends from the transport's thread to the core's loop. It does not free or allocate
blocks: the scheduler does, when this module reports a lease ended (``take_released``) or a
request's pulls ended (``take_finished_pulls``). Everything here is called on the core's loop,
except the producer's release callback, which only queues.

Overlap (``announce_kv``): a prefill-side request's blocks are announced as they become final,
each announcement pinned under a lease of its own (``announcement_lease``), the blocks still
owned by the running request; at finish every block is pinned under the request id, as
without overlap. Ending the request's main lease (release, expiry) or aborting or preempting
it ends its announcement leases first: ``LeaseTable.remove`` waits for a copy reading them,
and a direct send caught reading is told "lease_expired", so a block is never freed under a
reader. On the decode side, a request's pulls are one ``_Receipt``: every announced range is
pulled as it comes, the rest from the result's handle; the receipt ends when every pull has
and the prefill replica's result (or its failure) is in.
"""

from __future__ import annotations

import logging
import queue
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from engine_common.config import KvTransferConfig
from engine_common.outputs import ANNOUNCEMENT_LEASE_SEPARATOR, KvTransferReport
from engine_common.parallel.kv_ranks import ParallelKv
from engine_common.request import Request, RequestStatus
from kv_transfer.connector import KvHandle, KvTransferError, TransferResult
from kv_transfer.layout import KvLayout
from kv_transfer.rank_reader import RankedPulls, RankReader
from kv_transfer.ucx_connector import UcxKvConsumer, UcxKvProducer

logger = logging.getLogger(__name__)


LEASE_SEPARATOR = ANNOUNCEMENT_LEASE_SEPARATOR


def announcement_lease(request_id: str, first_block: int) -> str:
    return f"{request_id}{LEASE_SEPARATOR}{first_block}"


@dataclass
class _Receipt:
    """A decode-side request's prompt KV on its way here."""

    request: Request
    local_block_ids: list[int]  # the prompt's blocks here, in order
    next_block: int  # prompt blocks before this one are here or being pulled
    report: KvTransferReport  # what came so far; fallback_reason: the first failure
    pulls: list[tuple[Future[TransferResult], bool]] = field(default_factory=list)  # (, early)
    result_pulled: bool = False  # the pull from the result's handle has started

    @property
    def failed(self) -> bool:
        return self.report.fallback_reason is not None


class RemoteKv:
    def __init__(self, config: KvTransferConfig, kv_cache: torch.Tensor, layout: KvLayout,
                 engine_id: str, ranks: ParallelKv | None = None, pages_per_block: int = 1):
        """``ranks``: the replica's tensor-parallel ranks (None: one): a producer offers
        every rank's cache to readers, a consumer has each rank read its own heads, from
        producers of any parallel size (``kv_transfer.rank_reader``). ``pages_per_block``:
        blocks a prompt block spans (one per KV cache group); every block index here counts
        them (``KVCacheManager.get_transfer_block_ids``)."""
        if config.role not in ("producer", "consumer"):
            raise ValueError(f"KV transfer role must be 'producer' or 'consumer', got {config.role!r}")
        if config.transport not in ("auto", "tcp"):
            raise ValueError(f"KV transport must be 'auto' or 'tcp', got {config.transport!r}")
        if config.fallback not in ("recompute", "fail"):
            raise ValueError(f"KV transfer fallback must be 'recompute' or 'fail', got {config.fallback!r}")
        self.config = config
        self.layout = layout
        self.pages_per_block = pages_per_block
        self._kv_cache = kv_cache
        self._released: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._receipts: dict[str, _Receipt] = {}
        # Prefill side: each request's announcement leases still in force.
        self._announced: dict[str, list[str]] = {}
        self.producer: UcxKvProducer | None = None
        self.consumer: UcxKvConsumer | None = None
        self.address: tuple[str, int] | None = None
        self._rank_reader: RankReader | None = None
        if config.role == "producer":
            self.producer = UcxKvProducer(
                kv_cache, self.layout, engine_id, host=config.host, port=config.port,
                on_release=lambda lease_id, _blocks: self._released.put(lease_id))
            self.address = self.producer.start()
            if ranks is not None and not kv_cache.is_cuda:
                self.producer.heads = ranks.heads
                self.producer.other_ranks = ranks.gather_caches()
        else:
            ranked = None
            if ranks is not None and not kv_cache.is_cuda:
                self._rank_reader = RankReader(kv_cache, layout, ranks.heads[0], config.host)
                ranked = RankedPulls(layout, ranks.total_heads, self._rank_reader,
                                     ranks.channel())
            self.consumer = UcxKvConsumer(kv_cache, self.layout, host=config.host,
                                          transport=config.transport, ranked=ranked)

    # ------------------------------------------------------------------ producer
    def pin(self, request: Request, block_ids: list[int]) -> KvHandle:
        """Pin every prompt block of a finished prefill under the request id."""
        assert self.producer is not None
        return self.producer.pin(request.request_id, block_ids, request.num_computed_tokens,
                                 self.config.lease_seconds)

    def announce(self, request: Request, first_block: int, block_ids: list[int]) -> KvHandle | None:
        """Pin blocks of a running prefill that just became final (the prompt's blocks
        ``first_block``...) under a lease of their own; None when they cannot be."""
        assert self.producer is not None
        if self._kv_cache.is_cuda:  # the step's kernels may still be writing them
            torch.cuda.synchronize(self._kv_cache.device)
        lease_id = announcement_lease(request.request_id, first_block)
        try:
            handle = self.producer.pin(lease_id, block_ids, request.num_prompt_tokens,
                                       self.config.lease_seconds)
        except ValueError:  # a lease of that id exists: announce nothing more
            logger.warning("cannot announce %s's blocks from %d", request.request_id, first_block)
            return None
        self._announced.setdefault(request.request_id, []).append(lease_id)
        return handle

    def end_announcements(self, request_id: str) -> None:
        """End a request's announcement leases (its blocks are about to be freed or it is
        released); waits for a copy reading them, never for the network."""
        assert self.producer is not None
        for lease_id in self._announced.pop(request_id, ()):
            self.producer.release(lease_id)

    def release(self, request_id: str) -> None:
        if self.producer is not None:
            self.end_announcements(request_id)
            self.producer.release(request_id)

    def take_released(self) -> list[str]:
        """Request ids whose main lease ended (released or expired) since the last call;
        their announcement leases are ended too."""
        if self.producer is not None:
            self.producer.expire_leases(time.time())
        released = []
        while not self._released.empty():
            lease_id = self._released.get_nowait()
            request_id, separator, _ = lease_id.partition(LEASE_SEPARATOR)
            if separator:  # an announcement's lease: its blocks are the request's
                leases = self._announced.get(request_id)
                if leases is not None and lease_id in leases:
                    leases.remove(lease_id)
                continue
            self.end_announcements(request_id)
            released.append(request_id)
        return released

    @property
    def num_pinned(self) -> int:
        return self.producer.num_leases if self.producer is not None else 0

    # ------------------------------------------------------------------ consumer
    def start_pull(self, request: Request, local_block_ids: list[int], num_local_blocks: int) -> None:
        """Begin receiving a request's prompt blocks into ``local_block_ids`` (the first
        ``num_local_blocks`` were prefix-cache hits here): whatever its prefill replica has
        announced or returned so far is pulled now, the rest by ``advance``."""
        assert self.consumer is not None
        num_blocks = -(-request.num_prompt_tokens // self.layout.block_size) * self.pages_per_block
        self._receipts[request.request_id] = _Receipt(
            request, local_block_ids[:num_blocks], next_block=num_local_blocks,
            report=KvTransferReport(prefill_engine_id="", blocks_local=num_local_blocks))
        self.advance(request)

    def advance(self, request: Request) -> None:
        """Pull what the request's prefill replica announced or returned since the last call
        (only drops the announcements before ``start_pull``, after a failure, or once aborted)."""
        receipt = self._receipts.get(request.request_id)
        if receipt is None:
            return
        chunks, request.kv_chunks = request.kv_chunks, []
        if receipt.failed or request.status != RequestStatus.WAITING_FOR_REMOTE_KV:
            return
        for chunk in chunks:  # early: while the prefill replica still computes the prompt
            self._pull_range(receipt, chunk.handle, chunk.first_block, early=request.stream_kv)
        result = request.remote_prefill
        if result is None or receipt.result_pulled or receipt.failed:
            return
        receipt.result_pulled = True
        handle = result.handle
        if handle.num_tokens != request.num_prompt_tokens or \
                len(handle.block_ids) != len(receipt.local_block_ids):
            if handle.layout_fingerprint != self.layout.fingerprint():
                # Another layout may count other blocks (KV cache groups: a page per group).
                self.fail(request, "layout_mismatch",
                          self.layout.mismatch(handle.layout_fingerprint, "producer"))
                return
            self.fail(request, "protocol", f"the handle covers {handle.num_tokens} tokens in "
                      f"{len(handle.block_ids)} blocks; the request has "
                      f"{request.num_prompt_tokens} prompt tokens")
            return
        self._pull_range(receipt, handle, 0, early=False)

    def _pull_range(self, receipt: _Receipt, handle: KvHandle, first_block: int,
                    early: bool) -> None:
        """Pull the blocks of ``handle`` (the prompt's blocks from ``first_block``) that are
        neither here nor on their way yet."""
        assert self.consumer is not None
        receipt.report.prefill_engine_id = handle.engine_id
        end = first_block + len(handle.block_ids)
        if first_block > receipt.next_block or end > len(receipt.local_block_ids):
            if handle.layout_fingerprint != self.layout.fingerprint():
                self.fail(receipt.request, "layout_mismatch",
                          self.layout.mismatch(handle.layout_fingerprint, "producer"))
                return
            self.fail(receipt.request, "protocol", f"blocks [{first_block}, {end}) announced "
                      f"after {receipt.next_block} of {len(receipt.local_block_ids)}")
            return
        start = max(receipt.next_block, first_block)
        if start >= end:
            return
        future = self.consumer.pull(handle, handle.block_ids[start - first_block:],
                                    receipt.local_block_ids[start:end],
                                    self.config.pull_timeout_seconds)
        receipt.pulls.append((future, early))
        receipt.next_block = end

    def fail(self, request: Request, reason: str, detail: str = "") -> None:
        """Record why the request's prompt KV will not all arrive (the first reason wins);
        pulls still running are let finish, none is started any more."""
        receipt = self._receipts.get(request.request_id)
        if receipt is not None and not receipt.failed:
            receipt.report.fallback_reason = reason
            logger.warning("KV transfer for %s failed (%s): %s", request.request_id, reason,
                           detail)

    @property
    def num_pulls_in_flight(self) -> int:
        """Requests receiving KV (pulling, or waiting for announcements or a result)."""
        return len(self._receipts)

    @property
    def has_pulls_running(self) -> bool:
        """A pull has not ended yet, or has ended and is not collected (the core's next step
        moves its request on)."""
        return any(receipt.pulls for receipt in self._receipts.values())

    def take_finished_pulls(self) -> list[tuple[Request, KvTransferReport]]:
        """Requests whose prompt KV is complete, or will not be: every pull has ended and the
        prefill replica's result (or its failure) is in, or the request was aborted."""
        finished = []
        for request_id, receipt in list(self._receipts.items()):
            request = receipt.request
            if any(not future.done() for future, _ in receipt.pulls):
                continue
            self._collect(receipt)
            aborted = request.status == RequestStatus.FINISHED_ABORTED
            if not aborted:
                if request.stream_kv:
                    continue  # more announcements, then the result or a failure, to come
                if not receipt.failed and not receipt.result_pulled:
                    continue
            del self._receipts[request_id]
            if aborted and not receipt.failed:
                receipt.report.fallback_reason = "aborted"
            finished.append((request, receipt.report))
        return finished

    def _collect(self, receipt: _Receipt) -> None:
        """Fold the ended pulls into the receipt's report."""
        ended, receipt.pulls = receipt.pulls, []
        report = receipt.report
        for future, early in ended:
            try:
                result = future.result()
            except KvTransferError as exc:
                self.fail(receipt.request, exc.reason, str(exc))
                continue
            except Exception as exc:  # noqa: BLE001 - any transport bug becomes a fallback
                logger.exception("KV pull for %s failed", receipt.request.request_id)
                self.fail(receipt.request, "protocol", str(exc))
                continue
            report.blocks_pulled += result.num_blocks
            report.blocks_pulled_early += result.num_blocks if early else 0
            report.num_bytes += result.num_bytes
            report.seconds += result.seconds
            report.transport = result.transport

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()
        if self.consumer is not None:
            self.consumer.close()
        if self._rank_reader is not None:
            self._rank_reader.close()
