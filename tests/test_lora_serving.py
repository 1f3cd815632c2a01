"""LoRA adapters served by name (``--lora-modules NAME=PATH``), as vLLM serves them.

A P/D suite of real processes (a prefill and a decode replica, the gateway) with two PEFT
adapters: a request whose ``model`` is an adapter's name runs with it on both replicas (the
prefill replica computes the prompt's KV under it, the decode replica continues under it)
and answers what the offline engine answers with that adapter, which the engine tests hold
equal to Hugging Face + PEFT; the base model still answers as before. The model list shows
the adapters, an unknown name is refused with the names that are served, and the gateway
hashes an adapter's prompt blocks as the engines do (apart from the base model's).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from engine_common.llm import LLM
from engine_common.request import Request
from engine_common.sampling_params import SamplingParams
from gateway.snapshot import prompt_block_hashes
from protos.tandem.v1 import engine_pb2, engine_pb2_grpc
from tandem import Client, InvalidRequestError
from tests.model_factory import write_serving_adapters
from tests.openai_http import offline_engine
from tests.replica_process import (
    ReplicaProcess,
    free_port,
    healthy_replicas,
    is_serving,
    launch_replicas,
    spawn_module,
    wait_serving,
    wait_until,
)

# Long enough (32+ tokens) that the gateway sends them through the prefill replica.
PROMPTS = [" ".join(["the river runs"] * 6), " ".join(["once upon a time there"] * 5),
           " ".join(["a story about the sea and"] * 4)]
MAX_TOKENS = 8


@dataclass
class Suite:
    replicas: dict[str, ReplicaProcess]
    gateway: str


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return write_serving_adapters(tiny_llama_dir, tmp_path_factory.mktemp("lora-adapters"))


@pytest.fixture(scope="module")
def offline(tiny_llama_dir: Path, adapters: dict[str, str]) -> LLM:
    return offline_engine(tiny_llama_dir, adapters)


@pytest.fixture(scope="module")
def suite(tiny_llama_dir: Path, adapters: dict[str, str],
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Suite]:
    logs = tmp_path_factory.mktemp("lora-serving-logs")
    lora_args = ["--lora-modules", *(f"{name}={path}" for name, path in adapters.items())]
    common = ["--dtype", "float32", "--kv-cache-memory", "16MiB", "--served-model-name", "tiny",
              "--log-level", "WARNING", *lora_args]
    # The gateway starts with the replicas (it retries them until they answer).
    replicas = launch_replicas(tiny_llama_dir, logs, {
        "prefill": [*common, "--role", "prefill"], "decode": [*common, "--role", "decode"]})
    port, metrics_port = free_port(), free_port()
    gateway: subprocess.Popen[bytes] | None = None
    try:
        gateway = spawn_module(logs, "gateway", [
            "gateway", "--model", str(tiny_llama_dir), "--served-model-name", "tiny",
            "--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics_port),
            *lora_args, *[a for r in replicas.values() for a in ("--replica", r.target)]])
        wait_serving(replicas)
        wait_until(lambda: is_serving(f"127.0.0.1:{port}") and healthy_replicas(metrics_port)
                   == 2, time.monotonic() + 60, "the gateway's view of both replicas", logs)
        time.sleep(1.0)  # load reports in: P/D routes
        yield Suite(replicas, f"127.0.0.1:{port}")
    finally:
        if gateway is not None and gateway.poll() is None:
            os.killpg(gateway.pid, signal.SIGKILL)
            gateway.wait(10)
        for replica in replicas.values():
            replica.kill()


def greedy(offline: LLM, lora_name: str | None) -> list[str]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [out.text for out in offline.generate(PROMPTS, params, lora_name=lora_name)]


def test_each_adapter_answers_by_name_through_pd(suite: Suite, offline: LLM) -> None:
    want = {name: greedy(offline, name) for name in ("sql", "poet")}
    want["tiny"] = greedy(offline, None)
    assert len({tuple(texts) for texts in want.values()}) == 3  # the adapters change text
    transfers_before = _metric(suite.replicas["decode"], "tandem:kv_transfer_bytes_total")
    with Client(suite.gateway, timeout=60) as client:
        for model, texts in want.items():
            for prompt, text in zip(PROMPTS, texts, strict=True):
                answer = client.complete(prompt, model=model, max_tokens=MAX_TOKENS,
                                         temperature=0, ignore_eos=True)
                assert (answer.text, answer.model) == (text, model), (model, prompt)
        # Streamed, and as a chat: the same adapter on the same path.
        streamed = "".join(c.text for c in client.complete_stream(
            PROMPTS[0], model="poet", max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
        assert streamed == want["poet"][0]
    # The prompts' KV came from the prefill replica (computed under the adapter there).
    assert _metric(suite.replicas["decode"], "tandem:kv_transfer_bytes_total") > \
        transfers_before


def test_the_cli_generates_with_an_adapter(suite: Suite, offline: LLM) -> None:
    """``tandem generate --model ADAPTER`` streams what the engine gives with it."""
    want = offline.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=6),
                            lora_name="sql")[0].text
    result = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "generate", PROMPTS[1], "--target", suite.gateway,
         "--model", "sql", "--max-tokens", "6"],
        capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout == want + "\n"


def test_models_lists_the_adapters_and_unknown_names_are_refused(suite: Suite) -> None:
    for target in (suite.gateway, suite.replicas["decode"].target):
        with Client(target, timeout=30) as client:
            listed = client.models()
            assert [(m.id, m.parent) for m in listed] == [
                ("tiny", None), ("poet", "tiny"), ("sql", "tiny")]
            assert [client.model(m.id) for m in listed] == listed
            with pytest.raises(InvalidRequestError, match="The model 'sq1' does not exist"):
                client.model("sq1")
            with pytest.raises(InvalidRequestError, match="'sq1' is not served here.*"
                                                          "LoRA adapter: 'poet', 'sql'"):
                client.complete("hi", model="sq1", max_tokens=2)
    # The internal Engine service (gateway to replica, decode to prefill) checks too.
    sampling = engine_pb2.SamplingParams(max_tokens=2)
    with grpc.insecure_channel(suite.replicas["decode"].target) as channel:
        with pytest.raises(grpc.RpcError) as generate:
            list(engine_pb2_grpc.EngineStub(channel).Generate(engine_pb2.GenerateRequest(
                request_id="bad-lora", prompt_token_ids=[5, 6, 7], sampling_params=sampling,
                lora_name="sq1"), timeout=30))
    with grpc.insecure_channel(suite.replicas["prefill"].target) as channel:
        with pytest.raises(grpc.RpcError) as prefill:
            list(engine_pb2_grpc.EngineStub(channel).Prefill(engine_pb2.PrefillRequest(
                request_id="bad-lora", prompt_token_ids=[5, 6, 7], sampling_params=sampling,
                lora_name="sq1"), timeout=30))
    for refused in (generate.value, prefill.value):
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "LoRA adapter 'sq1' is not loaded on this replica (loaded: poet, sql)" in \
            refused.details()


def test_an_adapter_hashes_its_blocks_apart_and_alike_everywhere() -> None:
    """The gateway's chain for an adapter's prompt is the engine's (so routing finds the
    replica holding it) and differs from the base model's and another adapter's."""
    tokens = list(range(3, 3 + 40))
    engine = Request("r", tokens, SamplingParams(), block_size=16, lora_name="sql",
                     cache_salt="tenant")
    gateway = prompt_block_hashes(tokens, 16, "tenant", "sql")
    assert engine.block_hashes == gateway and len(gateway) == 2
    assert gateway != prompt_block_hashes(tokens, 16, "tenant")
    assert gateway != prompt_block_hashes(tokens, 16, "tenant", "poet")
    assert gateway != prompt_block_hashes(tokens, 16, "", "sql")
    # A salt that spells an adapter's keys is still no adapter.
    assert prompt_block_hashes(tokens, 16, "lora") != prompt_block_hashes(tokens, 16, "", "")


def _metric(replica: ReplicaProcess, name: str) -> float:
    text = urllib.request.urlopen(replica.metrics_url, timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name))
