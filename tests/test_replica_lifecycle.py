"""A replica's behaviour at its limits and at its end, on real processes: a full waiting
queue answers RESOURCE_EXHAUSTED; SIGTERM drains an in-flight stream to completion while
refusing new work, then closes the watchers' streams with UNAVAILABLE; SIGKILL ends a client's stream with UNAVAILABLE promptly; a dead engine
core turns health NOT_SERVING and requests UNAVAILABLE, and so does a dead tensor-parallel
worker of a TP=2 replica (whose GetInfo and load reports say it has 2 ranks). The four
replicas start together.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.tandem.v1 import engine_pb2 as epb
from protos.tandem.v1 import engine_pb2_grpc as epb_grpc
from tandem.client import Client
from tandem.errors import OverloadedError, UnavailableError
from tests.replica_process import ReplicaProcess, start_replicas

COMMON = ["--dtype", "float32", "--kv-cache-memory", "16MiB"]
LONG = dict(max_tokens=480, temperature=0, ignore_eos=True)
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def replicas(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    started = start_replicas(tiny_llama_dir, tmp_path_factory.mktemp("lifecycle-logs"), {
        # A grace period no loaded test machine runs out of: the drain test checks that the
        # stream completes, not how fast.
        "small-queue": [*COMMON, "--max-num-seqs", "1", "--max-waiting", "1",
                        "--shutdown-grace", "300"],
        "to-kill": COMMON,
        "core-dies": COMMON,
        "tp-worker-dies": [*COMMON, "--tensor-parallel-size", "2"],
    })
    yield started
    for replica in started.values():
        replica.kill()


def _poll(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_full_queue_answers_resource_exhausted(replicas: dict[str, ReplicaProcess]):
    replica = replicas["small-queue"]
    with Client(replica.target, timeout=60) as client, \
            grpc.insecure_channel(replica.target) as channel:
        engine = epb_grpc.EngineStub(channel)
        running = client.complete_stream("first", **LONG)
        next(running)
        waiting = client.complete_stream("second", **LONG)  # queued behind the first
        _poll(lambda: engine.GetLoad(epb.GetLoadRequest()).num_requests_waiting == 1, 20,
              "the second request to wait")
        with pytest.raises(OverloadedError, match="queue is full"):
            client.complete("third", max_tokens=2)
        running.cancel()
        waiting.cancel()

        def admitted() -> bool:
            try:
                return client.complete("fourth", max_tokens=2).finish_reason == "length"
            except OverloadedError:
                return False  # the cancelled requests have not left yet

        _poll(admitted, 20, "a slot to free up")


def test_sigterm_drains_the_stream_in_flight(replicas: dict[str, ReplicaProcess]):
    replica = replicas["small-queue"]
    with Client(replica.target, timeout=300) as client, \
            grpc.insecure_channel(replica.target) as channel:
        # Watchers, as a gateway keeps them open: they end when the drain does.
        watches = [health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest()),
                   epb_grpc.EngineStub(channel).WatchLoad(epb.WatchLoadRequest())]
        for watch in watches:
            next(watch)
        stream = client.complete_stream("draining", max_tokens=240, temperature=0,
                                        ignore_eos=True)
        chunks = [next(stream)]
        replica.process.send_signal(signal.SIGTERM)
        _poll(lambda: replica.health() == NOT_SERVING, 10, "health NOT_SERVING")
        with pytest.raises(UnavailableError, match="shutting down"):
            client.complete("too late", max_tokens=2)
        chunks += list(stream)
        for watch in watches:
            with pytest.raises(grpc.RpcError) as ended:
                for _ in watch:
                    pass
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "stopping" in (ended.value.details() or "")
    assert chunks[-2].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 240
    assert replica.process.wait(timeout=120) == 0
    # Closed by the server, not cut at exit (grpc.aio logs an ERROR per call cut there).
    assert "Exception not handled" not in replica.log()


def test_sigkill_ends_a_client_stream_with_unavailable(replicas: dict[str, ReplicaProcess]):
    replica = replicas["to-kill"]
    with Client(replica.target, timeout=120) as client:
        stream = client.complete_stream("doomed", **LONG)
        next(stream)
        core_pid = replica.engine_core_pid()
        replica.process.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(UnavailableError):
            for _ in stream:
                pass
        assert time.monotonic() - killed_at < 10
    replica.process.wait(timeout=10)
    # The engine core notices that its parent is gone and exits too: no orphan is left.
    _poll(lambda: not _alive(core_pid), 20, "the orphaned engine core to exit")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_dead_engine_core_marks_the_replica_unavailable(replicas: dict[str, ReplicaProcess]):
    replica = replicas["core-dies"]
    with Client(replica.target, timeout=60) as client:
        stream = client.complete_stream("orphaned", **LONG)
        next(stream)
        os.kill(replica.engine_core_pid(), signal.SIGKILL)
        with pytest.raises(UnavailableError, match="engine"):
            for _ in stream:
                pass
        with pytest.raises(UnavailableError, match="engine is not running"):
            client.complete("anyone there?", max_tokens=2)
        _poll(lambda: replica.health() == NOT_SERVING, 10, "health NOT_SERVING")
        assert replica.health("tandem.v1.Generation") == NOT_SERVING


def _tp_worker_pid(core_pid: int) -> int:
    """The one tensor-parallel worker the engine core ``core_pid`` started (its child)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if ppid == core_pid and b"engine_common.parallel.worker" in cmdline:
            found.append(int(entry.name))
    [pid] = found
    return pid


def test_a_dead_tensor_parallel_worker_takes_the_replica_down_clearly(
        replicas: dict[str, ReplicaProcess]):
    """SIGKILL a TP=2 replica's worker under a stream: the stream ends UNAVAILABLE naming the
    worker, promptly (no hang in a collective), the engine core exits, and the replica
    reports NOT_SERVING (its supervisor restarts it: ``deploy.supervisor``)."""
    replica = replicas["tp-worker-dies"]
    with grpc.insecure_channel(replica.target) as channel:
        engine = epb_grpc.EngineStub(channel)
        info = engine.GetInfo(epb.GetInfoRequest(), timeout=10)
        assert info.tensor_parallel_size == 2 and info.kv_layout.tensor_parallel_size == 2
        # The tiny model's 2 KV heads: one per rank; the KV figures are the replica's.
        assert info.kv_layout.num_kv_heads == 1
        load = engine.GetLoad(epb.GetLoadRequest(), timeout=10)
        assert load.tensor_parallel_size == 2 and load.num_total_blocks > 0
    with Client(replica.target, timeout=60) as client:
        stream = client.complete_stream("split in two", **LONG)
        next(stream)
        core_pid = replica.engine_core_pid()
        os.kill(_tp_worker_pid(core_pid), signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(UnavailableError, match="tensor-parallel worker rank 1"):
            for _ in stream:
                pass
        assert time.monotonic() - killed_at < 15
        _poll(lambda: not _alive(core_pid), 15, "the engine core to exit")
        _poll(lambda: replica.health() == NOT_SERVING, 10, "health NOT_SERVING")
