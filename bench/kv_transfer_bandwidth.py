"""KV transfer bandwidth: the UCX connector against raw ucxx, on shared memory and on TCP, by stage.

For each transfer size (SmolLM2-135M's KV layout: 30 layers, 3 KV heads, head size 64,
16-token blocks, bf16: 360 KiB a block; 64 blocks are a 1k-token prompt) and each transport
(``shm``: the producer is on this host, so UCX uses posix/sysv + cma; ``tcp``: the consumer
asks for TCP, as it does for a producer on another host), with the producer in another
process, it measures, interleaved round by round:

  connector_direct  ``UcxKvConsumer.pull`` of n blocks consecutive on both sides, cache to
                    cache, no staging: the consumer reads each (layer, K/V) run itself
                    (RMA GET, ``ucx_rma``; cma on shm, UCX's emulation over tcp), protocol
                    version 4: no frame before the reads, one confirmation after
  connector_v3      the same pull by a consumer of protocol version 3 (issue 34's "before",
                    in the same rounds): admission, reads (shm) or sends (tcp), then the
                    final status
  connector_sent    the same pull with the consumer's reads turned off
                    (``remote_read=False``): the producer sends each run as a tagged
                    message (the fallback for a peer that cannot be read)
  connector_staged  a pull of n scattered blocks into n shuffled ones: gather, layer
                    chunks on the wire, scatter (overlapped)
  raw               the network floor: one pre-allocated buffer of the same byte count,
                    one tagged message, same UCX runtime and transport as the connector
  raw_direct_shape  the same bytes cut as a direct pull of the previous, layer-major cache
                    layout had to cut them (2 * layers messages; the block-major cache
                    moves a run in one): what that message count alone cost
  gather, scatter   the staged pull's two copies alone (``BlockCopier``), in this process

The wire stage is ``raw``. Every variant is timed the same way (from the calling thread,
submit to result) and the order rotates every round, so that this shared machine's load
hits all alike. It prints GB/s and the ratios to raw (goal: >= 0.8, and >= 5 GB/s on
shared memory at 64 blocks) and writes ``bench/results/kv_transfer_bandwidth.json`` with
the machine and settings, including the lanes UCX chose for each endpoint.

``--device cuda`` puts both KV caches and the raw buffers in GPU memory (one GPU, two
processes): UCX then moves device memory (cuda_ipc between processes on one GPU where it
can, else staged through host memory; the lanes it chose are recorded), the staged
variants gather and scatter on the GPU, and a pull's transport is recorded, not asserted.

Run from the repository root: ``python -m bench.kv_transfer_bandwidth [--iters N] [--device D]``.
"""

from __future__ import annotations

import argparse
import asyncio
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
from engine_common.model.attention.kv_cache_layout import kv_cache_shape  # noqa: E402
from engine_common.model.kv_cache_memory import allocate_host_cache, page_policy  # noqa: E402
from kv_transfer.block_copy import BlockCopier, StagingBuffer  # noqa: E402
from kv_transfer.connector import KvHandle  # noqa: E402
from kv_transfer.layout import KvLayout  # noqa: E402
from kv_transfer.transfer_plan import DIRECT_MIN_MESSAGE_BYTES, plan_transfer  # noqa: E402
from kv_transfer.ucp_introspection import endpoint_lanes, transport_label  # noqa: E402
from kv_transfer.ucx_connector import UcxKvConsumer, UcxKvProducer  # noqa: E402
from kv_transfer.ucx_io import open_endpoint, post  # noqa: E402
from kv_transfer.ucx_runtime import UcxRuntime  # noqa: E402
from kv_transfer.wire import PREVIOUS_VERSION, PROTOCOL_VERSION, TransportKind  # noqa: E402

LAYOUT = KvLayout(
    model="HuggingFaceTB/SmolLM2-135M-Instruct",
    dtype="bfloat16",
    num_layers=30,
    num_kv_heads=3,
    head_size=64,
    block_size=16,
)
SIZES = [1, 8, 32, 64, 128, 256]
CACHE_BLOCKS = 320  # per side; > the largest pull so that scattered ids spread out
HOST = "127.0.0.1"
TRANSPORTS: tuple[TransportKind, ...] = ("shm", "tcp")
RAW_REQUEST_TAG = 7  # raw requests: [transport index, nbytes, messages, first tag]
RESULTS = Path(__file__).resolve().parent / "results" / "kv_transfer_bandwidth.json"


