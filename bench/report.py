"""What every benchmark's results file holds besides its own numbers.

Owns describing the machine a run was on, the ratios of a two-or-more-engine run against
Tandem (of the medians, and round by round), where two runs' tokens part, and writing the results file (the benchmark's
name, the machine, its fields, a timestamp). It does not own any workload or measurement.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

# The CPU features the engines' speed depends on (the matmul and attention kernels each
# engine picks), named in every results file: the same model name spans CPUs with and
# without them.
MATMUL_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
                "avx_ne_convert", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16")


def machine() -> dict[str, object]:
    cpu, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == platform.processor():
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_flags": [flag for flag in MATMUL_FLAGS if flag in flags],
        "nproc": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        # How busy this shared machine was as the results were written, at the run's end
        # (other tenants' work; files before 2026-11-26 called this "load_average_at_start").
        "load_average_at_end": list(os.getloadavg()),
    }


def ratios_over_tandem(seconds: dict[str, list[float]]) -> dict[str, object]:
    """Each peer's time over Tandem's (above 1: Tandem is faster): of the medians, and per
    round (engines ran minutes apart across rounds: the ratio within a round is fairer)."""
    ours = seconds["tandem"]
    ratios: dict[str, object] = {}
    for name, runs in seconds.items():
        if name != "tandem":
            ratios[f"tandem_over_{name}"] = statistics.median(runs) / statistics.median(ours)
            ratios[f"tandem_over_{name}_per_round"] = [
                peer / mine for peer, mine in zip(runs, ours, strict=True)]
    return ratios


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Where two runs' tokens first part (None: nowhere)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


def write_report(out: Path, benchmark: str, **fields: object) -> None:
    """``{"benchmark", "machine", **fields, "timestamp"}`` as indented JSON at ``out``."""
    report = {"benchmark": benchmark, "machine": machine(), **fields,
              "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
