"""Choosing replicas for one request: filters, weighted scorers and the P/D decider.

A pure function over a snapshot (each replica's role, health, load and how much of this
prompt it already caches), so the gateway's proxy and an Envoy ext_proc endpoint picker can
share it. It owns no I/O and no state; building the snapshot is ``snapshot``'s job.

Scoring, per candidate, each scorer in [0, 1] and weighted:

- prefix: the fraction of the prompt's tokens the replica already holds in its prefix cache;
- kv_usage: room for the request's blocks without preempting: 1 up to ``kv_usage_floor`` of
  the cache in use, falling linearly to 0 at a full cache;
- queue: ``1 / (1 + queue_depth / queue_scale)`` (requests running or waiting there).

Why KV usage counts only above a floor: a replica reports its usage as its last engine step
left it, and a step allocates its prompts' blocks when it starts, so a replica in the middle
of a long prefill reports its usage from before that prompt arrived. Below the floor the
differences between replicas say more about whose report is stale than about room, and as
the tie-breaker among equally queued replicas they sent new requests to the ones busiest
prefilling (the routing simulation measured it: ``docs/routing-simulation.md``). Near a full
cache, where preemption and admission stalls begin, they are what matters.

The decode side (the replica that streams the answer: role ``decode`` or ``both``) is the
best-scoring candidate. When prefill replicas exist, the P/D decider adds a prefill replica,
scored the same way, unless fewer than ``prefill_min_uncached_tokens`` of the prompt's
tokens are left to compute on the decode replica (then the hop costs more than it saves), or
the decode replica holds at least ``prefill_skip_fraction`` of the prompt (off by default).

NOTE: the decider counts the tokens left to compute, not the fraction cached, as llm-d's
prefix-based P/D decider does. A decode replica's compute belongs to its running streams; a
fraction rule (it was 0.5) sent every shared-prefix prompt whose prefix the decode replica
held (it pulled those blocks for an earlier request) to be computed there: 256-token
suffixes of 512-token prompts piled onto the busy decode replica while the prefill replica,
holding the same prefix, idled (issue 39: P/D TTFT 7.5-20x the aggregated layout's on a
shared-prefix workload). The prefill replica's own prefix match is in its score, and the
decode replica pulls only the blocks it does not hold.

Where the prompt is computed, when the hop is worth it, is placed by estimated time to the
first token (``estimate_placement``), from what each replica publishes
(``engine_common.prefill_outlook``): (prompt tokens queued there + this prompt's tokens it does
not cache) / (its measured prompt rate x the share of a step a new prompt gets beside its
decodes). A replica that has not measured its rate yet (a restarted one, a decode replica
that has computed no prompt) is estimated with the median rate the others measured (one
model, one kind of machine); with none measured the scores decide, as before. The prefill
replica with the lowest estimate takes it (estimates within ``estimate_tie_s`` are even, and
the scores break the tie); the decode replica computes the prompt itself instead
(``pd_reason="self_prefill_sooner"``) when its own estimate beats that one, plus the hop's
cost (``prefill_hop_s``), by at least ``self_prefill_min_gain_s``: its compute belongs to its
running streams, which wait while it prefills, so a gain of milliseconds is not worth it, but
a prefill replica seconds behind (a queue of long prompts, or the prompts of a dead prefill
replica handed back to it) is.

Roles are a preference, not a wall: with no usable decode-capable replica, the best prefill
replica is the decode side and runs the request whole (``missing_role="decode"``,
``pd_reason="no_decode_replica"``); with prefill replicas known but none usable, the decode
replica computes the prompt itself (``missing_role="prefill"``). Either ends as soon as a
replica of the missing role is usable again: nothing here remembers it.
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace

from gateway.load import LoadView

DECODE_ROLES = frozenset({"decode", "both"})
PREFILL_ROLES = frozenset({"prefill"})


class NoReplicaError(RuntimeError):
    """No replica can take the request; the message says why each one was left out."""


@dataclass(frozen=True)
class ReplicaState:
    """What the picker knows about one replica for one request."""

    address: str
    role: str
    healthy: bool
    load: LoadView = field(default_factory=LoadView)
    # Leading blocks of this request's prompt that the replica holds in its prefix cache.
    matched_blocks: int = 0
    lora_adapters: frozenset[str] = frozenset()  # the LoRA adapters it serves


@dataclass(frozen=True)
class PickerConfig:
    prefix_weight: float = 2.0
    kv_usage_weight: float = 1.0
    queue_weight: float = 1.0
    # Queue depth at which the queue score halves.
    queue_scale: float = 4.0
    # KV-cache usage up to this fraction scores as full room (see the module docstring); in
    # [0, 1), 0 scores every block.
    kv_usage_floor: float = 0.5
    # A replica whose last load report is older than this is left out (it may be hung), unless
    # every candidate is in that state.
    max_load_age_s: float = 2.0
    # The decode replica holding at least this fraction of the prompt computes it itself
    # (1.0: only a fully cached prompt; see the module docstring's NOTE).
    prefill_skip_fraction: float = 1.0
    # Fewer uncached prompt tokens than this are not worth a prefill hop.
    prefill_min_uncached_tokens: int = 32
    # Place the prompt's computation by estimated time to first token (the module
    # docstring); False: the best-scoring prefill replica, always.
    estimate_placement: bool = True
    # What the hop adds to a prefill replica's estimate: the Prefill call and the KV pull.
    prefill_hop_s: float = 0.05
    # The decode replica computes the prompt itself only when that is estimated sooner by at
    # least this much (its running streams pay for it).
    self_prefill_min_gain_s: float = 1.0
    # Prefill replicas whose estimates differ by less than this are even: scores decide.
    # NOTE: 0.05 s, the hop's own cost: idle replicas' estimates are milliseconds apart, by
    # their measured rates' noise, and a tighter tie sent every prompt of a sequential
    # client to the one fastest-measured replica, never to a restarted one (a fresh make
    # test's test_supervisor_faults); within it the scores (prefix, load) spread the work.
    estimate_tie_s: float = 0.05

    def __post_init__(self) -> None:
        if not 0.0 <= self.kv_usage_floor < 1.0:
            raise ValueError(f"kv_usage_floor must be in [0, 1), got {self.kv_usage_floor}")
        for name in ("prefill_hop_s", "self_prefill_min_gain_s", "estimate_tie_s"):
            if not getattr(self, name) >= 0.0:  # NaN too
                raise ValueError(f"{name} must be 0 or more, got {getattr(self, name)}")


@dataclass(frozen=True)
class ScoredReplica:
    address: str
    role: str
    score: float
    matched_blocks: int
    prefix_fraction: float
    queue_depth: int
    kv_cache_usage: float
    scores: dict[str, float]
    # Estimated seconds to the prompt's first token if computed here (the module
    # docstring); None where not estimated.
    ttft_estimate_s: float | None = None


@dataclass(frozen=True)
class RoutingDecision:
    decode: ScoredReplica
    # Set when the decode replica should pull the prompt's KV from this prefill replica.
    prefill: ScoredReplica | None
    # Why ``decode`` won: "prefix" (it caches more of the prompt than some other candidate),
    # "load" (caches are level; load decided) or "only_candidate".
    reason: str
    # "prefill_hop", "cached_on_decode", "short_prompt", "self_prefill_sooner" (estimated
    # sooner on the decode replica than on any prefill replica), "no_prefill_replica" or
    # "no_decode_replica" (``decode`` is a prefill replica running the request whole).
    pd_reason: str
    # Decode candidates, best first.
    candidates: tuple[ScoredReplica, ...]
    # Replicas left out, and why ("unhealthy", "excluded", "load_stale").
    filtered: dict[str, str]
    # The role with no usable replica whose work another role does here: "decode" (a prefill
    # replica runs the request whole), "prefill" (prefill replicas exist, none is usable: the
    # decode replica computes the prompt), or "" (none missing).
    missing_role: str = ""

    @property
    def reasons(self) -> list[str]:
        return [self.reason, self.pd_reason]


def score_replica(
    replica: ReplicaState, num_prompt_tokens: int, block_size: int, config: PickerConfig
) -> ScoredReplica:
    cached_tokens = min(replica.matched_blocks * block_size, num_prompt_tokens)
    prefix_fraction = cached_tokens / num_prompt_tokens if num_prompt_tokens > 0 else 0.0
    queue_depth = replica.load.queue_depth
    kv_usage = min(max(replica.load.kv_cache_usage, 0.0), 1.0)
    scores = {
        "prefix": prefix_fraction,
        "kv_usage": min(1.0, (1.0 - kv_usage) / (1.0 - config.kv_usage_floor)),
        "queue": 1.0 / (1.0 + queue_depth / config.queue_scale),
    }
    total = (
        config.prefix_weight * scores["prefix"]
        + config.kv_usage_weight * scores["kv_usage"]
        + config.queue_weight * scores["queue"]
    )
    return ScoredReplica(
        replica.address, replica.role, total, replica.matched_blocks, prefix_fraction,
        queue_depth, kv_usage, scores)


def _filter(
    replicas: Sequence[ReplicaState],
    roles: Collection[str],
    exclude: Collection[str],
    config: PickerConfig,
    filtered: dict[str, str],
    lora_name: str,
) -> list[ReplicaState]:
    usable: list[ReplicaState] = []
    stale: list[ReplicaState] = []
    for replica in replicas:
        if replica.role not in roles:
            continue
        if not replica.healthy:
            filtered[replica.address] = "unhealthy"
        elif replica.address in exclude:
            filtered[replica.address] = "excluded"
        elif lora_name and lora_name not in replica.lora_adapters:
            filtered[replica.address] = f"no LoRA adapter {lora_name!r}"
        elif replica.load.age_s is not None and replica.load.age_s > config.max_load_age_s:
            stale.append(replica)
        else:
            usable.append(replica)
    if not usable:
        # Stale reports everywhere says more about the reporting than about the replicas.
        return stale
    for replica in stale:
        filtered[replica.address] = "load_stale"
    return usable


def _best(scored: list[ScoredReplica], tie_break: int) -> ScoredReplica:
    scored.sort(key=lambda s: (-s.score, s.address))
    top = scored[0].score
    tied = [s for s in scored if top - s.score <= 1e-9]
    return tied[tie_break % len(tied)]


def pick(
    replicas: Sequence[ReplicaState],
    num_prompt_tokens: int,
    block_size: int,
    config: PickerConfig | None = None,
    *,
    exclude: Collection[str] = (),
    tie_break: int = 0,
    lora_name: str = "",
) -> RoutingDecision:
    """Choose the decode replica, and a prefill replica when the hop is worth it.

    ``exclude``: addresses that already failed this request. ``lora_name``: the request's
    LoRA adapter; only replicas serving it are candidates, for decode and for prefill. ``tie_break``: which of equally
    scored candidates to take (a caller passing a counter spreads ties round-robin).
    Raises ``NoReplicaError`` when no replica of any role is usable.
    """
    config = config or PickerConfig()
    filtered: dict[str, str] = {}
    decode_pool = _filter(replicas, DECODE_ROLES, exclude, config, filtered, lora_name)
    prefill_pool = _filter(replicas, PREFILL_ROLES, exclude, config, filtered, lora_name)
    if not decode_pool and prefill_pool:
        # NOTE: a prefill replica holds the same model; running the request whole there
        # beats refusing it while the decode replicas are gone.
        decode, candidates, reason = _best_of(prefill_pool, num_prompt_tokens, block_size,
                                              config, tie_break)
        return RoutingDecision(decode, None, reason, "no_decode_replica", candidates,
                               filtered, missing_role="decode")
    if not decode_pool:
        known = ", ".join(f"{a}: {why}" for a, why in sorted(filtered.items())) or "none known"
        raise NoReplicaError(f"no decode-capable replica is available, nor a prefill replica to "
                             f"run the request whole ({known})")
    decode, candidates, reason = _best_of(decode_pool, num_prompt_tokens, block_size, config,
                                          tie_break)
    prefill: ScoredReplica | None = None
    missing_role = ""
    uncached_tokens = num_prompt_tokens - min(
        decode.matched_blocks * block_size, num_prompt_tokens)
    if not prefill_pool:
        pd_reason = "no_prefill_replica"
        if any(r.role in PREFILL_ROLES for r in replicas):
            missing_role = "prefill"
    elif decode.prefix_fraction >= config.prefill_skip_fraction:
        pd_reason = "cached_on_decode"
    elif uncached_tokens < config.prefill_min_uncached_tokens:
        pd_reason = "short_prompt"
    else:
        own = next(r for r in decode_pool if r.address == decode.address)
        decode, prefill = _place_prompt(decode, own, prefill_pool, replicas,
                                        num_prompt_tokens, block_size, config, tie_break)
        pd_reason = "prefill_hop" if prefill is not None else "self_prefill_sooner"
    return RoutingDecision(decode, prefill, reason, pd_reason, candidates, filtered,
                           missing_role)


def ttft_estimate(replica: ReplicaState, num_prompt_tokens: int, block_size: int,
                  fallback_rate: float) -> float | None:
    """Seconds until the prompt's first token if ``replica`` computes it (the module
    docstring); None when no rate is known, its own or ``fallback_rate``."""
    load = replica.load
    rate = (load.prefill_tokens_per_s or fallback_rate) * min(max(load.prefill_share, 0.0), 1.0)
    if rate <= 0.0:
        return None
    uncached = num_prompt_tokens - min(replica.matched_blocks * block_size, num_prompt_tokens)
    return (load.prefill_tokens_queued + uncached) / rate


def _place_prompt(
    decode: ScoredReplica, own: ReplicaState, prefill_pool: Sequence[ReplicaState],
    replicas: Sequence[ReplicaState], num_prompt_tokens: int, block_size: int,
    config: PickerConfig, tie_break: int,
) -> tuple[ScoredReplica, ScoredReplica | None]:
    """The decode side (with its own estimate when it computes the prompt) and the prefill
    replica that computes the prompt, or None for the decode replica itself."""
    scored = [score_replica(r, num_prompt_tokens, block_size, config) for r in prefill_pool]
    rates = [r.load.prefill_tokens_per_s for r in replicas if r.load.prefill_tokens_per_s > 0]
    fallback = statistics.median(rates) if rates else 0.0
    estimates = {r.address: ttft_estimate(r, num_prompt_tokens, block_size, fallback)
                 for r in prefill_pool}
    known = [e for e in estimates.values() if e is not None]
    if not config.estimate_placement or len(known) < len(estimates):
        return decode, _best(scored, tie_break)
    lowest = min(known)
    # NOTE: an idle replica (no prompt tokens queued) is even with the soonest, whatever its
    # rate says: a rate measured over a restarted replica's first, cold steps is far too low,
    # and, sent no prompt since, it was never measured again (a fresh make test's restarted
    # prefill replica got none of 300 sequential prompts). Estimates part replicas by queues.
    idle = {r.address for r in prefill_pool if r.load.prefill_tokens_queued == 0}
    even = [s for s in scored if s.address in idle
            or (estimates[s.address] or 0.0) - lowest <= config.estimate_tie_s]
    best = _best(even, tie_break)
    via_hop = (estimates[best.address] or 0.0) + config.prefill_hop_s
    # NOTE: only a prefill replica with prompts queued is passed over. An idle one's
    # estimate rests on its rate alone, and a rate measured over its first, cold steps (new
    # kernels' first calls, a model's first prompt) can be 100x low for minutes; an idle
    # prefill replica finishes a prompt soonest whatever its rate says (Dynamo's
    # conditional disaggregation likewise prefills locally only past a prefill queue size).
    queued = next(r.load.prefill_tokens_queued for r in prefill_pool if r.address == best.address)
    itself = ttft_estimate(own, num_prompt_tokens, block_size, fallback) if queued > 0 else None
    if itself is not None and itself + config.self_prefill_min_gain_s <= via_hop:
        return replace(decode, ttft_estimate_s=itself), None
    return decode, replace(best, ttft_estimate_s=via_hop)


def _best_of(
    pool: Sequence[ReplicaState], num_prompt_tokens: int, block_size: int,
    config: PickerConfig, tie_break: int,
) -> tuple[ScoredReplica, tuple[ScoredReplica, ...], str]:
    """The best of ``pool``, every candidate scored, and why it won."""
    candidates = [score_replica(r, num_prompt_tokens, block_size, config) for r in pool]
    best = _best(candidates, tie_break)
    if len(candidates) == 1:
        reason = "only_candidate"
    elif best.prefix_fraction > min(c.prefix_fraction for c in candidates):
        reason = "prefix"
    else:
        reason = "load"
    return best, tuple(candidates), reason