def make_cache(num_blocks: int, seed: int, device: str, pages: str = "4k") -> torch.Tensor:
    """A random cache; in host memory, ``pages`` is torch's 4 KiB pages ("4k") or a page
    policy of the engine's allocation (``kv_cache_memory.allocate_host_cache``: "huge",
    "huge-if-free")."""
    shape = kv_cache_shape(LAYOUT.num_layers, num_blocks, LAYOUT.block_size,
                           LAYOUT.num_kv_heads, LAYOUT.head_size)
    generator = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=generator)
    if pages != "4k" and device == "cpu":
        cache, memory = allocate_host_cache(shape, torch.int16, pages)
        print(f"cache of {num_blocks} blocks: {memory}", flush=True)
        return cache.copy_(bits).view(torch.bfloat16)
    return bits.view(torch.bfloat16).to(device)


def cache_pages(setting: str, role: str) -> str:
    """The page policy a ``role`` ("producer", "consumer") side's cache gets."""
    if setting == "engine":
        return page_policy("auto", role)
    return setting


def make_buffer(nbytes: int, device: str, fill: int) -> Any:
    """A raw transfer buffer UCX can read: numpy in host memory, a tensor on a GPU
    (ucxx reads its ``__cuda_array_interface__``)."""
    if device == "cpu":
        return np.full(nbytes, fill, dtype=np.uint8)
    return torch.full((nbytes,), fill, dtype=torch.uint8, device=device)


# -- producer process -----------------------------------------------------------------


async def _serve_raw(runtime: UcxRuntime, endpoint: Any, buffer: Any) -> None:
    import ucxx

    request = np.empty(3, dtype=np.uint64)
    while True:
        await ucxx.recv(request, tag=RAW_REQUEST_TAG)
        nbytes, count, tag = (int(x) for x in request)
        step = nbytes // count
        messages = [(buffer[i * step:(i + 1) * step], tag + i) for i in range(count)]
        sends = post(endpoint, messages, receive=False)  # held: it keeps the requests alive
        await asyncio.gather(*sends.futures)


async def _open_raw(runtime: UcxRuntime, address: bytes, buffer: Any) -> asyncio.Task[None]:
    """Serve raw requests (the task holds the endpoint: keep it)."""
    return asyncio.ensure_future(_serve_raw(runtime, await open_endpoint(address), buffer))


def _producer_main(conn: Connection, kind: TransportKind, device: str,
                   pages: str = "4k") -> None:
    """A producer process for one transport (as a deployment reaches each producer one way),
    with a raw server beside its connector."""
    producer = UcxKvProducer(make_cache(CACHE_BLOCKS, seed=1, device=device,
                                        pages=cache_pages(pages, "producer")), LAYOUT,
                             f"bench-{kind}", host=HOST)
    producer.start()
    runtime = UcxRuntime.shared(HOST)
    conn.send(runtime.worker_address(kind))
    raw_buffer = make_buffer(max(SIZES) * LAYOUT.bytes_per_block, device, fill=1)
    raw_server = runtime.call(_open_raw(runtime, conn.recv(), raw_buffer))
    conn.send(None)
    while True:
        command, args = conn.recv()
        if command == "pin":
            conn.send(producer.pin(*args))
        elif command == "release":
            conn.send(producer.release(*args))
        else:
            raw_server.cancel()
            producer.close()
            conn.send(None)
            return


# -- consumer side ----------------------------------------------------------------------


