"""The internal ``tandem.v1.Engine`` service of one replica (gateway -> replica, peer -> peer).

Owns the handlers: Generate (tokenized requests streamed back as ``GenerateResponse`` deltas),
Abort, GetLoad and WatchLoad (the scheduler's latest statistics and the cumulative prefix-cache
counters, once or as they change: ``load_watch`` paces them),
WatchKvEvents, GetInfo, and the P/D pair on a prefill replica: Prefill (compute the prompt,
sample the first token, pin the blocks under a lease, answer with a KV handle; asked to
announce the KV, it first streams handles on the blocks that become final while later chunks
are computed; asked for keepalives, it sends one whenever ``keepalive_s`` passes without
another message, since its caller sets no deadline on a prompt that queues) and ReleaseKv (a
decode replica is done with them). A Generate that names a ``prefill_peer`` gets its KV from
that replica when this one decodes (``LocalEngine``); any other role computes the prefill here
and says so in ``kv_transfer.fallback_reason``.

WatchKvEvents replays the batches after ``since_seq`` and then streams new ones live. Every
message carries the engine's incarnation, a random id drawn once per engine start, and a
watcher names the one its ``since_seq`` belongs to. When the replica's event log no longer
covers ``since_seq`` (the watcher fell too far behind, or it watched another incarnation of
this engine: the request names one, or its seq was higher), it sends a snapshot of every
block hash in the prefix cache instead, taken by the engine core between two steps:
one or more batches with ``resync=true``, the snapshot's ``seq`` and a ``snapshot`` piece
each (no events), then the live batches from ``seq + 1``. The watcher replaces what it knew
about this replica with the snapshot and applies the rest on top (see engine.proto).
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import replace
from typing import cast

import grpc.aio

from engine_common.generation_request import GenerationRequest
from engine_common.kv_events import KVCacheSnapshotChunk, KVEventBatch
from engine_common.output_processor import RequestOutput
from engine_common.outputs import ANNOUNCEMENT_LEASE_SEPARATOR
from engine_common.sampling_params import SamplingParams
from protos.tandem.v1 import engine_pb2 as epb
from protos.tandem.v1 import engine_pb2_grpc as epb_grpc
from services.engine_api.messages import (
    delta_to_response,
    kv_event_batch_to_pb,
    kv_handle_to_pb,
    position_to_pb,
    sampling_params_from_pb,
)
from services.engine_api.prefill_handback import caller_takes_handback
from services.frontend.engine_seam import CallContext
from services.frontend.errors import FailedPrecondition, InvalidArgument, rpc_handler
from services.frontend.lora_updates import LoraUpdates, runtime_updates_off
from services.frontend.served_model import ServedModel
from services.replica.callers import CallerScopes, caller_of
from services.replica.keepalive import with_keepalives
from services.replica.kv_address import may_advertise
from services.replica.load_watch import LoadPacing, paced_reports
from services.replica.local_engine import LocalEngine


class EngineServicer(epb_grpc.EngineServicer):
    def __init__(self, engine: LocalEngine, role: str, model: ServedModel,
                 lora_updates: LoraUpdates | None = None,
                 callers: CallerScopes | None = None):
        self.engine = engine
        # Whose work is whose (Abort, ReleaseKv) and how much one caller may pin.
        self.callers = callers or CallerScopes(max_pinned_blocks=engine.llm.info.num_blocks)
        self.llm = engine.llm
        self.role = role
        self.model = model
        self.lora_updates = lora_updates  # None: adapters are fixed at start

    @rpc_handler
    async def Generate(self, request: epb.GenerateRequest,  # noqa: N802 (gRPC's names)
                       context: grpc.aio.ServicerContext) -> None:
        request_id = request.request_id or f"gen-{uuid.uuid4().hex}"
        generation = self._generation_request(request)
        await self.llm.check_structured_output(generation.params)  # before admission
        resumed = generation.num_resumed_tokens
        # A resumed stream recomputes here: the prefill replica never saw its output tokens.
        peer = request.prefill_peer if request.HasField("prefill_peer") and not resumed else None
        call = CallContext.within(context.time_remaining(), peer)
        return_token_ids = request.output_options.return_token_ids
        self.callers.started(request_id, caller_of(context.peer()))
        try:
            # A caller that routes again (the gateway) takes back a request whose prefill
            # peer is down (services.engine_api.prefill_handback).
            hand_back = caller_takes_handback(context.invocation_metadata())
            async with aclosing(self.engine.generate(request_id, generation, call,
                                                     hand_back=hand_back)) as deltas:
                async for delta in deltas:
                    response = delta_to_response(delta, request_id, return_token_ids)
                    # Resumed tokens were sent by the replica that died: they count as output.
                    response.prompt_tokens -= resumed
                    response.completion_tokens += resumed
                    await context.write(response)
        finally:
            self.callers.finished(request_id)

    def _generation_request(self, request: epb.GenerateRequest) -> GenerationRequest:
        params = _one_choice(sampling_params_from_pb(request.sampling_params))
        prompt = list(request.prompt_token_ids)
        resumed = list(request.resume_output_token_ids)
        if resumed:
            if params.max_tokens is not None and len(resumed) >= params.max_tokens:
                raise InvalidArgument(
                    f"resume_output_token_ids holds {len(resumed)} tokens, which already "
                    f"reaches max_tokens ({params.max_tokens}); the request is complete")
            if not prompt:
                raise InvalidArgument("prompt_token_ids is empty")
            params = replace(
                params,
                max_tokens=None if params.max_tokens is None else params.max_tokens - len(resumed),
                min_tokens=max(0, params.min_tokens - len(resumed)),
                # The replica that began the stream sent them with its first token.
                prompt_logprobs=None)
            prompt += resumed
        self.llm.inputs.validate_prompt(prompt, params.max_tokens)
        self.llm.inputs.check_sampling_token_ids(params)
        return GenerationRequest(prompt, params, request.priority, request.cache_salt or None,
                                 self._lora_name(request.lora_name),
                                 num_resumed_tokens=len(resumed))

    def _lora_name(self, requested: str) -> str | None:
        """The LoRA adapter a request names (empty: none); raises InvalidArgument for one
        this replica did not load."""
        if requested and requested not in self.model.lora_names:
            loaded = ", ".join(sorted(self.model.lora_names)) or "none"
            raise InvalidArgument(f"LoRA adapter {requested!r} is not loaded on this replica "
                                  f"(loaded: {loaded}); start it with --lora-modules "
                                  f"{requested}=PATH, or load it with LoadLoraAdapter")
        return requested or None

    @rpc_handler
    async def Prefill(self, request: epb.PrefillRequest,  # noqa: N802
                      context: grpc.aio.ServicerContext) -> None:
        self._check_prefill_caller(request, context.peer())
        params = _one_choice(sampling_params_from_pb(request.sampling_params))
        prompt = list(request.prompt_token_ids)
        self.llm.inputs.validate_prompt(prompt, None)
        self.llm.inputs.check_sampling_token_ids(params)
        await self.llm.check_structured_output(params)
        caller, blocks = caller_of(context.peer()), -(-len(prompt) // self.llm.info.block_size)
        self.callers.check_new(request.request_id)
        self.callers.check_pin(caller, blocks)
        generation = GenerationRequest(prompt, params, request.priority,
                                       request.cache_salt or None,
                                       self._lora_name(request.lora_name))
        keepalive_s = _keepalive_interval(request.keepalive_s)
        answered = False
        with self.engine.admission.admit(request.request_id):
            outputs = self.llm.prefill(request.request_id, generation, request.announce_kv)
            try:
                async with aclosing(outputs):
                    first_block = 0  # of the next announcement: they come in prompt order
                    async for output in with_keepalives(outputs, keepalive_s):
                        if output is None:
                            await context.write(epb.PrefillResponse(
                                request_id=request.request_id, keepalive=True))
                            continue
                        assert output.kv_handle is not None
                        # Pinned from the first announcement on: the caller may release them.
                        self.callers.pin(request.request_id, caller, blocks,
                                         output.kv_handle.lease_deadline)
                        message = self._prefill_message(request.request_id, output, first_block)
                        first_block += len(output.kv_handle.block_ids)
                        answered = message.HasField("first_token_id")
                        await context.write(message)
            finally:
                if not answered:  # ended early: the engine released what it pinned
                    self.callers.released(request.request_id)

    def _prefill_message(self, request_id: str, output: RequestOutput,
                         first_block: int) -> epb.PrefillResponse:
        """An announcement of the blocks from ``first_block`` (an output without tokens), or
        the result: the first token and a handle on every block."""
        assert output.kv_handle is not None
        handle = kv_handle_to_pb(output.kv_handle, self.llm.info.kv_layout,
                                 output.num_cached_tokens, request_id)
        if not output.new_token_ids:
            return epb.PrefillResponse(request_id=request_id, kv_handle=handle,
                                       first_block=first_block)
        response = epb.PrefillResponse(request_id=request_id, kv_handle=handle,
                                       first_token_id=output.new_token_ids[0])
        delta = self.engine.delta_of(output)
        if delta.logprobs:
            response.first_token_logprobs.CopyFrom(position_to_pb(delta.logprobs[0]))
        response.prompt_logprobs.extend(position_to_pb(p) for p in delta.prompt_logprobs or ())
        return response

    def _check_prefill_caller(self, request: epb.PrefillRequest, peer: str) -> None:
        if self.role != "prefill":
            raise FailedPrecondition(
                f"this replica's role is {self.role}; Prefill is served by prefill replicas")
        if not request.request_id:
            raise InvalidArgument("request_id is required: the decode replica releases the "
                                  "blocks under it")
        if ANNOUNCEMENT_LEASE_SEPARATOR in request.request_id:
            raise InvalidArgument("request_id must not contain the character U+001F: it "
                                  "separates the ids of the leases announced blocks are "
                                  "pinned under")
        kv_host = self.llm.config.kv_transfer.host
        if not may_advertise(kv_host, peer):
            raise FailedPrecondition(
                f"this prefill replica's KV address is {kv_host} (loopback), which a decode "
                "replica on another host cannot reach; start it with --kv-host set to an "
                "address other hosts reach")

    @rpc_handler
    async def ReleaseKv(self, request: epb.ReleaseKvRequest,  # noqa: N802
                        context: grpc.aio.ServicerContext) -> epb.ReleaseKvResponse:
        if self.role != "prefill":
            raise FailedPrecondition(f"this replica's role is {self.role}; it pins no KV blocks")
        if request.engine_id and request.engine_id != self.llm.info.engine_id:
            # A handle of an earlier incarnation of this replica: nothing of it is held.
            return epb.ReleaseKvResponse(released=False)
        self.callers.check_release(request.request_id, caller_of(context.peer()))
        self.llm.release_kv(request.request_id)
        self.callers.released(request.request_id)
        return epb.ReleaseKvResponse(released=True)

    @rpc_handler
    async def Abort(self, request: epb.AbortRequest,  # noqa: N802
                    context: grpc.aio.ServicerContext) -> epb.AbortResponse:
        # Only the caller's own Generate requests: another caller's ids are not its to stop.
        own = self.callers.abortable(list(request.request_ids), caller_of(context.peer()))
        return epb.AbortResponse(aborted_request_ids=self.engine.abort(own))

    @rpc_handler
    async def GetLoad(self, request: epb.GetLoadRequest,  # noqa: N802
                      context: grpc.aio.ServicerContext) -> epb.LoadReport:
        return self._load_report()

    @rpc_handler
    async def WatchLoad(self, request: epb.WatchLoadRequest,  # noqa: N802
                        context: grpc.aio.ServicerContext) -> None:
        reports = paced_reports(self._load_report, LoadPacing.of(request))
        async with aclosing(reports):
            async for report in reports:
                await context.write(report)

    def _load_report(self) -> epb.LoadReport:
        stats, info = self.llm.stats, self.llm.info
        return epb.LoadReport(
            engine_id=info.engine_id,
            role=self.role,
            model=self.model.name,
            num_requests_running=stats.num_running_reqs,
            num_requests_waiting=stats.num_waiting_reqs,
            kv_cache_usage_perc=stats.kv_cache_usage,
            num_free_blocks=stats.num_free_blocks,
            num_total_blocks=stats.num_total_blocks,
            prefix_cache_queries=self.llm.prefix_cache_queries,
            prefix_cache_hits=self.llm.prefix_cache_hits,
            num_preemptions=self.llm.num_preemptions,
            block_size=info.block_size,
            tensor_parallel_size=info.tensor_parallel_size,
            kv_events_last_seq=self.llm.kv_events.last_seq,
            timestamp=time.time(),
            lora_adapters=sorted(self.model.lora_names),
            num_prefill_tokens_queued=stats.num_prefill_tokens_queued,
            # Rounded: a report is sent again only when its content changes (load_watch).
            prefill_tokens_per_s=float(f"{stats.prefill_tokens_per_s:.3g}"),
            prefill_share=round(stats.prefill_share, 3),
        )

    @rpc_handler
    async def WatchKvEvents(self, request: epb.WatchKvEventsRequest,  # noqa: N802
                            context: grpc.aio.ServicerContext) -> None:
        if request.since_seq < 0:
            raise InvalidArgument(f"since_seq must be 0 or more, got {request.since_seq}")
        incarnation = self.llm.kv_events.incarnation
        watch = cast(AsyncGenerator[list[KVEventBatch] | KVCacheSnapshotChunk, None],
                     self.llm.watch_kv_events(request.since_seq, request.incarnation))
        async with aclosing(watch):
            async for item in watch:
                if isinstance(item, KVCacheSnapshotChunk):
                    await context.write(_snapshot_chunk_to_pb(item, incarnation))
                    continue
                for batch in item:
                    message = kv_event_batch_to_pb(batch)
                    message.incarnation = incarnation
                    await context.write(message)

    @rpc_handler
    async def GetInfo(self, request: epb.GetInfoRequest,  # noqa: N802
                      context: grpc.aio.ServicerContext) -> epb.EngineInfo:
        info, layout = self.llm.info, self.llm.info.kv_layout
        return epb.EngineInfo(
            engine_id=info.engine_id,
            role=self.role,
            model=self.model.name,
            max_model_len=info.max_model_len,
            block_size=info.block_size,
            kv_layout=epb.KvLayout(
                model=layout.model, dtype=layout.dtype, num_layers=layout.num_layers,
                num_kv_heads=layout.num_kv_heads, head_size=layout.head_size,
                block_size=layout.block_size, fingerprint=layout.fingerprint(),
                tensor_parallel_size=layout.tensor_parallel_size),
            lora_adapters=sorted(self.model.lora_names),
            model_summary=list(info.model_summary),
            tensor_parallel_size=info.tensor_parallel_size,
        )

    @rpc_handler
    async def LoadLora(self, request: epb.LoadLoraRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> epb.LoraAdapters:
        if self.lora_updates is None:
            raise runtime_updates_off()
        _, names = await self.lora_updates.load(request.lora_name, request.lora_path)
        return epb.LoraAdapters(names=names)

    @rpc_handler
    async def UnloadLora(self, request: epb.UnloadLoraRequest,  # noqa: N802
                         context: grpc.aio.ServicerContext) -> epb.LoraAdapters:
        if self.lora_updates is None:
            raise runtime_updates_off()
        _, names = await self.lora_updates.unload(request.lora_name)
        return epb.LoraAdapters(names=names)


def _snapshot_chunk_to_pb(chunk: KVCacheSnapshotChunk, incarnation: str) -> epb.KvEventBatch:
    return epb.KvEventBatch(
        seq=chunk.seq, timestamp=chunk.timestamp, resync=True, incarnation=incarnation,
        snapshot=epb.KvCacheSnapshot(block_hashes=chunk.block_hashes,
                                     chunk_index=chunk.index, num_chunks=chunk.count))


def _one_choice(params: SamplingParams) -> SamplingParams:
    """The internal API computes one sequence per call: the public Generation API (replica
    or gateway) fans a request for n choices out into n calls."""
    if params.n != 1:
        raise InvalidArgument(
            f"sampling_params.n must be 1 on the Engine API (got {params.n}); ask the "
            "Generation API for several choices, or make one call per choice")
    return params


def _keepalive_interval(keepalive_s: float) -> float:
    """A Prefill's keepalive interval: 0 (none), or 0.1 to 60 s; InvalidArgument otherwise."""
    if keepalive_s == 0:
        return 0.0
    if not math.isfinite(keepalive_s) or not 0.1 <= keepalive_s <= 60:
        raise InvalidArgument(f"keepalive_s must be 0 (none) or between 0.1 and 60 seconds, "
                              f"got {keepalive_s:.3g}")
    return keepalive_s
