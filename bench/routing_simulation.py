"""Routing at cluster scale, simulated with the gateway's real code (issue 24, goal 4).

The gateway's real picker, prefix index and load tracker route requests onto simulated
replicas: each is the engine's real scheduler and KV-cache manager (prefix cache, LRU
eviction, real block hashes and KV events), with step times from a cost model fitted to
the real engine on this machine (``python -m bench.routing_sim.fit_costs``). First the
simulator replays the real 3-replica benchmark (``bench/prefix_routing.py``'s results
files) and compares its round-robin over scorer ratios with the measured ones; then it
runs (a) shared-system-prompt chat groups, (b) multi-turn conversations and (c) a
no-sharing control at 8, 16 and 64 replicas under round-robin, least-load, prefix-only and
Tandem's scorer (the default ``PickerConfig``). Results: ``bench/results/
routing_simulation.json`` (machine, settings, seeds, every cell). See
``docs/routing-simulation.md``.

    python bench/routing_simulation.py                     # ~10 minutes on one core
    python bench/routing_simulation.py --replicas 8 --seeds 0 --requests-scale 0.3
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import machine  # noqa: E402
from bench.routing_sim import validation  # noqa: E402
from bench.routing_sim.cost_model import StepCostModel  # noqa: E402
from bench.routing_sim.gateway_view import POLICIES  # noqa: E402
from bench.routing_sim.replica import ReplicaSpec  # noqa: E402
from bench.routing_sim.scale import WorkloadSettings, goals, run_cell  # noqa: E402

RESULTS = ROOT / "bench" / "results"
WORKLOADS = ("shared_prefix", "multi_turn", "no_sharing")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cost-model", default=str(RESULTS / "routing_simulation_step_costs.json"),
                   help="fit_costs' results file")
    p.add_argument("--measured", default=str(RESULTS / "prefix_routing*.json"),
                   help="glob of bench/prefix_routing.py results to validate against")
    p.add_argument("--validation-cores", type=float, default=None,
                   help="cores the measured run's replicas shared (default: its machine's)")
    p.add_argument("--replicas", default="8,16,64")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--seeds", default="0,1,2", help="one run per seed, the median reported")
    p.add_argument("--large", type=int, default=64,
                   help="clusters of at least this many replicas run --large-seeds only "
                        "(they cost as much as all smaller sizes together)")
    p.add_argument("--large-seeds", default="0")
    p.add_argument("--kv-cache-memory-mib", type=int, default=1024,
                   help="per simulated replica at scale (the replica's default: 1 GiB)")
    p.add_argument("--requests-scale", type=float, default=1.0,
                   help="multiply every workload's requests (conversations) per replica")
    p.add_argument("--load-scale", type=float, default=1.0,
                   help="multiply every workload's arrival rate per replica")
    p.add_argument("--skip-validation", action="store_true")
    p.add_argument("--validation-only", action="store_true")
    p.add_argument("--out", default=str(RESULTS / "routing_simulation.json"))
    return p.parse_args(argv)


def workload_settings(args: argparse.Namespace) -> WorkloadSettings:
    base = WorkloadSettings()
    s, m, n = base.shared_prefix, base.multi_turn, base.no_sharing
    return WorkloadSettings(
        replace(s, requests_per_replica=max(1, round(s.requests_per_replica * args.requests_scale)),
                rate_per_replica=s.rate_per_replica * args.load_scale),
        replace(m, conversations_per_replica=max(
                    1, round(m.conversations_per_replica * args.requests_scale)),
                start_rate_per_replica=m.start_rate_per_replica * args.load_scale),
        replace(n, requests_per_replica=max(1, round(n.requests_per_replica * args.requests_scale)),
                rate_per_replica=n.rate_per_replica * args.load_scale))


def bytes_per_block(block_size: int) -> int:
    """The default model's KV bytes per block in float32, as the engine sizes its cache."""
    import torch

    from engine_common.default_model import ensure_default_model
    from engine_common.model.arch_config import ModelArchConfig
    from engine_common.model_runner import kv_cache_bytes_per_block
    arch = ModelArchConfig.from_model_dir(str(ensure_default_model()))
    return kv_cache_bytes_per_block(arch, block_size, torch.float32)