class RawClient:
    """Fetches n bytes cut into k messages from each producer's raw server."""

    def __init__(self, runtime: UcxRuntime, addresses: dict[TransportKind, bytes],
                 max_bytes: int, device: str):
        self._runtime = runtime
        self._buffer = make_buffer(max_bytes, device, fill=0)
        self._tag = 1 << 32
        self.endpoints = runtime.call(self._connect(addresses))

    @staticmethod
    async def _connect(addresses: dict[TransportKind, bytes]) -> dict[TransportKind, Any]:
        return {kind: await open_endpoint(address) for kind, address in addresses.items()}

    async def _fetch(self, kind: TransportKind, nbytes: int, count: int) -> None:
        self._tag += count
        step = nbytes // count
        receives = post(self.endpoints[kind], [
            (self._buffer[i * step:(i + 1) * step], self._tag + i) for i in range(count)],
            receive=True)
        request = np.array([nbytes, count, self._tag], dtype=np.uint64)
        await self.endpoints[kind].send(request, tag=RAW_REQUEST_TAG, force_tag=True)
        await asyncio.gather(*receives.futures)

    def fetch(self, kind: TransportKind, nbytes: int, count: int) -> float:
        started = time.perf_counter()
        self._runtime.call(self._fetch(kind, nbytes, count))
        return time.perf_counter() - started

    def lanes(self, kind: TransportKind) -> list[tuple[str, str]]:
        return endpoint_lanes(self.endpoints[kind].ucp_endpoint)


def time_pull(consumer: UcxKvConsumer, handle: KvHandle, remote: list[int], local: list[int],
              expect: tuple[str | None, str]) -> float:
    """Seconds for one pull; ``expect`` is (transport, mode), transport None: any."""
    started = time.perf_counter()
    result = consumer.pull(handle, remote, local, timeout=120).result()
    elapsed = time.perf_counter() - started
    assert result.mode == expect[1] and expect[0] in (None, result.transport), (result, expect)
    return elapsed


def time_copy(copy: Callable[[], None]) -> float:
    started = time.perf_counter()
    copy()
    return time.perf_counter() - started


@dataclasses.dataclass
class Bench:
    """Everything one size's rounds use."""

    producers: dict[TransportKind, Connection]  # to the producer process of each transport
    consumers: dict[TransportKind, dict[str, UcxKvConsumer]]  # transport -> mode -> consumer
    raw: RawClient
    copier: BlockCopier
    staging: StagingBuffer
    rng: random.Random
    device: str

    def runs(self, num_blocks: int
             ) -> tuple[dict[str, Callable[[], float]], list[tuple[TransportKind, str]]]:
        """The timed variants of one size, and the requests they pinned."""
        nbytes = num_blocks * LAYOUT.bytes_per_block
        contiguous = list(range(num_blocks))
        contiguous_local = list(range(CACHE_BLOCKS - num_blocks, CACHE_BLOCKS))
        scattered_remote = self.rng.sample(range(CACHE_BLOCKS), num_blocks)
        scattered_local = self.rng.sample(range(CACHE_BLOCKS), num_blocks)
        pinned: list[tuple[TransportKind, str]] = []
        runs: dict[str, Callable[[], float]] = {}
        for kind in TRANSPORTS:
            for mode, remote, local in (("direct", contiguous, contiguous_local),
                                        ("staged", scattered_remote, scattered_local)):
                request_id = f"bench-{num_blocks}-{kind}-{mode}"
                self.producers[kind].send(("pin", (request_id, remote, num_blocks * 16, 600.0)))
                handle = self.producers[kind].recv()
                pinned.append((kind, request_id))
                reads = self.device == "cpu" and mode == "direct"
                expect = (kind if self.device == "cpu" else None, "read" if reads else mode)
                runs[f"{kind}_connector_{mode}"] = functools.partial(
                    time_pull, self.consumers[kind][mode], handle, remote, local, expect)
                if mode == "direct":
                    runs[f"{kind}_connector_sent"] = functools.partial(
                        time_pull, self.consumers[kind]["sent"], handle, remote, local,
                        (expect[0], "direct"))
                    v3_reads = reads and kind == "shm"  # version 3 read on shm only
                    runs[f"{kind}_connector_v3"] = functools.partial(
                        time_pull, self.consumers[kind]["v3"], handle, remote, local,
                        (expect[0], "read" if v3_reads else "direct"))
            runs[f"{kind}_raw"] = functools.partial(self.raw.fetch, kind, nbytes, 1)
            runs[f"{kind}_raw_direct_shape"] = functools.partial(
                self.raw.fetch, kind, nbytes, 2 * LAYOUT.num_layers)
        out = self.staging.blocks(num_blocks)
        runs["gather"] = functools.partial(time_copy, functools.partial(
            self.copier.gather, scattered_remote, out, 0, LAYOUT.num_layers))
        runs["scatter"] = functools.partial(time_copy, functools.partial(
            self.copier.scatter, out, scattered_local, 0, LAYOUT.num_layers))
        return runs, pinned


