"""The engine seam, observed: a ``GenerateFn`` that fills the current request's record.

Owns wrapping the ``GenerateFn`` a public ``GenerationServicer`` runs on (a replica's local
engine, the gateway's remote one) so that each engine request (one per choice) reports its
prompt, its running output count, its first token and its finish reason, and on a decode
replica how its prompt's KV arrived, to the ``RequestRecord`` of the call it belongs to
(``request_record.current_request``), and its KV pull and decode as spans (``phase_spans``).
The deltas pass through unchanged. It does not own
the record or logging it (``request_log``).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing

from engine_common.finished_requests import FinishedRequests
from engine_common.generation_request import GenerationRequest
from services.frontend.engine_seam import CallContext, GenerateFn, GenerationDelta
from services.observability.phase_spans import SequencePhases
from services.observability.request_record import current_request


def observed(generate: GenerateFn, finished: FinishedRequests | None = None) -> GenerateFn:
    """``generate``, reporting to the current request's record (when there is one);
    ``finished``: the engine's recent request statistics (a replica's), for its phases."""

    async def observed_generate(request_id: str, request: GenerationRequest,
                                call: CallContext) -> AsyncGenerator[GenerationDelta, None]:
        record = current_request()
        deltas = generate(request_id, request, call)
        if record is None:
            async with aclosing(deltas):
                async for delta in deltas:
                    yield delta
            return
        record.add_sequence(request_id, request.prompt_token_ids)
        phases = SequencePhases(request_id, finished)
        async with aclosing(deltas):
            async for delta in deltas:
                record.observe(request_id, delta.completion_tokens, delta.prompt_tokens,
                               delta.finish_reason)
                report = delta.kv_transfer
                if report is not None:
                    record.note_kv_transfer(report.fallback_reason or "")
                pulled = report is not None and not report.fallback_reason
                phases.observe(delta.completion_tokens, delta.finish_reason is not None,
                               report.seconds if pulled and report else None,
                               report.num_bytes if report else 0,
                               report.blocks_pulled if report else 0)
                yield delta

    return observed_generate
