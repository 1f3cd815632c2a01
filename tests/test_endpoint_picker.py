"""The ext_proc endpoint picker: its protocol, and Envoy routing to the replica it picks.

Pure parts first (reading bodies, saturation, answer shapes), then a picker with no live
replica (503s), then the real thing: two ``both`` replicas on a tiny model, the picker as a
process, and the real Envoy (``deploy.envoy_runner --picker``) in both body modes, whose
``ORIGINAL_DST`` cluster must connect to the replica the picker named.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from engine_common.input_processor import InputProcessor
from gateway.endpoint_picker import (
    DESTINATION_HEADER,
    LB_NAMESPACE,
    PREFILL_PEER_HEADER,
    Choice,
    SheddingPolicy,
    is_saturated,
    read_request,
    refusal,
    routing_metadata,
    routing_mutation,
)
from gateway.endpoint_picker_main import EndpointPickerServer, PickerOptions
from gateway.load import LoadView
from gateway.picker import ReplicaState, pick
from gateway.server import load_inputs
from protos.tandem.v1 import generation_pb2 as pb
from protos.third_party import generate as third_party
from protos.third_party.envoy.config.core.v3 import base_pb2
from protos.third_party.envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from protos.third_party.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from protos.third_party.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from services.frontend.validation import MAX_MESSAGE_BYTES
from tandem.client import Client
from tests.reflection_client import VERSIONS, defines_service, reflect
from tests.replica_process import ReplicaProcess, free_port, start_replicas, stop_all

REPO = Path(__file__).resolve().parents[1]
SERVED_HEADER = "x-gateway-destination-endpoint-served"
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima".split()

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def inputs(tiny_llama_dir: Path) -> InputProcessor:
    return load_inputs(str(tiny_llama_dir))


def grpc_frame(message: Message) -> bytes:
    payload = message.SerializeToString()
    return b"\x00" + len(payload).to_bytes(4, "big") + payload


# --------------------------------------------------------------------------- pure parts


def test_vendored_ext_proc_code_is_fresh() -> None:
    assert third_party.stale_files() == [], "run python -m protos.third_party.generate"


def test_bodies_are_tokenized_as_the_replicas_tokenize(inputs: InputProcessor) -> None:
    prompt = "alpha bravo charlie delta echo"
    body = json.dumps({"model": "tiny", "prompt": prompt, "stream": True, "cache_salt": "t1",
                       "priority": 3, "unknown_field": 1}).encode()
    for path in ("/v1/completions", "/v1/completions:stream"):
        features = read_request(path, "application/json", body, inputs)
        assert features is not None
        assert features.prompt_token_ids == inputs.tokenize(prompt)
        assert (features.cache_salt, features.priority) == ("t1", 3)
    messages = [{"role": "user", "content": "hotel india"}]
    chat = json.dumps({"messages": messages}).encode()
    features = read_request("/v1/chat/completions", "application/json", chat, inputs)
    assert features is not None and features.prompt_token_ids == inputs.tokenize_chat(messages)
    # gRPC clients of the same port: the body is one length-prefixed protobuf message.
    request = pb.CompletionRequest()
    request.prompt.string_value = prompt
    features = read_request("/tandem.v1.Generation/CompleteStream", "application/grpc",
                            grpc_frame(request), inputs)
    assert features is not None and features.prompt_token_ids == inputs.tokenize(prompt)


def test_a_lora_adapters_requests_are_read_under_its_name(inputs: InputProcessor) -> None:
    """The picker hashes an adapter's prompt as the replicas do: under the adapter, which
    the request names as its model; the base model's name and unknown names are no
    adapter."""
    adapters = frozenset({"sql"})
    for model, want in (("sql", "sql"), ("tiny", ""), ("other", "")):
        completion = json.dumps({"model": model, "prompt": "alpha"}).encode()
        chat = json.dumps({"model": model,
                           "messages": [{"role": "user", "content": "a"}]}).encode()
        response = json.dumps({"model": model, "input": "alpha"}).encode()
        for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat),
                           ("/v1/responses", response)):
            features = read_request(path, "application/json", body, inputs, adapters)
            assert features is not None and features.lora_name == want, (path, model)


def test_a_stored_responses_requests_name_its_replica(inputs: InputProcessor) -> None:
    """GET / DELETE /v1/responses/{id}, its input_items and cancel, a background one's
    events again (Lua's :stream path) (with or without a query), and their gRPC methods,
    are read for the engine id in the id."""
    response_id = f"resp_{'0' * 32}_replica-a.1"
    for path in (f"/v1/responses/{response_id}", f"/v1/responses/{response_id}?include[]=x",
                 f"/v1/responses/{response_id}/input_items",
                 f"/v1/responses/{response_id}/input_items?after=msg_1&limit=2&order=asc",
                 f"/v1/responses/{response_id}/cancel",
                 f"/v1/responses/{response_id}:stream?stream=true&starting_after=3"):
        features = read_request(path, "", b"", inputs)
        assert features is not None and features.responder == "replica-a.1", path
    listing = pb.ListResponseInputItemsRequest(response_id=response_id, after="msg_1", limit=2)
    for method, message in (("GetResponse", pb.GetResponseRequest(response_id=response_id)),
                            ("DeleteResponse", pb.DeleteResponseRequest(
                                response_id=response_id)),
                            ("ListResponseInputItems", listing),
                            ("GetResponseStream", pb.GetResponseRequest(
                                response_id=response_id, stream=True, starting_after=3)),
                            ("CancelResponse", pb.CancelResponseRequest(
                                response_id=response_id))):
        features = read_request(f"/tandem.v1.Generation/{method}", "application/grpc",
                                grpc_frame(message), inputs)
        assert features is not None and features.responder == "replica-a.1", method
    # An id without an engine id (a gateway's) is routed by load alone.
    features = read_request(f"/v1/responses/resp_{'0' * 32}/input_items", "", b"", inputs)
    assert features is not None and features.responder == ""


def test_unreadable_bodies_are_routed_by_load_alone(inputs: InputProcessor) -> None:
    for path, body in (("/v1/completions", b'{"prompt": '),          # bad JSON
                       ("/v1/completions", b'{"prompt": ""}'),       # the replica refuses it
                       ("/v1/completions", b'{"prompt": "hi", "temperature": -1}'),
                       ("/v1/models", b""),                          # no prompt on this path
                       ("/tandem.v1.Generation/Complete", b"\x01\x00\x00\x00\x01x")):
        content_type = "application/grpc" if path.startswith("/tandem") else "application/json"
        assert read_request(path, content_type, body, inputs) is None, (path, body)


def test_saturation_needs_every_candidate_over_a_threshold() -> None:
    policy = SheddingPolicy(queue_depth_threshold=5, kv_cache_threshold=0.8)
    busy = ReplicaState("10.0.0.1:1", "both", True, LoadView(num_waiting=6))
    full = ReplicaState("10.0.0.2:1", "both", True, LoadView(kv_cache_usage=0.9))
    idle = ReplicaState("10.0.0.3:1", "decode", True, LoadView(num_waiting=1))
    waiting = {r.address: r.load.num_waiting for r in (busy, full, idle)}
    assert is_saturated(pick([busy, full], 10, 16), waiting, policy)
    assert not is_saturated(pick([busy, full, idle], 10, 16), waiting, policy)


def test_answers_follow_the_endpoint_picker_protocol() -> None:
    aggregated = routing_mutation(Choice(200, "10.0.0.5:50051"))
    assert [(h.header.key, h.header.raw_value) for h in aggregated.set_headers] == [
        (DESTINATION_HEADER, b"10.0.0.5:50051")]
    assert list(aggregated.remove_headers) == [PREFILL_PEER_HEADER]  # a client's copy goes
    disaggregated = routing_mutation(Choice(200, "10.0.0.5:50051", "10.0.0.9:50051"))
    assert (disaggregated.set_headers[1].header.key, disaggregated.set_headers[1].header.raw_value
            ) == (PREFILL_PEER_HEADER, b"10.0.0.9:50051")
    assert all(h.append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
               for h in disaggregated.set_headers)
    metadata = routing_metadata(Choice(200, "10.0.0.5:50051"))
    assert dict(metadata.fields[LB_NAMESPACE].struct_value) == {
        DESTINATION_HEADER: "10.0.0.5:50051"}
    http = refusal(Choice(429, message="busy"), grpc_request=False).immediate_response
    assert http.status.code == 429 and not http.HasField("grpc_status")
    assert json.loads(http.body)["error"] == {
        "message": "busy", "type": "rate_limit_error", "param": None,
        "code": "resource_exhausted"}
    grpc_reply = refusal(Choice(503, message="none"), grpc_request=True).immediate_response
    assert grpc_reply.grpc_status.status == grpc.StatusCode.UNAVAILABLE.value[0]


# --------------------------------------------------------------------------- no live replica


@dataclass
class InProcessPicker:
    port: int
    loop: asyncio.AbstractEventLoop
    server: EndpointPickerServer


@pytest.fixture(scope="module")
def dead_picker(tiny_llama_dir: Path) -> Iterator[InProcessPicker]:
    """A picker whose only replica address has nothing listening, in a thread of this process."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    options = PickerOptions(model=str(tiny_llama_dir), replicas=[f"127.0.0.1:{free_port()}"],
                            host="127.0.0.1", port=0)
    server = asyncio.run_coroutine_threadsafe(
        EndpointPickerServer.start(options), loop).result(60)
    yield InProcessPicker(server.port, loop, server)
    asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def headers_message(path: str, content_type: str = "application/json", *,
                    end_of_stream: bool = False) -> ep.ProcessingRequest:
    headers = base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":path", raw_value=path.encode()),
        base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
        base_pb2.HeaderValue(key="content-type", raw_value=content_type.encode())])
    return ep.ProcessingRequest(request_headers=ep.HttpHeaders(
        headers=headers, end_of_stream=end_of_stream))


