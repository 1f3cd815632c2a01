"""The dtype the CPU path runs a bf16 checkpoint in: bf16, float32 with plain weights, and
float32 with its weights packed for oneDNN, in one script.

The default model (SmolLM2-135M-Instruct, a bf16 checkpoint), the offline ``LLM``, 16 chat
prompts x 64 greedy tokens (EOS ignored), every variant once per round, three rounds. bf16
is packed for oneDNN where the CPU has a bf16 matmul (AVX512 or AVX-NE-CONVERT) and plain
elsewhere; "float32_packed" is float32 with every projection and the LM head packed after
loading, which is what ``--dtype auto`` runs where the CPU has no bf16 matmul
(``engine_common/model/packed_linear.py``). Reported: output tokens/s (medians and every
round), each variant's ratio over bf16 and over float32 plain, the dtype ``auto`` chose on
this machine, and where each variant's greedy tokens first part from float32 plain's.
Results: ``bench/results/cpu_dtype.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import first_difference, write_report  # noqa: E402
from engine_common.config import CacheConfig, EngineConfig  # noqa: E402
from engine_common.default_model import ensure_default_model  # noqa: E402
from engine_common.llm import LLM  # noqa: E402
from engine_common.model.packed_linear import bf16_packing_supported  # noqa: E402
from engine_common.sampling_params import SamplingParams  # noqa: E402

VARIANTS = ("bf16", "float32_plain", "float32_packed")


def build(model: Path, variant: str) -> LLM:
    dtype = "bfloat16" if variant == "bf16" else "float32"
    llm = LLM(EngineConfig(model=str(model), dtype=dtype,
                           cache=CacheConfig(num_gpu_blocks_override=512)))
    if variant == "float32_packed":
        assert llm.core.model_runner.model.pack_linear_weights(float32=True)
    return llm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/cpu_dtype.json")
    args = parser.parse_args()
    model = ensure_default_model()
    engines = {variant: build(model, variant) for variant in VARIANTS}
    auto = LLM(EngineConfig(model=str(model), cache=CacheConfig(num_gpu_blocks_override=16)))
    auto_dtype = str(auto.core.model_runner.dtype).removeprefix("torch.")
    auto_packed = auto.core.model_runner.model.packed_lm_head is not None
    del auto
    prompts = [engines["bf16"].inputs.tokenize_chat(
        [{"role": "user", "content": f"Write a short story about the number {i} and a river."}])
        for i in range(args.prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    warmup = SamplingParams(temperature=0.0, max_tokens=4)
    tokens_per_s: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    token_ids: dict[str, list[list[int]]] = {}
    for engine in engines.values():
        engine.generate(prompts[:2], warmup)
    for round_index in range(args.rounds):
        for variant, engine in engines.items():
            started = time.perf_counter()
            outputs = engine.generate(prompts, params)
            seconds = time.perf_counter() - started
            tokens_per_s[variant].append(sum(len(o.token_ids) for o in outputs) / seconds)
            token_ids[variant] = [list(o.token_ids) for o in outputs]
            print(f"round {round_index + 1} {variant:15s} {tokens_per_s[variant][-1]:7.1f} "
                  "tokens/s", flush=True)
    medians = {variant: statistics.median(runs) for variant, runs in tokens_per_s.items()}
    ratios = {f"{variant}_over_{base}": medians[variant] / medians[base]
              for variant in VARIANTS for base in ("bf16", "float32_plain") if variant != base}
    differences = {variant: [first_difference(a, b) for a, b in
                             zip(token_ids[variant], token_ids["float32_plain"], strict=True)]
                   for variant in VARIANTS if variant != "float32_plain"}
    for name, value in ratios.items():
        print(f"{name:36s} {value:.2f}x")
    print(f"--dtype auto on this machine: {auto_dtype}, packed: {auto_packed}")
    write_report(
        args.out, "cpu_dtype",
        settings={"model": str(model), "prompts": args.prompts, "output_len": args.output_len,
                  "rounds": args.rounds, "greedy": True, "ignore_eos": True,
                  "bf16_matmul_on_this_cpu": bf16_packing_supported(),
                  "auto_dtype": auto_dtype, "auto_packed": auto_packed},
        tokens_per_s=tokens_per_s, median_tokens_per_s=medians, ratios=ratios,
        first_difference_from_float32_plain=differences)


if __name__ == "__main__":
    main()
