"""A tensor-parallel rank's place in its group and the collectives the model calls.

Owns ``TensorParallel`` (rank, size, the process group) and joining the group: gloo on the
CPU, NCCL on CUDA, over a TCP store rank 0 hosts on loopback (every rank of a replica runs
on one machine, in one pod). The group is a process-group object of its own, not
``torch.distributed``'s default group: nothing global is set, so a process may build one
group after another (a test, an offline engine closed and opened again). It does not own
which weights a rank holds (``sharding``) or the processes (``workers``, ``worker``).

Collectives are sums and gathers of whole tensors: a rank's share of a row-parallel
projection (o_proj, down_proj, the experts' down projection) is added up with one
all-reduce, and the LM head's vocabulary slices are gathered (exact: no arithmetic).
A rank that dies fails the others' collective at once (gloo: "Connection closed by peer"
as its sockets close); one that hangs fails it after ``COLLECTIVE_TIMEOUT``.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)


@dataclass(frozen=True)
class TensorParallel:
    """This process's rank among ``size`` (1: no parallelism, no group)."""

    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroupGloo / ProcessGroupNCCL

    @property
    def is_parallel(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x``, in place (``x`` itself when not parallel)."""
        if self.size > 1:
            self.group.allreduce([x]).wait()
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` concatenated on the last dim, in rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def min_int(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's ``value`` (the KV block count all ranks can hold)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self.group.allreduce([t], options).wait()
        return int(t.item())


SINGLE = TensorParallel()  # one rank: no group, every collective a no-op


def master_store(size: int) -> tuple[dist.TCPStore, int]:
    """Rank 0's store on a free loopback port, and that port (for the workers)."""
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=COLLECTIVE_TIMEOUT,
                          wait_for_workers=False)
    return store, store.port


def join_as_master(store: dist.TCPStore, size: int, device: torch.device) -> TensorParallel:
    """Rank 0 joins its group through the store ``master_store`` made; blocks until every
    rank has."""
    return _join(store, 0, size, device)


def join_group(rank: int, size: int, store_port: int, device: torch.device) -> TensorParallel:
    """A worker joins its replica's group as ``rank`` of ``size`` through rank 0's store on
    ``127.0.0.1:store_port``; blocks until every rank has."""
    store = dist.TCPStore("127.0.0.1", store_port, size, is_master=False,
                          timeout=COLLECTIVE_TIMEOUT)
    store.set(_arrived(rank), b"1")
    return _join(store, rank, size, device)


def wait_for_workers(store: dist.TCPStore, size: int, gone: Callable[[], str | None]) -> None:
    """Rank 0, before it joins: wait until every worker has reached the store, or raise
    RuntimeError as soon as ``gone`` says why one cannot (it exited while starting: a group
    it never joins would hold rank 0 for ``COLLECTIVE_TIMEOUT``)."""
    keys = [_arrived(rank) for rank in range(1, size)]
    deadline = time.monotonic() + COLLECTIVE_TIMEOUT.total_seconds()
    while not store.check(keys):
        if (reason := gone()) is not None:
            raise RuntimeError(f"tensor-parallel start-up failed: {reason}")
        if time.monotonic() > deadline:
            raise RuntimeError("tensor-parallel workers did not start within "
                               f"{COLLECTIVE_TIMEOUT.total_seconds():g} s")
        time.sleep(0.05)


def _arrived(rank: int) -> str:
    return f"tandem/arrived/{rank}"


def _join(store: dist.TCPStore, rank: int, size: int, device: torch.device) -> TensorParallel:
    group: Any
    if device.type == "cuda":
        torch.cuda.set_device(device)
        group = dist.ProcessGroupNCCL(store, rank, size)
    else:
        # Loopback: a replica's ranks are processes of one host (pod). gloo's default
        # device resolves the host's name, which in a pod or network namespace whose name
        # has no record waits out DNS (20-30 s measured in tests/test_k8s_multihost.py).
        options = dist.ProcessGroupGloo._Options()
        options._timeout = COLLECTIVE_TIMEOUT
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        group = dist.ProcessGroupGloo(store, rank, size, options)
    return TensorParallel(rank, size, group)
