"""What the gateway and Envoy add to a request: latency per request and CPU per replica's.

One aggregated replica on the default model, a gateway in front of it and Envoy in front of
the gateway, all started here as plain processes. The same workload (``--concurrency``
clients, each streaming completions of ``--output-tokens`` tokens from a fixed prompt, EOS
ignored) runs over four paths in interleaved rounds, the paths' order shuffled per round:

  direct   gRPC SDK -> replica
  gateway  gRPC SDK -> gateway -> replica
  envoy    gRPC SDK -> Envoy -> gateway -> replica (Envoy routes gRPC as it is)
  http     HTTP (SSE) -> Envoy (JSON transcoding) -> gateway -> replica

Per path: TTFT and end-to-end latency (p50, p99) and the CPU seconds each process used
while that path ran (``/proc/PID/stat``, the process and its children). What a hop adds is
the difference to the path without it, measured in the same round; its CPU is its seconds
over the replica's (the replica and its engine core) in the same phase. Goals (issue 27): the
gateway adds < 2 ms p99 per request and < 5% of a replica's CPU.

Then the per-request latency probe (``--probe`` iterations): one request at a time, one
output token of the same (prefix-cached) prompt, each iteration sending one request down each
path in shuffled order over connections kept open, as a client's are. With no queue and no
other request in flight, a path's latency is its hops' plus one engine step, and the paired
difference per iteration (the gateway path's latency minus the direct one's sent moments
apart) is what the hop adds to a request, with the engine's drift mostly cancelled; its p50
and p99 are the figures for the goal's "< 2 ms p99". Each iteration also makes one call to a
bare grpc.aio server in another process (``Engine.Generate`` answering one message at once,
no interceptors, no engine): the least any Python gRPC hop costs here, the gateway's floor.
The gateway's and the replica's request logs then split the probe's gateway requests: the
gateway's own time around the replica's call (its log's total less the replica's for the
same request id: routing, the hop both ways, relaying) and the rest.

It also times what the gateway does per streamed message that a byte-for-byte relay would
not: parse the replica's ``GenerateResponse``, turn it into a ``GenerationDelta`` and then
into an OpenAI chunk, serialize it (``--micro`` iterations), against parsing and serializing
the message alone.

    python bench/hop_overhead.py [--rounds 3] [--requests 32] [--concurrency 4] [--probe 200]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import grpc.aio
import httpx2

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import write_report  # noqa: E402
from protos.tandem.v1 import engine_pb2 as epb  # noqa: E402
from protos.tandem.v1 import engine_pb2_grpc as epb_grpc  # noqa: E402
from tandem import AsyncClient  # noqa: E402

PATHS = ("direct", "gateway", "envoy", "http")
PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. "
          "The story should be vivid and calm.")


@dataclass
class Suite:
    processes: dict[str, subprocess.Popen[bytes]]
    replica: str
    gateway: str
    envoy_port: int
    gateway_metrics_port: int
    bare_hop: str
    log_dir: Path

    def cpu_seconds(self) -> dict[str, float]:
        return {name: _cpu_seconds(proc.pid) for name, proc in self.processes.items()}


def _cpu_seconds(pid: int) -> float:
    """User + system time of ``pid`` and of its live children (the engine core), seconds."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    pids = [pid] + [int(p) for p in _children(pid)]
    for one in pids:
        try:
            fields = Path(f"/proc/{one}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks
    return total


def _children(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _spawn(log_dir: Path, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
    with open(log_dir / f"{name}.log", "wb") as log:
        return subprocess.Popen([sys.executable, "-m", *argv], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def start_suite(log_dir: Path, replica_args: list[str]) -> Suite:
    replica_port, gateway_port, envoy_port = _free_port(), _free_port(), _free_port()
    gateway_metrics_port, bare_hop_port = _free_port(), _free_port()
    processes = {
        "replica": _spawn(log_dir, "replica", [
            "services.replica", "--role", "both", "--port", str(replica_port),
            "--metrics-port", "0", *replica_args]),
        "gateway": _spawn(log_dir, "gateway", [
            "gateway", "--port", str(gateway_port), "--metrics-port", str(gateway_metrics_port),
            "--replica", f"127.0.0.1:{replica_port}"]),
        "envoy": _spawn(log_dir, "envoy", [
            "deploy.envoy_runner", "--http-port", str(envoy_port), "--concurrency", "1",
            "--upstream", f"127.0.0.1:{gateway_port}"]),
        "bare_hop": _spawn(log_dir, "bare_hop", [
            "bench.hop_overhead", "--bare-hop-server", str(bare_hop_port)]),
    }
    suite = Suite(processes, f"127.0.0.1:{replica_port}", f"127.0.0.1:{gateway_port}",
                  envoy_port, gateway_metrics_port, f"127.0.0.1:{bare_hop_port}", log_dir)
    deadline = time.monotonic() + 300
    for target in (suite.replica, suite.gateway, f"127.0.0.1:{envoy_port}", suite.bare_hop):
        while not _answers(target):
            dead = [name for name, proc in processes.items() if proc.poll() is not None]
            if dead or time.monotonic() > deadline:
                stop_suite(suite)
                raise RuntimeError(f"{dead or target} did not start; logs in {log_dir}")
            time.sleep(0.5)
    return suite


def _answers(target: str) -> bool:
    with grpc.insecure_channel(target) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=1)
        except grpc.FutureTimeoutError:
            return False
    return True


def stop_suite(suite: Suite) -> None:
    for proc in suite.processes.values():
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
    for proc in suite.processes.values():
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)


@dataclass
class Timings:
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)


async def _grpc_request(target: str, tokens: int, timings: Timings) -> None:
    async with AsyncClient(target, timeout=300) as client:
        started = time.perf_counter()
        first = None
        async for chunk in client.complete_stream(PROMPT, max_tokens=tokens, temperature=0.0,
                                                  ignore_eos=True):
            if first is None and chunk.text:
                first = time.perf_counter()
        timings.e2e.append(time.perf_counter() - started)
        timings.ttft.append((first or time.perf_counter()) - started)


async def _http_request(port: int, tokens: int, timings: Timings) -> None:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    async with httpx2.AsyncClient(timeout=300) as http:
        started = time.perf_counter()
        first = None
        async with http.stream("POST", f"http://127.0.0.1:{port}/v1/completions",
                               json=body) as response:
            async for line in response.aiter_lines():
                if first is None and line.startswith("data: {"):
                    first = time.perf_counter()
        timings.e2e.append(time.perf_counter() - started)
        timings.ttft.append((first or time.perf_counter()) - started)


async def run_path(suite: Suite, path: str, requests: int, concurrency: int,
                   tokens: int) -> Timings:
    timings = Timings()
    queue = list(range(requests))

    async def worker() -> None:
        while queue:
            queue.pop()
            if path == "http":
                await _http_request(suite.envoy_port, tokens, timings)
            else:
                target = {"direct": suite.replica, "gateway": suite.gateway,
                          "envoy": f"127.0.0.1:{suite.envoy_port}"}[path]
                await _grpc_request(target, tokens, timings)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return timings


class _OneMessageEngine(epb_grpc.EngineServicer):
    async def Generate(self, request: epb.GenerateRequest,  # noqa: N802 (gRPC's names)
                       context: grpc.aio.ServicerContext) -> None:
        await context.write(epb.GenerateResponse(request_id=request.request_id,
                                                 new_token_ids=[1], finish_reason="length"))


async def serve_bare_hop(port: int) -> None:
    """The bare hop's server (``--bare-hop-server``): runs until killed."""
    server = grpc.aio.server()
    epb_grpc.add_EngineServicer_to_server(_OneMessageEngine(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


class _BareHop:
    """A client of the bare hop's server, shaped like the SDK's ``complete_stream``."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = epb_grpc.EngineStub(self.channel)
        self.request = epb.GenerateRequest(request_id="bare", prompt_token_ids=list(range(24)),
                                           sampling_params=epb.SamplingParams(max_tokens=1))

    async def complete_stream(self, *_: object, **__: object) -> AsyncIterator[object]:
        async for response in self.stub.Generate(self.request):
            yield response

    async def close(self) -> None:
        await self.channel.close()


async def probe_latency(suite: Suite, iterations: int) -> dict[str, list[float]]:
    """Seconds per one-token request on each path (and per call of the bare hop),
    ``iterations`` rounds of one request per path in shuffled order, strictly one at a time,
    over kept-open connections."""
    clients: dict[str, AsyncClient | _BareHop] = {
        "direct": AsyncClient(suite.replica, timeout=60),
        "gateway": AsyncClient(suite.gateway, timeout=60),
        "envoy": AsyncClient(f"127.0.0.1:{suite.envoy_port}", timeout=60),
        "bare_hop": _BareHop(suite.bare_hop)}
    body = {"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": 1,
            "temperature": 0, "stream": True}
    url = f"http://127.0.0.1:{suite.envoy_port}/v1/completions"
    paths = (*PATHS, "bare_hop")
    latencies: dict[str, list[float]] = {path: [] for path in paths}
    async with httpx2.AsyncClient(timeout=60) as http:
        for iteration in range(iterations + 3):  # the first 3: warm-up, not kept
            for path in random.Random(1000 + iteration).sample(paths, len(paths)):
                started = time.perf_counter()
                if path == "http":
                    async with http.stream("POST", url, json=body) as response:
                        async for _ in response.aiter_lines():
                            pass
                else:
                    async for _ in clients[path].complete_stream(PROMPT, max_tokens=1,
                                                                 temperature=0.0):
                        pass
                if iteration >= 3:
                    latencies[path].append(time.perf_counter() - started)
    for client in clients.values():
        await client.close()
    return latencies


def gateway_routing_time(suite: Suite) -> dict[str, float]:
    """The gateway's own routing work per request (its ``routing_latency`` histogram: the
    snapshot, hashing and picking before it forwards): how many requests, and the fraction
    done within 1 ms and within 2 ms (the buckets' bounds)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx2.get(f"http://127.0.0.1:{suite.gateway_metrics_port}/metrics", timeout=10).text
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "tandem:gateway_routing_latency_seconds":
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    buckets[float(sample.labels["le"])] = sample.value
    total = buckets.get(float("inf"), 0.0)
    return {"requests": total,
            "fraction_within_1ms": buckets.get(0.001, 0.0) / max(total, 1.0),
            "fraction_within_2.5ms": buckets.get(0.0025, 0.0) / max(total, 1.0)}


_LOG_LINE = re.compile(r"tandem\.requests: request request_id=(\S+) method=(\S+) .*"
                       r"output_tokens=1 ttft_s=(\S+) total_s=(\S+)")


def _one_token_requests(log: Path, method: str) -> dict[str, tuple[float, float]]:
    """(ttft, total) seconds of each one-token request ``method`` served, from a request
    log in its text format, by request id."""
    found = {}
    for line in log.read_text(errors="replace").splitlines():
        match = _LOG_LINE.search(line)
        if match and match.group(2) == method:
            found[match.group(1)] = (float(match.group(3)), float(match.group(4)))
    return found


def gateway_share_from_logs(suite: Suite) -> dict[str, float]:
    """Over the probe's requests through the gateway: the gateway's own time around the
    replica's call (p50 and p90 ms of its log's total less the replica's log's, and the same
    for the first token), paired by request id."""
    gateway = _one_token_requests(suite.log_dir / "gateway.log",
                                  "tandem.v1.Generation/CompleteStream")
    replica = _one_token_requests(suite.log_dir / "replica.log", "tandem.v1.Engine/Generate")
    paired = [(gateway[rid], replica[rid]) for rid in gateway if rid in replica]
    if not paired:
        return {"requests": 0}
    total = [g[1] - r[1] for g, r in paired]
    ttft = [g[0] - r[0] for g, r in paired]
    return {"requests": len(paired),
            "own_total_p50_ms": 1e3 * statistics.median(total),
            "own_total_p90_ms": 1e3 * _pct(total, 0.9),
            "own_ttft_p50_ms": 1e3 * statistics.median(ttft),
            "own_ttft_p90_ms": 1e3 * _pct(ttft, 0.9)}


def probe_summary(latencies: dict[str, list[float]]) -> dict[str, object]:
    """Per path p50/p99 (ms), and per hop the paired per-iteration differences' p50/p99."""
    paths = {path: {"p50_ms": 1e3 * statistics.median(v), "p99_ms": 1e3 * _pct(v, 0.99)}
             for path, v in latencies.items()}
    hops = {"gateway": ("direct", "gateway"), "envoy_grpc": ("gateway", "envoy"),
            "envoy_http": ("envoy", "http")}
    added = {}
    for hop, (without, with_hop) in hops.items():
        diffs = [b - a for a, b in zip(latencies[without], latencies[with_hop], strict=True)]
        added[hop] = {"paired_p50_ms": 1e3 * statistics.median(diffs),
                      "paired_p99_ms": 1e3 * _pct(diffs, 0.99),
                      "p50_difference_ms": paths[with_hop]["p50_ms"] - paths[without]["p50_ms"],
                      "p99_difference_ms": paths[with_hop]["p99_ms"] - paths[without]["p99_ms"]}
    added["gateway"]["over_bare_hop_p50"] = (added["gateway"]["paired_p50_ms"]
                                             / paths["bare_hop"]["p50_ms"])
    return {"iterations": len(latencies["direct"]), "paths": paths, "added": added}


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(timings: Timings) -> dict[str, float]:
    return {"ttft_p50_ms": 1e3 * statistics.median(timings.ttft),
            "ttft_p99_ms": 1e3 * _pct(timings.ttft, 0.99),
            "e2e_p50_ms": 1e3 * statistics.median(timings.e2e),
            "e2e_p99_ms": 1e3 * _pct(timings.e2e, 0.99)}


def micro_relay_cost(iterations: int) -> dict[str, float]:
    """Microseconds per streamed message: the gateway's parse -> delta -> OpenAI chunk ->
    serialize within one stream of ``iterations`` messages, a relay's parse + serialize of
    the same message, and what starting a stream costs the gateway (a one-message stream
    less one message)."""
    from services.engine_api.messages import delta_from_response
    from services.frontend.choices import ChoiceDelta
    from services.frontend.completions.response import completion_chunks

    raw = epb.GenerateResponse(request_id="cmpl-x", delta_text=" word", new_token_ids=[1234],
                               prompt_tokens=30, completion_tokens=7).SerializeToString()

    async def stream(messages: int) -> None:
        async def deltas():  # type: ignore[no-untyped-def]
            for _ in range(messages):
                yield ChoiceDelta(0, delta_from_response(epb.GenerateResponse.FromString(raw)))
        async for chunk in completion_chunks(deltas(), response_id="cmpl-x", model="m",
                                             include_usage=False):
            chunk.SerializeToString()

    def timed(fn: Callable[[], object], repeat: int) -> float:
        started = time.perf_counter()
        for _ in range(repeat):
            fn()
        return 1e6 * (time.perf_counter() - started) / repeat

    loop = asyncio.new_event_loop()
    try:
        per_message = timed(lambda: loop.run_until_complete(stream(iterations)), 1) / iterations
        one_message_stream = timed(lambda: loop.run_until_complete(stream(1)), 200)
    finally:
        loop.close()
    relay = timed(lambda: epb.GenerateResponse.FromString(raw).SerializeToString(), iterations)
    return {"gateway_us_per_message": per_message, "relay_us_per_message": relay,
            "gateway_us_per_stream_start": one_message_stream - per_message}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=32, help="per path and round")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--micro", type=int, default=2000)
    parser.add_argument("--probe", type=int, default=200,
                        help="iterations of the one-at-a-time latency probe (0: none)")
    parser.add_argument("--replica-args", default="--max-num-seqs 16",
                        help="extra flags of the replica")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/hop_overhead.json")
    parser.add_argument("--bare-hop-server", type=int, metavar="PORT",
                        help=argparse.SUPPRESS)  # the bare hop's server process
    args = parser.parse_args()
    if args.bare_hop_server:
        asyncio.run(serve_bare_hop(args.bare_hop_server))
        return
    log_dir = ROOT / ".cache/tandem/bench-logs/hop_overhead"
    log_dir.mkdir(parents=True, exist_ok=True)
    suite = start_suite(log_dir, args.replica_args.split())
    rounds: list[dict[str, object]] = []
    try:
        asyncio.run(run_path(suite, "direct", 2, 1, 4))  # warm up, untimed
        for number in range(args.rounds):
            order = random.Random(number).sample(PATHS, len(PATHS))
            results: dict[str, object] = {"order": order}
            for path in order:
                before = suite.cpu_seconds()
                timings = asyncio.run(run_path(suite, path, args.requests, args.concurrency,
                                               args.output_tokens))
                after = suite.cpu_seconds()
                cpu = {name: after[name] - before[name] for name in after}
                results[path] = {**summarize(timings), "cpu_seconds": cpu}
                print(f"round {number} {path}: {results[path]}", flush=True)
            rounds.append(results)
        probe = probe_summary(asyncio.run(probe_latency(suite, args.probe))) \
            if args.probe else None
        print(f"probe: {probe}", flush=True)
        routing = gateway_routing_time(suite)
        print(f"gateway routing: {routing}", flush=True)
        share = gateway_share_from_logs(suite) if args.probe else None
        print(f"gateway's own time, from the request logs: {share}", flush=True)
    finally:
        stop_suite(suite)
    write_report(args.out, "hop_overhead", settings=vars(args) | {"out": str(args.out)},
                 rounds=rounds, added=added_by_hops(rounds), probe=probe,
                 gateway_routing=routing, gateway_share_from_logs=share,
                 micro=micro_relay_cost(args.micro))


def added_by_hops(rounds: list[dict[str, object]]) -> dict[str, object]:
    """Per hop, per round: the latency it adds (ms) and its CPU over the replica's."""
    hops = {"gateway": ("direct", "gateway", "gateway"), "envoy_grpc": ("gateway", "envoy", "envoy"),
            "envoy_http": ("envoy", "http", "envoy")}
    out: dict[str, object] = {}
    for hop, (without, with_hop, process) in hops.items():
        per_round = []
        for r in rounds:
            base, hopped = r[without], r[with_hop]  # type: ignore[index]
            per_round.append({
                **{f"added_{k}": hopped[k] - base[k] for k in base if k.endswith("_ms")},
                "cpu_over_replica": hopped["cpu_seconds"][process]
                / max(hopped["cpu_seconds"]["replica"], 1e-9)})
        out[hop] = {"per_round": per_round, "median": {
            key: statistics.median(p[key] for p in per_round) for key in per_round[0]}}
    return out


if __name__ == "__main__":
    main()
