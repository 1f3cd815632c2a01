"""Tensor parallelism on this machine's cores: TP=2 against TP=1 decode throughput and step
latency, and the all-reduce's share of a TP=2 step (issue 36).

Two models: the default (SmolLM2-135M, bf16) and a synthetic Llama of about 1.1B parameters
(TinyLlama's shapes: hidden 2048, 22 layers, 32 query / 4 KV heads, MLP 5632, SmolLM2's
49,152-token vocabulary; random bf16 weights written once under ``--model-root``). For each
model and size: ``--batch`` prompts of ``--prompt-len`` random tokens, ``--output-len``
greedy tokens each, EOS ignored, through the offline engine in its own process on the
same CPUs (``--cpus``: TP=1 runs two torch threads on both, TP=2 one rank per CPU; and,
to tell TP's gain from two threads' cost on a busy machine, TP=1 on the first CPU alone
with one thread, ``tp1_one_cpu``). The
prompts are prefilled in the first step; every later step is a pure decode step of the
whole batch, and those are measured: wall time per step, the CPU seconds every rank used
(from /proc), and on rank 0 the wall time inside the all-reduces (which includes waiting
for the other rank: the collective's real cost to the step). Sizes alternate within a round
(in reverse order in odd rounds).

The machine is shared with other agents: the load average around each run is recorded, and
the CPU seconds per step are the steadier figure under load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import write_report  # noqa: E402

RESULT_PREFIX = "TP_RESULT "
SYNTHETIC_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                    num_attention_heads=32, num_key_value_heads=4, vocab_size=49152)


def build_synthetic(out: Path) -> Path:
    """The ~1.1B-parameter Llama at ``out`` (random bf16 weights, the default model's
    tokenizer); built once."""
    if (out / "model.safetensors").is_file():
        return out
    from safetensors.torch import save_file

    from engine_common.default_model import default_model_dir

    out.mkdir(parents=True, exist_ok=True)
    source = default_model_dir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, out / name)
    shape = SYNTHETIC_1B
    h, inter, heads, kv = (shape["hidden_size"], shape["intermediate_size"],
                           shape["num_attention_heads"], shape["num_key_value_heads"])
    head = h // heads
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "max_position_embeddings": 2048, "tie_word_embeddings": False,
              "bos_token_id": 0, "eos_token_id": 0, **shape}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    g = torch.Generator().manual_seed(0)

    def rand(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=g) * 0.02).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": rand(shape["vocab_size"], h),
               "lm_head.weight": rand(shape["vocab_size"], h),
               "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {p + "self_attn.q_proj.weight": rand(h, h),
                    p + "self_attn.k_proj.weight": rand(kv * head, h),
                    p + "self_attn.v_proj.weight": rand(kv * head, h),
                    p + "self_attn.o_proj.weight": rand(h, h),
                    p + "mlp.gate_proj.weight": rand(inter, h),
                    p + "mlp.up_proj.weight": rand(inter, h),
                    p + "mlp.down_proj.weight": rand(h, inter),
                    p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                    p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)}
    print(f"synthetic model: {sum(t.numel() for t in tensors.values()) / 1e9:.2f}B parameters",
          flush=True)
    save_file(tensors, str(out / "model.safetensors"))
    return out


class _TimedGroup:
    """Rank 0's process group, timing each collective to its end (bench only)."""

    def __init__(self, group: Any):
        self.group = group
        self.all_reduce_s = 0.0
        self.all_reduces = 0

    def allreduce(self, tensors: list[torch.Tensor], *options: Any) -> Any:
        start = time.perf_counter()
        self.group.allreduce(tensors, *options).wait()
        self.all_reduce_s += time.perf_counter() - start
        self.all_reduces += 1
        return _Done()

    def allgather(self, *args: Any) -> Any:
        return self.group.allgather(*args)


