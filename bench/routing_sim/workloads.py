"""The simulated workloads: who sends which tokens when.

Owns three synthetic workloads, each as sessions of turns (a turn's prompt is everything the
session said and was answered before, plus the turn's new tokens):

- ``shared_prefix`` (a): chat groups sharing a long system prompt; every request is one
  turn: its group's system prompt plus a question of its own.
- ``multi_turn`` (b): conversations whose each turn extends the last (prompt, answer, next
  user message), with a think time between an answer and the next turn.
- ``no_sharing`` (c): the control: every prompt its own random tokens.

Sizes and rates are per replica, so a workload keeps its per-replica pressure (groups per
cache, requests per second per replica) at any cluster size. Token ids are random ordinary
ids; only their equality matters (block hashes). It does not own replaying the real
benchmark's prompts (``validation``) or running sessions (``driver``).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

VOCAB = (100, 49152)  # ordinary token ids of the default model's vocabulary


@dataclass(frozen=True)
class Turn:
    new_tokens: list[int]  # appended to the session's history to form this turn's prompt
    output_tokens: list[int]  # the answer the replica "samples"
    think_s: float = 0.0  # after the previous turn's answer, before this turn is sent


@dataclass(frozen=True)
class Session:
    start_s: float
    turns: list[Turn]
    group: int = -1  # shared-prefix group, -1 for none


@dataclass(frozen=True)
class Workload:
    name: str
    sessions: list[Session]
    settings: dict[str, object]

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(n)]


def _length(rng: random.Random, bounds: tuple[int, int]) -> int:
    return rng.randint(*bounds)


@dataclass(frozen=True)
class SharedPrefixSettings:
    groups_per_replica: float = 4.0
    system_tokens: int = 1024
    question_tokens: tuple[int, int] = (32, 128)
    output_tokens: tuple[int, int] = (16, 64)
    rate_per_replica: float = 0.08  # requests per second
    requests_per_replica: int = 60


def shared_prefix(rng: random.Random, replicas: int, s: SharedPrefixSettings) -> Workload:
    groups = max(1, round(s.groups_per_replica * replicas))
    systems = [_tokens(rng, s.system_tokens) for _ in range(groups)]
    sessions, t = [], 0.0
    for _ in range(s.requests_per_replica * replicas):
        t += rng.expovariate(s.rate_per_replica * replicas)
        g = rng.randrange(groups)
        turn = Turn(systems[g] + _tokens(rng, _length(rng, s.question_tokens)),
                    _tokens(rng, _length(rng, s.output_tokens)))
        sessions.append(Session(t, [turn], g))
    return Workload("shared_prefix", sessions, {**asdict(s), "groups": groups})


@dataclass(frozen=True)
class MultiTurnSettings:
    first_tokens: tuple[int, int] = (256, 768)  # system prompt and first message, per conv.
    user_tokens: tuple[int, int] = (32, 128)
    output_tokens: tuple[int, int] = (32, 128)
    turns: tuple[int, int] = (3, 8)
    think_s: float = 10.0  # mean, exponential
    conversations_per_replica: int = 8
    # New conversations per second per replica.
    start_rate_per_replica: float = 0.016


def multi_turn(rng: random.Random, replicas: int, s: MultiTurnSettings) -> Workload:
    sessions, t = [], 0.0
    for _ in range(s.conversations_per_replica * replicas):
        t += rng.expovariate(s.start_rate_per_replica * replicas)
        turns = []
        for k in range(_length(rng, s.turns)):
            new = _tokens(rng, _length(rng, s.first_tokens if k == 0 else s.user_tokens))
            turns.append(Turn(new, _tokens(rng, _length(rng, s.output_tokens)),
                              rng.expovariate(1.0 / s.think_s) if k else 0.0))
        sessions.append(Session(t, turns))
    return Workload("multi_turn", sessions, asdict(s))


@dataclass(frozen=True)
class NoSharingSettings:
    prompt_tokens: tuple[int, int] = (256, 1024)
    output_tokens: tuple[int, int] = (16, 64)
    rate_per_replica: float = 0.1
    requests_per_replica: int = 50


def no_sharing(rng: random.Random, replicas: int, s: NoSharingSettings) -> Workload:
    sessions, t = [], 0.0
    for _ in range(s.requests_per_replica * replicas):
        t += rng.expovariate(s.rate_per_replica * replicas)
        sessions.append(Session(t, [Turn(_tokens(rng, _length(rng, s.prompt_tokens)),
                                         _tokens(rng, _length(rng, s.output_tokens)))]))
    return Workload("no_sharing", sessions, asdict(s))
