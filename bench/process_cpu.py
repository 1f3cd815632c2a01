"""CPU time used by process trees and by the whole host, from /proc (Linux): what ran on the
cores while a benchmark's request ran (``bench/pd_overlap.py --cpu-profile``)."""

from __future__ import annotations

import os
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: str) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # gone meanwhile
        return None
    return text[text.rindex(")") + 2:].split()  # after "pid (comm) "


def tree_cpu_seconds(roots: dict[str, int]) -> dict[str, float]:
    """Per name, the user + system CPU seconds of its root process and every descendant
    alive now (a replica's frontend and engine core processes)."""
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat_fields(entry)
        if fields is None:
            continue
        pid = int(entry)
        parent[pid] = int(fields[1])  # ppid
        cpu[pid] = (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime
    owner = {pid: name for name, pid in roots.items()}

    def root_of(pid: int) -> str | None:
        seen = 0
        while pid > 1 and seen < 64:
            if pid in owner:
                return owner[pid]
            pid, seen = parent.get(pid, 0), seen + 1
        return None

    totals = dict.fromkeys(roots, 0.0)
    for pid, seconds in cpu.items():
        name = root_of(pid)
        if name is not None:
            totals[name] += seconds
    return totals


def host_busy_seconds() -> float:
    """CPU seconds the host's cores were busy since boot, all cores together (/proc/stat:
    user, nice, system, irq, softirq, steal)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / _TICK
