"""Serving through Envoy vs `vllm serve`, measured by `vllm bench serve` (issue 27 goal 2).

Three servers, one at a time (never two at once on a small machine), each driven by vLLM's
own client, `vllm bench serve` from `.venv-peer` (`make bench-peer-setup`), so that every
figure is one a vLLM user can reproduce with the command lines in the results file:

- ``vllm``: `vllm serve` from `.venv-peer`, eager (its compiled mode gave wrong greedy text on
  SmolLM2 here), started by ``bench.online_serving.vllm_server`` (flags and why: there);
- ``tandem_pd``: Tandem, 1 prefill + 1 decode replica behind the gateway and Envoy;
- ``tandem_both``: Tandem, one aggregated (``both``) replica behind the gateway and Envoy;

both Tandem suites as `tandem up --envoy` starts them, through
``bench.online_serving.tandem_server``. The same dtype, KV-cache size, max-num-seqs and
max-num-batched-tokens for all three.

Workloads (issues 27 and 39), ``--ignore-eos``, seeded: A = 64 requests of 128 prompt / 128
output tokens sent at once (``--request-rate inf``); B = 48 requests of 512 / 128 at Poisson 2
req/s (beyond a 2-core machine's capacity, so queues build); C = 24 of 1024 / 256 at 0.5 req/s
(long prompts, long answers); D = 48 prompts of a 256-token prefix shared 6 ways (8 prefixes)
and a 256-token suffix, 128 output tokens, at 2 req/s (vLLM's prefix_repetition dataset).
A-C use the random dataset. ``tandem_pd_fraction`` (not run by default) is P/D with the
gateway's P/D decider as it was before issue 39, for that change's before and after;
``tandem_pd_shared`` (not run by default) is P/D with `tandem up --cpu-layout shared`, the
CPU layout before issue 39's goal 4. Per round every
server is started fresh, warmed up, runs A then B, and is stopped; servers interleave round
by round (vllm, tandem_pd, tandem_both, vllm, ...), since a shared machine's speed drifts
within minutes. The first round also sends a few greedy requests to each server and compares
the texts with vLLM's (bf16 near-ties may part; recorded, not failed).

After each workload the replicas' own metrics are read (``vllm:request_queue_time_seconds``,
``vllm:request_prefill_time_seconds``, ``vllm:time_to_first_token_seconds``, sums and
counts): the engine's share of the client's TTFT (waiting for a slot vs computing the
prompt), the rest being the hops (Envoy, gateway, frontend).

Written to bench/results/serving_vs_vllm.json: the machine, the settings, every command line,
each round's `vllm bench serve` summary, and per workload and Tandem layout the ratios to
vLLM per round and of the medians (output tok/s: higher is better; TTFT p50/p99, ITL p50/p99:
lower is better), and Tandem's own ITL p99 over its p50.

    python bench/serving_vs_vllm.py                 # 2 rounds, ~25 minutes on 2 cores
    python bench/serving_vs_vllm.py --quick         # a smoke run: 1 round, tiny workloads
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.online_serving import (  # noqa: E402
    GREEDY_PROMPTS,
    PEER_VLLM,
    Server,
    on_sigterm,
    sequential,
    tandem_server,
    vllm_server,
)
from bench.peer import run_process_group  # noqa: E402
from bench.report import write_report  # noqa: E402
from engine_common.default_model import ensure_default_model  # noqa: E402

SERVERS = ("vllm", "tandem_pd", "tandem_both", "tandem_pd_fraction", "tandem_pd_shared")
# (prefill, decode, both) replicas of each Tandem layout.
LAYOUTS = {"tandem_pd": (1, 1, 0), "tandem_both": (0, 0, 1), "tandem_pd_fraction": (1, 1, 0),
           "tandem_pd_shared": (1, 1, 0)}
# `tandem up --cpu-layout` per Tandem server (default auto: by-role for P/D):
# ``tandem_pd_shared`` is P/D with the CPU layout before issue 39's goal 4 (the prefill
# replica on every CPU, the decode engine core on the last one, nothing else pinned).
CPU_LAYOUTS = {"tandem_pd_shared": "shared"}
# The gateway's flags per Tandem server: ``tandem_pd_fraction`` is P/D with the decider's
# rule before issue 39 (the decode replica computes a prompt it holds half of), to measure
# that change in the same run.
GATEWAY_ARGS = {"tandem_pd_fraction": ("--prefill-skip-fraction", "0.5")}
# (key in our summary, key in `vllm bench serve`'s result, scale to seconds or 1)
METRICS = (
    ("output_tok_s", "output_throughput", 1.0),
    ("request_s", "request_throughput", 1.0),
    ("ttft_p50_s", "p50_ttft_ms", 1e-3),
    ("ttft_p99_s", "p99_ttft_ms", 1e-3),
    ("itl_p50_s", "p50_itl_ms", 1e-3),
    ("itl_p99_s", "p99_itl_ms", 1e-3),
    ("tpot_p50_s", "p50_tpot_ms", 1e-3),
    ("e2e_p50_s", "p50_e2el_ms", 1e-3),
    ("duration_s", "duration", 1.0),
    ("completed", "completed", 1.0),
    ("failed", "failed", 1.0),
)
HIGHER_IS_BETTER = {"output_tok_s", "request_s", "completed"}
ENGINE_HISTOGRAMS = {"queue": "vllm:request_queue_time_seconds",
                     "prefill": "vllm:request_prefill_time_seconds",
                     "ttft": "vllm:time_to_first_token_seconds"}
GREEDY_TOKENS = 32


@dataclass(frozen=True)
class Workload:
    name: str
    num_prompts: int
    input_len: int  # prompt tokens; with ``shared_prefix``, the part after the prefix
    output_len: int
    rate: str  # requests/s for `--request-rate`: "inf" (all at once) or a Poisson rate
    # Tokens of a prefix shared by the prompts (vLLM's prefix_repetition dataset, with
    # ``num_prefixes`` distinct prefixes); 0: random prompts.
    shared_prefix: int = 0
    num_prefixes: int = 0


# A: a burst; B: overload, Poisson; C: long prompts and long answers at a steady rate;
# D: shared prefixes (prefix_repetition: 8 prefixes of 256 tokens, 256-token suffixes).
FULL_WORKLOADS = (Workload("A", 64, 128, 128, "inf"), Workload("B", 48, 512, 128, "2"),
                  Workload("C", 24, 1024, 256, "0.5"),
                  Workload("D", 48, 256, 128, "2", shared_prefix=256, num_prefixes=8))
QUICK_WORKLOADS = (Workload("A", 8, 64, 16, "inf"), Workload("B", 6, 128, 16, "4"),
                   Workload("C", 4, 256, 32, "2"),
                   Workload("D", 8, 64, 16, "4", shared_prefix=64, num_prefixes=2))


# --------------------------------------------------------------------------- the client


def bench_command(server: Server, workload: Workload, model: Path, seed: int, result_dir: Path,
                  result_file: str, client: Path = PEER_VLLM) -> list[str]:
    """The `vllm bench serve` command line that runs ``workload`` against ``server``."""
    if workload.shared_prefix:
        dataset = ["--dataset-name", "prefix_repetition",
                   "--prefix-repetition-prefix-len", str(workload.shared_prefix),
                   "--prefix-repetition-suffix-len", str(workload.input_len),
                   "--prefix-repetition-num-prefixes", str(workload.num_prefixes),
                   "--prefix-repetition-output-len", str(workload.output_len)]
    else:
        dataset = ["--dataset-name", "random", "--random-input-len", str(workload.input_len),
                   "--random-output-len", str(workload.output_len), "--random-range-ratio", "0"]
    return [
        str(client), "bench", "serve", "--backend", "openai", "--base-url", server.base_url,
        "--endpoint", "/v1/completions", "--model", server.model, "--tokenizer", str(model),
        *dataset,
        "--num-prompts", str(workload.num_prompts), "--request-rate", workload.rate,
        "--seed", str(seed), "--ignore-eos", "--temperature", "0",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
        "--save-result", "--save-detailed", "--result-dir", str(result_dir),
        "--result-filename", result_file,
        "--disable-tqdm", "--ready-check-timeout-sec", "0",
    ]


def parse_result(result: dict[str, Any]) -> dict[str, float]:
    """Our summary of one `vllm bench serve` result (its saved JSON): seconds, tokens/s."""
    summary = {}
    for key, theirs, scale in METRICS:
        value = result.get(theirs)
        if not isinstance(value, int | float):
            raise ValueError(f"`vllm bench serve`'s result has no number {theirs!r}")
        summary[key] = float(value) * scale
    return summary


def run_workload(server: Server, workload: Workload, model: Path, seed: int, result_dir: Path,
                 label: str, timeout_s: float) -> tuple[list[str], dict[str, Any]]:
    """Run `vllm bench serve`; its command line and its saved result."""
    result_file = f"{label}.json"
    (result_dir / result_file).unlink(missing_ok=True)
    argv = bench_command(server, workload, model, seed, result_dir, result_file)
    stdout, stderr = run_process_group(argv, {**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
                                       None, timeout_s)
    (result_dir / f"{label}.log").write_text(stdout + "\n--- stderr\n" + stderr)
    path = result_dir / result_file
    if not path.exists():
        raise RuntimeError(f"`vllm bench serve` wrote no result for {label}; its output ends:\n"
                           f"{(stdout + stderr)[-3000:]}")
    return argv, json.loads(path.read_text())


# --------------------------------------------------------------------------- the engine's view


def metrics_urls(server: Server) -> list[str]:
    """The replicas' Prometheus endpoints (Tandem: from their command lines; vLLM: its own)."""
    if server.name == "vllm":
        return [f"{server.base_url}/metrics"]
    urls = []
    for argv in server.commands:
        if "services.replica" in " ".join(argv) and "--metrics-port" in argv:
            urls.append(f"http://127.0.0.1:{argv[argv.index('--metrics-port') + 1]}/metrics")
    return urls


