"""The KV connector's protocol version 4 (issue 34): reads with no request before them, a
lease's generation confirmed after them, and the previous version still served.

Real processes and the real UCX library: the producer is a spawned process
(``tests.kv_peer``), the consumer lives in the test process; every byte pulled is compared
bit-exactly with the producer's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest
import torch

from kv_transfer.connector import KvTransferError
from kv_transfer.layout import KvLayout
from kv_transfer.leases import LeaseTable
from kv_transfer.listener_probe import kv_listener_answers
from kv_transfer.ucx_connector import UcxKvConsumer
from kv_transfer.ucx_rma import coalesce_reads
from kv_transfer.wire import PREVIOUS_VERSION, PROTOCOL_VERSION
from tests.kv_peer import PeerProcess, as_bits, kv_pattern

LAYOUT = KvLayout("kv-protocol-test", "bfloat16", num_layers=3, num_kv_heads=2, head_size=16,
                  block_size=16)
PRODUCER_BLOCKS, CONSUMER_BLOCKS = 48, 40


def _pull_exact(consumer: UcxKvConsumer, kv: torch.Tensor, handle, remote: list[int],
                local: list[int], source: torch.Tensor):
    result = consumer.pull(handle, remote, local, 20).result(30)
    assert torch.equal(as_bits(kv[local]), as_bits(source[remote]))
    return result


@pytest.fixture(scope="module")
def producer():
    peer = PeerProcess("producer", LAYOUT, PRODUCER_BLOCKS, seed=1, engine_id="p-v4")
    yield peer
    peer.stop()


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_reads_are_exact_on_both_transports_and_a_re_pinned_lease_is_detected(
        producer: PeerProcess, transport: str) -> None:
    """A direct pull is read by the consumer on shared memory and over TCP alike (mode
    "read"), bit-exact. A handle of a lease that was released and pinned again under the same
    id (its blocks possibly reused meanwhile) is refused after the read ("lease_expired",
    "pinned again"), never served; the new pin's handle reads fine."""
    source = kv_pattern(LAYOUT, PRODUCER_BLOCKS, seed=1)
    kv = kv_pattern(LAYOUT, CONSUMER_BLOCKS, seed=9)
    consumer = UcxKvConsumer(kv, LAYOUT, transport=transport, direct_min_message_bytes=0)
    carried = "shm" if transport == "auto" else "tcp"
    try:
        remote, local = list(range(10, 22)), list(range(3, 15))
        old = producer.pin(f"reused-{transport}", remote)
        result = _pull_exact(consumer, kv, old, remote, local, source)
        assert (result.transport, result.mode) == (carried, "read")
        # One GET: the 12 blocks are one run on both sides, every layer in it.
        assert consumer.num_connections == 1

        assert producer.call("release", f"reused-{transport}") == remote
        new = producer.pin(f"reused-{transport}", remote)
        assert new.lease_generation != old.lease_generation
        with pytest.raises(KvTransferError, match="pinned again") as refused:
            consumer.pull(old, remote, local, 20).result(30)
        assert refused.value.reason == "lease_expired"
        # The refusal dropped the connection (what landed is discarded); the next pull
        # connects again and reads the new lease.
        result = _pull_exact(consumer, kv, new, remote, local, source)
        assert (result.transport, result.mode) == (carried, "read")
        assert consumer.num_downgrades == 0
        producer.call("release", f"reused-{transport}")
    finally:
        consumer.close()


