"""Decode-attention kernel benchmark: achieved KV bandwidth against the GPU's copy bandwidth.

Times the Triton paged decode kernel (engine_common/model/attention/triton_kernels) over a
batch x context sweep, with the split count the kernel chooses and with a single split (to
show what flash-decoding's split buys). Achieved bandwidth is the bytes of KV and q the
kernel must read over its time; the roof is a large device-to-device tensor copy measured
in the same run. Writes JSON with the GPU name and every setting.

GPU only: without CUDA it prints why and exits 0 without measuring anything.

    python bench/attention_kernels.py --out attention_kernels.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("attention_kernels.json"))
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    # Defaults are Llama-3-8B's attention shape.
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--batches", default="1,4,16,64,256")
    parser.add_argument("--contexts", default="512,2048,8192,32768")
    parser.add_argument(
        "--max-kv-gib", type=float, default=16.0, help="skip sweep points whose KV is larger"
    )
    parser.add_argument("--copy-gib", type=float, default=2.0, help="size of the copy roof test")
    return parser.parse_args()


def time_ms(fn) -> float:
    """Median time of ``fn`` in ms; triton's do_bench clears L2 between runs."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def copy_bandwidth_gbps(gib: float) -> float:
    numel = int(gib * 2**30) // 2
    src = torch.empty(numel, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9  # read + write


def make_decode_inputs(args: argparse.Namespace, batch: int, context: int, dtype: torch.dtype):
    from engine_common.model.attention.backend import AttentionMetadata

    blocks_per_seq = math.ceil(context / args.block_size)
    num_blocks = batch * blocks_per_seq + 1
    kv_cache = torch.empty(
        (2, num_blocks, args.block_size, args.num_kv_heads, args.head_size),
        dtype=dtype,
        device="cuda",
    ).normal_()
    # Shuffled blocks, as a long-running server's free list hands them out.
    block_tables = (
        (torch.randperm(num_blocks - 1, device="cuda")[: batch * blocks_per_seq] + 1)
        .view(batch, blocks_per_seq)
        .to(torch.int32)
    )
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device="cuda"),  # unused here
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device="cuda"),
        block_tables=block_tables,
        max_query_len=1,
        max_seq_len=context,
        query_lens_cpu=[1] * batch,
        seq_lens_cpu=[context] * batch,
    )
    query = torch.randn(batch, args.num_heads, args.head_size, dtype=dtype, device="cuda")
    return query, kv_cache, metadata


def check_against_torch_backend(args: argparse.Namespace, dtype: torch.dtype) -> float:
    """Max abs difference between the Triton and PyTorch backends on one small decode step,
    so that a broken kernel's bandwidth is never reported as if it meant something."""
    from engine_common.model.attention.torch_backend import TorchAttentionBackend
    from engine_common.model.attention.triton_backend import TritonAttentionBackend

    batch, bs = 3, args.block_size
    query, kv_cache, md = make_decode_inputs(args, batch=batch, context=1000, dtype=dtype)
    # This step's token is the last of each context: forward writes it, then attends.
    last = md.seq_lens.long() - 1
    md.slot_mapping = md.block_tables.long().gather(1, (last // bs)[:, None])[:, 0] * bs + last % bs
    new_key, new_value = torch.randn(
        2, batch, args.num_kv_heads, args.head_size, dtype=dtype, device="cuda"
    ).unbind(0)
    heads = (args.num_heads, args.num_kv_heads, args.head_size, args.head_size**-0.5)
    out = TritonAttentionBackend(*heads).forward(query, new_key, new_value, kv_cache.clone(), md)
    expected = TorchAttentionBackend(*heads).forward(
        query, new_key, new_value, kv_cache.clone(), md
    )
    return float((out.float() - expected.float()).abs().max())


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

    from engine_common.model.attention.triton_kernels.decode_attention import choose_num_splits

    dtype = DTYPES[args.dtype]
    elem = torch.tensor([], dtype=dtype).element_size()
    device_props = torch.cuda.get_device_properties(0)
    max_abs_err = check_against_torch_backend(args, dtype)
    print(f"GPU: {device_props.name}, {device_props.multi_processor_count} SMs")
    print(f"decode kernel vs torch backend on a small case: max abs diff {max_abs_err:.2e}")
    if max_abs_err > 5e-2:
        print("decode kernel disagrees with the torch backend: not benchmarking it")
        return 1
    copy_gbps = copy_bandwidth_gbps(args.copy_gib)
    print(f"HBM copy bandwidth: {copy_gbps:.0f} GB/s")

    results = []
    header = f"{'batch':>6} {'context':>8} {'splits':>6} {'us':>9} {'GB/s':>7} {'%copy':>6}"
    print(header + f" {'us(1 split)':>12}")
    for batch in (int(b) for b in args.batches.split(",")):
        for context in (int(c) for c in args.contexts.split(",")):
            kv_bytes = 2 * batch * context * args.num_kv_heads * args.head_size * elem
            if kv_bytes > args.max_kv_gib * 2**30:
                continue
            query, kv_cache, md = make_decode_inputs(args, batch, context, dtype)
            num_splits = choose_num_splits(
                batch, args.num_kv_heads, context, device_props.multi_processor_count
            )
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
                    "fraction_of_copy_bandwidth": gbps / copy_gbps,
                }
            )
            print(
                f"{batch:>6} {context:>8} {num_splits:>6} {ms * 1e3:>9.1f} {gbps:>7.0f} "
                f"{100 * gbps / copy_gbps:>5.0f}% {ms_single * 1e3:>12.1f}"
            )
            del query, kv_cache, md
            torch.cuda.empty_cache()

    report = {
        "gpu": device_props.name,
        "num_sms": device_props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "settings": {
            "dtype": args.dtype,
            "num_heads": args.num_heads,
            "num_kv_heads": args.num_kv_heads,
            "head_size": args.head_size,
            "block_size": args.block_size,
            "bytes_counted": "K and V of every context token plus q, read once",
            "timing": "triton.testing.do_bench median, L2 cleared between runs",
        },
        "check_max_abs_diff_vs_torch_backend": max_abs_err,
        "hbm_copy_gbps": copy_gbps,
        "results": results,
    }
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
