"""Which CPUs a replica's frontend and engine core run on, and with how many torch threads.

Owns the CPU-list syntax (``0-3``, ``0,2,5-6``), pinning the replica (``--cpus``), splitting
its CPUs between the engine core and the frontend (``--engine-cpus``), and the default of
that split. It does not own starting the engine core (``engine_common.core_process`` applies
the engine's CPUs in the child) or splitting a machine among replicas (``deploy.supervisor``).

Why a split by default: a CPU decode step runs on every torch thread at once and waits for
the slowest, so when the frontend (gRPC, tokenizing, streaming), a gateway or Envoy takes a
core from one thread, the whole step waits. vLLM-CPU keeps a core for its frontend for the
same reason; on the 2-core bench machine the split lowers ITL 1.4x (README, Benchmarks).
The default splits only CPUs the replica owns: a container limited by a CPU quota or an
``OMP_NUM_THREADS`` smaller than its affinity mask (a Kubernetes pod without the static CPU
manager sees every CPU of the node) would otherwise pin a thread per node CPU.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

_CPU_RANGE = re.compile(r"^\s*(\d+)(?:-(\d+))?\s*$")

# ``--engine-cpus`` values besides a CPU list.
AUTO = "auto"
SHARED = "none"


def parse_cpus(text: str) -> list[int]:
    """``0-3``, ``0,2,5-6``: a list of CPU numbers, as taskset and cgroups write them."""
    cpus: set[int] = set()
    for part in text.split(","):
        match = _CPU_RANGE.match(part)
        if match is None:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a CPU list; write e.g. 0-3 or 0,2,5-6")
        first, last = match.groups()
        if last is not None and int(last) < int(first):
            raise argparse.ArgumentTypeError(f"{part!r} in the CPU list {text!r} is empty")
        cpus.update(range(int(first), int(last or first) + 1))
    return sorted(cpus)


def parse_engine_cpus(text: str) -> list[int] | str:
    """``--engine-cpus``: a CPU list, ``auto`` or ``none``."""
    if text in (AUTO, SHARED):
        return text
    try:
        return parse_cpus(text)
    except argparse.ArgumentTypeError as error:
        raise argparse.ArgumentTypeError(f"{error}, or {AUTO} or {SHARED}") from None


def split_engine_cpus(replica_cpus: list[int], engine_cpus: list[int]) -> list[int]:
    """The frontend's CPUs: the replica's minus the engine core's (which must be among them,
    leaving at least one)."""
    if not set(engine_cpus) <= set(replica_cpus):
        raise ValueError(f"--engine-cpus {engine_cpus} is not within the replica's CPUs "
                         f"({replica_cpus})")
    frontend = [cpu for cpu in replica_cpus if cpu not in engine_cpus]
    if not frontend:
        raise ValueError(f"--engine-cpus {engine_cpus} leaves no CPU of {replica_cpus} for the "
                         "frontend")
    return frontend


def cgroup_cpu_limit(
    cgroup_root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup"),
) -> float | None:
    """CPUs' worth of time this process's cgroup (or an ancestor) may use; None if unlimited.

    cgroup v2 ``cpu.max`` (``max 100000`` or ``<quota> <period>``), or v1
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1: unlimited), read along the path that
    ``/proc/self/cgroup`` gives, up to the hierarchy's root.
    """
    try:
        entries = [line.split(":", 2) for line in proc_cgroup.read_text().splitlines()]
    except OSError:
        return None
    limits: list[float] = []
    for entry in entries:
        if len(entry) != 3:
            continue
        _, controllers, path = entry
        if controllers == "":
            mounts = [cgroup_root]
        elif "cpu" in controllers.split(","):
            mounts = [cgroup_root / controllers, cgroup_root / "cpu"]
        else:
            continue
        for mount in mounts:
            directory = mount / path.strip("/")
            for candidate in (directory, *directory.parents):
                quota = _read_quota(candidate)
                if quota is not None:
                    limits.append(quota)
                if candidate == mount:
                    break
    return min(limits) if limits else None


def _read_quota(directory: Path) -> float | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((directory / "cpu.cfs_quota_us").read_text())
        period_us = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 else None


def default_engine_cpus(
    role: str,
    device: str,
    replica_cpus: list[int],
    omp_num_threads: int | None,
    cpu_limit: float | None,
    ranks: int = 1,
) -> list[int] | None:
    """``--engine-cpus auto``: a decoding CPU replica that owns two or more CPUs runs its
    engine core on all but the first and its frontend on that one; otherwise (None) they
    share. A prefill replica keeps every thread for its compute-bound prompts (it streams no
    tokens); on a GPU the engine core's CPU threads only launch kernels. An engine core of
    ``ranks`` tensor-parallel ranks that would get fewer CPUs than ranks shares them all
    (each rank on its own CPU beats ranks time-sliced on one: every step all-reduces)."""
    if role == "prefill" or device != "cpu" or len(replica_cpus) < 1 + max(1, ranks):
        return None
    owned = len(replica_cpus)
    if omp_num_threads is not None and omp_num_threads < owned:
        return None
    if cpu_limit is not None and cpu_limit < owned:
        return None
    return replica_cpus[1:]


def omp_num_threads_from_env() -> int | None:
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() else None


def pin_to_cpus(cpus: list[int]) -> None:
    """Run this process and the engine core it starts on ``cpus`` only, with as many torch
    threads: replicas sharing a host then stop taking each other's cores (a prefill burst
    on one cannot slow the other's decode steps)."""
    allowed = os.sched_getaffinity(0)
    if not set(cpus) <= allowed:
        raise ValueError(f"--cpus {cpus} is not within the CPUs this process may use "
                         f"({sorted(allowed)})")
    os.sched_setaffinity(0, cpus)
    # Read by the engine core process's OpenMP when it starts; torch in this process too.
    os.environ["OMP_NUM_THREADS"] = str(len(cpus))
    import torch

    torch.set_num_threads(len(cpus))