def test_a_previous_version_consumer_is_served_by_a_new_producer(producer: PeerProcess) -> None:
    """Rolling upgrade, producers first: a consumer of version 3 (admission before its
    reads, reads on shared memory only) is served by a version 4 producer, bit-exact, on
    both transports."""
    source = kv_pattern(LAYOUT, PRODUCER_BLOCKS, seed=1)
    rng = random.Random(5)
    for transport, mode in (("auto", "read"), ("tcp", "direct")):
        kv = kv_pattern(LAYOUT, CONSUMER_BLOCKS, seed=9)
        consumer = UcxKvConsumer(kv, LAYOUT, transport=transport, direct_min_message_bytes=0,
                                 protocol_version=PREVIOUS_VERSION)
        try:
            remote = rng.sample(range(PRODUCER_BLOCKS), 8)
            local = rng.sample(range(CONSUMER_BLOCKS), 8)
            handle = producer.pin(f"old-consumer-{transport}", remote)
            result = _pull_exact(consumer, kv, handle, remote, local, source)
            assert result.mode == mode
            assert consumer.num_downgrades == 0
            producer.call("release", f"old-consumer-{transport}")
        finally:
            consumer.close()


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_a_new_consumer_falls_back_to_the_previous_version_of_an_old_producer(
        transport: str) -> None:
    """Rolling upgrade, consumers first: a producer of version 3 closes the connection on a
    version 4 hello; the consumer says hello again in version 3 (counted in
    ``num_downgrades``, logged with the reason) and is served, bit-exact."""
    old = PeerProcess("producer", LAYOUT, PRODUCER_BLOCKS, seed=1, engine_id="p-v3",
                      versions=(PREVIOUS_VERSION,))
    source = kv_pattern(LAYOUT, PRODUCER_BLOCKS, seed=1)
    kv = kv_pattern(LAYOUT, CONSUMER_BLOCKS, seed=9)
    consumer = UcxKvConsumer(kv, LAYOUT, transport=transport, direct_min_message_bytes=0)
    try:
        remote, local = list(range(4, 12)), list(range(20, 28))
        handle = old.pin("new-consumer", remote)
        result = _pull_exact(consumer, kv, handle, remote, local, source)
        assert result.mode == ("read" if transport == "auto" else "direct")
        assert consumer.num_downgrades == 1
        _pull_exact(consumer, kv, handle, remote, local, source)  # the connection is kept
        assert consumer.num_downgrades == 1
    finally:
        consumer.close()
        old.stop()


def test_an_old_consumer_of_a_producer_that_dropped_its_version_is_refused() -> None:
    """A producer serving version 4 alone (once every consumer is upgraded) and a version 3
    consumer: the producer closes the connection at hello (logging the versions), the pull
    fails as "unreachable" at hello, which the engine counts as a fallback and recomputes."""
    new = PeerProcess("producer", LAYOUT, PRODUCER_BLOCKS, seed=1, engine_id="p-v4-only",
                      versions=(PROTOCOL_VERSION,))
    kv = kv_pattern(LAYOUT, CONSUMER_BLOCKS, seed=9)
    consumer = UcxKvConsumer(kv, LAYOUT, direct_min_message_bytes=0,
                             protocol_version=PREVIOUS_VERSION)
    try:
        handle = new.pin("refused", [1, 2])
        with pytest.raises(KvTransferError, match="closed the connection at hello") as refused:
            consumer.pull(handle, [1, 2], [1, 2], 10).result(20)
        assert refused.value.reason == "unreachable"
        assert consumer.num_connections == 0
    finally:
        consumer.close()
        new.stop()


class _PreviousCacheLayout(KvLayout):
    """What a peer of the previous release (layer-major cache) announces."""

    def fingerprint(self) -> str:
        return self.previous_layout_fingerprint()


