"""A replica's throughput against the offline engine's on the same cores (issue 39, goal 3).

The offline workload of ``bench/offline_throughput.py`` (64 prompts of 128 random token ids,
128 greedy output tokens each, EOS ignored, the default model) run three ways, each on the
same engine CPU (the host's last):

- ``offline``: the engine in a process of its own pinned to that CPU (``LLM.generate``);
- ``replica``: one aggregated replica as `tandem up` lays it out (``--cpu-layout auto``: its
  engine core alone on that CPU, its frontend on the others), the 64 requests streamed to
  it at once over gRPC by the SDK's ``AsyncClient`` (this script's client runs on the other
  CPUs too, as a remote client would not: it is counted and reported);
- ``gateway``: the same behind the gateway (pinned with the frontend).

Rounds interleave the three (their order rotating per round), since a shared machine's
speed drifts within minutes. Per run: output tokens per second (first request sent to last
token received, against ``LLM.generate``'s wall time) and the CPU seconds of each process
(``/proc/PID/stat``: the engine core, the replica's frontend, the gateway; the offline
process). The goal: the replica's throughput >= 90% of the offline engine's, per round. The
engine core's CPU seconds against the offline process's say whether serving makes the engine
itself do more (polling, output transport); its main thread's scheduler statistics split
the wall time into running, waiting runnable for the CPU (other tenants: on a shared
machine, the figure to subtract) and idle (waiting for work: the serving path's own cost).

    python bench/suite_vs_offline.py [--rounds 3] [--dtype auto]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.offline_throughput import main_thread_schedstat, make_prompts, run_tandem  # noqa: E402
from bench.online_serving import free_ports  # noqa: E402
from bench.report import write_report  # noqa: E402
from deploy.suite_plan import SuiteConfig, plan_suite  # noqa: E402
from deploy.supervisor import Supervisor  # noqa: E402
from engine_common.default_model import ensure_default_model  # noqa: E402
from tandem.client import AsyncClient  # noqa: E402

PATHS = ("offline", "replica", "gateway")
VOCAB = 49152


def cpu_seconds(pid: int) -> float:
    """User + system seconds of ``pid`` (its threads; not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        found.extend(int(child) for child in text)
    return found


@contextmanager
def suite(model: Path, dtype: str, gateway: bool, log_dir: Path) -> Iterator[
        tuple[str, dict[str, int]]]:
    """One ``both`` replica (and the gateway): the target to call and the pids to account."""
    base, metrics = free_ports(1), free_ports(2)
    gateway_port = free_ports(1)
    cfg = SuiteConfig(model=str(model), num_prefill=0, num_decode=0, num_both=1,
                      base_port=base, gateway_port=gateway_port, metrics_base_port=metrics,
                      kv_cache_memory="1GiB", gateway=gateway,
                      extra_replica_args=["--dtype", dtype, "--max-num-seqs", "256",
                                          "--max-num-batched-tokens", "8192"])
    plan = plan_suite(cfg)
    supervisor = Supervisor(plan, log_dir)
    try:
        supervisor.start()
        procs = supervisor.procs
        replica = next(p.pid for name, p in procs.items() if name.startswith("both"))
        pids = {"frontend": replica}
        cores = [pid for pid in children(replica)
                 if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()]
        pids["engine_core"] = cores[0]
        if gateway:
            pids["gateway"] = procs["gateway"].pid
        target = f"127.0.0.1:{gateway_port if gateway else base}"
        yield target, pids
    finally:
        supervisor.stop()


async def burst(target: str, model: str, prompts: list[list[int]], out_len: int) -> float:
    """Every prompt streamed at once; seconds from the first send to the last token."""
    async with AsyncClient(target) as client:
        await client.complete([1, 2, 3], model=model, max_tokens=2)  # warm-up
        start = time.perf_counter()

        async def one(prompt: list[int]) -> int:
            tokens = 0
            async for chunk in client.complete_stream(prompt, model=model, max_tokens=out_len,
                                                      temperature=0.0, ignore_eos=True):
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            return tokens

        counts = await asyncio.gather(*(one(p) for p in prompts))
        elapsed = time.perf_counter() - start
    if sum(counts) != len(prompts) * out_len:
        raise RuntimeError(f"streamed {sum(counts)} tokens, expected {len(prompts) * out_len}")
    return elapsed


def run_served(args: argparse.Namespace, gateway: bool) -> dict[str, Any]:
    with suite(args.model, args.dtype, gateway, args.log_dir) as (target, pids):
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        client_before = sum(os.times()[:2])
        sched_before = main_thread_schedstat(pids["engine_core"])
        elapsed = asyncio.run(burst(target, args.model.name, args.prompts, args.output_len))
        ran, waited = (after - start for after, start in zip(
            main_thread_schedstat(pids["engine_core"]), sched_before, strict=True))
        used = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
        used["client"] = sum(os.times()[:2]) - client_before
    return {"seconds": elapsed, "cpu_seconds": used,
            "engine_main_thread": {"ran_s": ran, "runnable_waiting_s": waited}}


def run_offline(args: argparse.Namespace) -> dict[str, Any]:
    result = run_tandem(args.model, args.prompts, args.output_len, [args.engine_cpu],
                        args.dtype, nice=0)
    if result is None:
        raise RuntimeError("the offline engine failed")
    return {"seconds": result["elapsed"], "cpu_seconds": {"engine": result["cpu_seconds"]},
            "engine_main_thread": result["main_thread"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--log-dir", type=Path, default=ROOT / "bench" / "results" / "logs")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "suite_vs_offline.json")
    args = p.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("needs two CPUs: the engine's and the frontend's")
    args.engine_cpu = cpus[-1]
    args.model = ensure_default_model()
    args.prompts = make_prompts(args.num_prompts, args.prompt_len, VOCAB, seed=0)
    runs: dict[str, list[dict[str, Any]]] = {path: [] for path in PATHS}
    tokens = args.num_prompts * args.output_len
    for round_index in range(args.rounds):
        order = PATHS[round_index % 3:] + PATHS[:round_index % 3]
        for path in order:
            load = os.getloadavg()[0]
            record = (run_offline(args) if path == "offline"
                      else run_served(args, gateway=path == "gateway"))
            record.update(load_1min_before=load, tok_s=tokens / record["seconds"])
            runs[path].append(record)
            cpu = ", ".join(f"{k} {v:.1f}" for k, v in record["cpu_seconds"].items())
            main = record["engine_main_thread"]
            idle = record["seconds"] - main["ran_s"] - main["runnable_waiting_s"]
            print(f"round {round_index + 1} {path:8s} {record['tok_s']:7.1f} tok/s "
                  f"(CPU s: {cpu}; engine thread ran {main['ran_s']:.1f} s, waited for a "
                  f"CPU {main['runnable_waiting_s']:.1f} s, idle {idle:.1f} s; load "
                  f"{load:.1f})", flush=True)
    summary = {
        f"{path}_over_offline_per_round": [
            r["tok_s"] / o["tok_s"] for r, o in zip(runs[path], runs["offline"], strict=True)]
        for path in PATHS[1:]}
    summary.update({f"{path}_over_offline_median": statistics.median(
        summary[f"{path}_over_offline_per_round"]) for path in PATHS[1:]})
    print({k: v for k, v in summary.items() if k.endswith("median")})
    write_report(args.out, "suite_vs_offline", settings={
        "num_prompts": args.num_prompts, "prompt_len": args.prompt_len,
        "output_len": args.output_len, "dtype": args.dtype, "engine_cpu": args.engine_cpu,
        "rounds": args.rounds}, runs=runs, summary=summary)


if __name__ == "__main__":
    main()
