"""The replica's command line: ``python -m services.replica`` and ``tandem serve``.

Owns the flags, their mapping onto ``EngineConfig`` and ``ReplicaOptions`` (defaults come from
those records, not repeated here), byte sizes such as ``1GiB``, and the process's logging and
exit code. It does not own serving (``server``).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import socket
from dataclasses import replace

from engine_common.config import (
    CacheConfig,
    EngineConfig,
    KvTransferConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from services.entrypoint import run_service
from services.frontend.responses.store import STORE_HELP
from services.model_settings import add_model_settings_args, model_settings_from_args
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
from services.replica.kv_address import resolve_kv_host
from services.replica.server import ROLES, ReplicaOptions, serve
from services.suite_tls import add_tls_args, tls_from_args

logger = logging.getLogger("services.replica")

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
    "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """``1073741824``, ``1GiB``, ``512Mi``, ``2G`` (Kubernetes' convention: ``Gi`` is 2**30,
    ``G`` is 10**9; a trailing ``B`` is optional)."""
    match = _SIZE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; use bytes or a unit such as 512MiB, 1GiB, 2G")
    number, unit = match.groups()
    return int(float(number) * _UNITS[(unit or "").lower()])


def build_parser() -> argparse.ArgumentParser:
    cache, scheduler = CacheConfig(), SchedulerConfig()
    engine = EngineConfig(model="")
    options = ReplicaOptions(engine=engine)
    p = argparse.ArgumentParser(
        prog="python -m services.replica",
        description="Serve one engine over gRPC: tandem.v1.Generation (public, OpenAI-shaped), "
                    "tandem.v1.Engine (internal), health, reflection and Prometheus /metrics.")
    p.add_argument("--model", default=None,
                   help="local Hugging Face model directory (default: the bundled "
                        "SmolLM2-135M-Instruct, converted on first use)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients use (default: the model directory's name)")
    p.add_argument("--role", choices=ROLES, default=options.role,
                   help="prefill, decode or both (aggregated) (default: %(default)s)")
    p.add_argument("--host", default=options.host, help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=options.port,
                   help="gRPC port (default: %(default)s; 0 picks a free one)")
    p.add_argument("--metrics-port", type=int, default=options.metrics_port,
                   help="Prometheus /metrics HTTP port, 0 for none (default: %(default)s)")
    p.add_argument("--engine-id", default=None,
                   help="stable engine identity in KV events and handles "
                        "(default: <role>-<hostname>-<port>)")
    p.add_argument("--dtype", default=engine.dtype,
                   choices=("auto", "bfloat16", "float16", "float32"),
                   help="weights and KV-cache dtype (default: the checkpoint's; a bf16 one runs "
                        "in float32 on a CPU without a bf16 matmul)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: cuda when available, else cpu (default: %(default)s)")
    p.add_argument("--attention-backend", default=engine.attention_backend,
                   choices=("auto", "torch", "triton"), help="(default: %(default)s)")
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
    add_model_settings_args(p)
    p.add_argument("--enforce-eager", action="store_true",
                   help="on CUDA, run decode steps eagerly instead of replaying CUDA graphs")
    p.add_argument("--cuda-graph-max-batch-size", type=int,
                   default=engine.cuda_graph_max_batch_size,
                   help="largest decode batch captured in a CUDA graph (default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: the model's)")
    p.add_argument("--seed", type=int, default=engine.seed, help="(default: %(default)s)")
    p.add_argument("--block-size", type=int, default=cache.block_size,
                   help="tokens per KV block (default: %(default)s)")
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=cache.kv_cache_memory_bytes,
                   help="KV-cache bytes on CPU, e.g. 1GiB (default: %(default)s)")
    p.add_argument("--gpu-memory-utilization", type=float, default=cache.gpu_memory_utilization,
                   help="fraction of free GPU memory for the KV cache (default: %(default)s)")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="exact number of KV blocks, overriding the memory budget")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    p.add_argument("--max-num-batched-tokens", type=int, default=scheduler.max_num_batched_tokens,
                   help="token budget per engine step (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=scheduler.max_num_seqs,
                   help="requests running at once (default: %(default)s)")
    p.add_argument("--max-waiting", type=int, default=options.max_waiting,
                   help="requests queued beyond --max-num-seqs before new ones are refused "
                        "with RESOURCE_EXHAUSTED (default: %(default)s)")
    p.add_argument("--max-stored-responses", type=int, default=options.max_stored_responses,
                   help=STORE_HELP)
    p.add_argument("--scheduling-policy", default=scheduler.policy, choices=("fcfs", "priority"),
                   help="(default: %(default)s)")
    spec = SpeculativeConfig()
    p.add_argument("--speculative-ngram", type=int, default=spec.num_tokens, metavar="K",
                   help="speculative decoding by n-gram lookup: up to K draft tokens per "
                        "decode step, taken from where the sequence's last tokens occurred "
                        "before (0: off; default: %(default)s)")
    p.add_argument("--speculative-ngram-range", type=_ngram_range,
                   default=f"{spec.ngram_min}:{spec.ngram_max}", metavar="MIN:MAX",
                   help="lengths of the sequence's last tokens looked up, longest first "
                        "(default: %(default)s)")
    p.add_argument("--speculative-max-batch", type=int, default=spec.max_batch_size,
                   help="speculate only while at most this many requests run (default: "
                        "%(default)s)")
    p.add_argument("--shutdown-grace", type=float, default=options.shutdown_grace_s,
                   help="seconds in-flight requests get to finish on SIGTERM (default: %(default)s)")
    kv = KvTransferConfig()
    p.add_argument("--kv-host", default=None,
                   help="P/D: the address decode replicas reach this prefill replica's UCX "
                        "listener on, which binds only it (default: --host; required when "
                        "--host is a wildcard such as 0.0.0.0: in Kubernetes, the pod IP)")
    p.add_argument("--kv-port", type=int, default=kv.port,
                   help="P/D: UCX listener port of a prefill replica (default: a free one)")
    p.add_argument("--kv-lease-seconds", type=float, default=kv.lease_seconds,
                   help="P/D: pinned blocks nobody pulls are freed after this (default: %(default)s)")
    p.add_argument("--kv-pull-timeout", type=float, default=kv.pull_timeout_seconds,
                   help="P/D: seconds a decode replica waits for a KV pull (default: %(default)s)")
    p.add_argument("--kv-max-pinned-fraction", type=float, default=options.max_pinned_fraction,
                   help="P/D: the share of a prefill replica's KV blocks one caller may keep "
                        "pinned for pulls; more is RESOURCE_EXHAUSTED (default: %(default)s)")
    p.add_argument("--kv-fallback", default=kv.fallback, choices=("recompute", "fail"),
                   help="P/D: when the prefill replica or the transfer fails, recompute the "
                        "prefill here, or fail the request (default: %(default)s)")
    add_tls_args(p)
    p.add_argument("--health-port", type=int, default=options.health_port,
                   help="also answer grpc.health.v1, and only that, in plaintext on this port: "
                        "for probes without the suite's certificate, such as a kubelet's "
                        "(default: none)")
    add_observability_args(p)  # --log-level, --log-format, --otlp-traces-endpoint
    return p


def resolve_engine_cpus(args: argparse.Namespace) -> list[int] | None:
    """``--engine-cpus`` as CPUs for the engine core, or None when it shares the replica's."""
    if args.engine_cpus == SHARED:
        return None
    if args.engine_cpus != AUTO:
        return list(args.engine_cpus)
    return default_engine_cpus(args.role, _resolve_device(args.device),
                               sorted(os.sched_getaffinity(0)), omp_num_threads_from_env(),
                               cgroup_cpu_limit())


