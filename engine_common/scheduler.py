"""The scheduler: which requests run this step and how many tokens each computes.

Owns the waiting and running queues and the per-step token budget. There is no prefill or
decode phase: every request has ``num_tokens - num_computed_tokens`` tokens still to compute,
and a step hands out at most ``max_num_batched_tokens`` of them, RUNNING requests first,
then WAITING ones (chunked prefill is just ``min(remaining, budget)``). While any running
request is decoding, the prompt tokens of a step are capped apart, in tokens and in time
(``max_prefill_tokens_while_decoding``, ``max_prefill_time_per_decode_step``, timed with
``StepCosts``): a long prompt computed here then runs in chunks between the decodes, and a
running stream waits for at most one such chunk beside its own step. On an aggregated replica
(``prefill_caps_scale_with_queue``) there is no time cap and a queue of prompts multiplies the
token cap by its length, up to the whole budget, so that a queue past capacity is not starved
by the decodes. A waiting request is admitted only into blocks the running ones are not
expected to need for their own prompts and output (``OutputRoom``, with
``reserve_output_room``). When the KV pool is nevertheless
exhausted a running request is preempted by recompute: its blocks are freed and it goes back
to the front of the waiting queue with ``num_computed_tokens = 0`` (its prompt and output so
far are recomputed, mostly from the prefix cache; a grammar keeps its state, since the
output is kept). Sampled tokens are accepted here: appended to the request and, for a
structured output, advanced through its grammar. With speculative decoding a
request's decode step also runs draft tokens (``NgramDrafter``); the model runner says how
many it agrees with, and the KV of the rest is recomputed. With ``max_loras``, a waiting
request whose LoRA adapter would make more different adapters run than that is skipped for
the step, keeping its place, while requests behind it may be admitted. It does not own
blocks (``KVCacheManager``) or the forward pass (``ModelRunner``).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine_common.block_hash import BlockHash
from engine_common.config import SchedulerConfig, SpeculativeConfig
from engine_common.kv_cache_manager import KVCacheManager
from engine_common.ngram_drafter import NgramDrafter
from engine_common.output_room import OutputRoom
from engine_common.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerStats
from engine_common.prefill_outlook import PrefillOutlook, prefill_outlook
from engine_common.request import Request, RequestStatus
from engine_common.step_costs import StepCosts

if TYPE_CHECKING:
    from engine_common.structured_output.grammar import RequestGrammar

logger = logging.getLogger(__name__)


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # the drafts included
    block_ids: list[int]
    # Speculative decoding: tokens guessed to follow the request's last one, run after it
    # in this step; the model keeps those it agrees with. With a grammar, the grammar's
    # state after each draft (the masks of the positions that follow them).
    draft_token_ids: list[int] = field(default_factory=list)
    draft_grammars: list[RequestGrammar] = field(default_factory=list)
    # The tables of the KV cache groups after the first (``kv_cache_groups``); none with one.
    extra_block_ids: tuple[list[int], ...] = ()

    @property
    def completes_sequence(self) -> bool:
        """True when this step computes up to the request's last known token, so the
        step must sample its next token (a partial prefill chunk samples nothing)."""
        known = self.num_new_tokens - len(self.draft_token_ids)
        return self.request.num_computed_tokens + known == self.request.num_tokens


@dataclass
class RemoteKvPull:
    """A decode-side request whose prompt blocks are allocated and must now be pulled."""

    request: Request
    block_ids: list[int]
    # Leading blocks that were prefix-cache hits here. With KV cache groups both count
    # pages: block_ids interleave the groups (``get_transfer_block_ids``).
    num_local_blocks: int


@dataclass
class TierLoad:
    """A request whose next blocks a KV tier may hold: its blocks for them are allocated
    and the longest run the tiers hold must now be loaded into them."""

    request: Request
    block_hashes: list[BlockHash]
    block_ids: list[int]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    pulls: list[RemoteKvPull] = field(default_factory=list)
    tier_loads: list[TierLoad] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class WaitingQueue:
    """FCFS (a deque) or priority (a heap on (priority, arrival, seq)) waiting queue.

    A scheduling pass may ``skip`` the head (a request that may not run this step, while
    those behind it may): it is set aside, unseen by ``peek``, ``pop`` and ``len``, until
    ``restore_skipped`` puts every skipped request back exactly where it was (at the front
    in their order; under the priority policy with their original keys)."""

    def __init__(self, policy: str):
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {policy!r}; choose 'fcfs' or 'priority'")
        self._priority = policy == "priority"
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()
        self._skipped_fifo: list[Request] = []
        self._skipped_heap: list[tuple[int, float, int, Request]] = []

    def add(self, request: Request) -> None:
        if self._priority:
            heapq.heappush(
                self._heap, (request.priority, request.arrival_time, next(self._seq), request)
            )
        else:
            self._fifo.append(request)

    def add_front(self, request: Request) -> None:
        """Re-queue a preempted request so it is the next one admitted (FCFS); under the
        priority policy its (priority, arrival) key already puts it in the right place."""
        if self._priority:
            self.add(request)
        else:
            self._fifo.appendleft(request)

    def peek(self) -> Request:
        return self._heap[0][3] if self._priority else self._fifo[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3] if self._priority else self._fifo.popleft()

    def skip(self) -> Request:
        """Set the head aside until ``restore_skipped``; returns it."""
        if self._priority:
            entry = heapq.heappop(self._heap)
            self._skipped_heap.append(entry)
            return entry[3]
        request = self._fifo.popleft()
        self._skipped_fifo.append(request)
        return request

    def restore_skipped(self) -> None:
        """Put the skipped requests back where they were: at the front in the order they
        were skipped (FCFS), or under their original keys (priority)."""
        for entry in self._skipped_heap:
            heapq.heappush(self._heap, entry)
        self._fifo.extendleft(reversed(self._skipped_fifo))
        self._skipped_heap.clear()
        self._skipped_fifo.clear()

    def remove(self, request: Request) -> None:
        if self._priority:
            self._heap = [e for e in self._heap if e[3] is not request]
            heapq.heapify(self._heap)
        else:
            self._fifo.remove(request)

    def __len__(self) -> int:
        return len(self._heap) if self._priority else len(self._fifo)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return (e[3] for e in self._heap) if self._priority else iter(self._fifo)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 speculative: SpeculativeConfig | None = None, *, lora_enabled: bool = False,
                 max_loras: int | None = None,
                 tier_probe: Callable[[BlockHash], bool] | None = None):
        """``lora_enabled``: the engine serves LoRA adapters (or may load some while it
        serves), so the statistics report them. ``max_loras``: at most this many different
        adapters among the running requests (None: any number). ``tier_probe``: whether a
        KV tier may hold a block (None: no tiers)."""
        if config.max_num_batched_tokens < 1 or config.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        if config.max_prefill_tokens_while_decoding < 0 or \
                config.max_prefill_time_per_decode_step < 0:
            raise ValueError("max_prefill_tokens_while_decoding and "
                             "max_prefill_time_per_decode_step must be 0 (off) or positive")
        if max_loras is not None and max_loras < 1:
            raise ValueError(f"max_loras must be at least 1 (or None: no cap), got {max_loras}")
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        if speculative is not None and speculative.num_tokens < 0:
            raise ValueError("speculative decoding's num_tokens must be 0 (off) or positive, "
                             f"got {speculative.num_tokens}")
        self.drafter = (NgramDrafter(speculative) if speculative is not None
                        and speculative.num_tokens > 0 else None)
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(config.policy)
        self.running: list[Request] = []
        # P/D, decode side: prompt blocks allocated, KV being pulled (WAITING_FOR_REMOTE_KV).
        self.receiving: dict[str, Request] = {}
        # KV tiers: prefix blocks allocated, being loaded from a tier (WAITING_FOR_TIER_KV).
        self.tier_probe = tier_probe
        self.loading: dict[str, Request] = {}
        # P/D, prefill side: finished requests whose blocks stay pinned for a decode replica.
        self.held: dict[str, Request] = {}
        self._to_pin: list[tuple[Request, EngineCoreOutput]] = []
        # Requests ended without running (they cannot fit in the KV cache at all).
        self._finished_unscheduled: list[EngineCoreOutput] = []
        self._num_preemptions_since_report = 0
        self._num_scheduled_tokens = 0  # by the latest step, for its statistics
        self._num_draft_tokens = self._num_accepted_tokens = 0  # since the last statistics
        self._watermark_blocks = int(config.watermark * kv_cache_manager.num_blocks)
        self.output_room = (OutputRoom(kv_cache_manager.block_size)
                            if config.reserve_output_room else None)
        # What steps cost, for the prompt chunks beside running decodes (_prefill_room).
        self.step_costs = StepCosts()
        self._step_make_up: tuple[int, int, float] | None = None
        self.lora_enabled = lora_enabled
        self.max_loras = max_loras
        # The adapters the engine serves now, kept up to date by the engine core: the
        # statistics' max_lora when there is no cap (any of them may run in one step).
        self.num_lora_adapters = 0

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        if request.grammar is not None and request.grammar.is_terminated:
            # Its output so far (sampled elsewhere) already ends the grammar: nothing may
            # follow, so it ends without running.
            request.status = RequestStatus.FINISHED_STOPPED
            self._finished_unscheduled.append(EngineCoreOutput(
                request.request_id, [], finish_reason="stop",
                num_cached_tokens=0, num_preemptions=0))
            return
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        aborted = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.status.is_finished:
                continue
            if request.status in (RequestStatus.WAITING_FOR_REMOTE_KV,
                                  RequestStatus.WAITING_FOR_TIER_KV):
                # A pull or a tier load may still be writing into its blocks: they are
                # freed when it ends (finish_remote_kv, finish_tier_load), never before.
                request.status = RequestStatus.FINISHED_ABORTED
                aborted.append(request)
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = RequestStatus.FINISHED_ABORTED
            self._free(request)
            aborted.append(request)
        return aborted

    def has_unfinished_requests(self) -> bool:
        return (bool(self.running) or len(self.waiting) > 0 or bool(self.receiving)
                or bool(self.loading))

    # ------------------------------------------------------------------ P/D
    def finish_remote_kv(self, request: Request, ok: bool) -> bool:
        """A pull ended. On success the prompt is computed; otherwise the blocks stay and the
        prompt is recomputed from the local prefix hits on. Returns False when the request
        was aborted meanwhile (its blocks are freed now)."""
        del self.receiving[request.request_id]
        if request.status == RequestStatus.FINISHED_ABORTED:
            self.kv_cache_manager.free(request)
            self.requests.pop(request.request_id, None)
            return False
        if ok:
            request.num_computed_tokens = request.num_prompt_tokens
            self.kv_cache_manager.cache_blocks(request, request.num_prompt_tokens)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return True

    # ------------------------------------------------------------------ KV tiers
    def finish_tier_load(self, request: Request, num_blocks: int) -> bool:
        """A tier load ended with the first ``num_blocks`` of its blocks loaded: they join
        the prefix cache and the request runs, computing the rest of its prompt. Returns
        False when the request was aborted meanwhile (its blocks are freed now)."""
        del self.loading[request.request_id]
        if request.status == RequestStatus.FINISHED_ABORTED:
            self.kv_cache_manager.free(request)
            self.requests.pop(request.request_id, None)
            return False
        kv = self.kv_cache_manager
        request.num_computed_tokens += num_blocks * kv.block_size
        request.num_cached_tokens = request.num_computed_tokens
        request.num_offered_blocks = max(request.num_offered_blocks,
                                         request.num_computed_tokens // kv.block_size)
        kv.cache_blocks(request, request.num_computed_tokens)
        kv.note_tier_hits(num_blocks * kv.block_size)
        if request.kv_from_peer and request.num_preemptions == 0:
            # P/D, decode side: the loaded blocks are prefix-cache hits now. The request is
            # admitted again at the front, as a remote one, and pulls only the rest.
            kv.free(request)
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            self.waiting.add_front(request)
            return True
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return True

    def _admit_tier_load(self, request: Request, computed_blocks: list, num_computed: int,
                         out: SchedulerOutput, reserve: int) -> bool | None:
        """Start loading the request's next prompt blocks from a tier, if one may hold the
        first of them: allocate its blocks up to its last full prompt block (those after
        the device's hits), without caching them until loaded. None: no tier holds it (the
        request is admitted as usual); False: no room now."""
        request.tiers_probed = True
        kv = self.kv_cache_manager
        bs = kv.block_size
        first = num_computed // bs
        last = (request.num_tokens - 1) // bs
        if (self.tier_probe is None or first >= last or request.needs_prompt_logprobs
                or not self.tier_probe(request.block_hashes[first])):
            return None
        if kv.allocate_slots(
            request, (last - first) * bs, new_computed_blocks=computed_blocks,
            num_new_computed_tokens=num_computed, num_reserved_blocks=reserve,
            delay_caching=True,
        ) is None:
            if not self.running and not self.receiving and not self.loading \
                    and not out.scheduled:
                return None  # it cannot fit even alone: the usual admission ends it
            request.tiers_probed = False  # probed again once there is room
            return False
        self.waiting.pop()
        request.status = RequestStatus.WAITING_FOR_TIER_KV
        request.num_computed_tokens = num_computed
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        self.loading[request.request_id] = request
        out.tier_loads.append(TierLoad(request, request.block_hashes[first:last],
                                       kv.get_block_ids(request.request_id)[first:last]))
        return True

    def take_finished_unscheduled(self) -> list[EngineCoreOutput]:
        finished, self._finished_unscheduled = self._finished_unscheduled, []
        return finished

    def take_to_pin(self) -> list[tuple[Request, EngineCoreOutput]]:
        """Finished prefill-side requests whose blocks the core must pin for a consumer."""
        to_pin, self._to_pin = self._to_pin, []
        return to_pin

    def release_held(self, request_id: str) -> None:
        request = self.held.pop(request_id, None)
        if request is not None:
            self.kv_cache_manager.free(request)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        prefill_room = self._prefill_room()
        kv = self.kv_cache_manager

        # 1. RUNNING requests first, in order; preempt from the back when blocks run out.
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            prefilling = _is_prefilling(request)
            num_new = self._cap_new_tokens(request, request.num_tokens - request.num_computed_tokens,
                                           min(budget, prefill_room) if prefilling else budget)
            if num_new <= 0:
                index += 1
                continue
            drafts, draft_grammars = self._drafts(request, num_new, budget)
            # Drafts only take blocks that leave one free for each running request.
            if drafts and kv.allocate_slots(request, num_new + len(drafts),
                                            num_reserved_blocks=len(self.running)) is not None:
                out.scheduled.append(ScheduledRequest(
                    request, num_new + len(drafts), kv.get_block_ids(request.request_id), drafts,
                    draft_grammars, kv.get_extra_block_ids(request.request_id)))
                budget -= num_new + len(drafts)
                index += 1
                continue
            while kv.allocate_slots(request, num_new) is None:
                victim = self._pick_victim()
                if self.running.index(victim) < index:
                    # Under the priority policy the victim may already be scheduled in
                    # this step: take its tokens back.
                    done = next(s for s in out.scheduled if s.request is victim)
                    out.scheduled.remove(done)
                    budget += done.num_new_tokens
                    if _is_prefilling(victim):
                        prefill_room += done.num_new_tokens
                    index -= 1
                self._preempt(victim)
                out.preempted_request_ids.append(victim.request_id)
                if victim is request:
                    break
            else:
                out.scheduled.append(self._scheduled(request, num_new))
                budget -= num_new
                if prefilling:
                    prefill_room -= num_new
                index += 1
                continue
            # The request itself was preempted; the ones after it were already scheduled
            # or are gone, so stop here.
            break

        # 2. WAITING requests, unless this step had to preempt (no room to admit anyone).
        # (The reserve walks the running requests: only when someone waits.)
        if not out.preempted_request_ids and len(self.waiting) > 0:
            try:
                # Everything admitted here is a prefill (a remote one takes no budget).
                self._admit_waiting(out, min(budget, prefill_room), self._admission_reserve())
            finally:
                # Requests skipped for max_loras keep their places for the next step.
                self.waiting.restore_skipped()
        self._num_scheduled_tokens = out.total_num_scheduled_tokens
        self._note_step(out)
        return out

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        kv, request_id = self.kv_cache_manager, request.request_id
        return ScheduledRequest(request, num_new, kv.get_block_ids(request_id),
                                extra_block_ids=kv.get_extra_block_ids(request_id))

    def _admission_reserve(self) -> int:
        """Blocks an admission must leave free: the watermark, and with ``reserve_output_room``
        what the running requests and those receiving their KV are expected to grow into."""
        return self._watermark_blocks + sum(
            self._reserve_for(r) for r in itertools.chain(self.running, self.receiving.values(),
                                                          self.loading.values()))

    def _reserve_for(self, request: Request) -> int:
        """The blocks a request holding some is expected to add (0 without the reserve)."""
        if self.output_room is None:
            return 0
        held = len(self.kv_cache_manager.get_block_ids(request.request_id))
        return self.output_room.blocks_still_needed(request, held)

    def _admit_waiting(self, out: SchedulerOutput, budget: int, reserve: int) -> None:
        """Admit waiting requests, in order, while the budget, max_num_seqs and the KV
        pool (less ``reserve`` blocks, kept free for the admitted requests to grow) allow."""
        kv = self.kv_cache_manager
        # Under a max_loras cap, the adapters of requests running, or about to run once their
        # KV has arrived (a finished pull joins the running requests without coming back
        # here); without one the step need not look.
        active_loras = {r.lora_name for r in itertools.chain(self.running,
                                                              self.receiving.values(),
                                                              self.loading.values())
                        if r.lora_name} if self.max_loras is not None else set()
        while (len(self.waiting) > 0 and len(self.running) + len(self.receiving)
               + len(self.loading) < self.config.max_num_seqs):
            request = self.waiting.peek()
            is_remote = request.kv_from_peer and request.num_preemptions == 0
            if budget <= 0 and not is_remote:  # a remote prefill computes nothing here
                break
            if (self.max_loras is not None and request.lora_name
                    and request.lora_name not in active_loras
                    and len(active_loras) >= self.max_loras):
                # As vLLM: it waits for an adapter's last request to finish, while
                # requests behind it of the base model or a running adapter go ahead.
                self.waiting.skip()
                continue
            computed_blocks, num_computed = kv.get_computed_blocks(request)
            if self.tier_probe is not None and not request.tiers_probed:
                loading = self._admit_tier_load(request, computed_blocks, num_computed, out,
                                                reserve)
                if loading is False:
                    break
                if loading:
                    reserve += self._reserve_for(request)
                    if request.lora_name:
                        active_loras.add(request.lora_name)
                    continue
            if is_remote:
                if not self._admit_remote(request, computed_blocks, num_computed, out, reserve):
                    break
                reserve += self._reserve_for(request)
                if request.lora_name:
                    active_loras.add(request.lora_name)
                continue
            num_new = self._cap_new_tokens(request, request.num_tokens - num_computed, budget)
            if not self.config.enable_chunked_prefill and num_new < request.num_tokens - num_computed:
                break
            alone = (not self.running and not self.receiving and not self.loading
                     and not out.scheduled)
            if (
                kv.allocate_slots(
                    request,
                    num_new,
                    new_computed_blocks=computed_blocks,
                    num_new_computed_tokens=num_computed,
                    # The reserve keeps room for running requests to grow; with
                    # none running it would only keep this one waiting forever.
                    num_reserved_blocks=0 if alone else reserve,
                )
                is None
            ):
                if alone:
                    # Not even an empty pool holds it: end it instead of waiting forever.
                    self.waiting.pop()
                    request.status = RequestStatus.FINISHED_LENGTH
                    request.stop_reason = "kv_cache_capacity"
                    self._free(request)
                    self._finished_unscheduled.append(EngineCoreOutput(
                        request.request_id, [], finish_reason="length",
                        stop_reason=request.stop_reason,
                        num_preemptions=request.num_preemptions))
                    continue
                break
            self.waiting.pop()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            if request.lora_name:
                active_loras.add(request.lora_name)
            out.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
            reserve += self._reserve_for(request)

    def _admit_remote(self, request: Request, computed_blocks: list, num_computed: int,
                      out: SchedulerOutput, reserve: int) -> bool:
        """Allocate a decode-side request's prompt blocks and queue the pull of those the
        prefix cache does not already hold here. Takes no token budget: nothing is computed.
        The blocks enter the prefix cache only once their KV has arrived."""
        kv = self.kv_cache_manager
        if kv.allocate_slots(
            request, request.num_prompt_tokens - num_computed, new_computed_blocks=computed_blocks,
            num_new_computed_tokens=num_computed, num_reserved_blocks=reserve,
            delay_caching=True,
        ) is None:
            return False
        self.waiting.pop()
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        request.num_computed_tokens = num_computed
        request.num_cached_tokens = num_computed
        request.first_scheduled_time = time.monotonic()
        self.receiving[request.request_id] = request
        out.pulls.append(RemoteKvPull(request, kv.get_transfer_block_ids(request.request_id),
                                      num_computed // kv.block_size * kv.pages_per_block))
        return True

    def _drafts(self, request: Request, num_new: int,
                budget: int) -> tuple[list[int], list[RequestGrammar]]:
        """Speculative decoding: the drafts for a request's decode step, within the step's
        budget and the request's length limit (none while the batch is large), and for a
        request with a grammar its states after each: only the leading drafts the grammar
        allows are kept, short of one that would complete it (the completing token ends the
        request, and is sampled like any step's last token)."""
        if (self.drafter is None or len(self.running) > self.drafter.config.max_batch_size
                or num_new != 1 or request.num_computed_tokens != request.num_tokens - 1):
            return [], []
        # The step appends the accepted drafts and one more token.
        room = min(budget - 1, request.max_total_tokens - request.num_tokens - 1)
        drafts = self.drafter.propose(request.all_token_ids, room)
        if request.grammar is None:
            return drafts, []
        states: list[RequestGrammar] = []
        state = request.grammar
        for token_id in drafts:
            state = state.fork()
            if not state.accept(token_id) or state.is_terminated:
                break
            states.append(state)
        return drafts[:len(states)], states

    def _prefill_room(self) -> int:
        """Prompt tokens this step may compute, over every prefilling request together.
        While a running request is decoding: ``max_prefill_tokens_while_decoding``. On a
        decode replica (fixed caps), also no more than take ``max_prefill_time_per_decode_step``
        decode steps by the measured costs (at least one block, so the prompt moves on), so
        that the decodes' next token waits for about that much beside their own step. On an
        aggregated replica (``prefill_caps_scale_with_queue``): the token cap times the
        prompts queued (waiting or being computed), up to the budget, without the time cap.
        Else the whole budget; without chunked prefill a prompt runs whole, so there is no
        such cap."""
        cap = self.config.max_prefill_tokens_while_decoding
        prefilling = sum(1 for r in self.running if _is_prefilling(r))
        if (cap <= 0 or not self.config.enable_chunked_prefill
                or prefilling == len(self.running)):
            return self.config.max_num_batched_tokens
        if self.config.prefill_caps_scale_with_queue:
            # NOTE: an aggregated replica serves prompts and streams alike, and its users
            # wait for both: each queued prompt adds a token cap, so a queue past capacity
            # drains instead of trickling in, and no time cap. Under a queue the time cap
            # starved prompts (no decode-only step for StepCosts to measure the decodes by,
            # so the growing decode batch was charged to the prompt tokens and chunks shrank
            # to a block a step: the 107 s TTFT tail of issue 27); for a lone prompt it
            # spread a 1,024-token prompt over many steps, TTFT 1.8x vllm serve's, which
            # computes it in one (issue 39). The token cap alone still bounds a stream's gap.
            queued = max(1, prefilling + len(self.waiting))
            return min(cap * queued, self.config.max_num_batched_tokens)
        ratio = self.config.prefill_time_cap
        if ratio > 0:
            # Costs not seen yet (a decode replica's first fallback: its prompts came as
            # KV so far): one block, to measure by.
            fits = self.step_costs.prefill_tokens_within(ratio) or 0
            cap = min(cap, max(fits, self.kv_cache_manager.block_size))
        return min(cap, self.config.max_num_batched_tokens)

    def _note_step(self, out: SchedulerOutput) -> None:
        """Remember what the step holds, to time it when its output comes back."""
        prefill = sum(s.num_new_tokens for s in out.scheduled if _is_prefilling(s.request))
        decodes = sum(1 for s in out.scheduled if not _is_prefilling(s.request))
        self._step_make_up = (prefill, decodes, time.perf_counter()) if out.scheduled else None

    def _cap_new_tokens(self, request: Request, remaining: int, budget: int) -> int:
        threshold = self.config.long_prefill_token_threshold
        if threshold > 0:
            remaining = min(remaining, threshold)
        return min(remaining, budget)

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            # Lowest priority (largest value) first, then the latest arrival.
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.tiers_probed = False  # its prefix may be in a tier by now
        request.num_preemptions += 1
        self._num_preemptions_since_report += 1
        self.waiting.add_front(request)

    # ------------------------------------------------------------------ results
    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        runner_output: ModelRunnerOutput,
    ) -> list[EngineCoreOutput]:
        if self._step_make_up is not None:  # the model ran the step just now
            prefill, decodes, started = self._step_make_up
            self.step_costs.observe(prefill, decodes, time.perf_counter() - started)
            self._step_make_up = None
        outputs: list[EngineCoreOutput] = []
        for item in scheduler_output.scheduled:
            request = item.request
            if request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            accepted = runner_output.accepted_drafts.get(request.request_id, [])
            # A rejected draft's KV is not the sequence's: those positions run again.
            request.num_computed_tokens += item.num_new_tokens - (
                len(item.draft_token_ids) - len(accepted))
            self._num_draft_tokens += len(item.draft_token_ids)
            self._num_accepted_tokens += len(accepted)
            prompt_logprobs = runner_output.prompt_logprobs.get(request.request_id)
            if prompt_logprobs:
                request.pending_prompt_logprobs.extend(prompt_logprobs)
                request.next_prompt_logprob_position += len(prompt_logprobs)
            result = runner_output.sampled.get(request.request_id)
            if result is None:
                continue  # a prefill chunk that does not reach the end yet
            token_id, logprobs = result
            if accepted and item.draft_grammars:
                # The state that has accepted the kept drafts (the scheduler checked them).
                request.grammar = item.draft_grammars[len(accepted) - 1]
            if request.grammar is not None and not request.grammar.accept(token_id):
                outputs.append(self._end_rejected(request, token_id))
                continue
            new_token_ids: list[int] = []
            for new_token_id in [*accepted, token_id]:
                request.append_output_token(new_token_id)
                new_token_ids.append(new_token_id)
                finished = request.check_stop()
                if finished:  # the tokens after a stop are not part of the output
                    break
            output = EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=new_token_ids,
                new_logprobs=[*runner_output.accepted_draft_logprobs.get(
                    request.request_id, [None] * len(accepted)), logprobs][:len(new_token_ids)],
                num_cached_tokens=max(request.num_cached_tokens, 0),
                num_preemptions=request.num_preemptions,
                first_scheduled_time=request.first_scheduled_time,
            )
            if request.sampling_params.prompt_logprobs is not None and request.num_output_tokens == 1:
                output.prompt_logprobs, request.pending_prompt_logprobs = (
                    request.pending_prompt_logprobs, [])
            if finished:
                self.running.remove(request)
                if self.output_room is not None:
                    self.output_room.observe_finished(request.num_output_tokens)
                output.finish_reason = request.status.finish_reason
                output.stop_reason = request.stop_reason
                if request.hold_kv and request.status == RequestStatus.FINISHED_LENGTH:
                    del self.requests[request.request_id]
                    self.held[request.request_id] = request
                    self._to_pin.append((request, output))
                else:
                    self._free(request)
            outputs.append(output)
        return outputs

    def _end_rejected(self, request: Request, token_id: int) -> EngineCoreOutput:
        """End a request whose grammar rejects its sampled token, without that token.

        The mask allows only what the grammar accepts, so this means nothing was left to
        sample (every allowed logit at -inf or NaN): the output cannot go on and stay valid.
        """
        logger.error("request %s: its grammar rejected sampled token %d; ending it",
                     request.request_id, token_id)
        self.running.remove(request)
        request.status = RequestStatus.FINISHED_ABORTED
        request.stop_reason = "structured_output_rejected"
        self._free(request)
        return EngineCoreOutput(request.request_id, [], finish_reason="abort",
                                stop_reason=request.stop_reason,
                                num_cached_tokens=max(request.num_cached_tokens, 0),
                                num_preemptions=request.num_preemptions)

    def _free(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]

    def _prefill_outlook(self) -> PrefillOutlook:
        queued = sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)
        queued += sum(r.num_tokens - r.num_computed_tokens for r in self.running
                      if _is_prefilling(r))
        decoding = any(not _is_prefilling(r) for r in self.running)
        return prefill_outlook(self.step_costs, self.config, queued_tokens=queued,
                               decoding=decoding, block_size=self.kv_cache_manager.block_size)

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        prefix = kv.take_prefix_cache_stats()
        stats = SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=kv.usage,
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.num_blocks,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            kv_tier_hit_tokens=prefix.tier_hits,
            num_preemptions=self._num_preemptions_since_report,
            num_pinned_blocks=sum(
                len(kv.get_block_ids(request_id)) for request_id in self.held),
            num_scheduled_tokens=self._num_scheduled_tokens,
            num_draft_tokens=self._num_draft_tokens,
            num_accepted_tokens=self._num_accepted_tokens,
        )
        outlook = self._prefill_outlook()
        stats.num_prefill_tokens_queued = outlook.queued_tokens
        stats.prefill_tokens_per_s, stats.prefill_share = outlook.tokens_per_s, outlook.share
        if self.lora_enabled:
            stats.max_lora = (self.max_loras if self.max_loras is not None
                              else self.num_lora_adapters)
            stats.running_lora_adapters = sorted(
                {r.lora_name for r in self.running if r.lora_name})
            stats.waiting_lora_adapters = sorted(
                {r.lora_name for r in itertools.chain(self.waiting, self.receiving.values())
                 if r.lora_name})
        self._num_preemptions_since_report = 0
        self._num_scheduled_tokens = self._num_draft_tokens = self._num_accepted_tokens = 0
        return stats


def _is_prefilling(request: Request) -> bool:
    """More than one token still to compute: its prompt (or, after a preemption, its prompt
    and output), not one decode step."""
    return request.num_tokens - request.num_computed_tokens > 1
