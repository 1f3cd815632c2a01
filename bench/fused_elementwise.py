"""The decoder's elementwise work of one forward step, torch ops against the fused CPU kernels.

Owns one measurement: for SmolLM2-135M's shapes (30 layers, hidden 576, intermediate 1536,
9 query + 3 KV heads of 64) and a number of tokens (``--tokens``: a batch-1 decode, a
batch-64 decode, a prefill chunk), the work the fused kernels
(``engine_common/model/layers/cpu_fused.py``) replace in one forward: 61 residual adds +
RMSNorms, 30 SiLU x up, 30 rotary rotations of q/k. Each is timed through the layers'
own methods, once with the kernels and once with the torch ops (the layers' fallback), in
thread CPU time, the two interleaved round by round on one pinned core; the medians are
reported. It does not time the GEMMs or attention (``engine_profile`` does the whole step).

    .venv/bin/python bench/fused_elementwise.py --cpu 1 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import write_report  # noqa: E402
from engine_common.model.layers import cpu_fused  # noqa: E402
from engine_common.model.layers.norm import RMSNorm  # noqa: E402
from engine_common.model.layers.rotary import RotaryEmbedding  # noqa: E402

LAYERS, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD = 30, 576, 1536, 9, 3, 64


def step_work(tokens: int, dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    """One forward's worth of each kind of work, through the layers' code paths."""
    cpu = torch.device("cpu")
    norm = RMSNorm(HIDDEN, 1e-5, dtype, cpu)
    norm.weight.data.uniform_(0.5, 1.5)
    x, residual = torch.randn(tokens, HIDDEN).to(dtype), torch.randn(tokens, HIDDEN).to(dtype)
    gate_up = torch.randn(tokens, 2 * INTERMEDIATE).to(dtype)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD).to(dtype)
    qk = qkv[:, : (HEADS + KV_HEADS) * HEAD].view(tokens, -1, HEAD)
    angles = torch.rand(tokens, 1, HEAD // 2) * 100
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    rotate = RotaryEmbedding.rotate_
    rotary = mock.Mock(half_size=HEAD // 2)  # all rotate_ reads of its module

    def silu_mul() -> object:  # GatedMLP.forward between its two projections
        ops = cpu_fused.silu_ops_for(gate_up, INTERMEDIATE)
        if ops is not None:
            return ops.silu_mul(gate_up, INTERMEDIATE)
        return torch.nn.functional.silu(gate_up[:, :INTERMEDIATE]) * gate_up[:, INTERMEDIATE:]

    return {
        "residual add + RMSNorm (x61)": repeat(lambda: norm.add_forward(x, residual),
                                               2 * LAYERS + 1),
        "SiLU x up (x30)": repeat(silu_mul, LAYERS),
        "rotary (x30)": repeat(lambda: rotate(rotary, qk, (cos, sin)), LAYERS),
    }


def repeat(fn: Callable[[], object], times: int) -> Callable[[], None]:
    """``fn`` ``times`` times, each result dropped before the next call as in a forward
    (kept alive, 61 outputs of prefill size would measure page faults, not the work)."""
    def run() -> None:
        for _ in range(times):
            fn()
    return run


def thread_ms(fn: Callable[[], object]) -> float:
    started = time.thread_time()
    fn()
    return 1000 * (time.thread_time() - started)


def measure(tokens: int, dtype: torch.dtype, rounds: int) -> dict[str, dict[str, float]]:
    work = step_work(tokens, dtype)
    times: dict[str, dict[str, list[float]]] = {k: {"torch": [], "fused": []} for k in work}
    for _ in range(rounds):
        for name, fn in work.items():
            times[name]["fused"].append(thread_ms(fn))
            with mock.patch.object(cpu_fused, "load_fused_ops", lambda: None):
                times[name]["torch"].append(thread_ms(fn))
    return {name: {"torch_ms": statistics.median(t["torch"]),
                   "fused_ms": statistics.median(t["fused"])} for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--tokens", default="1,64,2048")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", type=Path,
                        default=ROOT / "bench" / "results" / "fused_elementwise.json")
    args = parser.parse_args()
    os.sched_setaffinity(0, {args.cpu})
    torch.set_num_threads(1)
    assert cpu_fused.load_fused_ops() is not None, "the fused kernels did not build"
    dtype = getattr(torch, args.dtype)
    results = {}
    with torch.inference_mode():
        for tokens in (int(t) for t in args.tokens.split(",")):
            results[str(tokens)] = measure(tokens, dtype, args.rounds)
            for name, r in results[str(tokens)].items():
                print(f"{tokens:5d} tokens  {name:30s} torch {r['torch_ms']:8.2f} ms  fused "
                      f"{r['fused_ms']:8.2f} ms  ({r['torch_ms'] / r['fused_ms']:.2f}x)")
    write_report(args.out, "fused_elementwise", settings=vars(args) | {"out": str(args.out)},
                 load_average=os.getloadavg(), results=results)


if __name__ == "__main__":
    main()