def measure(bench: Bench, num_blocks: int, iters: int, warmup: int) -> dict[str, Any]:
    runs, pinned = bench.runs(num_blocks)
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    order = list(runs)
    for i in range(warmup + iters):
        # Rotate who goes first, so that no variant always follows another.
        for name in order[i % len(order):] + order[:i % len(order)]:
            elapsed = runs[name]()
            if i >= warmup:
                seconds[name].append(elapsed)
    for kind, request_id in pinned:
        bench.producers[kind].send(("release", (request_id,)))
        bench.producers[kind].recv()
    nbytes = num_blocks * LAYOUT.bytes_per_block
    default = plan_transfer(LAYOUT, list(range(num_blocks)), list(range(num_blocks)))
    row: dict[str, Any] = {"num_blocks": num_blocks, "bytes": nbytes,
                           "default_mode_for_consecutive_blocks": default.mode}
    for name, values in seconds.items():
        row[f"{name}_ms_median"] = round(statistics.median(values) * 1e3, 3)
        row[f"{name}_ms_min"] = round(min(values) * 1e3, 3)
        row[f"{name}_gbps"] = round(nbytes / statistics.median(values) / 1e9, 3)
    for kind in TRANSPORTS:
        raw = statistics.median(seconds[f"{kind}_raw"])
        for variant in ("connector_direct", "connector_v3", "connector_sent", "connector_staged",
                        "raw_direct_shape"):
            name = f"{kind}_{variant}"
            if name not in seconds:
                continue
            row[f"{name}_ratio"] = round(raw / statistics.median(seconds[name]), 3)
            # Best case against best case: less exposed to other tenants' load.
            row[f"{name}_ratio_of_min"] = round(min(seconds[f"{kind}_raw"]) /
                                                min(seconds[name]), 3)
            # Round by round: the variants of a round ran seconds apart.
            per_round = [r / v for r, v in zip(seconds[f"{kind}_raw"], seconds[name],
                                               strict=True)]
            row[f"{name}_ratio_per_round_median"] = round(statistics.median(per_round), 3)
    return row


def report_line(row: dict[str, Any]) -> str:
    parts = [f"{row['num_blocks']:4d} blocks {row['bytes'] / 2**20:6.1f} MiB"]
    for kind in TRANSPORTS:
        parts.append(
            f"{kind}: raw {row[f'{kind}_raw_gbps']:5.2f} direct "
            f"{row[f'{kind}_connector_direct_gbps']:5.2f} (x{row[f'{kind}_connector_direct_ratio']:.2f})"
            f" v3 {row[f'{kind}_connector_v3_gbps']:5.2f} (x{row[f'{kind}_connector_v3_ratio']:.2f})"
            f" sent {row[f'{kind}_connector_sent_gbps']:5.2f} "
            f"(x{row[f'{kind}_connector_sent_ratio']:.2f})" +
            f" staged {row[f'{kind}_connector_staged_gbps']:5.2f} "
            f"(x{row[f'{kind}_connector_staged_ratio']:.2f}) GB/s")
    parts.append(f"gather {row['gather_ms_median']:.1f} ms scatter {row['scatter_ms_median']:.1f} ms")
    return "  ".join(parts)


