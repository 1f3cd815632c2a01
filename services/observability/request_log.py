"""One INFO log line per request, as a gRPC server interceptor.

Owns opening a ``RequestRecord`` for each call that runs requests through an engine (the
public ``tandem.v1.Generation`` methods that generate, and the internal ``Engine.Generate``
and ``Engine.Prefill``), making it current while the handler runs, filling it from the
internal API's responses (the public API's are filled at the engine seam:
``observed_engine``) with its KV pull and decode spans (``phase_spans``), and logging it when the call ends, however it ends: on the logger
``tandem.requests``, its fields as the JSON keys of ``--log-format json``. It also observes
``vllm:request_params_n`` once per public request, where its choices are fanned out. It does
not own the record's contents (``request_record``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import grpc.aio
from prometheus_client import Histogram

from engine_common.finished_requests import FinishedRequests
from protos.tandem.v1 import engine_pb2 as epb
from services.handler_wrapping import Behaviour, wrap_unary_request
from services.observability.phase_spans import SequencePhases, record_engine_phases
from services.observability.request_record import RequestRecord, request_scope

logger = logging.getLogger("tandem.requests")

GENERATION_SERVICE = "tandem.v1.Generation"
ENGINE_SERVICE = "tandem.v1.Engine"
# The methods that run requests through an engine, by service.
OBSERVED_METHODS = {
    GENERATION_SERVICE: frozenset({
        "Complete", "CompleteStream", "CompleteEvents", "ChatComplete", "ChatCompleteStream",
        "ChatCompleteEvents", "CreateResponse", "CreateResponseStream", "CreateResponseEvents"}),
    ENGINE_SERVICE: frozenset({"Generate", "Prefill"}),
}


class RequestLogInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, params_n: Histogram | None = None,
                 finished: FinishedRequests | None = None) -> None:
        """``params_n``: where the public requests' ``n`` is observed (None: nowhere);
        ``finished``: the engine's recent request statistics (a replica's), whose queue and
        prefill become spans of the internal API's requests."""
        self.params_n = params_n
        self.finished = finished

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        service, _, method = handler_call_details.method.lstrip("/").partition("/")
        if handler is None or method not in OBSERVED_METHODS.get(service, ()):
            return handler
        name = f"{service}/{method}"
        return wrap_unary_request(handler, lambda behaviour: self._logged(name, behaviour))

    def _logged(self, name: str, behaviour: Behaviour) -> Behaviour:
        async def logged(request: Any, context: grpc.aio.ServicerContext) -> Any:
            record = RequestRecord(name)
            if name.startswith(ENGINE_SERVICE):
                _open_engine_request(record, request)
                context = _ObservedContext(context, record, SequencePhases(
                    getattr(request, "request_id", ""), self.finished))
            with request_scope(record):
                try:
                    return await behaviour(request, context)
                except BaseException as error:
                    record.code = _code_of(error, context)
                    raise
                finally:
                    self._finish(record, request)
        return logged

    def _finish(self, record: RequestRecord, request: Any) -> None:
        if self.params_n is not None and record.method.startswith(GENERATION_SERVICE) and (
                record.request_ids):
            # Every choice ran through here (an engine runs one each): vLLM's n, per request.
            self.params_n.observe(getattr(request, "n", 0) or 1)
        fields = record.fields()
        logger.info("%s", record.message(fields), extra={"fields": fields})


def _open_engine_request(record: RequestRecord, request: Any) -> None:
    if isinstance(request, epb.GenerateRequest | epb.PrefillRequest):
        record.add_sequence(request.request_id, list(request.prompt_token_ids))


class _ObservedContext:
    """The handler's context, with each response it writes (an ``Engine.Generate`` or
    ``Engine.Prefill`` stream's) read into the request's record first."""

    def __init__(self, context: grpc.aio.ServicerContext, record: RequestRecord,
                 phases: SequencePhases) -> None:
        self._context = context
        self._record = record
        self._phases = phases

    async def write(self, message: Any) -> None:
        if isinstance(message, epb.PrefillResponse) and message.HasField("first_token_id"):
            # A Prefill stream's last message (those before it announce KV blocks).
            self._record.observe(message.request_id, 1, message.kv_handle.num_tokens)
            record_engine_phases(self._phases.finished, message.request_id)
        if isinstance(message, epb.GenerateResponse):
            finished = message.HasField("finish_reason")
            self._record.observe(message.request_id, message.completion_tokens,
                                 message.prompt_tokens,
                                 message.finish_reason if finished else None)
            kv = message.kv_transfer if message.HasField("kv_transfer") else None
            if kv is not None:
                self._record.note_kv_transfer(kv.fallback_reason)
            pulled = kv is not None and not kv.fallback_reason
            self._phases.observe(message.completion_tokens, finished,
                                 kv.seconds if pulled and kv else None,
                                 kv.bytes if kv else 0, kv.blocks_pulled if kv else 0)
        await self._context.write(message)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


def _code_of(error: BaseException, context: grpc.aio.ServicerContext) -> str:
    if isinstance(error, asyncio.CancelledError):
        return "CANCELLED"
    status = context.code()
    return status.name if isinstance(status, grpc.StatusCode) else "UNKNOWN"
