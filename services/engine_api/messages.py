"""The internal ``tandem.v1.Engine`` messages and the engine's records, both ways.

Owns ``SamplingParams`` <-> ``engine_pb2.SamplingParams``, ``GenerationDelta`` <->
``GenerateResponse`` and KV-event batches -> ``KvEventBatch``. The replica uses the
``*_from_pb`` / ``*_to_pb`` pair that serves a request; the gateway uses the other pair to
send one (``sampling_params_to_pb``) and read the stream back (``delta_from_response``), so a
round trip is the identity. A field of ``SamplingParams`` travels in the engine message's field
of the same name, converted by that field's kind; only the fields whose wire form differs
have converters of their own. It does not own validation (``SamplingParams`` validates on
construction) or the RPCs themselves (``engine_servicer``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any

from engine_common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from engine_common.outputs import KvTransferReport, TokenLogprobs
from engine_common.sampling_params import SamplingParams
from engine_common.structured_output.spec import StructuredOutputSpec
from kv_transfer.connector import KvHandle
from kv_transfer.layout import KvLayout
from protos.tandem.v1 import engine_pb2 as epb
from services.frontend.engine_seam import GenerationDelta, PositionLogprobs, TokenChoice

_ENGINE_FIELDS = epb.SamplingParams.DESCRIPTOR.fields_by_name


def _structured_output_from_pb(message: epb.SamplingParams) -> StructuredOutputSpec | None:
    if not message.HasField("structured_output"):
        return None
    wanted = message.structured_output
    return StructuredOutputSpec.parse(
        wanted.kind, wanted.value, tuple(wanted.starts_after),
        wanted.waits_if_first if wanted.HasField("waits_if_first") else None)


def _structured_output_to_pb(message: epb.SamplingParams,
                             spec: StructuredOutputSpec | None) -> None:
    if spec is not None:
        message.structured_output.kind = spec.kind
        message.structured_output.value = spec.value
        message.structured_output.starts_after.extend(spec.starts_after)
        if spec.waits_if_first is not None:
            message.structured_output.waits_if_first = spec.waits_if_first


# The fields whose wire form is not their value as it stands. Every other field of
# SamplingParams travels in the engine message's field of the same name, converted by that
# field's kind (optional scalar, repeated scalar, map): a plain new field needs no edit here.
_FROM_PB: dict[str, Callable[[epb.SamplingParams], Any]] = {
    # Unset: up to the context length, not the record's default (the sender resolved any
    # API default already).
    "max_tokens": lambda m: m.max_tokens if m.HasField("max_tokens") else None,
    # An empty list is not a valid value: none means every token.
    "allowed_token_ids": lambda m: list(m.allowed_token_ids) or None,
    "bad_words_token_ids": lambda m: [list(sequence.ids) for sequence in m.bad_words_token_ids],
    "structured_output": _structured_output_from_pb,
}
_TO_PB: dict[str, Callable[[epb.SamplingParams, Any], None]] = {
    "allowed_token_ids": lambda m, ids: m.allowed_token_ids.extend(ids or ()),
    "bad_words_token_ids": lambda m, sequences: m.bad_words_token_ids.extend(
        epb.TokenIds(ids=ids) for ids in sequences),
    "structured_output": _structured_output_to_pb,
}


def _is_map(name: str) -> bool:
    field = _ENGINE_FIELDS[name]
    return field.message_type is not None and field.message_type.GetOptions().map_entry


def sampling_params_from_pb(message: epb.SamplingParams) -> SamplingParams:
    """Unset optional fields take ``SamplingParams``' defaults (but ``max_tokens``)."""
    kwargs: dict[str, Any] = {}
    for f in fields(SamplingParams):
        if f.name in _FROM_PB:
            kwargs[f.name] = _FROM_PB[f.name](message)
        elif _is_map(f.name):
            kwargs[f.name] = dict(getattr(message, f.name))
        elif _ENGINE_FIELDS[f.name].is_repeated:
            kwargs[f.name] = list(getattr(message, f.name))
        elif message.HasField(f.name):
            kwargs[f.name] = getattr(message, f.name)
    return SamplingParams(**kwargs)


def sampling_params_to_pb(params: SamplingParams) -> epb.SamplingParams:
    """Every field is set explicitly, so the receiver's defaults never matter; None (no
    max_tokens, seed or logprobs) stays unset."""
    message = epb.SamplingParams()
    for f in fields(SamplingParams):
        value = getattr(params, f.name)
        if f.name in _TO_PB:
            _TO_PB[f.name](message, value)
        elif _is_map(f.name):
            getattr(message, f.name).update(value)
        elif _ENGINE_FIELDS[f.name].is_repeated:
            getattr(message, f.name).extend(value)
        elif value is not None:
            setattr(message, f.name, value)
    return message


def _choice_to_pb(choice: TokenChoice) -> epb.TokenLogprob:
    return epb.TokenLogprob(token_id=choice.token_id, logprob=choice.logprob,
                            token=choice.token, rank=choice.rank)


def _choice_from_pb(message: epb.TokenLogprob) -> TokenChoice:
    return TokenChoice(message.token_id, message.token, message.logprob, message.rank)


def position_to_pb(position: PositionLogprobs) -> epb.PositionLogprobs:
    return epb.PositionLogprobs(sampled=_choice_to_pb(position.sampled),
                                top=[_choice_to_pb(c) for c in position.top])


def position_from_pb(message: epb.PositionLogprobs) -> PositionLogprobs:
    return PositionLogprobs(_choice_from_pb(message.sampled),
                            [_choice_from_pb(c) for c in message.top])


