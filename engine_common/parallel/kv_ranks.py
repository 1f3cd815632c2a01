"""P/D KV transfer under tensor parallelism: each rank's cache taking part itself.

Owns the engine's side of per-rank pulls (``kv_transfer.rank_reader``): what a replica's
rank 0 needs to serve or pull them (``ParallelKv``: its heads, the model's, the other
ranks' caches or channel), a worker's part (``WorkerKv``: a prefill worker maps its cache
for readers and publishes where it is; a decode worker reads its heads when rank 0 says so
and reports), and rank 0's channel to its workers (``WorkerChannel``): a pull's part goes
down the worker's pipe (``workers``), its report comes back through the replica's TCP
store on loopback (the group's rendezvous store, already there; the pipes go one way).

It does not own the transfer (``kv_transfer``) or the leases (rank 0's ``remote_kv``).
"""

from __future__ import annotations

import datetime
import logging
import pickle
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from engine_common.parallel.group import COLLECTIVE_TIMEOUT
from engine_common.parallel.workers import TensorParallelWorkers
from kv_transfer.connector import KvTransferError
from kv_transfer.layout import KvLayout
from kv_transfer.rank_layout import RankCache, kv_head_range
from kv_transfer.rank_reader import RankPull, RankReader
from kv_transfer.rank_wire_up import answer_wire_ups
from kv_transfer.ucx_rma import MappedMemory
from kv_transfer.ucx_runtime import UcxRuntime

logger = logging.getLogger(__name__)


def _cache_key(rank: int) -> str:
    return f"tandem/kv-rank/{rank}"


def _report_key(pull_id: int, rank: int) -> str:
    return f"tandem/kv-pull/{pull_id}/{rank}"


@dataclass
class ParallelKv:
    """Rank 0's view of its replica's ranks for KV transfer (one rank: no others)."""

    heads: tuple[int, int]  # rank 0's KV heads (first, count)
    total_heads: int  # the model's KV heads
    size: int = 1
    store: Any = None  # rank 0's TCP store (several ranks)
    workers: TensorParallelWorkers | None = None
    other_caches: list[RankCache] = field(default_factory=list)

    def gather_caches(self) -> list[RankCache]:
        """The prefill workers' caches, as each published it (blocks until each has)."""
        if self.size > 1 and not self.other_caches:
            self.other_caches = [pickle.loads(self.store.get(_cache_key(rank)))
                                 for rank in range(1, self.size)]
        return self.other_caches

    def channel(self) -> WorkerChannel | None:
        return None if self.workers is None else WorkerChannel(self.workers, self.store)


def parallel_kv(total_heads: int, size: int, store: Any,
                workers: TensorParallelWorkers | None) -> ParallelKv:
    return ParallelKv(kv_head_range(total_heads, 0, size), total_heads, size, store, workers)


class WorkerChannel:
    """``rank_reader.OtherRanks`` over the workers' pipes and the replica's store."""

    def __init__(self, workers: TensorParallelWorkers, store: Any):
        self._workers, self._store = workers, store

    def send(self, rank: int, pull: RankPull) -> None:
        self._workers.send_to(rank, pull)

    def wait(self, pull_id: int, ranks: Sequence[int], timeout: float) -> None:
        keys = [_report_key(pull_id, rank) for rank in ranks]
        try:
            self._store.wait(keys, datetime.timedelta(seconds=timeout))
        except RuntimeError:  # the store's timeout (or it is gone: the replica is ending)
            raise KvTransferError("timeout", f"tensor-parallel ranks {list(ranks)} did not "
                                  f"report their KV reads within {timeout:g} s") from None
        failures = []
        for rank, key in zip(ranks, keys, strict=True):
            report = self._store.get(key)
            self._store.delete_key(key)
            if report != b"ok":
                failures.append(f"rank {rank}: {report.decode(errors='replace')}")
        if failures:
            raise KvTransferError("unreachable", "; ".join(failures))


class WorkerKv:
    """A worker's part in P/D: a prefill worker's mapped cache, or a decode worker's reads."""

    def __init__(self, kv_cache: torch.Tensor, layout: KvLayout, role: str, host: str,
                 rank: int, heads: tuple[int, int], store_port: int):
        self._store = dist.TCPStore("127.0.0.1", store_port, is_master=False,
                                    timeout=COLLECTIVE_TIMEOUT)
        self.rank = rank
        self._mapped: MappedMemory | None = None
        self._reader: RankReader | None = None
        if role == "producer":
            runtime = UcxRuntime.shared(host)
            self._mapped = runtime.call(_map(kv_cache), timeout=30)
            cache = RankCache(rank, heads[0], heads[1], runtime.worker_address("shm"),
                              self._mapped.rkey, self._mapped.address, kv_cache.shape[0],
                              runtime.worker_address("tcp"))
            answer_wire_ups(runtime)  # readers over TCP (``rank_wire_up``)
            self._store.set(_cache_key(rank), pickle.dumps(cache))
        else:
            self._reader = RankReader(kv_cache, layout, heads[0], host)

    def pull(self, pull: RankPull) -> None:
        """Start this rank's part of a pull; its report goes to the store when it ends."""
        assert self._reader is not None, "a prefill worker was asked to pull"
        self._reader.start(pull).add_done_callback(
            lambda done: self._report(pull.pull_id, done))

    def _report(self, pull_id: int, done: Future[int]) -> None:
        error = done.exception()
        if error is not None:
            logger.warning("KV reads of pull %d failed: %s", pull_id, error)
        self._store.set(_report_key(pull_id, self.rank),
                        b"ok" if error is None else str(error)[:500].encode())


async def _map(kv_cache: torch.Tensor) -> MappedMemory:
    """The cache mapped for remote reads (on the runtime's loop: ucxx's context is there)."""
    import ucxx

    context = ucxx.core._get_ctx().context.handle
    return MappedMemory(context, kv_cache.data_ptr(), kv_cache.numel() * kv_cache.element_size())


def worker_kv(config: Any, kv_cache: torch.Tensor, model_name: str, rank: int, size: int,
              total_heads: int, store_port: int) -> WorkerKv | None:
    """A worker's ``WorkerKv`` when its replica moves KV (host memory only), else None."""
    role = config.kv_transfer.role
    if role is None or kv_cache.is_cuda:
        return None
    layout = KvLayout.of_cache(model_name, kv_cache, size)
    return WorkerKv(kv_cache, layout, role, config.kv_transfer.host, rank,
                    kv_head_range(total_heads, rank, size), store_port)

