"""What putting the engine's KV cache on transparent huge pages costs at start-up.

Each measurement allocates one cache the way an engine does, in a fresh process (as an
engine start is), and reports wall time, the process's CPU time (user + system, every
thread: the kernel's zeroing and compaction are system time), the bytes the kernel reports
on huge pages (AnonHugePages of the cache's range) and the load average. Variants,
interleaved and rotated round by round:

  zeros   torch.zeros after ``keep_large_temporaries_in_heap`` (the engine before issue 34)
  4k      ``allocate_host_cache(pages="4k")``: a fresh mapping faulted in, 4 KiB pages
  huge    ``allocate_host_cache(pages="huge")``: advised MADV_HUGEPAGE, then faulted in
  huge-if-free  the same, the rest on 4 KiB pages once huge ones come slowly

Run: ``python -m bench.kv_cache_pages_probe [--sizes-mib 512,1024] [--rounds 5]``; writes
bench/results/kv_cache_pages_probe.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench.report import machine

RESULTS = Path(__file__).resolve().parent / "results" / "kv_cache_pages_probe.json"
VARIANTS = ("zeros", "4k", "huge", "huge-if-free")

_CHILD = r"""
import json, resource, sys, time
import torch
from engine_common.model.cpu_allocator import keep_large_temporaries_in_heap
from engine_common.model.kv_cache_memory import allocate_host_cache, anon_huge_bytes
variant, nbytes = sys.argv[1], int(sys.argv[2])
keep_large_temporaries_in_heap()
shape = (nbytes // 2,)
def cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
started, cpu_started = time.perf_counter(), cpu()
if variant == "zeros":
    cache, pages, reason = torch.zeros(shape, dtype=torch.bfloat16), "4k", ""
else:
    cache, memory = allocate_host_cache(shape, torch.bfloat16, variant)
    pages, reason = memory.pages, memory.reason
wall, cpu_s = time.perf_counter() - started, cpu() - cpu_started
assert not cache.any()
print(json.dumps({"wall_s": wall, "cpu_s": cpu_s, "pages": pages, "reason": reason,
                  "anon_huge_mib": anon_huge_bytes(cache.data_ptr(), nbytes) >> 20}))
"""


def measure(variant: str, nbytes: int) -> dict[str, object]:
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", _CHILD, variant, str(nbytes)], cwd=root,
                         check=True, capture_output=True, text=True).stdout
    result: dict[str, object] = json.loads(out.splitlines()[-1])
    result["load"] = os.getloadavg()[0]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", default="512,1024")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    thp = {name: Path(f"/sys/kernel/mm/transparent_hugepage/{name}").read_text().strip()
           for name in ("enabled", "defrag")}
    runs: dict[str, list[dict[str, object]]] = {}
    for round_index in range(args.rounds):
        for size in (int(part) for part in args.sizes_mib.split(",")):
            shift = round_index % len(VARIANTS)
            order = VARIANTS[shift:] + VARIANTS[:shift]
            for variant in order:
                result = measure(variant, size << 20)
                runs.setdefault(f"{variant}@{size}MiB", []).append(result)
                print(f"round {round_index} {variant:12s} {size:5d} MiB {result}", flush=True)
    summary = {key: {"wall_s": statistics.median(float(r["wall_s"]) for r in values),  # type: ignore[arg-type]
                     "cpu_s": statistics.median(float(r["cpu_s"]) for r in values),  # type: ignore[arg-type]
                     "anon_huge_mib": [r["anon_huge_mib"] for r in values],
                     "loads": [r["load"] for r in values]}
               for key, values in runs.items()}
    for key, row in summary.items():
        print(f"{key:14s} wall {row['wall_s']:.3f} s  cpu {row['cpu_s']:.3f} s  "
              f"huge MiB {row['anon_huge_mib']}  load {row['loads']}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"machine": machine(), "thp": thp, "rounds": args.rounds,
                                       "summary": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