def histogram_totals(text: str) -> dict[str, dict[str, float]]:
    """Sum and count of each of ENGINE_HISTOGRAMS in a Prometheus text page."""
    totals = {name: {"sum": 0.0, "count": 0.0} for name in ENGINE_HISTOGRAMS}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        for name, metric in ENGINE_HISTOGRAMS.items():
            for part in ("sum", "count"):
                if line.startswith(f"{metric}_{part}"):
                    totals[name][part] += float(line.rsplit(" ", 1)[1])
    return totals


def engine_totals(server: Server) -> dict[str, dict[str, float]]:
    """ENGINE_HISTOGRAMS over every replica of ``server`` (a P/D suite's prefill replica
    reports its prompts' queue and prefill, its decode replica the TTFT it streamed)."""
    totals = {name: {"sum": 0.0, "count": 0.0} for name in ENGINE_HISTOGRAMS}
    for url in metrics_urls(server):
        with urllib.request.urlopen(url, timeout=30) as response:
            page = histogram_totals(response.read().decode())
        for name, value in page.items():
            for part in ("sum", "count"):
                totals[name][part] += value[part]
    return totals


def engine_means(before: dict[str, dict[str, float]],
                 after: dict[str, dict[str, float]]) -> dict[str, float | None]:
    """Mean seconds per request of each histogram between two readings."""
    means: dict[str, float | None] = {}
    for name in ENGINE_HISTOGRAMS:
        count = after[name]["count"] - before[name]["count"]
        means[f"{name}_mean_s"] = ((after[name]["sum"] - before[name]["sum"]) / count
                                   if count else None)
    return means


