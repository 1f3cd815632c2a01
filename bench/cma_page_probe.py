"""What the memory under a cma copy costs: ``process_vm_readv`` (what UCX's cma transport
calls, 512 KiB a call) of 45 MiB (128 blocks of SmolLM2-135M's KV) from buffers allocated
different ways into one numpy buffer, in this process (no UCX), CPU time per copy.

Why (issue 34): raw UCX in ``bench/kv_transfer_bandwidth.py`` moves numpy buffers, which
numpy advises ``MADV_HUGEPAGE`` (transparent huge pages, here ``madvise`` mode), while the
KV caches are torch tensors on 4 KiB pages (``engine_common/model_runner.py`` keeps them off
huge pages on purpose: faulting them in at start costs seconds). The kernel pins and walks
the source's pages for every call, so the same cma copy costs about twice as much from a
4 KiB-page buffer: the connector's remaining gap to "raw" is the memory, not UCX or Python.

  numpy             np.full: numpy advises huge pages for large arrays
  numpy_no_advice   np.full with numpy's huge-page advice turned off
  torch             torch.full: 4 KiB pages (as the engine's and the bench's caches)
  torch_advised     torch.empty, MADV_HUGEPAGE on it, then filled (advice before first touch)
  torch_advised_late  torch.full, then MADV_HUGEPAGE (too late: pages already faulted in)

Run: ``python -m bench.cma_page_probe [--rounds 12]``; writes bench/results/cma_page_probe.json.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

NBYTES = 128 * 368_640
SEGMENT = 512 * 1024  # UCX_CMA_SEG_SIZE's default
_MADV_HUGEPAGE = 14
_PAGE = 4096
RESULTS = Path(__file__).resolve().parent / "results" / "cma_page_probe.json"


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    iov = ctypes.POINTER(_Iovec)
    libc.process_vm_readv.argtypes = [ctypes.c_int, iov, ctypes.c_ulong, iov, ctypes.c_ulong,
                                      ctypes.c_ulong]
    libc.process_vm_readv.restype = ctypes.c_ssize_t
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """``nbytes`` of uint8, advised huge pages before first touch (2 MiB-aligned start)."""
    holder = torch.empty((nbytes + 2**21,), dtype=torch.uint8)
    start = -holder.data_ptr() % 2**21
    view = holder[start:start + nbytes]
    assert _libc().madvise(view.data_ptr(), nbytes, _MADV_HUGEPAGE) == 0
    return view  # a view keeps its holder's storage alive


def _advised(fill: int, late: bool) -> tuple[Any, int]:
    """A torch buffer whose page-aligned range is advised huge pages, before or after it
    is first touched."""
    holder = torch.full((NBYTES + 2 * _PAGE,), fill, dtype=torch.uint8) if late else \
        torch.empty((NBYTES + 2 * _PAGE,), dtype=torch.uint8)
    start = -holder.data_ptr() % _PAGE
    assert _libc().madvise(holder.data_ptr() + start, NBYTES + _PAGE, _MADV_HUGEPAGE) == 0
    view = holder[start + 16:start + 16 + NBYTES]  # numpy's page offset, as the destination
    view.fill_(fill)
    return holder, view.data_ptr()


def allocate(kind: str, fill: int) -> tuple[Any, int]:
    """(an object keeping the memory alive, its address)."""
    if kind in ("numpy", "numpy_no_advice"):
        multiarray = np._core.multiarray  # type: ignore[attr-defined]
        multiarray._set_madvise_hugepage(kind == "numpy")
        array = np.full(NBYTES, fill, dtype=np.uint8)
        multiarray._set_madvise_hugepage(True)
        return array, array.ctypes.data
    if kind == "torch":
        tensor = torch.full((NBYTES,), fill, dtype=torch.uint8)
        return tensor, tensor.data_ptr()
    return _advised(fill, late=kind == "torch_advised_late")


def copy(libc: ctypes.CDLL, destination: int, source: int) -> None:
    """As UCX's cma transport: one ``process_vm_readv`` per 512 KiB segment."""
    for offset in range(0, NBYTES, SEGMENT):
        nbytes = min(SEGMENT, NBYTES - offset)
        local, remote = _Iovec(destination + offset, nbytes), _Iovec(source + offset, nbytes)
        if libc.process_vm_readv(os.getpid(), ctypes.byref(local), 1, ctypes.byref(remote),
                                 1, 0) != nbytes:
            raise OSError(ctypes.get_errno(), "process_vm_readv")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    libc = _libc()
    kinds = ["numpy", "numpy_no_advice", "torch", "torch_advised", "torch_advised_late"]
    sources = {kind: allocate(kind, 3) for kind in kinds}
    destination = allocate("numpy", 0)
    seconds: dict[str, list[float]] = {kind: [] for kind in kinds}
    load = [os.getloadavg()]
    for _ in range(args.rounds):
        for kind in kinds:  # interleaved: each round copies from every source once
            started = time.thread_time()
            copy(libc, destination[1], sources[kind][1])
            seconds[kind].append(time.thread_time() - started)
    load.append(os.getloadavg())
    results = {kind: round(statistics.median(values) * 1e3, 2) for kind, values in seconds.items()}
    for kind, ms in results.items():
        print(f"{kind:20s} {ms:6.2f} ms CPU per {NBYTES / 2**20:.0f} MiB "
              f"({NBYTES / ms / 1e6:.1f} GB/s)")
    report = {"benchmark": "cma_page_probe", "bytes": NBYTES, "segment_bytes": SEGMENT,
              "rounds": args.rounds, "statistic": "median thread CPU ms per copy",
              "transparent_hugepage": Path("/sys/kernel/mm/transparent_hugepage/enabled")
              .read_text().strip(),
              "load_average": load, "results_ms": results,
              "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
