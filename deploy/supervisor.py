"""The local supervisor behind `tandem up`: start a suite of processes, watch, stop.

Owns starting the planned processes (``suite_plan``) in their own process groups with their
output in log files, waiting until each answers ``grpc.health.v1`` SERVING, and stopping all
of them cleanly (SIGTERM, then SIGKILL after a grace period) on Ctrl-C, SIGTERM, or when one
of them dies. It does not own what the processes do.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy.suite_plan import Suite


def wait_serving(target: str, deadline: float) -> None:
    """Block until ``target`` answers SERVING, or raise TimeoutError at ``deadline``."""
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{target} did not become healthy in time")
            time.sleep(0.2)


class Supervisor:
    def __init__(self, suite: Suite, log_dir: Path):
        self.suite = suite
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, timeout: float = 300.0) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for spec in self.suite.specs:
            log = open(self.log_dir / f"{spec.name}.log", "wb")  # noqa: SIM115 - owned by the child
            self.procs[spec.name] = subprocess.Popen(
                spec.argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **spec.env},
                start_new_session=True)
        deadline = time.monotonic() + timeout
        for spec in self.suite.specs:
            if spec.grpc_target is None:
                continue
            while True:
                self.check_alive()
                try:
                    wait_serving(spec.grpc_target, min(deadline, time.monotonic() + 2))
                    break
                except TimeoutError:
                    if time.monotonic() > deadline:
                        raise

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                tail = (self.log_dir / f"{name}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{name} exited with code {proc.returncode}; its log ends:\n{tail}")

    def stop(self, grace: float = 15.0) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def serve_forever(self) -> None:
        """Wait until Ctrl-C or SIGTERM, or until a process dies; then stop everything."""
        stop = False

        def on_signal(signum: int, _frame: object) -> None:
            nonlocal stop
            stop = True

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        try:
            while not stop:
                self.check_alive()
                time.sleep(0.5)
        finally:
            self.stop()