# --------------------------------------------------------------------------- rounds


@contextmanager
def launch(name: str, args: argparse.Namespace, model: Path, round_index: int) -> Iterator[Server]:
    logs = args.log_dir / f"serving_vs_vllm-{name}-round{round_index + 1}"
    if name == "vllm":
        with vllm_server(args, model, logs.with_suffix(".log")) as server:
            yield server
    else:
        with tandem_server(args, model, logs, LAYOUTS[name], GATEWAY_ARGS.get(name, ()),
                           CPU_LAYOUTS.get(name, "auto")) as server:
            yield Server(name, server.base_url, server.model, server.commands, server.env,
                         server.started_in_s)


def greedy_texts(server: Server) -> list[str]:
    records = asyncio.run(sequential(server.base_url, server.model, list(GREEDY_PROMPTS),
                                     GREEDY_TOKENS))
    return [r.text if r.ok else f"<failed: {r.error}>" for r in records]


def run_server_round(name: str, args: argparse.Namespace, model: Path, round_index: int,
                     workloads: tuple[Workload, ...], report: dict) -> None:
    """Start ``name``, run every workload on it, stop it; results into ``report``."""
    print(f"round {round_index + 1}/{args.rounds}: starting {name} ...", flush=True)
    with launch(name, args, model, round_index) as server:
        report["commands"]["servers"][name] = {"argv": server.commands, "env": server.env}
        asyncio.run(sequential(server.base_url, server.model, ["Warm up the server."], 8))
        if round_index == 0:
            report["greedy"]["texts"][name] = greedy_texts(server)
        for workload in workloads:
            label = f"{name}-{workload.name}-round{round_index + 1}"
            load = os.getloadavg()
            before = engine_totals(server)
            argv, result = run_workload(server, workload, model, args.seed, args.result_dir,
                                        label, args.workload_timeout)
            engine = engine_means(before, engine_totals(server))
            summary = parse_result(result)
            report["commands"]["client"][f"{name}-{workload.name}"] = argv
            report["rounds"].append({
                "round": round_index + 1, "server": name, "workload": workload.name,
                "summary": summary, "engine": engine, "load_average_before": load,
                "server_start_s": server.started_in_s,
                "ttfts_s": [round(float(t), 4) for t in result.get("ttfts") or []],
                "errors": sorted({str(e) for e in result.get("errors") or [] if e})[:5]})
            print(f"  {name} {workload.name}: {summary['completed']:.0f} completed, "
                  f"{summary['output_tok_s']:.1f} out tok/s, TTFT p50/p99 "
                  f"{summary['ttft_p50_s']:.2f}/{summary['ttft_p99_s']:.2f} s, ITL p50/p99 "
                  f"{summary['itl_p50_s'] * 1e3:.0f}/{summary['itl_p99_s'] * 1e3:.0f} ms; "
                  f"engine queue {engine['queue_mean_s'] or 0:.2f} s, prefill "
                  f"{engine['prefill_mean_s'] or 0:.2f} s mean", flush=True)


