"""The replica's engine as a ``GenerateFn``: ``AsyncLLM`` behind admission control.

Owns turning ``AsyncLLM``'s ``RequestOutput``s into ``GenerationDelta``s (with logprob tokens
decoded to text), holding an admission slot for the life of each request, aborting requests
by id so that their streams end with finish_reason "abort", and, on a decode replica, the
P/D flow of a request that names a prefill replica: ask it to prefill, stream its first token
at once, let the engine pull the KV, release the prefill replica's blocks, or fall back to a
local prefill (policy ``recompute``) when any of that fails, unless the caller routes again
(``services.engine_api.prefill_handback``: then a peer that is down hands the request back).
Both public API
(``generation_servicer``) and internal API (``engine_servicer``) requests go through here, so
one bound covers both. It does not own the engine (``engine_common.async_llm``) or any wire
format.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from typing import cast

import grpc

from engine_common.async_llm import AsyncLLM
from engine_common.core_process import EngineDeadError
from engine_common.generation_request import GenerationRequest
from engine_common.output_processor import RequestOutput
from engine_common.outputs import KvTransferReport, RemoteKvChunk, RemotePrefill, TokenLogprobs
from services.engine_api.prefill_handback import PrefillHandedBack
from services.frontend.engine_seam import (
    CallContext,
    GenerationDelta,
    PositionLogprobs,
    TokenChoice,
)
from services.frontend.errors import Unavailable
from services.frontend.routing_headers import PREFILL_OUTCOME_HEADER, prefill_outcome
from services.replica.admission import Admission
from services.replica.prefill_peers import PrefillFailed, PrefillPeers

# A prefill replica's answer: its result, or its stream of announced chunks, then the result.
RemoteFeed = RemotePrefill | AsyncIterator[RemoteKvChunk | RemotePrefill]


async def _resumed(first: RemoteKvChunk,
                   rest: AsyncGenerator[RemoteKvChunk | RemotePrefill, None]
                   ) -> AsyncGenerator[RemoteKvChunk | RemotePrefill, None]:
    """The stream again from its first item, which was read already; closing it closes
    ``rest``."""
    async with aclosing(rest):
        yield first
        async for item in rest:
            yield item


class LocalEngine:
    def __init__(self, llm: AsyncLLM, admission: Admission,
                 prefill_peers: PrefillPeers | None = None) -> None:
        self.llm = llm
        self.admission = admission
        # Set on decode replicas: requests naming a prefill replica get their KV from it.
        self.prefill_peers = prefill_peers
        self._token_text: dict[int, str] = {}  # bounded by the vocabulary

    async def generate(self, request_id: str, request: GenerationRequest, call: CallContext,
                       *, hand_back: bool = False) -> AsyncGenerator[GenerationDelta, None]:
        """Stream the request's deltas; closing this iterator early aborts the request.
        With ``call.prefill_peer`` (a decode replica) the prompt's KV comes from there; with
        ``hand_back`` too, a peer that is down fails the request with ``PrefillHandedBack``
        (its caller routes it again) instead of this replica computing the prompt."""
        peer = call.prefill_peer
        with self.admission.admit(request_id):
            if self.llm.dead_reason is not None:
                raise Unavailable(f"the engine is not running: {self.llm.dead_reason}")
            remote, engine_id, report = await self._remote_prefill(
                request_id, request, peer, hand_back)
            if peer:  # the public call tells the endpoint picker where the prefill ran
                call.response_headers[PREFILL_OUTCOME_HEADER] = prefill_outcome(
                    None if report is None else report.fallback_reason)
            # An async generator, though annotated as an iterator: it must be closed (which
            # aborts the request) as soon as this one is.
            outputs = cast(AsyncGenerator[RequestOutput, None], self.llm.generate(
                request_id, request, remote_prefill=remote))
            released = remote is None
            try:
                async with aclosing(outputs):
                    async for output in outputs:
                        delta = self.delta_of(output)
                        if report is not None:  # a fallback, reported on the first delta
                            delta.kv_transfer, report = report, None
                        if output.kv_transfer is not None and not released:
                            self._release(peer, engine_id, request_id)
                            released = True
                        yield delta
            except EngineDeadError as error:
                raise Unavailable(f"the engine stopped mid-request: {error}") from error
            finally:
                if not released:  # cancelled or finished before the pull: free P's blocks
                    self._release(peer, engine_id, request_id)

    async def _remote_prefill(self, request_id: str, request: GenerationRequest, peer: str | None,
                              hand_back: bool = False) -> tuple[RemoteFeed | None, str,
                                                                KvTransferReport | None]:
        """Ask the prefill replica ``peer`` for the prompt's KV. Returns its result, or its
        stream still running (announced chunks, then the result) when it announces KV, with
        its engine id; or (None, "", a fallback report) when this replica computes the
        prefill itself. A failure after the stream's first message is the engine's to
        handle (``AsyncLLM.generate``): it computes the prompt here."""
        if not peer:
            return None, "", None
        if self.prefill_peers is None:
            report = KvTransferReport(prefill_engine_id="", fallback_reason="not_a_decode_replica")
        else:
            stream = self.prefill_peers.prefill(peer, request_id, request,
                                                announce_kv=self.prefill_peers.announce_kv)
            try:
                first = await anext(stream)
            except PrefillFailed as error:
                report = KvTransferReport(prefill_engine_id="", fallback_reason=error.reason)
                if hand_back and error.code == grpc.StatusCode.UNAVAILABLE:
                    # Counted here too: the prompt is computed elsewhere, not pulled.
                    self.llm.metrics.record_kv_transfer(report)
                    raise PrefillHandedBack(
                        f"prefill replica {peer} is unavailable ({error.code.name}); "
                        "route the request again") from error
                if self.llm.config.kv_transfer.fallback == "fail":
                    raise Unavailable(
                        f"the prefill replica failed ({error}) and this replica runs with "
                        "--kv-fallback fail") from error
            except BaseException:
                await stream.aclose()  # cancelled: the call ends, P's blocks are released
                raise
            else:
                if isinstance(first, RemotePrefill):
                    await stream.aclose()
                    return first, first.handle.engine_id, None
                return _resumed(first, stream), first.handle.engine_id, None
        self.llm.metrics.record_kv_transfer(report)
        return None, "", report

    def _release(self, peer: str | None, engine_id: str, request_id: str) -> None:
        if engine_id and self.prefill_peers is not None and peer:
            self.prefill_peers.release(peer, request_id, engine_id)

    def abort(self, request_ids: Sequence[str]) -> list[str]:
        """Abort the requests still running here; their streams end with "abort"."""
        live = [rid for rid in dict.fromkeys(request_ids) if self.admission.is_active(rid)]
        self.llm.abort(live)
        return live

    def delta_of(self, output: RequestOutput) -> GenerationDelta:
        return GenerationDelta(
            text=output.delta_text,
            token_ids=list(output.new_token_ids),
            logprobs=[self._position(lp) for lp in output.new_logprobs if lp is not None],
            finish_reason=output.finish_reason,
            stop_reason=output.stop_reason,
            prompt_tokens=output.num_prompt_tokens,
            completion_tokens=output.num_output_tokens,
            cached_tokens=output.num_cached_tokens,
            kv_transfer=output.kv_transfer,
            prompt_logprobs=None if output.prompt_logprobs is None
            else [self._position(lp) for lp in output.prompt_logprobs],
        )

    def _position(self, logprobs: TokenLogprobs) -> PositionLogprobs:
        return PositionLogprobs(
            sampled=TokenChoice(logprobs.token_id, self._text(logprobs.token_id),
                                logprobs.logprob, logprobs.rank),
            top=[TokenChoice(token_id, self._text(token_id), logprob, rank)
                 for rank, (token_id, logprob) in enumerate(logprobs.top, start=1)],
        )

    def _text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = str(self.llm.tokenizer.decode([token_id]))
        return text
