"""A dead prefill replica costs the decode replicas no recompute when the gateway can route
again: real replica processes on a tiny model.

Checked: a decode replica whose prefill peer is down hands the request back (ABORTED, before
any output, counted as a KV fallback) when the caller asks for hand-backs
(``services.engine_api.prefill_handback``), and computes the prompt itself otherwise (the
endpoint picker's path, a peer's call); a peer that answers but fails another way falls back
locally either way; and the gateway's registry takes a replica a peer reports failing out of
rotation at once, and back as soon as it serves again after a restart.
"""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request

import grpc
import pytest

from engine_common.config import CacheConfig, EngineConfig
from engine_common.llm import LLM
from engine_common.sampling_params import SamplingParams
from gateway.registry import ReplicaRegistry
from protos.tandem.v1 import engine_pb2 as epb
from protos.tandem.v1 import engine_pb2_grpc as epb_grpc
from services.engine_api.prefill_handback import HANDBACK_CODE, handback_metadata
from tests.replica_process import free_port, restart_replica, start_replicas

pytestmark = pytest.mark.timeout(300)
ARGS = ["--num-kv-blocks", "128", "--max-num-seqs", "8"]


@pytest.fixture(scope="module")
def pair(tiny_llama_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("handback-logs")
    replicas = start_replicas(tiny_llama_dir, log_dir, {
        "prefill-h": ["--role", "prefill", *ARGS], "decode-h": ["--role", "decode", *ARGS]})
    yield replicas, log_dir
    for replica in replicas.values():
        replica.stop()


def fallbacks(url: str) -> float:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return sum(float(v) for v in re.findall(
        r"^tandem:kv_transfer_fallbacks_total\{[^}]*\} (\S+)$", text, re.M))


def generate(target: str, prompt: list[int], peer: str, metadata=()):
    request = epb.GenerateRequest(
        request_id=f"h-{time.monotonic_ns()}", prompt_token_ids=prompt, prefill_peer=peer,
        sampling_params=epb.SamplingParams(max_tokens=6, min_tokens=6, temperature=0),
        output_options=epb.OutputOptions(return_token_ids=True))
    with grpc.insecure_channel(target) as channel:
        responses = list(epb_grpc.EngineStub(channel).Generate(
            request, timeout=60, metadata=metadata))
    return [t for r in responses for t in r.new_token_ids], responses


def test_a_dead_prefill_peer_hands_the_request_back_to_a_caller_that_routes_again(
        pair, tiny_llama_dir):
    replicas, _ = pair
    decode = replicas["decode-h"]
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    prompt = list(range(5, 70))
    before = fallbacks(decode.metrics_url)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as error:
        generate(decode.target, prompt, dead, handback_metadata())
    assert error.value.code() == HANDBACK_CODE
    assert dead in error.value.details() and "route the request again" in error.value.details()
    assert time.monotonic() - started < 10  # no local prefill, no waiting
    assert fallbacks(decode.metrics_url) == before + 1
    # Without the header (a peer, the endpoint picker's path) it computes the prompt itself.
    offline = LLM(EngineConfig(model=str(tiny_llama_dir),
                               cache=CacheConfig(num_gpu_blocks_override=64)))
    [want] = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=6, min_tokens=6))
    tokens, responses = generate(decode.target, prompt, dead)
    assert tokens == want.token_ids
    # Refused outright once the channel's connection attempt failed ("unreachable": nothing
    # listens there, no connect wait), or the call's own attempt failing at once.
    assert responses[0].kv_transfer.fallback_reason in ("unreachable", "prefill_failed")
    assert fallbacks(decode.metrics_url) == before + 2


def test_a_peer_that_answers_but_cannot_prefill_falls_back_locally_even_so(pair):
    replicas, _ = pair
    decode = replicas["decode-h"]
    # A decode replica refuses Prefill (FAILED_PRECONDITION): not down, so no hand-back.
    tokens, responses = generate(decode.target, list(range(5, 60)), decode.target,
                                 handback_metadata())
    assert len(tokens) == 6
    assert responses[0].kv_transfer.fallback_reason == "prefill_failed"


def test_a_live_prefill_peer_serves_as_before_with_hand_backs_asked(pair):
    replicas, _ = pair
    tokens, responses = generate(replicas["decode-h"].target, list(range(7, 90)),
                                 replicas["prefill-h"].target, handback_metadata())
    assert len(tokens) == 6
    assert all(r.kv_transfer.fallback_reason == "" for r in responses)
    assert max(r.kv_transfer.blocks_pulled for r in responses) > 0  # reported once pulled


def test_a_reported_replica_leaves_rotation_at_once_and_returns_when_it_serves_again(
        pair, tiny_llama_dir):
    replicas, log_dir = pair

    async def run() -> None:
        registry = ReplicaRegistry([replicas["prefill-h"].target], suspect_s=60.0)
        await registry.start()
        try:
            assert await registry.wait_until(lambda r: len(r.routable()) == 1, 30)
            registry.report_failure(replicas["prefill-h"].target, "a test says so")
            assert registry.routable() == []  # at once, though its health says SERVING
            # Restarted (as the supervisor does): back as soon as it serves, not after 60 s.
            replicas["prefill-h"] = await asyncio.to_thread(
                restart_replica, replicas["prefill-h"], tiny_llama_dir, log_dir, "prefill-h",
                ["--role", "prefill", *ARGS])
            assert await registry.wait_until(lambda r: len(r.routable()) == 1, 30)
        finally:
            await registry.stop()

    asyncio.run(run())
