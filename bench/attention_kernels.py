"""Decode-attention kernel benchmark: achieved KV bandwidth against the GPU's memory roof.

Owns checking the Triton paged-attention kernels against the PyTorch backend on the GPU
(decode with the chosen and with forced split counts, and a mixed prefill + decode step),
measuring the memory roof (a large device-to-device copy, and a large read-only reduction)
and timing the Triton decode kernel (engine_common/model/attention/triton_kernels) over a
batch x context sweep, with the split count the kernel chooses and with a single split (to
show what flash-decoding's split buys). Achieved bandwidth is the bytes of KV and q the
kernel must read over its time.

Importable (bench/gpu_benchmark.py, behind ``make bench-gpu``, runs these checks and this
sweep in its one run) and runnable alone. GPU only: without CUDA ``main`` prints why and
exits 0 without measuring anything.

    python bench/attention_kernels.py --out attention_kernels.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Max abs difference from the PyTorch backend a correct kernel stays under (outputs are
# attention-weighted averages of N(0, 1) values, so of order 1).
CHECK_TOLERANCES = {torch.bfloat16: 5e-2, torch.float16: 1e-2, torch.float32: 1e-3}


@dataclass(frozen=True)
class AttentionShape:
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int = 16

    @property
    def label(self) -> str:
        return f"{self.num_heads}q/{self.num_kv_heads}kv x {self.head_size}"


# Llama-3-8B's attention: the sweep's default shape.
LLAMA3_8B_ATTENTION = AttentionShape(num_heads=32, num_kv_heads=8, head_size=128)


@dataclass
class KernelCheck:
    """One comparison of the Triton backend (or decode kernel) with the PyTorch backend."""

    case: str
    shape: str
    dtype: str
    seq_lens: list[int]
    query_lens: list[int]
    num_splits: int | None  # None: the split count the kernel chooses
    max_abs_diff: float
    tolerance: float

    @property
    def passed(self) -> bool:
        # NaN compares False, so a kernel that writes NaN fails.
        return self.max_abs_diff <= self.tolerance

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


def time_ms(fn: Callable[[], object]) -> float:
    """Median time of ``fn`` in ms; triton's do_bench clears L2 between runs."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def copy_bandwidth_gbps(gib: float) -> float:
    """A device-to-device copy of ``gib`` GiB: bytes read plus bytes written over its time."""
    numel = int(gib * 2**30) // 2
    src = torch.empty(numel, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * numel * 2 / (ms * 1e-3) / 1e9


def read_bandwidth_gbps(gib: float) -> float:
    """A sum over ``gib`` GiB: the read-only roof, which is what a decode kernel does."""
    numel = int(gib * 2**30) // 4
    src = torch.empty(numel, dtype=torch.float32, device="cuda").normal_()
    out = torch.empty((), dtype=torch.float32, device="cuda")
    ms = time_ms(lambda: torch.sum(src, dim=0, out=out))
    return numel * 4 / (ms * 1e-3) / 1e9


def make_step_inputs(
    shape: AttentionShape,
    seq_lens: Sequence[int],
    query_lens: Sequence[int],
    dtype: torch.dtype,
    device: str = "cuda",
):
    """(query, new_key, new_value, kv_cache, metadata) of one step over a random paged cache.

    Sequence ``i`` has ``seq_lens[i]`` tokens after the step, its last ``query_lens[i]``
    computed now; blocks are shuffled, as a long-running server's free list hands them out.
    """
    from engine_common.model.attention.backend import AttentionMetadata

    bs = shape.block_size
    blocks_per_seq = [math.ceil(s / bs) for s in seq_lens]
    width = max(blocks_per_seq)
    num_blocks = sum(blocks_per_seq) + 1
    # One layer's [num_blocks, 2, kv_heads, block_size, head] (kv_cache_layout; one layer
    # alone, so its block stride is that layer's block)
    kv_cache = torch.empty(
        (num_blocks, 2, shape.num_kv_heads, bs, shape.head_size), dtype=dtype, device=device
    ).normal_()
    ids = (torch.randperm(num_blocks - 1, device=device) + 1).to(torch.int32)
    block_tables = torch.zeros((len(seq_lens), width), dtype=torch.int32, device=device)
    start = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = ids[start : start + n]
        start += n
    positions = torch.cat(
        [torch.arange(s - q, s, device=device) for s, q in zip(seq_lens, query_lens, strict=True)]
    )
    seq_index = torch.repeat_interleave(
        torch.arange(len(seq_lens), device=device),
        torch.tensor(list(query_lens), device=device),
    )
    slot_mapping = block_tables.long()[seq_index, positions // bs] * bs + positions % bs
    query_start_loc = torch.zeros(len(seq_lens) + 1, dtype=torch.int32, device=device)
    query_start_loc[1:] = torch.tensor(list(query_lens), device=device).cumsum(0)
    metadata = AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
        block_tables=block_tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
    )
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, shape.num_heads, shape.head_size, dtype=dtype, device=device)
    new_key, new_value = torch.randn(
        2, num_tokens, shape.num_kv_heads, shape.head_size, dtype=dtype, device=device
    ).unbind(0)
    return query, new_key, new_value, kv_cache, metadata


