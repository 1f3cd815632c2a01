"""The local supervisor behind `tandem up`: start a suite of processes, keep it up, stop it.

Owns the life of the planned processes (``suite_plan``): that every port they will listen on
is free before anything starts (``check_ports``); starting each in its own process group with
its output appended to a log file; counting a process ready once its health check passes
(``grpc.health.v1`` SERVING, or its ``ready_url`` answering 200) and every port it plans
accepts connections, and the suite started once every ``serving_url`` answers 200 too
(Envoy's /health); and restarting one that dies, as a Kubernetes Deployment would: after
a delay that doubles with each restart in a row up to a cap (``RestartPolicy``), the count
starting over once the process has stayed ready for a while. A ready process whose health
check keeps failing (a replica whose engine core died reports NOT_SERVING) is killed and
restarted the same way. Every exit and restart is one line on the supervisor's output.

It gives up, stopping everything with a ``SuiteFailed`` that names the process and shows the
end of its log, only when a process keeps failing at start: it exited (or was not ready in
time) ``max_start_failures`` times in a row without becoming ready. Otherwise it runs until
Ctrl-C or SIGTERM, then stops in two stages: SIGTERM to the processes that drain first (the
replicas: they refuse new requests and finish their streams, which the gateway and Envoy
still relay), then SIGTERM to the rest once those exited, SIGKILL to whatever is left after
the grace period; a second signal skips to SIGKILL. It does not own what the processes do.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy.suite_plan import PortUse, ProcessSpec, Suite
from services.suite_tls import SuiteTls
from services.suite_tls import channel as suite_channel

_TICK_S = 0.2
_LAST_STAGE_GRACE_S = 5.0
_LOG_TAIL_CHARS = 2000


class SuiteFailed(RuntimeError):
    """The suite cannot run: a port is taken, or a process keeps failing at start."""


@dataclass(frozen=True)
class RestartPolicy:
    """When a dead process starts again (Kubernetes' CrashLoopBackOff, with local times)."""

    # The first restart waits this long; each restart in a row doubles it, up to the cap.
    initial_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    # Ready this long without interruption: the next restart waits initial_backoff_s again.
    reset_after_s: float = 60.0
    # Exits (or start timeouts) in a row without becoming ready, before the suite gives up.
    max_start_failures: int = 3
    # A started process not ready after this long counts as a failed start.
    start_timeout_s: float = 300.0
    # A ready process is probed this often; failing for liveness_timeout_s it is restarted.
    liveness_interval_s: float = 2.0
    liveness_timeout_s: float = 15.0

    def backoff(self, restarts_in_a_row: int) -> float:
        """The delay before restart number ``restarts_in_a_row`` (1, 2, ...)."""
        exponent = min(max(restarts_in_a_row - 1, 0), 32)
        return min(self.initial_backoff_s * 2.0 ** exponent, self.max_backoff_s)


def check_ports(specs: Sequence[ProcessSpec]) -> None:
    """Raise ``SuiteFailed`` naming every planned port that is taken (by another process, or
    planned twice). A listener that shares its port (SO_REUSEPORT, as Envoy's listeners do)
    still refuses this bind, so a second suite cannot quietly share the first one's ports."""
    problems: list[str] = []
    seen: dict[int, PortUse] = {}
    for spec in specs:
        for use in spec.ports:
            if use.port == 0:
                continue
            if use.port in seen:
                problems.append(f"port {use.port} is planned twice: for {seen[use.port].what} "
                                f"and for {use.what}")
                continue
            seen[use.port] = use
            reason = _bind_refused(use.host, use.port)
            if reason is not None:
                problems.append(f"port {use.port} on {use.host} ({use.what}) is {reason}")
    if problems:
        raise SuiteFailed("cannot start the suite: " + "; ".join(problems)
                          + ". Stop what listens there or choose other ports.")


def _bind_refused(host: str, port: int) -> str | None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # As the servers bind: connections of an earlier run in TIME_WAIT do not count.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            return "in use" if error.errno == errno.EADDRINUSE else f"not usable ({error})"
    return None


def describe_exit(code: int) -> str:
    """``-9`` as "killed by SIGKILL", ``1`` as "exited with code 1", ``137`` (a runner whose
    child was killed, as a shell reports it) as "exited with code 137 (128 + SIGKILL)"."""
    if code < 0:
        return f"killed by {_signal_name(-code)}"
    if 128 < code < 128 + 65:
        return f"exited with code {code} (128 + {_signal_name(code - 128)})"
    return f"exited with code {code}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


@dataclass
class _Managed:
    """One planned process across its restarts."""

    spec: ProcessSpec
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    ready_since: float | None = None  # None: not ready since its latest start
    restarts_in_a_row: int = 0  # for the backoff; reset after reset_after_s of readiness
    start_failures: int = 0  # exits before becoming ready, in a row
    restart_at: float | None = None  # when a dead process starts again
    restarts: int = 0  # in all, for the log
    next_probe_at: float = 0.0
    failing_since: float | None = None  # a ready process's health check failing since
    channel: grpc.Channel | None = None

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-_LOG_TAIL_CHARS:]
        except OSError:
            return "(no log)"


