"""bf16 projections through oneDNN's matmul primitive, created once and called directly.

torch's packed linear (``packed_linear.packed_linear``) runs oneDNN's kernel on a weight
packed once, but rebuilds the primitive's descriptor, looks the primitive up and allocates
a scratchpad on every call: ~14 us a call on one Zen 4 core, against 20-90 us of kernel for
a SmolLM2 projection at a decode batch of one. ``cpu_kernels/onednn_gemm.cpp`` keeps the
primitive per weight shape and M, and the weight in the layout it prefers; a call costs
~3 us (``bench/cpu_kernels_vs_vllm.py``; vLLM-CPU's ``onednn_mm``, which does the same
behind torch's op dispatcher, ~7 us).

oneDNN comes from the ``onednn-cpu-gomp`` wheel (its library, built on GNU OpenMP: the
libgomp torch has loaded, so ``torch.set_num_threads`` bounds its threads too) and
``onednn-devel-cpu-gomp`` (its headers): torch links its own oneDNN statically and exports
none of it. The library is built once per machine like the paged-attention kernel
(``native_build``). Where the wheels, a compiler or the CPU's
bf16 matmul are missing, ``load_onednn_gemm`` returns None (logged once) and projections
keep torch's packed path. ``TANDEM_ONEDNN_GEMM=0`` turns the path off (for A/B runs).

The arithmetic is oneDNN's bf16 matmul with float32 accumulation, as torch's packed path,
but from another oneDNN version: outputs may differ from it in the last bf16 bit. So it is
used in bf16 only; float32 keeps ``F.linear`` (exact against Hugging Face).

Owns loading the library and one packed weight's handle and call; it does not own which
layers are packed (``packed_linear``, ``layers.linear``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.metadata
import logging
import os
import subprocess
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine_common.model import native_build

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_kernels") / "onednn_gemm.cpp"
_F32, _BF16 = 0, 1  # the source's DType
_OUT_DTYPES = {torch.bfloat16: _BF16, torch.float32: _F32}
# The M oneDNN picks the weight layout for; a primitive for any other M takes that layout.
# A decode batch's order of magnitude (vLLM-CPU probes with 128; 1-128 gave the same
# layout and speed here).
_PROBE_M = 64
_PROFILE_NAME = "tandem::onednn_linear"
_P = ctypes.c_void_p
_I64 = ctypes.c_int64


@dataclass(frozen=True)
class OnednnLibrary:
    """The loaded library's entry points."""

    create: Any
    run: Any
    destroy: Any
    packed_bytes: Any


def _onednn_dirs() -> tuple[Path, Path] | None:
    """(the directory of libdnnl.so.3, the include directory) of the installed wheels."""
    try:
        lib_files = importlib.metadata.files("onednn-cpu-gomp") or []
        include_files = importlib.metadata.files("onednn-devel-cpu-gomp") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    lib = next((f for f in lib_files if f.name == "libdnnl.so.3"), None)
    header = next((f for f in include_files if f.as_posix().endswith("oneapi/dnnl/dnnl.hpp")),
                  None)
    if lib is None or header is None:
        return None
    return Path(str(lib.locate())).parent, Path(str(header.locate())).parents[2]


@functools.cache
def load_onednn_gemm() -> OnednnLibrary | None:
    """The library, built if needed; None (logged once) where it cannot be had."""
    if os.environ.get("TANDEM_ONEDNN_GEMM", "1") == "0":
        return None
    path = build_onednn_gemm()
    if path is None:
        return None
    try:
        return open_library(path)
    except OSError as exc:  # e.g. the wheel's libdnnl.so.3 removed since the build
        logger.warning("oneDNN GEMM library failed to load (%s): bf16 projections use "
                       "torch's packed linear", str(exc)[:500])
        return None


def build_onednn_gemm() -> Path | None:
    """The built library's path (built now if needed); None, logged, where it cannot be."""
    dirs = _onednn_dirs()
    if dirs is None:
        logger.warning("oneDNN's wheels (onednn-cpu-gomp, onednn-devel-cpu-gomp) are not "
                       "installed: bf16 projections use torch's packed linear (slower calls)")
        return None
    lib_dir, include_dir = dirs
    flags = (f"-I{include_dir}", str(lib_dir / "libdnnl.so.3"), f"-Wl,-rpath,{lib_dir}")
    compiler = native_build.compiler()
    if compiler is None:
        logger.warning("no C++ compiler found (install g++ or set CXX): bf16 projections use "
                       "torch's packed linear")
        return None
    try:
        return native_build.build(compiler, _SOURCE, flags)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("oneDNN GEMM library unavailable (%s): bf16 projections use torch's "
                       "packed linear", str(exc)[:500])
        return None


