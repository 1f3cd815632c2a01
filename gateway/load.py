"""How busy each replica is: its own load reports, plus what this gateway has sent it.

Owns watching every registered replica's load (``Engine.WatchLoad``: the replica sends a
report when it changes, at most every ``interval_s``, 50 ms by default, and at least every
``heartbeat_s``; a replica that predates WatchLoad is polled with ``GetLoad`` every
``interval_s`` instead) and the gateway's own count of open streams per replica, incremented
at pick time. The reports lag (a request the gateway just
sent shows up in the replica's queue only after its next engine step), so a burst of picks
between two reports would all land on the replica that looked idlest; counting our own
in-flight streams closes that gap. The reports also carry the LoRA adapters a replica serves
now (they may change at run time), which it writes onto the registry's ``Replica``. It does
not own health (``registry``) or scoring (``picker``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import cast

import grpc.aio

from gateway.registry import Replica
from protos.tandem.v1 import engine_pb2

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadView:
    """One replica's load as the picker sees it."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    # Streams this gateway has open to the replica (picked, not yet finished).
    in_flight: int = 0
    # Seconds since the last report arrived; None before the first.
    age_s: float | None = None
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Prompt tokens still to compute there: its report's, or the prompts this gateway sent it
    # that have not had their first token yet, whichever is more (as ``queue_depth``).
    prefill_tokens_queued: int = 0
    # Its measured prompt rate (tokens/s; 0 unknown) and the share of step time a new prompt
    # gets beside its running decodes (``engine_common.prefill_outlook``).
    prefill_tokens_per_s: float = 0.0
    prefill_share: float = 1.0

    @property
    def queue_depth(self) -> int:
        """Requests on the replica: its report, or our own count when that is higher (our
        latest picks are not in its report yet). Not the sum: the report already holds most
        of ours, and adding would count them twice."""
        return max(self.num_running + self.num_waiting, self.in_flight)


@dataclass
class _ReplicaLoad:
    report: engine_pb2.LoadReport | None = None
    received_at: float = 0.0
    in_flight: int = 0
    # Prompt tokens sent here to compute that have not had their first token yet.
    pending_prefill_tokens: int = 0
    task: asyncio.Task[None] | None = None


class LoadTracker:
    """A ``ReplicaListener``: starts a watcher per replica the registry adds."""

    def __init__(self, interval_s: float = 0.05, rpc_timeout_s: float = 0.5,
                 heartbeat_s: float = 0.5) -> None:
        self.interval_s = interval_s
        self.rpc_timeout_s = rpc_timeout_s
        # Well under PickerConfig.max_load_age_s: an idle replica's report stays trusted.
        self.heartbeat_s = max(heartbeat_s, interval_s)
        self._loads: dict[str, _ReplicaLoad] = {}

    # ----------------------------------------------------------------- listener
    def replica_added(self, replica: Replica) -> None:
        load = self._loads.setdefault(replica.address, _ReplicaLoad())
        load.task = asyncio.get_running_loop().create_task(
            self._watch(replica, load), name=f"load-{replica.address}")

    def replica_removed(self, replica: Replica) -> None:
        load = self._loads.pop(replica.address, None)
        if load is not None and load.task is not None:
            load.task.cancel()

    async def stop(self) -> None:
        tasks = [load.task for load in self._loads.values() if load.task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # ----------------------------------------------------------------- in flight
    def stream_started(self, address: str) -> None:
        load = self._loads.get(address)
        if load is not None:
            load.in_flight += 1

    def stream_finished(self, address: str) -> None:
        load = self._loads.get(address)
        if load is not None and load.in_flight > 0:
            load.in_flight -= 1

    def prefill_sent(self, address: str, tokens: int) -> None:
        """``tokens`` prompt tokens were sent to ``address`` to compute (the report shows them
        only after its next step); ``prefill_done`` with the same count at the first token."""
        load = self._loads.get(address)
        if load is not None:
            load.pending_prefill_tokens += tokens

    def prefill_done(self, address: str, tokens: int) -> None:
        load = self._loads.get(address)
        if load is not None:
            load.pending_prefill_tokens = max(0, load.pending_prefill_tokens - tokens)

    # ----------------------------------------------------------------- views
    def view(self, address: str, now: float | None = None) -> LoadView:
        load = self._loads.get(address)
        if load is None:
            return LoadView()
        report = load.report
        if report is None:
            return LoadView(in_flight=load.in_flight,
                            prefill_tokens_queued=load.pending_prefill_tokens)
        now = time.monotonic() if now is None else now
        return LoadView(
            num_running=report.num_requests_running,
            num_waiting=report.num_requests_waiting,
            kv_cache_usage=report.kv_cache_usage_perc,
            in_flight=load.in_flight,
            age_s=max(0.0, now - load.received_at),
            prefix_cache_queries=report.prefix_cache_queries,
            prefix_cache_hits=report.prefix_cache_hits,
            prefill_tokens_queued=max(report.num_prefill_tokens_queued,
                                      load.pending_prefill_tokens),
            prefill_tokens_per_s=report.prefill_tokens_per_s,
            prefill_share=report.prefill_share or 1.0,
        )

    def report(self, address: str) -> engine_pb2.LoadReport | None:
        load = self._loads.get(address)
        return None if load is None else load.report

    # ----------------------------------------------------------------- watching
    def _received(self, replica: Replica, load: _ReplicaLoad,
                  report: engine_pb2.LoadReport) -> None:
        load.report = report
        load.received_at = time.monotonic()
        # Adapters come and go at run time (and with a restart): routing follows.
        replica.lora_adapters = frozenset(report.lora_adapters)

    async def _watch(self, replica: Replica, load: _ReplicaLoad) -> None:
        request = engine_pb2.WatchLoadRequest(min_interval_s=self.interval_s,
                                              heartbeat_s=self.heartbeat_s)
        # A stream that stays silent past a few heartbeats is stuck (a partition that drops
        # packets leaves the connection open): it is cancelled and opened again.
        silent_limit = 3 * self.heartbeat_s + self.rpc_timeout_s
        while True:
            call = replica.engine.WatchLoad(request)
            try:
                while True:
                    # NOTE: asyncio.timeout, not wait_for: Python 3.11's wait_for returns the
                    # read's result when a cancellation arrives just as the read completes,
                    # and this loop then never ends (a gateway hung on SIGTERM for 30 s).
                    async with asyncio.timeout(silent_limit):
                        report = await call.read()
                    if report is grpc.aio.EOF:
                        break
                    self._received(replica, load, cast(engine_pb2.LoadReport, report))
            except TimeoutError:
                logger.debug("WatchLoad on %s went silent; reconnecting", replica.address)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    await self._poll(replica, load)  # an older replica: for good
                # The report ages; the picker stops trusting it once it is too old.
                logger.debug("WatchLoad on %s failed: %s", replica.address, e.code())
            finally:
                call.cancel()
            await asyncio.sleep(max(self.interval_s, 0.2))

    async def _poll(self, replica: Replica, load: _ReplicaLoad) -> None:
        request = engine_pb2.GetLoadRequest()
        while True:
            started = time.monotonic()
            try:
                self._received(replica, load, await replica.engine.GetLoad(
                    request, timeout=self.rpc_timeout_s))
                pause = self.interval_s - (load.received_at - started)
            except grpc.aio.AioRpcError as e:
                logger.debug("GetLoad on %s failed: %s", replica.address, e.code())
                pause = max(self.interval_s, 0.2)
            await asyncio.sleep(max(pause, 0.0))