def _resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def options_from_args(args: argparse.Namespace) -> ReplicaOptions:
    if args.model is None:
        from engine_common.default_model import ensure_default_model

        args.model = str(ensure_default_model())
    engine = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=_resolve_device(args.device),
        max_model_len=args.max_model_len,
        seed=args.seed,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        cuda_graph_max_batch_size=args.cuda_graph_max_batch_size,
        engine_id=args.engine_id or f"{args.role}-{socket.gethostname()}-{args.port}",
        cpus=args.engine_cpus,
        model_settings=model_settings_from_args(args),
        cache=replace(
            CacheConfig(), block_size=args.block_size,
            kv_cache_memory_bytes=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization,
            num_gpu_blocks_override=args.num_kv_blocks,
            enable_prefix_caching=not args.no_prefix_caching),
        scheduler=replace(
            SchedulerConfig(), max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs, policy=args.scheduling_policy),
        kv_transfer=KvTransferConfig(
            role={"prefill": "producer", "decode": "consumer"}.get(args.role),
            host=resolve_kv_host(args.kv_host, args.host, args.role),
            port=args.kv_port, lease_seconds=args.kv_lease_seconds,
            pull_timeout_seconds=args.kv_pull_timeout, fallback=args.kv_fallback),
        speculative=replace(SpeculativeConfig(), num_tokens=args.speculative_ngram,
                            ngram_min=args.speculative_ngram_range[0],
                            ngram_max=args.speculative_ngram_range[1],
                            max_batch_size=args.speculative_max_batch),
    )
    return ReplicaOptions(
        engine=engine, role=args.role, host=args.host, port=args.port,
        metrics_port=args.metrics_port, served_model_name=args.served_model_name,
        max_waiting=args.max_waiting, shutdown_grace_s=args.shutdown_grace,
        max_stored_responses=args.max_stored_responses, tls=tls_from_args(args),
        max_pinned_fraction=args.kv_max_pinned_fraction, health_port=args.health_port)


def _ngram_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    try:
        ngram_min, ngram_max = int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX, e.g. 2:4; got {text!r}") from None
    if not 1 <= ngram_min <= ngram_max:
        raise argparse.ArgumentTypeError(f"need 1 <= MIN <= MAX, got {text!r}")
    return ngram_min, ngram_max


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), serve until stopped; the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.cpus is not None:
            pin_to_cpus(args.cpus)
        args.engine_cpus = resolve_engine_cpus(args)
        if args.engine_cpus is not None:
            pin_to_cpus(split_engine_cpus(sorted(os.sched_getaffinity(0)), args.engine_cpus))
    except ValueError as error:
        parser.error(str(error))
    return run_service("replica", ObservabilitySettings.from_args("tandem-replica", args),
                       lambda: options_from_args(args), serve)