# --------------------------------------------------------------------------- ratios


def ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def compare(rounds: list[dict], workloads: list[str], servers: list[str]) -> dict:
    """Per workload and Tandem layout: each metric per round, its median, and the ratio to
    vLLM per round (the fairer pairing: a round's servers ran minutes apart) and of the
    medians; with Tandem's own ITL p99 over its ITL p50."""
    table: dict[str, dict] = {}
    for workload in workloads:
        per_server = {name: [r["summary"] for r in rounds
                             if r["workload"] == workload and r["server"] == name]
                      for name in servers}
        table[workload] = {}
        for name in servers:
            runs = per_server[name]
            row: dict[str, object] = {}
            for key, _, _ in METRICS:
                values = [run[key] for run in runs]
                entry: dict[str, object] = {"per_round": values,
                                            "median": statistics.median(values)}
                peer = [run[key] for run in per_server.get("vllm", [])]
                if name != "vllm" and len(peer) == len(values):
                    entry["over_vllm_per_round"] = [ratio(t, v) for t, v in zip(values, peer, strict=True)]
                    entry["over_vllm"] = ratio(statistics.median(values), statistics.median(peer))
                row[key] = entry
            row["itl_p99_over_own_p50_per_round"] = [ratio(r["itl_p99_s"], r["itl_p50_s"])
                                                     for r in runs]
            table[workload][name] = row
    return table


def goals(table: dict) -> dict:
    """The issue's goals per workload and Tandem layout, by the medians: met or not."""
    verdict: dict[str, dict] = {}
    for workload, rows in table.items():
        verdict[workload] = {}
        for name, row in rows.items():
            if name == "vllm" or "over_vllm" not in row["output_tok_s"]:
                continue
            itl_ratio = ratio(row["itl_p99_s"]["median"], row["itl_p50_s"]["median"])
            verdict[workload][name] = {
                "out_tok_s_ge_vllm": row["output_tok_s"]["over_vllm"] >= 1.0,
                "ttft_p50_le_vllm": row["ttft_p50_s"]["over_vllm"] <= 1.0,
                "ttft_p99_le_vllm": row["ttft_p99_s"]["over_vllm"] <= 1.0,
                "itl_p99_over_own_p50": itl_ratio,
                "itl_p99_le_2x_own_p50": itl_ratio is not None and itl_ratio <= 2.0,
            }
    return verdict


