"""What a replica tells routers about computing one more prompt here: the prompt tokens
already queued ahead of it, the measured rate of prompt tokens, and the share of each step a
new prompt would get beside the running decodes.

A router divides (queued + the new prompt's uncached tokens) by (rate x share) to estimate
the prompt's time to its first token on this replica, and compares that across replicas and
roles (``gateway.picker``). Owns that figure, taken from the scheduler's own measurements
(``step_costs``) and caps (``SchedulerConfig``), so it says what the scheduler will do, not
what a router guesses. It does not own scheduling (``scheduler``) or the estimate itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_common.config import SchedulerConfig
from engine_common.step_costs import StepCosts


@dataclass(frozen=True)
class PrefillOutlook:
    # Prompt tokens still to compute here: waiting requests' and those being prefilled.
    queued_tokens: int = 0
    # Prompt tokens computed per second of their steps' time, lately (``StepCosts``); 0: not
    # measured yet (no prompt computed since the start).
    tokens_per_s: float = 0.0
    # The fraction of step time a new prompt gets: 1 with no decodes running; beside running
    # decodes the chunk cap (``max_prefill_tokens_while_decoding``, and on a decode replica
    # ``max_prefill_time_per_decode_step`` decode steps) leaves it less.
    share: float = 1.0


def prefill_outlook(costs: StepCosts, config: SchedulerConfig, *, queued_tokens: int,
                    decoding: bool, block_size: int) -> PrefillOutlook:
    """The outlook of a scheduler whose requests leave ``queued_tokens`` prompt tokens to
    compute, with running decodes when ``decoding``."""
    return PrefillOutlook(queued_tokens, costs.prefill_tokens_per_s,
                          _share(costs, config, decoding, block_size))


def _share(costs: StepCosts, config: SchedulerConfig, decoding: bool, block_size: int) -> float:
    cap = config.max_prefill_tokens_while_decoding
    if not decoding or cap <= 0 or not config.enable_chunked_prefill:
        return 1.0  # the whole budget goes to prompts (the decodes' own share is small)
    ratio = config.prefill_time_cap
    if costs.decode_step_s is None or not costs.prefill_token_s:
        # Not measured yet: the time cap's intent, a chunk as long as a decode step.
        return ratio / (1.0 + ratio) if ratio > 0 else 0.5
    tokens = min(cap, config.max_num_batched_tokens)
    if ratio > 0:
        tokens = min(tokens, max(costs.prefill_tokens_within(ratio) or 0, block_size))
    compute = tokens * costs.prefill_token_s
    return compute / (costs.decode_step_s + compute)
