"""One gateway process: the registry, load tracker, prefix index and proxy behind a grpc.aio
server, plus /metrics.

Owns wiring the parts together and their life: serve ``tandem.v1.Generation`` (the replica's
own servicer, over ``RemoteEngine``), ``grpc.health.v1`` and server reflection on one port and
the gateway's Prometheus registry on another; report SERVING while at least one
replica of any role is routable; stop cleanly on SIGTERM or SIGINT. The model directory
gives the tokenizer (the replicas' own, so prompts hash the same) and the served name; the
LoRA adapters it accepts are those the replicas report. It does not own routing (``picker``),
forwarding (``proxy``) or loading adapters on the replicas (``lora_rollout``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar
from wsgiref.simple_server import WSGIServer

from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from prometheus_client import start_http_server

from engine_common.config import ModelSettings
from engine_common.input_processor import InputProcessor
from engine_common.metrics import request_params_n
from engine_common.model.arch_config import ModelArchConfig
from engine_common.sampling_defaults import load_sampling_defaults
from engine_common.tokenizer import load_tokenizer
from gateway.cluster import ClusterView
from gateway.lora_rollout import ClusterLoraUpdates
from gateway.metrics import GatewayMetrics
from gateway.picker import PickerConfig
from gateway.proxy import EngineProxy, RetryPolicy
from gateway.registry import DnsTarget
from gateway.remote_engine import RemoteEngine
from gateway.request_metrics import RequestMetricsInterceptor
from protos.tandem.v1 import generation_pb2 as pb
from protos.tandem.v1 import generation_pb2_grpc as pb_grpc
from services.endless_streams import EndlessStreams
from services.entrypoint import wait_for_stop_signal
from services.frontend.generation_servicer import GenerationServicer
from services.frontend.grpc_server import new_server
from services.frontend.responses.store import DEFAULT_MAX_STORED_RESPONSES, ResponseStore
from services.frontend.served_model import ServedModel
from services.observability.observed_engine import observed
from services.observability.request_log import RequestLogInterceptor
from services.reflection import enable_reflection
from services.suite_tls import SuiteTls

logger = logging.getLogger(__name__)

GENERATION_SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name
HEALTH_SERVICES = ("", GENERATION_SERVICE)
_STATE_INTERVAL_S = 0.25

R = TypeVar("R")


@dataclass
class GatewayOptions:
    model: str
    replicas: list[str] = field(default_factory=list)
    dns: list[DnsTarget] = field(default_factory=list)
    host: str = "127.0.0.1"  # loopback unless told otherwise (a pod binds 0.0.0.0)
    port: int = 50050
    metrics_port: int = 9450  # 0: no /metrics endpoint
    served_model_name: str | Sequence[str] | None = None  # the first names answers
    picker: PickerConfig = field(default_factory=PickerConfig)
    # The prefix index's weight per KV tier (``PrefixIndex.tier_weights``); None: defaults.
    kv_tier_weights: dict[str, float] | None = None
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    load_interval_s: float = 0.05
    dns_interval_s: float = 5.0
    # The replicas' chat template, tool-call syntax and sampling defaults: the gateway
    # renders chats, parses calls and resolves requests into SamplingParams itself.
    model_settings: ModelSettings = field(default_factory=ModelSettings)
    # Responses kept for previous_response_id and GET /v1/responses/{id}; 0: none.
    max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES
    # Mutual TLS toward the replicas (they accept suite members only); None: plaintext. The
    # gateway's own port serves clients: their edge is Envoy (API keys) or this host.
    tls: SuiteTls | None = None

    def __post_init__(self) -> None:
        if not self.replicas and not self.dns:
            raise ValueError("give at least one replica (host:port) or DNS name (name:port)")


def load_inputs(model_dir: str, settings: ModelSettings | None = None) -> InputProcessor:
    """The replicas' tokenizer, limits and sampling defaults, from the model directory they
    serve and the settings they were given."""
    settings = settings or ModelSettings()
    arch = ModelArchConfig.from_model_dir(model_dir)
    # The replicas may run with a shorter context; GatewayServer adopts theirs once known.
    return InputProcessor(
        load_tokenizer(model_dir, settings.chat_template), arch.max_position_embeddings,
        arch.vocab_size,
        load_sampling_defaults(model_dir, settings.generation_config,
                               settings.override_generation_config),
        settings.tool_call_parser)


class GatewayServer:
    def __init__(self, options: GatewayOptions, inputs: InputProcessor) -> None:
        self.options = options
        self.metrics = GatewayMetrics()
        self.cluster = ClusterView.create(
            options.replicas, options.dns, dns_interval_s=options.dns_interval_s,
            load_interval_s=options.load_interval_s, tls=options.tls,
            tier_weights=options.kv_tier_weights)
        self.proxy = EngineProxy(self.cluster.registry, self.cluster.loads, self.cluster.index,
                                 self.metrics, options.picker, options.retry)
        self.inputs = inputs
        self.model = ServedModel.for_directory(options.model, self.inputs.max_model_len,
                                               options.served_model_name,
                                               options.model_settings.lora_modules)
        self.lora_updates = (
            ClusterLoraUpdates(self.cluster.registry, lambda: self.servicer.model,
                               self._refresh_model)
            if options.model_settings.allow_runtime_lora_updating else None)
        self.servicer = GenerationServicer(
            self.model, self.inputs, observed(RemoteEngine(self.proxy).generate),
            self.lora_updates,
            ResponseStore.sized(options.max_stored_responses))
        self.health = health_aio.HealthServicer()
        params_n = request_params_n(self.metrics.registry, self.model.name, "gateway")
        self.endless = EndlessStreams()  # health watches, closed as the gateway stops
        self.server = new_server([self.endless, RequestLogInterceptor(params_n),
                                  RequestMetricsInterceptor(self.metrics)])
        pb_grpc.add_GenerationServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        enable_reflection(self.server, (
            GENERATION_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name))
        self.port = self.server.add_insecure_port(f"{options.host}:{options.port}")
        self.metrics_port = 0
        self._metrics_http: WSGIServer | None = None
        self._serving: bool | None = None
        self._follower: asyncio.Task[None] | None = None
        self._reconciling: asyncio.Task[None] | None = None

    @classmethod
    async def start(cls, options: GatewayOptions) -> GatewayServer:
        # Loading the tokenizer takes a moment; keep the event loop free meanwhile.
        inputs = await asyncio.get_running_loop().run_in_executor(
            None, load_inputs, options.model, options.model_settings)
        gateway = cls(options, inputs)
        await gateway._start()
        return gateway

    async def _start(self) -> None:
        if self.options.metrics_port:
            self._metrics_http, _ = start_http_server(
                self.options.metrics_port, addr=self.options.host, registry=self.metrics.registry)
            self.metrics_port = self._metrics_http.server_port
        await self.cluster.start()
        await self.server.start()
        await self._update_state()
        self._follower = asyncio.create_task(self._follow_replicas(), name="gateway-state")
        logger.info("gateway serving %s on %s:%d in front of %s%s", self.model.name,
                    self.options.host, self.port,
                    ", ".join(self.options.replicas + [f"{d.host}:{d.port}"
                                                       for d in self.options.dns]),
                    f", metrics on :{self.metrics_port}/metrics" if self.metrics_port else "")

    async def _update_state(self) -> None:
        replicas = self.cluster.registry.replicas()
        # NOTE: any role serves: with no decode replica a prefill replica runs requests whole.
        serving = any(r.routable for r in replicas)
        if serving != self._serving:
            self._serving = serving
            status = (health_pb2.HealthCheckResponse.SERVING if serving
                      else health_pb2.HealthCheckResponse.NOT_SERVING)
            for service in HEALTH_SERVICES:
                await self.health.set(service, status)
        self.metrics.set_replicas(replicas)
        max_model_len = self.cluster.max_model_len()
        if max_model_len is not None:
            self.inputs.max_model_len = max_model_len
        self._refresh_model()
        if self.lora_updates is not None and self.lora_updates.has_targets and (
                self._reconciling is None or self._reconciling.done()):
            # In its own task: loading an adapter takes a while, health must not wait.
            self._reconciling = asyncio.create_task(self.lora_updates.reconcile())

    def _refresh_model(self) -> None:
        """The model as the replicas serve it now: their context length, and the LoRA
        adapters any of them serves (they may change at run time; those given with
        --lora-modules until the replicas say)."""
        replicas = self.cluster.registry.replicas()
        lora_names = (frozenset(name for r in replicas for name in r.lora_adapters)
                      if any(r.role for r in replicas) else self.model.lora_names)
        model = replace(self.model, max_model_len=self.inputs.max_model_len,
                        lora_names=lora_names)
        if model != self.servicer.model:
            self.servicer.model = model

    async def _follow_replicas(self) -> None:
        while True:
            await asyncio.sleep(_STATE_INTERVAL_S)
            await self._update_state()

    async def stop(self, grace_s: float = 1.0) -> None:
        await self.health.enter_graceful_shutdown()
        for task in (self._follower, self._reconciling):
            if task is not None:
                task.cancel()
        self.endless.end()
        await self.server.stop(grace_s)
        await self.cluster.stop()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()


async def serve(options: GatewayOptions) -> None:
    """Run a gateway until SIGTERM or SIGINT."""
    gateway = await GatewayServer.start(options)
    await wait_for_stop_signal()
    logger.info("gateway stopping")
    await gateway.stop()