def open_library(path: Path | str) -> OnednnLibrary:
    """The entry points of a library ``build_onednn_gemm`` built (the benchmarks open it
    from vLLM-CPU's interpreter, which has no oneDNN wheels)."""
    library = ctypes.CDLL(str(path))
    create, run = library.tandem_gemm_create, library.tandem_gemm_run
    create.argtypes = [ctypes.c_int, _I64, _I64, _P, _I64, _I64, ctypes.POINTER(_P)]
    create.restype = ctypes.c_int
    run.argtypes = [_P, _P, _I64, _P, _P, ctypes.c_int]
    run.restype = ctypes.c_int
    destroy, packed_bytes = library.tandem_gemm_destroy, library.tandem_gemm_packed_bytes
    destroy.argtypes = [_P]
    destroy.restype = None
    packed_bytes.argtypes = [_P]
    packed_bytes.restype = _I64
    return OnednnLibrary(create, run, destroy, packed_bytes)


class OnednnGemm:
    """One bf16 weight ([out, in]) packed for oneDNN's matmul; calling it is ``F.linear``."""

    def __init__(self, library: OnednnLibrary, weight: torch.Tensor):
        if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(f"expected a 2-D bf16 CPU weight, got {tuple(weight.shape)} "
                             f"{weight.dtype} on {weight.device}")
        weight = weight.contiguous()
        self.out_features, self.in_features = weight.shape
        self._run = library.run
        handle = _P()
        code = library.create(_BF16, self.out_features, self.in_features, weight.data_ptr(),
                              weight.stride(0), _PROBE_M, ctypes.byref(handle))
        if code != 0:
            raise RuntimeError(f"oneDNN refused to pack a {tuple(weight.shape)} bf16 weight "
                               f"(code {code})")
        self._handle = handle
        self.nbytes = int(library.packed_bytes(handle))
        # The packed copy is oneDNN's memory: freed with this object.
        weakref.finalize(self, library.destroy, handle)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None,
                 out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """``F.linear(x, weight, bias)``; ``out_dtype`` float32: its float32 sums, not
        rounded to bf16 (the LM head's logits: ``CausalLM.compute_logits``)."""
        if x.dtype != torch.bfloat16 or x.shape[-1] != self.in_features:
            raise ValueError(f"expected [..., {self.in_features}] bf16 input, got "
                             f"{tuple(x.shape)} {x.dtype}")
        rows = x.reshape(-1, self.in_features)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        if out_dtype not in _OUT_DTYPES:
            raise ValueError(f"out_dtype must be bfloat16 or float32, not {out_dtype}")
        out = torch.empty(rows.shape[0], self.out_features, dtype=out_dtype)
        if rows.shape[0]:
            if bias is not None and not (bias.dtype == torch.bfloat16 and bias.is_contiguous()
                                         and bias.numel() == self.out_features):
                raise ValueError("bias must be a contiguous bf16 vector of out_features")
            # torch.profiler sees no foreign call: name it while a profile is recording.
            with (torch.profiler.record_function(_PROFILE_NAME)
                  if torch.autograd.profiler._is_profiler_enabled else contextlib.nullcontext()):
                code = self._run(self._handle, rows.data_ptr(), rows.shape[0],
                                 out.data_ptr(), None if bias is None else bias.data_ptr(),
                                 _OUT_DTYPES[out_dtype])
            if code != 0:
                raise RuntimeError(f"oneDNN matmul failed (code {code})")
        return out.view(*x.shape[:-1], self.out_features)


def pack_for_onednn(weight: torch.Tensor) -> OnednnGemm | None:
    """``weight`` packed for the direct oneDNN path, or None where that path is unavailable
    (then torch's packed linear serves)."""
    library = load_onednn_gemm()
    if library is None or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return None
    try:
        return OnednnGemm(library, weight)
    except RuntimeError as exc:  # e.g. no bf16 matmul on this CPU in this oneDNN
        logger.warning("%s: torch's packed linear serves instead", exc)
        return None
