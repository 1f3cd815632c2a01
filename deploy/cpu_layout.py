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
  for it (a CPU per decoding engine core beside the prefill replicas'), ``shared``
  otherwise.

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


def plan_cpus(layout: str, roles: list[str], cpus: list[int], owned: bool) -> CpuPlan:
    """The plan for replicas of ``roles`` on ``cpus`` (this process's affinity, sorted);
    ``owned``: whether the suite may use all of them (no smaller quota)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown CPU layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    if layout == "auto":
        layout = "by-role" if owned and _fits_by_role(roles, cpus) else "shared"
    if layout == "by-role":
        return _by_role(roles, cpus)
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


def _fits_by_role(roles: list[str], cpus: list[int]) -> bool:
    num_decoding = len(roles) - roles.count("prefill")
    return num_decoding > 0 and len(cpus) - _num_front_cpus(roles, cpus) >= num_decoding


def _by_role(roles: list[str], cpus: list[int]) -> CpuPlan:
    if not _fits_by_role(roles, cpus):
        raise ValueError(f"--cpu-layout by-role needs a CPU for each decode or both replica's "
                         f"engine core beside those of the prefill replicas and frontends; "
                         f"this process may use {len(cpus)}")
    num_front = _num_front_cpus(roles, cpus)
    front, engine_cpus = cpus[:num_front], cpus[num_front:]
    prefill_shares = iter(split_cpus(front, max(1, roles.count("prefill"))))
    engine_shares = iter(split_cpus(engine_cpus, len(roles) - roles.count("prefill")))
    args: list[list[str]] = []
    for role in roles:
        if role == "prefill":
            args.append(["--cpus", _cpu_list(next(prefill_shares))])
        else:
            engine = next(engine_shares)
            args.append(["--cpus", _cpu_list(front + engine), "--engine-cpus", _cpu_list(engine)])
    return CpuPlan(args, front, "by-role")


def _cpu_list(cpus: list[int]) -> str:
    return ",".join(map(str, cpus))
