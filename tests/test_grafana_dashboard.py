"""The Grafana dashboard cannot drift from the metrics: every metric its PromQL reads is one
that a running replica or gateway exports, with a suffix its type has (``_total`` on a
counter, ``_bucket`` on a histogram). Also: the checked-in JSON is what
``deploy.grafana.dashboard`` renders, and it has the panels the suite needs.
"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deploy.grafana import dashboard
from tandem.client import Client
from tests.replica_process import free_port, replica_behind_gateway

METRIC = re.compile(r"\b((?:vllm|tandem):[A-Za-z0-9_:]+|(?:process|python)_[a-z_]+)")
SUFFIXES = {"_bucket": "histogram", "_sum": "histogram", "_count": "histogram",
            "_total": "counter"}


def queries() -> list[str]:
    model = json.loads(dashboard.DASHBOARD_PATH.read_text())
    return [target["expr"] for panel in model["panels"] for target in panel.get("targets", ())]


def referenced_metrics() -> set[str]:
    return {name for expr in queries() for name in METRIC.findall(expr)}


def test_the_checked_in_dashboard_is_the_rendered_one() -> None:
    assert dashboard.main(["--check"]) == 0, "run: python -m deploy.grafana.dashboard"


def test_the_dashboard_has_the_suites_panels() -> None:
    model = json.loads(dashboard.DASHBOARD_PATH.read_text())
    ids = [panel["id"] for panel in model["panels"]]
    assert len(ids) == len(set(ids))
    for panel in model["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
    names = referenced_metrics()
    for needed in ("tandem:gateway_replicas", "tandem:gateway_routing_decisions_total",
                   "tandem:gateway_picks_total", "tandem:gateway_prefill_outcomes_total",
                   "vllm:time_to_first_token_seconds_bucket",
                   "vllm:inter_token_latency_seconds_bucket",
                   "vllm:e2e_request_latency_seconds_bucket", "vllm:num_requests_waiting",
                   "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits_total",
                   "tandem:kv_transfer_bytes_total", "tandem:kv_transfer_seconds_bucket",
                   "tandem:kv_transfer_fallbacks_total"):
        assert needed in names, needed


def scrape(url: str) -> dict[str, str]:
    """Metric family name -> type, as a /metrics page declares them."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {family.name: family.type for family in text_string_to_metric_families(text)}


def family_of(name: str, families: dict[str, str]) -> tuple[str, str] | None:
    if name in families:
        return name, families[name]
    for suffix, kind in SUFFIXES.items():
        base = name.removesuffix(suffix)
        if base != name and families.get(base) == kind:
            return base, kind
    return None


@pytest.fixture(scope="module")
def exported(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    gateway_metrics = free_port()
    with replica_behind_gateway(
            tiny_llama_dir, tmp_path_factory.mktemp("dashboard-logs"),
            ["--dtype", "float32", "--kv-cache-memory", "16MiB", "--log-level", "WARNING"],
            ["--metrics-port", str(gateway_metrics), "--log-level", "WARNING"]) as stack:
        with Client(stack.gateway, timeout=60) as client:
            client.complete("fill the histograms", max_tokens=3)
        replica = scrape(stack.replica.metrics_url)
        gateway = scrape(f"http://127.0.0.1:{gateway_metrics}/metrics")
    assert "tandem:gateway_replicas" in gateway and "vllm:num_requests_running" in replica
    return {**replica, **gateway}


def test_every_queried_metric_is_exported(exported: dict[str, str]) -> None:
    missing = sorted(name for name in referenced_metrics() if family_of(name, exported) is None)
    assert not missing, f"the dashboard queries metrics nothing exports: {missing}"


def test_the_check_catches_a_misspelt_metric(exported: dict[str, str]) -> None:
    assert family_of("vllm:time_to_first_token_seconds_bucket", exported) is not None
    assert family_of("vllm:time_to_first_token_second_bucket", exported) is None
    assert family_of("vllm:kv_cache_usage_perc_total", exported) is None  # a gauge
    assert family_of("tandem:gateway_picks_bucket", exported) is None  # a counter
