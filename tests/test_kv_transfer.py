"""KV transfer over real UCX between real processes.

Producers run in spawned subprocesses (driven over a pipe: pin, release, expire, kill);
consumers run in the test process. Caches hold a bit pattern that is a function of
(layer, K/V, block, offset), compared bit-exactly (bf16 through an int16 view).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import random
import signal
import time
from collections.abc import Iterator
from concurrent.futures import wait
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as mp_wait
from typing import Any

import pytest
import torch

from kv_transfer.block_copy import BlockCopier, StagingBuffer
from kv_transfer.connector import KvHandle, KvTransferError
from kv_transfer.layout import KvLayout
from kv_transfer.leases import LeaseTable
from kv_transfer.transfer_plan import Run, TransferPlan, joint_runs, plan_transfer
from kv_transfer.ucx_connector import UcxKvConsumer, UcxKvProducer
from kv_transfer.wire import payload_tag
from tests.kv_peer import as_bits, kv_pattern

MODEL = "test-model"
PRODUCER_BLOCKS = 48
CONSUMER_BLOCKS = 40
# Staged bf16 pulls come a layer per message (pipelined), fp32 ones in one message.
CHUNK_BYTES = {"bfloat16": 4096, "float32": 2**40}
# The smallest mean message size that sends a pull cache to cache (transfer_plan): 0 makes
# every pull direct, a huge one every pull staged.
# A pull's mode, forced: the producer sends its (layer, K/V) runs as they lie ("direct"), or
# a staged copy ("staged"), or the consumer reads the runs itself ("read", same host only).
DIRECT_MIN = {"direct": 0, "staged": 2**62, "read": 0}


def make_layout(dtype: str) -> KvLayout:
    # 16-token blocks of 2 heads x 16: 6 KiB per bf16 block, so a pull of a few blocks
    # crosses UCX's 8 KiB rendezvous threshold as real transfers do.
    return KvLayout(MODEL, dtype, num_layers=3, num_kv_heads=2, head_size=16, block_size=16)


# -- the producer process ------------------------------------------------------------


def _producer_main(conn: Connection, seed: int) -> None:
    # Waits for its ports first, so that a test can spawn it (torch import: seconds)
    # well before it must listen.
    dtypes, ports = conn.recv()
    producers: dict[str, UcxKvProducer] = {}
    released: list[tuple[str, list[int]]] = []
    for dtype, port in zip(dtypes, ports, strict=True):
        layout = make_layout(dtype)
        producer = UcxKvProducer(
            kv_pattern(layout, PRODUCER_BLOCKS, seed),
            layout,
            engine_id=f"prefill-{dtype}",
            port=port,
            on_release=lambda rid, ids: released.append((rid, ids)),
        )
        producer.start()
        producers[dtype] = producer
    conn.send({dtype: p.port for dtype, p in producers.items()})
    while True:
        command, dtype, args = conn.recv()
        try:
            if command == "pin":
                conn.send(producers[dtype].pin(*args))
            elif command == "release":
                conn.send(producers[dtype].release(*args))
            elif command == "expire":
                conn.send(producers[dtype].expire_leases(*args))
            elif command == "released_log":
                conn.send(list(released))
            elif command == "stop":
                for producer in producers.values():
                    producer.close()
                conn.send(None)
                return
        except Exception as exc:  # report to the test instead of dying silently
            conn.send(exc)


class ProducerProcess:
    """A spawned process hosting one UcxKvProducer per dtype; ``listen`` starts them."""

    def __init__(self, seed: int = 1):
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=_producer_main, args=(child_conn, seed), daemon=True)
        self.process.start()
        self.ports: dict[str, int] = {}

    def listen(self, dtypes: list[str], ports: list[int] | None = None) -> ProducerProcess:
        self._conn.send((dtypes, ports or [0] * len(dtypes)))
        self.ports = self._answer("listen", timeout=60)
        return self

    def _answer(self, what: str, timeout: float) -> Any:
        ready = mp_wait([self._conn, self.process.sentinel], timeout)
        if self._conn not in ready:
            raise TimeoutError(f"producer process gave no answer to {what}")
        return self._conn.recv()

    def call(self, command: str, dtype: str = "", *args: Any) -> Any:
        self._conn.send((command, dtype, args))
        answer = self._answer(command, timeout=30)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def pin(self, dtype: str, request_id: str, block_ids: list[int], lease: float = 60.0):
        handle = self.call("pin", dtype, request_id, block_ids, len(block_ids) * 16, lease)
        assert isinstance(handle, KvHandle)
        return handle

    def kill(self) -> None:
        if self.process.is_alive():
            assert self.process.pid is not None
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(10)

    def stop(self) -> None:
        if self.ports and self.process.is_alive():
            try:
                self.call("stop")
            except (TimeoutError, OSError, EOFError):
                pass
        self.kill()


@pytest.fixture(scope="module")
def producer() -> Iterator[ProducerProcess]:
    process = ProducerProcess().listen(["bfloat16", "float32"])
    yield process
    process.stop()


def make_consumer(dtype: str, seed: int = 99, mode: str = "staged"
                  ) -> tuple[UcxKvConsumer, torch.Tensor]:
    layout = make_layout(dtype)
    kv = kv_pattern(layout, CONSUMER_BLOCKS, seed)
    consumer = UcxKvConsumer(kv, layout, chunk_bytes=CHUNK_BYTES[dtype],
                             direct_min_message_bytes=DIRECT_MIN[mode],
                             remote_read=mode == "read")
    return consumer, kv


def pull_and_check(
    consumer: UcxKvConsumer,
    kv: torch.Tensor,
    handle: KvHandle,
    remote: list[int],
    local: list[int],
    timeout: float = 10.0,
    mode: str = "staged",
) -> None:
    layout = make_layout(str(kv.dtype).removeprefix("torch."))
    source = kv_pattern(layout, PRODUCER_BLOCKS, seed=1)
    before = kv.clone()
    result = consumer.pull(handle, remote, local, timeout).result(timeout + 5)
    assert result.num_blocks == len(remote)
    assert result.num_bytes == len(remote) * layout.bytes_per_block
    assert result.transport == "shm"  # producer and consumer share this host
    assert result.mode == mode
    assert torch.equal(as_bits(kv[local]), as_bits(source[remote]))
    untouched = [b for b in range(kv.shape[0]) if b not in set(local)]
    assert torch.equal(as_bits(kv[untouched]), as_bits(before[untouched]))


# -- layout ------------------------------------------------------------------------------


def test_layout_fingerprint_is_stable_and_sensitive() -> None:
    layout = make_layout("bfloat16")
    assert layout.fingerprint() == make_layout("bfloat16").fingerprint()
    assert len(layout.fingerprint()) == 32 and int(layout.fingerprint(), 16) >= 0
    for change in (
        {"model": "other"},
        {"dtype": "float16"},
        {"num_layers": 4},
        {"num_kv_heads": 1},
        {"head_size": 8},
        {"block_size": 8},
    ):
        assert dataclasses.replace(layout, **change).fingerprint() != layout.fingerprint()
    # The previous release's (layer-major) cache: refused, and the refusal says why.
    old = layout.previous_layout_fingerprint()
    assert old != layout.fingerprint()
    assert "previous KV cache layout" in layout.mismatch(old, "producer")
    assert "previous" not in layout.mismatch(make_layout("float32").fingerprint(), "producer")
    assert layout.bytes_per_block == 3 * 2 * 16 * 2 * 16 * 2
    assert make_layout("float32").bytes_per_block == 2 * layout.bytes_per_block
    cache = kv_pattern(layout, 5, seed=0)
    assert KvLayout.of_cache(MODEL, cache) == layout
    with pytest.raises(ValueError):
        make_layout("float32").check_cache(cache)


# -- data --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_block_copier_gathers_and_scatters_layer_ranges(dtype: str) -> None:
    layout = make_layout(dtype)
    source = kv_pattern(layout, 12, seed=5)
    target = kv_pattern(layout, 9, seed=6)
    before = target.clone()
    remote, local = [7, 0, 11, 3], [2, 8, 0, 5]
    staging = StagingBuffer(source).blocks(len(remote))
    for start, stop in [(0, 1), (1, 3)]:  # two chunks covering the 3 layers
        BlockCopier(source, layout).gather(remote, staging, start, stop)
    # staging is layer-major: [layers, 2, n, ...]
    assert torch.equal(as_bits(staging), as_bits(source[remote].movedim(0, 2)))
    copier = BlockCopier(target, layout)
    copier.scatter(staging, local, 2, 3)
    assert torch.equal(as_bits(target[:, :2]), as_bits(before[:, :2]))  # layers not copied yet
    copier.scatter(staging, local, 0, 2)
    assert torch.equal(as_bits(target[local]), as_bits(source[remote]))
    others = [b for b in range(9) if b not in local]
    assert torch.equal(as_bits(target[others]), as_bits(before[others]))


@pytest.mark.parametrize("mode", ["staged", "direct", "read"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_pull_random_subset_into_shuffled_blocks_is_exact(
    producer: ProducerProcess, dtype: str, mode: str
) -> None:
    rng = random.Random(7)
    pinned = rng.sample(range(PRODUCER_BLOCKS), 24)
    handle = producer.pin(dtype, f"exact-{dtype}-{mode}", pinned)
    consumer, kv = make_consumer(dtype, mode=mode)
    try:
        for size in (1, 5, 17):
            remote = rng.sample(pinned, size)
            local = rng.sample(range(CONSUMER_BLOCKS), size)
            pull_and_check(consumer, kv, handle, remote, local, mode=mode)
    finally:
        consumer.close()
    assert producer.call("release", dtype, f"exact-{dtype}-{mode}") == pinned


@pytest.mark.parametrize("mode", ["staged", "direct", "read"])
def test_pull_of_runs_consecutive_on_both_sides_is_exact(producer: ProducerProcess,
                                                         mode: str) -> None:
    """Runs (a fresh prefill's blocks usually are one): direct pulls send each run, every
    layer's K and V, in place, one message each; staged ones copy through the staging
    buffer."""
    remote = [*range(4, 14), 30, 31, *range(20, 25)]
    local = [*range(20, 30), 2, 3, *range(33, 38)]
    handle = producer.pin("bfloat16", f"runs-{mode}", remote)
    consumer, kv = make_consumer("bfloat16", mode=mode)
    try:
        pull_and_check(consumer, kv, handle, remote, local, mode=mode)
    finally:
        consumer.close()
    producer.call("release", "bfloat16", f"runs-{mode}")


def test_transfer_plan_goes_direct_only_for_long_runs() -> None:
    layout = make_layout("bfloat16")  # 6 KiB a block (3 layers, K and V, 1 KiB each)
    assert joint_runs([5, 6, 7, 9, 10, 2], [0, 1, 2, 3, 4, 8]) == [
        Run(5, 0, 3), Run(9, 3, 2), Run(2, 8, 1)]
    assert joint_runs([3, 4], [7, 6]) == [Run(3, 7, 1), Run(4, 6, 1)]  # only one side runs
    # 40 consecutive blocks: one message of 240 KiB, every layer's K and V (block-major)
    run = plan_transfer(layout, list(range(40)), list(range(8, 48)),
                        direct_min_message_bytes=32 * 1024)
    assert run.mode == "direct" and run.num_messages(layout) == 1
    assert run.runs == (Run(0, 8, 40),)
    # two runs: two messages of 120 KiB
    two = plan_transfer(layout, list(range(40)), [*range(8, 28), *range(60, 80)],
                        direct_min_message_bytes=32 * 1024)
    assert two.runs == (Run(0, 8, 20), Run(20, 60, 20)) and two.num_messages(layout) == 2
    # the same blocks shuffled: 6 KiB messages, so staged, two layers (2 * 80 KiB) a chunk
    shuffled = plan_transfer(layout, list(range(40)), list(range(47, 7, -1)),
                             chunk_bytes=160 * 1024, direct_min_message_bytes=32 * 1024)
    assert shuffled == TransferPlan("staged", layers_per_chunk=2)
    assert shuffled.layer_chunks(layout) == [(0, 2), (2, 3)]
    for plan in (run, shuffled):  # what the producer reads back is what was meant
        assert TransferPlan.from_wire(plan.to_wire(), layout, list(range(40))) == plan


@pytest.mark.parametrize("wire", [
    {"mode": "direct", "runs": [[0, 0, 3]]},  # covers 0..2, the request asks 0..3
    {"mode": "direct", "runs": [[0, 0, 4], [9, 9, 0]]},
    {"mode": "direct", "runs": [[0, "0", 4]]},
    {"mode": "staged", "layers_per_chunk": 0},
    {"mode": "staged", "layers_per_chunk": 4},
    {"mode": "teleport"},
    [],
])
def test_a_producer_refuses_a_plan_that_does_not_fit_the_request(wire: object) -> None:
    with pytest.raises(KvTransferError) as refused:
        TransferPlan.from_wire(wire, make_layout("float32"), [0, 1, 2, 3])
    assert refused.value.reason == "protocol"


def test_payload_tags_name_one_message_of_one_pull_of_one_connection() -> None:
    tags = {payload_tag(c, s, i) for c in (1, 2, 65_537) for s in (1, 2, 257) for i in (0, 5)}
    # Connection 65,537 wraps to 1 and pull 257 to 1: 2 connections x 2 pulls x 2 indices.
    assert len(tags) == 8
    assert payload_tag(1, 1, 0) != payload_tag(1, 2, 0) != payload_tag(2, 1, 0)
    with pytest.raises(ValueError):
        payload_tag(1, 1, 1 << 24)


def test_a_lease_read_in_place_is_known_to_have_ended_meanwhile() -> None:
    table = LeaseTable()
    table.add("r", [1, 2], 32, time.time() + 60)
    with table.reading("r", [1], time.time()) as lease:
        pass
    assert table.holds(lease)
    table.remove("r")
    assert not table.holds(lease)
    table.add("r", [1, 2], 32, time.time() + 60)  # pinned again: another lease
    assert not table.holds(lease)


# -- refusals ----------------------------------------------------------------------------


def test_layout_mismatch_is_refused_and_producer_stays_healthy(
    producer: ProducerProcess,
) -> None:
    handle = producer.pin("bfloat16", "mismatch", [1, 2, 3])
    # The handle names a float32 producer's layout: refused before any connection.
    consumer32, _ = make_consumer("float32")
    with pytest.raises(KvTransferError) as refused:
        consumer32.pull(handle, [1], [0], 5).result(10)
    assert refused.value.reason == "layout_mismatch"
    consumer32.close()

    # A consumer of another model whose handle claims its own layout (stale metadata):
    # only the producer can tell, and does.
    other_layout = dataclasses.replace(make_layout("bfloat16"), model="another-model")
    other = UcxKvConsumer(kv_pattern(other_layout, CONSUMER_BLOCKS, 3), other_layout)
    forged = dataclasses.replace(handle, layout_fingerprint=other_layout.fingerprint())
    with pytest.raises(KvTransferError) as refused:
        other.pull(forged, [1, 2], [0, 1], 5).result(10)
    assert refused.value.reason == "layout_mismatch"
    other.close()

    consumer, kv = make_consumer("bfloat16")
    pull_and_check(consumer, kv, handle, [3, 1], [7, 8])
    consumer.close()
    producer.call("release", "bfloat16", "mismatch")


def test_unknown_released_and_unpinned_blocks_are_refused(producer: ProducerProcess) -> None:
    consumer, kv = make_consumer("bfloat16")
    handle = producer.pin("bfloat16", "to-release", [10, 11, 12])
    try:
        never = dataclasses.replace(handle, request_id="never-pinned")
        with pytest.raises(KvTransferError) as refused:
            consumer.pull(never, [10], [0], 5).result(10)
        assert refused.value.reason == "unknown_request"

        with pytest.raises(KvTransferError) as refused:
            consumer.pull(handle, [10, 13], [0, 1], 5).result(10)
        assert refused.value.reason == "protocol"

        pull_and_check(consumer, kv, handle, [12, 10, 11], [5, 3, 4])
        assert producer.call("release", "bfloat16", "to-release") == [10, 11, 12]
        assert producer.call("release", "bfloat16", "to-release") == []
        with pytest.raises(KvTransferError) as refused:
            consumer.pull(handle, [10], [0], 5).result(10)
        assert refused.value.reason == "unknown_request"
        assert ("to-release", [10, 11, 12]) in producer.call("released_log")
    finally:
        consumer.close()


def test_expired_lease_is_refused_and_returned_to_the_engine(
    producer: ProducerProcess,
) -> None:
    consumer, _ = make_consumer("bfloat16")
    try:
        handle = producer.pin("bfloat16", "short", [20, 21], 0.2)
        producer.pin("bfloat16", "long", [22], 60.0)
        time.sleep(0.3)
        # Past its deadline but not yet collected: refused all the same.
        with pytest.raises(KvTransferError) as refused:
            consumer.pull(handle, [20], [0], 5).result(10)
        assert refused.value.reason == "lease_expired"

        expired = producer.call("expire", "bfloat16", time.time())
        assert expired == [("short", [20, 21])]
        assert ("short", [20, 21]) in producer.call("released_log")
        assert not any(rid == "long" for rid, _ in producer.call("released_log"))
        with pytest.raises(KvTransferError) as refused:
            consumer.pull(handle, [20], [0], 5).result(10)
        assert refused.value.reason == "lease_expired"
        assert producer.call("release", "bfloat16", "long") == [22]
    finally:
        consumer.close()


def test_local_producer_lease_bookkeeping() -> None:
    layout = make_layout("bfloat16")
    ended: list[tuple[str, list[int]]] = []
    producer = UcxKvProducer(
        kv_pattern(layout, 8, 0),
        layout,
        "local",
        on_release=lambda rid, ids: ended.append((rid, ids)),
    )
    host, port = producer.start()
    try:
        assert host == "127.0.0.1" and port > 0
        before = time.time()
        handle = producer.pin("a", [1, 2], 20, 5.0)
        assert handle.port == port and handle.layout_fingerprint == layout.fingerprint()
        # Five seconds from the pin, rounded to the millisecond (the lease's generation,
        # kv_transfer.leases): up to half a millisecond either side of it.
        assert before + 5.0 - 1e-3 <= handle.lease_deadline <= time.time() + 5.0 + 1e-3
        producer.pin("b", [3], 5, 5.0)
        with pytest.raises(ValueError):
            producer.pin("a", [4], 5, 5.0)
        with pytest.raises(ValueError):
            producer.pin("c", [8], 5, 5.0)
        assert producer.expire_leases(time.time()) == []
        assert producer.expire_leases(handle.lease_deadline + 1) == [("a", [1, 2]), ("b", [3])]
        assert ended == [("a", [1, 2]), ("b", [3])]
        assert producer.release("a") == [] and producer.num_leases == 0
    finally:
        producer.close()


# -- faults --------------------------------------------------------------------------------


def freeze(pid: int) -> None:
    """SIGSTOP ``pid`` and return once every thread of it has stopped (kill() returns when the
    signal is sent; a thread the scheduler has not run yet may still be running)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while True:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/stat", encoding="ascii") as stat:
                states.append(stat.read().rsplit(")", 1)[1].split()[0])
        if all(state in ("T", "t") for state in states):
            return
        assert time.monotonic() < deadline, f"process {pid} did not stop: {states}"
        time.sleep(0.01)


def test_frozen_or_killed_producer_fails_in_time_and_a_restarted_one_is_reconnected() -> None:
    first = ProducerProcess().listen(["bfloat16"])
    port = first.ports["bfloat16"]
    second = ProducerProcess()  # the restart, spawned early: spawning takes seconds
    consumer, kv = make_consumer("bfloat16")
    try:
        handle = first.pin("bfloat16", "r", [1, 2, 3])
        pull_and_check(consumer, kv, handle, [1, 2], [0, 1])  # the endpoint is now cached

        # A frozen producer (connection up, no answers) costs a pull its timeout, no more.
        assert first.process.pid is not None
        freeze(first.process.pid)
        started = time.monotonic()
        with pytest.raises(KvTransferError) as failed:
            consumer.pull(handle, [3], [2], 1.0).result(10)
        assert failed.value.reason == "timeout"
        assert time.monotonic() - started < 2.0

        first.kill()

        timeout = 3.0
        started = time.monotonic()
        with pytest.raises(KvTransferError) as failed:
            consumer.pull(handle, [3], [2], timeout).result(timeout + 5)
        assert failed.value.reason in {"unreachable", "timeout"}
        assert time.monotonic() - started < timeout + 1.0

        second.listen(["bfloat16"], ports=[port])
        assert second.ports["bfloat16"] == port
        handle = second.pin("bfloat16", "r", [4, 5])
        pull_and_check(consumer, kv, handle, [5, 4], [10, 11])
    finally:
        consumer.close()
        first.stop()
        second.stop()


def test_nothing_listening_is_unreachable() -> None:
    consumer, _ = make_consumer("bfloat16")
    layout = make_layout("bfloat16")
    handle = KvHandle("gone", "127.0.0.1", 1, "r", (0,), 16, time.time() + 60, layout.fingerprint())
    started = time.monotonic()
    with pytest.raises(KvTransferError) as failed:
        consumer.pull(handle, [0], [0], 4.0).result(10)
    # A refused connection is told apart from a slow one, and at once.
    assert failed.value.reason == "unreachable"
    assert time.monotonic() - started < 2.0
    consumer.close()


# -- concurrency -----------------------------------------------------------------------------


def test_concurrent_pulls_from_two_consumers_are_all_exact(producer: ProducerProcess) -> None:
    rng = random.Random(11)
    layout = make_layout("bfloat16")
    source = kv_pattern(layout, PRODUCER_BLOCKS, seed=1)
    handles = [
        producer.pin("bfloat16", f"conc-{i}", rng.sample(range(PRODUCER_BLOCKS), 6))
        for i in range(8)
    ]
    consumers = [make_consumer("bfloat16", seed=50 + i) for i in range(2)]
    try:
        jobs = []
        for c, (consumer, kv) in enumerate(consumers):
            # Each consumer fills disjoint local blocks with 4 requests at once.
            free = rng.sample(range(CONSUMER_BLOCKS), 4 * 6)
            for j, handle in enumerate(handles[c * 4 : c * 4 + 4]):
                remote = list(handle.block_ids)
                rng.shuffle(remote)
                local = free[j * 6 : j * 6 + 6]
                jobs.append((kv, remote, local, consumer.pull(handle, remote, local, 20)))
        done, not_done = wait([job[3] for job in jobs], timeout=30)
        assert not not_done
        for kv, remote, local, future in jobs:
            assert future.result().num_blocks == 6
            assert torch.equal(as_bits(kv[local]), as_bits(source[remote]))
    finally:
        for consumer, _ in consumers:
            consumer.close()
        for i in range(8):
            producer.call("release", "bfloat16", f"conc-{i}")
