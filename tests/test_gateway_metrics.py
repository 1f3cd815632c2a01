"""The gateway's replica gauge as a scrape sees it while the gateway refreshes it (every
0.25 s, on the event loop) from another thread: never a transient count."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import GatewayMetrics


@pytest.fixture
def fast_thread_switches() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads interleave inside set_replicas, as a scrape may
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def healthy(metrics: GatewayMetrics) -> float:
    text = generate_latest(metrics.registry).decode()
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples
               if sample.name == "tandem:gateway_replicas"
               and sample.labels.get("healthy") == "true")


def test_a_scrape_never_sees_replicas_missing_while_the_gauge_is_refreshed(
        fast_thread_switches: None) -> None:
    metrics = GatewayMetrics()
    replicas = [SimpleNamespace(role=role, healthy=True)
                for role in ("prefill", "prefill", "decode", "decode", "decode")]
    metrics.set_replicas(replicas)  # type: ignore[arg-type]
    stop = threading.Event()

    def refresh() -> None:
        while not stop.is_set():
            metrics.set_replicas(replicas)  # type: ignore[arg-type]

    refresher = threading.Thread(target=refresh)
    refresher.start()
    try:
        seen = {healthy(metrics) for _ in range(300)}
    finally:
        stop.set()
        refresher.join()
    assert seen == {5}
    # A replica out of rotation moves between series; the emptied one reads 0, not absent.
    replicas[0].healthy = False
    metrics.set_replicas(replicas)  # type: ignore[arg-type]
    assert healthy(metrics) == 4
