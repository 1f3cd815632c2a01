"""The live view of the replicas that the gateway and the endpoint picker share.

Owns wiring the three sources together (the registry tells the load tracker and the prefix
index which replicas exist), starting them and stopping them in order, and the one
cluster-wide fact both servers derive from them: the shortest context any replica serves.
It does not own what each source tracks (``registry``, ``load``, ``prefix_index``) or how a
prompt is scored (``snapshot``, ``picker``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gateway.load import LoadTracker
from gateway.prefix_index import PrefixIndex
from gateway.registry import DnsTarget, ReplicaRegistry
from services.suite_tls import SuiteTls


@dataclass
class ClusterView:
    registry: ReplicaRegistry
    loads: LoadTracker
    index: PrefixIndex

    @classmethod
    def create(cls, replicas: Sequence[str], dns: Sequence[DnsTarget], *,
               dns_interval_s: float, load_interval_s: float,
               tls: SuiteTls | None = None,
               tier_weights: Mapping[str, float] | None = None) -> ClusterView:
        registry = ReplicaRegistry(replicas, dns, dns_interval_s=dns_interval_s, tls=tls)
        view = cls(registry, LoadTracker(interval_s=load_interval_s),
                   PrefixIndex(tier_weights=tier_weights))
        registry.add_listener(view.loads)
        registry.add_listener(view.index)
        return view

    async def start(self) -> None:
        await self.registry.start()

    async def stop(self) -> None:
        await self.loads.stop()
        await self.index.stop()
        await self.registry.stop()

    def max_model_len(self) -> int | None:
        """The shortest context among the replicas that reported one: requests are
        validated against it, as the replicas would."""
        lengths = [r.max_model_len for r in self.registry.replicas() if r.max_model_len > 0]
        return min(lengths) if lengths else None
