"""Where a KV pull's time goes, stage by stage (issue 34): the connector's read pull (protocol
version 4) against raw UCX, on shared memory and on TCP, at 1 block (the fixed cost) and 64.

The producer runs in another process (``bench.kv_transfer_bandwidth``'s, SmolLM2-135M's
layout). Each round, in rotating order, it times from the calling thread:

  pull      ``UcxKvConsumer.pull(...).result()``: the whole pull
  hop       a no-op coroutine submitted to the UCX runtime's loop and its result back: the
            thread hand-off every pull pays (the engine calls ``pull`` from its own thread)
  reads     on the loop, the pull's GETs posted and waited for (``_read_runs``), alone
  confirm   on the loop, one ``ReadConfirm`` and the producer's answer: the one control
            round trip a read pull pays
  raw       raw ucxx: one tagged message of the same bytes (request + receive)

The rest of a pull (plan, checks, Python between stages) is ``pull - hop - reads - confirm``.
Results: bench/results/kv_pull_profile.json. Run: ``python -m bench.kv_pull_profile``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path
from typing import Any

from bench.kv_transfer_bandwidth import (
    CACHE_BLOCKS,
    HOST,
    LAYOUT,
    TRANSPORTS,
    RawClient,
    _producer_main,
    make_cache,
)
from bench.report import machine as report_machine
from kv_transfer.connector import KvHandle
from kv_transfer.transfer_plan import plan_transfer
from kv_transfer.ucx_connector import UcxKvConsumer
from kv_transfer.ucx_runtime import UcxRuntime
from kv_transfer.wire import ReadConfirm, TransferStatus, read_frame

RESULTS = Path(__file__).resolve().parent / "results" / "kv_pull_profile.json"


async def _noop() -> None:
    return None


def _stage_reads(consumer: UcxKvConsumer, handle: KvHandle, remote: list[int],
                 local: list[int]) -> float:
    async def run() -> float:
        peer = consumer._peers[(handle.host, handle.port)]
        async with peer.lock:
            assert peer.connection is not None
            plan = plan_transfer(LAYOUT, remote, local, direct_min_message_bytes=0)
            started = time.perf_counter()
            await consumer._read_runs(peer.connection, plan)
            return time.perf_counter() - started

    return consumer._runtime.call(run())


def _stage_confirm(consumer: UcxKvConsumer, handle: KvHandle, remote: list[int]) -> float:
    async def run() -> float:
        peer = consumer._peers[(handle.host, handle.port)]
        async with peer.lock:
            connection = peer.connection
            assert connection is not None
            started = time.perf_counter()
            connection.writer.write(ReadConfirm(connection.next_seq(), handle.request_id,
                                                remote, handle.lease_generation).encode())
            TransferStatus.decode(await read_frame(connection.reader, "status")
                                  ).raise_for_failure()
            return time.perf_counter() - started

    return consumer._runtime.call(run())


def _timed(fn: Any) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def profile(consumer: UcxKvConsumer, raw: RawClient, kind: str, handle: KvHandle,
            num_blocks: int, iters: int) -> dict[str, Any]:
    remote = list(range(num_blocks))
    local = list(range(CACHE_BLOCKS - num_blocks, CACHE_BLOCKS))
    nbytes = num_blocks * LAYOUT.bytes_per_block
    runtime = consumer._runtime
    stages = {
        "pull": lambda: _timed(lambda: consumer.pull(handle, remote, local, 60).result()),
        "hop": lambda: _timed(lambda: runtime.call(_noop())),
        "reads": lambda: _stage_reads(consumer, handle, remote, local),
        "confirm": lambda: _stage_confirm(consumer, handle, remote),
        "raw": lambda: raw.fetch(kind, nbytes, 1),  # type: ignore[arg-type]
    }
    consumer.pull(handle, remote, local, 60).result()  # connected, warm
    seconds: dict[str, list[float]] = {name: [] for name in stages}
    order = list(stages)
    for i in range(iters):
        for name in order[i % len(order):] + order[:i % len(order)]:
            seconds[name].append(stages[name]())
    row: dict[str, Any] = {"transport": kind, "num_blocks": num_blocks, "bytes": nbytes}
    for name, values in seconds.items():
        row[f"{name}_ms_median"] = round(statistics.median(values) * 1e3, 3)
    row["rest_ms_median"] = round(row["pull_ms_median"] - row["hop_ms_median"]
                                  - row["reads_ms_median"] - row["confirm_ms_median"], 3)
    row["pull_ratio_to_raw"] = round(row["raw_ms_median"] / row["pull_ms_median"], 3)
    row["reads_ratio_to_raw"] = round(row["raw_ms_median"] / row["reads_ms_median"], 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--sizes", default="1,64")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    load_before = os.getloadavg()
    ctx = mp.get_context("spawn")
    producers, children = {}, []
    for kind in TRANSPORTS:
        producers[kind], child = ctx.Pipe()
        children.append(ctx.Process(target=_producer_main, args=(child, kind, "cpu"),
                                    daemon=True))
        children[-1].start()
    runtime = UcxRuntime.shared(HOST)
    kv = make_cache(CACHE_BLOCKS, seed=2, device="cpu")
    addresses = {kind: conn.recv() for kind, conn in producers.items()}
    raw = RawClient(runtime, addresses, 512 * LAYOUT.bytes_per_block, "cpu")
    for kind, conn in producers.items():
        conn.send(runtime.worker_address(kind))
        conn.recv()
    rows = []
    consumers = {kind: UcxKvConsumer(kv, LAYOUT, host=HOST,
                                     transport="auto" if kind == "shm" else "tcp",
                                     direct_min_message_bytes=0) for kind in TRANSPORTS}
    try:
        for num_blocks in [int(s) for s in args.sizes.split(",")]:
            for kind in TRANSPORTS:
                producers[kind].send(("pin", (f"profile-{num_blocks}", list(range(num_blocks)),
                                              num_blocks * 16, 600.0)))
                handle = producers[kind].recv()
                row = profile(consumers[kind], raw, kind, handle, num_blocks, args.iters)
                rows.append(row)
                print(json.dumps(row), flush=True)
                producers[kind].send(("release", (f"profile-{num_blocks}",)))
                producers[kind].recv()
    finally:
        for consumer in consumers.values():
            consumer.close()
        for conn in producers.values():
            conn.send(("stop", ()))
            conn.recv()
        for child in children:
            child.join(10)
    report = {"benchmark": "kv_pull_profile", "machine": report_machine(),
              "settings": {"iters": args.iters, "layout": LAYOUT.__dict__,
                           "statistic": "median ms over rounds, stages interleaved"},
              "load_average": {"start": load_before, "end": os.getloadavg()},
              "results": rows,
              "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
