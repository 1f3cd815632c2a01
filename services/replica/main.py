"""The replica's command line: ``tandem serve`` (also ``python -m services.replica``).

Owns the flags of one replica (role, ports, engine id, CPUs, the P/D listener, TLS, health
port, observability), their mapping onto ``ReplicaOptions``, and the process's logging and
exit code. The engine flags every replica of a suite shares are ``engine_flags``'s; defaults
come from the config records, not repeated here. It does not own serving (``server``).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket

from engine_common.config import EngineConfig, KvTransferConfig
from services.entrypoint import run_service
from services.help_format import DefaultsHelpFormatter
from services.model_args import ModelDirError, check_model_dir
from services.observability.settings import ObservabilitySettings, add_observability_args
from services.replica.cpu_binding import (
    AUTO,
    SHARED,
    cgroup_cpu_limit,
    default_engine_cpus,
    omp_num_threads_from_env,
    parse_cpus,
    parse_engine_cpus,
    pin_to_cpus,
    split_engine_cpus,
)
from services.replica.engine_flags import add_engine_args, engine_config
from services.replica.kv_address import resolve_kv_host
from services.replica.options import ROLES, ReplicaOptions
from services.suite_tls import add_tls_args, tls_from_args

logger = logging.getLogger("services.replica")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tandem serve", formatter_class=DefaultsHelpFormatter,
        description="Serve one engine over gRPC: tandem.v1.Generation (public, OpenAI-shaped), "
                    "tandem.v1.Engine (internal), health, reflection and Prometheus /metrics.")
    _add_replica_args(p)
    add_engine_args(p)
    add_tls_args(p)
    add_observability_args(p)  # --log-level, --log-format, --otlp-traces-endpoint
    return p


def _add_replica_args(p: argparse.ArgumentParser) -> None:
    """This replica's own flags: what differs between the replicas of one suite."""
    options = ReplicaOptions(engine=EngineConfig(model=""))
    kv = KvTransferConfig()
    p.add_argument("--role", choices=ROLES, default=options.role,
                   help="prefill, decode or both (aggregated)")
    p.add_argument("--host", default=options.host, help="address to bind")
    p.add_argument("--port", type=int, default=options.port, help="gRPC port (0 picks a free one)")
    p.add_argument("--metrics-port", type=int, default=options.metrics_port,
                   help="Prometheus /metrics HTTP port, 0 for none")
    p.add_argument("--engine-id", default=None,
                   help="stable engine identity in KV events and handles "
                        "(default: <role>-<hostname>-<port>)")
    p.add_argument("--cpus", type=parse_cpus, default=None,
                   help="pin the replica (frontend and engine core) to these CPUs, e.g. 0-3, "
                        "with one torch thread per CPU (default: every CPU it may use)")
    p.add_argument("--engine-cpus", type=parse_engine_cpus, default=AUTO,
                   help="run the engine core alone on these CPUs (one torch thread each) and "
                        "the frontend on the replica's other CPUs, e.g. 1-3 of 0-3: gRPC, "
                        "tokenizing and streaming then never stall the model's threads; "
                        f"{SHARED}: they share the replica's CPUs; {AUTO}: all but the first "
                        "for a decode or both replica on CPU that owns two or more (no "
                        "smaller cgroup CPU quota or OMP_NUM_THREADS), else shared "
                        "(default: %(default)s)")
    p.add_argument("--kv-host", default=None,
                   help="P/D: the address decode replicas reach this prefill replica's UCX "
                        "listener on, which binds only it (default: --host; required when "
                        "--host is a wildcard such as 0.0.0.0: in Kubernetes, the pod IP)")
    p.add_argument("--kv-port", type=int, default=kv.port,
                   help="P/D: UCX listener port of a prefill replica (default: a free one)")
    p.add_argument("--health-port", type=int, default=options.health_port,
                   help="also answer grpc.health.v1, and only that, in plaintext on this port: "
                        "for probes without the suite's certificate, such as a kubelet's "
                        "(default: none)")


def resolve_engine_cpus(args: argparse.Namespace) -> list[int] | None:
    """``--engine-cpus`` as CPUs for the engine core, or None when it shares the replica's."""
    if args.engine_cpus == SHARED:
        return None
    if args.engine_cpus != AUTO:
        return list(args.engine_cpus)
    return default_engine_cpus(args.role, _resolve_device(args.device),
                               sorted(os.sched_getaffinity(0)), omp_num_threads_from_env(),
                               cgroup_cpu_limit(), args.tensor_parallel_size)


def _resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def options_from_args(args: argparse.Namespace) -> ReplicaOptions:
    if args.model is None:
        from engine_common.default_model import ensure_default_model

        args.model = str(ensure_default_model())
    kv = KvTransferConfig(
        role={"prefill": "producer", "decode": "consumer"}.get(args.role),
        host=resolve_kv_host(args.kv_host, args.host, args.role),
        port=args.kv_port, lease_seconds=args.kv_lease_seconds,
        pull_timeout_seconds=args.kv_pull_timeout, fallback=args.kv_fallback,
        transport=args.kv_transport)
    device = _resolve_device(args.device)
    engine_cpus = args.engine_cpus
    if engine_cpus is None and args.tensor_parallel_size > 1 and device == "cpu":
        # An engine core sharing the replica's CPUs: its ranks split them all
        # (``model_runner.rank_cpus``, rank 0 its first share), rather than rank 0's
        # threads spanning the workers' CPUs.
        engine_cpus = sorted(os.sched_getaffinity(0))
    engine = engine_config(
        args, device, args.engine_id or f"{args.role}-{socket.gethostname()}-{args.port}",
        engine_cpus, kv)
    return ReplicaOptions(
        engine=engine, role=args.role, host=args.host, port=args.port,
        metrics_port=args.metrics_port, served_model_name=args.served_model_name,
        max_waiting=args.max_waiting, shutdown_grace_s=args.shutdown_grace,
        max_stored_responses=args.max_stored_responses, tls=tls_from_args(args),
        max_pinned_fraction=args.kv_max_pinned_fraction, health_port=args.health_port,
        kv_overlap=args.kv_overlap == "on")


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), serve until stopped; the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_model_dir(args.model)  # one line, before torch or the engine start
    except ModelDirError as error:
        parser.exit(2, f"error: {error}\n")
    try:
        if args.cpus is not None:
            pin_to_cpus(args.cpus)
        args.engine_cpus = resolve_engine_cpus(args)
        if args.engine_cpus is not None:
            pin_to_cpus(split_engine_cpus(sorted(os.sched_getaffinity(0)), args.engine_cpus))
    except ValueError as error:
        parser.error(str(error))
    # NOTE: imported only now: serving loads torch (seconds), which a wrong flag or model
    # path, answered above, must not wait for.
    from services.replica.server import serve

    return run_service("replica", ObservabilitySettings.from_args("tandem-replica", args),
                       lambda: options_from_args(args), serve)
