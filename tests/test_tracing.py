"""One trace across the disaggregated path, received by a real OTLP collector.

An in-process ``opentelemetry.proto`` ``TraceService`` (a gRPC server, as a collector is)
receives the spans of real processes: a gateway, a decode replica and a prefill replica,
each started with ``--otlp-traces-endpoint``. A request sent with a W3C ``traceparent`` in its
metadata (what Envoy passes on from an HTTP client's header) becomes one trace whose tree is
client -> gateway (server) -> gateway's call to the decode replica -> the decode replica's
Engine.Generate -> {its Prefill call -> the prefill replica's Prefill, the KV pull, the
decode}, parent and child across the processes. Without the flag a process sends nothing.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from engine_common.finished_requests import FinishedRequests
from engine_common.metrics import FinishedRequestStats
from tandem.client import Client
from tests.replica_process import (
    envoy_answers,
    free_port,
    gateway_started,
    healthy_replicas,
    is_serving,
    launch_replicas,
    spawn_module,
    stop_all,
    wait_serving,
    wait_until,
)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"


def prompt(tag: str) -> str:
    """40 words no other test's prompt starts with: the decode replica holds none of it, so
    the gateway sends it through the prefill replica (a cached prompt skips the hop)."""
    return " ".join(f"{tag}{i}" for i in range(40))


PROMPT = prompt("word")


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, object]


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """What an OpenTelemetry collector's OTLP/gRPC receiver does, keeping the spans."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()

    def Export(self, request, context):  # noqa: N802 (gRPC's names)
        with self._lock:
            for resource_spans in request.resource_spans:
                service = next(a.value.string_value for a in resource_spans.resource.attributes
                               if a.key == "service.name")
                for scope in resource_spans.scope_spans:
                    for span in scope.spans:
                        self.spans.append(Span(
                            service, span.name, span.kind, span.trace_id.hex(),
                            span.span_id.hex(), span.parent_span_id.hex(),
                            span.start_time_unix_nano, span.end_time_unix_nano,
                            {a.key: a.value.string_value or a.value.int_value
                             for a in span.attributes}))
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]


@pytest.fixture(scope="module")
def collector() -> Iterator[tuple[Collector, int]]:
    servicer = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(0)


@dataclass
class Suite:
    gateway: str
    decode: str
    prefill: str
    logs: Path


@pytest.fixture(scope="module")
def suite(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory,
          collector: tuple[Collector, int]) -> Iterator[Suite]:
    _, port = collector
    logs = tmp_path_factory.mktemp("trace-logs")
    otlp = ["--otlp-traces-endpoint", f"127.0.0.1:{port}"]
    common = ["--dtype", "float32", "--num-kv-blocks", "256", *otlp]
    metrics_port = free_port()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export every 0.1 s, not every 5 s
        # The gateway starts with the replicas (it retries them until they answer).
        replicas = launch_replicas(tiny_llama_dir, logs, {
            "prefill": ["--role", "prefill", *common],
            "decode": ["--role", "decode", *common]})
        try:
            with gateway_started(tiny_llama_dir, logs,
                                 [r.target for r in replicas.values()],
                                 ["--prefill-min-uncached-tokens", "1", "--metrics-port",
                                  str(metrics_port), *otlp]) as gateway:
                wait_serving(replicas)
                # Both registered: the first request's P/D pick sees the prefill replica.
                wait_until(lambda: is_serving(gateway) and healthy_replicas(metrics_port) == 2,
                           time.monotonic() + 60, "the gateway's view of both replicas", logs)
                yield Suite(gateway, replicas["decode"].target, replicas["prefill"].target, logs)
        finally:
            stop_all([], replicas)


def wait_for_spans(collector: Collector, trace_id: str, names: set[str],
                   timeout: float = 30.0) -> list[Span]:
    deadline = time.monotonic() + timeout
    while True:
        spans = collector.trace(trace_id)
        if names <= {s.name for s in spans} or time.monotonic() > deadline:
            return spans
        time.sleep(0.2)


