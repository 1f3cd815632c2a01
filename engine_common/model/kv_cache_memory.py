"""Where a host KV cache's memory comes from: 4 KiB pages, or transparent huge pages.

Owns the allocation of a CPU KV cache (zeros, as ``torch.zeros`` gives) and the choice of
its page size; not its shape (``kv_cache_layout``) or size (the model runner's budget).

Why huge pages (issue 34, measured in docs/kv-transfer.md and docs/benchmarks.md): decode
attention reads a layer's rows a block apart, a TLB miss per block on 4 KiB pages (8-13%
faster on 2 MiB pages), and ``process_vm_readv``, which a shared-memory KV pull is, walks and
pins the source's pages for every call: about 3x the CPU from 4 KiB pages. The advice must
come before the first touch (pages already faulted in stay 4 KiB), so the cache is a fresh
anonymous mapping, advised ``MADV_HUGEPAGE``, then faulted in with ``MADV_POPULATE_WRITE``
(the kernel zeroes each page once; ``torch.zeros`` writes every byte a second time).

Where the kernel cannot give huge pages fast (``defrag`` makes an advised fault compact
memory synchronously, which took 2.6-3.3 s per GiB on a loaded host instead of ~1 s), the
fault-in is timed chunk by chunk and the rest of the cache goes on 4 KiB pages once huge
ones come slower than ``MIN_HUGE_BYTES_PER_S``; where THP is ``never`` (or absent), no
advice is given. Either way the cache works the same, and the reason is logged once.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine_common.config import KV_CACHE_PAGE_POLICIES

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
THP_ROOT = Path("/sys/kernel/mm/transparent_hugepage")
# Faulted in and timed this much at a time: small enough to stop early, large enough that
# the clock costs nothing.
CHUNK_BYTES = 16 << 20
# Huge pages faulted in slower than this (this thread's CPU time: the kernel's zeroing and
# any compaction run on it) cost start-up more than 4 KiB ones, which take ~0.45 s of CPU a
# GiB here (docs/kv-transfer.md); 2 MiB ones ~0.3 s when the kernel has them free, ~6 s
# when it compacts for each. The rest then goes on 4 KiB pages.
MIN_HUGE_BYTES_PER_CPU_S = 1 << 30
# ... or slower than this in wall time (a fault may also sleep in reclaim).
MIN_HUGE_BYTES_PER_S = 256 << 20
# Timed from this many bytes on (one chunk's rate is too noisy).
MIN_TIMED_BYTES = 32 << 20

PAGE_POLICIES = KV_CACHE_PAGE_POLICIES

_MADV_HUGEPAGE = 14
_MADV_NOHUGEPAGE = 15
_MADV_POPULATE_WRITE = 23  # Linux 5.14


@dataclass(frozen=True)
class ThpSettings:
    """The host's transparent huge page settings (the bracketed word of each file)."""
    enabled: str  # "always", "madvise", "never", or "absent" (no THP in this kernel)
    defrag: str

    @property
    def advisable(self) -> bool:
        """Whether ``MADV_HUGEPAGE`` can give huge pages here."""
        return self.enabled in ("always", "madvise")


@dataclass(frozen=True)
class CacheMemory:
    """What an allocation got: its page size, why, and what it cost."""
    policy: str  # what was asked for (one of PAGE_POLICIES)
    pages: str  # "huge", "partly huge" or "4k": what the kernel gave (AnonHugePages)
    reason: str  # why not all huge, or ""
    huge_bytes: int  # of the cache's mapping, on huge pages (the kernel's AnonHugePages)
    seconds: float
    cpu_seconds: float  # this thread's CPU time (the kernel's zeroing and compaction)


def _bracketed(path: Path) -> str:
    text = path.read_text()
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else text.strip()


def thp_settings(root: Path = THP_ROOT) -> ThpSettings:
    """The host's settings; ``absent`` where the kernel has no THP (or /sys is hidden)."""
    try:
        return ThpSettings(_bracketed(root / "enabled"), _bracketed(root / "defrag"))
    except OSError:
        return ThpSettings("absent", "absent")


def _madvise(libc: ctypes.CDLL, address: int, nbytes: int, advice: int) -> int:
    """0, or the errno."""
    if libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), advice) == 0:
        return 0
    return ctypes.get_errno()


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc


def _populate(libc: ctypes.CDLL, memory: torch.Tensor, start: int, end: int) -> None:
    """Fault in ``memory[start:end]`` (page-aligned): with the kernel's populate, else by
    writing it (zeros: the mapping is zeros already)."""
    if _madvise(libc, memory.data_ptr() + start, end - start, _MADV_POPULATE_WRITE) != 0:
        memory[start:end].zero_()


