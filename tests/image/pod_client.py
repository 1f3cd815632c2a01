"""A client inside a pod sandbox's network namespace (run under ``nsenter --net``), for
``image_checks``: waits until the replica at ``TARGET`` answers health SERVING, then (with
``--prompt-ids``) completes the prompt greedily through the real SDK and prints the result as
one JSON line; with ``--listening PORT`` it prints whether something listens on PORT and on
which address.

    python tests/image/pod_client.py 198.18.0.10:50051 --prompt-ids 1,2,3 --max-tokens 12
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tandem.client import Client  # noqa: E402


def wait_serving(target: str, timeout_s: float) -> float:
    """Seconds it took; raises TimeoutError past ``timeout_s``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        with grpc.insecure_channel(target) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return time.monotonic() - start
            except grpc.RpcError:
                pass
        time.sleep(1.0)
    raise TimeoutError(f"{target} did not answer SERVING within {timeout_s:.0f} s")


def listeners(port: int) -> list[str]:
    """Local addresses listening on TCP ``port``, from /proc/net/tcp (IPv4)."""
    found = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, local_port = local.split(":")
        if state == "0A" and int(local_port, 16) == port:  # 0A: LISTEN
            octets = bytes.fromhex(address)[::-1]
            found.append(".".join(str(b) for b in octets))
    return found


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("target")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--prompt-ids", default=None)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--listening", type=int, default=None)
    parser.add_argument("--metrics", default=None, help="host:port of a /metrics endpoint")
    args = parser.parse_args()
    result: dict[str, object] = {"ready_s": wait_serving(args.target, args.timeout)}
    if args.prompt_ids:
        prompt = [int(i) for i in args.prompt_ids.split(",")]
        with Client(args.target, timeout=120) as client:
            completion = client.complete(prompt, max_tokens=args.max_tokens, temperature=0.0,
                                         ignore_eos=True, return_token_ids=True)
        result.update(model=completion.model, text=completion.text,
                      token_ids=completion.choices[0].token_ids)
    if args.listening is not None:
        result["listening"] = listeners(args.listening)
    if args.metrics:
        with urllib.request.urlopen(f"http://{args.metrics}/metrics", timeout=10) as reply:
            result["metrics"] = reply.read().decode()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