def only(spans: list[Span], service: str, name: str) -> Span:
    found = [s for s in spans if s.service == service and s.name == name]
    assert len(found) == 1, (service, name, [(s.service, s.name) for s in spans])
    return found[0]


def test_one_trace_shows_the_disaggregated_path(suite: Suite, collector) -> None:
    collector, _ = collector
    traceparent = f"00-{TRACE_ID}-{CLIENT_SPAN_ID}-01"
    with Client(suite.gateway, timeout=120, metadata=[("traceparent", traceparent)]) as client:
        answer = client.complete(PROMPT, max_tokens=6, temperature=0, ignore_eos=True)
    assert answer.usage.completion_tokens == 6
    spans = wait_for_spans(collector, TRACE_ID, {
        "tandem.v1.Generation/Complete", "tandem.v1.Engine/Generate",
        "tandem.v1.Engine/Prefill", "kv_pull", "decode", "queue", "prefill"})

    gateway = only(spans, "tandem-gateway", "tandem.v1.Generation/Complete")
    assert gateway.parent_span_id == CLIENT_SPAN_ID  # the caller's traceparent was honoured
    to_decode = only(spans, "tandem-gateway", "tandem.v1.Engine/Generate")
    assert to_decode.parent_span_id == gateway.span_id
    assert to_decode.attributes["server.address"] == suite.decode
    assert to_decode.attributes["tandem.prefill_peer"] == suite.prefill
    replica_spans = [s for s in spans if s.service == "tandem-replica"]
    decode = next(s for s in replica_spans if s.name == "tandem.v1.Engine/Generate"
                  and s.kind == 2)  # SERVER
    assert decode.parent_span_id == to_decode.span_id  # across processes: gateway -> D
    to_prefill = next(s for s in replica_spans if s.name == "tandem.v1.Engine/Prefill"
                      and s.kind == 3)  # CLIENT
    prefill = next(s for s in replica_spans if s.name == "tandem.v1.Engine/Prefill"
                   and s.kind == 2)
    assert to_prefill.parent_span_id == decode.span_id
    assert to_prefill.attributes["server.address"] == suite.prefill
    assert prefill.parent_span_id == to_prefill.span_id  # across processes: D -> P
    pull, decoding = only(replica_spans, "tandem-replica", "kv_pull"), only(
        replica_spans, "tandem-replica", "decode")
    assert pull.parent_span_id == decoding.parent_span_id == decode.span_id
    assert pull.attributes["tandem.kv.bytes"] > 0
    # The phases line up in time: the prefill before the pull, the pull inside the request.
    assert to_prefill.start_ns <= prefill.start_ns <= prefill.end_ns <= to_prefill.end_ns
    assert prefill.end_ns <= pull.end_ns <= decode.end_ns
    assert decode.start_ns <= decoding.start_ns <= decoding.end_ns <= decode.end_ns
    assert gateway.start_ns <= to_decode.start_ns and decode.end_ns <= gateway.end_ns + 10**9
    # The engines' own phases: the prefill replica's queue and prefill inside its Prefill
    # call, the decode replica's queue inside its Generate.
    children = {name: [s for s in replica_spans if s.name == name]
                for name in ("queue", "prefill")}
    [p_queue] = [s for s in children["queue"] if s.parent_span_id == prefill.span_id]
    [p_prefill] = [s for s in children["prefill"] if s.parent_span_id == prefill.span_id]
    [d_queue] = [s for s in children["queue"] if s.parent_span_id == decode.span_id]
    slack = 5 * 10**6  # the engine's clock and the wall clock, read a moment apart
    assert prefill.start_ns - slack <= p_queue.start_ns <= p_queue.end_ns
    assert p_queue.end_ns <= p_prefill.start_ns + slack <= p_prefill.end_ns + slack
    assert p_prefill.end_ns <= prefill.end_ns + slack
    assert p_prefill.attributes["tandem.prompt_tokens"] == answer.usage.prompt_tokens
    assert decode.start_ns - slack <= d_queue.start_ns <= d_queue.end_ns <= decode.end_ns + slack
    # Every span of the trace hangs from the client's span.
    ids = {s.span_id for s in spans} | {CLIENT_SPAN_ID}
    assert all(s.parent_span_id in ids for s in spans)

    # The gateway's log line names both replicas.
    log = (suite.logs / "gateway.log").read_text()
    line = next(line for line in log.splitlines() if "method=tandem.v1.Generation/Complete"
                in line)
    assert f"decode_replicas={suite.decode}" in line
    assert f"prefill_replicas={suite.prefill}" in line and "kv_transfer=remote" in line