def validate(args: argparse.Namespace, cost: StepCostModel, per_block: int) -> list[dict[str, Any]]:
    from engine_common.default_model import ensure_default_model
    from engine_common.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(str(ensure_default_model()))

    def tokenize(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=True).input_ids)

    out = []
    for measured in validation.load_measured([Path(p) for p in sorted(glob.glob(args.measured))]):
        cores = args.validation_cores or float(measured.report["machine"]["nproc"])
        fitted = validation.simulate(measured, cost, tokenize, per_block, cores)
        calibrated = validation.calibrate(measured, cost, tokenize, per_block, cores)
        entry = {"measured_file": str(Path(measured.path).relative_to(ROOT)),
                 "measured_load_average_at_end": measured.report["machine"].get(
                     "load_average_at_end", measured.report["machine"].get(
                         "load_average_at_start")),  # the older name of the same figure
                 "measured_summary": measured.report["summary"]}
        for name, sim in (("fitted_speed", fitted), ("calibrated_speed", calibrated)):
            entry[name] = {"simulated": sim, "comparison": validation.compare(
                sim["summary"], measured.report["summary"])}
        out.append(entry)
        print(json.dumps({"file": entry["measured_file"], **{
            name: {"speed_factor": entry[name]["simulated"]["cluster"]["speed_factor"],
                   "comparison": entry[name]["comparison"]}
            for name in ("fitted_speed", "calibrated_speed")}}, indent=2), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    machine_info = machine()
    cost_report = json.loads(Path(args.cost_model).read_text())
    cost = StepCostModel.from_json(cost_report["coefficients"])
    per_block = bytes_per_block(16)
    started = time.monotonic()
    validation_out = [] if args.skip_validation else validate(args, cost, per_block)
    if args.validation_only:
        args.workloads = ""

    replica = ReplicaSpec(num_blocks=(args.kv_cache_memory_mib << 20) // per_block)
    settings = workload_settings(args)
    seeds = [int(s) for s in args.seeds.split(",")]
    large_seeds = [int(s) for s in args.large_seeds.split(",")]
    results: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    for workload in filter(None, args.workloads.split(",")):
        for replicas in (int(n) for n in args.replicas.split(",")):
            for policy in args.policies.split(","):
                cell = run_cell(workload, replicas, policy,
                                large_seeds if replicas >= args.large else seeds, settings,
                                cost, replica)
                results.setdefault(workload, {}).setdefault(str(replicas), {})[policy] = cell
                print(f"{workload:13s} {replicas:3d} {policy:11s} "
                      f"TTFT p50 {cell['ttft_p50_s']:7.3f} p90 {cell['ttft_p90_s']:7.3f} "
                      f"p99 {cell['ttft_p99_s']:7.3f} s  hit {cell['prefix_cache_hit_rate']:.2f} "
                      f"{cell['throughput_req_per_s']:.2f} req/s", flush=True)
    report = {
        "benchmark": "routing_simulation",
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine_info,
        "settings": {**vars(args), "seeds": seeds, "large_seeds": large_seeds,
                     "replica": {**asdict(replica), "kv_cache_memory_mib": args.kv_cache_memory_mib},
                     "workloads": asdict(settings),
                     "policies": {p: asdict(POLICIES[p]) for p in args.policies.split(",")},
                     "cost_model": {"file": str(Path(args.cost_model).relative_to(ROOT))
                                    if Path(args.cost_model).is_relative_to(ROOT)
                                    else args.cost_model,
                                    "coefficients": cost.to_json(),
                                    "fitted_on": cost_report.get("machine")}},
        "validation": validation_out,
        "results": results,
        "goals": goals(results),
        "wall_s": time.monotonic() - started,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["goals"], indent=2))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
