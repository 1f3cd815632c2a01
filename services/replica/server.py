"""One replica process: the engine, a grpc.aio server with every service, and /metrics.

Owns the replica's life: start the engine core (its own process), serve
``tandem.v1.Generation``, ``tandem.v1.Engine``, ``grpc.health.v1`` and server reflection on one
port and the engine's Prometheus registry on another; report SERVING once the engine is up
(and, on a prefill replica, its KV listener accepts connections where peers dial it) and
NOT_SERVING if its core dies; on SIGTERM or SIGINT drain: NOT_SERVING, refuse new
requests (UNAVAILABLE), let the requests in flight finish within the grace period, then stop
the server and the engine. A second signal cuts the drain short. It does not own the RPC
handlers (``generation_servicer``, ``engine_servicer``) or command-line parsing (``main``).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Sequence
from dataclasses import replace
from wsgiref.simple_server import WSGIServer

import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from prometheus_client import start_http_server

from engine_common.async_llm import AsyncLLM
from engine_common.config import EngineConfig
from engine_common.core_process import fork_is_safe
from protos.tandem.v1 import engine_pb2, engine_pb2_grpc, generation_pb2, generation_pb2_grpc
from services.endless_streams import EndlessStreams
from services.frontend.engine_seam import CallContext
from services.frontend.generation_servicer import GenerationServicer
from services.frontend.grpc_server import new_server
from services.frontend.responses.store import ResponseStore
from services.frontend.routing_headers import PREFILL_PEER_HEADER, prefill_peer_of
from services.frontend.served_model import ServedModel
from services.health_port import HealthPort
from services.observability.observed_engine import observed
from services.observability.request_log import RequestLogInterceptor
from services.observability.throughput_log import ThroughputLog
from services.reflection import enable_reflection
from services.replica.admission import Admission
from services.replica.callers import CallerScopes
from services.replica.engine_servicer import EngineServicer
from services.replica.local_engine import LocalEngine
from services.replica.lora_updates import LocalLoraUpdates
from services.replica.options import ReplicaOptions
from services.replica.prefill_peers import PrefillPeers
from services.replica.readiness import wait_listening
from services.suite_tls import add_port

logger = logging.getLogger(__name__)

GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
ENGINE_SERVICE = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name
# "" is the server as a whole, as grpc.health.v1 defines it.
HEALTH_SERVICES = ("", GENERATION_SERVICE, ENGINE_SERVICE)
# After the drain, unary calls get this long to finish before the server cuts every call
# (endless ones too: KV-event and health watchers).
_FINAL_GRACE_S = 1.0
_ENGINE_CHECK_INTERVAL_S = 0.5
_KV_LISTENER_WAIT_S = 30.0


async def start_engine(config: EngineConfig,
                       served_model_name: str | Sequence[str] | None = None) -> AsyncLLM:
    """Start the engine core off the event loop (seconds: the model loads); forked when this
    process is a fresh replica (see ``fork_is_safe``), as it is under ``main``. Its metrics
    name the model as clients do (``served_model_name``)."""
    fork = fork_is_safe()
    if not fork:
        # A slower start (every import again in the child); the threads say what ran.
        logger.info("engine core spawned, not forked: threads running %s",
                    [thread.name for thread in threading.enumerate()][:8])
    return await AsyncLLM.create(config, fork=fork, served_model_name=served_model_name)


class ReplicaServer:
    def __init__(self, options: ReplicaOptions, llm: AsyncLLM) -> None:
        self.options = options
        self.llm = llm
        info = llm.info
        self.model = ServedModel.for_directory(
            options.engine.model, info.max_model_len, options.served_model_name,
            options.engine.model_settings.lora_modules)
        self.admission = Admission(options.engine.scheduler.max_num_seqs, options.max_waiting)
        self.prefill_peers = (PrefillPeers(tls=options.tls, announce_kv=options.kv_overlap)
                              if options.role == "decode" else None)
        self.engine = LocalEngine(llm, self.admission, self.prefill_peers)
        self.health = health_aio.HealthServicer()
        # One log line per request; its choices' n observed as vLLM does.
        self.endless = EndlessStreams()  # the watches, closed at the end of a drain
        self.server = new_server([self.endless,
                                  RequestLogInterceptor(llm.metrics.request_params_n,
                                                        llm.metrics.finished_requests)])
        lora_updates = (
            LocalLoraUpdates(llm, lambda: self.model, self._serve_lora_adapters)
            if options.engine.model_settings.allow_runtime_lora_updating else None)
        self.generation = GenerationServicer(
            self.model, llm.inputs, observed(self.engine.generate, llm.metrics.finished_requests),
            lora_updates,
            ResponseStore.sized(options.max_stored_responses), responder=info.engine_id,
            call_context=self._call_context)
        self.engine_servicer = EngineServicer(
            self.engine, options.role, self.model, lora_updates,
            CallerScopes(max(1, int(options.max_pinned_fraction * info.num_blocks))))
        generation_pb2_grpc.add_GenerationServicer_to_server(self.generation, self.server)
        engine_pb2_grpc.add_EngineServicer_to_server(self.engine_servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        enable_reflection(self.server, (GENERATION_SERVICE, ENGINE_SERVICE, health_pb2.DESCRIPTOR
                                        .services_by_name["Health"].full_name))
        self.port = add_port(self.server, f"{options.host}:{options.port}", options.tls)
        self._metrics_http: WSGIServer | None = None
        self.health_port = (HealthPort(self.health, options.host, options.health_port)
                            if options.health_port else None)
        self._forced = asyncio.Event()
        self._watchdog: asyncio.Task[None] | None = None
        self._throughput_log: asyncio.Task[None] | None = None

    def _call_context(self, context: grpc.aio.ServicerContext) -> CallContext:
        """A public call's deadline, and on a decode replica the prefill replica the endpoint
        picker chose for it (``x-prefiller-host-port``): decode-first P/D, exactly as the
        gateway's ``prefill_peer`` asks. Another role computes the prompt itself; a malformed
        value is INVALID_ARGUMENT on any role."""
        peer = prefill_peer_of(context.invocation_metadata())
        if peer is not None and self.options.role != "decode":
            logger.debug("ignoring %s on a %s replica", PREFILL_PEER_HEADER, self.options.role)
            peer = None
        return CallContext.within(context.time_remaining(), peer)

    @classmethod
    async def start(cls, options: ReplicaOptions) -> ReplicaServer:
        llm = await start_engine(options.engine, options.served_model_name)
        try:
            replica = cls(options, llm)
            await replica._start()
        except BaseException:
            llm.shutdown()
            raise
        return replica

    async def _start(self) -> None:
        if self.options.metrics_port:
            self._metrics_http, _ = start_http_server(
                self.options.metrics_port, addr=self.options.host,
                registry=self.llm.metrics.registry)
        await self.server.start()
        if self.health_port is not None:
            await self.health_port.start()
        await self._kv_listener_answers()
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self._watchdog = asyncio.create_task(self._watch_engine())
        self._throughput_log = asyncio.create_task(
            ThroughputLog(self.llm.metrics, self.llm.info.engine_id).run())
        logger.info(
            "replica %s (role %s) serving %s on %s:%d%s", self.llm.info.engine_id,
            self.options.role, self.model.name, self.options.host, self.port,
            f", metrics on :{self.options.metrics_port}/metrics"
            if self.options.metrics_port else "")

    async def _kv_listener_answers(self) -> None:
        """On a prefill replica, wait until its KV listener accepts connections at the
        address decode replicas dial: SERVING before that sent prompts to a replica whose KV
        no peer could pull."""
        address = self.llm.info.kv_address
        if self.options.role != "prefill" or address is None:
            return
        took = await wait_listening(*address, timeout_s=_KV_LISTENER_WAIT_S)
        logger.info("KV listener %s:%d answers (after %.3f s)", *address, took)

    def _serve_lora_adapters(self, names: frozenset[str]) -> None:
        """Requests may name these adapters from now on (after a load or an unload)."""
        self.model = replace(self.model, lora_names=names)
        self.generation.model = self.engine_servicer.model = self.model

    async def _set_health(self, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        for service in HEALTH_SERVICES:
            await self.health.set(service, status)

    async def _watch_engine(self) -> None:
        while self.llm.dead_reason is None:
            await asyncio.sleep(_ENGINE_CHECK_INTERVAL_S)
        logger.error("engine core died (%s): reporting NOT_SERVING", self.llm.dead_reason)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)

    def force_stop(self) -> None:
        """Cut a drain in progress short (a second signal)."""
        self._forced.set()

    async def shutdown(self, grace_s: float) -> None:
        """Drain (see the module docstring), then stop the server and the engine."""
        await self.health.enter_graceful_shutdown()
        self.admission.start_draining()
        idle = asyncio.create_task(self.admission.wait_idle(grace_s))
        forced = asyncio.create_task(self._forced.wait())
        await asyncio.wait((idle, forced), return_when=asyncio.FIRST_COMPLETED)
        if not (idle.done() and idle.result()):
            logger.warning("stopping with requests still in flight (grace period over or forced)")
        idle.cancel()
        forced.cancel()
        self.endless.end()
        await self.server.stop(0 if self._forced.is_set() else _FINAL_GRACE_S)
        if self.health_port is not None:
            await self.health_port.stop()
        for task in (self._watchdog, self._throughput_log):
            if task is not None:
                task.cancel()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
        if self.prefill_peers is not None:
            await self.prefill_peers.close()
        self.llm.shutdown()
        logger.info("replica %s stopped", self.llm.info.engine_id)


async def serve(options: ReplicaOptions) -> None:
    """Run a replica until SIGTERM or SIGINT, then drain and stop."""
    replica = await ReplicaServer.start(options)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal() -> None:
        if stop.is_set():
            replica.force_stop()
        else:
            logger.info("draining (up to %.0f s); signal again to stop now",
                        options.shutdown_grace_s)
            stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    try:
        await stop.wait()
        await replica.shutdown(options.shutdown_grace_s)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
