"""Measure the real engine's steps on one core and fit the simulator's step-cost model.

    python -m bench.routing_sim.fit_costs            # ~15 minutes on a quiet core
    python -m bench.routing_sim.fit_costs --rounds 1 --quick

Owns the measurement plan and the results file (``bench/results/
routing_simulation_step_costs.json``: the machine, the settings, every measured step, the
fitted coefficients and how well they fit). It does not own the model (``cost_model``).

The engine is ``engine_common.engine_core.EngineCore``, in process, on the default model
(SmolLM2-135M-Instruct) with one torch thread, as the prefix-routing benchmark runs each
replica (``--threads-per-replica 1``, float32). Each timed unit is one ``EngineCore.step()``
(scheduler, forward pass, sampler, bookkeeping), and its shape is read off the requests:
how many tokens each computed in that step, after how much context, and whether it sampled.
Three kinds of steps, interleaved round by round so the shared machine's load falls on all
alike:

- prefill chunks of ``c`` tokens after a cached prefix of ``p`` tokens (the prefix is
  computed first and stays in the prefix cache; its own steps are samples at ``p = 0``);
- decode steps of ``B`` sequences at context ``L`` (the sequences share a prefix computed
  once per round and kept in the prefix cache, so each batch costs only its own tails);
- mixed steps (decodes plus a prefill chunk), held out of the fit to check that costs add.

Steps are timed by this process's CPU time by default: with one torch thread that is the
step's compute, and far less disturbed than the wall clock by the other tenants of a shared
machine (though not immune: a busy sibling hyperthread or memory bus still slows it; the
load average is recorded at both ends).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "routing_simulation_step_costs.json"


@dataclass(frozen=True)
class MeasuredStep:
    kind: str  # "prefill", "setup", "decode", "mixed"
    config: str  # the measurement it belongs to, e.g. "prefill p=256 c=64"
    tokens: int
    sampled: int
    context_tokens: int
    attention_pairs: int
    seconds: float  # by the clock the fit uses (``--clock``)
    wall_seconds: float


class StepTimer:
    """Runs an ``EngineCore`` step by step, timing each and reading off its shape."""

    def __init__(self, core: Any, clock: str, vocab: int, rng: random.Random) -> None:
        self.core = core
        self.clock = clock
        self.vocab = vocab
        self.rng = rng
        self._ids = itertools.count()

    def tokens(self, n: int) -> list[int]:
        # Ordinary token ids, away from the special ones at the start of the vocabulary.
        return [self.rng.randrange(100, self.vocab) for _ in range(n)]

    def add(self, token_ids: list[int], max_tokens: int) -> Any:
        """Queue a request; returns the engine's ``Request`` for it."""
        from engine_common.generation_request import GenerationRequest
        from engine_common.outputs import EngineCoreRequest
        from engine_common.sampling_params import SamplingParams
        request_id = f"fit-{next(self._ids)}"
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.core.add_request(EngineCoreRequest(
            request_id, GenerationRequest(token_ids, params), time.monotonic()))
        return self.core.scheduler.requests[request_id]

    def step(self, kind: str, config: str) -> MeasuredStep:
        from bench.routing_sim.cost_model import StepShape
        from engine_common.request import RequestStatus
        requests = list(self.core.scheduler.requests.values())
        before = {id(r): (r.status, r.num_computed_tokens, r.num_output_tokens)
                  for r in requests}
        started, cpu_started = time.perf_counter(), time.process_time()
        self.core.step()
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        chunks = []
        for r in requests:
            status, computed, outputs = before[id(r)]
            if status != RequestStatus.RUNNING:
                computed = max(r.num_cached_tokens, 0)  # admitted now: its hits cost nothing
            new = r.num_computed_tokens - computed
            if new > 0:
                chunks.append((computed, new, r.num_output_tokens > outputs))
        shape = StepShape.of(chunks)
        return MeasuredStep(kind, config, shape.tokens, shape.sampled, shape.context_tokens,
                            shape.attention_pairs, cpu if self.clock == "cpu" else wall, wall)

    def run_until_done(self, kind: str, config: str) -> list[MeasuredStep]:
        steps = []
        while self.core.has_unfinished_requests():
            steps.append(self.step(kind, config))
        return steps


def measure_prefill(timer: StepTimer, prefix: int, chunks: list[int]) -> list[MeasuredStep]:
    out = []
    base = timer.tokens(prefix)
    if prefix:
        timer.add(base, 1)
        out += timer.run_until_done("prefill", f"prefill p=0 c={prefix}")
    for chunk in chunks:
        # The prefix's blocks are cached: only the chunk is computed.
        timer.add(base + timer.tokens(chunk), 1)
        out += timer.run_until_done("prefill", f"prefill p={prefix} c={chunk}")
    return out


def measure_decode(timer: StepTimer, shared: list[int], batch: int, steps: int,
                   extra_prefill: int = 0) -> list[MeasuredStep]:
    """``batch`` sequences decoding after ``shared`` (cached once computed) and 16 tokens of
    their own; with ``extra_prefill``, a request of that many fresh tokens joins after the
    second decode step (the mixed step)."""
    context = len(shared) + 16
    requests = [timer.add(shared + timer.tokens(16), steps + 2) for _ in range(batch)]
    out = []
    # Admission (each one's own tail, and the shared prefix the first time), in as many
    # steps as the token budget needs. Exact shapes too, so they are samples as well.
    while any(r.num_output_tokens == 0 for r in requests):
        out.append(timer.step("setup", f"setup B={batch} L={context}"))
    kind = "mixed" if extra_prefill else "decode"
    config = f"{kind} B={batch} L={context}" + (f" c={extra_prefill}" if extra_prefill else "")
    for i in range(steps):
        if extra_prefill and i == 2:
            timer.add(timer.tokens(extra_prefill), 1)
        step = timer.step(kind, config)
        if extra_prefill and step.tokens == batch:
            continue  # pure decode: the mixed step is the one the newcomer joins
        out.append(step)
        if extra_prefill:
            break
    timer.run_until_done("drain", "drain")
    return out


