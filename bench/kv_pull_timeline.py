"""One read pull's timeline, stage boundary by stage boundary (issue 34's fixed cost per
pull): where a 1-block pull's time goes between ``UcxKvConsumer.pull`` and its result.

The consumer's own methods are wrapped (this script only, nothing changes in the
connector) to stamp ``time.perf_counter()`` at each boundary of the pull, in order:

  submit     ``pull`` called in this thread
  on_loop    ``_pull`` starts on the UCX runtime's loop (the hop)
  reads_in   ``_read_runs`` entered (lock, plan, checks before it)
  reads_out  the GETs landed
  confirmed  ``_confirm_reads`` returned (``ReadConfirm`` out, the status back)
  resolved   ``.result()`` returned in this thread (the hop back)

Run: ``python -m bench.kv_pull_timeline [--blocks 1] [--iters 60]``; the producer is
``bench.kv_transfer_bandwidth``'s (another process, SmolLM2-135M's layout). Writes
bench/results/kv_pull_timeline.json (medians of each interval, ms, per transport).
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
from kv_transfer.ucx_connector import UcxKvConsumer
from kv_transfer.ucx_runtime import UcxRuntime

RESULTS = Path(__file__).resolve().parent / "results" / "kv_pull_timeline.json"
MARKS = ("submit", "on_loop", "reads_in", "reads_out", "confirmed", "resolved")


def stamp(consumer: UcxKvConsumer, marks: dict[str, float]) -> None:
    """Wrap ``consumer``'s stages so that each pull records its boundaries in ``marks``."""
    pull, read_runs, confirm = consumer._pull, consumer._read_runs, consumer._confirm_reads

    async def timed_pull(*args: Any) -> Any:
        marks["on_loop"] = time.perf_counter()
        return await pull(*args)

    async def timed_reads(*args: Any) -> None:
        marks["reads_in"] = time.perf_counter()
        await read_runs(*args)
        marks["reads_out"] = time.perf_counter()

    async def timed_confirm(*args: Any) -> None:
        await confirm(*args)
        marks["confirmed"] = time.perf_counter()

    consumer._pull = timed_pull  # type: ignore[method-assign]
    consumer._read_runs = timed_reads  # type: ignore[method-assign]
    consumer._confirm_reads = timed_confirm  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1)
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    load_before = os.getloadavg()
    ctx = mp.get_context("spawn")
    producers, children = {}, []
    for kind in TRANSPORTS:
        producers[kind], child = ctx.Pipe()
        children.append(ctx.Process(target=_producer_main, args=(child, kind, "cpu", "engine"),
                                    daemon=True))
        children[-1].start()
    runtime = UcxRuntime.shared(HOST)
    kv = make_cache(CACHE_BLOCKS, seed=2, device="cpu", pages="huge-if-free")
    # As kv_pull_profile: the raw client's endpoints too (reads over TCP on a process
    # pair without them stalled here, as docs/kv-transfer.md's "Reads over TCP" tells).
    addresses = {kind: conn.recv() for kind, conn in producers.items()}
    raw = RawClient(runtime, addresses, 512 * LAYOUT.bytes_per_block, "cpu")
    for kind, conn in producers.items():
        conn.send(runtime.worker_address(kind))
        conn.recv()
    marks: dict[str, float] = {}
    consumers = {kind: UcxKvConsumer(kv, LAYOUT, host=HOST,
                                     transport="auto" if kind == "shm" else "tcp",
                                     direct_min_message_bytes=0) for kind in TRANSPORTS}
    for consumer in consumers.values():
        stamp(consumer, marks)
    remote = list(range(args.blocks))
    local = list(range(CACHE_BLOCKS - args.blocks, CACHE_BLOCKS))
    intervals: dict[str, dict[str, list[float]]] = {kind: {} for kind in TRANSPORTS}
    try:
        handles = {}
        for kind in TRANSPORTS:
            producers[kind].send(("pin", ("timeline", remote, args.blocks * 16, 600.0)))
            handles[kind] = producers[kind].recv()
            consumers[kind].pull(handles[kind], remote, local, 60).result()  # warm
        for i in range(args.iters):
            for kind in TRANSPORTS if i % 2 else TRANSPORTS[::-1]:
                marks.clear()
                marks["submit"] = time.perf_counter()
                result = consumers[kind].pull(handles[kind], remote, local, 60).result()
                marks["resolved"] = time.perf_counter()
                assert result.mode == "read", result
                for before, after in zip(MARKS, MARKS[1:], strict=False):
                    intervals[kind].setdefault(f"{before}->{after}", []).append(
                        (marks[after] - marks[before]) * 1e3)
                intervals[kind].setdefault("pull", []).append(
                    (marks["resolved"] - marks["submit"]) * 1e3)
    finally:
        del raw
        for consumer in consumers.values():
            consumer.close()
        for conn in producers.values():
            conn.send(("stop", ()))
            conn.recv()
        for child in children:
            child.join(10)
    rows = {kind: {name: round(statistics.median(values), 3) for name, values in by.items()}
            for kind, by in intervals.items()}
    for kind, row in rows.items():
        print(kind, json.dumps(row))
    report = {"benchmark": "kv_pull_timeline", "machine": report_machine(),
              "settings": {"blocks": args.blocks, "iters": args.iters,
                           "statistic": "median ms of each interval over pulls, the two "
                           "transports alternated"},
              "load_average": {"start": load_before, "end": os.getloadavg()},
              "results": rows, "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
