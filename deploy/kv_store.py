"""``tandem up --kv-store local``: a Redis server on loopback for the suite's shared KV tier.

Owns starting and stopping that ``redis-server`` (the Debian package's binary; ``make
setup`` installs it where it is missing). It keeps nothing on disk (no RDB, no AOF), binds
127.0.0.1 only, evicts least recently used keys at its memory cap, and ends with the suite.
It does not own the tier itself (``engine_common.kv_tiers.redis_tier``).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator

import redis

LOCAL = "local"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def redis_server(port: int, maxmemory: str = "1gb",
                 policy: str = "allkeys-lru") -> Iterator[subprocess.Popen[bytes]]:
    """A loopback redis-server on ``port`` until the block ends (tests use it directly)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("error: --kv-store local needs redis-server (Debian package "
                         "redis-server; `make setup` installs it as root)")
    process = subprocess.Popen(
        [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "",
         "--appendonly", "no", "--maxmemory", maxmemory, "--maxmemory-policy", policy,
         "--protected-mode", "yes"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"error: redis-server did not start on port {port}") \
                        from None
                time.sleep(0.05)
        client.close()
        yield process
    finally:
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def local_kv_store(args: argparse.Namespace) -> Iterator[None]:
    """With ``--kv-store local``: start a loopback Redis and give the replicas its URL."""
    if getattr(args, "kv_store", None) != LOCAL:
        yield
        return
    port = free_port()
    with redis_server(port):
        args.kv_store = f"redis://127.0.0.1:{port}/0"
        print(f"shared KV tier: redis-server on {args.kv_store}", flush=True)
        yield
