"""``tandem render envoy`` (``deploy.render``): the bootstrap it writes, checked by the YAML
parser's events and by the real Envoy binary (``envoy --mode validate``).

The rendered routes and filters themselves are ``test_envoy_config``'s; here: what the
command line writes (no YAML anchors or aliases) and that it takes the flags
``deploy.envoy_runner`` takes, with the same effect.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.envoy_runner import build_parser as runner_parser
from deploy.envoy_runner import find_envoy
from deploy.local_ca import make_suite_certificates
from deploy.render import build_parser as render_parser
from deploy.render import main as render_main

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(120)


def _yaml_anchors(text: str) -> list[str]:
    """Anchors and aliases in a YAML text, from the parser's events."""
    return [f"{type(event).__name__} {event.anchor}" for event in yaml.parse(text)
            if getattr(event, "anchor", None) is not None]


def _envoy_validates(path: Path) -> None:
    result = subprocess.run(
        [str(find_envoy()), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def _render(tmp_path: Path, name: str, *args: str) -> tuple[str, dict[str, Any]]:
    out = tmp_path / f"{name}.yaml"
    assert render_main(["envoy", *args, "-o", str(out)]) == 0
    text = out.read_text()
    return text, yaml.safe_load(text)


@pytest.fixture(scope="module")
def suite_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_suite_certificates(tmp_path_factory.mktemp("suite"))


def test_the_written_bootstrap_holds_no_yaml_anchors(tmp_path: Path, suite_dir: Path) -> None:
    """The HTTPS listener shares the HTTP one's routes and filters (the same dicts): a plain
    PyYAML dump writes them once with ``&id001`` and again as ``*id001``."""
    keys = tmp_path / "keys"
    keys.write_text("key-one\n")
    tls = ["--tls-cert", str(suite_dir / "tls.crt"), "--tls-key", str(suite_dir / "tls.key"),
           "--api-key-file", str(keys)]
    for name, target in (("gateway", ["--upstream", "127.0.0.1:50051"]),
                         ("picker", ["--picker", "127.0.0.1:9002"])):
        text, config = _render(tmp_path, name, *target, *tls)
        assert _yaml_anchors(text) == [], name
        assert len(config["static_resources"]["listeners"]) == 2  # HTTP and HTTPS: shared dicts
        _envoy_validates(tmp_path / f"{name}.yaml")
    assert _yaml_anchors("a: &x {b: 1}\nc: *x\n") == ["MappingStartEvent x", "AliasEvent x"]


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


def test_render_takes_every_bootstrap_flag_the_runner_takes() -> None:
    """Only running Envoy is the runner's own (threads, log level, printing); every flag that
    shapes the bootstrap is one definition shared by both (``deploy.envoy_args``)."""
    envoy_parser = next(action for action in render_parser()._actions
                        if isinstance(action, argparse._SubParsersAction)).choices["envoy"]
    missing = _option_strings(runner_parser()) - _option_strings(envoy_parser)
    assert missing == {"--concurrency", "--log-level", "--print-config"}


def _routes(config: dict[str, Any]) -> list[dict[str, Any]]:
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    return list(manager["typed_config"]["route_config"]["virtual_hosts"][0]["routes"])


def test_metrics_and_upstream_tls_flags_reach_the_bootstrap(tmp_path: Path,
                                                            suite_dir: Path) -> None:
    """--upstream-metrics routes GET /metrics to that endpoint; --upstream-tls-dir puts the
    suite's certificate on the cluster of the replicas Envoy calls; --upstream-retries is the
    upstream route's retry count. The same flags give the runner's bootstrap, byte for byte."""
    suite = str(suite_dir.resolve())
    for name, target, replicas in (("gateway", ["--upstream", "127.0.0.1:50051"], "tandem_upstream"),
                                   ("picker", ["--picker", "127.0.0.1:9002"], "picked_replica")):
        flags = [*target, "--http-port", "8081", "--upstream-metrics", "10.0.0.7:9090",
                 "--upstream-tls-dir", suite, "--upstream-retries", "3"]
        text, config = _render(tmp_path, name, *flags)
        _envoy_validates(tmp_path / f"{name}.yaml")  # validate mode loads the TLS files
        clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
        metrics = clusters["tandem_metrics"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
        assert metrics["endpoint"]["address"]["socket_address"] == {"address": "10.0.0.7",
                                                                   "port_value": 9090}
        assert any(r["match"].get("path") == "/metrics"
                   and r.get("route", {}).get("cluster") == "tandem_metrics"
                   for r in _routes(config))
        context = clusters[replicas]["transport_socket"]["typed_config"]["common_tls_context"]
        assert context["tls_certificates"][0]["certificate_chain"]["filename"] == \
            f"{suite}/tls.crt"
        retried = [r["route"]["retry_policy"]["num_retries"] for r in _routes(config)
                   if "retry_policy" in r.get("route", {})]
        if name == "picker":  # a retry would go to the same picked replica
            assert retried == []
        else:
            assert retried and set(retried) == {3}
        printed = subprocess.run(
            [sys.executable, "-m", "deploy.envoy_runner", *flags, "--listen-host", "0.0.0.0",
             "--admin-port", "9901", "--print-config"],
            cwd=REPO, capture_output=True, text=True, timeout=60)
        assert printed.returncode == 0, printed.stderr
        assert printed.stdout == text


def test_a_rendered_upstream_tls_dir_is_named_as_given(tmp_path: Path) -> None:
    """The directory is where the machine running Envoy mounts it (a pod's Secret): the
    render neither reads it nor rewrites the path; the runner, which runs Envoy here, checks
    the files first."""
    _text, config = _render(tmp_path, "pod", "--picker", "epp:9002",
                            "--upstream-tls-dir", "/etc/tandem/suite-tls")
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    context = clusters["picked_replica"]["transport_socket"]["typed_config"]["common_tls_context"]
    assert context["validation_context"]["trusted_ca"]["filename"] == \
        "/etc/tandem/suite-tls/ca.crt"
    result = subprocess.run(
        [sys.executable, "-m", "deploy.envoy_runner", "--http-port", "8081", "--picker",
         "epp:9002", "--upstream-tls-dir", str(tmp_path / "absent"), "--print-config"],
        cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "lacks" in result.stderr
