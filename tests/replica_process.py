"""Real replica processes for tests: ``python -m services.replica`` on loopback.

``start_replicas`` launches one or more replicas at once (their start-ups overlap, which is
most of the cost), waits until each answers health SERVING and returns ``ReplicaProcess``
handles (``launch_replicas`` and ``wait_serving`` are its two halves, for a caller that starts
more processes in between); ``ReplicaProcess.stop`` ends one gracefully (SIGTERM, then
SIGKILL), ``kill`` at once. A replica's stderr goes to a log file whose tail is shown when it
fails to start.

For the rest of a suite (gateway, Envoy): ``spawn_module`` starts ``python -m MODULE`` in its
own session with its output in a log, ``wait_until`` polls a readiness check (showing every
log's tail when it times out), ``is_serving``, ``envoy_answers`` and ``healthy_replicas`` (how
many replicas a gateway routes to) are such checks.
``replica_behind_gateway`` is the common small stack: one replica and a gateway in front
(``gateway_before`` puts a gateway in front of replicas already running, ``gateway_started``
one in front of replicas still starting). The gateway starts
together with its replica, not after it: it watches a replica until it answers (retrying
every 0.2 s, reconnecting within 1 s) and reports SERVING once one can decode, so the two
processes' imports overlap. ``wait_all_free`` waits until replicas hold nothing (no request,
no KV block).
"""

from __future__ import annotations

import fcntl
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from protos.tandem.v1 import engine_pb2, engine_pb2_grpc
from services.suite_tls import SuiteTls
from services.suite_tls import channel as suite_channel

REPO_ROOT = Path(__file__).resolve().parent.parent
STARTUP_TIMEOUT_S = 240.0


# Ports for the servers tests start come from below Linux's ephemeral range (32768 and up by
# default): a port the kernel hands out for bind(0) or an outgoing connection (Envoy's admin
# listener, a UCX listener, any client socket) can then never take one between our choosing
# it and the server binding it, and no port is handed out twice in a run. Under pytest-xdist
# each worker (PYTEST_XDIST_WORKER gw0, gw1, ...) draws from its own slice of the range, so
# two workers never choose the same port either.
def _port_slice() -> tuple[int, int]:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    index = int(worker) if worker.isdigit() else 0
    span = (32768 - 20000) // max(workers, 1)
    return 20000 + index * span, 20000 + (index + 1) * span


_PORT_SLICE = _port_slice()
_next_test_port = [_PORT_SLICE[0] + random.randrange(0, (_PORT_SLICE[1] - _PORT_SLICE[0]) // 2,
                                                     1000)]


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive loopback ports nothing listens on (for flags that
    take a base port), outside the kernel's ephemeral range, and reserved for this process (``_reserved``)."""
    while _next_test_port[0] + count <= _PORT_SLICE[1]:
        first = _next_test_port[0]
        _next_test_port[0] += count
        ports = range(first, first + count)
        if all(_reserved(port) for port in ports) and all(_bindable(port) for port in ports):
            return first
    raise RuntimeError(f"ran out of test ports below {_PORT_SLICE[1]}")


# NOTE: two test runs on one machine (two checkouts' make test) each start at a random port
# of the same slice; one chose a port the other had chosen but not yet bound, and a gateway
# then reached the other run's replica ("Method not found!"). Ports are reserved a hundred at
# a time by an exclusive lock on a file named after the hundred, held until this process
# exits (a few descriptors per run).
_RESERVATIONS_DIR = Path(os.environ.get("TMPDIR", "/tmp")) / "tandem-test-ports"
_reservations: dict[int, int | None] = {}  # hundred -> the locked file's descriptor, or None


