"""What rank 0 sends its tensor-parallel workers: the setup once, then one message a step.

Owns the records on the rank-0-to-worker channel and stripping a step down to what a
worker's model runner reads. A worker runs the same ``ModelRunner.execute`` as rank 0 (so
every rank makes the same collectives in the same order, including the LM head's gathers
for prompt logprobs and speculative drafts) and its sampled tokens are dropped: only rank
0's go back to the scheduler. A worker therefore needs each scheduled request's tokens,
sampling parameters and block ids (every KV cache group's), not its grammar (masks change logits after the last
collective) nor its P/D or tier state.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from engine_common.config import EngineConfig
from engine_common.scheduler import ScheduledRequest, SchedulerOutput


@dataclass(frozen=True)
class WorkerSetup:
    """The first message: who the worker is and what it loads."""

    config: EngineConfig
    eos_token_ids: frozenset[int]
    max_model_len: int
    rank: int
    store_port: int  # rank 0's TCP store on loopback
    cpus: list[int] | None  # the worker's share of the replica's CPUs; None: unpinned


@dataclass(frozen=True)
class StepMessage:
    """One step for every rank; ``released``: requests finished since the last step (their
    seeded generators go)."""

    scheduler_output: SchedulerOutput
    released: list[str]


def step_message(scheduler_output: SchedulerOutput, released: list[str]) -> StepMessage:
    """The step as workers need it (see the module docstring)."""
    scheduled = []
    for item in scheduler_output.scheduled:
        request = copy.copy(item.request)  # shallow: its token lists are only read
        request.grammar = None
        request.remote_prefill = None
        request.kv_chunks = []
        request.block_hashes = []
        request.pending_prompt_logprobs = []
        scheduled.append(ScheduledRequest(request, item.num_new_tokens, item.block_ids,
                                          item.draft_token_ids,
                                          extra_block_ids=item.extra_block_ids))
    return StepMessage(SchedulerOutput(scheduled=scheduled), released)
