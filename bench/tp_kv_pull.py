"""Per-rank KV pulls (``kv_transfer.rank_reader``) against the single-rank pull, on shared memory or TCP.

SmolLM2-135M's KV layout (30 layers, 3 KV heads of 64, 16-token blocks, bf16: 360 KiB a
block over all heads), whose 3 KV heads split 2 and 1 over two ranks. Each producer rank
is its own process with its cache mapped for reads (as a prefill worker maps its own); the
consumer ranks' reads are timed in this process, interleaved round by round:

  tp1_to_tp1        the consumer reads all 3 heads from one producer: one GET per run of
                    blocks (what a single-rank pull's reads are)
  tp2_to_tp1        the one consumer rank reads heads 0-1 from producer rank 0 and head 2
                    from producer rank 1: a GET per (block, layer, K/V) from each
  tp1_to_tp2_rank0  decode rank 0 of two reads its heads 0-1 from the one producer
  tp1_to_tp2_rank1  decode rank 1 reads its head 2 (each rank reads at once, in its own
                    process, in a real replica: a pull takes the slower of the two)

``--transport tcp``: the same reads over UCX's TCP transport on loopback (each producer
rank offers its network-only worker address and answers wire-ups, ``rank_wire_up``; the
first round opens and wires up the endpoints, untimed).

Every read is checked against the producer's bytes once. Prints milliseconds and GB/s
(median of the rounds) and writes ``bench/results/tp_kv_pull.json`` (``tp_kv_pull_tcp.json``
over TCP) with the machine and the load average. Run from the repository root:
``python -m bench.tp_kv_pull [--rounds N] [--transport tcp]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pickle
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
LAYERS, HEADS, HEAD, BLOCK = 30, 3, 64, 16


def _cache(heads: int, blocks: int, first_head: int) -> torch.Tensor:
    """A cache whose every element says which block, layer, K/V and head it is."""
    shape = (blocks, LAYERS, 2, heads, BLOCK, HEAD)
    b, layer, kv, h = torch.meshgrid(*(torch.arange(n) for n in shape[:4]), indexing="ij")
    code = ((b * 64 + layer) * 2 + kv) * 8 + h + first_head
    return (code.to(torch.float32)[..., None, None] % 251).expand(shape).to(torch.bfloat16) \
        .contiguous()


def _serve(rank: int, first_head: int, heads: int, blocks: int, conn: Connection) -> None:
    from kv_transfer.rank_layout import RankCache
    from kv_transfer.rank_wire_up import answer_wire_ups
    from kv_transfer.ucx_runtime import UcxRuntime

    cache = _cache(heads, blocks, first_head)
    runtime = UcxRuntime.shared("127.0.0.1")

    async def mapped():  # type: ignore[no-untyped-def]
        import ucxx

        from kv_transfer.ucx_rma import MappedMemory

        return MappedMemory(ucxx.core._get_ctx().context.handle, cache.data_ptr(),
                            cache.numel() * cache.element_size())
    memory = runtime.call(mapped(), timeout=30)
    answer_wire_ups(runtime)
    conn.send(pickle.dumps(RankCache(rank, first_head, heads, runtime.worker_address("shm"),
                                     memory.rkey, memory.address, blocks,
                                     runtime.worker_address("tcp"))))
    conn.recv()  # until the consumer is done
    memory.close()


def _producers(splits: list[tuple[int, int]], blocks: int) -> tuple[list, list]:
    ctx = mp.get_context("spawn")
    caches, procs = [], []
    for rank, (first, count) in enumerate(splits):
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(rank, first, count, blocks, theirs), daemon=True)
        proc.start()
        caches.append(pickle.loads(ours.recv()))
        procs.append((proc, ours))
    return caches, procs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--blocks", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--transport", choices=("shm", "tcp"), default="shm")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    tcp = args.transport == "tcp"
    if args.out is None:
        args.out = ROOT / "bench" / "results" / f"tp_kv_pull{'_tcp' if tcp else ''}.json"
    sys.path.insert(0, str(ROOT))
    from bench.report import machine
    from kv_transfer.layout import KvLayout
    from kv_transfer.rank_layout import kv_head_range, plan_heads
    from kv_transfer.rank_reader import RankReader
    from kv_transfer.ucx_runtime import UcxRuntime

    capacity = max(args.blocks)
    one, one_procs = _producers([(0, HEADS)], capacity)
    two, two_procs = _producers([kv_head_range(HEADS, r, 2) for r in range(2)], capacity)
    one, two = ([c.reached_over(args.transport) for c in caches] for caches in (one, two))
    runtime = UcxRuntime.shared("127.0.0.1")
    results: dict[str, dict[str, object]] = {}
    for blocks in args.blocks:
        # Consecutive blocks on both sides: a single-rank pull's best case (one GET).
        remote, local = list(range(0, blocks)), list(range(blocks))
        cases = {}
        for name, producers, heads in (
                ("tp1_to_tp1", one, (0, HEADS)), ("tp2_to_tp1", two, (0, HEADS)),
                ("tp1_to_tp2_rank0", one, kv_head_range(HEADS, 0, 2)),
                ("tp1_to_tp2_rank1", one, kv_head_range(HEADS, 1, 2))):
            cache = torch.zeros(blocks, LAYERS, 2, heads[1], BLOCK, HEAD, dtype=torch.bfloat16)
            layout = KvLayout("m", "bfloat16", LAYERS, heads[1], HEAD, BLOCK)
            reader = RankReader(cache, layout, heads[0], "127.0.0.1")
            plan = plan_heads(producers, heads)
            cases[name] = (reader, producers, plan, cache, heads)
        seconds: dict[str, list[float]] = {name: [] for name in cases}
        for round_index in range(args.rounds + 1):
            order = list(cases)[round_index % 4:] + list(cases)[:round_index % 4]
            for name in order:
                reader, producers, plan, cache, heads = cases[name]
                cache.zero_()
                started = time.perf_counter()
                runtime.call(reader.read(producers, plan, remote, local, tcp), timeout=60)
                if round_index:  # the first round opens the endpoints
                    seconds[name].append(time.perf_counter() - started)
                else:
                    expected = _cache(HEADS, blocks, 0)[:, :, :, heads[0]:heads[0] + heads[1]]
                    assert torch.equal(cache, expected), name
        for name, (_, _, plan, cache, _) in cases.items():
            median = statistics.median(seconds[name])
            nbytes = cache.numel() * cache.element_size()
            results[f"{name} x{blocks}"] = {
                "blocks": blocks, "bytes": nbytes, "median_ms": median * 1e3,
                "GB_per_s": nbytes / median / 1e9, "head_reads": len(plan),
                "rounds": len(seconds[name])}
            print(f"{name:18s} {blocks:4d} blocks {nbytes / 2**20:7.1f} MiB "
                  f"{median * 1e3:8.2f} ms {nbytes / median / 1e9:6.2f} GB/s")
        for reader, *_ in cases.values():
            reader.close()
    for proc, conn in one_procs + two_procs:
        conn.send(None)
        proc.join(10)
    report = {"machine": machine(), "load_average": os.getloadavg(),
              "transport": args.transport, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"load average {os.getloadavg()}; wrote {args.out}")


if __name__ == "__main__":
    main()