def make_decode_inputs(shape: AttentionShape, batch: int, context: int, dtype: torch.dtype):
    """(query, kv_cache, metadata) of a pure decode step: ``batch`` sequences of ``context``."""
    query, _key, _value, kv_cache, metadata = make_step_inputs(
        shape, [context] * batch, [1] * batch, dtype
    )
    return query, kv_cache, metadata


def check_against_torch_backend(
    shape: AttentionShape,
    dtype: torch.dtype,
    seq_lens: Sequence[int] = (1000, 1000, 1000),
    query_lens: Sequence[int] = (1, 1, 1),
    num_splits: int | None = None,
    device: str = "cuda",
) -> float:
    """Max abs difference between the Triton and PyTorch backends on one step, so that a
    broken kernel's bandwidth is never reported as if it meant something.

    With ``num_splits`` (pure decode steps only) the decode kernel runs with that split
    count instead of the one it would choose. (``device="cpu"`` runs the kernels in
    Triton's interpreter, which TRITON_INTERPRET=1 must have enabled before triton loaded.)
    """
    from engine_common.model.attention.torch_backend import TorchAttentionBackend
    from engine_common.model.attention.triton_backend import TritonAttentionBackend
    from engine_common.model.attention.triton_kernels.decode_attention import decode_attention
    from engine_common.model.attention.triton_kernels.kv_write import kv_write

    query, key, value, kv_cache, md = make_step_inputs(shape, seq_lens, query_lens, dtype, device)
    heads = (shape.num_heads, shape.num_kv_heads, shape.head_size, shape.head_size**-0.5)
    expected = TorchAttentionBackend(*heads).forward(query, key, value, kv_cache.clone(), md)
    if num_splits is None:
        out = TritonAttentionBackend(*heads).forward(query, key, value, kv_cache.clone(), md)
    else:
        assert md.is_pure_decode, "a forced split count applies to pure decode steps"
        cache = kv_cache.clone()
        kv_write(key, value, cache, md.slot_mapping)
        out = torch.empty_like(query)
        decode_attention(
            query, cache, out, md.block_tables, md.seq_lens, md.query_start_loc,
            shape.head_size**-0.5, md.max_seq_len, num_splits=num_splits,
        )
    return float((out.float() - expected.float()).abs().max())


# (case, seq_lens, query_lens, num_splits): decodes over ragged contexts (one of a single
# token, one across many splits), the same with forced split counts, and a mixed step
# (a whole prompt, a chunk after a cached prefix, two decodes) that takes the prefill kernel.
CHECK_CASES: list[tuple[str, list[int], list[int], int | None]] = [
    ("decode", [1000, 1, 333, 4097], [1, 1, 1, 1], None),
    ("decode, 1 split", [1000, 1, 333, 4097], [1, 1, 1, 1], 1),
    ("decode, 4 splits", [1000, 1, 333, 4097], [1, 1, 1, 1], 4),
    ("mixed prefill + decode", [1000, 37, 300, 129], [1, 37, 100, 1], None),
]


def run_kernel_checks(
    shapes: Sequence[AttentionShape], dtypes: Sequence[torch.dtype], device: str = "cuda"
) -> list[KernelCheck]:
    torch.manual_seed(0)
    checks = []
    for shape in shapes:
        for dtype in dtypes:
            for case, seq_lens, query_lens, num_splits in CHECK_CASES:
                diff = check_against_torch_backend(
                    shape, dtype, seq_lens, query_lens, num_splits, device
                )
                checks.append(
                    KernelCheck(
                        case=case,
                        shape=shape.label,
                        dtype=str(dtype).removeprefix("torch."),
                        seq_lens=seq_lens,
                        query_lens=query_lens,
                        num_splits=num_splits,
                        max_abs_diff=diff,
                        tolerance=CHECK_TOLERANCES[dtype],
                    )
                )
    return checks


def time_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata,
    num_splits: int | None,
) -> float:
    from engine_common.model.attention.triton_kernels.decode_attention import decode_attention

    out = torch.empty_like(query)
    scale = query.shape[-1] ** -0.5
    return time_ms(
        lambda: decode_attention(
            query,
            kv_cache,
            out,
            metadata.block_tables,
            metadata.seq_lens,
            metadata.query_start_loc,
            scale,
            metadata.max_seq_len,
            num_splits=num_splits,
        )
    )


