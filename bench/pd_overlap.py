"""P/D with the KV transfer overlapped with the prefill's compute, against P/D without it and
one aggregated replica (issue 24 goal 2).

Starts, side by side on this machine, a prefill + decode pair with ``--kv-overlap on`` (the
prefill replica computes long prompts in chunks of ``--chunk-tokens`` and announces each
chunk's blocks; the decode replica pulls them while later chunks compute), a pair with
``--kv-overlap off`` (today's flow: the pull begins once the whole prompt is computed) and
one ``both`` replica, all on the default model. For each prompt length, in interleaved rounds
(the variants' order rotating round by round, each request a fresh random prompt, so no
prefix-cache hits), it measures through ``Engine.Generate``:

- TTFT (request sent to the first token's message) and the first inter-token gap (first to
  second token), for P/D with overlap, P/D without, and the aggregated replica;
- the prefill replicas' compute time alone for the same prompt: ``Engine.Prefill`` on each
  prefill replica (no transfer), request sent to its answer. The overlap pair's prefill
  replica chunks, the other does not: their ratio is the compute cost of chunking.

The decode replica streams the prefill replica's first token at once, so a transfer that is
not hidden shows in the first inter-token gap rather than TTFT: both, and their sum (the time
to the second token), are reported. Before starting replicas it also times the offline
engine's prefill at several chunk sizes (the compute cost of chunking, without any process
boundary). Results, machine and settings: bench/results/pd_overlap.json.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.process_cpu import host_busy_seconds, tree_cpu_seconds  # noqa: E402
from bench.report import machine, write_report  # noqa: E402
from engine_common.default_model import ensure_default_model  # noqa: E402
from protos.tandem.v1 import engine_pb2 as epb  # noqa: E402
from protos.tandem.v1 import engine_pb2_grpc as epb_grpc  # noqa: E402

PD_VARIANTS = ("pd_overlap", "pd_no_overlap", "aggregated")
COMPUTE_VARIANTS = ("compute_chunked", "compute_whole")


@dataclass
class Replica:
    name: str
    process: subprocess.Popen[bytes]
    port: int

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"


def start_replica(name: str, model: str, port: int, args: list[str], logs: Path) -> Replica:
    with open(logs / f"{name}.log", "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "services.replica", "--model", model, "--host", "127.0.0.1",
             "--port", str(port), "--metrics-port", "0", "--engine-id", name, *args],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return Replica(name, process, port)


def wait_serving(replicas: list[Replica], timeout: float = 900.0) -> None:
    deadline = time.monotonic() + timeout
    for replica in replicas:
        with grpc.insecure_channel(replica.target) as channel:
            while True:
                if replica.process.poll() is not None:
                    raise RuntimeError(f"{replica.name} exited ({replica.process.returncode})")
                try:
                    epb_grpc.EngineStub(channel).GetInfo(epb.GetInfoRequest(), timeout=2)
                    break
                except grpc.RpcError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{replica.name} did not start") from None
                    time.sleep(0.5)


def stop(replicas: list[Replica]) -> None:
    for replica in replicas:
        if replica.process.poll() is None:
            replica.process.terminate()
    for replica in replicas:
        try:
            replica.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            replica.process.kill()
            replica.process.wait()


def timed_generate(target: str, prompt: list[int], peer: str | None
                   ) -> tuple[float, float, epb.KvTransferInfo | None]:
    """TTFT and the first inter-token gap of a 3-token greedy request, and its transfer."""
    request = epb.GenerateRequest(
        request_id=f"bench-{random.getrandbits(64):x}", prompt_token_ids=prompt,
        sampling_params=epb.SamplingParams(max_tokens=3, min_tokens=3, temperature=0),
        output_options=epb.OutputOptions(return_token_ids=True))
    if peer is not None:
        request.prefill_peer = peer
    times: list[float] = []
    transfer = None
    with grpc.insecure_channel(target) as channel:
        start = time.perf_counter()
        for response in epb_grpc.EngineStub(channel).Generate(request, timeout=300):
            now = time.perf_counter()
            times.extend([now] * len(response.new_token_ids))
            if response.HasField("kv_transfer"):
                transfer = response.kv_transfer
    return times[0] - start, times[1] - times[0], transfer


def timed_prefill(target: str, prompt: list[int]) -> float:
    """The prefill replica's compute alone: Prefill sent to its answer; then released."""
    request_id = f"compute-{random.getrandbits(64):x}"
    with grpc.insecure_channel(target) as channel:
        stub = epb_grpc.EngineStub(channel)
        start = time.perf_counter()
        last = list(stub.Prefill(epb.PrefillRequest(
            request_id=request_id, prompt_token_ids=prompt,
            sampling_params=epb.SamplingParams(max_tokens=1, temperature=0)), timeout=300))[-1]
        seconds = time.perf_counter() - start
        stub.ReleaseKv(epb.ReleaseKvRequest(request_id=request_id,
                                            engine_id=last.kv_handle.engine_id), timeout=10)
    return seconds