def test_a_request_without_a_traceparent_starts_a_trace_at_the_gateway(suite: Suite,
                                                                       collector) -> None:
    collector, _ = collector
    before = {s.trace_id for s in collector.spans}
    with Client(suite.gateway, timeout=120) as client:
        # A prompt of its own: one sharing PROMPT's start is cached on the decode replica,
        # which then skips the prefill hop, and the Prefill span awaited below never comes.
        client.complete(prompt("again"), max_tokens=2)
    deadline = time.monotonic() + 30
    while True:
        roots = [s for s in collector.spans if s.trace_id not in before
                 and s.name == "tandem.v1.Generation/Complete"]
        if roots or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    [root] = roots
    assert root.parent_span_id == "" and root.service == "tandem-gateway"
    spans = wait_for_spans(collector, root.trace_id, {"tandem.v1.Engine/Prefill"})
    assert {s.service for s in spans} == {"tandem-gateway", "tandem-replica"}


def test_an_http_clients_traceparent_passes_through_envoy(suite: Suite, collector) -> None:
    """Envoy's JSON transcoder forwards the HTTP request's headers as gRPC metadata: an
    OpenAI-style POST with a ``traceparent`` joins the caller's trace at the gateway."""
    collector, _ = collector
    port = free_port()
    envoy = spawn_module(suite.logs, "envoy", [
        "deploy.envoy_runner", "--http-port", str(port), "--upstream", suite.gateway])
    try:
        wait_until(lambda: envoy_answers(port), time.monotonic() + 60, "envoy", suite.logs)
        trace_id, span_id = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", method="POST",
            data=json.dumps({"model": "tiny", "prompt": prompt("http"),  # uncached: P/D
                             "max_tokens": 2}).encode(),
            headers={"content-type": "application/json",
                     "traceparent": f"00-{trace_id}-{span_id}-01"})
        with urllib.request.urlopen(request, timeout=120) as response:
            assert json.loads(response.read())["usage"]["completion_tokens"] == 2
        spans = wait_for_spans(collector, trace_id, {"tandem.v1.Generation/Complete",
                                                     "tandem.v1.Engine/Prefill"})
        gateway = only(spans, "tandem-gateway", "tandem.v1.Generation/Complete")
        assert gateway.parent_span_id == span_id
    finally:
        os.killpg(envoy.pid, signal.SIGTERM)
        envoy.wait(30)


def test_finished_request_statistics_are_read_once_and_bounded() -> None:
    finished = FinishedRequests(capacity=2)
    for rid in ("a", "b", "c"):
        finished.add(FinishedRequestStats("length", 3, 1, 0.5, request_id=rid))
    assert finished.pop("a") is None  # the oldest went first
    assert finished.pop("b").request_id == "b" and finished.pop("b") is None
    assert len(finished) == 1


def test_without_the_flag_nothing_is_traced() -> None:
    """The entry points install no tracer provider unless given an endpoint."""
    from services.observability.tracing import configure_tracing, tracing_enabled

    assert configure_tracing("tandem-test", None) is None
    assert not tracing_enabled()
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in os.environ
