"""A decode step of the synthetic Qwen3-MoE-shaped model (``bench/moe_throughput.py``'s) in
bf16 on the CPU, with the experts' matrices packed for oneDNN (the default) and plain (the
grouped GEMM), by thread CPU time, in interleaved rounds in one process on one core, so that
other load on a shared machine weighs on both alike. Also checks both give the same tokens.

    python bench/moe_expert_packing.py [--batch 64] [--rounds 8] [--steps 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.moe_throughput import VOCAB, build_model  # noqa: E402
from bench.report import write_report  # noqa: E402


def engine(model: Path, packed: bool):  # type: ignore[no-untyped-def]
    from engine_common.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine_common.llm import LLM
    from engine_common.model.layers.moe import SparseMoeBlock

    config = EngineConfig(model=str(model), dtype="bfloat16",
                          cache=CacheConfig(kv_cache_memory_bytes=1 << 30),
                          scheduler=SchedulerConfig(max_num_batched_tokens=8192,
                                                    max_num_seqs=256))
    if packed:
        return LLM(config)
    with mock.patch.object(SparseMoeBlock, "pack_weight", lambda self, float32=False: None):
        return LLM(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--cpu", type=int, default=0)
    parser.add_argument("--model-root", type=Path, default=ROOT / ".cache" / "moe_bench")
    parser.add_argument("--out", type=Path,
                        default=ROOT / "bench" / "results" / "moe_expert_packing.json")
    args = parser.parse_args()
    os.sched_setaffinity(0, [args.cpu])
    torch.set_num_threads(1)
    from engine_common.sampling_params import SamplingParams

    model = build_model("qwen3_moe", args.model_root / "qwen3_moe")
    prompts = torch.randint(3, VOCAB, (args.batch, 32),
                            generator=torch.Generator().manual_seed(1)).tolist()
    engines = {"packed": engine(model, True), "plain": engine(model, False)}
    tokens: dict[str, list[list[int]]] = {}
    max_tokens = 2 + args.rounds * args.steps
    for name, llm in engines.items():
        for prompt in prompts:
            llm.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                   ignore_eos=True))
        llm.step()  # the prefill
        tokens[name] = [[] for _ in prompts]
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    for round_ in range(args.rounds):
        order = list(engines.items())
        for name, llm in order if round_ % 2 == 0 else order[::-1]:
            started = time.thread_time()
            for _ in range(args.steps):
                for out in llm.step():
                    tokens[name][int(out.request_id.rsplit("-", 1)[1]) % args.batch].extend(
                        out.new_token_ids)
            seconds[name].append((time.thread_time() - started) / args.steps)
    for name in engines:
        print(f"{name}: {[round(s * 1e3, 1) for s in seconds[name]]} ms thread CPU per step")
    # Both run the same steps (the same context lengths) in the same round.
    ratios = sorted(p / q for p, q in zip(seconds["plain"], seconds["packed"], strict=True))
    ratio = ratios[len(ratios) // 2]
    same = tokens["packed"] == tokens["plain"]
    print(f"plain / packed per round: {[round(r, 2) for r in ratios]}, median {ratio:.2f}x; same tokens: {same}; "
          f"load {os.getloadavg()[0]:.1f}")
    write_report(args.out, "moe_expert_packing", settings={k: str(v) if isinstance(v, Path) else v
                                                        for k, v in vars(args).items()} | {
        "model": "synthetic Qwen3-MoE-shaped (16 experts, top-4, hidden 512, 8 layers)",
        "dtype": "bfloat16"}, results={
        "seconds_per_step": seconds, "plain_over_packed_per_round": ratios,
        "plain_over_packed_median": ratio,
        "same_tokens": same, "load_1min_after": os.getloadavg()[0]})


if __name__ == "__main__":
    main()
