"""Logs a person reads: one INFO line per request and the periodic throughput line.

A real replica and a gateway in front of it, both with ``--log-format json``: a request
through the gateway leaves exactly one request line on each (the gateway's names the replica
that served it; both carry the request's id, tokens, time to first token, total time and
finish reason), a refused request leaves one with its status, and every line of both logs is
a JSON object with timestamp, level, logger and message. The text format and the throughput
line (vLLM's ``LoggingStatLogger`` wording) are checked on their own parts.
"""

from __future__ import annotations

import io
import json
import logging
import re
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_common.metrics import EngineMetrics
from engine_common.outputs import SchedulerStats
from services.observability.log_format import configure_logging
from services.observability.request_record import RequestRecord
from services.observability.throughput_log import ThroughputLog
from tandem.client import Client
from tandem.errors import TandemError
from tests.replica_process import GatewayStack, free_port, replica_behind_gateway, wait_until

JSON_ARGS = ["--log-format", "json"]


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("json-logs")
    metrics_port = free_port()
    with replica_behind_gateway(tiny_llama_dir, logs, [
            "--dtype", "float32", "--kv-cache-memory", "16MiB", *JSON_ARGS],
            [*JSON_ARGS, "--metrics-port", str(metrics_port)]) as stack:
        stack.gateway_metrics_port = metrics_port  # type: ignore[attr-defined]
        yield stack, logs


def json_lines(path: Path) -> list[dict]:
    """Every line of a JSON log, parsed (a line that is not one JSON object fails)."""
    entries = []
    for line in path.read_text().splitlines():
        if not line.strip() or not line.startswith("{"):
            # Not ours: output of libraries that print (the engine core's start-up banner).
            assert "tandem.requests" not in line, line
            continue
        entry = json.loads(line)
        assert {"timestamp", "level", "logger", "message"} <= set(entry), entry
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", entry["timestamp"])
        entries.append(entry)
    return entries


def request_lines(path: Path, method: str) -> list[dict]:
    return [e for e in json_lines(path) if e["logger"] == "tandem.requests"
            and e["method"] == method]


def test_a_request_leaves_one_line_on_the_gateway_and_on_its_replica(stack) -> None:
    stack, logs = stack
    stack: GatewayStack
    with Client(stack.gateway, timeout=60) as client:
        answer = client.chat([{"role": "user", "content": "count to five"}], max_tokens=5,
                             temperature=0, ignore_eos=True)
    usage = answer.usage
    gateway_log, replica_log = logs / "gateway.log", logs / "a.log"
    wait_until(lambda: len(request_lines(replica_log, "tandem.v1.Engine/Generate")) == 1,
               time.monotonic() + 10, "the replica's request line", logs)
    [gateway_line] = request_lines(gateway_log, "tandem.v1.Generation/ChatComplete")
    [replica_line] = request_lines(replica_log, "tandem.v1.Engine/Generate")
    for line in (gateway_line, replica_line):
        assert line["level"] == "INFO" and line["status"] == "OK"
        assert line["prompt_tokens"] == usage.prompt_tokens
        assert line["output_tokens"] == usage.completion_tokens == 5
        assert line["finish_reason"] == "length"
        assert 0 < line["ttft_s"] <= line["total_s"] < 60
        # The text is in the message too (what the text format prints).
        assert f"request_id={line['request_id']}" in line["message"]
    # One request id end to end: the gateway's engine request is the replica's.
    assert gateway_line["request_id"] == replica_line["request_id"]
    assert gateway_line["request_id"].startswith("chatcmpl-")
    assert gateway_line["decode_replicas"] == [stack.replica.target]
    assert gateway_line["prefill_replicas"] == [] and gateway_line["kv_transfer"] is None
    assert gateway_line["total_s"] >= replica_line["total_s"]