def test_a_peer_of_the_previous_cache_layout_is_refused_clearly(producer: PeerProcess
                                                                 ) -> None:
    """The cache layout changed (block-major): a peer of the previous release must never
    be read or served. Its handle is refused before any connection, and a previous-layout
    consumer's request is refused by the producer; both as "layout_mismatch" (a fallback
    the engine counts and recomputes), saying that the peer runs the previous layout."""
    kv = kv_pattern(LAYOUT, CONSUMER_BLOCKS, seed=9)
    consumer = UcxKvConsumer(kv, LAYOUT, direct_min_message_bytes=0)
    handle = producer.pin("old-layout", [1, 2])
    stale = dataclasses.replace(handle, layout_fingerprint=LAYOUT.previous_layout_fingerprint())
    try:
        with pytest.raises(KvTransferError, match="producer runs the previous KV cache layout"
                           ) as refused:
            consumer.pull(stale, [1, 2], [1, 2], 10).result(20)
        assert refused.value.reason == "layout_mismatch" and consumer.num_connections == 0
    finally:
        consumer.close()
    old_layout = _PreviousCacheLayout(**dataclasses.asdict(LAYOUT))
    old = UcxKvConsumer(kv, old_layout, direct_min_message_bytes=0,
                        protocol_version=PREVIOUS_VERSION)  # its request names its layout
    try:
        with pytest.raises(KvTransferError, match="consumer runs the previous KV cache layout"
                           ) as refused:
            old.pull(stale, [1, 2], [1, 2], 10).result(20)
        assert refused.value.reason == "layout_mismatch"
        assert torch.equal(as_bits(kv), as_bits(kv_pattern(LAYOUT, CONSUMER_BLOCKS, seed=9)))
    finally:
        old.close()
        producer.call("release", "old-layout")


def test_lease_generations_name_one_pin_and_confirmation_checks_them() -> None:
    table = LeaseTable()
    first = table.add("r", [1, 2], 32, deadline=1000.0)
    table.confirm("r", [1], first.generation, now=999.0)
    assert table.remove("r") == [1, 2]
    again = table.add("r", [1, 2], 32, deadline=1000.0)  # the same deadline, re-pinned
    assert again.generation == first.generation + 1 and again.deadline == 1000.001
    with pytest.raises(KvTransferError, match="pinned again"):
        table.confirm("r", [1], first.generation, now=999.0)
    with pytest.raises(KvTransferError) as stray:
        table.confirm("r", [3], again.generation, now=999.0)
    assert stray.value.reason == "protocol"
    with pytest.raises(KvTransferError) as late:
        table.confirm("r", [1], again.generation, now=1001.0)
    assert late.value.reason == "lease_expired"
    # A short lease pinned after a long one keeps its own deadline.
    long, short = table.add("a", [5], 16, 5000.0), table.add("b", [6], 16, 1200.0)
    assert (long.deadline, short.deadline) == (5000.0, 1200.0)


def test_reads_adjacent_in_both_memories_merge_into_one() -> None:
    reads = [(100, 10, 1000), (110, 10, 1010), (120, 5, 2000), (125, 5, 2005), (200, 1, 2010)]
    assert coalesce_reads(reads) == [(100, 20, 1000), (120, 10, 2000), (200, 1, 2010)]
    assert coalesce_reads([]) == []


def test_the_kv_listener_probe_tells_a_listening_producer_from_none(producer: PeerProcess
                                                                    ) -> None:
    """The health check a prefill replica's SERVING waits for (kv_transfer.listener_probe):
    True for a started producer (which drops the probe's connection and goes on serving),
    False for a port nothing listens on."""
    assert producer.address is not None
    host, port = producer.address
    assert asyncio.run(kv_listener_answers(host, port))
    other = PeerProcess("producer", LAYOUT, 4, seed=1, engine_id="p-gone")
    assert other.address is not None
    other.stop()
    assert not asyncio.run(kv_listener_answers(*other.address, timeout=0.5))
    # The probed producer still serves.
    source = kv_pattern(LAYOUT, PRODUCER_BLOCKS, seed=1)
    kv = kv_pattern(LAYOUT, CONSUMER_BLOCKS, seed=9)
    consumer = UcxKvConsumer(kv, LAYOUT, direct_min_message_bytes=0)
    try:
        handle = producer.pin("after-probe", [0, 1, 2])
        _pull_exact(consumer, kv, handle, [0, 1, 2], [0, 1, 2], source)
        producer.call("release", "after-probe")
    finally:
        consumer.close()
