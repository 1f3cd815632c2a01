"""Admission's output reserve (engine_common/output_room.py): how many blocks a running
request is expected still to need, and the scheduler keeping them free.

The engine-level check (a small pool, HF-exact tokens, no preemption with the reserve and
some without it) is in test_engine_greedy.py, beside the preemption test it mirrors.
"""

from __future__ import annotations

from engine_common.config import SchedulerConfig
from engine_common.kv_cache_manager import KVCacheManager
from engine_common.output_room import OutputRoom
from engine_common.outputs import ModelRunnerOutput
from engine_common.request import Request
from engine_common.sampling_params import SamplingParams
from engine_common.scheduler import Scheduler

BLOCK = 4


def request(prompt_len: int, max_tokens: int | None, max_model_len: int = 1 << 30) -> Request:
    return Request(f"r{prompt_len}-{max_tokens}", list(range(prompt_len)),
                   SamplingParams(max_tokens=max_tokens), max_model_len=max_model_len,
                   block_size=BLOCK)


def test_expected_output_is_the_floor_or_what_recent_requests_reached_above_it():
    room = OutputRoom(BLOCK, window=10, floor_tokens=20)
    assert room.expected_output_tokens == 20
    for n in range(1, 11):  # short requests (a warm-up) do not lower it
        room.observe_finished(n)
    assert room.expected_output_tokens == 20
    for n in range(101, 111):  # 101..110 tokens: the 90th percentile is 110
        room.observe_finished(n)
    assert room.expected_output_tokens == 110
    for _ in range(10):  # the window forgets the old lengths
        room.observe_finished(3)
    assert room.expected_output_tokens == 20


def test_a_request_needs_its_prompt_rest_and_expected_output_within_max_tokens():
    room = OutputRoom(BLOCK, floor_tokens=8)
    # 10-token prompt, nothing held: 10 + min(max_tokens 100, expected 8) = 18 tokens, 5 blocks.
    assert room.blocks_still_needed(request(10, 100), num_held_blocks=0) == 5
    # max_tokens below the estimate caps it: 10 + 2 = 12 tokens, 3 blocks, 1 held.
    assert room.blocks_still_needed(request(10, 2), num_held_blocks=1) == 2
    # No max_tokens: the model's length is the limit, the estimate what is reserved.
    assert room.blocks_still_needed(request(10, None, max_model_len=12), 0) == 3
    assert room.blocks_still_needed(request(10, None), 0) == 5
    # A request past the estimate reserves nothing beyond what it holds.
    grown = request(4, 100)
    for token in range(20):
        grown.append_output_token(token)
    assert room.blocks_still_needed(grown, num_held_blocks=6) == 0


def test_the_scheduler_admits_only_what_the_reserve_leaves():
    # 12 blocks of 4. Each request: 8-token prompt + 8 output tokens = 4 blocks grown.
    kv = KVCacheManager(num_blocks=12, block_size=BLOCK, max_model_len=64)
    config = SchedulerConfig(max_num_batched_tokens=64, watermark=0.0)
    scheduler = Scheduler(config, kv)
    assert scheduler.output_room is not None
    scheduler.output_room.floor_tokens = 8
    for i in range(5):
        scheduler.add_request(Request(f"r{i}", [i] * 8, SamplingParams(max_tokens=8),
                                      block_size=BLOCK, max_model_len=64))
    admitted = [s.request.request_id for s in scheduler.schedule().scheduled]
    # 3 x 4 blocks fill the pool once grown: the 4th and 5th wait.
    assert admitted == ["r0", "r1", "r2"]
    unreserved = Scheduler(SchedulerConfig(max_num_batched_tokens=64, watermark=0.0,
                                           reserve_output_room=False),
                           KVCacheManager(num_blocks=12, block_size=BLOCK, max_model_len=64))
    for i in range(5):
        unreserved.add_request(Request(f"r{i}", [i] * 8, SamplingParams(max_tokens=8),
                                       block_size=BLOCK, max_model_len=64))
    # Without the reserve every prompt that fits now is admitted: 5 x 2 blocks.
    assert len(unreserved.schedule().scheduled) == 5


def _burst(reserve_output_room: bool) -> tuple[int, int]:
    """24 requests of 64 prompt + 32 output tokens at once into 100 blocks of 16 (16 such
    requests fully grown), after a warm-up's short requests finished: the preemptions and
    the most requests running at once, stepping the real scheduler (tokens made up)."""
    kv = KVCacheManager(num_blocks=100, block_size=16, max_model_len=1024)
    scheduler = Scheduler(SchedulerConfig(prefill_caps_scale_with_queue=True,
                                          reserve_output_room=reserve_output_room), kv)
    if scheduler.output_room is not None:
        for n in (1, 1, 8):
            scheduler.output_room.observe_finished(n)
    for i in range(24):
        scheduler.add_request(Request(f"r{i}", [3 + i] * 64, SamplingParams(
            max_tokens=32, ignore_eos=True), block_size=16, max_model_len=1024))
    preemptions = most_running = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        preemptions += len(out.preempted_request_ids)
        most_running = max(most_running, len(scheduler.running))
        scheduler.update_from_output(out, ModelRunnerOutput(
            {s.request.request_id: (5, None) for s in out.scheduled if s.completes_sequence}))
    return preemptions, most_running


def test_a_burst_after_short_requests_is_admitted_without_preemptions():
    """The regression of issue 27's first try: the estimate followed a warm-up's one-token
    requests, reserved nothing for a burst of long ones and they preempted each other."""
    assert _burst(reserve_output_room=True) == (0, 16)
    preemptions, most_running = _burst(reserve_output_room=False)
    assert preemptions > 0 and most_running > 16
