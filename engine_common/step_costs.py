"""What the engine's steps cost in time, as the scheduler needs it: the wall time of a step of
decodes alone, and the time each prompt token adds to a step.

Owns two running estimates (moving averages; the prompt tokens' cost goes up at once and down
slowly, the safe side), fed with every step's make-up and wall time, and the number of prompt
tokens that take about a given multiple of a decode step. The scheduler uses that to size the
prompt chunks it computes beside running decodes, so that their inter-token gap stays bounded
in time on any hardware and model: a token count alone cannot say that (64 prompt tokens cost
a fraction of a decode step on a GPU, and several on one CPU core). Also the recent rate of
prompt tokens (a ratio of decayed sums), which a replica publishes for routers
(``prefill_outlook``). It does not own scheduling (``scheduler``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepCosts:
    # Weight of the newest step in each average: a change of batch shows within a few steps,
    # one step delayed by another process on the machine fades as fast.
    smoothing: float = 0.2
    decode_step_s: float | None = None  # a step of decodes only
    prefill_token_s: float | None = None  # what one more prompt token adds to a step
    # The prompt tokens of recent steps and the seconds they took (each step's time less its
    # decodes' share), both decayed by ``rate_decay`` at every step with prompt tokens: their
    # ratio is the prompt rate routers estimate a time to first token with. A ratio of sums,
    # not an average of per-step rates, and not ``prefill_token_s``: that one rises at once
    # on a step of a few prompt tokens beside many decodes (their fixed cost all charged to
    # those tokens), which is the safe side for sizing chunks but said 20 tokens/s on a
    # replica that computes thousands, and sent prompts away from it.
    rate_decay: float = 0.9
    prefill_tokens_seen: float = 0.0
    prefill_seconds_seen: float = 0.0

    def observe(self, prefill_tokens: int, decodes: int, seconds: float) -> None:
        """One step: ``prefill_tokens`` prompt tokens (all requests together) beside
        ``decodes`` decoding requests, in ``seconds``."""
        if prefill_tokens <= 0:
            if decodes:
                self.decode_step_s = self._mix(self.decode_step_s, seconds)
            return
        # The decodes' share of a mixed step is what a step of decodes alone costs; a step
        # of prompt tokens alone charges its fixed cost to them (too high, the safe side).
        base = self.decode_step_s if decodes and self.decode_step_s is not None else 0.0
        per_token = max(seconds - base, 0.0) / prefill_tokens
        self.prefill_tokens_seen = self.rate_decay * self.prefill_tokens_seen + prefill_tokens
        self.prefill_seconds_seen = (self.rate_decay * self.prefill_seconds_seen
                                     + max(seconds - base, 0.0))
        # Up at once, down slowly: a prompt's later tokens cost more (each attends to all
        # before it), and a chunk sized by an old, lower cost is a gap too long.
        self.prefill_token_s = max(per_token, self._mix(self.prefill_token_s, per_token))

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens computed per second of their steps, lately; 0 before any."""
        if self.prefill_seconds_seen <= 0.0:
            return 0.0
        return self.prefill_tokens_seen / self.prefill_seconds_seen

    def prefill_tokens_within(self, decode_steps: float) -> int | None:
        """Prompt tokens that take about ``decode_steps`` decode steps; None until both
        costs have been seen."""
        if self.decode_step_s is None or not self.prefill_token_s:
            return None
        return int(decode_steps * self.decode_step_s / self.prefill_token_s)

    def _mix(self, average: float | None, value: float) -> float:
        return value if average is None else average + self.smoothing * (value - average)
