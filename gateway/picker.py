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

Roles are a preference, not a wall: with no usable decode-capable replica, the best prefill
replica is the decode side and runs the request whole (``missing_role="decode"``,
``pd_reason="no_decode_replica"``); with prefill replicas known but none usable, the decode
replica computes the prompt itself (``missing_role="prefill"``). Either ends as soon as a
replica of the missing role is usable again: nothing here remembers it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

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

    def __post_init__(self) -> None:
        if not 0.0 <= self.kv_usage_floor < 1.0:
            raise ValueError(f"kv_usage_floor must be in [0, 1), got {self.kv_usage_floor}")


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


@dataclass(frozen=True)
class RoutingDecision:
    decode: ScoredReplica
    # Set when the decode replica should pull the prompt's KV from this prefill replica.
    prefill: ScoredReplica | None
    # Why ``decode`` won: "prefix" (it caches more of the prompt than some other candidate),
    # "load" (caches are level; load decided) or "only_candidate".
    reason: str
    # "prefill_hop", "cached_on_decode", "short_prompt", "no_prefill_replica" or
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
        prefill = _best(
            [score_replica(r, num_prompt_tokens, block_size, config) for r in prefill_pool],
            tie_break)
        pd_reason = "prefill_hop"
    return RoutingDecision(decode, prefill, reason, pd_reason, candidates, filtered,
                           missing_role)


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
