"""``python -m gateway.endpoint_picker_main``: the endpoint picker as a process.

Owns the picker's flags, wiring the gateway's registry, load tracker and prefix index to an
``EndpointChooser`` behind a grpc.aio server (``envoy.service.ext_proc.v3.ExternalProcessor``,
``grpc.health.v1`` and reflection; built as every Tandem server is, by
``services.frontend.grpc_server``: its message size limit, a port not shared, and the request
guard, so that bytes that are not a ``ProcessingRequest`` are INVALID_ARGUMENT, not UNKNOWN
with a traceback; its port is plaintext, Envoy's), and its life: health as the endpoint-picker protocol
defines it (``liveness`` while the process runs; ``readiness``, the ext_proc service and the
server as a whole SERVING while at least one replica of any role is routable), optional
Prometheus /metrics, and a clean stop on SIGTERM or SIGINT. It does not own the protocol
(``endpoint_picker``) or choosing (``picker``).

    python -m gateway.endpoint_picker_main --port 9002 --model DIR \\
        --replica 10.0.0.5:50051 --dns tandem-decode.default.svc.cluster.local:50051
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from dataclasses import dataclass, field, replace
from wsgiref.simple_server import WSGIServer

from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from prometheus_client import start_http_server

from engine_common.config import ModelSettings
from gateway.cluster import ClusterView
from gateway.endpoint_picker import (
    EXT_PROC_SERVICE,
    EndpointChooser,
    EndpointPickerServicer,
    SheddingPolicy,
)
from gateway.metrics import GatewayMetrics
from gateway.picker import PickerConfig
from gateway.registry import DnsTarget
from gateway.server import load_inputs
from gateway.tier_weights import add_placement_args
from protos.third_party.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from services.entrypoint import run_service, wait_for_stop_signal
from services.frontend.grpc_server import new_server
from services.help_format import DefaultsHelpFormatter
from services.model_settings import add_model_settings_args, model_settings_from_args
from services.observability.settings import ObservabilitySettings, add_observability_args
from services.reflection import enable_reflection
from services.suite_tls import SuiteTls, add_tls_args, tls_from_args

logger = logging.getLogger("gateway.endpoint_picker")

_STATE_INTERVAL_S = 0.25
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class PickerOptions:
    model: str
    replicas: list[str] = field(default_factory=list)
    dns: list[DnsTarget] = field(default_factory=list)
    host: str = "127.0.0.1"  # loopback unless told otherwise (a pod binds 0.0.0.0)
    port: int = 9002  # the inference extension's conventional endpoint-picker port
    metrics_port: int = 0
    picker: PickerConfig = field(default_factory=PickerConfig)
    # The prefix index's weight per KV tier (``PrefixIndex.tier_weights``); None: defaults.
    kv_tier_weights: dict[str, float] | None = None
    shedding: SheddingPolicy = field(default_factory=SheddingPolicy)
    load_interval_s: float = 0.05
    dns_interval_s: float = 5.0
    # The replicas' model settings: the picker renders chats with their chat template and
    # hashes a LoRA adapter's prompts as they do, to route them by prefix.
    model_settings: ModelSettings = field(default_factory=ModelSettings)
    # Mutual TLS toward the replicas; None: plaintext. The picker's own port serves Envoy.
    tls: SuiteTls | None = None

    def __post_init__(self) -> None:
        if not self.replicas and not self.dns:
            raise ValueError("give at least one replica (ip:port) or DNS name (name:port)")


class EndpointPickerServer:
    def __init__(self, options: PickerOptions, cluster: ClusterView,
                 chooser: EndpointChooser) -> None:
        self.options = options
        self.cluster = cluster
        self.chooser = chooser
        self.health = health_aio.HealthServicer()
        self.server = new_server()
        ep_grpc.add_ExternalProcessorServicer_to_server(
            EndpointPickerServicer(chooser), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        enable_reflection(self.server, (
            EXT_PROC_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name))
        self.port = self.server.add_insecure_port(f"{options.host}:{options.port}")
        self._ready: bool | None = None
        self._follower: asyncio.Task[None] | None = None
        self._metrics_http: WSGIServer | None = None

    @classmethod
    async def start(cls, options: PickerOptions) -> EndpointPickerServer:
        # Routing reads prompts only: no sampling defaults.
        inputs = await asyncio.get_running_loop().run_in_executor(
            None, load_inputs, options.model,
            replace(options.model_settings, generation_config="vllm",
                    override_generation_config={}))
        metrics = GatewayMetrics()
        cluster = ClusterView.create(
            options.replicas, options.dns, dns_interval_s=options.dns_interval_s,
            load_interval_s=options.load_interval_s, tls=options.tls,
            tier_weights=options.kv_tier_weights)
        chooser = EndpointChooser(cluster.registry, cluster.loads, cluster.index, inputs,
                                  options.picker, options.shedding, metrics,
                                  frozenset(options.model_settings.lora_modules))
        picker = cls(options, cluster, chooser)
        if options.metrics_port:
            picker._metrics_http, _ = start_http_server(
                options.metrics_port, addr=options.host, registry=metrics.registry)
        await cluster.start()
        await picker.server.start()
        await picker.health.set("liveness", _SERVING)
        await picker._update_state()
        picker._follower = asyncio.create_task(picker._follow(), name="picker-state")
        logger.info("endpoint picker on %s:%d in front of %s", options.host, picker.port,
                    ", ".join(options.replicas + [f"{d.host}:{d.port}" for d in options.dns]))
        return picker

    async def _update_state(self) -> None:
        replicas = self.cluster.registry.replicas()
        ready = any(r.routable for r in replicas)  # a prefill replica can run requests whole
        if ready != self._ready:
            self._ready = ready
            for service in ("", "readiness", EXT_PROC_SERVICE):
                await self.health.set(service, _SERVING if ready else _NOT_SERVING)
        self.chooser.metrics.set_replicas(replicas)
        max_model_len = self.cluster.max_model_len()
        if max_model_len is not None:
            self.chooser.inputs.max_model_len = max_model_len

    async def _follow(self) -> None:
        while True:
            await asyncio.sleep(_STATE_INTERVAL_S)
            await self._update_state()

    async def stop(self, grace_s: float = 1.0) -> None:
        await self.health.enter_graceful_shutdown()
        if self._follower is not None:
            self._follower.cancel()
        await self.server.stop(grace_s)
        await self.cluster.stop()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()


async def serve(options: PickerOptions) -> None:
    """Run the picker until SIGTERM or SIGINT."""
    picker = await EndpointPickerServer.start(options)
    await wait_for_stop_signal()
    await picker.stop()


def build_parser() -> argparse.ArgumentParser:
    defaults = PickerOptions(model="", replicas=["unused:0"])
    picker, shedding = defaults.picker, defaults.shedding
    p = argparse.ArgumentParser(
        prog="tandem picker", formatter_class=DefaultsHelpFormatter,
        description="Tandem's endpoint picker: an Envoy ext_proc server that names the replica "
                    "for each request (x-gateway-destination-endpoint), by prefix-cache match "
                    "and load, as the gateway-api-inference-extension protocol specifies.")
    p.add_argument("--replica", action="append", default=[], metavar="IP:PORT",
                   help="a replica's gRPC address (repeat); Envoy connects to it by IP")
    p.add_argument("--dns", action="append", default=[], metavar="NAME:PORT",
                   type=DnsTarget.parse,
                   help="a DNS name whose addresses are replicas (a headless Service)")
    p.add_argument("--model", default=None,
                   help="the replicas' model directory, for the tokenizer (default: the "
                        "bundled SmolLM2-135M-Instruct)")
    p.add_argument("--host", default=defaults.host, help="(default: %(default)s)")
    p.add_argument("--port", type=int, default=defaults.port,
                   help="ext_proc gRPC port (default: %(default)s)")
    p.add_argument("--metrics-port", type=int, default=defaults.metrics_port,
                   help="Prometheus /metrics port, 0 for none (default: %(default)s)")
    p.add_argument("--prefix-weight", type=float, default=picker.prefix_weight)
    p.add_argument("--kv-usage-weight", type=float, default=picker.kv_usage_weight)
    p.add_argument("--queue-weight", type=float, default=picker.queue_weight)
    add_placement_args(p)
    p.add_argument("--shed-queue-depth", type=int, default=shedding.queue_depth_threshold,
                   help="waiting requests at which a replica counts as saturated "
                        "(default: %(default)s)")
    p.add_argument("--shed-kv-cache-usage", type=float, default=shedding.kv_cache_threshold,
                   help="KV-cache fill at which a replica counts as saturated "
                        "(default: %(default)s)")
    p.add_argument("--dns-interval", type=float, default=defaults.dns_interval_s)
    # The replicas' flags: chats are routed by the prompt the chat template renders, a LoRA
    # adapter's requests by its blocks (the others are read and left alone).
    add_model_settings_args(p)
    add_tls_args(p)
    add_observability_args(p)  # --log-level, --log-format, --otlp-traces-endpoint
    return p


def options_from_args(args: argparse.Namespace) -> PickerOptions:
    if args.model is None:
        from engine_common.default_model import ensure_default_model

        args.model = str(ensure_default_model())
    return PickerOptions(
        model=args.model, replicas=args.replica, dns=args.dns, host=args.host, port=args.port,
        metrics_port=args.metrics_port,
        picker=replace(PickerConfig(), prefix_weight=args.prefix_weight,
                       kv_usage_weight=args.kv_usage_weight, queue_weight=args.queue_weight,
                       estimate_placement=args.prefill_placement == "estimate"),
        kv_tier_weights=args.kv_tier_weights,
        shedding=SheddingPolicy(args.shed_queue_depth, args.shed_kv_cache_usage),
        dns_interval_s=args.dns_interval, model_settings=model_settings_from_args(args),
        tls=tls_from_args(args))


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), serve until stopped; the exit code."""
    args = build_parser().parse_args(argv)
    return run_service("endpoint picker",
                       ObservabilitySettings.from_args("tandem-endpoint-picker", args),
                       lambda: options_from_args(args), serve)


if __name__ == "__main__":
    sys.exit(main())
