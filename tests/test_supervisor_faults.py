"""kill -9 of each kind of process under the real `tandem up` (tiny Llama; two prefill and two
decode replicas, the gateway, Envoy), with streams in flight.

In file order on one suite: a second suite on the first one's HTTP port is refused at once,
naming the port; a decode replica dies (its streams resume on the other one, token for token;
the supervisor restarts it); a prefill replica dies under a burst of long prompts (every
request still completes, HF-exact; the failure is counted as KV fallbacks or hand-backs;
requests go to the other prefill replica meanwhile); Envoy dies (restarted; HTTP serves
again); the gateway dies (restarted; the same gRPC client and HTTP through Envoy are served
again); the two replicas are back meanwhile and the gateway sends them work again; and
SIGTERM drains the streams in flight before everything stops. Greedy references come from the offline engine,
which equals Hugging Face (``test_engine_greedy``).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from engine_common.config import CacheConfig, EngineConfig
from engine_common.llm import LLM
from engine_common.sampling_params import SamplingParams
from services.suite_tls import SuiteTls
from services.suite_tls import channel as suite_channel
from tandem.client import Client
from tests.replica_process import REPO_ROOT, free_port, free_ports

pytestmark = pytest.mark.timeout(600)
STARTUP_S = 240.0
RESTART_S = 180.0


@dataclass
class UpSuite:
    process: subprocess.Popen[bytes]
    output: Path
    base_port: int
    gateway_port: int
    metrics_base: int
    http_port: int
    killed_decode: str = ""  # the decode replica the tests killed
    tls_dir: Path | None = None  # the throwaway certificates tandem up made

    NAMES = ("prefill-0", "prefill-1", "decode-2", "decode-3")

    def text(self) -> str:
        return self.output.read_text(errors="replace")

    def wait_said(self, pattern: str, timeout: float) -> None:
        wait_for(lambda: re.search(pattern, self.text()) is not None, timeout,
                 lambda: f"no {pattern!r} in the supervisor's output:\n{self.text()[-3000:]}")

    @property
    def gateway(self) -> str:
        return f"127.0.0.1:{self.gateway_port}"

    def metrics_port(self, name: str) -> int:
        return self.metrics_base + (self.NAMES.index(name) if name in self.NAMES else 4)

    def metric(self, name: str, metric: str, **labels: str) -> float:
        url = f"http://127.0.0.1:{self.metrics_port(name)}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        return sum(sample.value for family in text_string_to_metric_families(text)
                   for sample in family.samples if sample.name == metric
                   and all(sample.labels.get(k) == v for k, v in labels.items()))

    def metric_or_zero(self, name: str, metric: str) -> float:
        """``metric``, or 0 while the process is down (a restarted one starts at 0 too)."""
        try:
            return self.metric(name, metric)
        except OSError:
            return 0.0

    def pid(self, name: str) -> int:
        """The pid of the suite's process ``name`` (a replica's frontend, "gateway", or
        "envoy": the Envoy binary under its runner)."""
        for pid, parent, argv in processes():
            if parent != self.process.pid:
                continue
            if name in self.NAMES and f"--engine-id\0{name}\0" in argv:
                return pid
            if name == "gateway" and "\0-m\0gateway\0" in argv:
                return pid
            if name == "envoy" and "deploy.envoy_runner" in argv:
                return children(pid)[0]
        raise LookupError(f"no {name} under the supervisor")


def processes() -> list[tuple[int, int, str]]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                argv = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            found.append((int(entry.name), int(stat.rsplit(")", 1)[1].split()[1]), argv))
    return found


def children(pid: int) -> list[int]:
    return [child for child, parent, _ in processes() if parent == pid]


def wait_for(condition: Callable[[], bool], timeout: float,
             why: Callable[[], str] = lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not in {timeout} s. {why()}"
        time.sleep(0.2)


def up_command(model: Path, log_dir: Path, base: int, gateway: int, metrics: int,
               http: int) -> list[str]:
    return [sys.executable, "-m", "deploy.cli", "up", "--model", str(model),
            "--prefill", "2", "--decode", "2", "--envoy", "--kv-cache-memory", "16MiB",
            "--base-port", str(base), "--gateway-port", str(gateway),
            "--metrics-base-port", str(metrics), "--http-port", str(http),
            "--log-dir", str(log_dir)]


@pytest.fixture(scope="module")
def suite(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpSuite]:
    root = tmp_path_factory.mktemp("up")
    ports = (free_ports(4), free_port(), free_ports(6), free_port())
    output = root / "up.out"
    with output.open("wb") as out:
        process = subprocess.Popen(up_command(tiny_llama_dir, root / "logs", *ports),
                                   cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
    up = UpSuite(process, output, *ports)
    try:
        up.wait_said(r"all healthy after", STARTUP_S)
        yield up
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()  # its children are in their own groups: end them by pid
                for pid, _, argv in processes():
                    if str(ports[0]) in argv or f"--http-port\0{ports[3]}" in argv:
                        os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def offline(tiny_llama_dir: Path) -> LLM:
    return LLM(EngineConfig(model=str(tiny_llama_dir),
                            cache=CacheConfig(num_gpu_blocks_override=512)))


def greedy(offline: LLM, prompts: list[list[int]], max_tokens: int) -> list[str]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [r.text for r in offline.generate(prompts, params)]


def stream_all(target: str, prompts: list[list[int]], max_tokens: int,
               then: Callable[[], None] | None = None,
               once: int = 1) -> list[str | Exception]:
    """Stream every prompt at once through ``target``; ``then`` runs once ``once`` streams
    have their first text. Returns each stream's text, or the error that ended it."""
    results: list[str | Exception] = [""] * len(prompts)
    started = threading.Semaphore(0)

    def one(i: int) -> None:
        try:
            with Client(target, timeout=180) as client:
                pieces: list[str] = []
                for chunk in client.complete_stream(prompts[i], max_tokens=max_tokens,
                                                    temperature=0, ignore_eos=True):
                    if not pieces:
                        started.release()
                    pieces.append(chunk.text)
                results[i] = "".join(pieces)
        except Exception as error:  # noqa: BLE001 - reported per stream
            results[i] = error

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    if then is not None:
        for _ in range(once):
            started.acquire(timeout=120)
        then()
    for thread in threads:
        thread.join(240)
    return results