@dataclass
class Supervisor:
    suite: Suite
    log_dir: Path
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    # Where the one-line restart and exit reports go.
    say: Callable[[str], None] = field(default=lambda line: print(line, flush=True))
    # The suite's mutual TLS, when its processes run with it: health checks present it.
    tls: SuiteTls | None = None

    def __post_init__(self) -> None:
        self._managed = {spec.name: _Managed(spec, self.log_dir / f"{spec.name}.log")
                         for spec in self.suite.specs}
        self._stop_requested = False
        self._force = False
        self._stopped = False

    # ----------------------------------------------------------------- queries
    @property
    def procs(self) -> dict[str, subprocess.Popen[bytes]]:
        """The live process object of each started process (its latest incarnation)."""
        return {name: m.proc for name, m in self._managed.items() if m.proc is not None}

    def is_ready(self, name: str) -> bool:
        return self._managed[name].ready_since is not None

    def restarts(self, name: str) -> int:
        return self._managed[name].restarts

    def request_stop(self) -> None:
        """Ask ``start`` or ``serve_forever`` to stop, as Ctrl-C does (from another thread)."""
        self._stop_requested = True

    # ----------------------------------------------------------------- life
    def start(self) -> None:
        """Check the ports, start every process and return once all are ready (restarting
        those that die meanwhile); ``SuiteFailed`` if one keeps failing, KeyboardInterrupt on
        a stop signal meanwhile. The caller stops the suite after either."""
        check_ports(self.suite.specs)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with self._stop_signals():
            for managed in self._managed.values():
                self._spawn(managed)
            all_ready_at: float | None = None
            while not self._started():
                if self._stop_requested:
                    raise KeyboardInterrupt
                self.tick()
                all_ready_at = self._check_serving_wait(all_ready_at)
                time.sleep(_TICK_S)

    def _started(self) -> bool:
        """Every process ready, and every ``serving_url`` answering 200 (Envoy's /health:
        "healthy" must not be printed while it still answers 503)."""
        managed = self._managed.values()
        return (all(m.ready_since is not None for m in managed)
                and all(_url_ok(m.spec.serving_url) for m in managed
                        if m.spec.serving_url is not None))

    def _check_serving_wait(self, all_ready_at: float | None) -> float | None:
        """When every process became ready (None: not all are); ``SuiteFailed`` when a
        ``serving_url`` still fails ``start_timeout_s`` after that."""
        if not all(m.ready_since is not None for m in self._managed.values()):
            return None
        now = time.monotonic()
        if all_ready_at is None:
            return now
        if now - all_ready_at > self.policy.start_timeout_s:
            failing = [m.spec for m in self._managed.values()
                       if m.spec.serving_url is not None and not _url_ok(m.spec.serving_url)]
            if failing:
                raise SuiteFailed(
                    f"{failing[0].name} is ready but {failing[0].serving_url} did not answer "
                    f"200 within {self.policy.start_timeout_s:.0f} s")
        return all_ready_at

    def serve_forever(self, grace_s: float = 35.0) -> None:
        """Keep the suite up until Ctrl-C or SIGTERM (then drain and stop, within
        ``grace_s``), or until a process keeps failing at start (stop, raise SuiteFailed)."""
        with self._stop_signals():
            try:
                while not self._stop_requested:
                    self.tick()
                    time.sleep(_TICK_S)
            finally:
                self.stop(grace_s)

    def tick(self) -> None:
        """One round: notice exits, start what is due, probe readiness and liveness."""
        now = time.monotonic()
        for managed in self._managed.values():
            proc = managed.proc
            if proc is not None and proc.poll() is not None:
                self._on_exit(managed, proc.returncode, now)
            elif managed.proc is None and managed.restart_at is not None \
                    and now >= managed.restart_at:
                self._spawn(managed)
            elif managed.proc is not None and managed.ready_since is None:
                self._probe_start(managed, now)
            elif managed.proc is not None:
                self._probe_liveness(managed, now)

    def stop(self, grace_s: float = 35.0) -> None:
        """SIGTERM the processes that drain first, then the rest once those exited; SIGKILL
        whatever is left after ``grace_s`` (at once on a second signal)."""
        if self._stopped:
            return
        self._stopped = self._stop_requested = True
        deadline = time.monotonic() + grace_s
        first = [m for m in self._managed.values() if m.spec.drains_first]
        rest = [m for m in self._managed.values() if not m.spec.drains_first]
        with self._stop_signals():  # a Ctrl-C now cuts the drain short, never the stop
            for group in (first, rest):
                for managed in group:
                    managed.restart_at = None
                    _signal_group(managed, signal.SIGTERM)
                # What drains last gets a moment even when the first stage used the grace.
                stage_deadline = max(deadline, time.monotonic() + _LAST_STAGE_GRACE_S)
                for managed in group:
                    self._wait_or_kill(managed, stage_deadline)
        for managed in self._managed.values():
            if managed.channel is not None:
                managed.channel.close()
                managed.channel = None

    # ----------------------------------------------------------------- internals
    @contextlib.contextmanager
    def _stop_signals(self) -> Iterator[None]:
        """While inside: SIGTERM and SIGINT ask for a stop (a second one for no more
        waiting) instead of killing the supervisor and orphaning the suite. Outside a main
        thread the caller stops the suite itself."""
        def on_signal(_signum: int, _frame: FrameType | None) -> None:
            if self._stop_requested:
                self._force = True
            self._stop_requested = True

        try:
            previous = {sig: signal.signal(sig, on_signal)
                        for sig in (signal.SIGTERM, signal.SIGINT)}
        except ValueError:
            previous = {}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _spawn(self, managed: _Managed) -> None:
        spec = managed.spec
        with open(managed.log_path, "ab") as log:
            if managed.restarts:
                log.write(f"--- tandem up: restart {managed.restarts} of {spec.name} at "
                          f"{time.strftime('%H:%M:%S')}\n".encode())
                log.flush()
            argv = spec.argv if spec.cpus is None else [
                sys.executable, "-m", "deploy.pinned_exec", ",".join(map(str, spec.cpus)), "--",
                *spec.argv]
            managed.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **spec.env}, start_new_session=True)
        managed.started_at = time.monotonic()
        managed.ready_since = managed.restart_at = managed.failing_since = None

    def _on_exit(self, managed: _Managed, code: int, now: float) -> None:
        _reaped(managed)
        name, how = managed.spec.name, describe_exit(code)
        if managed.ready_since is None:
            managed.start_failures += 1
            if managed.start_failures >= self.policy.max_start_failures:
                raise SuiteFailed(
                    f"{name} keeps failing at start: it {how}, {managed.start_failures} times "
                    f"in a row without becoming ready; giving up. Its log "
                    f"({managed.log_path}) ends:\n{managed.log_tail()}")
        elif now - managed.ready_since >= self.policy.reset_after_s:
            managed.restarts_in_a_row = 0  # it had been stable: back to the first delay
        managed.ready_since = None
        managed.restarts_in_a_row += 1
        managed.restarts += 1
        delay = self.policy.backoff(managed.restarts_in_a_row)
        managed.restart_at = now + delay
        self.say(f"supervisor: {name} {how}; restarting it in {delay:.1f} s "
                 f"(restart {managed.restarts}, {managed.restarts_in_a_row} in a row)")

    def _probe_start(self, managed: _Managed, now: float) -> None:
        if _ready(managed, self.tls):
            managed.ready_since = now
            managed.start_failures = 0
            managed.next_probe_at = now + self.policy.liveness_interval_s
            if managed.restarts:
                self.say(f"supervisor: {managed.spec.name} is ready again after "
                         f"{now - managed.started_at:.1f} s (restart {managed.restarts})")
        elif now - managed.started_at > self.policy.start_timeout_s:
            self.say(f"supervisor: {managed.spec.name} was not ready within "
                     f"{self.policy.start_timeout_s:.0f} s; killing it")
            _signal_group(managed, signal.SIGKILL)  # the next tick counts the failed start

    def _probe_liveness(self, managed: _Managed, now: float) -> None:
        if now < managed.next_probe_at:
            return
        managed.next_probe_at = now + self.policy.liveness_interval_s
        if _alive(managed, self.tls):
            managed.failing_since = None
            return
        if managed.failing_since is None:
            managed.failing_since = now
        elif now - managed.failing_since >= self.policy.liveness_timeout_s:
            self.say(f"supervisor: {managed.spec.name} failed its health check for "
                     f"{now - managed.failing_since:.0f} s; killing it")
            _signal_group(managed, signal.SIGKILL)  # restarted like any dead process

    def _wait_or_kill(self, managed: _Managed, deadline: float) -> None:
        proc = managed.proc
        if proc is None:
            return
        while proc.poll() is None and time.monotonic() < deadline and not self._force:
            time.sleep(0.05)
        if proc.poll() is None:
            self.say(f"supervisor: {managed.spec.name} did not stop in time; killing it")
            _signal_group(managed, signal.SIGKILL)
            proc.wait()
        _reaped(managed)