def exchange(port: int, messages: list[ep.ProcessingRequest]) -> list[ep.ProcessingResponse]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = ep_grpc.ExternalProcessorStub(channel)
        return list(stub.Process(iter(messages), timeout=20))


@pytest.mark.parametrize("version", VERSIONS)
def test_reflection_v1_and_v1alpha(dead_picker: InProcessPicker, version: str) -> None:
    ext_proc = "envoy.service.ext_proc.v3.ExternalProcessor"
    with grpc.insecure_channel(f"127.0.0.1:{dead_picker.port}") as channel:
        answer = reflect(channel, version, [ext_proc])
    assert {ext_proc, "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"} <= set(answer.services)
    assert defines_service(answer.files[ext_proc][0], ext_proc)


def test_no_eligible_replica_is_an_immediate_503(dead_picker: InProcessPicker) -> None:
    body = json.dumps({"prompt": "alpha bravo"}).encode()
    replies = exchange(dead_picker.port, [
        headers_message("/v1/completions"),
        ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True))])
    # BUFFERED: the headers are let through at once, the body is answered with the refusal.
    assert replies[0].WhichOneof("response") == "request_headers"
    refused = replies[1].immediate_response
    assert refused.status.code == 503
    error = json.loads(refused.body)["error"]
    assert error["type"] == "server_error" and "no decode-capable replica" in error["message"]
    grpc_replies = exchange(dead_picker.port, [
        headers_message("/tandem.v1.Generation/ListModels", "application/grpc",
                        end_of_stream=True)])
    assert grpc_replies[0].immediate_response.grpc_status.status == 14  # UNAVAILABLE
    with grpc.insecure_channel(f"127.0.0.1:{dead_picker.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        status = {s: health.Check(health_pb2.HealthCheckRequest(service=s)).status
                  for s in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")}
    serving, not_serving = (health_pb2.HealthCheckResponse.SERVING,
                            health_pb2.HealthCheckResponse.NOT_SERVING)
    assert status == {"liveness": serving, "readiness": not_serving,
                      "envoy.service.ext_proc.v3.ExternalProcessor": not_serving}


def _raw_process(port: int, payloads: list[bytes]) -> grpc.RpcError:
    """Sends ``payloads`` as the messages of one Process stream, unserialized; the error."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        process = channel.stream_stream(
            "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
            request_serializer=lambda raw: raw, response_deserializer=lambda raw: raw)
        with pytest.raises(grpc.RpcError) as caught:
            list(process(iter(payloads), timeout=20))
    return caught.value


def test_garbage_and_oversized_messages_are_refused_and_the_picker_stays_healthy(
        dead_picker: InProcessPicker, caplog: pytest.LogCaptureFixture) -> None:
    """The picker's server is built as every Tandem server (``grpc_server.new_server``): bytes
    that are not a ProcessingRequest are INVALID_ARGUMENT naming the message (not UNKNOWN
    with a traceback), a message over the size limit RESOURCE_EXHAUSTED, a client's status
    both; the picker answers the next request as before."""
    valid = headers_message("/v1/completions").SerializeToString()
    for payloads in ([b"\xff\xff\xff\xff garbage"], [valid, b"\x0a\x05\x0a"]):
        error = _raw_process(dead_picker.port, payloads)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        assert "envoy.service.ext_proc.v3.ProcessingRequest" in (error.details() or "")
    error = _raw_process(dead_picker.port, [b"\x0a" + b"\x00" * (MAX_MESSAGE_BYTES + 16)])
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
    assert "Traceback" not in caplog.text
    body = json.dumps({"prompt": "alpha bravo"}).encode()
    replies = exchange(dead_picker.port, [
        headers_message("/v1/completions"),
        ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True))])
    assert replies[1].immediate_response.status.code == 503  # routed as ever: no replica
    with grpc.insecure_channel(f"127.0.0.1:{dead_picker.port}") as channel:
        liveness = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="liveness"), timeout=5)
    assert liveness.status == health_pb2.HealthCheckResponse.SERVING


# --------------------------------------------------------------------------- real replicas


def wait_http(port: int, deadline: float, log: Path) -> None:
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/nowhere", timeout=1)
        except urllib.error.HTTPError:
            return
        except OSError:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)


def is_serving(target: str) -> bool:
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="readiness"), timeout=1)
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


@dataclass
class PickerCluster:
    replicas: dict[str, ReplicaProcess]
    picker_port: int
    picker_metrics_port: int
    envoy_ports: dict[str, int]  # body mode, or "dead", -> HTTP port

    def routing_decisions(self, reason: str) -> float:
        url = f"http://127.0.0.1:{self.picker_metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        return sum(sample.value for family in text_string_to_metric_families(text)
                   for sample in family.samples
                   if sample.name == "tandem:gateway_routing_decisions_total"
                   and sample.labels.get("reason") == reason)


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory,
            dead_picker: InProcessPicker) -> Iterator[PickerCluster]:
    logs = tmp_path_factory.mktemp("picker-logs")
    replica_args = ["--role", "both", "--dtype", "float32", "--kv-cache-memory", "16MiB",
                    "--served-model-name", "tiny", "--log-level", "WARNING"]
    picker_port, metrics_port = free_port(), free_port()
    processes: list[subprocess.Popen[bytes]] = []

    def spawn(name: str, argv: list[str]) -> None:
        with open(logs / f"{name}.log", "wb") as log:
            processes.append(subprocess.Popen(
                [sys.executable, *argv], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True))

    replicas = start_replicas(tiny_llama_dir, logs, {"a": replica_args, "b": replica_args})
    try:
        spawn("picker", ["-m", "gateway.endpoint_picker_main", "--model", str(tiny_llama_dir),
                         "--host", "127.0.0.1", "--port", str(picker_port),
                         "--metrics-port", str(metrics_port),
                         *[a for r in replicas.values() for a in ("--replica", r.target)]])
        envoy_ports = {"BUFFERED": free_port(), "FULL_DUPLEX_STREAMED": free_port(),
                       "dead": free_port()}
        for mode, port in envoy_ports.items():
            target = dead_picker.port if mode == "dead" else picker_port
            spawn(f"envoy-{mode}", [
                "-m", "deploy.envoy_runner", "--http-port", str(port), "--concurrency", "1",
                "--picker", f"127.0.0.1:{target}",
                "--picker-body-mode", "BUFFERED" if mode == "dead" else mode])
        deadline = time.monotonic() + 120
        for mode, port in envoy_ports.items():
            wait_http(port, deadline, logs / f"envoy-{mode}.log")
        while not is_serving(f"127.0.0.1:{picker_port}"):
            assert time.monotonic() < deadline, (logs / "picker.log").read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(1.0)  # both replicas registered, their first load reports in
        yield PickerCluster(replicas, picker_port, metrics_port, envoy_ports)
    finally:
        stop_all(processes, replicas)


def test_full_duplex_conversation_by_hand(cluster: PickerCluster) -> None:
    body = json.dumps({"model": "tiny", "prompt": "alpha bravo charlie", "max_tokens": 2})
    half = len(body) // 2
    duplex = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
    first = headers_message("/v1/completions")
    first.protocol_config.request_body_mode = duplex
    first.protocol_config.response_body_mode = duplex
    replies = exchange(cluster.picker_port, [
        first,
        ep.ProcessingRequest(request_body=ep.HttpBody(body=body[:half].encode())),
        ep.ProcessingRequest(request_body=ep.HttpBody(body=body[half:].encode(),
                                                      end_of_stream=True)),
        ep.ProcessingRequest(response_headers=ep.HttpHeaders()),
        ep.ProcessingRequest(response_body=ep.HttpBody(body=b"data: x\n\n", end_of_stream=True)),
    ])
    kinds = [r.WhichOneof("response") for r in replies]
    # The headers answer waits for the whole body, then the body goes back unchanged.
    assert kinds == ["request_headers", "request_body", "response_headers", "response_body"]
    mutation = replies[0].request_headers.response.header_mutation
    destination = mutation.set_headers[0].header.raw_value.decode()
    assert destination in {r.target for r in cluster.replicas.values()}
    lb = replies[0].dynamic_metadata.fields[LB_NAMESPACE].struct_value
    assert lb.fields[DESTINATION_HEADER].string_value == destination
    streamed = replies[1].request_body.response.body_mutation.streamed_response
    assert (streamed.body.decode(), streamed.end_of_stream) == (body, True)
    echoed = replies[3].response_body.response.body_mutation.streamed_response
    assert (echoed.body, echoed.end_of_stream) == (b"data: x\n\n", True)


def openai_client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                         max_retries=0, timeout=60)


def test_requests_reach_the_replica_that_holds_their_prefix(cluster: PickerCluster) -> None:
    prefixes = {name: " ".join(WORDS[i % len(WORDS)] for i in range(k, k + 60))
                for k, name in enumerate(cluster.replicas)}
    for name, prefix in prefixes.items():  # each replica caches its own prefix, directly
        with Client(cluster.replicas[name].target, timeout=60) as client:
            client.complete(prefix, max_tokens=1, temperature=0.0)
    time.sleep(1.0)  # KV events reach the picker's prefix index
    before = cluster.routing_decisions("prefix")
    for mode in ("BUFFERED", "FULL_DUPLEX_STREAMED"):
        client = openai_client(cluster.envoy_ports[mode])
        for name, prefix in prefixes.items():
            raw = client.completions.with_raw_response.create(
                model="tiny", prompt=prefix + " mike november", max_tokens=2, temperature=0)
            assert raw.headers[SERVED_HEADER] == cluster.replicas[name].target, (mode, name)
            assert raw.parse().choices[0].finish_reason == "length"
            stream = client.chat.completions.with_raw_response.create(
                model="tiny", messages=[{"role": "user", "content": prefix}], max_tokens=3,
                stream=True, temperature=0)
            assert stream.headers["content-type"] == "text/event-stream"
            assert len([c for c in stream.parse() if c.choices]) >= 1
    assert cluster.routing_decisions("prefix") - before >= 4


def test_grpc_clients_and_bodyless_requests_are_routed_too(cluster: PickerCluster) -> None:
    port = cluster.envoy_ports["BUFFERED"]
    with Client(f"127.0.0.1:{port}", timeout=60) as client:
        chunks = list(client.complete_stream("alpha bravo", max_tokens=3, temperature=0.0))
        assert "".join(c.text for c in chunks) and chunks[-1].usage is not None
        assert [m.id for m in client.models()] == ["tiny"]
    models = openai_client(port).models.with_raw_response.list()
    assert models.headers[SERVED_HEADER] in {r.target for r in cluster.replicas.values()}


def test_picker_refusal_reaches_http_clients_as_an_openai_503(cluster: PickerCluster) -> None:
    client = openai_client(cluster.envoy_ports["dead"])
    with pytest.raises(openai.InternalServerError) as raised:
        client.completions.create(model="tiny", prompt="alpha", max_tokens=2)
    assert raised.value.status_code == 503
    assert raised.value.body == {"message": raised.value.body["message"],  # type: ignore[index]
                                 "type": "server_error", "param": None, "code": "unavailable"}
    assert "no decode-capable replica" in str(raised.value.message)


def test_a_stored_response_is_read_and_continued_where_it_is_stored(
        cluster: PickerCluster) -> None:
    """Each replica keeps the responses it answered; a response's id names its replica, so
    continuations (previous_response_id), GET /v1/responses/{id} and its input_items reach
    that one, over HTTP in both body modes and from gRPC clients."""
    targets = {name: r.target for name, r in cluster.replicas.items()}
    for mode in ("BUFFERED", "FULL_DUPLEX_STREAMED"):
        client = openai_client(cluster.envoy_ports[mode])
        raw = client.responses.with_raw_response.create(model="tiny", input="alpha bravo",
                                                        max_output_tokens=2, temperature=0)
        first = raw.parse()
        holder = raw.headers[SERVED_HEADER]
        name = first.id.rsplit("_", 1)[1]  # the replica's engine id ("a" or "b")
        assert targets[name] == holder
        previous = first.id
        for turn in range(4):  # by load alone, some would go to the other replica
            raw = client.responses.with_raw_response.create(
                model="tiny", input=f"and then {turn}", previous_response_id=previous,
                max_output_tokens=2, temperature=0)
            assert raw.headers[SERVED_HEADER] == holder, (mode, turn)
            previous = raw.parse().id
        retrieved = client.responses.with_raw_response.retrieve(first.id)
        assert retrieved.headers[SERVED_HEADER] == holder
        assert retrieved.parse().output_text == first.output_text
        for _ in range(4):  # the path's query and its /input_items suffix hide no id
            listed = client.responses.input_items.with_raw_response.list(
                previous, limit=2, order="asc")
            assert listed.headers[SERVED_HEADER] == holder, mode
        # The chain's items, oldest first: each turn's input, then its output; the latest
        # input last.
        items = [item.model_dump() for item in client.responses.input_items.list(
            previous, limit=3, order="asc")]  # by the SDK's auto-pagination
        assert len(items) == 2 * 5 - 1 and items[0]["content"][0]["text"] == "alpha bravo"
        assert items[-1]["content"][0]["text"] == "and then 3"
        client.responses.delete(previous)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(previous)
    with Client(f"127.0.0.1:{cluster.envoy_ports['BUFFERED']}", timeout=60) as sdk:
        assert sdk.get_response(first.id).output_text == first.output_text
        page = sdk.list_response_input_items(first.id)
        assert [item["content"] for item in page.items] == [
            [{"type": "input_text", "text": "alpha bravo"}]]
        continued = sdk.respond("and so on", model="tiny", previous_response_id=first.id,
                                max_output_tokens=2, temperature=0)
        assert continued.id.endswith(f"_{name}")
