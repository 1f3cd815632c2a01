"""One long prompt's prefill in Tandem's engine, this checkout against another, on one core.

Owns one A/B measurement (issue 39: the bf16 prefill attention kernel): the engine (``LLM``,
bf16, the default model) prefills one ``--prompt-len``-token prompt of random token ids
(``max_tokens=1``, so the step is the prefill and one sampled token) in a fresh process per
run, pinned to ``--cpu`` with one torch thread; the process CPU time of that ``generate``
(after a short warm-up prompt) is the figure. Runs of this checkout and of ``--base``
(another checkout's engine, via ``TANDEM_BENCH_ENGINE_ROOT``) alternate for ``--rounds``
rounds, and each side's minimum is kept (a shared machine's caches still make runs vary).
Written to ``bench/results/cpu_prefill_ab.json`` with the machine.

    python bench/cpu_prefill_ab.py --base /path/to/other/checkout --prompt-len 1664
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.peer import run_process_group  # noqa: E402
from bench.report import write_report  # noqa: E402

ENGINE_ROOT_VARIABLE = "TANDEM_BENCH_ENGINE_ROOT"
RESULT_PREFIX = "AB_RESULT "


def worker(config: dict[str, Any]) -> None:
    """In a fresh process: the engine of ``$TANDEM_BENCH_ENGINE_ROOT``, one timed prefill."""
    os.sched_setaffinity(0, {config["cpu"]})
    sys.path.insert(0, os.environ.get(ENGINE_ROOT_VARIABLE, str(ROOT)))
    import torch

    from engine_common.config import CacheConfig, EngineConfig
    from engine_common.default_model import ensure_default_model
    from engine_common.llm import LLM
    from engine_common.sampling_params import SamplingParams

    torch.set_num_threads(1)
    llm = LLM(EngineConfig(model=str(ensure_default_model()), dtype="bfloat16",
                           cache=CacheConfig(kv_cache_memory_bytes=1 << 30)))
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    gen = torch.Generator().manual_seed(config["seed"])
    warm, prompt = (torch.randint(100, 49152, (n,), generator=gen).tolist()
                    for n in (64, config["prompt_len"]))
    llm.generate([warm], params)
    start = time.process_time()
    llm.generate([prompt], params)
    print(RESULT_PREFIX + json.dumps({"cpu_s": time.process_time() - start}), flush=True)


def run(root: Path, config: dict[str, Any]) -> float | None:
    env = dict(os.environ, **{ENGINE_ROOT_VARIABLE: str(root)})
    stdout, stderr = run_process_group(
        [sys.executable, __file__, "--worker", json.dumps(config)], env, None, timeout_s=1800)
    for line in stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return float(json.loads(line.removeprefix(RESULT_PREFIX))["cpu_s"])
    print(f"run of {root} failed:\n{stderr[-3000:]}", file=sys.stderr)
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--base", type=Path, help="the other checkout (required)")
    parser.add_argument("--prompt-len", type=int, default=1664)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cpu", type=int, default=1)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu_prefill_ab.json")
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    if args.base is None:
        parser.error("--base is required")
    config = {"cpu": args.cpu, "prompt_len": args.prompt_len, "seed": 0}
    times: dict[str, list[float]] = {"this": [], "base": []}
    for _ in range(args.rounds):
        for name, root in (("this", ROOT), ("base", args.base.resolve())):
            cpu_s = run(root, config)
            if cpu_s is None:
                return 1
            times[name].append(round(cpu_s, 3))
            print(f"{name}: {cpu_s:.3f} CPU-s", flush=True)
    best = {name: min(v) for name, v in times.items()}
    write_report(args.out, "cpu_prefill_ab", settings={
        "base": str(args.base), "prompt_len": args.prompt_len, "rounds": args.rounds,
        "cpu": args.cpu, "load_average": os.getloadavg()}, cpu_s=times, best_cpu_s=best,
        base_over_this=round(best["base"] / best["this"], 3))
    print(f"best: this {best['this']:.3f} CPU-s, base {best['base']:.3f}: "
          f"{best['base'] / best['this']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
