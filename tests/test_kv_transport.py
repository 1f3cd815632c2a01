"""Which transport KV takes, what the KV listener binds, and a producer killed mid-transfer.

Real processes and the real UCX library throughout: producers (and, where a network
namespace is involved, consumers) are spawned processes (``tests.kv_peer``); "another
host" is another Linux network namespace joined by a veth pair. Every byte pulled is
compared bit-exactly with the producer's.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch
from prometheus_client import generate_latest

from engine_common.config import CacheConfig, EngineConfig, KvTransferConfig
from engine_common.engine_core import EngineCore
from engine_common.generation_request import GenerationRequest
from engine_common.metrics import EngineMetrics
from engine_common.outputs import EngineCoreRequest, KvTransferReport, RemotePrefill
from engine_common.sampling_params import SamplingParams
from kv_transfer.connector import KvTransferError
from kv_transfer.layout import KvLayout
from kv_transfer.local_addresses import check_bind_address, is_local_address
from kv_transfer.ucx_connector import UcxKvConsumer, UcxKvProducer
from tests.kv_peer import (
    PeerProcess,
    PullOutcome,
    as_bits,
    kv_pattern,
    listening_addresses,
    veth_namespace,
)

SMALL = KvLayout("kv-transport-test", "bfloat16", num_layers=3, num_kv_heads=2, head_size=16,
                 block_size=16)
# SmolLM2-135M's geometry: 360 KiB a block, so a 96-block pull (34 MiB) takes long enough
# for a kill to land in the middle of it.
BIG = KvLayout("kv-kill-test", "bfloat16", num_layers=30, num_kv_heads=3, head_size=64,
               block_size=16)
BIG_BLOCKS, BIG_PULL = 112, 96
# What "noticed in time" means (issue 24): a producer's death fails the pull within this.
DETECTION_S = 2.0


# -- binding -------------------------------------------------------------------------------


def test_a_kv_listener_binds_only_an_address_of_this_host() -> None:
    assert check_bind_address("127.0.0.1") == "127.0.0.1"
    for wildcard in ("0.0.0.0", "::", ""):
        with pytest.raises(ValueError, match="wildcard"):
            check_bind_address(wildcard)
    with pytest.raises(ValueError, match="not an IP address"):
        check_bind_address("localhost")
    with pytest.raises(ValueError, match="not an address of this host"):
        check_bind_address("198.51.100.7")  # TEST-NET-2: nobody's
    cache = kv_pattern(SMALL, 4, seed=0)
    with pytest.raises(ValueError, match="wildcard"):
        UcxKvProducer(cache, SMALL, "p", host="0.0.0.0")
    with pytest.raises(ValueError, match="not an address of this host"):
        UcxKvConsumer(cache, SMALL, host="198.51.100.7")


# -- transports ----------------------------------------------------------------------------


def _pulled(consumer: PeerProcess | None, kv: torch.Tensor | None, local: list[int]
            ) -> torch.Tensor:
    if consumer is not None:
        return consumer.call("blocks", local)
    assert kv is not None
    return kv[local]


def test_same_host_pulls_take_shared_memory_and_tcp_on_request() -> None:
    """A producer on this host's loopback: the listener binds only that address (its
    control socket and UCX's TCP transport alike); pulls go over shared memory (read by
    the consumer, sent direct, or staged), or over TCP when the consumer asks; a handle naming another engine fails."""
    producer = PeerProcess("producer", SMALL, 48, seed=1, host="127.0.0.1", engine_id="p-lo")
    source = kv_pattern(SMALL, 48, seed=1)
    try:
        assert producer.address is not None and producer.address[0] == "127.0.0.1"
        listening = listening_addresses(producer.pid)
        assert f"127.0.0.1:{producer.address[1]}" in listening
        assert len(listening) >= 2 and all(a.startswith("127.0.0.1:") for a in listening), \
            listening  # the control listener and UCX's TCP transport, nothing else

        rng = random.Random(3)
        remote = rng.sample(range(48), 20)
        handle = producer.pin("same-host", remote)
        # A consumer reads direct pulls itself (ucx_rma), on shared memory and over TCP,
        # unless told not to (then the producer sends them: the fallback).
        for transport, direct_min, read, mode, carried in (
                ("auto", 0, True, "read", "shm"), ("auto", 0, False, "direct", "shm"),
                ("auto", 2**62, True, "staged", "shm"), ("tcp", 0, True, "read", "tcp"),
                ("tcp", 0, False, "direct", "tcp"), ("tcp", 2**62, True, "staged", "tcp")):
            kv = kv_pattern(SMALL, 40, seed=9)
            consumer = UcxKvConsumer(kv, SMALL, transport=transport,
                                     direct_min_message_bytes=direct_min, remote_read=read)
            try:
                local = rng.sample(range(40), 20)
                result = consumer.pull(handle, remote, local, 20).result(30)
                assert (result.transport, result.mode) == (carried, mode)
                assert torch.equal(as_bits(kv[local]), as_bits(source[remote]))

                imposter = replace(handle, engine_id="another-engine")
                with pytest.raises(KvTransferError, match="is KV engine 'p-lo'") as refused:
                    consumer.pull(imposter, remote[:1], local[:1], 10).result(20)
                assert refused.value.reason == "unreachable"
            finally:
                consumer.close()
    finally:
        producer.stop()


def test_a_peer_in_another_network_namespace_is_another_host_reached_over_tcp() -> None:
    """Two "hosts" on one machine: the consumer's namespace holds a producer on its veth
    address (same host: shared memory), the other namespace a producer on its own (another
    host: TCP, though UCX could have used shared memory across network namespaces). Each
    listener binds only its address. Killing the remote producer mid-pull fails that pull
    in time and drops only that connection."""
    with veth_namespace() as (namespace, ours, theirs):
        assert is_local_address(ours) and not is_local_address(theirs)
        remote_producer = PeerProcess("producer", SMALL, 48, seed=1, netns=namespace,
                                      host=theirs, engine_id="p-remote")
        local_producer = PeerProcess("producer", SMALL, 48, seed=1, host=ours,
                                     engine_id="p-local")
        consumer = PeerProcess("consumer", SMALL, 40, seed=9, host=ours)
        try:
            for producer, address in ((remote_producer, theirs), (local_producer, ours)):
                listening = listening_addresses(producer.pid)
                assert len(listening) >= 2, listening
                assert all(a.startswith(f"{address}:") for a in listening), listening

            source = kv_pattern(SMALL, 48, seed=1)
            rng = random.Random(4)
            for producer, transport in ((remote_producer, "tcp"), (local_producer, "shm")):
                remote, local = rng.sample(range(48), 12), rng.sample(range(40), 12)
                handle = producer.pin(f"ns-{transport}", remote)
                outcome = consumer.call("pull", handle, remote, local, 20.0)
                assert isinstance(outcome, PullOutcome) and not outcome.reason, outcome
                assert outcome.transport == transport
                assert torch.equal(as_bits(_pulled(consumer, None, local)),
                                   as_bits(source[remote]))
            assert consumer.call("connections") == 2

            handle = remote_producer.pin("ns-killed", list(range(10)))
            remote_producer.freeze()
            consumer.send("pull", handle, list(range(10)), list(range(10)), 30.0)
            time.sleep(0.5)  # the request is out; the frozen producer will never answer
            killed = remote_producer.kill()
            outcome = consumer.answer(timeout=30)
            assert outcome.reason == "unreachable", outcome
            assert outcome.finished - killed < DETECTION_S, outcome
            assert consumer.call("connections") == 1  # the live producer's stays
        finally:
            consumer.stop()
            remote_producer.stop()
            local_producer.stop()


# -- a producer killed mid-transfer ----------------------------------------------------------


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_a_producer_killed_mid_transfer_fails_the_pull_in_time_and_frees_it(
        transport: str) -> None:
    """On shared memory ("auto" on one host) and on TCP: (1) a producer frozen with a pull
    in flight, then killed; (2) a producer killed while a stream of back-to-back 34 MiB
    pulls is in full flow (the first pull's bytes checked). Each time the pull fails as
    "unreachable" within 2 s of the kill (the control connection closes: no waiting for the
    pull's timeout), the consumer holds no connection afterwards, and it pulls from a live
    producer again."""
    frozen = PeerProcess("producer", BIG, BIG_BLOCKS, seed=1, engine_id="frozen")
    streaming = PeerProcess("producer", BIG, BIG_BLOCKS, seed=1, engine_id="streaming")
    kv = kv_pattern(BIG, BIG_BLOCKS, seed=2)
    consumer = UcxKvConsumer(kv, BIG, transport=transport)
    blocks = list(range(BIG_PULL))
    expected = "shm" if transport == "auto" else "tcp"
    try:
        handle = frozen.pin("first", blocks)
        assert consumer.pull(handle, blocks, blocks, 30).result(60).transport == expected
        # Byte-exact: a read this large is progressed by ucxx's progress thread (ucx_rma).
        assert torch.equal(kv[:BIG_PULL].view(torch.int16),
                           kv_pattern(BIG, BIG_PULL, seed=1).view(torch.int16))
        frozen.freeze()
        in_flight = consumer.pull(handle, blocks, blocks, 60)
        time.sleep(0.5)
        killed = frozen.kill()
        with pytest.raises(KvTransferError) as failed:
            in_flight.result(DETECTION_S + 5)
        assert failed.value.reason == "unreachable", failed.value
        assert time.monotonic() - killed < DETECTION_S
        assert consumer.num_connections == 0

        outcomes = _kill_mid_stream(consumer, streaming, blocks)
        assert outcomes[:-1] and all(not o.reason for o in outcomes[:-1])
        assert all(o.transport == expected for o in outcomes[:-1])
        last = outcomes[-1]
        assert last.reason == "unreachable", last
        assert last.submitted < streaming.killed_at < last.finished, \
            "the kill did not land during a pull"
        assert last.finished - streaming.killed_at < DETECTION_S, last
        assert consumer.num_connections == 0
    finally:
        consumer.close()
        frozen.stop()
        streaming.stop()


def _kill_mid_stream(consumer: UcxKvConsumer, producer: PeerProcess, blocks: list[int]
                     ) -> list[PullOutcome]:
    """Pull back to back until a pull fails; kill the producer once a pull has been under
    way for a few milliseconds (the pulls take tens of them)."""
    handle = producer.pin("stream", blocks)
    outcomes: list[PullOutcome] = []
    current: list[float] = []  # the monotonic start of the pull in flight, if any
    lock = threading.Lock()

    def stream() -> None:
        while True:
            with lock:
                current[:] = [time.monotonic()]
            future = consumer.pull(handle, blocks, blocks, 60)
            try:
                result = future.result(70)
                outcome = PullOutcome(current[0], time.monotonic(), result.transport,
                                      result.mode)
            except KvTransferError as failure:
                outcome = PullOutcome(current[0], time.monotonic(), reason=failure.reason,
                                      detail=failure.detail)
            with lock:
                current.clear()
                outcomes.append(outcome)
            if outcome.reason:
                return

    with ThreadPoolExecutor(1) as pool:
        streaming = pool.submit(stream)
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline and not streaming.done(), outcomes
            with lock:
                ready = len(outcomes) >= 3 and current and time.monotonic() - current[0] > 0.003
                if ready:
                    producer.kill()
                    break
            time.sleep(0.0005)
        streaming.result(DETECTION_S + 70)
    return outcomes


# -- the decode engine's side --------------------------------------------------------------


def test_a_decode_engine_falls_back_when_its_producer_dies_during_the_pull(
        tiny_llama_dir) -> None:
    """The decode replica's engine pulls from a producer that froze, then was killed: the
    request falls back to computing the prompt itself ("unreachable") within 2 s of the
    kill, its output equals an aggregated engine's, and no block or connection stays."""
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def core(engine_id: str, role: str | None) -> EngineCore:
        return EngineCore(EngineConfig(
            model=str(tiny_llama_dir), dtype="float32", engine_id=engine_id,
            cache=CacheConfig(block_size=4, num_gpu_blocks_override=64),
            kv_transfer=KvTransferConfig(role=role, pull_timeout_seconds=30.0)))

    decode, both = core("decode-k", "consumer"), core("both-k", None)
    assert decode.remote_kv is not None and decode.remote_kv.consumer is not None
    producer = PeerProcess("producer", decode.remote_kv.layout, 64, seed=1, engine_id="gone")
    try:
        prompt = list(range(7, 28))  # 21 tokens: 6 blocks of 4
        both.add_request(EngineCoreRequest("ref", GenerationRequest(prompt, greedy),
                                           time.monotonic()))
        expected = _run(both)[0]
        handle = producer.pin("dying", list(range(6)), num_tokens=len(prompt))
        producer.freeze()
        decode.add_request(EngineCoreRequest(
            "dying", GenerationRequest(prompt, greedy), time.monotonic(),
            remote_prefill=RemotePrefill(handle=handle, first_token_id=expected[0])))
        killer = threading.Timer(0.5, producer.kill)
        killer.start()
        tokens, report, reported_at = _run(decode)
        killer.join()
        assert report is not None and report.fallback_reason == "unreachable"
        assert reported_at - producer.killed_at < DETECTION_S
        # The prefill's first token came with the handle; the engine emits the rest.
        assert [expected[0], *tokens] == expected
        assert decode.kv_cache_manager.num_free_blocks == decode.kv_cache_manager.num_blocks
        assert decode.remote_kv.consumer.num_connections == 0
    finally:
        producer.stop()
        decode.remote_kv.close()


def _run(core: EngineCore) -> tuple[list[int], KvTransferReport | None, float]:
    """Step until the one request finishes: its tokens, its KV report and when it came."""
    tokens: list[int] = []
    report, reported_at = None, 0.0
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline, "the engine did not finish in time"
        if not core.has_runnable_requests():
            time.sleep(0.002)
        for output in core.step().outputs:
            tokens.extend(output.new_token_ids)
            if output.kv_transfer is not None:
                report, reported_at = output.kv_transfer, time.monotonic()
            if output.finished:
                return tokens, report, reported_at


# -- metrics ---------------------------------------------------------------------------------


def test_kv_transfer_metrics_carry_the_transport() -> None:
    metrics = EngineMetrics("m", "decode-0")
    metrics.record_kv_transfer(KvTransferReport("p", blocks_pulled=4, num_bytes=1000,
                                                seconds=0.01, transport="shm"))
    metrics.record_kv_transfer(KvTransferReport("p", blocks_pulled=1, num_bytes=7,
                                                seconds=0.2, transport="tcp"))
    metrics.record_kv_transfer(KvTransferReport("p", fallback_reason="unreachable"))
    text = generate_latest(metrics.registry).decode()
    assert 'tandem:kv_transfer_bytes_total{engine="decode-0",model_name="m",transport="shm"} ' \
           '1000.0' in text
    assert 'tandem:kv_transfer_bytes_total{engine="decode-0",model_name="m",transport="tcp"} ' \
           '7.0' in text
    assert 'tandem:kv_transfer_seconds_count{engine="decode-0",model_name="m",transport="tcp"} ' \
           '1.0' in text
    assert 'tandem:kv_transfer_failures_total{engine="decode-0",model_name="m",' \
           'reason="unreachable"} 1.0' in text
