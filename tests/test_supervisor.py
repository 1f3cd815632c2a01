"""The supervisor behind `tandem up` on small real programs (``tests.supervised_program``):
busy ports refused before anything starts, restarts with exponential backoff that starts over
after a stable period, the rest of the suite untouched meanwhile, a process that stops
serving restarted, a crash loop at start stopping the suite with the process's name and log,
and the staged drain on stop. ``test_supervisor_faults`` runs the real suite under it.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from deploy.suite_plan import PortUse, ProcessSpec, Suite, SuiteConfig, plan_suite
from deploy.supervisor import RestartPolicy, SuiteFailed, Supervisor, check_ports, describe_exit
from tests.replica_process import REPO_ROOT, free_port

pytestmark = pytest.mark.timeout(120)

FAST = RestartPolicy(initial_backoff_s=0.2, max_backoff_s=0.8, reset_after_s=3.0,
                     max_start_failures=3, start_timeout_s=60.0,
                     liveness_interval_s=0.2, liveness_timeout_s=1.0)


def program(name: str, *args: str, port: int = 0, grpc_target: str | None = None,
            **fields: bool) -> ProcessSpec:
    return ProcessSpec(
        name=name, argv=[sys.executable, "-m", "tests.supervised_program", *args],
        grpc_target=grpc_target, env={"PYTHONPATH": str(REPO_ROOT)},
        ports=[PortUse("127.0.0.1", port, f"{name} port")] if port else [], **fields)


def listener(name: str, *args: str, **fields: bool) -> ProcessSpec:
    port = free_port()
    return program(name, "listen", str(port), *args, port=port, **fields)


@contextmanager
def supervised(specs: list[ProcessSpec], tmp_path: Path,
               policy: RestartPolicy = FAST) -> Iterator[tuple[Supervisor, list[str]]]:
    said: list[str] = []
    supervisor = Supervisor(Suite(specs, {}), tmp_path / "logs", policy, said.append)
    try:
        yield supervisor, said
    finally:
        supervisor.stop(grace_s=5)


def tick_until(supervisor: Supervisor, condition: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        supervisor.tick()
        time.sleep(0.05)


def test_a_busy_port_is_refused_naming_it_even_when_the_listener_shares_ports() -> None:
    port = free_port()
    with socket.socket() as taken:
        # As Envoy's listeners: SO_REUSEPORT would let a second one share the port.
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", port))
        taken.listen()
        spec = program("envoy", port=port)
        spec.ports[0] = PortUse("127.0.0.1", port, "Envoy HTTP (--http-port)")
        with pytest.raises(SuiteFailed, match=rf"port {port} on 127.0.0.1 \(Envoy HTTP "
                                               r"\(--http-port\)\) is in use"):
            check_ports([spec])
    check_ports([spec])  # free again


def test_a_port_planned_twice_is_refused() -> None:
    port = free_port()
    with pytest.raises(SuiteFailed, match=f"port {port} is planned twice: for a port and for b"):
        check_ports([program("a", port=port), program("b", port=port)])


def test_the_plan_lists_every_port_it_assigns_and_envoy_gets_a_readiness_check() -> None:
    suite = plan_suite(SuiteConfig(model="m", num_prefill=1, num_decode=2, base_port=30100,
                                   gateway_port=30050, metrics_base_port=30200, envoy=True,
                                   envoy_http_port=30080))
    ports = {use.port: use.what for spec in suite.specs for use in spec.ports}
    assert ports == {
        30100: "prefill-0 gRPC (--base-port)", 30101: "decode-1 gRPC (--base-port)",
        30102: "decode-2 gRPC (--base-port)",
        30200: "prefill-0 metrics (--metrics-base-port)",
        30201: "decode-1 metrics (--metrics-base-port)",
        30202: "decode-2 metrics (--metrics-base-port)",
        30050: "gateway gRPC (--gateway-port)", 30203: "gateway metrics (--metrics-base-port)",
        30080: "Envoy HTTP (--http-port)", 30204: "Envoy admin (after --metrics-base-port)"}
    envoy = suite.specs[-1]
    assert envoy.argv[envoy.argv.index("--admin-port") + 1] == "30204"
    assert envoy.ready_url == "http://127.0.0.1:30204/ready"
    assert envoy.serving_url == "http://127.0.0.1:30080/health"
    assert [s.drains_first for s in suite.specs] == [True, True, True, False, False]
    assert [s.restart_when_not_serving for s in suite.specs] == [True, True, True, False, True]


def test_the_suite_is_started_only_once_every_serving_url_answers_200(tmp_path: Path) -> None:
    """As Envoy's /health answers 503 until its first health check of the gateway passes
    (up to 2 s after the gateway serves): "all healthy" must wait for it."""
    port = free_port()
    spec = program("envoy", "http", str(port), "--ok-after", "3", port=port)
    spec.serving_url = f"http://127.0.0.1:{port}/health"
    with supervised([spec], tmp_path) as (supervisor, _):
        began = time.monotonic()
        supervisor.start()
        assert time.monotonic() - began >= 3.0
        with urllib.request.urlopen(spec.serving_url, timeout=5) as answer:
            assert answer.status == 200
        assert supervisor.is_ready("envoy")


def test_a_dead_process_restarts_with_backoff_that_starts_over_after_a_stable_period(
        tmp_path: Path) -> None:
    with supervised([listener("steady"), listener("victim")], tmp_path) as (supervisor, said):
        supervisor.start()
        steady = supervisor.procs["steady"].pid

        def kill_and_wait_ready(restart: int) -> float:
            os.kill(supervisor.procs["victim"].pid, signal.SIGKILL)
            tick_until(supervisor, lambda: supervisor.restarts("victim") == restart, 10)
            tick_until(supervisor, lambda: supervisor.is_ready("victim"), 20)
            line = next(line for line in said if f"(restart {restart}," in line)
            delay = re.search(r"in ([\d.]+) s", line)
            assert delay is not None and "victim killed by SIGKILL" in line, said
            return float(delay.group(1))

        # Each restart in a row doubles the delay, up to the cap.
        assert [kill_and_wait_ready(n) for n in (1, 2, 3, 4)] == [0.2, 0.4, 0.8, 0.8]
        assert supervisor.procs["steady"].pid == steady  # the rest kept running
        assert any("victim is ready again" in line for line in said)
        # Ready for reset_after_s: the next restart waits the first delay again.
        deadline = time.monotonic() + FAST.reset_after_s + 0.3
        tick_until(supervisor, lambda: time.monotonic() > deadline, 10)
        assert kill_and_wait_ready(5) == 0.2
        log = (tmp_path / "logs" / "victim.log").read_text()
        assert "--- tandem up: restart 5 of victim" in log


def test_a_process_that_keeps_failing_at_start_stops_the_suite_naming_it(tmp_path: Path) -> None:
    with supervised([listener("fine"), program("broken", "crash", port=free_port())], tmp_path) as (
            supervisor, said):
        started = time.monotonic()
        with pytest.raises(SuiteFailed) as failure:
            supervisor.start()
        message = str(failure.value)
        assert message.startswith("broken keeps failing at start: it exited with code 3, "
                                   "3 times in a row without becoming ready")
        assert "boom" in message  # the end of its log
        assert [line.split(";")[0] for line in said] == ["supervisor: broken exited with code 3"] * 2
        assert time.monotonic() - started < 30
        fine = supervisor.procs["fine"]
    assert fine.poll() is not None  # stopped with the rest


def test_a_ready_process_that_stops_serving_is_restarted_unless_that_may_pass(
        tmp_path: Path) -> None:
    broken, patient = free_port(), free_port()
    specs = [
        program("replica", "health", str(broken), "--not-serving-after", "1",
                grpc_target=f"127.0.0.1:{broken}"),
        program("gateway", "health", str(patient), "--not-serving-after", "1",
                grpc_target=f"127.0.0.1:{patient}", restart_when_not_serving=False),
    ]
    with supervised(specs, tmp_path) as (supervisor, said):
        supervisor.start()
        gateway = supervisor.procs["gateway"].pid
        tick_until(supervisor, lambda: supervisor.restarts("replica") == 1, 20)
        assert any("replica failed its health check" in line for line in said), said
        tick_until(supervisor, lambda: supervisor.is_ready("replica"), 20)
        assert supervisor.procs["gateway"].pid == gateway and supervisor.restarts("gateway") == 0


def test_stop_drains_the_replicas_first_then_the_rest_and_kills_what_ignores_it(
        tmp_path: Path) -> None:
    marks = {name: tmp_path / f"{name}.marks" for name in ("replica", "gateway", "stubborn")}
    specs = [listener("replica", "--term-delay", "1.0", "--mark", str(marks["replica"]),
                      drains_first=True),
             listener("gateway", "--mark", str(marks["gateway"])),
             listener("stubborn", "--ignore-term", "--mark", str(marks["stubborn"]))]
    said: list[str] = []
    supervisor = Supervisor(Suite(specs, {}), tmp_path / "logs", FAST, said.append)
    supervisor.start()
    procs = supervisor.procs
    started = time.monotonic()
    supervisor.stop(grace_s=2.0)
    assert all(proc.poll() is not None for proc in procs.values())

    def when(name: str, what: str) -> float:
        return next(float(line.split()[1]) for line in marks[name].read_text().splitlines()
                    if line.startswith(what))

    # The gateway is told to stop only once the replica finished draining.
    assert when("gateway", "term") >= when("replica", "exit")
    assert procs["stubborn"].returncode == -signal.SIGKILL
    assert any("stubborn did not stop in time" in line for line in said)
    assert time.monotonic() - started < 2.0 + 5.0 + 3.0


@pytest.mark.parametrize(("code", "text"), [
    (-9, "killed by SIGKILL"), (1, "exited with code 1"), (0, "exited with code 0"),
    (137, "exited with code 137 (128 + SIGKILL)"), (143, "exited with code 143 (128 + SIGTERM)")])
def test_exits_are_described_as_a_person_reads_them(code: int, text: str) -> None:
    assert describe_exit(code) == text
