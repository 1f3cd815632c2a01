"""KV transfer bandwidth: the UCX connector end to end against raw ucxx, same bytes.

For each transfer size (SmolLM2-135M's KV layout: 30 layers, 3 KV heads, head size 64,
16-token blocks, bf16: 360 KiB a block) it measures, with the producer in another process:

  (a) connector: ``UcxKvConsumer.pull`` of n scattered remote blocks into n shuffled
      local blocks: request header, status, gather, one payload message, scatter;
  (b) raw: a request of 8 bytes answered by ``ep.send`` of one pre-allocated buffer of
      the same byte count, received into one pre-allocated buffer: the network floor.

Both run on the same UCX runtime (thread progress, Python futures), are timed the same
way (from the calling thread, submit to result) and alternate within every iteration so
that machine load hits both alike. It prints GB/s for both and the ratio (goal >= 0.8)
and writes ``bench/results/kv_transfer_bandwidth.json``.

Run from the repository root: ``python -m bench.kv_transfer_bandwidth [--iters N]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import machine as report_machine  # noqa: E402
from kv_transfer.connector import KvHandle  # noqa: E402
from kv_transfer.layout import KvLayout  # noqa: E402
from kv_transfer.ucx_connector import (  # noqa: E402
    DEFAULT_CHUNK_BYTES,  # noqa: E402
    UcxKvConsumer,
    UcxKvProducer,
)
from kv_transfer.ucx_runtime import UcxRuntime  # noqa: E402

LAYOUT = KvLayout(
    model="HuggingFaceTB/SmolLM2-135M-Instruct",
    dtype="bfloat16",
    num_layers=30,
    num_kv_heads=3,
    head_size=64,
    block_size=16,
)
SIZES = [8, 32, 64, 128, 256]
# connector variants, by the producer's chunk_bytes: the default (layer chunks, pipelined)
# and the whole payload as one message
VARIANTS = {"connector": DEFAULT_CHUNK_BYTES, "one_message": 2**62}
CACHE_BLOCKS = 320  # per side; > the largest pull so that ids scatter
RESULTS = Path(__file__).resolve().parent / "results" / "kv_transfer_bandwidth.json"


def make_cache(num_blocks: int, seed: int) -> torch.Tensor:
    shape = (
        LAYOUT.num_layers,
        2,
        num_blocks,
        LAYOUT.block_size,
        LAYOUT.num_kv_heads,
        LAYOUT.head_size,
    )
    generator = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=generator)
    return bits.view(torch.bfloat16)


# -- producer process -----------------------------------------------------------------


async def _serve_raw(endpoint: Any, buffer: np.ndarray) -> None:
    size = np.empty(1, dtype=np.uint64)
    while True:
        try:
            await endpoint.recv(size)
        except Exception:
            return  # the consumer closed
        await endpoint.send(buffer[: int(size[0])])


async def _listen_raw(buffer: np.ndarray) -> Any:
    import ucxx

    async def handler(endpoint: Any) -> None:
        await _serve_raw(endpoint, buffer)

    return ucxx.create_listener(handler, port=0)


def _producer_main(conn: Connection, variants: dict[str, int]) -> None:
    cache = make_cache(CACHE_BLOCKS, seed=1)
    producers = {
        name: UcxKvProducer(cache, LAYOUT, engine_id=name, chunk_bytes=chunk_bytes)
        for name, chunk_bytes in variants.items()
    }
    for producer in producers.values():
        producer.start()
    raw_buffer = np.ones(max(SIZES) * LAYOUT.bytes_per_block, dtype=np.uint8)
    listener = UcxRuntime.shared().call(_listen_raw(raw_buffer))
    conn.send(listener.port)
    while True:
        command, args = conn.recv()
        if command == "pin":  # the same blocks, pinned in every variant
            conn.send({name: p.pin(*args) for name, p in producers.items()})
        elif command == "release":
            conn.send([p.release(*args) for p in producers.values()])
        else:
            for producer in producers.values():
                producer.close()
            conn.send(None)
            return


# -- consumer side ----------------------------------------------------------------------


class RawClient:
    def __init__(self, runtime: UcxRuntime, port: int, max_bytes: int):
        self._runtime = runtime
        self._buffer = np.zeros(max_bytes, dtype=np.uint8)
        self._endpoint = runtime.call(self._connect(port))

    @staticmethod
    async def _connect(port: int) -> Any:
        import ucxx

        return await ucxx.create_endpoint("127.0.0.1", port)

    async def _roundtrip(self, nbytes: int) -> None:
        await self._endpoint.send(np.array([nbytes], dtype=np.uint64))
        await self._endpoint.recv(self._buffer[:nbytes])

    def fetch(self, nbytes: int) -> float:
        started = time.perf_counter()
        self._runtime.call(self._roundtrip(nbytes))
        return time.perf_counter() - started

    def close(self) -> None:
        async def close() -> None:
            await self._endpoint.close()

        self._runtime.call(close())


def time_pull(
    consumer: UcxKvConsumer, handle: KvHandle, remote: list[int], local: list[int]
) -> float:
    started = time.perf_counter()
    consumer.pull(handle, remote, local, timeout=120).result()
    return time.perf_counter() - started


def gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    machine = report_machine()

    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_producer_main, args=(child_conn, VARIANTS), daemon=True)
    child.start()
    raw_port = conn.recv()

    import ucxx

    runtime = UcxRuntime.shared()
    kv = make_cache(CACHE_BLOCKS, seed=2)
    consumer = UcxKvConsumer(kv, LAYOUT)
    raw = RawClient(runtime, raw_port, max(SIZES) * LAYOUT.bytes_per_block)
    rng = random.Random(0)
    results = []
    try:
        for num_blocks in SIZES:
            nbytes = num_blocks * LAYOUT.bytes_per_block
            remote = rng.sample(range(CACHE_BLOCKS), num_blocks)
            local = rng.sample(range(CACHE_BLOCKS), num_blocks)
            request_id = f"bench-{num_blocks}"
            conn.send(("pin", (request_id, remote, num_blocks * 16, 600.0)))
            handles: dict[str, KvHandle] = conn.recv()

            runs: dict[str, Callable[[], float]] = {
                name: functools.partial(time_pull, consumer, handle, remote, local)
                for name, handle in handles.items()
            }
            runs["raw"] = functools.partial(raw.fetch, nbytes)
            seconds: dict[str, list[float]] = {name: [] for name in runs}
            order = list(runs)
            for i in range(args.warmup + args.iters):
                # Rotate who goes first, so that no variant always follows another.
                for name in order[i % len(order) :] + order[: i % len(order)]:
                    elapsed = runs[name]()
                    if i >= args.warmup:
                        seconds[name].append(elapsed)
            conn.send(("release", (request_id,)))
            conn.recv()
            raw_gbps = gbps(nbytes, seconds["raw"])
            row: dict[str, Any] = {"num_blocks": num_blocks, "bytes": nbytes}
            for name in runs:
                row[f"{name}_gbps"] = round(gbps(nbytes, seconds[name]), 3)
                row[f"{name}_ms_median"] = round(statistics.median(seconds[name]) * 1e3, 2)
                row[f"{name}_ms_min"] = round(min(seconds[name]) * 1e3, 2)
            for name in handles:
                row[f"{name}_ratio"] = round(gbps(nbytes, seconds[name]) / raw_gbps, 3)
                # Best case against best case: less exposed to other tenants' load.
                row[f"{name}_ratio_of_min"] = round(min(seconds["raw"]) / min(seconds[name]), 3)
            results.append(row)
            print(
                f"{num_blocks:4d} blocks {nbytes / 2**20:6.1f} MiB  raw {raw_gbps:5.2f} GB/s  "
                + "  ".join(
                    f"{name} {row[f'{name}_gbps']:5.2f} GB/s (x{row[f'{name}_ratio']:.2f}, "
                    f"min x{row[f'{name}_ratio_of_min']:.2f})"
                    for name in handles
                ),
                flush=True,
            )
        transports = sorted(ucxx.get_active_transports())
    finally:
        raw.close()
        consumer.close()
        conn.send(("stop", ()))
        conn.recv()
        child.join(10)

    report = {
        "benchmark": "kv_transfer_bandwidth",
        "machine": machine,
        "settings": {
            "layout": dataclasses.asdict(LAYOUT),
            "bytes_per_block": LAYOUT.bytes_per_block,
            "sizes_blocks": SIZES,
            "variants_chunk_bytes": VARIANTS,
            "iters": args.iters,
            "warmup": args.warmup,
            "statistic": "median seconds per transfer, submit to result; GB = 1e9 bytes; "
            "ratio = variant GB/s / raw GB/s (medians); ratio_of_min = raw min s / variant "
            "min s",
            "ucxx": ucxx.__version__,
            "ucx": ".".join(map(str, ucxx.get_ucx_version())),
            "active_transports": transports,
            "transport_used": "tcp over loopback: with endpoint error handling (peer-failure "
            "detection) UCX cannot use posix/sysv shared memory",
            "ucx_env": {k: v for k, v in os.environ.items() if k.startswith(("UCX", "UCXPY"))},
        },
        "results": results,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
