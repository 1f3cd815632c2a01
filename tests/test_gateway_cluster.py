"""The gateway in front of three real replicas on loopback (subprocesses, a tiny model).

Everything here is observed from outside: the public API through the gateway, the replicas'
own /metrics, GetLoad, WatchLoad and KV events, and the gateway's /metrics. The tests share one cluster
and run in file order; the last one kills a replica and restarts it.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from engine_common.config import DEFAULT_BLOCK_SIZE
from engine_common.input_processor import InputProcessor
from engine_common.tokenizer import load_tokenizer
from gateway.registry import DnsTarget, ReplicaRegistry
from gateway.snapshot import prompt_block_hashes
from protos.tandem.v1 import engine_pb2, engine_pb2_grpc, generation_pb2, generation_pb2_grpc
from tandem.client import Client
from tandem.errors import DeadlineExceededError
from tandem.request_builders import chat_message
from tests.reflection_client import defines_service, reflect
from tests.replica_process import free_port

REPO = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 150.0
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
         "november oscar papa quebec romeo sierra tango uniform victor whiskey").split()

pytestmark = pytest.mark.timeout(400)


def scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text from 127.0.0.1:port/metrics, as sample name -> [(labels, value)]."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return samples


def metric(port: int, name: str, **labels: str) -> float:
    return sum(value for sample_labels, value in scrape(port).get(name, [])
               if all(sample_labels.get(k) == v for k, v in labels.items()))


def wait_for(condition: Callable[[], bool], timeout: float, interval: float = 0.05) -> float:
    """Seconds until ``condition()`` held; fails the test after ``timeout``."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)
    return time.monotonic() - start


def is_serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=1.0)
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