def sweep_decode_bandwidth(
    shape: AttentionShape,
    dtype: torch.dtype,
    batches: Sequence[int],
    contexts: Sequence[int],
    max_kv_gib: float,
    roof_gbps: float,
) -> list[dict[str, Any]]:
    """Times the decode kernel at every (batch, context) whose KV fits ``max_kv_gib``;
    prints a row per point and returns them."""
    from engine_common.model.attention.triton_kernels.decode_attention import choose_num_splits

    elem = torch.empty((), dtype=dtype).element_size()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    print(f"{'batch':>6} {'context':>8} {'splits':>6} {'us':>9} {'GB/s':>7} {'%roof':>6}"
          f" {'us(1 split)':>12}")
    for batch in batches:
        for context in contexts:
            kv_bytes = 2 * batch * context * shape.num_kv_heads * shape.head_size * elem
            if kv_bytes > max_kv_gib * 2**30:
                continue
            query, kv_cache, md = make_decode_inputs(shape, batch, context, dtype)
            num_splits = choose_num_splits(batch, shape.num_kv_heads, context, num_sms)
            ms = time_decode(query, kv_cache, md, num_splits=None)
            ms_single = time_decode(query, kv_cache, md, num_splits=1)
            bytes_read = kv_bytes + query.numel() * elem
            gbps = bytes_read / (ms * 1e-3) / 1e9
            results.append(
                {
                    "batch": batch,
                    "context": context,
                    "num_splits": num_splits,
                    "time_us": ms * 1e3,
                    "time_us_single_split": ms_single * 1e3,
                    "kv_and_q_bytes": bytes_read,
                    "achieved_gbps": gbps,
                    "fraction_of_roof": gbps / roof_gbps,
                }
            )
            print(
                f"{batch:>6} {context:>8} {num_splits:>6} {ms * 1e3:>9.1f} {gbps:>7.0f} "
                f"{100 * gbps / roof_gbps:>5.0f}% {ms_single * 1e3:>12.1f}",
                flush=True,
            )
            del query, kv_cache, md
            torch.cuda.empty_cache()
    return results


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("attention_kernels.json"))
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    # Defaults are Llama-3-8B's attention shape.
    parser.add_argument("--num-heads", type=int, default=LLAMA3_8B_ATTENTION.num_heads)
    parser.add_argument("--num-kv-heads", type=int, default=LLAMA3_8B_ATTENTION.num_kv_heads)
    parser.add_argument("--head-size", type=int, default=LLAMA3_8B_ATTENTION.head_size)
    parser.add_argument("--block-size", type=int, default=LLAMA3_8B_ATTENTION.block_size)
    parser.add_argument("--batches", default="1,4,16,64,256")
    parser.add_argument("--contexts", default="512,2048,8192,32768")
    parser.add_argument(
        "--max-kv-gib", type=float, default=16.0, help="skip sweep points whose KV is larger"
    )
    parser.add_argument("--copy-gib", type=float, default=2.0, help="size of the roof tests")
    return parser.parse_args(argv)


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        print(
            "bench/attention_kernels.py: no CUDA device here. This benchmark times the Triton "
            "decode kernel on a GPU; nothing was measured. (The kernels' CPU tests are "
            "tests/test_triton_attention.py.)"
        )
        return 0

    import triton

    dtype = DTYPES[args.dtype]
    shape = AttentionShape(args.num_heads, args.num_kv_heads, args.head_size, args.block_size)
    device_props = torch.cuda.get_device_properties(0)
    print(f"GPU: {device_props.name}, {device_props.multi_processor_count} SMs")
    checks = run_kernel_checks([shape], [dtype])
    for check in checks:
        print(f"check {check.case} ({check.dtype}): max abs diff {check.max_abs_diff:.2e}")
    if not all(check.passed for check in checks):
        print("the Triton kernels disagree with the torch backend: not benchmarking them")
        return 1
    copy_gbps = copy_bandwidth_gbps(args.copy_gib)
    read_gbps = read_bandwidth_gbps(args.copy_gib)
    roof_gbps = max(copy_gbps, read_gbps)
    print(f"HBM copy bandwidth: {copy_gbps:.0f} GB/s, read-only: {read_gbps:.0f} GB/s")
    results = sweep_decode_bandwidth(
        shape,
        dtype,
        [int(b) for b in args.batches.split(",")],
        [int(c) for c in args.contexts.split(",")],
        args.max_kv_gib,
        roof_gbps,
    )
    report = {
        "gpu": device_props.name,
        "num_sms": device_props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "settings": {
            "dtype": args.dtype,
            **asdict(shape),
            "bytes_counted": "K and V of every context token plus q, read once",
            "timing": "triton.testing.do_bench median, L2 cleared between runs",
            "roof": "max(device copy read+write GB/s, float32 sum read GB/s)",
        },
        "checks": [check.to_json() for check in checks],
        "hbm_copy_gbps": copy_gbps,
        "hbm_read_gbps": read_gbps,
        "roof_gbps": roof_gbps,
        "results": results,
    }
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