def print_table(table: dict) -> None:
    for workload, rows in table.items():
        print(f"\nworkload {workload}: Tandem / vLLM per round (of the medians)")
        for name, row in rows.items():
            if name == "vllm":
                continue
            parts = []
            for key in ("output_tok_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s"):
                entry = row[key]
                if "over_vllm" in entry:
                    rounds = ", ".join(f"{x:.2f}" for x in entry["over_vllm_per_round"] if x)
                    parts.append(f"{key} {entry['over_vllm']:.2f}x ({rounds})")
            own = ", ".join(f"{x:.1f}" for x in row["itl_p99_over_own_p50_per_round"] if x)
            print(f"  {name}: " + "; ".join(parts) + f"; ITL p99/own p50 ({own})")


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None,
                   help="model directory (default: the default model, SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=("bfloat16", "float32"),
                   help="for every server (float32: a CPU without a bf16 matmul)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 1 round of tiny workloads (8 x 64/16 at once, "
                        "6 x 128/16 at 4 req/s)")
    p.add_argument("--servers", nargs="+", default=list(SERVERS[:3]), choices=SERVERS)
    p.add_argument("--workloads", nargs="+", default=["A", "B"],
                   choices=[w.name for w in FULL_WORKLOADS])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-gib", type=int, default=1, help="KV cache, for every server")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--vllm-omp-bind", default="auto",
                   help="VLLM_CPU_OMP_THREADS_BIND (auto: vLLM's default)")
    p.add_argument("--tandem-cpus", default=None, help="each replica's --cpus (default: all)")
    p.add_argument("--tandem-engine-cpus", default="auto", help="each replica's --engine-cpus")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--workload-timeout", type=float, default=1800.0)
    p.add_argument("--log-dir", type=Path, default=ROOT / "bench" / "results" / "logs")
    p.add_argument("--out", type=Path,
                   default=ROOT / "bench" / "results" / "serving_vs_vllm.json")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds = 1
    args.result_dir = args.log_dir / "serving_vs_vllm-client"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not PEER_VLLM.exists():
        print(f"{PEER_VLLM} is missing: `vllm bench serve` (the client) and `vllm serve` come "
              f"from it (make bench-peer-setup builds .venv-peer)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, on_sigterm)
    began = time.monotonic()
    model = args.model.resolve() if args.model else ensure_default_model()
    workloads = tuple(w for w in (QUICK_WORKLOADS if args.quick else FULL_WORKLOADS)
                      if w.name in args.workloads)
    args.result_dir.mkdir(parents=True, exist_ok=True)
    report: dict = {"commands": {"servers": {}, "client": {}}, "rounds": [],
                    "greedy": {"prompts": list(GREEDY_PROMPTS), "max_tokens": GREEDY_TOKENS,
                               "texts": {}}}
    for round_index in range(args.rounds):
        for name in args.servers:
            run_server_round(name, args, model, round_index, workloads, report)
    table = compare(report["rounds"], [w.name for w in workloads], args.servers)
    texts = report["greedy"]["texts"]
    if "vllm" in texts:
        report["greedy"]["identical_to_vllm"] = {
            name: sum(a == b for a, b in zip(t, texts["vllm"], strict=True)) / len(GREEDY_PROMPTS)
            for name, t in texts.items() if name != "vllm"}
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    write_report(args.out, "serving_vs_vllm",
                 settings=settings | {"model": str(model),
                                      "workloads": [asdict(w) for w in workloads],
                                      "order": "per round: " + ", ".join(args.servers)
                                      + "; every server restarted per round"},
                 **report, summary=table, goals=goals(table),
                 total_runtime_s=time.monotonic() - began)
    print_table(table)
    print(f"greedy texts identical to vLLM's: {report['greedy'].get('identical_to_vllm')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