def chunking_cost(model: str, lengths: list[int], chunks: list[int], rounds: int,
                  vocab: int) -> dict[str, object]:
    """The offline engine's prefill time at each chunk size over no chunking (0)."""
    from engine_common.config import CacheConfig, EngineConfig
    from engine_common.llm import LLM
    from engine_common.sampling_params import SamplingParams

    llm = LLM(EngineConfig(model=model, dtype="float32",
                           cache=CacheConfig(kv_cache_memory_bytes=512 << 20)))
    config = llm.core.scheduler.config
    rng = random.Random(1)
    seconds: dict[str, list[float]] = {}
    llm.generate([[rng.randrange(3, vocab) for _ in range(256)]], SamplingParams(max_tokens=1))
    for round_index in range(rounds):
        for length in lengths:
            order = [0, *chunks]
            order = order[round_index % len(order):] + order[:round_index % len(order)]
            for chunk in order:
                config.long_prefill_token_threshold = chunk
                prompt = [rng.randrange(3, vocab) for _ in range(length)]
                start = time.perf_counter()
                llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
                seconds.setdefault(f"{length}/{chunk}", []).append(time.perf_counter() - start)
    del llm
    medians = {key: statistics.median(values) for key, values in seconds.items()}
    return {
        "seconds": seconds,
        "median_over_unchunked": {
            f"{length} tokens, chunks of {chunk}": medians[f"{length}/{chunk}"]
            / medians[f"{length}/0"] for length in lengths for chunk in chunks},
    }


def cpu_snapshot(pairs: dict[str, Replica]) -> dict[str, float]:
    """CPU seconds so far of each replica (its processes) and of the whole host."""
    return tree_cpu_seconds({name: r.process.pid for name, r in pairs.items()}) | {
        "host": host_busy_seconds(), "wall": time.perf_counter()}


def record_cpu(row: dict[str, list[float]], variant: str, before: dict[str, float],
               after: dict[str, float]) -> None:
    """The CPU seconds each replica and the host used during one request: where the cores
    went while the prefill replica computed (``--cpu-profile``)."""
    for name, seconds in after.items():
        row.setdefault(f"{variant}_cpu_{name}", []).append(seconds - before[name])
    replicas = sum(after[n] - before[n] for n in after if n not in ("host", "wall"))
    row.setdefault(f"{variant}_cpu_not_replicas", []).append(
        after["host"] - before["host"] - replicas)


def measure(lengths: list[int], rounds: int, vocab: int, pairs: dict[str, Replica],
            cpu_profile: bool = False) -> dict[str, dict[str, list[float]]]:
    """Every variant at every length, rounds interleaved; seconds by length and quantity
    (and with ``cpu_profile`` the CPU seconds of each replica and the host per request)."""
    rng = random.Random(0)
    variants = [*PD_VARIANTS, *COMPUTE_VARIANTS]
    results: dict[str, dict[str, list[float]]] = {}
    for round_index in range(rounds):
        for length in lengths:
            order = variants[round_index % len(variants):] + variants[:round_index % len(variants)]
            row = results.setdefault(str(length), {})
            for variant in order:
                prompt = [rng.randrange(3, vocab) for _ in range(length)]
                before = cpu_snapshot(pairs) if cpu_profile else None
                if variant in COMPUTE_VARIANTS:
                    prefill = pairs["p_overlap" if variant == "compute_chunked" else "p_plain"]
                    row.setdefault(variant, []).append(timed_prefill(prefill.target, prompt))
                    if before is not None:
                        record_cpu(row, variant, before, cpu_snapshot(pairs))
                    continue
                decode, peer = {
                    "pd_overlap": (pairs["d_overlap"], pairs["p_overlap"].target),
                    "pd_no_overlap": (pairs["d_plain"], pairs["p_plain"].target),
                    "aggregated": (pairs["both"], None)}[variant]
                ttft, gap, transfer = timed_generate(decode.target, prompt, peer)
                if before is not None:
                    record_cpu(row, variant, before, cpu_snapshot(pairs))
                if transfer is not None and transfer.fallback_reason:
                    raise RuntimeError(f"{variant} fell back: {transfer.fallback_reason}")
                row.setdefault(f"{variant}_ttft", []).append(ttft)
                row.setdefault(f"{variant}_first_gap", []).append(gap)
                row.setdefault(f"{variant}_second_token", []).append(ttft + gap)
                if transfer is not None:
                    row.setdefault(f"{variant}_transfer_seconds", []).append(transfer.seconds)
                    row.setdefault(f"{variant}_blocks_pulled_early", []).append(
                        transfer.blocks_pulled_early)
            print(f"round {round_index} {length}: " + ", ".join(
                f"{k}={v[-1]:.3f}" for k, v in row.items()), flush=True)
    return results