def _reserved(port: int) -> bool:
    hundred = port // 100
    if hundred not in _reservations:
        _RESERVATIONS_DIR.mkdir(exist_ok=True)
        fd: int | None = os.open(_RESERVATIONS_DIR / str(hundred), os.O_CREAT | os.O_RDWR,
                                 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # another run's
            os.close(fd)
            fd = None
        _reservations[hundred] = fd
    return _reservations[hundred] is not None


def free_port() -> int:
    return free_ports(1)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass
class ReplicaProcess:
    process: subprocess.Popen[bytes]
    port: int
    metrics_port: int
    log_path: Path
    tls: SuiteTls | None = None  # the suite's mutual TLS, when started with --tls-dir

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self, service: str = "", timeout: float = 2.0) -> int:
        """The health status (a ``HealthCheckResponse.ServingStatus``); raises grpc.RpcError
        when the server does not answer."""
        with suite_channel(self.target, self.tls) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest(service=service)
            return int(stub.Check(request, timeout=timeout).status)

    def engine_core_pid(self) -> int:
        """The pid of this replica's engine-core child process: forked (it keeps its
        parent's command line) or spawned (multiprocessing's ``spawn_main``; the replica
        spawns when another thread runs at the engine's start, see ``fork_is_safe``, and
        says so in its log)."""
        replica_cmdline = Path(f"/proc/{self.process.pid}/cmdline").read_bytes()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            # NOTE: both reads under one guard. The scan meets every process on the machine,
            # and any of them may exit between the listing and a read: an unguarded cmdline
            # read raised FileNotFoundError for a stranger's process that exited after its
            # stat was read (1 in ~1,300 lookups while two threads ran `true` in a loop). Our
            # engine core is alive while we look, so a process gone mid-read is never it.
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            # Fields after the parenthesised command name: state, ppid, ...
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            # NOTE: a spawned core too (the resource tracker, also a spawned child, runs
            # another entry point): this lookup once failed with "no engine-core child" in a
            # run of tests/test_prefill_keepalive.py under load, the core not forked.
            if ppid == self.process.pid and (cmdline == replica_cmdline
                                             or b"spawn_main" in cmdline):
                return int(entry.name)
        raise LookupError(f"no engine-core child of pid {self.process.pid}")

    def kill(self) -> None:
        """SIGKILL (the engine core exits on its own when its pipe closes)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()

    def stop(self, timeout: float = 30.0) -> None:
        """Graceful: SIGTERM, then SIGKILL after ``timeout``."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def stop_all(processes: Sequence[subprocess.Popen[bytes]],
             replicas: dict[str, ReplicaProcess]) -> None:
    """Stop a cluster gracefully: SIGTERM to every process group and replica at once (they
    drain side by side, not one after another), then SIGKILL whatever is left after 30 s."""
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
    for replica in replicas.values():
        if replica.process.poll() is None:
            replica.process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
    for replica in replicas.values():
        replica.stop()


def spawn_module(log_dir: Path, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
    """``python -m argv...`` from the repository root, in a session of its own (so that
    ``os.killpg`` ends it and its children), output to ``log_dir/name.log``."""
    with open(log_dir / f"{name}.log", "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", *argv], cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)


def is_serving(target: str) -> bool:
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def envoy_answers(port: int) -> bool:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/nowhere", timeout=1)
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True


def healthy_replicas(metrics_port: int) -> int:
    """How many replicas the gateway whose metrics are on ``metrics_port`` has healthy (0
    when it does not answer)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                    timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return 0
    return int(sum(sample.value for family in text_string_to_metric_families(text)
                   for sample in family.samples
                   if sample.name == "tandem:gateway_replicas"
                   and sample.labels.get("healthy") == "true"))


def wait_until(condition: Callable[[], bool], deadline: float, what: str, logs: Path) -> None:
    while not condition():
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
                              for p in sorted(logs.glob("*.log")))
            raise AssertionError(f"{what} not ready in time\n{tails}")
        time.sleep(0.2)


def _launch(model_dir: Path, log_dir: Path, name: str, args: list[str],
            ports: tuple[int, int] | None = None) -> ReplicaProcess:
    port, metrics_port = ports or (free_port(), free_port())
    log_path = log_dir / f"{name}.log"
    command = [
        sys.executable, "-m", "services.replica", "--model", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics_port),
        "--engine-id", name, *args,
    ]
    with open(log_path, "ab") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
    tls = SuiteTls.load(Path(args[args.index("--tls-dir") + 1])) if "--tls-dir" in args else None
    return ReplicaProcess(process, port, metrics_port, log_path, tls)


def _wait_serving(replica: ReplicaProcess, deadline: float) -> None:
    while True:
        if replica.process.poll() is not None:
            raise RuntimeError(
                f"replica exited with code {replica.process.returncode}:\n{replica.log()[-3000:]}")
        try:
            if replica.health(timeout=1.0) == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"replica not SERVING in time:\n{replica.log()[-3000:]}")
        time.sleep(0.2)


def launch_replicas(model_dir: Path, log_dir: Path,
                    configs: dict[str, list[str]]) -> dict[str, ReplicaProcess]:
    """Start one replica per ``{name: extra_args}``, concurrently; returns at once (their
    ports are chosen, nothing answers on them yet: ``wait_serving``)."""
    return {name: _launch(model_dir, log_dir, name, args) for name, args in configs.items()}


def wait_serving(replicas: dict[str, ReplicaProcess]) -> None:
    """Wait until every replica serves; kill them all if one fails or is late."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    try:
        for replica in replicas.values():
            _wait_serving(replica, deadline)
    except BaseException:
        for replica in replicas.values():
            replica.kill()
        raise