def test_choices_and_refusals_are_one_line_each(stack) -> None:
    stack, logs = stack
    with Client(stack.gateway, timeout=60) as client:
        client.complete("two choices", max_tokens=3, n=2, seed=7)
        with pytest.raises(TandemError):
            client.complete("x" * 10, max_tokens=-1)
    wait_until(lambda: len(request_lines(logs / "gateway.log",
                                         "tandem.v1.Generation/Complete")) == 2,
               time.monotonic() + 10, "the gateway's request lines", logs)
    choices, refused = request_lines(logs / "gateway.log", "tandem.v1.Generation/Complete")
    assert choices["sequences"] == 2 and choices["output_tokens"] == 6
    assert choices["request_id"].startswith("cmpl-") and "," not in choices["request_id"]
    assert refused["status"] == grpc.StatusCode.INVALID_ARGUMENT.name
    assert refused["sequences"] == 0 and refused["ttft_s"] is None
    # vLLM's n, once per request where its choices fan out (here: the gateway), and only
    # for requests that ran: the chat (n=1) and the completion (n=2).
    url = f"http://127.0.0.1:{stack.gateway_metrics_port}/metrics"
    families = {f.name: f for f in text_string_to_metric_families(
        urllib.request.urlopen(url, timeout=10).read().decode())}
    samples = {s.name: s for s in families["vllm:request_params_n"].samples}
    assert samples["vllm:request_params_n_count"].value == 2
    assert samples["vllm:request_params_n_sum"].value == 3
    assert samples["vllm:request_params_n_count"].labels == {
        "model_name": "tiny", "engine": "gateway"}


def test_text_lines_carry_the_same_fields() -> None:
    record = RequestRecord("tandem.v1.Generation/CompleteStream", started=100.0)
    record.add_sequence("cmpl-1", [1, 2, 3])
    record.note_replica("10.0.0.1:50051", "decode")
    record.note_replica("10.0.0.2:50051", "prefill")
    record.note_kv_transfer("")
    record.observe("cmpl-1", 4, 3, "stop")
    fields = record.fields(now=101.5)
    assert record.message(fields) == (
        "request request_id=cmpl-1 method=tandem.v1.Generation/CompleteStream status=OK "
        "decode_replicas=10.0.0.1:50051 prefill_replicas=10.0.0.2:50051 kv_transfer=remote "
        f"sequences=1 prompt_tokens=3 output_tokens=4 ttft_s={fields['ttft_s']} "
        "total_s=1.5 finish_reason=stop")


def test_the_throughput_line_is_vllms(tiny_llama_dir: Path) -> None:
    """vLLM's wording and arithmetic: tokens over the interval, usage and hit rate as
    percentages; INFO while there is work, DEBUG once an interval passed idle."""
    metrics = EngineMetrics("tiny", "e0")
    now = [0.0]
    log = ThroughputLog(metrics, "e0", clock=lambda: now[0])
    metrics.prompt_tokens.inc(300)
    metrics.generation_tokens.inc(50)
    metrics.record_scheduler_stats(SchedulerStats(
        num_running_reqs=3, num_waiting_reqs=1, kv_cache_usage=0.25,
        prefix_cache_queries=200, prefix_cache_hits=50))
    stream = io.StringIO()
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    configure_logging("DEBUG", "json", stream)
    try:
        now[0] = 10.0
        log.log()
        now[0] = 20.0
        log.log()  # no new tokens, but the interval before had some: still INFO
        now[0] = 30.0
        log.log()  # idle for a whole interval: DEBUG
    finally:
        root.handlers[:], _ = saved[0], root.setLevel(saved[1])
    first, second, third = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["message"] == (
        "Engine e0: Avg prompt throughput: 30.0 tokens/s, Avg generation throughput: 5.0 "
        "tokens/s, Running: 3 reqs, Waiting: 1 reqs, GPU KV cache usage: 25.0%, "
        "Prefix cache hit rate: 25.0%")
    assert (first["level"], second["level"], third["level"]) == ("INFO", "INFO", "DEBUG")
    assert first["prompt_throughput"] == 30.0 and first["prefix_cache_hit_rate"] == 0.25
    assert second["generation_throughput"] == 0.0