def _fault_in(libc: ctypes.CDLL, memory: torch.Tensor, huge: bool,
              stop_when_slow: bool) -> str:
    """Fault in every page of ``memory`` (aligned to 2 MiB), advised huge pages first when
    ``huge`` (the rest on 4 KiB pages once they come slowly, if ``stop_when_slow``), else
    advised 4 KiB pages (which THP's ``always`` mode would otherwise override): why any
    page is not huge, or ""."""
    nbytes, address = memory.numel(), memory.data_ptr()
    error = _madvise(libc, address, nbytes, _MADV_HUGEPAGE if huge else _MADV_NOHUGEPAGE)
    if not huge or error:
        _populate(libc, memory, 0, nbytes)
        return f"madvise(MADV_HUGEPAGE) failed (errno {error})" if huge else ""
    started, cpu_started, done = time.perf_counter(), time.thread_time(), 0
    while done < nbytes:
        end = min(done + CHUNK_BYTES, nbytes)
        _populate(libc, memory, done, end)
        done = end
        rate = done / max(time.perf_counter() - started, 1e-9)
        cpu_rate = done / max(time.thread_time() - cpu_started, 1e-9)
        if stop_when_slow and done >= MIN_TIMED_BYTES and done < nbytes and (
                rate < MIN_HUGE_BYTES_PER_S or cpu_rate < MIN_HUGE_BYTES_PER_CPU_S):
            # Slow: the kernel compacts memory for every huge page. The rest on 4 KiB pages
            # for good (not advised afterwards either: khugepaged would compact for them
            # in the background, on the cores the engine runs on).
            _madvise(libc, address + done, nbytes - done, _MADV_NOHUGEPAGE)
            _populate(libc, memory, done, nbytes)
            return (f"huge pages faulted in at {rate / 2**20:.0f} MiB/s, "
                    f"{cpu_rate / 2**20:.0f} MiB per CPU second (the kernel compacts memory "
                    f"for them): the rest on 4 KiB pages")
    return ""


def page_policy(setting: str, kv_role: str | None) -> str:
    """The page policy of ``setting`` ("auto" or one of ``PAGE_POLICIES``) for an engine of
    ``kv_role``. "auto": "huge" on a KV producer (a prefill replica: the connector's reads
    copy from its cache, about 3x the CPU from 4 KiB pages), "huge-if-free" elsewhere
    (attention gains 8-13%, but not at any start-up cost: docs/kv-transfer.md)."""
    if setting == "auto":
        return "huge" if kv_role == "producer" else "huge-if-free"
    if setting not in PAGE_POLICIES:
        raise ValueError(f"KV cache pages must be auto or one of {', '.join(PAGE_POLICIES)}, "
                         f"not {setting[:40]!r}")
    return setting


def allocate_host_cache(shape: tuple[int, ...], dtype: torch.dtype, pages: str,
                        thp_root: Path = THP_ROOT) -> tuple[torch.Tensor, CacheMemory]:
    """A zeroed CPU tensor of ``shape`` in a fresh anonymous mapping (returned to the
    system when the tensor is freed), every page faulted in. ``pages`` (one of
    ``PAGE_POLICIES``): "4k"; "huge": transparent huge pages wherever the host allows them,
    however long the kernel compacts memory for them; "huge-if-free": huge pages while the
    kernel has them at hand, the rest on 4 KiB pages once they come slowly. ``thp_root``:
    where the host's THP settings are read (a test's stand-in for /sys)."""
    if pages not in PAGE_POLICIES:
        raise ValueError(f"KV cache pages must be one of {', '.join(PAGE_POLICIES)}, "
                         f"not {pages[:40]!r}")
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    started, cpu_started = time.perf_counter(), time.thread_time()
    span = -(-max(nbytes, 1) // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    # One huge page more, so the cache can start on a 2 MiB boundary.
    mapping = mmap.mmap(-1, span + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping while alive
    offset = -whole.data_ptr() % HUGE_PAGE_BYTES
    aligned = whole[offset:offset + span]
    settings = thp_settings(thp_root)
    if pages == "4k":
        reason = "4 KiB pages asked for"
    elif not settings.advisable:
        reason = f"transparent huge pages are {settings.enabled!r} on this host"
    else:
        reason = ""
    slow = _fault_in(_libc(), aligned, pages != "4k" and settings.advisable,
                     stop_when_slow=pages == "huge-if-free")
    huge_bytes = anon_huge_bytes(aligned.data_ptr(), span)
    got = "4k" if huge_bytes == 0 else "huge" if huge_bytes >= span else "partly huge"
    if got != "huge" and not (reason or slow):
        reason = "the kernel gave 4 KiB pages where huge ones were advised"
    cache = aligned[:nbytes].view(dtype).view(shape)
    return cache, CacheMemory(pages, got, reason or slow, huge_bytes,
                              time.perf_counter() - started, time.thread_time() - cpu_started)


def anon_huge_bytes(address: int, nbytes: int, smaps: Path = Path("/proc/self/smaps")) -> int:
    """The bytes of this process's mappings overlapping ``[address, address + nbytes)`` that
    the kernel reports on transparent huge pages (``AnonHugePages``). Per mapping (VMA):
    a cache's advised range is a VMA of its own (its advice differs from its neighbours')."""
    total, overlaps = 0, False
    for line in smaps.read_text().splitlines():
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            low, high = (int(part, 16) for part in head.split("-"))
            overlaps = low < address + nbytes and address < high
        elif overlaps and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return total
