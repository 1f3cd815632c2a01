"""The gateway's Prometheus metrics, in a registry of its own (never the process-global one).

Owns the collectors and their names (``tandem:gateway_*``): routing decisions by reason,
picks per replica, the prefix-match fraction of picks, retries, resumptions, role
fallbacks, request latency,
time to first token and the routing work itself. It does not own serving them over HTTP
(``server``).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine_common.metrics import register_process_collectors
from gateway.registry import Replica

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
)
_ROUTING_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)
_FRACTION_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        register_process_collectors(self.registry)  # process_*, python_*, as a replica has
        reg = self.registry
        self.routing_decisions = Counter(
            "tandem:gateway_routing_decisions",
            "Routing decisions by why the decode replica won and what the P/D decider chose.",
            ["reason", "pd"], registry=reg)
        self.picks = Counter(
            "tandem:gateway_picks", "Replicas picked, by address and the part they play.",
            ["replica", "as_role"], registry=reg)
        self.prefix_match_fraction = Histogram(
            "tandem:gateway_pick_prefix_match_fraction",
            "Fraction of the prompt cached on the picked decode replica.",
            buckets=_FRACTION_BUCKETS, registry=reg)
        self.retries = Counter(
            "tandem:gateway_retries",
            "Requests sent to another replica after one failed before the first token.",
            ["code"], registry=reg)
        self.resumptions = Counter(
            "tandem:gateway_resumptions",
            "Streams broken after the first token, by how their resumption ended, counted "
            "once it is known: resumed (another replica answered), no_replica, gave_up, "
            "refused or failed.",
            ["outcome"], registry=reg)
        self.requests = Counter(
            "tandem:gateway_requests", "Finished requests by method and gRPC status code.",
            ["method", "code"], registry=reg)
        self.request_latency = Histogram(
            "tandem:gateway_request_latency_seconds", "Arrival to last response, per method.",
            ["method"], buckets=_LATENCY_BUCKETS, registry=reg)
        self.time_to_first_token = Histogram(
            "tandem:gateway_time_to_first_token_seconds", "Arrival to first output token.",
            buckets=_LATENCY_BUCKETS, registry=reg)
        self.routing_latency = Histogram(
            "tandem:gateway_routing_latency_seconds",
            "The gateway's own work per attempt before forwarding: snapshot, hashing, picking.",
            buckets=_ROUTING_BUCKETS, registry=reg)
        self.replicas = Gauge(
            "tandem:gateway_replicas", "Known replicas by role and health.",
            ["role", "healthy"], registry=reg)
        self._replica_series: set[tuple[str, str]] = set()  # (role, healthy) ever set
        self.prefill_outcomes = Counter(
            "tandem:gateway_prefill_outcomes",
            "P/D picks by how the decode replica got the prompt's KV (remote, or the fallback "
            "reason); the picker reads it from the decode replica's response headers.",
            ["outcome"], registry=reg)
        self.role_fallbacks = Counter(
            "tandem:gateway_role_fallbacks",
            "Requests (and resumptions) routed with no usable replica of a role: "
            "missing_role=decode, a prefill replica ran them whole; missing_role=prefill, the "
            "decode replica computed the prompt though prefill replicas are configured.",
            ["missing_role"], registry=reg)
        self.no_replica = Counter(
            "tandem:gateway_no_replica", "Requests refused because no replica was usable.",
            registry=reg)

    def set_replicas(self, replicas: Iterable[Replica]) -> None:
        """The known replicas, by role and health, as the registry sees them now.

        NOTE: each series is set to its new count (0 for one that emptied), never cleared and
        counted up again: a scrape runs on the metrics server's thread, and one that fell
        between a clear and the counting saw replicas missing (a test waiting for one fewer
        healthy replica waited forever after reading such a transient count)."""
        counts = collections.Counter((replica.role or "unknown", str(replica.healthy).lower())
                                     for replica in replicas)
        for labels in self._replica_series - counts.keys():
            self.replicas.labels(*labels).set(0)
        for labels, count in counts.items():
            self.replicas.labels(*labels).set(count)
        self._replica_series |= counts.keys()
