"""Small real programs for the supervisor's tests: ``python -m tests.supervised_program KIND``.

- ``listen PORT``: listen on 127.0.0.1:PORT until SIGTERM;
- ``crash``: print "boom" and exit with code 3;
- ``health PORT [--not-serving-after S]``: a ``grpc.health.v1`` server answering SERVING,
  NOT_SERVING after S seconds;
- ``http PORT --ok-after S``: an HTTP server answering 503 to every GET for S seconds, then
  200 (as Envoy's /health until its first health check of the gateway passes).

``--term-delay S`` makes a SIGTERM take S seconds to end the program (a drain); ``--ignore-term``
never lets it; ``--mark FILE`` appends "term <time>" and "exit <time>" lines (time.time()) to
FILE, so a test can see the order in which processes were told to stop.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading
import time
from concurrent import futures
from pathlib import Path
from types import FrameType


def _mark(path: Path | None, what: str) -> None:
    if path is not None:
        with path.open("a") as out:
            out.write(f"{what} {time.time()}\n")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("kind", choices=("listen", "crash", "health", "http"))
    p.add_argument("port", type=int, nargs="?", default=0)
    p.add_argument("--term-delay", type=float, default=0.0)
    p.add_argument("--ignore-term", action="store_true")
    p.add_argument("--not-serving-after", type=float, default=None)
    p.add_argument("--ok-after", type=float, default=0.0)
    p.add_argument("--mark", type=Path, default=None)
    args = p.parse_args()
    if args.kind == "crash":
        print("boom", flush=True)
        return 3
    stop = threading.Event()

    def on_term(_signum: int, _frame: FrameType | None) -> None:
        _mark(args.mark, "term")
        if not args.ignore_term:
            threading.Timer(args.term_delay, stop.set).start()

    signal.signal(signal.SIGTERM, on_term)
    if args.kind == "listen":
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", args.port))
        server.listen()
    elif args.kind == "http":
        _serve_http(args.port, time.monotonic() + args.ok_after)
    else:
        import grpc
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc

        grpc_server = grpc.server(futures.ThreadPoolExecutor(2))
        servicer = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, grpc_server)
        grpc_server.add_insecure_port(f"127.0.0.1:{args.port}")
        grpc_server.start()
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        if args.not_serving_after is not None:
            threading.Timer(args.not_serving_after, servicer.set,
                            ("", health_pb2.HealthCheckResponse.NOT_SERVING)).start()
    print("ready", flush=True)
    while not stop.wait(0.05):
        pass
    _mark(args.mark, "exit")
    return 0


def _serve_http(port: int, ok_at: float) -> None:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(200 if time.monotonic() >= ok_at else 503)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *_args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
