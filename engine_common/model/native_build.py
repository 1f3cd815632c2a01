"""Building the engine's C++ CPU kernels once per machine with the system compiler.

Each kernel library is one C++ file (with the shared headers of ``cpu_kernels/``), compiled like torch's inductor compiles its kernels:
``-march=native`` for the CPU it runs on, linked against the libgomp torch has already
loaded (the same soname), so ``torch.set_num_threads`` also bounds the kernel's threads and
no second thread pool spins. A library is cached under ``$TANDEM_CACHE_DIR/kernels``
(default ``~/.cache/tandem/kernels``) by a hash of the source, the shared headers, the compiler, its flags and
the CPU's feature flags, written atomically, so concurrent engines build it at most once
each (one at a time, under a file lock) and never load a half-written file. Without a compiler, or if the build fails,
``load_library`` returns None (logged) and the caller keeps its PyTorch path.

Owns the compiler, the flags every library shares, the cache, the load and the declaration
of an entry point's C signature. It does not own any kernel's entry points or argument
checks (``attention/cpu_paged_kernel``, ``layers/cpu_fused``).
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
# Headers every kernel may include (``#include "bf16.h"``): on the include path, their
# text part of every library's build key (not their path: checkouts share builds).
INCLUDE_DIR = Path(__file__).with_name("cpu_kernels")
_BUILD_TIMEOUT_S = 300


def kernel_cache_dir() -> Path:
    root = os.environ.get("TANDEM_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "tandem") / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def build(compiler: str, source: Path, extra_flags: tuple[str, ...] = ()) -> Path:
    """The library's path, built now unless a build with the same key exists
    (``extra_flags``: the source's own flags, include paths and libraries, after it on the
    command line so that libraries link)."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    headers = [h.read_text() for h in sorted(INCLUDE_DIR.glob("*.h"))]
    key = hashlib.sha256("\0".join([source.read_text(), *headers, compiler, version, *FLAGS,
                                    *extra_flags, _cpu_flags()]).encode()).hexdigest()
    target = kernel_cache_dir() / f"{source.stem}-{key[:20]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # One build at a time per library: a tensor-parallel replica's ranks start together, and
    # N compilers at once cost N times the CPU; the others wait, then load its result.
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            command = [compiler, *FLAGS, f"-I{INCLUDE_DIR}", str(source), *extra_flags,
                       "-o", str(built)]
            proc = subprocess.run(command, capture_output=True, text=True,
                                  timeout=_BUILD_TIMEOUT_S)
            if proc.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {proc.stderr[-2000:]}")
            os.replace(built, target)
    logger.info("built the CPU kernel library %s", target)
    return target


def load_library(source: Path, what: str, fallback: str,
                 extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """``source`` built (if needed) and loaded; None, with a warning naming ``what`` and the
    ``fallback`` the caller takes, where it cannot be built or loaded."""
    cxx = compiler()
    if cxx is None:
        logger.warning("no C++ compiler found: %s unavailable, %s; install g++ or set CXX",
                       what, fallback)
        return None
    try:
        return ctypes.CDLL(str(build(cxx, source, extra_flags)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("%s unavailable (%s): %s", what, str(exc)[:500], fallback)
        return None


def entry_point(library: ctypes.CDLL, name: str, argtypes: list[Any]) -> Any:
    """``library``'s C function ``name``, declared to take ``argtypes`` and to return an int
    (every kernel's status: 0, or a negative code for arguments it refused)."""
    function = getattr(library, name)
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function
