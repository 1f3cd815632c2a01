"""The HTTP edge when the gateway behind it dies: real processes, kill -9.

One replica (role ``both``, two sequences at a time) on a tiny model, the gateway in front of
it on a fixed port, and Envoy (``deploy.envoy_runner``) in front of the gateway, with its
admin port open for its counters. Each test finds the gateway up (``ensure_gateway``).

- A request made while the gateway is down waits at Envoy (which retries what never reached
  the gateway) and is served by the restarted gateway: the client never sees the outage.
- A request the gateway had received when it died is not sent again (it may have started a
  generation): a non-streamed one gets an OpenAI-shaped 503, a stream breaks as a transport
  error (its chunked body never ends, no ``[DONE]``), never as a clean, truncated end. Envoy
  cannot write an ``error`` event after the upstream is gone: once a response has started,
  an upstream reset resets the client's stream (docs/http-api.md).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from engine_common.llm import LLM
from engine_common.sampling_params import SamplingParams
from protos.tandem.v1 import engine_pb2, engine_pb2_grpc
from tests.openai_http import http_status, offline_engine
from tests.replica_process import (
    ReplicaProcess,
    free_port,
    spawn_module,
    start_replicas,
    stop_all,
    wait_until,
)

pytestmark = pytest.mark.timeout(600)

PROMPT = "alpha bravo charlie delta"
LONG = 480  # tokens: a generation still running when the gateway is killed
# Envoy's retries of what never reached the gateway: ~100 s, a gateway start on a busy
# machine (the default, ~20 s, is for a supervisor's restart on an idle one).
RETRIES = "200"


@dataclass
class EdgeStack:
    replica: ReplicaProcess
    model_dir: Path
    logs: Path
    gateway_port: int
    http_port: int
    admin_port: int
    gateway: subprocess.Popen[bytes] | None = None
    starts: int = 0

    def start_gateway(self) -> None:
        self.starts += 1
        self.gateway = spawn_module(self.logs, f"gateway-{self.starts}", [
            "gateway", "--model", str(self.model_dir), "--served-model-name", "tiny",
            "--host", "127.0.0.1", "--port", str(self.gateway_port), "--metrics-port", "0",
            "--max-attempts", "1", "--replica", self.replica.target])

    def kill_gateway(self) -> None:
        if self.gateway is not None and self.gateway.poll() is None:
            os.killpg(self.gateway.pid, signal.SIGKILL)
            self.gateway.wait(30)

    def ensure_gateway(self) -> None:
        """The gateway up and Envoy's health check seeing it serve."""
        if self.gateway is None or self.gateway.poll() is not None:
            self.start_gateway()
        wait_until(lambda: http_status(self.http_port, "/health") == 200,
                   time.monotonic() + 240, "envoy /health", self.logs)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.http_port}/v1", api_key="x",
                             max_retries=0, timeout=300)

    def envoy_counter(self, name: str) -> int:
        url = f"http://127.0.0.1:{self.admin_port}/stats?filter=^{name}$"
        with urllib.request.urlopen(url, timeout=10) as response:
            return int(response.read().decode().split(":")[1])

    def replica_load(self) -> engine_pb2.LoadReport:
        with grpc.insecure_channel(self.replica.target) as channel:
            return engine_pb2_grpc.EngineStub(channel).GetLoad(engine_pb2.GetLoadRequest(),
                                                               timeout=10)


@pytest.fixture(scope="module")
def edge(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EdgeStack]:
    logs = tmp_path_factory.mktemp("envoy-gateway-faults")
    replicas = start_replicas(tiny_llama_dir, logs, {"both": [
        "--role", "both", "--dtype", "float32", "--kv-cache-memory", "16MiB",
        "--served-model-name", "tiny", "--log-level", "WARNING", "--max-num-seqs", "2"]})
    stack = EdgeStack(replicas["both"], tiny_llama_dir, logs, free_port(), free_port(),
                      free_port())
    envoy = spawn_module(logs, "envoy", [
        "deploy.envoy_runner", "--http-port", str(stack.http_port), "--upstream",
        f"127.0.0.1:{stack.gateway_port}", "--admin-port", str(stack.admin_port),
        "--upstream-retries", RETRIES, "--concurrency", "1"])
    try:
        stack.ensure_gateway()
        yield stack
    finally:
        stack.kill_gateway()
        stop_all([envoy], replicas)


@pytest.fixture(scope="module")
def offline(tiny_llama_dir: Path) -> LLM:
    return offline_engine(tiny_llama_dir)


