"""native_build: a kernel library is rebuilt when the source or a shared header changes, and
loaded from the cache otherwise (a real compiler, a real tiny library)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from engine_common.model import native_build

SOURCE = """#include "answer.h"
extern "C" int tandem_answer() { return ANSWER; }
"""


@pytest.fixture
def kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    if native_build.compiler() is None:
        pytest.fail("no C++ compiler: make setup installs g++")
    headers = tmp_path / "include"
    headers.mkdir()
    monkeypatch.setattr(native_build, "INCLUDE_DIR", headers)
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "answer.cpp"
    source.write_text(SOURCE)
    return source, headers / "answer.h"


def answer(library: Path) -> int:
    return int(ctypes.CDLL(str(library)).tandem_answer())


def test_a_shared_header_change_rebuilds_every_library_that_may_include_it(kernel):
    source, header = kernel
    compiler = native_build.compiler()
    assert compiler is not None
    header.write_text("#define ANSWER 41\n")
    first = native_build.build(compiler, source)
    assert answer(first) == 41
    assert native_build.build(compiler, source) == first  # cached: not built again
    header.write_text("#define ANSWER 42\n")
    second = native_build.build(compiler, source)
    assert second != first and answer(second) == 42
