"""One simulated replica: the engine's real scheduler and KV cache, with modelled step times.

Owns a replica's engine loop in simulated time. The parts that decide what a step does are
the engine's own: ``engine_common.scheduler.Scheduler`` (token budget, chunked prefill,
preemption, watermark) over a real ``KVCacheManager`` / ``BlockPool`` (prefix cache, LRU
eviction, the real chained block hashes), whose KV events go into a real ``KVEventBuffer``
(sequence numbers, incarnation) and out as the protobuf batches ``WatchKvEvents`` streams.
What is modelled: how long a step takes (``cost_model``, through ``CpuShare`` when replicas
share cores) and which token each sequence samples (the workload scripts it, so that a
conversation's next turn carries the very tokens this replica cached).

As in the engine core process, requests that arrive during a step join the scheduler before
the next one, and a load report (``GetLoad``) describes the replica as the last step left it.
It does not own routing (``gateway_view``) or what requests arrive when (``driver``).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from bench.routing_sim.cost_model import StepCostModel, StepShape
from bench.routing_sim.cpu_share import CpuShare
from bench.routing_sim.events import EventLoop
from engine_common.config import SchedulerConfig
from engine_common.kv_cache_manager import KVCacheManager
from engine_common.kv_events import KVEventBuffer
from engine_common.outputs import (
    EngineCoreOutput,
    ModelRunnerOutput,
    SchedulerStats,
    TokenLogprobs,
)
from engine_common.request import Request
from engine_common.sampling_params import SamplingParams
from engine_common.scheduler import Scheduler, SchedulerOutput
from protos.tandem.v1 import engine_pb2
from services.engine_api.messages import kv_event_batch_to_pb


def simulated_scheduler_config() -> SchedulerConfig:
    """The engine's default scheduler settings, less any that read the wall clock: a
    scheduler that sizes prompt chunks by timing its steps (the time between ``schedule``
    and ``update_from_output``) would time the simulator's bookkeeping, not the modelled
    step, and make runs differ from one another. Its token caps stay."""
    config = SchedulerConfig()
    if hasattr(config, "max_prefill_time_per_decode_step"):
        config = replace(config, max_prefill_time_per_decode_step=0.0)
    return config


@dataclass(frozen=True)
class ReplicaSpec:
    num_blocks: int  # KV-cache capacity, in blocks
    block_size: int = 16
    max_model_len: int = 8192
    scheduler: SchedulerConfig = field(default_factory=simulated_scheduler_config)
    kv_event_capacity: int = 4096  # batches the replica keeps for watchers


@dataclass
class SimRequest:
    """A request as the simulation tracks it across gateway and replica."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # what the replica will "sample", in order
    arrival_s: float  # at the gateway
    turn: int = 0  # within its session (multi-turn: 0 is the conversation's first)
    address: str = ""
    first_token_s: float | None = None  # when the replica produced it
    finished_s: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0


# (request, engine output) -> None; called at the end of the step that produced it.
OutputSink = Callable[[SimRequest, EngineCoreOutput], None]
# (address, batch) -> None; called with each step's KV events, as WatchKvEvents sends them.
KvEventSink = Callable[[str, engine_pb2.KvEventBatch], None]


