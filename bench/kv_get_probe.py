"""Why a cma GET is slower than a tagged rendezvous of the same bytes: one process pair, the
same buffers, interleaved rounds, CPU time per variant.

The producer process maps an N-byte buffer for reads (``ucx_rma.MappedMemory``) and serves
raw requests (one tagged message of N bytes from the same buffer). The consumer moves the N
bytes into one destination buffer, round by round, each variant in turn:

  raw          a tagged message (UCX: rendezvous, the receiver reads by cma zero-copy);
               ucxx's progress thread progresses it (woken by the rendezvous message)
  get_copy     ``ucp_get_nbx`` posted on the runtime's loop, progressed there for 2 ms,
               then on a copy thread (``ReadBurst.wait``): the connector's read path
               before issue 34's fix
  get_signal   ``ucp_get_nbx`` posted on the loop, then ``ucp_worker_signal``: ucxx's
               progress thread wakes and progresses it (a worker with cma work in flight
               refuses to sleep), nobody else; the caller waits on the completion (the
               connector's read path of more than 1 MiB since the fix)
  get_caller   posted and progressed on the calling thread alone (no loop, no hop)

Per variant: wall ms (median), the CPU time of the consumer's and the producer's processes
and of the consumer's threads by name during the transfer (``/proc/*/schedstat``), and the
consumer's minor page faults (first touches of the destination would show there).

Run: ``python -m bench.kv_get_probe [--blocks 64] [--rounds 15]``; ``UCX_PROTO_INFO=y``
prints the protocols UCX chose; ``UCX_CMA_SEG_SIZE`` / ``UCX_CMA_TX_QUOTA`` change how much
each progress call copies.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kv_transfer.ucx_io import open_endpoint, post  # noqa: E402
from kv_transfer.ucx_rma import MappedMemory, Reader, RemoteKey, wake_worker  # noqa: E402
from kv_transfer.ucx_runtime import UcxRuntime  # noqa: E402

HOST = "127.0.0.1"
BLOCK_BYTES = 368_640
REQUEST_TAG = 7
RESULTS = Path(__file__).resolve().parent / "results" / "kv_get_probe.json"


def _allocate(nbytes: int, fill: int, alloc: str) -> Any:
    """A buffer as the raw bench makes it (numpy) or as a KV cache is (torch)."""
    if alloc == "numpy":
        return np.full(nbytes, fill, dtype=np.uint8)
    import torch

    return torch.full((nbytes,), fill, dtype=torch.uint8).numpy()  # same memory


def _producer(conn: Connection, nbytes: int, alloc: str) -> None:
    import ucxx

    runtime = UcxRuntime.shared(HOST)
    buffer = _allocate(nbytes, 3, alloc.split(",")[0])
    mapped = MappedMemory(ucxx.core._get_ctx().context.handle, buffer.ctypes.data, nbytes)
    conn.send((runtime.worker_address("shm"), mapped.rkey, mapped.address, os.getpid()))

    async def serve(address: bytes) -> None:
        endpoint = await open_endpoint(address)
        request = np.empty(1, dtype=np.uint64)
        while True:
            await ucxx.recv(request, tag=REQUEST_TAG)
            sent = post(endpoint, [(buffer, int(request[0]))], receive=False)
            await asyncio.gather(*sent.futures)

    task = runtime.submit(serve(conn.recv()))
    conn.recv()
    task.cancel()
    mapped.close()


def _tasks_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of ``pid`` (``schedstat``: nanoseconds on a CPU)."""
    out: dict[int, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = int((task / "schedstat").read_text().split()[0]) / 1e9
        except OSError:
            continue
    return out


def _cpu_of(pid: int) -> float:
    return sum(_tasks_cpu(pid).values())


def _threads_cpu() -> dict[str, float]:
    """CPU seconds of this process's threads, by Python thread name (others: "ucxx/<tid>",
    ucxx's progress and notifier threads)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    return {names.get(tid, f"ucxx/{tid}"): cpu for tid, cpu in _tasks_cpu(os.getpid()).items()}


class Probe:
    def __init__(self, conn: Connection, nbytes: int, alloc: str):
        import ucxx

        self.runtime = UcxRuntime.shared(HOST)
        self.nbytes = nbytes
        address, rkey, self.remote, self.producer_pid = conn.recv()
        self.dest = _allocate(nbytes, 0, alloc.split(",")[-1])
        self.endpoint = self.runtime.call(open_endpoint(address))
        conn.send(self.runtime.worker_address("shm"))
        self.rkey = RemoteKey(self.endpoint.ucp_endpoint, rkey)
        self.reader = Reader()
        self.worker = int(ucxx.get_ucp_worker())
        self.tag = 1 << 40

    def _reads(self) -> list[tuple[int, int, int]]:
        return [(self.dest.ctypes.data, self.nbytes, self.remote)]

    async def _raw(self) -> None:
        self.tag += 1
        received = post(self.endpoint, [(self.dest, self.tag)], receive=True)
        await self.endpoint.send(np.array([self.tag], dtype=np.uint64), tag=REQUEST_TAG,
                                 force_tag=True)
        await asyncio.gather(*received.futures)

    def raw(self) -> None:
        self.runtime.call(self._raw())

    async def _get_copy(self) -> None:
        burst = self.reader.get(self.endpoint.ucp_endpoint, self.rkey, self._reads())
        if not burst.wait(self.worker, 0.002):
            assert await self.runtime.run_copy(lambda: burst.wait(self.worker, 10.0))
        self.reader.forget(burst)
        burst.raise_for_failure()

    def get_copy(self) -> None:
        self.runtime.call(self._get_copy())

    async def _post_signal(self) -> Any:
        burst = self.reader.get(self.endpoint.ucp_endpoint, self.rkey, self._reads())
        wake_worker(self.worker)
        return burst

    def get_signal(self) -> None:
        burst = self.runtime.call(self._post_signal())
        assert burst._over.wait(10.0)
        self.reader.forget(burst)
        burst.raise_for_failure()

    def get_caller(self) -> None:
        burst = self.reader.get(self.endpoint.ucp_endpoint, self.rkey, self._reads())
        assert burst.wait(self.worker, 10.0)
        self.reader.forget(burst)
        burst.raise_for_failure()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--variants", default="raw,get_copy,get_signal,get_caller")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--alloc", default="numpy",
                        help="who allocates the buffers, numpy or torch, both or "
                        "PRODUCER,CONSUMER (the bench's raw buffers are numpy, KV caches torch)")
    args = parser.parse_args()
    nbytes = args.blocks * BLOCK_BYTES
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_producer, args=(child, nbytes, args.alloc), daemon=True)
    process.start()
    probe = Probe(parent, nbytes, args.alloc)
    names = args.variants.split(",")
    stats: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    load = [os.getloadavg()]
    for i in range(args.warmup + args.rounds):
        for name in names[i % len(names):] + names[:i % len(names)]:
            probe.dest.fill(0)
            threads, peer = _threads_cpu(), _cpu_of(probe.producer_pid)
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            cpu, started = time.process_time(), time.perf_counter()
            getattr(probe, name)()
            wall = time.perf_counter() - started
            cpu = time.process_time() - cpu
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            after = _threads_cpu()
            assert (probe.dest == 3).all(), name
            if i < args.warmup:
                continue
            row = stats[name]
            row.setdefault("wall_ms", []).append(wall * 1e3)
            row.setdefault("consumer_cpu_ms", []).append(cpu * 1e3)
            row.setdefault("consumer_minor_faults", []).append(faults)
            row.setdefault("producer_cpu_ms", []).append((_cpu_of(probe.producer_pid) - peer) * 1e3)
            for thread, seconds in after.items():
                spent = (seconds - threads.get(thread, 0.0)) * 1e3
                if spent > 0.05 or f"thread[{thread}]_cpu_ms" in row:
                    row.setdefault(f"thread[{thread}]_cpu_ms", []).append(spent)
    load.append(os.getloadavg())
    parent.send(None)
    process.join(5)
    summary = {name: {key: round(statistics.median(values), 2) for key, values in row.items()}
               for name, row in stats.items()}
    raw = summary.get("raw", {}).get("wall_ms")
    for name, row in summary.items():
        if raw:
            row["ratio_to_raw"] = round(raw / row["wall_ms"], 3)
        print(name, json.dumps(row), flush=True)
    report = {"benchmark": "kv_get_probe", "blocks": args.blocks, "bytes": nbytes,
              "alloc": args.alloc,
              "rounds": args.rounds, "statistic": "medians over interleaved rounds",
              "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX")},
              "load_average": load, "results": summary,
              "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