def plan(quick: bool) -> dict[str, list[int]]:
    if quick:
        return {"prefixes": [0, 512], "chunks": [32, 256], "batches": [1, 8],
                "contexts": [128, 1024], "mixed_batches": [4]}
    return {"prefixes": [0, 512, 2048], "chunks": [16, 64, 256, 1024],
            "batches": [1, 4, 16, 64], "contexts": [128, 1024, 2048],
            "mixed_batches": [2, 16]}


def measure(args: argparse.Namespace) -> tuple[list[MeasuredStep], dict[str, object]]:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    torch.set_num_threads(1)
    from engine_common.config import CacheConfig, EngineConfig
    from engine_common.default_model import ensure_default_model
    from engine_common.engine_core import EngineCore
    model = args.model or str(ensure_default_model())
    core = EngineCore(EngineConfig(model=model, dtype=args.dtype, cache=CacheConfig(
        kv_cache_memory_bytes=args.kv_cache_memory_mib << 20)))
    timer = StepTimer(core, args.clock, core.arch.vocab_size, random.Random(args.seed))
    shapes = plan(args.quick)
    timer.add(timer.tokens(64), 4)  # warm-up: first calls allocate and pick kernels
    timer.run_until_done("warmup", "warmup")
    steps: list[MeasuredStep] = []
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds} (load average {os.getloadavg()[0]:.1f}) ...",
              flush=True)
        for prefix in shapes["prefixes"]:
            steps += measure_prefill(timer, prefix, shapes["chunks"])
        for context in shapes["contexts"]:
            shared = timer.tokens(context - 16)
            for batch in shapes["batches"]:
                steps += measure_decode(timer, shared, batch, 5)
        shared = timer.tokens(512 - 16)
        for batch in shapes["mixed_batches"]:
            steps += measure_decode(timer, shared, batch, 6, extra_prefill=256)
    settings = {**vars(args), "model": model, "torch_threads": torch.get_num_threads(),
                "num_kv_blocks": core.info.num_blocks, "plan": shapes}
    return steps, settings


def summarize(steps: list[MeasuredStep]) -> list[MeasuredStep]:
    """One step per (config, shape): the median over rounds (the shared machine's other
    tenants make single timings noisy; a shape's first run also pays for kernel choice)."""
    groups: dict[tuple[Any, ...], list[MeasuredStep]] = {}
    for s in steps:
        key = (s.kind, s.config, s.tokens, s.sampled, s.context_tokens, s.attention_pairs)
        groups.setdefault(key, []).append(s)
    return [MeasuredStep(v[0].kind, v[0].config, v[0].tokens, v[0].sampled, v[0].context_tokens,
                         v[0].attention_pairs, statistics.median(x.seconds for x in v),
                         statistics.median(x.wall_seconds for x in v))
            for v in groups.values()]


def error_summary(errors: list[float]) -> dict[str, float]:
    if not errors:
        return {}
    absolute = sorted(abs(e) for e in errors)
    return {"median_abs_rel_error": statistics.median(absolute),
            "p90_abs_rel_error": absolute[math.ceil(0.9 * len(absolute)) - 1],
            "max_abs_rel_error": absolute[-1], "n": len(errors)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: the default model)")
    p.add_argument("--dtype", default="float32", help="as the prefix-routing bench's replicas")
    p.add_argument("--kv-cache-memory-mib", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                   help="time steps by CPU time (default; robust to other tenants) or wall")
    p.add_argument("--quick", action="store_true", help="fewer shapes (a smoke run)")
    p.add_argument("--out", default=str(RESULTS))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))
    from bench.report import machine
    from bench.routing_sim.cost_model import StepShape, fit, relative_errors
    args = parse_args(argv)
    machine_info = machine()
    raw, settings = measure(args)
    steps = [s for s in summarize(raw) if s.kind not in ("warmup", "drain")]
    train = [s for s in steps if s.kind != "mixed"]
    held = [s for s in steps if s.kind == "mixed"]

    def shape(s: MeasuredStep) -> StepShape:
        return StepShape(s.tokens, s.sampled, s.context_tokens, s.attention_pairs)

    model = fit([shape(s) for s in train], [s.seconds for s in train])
    report = {
        "benchmark": "routing_simulation_step_costs",
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine_info,
        "load_average_at_end": list(os.getloadavg()),
        "settings": settings,
        "coefficients": model.to_json(),
        "fit": {"train": error_summary(relative_errors(
                    model, [shape(s) for s in train], [s.seconds for s in train])),
                "held_out_mixed": error_summary(relative_errors(
                    model, [shape(s) for s in held], [s.seconds for s in held]))},
        "derived": {
            "prefill_tokens_per_s_chunk_512_no_prefix":
                512 / model.step_time(StepShape.of([(0, 512, True)])),
            "decode_step_s_batch_1_context_128": model.step_time(StepShape.of([(127, 1, True)])),
            "decode_step_s_batch_32_context_512":
                model.step_time(StepShape.of([(511, 1, True)] * 32)),
        },
        "steps": [{**asdict(s), "predicted_s": model.step_time(shape(s))} for s in steps],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("coefficients", "fit", "derived")}, indent=2))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
