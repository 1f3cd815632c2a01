"""How `tandem up` shares one host's CPUs among a suite's processes (``--cpu-layout``).

Layouts:

- ``by-role``: the engine cores of the decoding (decode and ``both``) replicas get CPUs of
  their own (half of the host's beside prefill replicas, all but one without, at least one
  each); the prefill replicas split the rest, and every frontend (the replicas' gRPC,
  tokenizing and streaming), the gateway and Envoy run on those same CPUs. A decode step
  runs on every torch thread at once and waits for the slowest, so one prefill thread or
  gateway wakeup on a decode core delays every stream on that replica; a prefill is
  compute-bound and only its TTFT pays for a time-sliced core. `vllm serve` on CPU keeps
  its API server off its model's cores for the same reason.
- ``even``: each replica its own contiguous share (``--cpus``), gateway and Envoy unpinned.
- ``shared``: no pinning; a decoding replica that is the only one keeps its first CPU for
  its frontend (``--engine-cpus auto``), several share every CPU.
- ``auto`` (the default): ``by-role`` where the host's CPUs are the suite's own and enough
  for it (a CPU per decoding engine core's rank beside the prefill replicas'), ``shared``
  otherwise.

Tensor parallelism: a replica's engine core runs a process per rank, and each rank takes
its contiguous part of the engine's CPUs (``model_runner.rank_cpus``); ranks that outnumber
those CPUs all run unpinned on them, time-sliced, so that every step's all-reduces wait for
the scheduler. So ``by-role`` splits the decoding engines' CPUs by rank count, and a
decoding replica whose share holds fewer CPUs than its ranks gets no engine CPUs of its
own (``--engine-cpus none``): its ranks spread over all its CPUs, the frontend's included
(on 2 cores, 1 prefill and 1 TP=2 decode: rank 0 with the frontends on CPU 0, rank 1 alone
on CPU 1). Prefill replicas' ranks split their share the same way, time-sliced where the
share is smaller (a prefill is compute-bound: it is slower, not stalled). ``shared`` leaves
the choice to the replica (``cpu_binding.default_engine_cpus``, which shares where its
ranks would not get a CPU each).

Why ``by-role`` is the default, measured on 2 cores: docs/benchmarks.md ("Cores on a
small machine"). A host whose CPUs the suite does not own (a CPU quota or an
``OMP_NUM_THREADS`` smaller than the affinity mask: a container that sees every CPU of its
node) is never pinned: a thread per visible CPU would oversubscribe its share.

Owns only the plan: which flags each replica gets and which CPUs the gateway and Envoy are
pinned to. Pinning a replica is the replica's own (``services.replica.cpu_binding``);
starting the processes is ``deploy.supervisor``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.replica.cpu_binding import SHARED

LAYOUTS = ("auto", "by-role", "even", "shared")


@dataclass(frozen=True)
class CpuPlan:
    """Each replica's CPU flags (in the order of the roles given) and the CPUs the gateway
    and Envoy are pinned to (None: unpinned)."""

    replica_args: list[list[str]]
    service_cpus: list[int] | None
    layout: str  # the layout chosen: never "auto"


def plan_cpus(layout: str, roles: list[str], cpus: list[int], owned: bool,
              ranks: list[int] | None = None) -> CpuPlan:
    """The plan for replicas of ``roles`` on ``cpus`` (this process's affinity, sorted);
    ``owned``: whether the suite may use all of them (no smaller quota); ``ranks``: each
    replica's tensor-parallel ranks (default: one each)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown CPU layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    ranks = ranks or [1] * len(roles)
    if layout == "auto":
        decoding_ranks = [n for role, n in zip(roles, ranks, strict=True) if role != "prefill"]
        layout = ("by-role" if owned and _fits_by_role(roles, cpus, sum(decoding_ranks))
                  else "shared")
    if layout == "by-role":
        return _by_role(roles, cpus, ranks)
    if layout == "even":
        shares = split_cpus(cpus, len(roles))
        return CpuPlan([["--cpus", _cpu_list(share)] for share in shares], None, "even")
    # Unpinned, several decoding replicas would each put their engine core on the same CPUs
    # (all but the first), so they share every CPU instead.
    decoding = sum(role != "prefill" for role in roles)
    return CpuPlan([["--engine-cpus", SHARED] if role != "prefill" and decoding > 1 else []
                    for role in roles], None, "shared")


def split_cpus(cpus: list[int], parts: int) -> list[list[int]]:
    """``cpus`` cut into ``parts`` contiguous shares, as even as can be."""
    if parts > len(cpus):
        raise ValueError(f"pinning {parts} replicas needs at least {parts} CPUs; "
                         f"this process may use {len(cpus)}")
    size, extra = divmod(len(cpus), parts)
    shares, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        shares.append(cpus[start:end])
        start = end
    return shares


def _num_front_cpus(roles: list[str], cpus: list[int]) -> int:
    """CPUs left to prefill replicas and frontends: half the host with prefill replicas
    (at least one each, fewer than half where the decoding engine cores need more), one
    without; what remains goes to the decoding engine cores."""
    num_prefill = roles.count("prefill")
    if num_prefill == 0:
        return 1
    num_decoding = len(roles) - num_prefill
    return max(num_prefill, min(len(cpus) - len(cpus) // 2, len(cpus) - num_decoding))


def _fits_by_role(roles: list[str], cpus: list[int], needed: int | None = None) -> bool:
    """CPUs beside the prefill replicas' and frontends' for ``needed`` (default: one per
    decoding engine core)."""
    num_decoding = len(roles) - roles.count("prefill")
    needed = num_decoding if needed is None else needed
    return num_decoding > 0 and len(cpus) - _num_front_cpus(roles, cpus) >= needed


def _by_rank(cpus: list[int], ranks: list[int]) -> list[list[int]]:
    """``cpus`` cut into contiguous shares, one per replica, as close to proportional to
    ``ranks`` as whole CPUs go (at least one each)."""
    if len(set(ranks)) == 1:  # equal shares, the first ones a CPU more
        return split_cpus(cpus, len(ranks))
    total, shares, start = sum(ranks), [], 0
    for i in range(len(ranks)):
        left = len(ranks) - i - 1  # replicas after this one, a CPU each at least
        end = max(start + 1, min(len(cpus) - left,
                                 round(len(cpus) * sum(ranks[:i + 1]) / total)))
        shares.append(cpus[start:end])
        start = end
    return shares


def _by_role(roles: list[str], cpus: list[int], ranks: list[int]) -> CpuPlan:
    if not _fits_by_role(roles, cpus):
        raise ValueError(f"--cpu-layout by-role needs a CPU for each decode or both replica's "
                         f"engine core beside those of the prefill replicas and frontends; "
                         f"this process may use {len(cpus)}")
    num_front = _num_front_cpus(roles, cpus)
    front, engine_cpus = cpus[:num_front], cpus[num_front:]
    prefill_shares = iter(split_cpus(front, max(1, roles.count("prefill"))))
    decoding_ranks = [n for role, n in zip(roles, ranks, strict=True) if role != "prefill"]
    engine_shares = iter(_by_rank(engine_cpus, decoding_ranks))
    args: list[list[str]] = []
    for role, n in zip(roles, ranks, strict=True):
        if role == "prefill":
            args.append(["--cpus", _cpu_list(next(prefill_shares))])
            continue
        engine = next(engine_shares)
        # Fewer CPUs than ranks: the ranks spread over the frontends' CPUs too (see the
        # module docstring) rather than time-slice the engine's.
        engine_arg = _cpu_list(engine) if len(engine) >= n else SHARED
        args.append(["--cpus", _cpu_list(front + engine), "--engine-cpus", engine_arg])
    return CpuPlan(args, front, "by-role")


def _cpu_list(cpus: list[int]) -> str:
    return ",".join(map(str, cpus))
