"""What `tandem up` starts: the suite's processes, their flags and ports.

Owns the process plan (which replicas, gateway and Envoy to start, on which ports, with which
flags and CPU shares) as ``ProcessSpec``s, with the ports each will listen on and how the
supervisor tells it is ready, and the endpoints to print. It does not start
anything (``supervisor``) or own what the processes do: each is a normal `python -m ...`
entry point.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from deploy.cpu_layout import plan_cpus
from engine_common.config import ModelSettings
from services.model_args import model_name_args
from services.model_settings import model_settings_args
from services.replica.cpu_binding import cgroup_cpu_limit, omp_num_threads_from_env


@dataclass(frozen=True)
class PortUse:
    """A port a planned process listens on, and what it is (for the error when it is busy)."""

    host: str
    port: int
    what: str  # e.g. "decode-1 gRPC (--base-port)"


@dataclass
class ProcessSpec:
    name: str
    argv: list[str]
    grpc_target: str | None  # checked for health; None: a process without gRPC health
    # Its gRPC port takes only callers holding the suite's certificate (a replica of a suite
    # with mutual TLS); the supervisor's health checks then present it.
    suite_tls: bool = False
    env: dict[str, str] = field(default_factory=dict)
    # Every port it listens on: checked free before anything starts, and accepting
    # connections before the process counts as ready.
    ports: list[PortUse] = field(default_factory=list)
    # An HTTP URL answering 200 once the process is ready (Envoy's admin /ready).
    ready_url: str | None = None
    # An HTTP URL answering 200 once what the process fronts serves through it (Envoy's
    # /health: its own health check of the gateway passed). The suite counts as started only
    # then; it is no readiness or liveness check of the process (it fails while the gateway has
    # no replica, which restarting Envoy would not mend).
    serving_url: str | None = None
    # NOT_SERVING after it was ready means it is broken and must be restarted (a replica
    # whose engine core died); False where NOT_SERVING may pass (the gateway while no
    # replica is routable).
    restart_when_not_serving: bool = True
    # Stopped first, and the others only once these exited: a replica finishes its streams
    # while the gateway and Envoy in front of it still relay them.
    drains_first: bool = False
    # The CPUs it runs on (its threads and children too); None: any.
    cpus: list[int] | None = None


@dataclass
class SuiteConfig:
    model: str | None = None  # None: the default model
    # The names clients call it by (the first names answers and metrics); None: its folder's.
    served_model_names: list[str] | None = None
    num_prefill: int = 1
    num_decode: int = 1
    num_both: int = 0
    host: str = "127.0.0.1"
    base_port: int = 50100  # replicas take base_port, base_port + 1, ...
    gateway_port: int = 50051
    metrics_base_port: int = 9100
    kv_cache_memory: str = "512MiB"
    gateway: bool = True
    envoy: bool = False
    envoy_http_port: int = 8080
    # Envoy's admin interface (on 127.0.0.1); None: the port after the gateway's metrics.
    envoy_admin_port: int | None = None
    # Envoy requires one of the API keys in this file (one per line) on every request.
    envoy_api_key_file: Path | None = None
    # The engine flags every replica gets (``services.replica.engine_flags.engine_argv``,
    # less --tensor-parallel-size, which is per role: the two fields below).
    engine_args: list[str] = field(default_factory=list)
    tensor_parallel_size: int = 1  # ranks per replica
    prefill_tensor_parallel_size: int | None = None  # prefill replicas'; None: the above
    # Flags every replica and the gateway get: logging and traces (--log-level, ...).
    process_args: list[str] = field(default_factory=list)
    extra_replica_args: list[str] = field(default_factory=list)  # after engine_args
    extra_gateway_args: list[str] = field(default_factory=list)  # the gateway's alone
    # The replicas' and the gateway's chat template, tool-call syntax and sampling defaults.
    model_settings: ModelSettings = field(default_factory=ModelSettings)
    # How the replicas, the gateway and Envoy share this host's CPUs (``deploy.cpu_layout``).
    cpu_layout: str = "auto"
    # The suite's mutual TLS (``services.suite_tls``: tls.crt, tls.key, ca.crt): replicas
    # serve only callers presenting a suite certificate, and the gateway, decode replicas
    # and Envoy (where it calls a replica itself) dial them with it. None: plaintext.
    tls_dir: Path | None = None


@dataclass
class Suite:
    specs: list[ProcessSpec]
    endpoints: dict[str, str]
    cpu_layout: str = "shared"  # the layout ``--cpu-layout`` resolved to


def plan_suite(cfg: SuiteConfig) -> Suite:
    roles = ["prefill"] * cfg.num_prefill + ["decode"] * cfg.num_decode + ["both"] * cfg.num_both
    if not roles:
        raise ValueError("the suite needs at least one replica")
    # What the replicas and the gateway must agree on: the model and its names, how chats
    # render and tool calls parse, and the requests' sampling defaults.
    model_args = [*model_name_args(cfg.model, cfg.served_model_names),
                  *model_settings_args(cfg.model_settings)]
    cpus = sorted(os.sched_getaffinity(0))
    omp_threads, cpu_limit = omp_num_threads_from_env(), cgroup_cpu_limit()
    owned = ((omp_threads is None or omp_threads >= len(cpus))
             and (cpu_limit is None or cpu_limit >= len(cpus)))
    cpu_plan = plan_cpus(cfg.cpu_layout, roles, cpus, owned,
                         [replica_ranks(cfg, role) for role in roles])
    suite = Suite([], {}, cpu_plan.layout)
    replica_targets = _plan_replicas(cfg, roles, model_args, cpu_plan.replica_args, suite)
    if cfg.gateway:
        _plan_gateway(cfg, len(roles), model_args, replica_targets, suite)
    if cfg.envoy:
        upstream = f"{cfg.host}:{cfg.gateway_port}" if cfg.gateway else replica_targets[0]
        _plan_envoy(cfg, len(roles), upstream, suite)
    if cpu_plan.service_cpus is not None:
        for spec in suite.specs[len(roles):]:
            spec.cpus = cpu_plan.service_cpus
    return suite


def replica_ranks(cfg: SuiteConfig, role: str) -> int:
    """A replica's tensor-parallel ranks: prefill replicas may differ from the others (P/D
    across parallel sizes moves the KV per rank, ``kv_transfer.rank_reader``)."""
    if role == "prefill" and cfg.prefill_tensor_parallel_size is not None:
        return cfg.prefill_tensor_parallel_size
    return cfg.tensor_parallel_size


def _tls_args(cfg: SuiteConfig) -> list[str]:
    return ["--tls-dir", str(cfg.tls_dir)] if cfg.tls_dir is not None else []


def _plan_replicas(cfg: SuiteConfig, roles: list[str], model_args: list[str],
                   cpu_args: list[list[str]], suite: Suite) -> list[str]:
    """Adds a spec and endpoints per replica to ``suite``; their gRPC targets."""
    targets = []
    for i, role in enumerate(roles):
        port, metrics_port = cfg.base_port + i, cfg.metrics_base_port + i
        name = f"{role}-{i}"
        target = f"{cfg.host}:{port}"
        targets.append(target)
        ranks = replica_ranks(cfg, role)
        rank_args = ["--tensor-parallel-size", str(ranks)] if ranks > 1 else []
        suite.specs.append(ProcessSpec(
            name=name,
            argv=[sys.executable, "-m", "services.replica", *model_args, "--role", role,
                  "--host", cfg.host, "--port", str(port), "--metrics-port", str(metrics_port),
                  "--engine-id", name, "--kv-cache-memory", cfg.kv_cache_memory,
                  *cpu_args[i], *_tls_args(cfg), *cfg.engine_args, *rank_args,
                  *cfg.process_args,
                  *cfg.extra_replica_args],
            grpc_target=target, suite_tls=cfg.tls_dir is not None,
            ports=[PortUse(cfg.host, port, f"{name} gRPC (--base-port)"),
                   PortUse(cfg.host, metrics_port, f"{name} metrics (--metrics-base-port)")],
            drains_first=True,
        ))
        suite.endpoints[f"replica {name} (gRPC)"] = target
        suite.endpoints[f"replica {name} (metrics)"] = f"http://{cfg.host}:{metrics_port}/metrics"
    return targets


def _plan_gateway(cfg: SuiteConfig, num_replicas: int, model_args: list[str],
                  replica_targets: list[str], suite: Suite) -> None:
    target = f"{cfg.host}:{cfg.gateway_port}"
    metrics_port = cfg.metrics_base_port + num_replicas
    replica_flags = [arg for t in replica_targets for arg in ("--replica", t)]
    suite.specs.append(ProcessSpec(
        name="gateway",
        argv=[sys.executable, "-m", "gateway", *model_args, "--host", cfg.host,
              "--port", str(cfg.gateway_port), "--metrics-port", str(metrics_port),
              *replica_flags, *_tls_args(cfg), *cfg.process_args, *cfg.extra_gateway_args],
        grpc_target=target,
        ports=[PortUse(cfg.host, cfg.gateway_port, "gateway gRPC (--gateway-port)"),
               PortUse(cfg.host, metrics_port, "gateway metrics (--metrics-base-port)")],
        restart_when_not_serving=False,
    ))
    suite.endpoints["gateway (gRPC, tandem.v1.Generation)"] = target
    suite.endpoints["gateway (metrics)"] = f"http://{cfg.host}:{metrics_port}/metrics"


def _dial_host(host: str) -> str:
    """Where to reach a listener bound to ``host`` from this machine."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def _plan_envoy(cfg: SuiteConfig, num_replicas: int, upstream: str, suite: Suite) -> None:
    admin_port = (cfg.envoy_admin_port if cfg.envoy_admin_port is not None
                  else cfg.metrics_base_port + num_replicas + 1)
    # GET /metrics on the HTTP port: the gateway's (or, without one, the replica's Envoy fronts).
    metrics_port = cfg.metrics_base_port + (num_replicas if cfg.gateway else 0)
    suite.specs.append(ProcessSpec(
        name="envoy",
        argv=[sys.executable, "-m", "deploy.envoy_runner", "--http-port", str(cfg.envoy_http_port),
              "--upstream", upstream, "--listen-host", cfg.host,
              "--admin-port", str(admin_port),
              "--upstream-metrics", f"{cfg.host}:{metrics_port}",
              *(["--api-key-file", str(cfg.envoy_api_key_file)]
                if cfg.envoy_api_key_file else []),
              # Envoy in front of a replica is a suite member; in front of the gateway it
              # calls its plaintext public port.
              *(["--upstream-tls-dir", str(cfg.tls_dir)]
                if cfg.tls_dir is not None and not cfg.gateway else [])],
        grpc_target=None,
        ports=[PortUse(cfg.host, cfg.envoy_http_port, "Envoy HTTP (--http-port)"),
               PortUse("127.0.0.1", admin_port, "Envoy admin (after --metrics-base-port)")],
        ready_url=f"http://127.0.0.1:{admin_port}/ready",
        serving_url=f"http://{_dial_host(cfg.host)}:{cfg.envoy_http_port}/health",
    ))
    suite.endpoints["envoy (HTTP, OpenAI-compatible)"] = f"http://{cfg.host}:{cfg.envoy_http_port}/v1"
