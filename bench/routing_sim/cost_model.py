"""How long one engine step takes, from what the step computes: the fitted cost model.

Owns the step's shape (``StepShape``), the linear model over it (``StepCostModel``), fitting
that model to measured steps (non-negative least squares) and its JSON form. It does not own
measuring steps (``fit_costs``) or running them (``replica``).

Why these features, on one CPU core:

- a fixed cost per step (the scheduler, Python, each layer's launch);
- a cost per token run through the weights (every scheduled token);
- a cost per sampled sequence (the LM head over the whole vocabulary and the sampler run
  only for a sequence whose step reaches its end, never for a partial prefill chunk);
- a cost per context token read (each scheduled sequence gathers the paged KV of its whole
  context once per step: what makes a decode step at a long context slow);
- a cost per query-key pair (each new token attends to the tokens before it: what makes a
  long prefill chunk superlinear).

The measured steps (``fit_costs``) separate the last two: a decode token has as many pairs
as context tokens, a prefill chunk of ``c`` tokens after ``p`` has ``p + c`` context tokens
but about ``c * (p + c / 2)`` pairs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

FEATURES = ("step", "tokens", "sampled", "context_tokens", "attention_pairs")


@dataclass(frozen=True)
class StepShape:
    """What one step computes."""

    tokens: int  # tokens run through the model, every scheduled sequence's together
    sampled: int  # sequences that sample a token in this step
    context_tokens: int  # for each scheduled sequence, its length after the step, summed
    attention_pairs: int  # for each new token, the tokens of its sequence up to it, summed

    @staticmethod
    def pairs(context_before: int, new_tokens: int) -> int:
        """Attention pairs of ``new_tokens`` tokens computed after ``context_before``."""
        after = context_before + new_tokens
        return (after * (after + 1) - context_before * (context_before + 1)) // 2

    @classmethod
    def of(cls, chunks: Sequence[tuple[int, int, bool]]) -> StepShape:
        """From (context before, new tokens, samples) per scheduled sequence."""
        return cls(sum(n for _, n, _ in chunks), sum(1 for _, _, s in chunks if s),
                   sum(c + n for c, n, _ in chunks), sum(cls.pairs(c, n) for c, n, _ in chunks))

    def features(self) -> list[float]:
        return [1.0, float(self.tokens), float(self.sampled), float(self.context_tokens),
                float(self.attention_pairs)]


@dataclass(frozen=True)
class StepCostModel:
    """Seconds per step: ``step_s`` plus each feature times its cost."""

    step_s: float
    token_s: float
    sampled_s: float
    context_token_s: float
    pair_s: float

    def step_time(self, shape: StepShape) -> float:
        return (self.step_s + shape.tokens * self.token_s + shape.sampled * self.sampled_s
                + shape.context_tokens * self.context_token_s
                + shape.attention_pairs * self.pair_s)

    def scaled(self, factor: float) -> StepCostModel:
        """Every cost times ``factor`` (a machine that much slower)."""
        return StepCostModel(*(factor * v for v in asdict(self).values()))

    def to_json(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, float]) -> StepCostModel:
        return cls(*(float(data[f]) for f in ("step_s", "token_s", "sampled_s",
                                               "context_token_s", "pair_s")))


def fit(shapes: Sequence[StepShape], seconds: Sequence[float]) -> StepCostModel:
    """Least squares on relative error (each step weighted by 1 / its time, so a 20 ms
    decode step counts as much as a 2 s prefill), coefficients kept non-negative by
    dropping any that come out negative and refitting the rest (a small active set)."""
    if len(shapes) != len(seconds) or len(shapes) < len(FEATURES):
        raise ValueError(f"need at least {len(FEATURES)} measured steps, one time each")
    x = np.array([s.features() for s in shapes])
    y = np.array(seconds, dtype=float)
    w = 1.0 / y
    active = list(range(len(FEATURES)))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        worst = min(zip(coef, active, strict=True))
        if worst[0] >= 0:
            break
        active.remove(worst[1])
    full = [0.0] * len(FEATURES)
    for a, c in zip(active, coef, strict=True):
        full[a] = float(c)
    return StepCostModel(*full)


def relative_errors(model: StepCostModel, shapes: Sequence[StepShape],
                    seconds: Sequence[float]) -> list[float]:
    """(predicted - measured) / measured, per step."""
    return [(model.step_time(s) - t) / t for s, t in zip(shapes, seconds, strict=True)]
