"""API keys at the Kubernetes-style edge: Envoy asking the endpoint picker
(``render_picker_bootstrap``, as ``tandem render k8s`` deploys it) checks gRPC calls of
``tandem.v1.Generation`` exactly as it checks OpenAI HTTP requests; and it reaches replicas
that require the suite's mutual TLS with the suite's certificate.

Real processes: one replica (role ``both``, ``--tls-dir``) on a tiny model, the endpoint picker
in front of it (``--tls-dir``), and ``deploy.envoy_runner --picker`` with an API key file and
``--upstream-tls-dir``. A real gRPC client and the openai SDK: without a key
UNAUTHENTICATED (grpc-status 16) / 401, with one (``Authorization: Bearer KEY`` in any case,
or ``x-api-key``) the replica's greedy text, equal to the offline engine's; health checks need
none. An Envoy without the certificate is refused by the replica (503).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy.local_ca import make_suite_certificates
from engine_common.sampling_params import SamplingParams
from protos.tandem.v1 import generation_pb2, generation_pb2_grpc
from tests.openai_http import http_status, offline_engine
from tests.replica_process import free_port, spawn_module, start_replicas, stop_all, wait_until

pytestmark = pytest.mark.timeout(600)

PROMPT = "alpha bravo charlie delta"
KEYS = ("key-alpha", "key-bravo")


@dataclass
class PickerEdge:
    http_port: int
    uncertified_port: int  # the same Envoy without the suite's certificate
    want: str  # the offline engine's greedy text for PROMPT, 6 tokens


@pytest.fixture(scope="module")
def edge(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PickerEdge]:
    logs = tmp_path_factory.mktemp("envoy-picker-keys")
    keys = logs / "api-keys"
    keys.write_text("\n".join(KEYS) + "\n")
    suite = str(make_suite_certificates(logs / "suite-tls"))
    replicas = start_replicas(tiny_llama_dir, logs, {"a": [
        "--role", "both", "--dtype", "float32", "--kv-cache-memory", "16MiB",
        "--served-model-name", "tiny", "--log-level", "WARNING", "--tls-dir", suite]})
    picker_port, http_port, uncertified_port = free_port(), free_port(), free_port()
    envoy = ["deploy.envoy_runner", "--picker", f"127.0.0.1:{picker_port}", "--api-key-file",
             str(keys), "--concurrency", "1"]
    processes = [
        spawn_module(logs, "picker", [
            "gateway.endpoint_picker_main", "--model", str(tiny_llama_dir), "--host",
            "127.0.0.1", "--port", str(picker_port), "--metrics-port", "0",
            "--replica", replicas["a"].target, "--tls-dir", suite]),
        spawn_module(logs, "envoy", [*envoy, "--http-port", str(http_port),
                                     "--upstream-tls-dir", suite]),
        spawn_module(logs, "envoy-uncertified", [*envoy, "--http-port", str(uncertified_port)]),
    ]
    try:
        # /health follows the picker's own health: SERVING once it sees a ready replica.
        wait_until(lambda: http_status(http_port, "/health") == 200, time.monotonic() + 240,
                   "envoy /health", logs)
        want = offline_engine(tiny_llama_dir).generate([PROMPT], SamplingParams(
            temperature=0.0, max_tokens=6, ignore_eos=True))[0].text
        yield PickerEdge(http_port, uncertified_port, want)
    finally:
        stop_all(processes, replicas)


def completion_request() -> generation_pb2.CompletionRequest:
    request = generation_pb2.CompletionRequest(model="tiny", max_tokens=6, temperature=0,
                                               ignore_eos=True)
    request.prompt.string_value = PROMPT
    return request


def test_grpc_calls_need_a_key_through_the_picker_edge(edge: PickerEdge) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{edge.http_port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for metadata in ((), (("authorization", "key-alpha"),),
                         (("authorization", "Bearer key-charlie"),), (("x-api-key", "nope"),)):
            with pytest.raises(grpc.RpcError) as refused:
                stub.Complete(completion_request(), metadata=metadata, timeout=60)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
            with pytest.raises(grpc.RpcError) as refused_stream:
                list(stub.CompleteStream(completion_request(), metadata=metadata, timeout=60))
            assert refused_stream.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for metadata in ((("authorization", "Bearer key-alpha"),),
                         (("authorization", "bearer key-bravo"),), (("x-api-key", "key-alpha"),)):
            reply = stub.Complete(completion_request(), metadata=metadata, timeout=60)
            assert reply.choices[0].text == edge.want, metadata
        pieces = stub.CompleteStream(completion_request(), metadata=(("x-api-key", "key-bravo"),),
                                     timeout=60)
        assert "".join(p.choices[0].text for p in pieces if p.choices) == edge.want
        # Probes carry no key.
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                           timeout=30)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_http_requests_need_a_key_through_the_picker_edge(edge: PickerEdge) -> None:
    base_url = f"http://127.0.0.1:{edge.http_port}/v1"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base_url, api_key="key-charlie", max_retries=0).completions \
            .create(model="tiny", prompt=PROMPT, max_tokens=6)
    client = openai.OpenAI(base_url=base_url, api_key="key-bravo", max_retries=0, timeout=120)
    completion = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert completion.choices[0].text == edge.want
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                       "ignore_eos": True}).encode()
    for authorization, status in (("key-alpha", 401), ("BEARER key-alpha", 200)):
        request = urllib.request.Request(f"{base_url}/completions", data=body, headers={
            "content-type": "application/json", "authorization": authorization})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                assert (response.status, status) == (200, 200)
                assert json.loads(response.read())["choices"][0]["text"] == edge.want
        except urllib.error.HTTPError as error:
            assert (error.code, status) == (401, 401), authorization
    assert http_status(edge.http_port, "/health") == 200


def test_replicas_with_mutual_tls_take_only_a_certified_envoy(edge: PickerEdge) -> None:
    """The same request from the Envoy without the suite's certificate: the replica refuses
    its handshake (503), where the certified one is served (the tests above)."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{edge.uncertified_port}/v1",
                           api_key="key-alpha", max_retries=0, timeout=60)
    with pytest.raises(openai.InternalServerError) as raised:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6)
    assert raised.value.status_code == 503