def summarize(results: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    """Medians, and the ratios the issue's goal is about."""
    summary: dict[str, dict[str, float]] = {}
    for length, row in results.items():
        med = {key: statistics.median(values) for key, values in row.items()}
        compute = med["compute_whole"]
        summary[length] = med | {
            "pd_overlap_ttft_over_compute_whole": med["pd_overlap_ttft"] / compute,
            "pd_no_overlap_ttft_over_compute_whole": med["pd_no_overlap_ttft"] / compute,
            "pd_overlap_ttft_over_compute_chunked":
                med["pd_overlap_ttft"] / med["compute_chunked"],
            "pd_overlap_second_token_over_no_overlap":
                med["pd_overlap_second_token"] / med["pd_no_overlap_second_token"],
            "pd_overlap_second_token_over_aggregated":
                med["pd_overlap_second_token"] / med["aggregated_second_token"],
            "pd_no_overlap_second_token_over_aggregated":
                med["pd_no_overlap_second_token"] / med["aggregated_second_token"],
            "pd_overlap_first_gap_over_no_overlap":
                med["pd_overlap_first_gap"] / med["pd_no_overlap_first_gap"],
            "compute_chunked_over_whole": med["compute_chunked"] / compute,
        }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--lengths", default="256,1024,2048,4096")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunk-tokens", type=int, default=512,
                        help="the overlap pair's prefill chunk (--kv-overlap-chunk-tokens)")
    parser.add_argument("--cost-chunks", default="256,512,1024",
                        help="chunk sizes whose offline compute cost is measured")
    parser.add_argument("--cost-rounds", type=int, default=3,
                        help="rounds of the offline chunking-cost measurement (0: skip it)")
    parser.add_argument("--base-port", type=int, default=50420)
    parser.add_argument("--cpu-profile", action="store_true",
                        help="also record each replica's and the host's CPU seconds per "
                        "request (where the prefill replica's cores went)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "pd_overlap.json")
    args = parser.parse_args()
    model = args.model or str(ensure_default_model())
    lengths = [int(n) for n in args.lengths.split(",")]
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    at_start = machine()
    cost = chunking_cost(model, [n for n in lengths if n >= 1024],
                         [int(c) for c in args.cost_chunks.split(",")], args.cost_rounds,
                         vocab) if args.cost_rounds > 0 else None
    if cost is not None:
        print(cost["median_over_unchunked"], flush=True)
    common = ["--dtype", "float32", "--kv-cache-memory", "512MiB"]
    logs = Path(tempfile.mkdtemp(prefix="pd-overlap-"))
    plan = {
        "p_overlap": ["--role", "prefill", "--kv-overlap", "on",
                      "--kv-overlap-chunk-tokens", str(args.chunk_tokens)],
        "d_overlap": ["--role", "decode", "--kv-overlap", "on"],
        "p_plain": ["--role", "prefill", "--kv-overlap", "off"],
        "d_plain": ["--role", "decode", "--kv-overlap", "off"],
        "both": ["--role", "both"],
    }
    replicas = {name: start_replica(name, model, args.base_port + i, [*common, *flags], logs)
                for i, (name, flags) in enumerate(plan.items())}
    try:
        wait_serving(list(replicas.values()))
        measure([256], 1, vocab, replicas)  # warm every path once
        results = measure(lengths, args.rounds, vocab, replicas, args.cpu_profile)
    finally:
        stop(list(replicas.values()))
    summary = summarize(results)
    for length, row in summary.items():
        print(length, {k: round(v, 3) for k, v in row.items()}, flush=True)
    write_report(args.out, "pd_overlap",
                 settings={k: v for k, v in vars(args).items() if k != "out"}
                 | {"model": model, "replica_flags": plan, "common_flags": common,
                    "machine_at_start": at_start},
                 chunking_cost=cost, results=results, summary=summary, logs=str(logs))


if __name__ == "__main__":
    main()