def delta_to_response(delta: GenerationDelta, request_id: str,
                      return_token_ids: bool) -> epb.GenerateResponse:
    response = epb.GenerateResponse(
        request_id=request_id,
        delta_text=delta.text,
        prompt_tokens=delta.prompt_tokens,
        completion_tokens=delta.completion_tokens,
        cached_tokens=delta.cached_tokens,
        logprobs=[position_to_pb(p) for p in delta.logprobs],
        prompt_logprobs=[position_to_pb(p) for p in delta.prompt_logprobs or ()],
    )
    if return_token_ids:
        response.new_token_ids.extend(delta.token_ids)
    if delta.finish_reason is not None:
        response.finish_reason = delta.finish_reason
    if isinstance(delta.stop_reason, str):
        response.stop_reason = delta.stop_reason
    elif isinstance(delta.stop_reason, int):
        response.stop_token_id = delta.stop_reason
    if delta.kv_transfer is not None:
        response.kv_transfer.CopyFrom(kv_transfer_to_pb(delta.kv_transfer))
    return response


def delta_from_response(response: epb.GenerateResponse) -> GenerationDelta:
    stop_reason: str | int | None = None
    if response.HasField("stop_reason"):
        stop_reason = response.stop_reason
    elif response.HasField("stop_token_id"):
        stop_reason = response.stop_token_id
    return GenerationDelta(
        text=response.delta_text,
        token_ids=list(response.new_token_ids),
        logprobs=[position_from_pb(p) for p in response.logprobs],
        prompt_logprobs=[position_from_pb(p) for p in response.prompt_logprobs] or None,
        finish_reason=response.finish_reason if response.HasField("finish_reason") else None,
        stop_reason=stop_reason,
        prompt_tokens=response.prompt_tokens,
        completion_tokens=response.completion_tokens,
        cached_tokens=response.cached_tokens,
        kv_transfer=kv_transfer_from_pb(response.kv_transfer)
        if response.HasField("kv_transfer") else None,
    )


def kv_transfer_to_pb(report: KvTransferReport) -> epb.KvTransferInfo:
    return epb.KvTransferInfo(
        prefill_engine_id=report.prefill_engine_id, blocks_pulled=report.blocks_pulled,
        blocks_local=report.blocks_local, bytes=report.num_bytes, seconds=report.seconds,
        fallback_reason=report.fallback_reason or "",
        blocks_pulled_early=report.blocks_pulled_early)


def kv_transfer_from_pb(message: epb.KvTransferInfo) -> KvTransferReport:
    return KvTransferReport(
        prefill_engine_id=message.prefill_engine_id, blocks_pulled=message.blocks_pulled,
        blocks_local=message.blocks_local, num_bytes=message.bytes, seconds=message.seconds,
        fallback_reason=message.fallback_reason or None,
        blocks_pulled_early=message.blocks_pulled_early)


def kv_handle_to_pb(handle: KvHandle, layout: KvLayout, num_cached_tokens: int,
                    request_id: str) -> epb.KvHandle:
    """``request_id``: the request's; the handle's lease is named apart when it differs (an
    announcement's)."""
    return epb.KvHandle(
        lease_id="" if handle.request_id == request_id else handle.request_id,
        engine_id=handle.engine_id, ucx_address=handle.host, ucx_port=handle.port,
        block_ids=handle.block_ids, num_tokens=handle.num_tokens,
        lease_deadline_unix_ms=handle.lease_generation,  # exact: the lease's generation
        layout=epb.KvLayout(
            model=layout.model, dtype=layout.dtype, num_layers=layout.num_layers,
            num_kv_heads=layout.num_kv_heads, head_size=layout.head_size,
            block_size=layout.block_size, fingerprint=handle.layout_fingerprint,
            tensor_parallel_size=layout.tensor_parallel_size),
        num_cached_tokens=num_cached_tokens)


def kv_handle_from_pb(message: epb.KvHandle, request_id: str) -> KvHandle:
    """The handle's ``request_id`` is the lease a pull names: ``lease_id``, else the request's."""
    return KvHandle(
        engine_id=message.engine_id, host=message.ucx_address, port=message.ucx_port,
        request_id=message.lease_id or request_id, block_ids=tuple(message.block_ids), num_tokens=message.num_tokens,
        lease_deadline=message.lease_deadline_unix_ms / 1000,
        layout_fingerprint=message.layout.fingerprint,
        tensor_parallel_size=message.layout.tensor_parallel_size or 1)


def token_logprobs_from_pb(message: epb.PositionLogprobs) -> TokenLogprobs:
    return TokenLogprobs(
        token_id=message.sampled.token_id, logprob=message.sampled.logprob,
        rank=message.sampled.rank, top=[(c.token_id, c.logprob) for c in message.top])


def kv_event_batch_to_pb(batch: KVEventBatch) -> epb.KvEventBatch:
    message = epb.KvEventBatch(seq=batch.seq, timestamp=batch.timestamp)
    for event in batch.events:
        if isinstance(event, BlockStored):
            stored = message.events.add().block_stored
            stored.block_hashes.extend(event.block_hashes)
            if event.parent_block_hash is not None:
                stored.parent_block_hash = event.parent_block_hash
            stored.token_ids.extend(event.token_ids)
            stored.block_size = event.block_size
            stored.medium = event.medium
        elif isinstance(event, BlockRemoved):
            removed = message.events.add().block_removed
            removed.block_hashes.extend(event.block_hashes)
            removed.medium = event.medium
        elif isinstance(event, AllBlocksCleared):
            message.events.add().all_blocks_cleared.SetInParent()
    return message