class _Done:
    def wait(self) -> None:
        return None


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker(cfg: dict[str, Any]) -> None:
    """One engine, one workload; prints the measurement."""
    import random

    from engine_common.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine_common.llm import LLM
    from engine_common.sampling_params import SamplingParams

    if cfg["tp"] == 1:  # the replica's core would pin itself to its CPUs: so does this one
        os.sched_setaffinity(0, cfg["cpus"])
        torch.set_num_threads(len(cfg["cpus"]))
    llm = LLM(EngineConfig(
        model=cfg["model"], tensor_parallel_size=cfg["tp"], cpus=cfg["cpus"],
        cache=CacheConfig(kv_cache_memory_bytes=256 << 20),
        scheduler=SchedulerConfig(max_num_batched_tokens=4096)))
    runner = llm.core.model_runner
    timed = None
    if runner.parallel.is_parallel:
        timed = _TimedGroup(runner.parallel.group)
        # NOTE: every layer holds this same TensorParallel, so one swap times them all.
        object.__setattr__(runner.parallel, "group", timed)
    pids = [os.getpid(), *(runner.workers.pids if runner.workers else [])]
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=cfg["output_len"], ignore_eos=True)
    for _ in range(cfg["batch"]):
        llm.add_request([rng.randrange(100, 40000) for _ in range(cfg["prompt_len"])], params)
    llm.step()  # the prefill of every prompt (and each one's first token)
    cpu0 = sum(_cpu_seconds(p) for p in pids)
    reduce0 = timed.all_reduce_s if timed else 0.0
    steps: list[float] = []
    for _ in range(cfg["output_len"] - 1):
        start = time.perf_counter()
        llm.step()
        steps.append(time.perf_counter() - start)
    cpu = sum(_cpu_seconds(p) for p in pids) - cpu0
    reduce_s = (timed.all_reduce_s - reduce0) if timed else 0.0
    llm.close()
    print(RESULT_PREFIX + json.dumps({
        "step_s": steps, "cpu_s": cpu, "all_reduce_s": reduce_s,
        "all_reduces_per_step": (timed.all_reduces / (len(steps) + 1)) if timed else 0,
        "load": os.getloadavg()[0]}), flush=True)


def run(model: Path, tp: int, cpus: list[int], args: argparse.Namespace, batch: int,
        output_len: int) -> dict[str, Any]:
    config = {"model": str(model), "tp": tp, "cpus": cpus, "batch": batch,
              "prompt_len": args.prompt_len, "output_len": output_len}
    done = subprocess.run([sys.executable, __file__, "--worker", json.dumps(config)],
                          capture_output=True, text=True, timeout=3600, check=False)
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            result: dict[str, Any] = json.loads(line.removeprefix(RESULT_PREFIX))
            return result
    raise RuntimeError(f"TP={tp} run failed:\n{done.stderr[-3000:]}")


def measure(model: Path, args: argparse.Namespace, batch: int, output_len: int,
            rounds: int) -> dict[str, Any]:
    configs = {"tp1": (1, args.cpus), "tp1_one_cpu": (1, args.cpus[:1]), "tp2": (2, args.cpus)}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    for r in range(rounds):
        for name in (list(configs) if r % 2 == 0 else list(reversed(configs))):
            tp, cpus = configs[name]
            result = run(model, tp, cpus, args, batch, output_len)
            runs[name].append(result)
            print(f"{model.name} {name} round {r}: median step "
                  f"{statistics.median(result['step_s']) * 1000:.1f} ms, load "
                  f"{result['load']:.1f}", flush=True)
    summary: dict[str, Any] = {"batch": batch, "decode_steps": output_len - 1}
    for name, results in runs.items():
        steps = [s for r in results for s in r["step_s"]]
        wall = sum(steps)
        summary[name] = {
            "median_step_ms": statistics.median(steps) * 1000,
            "decode_tokens_per_s": batch * len(steps) / wall,
            "cpu_s_per_step": sum(r["cpu_s"] for r in results) / len(steps),
            "all_reduce_share_of_step": sum(r["all_reduce_s"] for r in results) / wall,
            "all_reduces_per_step": results[0]["all_reduces_per_step"],
            "load_average": [r["load"] for r in results],
            "median_step_ms_per_round": [statistics.median(r["step_s"]) * 1000
                                         for r in results],
        }
    for base in ("tp1", "tp1_one_cpu"):
        summary[f"tp2_over_{base}_throughput"] = (summary["tp2"]["decode_tokens_per_s"]
                                                  / summary[base]["decode_tokens_per_s"])
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--cpus", type=lambda s: [int(c) for c in s.split(",")],
                        default=sorted(os.sched_getaffinity(0))[:2])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model-root", type=Path, default=ROOT / ".cache" / "bench-models")
    parser.add_argument("--skip-1b", action="store_true")
    parser.add_argument("--out", type=Path,
                        default=ROOT / "bench" / "results" / "tp_throughput.json")
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    from engine_common.default_model import default_model_dir

    results = {"SmolLM2-135M (bf16)": measure(default_model_dir(), args, 8, 33, args.rounds)}
    if not args.skip_1b:
        synthetic = build_synthetic(args.model_root / "synthetic-llama-1.1b")
        results["synthetic Llama 1.1B (bf16, random)"] = measure(synthetic, args, 4, 9,
                                                                 args.rounds)
    write_report(args.out, "tp_throughput", cpus=args.cpus, prompt_len=args.prompt_len,
                 rounds=args.rounds, results=results)


if __name__ == "__main__":
    main()