def greedy_text(offline: LLM, max_tokens: int) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return offline.generate([PROMPT], params)[0].text


def in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """``call`` running in a thread; its result (or exception) lands in the dict."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = call()
        except Exception as error:  # noqa: BLE001 - the test inspects it
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_a_request_made_while_the_gateway_is_down_is_served_after_its_restart(
        edge: EdgeStack, offline: LLM) -> None:
    edge.ensure_gateway()
    want = greedy_text(offline, 6)
    edge.kill_gateway()
    wait_until(lambda: http_status(edge.http_port, "/health") == 503,
               time.monotonic() + 30, "envoy /health 503", edge.logs)
    retries = edge.envoy_counter("cluster.tandem_upstream.upstream_rq_retry")
    client = edge.client()
    options: dict[str, Any] = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6,
                               "temperature": 0, "extra_body": {"ignore_eos": True}}

    def plain() -> str:
        return client.completions.create(**options).choices[0].text

    def streamed() -> str:
        chunks = client.completions.create(stream=True, **options)
        return "".join(c.choices[0].text for c in chunks if c.choices)

    calls = []
    for call in (plain, streamed, plain):
        calls.append(in_thread(call))
        time.sleep(0.3)
    # All three are waiting at Envoy, retried while nothing listens on the gateway's port.
    wait_until(lambda: edge.envoy_counter("cluster.tandem_upstream.upstream_rq_retry")
               >= retries + 3, time.monotonic() + 30, "envoy retries", edge.logs)
    edge.start_gateway()
    served = 0
    for thread, outcome in calls:
        thread.join(240)
        assert not thread.is_alive()
        if "result" in outcome:
            assert outcome["result"] == want
            served += 1
            continue
        # A restarted gateway listens a few tens of milliseconds before it has seen its
        # replica: a try landing then gets the gateway's own answer, never Envoy's
        # "upstream connect error" (which would mean no retry reached it).
        error = outcome["error"]
        assert isinstance(error, openai.InternalServerError), repr(error)
        assert "no decode-capable replica" in error.message, error.message
    assert served >= 1
    edge.ensure_gateway()


def test_a_gateway_killed_mid_request_never_ends_a_response_silently(
        edge: EdgeStack, offline: LLM) -> None:
    """Two streams running (the replica's two slots) and a third request queued behind them
    when the gateway is killed: the streams break as transport errors after a prefix of the
    right text, the queued request is a 503; the replica frees everything."""
    edge.ensure_gateway()
    want = greedy_text(offline, LONG)
    client = edge.client()
    sdk_stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=LONG,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
    chunks = iter(sdk_stream)
    received = next(chunks).choices[0].text
    raw = http.client.HTTPConnection("127.0.0.1", edge.http_port, timeout=120)
    raw.request("POST", "/v1/completions", json.dumps({
        "model": "tiny", "prompt": PROMPT, "max_tokens": LONG, "temperature": 0,
        "ignore_eos": True, "stream": True}), {"content-type": "application/json"})
    raw_response = raw.getresponse()
    assert raw_response.status == 200
    assert raw_response.readline().startswith(b"data: {")
    queued, outcome = in_thread(lambda: client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=4))
    wait_until(lambda: edge.replica_load().num_requests_waiting >= 1, time.monotonic() + 30,
               "a queued request", edge.logs)
    edge.kill_gateway()

    # The SDK raises, its HTTP client having seen the chunked body's missing end.
    with pytest.raises(openai.APIConnectionError) as broken:
        for chunk in chunks:
            received += chunk.choices[0].text if chunk.choices else ""
    assert "incomplete chunked read" in str(broken.value.__cause__), repr(broken.value.__cause__)
    assert want.startswith(received) and len(received) < len(want)
    with pytest.raises(http.client.IncompleteRead):  # the chunked body never ends
        raw_response.read()
    raw.close()
    queued.join(60)
    error = outcome.get("error")
    assert isinstance(error, openai.InternalServerError), outcome
    assert error.status_code == 503 and error.body["type"] == "server_error"  # type: ignore[index]
    assert "reset" in error.message
    # The replica saw its caller go: nothing left running or waiting.
    wait_until(lambda: (lambda load: load.num_requests_running == 0
                        and load.num_requests_waiting == 0)(edge.replica_load()),
               time.monotonic() + 60, "an idle replica", edge.logs)
    edge.ensure_gateway()
