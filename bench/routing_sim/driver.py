"""One simulated run: a workload through one gateway policy onto a cluster of replicas.

Owns wiring the parts together in simulated time and what travels between them, with its
delays: a request from the gateway to its replica (``request_delay_s``, the frontend and
gRPC hops), outputs back to the client (``output_delay_s``), each step's KV-event batch to
the gateway's index (``kv_event_delay_s``), and ``GetLoad`` polled every
``load_interval_s`` per replica (the gateway's default, 50 ms) at a random phase, its answer
arriving ``load_rpc_s`` later. A finished turn starts its session's next turn after the
think time.

Polls are not events: a report changes only when a step ends, and only the latest one
matters to a pick, so just before each pick the driver hands the load tracker, for each
replica, the answer to that replica's latest poll whose answer has arrived (what the
replica's statistics were at that poll's time), received when it would have been. The
tracker then holds what 50 ms polling would have left in it, at a cost per pick instead
of twenty events per replica per simulated second. The gateway's in-flight counts follow the streams: up at the pick, down when
the last output reaches the client. It does not own the metrics (``metrics``).
"""

from __future__ import annotations

import functools
import math
import random
import time
from dataclasses import dataclass

from bench.routing_sim.cost_model import StepCostModel
from bench.routing_sim.cpu_share import CpuShare
from bench.routing_sim.events import EventLoop
from bench.routing_sim.gateway_view import GatewayView
from bench.routing_sim.replica import ReplicaSpec, SimRequest, SimulatedReplica
from bench.routing_sim.workloads import Session, Workload
from engine_common.outputs import EngineCoreOutput
from gateway.picker import PickerConfig
from protos.tandem.v1 import engine_pb2


@dataclass(frozen=True)
class ClusterSpec:
    replicas: int
    replica: ReplicaSpec
    # Cores all replicas share (processor sharing); None: each has a core of its own.
    cores: float | None = None
    request_delay_s: float = 0.005
    output_delay_s: float = 0.002
    kv_event_delay_s: float = 0.002
    load_interval_s: float = 0.05
    load_rpc_s: float = 0.001


@dataclass
class RunRecord:
    """What one run leaves behind, for ``metrics``."""

    requests: list[SimRequest]
    replicas: list[SimulatedReplica]
    gateway: GatewayView
    spec: ClusterSpec
    sim_end_s: float = 0.0
    wall_s: float = 0.0
    events: int = 0


class ClusterRun:
    def __init__(self, workload: Workload, config: PickerConfig, cost: StepCostModel,
                 spec: ClusterSpec, seed: int = 0) -> None:
        self.workload = workload
        self.spec = spec
        self.loop = EventLoop()
        self.rng = random.Random(seed)
        cpu = CpuShare(self.loop, spec.cores) if spec.cores else None
        self.gateway = GatewayView(config, spec.replica.block_size)
        self.replicas: dict[str, SimulatedReplica] = {}
        for i in range(spec.replicas):
            address = f"replica-{i:02d}"
            replica = SimulatedReplica(address, spec.replica, cost, self.loop, self._on_output,
                                       self._on_kv_events, cpu)
            self.replicas[address] = replica
            self.gateway.register(address, replica.empty_snapshot())
        self.requests: list[SimRequest] = []
        self._session_of: dict[str, tuple[Session, int, list[int]]] = {}
        self._ids = 0
        # Each replica's poller starts at a random phase within the interval.
        self._poll_phase = {a: self.rng.uniform(0, spec.load_interval_s) for a in self.replicas}

    def run(self) -> RunRecord:
        started = time.perf_counter()
        for session in self.workload.sessions:
            self.loop.at(session.start_s, functools.partial(self._send, session, 0, []))
        self.loop.run()
        return RunRecord(self.requests, list(self.replicas.values()), self.gateway, self.spec,
                         self.loop.now, time.perf_counter() - started, self.loop.events_run)

    # ----------------------------------------------------------------- sessions
    def _send(self, session: Session, k: int, history: list[int]) -> None:
        turn = session.turns[k]
        prompt = history + turn.new_tokens
        self._ids += 1
        request = SimRequest(f"req-{self._ids}", prompt, turn.output_tokens, self.loop.now, k)
        self._deliver_polls()
        decision = self.gateway.route(prompt, self.loop.now)
        request.address = decision.decode.address
        self.gateway.loads.stream_started(request.address)
        self.requests.append(request)
        self._session_of[request.request_id] = (session, k, prompt)
        replica = self.replicas[request.address]
        self.loop.after(self.spec.request_delay_s, lambda: replica.add_request(request))

    def _on_output(self, request: SimRequest, output: EngineCoreOutput) -> None:
        if not output.finished:
            return
        session, k, prompt = self._session_of.pop(request.request_id)
        self.loop.after(self.spec.output_delay_s,
                        lambda: self.gateway.loads.stream_finished(request.address))
        if k + 1 < len(session.turns):
            history = prompt + request.output_token_ids
            delay = self.spec.output_delay_s + session.turns[k + 1].think_s
            self.loop.after(delay, lambda: self._send(session, k + 1, history))

    # ----------------------------------------------------------------- replica -> gateway
    def _on_kv_events(self, address: str, batch: engine_pb2.KvEventBatch) -> None:
        self.loop.after(self.spec.kv_event_delay_s,
                        lambda: self.gateway.kv_events(address, batch))

    def _deliver_polls(self) -> None:
        interval, rpc = self.spec.load_interval_s, self.spec.load_rpc_s
        for address, replica in self.replicas.items():
            phase = self._poll_phase[address]
            ticks = math.floor((self.loop.now - rpc - phase) / interval)
            if ticks < 0:
                continue  # no answer yet
            asked = phase + ticks * interval
            self.gateway.load_report(address, replica.load_report_at(asked), asked + rpc)