@dataclass
class ReplicaProcess:
    model_dir: Path
    port: int
    metrics_port: int
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it
        self.process = subprocess.Popen(
            [sys.executable, "-m", "services.replica", "--model", str(self.model_dir),
             "--host", "127.0.0.1", "--port", str(self.port),
             "--metrics-port", str(self.metrics_port), "--kv-cache-memory", "16MiB",
             "--log-level", "WARNING"],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def kill(self) -> None:
        """SIGKILL the replica and its engine core (the process group we started)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def load(self) -> engine_pb2.LoadReport:
        with grpc.insecure_channel(self.address) as channel:
            report: engine_pb2.LoadReport = engine_pb2_grpc.EngineStub(channel).GetLoad(
                engine_pb2.GetLoadRequest(), timeout=2.0)
        return report

    def served(self) -> float:
        """Requests this replica finished, from its own /metrics."""
        return metric(self.metrics_port, "vllm:request_success_total")

    def prefix_hits(self) -> float:
        return metric(self.metrics_port, "vllm:prefix_cache_hits_total")


@dataclass
class Cluster:
    model_dir: Path
    replicas: list[ReplicaProcess]
    gateway_port: int
    gateway_metrics_port: int
    gateway: subprocess.Popen[bytes] | None = None
    logs: list[Path] = field(default_factory=list)

    @property
    def gateway_address(self) -> str:
        return f"127.0.0.1:{self.gateway_port}"

    def client(self, timeout: float | None = 60.0) -> Client:
        return Client(self.gateway_address, timeout=timeout)

    def served(self) -> list[float]:
        return [r.served() for r in self.replicas]

    def gateway_metric(self, name: str, **labels: str) -> float:
        return metric(self.gateway_metrics_port, name, **labels)


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("gateway-cluster-logs")
    replicas = [ReplicaProcess(tiny_llama_dir, free_port(), free_port(), logs / f"replica{i}.log")
                for i in range(3)]
    c = Cluster(tiny_llama_dir, replicas, free_port(), free_port())
    try:
        for r in replicas:
            r.start()
        gateway_log = open(logs / "gateway.log", "ab")  # noqa: SIM115
        c.gateway = subprocess.Popen(
            [sys.executable, "-m", "gateway", "--model", str(tiny_llama_dir),
             "--host", "127.0.0.1", "--port", str(c.gateway_port),
             "--metrics-port", str(c.gateway_metrics_port),
             *[arg for r in replicas for arg in ("--replica", r.address)]],
            cwd=REPO, stdout=gateway_log, stderr=subprocess.STDOUT, start_new_session=True)
        gateway_log.close()
        try:
            wait_for(lambda: all(is_serving(r.address) for r in replicas)
                     and is_serving(c.gateway_address), STARTUP_TIMEOUT_S, interval=0.5)
            # The gateway is SERVING with one replica; wait for all three.
            wait_for(lambda: c.gateway_metric("tandem:gateway_replicas", healthy="true") == 3,
                     10.0)
        except AssertionError:
            for path in sorted(logs.iterdir()):
                print(f"--- {path.name}\n{path.read_text()[-3000:]}")
            raise
        yield c
    finally:
        if c.gateway is not None and c.gateway.poll() is None:
            os.killpg(c.gateway.pid, signal.SIGKILL)
        for r in replicas:
            r.kill()


def distinct_prompt(rng: random.Random, n_words: int = 12) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def served_by(before: list[float], after: list[float]) -> list[int]:
    return [round(a - b) for a, b in zip(after, before, strict=True)]


def test_requests_sharing_a_prefix_follow_it(cluster: Cluster) -> None:
    shared = "System: you are a careful assistant for the tandem project. " * 8
    with cluster.client() as client:
        before = cluster.served()
        hits_before = [r.prefix_hits() for r in cluster.replicas]
        client.complete(shared + "First question.", max_tokens=4, temperature=0)
        after_first = cluster.served()
        owner = served_by(before, after_first).index(1)
        time.sleep(0.3)  # the owner's KV events reach the gateway's index
        for i in range(4):
            client.complete(shared + f"Question {i}.", max_tokens=4, temperature=0)
    after = cluster.served()
    assert served_by(after_first, after) == [4 if i == owner else 0 for i in range(3)]
    hits = [r.prefix_hits() - h for r, h in zip(cluster.replicas, hits_before, strict=True)]
    num_shared_blocks = len(InputProcessor(
        load_tokenizer(cluster.model_dir), 512, 1 << 20).tokenize(shared)) // DEFAULT_BLOCK_SIZE
    assert hits[owner] >= 4 * (num_shared_blocks - 1) * DEFAULT_BLOCK_SIZE
    assert [h for i, h in enumerate(hits) if i != owner] == [0, 0]
    assert cluster.gateway_metric("tandem:gateway_routing_decisions_total", reason="prefix") >= 4


def test_uniform_load_spreads(cluster: Cluster) -> None:
    rng = random.Random(7)
    prompts = [f"{i} {distinct_prompt(rng)}" for i in range(9)]
    before = cluster.served()
    with cluster.client() as client, ThreadPoolExecutor(9) as pool:
        results = list(pool.map(
            lambda p: client.complete(p, max_tokens=24, temperature=0, ignore_eos=True),
            prompts))
    assert all(r.finish_reason == "length" for r in results)
    per_replica = served_by(before, cluster.served())
    assert sum(per_replica) == 9
    assert min(per_replica) >= 2, per_replica


def _stored_hashes(replica: ReplicaProcess) -> list[engine_pb2.BlockStored]:
    """Every BlockStored the replica published so far, replayed from seq 0."""
    last_seq = replica.load().kv_events_last_seq
    stored: list[engine_pb2.BlockStored] = []
    with grpc.insecure_channel(replica.address) as channel:
        call = engine_pb2_grpc.EngineStub(channel).WatchKvEvents(
            engine_pb2.WatchKvEventsRequest(since_seq=0), timeout=10.0)
        for batch in call:
            assert not batch.resync
            stored.extend(e.block_stored for e in batch.events
                          if e.WhichOneof("event") == "block_stored")
            if batch.seq >= last_seq:
                call.cancel()
                break
    return stored


def test_gateway_hashes_match_the_engines_kv_events(cluster: Cluster) -> None:
    system = "You answer in one word. Context: " + " ".join(WORDS) * 2
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Ready?"}]
    inputs = InputProcessor(load_tokenizer(cluster.model_dir), 512, 1 << 20)
    prompt = inputs.tokenize_chat(messages)
    with cluster.client() as client:
        # The gateway's own tokenization of the chat agrees with the replicas' code.
        with grpc.insecure_channel(cluster.gateway_address) as channel:
            tokenized = generation_pb2_grpc.GenerationStub(channel).Tokenize(
                generation_pb2.TokenizeRequest(
                    messages=[chat_message(m) for m in messages]), timeout=10)
        assert list(tokenized.tokens) == prompt
        for salt in ("", "tenant-7"):
            expected = prompt_block_hashes(prompt, DEFAULT_BLOCK_SIZE, salt)
            assert len(expected) >= 4
            before = cluster.served()
            reply = client.chat(messages, max_tokens=2, temperature=0,
                                **({"cache_salt": salt} if salt else {}))
            assert reply.finish_reason is not None
            owner = cluster.replicas[served_by(before, cluster.served()).index(1)]
            stored = _stored_hashes(owner)
            by_first = {bytes(s.block_hashes[0]): s for s in stored}
            run = by_first[expected[0]]  # the run that starts the prompt's chain
            assert not run.HasField("parent_block_hash")
            published = [bytes(h) for s in stored for h in s.block_hashes]
            assert set(expected) <= set(published)
            assert list(run.token_ids) == prompt[:len(run.block_hashes) * DEFAULT_BLOCK_SIZE]
    # The salted chain the engine published is not the plain one: the salt was hashed in.
    assert (prompt_block_hashes(prompt, DEFAULT_BLOCK_SIZE, "tenant-7")[0]
            != prompt_block_hashes(prompt, DEFAULT_BLOCK_SIZE)[0])


def _running(cluster: Cluster) -> list[int]:
    return [r.load().num_requests_running for r in cluster.replicas]


def test_deadline_and_cancellation_reach_the_replica(cluster: Cluster) -> None:
    prompt = "Count slowly: one two three"
    with cluster.client(timeout=60.0) as client:
        stream = client.complete_stream(prompt, max_tokens=480, temperature=0, ignore_eos=True)
        next(iter(stream))
        assert sum(_running(cluster)) == 1
        stream.cancel()
    wait_for(lambda: sum(_running(cluster)) == 0, 3.0)

    # A deadline well inside the time the whole generation takes here (measured, since the
    # tiny model's speed depends on the machine): it must expire mid-stream.
    with cluster.client(timeout=60.0) as client:
        started = time.monotonic()
        client.complete(prompt + " five", max_tokens=480, temperature=0, ignore_eos=True)
        generation_s = time.monotonic() - started
    with cluster.client(timeout=generation_s / 4) as client, pytest.raises(DeadlineExceededError):
        for _ in client.complete_stream(prompt + " four", max_tokens=480, temperature=0,
                                        ignore_eos=True):
            pass
    wait_for(lambda: sum(_running(cluster)) == 0, 3.0)


def test_gateway_serves_models_health_and_reflection(cluster: Cluster) -> None:
    with cluster.client() as client:
        assert [m.id for m in client.models()] == [cluster.model_dir.name]
    with grpc.insecure_channel(cluster.gateway_address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        services = {s.name for reply in replies for s in reply.list_services_response.service}
    assert {"tandem.v1.Generation", "grpc.health.v1.Health"} <= services
    assert "tandem.v1.Engine" not in services  # internal: the replicas serve it, not the gateway
    with grpc.insecure_channel(cluster.gateway_address) as channel:
        v1 = reflect(channel, "v1", ["tandem.v1.Generation", "tandem.v1.Engine"])
    assert {"tandem.v1.Generation", "grpc.reflection.v1.ServerReflection"} <= set(v1.services)
    assert defines_service(v1.files["tandem.v1.Generation"][0], "tandem.v1.Generation")
    # The Engine API's messages are linked in (the gateway speaks it) but not served.
    assert "tandem.v1.Engine" not in v1.services


def test_dns_discovery_finds_replicas(cluster: Cluster) -> None:
    """``localhost:port`` as a headless Service would be: resolved, watched, its role learned."""
    port = cluster.replicas[0].port

    async def discover() -> list[tuple[str, str]]:
        registry = ReplicaRegistry(dns_targets=[DnsTarget.parse(f"localhost:{port}")],
                                   dns_interval_s=0.2)
        await registry.start()
        try:
            assert await registry.wait_until(lambda r: bool(r.routable()), 10.0)
            return [(r.address, r.role) for r in registry.routable()]
        finally:
            await registry.stop()

    assert asyncio.run(discover()) == [(f"127.0.0.1:{port}", "both")]


def test_a_replicas_load_is_sent_as_it_changes(cluster: Cluster) -> None:
    """WatchLoad, what the gateway routes on: a report at once, heartbeats while nothing
    changes, one soon after a request moves the counters; pacing that makes no sense is
    refused with INVALID_ARGUMENT."""
    replica = cluster.replicas[0]
    with grpc.insecure_channel(replica.address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        refused = stub.WatchLoad(engine_pb2.WatchLoadRequest(min_interval_s=1.0,
                                                             heartbeat_s=0.5), timeout=10)
        with pytest.raises(grpc.RpcError) as error:
            next(refused)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "heartbeat_s" in (error.value.details() or "")
        watch = stub.WatchLoad(engine_pb2.WatchLoadRequest(min_interval_s=0.05,
                                                           heartbeat_s=0.3), timeout=60)
        try:
            first = next(watch)
            quiet = [next(watch) for _ in range(2)]
            gaps = [b.timestamp - a.timestamp for a, b in zip([first, *quiet[:-1]], quiet,
                                                              strict=True)]
            assert all(0.28 <= gap < 2.0 for gap in gaps), gaps  # heartbeats only
            with Client(replica.address, timeout=60) as client:
                client.complete("a request that moves the counters", max_tokens=2,
                                temperature=0)
            moved = next(r for r in watch if r.prefix_cache_queries > first.prefix_cache_queries)
            assert moved.engine_id == first.engine_id and moved.role == "both"
        finally:
            watch.cancel()


def test_killed_replica_is_avoided_its_stream_resumes_and_restart_returns(
        cluster: Cluster) -> None:
    prompt = "Tell a long story about alpha bravo charlie"
    # Long enough to be still running when the test looks, on a fast machine or a busy one.
    max_tokens = 400
    with cluster.client() as client:
        reference = client.complete(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True)
        resumed_before = cluster.gateway_metric(
            "tandem:gateway_resumptions_total", outcome="resumed")
        stream = client.complete_stream(prompt, max_tokens=max_tokens, temperature=0,
                                        ignore_eos=True)
        chunks = iter(stream)
        first = next(chunks)
        running = _running(cluster)
        assert sum(running) == 1
        victim = cluster.replicas[running.index(1)]
        victim.kill()
        # Out of rotation within seconds of the kill.
        assert wait_for(lambda: cluster.gateway_metric(
            "tandem:gateway_replicas", healthy="false") == 1, 3.0) < 3.0
        rest = list(chunks)

        # The stream went on elsewhere from the tokens already sent: nothing lost, nothing twice.
        text = first.text + "".join(c.text for c in rest)
        assert text == reference.text
        assert [c.finish_reason for c in rest if c.finish_reason] == ["length"]
        assert rest[-1].usage is not None and rest[-1].usage.completion_tokens == max_tokens
        assert cluster.gateway_metric(
            "tandem:gateway_resumptions_total", outcome="resumed") == resumed_before + 1

        # No request fails while it is down, and none goes to it.
        alive = [r for r in cluster.replicas if r is not victim]
        before = [r.served() for r in alive]
        rng = random.Random(11)
        for _ in range(4):
            assert client.complete(distinct_prompt(rng), max_tokens=4).finish_reason
        assert sum(r.served() - b for r, b in zip(alive, before, strict=True)) == 4

        # Back in rotation once it serves again.
        victim.start()
        wait_for(lambda: is_serving(victim.address), STARTUP_TIMEOUT_S, interval=0.5)
        returned_in = wait_for(lambda: cluster.gateway_metric(
            "tandem:gateway_replicas", healthy="true") == 3, 5.0)
        assert returned_in < 5.0
        before_all = cluster.served()
        prompts = [f"{i} {distinct_prompt(rng)}" for i in range(6)]
        with ThreadPoolExecutor(6) as pool:
            list(pool.map(lambda p: client.complete(p, max_tokens=24, ignore_eos=True), prompts))
        assert served_by(before_all, cluster.served())[cluster.replicas.index(victim)] >= 1