def start_replicas(model_dir: Path, log_dir: Path,
                   configs: dict[str, list[str]]) -> dict[str, ReplicaProcess]:
    """Start one replica per ``{name: extra_args}``, concurrently; wait until all serve."""
    replicas = launch_replicas(model_dir, log_dir, configs)
    wait_serving(replicas)
    return replicas


def restart_replica(replica: ReplicaProcess, model_dir: Path, log_dir: Path, name: str,
                    args: list[str]) -> ReplicaProcess:
    """Kill ``replica`` and start a new process in its place (the same ports, name and log,
    ``args`` added), as a supervisor restarts a crashed one; waits until it serves."""
    replica.kill()
    restarted = _launch(model_dir, log_dir, name, args, (replica.port, replica.metrics_port))
    try:
        _wait_serving(restarted, time.monotonic() + STARTUP_TIMEOUT_S)
    except BaseException:
        restarted.kill()
        raise
    return restarted


@dataclass
class GatewayStack:
    replica: ReplicaProcess
    gateway: str  # the gateway's gRPC target


@contextmanager
def gateway_started(model_dir: Path, log_dir: Path, targets: Sequence[str],
                    gateway_args: Sequence[str] = (), name: str = "gateway") -> Iterator[str]:
    """A gateway process routing to ``targets``, started (not yet serving: its replicas may
    still be starting too) and killed on the way out; yields its target."""
    port = free_port()
    gateway = spawn_module(log_dir, name, [
        "gateway", "--model", str(model_dir), "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0",
        *[arg for target in targets for arg in ("--replica", target)], *gateway_args])
    try:
        yield f"127.0.0.1:{port}"
    finally:
        if gateway.poll() is None:
            os.killpg(gateway.pid, signal.SIGKILL)
            gateway.wait(10)


@contextmanager
def gateway_before(model_dir: Path, log_dir: Path, targets: Sequence[str],
                   gateway_args: Sequence[str] = (), name: str = "gateway") -> Iterator[str]:
    """A gateway routing to the replicas at ``targets`` (``gateway_args`` added to its
    command line; served model name "tiny"), killed on the way out; yields its target once
    it serves (one of the replicas can decode)."""
    with gateway_started(model_dir, log_dir, targets, gateway_args, name) as gateway:
        wait_until(lambda: is_serving(gateway), time.monotonic() + 60, name, log_dir)
        yield gateway


@contextmanager
def replica_behind_gateway(model_dir: Path, log_dir: Path, replica_args: list[str],
                           gateway_args: Sequence[str] = ()) -> Iterator[GatewayStack]:
    """One replica (``replica_args`` added to its command line) and a gateway routing to it
    (``gateway_args`` added to its), started together; both are killed on the way out. The
    served model name is "tiny"."""
    replicas = launch_replicas(model_dir, log_dir, {"a": [
        "--served-model-name", "tiny", *replica_args]})
    try:
        with gateway_started(model_dir, log_dir, [replicas["a"].target],
                             gateway_args) as gateway:
            wait_serving(replicas)
            wait_until(lambda: is_serving(gateway), time.monotonic() + 60, "gateway", log_dir)
            yield GatewayStack(replicas["a"], gateway)
    finally:
        replicas["a"].kill()


def wait_all_free(*targets: str, timeout: float = 20.0) -> None:
    """Until every replica at ``targets`` runs nothing, queues nothing and holds no KV block
    (its GetLoad); fails after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    for target in targets:
        with grpc.insecure_channel(target) as channel:
            engine = engine_pb2_grpc.EngineStub(channel)
            while True:
                load = engine.GetLoad(engine_pb2.GetLoadRequest(), timeout=5)
                if (load.num_free_blocks == load.num_total_blocks
                        and load.num_requests_running == 0 and load.num_requests_waiting == 0):
                    break
                assert time.monotonic() < deadline, f"{target} still holds blocks: {load}"
                time.sleep(0.1)