def prompts_of(offline: LLM, seed: int, count: int, lengths: tuple[int, int]) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = offline.core.arch.vocab_size
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(*lengths))]
            for _ in range(count)]


def http_complete(suite: UpSuite, model: str, prompt: str) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{suite.http_port}/v1/completions", method="POST",
        data=json.dumps({"model": model, "prompt": prompt, "max_tokens": 4}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return dict(json.loads(response.read()))


def test_a_second_suite_on_the_same_http_port_is_refused_at_once(suite: UpSuite,
                                                                  tiny_llama_dir: Path,
                                                                  tmp_path: Path) -> None:
    started = time.monotonic()
    run = subprocess.run(
        up_command(tiny_llama_dir, tmp_path / "logs", free_ports(4), free_port(), free_ports(6),
                   suite.http_port),
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert (f"port {suite.http_port} on 127.0.0.1 (Envoy HTTP (--http-port)) is in use"
            in run.stderr), run.stderr
    assert "Traceback" not in run.stderr + run.stdout
    assert not (tmp_path / "logs").exists()  # nothing was started
    assert time.monotonic() - started < 60


def test_the_suite_runs_with_mutual_tls_by_default(suite: UpSuite) -> None:
    """`tandem up` made a throwaway CA and certificate: a replica refuses a plaintext caller
    and serves one holding the suite's certificate (the gateway and Envoy, in every other
    test, reach the replicas with it)."""
    made = re.search(r"suite mutual TLS: a throwaway CA and certificate in (\S+)", suite.text())
    assert made, suite.text()[-2000:]
    suite.tls_dir = Path(made.group(1))
    target = f"127.0.0.1:{suite.base_port}"
    check = health_pb2.HealthCheckRequest()
    with grpc.insecure_channel(target) as plaintext, pytest.raises(grpc.RpcError) as refused:
        health_pb2_grpc.HealthStub(plaintext).Check(check, timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    with suite_channel(target, SuiteTls.load(suite.tls_dir)) as member:
        answer = health_pb2_grpc.HealthStub(member).Check(check, timeout=10)
    assert answer.status == health_pb2.HealthCheckResponse.SERVING


def test_a_killed_decode_replica_resumes_its_streams_restarts_and_rejoins(
        suite: UpSuite, offline: LLM) -> None:
    prompts = prompts_of(offline, 1, 6, (8, 20))
    want = greedy(offline, prompts, 450)  # long enough to be killed mid-stream
    resumed = suite.metric("gateway", "tandem:gateway_resumptions_total", outcome="resumed")
    victims: list[str] = []

    def kill_the_busier_decode_replica() -> None:
        # NOTE: the decode replicas' engine cores are frozen (SIGSTOP) at the first stream's
        # first text, before their running gauges are read: a tiny model streams 450 tokens
        # in about a second, and a fresh make test once read the gauges so slowly (the
        # frontends busy streaming) that the victim's streams had all finished 5 ms before
        # the kill, leaving nothing to resume. A frozen core finishes nothing, so a gauge
        # read after the frontend has taken the core's last outputs counts streams the kill
        # surely cuts.
        decodes = ("decode-2", "decode-3")
        cores = [child for name in decodes for child in children(suite.pid(name))]
        for core in cores:
            os.kill(core, signal.SIGSTOP)
        try:
            time.sleep(0.5)  # the frontends take the outputs the cores sent before
            running = {name: suite.metric(name, "vllm:num_requests_running")
                       for name in decodes}
            busier = max(running, key=running.__getitem__)
            assert running[busier] > 0, running
            victims.append(busier)
            os.kill(suite.pid(busier), signal.SIGKILL)
        finally:
            for core in cores:  # the victim's core too: it ends once it sees its parent gone
                os.kill(core, signal.SIGCONT)

    got = stream_all(suite.gateway, prompts, 450, kill_the_busier_decode_replica, once=1)
    assert got == want
    assert suite.metric("gateway", "tandem:gateway_resumptions_total",
                        outcome="resumed") > resumed
    suite.killed_decode = victims[0]
    suite.wait_said(rf"supervisor: {victims[0]} killed by SIGKILL; restarting it in 1\.0 s "
                    r"\(restart 1, 1 in a row\)", 10)
    # Its return is checked after the next kills, while it starts again meanwhile.


def test_a_killed_prefill_replica_is_routed_around_restarts_and_prefills_again(
        suite: UpSuite, offline: LLM) -> None:
    prompts = prompts_of(offline, 2, 16, (100, 250))
    want = greedy(offline, prompts, 8)
    def fallbacks() -> list[float]:  # per decode replica; 0 while one is restarting
        return [suite.metric_or_zero(d, "tandem:kv_transfer_fallbacks_total")
                for d in ("decode-2", "decode-3")]

    before = fallbacks()
    handbacks = suite.metric("gateway", "tandem:gateway_retries_total", code="prefill_handback")
    victim = suite.pid("prefill-0")
    # Frozen first, so that the burst's prefills routed to it are surely in flight there
    # when it dies (its health stream stays open while it is stopped).
    os.kill(victim, signal.SIGSTOP)

    def kill_it_a_second_later() -> None:
        time.sleep(1.0)
        os.kill(victim, signal.SIGKILL)

    got = stream_all(suite.gateway, prompts, 8, kill_it_a_second_later, once=0)
    assert got == want
    # The decode replicas handed those back (each counted as a KV fallback) and the gateway
    # sent them again: every request completed, token for token.
    assert suite.metric("gateway", "tandem:gateway_retries_total",
                        code="prefill_handback") > handbacks
    assert any(after > was for after, was in zip(fallbacks(), before, strict=True))
    suite.wait_said(r"supervisor: prefill-0 killed by SIGKILL", 10)
    # While it is down, the other prefill replica takes the hops.
    down = "prefill-0 is ready again" not in suite.text()
    picks = suite.metric("gateway", "tandem:gateway_picks_total", as_role="prefill",
                         replica=f"127.0.0.1:{suite.base_port}")
    other = suite.metric("prefill-1", "vllm:prompt_tokens_total")
    more = prompts_of(offline, 3, 4, (100, 200))
    assert stream_all(suite.gateway, more, 4) == greedy(offline, more, 4)
    if down and "prefill-0 is ready again" not in suite.text():
        assert suite.metric("gateway", "tandem:gateway_picks_total", as_role="prefill",
                            replica=f"127.0.0.1:{suite.base_port}") == picks
        assert suite.metric("prefill-1", "vllm:prompt_tokens_total") > other


def test_a_killed_envoy_is_restarted_and_serves_http_again(suite: UpSuite) -> None:
    model = json.loads(urllib.request.urlopen(
        f"http://127.0.0.1:{suite.http_port}/v1/models", timeout=10).read())["data"][0]["id"]
    assert http_complete(suite, model, "hello")["choices"]
    os.kill(suite.pid("envoy"), signal.SIGKILL)
    suite.wait_said(r"supervisor: envoy exited with code 137 \(128 \+ SIGKILL\); restarting", 10)
    suite.wait_said(r"supervisor: envoy is ready again", RESTART_S)
    assert http_complete(suite, model, "hello again")["choices"]
    # The HTTP port's /metrics is the gateway's.
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{suite.http_port}/metrics",
                                     timeout=10).read().decode()
    assert "tandem:gateway_requests" in metrics, metrics[:500]


def test_a_killed_gateway_is_restarted_and_clients_are_served_again(suite: UpSuite) -> None:
    with Client(suite.gateway, timeout=60) as client:
        assert client.complete("before", max_tokens=2).choices
        os.kill(suite.pid("gateway"), signal.SIGKILL)
        suite.wait_said(r"supervisor: gateway killed by SIGKILL; restarting", 10)
        suite.wait_said(r"supervisor: gateway is ready again", RESTART_S)

        def served() -> bool:
            try:
                return bool(client.complete("after", max_tokens=2).choices)
            except Exception:  # noqa: BLE001 - reconnecting
                return False

        wait_for(served, 60)  # the same client: its channel reconnects
    model = json.loads(urllib.request.urlopen(
        f"http://127.0.0.1:{suite.http_port}/v1/models", timeout=10).read())["data"][0]["id"]
    wait_for(lambda: bool(http_complete(suite, model, "via envoy")["choices"]), 30)


def test_the_killed_replicas_restarted_and_the_gateway_sends_them_work_again(
        suite: UpSuite, offline: LLM) -> None:
    suite.wait_said(rf"supervisor: {suite.killed_decode} is ready again", RESTART_S)
    suite.wait_said(r"supervisor: prefill-0 is ready again", RESTART_S)
    # The gateway re-dials their static addresses: requests reach the new processes, for
    # decoding (a new process's counters start at 0) and for prefilling.
    def served_by_both() -> bool:
        prompt = prompts_of(offline, int(time.monotonic() * 1000), 1, (100, 200))
        assert stream_all(suite.gateway, prompt, 2) == greedy(offline, prompt, 2)
        return (suite.metric(suite.killed_decode, "vllm:request_success_total") > 0
                and suite.metric("prefill-0", "vllm:prompt_tokens_total") > 0)

    wait_for(served_by_both, 90)


def test_sigterm_drains_the_streams_in_flight_then_stops_everything(
        suite: UpSuite, offline: LLM) -> None:
    prompts = prompts_of(offline, 4, 4, (8, 20))
    want = greedy(offline, prompts, 150)
    pids = [suite.pid(name) for name in (*UpSuite.NAMES, "gateway", "envoy")]
    got = stream_all(suite.gateway, prompts, 150,
                     lambda: suite.process.send_signal(signal.SIGTERM), once=len(prompts))
    assert got == want  # every stream finished, none was cut
    assert suite.process.wait(90) == 0
    assert suite.text().rstrip().endswith("stopped")
    assert suite.tls_dir is not None and not suite.tls_dir.exists()  # the throwaway CA went
    alive = {pid for pid, _, _ in processes()}
    assert not alive & set(pids)
