"""Property-based fuzzing of every gRPC method the suite serves, on real processes.

Hostile requests (``tests.fuzz_requests``: valid requests with fields made hostile, random
messages, bytes that are no message) go to every RPC of ``tandem.v1.Generation`` on the
gateway and on a replica, and of the internal ``tandem.v1.Engine`` on the decode and the
prefill replica of the shared P/D stack (``conftest.openai_stack``). Each must be answered
with a status a client's mistake may get (INVALID_ARGUMENT and its kin, or OK: never
UNKNOWN, INTERNAL or UNAVAILABLE), a message of at most ``MAX_STATUS_MESSAGE_BYTES``, and no
process may die. Afterwards every replica is idle as before (nothing running or waiting, no
KV block kept) and a normal request is served (``tests.fuzz_stack``). ``TANDEM_FUZZ_EXAMPLES``
sets the examples per test (``make fuzz`` runs many more).
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protos.tandem.v1 import engine_pb2, engine_pb2_grpc
from services.frontend.errors import MAX_STATUS_MESSAGE_BYTES
from tests.fuzz_requests import (
    ACCEPTABLE_CODES,
    ENGINE,
    FUZZ_SETTINGS,
    GENERATION,
    TIMEOUT_S,
    Rpc,
    requests,
    rpcs,
)
from tests.fuzz_stack import Baseline, assert_alive, assert_whole
from tests.openai_http import Stack

pytestmark = pytest.mark.timeout(TIMEOUT_S)

def call(channel: grpc.Channel, rpc: Rpc, raw: bytes) -> tuple[grpc.StatusCode, str]:
    """Send ``raw`` as ``rpc``'s request; its status and message (reading a stream to its
    end; an endless one for a moment)."""
    timeout = 2.0 if rpc.endless else 120.0
    try:
        if rpc.streams:
            for _ in channel.unary_stream(rpc.path)(raw, timeout=timeout):
                pass
        else:
            channel.unary_unary(rpc.path)(raw, timeout=timeout)
    except grpc.RpcError as error:
        if rpc.endless and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return grpc.StatusCode.OK, ""
        return error.code(), error.details() or ""
    return grpc.StatusCode.OK, ""


def assert_refused_well(rpc: Rpc, code: grpc.StatusCode, details: str, stack: Stack) -> None:
    assert code in ACCEPTABLE_CODES, f"{rpc.path} answered {code.name}: {details[:500]}"
    assert len(details.encode()) <= MAX_STATUS_MESSAGE_BYTES, (
        f"{rpc.path} answered a {len(details.encode())}-byte message")
    assert_alive(stack)


@pytest.fixture(scope="module")
def baseline(openai_stack: Stack) -> Iterator[Baseline]:
    yield Baseline.of(openai_stack)


@pytest.fixture(scope="module")
def channels(openai_stack: Stack) -> Iterator[dict[str, grpc.Channel]]:
    targets = {"gateway": openai_stack.gateway,
               **{name: r.target for name, r in openai_stack.replicas.items()}}
    opened = {name: grpc.insecure_channel(target) for name, target in targets.items()}
    yield opened
    for channel in opened.values():
        channel.close()


@pytest.mark.parametrize("target", ["gateway", "decode"])
def test_the_generation_api_refuses_hostile_requests(openai_stack: Stack, baseline: Baseline,
                                                     channels: dict[str, grpc.Channel],
                                                     target: str) -> None:
    @FUZZ_SETTINGS
    @given(st.data())
    def fuzz(data: st.DataObject) -> None:
        rpc = data.draw(st.sampled_from(rpcs(GENERATION)), label="rpc")
        raw = data.draw(requests(rpc), label="request bytes")
        assert_refused_well(rpc, *call(channels[target], rpc, raw), openai_stack)

    fuzz()
    assert_whole(openai_stack, baseline)


def test_the_engine_api_refuses_hostile_requests(openai_stack: Stack, baseline: Baseline,
                                                 channels: dict[str, grpc.Channel]) -> None:
    pinned: set[str] = set()

    @FUZZ_SETTINGS
    @given(st.data())
    def fuzz(data: st.DataObject) -> None:
        target = data.draw(st.sampled_from(["decode", "prefill"]), label="replica")
        rpc = data.draw(st.sampled_from(rpcs(ENGINE)), label="rpc")
        raw = data.draw(requests(rpc), label="request bytes")
        code, details = call(channels[target], rpc, raw)
        if rpc.method.name == "Prefill" and code == grpc.StatusCode.OK:
            # A prefill that succeeds pins its blocks until released, as a decode replica
            # does after its pull (or until the lease ends): release them below.
            pinned.add(engine_pb2.PrefillRequest.FromString(raw).request_id)
        assert_refused_well(rpc, code, details, openai_stack)

    try:
        fuzz()
    finally:
        stub = engine_pb2_grpc.EngineStub(channels["prefill"])
        for request_id in pinned:
            stub.ReleaseKv(engine_pb2.ReleaseKvRequest(request_id=request_id), timeout=10)
    assert_whole(openai_stack, baseline)
