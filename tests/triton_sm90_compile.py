"""Compiles the engine's Triton kernels for an H100 (sm_90) on a machine without a GPU.

The interpreter checks what the kernels compute, not whether they compile for the GPU:
``tl.dot`` shapes, types, register pressure and launch options are only checked by the
real compiler. This script calls the engine's launch functions (``kv_write``,
``decode_attention``, ``prefill_attention``) with CPU tensors, records each kernel launch
instead of running it, and compiles every recorded launch with Triton's CUDA backend for
sm_90 (PTX, then ptxas to a cubin; both ship with Triton). ``cuobjdump`` then reads each
cubin's registers and local memory (register spills live there).

Run without TRITON_INTERPRET; prints one JSON record per compiled launch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_common.model.attention.kv_cache_layout import kv_cache_shape, layer_cache  # noqa: E402
from engine_common.model.attention.triton_kernels import (  # noqa: E402
    decode_attention,
    kv_write,
    prefill_attention,
)

H100 = GPUTarget("cuda", 90, 32)
_POINTER_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32",
                  torch.int32: "*i32", torch.int64: "*i64"}
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas")


@dataclass
class Launch:
    case: str
    kernel: JITFunction
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass
class Compiled:
    case: str
    kernel: str
    registers: int
    local_bytes: int  # register spills
    shared_bytes: int


def record_launches(case: str, function: Any, *args: Any, **kwargs: Any) -> list[Launch]:
    """Calls ``function(*args, **kwargs)`` with every kernel launch recorded instead of run."""
    launches: list[Launch] = []

    def record(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        launches.append(Launch(case, self, args, kwargs))

    original = JITFunction.run
    JITFunction.run = record  # type: ignore[method-assign]
    try:
        function(*args, **kwargs)
    finally:
        JITFunction.run = original  # type: ignore[method-assign]
    return launches


def _scalar_type(value: Any) -> str:
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    return "fp32"


def compile_launch(launch: Launch) -> Compiled:
    kernel = launch.kernel
    values = dict(zip(kernel.arg_names, launch.args, strict=False))
    values.update({k: v for k, v in launch.kwargs.items() if k not in _LAUNCH_OPTIONS})
    signature: dict[str, str] = {}
    constexprs: dict[tuple[int, ...], Any] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    unspecialised = set(kernel.do_not_specialize) | {kernel.arg_names[i] for i in
                                                     kernel.do_not_specialize
                                                     if isinstance(i, int)}
    for index, name in enumerate(kernel.arg_names):
        value = values[name]
        if index in kernel.constexprs:
            signature[name] = "constexpr"
            constexprs[(index,)] = value
        elif isinstance(value, torch.Tensor):
            signature[name] = _POINTER_TYPES[value.dtype]
            attrs[(index,)] = [["tt.divisibility", 16]]  # torch allocations are aligned
        else:
            signature[name] = _scalar_type(value)
            if (name not in unspecialised and isinstance(value, int)
                    and not isinstance(value, bool) and value % 16 == 0):
                attrs[(index,)] = [["tt.divisibility", 16]]
    options = {k: launch.kwargs[k] for k in _LAUNCH_OPTIONS if k in launch.kwargs}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=H100, options=options)
    usage = _resource_usage(compiled.asm["cubin"])
    return Compiled(launch.case, kernel.__name__, usage["REG"], usage["LOCAL"], usage["SHARED"])


def _resource_usage(cubin: bytes) -> dict[str, int]:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], check=True,
                             capture_output=True, text=True).stdout
    line = next(line for line in out.splitlines() if "REG:" in line)
    return {k: int(v) for k, v in (item.split(":")[:2] for item in line.split())
            if v.isdigit()}


def launches_to_compile() -> list[Launch]:
    """The launches of the shapes the engine serves: SmolLM2's (head 64, 9/3 heads),
    Llama-3-8B's (128, 32/8) and the test models' (16 and 32, 4/2), in the dtypes the tests
    and benchmarks use; decode with one split and with several, prefill with short and
    long queries."""
    launches: list[Launch] = []
    block_size, num_blocks = 16, 8
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    shapes = [(bf16, 64, 9, 3), (fp32, 64, 9, 3), (bf16, 128, 32, 8), (fp16, 128, 32, 8),
              (fp32, 128, 32, 8), (bf16, 16, 4, 2), (fp32, 16, 4, 2), (fp32, 32, 4, 2)]
    for dtype, head_size, heads, kv_heads in shapes:
        name = f"{str(dtype).removeprefix('torch.')} head {head_size} gqa {heads}/{kv_heads}"
        # A layer's view of the engine's block-major cache (strided over blocks)
        cache = layer_cache(torch.zeros(kv_cache_shape(2, num_blocks, block_size, kv_heads,
                                                       head_size), dtype=dtype), 1)
        tables = torch.zeros(2, 4, dtype=torch.int32)
        seq_lens = torch.tensor([40, 7], dtype=torch.int32)
        key = torch.zeros(5, kv_heads, head_size, dtype=dtype)
        slots = torch.arange(5, dtype=torch.int64)
        launches += record_launches(f"kv_write {name}", kv_write.kv_write, key, key, cache, slots)
        for splits in (1, 4):
            query = torch.zeros(2, heads, head_size, dtype=dtype)
            launches += record_launches(
                f"decode {splits} split(s) {name}", decode_attention.decode_attention,
                query, cache, torch.empty_like(query), tables, seq_lens,
                torch.arange(3, dtype=torch.int32), 0.1, 40, num_splits=splits)
        for num_tokens, case in ((2, "short queries"), (47, "long queries")):
            query = torch.zeros(num_tokens, heads, head_size, dtype=dtype)
            launches += record_launches(
                f"prefill {case} {name}", prefill_attention.prefill_attention,
                query, cache, torch.empty_like(query), tables, seq_lens,
                torch.tensor([0, num_tokens - 1, num_tokens], dtype=torch.int32), 0.1,
                max_query_len=num_tokens - 1)
    return launches


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run without TRITON_INTERPRET: the interpreter compiles nothing")
    # The launch functions refuse CPU tensors for compiled kernels; nothing runs here.
    for module in (kv_write, decode_attention, prefill_attention):
        module.check_launchable = lambda kernel, tensor: None  # type: ignore[attr-defined]
    for launch in launches_to_compile():
        print(json.dumps(asdict(compile_launch(launch))), flush=True)


if __name__ == "__main__":
    main()
