"""The engine core: one step = schedule, run the model, update request state.

Owns the scheduler, the KV cache manager and the model runner, and nothing that deals with
text or clients: it takes tokenized ``EngineCoreRequest`` records and emits token ids,
finish states, scheduler statistics and KV events (``EngineCoreOutputs``), and on request
the prefix cache's block hashes (a KV-event watcher's resync snapshot). Between steps it
loads and unloads LoRA adapters, and frees an unloaded adapter's weights once no request
uses it. The frontend (``output_processor``) turns those into text. It runs in the
replica's engine process (``core_process``) or in-process for offline use (``llm``).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections import Counter
from collections.abc import Callable

from engine_common.block_hash import BlockHash
from engine_common.config import EngineConfig
from engine_common.hybrid_kv_cache_manager import HybridKVCacheManager
from engine_common.kv_cache_manager import KVCacheManager
from engine_common.kv_events import KVEvent
from engine_common.kv_tiers.tiers import BlockToStore, KvTiers
from engine_common.model.arch_config import ModelArchConfig
from engine_common.model.startup_summary import startup_summary
from engine_common.model_runner import ModelRunner
from engine_common.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
    KvTransferReport,
    RemoteKvUpdate,
)
from engine_common.parallel.kv_ranks import parallel_kv
from engine_common.remote_kv import RemoteKv
from engine_common.request import Request, RequestStatus, tokens_sampled_elsewhere
from engine_common.scheduler import ScheduledRequest, Scheduler
from engine_common.structured_output.grammar import GrammarCompiler
from engine_common.tokenizer import eos_token_ids, load_tokenizer
from kv_transfer.layout import KvLayout

logger = logging.getLogger(__name__)


def context_length(requested: int | None, arch: ModelArchConfig) -> int:
    """The engine's context length: ``requested``, at most what the model supports.

    A Qwen model with ``use_sliding_window`` supports at most its window here: its layers
    attend to the whole context, which is exactly sliding-window attention while a sequence
    fits the window (vLLM caps the same way when it runs such a model without sliding
    windows). Mistral's and Mixtral's windows are run per layer (``attention_window``): no cap.
    """
    limit = arch.max_position_embeddings
    window = arch.sliding_window
    if window is not None and window < limit:
        logger.warning("context capped at the model's sliding window of %d tokens", window)
        limit = window
    return min(requested or limit, limit)


class EngineCore:
    def __init__(self, config: EngineConfig,
                 on_worker_death: Callable[[str], object] | None = None):
        """``on_worker_death``: called with the reason when a tensor-parallel worker of
        this replica exits (from a watcher thread; see ``engine_common.parallel.workers``)."""
        if config.tensor_parallel_size > 1 and config.kv_tiers.enabled:
            raise ValueError("KV tiers are not supported with tensor parallelism yet "
                             "(--tensor-parallel-size > 1 with a KV tier)")
        self.config = config
        self.arch = ModelArchConfig.from_model_dir(config.model)
        self.max_model_len = context_length(config.max_model_len, self.arch)
        tokenizer = load_tokenizer(config.model)
        self.eos_token_ids = eos_token_ids(config.model, tokenizer)
        # Structured outputs; xgrammar's tables are built by the first constrained request.
        self.grammars = GrammarCompiler(tokenizer, self.arch.vocab_size, self.eos_token_ids)
        self.model_runner = ModelRunner(config, self.arch, self.eos_token_ids, self.max_model_len,
                                        on_worker_death=on_worker_death)
        groups = self.model_runner.kv_groups
        self.kv_cache_manager = KVCacheManager(
            num_blocks=self.model_runner.num_blocks,
            block_size=config.cache.block_size,
            max_model_len=self.max_model_len,
            enable_caching=config.cache.enable_prefix_caching,
            sliding_window=self.arch.kv_window,
        ) if groups.is_single else HybridKVCacheManager(
            groups,
            num_blocks=self.model_runner.num_blocks,
            block_size=config.cache.block_size,
            max_model_len=self.max_model_len,
            enable_caching=config.cache.enable_prefix_caching,
        )
        # The model's directory name, not its path: P and D may keep it in different places.
        # With KV cache groups the name carries them: a peer that splits otherwise (or not
        # at all) is refused by the fingerprint, whatever the pages' shapes.
        kv_layout = KvLayout.of_cache(
            os.path.basename(os.path.normpath(config.model)) + groups.layout_suffix(),
            self.model_runner.kv_cache, config.tensor_parallel_size)
        self.kv_tiers = (KvTiers(config.kv_tiers, self.model_runner.kv_cache, kv_layout)
                         if config.kv_tiers.enabled and config.cache.enable_prefix_caching
                         else None)
        settings = config.model_settings
        self.scheduler = Scheduler(
            config.scheduler, self.kv_cache_manager, config.speculative,
            lora_enabled=bool(settings.lora_modules) or settings.allow_runtime_lora_updating,
            max_loras=settings.max_loras,
            tier_probe=self.kv_tiers.probe if self.kv_tiers is not None else None)
        self.scheduler.num_lora_adapters = len(self.model_runner.lora_adapters)
        self.remote_kv = (
            RemoteKv(config.kv_transfer, self.model_runner.kv_cache, kv_layout, config.engine_id,
                     parallel_kv(self.arch.num_kv_heads, config.tensor_parallel_size,
                                 self.model_runner.store, self.model_runner.workers),
                     pages_per_block=self.kv_cache_manager.pages_per_block)
            if config.kv_transfer.role is not None else None)
        self.info = EngineInfo(
            engine_id=config.engine_id,
            model=config.model,
            max_model_len=self.max_model_len,
            block_size=config.cache.block_size,
            num_blocks=self.model_runner.num_blocks,
            dtype=str(self.model_runner.dtype).removeprefix("torch."),
            vocab_size=self.arch.vocab_size,
            num_layers=self.arch.num_layers,
            num_kv_heads=self.arch.num_kv_heads,
            head_size=self.arch.head_size,
            kv_layout=kv_layout,
            kv_address=self.remote_kv.address if self.remote_kv else None,
            tensor_parallel_size=config.tensor_parallel_size,
        )
        self.info.model_summary = tuple(startup_summary(
            self.model_runner.model, self.model_runner.num_blocks, config.cache.block_size,
            self.max_model_len, groups))
        for line in self.info.model_summary:
            logger.info("%s", line)

    def add_request(self, core_request: EngineCoreRequest) -> None:
        """Queue a request, refusing one that breaks the engine's invariants (ValueError)."""
        request = core_request.request
        num_prompt = len(request.prompt_token_ids)
        if num_prompt == 0:
            raise ValueError("the prompt is empty")
        if num_prompt >= self.max_model_len:
            raise ValueError(
                f"the prompt has {num_prompt} tokens but the model's context is "
                f"{self.max_model_len} tokens (prompt plus at least one generated token)"
            )
        vocab = self.arch.vocab_size
        if any(not 0 <= t < vocab for t in request.prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if core_request.hold_kv and (self.remote_kv is None or self.remote_kv.producer is None):
            raise ValueError("this engine is not a KV producer (prefill role)")
        if core_request.request_id in self.scheduler.held and self.remote_kv is not None:
            for released in self.remote_kv.take_released():  # a release may be on its way
                self.scheduler.release_held(released)
        if core_request.request_id in self.scheduler.held:
            # Its blocks are still pinned for a consumer under that id: a second prefill
            # under it would pin over them.
            raise ValueError(f"request id {core_request.request_id!r} still holds pinned "
                             "blocks")
        if (core_request.remote_prefill is not None or core_request.stream_kv) and (
                self.remote_kv is None or self.remote_kv.consumer is None):
            raise ValueError("this engine is not a KV consumer (decode role)")
        if core_request.announce_kv and not core_request.hold_kv:
            raise ValueError("only a request that holds its KV for a consumer announces it")
        self.model_runner.lora_adapters.check(request.lora_name)
        scheduled = Request.of(core_request, eos_token_ids=self.eos_token_ids,
                               max_model_len=self.max_model_len,
                               block_size=self.config.cache.block_size)
        if request.params.structured_output is not None:
            # Compiled here, synchronously: milliseconds, and cached (see ``grammar``). The
            # matcher starts after the output tokens sampled elsewhere (P/D, resumed).
            scheduled.grammar = self.grammars.matcher(
                request.params.structured_output,
                tokens_sampled_elsewhere(scheduled.prompt_token_ids,
                                         request.num_resumed_tokens, core_request.remote_prefill))
        self.scheduler.add_request(scheduled)

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        if self.remote_kv is not None and self.remote_kv.producer is not None:
            for request_id in request_ids:  # before their blocks are freed
                self.remote_kv.end_announcements(request_id)
        aborted = self.scheduler.abort_requests(request_ids)
        self.model_runner.release([r.request_id for r in aborted])
        self._reap_lora_adapters()
        return [
            EngineCoreOutput(r.request_id, [], finish_reason="abort", num_preemptions=r.num_preemptions)
            for r in aborted
        ]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_runnable_requests(self) -> bool:
        """Requests the scheduler can run now (not only waiting on a KV pull)."""
        return bool(self.scheduler.running) or len(self.scheduler.waiting) > 0

    def has_pulls_running(self) -> bool:
        """KV pulls are in flight (their ends come without a message to the loop)."""
        return ((self.remote_kv is not None and self.remote_kv.has_pulls_running)
                or (self.kv_tiers is not None and self.kv_tiers.has_loads_running))

    def wait_for_tier_loads(self, timeout: float) -> None:
        """Block (the GIL released) until a KV tier load ends, at most ``timeout`` seconds;
        at once without tiers."""
        if self.kv_tiers is not None:
            self.kv_tiers.wait_for_loads(timeout)

    def has_pinned_kv(self) -> bool:
        """Blocks held for a consumer: the loop must keep checking releases and leases."""
        return bool(self.scheduler.held)

    def release_kv(self, request_ids: list[str]) -> None:
        if self.remote_kv is not None:
            for request_id in request_ids:
                self.remote_kv.release(request_id)

    def update_remote_kv(self, update: RemoteKvUpdate) -> list[EngineCoreOutput]:
        """Decode side: news of a request's prefill on its prefill replica (``stream_kv``):
        an announced range is pulled at once if the request's blocks are allocated (else
        when they are); the result gives the request its first token; a failure makes this
        engine compute the prompt (or, with fallback "fail", ends the request)."""
        request = self.scheduler.requests.get(update.request_id)
        if request is None or not request.stream_kv or self.remote_kv is None:
            return []  # finished, aborted, or no longer following that prefill
        if update.chunk is not None:
            request.kv_chunks.append(update.chunk)
        elif update.result is not None:
            request.take_remote_result(update.result)
            if request.grammar is not None:
                request.grammar.accept(update.result.first_token_id)
        else:
            request.stream_kv = False
            request.kv_chunks.clear()
            reason = update.failure or "prefill_failed"
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                self.remote_kv.fail(request, reason)
            else:  # not admitted yet: it is computed here like any request
                report = KvTransferReport(prefill_engine_id="", fallback_reason=reason)
                if self.config.kv_transfer.fallback == "fail":
                    self.scheduler.abort_requests([request.request_id])
                    return [EngineCoreOutput(request.request_id, [], finish_reason="abort",
                                             stop_reason=f"kv_transfer_failed:{reason}",
                                             kv_transfer=report)]
                return [EngineCoreOutput(request.request_id, [], kv_transfer=report)]
        self.remote_kv.advance(request)
        return []

    def _announce_kv(self, scheduled: list[ScheduledRequest]) -> list[EngineCoreOutput]:
        """Prefill side: pin and announce the prompt blocks each announcing request's step
        made final (the prefix-cache hits with its first chunk); the last, partial block and
        any block of a finished request go with its result instead (``take_to_pin``)."""
        assert self.remote_kv is not None
        outputs = []
        for item in scheduled:
            request = item.request
            if not request.announce_kv or request.status != RequestStatus.RUNNING:
                continue
            final = min(request.num_computed_tokens, request.num_prompt_tokens) // \
                self.config.cache.block_size
            first = request.num_announced_blocks
            if final <= first:
                continue
            kv = self.kv_cache_manager
            block_ids = kv.get_transfer_block_ids(request.request_id, first, final)
            handle = self.remote_kv.announce(request, first * kv.pages_per_block, block_ids)
            if handle is None:
                request.announce_kv = False
                continue
            request.num_announced_blocks = final
            outputs.append(EngineCoreOutput(request.request_id, [], kv_handle=handle,
                                            num_cached_tokens=max(request.num_cached_tokens, 0)))
        return outputs

    def _stop_announcing(self, preempted: list[str]) -> None:
        """Preempted requests free their blocks: their announced ones may be reused before
        a consumer pulls them, so their leases end now (before the step's model run writes
        any block), and the consumer's pulls of them fail; the result still comes."""
        assert self.remote_kv is not None
        for request_id in preempted:
            request = self.scheduler.requests.get(request_id)
            if request is not None and request.announce_kv:
                request.announce_kv = False
                self.remote_kv.end_announcements(request_id)

    def _transfer_housekeeping(self) -> list[EngineCoreOutput]:
        """Free the blocks of ended leases; move finished pulls on."""
        assert self.remote_kv is not None
        for request_id in self.remote_kv.take_released():
            self.scheduler.release_held(request_id)
        outputs = []
        for request, report in self.remote_kv.take_finished_pulls():
            ok = report.fallback_reason is None
            if not ok and self.config.kv_transfer.fallback == "fail" and \
                    request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                self.scheduler.abort_requests([request.request_id])
                self.scheduler.finish_remote_kv(request, ok=False)
                outputs.append(EngineCoreOutput(request.request_id, [], finish_reason="abort",
                                                stop_reason=f"kv_transfer_failed:{report.fallback_reason}",
                                                kv_transfer=report))
                continue
            if self.scheduler.finish_remote_kv(request, ok):
                outputs.append(EngineCoreOutput(request.request_id, [], kv_transfer=report,
                                                num_cached_tokens=max(request.num_cached_tokens, 0)))
        return outputs

    # ------------------------------------------------------------------ LoRA at runtime
    def load_lora_adapter(self, name: str, path: str) -> None:
        """Serve the PEFT adapter in directory ``path`` as ``name`` from the next step on.
        Raises ``LoraAdapterExists`` when the name is served or still draining, ValueError
        when the adapter cannot be served; the engine is unchanged then.

        The prefix cache keys blocks by adapter name, so when the name was served before
        (maybe with other weights), every cached block no request holds is evicted: those of
        the old adapter are all free by then (it had drained), and the cache cannot tell
        them from the others."""
        adapters = self.model_runner.lora_adapters
        # An adapter that drained since the last step frees its name here, not a step later.
        self._reap_lora_adapters()
        served_before = adapters.served_before(name)
        adapters.add(name, path, self.model_runner.model)
        if served_before:
            evicted = self.kv_cache_manager.evict_cached_free_blocks()
            logger.info("LoRA adapter %r served again: %d cached blocks evicted", name, evicted)
        # Loading enables the adapter statistics even where the settings did not (offline).
        self.scheduler.lora_enabled = True
        self.scheduler.num_lora_adapters = len(adapters)

    def unload_lora_adapter(self, name: str) -> None:
        """Stop serving ``name`` at once: new requests with it are refused, while those in
        the engine finish with its weights, which are freed once none is left (at once when
        none uses it). Raises ``LoraAdapterNotFound`` for a name not served."""
        adapters = self.model_runner.lora_adapters
        adapters.remove(name)
        self.scheduler.num_lora_adapters = len(adapters)
        self._reap_lora_adapters()

    def _reap_lora_adapters(self) -> None:
        """Free the slots of unloaded adapters that no unfinished request uses any more.
        Requests holding KV for a consumer count too: their blocks are cached under the
        adapter's name, which must not be served again while they are."""
        adapters = self.model_runner.lora_adapters
        if not adapters.draining:
            return
        scheduler = self.scheduler
        users = Counter(r.lora_name for r in itertools.chain(scheduler.requests.values(),
                                                             scheduler.held.values())
                        if r.lora_name)
        adapters.reap(users, self.model_runner.model)

    # ------------------------------------------------------------------ KV tiers
    def _finish_tier_loads(self) -> None:
        """Move the requests whose tier loads ended on (running, or freed if aborted)."""
        assert self.kv_tiers is not None
        for result in self.kv_tiers.take_finished_loads():
            request = self.scheduler.loading.get(result.request_id)
            if request is not None:
                self.scheduler.finish_tier_load(request, result.num_blocks)

    def _store_to_tiers(self, scheduled: list[ScheduledRequest]) -> None:
        """Write the blocks this step completed through to the tiers (copied now: the next
        step may reuse a finished request's blocks; stored by the tiers' worker)."""
        assert self.kv_tiers is not None
        bs = self.config.cache.block_size
        blocks: list[BlockToStore] = []
        for item in scheduled:
            request = item.request
            hashes = request.block_hashes
            num_full = min(request.num_computed_tokens // bs, len(hashes), len(item.block_ids))
            for i in range(request.num_offered_blocks, num_full):
                blocks.append(BlockToStore(hashes[i], hashes[i - 1] if i else None,
                                           request.all_token_ids[i * bs:(i + 1) * bs],
                                           item.block_ids[i]))
            request.num_offered_blocks = max(request.num_offered_blocks, num_full)
        if blocks:
            self.kv_tiers.store(blocks)

    def close(self) -> None:
        """Stop the tiers' worker (queued stores are written first) and close the tiers;
        stop the tensor-parallel workers."""
        if self.kv_tiers is not None:
            self.kv_tiers.close()
        self.model_runner.close()

    def snapshot_kv_cache(self) -> tuple[list[KVEvent], list[BlockHash]]:
        """Every block hash in the prefix cache, with the KV events recorded but not emitted
        yet (normally none between steps). The hashes are the state those events lead to, so
        the caller must deliver the events first, on the same ordered channel as the steps'."""
        return self.take_kv_events(), self.kv_cache_manager.get_cached_block_hashes()

    def take_kv_events(self) -> list[KVEvent]:
        """The KV events recorded since the last call: the prefix cache's, then the tiers'.
        Before the first step these are what the tiers opened with (a restarted replica's
        disk tier), which the core process sends at once so routers know them before any
        request comes (``core_process``)."""
        return self.kv_cache_manager.take_events() + (
            self.kv_tiers.take_events() if self.kv_tiers is not None else [])

    def step(self) -> EngineCoreOutputs:
        outputs: list[EngineCoreOutput] = []
        if self.remote_kv is not None:
            outputs.extend(self._transfer_housekeeping())
        if self.kv_tiers is not None:
            self._finish_tier_loads()
        scheduler_output = self.scheduler.schedule()
        if self.kv_tiers is not None:
            for load in scheduler_output.tier_loads:
                self.kv_tiers.start_load(load.request.request_id, load.block_hashes,
                                         load.block_ids)
        outputs.extend(self.scheduler.take_finished_unscheduled())
        if self.remote_kv is not None:
            for pull in scheduler_output.pulls:
                self.remote_kv.start_pull(pull.request, pull.block_ids, pull.num_local_blocks)
            if self.remote_kv.producer is not None:
                self._stop_announcing(scheduler_output.preempted_request_ids)
        if not scheduler_output.is_empty:
            runner_output = self.model_runner.execute(scheduler_output)
            outputs.extend(self.scheduler.update_from_output(scheduler_output, runner_output))
            if self.kv_tiers is not None:
                self._store_to_tiers(scheduler_output.scheduled)
            self.model_runner.release([o.request_id for o in outputs if o.finished])
            if self.remote_kv is not None and self.remote_kv.producer is not None:
                outputs.extend(self._announce_kv(scheduler_output.scheduled))
        for request, output in self.scheduler.take_to_pin():
            assert self.remote_kv is not None
            output.kv_handle = self.remote_kv.pin(
                request, self.kv_cache_manager.get_transfer_block_ids(request.request_id))
        self._reap_lora_adapters()
        stats = self.scheduler.make_stats()
        if self.kv_tiers is not None:
            stats.kv_tiers = self.kv_tiers.take_stats()
        return EngineCoreOutputs(
            outputs=outputs,
            stats=stats,
            kv_events=self.take_kv_events(),
            timestamp=time.time(),
        )
