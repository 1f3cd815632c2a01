"""Prefix-aware routing vs round-robin, and the gateway hop's overhead, on real replicas.

Workload (issue 5): ``--replicas`` replicas (role ``both``) of the default model on this
machine, two gateways in front of them (``--policy round_robin`` and Tandem's scorer), and a
shared-prefix workload: ``--groups`` groups, each with its own long system prompt, requests
arriving as a Poisson process (``--rate`` per second), each picking a group at random and
adding a short question. Both policies get the same schedule (arrival times, groups,
questions) with fresh system-prompt text (so the first phase's cache cannot help the
second). Per policy: TTFT p50/p90, end-to-end latency, throughput (completed requests and
output tokens per second, from the phase's start to its last completion) and the replicas'
prefix-cache hit rate (GetLoad counters, prompt tokens). Below saturation both policies
complete what arrives, so throughput differs little; a second workload (``--burst-requests``
arriving at once) measures it at saturation, where the makespan is the work itself. Then
the overhead of the gateway hop: the same small request sent alternately to a replica
directly and through the gateway, one at a time, latency p50/p99 of each, and the gateway's
own routing work per pick (its /metrics). The results file (JSON, ``bench/results/``)
records the machine and every setting.

    python bench/prefix_routing.py                       # defaults: a few minutes on 2 cores
    python bench/prefix_routing.py --requests 60 --rate 2 --groups 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import machine  # noqa: E402
from engine_common.default_model import ensure_default_model  # noqa: E402
from protos.tandem.v1 import engine_pb2, engine_pb2_grpc  # noqa: E402
from protos.tandem.v1 import generation_pb2 as pb  # noqa: E402
from protos.tandem.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402

WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there one all we their can has been if more "
    "when will would who so no time people year way day man thing woman life child world "
    "school state family student group country problem hand part place case week company "
    "system program question work government number night point home water room mother area "
    "money story fact month lot right study book eye job word business issue side kind head "
    "house service friend father power hour game line end member law car city community name"
).split()


# --------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Started:
    name: str
    address: str
    process: subprocess.Popen[bytes]

    def terminate(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)

    def wait_or_kill(self, timeout: float) -> None:
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(5)


def start(name: str, args: list[str], log_dir: Path, threads: int | None = None) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    with open(log_dir / f"{name}.log", "ab") as log:
        return subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def wait_serving(address: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise TimeoutError(f"{address} did not report SERVING within {timeout:.0f} s")


# --------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Arrival:
    at_s: float
    group: int
    prompt: str


@dataclass(frozen=True)
class Schedule:
    """When requests arrive, which group each belongs to and its question: the same for every
    policy, so that only the routing differs."""

    at_s: list[float]
    groups: list[int]
    questions: list[str]


def build_schedule(rng: random.Random, requests: int, rate: float | None,
                   args: argparse.Namespace) -> Schedule:
    """Poisson arrivals at ``rate`` per second, or all at once when ``rate`` is None."""
    at_s, groups, questions, t = [], [], [], 0.0
    for _ in range(requests):
        if rate is not None:
            t += rng.expovariate(rate)
        at_s.append(t)
        groups.append(rng.randrange(args.groups))
        questions.append(" ".join(rng.choice(WORDS) for _ in range(args.question_words)))
    return Schedule(at_s, groups, questions)


def build_workload(rng: random.Random, schedule: Schedule, system_words: int,
                   num_groups: int) -> list[Arrival]:
    """The schedule with fresh system prompts: a policy run later finds nothing cached from
    an earlier one."""
    systems = [
        f"System prompt {g}: " + " ".join(rng.choice(WORDS) for _ in range(system_words))
        for g in range(num_groups)
    ]
    return [Arrival(t, g, f"{systems[g]}\nQuestion: {q}?\nAnswer:")
            for t, g, q in zip(schedule.at_s, schedule.groups, schedule.questions, strict=True)]


def completion(prompt: str, max_tokens: int) -> pb.CompletionRequest:
    return pb.CompletionRequest(prompt=struct_pb2.Value(string_value=prompt),
                                max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                stream_options=pb.StreamOptions(include_usage=True))


@dataclass
class Outcome:
    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    output_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""


async def one_request(stub: pb_grpc.GenerationStub, arrival: Arrival, started: float,
                      max_tokens: int) -> Outcome:
    await asyncio.sleep(max(0.0, started + arrival.at_s - time.monotonic()))
    sent = time.monotonic()
    ttft = None
    usage = None
    try:
        async for chunk in stub.CompleteStream(completion(arrival.prompt, max_tokens),
                                               timeout=600):
            if ttft is None and chunk.choices:
                ttft = time.monotonic() - sent
            if chunk.HasField("usage"):
                usage = chunk.usage
    except grpc.aio.AioRpcError as e:
        return Outcome(False, error=f"{e.code().name}: {e.details()}")
    done = time.monotonic() - sent
    return Outcome(True, ttft if ttft is not None else done, done,
                   usage.completion_tokens if usage else 0,
                   usage.prompt_tokens_details.cached_tokens if usage else 0)


async def cache_counters(addresses: list[str]) -> tuple[int, int]:
    queries = hits = 0
    for address in addresses:
        async with grpc.aio.insecure_channel(address) as channel:
            report = await engine_pb2_grpc.EngineStub(channel).GetLoad(
                engine_pb2.GetLoadRequest(), timeout=5)
        queries += report.prefix_cache_queries
        hits += report.prefix_cache_hits
    return queries, hits


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


async def run_phase(gateway: str, replicas: list[str], arrivals: list[Arrival],
                    max_tokens: int) -> dict[str, object]:
    queries0, hits0 = await cache_counters(replicas)
    async with grpc.aio.insecure_channel(gateway) as channel:
        stub = pb_grpc.GenerationStub(channel)
        started = time.monotonic()
        outcomes = await asyncio.gather(
            *(one_request(stub, a, started, max_tokens) for a in arrivals))
        makespan = time.monotonic() - started
    queries1, hits1 = await cache_counters(replicas)
    ok = [o for o in outcomes if o.ok]
    ttfts = [o.ttft_s for o in ok]
    e2es = [o.e2e_s for o in ok]
    return {
        "requests": len(outcomes),
        "failed": len(outcomes) - len(ok),
        "errors": sorted({o.error for o in outcomes if not o.ok})[:5],
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p90_s": percentile(ttfts, 0.9),
        "e2e_p50_s": percentile(e2es, 0.5),
        "e2e_p90_s": percentile(e2es, 0.9),
        "makespan_s": makespan,
        "throughput_req_per_s": len(ok) / makespan,
        "throughput_output_tok_per_s": sum(o.output_tokens for o in ok) / makespan,
        "prefix_cache_hit_rate": (hits1 - hits0) / max(1, queries1 - queries0),
        "prompt_tokens_cached_per_request": statistics.fmean(o.cached_tokens for o in ok)
        if ok else 0.0,
    }


async def overhead(direct: str, gateway: str, n: int) -> dict[str, object]:
    """The same small request, alternately straight to a replica and through the gateway."""
    request = completion("Overhead probe: the quick brown fox", 1)
    latencies: dict[str, list[float]] = {"direct": [], "gateway": []}
    async with grpc.aio.insecure_channel(direct) as d, grpc.aio.insecure_channel(gateway) as g:
        stubs = {"direct": pb_grpc.GenerationStub(d), "gateway": pb_grpc.GenerationStub(g)}
        for i in range(n + 3):
            for name in ("direct", "gateway") if i % 2 == 0 else ("gateway", "direct"):
                t = time.monotonic()
                await stubs[name].Complete(request, timeout=60)
                if i >= 3:  # warm-up: channels, caches
                    latencies[name].append(time.monotonic() - t)
    p50 = {name: 1000 * percentile(values, 0.5) for name, values in latencies.items()}
    p99 = {name: 1000 * percentile(values, 0.99) for name, values in latencies.items()}
    result: dict[str, object] = {"samples": n}
    for name in latencies:
        result[f"{name}_p50_ms"] = p50[name]
        result[f"{name}_p99_ms"] = p99[name]
    result["added_p50_ms"] = p50["gateway"] - p50["direct"]
    result["added_p99_ms"] = p99["gateway"] - p99["direct"]
    return result


def routing_mean_ms(metrics_port: int) -> float:
    """Mean of the gateway's own routing work per pick (snapshot, hashing, scoring)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = sample.value
    name = "tandem:gateway_routing_latency_seconds"
    return 1000 * values[f"{name}_sum"] / max(1.0, values[f"{name}_count"])


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: the default model)")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--groups", type=int, default=6, help="system prompts shared by requests")
    p.add_argument("--system-words", type=int, default=200, help="words per system prompt")
    p.add_argument("--question-words", type=int, default=8)
    p.add_argument("--requests", type=int, default=24, help="requests per policy")
    p.add_argument("--rate", type=float, default=0.5, help="Poisson arrivals per second")
    p.add_argument("--burst-requests", type=int, default=12,
                   help="requests per policy arriving all at once, for throughput at "
                        "saturation (0: skip)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--overhead-requests", type=int, default=60)
    p.add_argument("--kv-cache-memory", default="256MiB", help="per replica")
    p.add_argument("--dtype", default="float32", help="replica dtype (float32 is fastest on CPU)")
    p.add_argument("--threads-per-replica", type=int, default=1, help="OMP_NUM_THREADS")
    p.add_argument("--policies", default="round_robin,score")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="results file (default: bench/results/...)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    machine_info = machine()
    model = args.model or str(ensure_default_model())
    policies = args.policies.split(",")
    log_dir = ROOT / "bench" / "results" / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    started: list[Started] = []
    try:
        replicas = []
        for i in range(args.replicas):
            port = free_port()
            address = f"127.0.0.1:{port}"
            process = start(f"replica{i}", [
                "services.replica", "--model", model, "--host", "127.0.0.1", "--port", str(port),
                "--metrics-port", "0", "--kv-cache-memory", args.kv_cache_memory,
                "--dtype", args.dtype, "--log-level", "WARNING"], log_dir,
                threads=args.threads_per_replica)
            started.append(Started(f"replica{i}", address, process))
            replicas.append(address)
        gateways: dict[str, str] = {}
        metrics_ports: dict[str, int] = {}
        for policy in policies:
            port, metrics_ports[policy] = free_port(), free_port()
            process = start(f"gateway-{policy}", [
                "gateway", "--model", model, "--host", "127.0.0.1", "--port", str(port),
                "--metrics-port", str(metrics_ports[policy]), "--policy", policy, "--log-level", "WARNING",
                *[a for r in replicas for a in ("--replica", r)]], log_dir)
            started.append(Started(f"gateway-{policy}", f"127.0.0.1:{port}", process))
            gateways[policy] = f"127.0.0.1:{port}"
        print(f"starting {args.replicas} replicas and {len(gateways)} gateways "
              f"(logs in {log_dir}) ...", flush=True)
        for s in started:
            wait_serving(s.address, 600)
        time.sleep(1.0)  # the gateways see every replica healthy

        rng = random.Random(args.seed)
        workloads = {"poisson": build_schedule(rng, args.requests, args.rate, args),
                     "burst": build_schedule(rng, args.burst_requests, None, args)}
        results: dict[str, dict[str, dict[str, object]]] = {}
        for workload, schedule in workloads.items():
            if not schedule.at_s:
                continue
            for policy in policies:
                arrivals = build_workload(rng, schedule, args.system_words, args.groups)
                print(f"{workload} / {policy}: {len(arrivals)} requests over "
                      f"{arrivals[-1].at_s:.0f} s ...", flush=True)
                results.setdefault(workload, {})[policy] = asyncio.run(
                    run_phase(gateways[policy], replicas, arrivals, args.max_tokens))
                print(json.dumps(results[workload][policy], indent=2), flush=True)
        scorer = "score" if "score" in gateways else policies[-1]
        print("overhead ...", flush=True)
        hop = asyncio.run(overhead(replicas[0], gateways[scorer], args.overhead_requests))
        hop["gateway_routing_mean_ms"] = routing_mean_ms(metrics_ports[scorer])
        print(json.dumps(hop, indent=2), flush=True)
    finally:
        for s in started:  # all at once: each drains for a while
            s.terminate()
        for s in started:
            s.wait_or_kill(15)

    summary: dict[str, dict[str, float]] = {}
    for workload, by_policy in results.items():
        rr, sc = by_policy.get("round_robin"), by_policy.get("score")
        if rr is None or sc is None:
            continue
        summary[workload] = {
            f"{key}_round_robin_over_score": float(rr[key]) / float(sc[key])  # type: ignore[arg-type]
            for key in ("ttft_p50_s", "ttft_p90_s", "makespan_s")
        }
        summary[workload]["hit_rate_round_robin"] = float(rr["prefix_cache_hit_rate"])  # type: ignore[arg-type]
        summary[workload]["hit_rate_score"] = float(sc["prefix_cache_hit_rate"])  # type: ignore[arg-type]
    report = {
        "benchmark": "prefix_routing",
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine_info,
        "settings": {**vars(args), "model": model},
        "results": results,
        "summary": summary,
        "gateway_overhead": hop,
    }
    out = Path(args.out) if args.out else (
        ROOT / "bench" / "results" / f"prefix_routing-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
