"""The frontend half of the engine: token ids in, text deltas and request metrics out.

Owns one ``IncrementalDetokenizer`` per live request, the stop-string check (a match means
the frontend must abort the request in the core), per-request timing (TTFT, inter-token
latency, end-to-end) and recording engine statistics into ``EngineMetrics``. It does not own
scheduling or the model (the engine core) nor transport (``llm`` / ``async_llm``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from engine_common.detokenizer import IncrementalDetokenizer
from engine_common.metrics import EngineMetrics, FinishedRequestStats
from engine_common.outputs import EngineCoreOutputs, KvTransferReport, TokenLogprobs
from engine_common.sampling_params import SamplingParams
from kv_transfer.connector import KvHandle


@dataclass
class RequestOutput:
    """What a caller sees of a request after one engine step (a streaming delta)."""

    request_id: str
    delta_text: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs | None]
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    kv_handle: KvHandle | None = None
    kv_transfer: KvTransferReport | None = None
    # With the first token of a request that asked for them: its prompt's logprobs
    # (positions 1 on; position 0 has nothing before it).
    prompt_logprobs: list[TokenLogprobs] | None = None


@dataclass
class _RequestState:
    detokenizer: IncrementalDetokenizer
    num_prompt_tokens: int
    arrival_time: float
    num_output_tokens: int = 0
    max_tokens_param: int | None = None  # the request's max_tokens, for the metrics
    scheduled_time: float | None = None  # when the core first ran it
    first_token_time: float | None = None
    last_token_time: float | None = None


class OutputProcessor:
    def __init__(self, tokenizer: object, metrics: EngineMetrics | None = None):
        self.tokenizer = tokenizer
        self.metrics = metrics
        self._states: dict[str, _RequestState] = {}

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        arrival_time: float, num_resumed_tokens: int = 0,
    ) -> None:
        """``num_resumed_tokens``: the prompt ends with that many output tokens of a stream
        that another replica began. They are detokenized as output and their text counted
        as sent, so text that replica was still holding back (a possible stop string, an
        unfinished character) comes out here instead of being lost."""
        num_prompt = len(prompt_token_ids) - num_resumed_tokens
        max_tokens_param = params.max_tokens
        if num_resumed_tokens:
            # The caller's params count only the tokens still to come; the detokenizer counts
            # the resumed ones as output too (min_tokens gates the stop-string check).
            params = replace(params, min_tokens=params.min_tokens + num_resumed_tokens,
                             max_tokens=None)
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids[:num_prompt], params)
        if num_resumed_tokens:
            detokenizer.update(prompt_token_ids[num_prompt:])
            detokenizer.get_delta_text(False)  # what the first replica already streamed
        self._states[request_id] = _RequestState(
            detokenizer=detokenizer,
            num_prompt_tokens=len(prompt_token_ids),
            arrival_time=arrival_time,
            max_tokens_param=max_tokens_param,
        )

    def has_request(self, request_id: str) -> bool:
        return request_id in self._states

    def remove_request(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    @property
    def num_unfinished(self) -> int:
        return len(self._states)

    def process(self, core_outputs: EngineCoreOutputs) -> tuple[list[RequestOutput], list[str]]:
        """Return the outputs for callers and the request ids to abort in the core because
        a stop string ended them here."""
        now = time.monotonic()
        if self.metrics is not None and core_outputs.stats is not None:
            self.metrics.record_scheduler_stats(core_outputs.stats)
        results: list[RequestOutput] = []
        to_abort: list[str] = []
        for out in core_outputs.outputs:
            if out.kv_transfer is not None and self.metrics is not None:
                self.metrics.record_kv_transfer(out.kv_transfer)
            state = self._states.get(out.request_id)
            if state is None:
                continue  # already finished here (stop string) or aborted
            if state.scheduled_time is None:
                state.scheduled_time = out.first_scheduled_time
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
            # A stop by token (EOS, a stop id, a complete grammar's EOS) has no string reason.
            stop_terminated = out.finish_reason == "stop" and not isinstance(out.stop_reason, str)
            stop_string = (state.detokenizer.update(out.new_token_ids, stop_terminated)
                           if out.new_token_ids else None)
            if stop_string is not None and finish_reason is None:
                finish_reason, stop_reason = "stop", stop_string
                to_abort.append(out.request_id)
            elif stop_string is not None:
                finish_reason, stop_reason = "stop", stop_string
            self._record_token_timing(state, len(out.new_token_ids), now)
            state.num_output_tokens += len(out.new_token_ids)
            finished = finish_reason is not None
            results.append(
                RequestOutput(
                    request_id=out.request_id,
                    delta_text=state.detokenizer.get_delta_text(finished),
                    new_token_ids=out.new_token_ids,
                    new_logprobs=out.new_logprobs,
                    finished=finished,
                    finish_reason=finish_reason,
                    stop_reason=stop_reason,
                    num_prompt_tokens=state.num_prompt_tokens,
                    num_output_tokens=state.num_output_tokens,
                    num_cached_tokens=out.num_cached_tokens,
                    kv_handle=out.kv_handle,
                    kv_transfer=out.kv_transfer,
                    prompt_logprobs=out.prompt_logprobs,
                )
            )
            if finished:
                del self._states[out.request_id]
                if self.metrics is not None and finish_reason is not None:
                    self.metrics.record_finished(
                        _finished_stats(out.request_id, state, finish_reason, now))
        return results, to_abort

    def _record_token_timing(self, state: _RequestState, num_new: int, now: float) -> None:
        if self.metrics is None or num_new == 0:
            return
        if state.last_token_time is None:
            state.first_token_time = now
            self.metrics.time_to_first_token.observe(now - state.arrival_time)
            self.metrics.prompt_tokens.inc(state.num_prompt_tokens)
        else:
            self.metrics.inter_token_latency.observe(now - state.last_token_time)
        self.metrics.generation_tokens.inc(num_new)
        state.last_token_time = now


def _finished_stats(request_id: str, state: _RequestState, finish_reason: str,
                    now: float) -> FinishedRequestStats:
    scheduled, first_token = state.scheduled_time, state.first_token_time
    return FinishedRequestStats(
        finish_reason=finish_reason,
        num_prompt_tokens=state.num_prompt_tokens,
        num_generation_tokens=state.num_output_tokens,
        e2e_latency=now - state.arrival_time,
        max_tokens_param=state.max_tokens_param,
        request_id=request_id,
        queued_time=None if scheduled is None else max(0.0, scheduled - state.arrival_time),
        prefill_time=None if scheduled is None or first_token is None
        else max(0.0, first_token - scheduled),
        decode_time=None if first_token is None else now - first_token,
        inference_time=None if scheduled is None else max(0.0, now - scheduled),
    )
