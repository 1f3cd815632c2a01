"""Which wire-up makes a UCX GET over TCP complete on a fresh endpoint (``rank_wire_up``).

A producer process maps 1 MiB for reads; the consumer (this process) opens an endpoint to
the producer worker's network-only address and GETs 64 KiB, after one of these:

  none          nothing: the GET is posted straight away
  back          the consumer sends its address; the producer opens an endpoint back and
                sends a 64 KiB (rendezvous) message on it (the connector's control
                endpoint's way, ``UcxKvConsumer._until_wired``)
  ahead-back    as ``back``, but the consumer had opened an endpoint to the producer's
                full address first (its next endpoint is no longer the producer's peer
                by UCX's endpoint numbering)
  consumer      the consumer sends one 64 KiB message on its own endpoint, which the
                producer's worker receives (``rank_wire_up.wire_up``, what per-rank
                readers do)
  ahead-consumer  as ``consumer``, after an endpoint opened first

Each case runs in a fresh pair of processes, ``--tries`` times; a GET counts as completed
if it ended within 5 s with the right bytes. Writes ``bench/results/tcp_get_wire_up.json``
with the machine and the load average. Run from the repository root:
``python -m bench.tcp_get_wire_up [--tries N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CASES = ("none", "back", "ahead-back", "consumer", "ahead-consumer")
BACK_TAG = 0x5258 << 48  # the "back" cases' own tags
READ_BYTES, OFFSET = 1 << 16, 4096


def _producer(case: str, conn: Connection) -> None:
    sys.path.insert(0, str(ROOT))
    import torch

    from kv_transfer.rank_wire_up import answer_wire_ups
    from kv_transfer.ucx_io import open_endpoint, post
    from kv_transfer.ucx_rma import MappedMemory
    from kv_transfer.ucx_runtime import UcxRuntime
    from kv_transfer.wire import WIRE_UP_BYTES

    memory = torch.arange(1 << 20, dtype=torch.int64).to(torch.uint8)
    runtime = UcxRuntime.shared("127.0.0.1")

    async def mapped() -> MappedMemory:
        import ucxx

        return MappedMemory(ucxx.core._get_ctx().context.handle, memory.data_ptr(),
                            memory.numel())

    async def answer_back() -> None:
        import ucxx
        from ucxx._lib.arr import Array
        from ucxx.types import Tag, TagMaskFull

        request = np.zeros(4096, dtype=np.uint8)
        buffer = Array(request)
        received = ucxx.core._get_ctx().worker.tag_recv(buffer, Tag(BACK_TAG), TagMaskFull)
        await received.future
        length = int.from_bytes(request[:2].tobytes(), "little")
        endpoint = await open_endpoint(request[2:2 + length].tobytes())
        answer = np.zeros(WIRE_UP_BYTES, dtype=np.uint8)
        sent = post(endpoint, [(answer, BACK_TAG + 1)], receive=False)
        await asyncio.gather(*sent.futures)
        await asyncio.sleep(3600)  # the endpoint back stays open

    mapping = runtime.call(mapped(), timeout=30)
    answer_wire_ups(runtime)
    if case.endswith("back"):
        runtime.submit(answer_back())
    conn.send((runtime.worker_address("tcp"), runtime.worker_address("shm"), mapping.rkey,
               mapping.address))
    conn.recv()


async def _consume(case: str, tcp: bytes, full: bytes, rkey: bytes, base: int) -> bool:
    import torch
    import ucxx

    from kv_transfer.rank_wire_up import wire_up
    from kv_transfer.ucx_io import open_endpoint, post
    from kv_transfer.ucx_rma import Reader, RemoteKey
    from kv_transfer.ucx_runtime import UcxRuntime
    from kv_transfer.wire import WIRE_UP_BYTES

    if case.startswith("ahead"):
        await open_endpoint(full)
    endpoint = await open_endpoint(tcp)
    if case.endswith("back"):
        own = UcxRuntime.shared("127.0.0.1").worker_address("tcp")
        request = np.zeros(4096, dtype=np.uint8)
        request[:2 + len(own)] = np.frombuffer(len(own).to_bytes(2, "little") + own,
                                               dtype=np.uint8)
        answer = np.zeros(WIRE_UP_BYTES, dtype=np.uint8)
        received = post(endpoint, [(answer, BACK_TAG + 1)], receive=True)
        sent = post(endpoint, [(request, BACK_TAG)], receive=False)
        await asyncio.wait_for(asyncio.gather(*received.futures, *sent.futures), 10)
    elif case.endswith("consumer"):
        await wire_up(endpoint, 10)
    out = torch.zeros(READ_BYTES, dtype=torch.uint8)
    reader = Reader()
    burst = reader.get(endpoint.ucp_endpoint, RemoteKey(endpoint.ucp_endpoint, rkey),
                       [(out.data_ptr(), READ_BYTES, base + OFFSET)])
    over = await asyncio.to_thread(burst.wait, int(ucxx.get_ucp_worker()), 5.0)
    expected = torch.arange(OFFSET, OFFSET + READ_BYTES, dtype=torch.int64).to(torch.uint8)
    return over and not burst.error and torch.equal(out, expected)


def _try(case: str) -> dict[str, object]:
    """One try in a fresh consumer process (this one's child) and a fresh producer."""
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    producer = ctx.Process(target=_producer, args=(case, theirs), daemon=True)
    producer.start()
    try:
        tcp, full, rkey, base = ours.recv()
        reply, result = ctx.Pipe()
        consumer = ctx.Process(target=_consumer, args=(case, tcp, full, rkey, base, result),
                               daemon=True)
        consumer.start()
        if not reply.poll(120):
            raise RuntimeError(f"{case}: the consumer process did not report")
        ok, seconds = reply.recv()
        consumer.join(10)
    finally:
        producer.kill()
    return {"completed": ok, "seconds": seconds}


def _consumer(case: str, tcp: bytes, full: bytes, rkey: bytes, base: int, result: Connection
              ) -> None:
    sys.path.insert(0, str(ROOT))
    from kv_transfer.ucx_runtime import UcxRuntime

    runtime = UcxRuntime.shared("127.0.0.1")
    started = time.perf_counter()
    ok = runtime.call(_consume(case, tcp, full, rkey, base), timeout=60)
    result.send((ok, time.perf_counter() - started))
    os._exit(0)  # an unfinished GET must not hold the process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tries", type=int, default=3)
    parser.add_argument("--out", type=Path,
                        default=ROOT / "bench" / "results" / "tcp_get_wire_up.json")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from bench.report import machine

    results: dict[str, list[dict[str, object]]] = {case: [] for case in CASES}
    for _ in range(args.tries):
        for case in CASES:
            results[case].append(_try(case))
            print(case, results[case][-1], flush=True)
    report = {"machine": machine(), "load_average": os.getloadavg(), "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"load average {os.getloadavg()}; wrote {args.out}")


if __name__ == "__main__":
    main()
