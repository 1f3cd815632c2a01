"""The multi-turn chat workload the KV-tier benchmarks share (LMBenchmark's multi-round QA,
on token ids).

``users`` users share a system prompt; each turn appends the user's previous answer and
``turn_tokens`` new random tokens. Users are interleaved (turn 1 of every user, then turn 2
of every user, ...), so between two turns of one user every other user's context passes
through the server's KV pool. Owns the prompts and what a server could have cached for each
(``max_hit``); not how a turn is served or timed (``kv_tiers`` runs it on the offline
engine, ``kv_tiers_serving`` over HTTP).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

VOCAB = 40000  # token ids are drawn below every benchmarked model's vocabulary size


@dataclass
class ChatWorkload:
    users: int
    turns: int
    system_tokens: int
    turn_tokens: int
    output_tokens: int
    seed: int = 0
    _new: list[list[list[int]]] = field(init=False, repr=False)
    _history: list[list[int]] = field(init=False, repr=False)
    _computed: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        system = [rng.randrange(VOCAB) for _ in range(self.system_tokens)]
        self._new = [[[rng.randrange(VOCAB) for _ in range(self.turn_tokens)]
                      for _ in range(self.turns)] for _ in range(self.users)]
        self._history = [list(system) for _ in range(self.users)]
        self._computed = [0] * self.users  # tokens of the user's context computed before

    def longest_conversation(self) -> int:
        return self.system_tokens + self.turns * (self.turn_tokens + self.output_tokens)

    def working_set(self) -> int:
        return self.users * self.longest_conversation()

    def schedule(self) -> Iterator[tuple[int, int]]:
        """(user, turn) in the order they are asked: users interleaved within each turn."""
        for turn in range(self.turns):
            for user in range(self.users):
                yield user, turn

    def prompt(self, user: int, turn: int) -> list[int]:
        return self._history[user] + self._new[user][turn]

    def max_hit(self, user: int, prompt: list[int], block_size: int) -> int:
        """Prompt tokens a cache of ``block_size`` blocks could hold: every full block
        computed before, short of the prompt's last token."""
        return min(self._computed[user], len(prompt) - 1) // block_size * block_size

    def answered(self, user: int, prompt: list[int], answer: list[int]) -> None:
        """The user's context grows by the answer; its last token was never computed."""
        self._computed[user] = len(prompt) + len(answer) - 1
        self._history[user] = prompt + answer
