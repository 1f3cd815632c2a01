"""The CPU KV cache's pages (engine_common.model.kv_cache_memory): zeros, on transparent
huge pages where the host's THP allows them (the kernel's own AnonHugePages says so), and
4 KiB pages where it does not, where asked, or once huge ones come slowly."""

from pathlib import Path

import pytest
import torch

from engine_common.model import kv_cache_memory
from engine_common.model.kv_cache_memory import (
    HUGE_PAGE_BYTES,
    allocate_host_cache,
    anon_huge_bytes,
    page_policy,
    thp_settings,
)

SHAPE = (4, 2, 2, 3, 16, 64 * 128)  # 24 MiB of bf16: twelve huge pages
NBYTES = 4 * 2 * 2 * 3 * 16 * 64 * 128 * 2


def fake_thp(tmp_path: Path, enabled: str) -> Path:
    for name, text in (("enabled", enabled), ("defrag", "always defer [madvise] never")):
        (tmp_path / name).write_text(text + "\n")
    return tmp_path


def test_huge_pages_where_the_host_allows_them():
    settings = thp_settings()
    if not settings.advisable:
        pytest.skip(f"this host's transparent huge pages are {settings.enabled!r}: "
                    "the fallback is tested below with a stand-in for /sys")
    cache, memory = allocate_host_cache(SHAPE, torch.bfloat16, "huge")
    assert cache.shape == SHAPE and cache.dtype == torch.bfloat16
    assert not cache.any()  # the kernels expect a fresh cache to read as zeros
    assert cache.data_ptr() % HUGE_PAGE_BYTES == 0
    assert memory.pages == "huge", memory.reason
    assert anon_huge_bytes(cache.data_ptr(), NBYTES) >= NBYTES
    cache[-1].fill_(1.5)  # writable to the end
    assert float(cache[-1, -1, -1, -1, -1, -1]) == 1.5


def test_four_kib_pages_when_asked_or_where_thp_is_never(tmp_path):
    asked, memory = allocate_host_cache(SHAPE, torch.bfloat16, "4k")
    assert memory.pages == "4k" and memory.reason == "4 KiB pages asked for"
    assert anon_huge_bytes(asked.data_ptr(), NBYTES) == 0 and not asked.any()
    never = fake_thp(tmp_path, "always madvise [never]")
    assert not thp_settings(never).advisable
    cache, memory = allocate_host_cache(SHAPE, torch.bfloat16, "huge", thp_root=never)
    assert memory.pages == "4k"
    assert memory.reason == "transparent huge pages are 'never' on this host"
    assert anon_huge_bytes(cache.data_ptr(), NBYTES) == 0 and not cache.any()
    assert thp_settings(tmp_path / "absent").enabled == "absent"


def test_the_rest_goes_on_small_pages_once_huge_ones_come_slowly(monkeypatch):
    if not thp_settings().advisable:
        pytest.skip("no transparent huge pages to fall back from on this host")
    # As if compacting: no rate is fast enough, so after the first timed bytes the rest
    # of the cache is faulted in on 4 KiB pages.
    monkeypatch.setattr(kv_cache_memory, "MIN_HUGE_BYTES_PER_CPU_S", float("inf"))
    monkeypatch.setattr(kv_cache_memory, "CHUNK_BYTES", 4 << 20)
    monkeypatch.setattr(kv_cache_memory, "MIN_TIMED_BYTES", 8 << 20)
    cache, memory = allocate_host_cache(SHAPE, torch.bfloat16, "huge-if-free")
    assert memory.pages == "partly huge", memory
    assert "the rest on 4 KiB pages" in memory.reason
    assert anon_huge_bytes(cache.data_ptr(), 8 << 20) >= 8 << 20
    assert anon_huge_bytes(cache.data_ptr() + (8 << 20), NBYTES - (8 << 20)) == 0
    assert not cache.any()


def test_page_policy_by_role():
    assert page_policy("auto", "producer") == "huge"
    assert page_policy("auto", "consumer") == "huge-if-free"
    assert page_policy("auto", None) == "huge-if-free"
    assert page_policy("4k", "producer") == "4k"
    with pytest.raises(ValueError, match="KV cache pages must be"):
        page_policy("gigantic", None)