def _signal_group(managed: _Managed, sig: signal.Signals) -> None:
    """Signal the process group a live (not yet reaped) process leads: it and every child
    it started. Once it is reaped its id may name another process: never signalled then."""
    if managed.proc is None or managed.proc.returncode is not None:
        return
    try:
        os.killpg(managed.proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _reaped(managed: _Managed) -> None:
    """A process just reaped: SIGKILL what it left in its group (an engine core, the Envoy
    binary under its runner) at once, while no other group can have taken its id, and
    forget it."""
    assert managed.proc is not None
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(managed.proc.pid, signal.SIGKILL)
    managed.proc = None


def _health(managed: _Managed, tls: SuiteTls | None) -> int | None:
    """The gRPC health status, or None when it does not answer. A channel that failed is
    dropped: a new one connects at once, where the old one would wait out its backoff."""
    target = managed.spec.grpc_target
    assert target is not None
    if managed.channel is None:
        managed.channel = suite_channel(target, tls if managed.spec.suite_tls else None)
    try:
        reply = health_pb2_grpc.HealthStub(managed.channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=1.0)
    except grpc.RpcError:
        managed.channel.close()
        managed.channel = None
        return None
    return int(reply.status)


def _url_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _accepts(use: PortUse) -> bool:
    host = "127.0.0.1" if use.host in ("0.0.0.0", "") else use.host
    try:
        with socket.create_connection((host, use.port), timeout=1.0):
            return True
    except OSError:
        return False


def _ready(managed: _Managed, tls: SuiteTls | None) -> bool:
    spec = managed.spec
    if (spec.grpc_target is not None
            and _health(managed, tls) != health_pb2.HealthCheckResponse.SERVING):
        return False
    if spec.ready_url is not None and not _url_ok(spec.ready_url):
        return False
    return all(_accepts(use) for use in spec.ports if use.port)


def _alive(managed: _Managed, tls: SuiteTls | None) -> bool:
    spec = managed.spec
    if spec.grpc_target is not None:
        status = _health(managed, tls)
        if status is None or (spec.restart_when_not_serving
                              and status != health_pb2.HealthCheckResponse.SERVING):
            return False
    if spec.ready_url is not None and not _url_ok(spec.ready_url):
        return False
    return True

