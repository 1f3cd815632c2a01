"""The KV room running requests will still need for their output: the admission reserve.

Admitting a prompt into blocks that the running requests will need for their own next tokens
ends, a few steps later, in a preemption by recompute: a victim's blocks are freed and its
prompt and output computed again, all of it wasted work (issue 27: an aggregated replica past
capacity admitted 44 requests of 512 + 128 tokens into a pool of ~36 such, reached 99.7% KV
use, then preempted the latest arrivals over and over while vLLM, with the same pool, held 36
without preempting). TGI reserves each request's whole ``max_new_tokens``; SGLang a fraction
of it, raised after each retraction. Here each running request is reserved the tokens it is
expected still to generate: its remaining ``max_tokens``, but no more than the larger of
``floor_tokens`` and what recent requests actually produced (the 90th percentile of the last
``window`` finished requests' output lengths), since a chat request that leaves ``max_tokens``
unset may run to the model's whole context and would otherwise reserve it. The floor keeps a
few short requests (a replica's warm-up, a health probe's one token) from lowering the
reserve of the long ones that follow: a burst is admitted long before any of it finishes,
so an estimate from short requests was the cause of the very preemptions this prevents. A
request that outgrows the estimate reserves nothing more; preemption remains the safety net
for what the estimate misses.

Owns the estimate and the reserve in blocks. It does not admit or preempt (``scheduler``) nor
hold blocks (``kv_cache_manager``).
"""

from __future__ import annotations

from collections import deque

from engine_common.request import Request

# The percentile of recent output lengths reserved for: the median would under-reserve half
# of a homogeneous batch by a little, every step; the maximum lets one outlier throttle all.
_PERCENTILE = 0.9


class OutputRoom:
    def __init__(self, block_size: int, window: int = 64, floor_tokens: int = 256):
        if block_size < 1 or window < 1 or floor_tokens < 0:
            raise ValueError("block_size and window must be positive, floor_tokens >= 0")
        self.block_size = block_size
        self.floor_tokens = floor_tokens
        self._lengths: deque[int] = deque(maxlen=window)
        self._expected: int | None = None  # the percentile, cached until the next finish

    def observe_finished(self, num_output_tokens: int) -> None:
        """A request finished by its own stop or length (not aborted) with this many tokens."""
        self._lengths.append(num_output_tokens)
        self._expected = None

    @property
    def expected_output_tokens(self) -> int:
        """How many output tokens a request is expected to reach: the floor, or more if
        recent requests ran longer."""
        if self._expected is None:
            ordered = sorted(self._lengths)
            recent = ordered[min(len(ordered) - 1, int(_PERCENTILE * len(ordered)))] \
                if ordered else 0
            self._expected = max(self.floor_tokens, recent)
        return self._expected

    def blocks_still_needed(self, request: Request, num_held_blocks: int) -> int:
        """Blocks ``request`` is expected to add to the ``num_held_blocks`` it holds: the rest
        of its prompt (a chunked prefill holds only what it has computed) and its expected
        output, within its length limit."""
        expected_total = min(request.max_total_tokens,
                             request.num_prompt_tokens + self.expected_output_tokens)
        needed_tokens = max(request.num_tokens, expected_total)
        return max(0, -(-needed_tokens // self.block_size) - num_held_blocks)
