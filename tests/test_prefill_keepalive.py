"""A Prefill call has no deadline: the prefill replica's keepalives show it alive while the
prompt waits, and only a silence ends the call (services/replica/prefill_peers.py).

A real prefill replica; its engine core is stopped with SIGSTOP to make a prompt wait as
long as a queue past capacity would, and the whole replica to make it silent.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import time
from collections.abc import Iterator

import grpc
import pytest

from engine_common.generation_request import GenerationRequest
from engine_common.outputs import RemotePrefill
from engine_common.sampling_params import SamplingParams
from protos.tandem.v1 import engine_pb2 as epb
from protos.tandem.v1 import engine_pb2_grpc as epb_grpc
from services.replica.prefill_peers import PrefillFailed, PrefillPeers
from tests.replica_process import ReplicaProcess, start_replicas, wait_all_free

PROMPT = list(range(5, 45))


@pytest.fixture(scope="module")
def prefill(tiny_llama_dir, tmp_path_factory) -> Iterator[ReplicaProcess]:
    [replica] = start_replicas(tiny_llama_dir, tmp_path_factory.mktemp("keepalive"), {
        "prefill-keepalive": ["--role", "prefill", "--num-kv-blocks", "128"]}).values()
    yield replica
    replica.stop()


def _stopped(pids: list[int], seconds: float) -> None:
    """Stop the processes for ``seconds`` (in a thread, while the caller waits on them)."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


@pytest.mark.parametrize("value", [math.nan, -1.0, 0.05, 61.0])
def test_a_bad_keepalive_interval_is_refused(prefill, value):
    with grpc.insecure_channel(prefill.target) as channel:
        call = epb_grpc.EngineStub(channel).Prefill(epb.PrefillRequest(
            request_id="bad-keepalive", prompt_token_ids=PROMPT, keepalive_s=value), timeout=10)
        with pytest.raises(grpc.RpcError) as caught:
            list(call)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "keepalive_s" in caught.value.details()


def test_keepalives_come_while_the_prompt_waits_then_the_result(prefill):
    """The engine core stopped for 1.5 s: keepalives every 0.2 s meanwhile, then the
    first token and the KV handle."""
    with grpc.insecure_channel(prefill.target) as channel:
        stub = epb_grpc.EngineStub(channel)
        core = prefill.engine_core_pid()
        os.kill(core, signal.SIGSTOP)
        try:
            call = stub.Prefill(epb.PrefillRequest(request_id="kept-alive",
                                                   prompt_token_ids=PROMPT, keepalive_s=0.2),
                                timeout=30)
            started = time.monotonic()
            keepalives = 0
            for message in call:
                if not message.keepalive:
                    break
                keepalives += 1
                if time.monotonic() - started > 1.5:
                    os.kill(core, signal.SIGCONT)
        finally:
            os.kill(core, signal.SIGCONT)
        assert keepalives >= 5, keepalives
        assert message.HasField("first_token_id") and message.kv_handle.block_ids
        assert message.request_id == "kept-alive"
        stub.ReleaseKv(epb.ReleaseKvRequest(request_id="kept-alive",
                                            engine_id=message.kv_handle.engine_id), timeout=10)
    wait_all_free(prefill.target)


def _prefill_through_peers(prefill: ReplicaProcess, request_id: str,
                           stop: list[int], stop_s: float) -> RemotePrefill | PrefillFailed:
    """A decode replica's PrefillPeers (keepalive 0.2 s, silence 1 s) asks for the prompt
    while ``stop`` is stopped for ``stop_s``: the result, or the PrefillFailed it raised."""
    async def run() -> RemotePrefill | PrefillFailed:
        peers = PrefillPeers(keepalive_s=0.2, silence_timeout_s=1.0)
        request = GenerationRequest(PROMPT, SamplingParams(max_tokens=4))
        pause = asyncio.get_running_loop().run_in_executor(None, _stopped, stop, stop_s)
        try:
            async for item in peers.prefill(prefill.target, request_id, request):
                if isinstance(item, RemotePrefill):
                    peers.release(prefill.target, request_id, item.handle.engine_id)
                    await asyncio.sleep(0.2)  # the release goes out before the channel closes
                    return item
            raise AssertionError("the stream ended without a result")
        except PrefillFailed as failed:
            return failed
        finally:
            await pause
            await peers.close()
    return asyncio.run(run())


def test_a_prompt_that_waits_longer_than_the_silence_timeout_is_not_given_up(prefill):
    result = _prefill_through_peers(prefill, "waits", [prefill.engine_core_pid()], 2.5)
    assert isinstance(result, RemotePrefill), result
    wait_all_free(prefill.target)


def test_a_silent_prefill_replica_is_given_up_after_the_silence_timeout(prefill):
    started = time.monotonic()
    result = _prefill_through_peers(
        prefill, "silent", [prefill.process.pid, prefill.engine_core_pid()], 3.0)
    assert isinstance(result, PrefillFailed), result
    assert "sent nothing" in str(result)
    assert time.monotonic() - started < 3.0 + 5  # failed near 1 s; waited out the pause
    wait_all_free(prefill.target)
