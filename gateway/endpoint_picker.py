"""An Envoy ``ext_proc`` endpoint picker: the gateway's choice of replica, made for Envoy.

Speaks the gateway-api-inference-extension endpoint-picker protocol
(``docs/proposals/004-endpoint-picker-protocol``): for each request Envoy streams its headers
and body here; the picker reads the OpenAI JSON body (or the gRPC message of a
``tandem.v1.Generation`` call), tokenizes it as the replicas do, hashes the prompt into their
block-hash chain, runs the gateway's picker over the same registry, load and prefix-index
snapshot, and answers with

- the request header ``x-gateway-destination-endpoint: ip:port`` and the same value under
  ``envoy.lb`` in the dynamic metadata (Envoy's ``ORIGINAL_DST`` cluster connects there);
- for a P/D pick, ``x-prefiller-host-port: ip:port`` naming the prefill replica the decode
  replica should pull the prompt's KV from (as llm-d names it); a client's own copy of either
  header is removed;
- an immediate 503 when no replica is eligible (none healthy, or none in the
  ``envoy.lb.subset_hint`` subset Envoy passed), 429 when shedding: a sheddable request
  (``priority`` > 0, below the default) while every candidate replica is saturated.

A request that reads or continues a stored Responses API response (``GET`` / ``DELETE
/v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``, ``previous_response_id``) goes
to the replica whose engine id the response's id carries, the only one that stored it.

A body the picker cannot read or that the replicas will reject is routed by load alone; the
replica then answers it with its own error, so error messages have one source.

Both ways Envoy can send a body are served: ``BUFFERED`` (one message, answered with the
routing headers) and ``FULL_DUPLEX_STREAMED`` (chunks, as Gateway API implementations
configure endpoint pickers: the headers answer waits for the whole body, which is then
streamed back unchanged). Response messages, if configured, pass through unchanged.

It does not own choosing (``picker``), the views of the cluster (``registry``, ``load``,
``prefix_index``) or running the server (``endpoint_picker_main``).
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field

import grpc.aio
from google.protobuf import json_format, struct_pb2
from google.protobuf.message import Message

from engine_common.block_hash import BlockHash
from engine_common.input_processor import InputProcessor
from gateway.load import LoadTracker
from gateway.metrics import GatewayMetrics
from gateway.picker import DECODE_ROLES, NoReplicaError, PickerConfig, RoutingDecision, pick
from gateway.prefix_index import PrefixIndex
from gateway.registry import ReplicaRegistry
from gateway.role_fallback import RoleFallbacks
from gateway.snapshot import take_snapshot
from protos.tandem.v1 import generation_pb2 as pb
from protos.third_party.envoy.config.core.v3 import base_pb2
from protos.third_party.envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from protos.third_party.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from protos.third_party.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from protos.third_party.envoy.type.v3 import http_status_pb2
from services.frontend.chat.request import chat_to_engine_request
from services.frontend.completions.request import completion_to_engine_request
from services.frontend.responses import translate as responses_api
from services.frontend.routing_headers import (
    PREFILL_FALLBACK,
    PREFILL_OUTCOME_HEADER,
    PREFILL_PEER_HEADER,
    PREFILL_REMOTE,
)

logger = logging.getLogger(__name__)

DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
EXT_PROC_SERVICE = ep.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
_FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
# Envoy recommends body chunks of at most 64 KiB in FULL_DUPLEX_STREAMED answers.
_CHUNK_BYTES = 62 * 1024
_GRPC_UNAVAILABLE = 14
_GRPC_RESOURCE_EXHAUSTED = 8


@dataclass(frozen=True)
class SheddingPolicy:
    """When the cluster counts as saturated (the inference extension's detector defaults): every
    candidate has at least ``queue_depth_threshold`` requests waiting or its KV cache at least
    ``kv_cache_threshold`` full."""

    queue_depth_threshold: int = 5
    kv_cache_threshold: float = 0.8


@dataclass(frozen=True)
class RequestFeatures:
    """What the picker reads from a request body."""

    prompt_token_ids: list[int] = field(default_factory=list)
    cache_salt: str = ""
    # Lower runs first; above 0 is below the default, so sheddable.
    priority: int = 0
    lora_name: str = ""
    # The engine id of the replica that stored the response the request reads or continues
    # (``responses_api.responder_of``): only it can serve the request.
    responder: str = ""


@dataclass(frozen=True)
class Choice:
    """Where a request goes, or why it goes nowhere (``status`` 503 or 429)."""

    status: int
    destination: str = ""
    prefill: str = ""
    # The prompt's block hashes, as the pick expects them on its replicas.
    block_hashes: tuple[BlockHash, ...] = ()
    message: str = ""


# Paths whose body is a completion or chat request: Envoy's OpenAI routes (before the
# transcoder) and the gRPC methods (for gRPC clients of the same port).
_COMPLETION_PATHS = frozenset({
    "/v1/completions", "/v1/completions:stream",
    "/tandem.v1.Generation/Complete", "/tandem.v1.Generation/CompleteStream",
    "/tandem.v1.Generation/CompleteEvents"})
_CHAT_PATHS = frozenset({
    "/v1/chat/completions", "/v1/chat/completions:stream",
    "/tandem.v1.Generation/ChatComplete", "/tandem.v1.Generation/ChatCompleteStream",
    "/tandem.v1.Generation/ChatCompleteEvents"})
_RESPONSES_PATHS = frozenset({
    "/v1/responses", "/v1/responses:stream",
    "/tandem.v1.Generation/CreateResponse", "/tandem.v1.Generation/CreateResponseStream",
    "/tandem.v1.Generation/CreateResponseEvents"})
# A stored response, read (or its events streamed again), deleted, cancelled or its input
# items listed: /v1/responses/{id}... (before the transcoder), or the gRPC methods, whose
# bodies all hold the id as field 1.
_STORED_RESPONSE_PATHS = frozenset({"/tandem.v1.Generation/GetResponse",
                                    "/tandem.v1.Generation/DeleteResponse",
                                    "/tandem.v1.Generation/ListResponseInputItems",
                                    "/tandem.v1.Generation/GetResponseStream",
                                    "/tandem.v1.Generation/GetResponseEvents",
                                    "/tandem.v1.Generation/CancelResponse"})
_STORED_RESPONSE_PREFIX = "/v1/responses/"


def _parse_body(body: bytes, content_type: str, message: Message) -> None:
    if content_type.startswith("application/grpc"):
        # One length-prefixed, uncompressed message (a unary or server-streaming call).
        if len(body) < 5 or body[0] != 0:
            raise ValueError("not one uncompressed gRPC message")
        length = int.from_bytes(body[1:5], "big")
        message.ParseFromString(body[5:5 + length])
    else:
        json_format.Parse(body, message, ignore_unknown_fields=True)


def read_request(path: str, content_type: str, body: bytes, inputs: InputProcessor,
                 lora_names: frozenset[str] = frozenset()) -> RequestFeatures | None:
    """The prompt, salt, priority and LoRA adapter (a model among ``lora_names``) of a
    completion, chat or responses request, tokenized as the replicas tokenize it; None when
    the path carries no prompt or the body cannot be served (the replica will say why)."""
    path = path.split("?", 1)[0]

    def adapter(model: str) -> str | None:
        return model if model in lora_names else None

    if path.startswith(_STORED_RESPONSE_PREFIX):
        # The id is the first segment: /v1/responses/{id}/input_items and .../cancel name it
        # too, and /v1/responses/{id}:stream (Lua's path for GET ...?stream=true).
        response_id = path.removeprefix(_STORED_RESPONSE_PREFIX).split("/", 1)[0]
        response_id = response_id.split(":", 1)[0]
        return RequestFeatures(responder=responses_api.responder_of(response_id))
    responder = ""
    try:
        if path in _STORED_RESPONSE_PATHS:
            stored = pb.GetResponseRequest()
            _parse_body(body, content_type, stored)
            return RequestFeatures(responder=responses_api.responder_of(stored.response_id))
        if path in _COMPLETION_PATHS:
            completion = pb.CompletionRequest()
            _parse_body(body, content_type, completion)
            # A request of several prompts goes where its first prompt is best served.
            request = completion_to_engine_request(
                completion, inputs, adapter(completion.model)).requests[0]
        elif path in _CHAT_PATHS:
            chat = pb.ChatCompletionRequest()
            _parse_body(body, content_type, chat)
            request = chat_to_engine_request(chat, inputs, adapter(chat.model)).request
        elif path in _RESPONSES_PATHS:
            response_request = pb.ResponseRequest()
            _parse_body(body, content_type, response_request)
            request = chat_to_engine_request(
                responses_api.chat_request(response_request), inputs,
                adapter(response_request.model)).request
            responder = responses_api.responder_of(response_request.previous_response_id)
        else:
            return None
    except Exception as error:  # noqa: BLE001 - any unreadable body is routed by load alone
        logger.debug("routing %s by load alone: %s", path, error)
        return None
    return RequestFeatures(request.prompt_token_ids, request.cache_salt or "", request.priority,
                           request.lora_name or "", responder)


def is_saturated(decision: RoutingDecision, waiting: dict[str, int],
                 policy: SheddingPolicy) -> bool:
    """Every decode candidate over a threshold (``waiting``: requests queued per address)."""
    return all(waiting.get(c.address, 0) >= policy.queue_depth_threshold
               or c.kv_cache_usage >= policy.kv_cache_threshold
               for c in decision.candidates)


class EndpointChooser:
    """The picker's decision for one request, over the gateway's live views of the cluster."""

    def __init__(self, registry: ReplicaRegistry, loads: LoadTracker, index: PrefixIndex,
                 inputs: InputProcessor, config: PickerConfig | None = None,
                 shedding: SheddingPolicy | None = None,
                 metrics: GatewayMetrics | None = None,
                 lora_names: frozenset[str] = frozenset()) -> None:
        self.registry = registry
        self.loads = loads
        self.index = index
        self.inputs = inputs
        self._configured_lora_names = lora_names  # given at start (--lora-modules)
        self.config = config or PickerConfig()
        self.shedding = shedding or SheddingPolicy()
        self.metrics = metrics or GatewayMetrics()
        self._tie_breaks = itertools.count()
        self.role_fallbacks = RoleFallbacks(self.metrics)

    @property
    def lora_names(self) -> frozenset[str]:
        """The models that are LoRA adapters (their requests' blocks are hashed under the
        adapter): those given at start and those the replicas serve now."""
        return self._configured_lora_names.union(
            *(r.lora_adapters for r in self.registry.replicas()))

    def choose(self, features: RequestFeatures | None,
               subset: Sequence[str] | None = None) -> Choice:
        features = features or RequestFeatures()
        tokens = features.prompt_token_ids
        snapshot = take_snapshot(self.registry, self.loads, self.index, tokens,
                                 features.cache_salt, features.lora_name)
        exclude = (frozenset(r.address for r in snapshot.replicas if r.address not in subset)
                   if subset is not None else frozenset())
        if features.responder:
            holder = next((r for r in self.registry.routable()
                           if r.engine_id == features.responder), None)
            if holder is not None:  # else any replica says the response is not there
                if not tokens:  # a stored response read or deleted
                    return Choice(200, holder.address)
                exclude |= {r.address for r in snapshot.replicas
                            if r.role in DECODE_ROLES and r.address != holder.address}
        try:
            decision = pick(snapshot.replicas, len(tokens), snapshot.block_size, self.config,
                            exclude=exclude, tie_break=next(self._tie_breaks),
                            lora_name=features.lora_name)
        except NoReplicaError as error:
            self.metrics.no_replica.inc()
            return Choice(503, message=str(error))
        if features.priority > 0:
            waiting = {r.address: r.load.num_waiting for r in snapshot.replicas}
            if is_saturated(decision, waiting, self.shedding):
                return Choice(429, message=(
                    "every replica is saturated and this request's priority "
                    f"({features.priority}) is below the default; retry later"))
        self.metrics.routing_decisions.labels(decision.reason, decision.pd_reason).inc()
        self.role_fallbacks.observe(decision)
        self.metrics.picks.labels(decision.decode.address, "decode").inc()
        self.metrics.prefix_match_fraction.observe(decision.decode.prefix_fraction)
        self.index.expect(decision.decode.address, snapshot.block_hashes)
        prefill = ""
        if decision.prefill is not None:
            prefill = decision.prefill.address
            self.metrics.picks.labels(prefill, "prefill").inc()
            self.index.expect(prefill, snapshot.block_hashes)
        return Choice(200, decision.decode.address, prefill, block_hashes=tuple(
            snapshot.block_hashes))


def _header_map(headers: base_pb2.HeaderMap) -> dict[str, str]:
    # Envoy puts values in raw_value; older versions used value.
    return {h.key.lower(): (h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value)
            for h in headers.headers}


def _subset_hint(metadata: base_pb2.Metadata) -> list[str] | None:
    hint = metadata.filter_metadata.get(SUBSET_NAMESPACE)
    if hint is None or SUBSET_KEY not in hint.fields:
        return None
    value = hint.fields[SUBSET_KEY]
    if value.WhichOneof("kind") == "list_value":
        return [v.string_value for v in value.list_value.values]
    return [a.strip() for a in value.string_value.split(",") if a.strip()]


def _set_header(name: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=name, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


def routing_mutation(choice: Choice) -> ep.HeaderMutation:
    mutation = ep.HeaderMutation(set_headers=[_set_header(DESTINATION_HEADER, choice.destination)])
    if choice.prefill:
        mutation.set_headers.append(_set_header(PREFILL_PEER_HEADER, choice.prefill))
    else:
        mutation.remove_headers.append(PREFILL_PEER_HEADER)
    return mutation


def routing_metadata(choice: Choice) -> struct_pb2.Struct:
    metadata = struct_pb2.Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION_HEADER: choice.destination}})
    return metadata


def refusal(choice: Choice, grpc_request: bool) -> ep.ProcessingResponse:
    """An immediate 503 or 429, OpenAI-shaped for HTTP clients, a gRPC status for gRPC ones."""
    error_type = "rate_limit_error" if choice.status == 429 else "server_error"
    code = "resource_exhausted" if choice.status == 429 else "unavailable"
    body = json.dumps({"error": {"message": choice.message, "type": error_type,
                                 "param": None, "code": code}})
    reply = ep.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=choice.status),  # type: ignore[arg-type]
        headers=ep.HeaderMutation(set_headers=[_set_header("content-type", "application/json")]),
        body=body.encode(),
        details=f"endpoint_picker_{code}",
    )
    if grpc_request:
        reply.grpc_status.status = (_GRPC_RESOURCE_EXHAUSTED if choice.status == 429
                                    else _GRPC_UNAVAILABLE)
        reply.body = choice.message.encode()
    return ep.ProcessingResponse(immediate_response=reply)


def _streamed_body(body: bytes, end_of_stream: bool) -> Iterable[ep.ProcessingResponse]:
    """The body handed back unchanged, in chunks Envoy accepts (FULL_DUPLEX_STREAMED)."""
    chunks = [body[i:i + _CHUNK_BYTES] for i in range(0, len(body), _CHUNK_BYTES)] or [b""]
    for i, chunk in enumerate(chunks):
        last = end_of_stream and i == len(chunks) - 1
        yield ep.ProcessingResponse(request_body=ep.BodyResponse(response=ep.CommonResponse(
            body_mutation=ep.BodyMutation(streamed_response=ep.StreamedBodyResponse(
                body=chunk, end_of_stream=last)))))


class _Exchange:
    """One request's ext_proc conversation (one ``Process`` stream)."""

    def __init__(self, chooser: EndpointChooser) -> None:
        self.chooser = chooser
        self.headers: dict[str, str] = {}
        self.subset: list[str] | None = None
        self.body = bytearray()
        self.body_seen = False  # a body message arrived (it may be empty)
        self.duplex_request = False
        self.duplex_response = False
        self.choice: Choice | None = None

    def handle(self, message: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        if message.HasField("protocol_config"):
            self.duplex_request = message.protocol_config.request_body_mode == _FULL_DUPLEX
            self.duplex_response = message.protocol_config.response_body_mode == _FULL_DUPLEX
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            self.headers = _header_map(message.request_headers.headers)
            self.subset = _subset_hint(message.metadata_context)
            if message.request_headers.end_of_stream:
                return self._route(headers_phase=True, body_end=True)
            # BUFFERED: Envoy sends the body only after this answer. FULL_DUPLEX_STREAMED:
            # the answer waits for the body (the destination depends on it).
            return [] if self.duplex_request else [
                ep.ProcessingResponse(request_headers=ep.HeadersResponse())]
        if kind == "request_body":
            self.body_seen = True
            self.body += message.request_body.body
            if not message.request_body.end_of_stream:
                return []
            return self._route(headers_phase=self.duplex_request, body_end=True)
        if kind == "request_trailers":  # FULL_DUPLEX_STREAMED with trailers ends the body here
            replies = [] if self.choice is not None else self._route(
                headers_phase=self.duplex_request, body_end=False)
            return replies + [ep.ProcessingResponse(request_trailers=ep.TrailersResponse())]
        if kind == "response_headers":
            self._prefill_outcome(_header_map(message.response_headers.headers))
            return [ep.ProcessingResponse(response_headers=ep.HeadersResponse())]
        if kind == "response_body":
            if self.duplex_response:
                chunk = message.response_body
                return [ep.ProcessingResponse(response_body=ep.BodyResponse(
                    response=ep.CommonResponse(body_mutation=ep.BodyMutation(
                        streamed_response=ep.StreamedBodyResponse(
                            body=chunk.body, end_of_stream=chunk.end_of_stream)))))]
            return [ep.ProcessingResponse(response_body=ep.BodyResponse())]
        if kind == "response_trailers":
            return [ep.ProcessingResponse(response_trailers=ep.TrailersResponse())]
        return []

    def _prefill_outcome(self, headers: dict[str, str]) -> None:
        """A P/D pick's decode replica says where the prompt's KV came from: unless the
        prefill replica computed it, its blocks are not there, and the index must not count
        them (``expect``)."""
        choice = self.choice
        outcome = headers.get(PREFILL_OUTCOME_HEADER)
        if choice is None or not choice.prefill or outcome is None:
            return
        kind = outcome.partition(":")[0]
        self.chooser.metrics.prefill_outcomes.labels(
            outcome[:64] if kind == PREFILL_FALLBACK else PREFILL_REMOTE).inc()
        if kind != PREFILL_REMOTE:
            self.chooser.index.retract(choice.prefill, choice.block_hashes)

    def _route(self, headers_phase: bool, body_end: bool) -> list[ep.ProcessingResponse]:
        content_type = self.headers.get("content-type", "")
        # Bodyless requests too: GET /v1/responses/{id} names its replica in the path.
        features = read_request(self.headers.get(":path", ""), content_type, bytes(self.body),
                                self.chooser.inputs, self.chooser.lora_names)
        self.choice = self.chooser.choose(features, self.subset)
        if self.choice.status != 200:
            logger.info("refusing %s with %d: %s", self.headers.get(":path"),
                        self.choice.status, self.choice.message)
            return [refusal(self.choice, content_type.startswith("application/grpc"))]
        common = ep.CommonResponse(header_mutation=routing_mutation(self.choice))
        metadata = routing_metadata(self.choice)
        if not headers_phase:  # BUFFERED: the body answer carries the routing
            return [ep.ProcessingResponse(request_body=ep.BodyResponse(response=common),
                                          dynamic_metadata=metadata)]
        replies = [ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common),
                                         dynamic_metadata=metadata)]
        if self.body_seen:  # FULL_DUPLEX_STREAMED: the body goes on only as we send it back
            replies += _streamed_body(bytes(self.body), end_of_stream=body_end)
        return replies

    @property
    def picked(self) -> list[str]:
        if self.choice is None or self.choice.status != 200:
            return []
        return [a for a in (self.choice.destination, self.choice.prefill) if a]


class EndpointPickerServicer(ep_grpc.ExternalProcessorServicer):
    """``envoy.service.ext_proc.v3.ExternalProcessor`` over an ``EndpointChooser``. The
    replicas a request was sent to count it as in flight until Envoy closes the stream."""

    def __init__(self, chooser: EndpointChooser) -> None:
        self.chooser = chooser

    async def Process(  # type: ignore[override]  # noqa: N802 (gRPC's name)
        self, request_iterator: AsyncIterator[ep.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[ep.ProcessingResponse]:
        exchange = _Exchange(self.chooser)
        counted: list[str] = []
        try:
            async for message in request_iterator:
                for reply in exchange.handle(message):
                    yield reply
                if not counted and exchange.picked:
                    counted = exchange.picked
                    for address in counted:
                        self.chooser.loads.stream_started(address)
        finally:
            for address in counted:
                self.chooser.loads.stream_finished(address)
