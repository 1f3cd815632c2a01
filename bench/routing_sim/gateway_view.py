"""The gateway in the simulation: its real prefix index, load tracker and picker, on sim time.

Owns one gateway's routing state and the routing policies compared. The objects are the
gateway's own: ``gateway.prefix_index.PrefixIndex`` applies the replicas' protobuf KV-event
batches through ``apply`` (what its ``WatchKvEvents`` watcher calls), ``gateway.load.
LoadTracker`` holds their ``LoadReport``s and the gateway's in-flight counts, and
``gateway.picker.pick`` chooses. ``route`` does what ``EngineProxy.route`` does (snapshot,
pick with a rotating tie-break, ``expect`` the prompt's blocks on the chosen replica), with
the simulation's clock passed as ``now`` wherever the gateway would read ``time.monotonic``.

Two seams are fed by hand, because the gateway fills them from gRPC streams this simulation
does not run: each replica's watcher state starts from the replica's answer to a first
``WatchKvEvents`` (a one-piece snapshot of its cache at seq 0, a message the protocol
allows), and a load report is stored the way ``LoadTracker._poll`` stores the answer to
``GetLoad`` (its ``report`` and ``received_at``). It does not own replicas (``replica``) or
when reports and events arrive (``driver``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace

from engine_common.block_hash import BlockHash
from gateway.load import LoadTracker, _ReplicaLoad
from gateway.picker import PickerConfig, ReplicaState, RoutingDecision, pick
from gateway.prefix_index import PrefixIndex
from gateway.snapshot import prompt_block_hashes
from protos.tandem.v1 import engine_pb2

# Each policy is a PickerConfig, run through the same pick(): round-robin is what the
# gateway's --policy round_robin does (every weight zero, ties rotate); least-load is the
# queue scorer alone (the fewest requests running, waiting or in flight from the gateway);
# prefix-only the prefix scorer alone (ties rotate); Tandem's scorer the default config, and
# the same scorer with every bit of KV usage counted (kv_usage_floor 0, as it was before the
# simulation found the floor worth having: docs/routing-simulation.md).
POLICIES: dict[str, PickerConfig] = {
    "round_robin": replace(PickerConfig(), prefix_weight=0.0, kv_usage_weight=0.0,
                           queue_weight=0.0),
    "least_load": replace(PickerConfig(), prefix_weight=0.0, kv_usage_weight=0.0),
    "prefix_only": replace(PickerConfig(), kv_usage_weight=0.0, queue_weight=0.0),
    "tandem": PickerConfig(),
    "tandem_no_kv_floor": replace(PickerConfig(), kv_usage_floor=0.0),
}


class KvEventGapError(RuntimeError):
    """The index refused a batch: the simulation delivered events out of order (a bug)."""


class GatewayView:
    def __init__(self, config: PickerConfig, block_size: int,
                 index: PrefixIndex | None = None) -> None:
        self.config = config
        self.block_size = block_size
        self.index = index or PrefixIndex()
        self.loads = LoadTracker()
        self.addresses: list[str] = []
        self._tie_breaks = itertools.count()
        self.kv_batches_applied = 0
        self.reasons: dict[str, int] = {}

    def register(self, address: str, first_answer: engine_pb2.KvEventBatch) -> None:
        """A replica joins: its load entry, and its watcher's state from its first answer."""
        self.addresses.append(address)
        self.loads._loads.setdefault(address, _ReplicaLoad())
        self.kv_events(address, first_answer)

    # ----------------------------------------------------------------- inputs
    def kv_events(self, address: str, batch: engine_pb2.KvEventBatch) -> None:
        if not self.index.apply(address, batch):
            raise KvEventGapError(f"{address}: batch seq {batch.seq} does not follow "
                                  f"seq {self.index.last_seq(address)}")
        self.kv_batches_applied += 1

    def load_report(self, address: str, report: engine_pb2.LoadReport, now: float) -> None:
        """A ``GetLoad`` answer arrived (as ``LoadTracker._poll`` stores one)."""
        load = self.loads._loads[address]
        load.report = report
        load.received_at = now

    # ----------------------------------------------------------------- routing
    def route(self, prompt_token_ids: Sequence[int], now: float) -> RoutingDecision:
        """``EngineProxy.route`` on the simulation's clock: snapshot, pick, expect."""
        hashes = prompt_block_hashes(prompt_token_ids, self.block_size)
        decision = pick(self.snapshot(hashes, now), len(prompt_token_ids), self.block_size,
                        self.config, tie_break=next(self._tie_breaks))
        self.index.expect(decision.decode.address, hashes, now=now)
        self.reasons[decision.reason] = self.reasons.get(decision.reason, 0) + 1
        return decision

    def snapshot(self, hashes: list[BlockHash], now: float) -> list[ReplicaState]:
        """``take_snapshot``'s replica states (one block size, every replica healthy)."""
        matched = self.index.match(hashes, now=now)
        return [ReplicaState(address=a, role="both", healthy=True,
                             load=self.loads.view(a, now), matched_blocks=matched.get(a, 0))
                for a in self.addresses]
