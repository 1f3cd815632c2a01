"""The asyncio streaming API that the replica service wraps.

``AsyncLLM`` owns the frontend side of one engine: tokenization and validation
(``InputProcessor``), one output stream per request, detokenization and metrics
(``OutputProcessor``), the latest scheduler statistics, the KV-event log that subscribers
replay from (one per ``AsyncLLM``, so its incarnation is drawn once per engine start), the
snapshots of the prefix cache that replace the log for a subscriber it no longer covers, and
the names of the LoRA adapters the core serves, as loads and unloads change them.
The engine core itself runs in its own process (``core_process``), so nothing here can stall
the step loop. Cancelling a stream (client gone, deadline) aborts the request in the core and
frees its blocks.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import replace
from typing import cast

from engine_common.config import EngineConfig
from engine_common.core_process import (
    LORA_EXISTS,
    LORA_INVALID,
    LORA_NOT_FOUND,
    EngineCoreClient,
    EngineDeadError,
    KvCacheSnapshotReply,
    LoraAdapterReply,
)
from engine_common.generation_request import GenerationRequest
from engine_common.input_processor import InputProcessor
from engine_common.kv_events import (
    KVCacheSnapshot,
    KVCacheSnapshotChunk,
    KVEventBatch,
    KVEventBuffer,
)
from engine_common.lora.errors import LoraAdapterExists, LoraAdapterNotFound
from engine_common.metrics import EngineMetrics, served_model_label
from engine_common.output_processor import OutputProcessor, RequestOutput
from engine_common.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    RemoteKvChunk,
    RemoteKvUpdate,
    RemotePrefill,
    RemotePrefillLost,
    SchedulerStats,
)
from engine_common.request import Request, tokens_sampled_elsewhere
from engine_common.sampling_defaults import load_sampling_defaults
from engine_common.sampling_params import SamplingParams
from engine_common.structured_output.grammar import GrammarCompiler
from engine_common.tokenizer import eos_token_ids, load_tokenizer

logger = logging.getLogger(__name__)


# What a ``LoraAdapterReply``'s error kind is raised as; another kind: RuntimeError.
_LORA_ERRORS: dict[str, type[Exception]] = {
    LORA_EXISTS: LoraAdapterExists, LORA_NOT_FOUND: LoraAdapterNotFound, LORA_INVALID: ValueError}


class AsyncLLM:
    def __init__(self, config: EngineConfig, loop: asyncio.AbstractEventLoop,
                 kv_event_capacity: int = 65536, kv_snapshot_chunk_blocks: int = 4096,
                 core: EngineCoreClient | None = None,
                 served_model_name: str | Sequence[str] | None = None):
        """Blocks until the engine core has started (seconds): ``core``, one already
        starting, or one spawned here. ``served_model_name``: the name the metrics label
        the model with (the first of several; default: the model directory's name)."""
        if kv_snapshot_chunk_blocks <= 0:
            raise ValueError(
                f"kv_snapshot_chunk_blocks must be positive, got {kv_snapshot_chunk_blocks}")
        self.config = config
        core = core or EngineCoreClient(config)
        try:  # while the core loads the model
            self.tokenizer = load_tokenizer(config.model, config.model_settings.chat_template)
            self.eos_token_ids = eos_token_ids(config.model, self.tokenizer)
        except BaseException:
            core.shutdown()
            raise
        self._loop = loop
        self._streams: dict[str, asyncio.Queue[RequestOutput | Exception]] = {}
        self.dead_reason: str | None = None
        self.stats = SchedulerStats()
        self.kv_events = KVEventBuffer(kv_event_capacity)
        # Bounds each snapshot piece on the wire (32-byte hashes: 4096 is ~140 KB).
        self.kv_snapshot_chunk_blocks = kv_snapshot_chunk_blocks
        self._kv_event_waiters: set[asyncio.Event] = set()
        # The snapshot asked of the core and not answered yet; every watcher that needs one
        # meanwhile shares it, so the core answers one request at a time, in order.
        self._kv_snapshot: asyncio.Future[KVCacheSnapshot] | None = None
        # LoRA adapters loaded and unloaded at runtime: one change at a time, and the core
        # answers each in order. The answers still to come, oldest first (more than one
        # only when a caller was cancelled before its answer came).
        self._lora_lock = asyncio.Lock()
        self._lora_replies: deque[asyncio.Future[LoraAdapterReply]] = deque()
        self._lora_names = sorted(config.model_settings.lora_modules)
        self.core = core
        self.info = core.wait_started()
        self.stats.num_total_blocks = self.stats.num_free_blocks = self.info.num_blocks
        settings = config.model_settings
        self.inputs = InputProcessor(
            self.tokenizer, self.info.max_model_len, self.info.vocab_size,
            load_sampling_defaults(config.model, settings.generation_config,
                                   settings.override_generation_config),
            settings.tool_call_parser)
        # The frontend's own compiler (the core's lives in its process): a constraint that
        # does not compile is refused before the request is admitted.
        self.grammars = GrammarCompiler(self.tokenizer, self.info.vocab_size, self.eos_token_ids)
        self.metrics = EngineMetrics(served_model_label(config.model, served_model_name),
                                     config.engine_id, max_model_len=self.info.max_model_len)
        self.metrics.set_cache_config(config.cache, self.info.num_blocks)
        self.outputs = OutputProcessor(self.tokenizer, self.metrics)
        # Cumulative prefix-cache counters (the stats carry per-step deltas).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_preemptions = 0
        # Last: a callback may run on the loop as soon as the receiver starts (a restarted
        # replica's first KV events come right after EngineInfo), so everything it uses
        # exists by then. Every callback hops onto the loop from the client's one receiver
        # thread, so they run in the order the core sent their messages.
        core.connect(
            on_outputs=lambda outs: self._loop.call_soon_threadsafe(self._on_outputs, outs),
            on_dead=lambda why: self._loop.call_soon_threadsafe(self._on_dead, why),
            on_kv_snapshot=lambda snap: self._loop.call_soon_threadsafe(
                self._on_kv_snapshot, snap),
            on_lora_reply=lambda reply: self._loop.call_soon_threadsafe(
                self._on_lora_reply, reply),
        )

    @classmethod
    async def create(cls, config: EngineConfig, fork: bool = False,
                     served_model_name: str | Sequence[str] | None = None) -> AsyncLLM:
        """Start the engine core (seconds: the model loads) off the event loop. ``fork``:
        fork the core from this thread (see ``fork_is_safe``) rather than spawn it."""
        loop = asyncio.get_running_loop()
        core = EngineCoreClient(config, "fork" if fork else "spawn")
        return await loop.run_in_executor(
            None, functools.partial(cls, config, loop, core=core,
                                    served_model_name=served_model_name))

    # ----------------------------------------------------------------- requests
    @property
    def num_unfinished_requests(self) -> int:
        return len(self._streams)

    async def generate(
        self,
        request_id: str,
        request: GenerationRequest,
        *,
        hold_kv: bool = False,
        announce_kv: bool = False,
        remote_prefill: RemotePrefill | AsyncIterator[RemoteKvChunk | RemotePrefill] | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream a request's outputs; closing the iterator early aborts the request.

        ``hold_kv`` (prefill replica): the final output carries a ``kv_handle`` and the blocks
        stay pinned until released or the lease ends; with ``announce_kv`` too, outputs
        without tokens come before it, each with a ``kv_handle`` on blocks that became final.
        ``remote_prefill`` (decode replica): the first token was sampled by a prefill
        replica; it is streamed at once, and an output with ``kv_transfer`` (no tokens)
        reports the pull when the prompt KV is in. It may also be the prefill replica's
        stream, still running: announced chunks, then its result (raising
        ``RemotePrefillLost`` if it ends without one, and the prompt is computed here); the
        engine pulls each chunk as it comes, and the first token is streamed when the result
        arrives. ``request.lora_name``: one of the engine's LoRA adapters (``lora_names``);
        one the core no longer serves when the request reaches it ends the stream with
        finish_reason "abort".
        """
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt, params = request.prompt_token_ids, request.params
        result = remote_prefill if isinstance(remote_prefill, RemotePrefill) else None
        try:
            self.inputs.validate_prompt(prompt, params.max_tokens)
            self.inputs.check_sampling_token_ids(params)
            if params.structured_output is not None:
                # The output tokens the core's matcher starts after (it must not refuse them:
                # a request the core refuses is never answered).
                await self.check_structured_output(params, tokens_sampled_elsewhere(
                    prompt, request.num_resumed_tokens, result))
        except BaseException:
            close = getattr(remote_prefill, "aclose", None)
            if close is not None:  # a prefill replica's stream nobody will follow
                await close()
            raise
        arrival = time.monotonic()
        self.outputs.add_request(request_id, prompt, params, arrival, request.num_resumed_tokens)
        if result is not None:
            first = self._first_remote_token(request_id, prompt, params, result)
            yield first
            if first.finished:
                return
            # Streamed above; the core has no use for them.
            result = replace(result, prompt_logprobs=None)
        stream: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self._streams[request_id] = stream
        self.core.add_request(EngineCoreRequest(
            request_id, request, arrival, hold_kv=hold_kv, announce_kv=announce_kv,
            remote_prefill=result, stream_kv=remote_prefill is not None and result is None))
        follow = None
        if remote_prefill is not None and result is None:
            feed = cast(AsyncIterator[RemoteKvChunk | RemotePrefill], remote_prefill)
            follow = self._loop.create_task(self._follow_remote_prefill(request_id, request, feed))
        try:
            async with aclosing(self._stream_outputs(request_id, stream)) as outputs:
                async for output in outputs:
                    yield output
        finally:
            if follow is not None:
                follow.cancel()

    async def _stream_outputs(self, request_id: str, stream: asyncio.Queue[RequestOutput | Exception]
                              ) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs from the core, until it finishes; stopping early aborts it."""
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:  # the caller stopped reading: nobody waits for an end
                self._streams.pop(request_id, None)
                self.outputs.remove_request(request_id)
                self.core.abort([request_id])

    async def _follow_remote_prefill(self, request_id: str, request: GenerationRequest,
                                     feed: AsyncIterator[RemoteKvChunk | RemotePrefill]) -> None:
        """Pass a prefill replica's announcements to the core; stream its first token the
        moment its result arrives (this side, not the core, decides the first token: it is
        the prefill replica's, unless the stream ended without one)."""
        try:
            async for item in feed:
                if isinstance(item, RemoteKvChunk):
                    self.core.update_remote_kv(RemoteKvUpdate(request_id, chunk=item))
                    continue
                stream = self._streams.get(request_id)
                if stream is None:
                    return  # ended meanwhile
                first = self._first_remote_token(request_id, request.prompt_token_ids,
                                                 request.params, item)
                stream.put_nowait(first)
                if first.finished:  # its first token ends it: the core has nothing to do
                    del self._streams[request_id]
                    self.core.abort([request_id])
                else:
                    self.core.update_remote_kv(RemoteKvUpdate(
                        request_id, result=replace(item, prompt_logprobs=None)))
                return
            raise RemotePrefillLost("prefill_failed", "the prefill stream ended without a result")
        except RemotePrefillLost as lost:
            self.core.update_remote_kv(RemoteKvUpdate(request_id, failure=lost.reason))
        except Exception:  # noqa: BLE001 - the request must not wait for a result forever
            logger.exception("following the prefill of %s failed", request_id)
            self.core.update_remote_kv(RemoteKvUpdate(request_id, failure="prefill_failed"))
        finally:
            close = getattr(feed, "aclose", None)
            if close is not None:
                await close()

    async def check_structured_output(self, params: SamplingParams,
                                      output_token_ids: Sequence[int] = ()) -> None:
        """Raise StructuredOutputError unless ``params.structured_output`` compiles and
        accepts ``output_token_ids`` (output sampled elsewhere). The core compiles again when it
        adds the request; each process has its own xgrammar cache. Runs off the event loop:
        the first constrained request builds xgrammar's tokenizer table (a fraction of a
        second), and a large schema can take a while to compile."""
        spec = params.structured_output
        if spec is not None:
            await self._loop.run_in_executor(None, self.grammars.matcher, spec, output_token_ids)

    def _first_remote_token(self, request_id: str, prompt_token_ids: list[int],
                            params: SamplingParams, remote: RemotePrefill) -> RequestOutput:
        """Detokenize the prefill replica's token and apply the same stop checks the core
        applies to every token, before the request reaches the core."""
        probe = Request(request_id, prompt_token_ids, params, eos_token_ids=self.eos_token_ids,
                        max_model_len=self.info.max_model_len, block_size=self.info.block_size,
                        remote_prefill=remote)
        done = probe.check_stop()
        results, _ = self.outputs.process(EngineCoreOutputs(outputs=[EngineCoreOutput(
            request_id, [remote.first_token_id], [remote.first_logprobs],
            prompt_logprobs=remote.prompt_logprobs,
            finish_reason=probe.status.finish_reason if done else None,
            stop_reason=probe.stop_reason)]))
        return results[0]

    async def prefill(self, request_id: str, request: GenerationRequest,
                      announce_kv: bool = False) -> AsyncGenerator[RequestOutput, None]:
        """Prefill replica: compute the prompt, sample the first token, pin the blocks. The
        last output has the token and a ``kv_handle`` on every prompt block; with
        ``announce_kv``, outputs without tokens come before it, each with a ``kv_handle`` on
        the blocks that became final since the last (the prompt's blocks in order)."""
        params = request.params
        one = replace(request, params=SamplingParams(**{
            **params.__dict__, "max_tokens": 1, "min_tokens": min(params.min_tokens, 1)}))
        last: RequestOutput | None = None
        try:
            async with aclosing(self.generate(request_id, one, hold_kv=True,
                                              announce_kv=announce_kv)) as outs:
                async for out in outs:
                    if out.kv_handle is not None and not out.new_token_ids and not out.finished:
                        yield out
                    else:
                        last = out
        except (asyncio.CancelledError, GeneratorExit):
            # The decode replica gave up (its client left). Leaving the loop aborts a prompt
            # still running; one that just finished has pinned its blocks for a pull that
            # will never come: free them now rather than when the lease ends.
            self.release_kv(request_id)
            raise
        if last is None or last.kv_handle is None or not last.new_token_ids:
            raise RuntimeError(f"prefill of {request_id} ended without a KV handle "
                               f"({last.finish_reason if last else 'no output'})")
        try:
            yield last
        except (asyncio.CancelledError, GeneratorExit):
            # NOTE: closed before the result was taken (the caller was cancelled as it came):
            # its blocks are pinned for a pull that will never come (issue 34).
            self.release_kv(request_id)
            raise

    def release_kv(self, request_id: str) -> None:
        self.core.release_kv([request_id])

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests in the core; their streams end with finish_reason "abort"."""
        self.core.abort([r for r in request_ids if r in self._streams])

    # ----------------------------------------------------------------- outputs
    def _on_outputs(self, core_outputs: EngineCoreOutputs) -> None:
        results, to_abort = self.outputs.process(core_outputs)
        for out in results:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.put_nowait(out)
            if out.finished:
                del self._streams[out.request_id]
        self.core.abort(to_abort)
        if core_outputs.stats is not None:
            stats = core_outputs.stats
            self.stats = stats
            self.prefix_cache_queries += stats.prefix_cache_queries
            self.prefix_cache_hits += stats.prefix_cache_hits
            self.num_preemptions += stats.num_preemptions
        if core_outputs.kv_events and self.kv_events.append(core_outputs.kv_events) is not None:
            for waiter in self._kv_event_waiters:
                waiter.set()

    def _on_dead(self, reason: str) -> None:
        logger.error("%s", reason)
        self.dead_reason = reason
        error = EngineDeadError(reason)
        for stream in self._streams.values():
            stream.put_nowait(error)
        self._streams.clear()
        snapshot, self._kv_snapshot = self._kv_snapshot, None
        if snapshot is not None and not snapshot.done():
            snapshot.set_exception(error)
        while self._lora_replies:
            reply = self._lora_replies.popleft()
            if not reply.done():
                reply.set_exception(error)

    # ----------------------------------------------------------------- KV events
    async def watch_kv_events(
        self, since_seq: int, incarnation: str = "",
    ) -> AsyncGenerator[list[KVEventBatch] | KVCacheSnapshotChunk, None]:
        """Yield the batches after ``since_seq``, then new ones as they arrive. ``incarnation``
        is the one ``since_seq`` belongs to (``kv_events.incarnation`` of the engine the
        watcher followed); empty when unknown, taken as this engine's.

        When the log no longer holds everything after ``since_seq`` (the watcher fell too far
        behind, or ``since_seq`` belongs to another incarnation of the engine), yield a
        snapshot of the whole prefix cache instead, in pieces of at most
        ``kv_snapshot_chunk_blocks`` hashes, then the batches after the snapshot's seq.
        """
        wake = asyncio.Event()
        self._kv_event_waiters.add(wake)
        try:
            seq = since_seq
            while True:
                # Cleared before looking, so a batch appended while this generator is
                # suspended in a yield below still wakes it.
                wake.clear()
                batches = self.kv_events.since(seq, incarnation)
                if batches is None:
                    snapshot = await self.snapshot_kv_cache()
                    for chunk in snapshot.chunks(self.kv_snapshot_chunk_blocks):
                        yield chunk
                    seq, incarnation = snapshot.seq, self.kv_events.incarnation
                elif batches:
                    seq = batches[-1].seq
                    yield batches
                else:
                    await wake.wait()
        finally:
            self._kv_event_waiters.discard(wake)

    async def snapshot_kv_cache(self) -> KVCacheSnapshot:
        """Every block hash in the engine's prefix cache, with the KV-event seq it matches:
        the core takes it between two steps, and the seq is the log's newest when the answer
        arrives, every batch the core sent before it being in the log by then."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self._kv_snapshot is None:
            self._kv_snapshot = self._loop.create_future()
            self.core.snapshot_kv_cache()
        # Shielded: a watcher that goes away must not cancel the answer the others wait for.
        return await asyncio.shield(self._kv_snapshot)

    def _on_kv_snapshot(self, answer: KvCacheSnapshotReply) -> None:
        snapshot, self._kv_snapshot = self._kv_snapshot, None
        if snapshot is not None and not snapshot.done():
            snapshot.set_result(KVCacheSnapshot(
                seq=self.kv_events.last_seq, timestamp=time.time(),
                block_hashes=answer.block_hashes))

    # ----------------------------------------------------------------- LoRA adapters
    @property
    def lora_names(self) -> list[str]:
        """The LoRA adapters the engine serves, sorted: ``lora_modules`` at start, then as
        each answered load or unload leaves them."""
        return list(self._lora_names)

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Serve the PEFT adapter in directory ``path`` (read by the core, on its machine)
        as ``name``, between two steps. Raises ``LoraAdapterExists`` when the name is served
        or still being unloaded, ValueError when the adapter cannot be served (the message
        says why), EngineDeadError when the core is gone."""
        await self._change_lora_adapters(lambda: self.core.load_lora_adapter(name, path))

    async def unload_lora_adapter(self, name: str) -> None:
        """Stop serving ``name``: requests sent after this returns are refused, those
        already in the engine finish with the adapter. Raises ``LoraAdapterNotFound`` when
        no adapter is served under the name, EngineDeadError when the core is gone."""
        await self._change_lora_adapters(lambda: self.core.unload_lora_adapter(name))

    async def _change_lora_adapters(self, send: Callable[[], None]) -> None:
        async with self._lora_lock:
            if self.dead_reason is not None:
                raise EngineDeadError(self.dead_reason)
            future: asyncio.Future[LoraAdapterReply] = self._loop.create_future()
            self._lora_replies.append(future)
            send()
            reply = await future
        if reply.error_kind is not None:
            raise _LORA_ERRORS.get(reply.error_kind, RuntimeError)(reply.message)

    def _on_lora_reply(self, reply: LoraAdapterReply) -> None:
        self._lora_names = list(reply.served)
        if self._lora_replies:
            future = self._lora_replies.popleft()
            if not future.done():  # else its caller was cancelled
                future.set_result(reply)

    def shutdown(self) -> None:
        self.core.shutdown()