def start_bench(producers: dict[TransportKind, Connection], device: str,
                pages: str = "4k") -> Bench:
    runtime = UcxRuntime.shared(HOST)
    kv = make_cache(CACHE_BLOCKS, seed=2, device=device, pages=cache_pages(pages, "consumer"))
    consumers = {
        # Each mode forced, to see both at every size (the default policy's choice is
        # recorded with the results).
        kind: {mode: UcxKvConsumer(kv, LAYOUT, host=HOST,
                                   transport="auto" if kind == "shm" else "tcp",
                                   direct_min_message_bytes=2**62 if mode == "staged" else 0,
                                   remote_read=mode != "sent",
                                   protocol_version=PREVIOUS_VERSION if mode == "v3"
                                   else PROTOCOL_VERSION)
               for mode in ("direct", "v3", "sent", "staged")}
        for kind in TRANSPORTS}
    addresses = {kind: conn.recv() for kind, conn in producers.items()}
    raw = RawClient(runtime, addresses, max(max(SIZES), 512) * LAYOUT.bytes_per_block, device)
    for kind, conn in producers.items():
        conn.send(runtime.worker_address(kind))
        conn.recv()
    copier = BlockCopier(kv, LAYOUT)
    return Bench(producers, consumers, raw, copier, StagingBuffer(kv), random.Random(0),
                 device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--device", default="cpu", help="where both KV caches live: cpu or cuda")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)),
                        help="comma-separated pull sizes in blocks")
    parser.add_argument("--cache-pages", choices=("engine", "4k", "huge", "huge-if-free"),
                        default="engine",
                        help="host KV caches' pages: as the engine's (--kv-cache-pages auto: "
                        "huge on the producer, huge-if-free on the consumer), torch's 4 KiB "
                        "pages (the engine's before issue 34), or one policy for both")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    machine = report_machine()
    load_before = os.getloadavg()

    ctx = mp.get_context("spawn")
    producers: dict[TransportKind, Connection] = {}
    children = []
    for kind in TRANSPORTS:
        producers[kind], child_conn = ctx.Pipe()
        children.append(ctx.Process(target=_producer_main,
                                    args=(child_conn, kind, args.device, args.cache_pages),
                                    daemon=True))
        children[-1].start()

    import ucxx

    bench = start_bench(producers, args.device, args.cache_pages)
    results = []
    try:
        for num_blocks in sizes:
            row = measure(bench, num_blocks, args.iters, args.warmup)
            results.append(row)
            print(report_line(row), flush=True)
        lanes = {kind: bench.raw.lanes(kind) for kind in TRANSPORTS}
    finally:
        for by_mode in bench.consumers.values():
            for consumer in by_mode.values():
                consumer.close()
        for conn in producers.values():
            conn.send(("stop", ()))
            conn.recv()
        for child in children:
            child.join(10)

    runtime = UcxRuntime.shared(HOST)
    report = {
        "benchmark": "kv_transfer_bandwidth",
        "machine": machine,
        "settings": {
            "layout": dataclasses.asdict(LAYOUT),
            "bytes_per_block": LAYOUT.bytes_per_block,
            "sizes_blocks": sizes,
            "iters": args.iters,
            "warmup": args.warmup,
            "host": HOST,
            "device": args.device,
            "cache_pages": args.cache_pages,
            "raw_buffers": "numpy (numpy advises transparent huge pages for large arrays)",
            "gpu": torch.cuda.get_device_name() if args.device != "cpu" else None,
            "statistic": "median seconds per transfer, submit to result, from the calling "
            "thread; GB = 1e9 bytes; ratio = raw median s / variant median s on the same "
            "transport; ratio_of_min = raw min s / variant min s; ratio_per_round_median = "
            "median over rounds of raw s / variant s in that round",
            "direct_min_message_bytes": DIRECT_MIN_MESSAGE_BYTES,
            "ucxx": ucxx.__version__,
            "ucx": ".".join(map(str, ucxx.get_ucx_version())),
            "ucx_options": runtime.options,
            "lanes": {kind: [f"{t}/{d}" for t, d in lanes[kind]] for kind in TRANSPORTS},
            "transports": {kind: transport_label(lanes[kind]) for kind in TRANSPORTS},
            "ucx_env": {k: v for k, v in os.environ.items() if k.startswith(("UCX", "UCXPY"))},
        },
        "results": results,
        # The machine is shared with other agents' work: its load average (1, 5, 15 min)
        # when the run began and ended.
        "load_average": {"start": load_before, "end": os.getloadavg()},
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
