"""Property tests of the scheduler over random workloads (no model: tokens are random).

Invariants checked every step: the token budget and max_num_seqs are never exceeded, a
scheduled request never computes past its known tokens, no block is both free and held,
chunked prefill and preemption keep num_computed_tokens consistent, and once every request
has finished or been aborted every block is free again.
"""

from __future__ import annotations

import random

from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine_common.config import SchedulerConfig, SpeculativeConfig
from engine_common.kv_cache_manager import KVCacheManager
from engine_common.outputs import ModelRunnerOutput
from engine_common.request import Request, RequestStatus
from engine_common.sampling_params import SamplingParams
from engine_common.scheduler import Scheduler

BLOCK = 4


def check_pool(kv: KVCacheManager) -> None:
    pool = kv.block_pool
    free_ids = {b.block_id for b in pool.free_block_queue.get_all_free_blocks()}
    held = {b.block_id for blocks in kv.req_to_blocks.values() for b in blocks}
    assert not free_ids & held, "a block is both free and held"
    assert all(b.ref_cnt >= 0 for b in pool.blocks)
    assert len(free_ids) + len(held) == kv.num_blocks


@settings(max_examples=60, deadline=None)
# A request that outgrows the pool while running alone: preempted, then ended for capacity.
@example(lengths=[1, 1, 1, 1, 1, 1, 39], max_tokens=[1, 1, 1, 1, 1, 1, 11, 1, 1, 1, 1, 1],
         budget=1, max_seqs=1, num_blocks=12, policy="fcfs", threshold=0, seed=0,
         speculate=False)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=12),
    max_tokens=st.lists(st.integers(1, 12), min_size=12, max_size=12),
    budget=st.integers(1, 64),
    max_seqs=st.integers(1, 6),
    num_blocks=st.integers(12, 48),
    policy=st.sampled_from(["fcfs", "priority"]),
    threshold=st.sampled_from([0, 3, 16]),
    seed=st.integers(0, 2**16),
    speculate=st.booleans(),
)
def test_scheduler_invariants(lengths, max_tokens, budget, max_seqs, num_blocks, policy,
                              threshold, seed, speculate):
    """With ``speculate``, greedy requests get drafts (tokens from a small alphabet repeat)
    and the emulated model accepts a random number of them."""
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks=num_blocks, block_size=BLOCK, max_model_len=64)
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                             policy=policy, long_prefill_token_threshold=threshold)
    speculative = SpeculativeConfig(num_tokens=3, ngram_min=1, ngram_max=2, max_batch_size=6)
    sched = Scheduler(config, kv, speculative if speculate else None)
    requests = []
    for i, n in enumerate(lengths):
        r = Request(f"r{i}", [rng.randrange(8 if speculate else 50) for _ in range(n)],
                    SamplingParams(max_tokens=max_tokens[i], ignore_eos=True,
                                   temperature=0.0 if speculate else 1.0),
                    priority=rng.randrange(3), max_model_len=64, block_size=BLOCK)
        requests.append(r)
        sched.add_request(r)
    finished: set[str] = set()
    for _step in range(2000):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        assert out.total_num_scheduled_tokens <= budget
        assert len(sched.running) <= max_seqs
        for item in out.scheduled:
            r = item.request
            assert item.num_new_tokens >= 1
            known = item.num_new_tokens - len(item.draft_token_ids)
            assert r.num_computed_tokens + known <= r.num_tokens
            assert not item.draft_token_ids or known == 1  # drafts only follow a decode
            if threshold:  # a prefill bound: a decode step's drafts come on top
                assert known <= threshold
            held_slots = len(kv.get_block_ids(r.request_id)) * BLOCK
            assert held_slots >= r.num_computed_tokens + item.num_new_tokens
        check_pool(kv)
        sampled = ModelRunnerOutput({s.request.request_id: (rng.randrange(8), None)
                                     for s in out.scheduled if s.completes_sequence})
        for item in out.scheduled:
            if item.draft_token_ids:
                sampled.accepted_drafts[item.request.request_id] = item.draft_token_ids[
                    :rng.randint(0, len(item.draft_token_ids))]
        for o in sched.update_from_output(out, sampled):
            if o.finished:
                finished.add(o.request_id)
        finished.update(o.request_id for o in sched.take_finished_unscheduled())
        if rng.random() < 0.05:
            victim = rng.choice(requests)
            if victim.request_id not in finished:
                for r in sched.abort_requests([victim.request_id]):
                    finished.add(r.request_id)
        check_pool(kv)
    assert not sched.has_unfinished_requests(), "the scheduler stalled"
    assert len(finished) == len(requests)
    assert kv.num_free_blocks == num_blocks
    for r in requests:
        if r.status == RequestStatus.FINISHED_LENGTH and r.stop_reason is None:
            assert r.num_output_tokens == r.sampling_params.max_tokens


def test_request_larger_than_the_pool_ends_instead_of_waiting_forever():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK, max_model_len=64)
    sched = Scheduler(SchedulerConfig(), kv)
    sched.add_request(Request("big", list(range(20)), SamplingParams(max_tokens=4),
                              max_model_len=64, block_size=BLOCK))
    out = sched.schedule()
    assert out.is_empty
    [ended] = sched.take_finished_unscheduled()
    assert ended.finish_reason == "length" and ended.stop_reason == "kv_cache_capacity"
    assert not sched.has_unfinished_requests() and kv.num_free_blocks == 4
