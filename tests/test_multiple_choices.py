"""OpenAI's ``n``: several choices per request, on real processes on loopback.

Two replicas (role ``both``, a tiny model, at most 4 running and 2 waiting each), the gateway
in front of them and Envoy in front of the gateway, all started at once for the module. The
replica tests go straight to replica "a" (SDK and raw stubs); the gateway and Envoy tests go
through the stack. Seeded choices must be reproducible and equal the n=1 request with
``seed + i``; streams must interleave every choice with one finish each and the usage once;
cancelling or failing a choice must leave nothing running in the engine; the gateway must
send every choice of a request to one replica.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from google.protobuf import struct_pb2
from prometheus_client.parser import text_string_to_metric_families

from protos.tandem.v1 import engine_pb2 as epb
from protos.tandem.v1 import engine_pb2_grpc as epb_grpc
from protos.tandem.v1 import generation_pb2 as pb
from protos.tandem.v1 import generation_pb2_grpc as pb_grpc
from tandem.client import AsyncClient, Client
from tandem.errors import OverloadedError
from tandem.request_builders import chat_message
from tests.replica_process import (
    ReplicaProcess,
    envoy_answers,
    free_port,
    is_serving,
    spawn_module,
    start_replicas,
    wait_until,
)

PROMPT = "alpha bravo charlie delta"
MESSAGES = [{"role": "user", "content": "Tell me a story"}]
SAMPLED: dict[str, Any] = {"temperature": 1.0, "max_tokens": 8, "ignore_eos": True}

pytestmark = pytest.mark.timeout(240)


@dataclass
class Stack:
    replicas: dict[str, ReplicaProcess]
    gateway: str
    http_port: int

    @property
    def replica(self) -> ReplicaProcess:
        return self.replicas["a"]


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("multiple-choices-logs")
    args = ["--dtype", "float32", "--kv-cache-memory", "16MiB", "--served-model-name", "tiny",
            "--max-num-seqs", "4", "--max-waiting", "2", "--log-level", "WARNING"]
    gateway_port, http_port = free_port(), free_port()
    processes: list[subprocess.Popen[bytes]] = []

    def spawn(name: str, argv: list[str]) -> None:
        processes.append(spawn_module(logs, name, argv))

    replicas: dict[str, ReplicaProcess] = {}
    try:
        # Envoy starts while the replicas load.
        spawn("envoy", ["deploy.envoy_runner", "--http-port", str(http_port), "--upstream",
                        f"127.0.0.1:{gateway_port}", "--concurrency", "1"])
        replicas = start_replicas(tiny_llama_dir, logs, {"a": args, "b": args})
        spawn("gateway", ["gateway", "--model", str(tiny_llama_dir), "--served-model-name",
                          "tiny", "--host", "127.0.0.1", "--port", str(gateway_port),
                          "--metrics-port", "0",
                          *[a for r in replicas.values() for a in ("--replica", r.target)]])
        deadline = time.monotonic() + 60
        wait_until(lambda: is_serving(f"127.0.0.1:{gateway_port}"), deadline, "gateway", logs)
        wait_until(lambda: envoy_answers(http_port), deadline, "envoy", logs)
        yield Stack(replicas, f"127.0.0.1:{gateway_port}", http_port)
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
        for replica in replicas.values():
            replica.kill()


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[Client]:
    with Client(stack.replica.target, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def channel(stack: Stack) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(stack.replica.target) as ch:
        yield ch


def wait_engine_idle(channel: grpc.Channel, timeout: float = 20.0) -> None:
    """Until nothing runs and every block is free again."""
    engine = epb_grpc.EngineStub(channel)
    deadline = time.monotonic() + timeout
    while True:
        load = engine.GetLoad(epb.GetLoadRequest())
        if load.num_requests_running == 0 and load.num_free_blocks == load.num_total_blocks:
            return
        assert time.monotonic() < deadline, f"the engine still holds requests: {load}"
        time.sleep(0.05)


def finished_requests(replica: ReplicaProcess) -> float:
    with urllib.request.urlopen(replica.metrics_url, timeout=5) as response:
        text = response.read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name == "vllm:request_success_total")


# --------------------------------------------------------------------------- the replica


def test_seeded_choices_differ_repeat_and_equal_single_requests_with_seed_plus_i(client):
    completion = client.complete(PROMPT, n=3, seed=1234, **SAMPLED)
    texts = [c.text for c in completion.choices]
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert len(set(texts)) == 3, texts
    assert completion.text == texts[0]
    assert all(c.finish_reason == "length" for c in completion.choices)
    single = client.complete(PROMPT, seed=1234 + 2, **SAMPLED)
    assert single.text == texts[2]
    assert single.usage is not None and completion.usage is not None
    # The prompt is counted once, the completion tokens summed over the choices.
    assert completion.usage.prompt_tokens == single.usage.prompt_tokens
    assert completion.usage.completion_tokens == 3 * 8
    assert completion.usage.total_tokens == single.usage.prompt_tokens + 24
    assert completion.usage.cached_tokens <= completion.usage.prompt_tokens
    repeat = client.complete(PROMPT, n=3, seed=1234, **SAMPLED)
    assert [c.text for c in repeat.choices] == texts
    assert [client.complete(PROMPT, seed=1234 + i, **SAMPLED).text for i in (0, 1)] == texts[:2]

    chat = client.chat(MESSAGES, n=3, seed=99, **SAMPLED)
    contents = [c.content for c in chat.choices]
    assert [c.index for c in chat.choices] == [0, 1, 2] and len(set(contents)) == 3
    assert all(c.role == "assistant" for c in chat.choices)
    assert chat.usage is not None and chat.usage.completion_tokens == 24
    assert client.chat(MESSAGES, seed=100, **SAMPLED).content == contents[1]
    assert [c.content for c in client.chat(MESSAGES, n=3, seed=99, **SAMPLED).choices] == contents


def test_greedy_choices_are_identical(client):
    completion = client.complete(PROMPT, n=2, temperature=0, max_tokens=6, ignore_eos=True)
    assert len(completion.choices) == 2
    assert completion.choices[0].text == completion.choices[1].text


def test_streams_interleave_choices_with_one_finish_each_and_usage_once(client):
    want = [c.text for c in client.complete(PROMPT, n=3, seed=7, **SAMPLED).choices]
    chunks = list(client.complete_stream(PROMPT, n=3, seed=7, **SAMPLED))
    usage = [c for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0] is chunks[-1]
    assert usage[0].usage is not None and usage[0].usage.completion_tokens == 24
    pieces = chunks[:-1]
    assert ["".join(c.text for c in pieces if c.index == i) for i in range(3)] == want
    assert sorted(c.index for c in pieces if c.finish_reason is not None) == [0, 1, 2]
    # A choice's finish is its last chunk.
    for i in range(3):
        assert [c for c in pieces if c.index == i][-1].finish_reason == "length"

    chat = list(client.chat_stream(MESSAGES, n=3, seed=99, **SAMPLED))
    assert chat[-1].usage is not None and chat[-1].usage.completion_tokens == 24
    assert sum(c.usage is not None for c in chat) == 1
    for i in range(3):
        mine = [c for c in chat[:-1] if c.index == i]
        assert [c.role for c in mine] == ["assistant"] + [None] * (len(mine) - 1)
        assert [c.finish_reason for c in mine].count("length") == 1
        assert mine[-1].finish_reason == "length"


SEVERAL = ["alpha bravo charlie delta", "hotel india juliet", "kilo lima mike november oscar"]


def test_several_prompts_answer_in_prompt_order_with_their_own_choices(client):
    """OpenAI's list of prompts: choice j of prompt i is choice i * n + j, equal to the
    single request of that prompt; each prompt counted once in the usage; streamed alike;
    echo starts each choice with its own prompt."""
    singles = [client.complete(p, n=2, seed=11, **SAMPLED) for p in SEVERAL]
    batch = client.complete(SEVERAL, n=2, seed=11, **SAMPLED)
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices] == [c.text for s in singles for c in s.choices]
    assert batch.usage is not None and all(s.usage is not None for s in singles)
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)  # type: ignore[union-attr]
    assert batch.usage.completion_tokens == 6 * 8

    chunks = list(client.complete_stream(SEVERAL, n=2, seed=11, **SAMPLED))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 48
    assert ["".join(c.text for c in chunks[:-1] if c.index == i) for i in range(6)] == [
        c.text for c in batch.choices]

    ids = [client.tokenize(p) for p in SEVERAL]
    scored = client.complete(ids, echo=True, max_tokens=0, logprobs=0)
    assert [c.text for c in scored.choices] == [client.detokenize(t) for t in ids]
    for choice, prompt in zip(scored.choices, ids, strict=True):
        alone = client.complete(prompt, echo=True, max_tokens=0, logprobs=0).choices[0]
        assert len(choice.logprobs) == len(prompt) and choice.logprobs[0].logprob is None
        assert [t.logprob for t in choice.logprobs[1:]] == pytest.approx(
            [t.logprob for t in alone.logprobs[1:]], abs=1e-4)


def _completion(n: int, **fields: object) -> pb.CompletionRequest:
    return pb.CompletionRequest(prompt=struct_pb2.Value(string_value=PROMPT), n=n,
                                **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [0, 129, -1])
def test_n_out_of_range_is_invalid_argument(channel, client, n):
    stub = pb_grpc.GenerationStub(channel)
    with pytest.raises(grpc.RpcError) as error:
        stub.Complete(_completion(n), timeout=30)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "n (choices per request) must be between 1 and 128" in error.value.details()
    with pytest.raises(grpc.RpcError) as error:
        list(stub.ChatCompleteStream(pb.ChatCompletionRequest(
            messages=[chat_message({"role": "user", "content": "hi"})], n=n), timeout=30))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert client.complete(PROMPT, max_tokens=2).finish_reason is not None


def test_seed_without_room_for_the_choices_is_invalid_argument(channel):
    with pytest.raises(grpc.RpcError) as error:
        pb_grpc.GenerationStub(channel).Complete(_completion(2, seed=2**63 - 1), timeout=30)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "seed" in error.value.details() and "n=2" in error.value.details()


def test_cancelling_a_stream_aborts_every_choice(client, channel):
    engine = epb_grpc.EngineStub(channel)
    stream = client.complete_stream(PROMPT, n=4, temperature=1.0, max_tokens=400,
                                    ignore_eos=True)
    seen: set[int] = set()
    for chunk in stream:
        seen.add(chunk.index)
        if len(seen) == 4:
            break
    assert engine.GetLoad(epb.GetLoadRequest()).num_requests_running == 4
    stream.cancel()
    wait_engine_idle(channel)


def test_a_failing_choice_fails_the_request_and_aborts_the_others(client, channel):
    # The replica admits 4 running + 2 waiting: choices 6 and 7 are refused, so the request
    # fails with the overload status and the 6 admitted choices must be aborted.
    with pytest.raises(OverloadedError, match="queue is full"):
        client.complete(PROMPT, n=8, temperature=1.0, max_tokens=400, ignore_eos=True)
    wait_engine_idle(channel)
    assert len(client.complete(PROMPT, n=6, **SAMPLED).choices) == 6


# --------------------------------------------------------------------------- gateway, Envoy


def test_gateway_serves_n_and_keeps_the_choices_on_one_replica(stack, client):
    want = [c.text for c in client.complete(PROMPT, n=2, seed=5, **SAMPLED).choices]
    with Client(stack.gateway, timeout=60) as gateway:
        assert [c.text for c in gateway.complete(PROMPT, n=2, seed=5, **SAMPLED).choices] == want
        chunks = list(gateway.chat_stream(MESSAGES, n=2, **SAMPLED))
        assert sorted(c.index for c in chunks if c.finish_reason) == [0, 1]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16

        before = [finished_requests(r) for r in stack.replicas.values()]
        # Short prompts cache nothing, so only load would decide: without the shared route
        # the four choices would spread over both replicas.
        assert len(gateway.complete("hotel india", n=4, **SAMPLED).choices) == 4

        def served() -> list[float]:
            return sorted(finished_requests(r) - b
                          for r, b in zip(stack.replicas.values(), before, strict=True))

        deadline = time.monotonic() + 5
        while sum(served()) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)  # the replicas count a request just after its last output
        assert served() == [0, 4]

    async def async_chat() -> list[str]:
        async with AsyncClient(stack.gateway, timeout=60) as gateway:
            chat = await gateway.chat(MESSAGES, n=2, seed=99, **SAMPLED)
            return [c.content for c in chat.choices]

    direct = [c.content for c in client.chat(MESSAGES, n=2, seed=99, **SAMPLED).choices]
    assert asyncio.run(async_chat()) == direct


def test_gateway_routes_each_prompt_of_a_request_on_its_own(stack, client):
    """Each prompt's choices stay together (one prompt, one prefix cache), and the request's
    prompts are routed one by one."""
    want = [c.text for c in client.complete(SEVERAL[:2], n=2, seed=5, **SAMPLED).choices]
    with Client(stack.gateway, timeout=60) as gateway:
        before = [finished_requests(r) for r in stack.replicas.values()]
        got = gateway.complete(SEVERAL[:2], n=2, seed=5, **SAMPLED)

        def served() -> list[float]:
            return sorted(finished_requests(r) - b
                          for r, b in zip(stack.replicas.values(), before, strict=True))

        deadline = time.monotonic() + 5
        while sum(served()) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert [c.text for c in got.choices] == want
    assert served() in ([0, 4], [2, 2])  # never one choice of a prompt apart from its twin


def test_openai_sdk_through_envoy_gets_n_choices(stack):
    sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{stack.http_port}/v1", api_key="unused",
                        max_retries=0, timeout=60)
    completion = sdk.completions.create(model="tiny", prompt=PROMPT, n=2, max_tokens=5,
                                        seed=3, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in completion.choices) == [0, 1]
    assert completion.usage is not None and completion.usage.completion_tokens == 10
    chunks = list(sdk.completions.create(model="tiny", prompt=PROMPT, n=2, max_tokens=5,
                                         seed=3, stream=True, extra_body={"ignore_eos": True}))
    streamed = ["".join(c.choices[0].text for c in chunks
                        if c.choices and c.choices[0].index == i) for i in range(2)]
    assert streamed == [c.text for c in sorted(completion.choices, key=lambda c: c.index)]
    several = sdk.completions.create(model="tiny", prompt=SEVERAL, max_tokens=3, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert sorted(c.index for c in several.choices) == [0, 1, 2]
    assert several.usage is not None and several.usage.completion_tokens == 9
