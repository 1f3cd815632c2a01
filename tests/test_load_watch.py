"""Load reports as they change (``Engine.WatchLoad``): the replica's pacing
(``services.replica.load_watch``) and the gateway's watcher (``gateway.load.LoadTracker``)
against real gRPC servers, including a replica that predates WatchLoad (polled instead).

The replica side end to end (a real replica's reports, the gateway routing on them, a
restarted replica watched again) is in tests/test_gateway_cluster.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import grpc
import grpc.aio
import pytest

from gateway.load import LoadTracker
from gateway.registry import Replica
from protos.tandem.v1 import engine_pb2 as epb
from protos.tandem.v1 import engine_pb2_grpc as epb_grpc
from services.frontend.errors import InvalidArgument
from services.replica.load_watch import LoadPacing, paced_reports


def test_pacing_defaults_and_refusals() -> None:
    assert LoadPacing.of(epb.WatchLoadRequest()) == LoadPacing(0.05, 0.5)
    assert LoadPacing.of(epb.WatchLoadRequest(min_interval_s=2.0)) == LoadPacing(2.0, 2.0)
    for bad in (epb.WatchLoadRequest(min_interval_s=-1), epb.WatchLoadRequest(heartbeat_s=61),
                epb.WatchLoadRequest(min_interval_s=float("nan")),
                epb.WatchLoadRequest(min_interval_s=1.0, heartbeat_s=0.5)):
        with pytest.raises(InvalidArgument):
            LoadPacing.of(bad)


async def _take(reports: AsyncIterator[epb.LoadReport], n: int) -> list[tuple[float, int]]:
    """(arrival time, running requests) of the next ``n`` reports."""
    taken = []
    for _ in range(n):
        report = await anext(reports)
        taken.append((time.monotonic(), report.num_requests_running))
    return taken


def test_a_change_is_sent_at_once_and_silence_only_as_heartbeats() -> None:
    asyncio.run(_change_and_heartbeats())


async def _change_and_heartbeats() -> None:
    running = [0]

    def take_report() -> epb.LoadReport:
        return epb.LoadReport(num_requests_running=running[0], timestamp=time.time())

    reports = paced_reports(take_report, LoadPacing(min_interval_s=0.01, heartbeat_s=0.2))
    started = time.monotonic()
    quiet = await _take(reports, 3)  # the first at once, then heartbeats only
    assert quiet[0][0] - started < 0.5
    gaps = [b[0] - a[0] for a, b in zip(quiet, quiet[1:], strict=False)]
    # Nothing changed: nothing sooner than a heartbeat (the upper bound is slack for a
    # loaded machine).
    assert all(0.19 <= gap < 1.0 for gap in gaps), gaps
    running[0] = 3
    changed_at = time.monotonic()
    (arrived, value), = await _take(reports, 1)
    assert value == 3 and arrived - changed_at < 0.19  # sooner than a heartbeat
    await reports.aclose()


class _Engine(epb_grpc.EngineServicer):
    """A real Engine server's load side: GetLoad always, WatchLoad only when ``watch``; any
    other RPC is UNIMPLEMENTED, as on a replica that predates it."""

    def __init__(self, watch: bool) -> None:
        self.running = 0
        self.calls = {"GetLoad": 0, "WatchLoad": 0}
        self.watch = watch

    def _report(self) -> epb.LoadReport:
        return epb.LoadReport(num_requests_running=self.running, lora_adapters=["a"])

    async def GetLoad(self, request: epb.GetLoadRequest,  # noqa: N802
                      context: grpc.aio.ServicerContext) -> epb.LoadReport:
        self.calls["GetLoad"] += 1
        return self._report()

    async def WatchLoad(self, request: epb.WatchLoadRequest,  # noqa: N802
                        context: grpc.aio.ServicerContext) -> None:
        self.calls["WatchLoad"] += 1
        if not self.watch:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        async for report in paced_reports(self._report, LoadPacing.of(request)):
            await context.write(report)


@asynccontextmanager
async def _tracked(engine: _Engine) -> AsyncIterator[tuple[LoadTracker, str]]:
    server = grpc.aio.server()
    epb_grpc.add_EngineServicer_to_server(engine, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    address = f"127.0.0.1:{port}"
    channel = grpc.aio.insecure_channel(address)
    tracker = LoadTracker(interval_s=0.02, heartbeat_s=0.1)
    replica = Replica(address, channel, epb_grpc.EngineStub(channel))
    tracker.replica_added(replica)
    try:
        yield tracker, address
        assert replica.lora_adapters == frozenset({"a"})
    finally:
        await tracker.stop()
        await channel.close()
        await server.stop(None)


async def _until(condition: Callable[[], bool], within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, "not within the time"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("watch", [True, False], ids=["watched", "polled-older-replica"])
def test_the_gateway_follows_a_replicas_load(watch: bool) -> None:
    asyncio.run(_follow(watch))


async def _follow(watch: bool) -> None:
    engine = _Engine(watch)
    async with _tracked(engine) as (tracker, address):
        await _until(lambda: tracker.view(address).age_s is not None)
        engine.running = 5
        await _until(lambda: tracker.view(address).num_running == 5)
        await asyncio.sleep(0.3)
        assert tracker.view(address).age_s is not None
        assert tracker.view(address).age_s < 0.25  # heartbeats (or polls) keep it fresh
    if watch:
        assert engine.calls == {"GetLoad": 0, "WatchLoad": 1}
    else:  # refused once, then polled for good
        assert engine.calls["WatchLoad"] == 1 and engine.calls["GetLoad"] > 5


class _BusyEngine(_Engine):
    """Reports as fast as it can write them: every read of the watcher completes at once."""

    async def WatchLoad(self, request: epb.WatchLoadRequest,  # noqa: N802
                        context: grpc.aio.ServicerContext) -> None:
        while True:
            self.running += 1
            await context.write(self._report())


def test_the_watcher_stops_while_reports_pour_in() -> None:
    """A gateway once hung on SIGTERM for 30 s: Python 3.11's ``asyncio.wait_for`` around the
    watcher's read returned the report when the stop's cancellation arrived just as the read
    completed, and the watch loop went on."""
    asyncio.run(_stop_under_reports())


async def _stop_under_reports() -> None:
    engine = _BusyEngine(watch=True)
    for _ in range(20):
        async with _tracked(engine) as (tracker, address):
            await _until(lambda: (tracker.view(address).num_running or 0) > 10)
            await asyncio.wait_for(asyncio.shield(tracker.stop()), 5.0)