class SimulatedReplica:
    def __init__(self, address: str, spec: ReplicaSpec, cost: StepCostModel, loop: EventLoop,
                 on_output: OutputSink, on_kv_events: KvEventSink,
                 cpu: CpuShare | None = None) -> None:
        self.address = address
        self.spec = spec
        self.cost = cost
        self.loop = loop
        self.cpu = cpu
        self.on_output = on_output
        self.on_kv_events = on_kv_events
        self.kv = KVCacheManager(spec.num_blocks, spec.block_size, spec.max_model_len,
                                 enable_caching=True, enable_kv_events=True)
        self.scheduler = Scheduler(spec.scheduler, self.kv)
        self.kv_events = KVEventBuffer(spec.kv_event_capacity)
        self._pending: list[Request] = []
        self._requests: dict[str, SimRequest] = {}
        self._stepping = False
        self.stats = SchedulerStats(num_total_blocks=spec.num_blocks,
                                    num_free_blocks=spec.num_blocks)
        # Cumulative counters, as AsyncLLM keeps them from each step's statistics.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_preemptions = 0
        self.busy_s = 0.0  # one-core seconds of steps run
        self.num_steps = 0
        # What GetLoad would have answered lately: (time, the report's fields), oldest first,
        # built into a protobuf only when a poll asks (most steps are never polled).
        self._history_times: list[float] = [0.0]
        self._history: list[_Report] = [self._report_fields()]

    # ----------------------------------------------------------------- requests
    def add_request(self, sim: SimRequest) -> None:
        params = SamplingParams(max_tokens=len(sim.output_token_ids), temperature=0.0,
                                ignore_eos=True)
        request = Request(sim.request_id, list(sim.prompt_token_ids), params,
                          arrival_time=self.loop.now, max_model_len=self.spec.max_model_len,
                          block_size=self.spec.block_size)
        self._requests[sim.request_id] = sim
        self._pending.append(request)
        if not self._stepping:
            self._start_step()

    # ----------------------------------------------------------------- the engine loop
    def _start_step(self) -> None:
        for request in self._pending:
            self.scheduler.add_request(request)
        self._pending = []
        out = self.scheduler.schedule()
        for output in self.scheduler.take_finished_unscheduled():
            self._emit(output)
        if out.is_empty:
            self._stepping = False
            self._publish()
            return
        self._stepping = True
        shape = step_shape(out)
        seconds = self.cost.step_time(shape)
        self.busy_s += seconds
        self.num_steps += 1
        if self.cpu is None:
            self.loop.after(seconds, lambda: self._end_step(out))
        else:
            self.cpu.run(seconds, lambda: self._end_step(out))

    def _end_step(self, out: SchedulerOutput) -> None:
        sampled: dict[str, tuple[int, TokenLogprobs | None]] = {}
        for item in out.scheduled:
            if item.completes_sequence:
                request = item.request
                script = self._requests[request.request_id].output_token_ids
                sampled[request.request_id] = (script[request.num_output_tokens], None)
        for output in self.scheduler.update_from_output(out, ModelRunnerOutput(sampled)):
            self._emit(output)
        self._publish()
        self._start_step()

    def _emit(self, output: EngineCoreOutput) -> None:
        sim = self._requests[output.request_id]
        if sim.first_token_s is None and output.new_token_ids:
            sim.first_token_s = self.loop.now
            sim.num_cached_tokens = output.num_cached_tokens
        sim.num_preemptions = output.num_preemptions
        if output.finished:
            sim.finished_s = self.loop.now
            del self._requests[output.request_id]
        self.on_output(sim, output)

    def _publish(self) -> None:
        """What the engine core hands its frontend after a step: statistics and KV events."""
        stats = self.scheduler.make_stats()
        self.stats = stats
        self.prefix_cache_queries += stats.prefix_cache_queries
        self.prefix_cache_hits += stats.prefix_cache_hits
        self.num_preemptions += stats.num_preemptions
        self._record_report()
        batch = self.kv_events.append(self.kv.take_events(), timestamp=self.loop.now)
        if batch is not None:
            message = kv_event_batch_to_pb(batch)
            message.incarnation = self.kv_events.incarnation
            self.on_kv_events(self.address, message)

    # ----------------------------------------------------------------- what it reports
    def empty_snapshot(self) -> engine_pb2.KvEventBatch:
        """The answer to a first ``WatchKvEvents``: its (empty) cache at seq 0, one piece."""
        return engine_pb2.KvEventBatch(
            seq=self.kv_events.last_seq, resync=True, incarnation=self.kv_events.incarnation,
            snapshot=engine_pb2.KvCacheSnapshot(
                block_hashes=self.kv.get_cached_block_hashes(), chunk_index=0, num_chunks=1))

    def load_report_at(self, when: float) -> engine_pb2.LoadReport:
        """What ``GetLoad`` answered at time ``when`` (not long ago): the statistics of the
        last step that had ended by then, with the counters as they stood."""
        i = max(bisect.bisect_right(self._history_times, when) - 1, 0)
        return self._history[i].message(self.address, self.spec.block_size)

    def _record_report(self) -> None:
        now = self.loop.now
        self._history_times.append(now)
        self._history.append(self._report_fields())
        # Polls ask about the last poll interval only: a second of history is plenty.
        old = bisect.bisect_left(self._history_times, now - 1.0) - 1
        if old > 16:
            del self._history_times[:old]
            del self._history[:old]

    def _report_fields(self) -> _Report:
        return _Report(self.stats, self.prefix_cache_queries, self.prefix_cache_hits,
                       self.num_preemptions, self.kv_events.last_seq)


@dataclass
class _Report:
    """A ``LoadReport``'s fields at one moment, and the message once built."""

    stats: SchedulerStats
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    kv_events_last_seq: int
    _message: engine_pb2.LoadReport | None = None

    def message(self, address: str, block_size: int) -> engine_pb2.LoadReport:
        """``GetLoad``'s answer (as the replica's Engine servicer builds it)."""
        if self._message is None:
            stats = self.stats
            self._message = engine_pb2.LoadReport(
                engine_id=address, role="both", model="simulated",
                num_requests_running=stats.num_running_reqs,
                num_requests_waiting=stats.num_waiting_reqs,
                kv_cache_usage_perc=stats.kv_cache_usage,
                num_free_blocks=stats.num_free_blocks, num_total_blocks=stats.num_total_blocks,
                prefix_cache_queries=self.prefix_cache_queries,
                prefix_cache_hits=self.prefix_cache_hits,
                num_preemptions=self.num_preemptions, block_size=block_size,
                kv_events_last_seq=self.kv_events_last_seq, timestamp=time.time())
        return self._message


def step_shape(out: SchedulerOutput) -> StepShape:
    """The step's shape, from the scheduler's output (a request's ``num_computed_tokens`` is
    still the context before this step)."""
    return StepShape.of([(item.request.num_computed_tokens, item.num_new_tokens,
                          item.completes_sequence) for item in out.scheduled])
