"""LoRA adapters loaded and unloaded while the suite serves (vLLM's runtime LoRA API).

A P/D suite of real processes (a prefill and a decode replica, the gateway, Envoy), all run
with ``--allow-runtime-lora-updating`` and no adapter at start: ``LoadLoraAdapter`` through
the gateway loads an adapter on every replica, and its requests then answer what the offline
engine answers with the adapter loaded at start (which the engine tests hold equal to Hugging
Face + PEFT), through P/D; over HTTP too (POST /v1/load_lora_adapter). A load is all or
nothing: when one replica refuses, those that loaded it unload it again. Unloading lets a
request running with the adapter finish with it and refuses new ones. The gateway gives its
adapters to a replica that restarts (which forgot them), and takes an adapter it unloaded
from a replica that was away at the time. Each refusal has its status and a message naming
what to do. ``tandem lora sync`` against the gateway rolls a file's adapters out over the
suite.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from deploy.lora_sync import render_config
from engine_common.llm import LLM
from engine_common.sampling_params import SamplingParams
from gateway.lora_rollout import ClusterLoraUpdates, ReplicaRefusal
from gateway.registry import ReplicaRegistry
from protos.tandem.v1 import engine_pb2, engine_pb2_grpc
from services.frontend.served_model import ServedModel
from tandem import Client, InvalidRequestError, TandemError
from tests.model_factory import write_serving_adapters
from tests.openai_http import offline_engine
from tests.replica_process import (
    ReplicaProcess,
    envoy_answers,
    free_port,
    healthy_replicas,
    is_serving,
    launch_replicas,
    restart_replica,
    spawn_module,
    stop_all,
    wait_serving,
    wait_until,
)

# Long enough (32+ tokens) that the gateway sends it through the prefill replica.
PROMPT = " ".join(["the river runs"] * 6)
MAX_TOKENS = 8
COMMON = ["--dtype", "float32", "--kv-cache-memory", "16MiB", "--served-model-name", "tiny",
          "--log-level", "WARNING"]
RUNTIME = ["--allow-runtime-lora-updating"]


@dataclass
class Suite:
    model_dir: Path
    logs: Path
    replicas: dict[str, ReplicaProcess]
    gateway: str
    http_port: int

    def adapters_of(self, name: str) -> list[str]:
        with grpc.insecure_channel(self.replicas[name].target) as channel:
            info = engine_pb2_grpc.EngineStub(channel).GetInfo(engine_pb2.GetInfoRequest(),
                                                              timeout=10)
        return list(info.lora_adapters)

    def post(self, path: str, body: dict[str, object]) -> tuple[int, dict[str, Any]]:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.http_port}{path}", data=json.dumps(body).encode(),
            headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return write_serving_adapters(tiny_llama_dir, tmp_path_factory.mktemp("runtime-lora-adapters"))


@pytest.fixture(scope="module")
def offline(tiny_llama_dir: Path, adapters: dict[str, str]) -> LLM:
    return offline_engine(tiny_llama_dir, adapters)


def greedy(offline: LLM, lora_name: str | None, max_tokens: int = MAX_TOKENS) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return offline.generate([PROMPT], params, lora_name=lora_name)[0].text


@pytest.fixture(scope="module")
def suite(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Suite]:
    logs = tmp_path_factory.mktemp("runtime-lora-logs")
    # The gateway and Envoy start with the replicas (they retry their upstreams).
    replicas = launch_replicas(tiny_llama_dir, logs, {
        "prefill": [*COMMON, *RUNTIME, "--role", "prefill"],
        "decode": [*COMMON, *RUNTIME, "--role", "decode", "--max-loras", "2"],
        # Not behind the gateway: a replica that keeps its adapters fixed.
        "fixed": [*COMMON, "--role", "both"]})
    gateway_port, metrics_port, http_port = free_port(), free_port(), free_port()
    processes = []
    try:
        processes.append(spawn_module(logs, "gateway", [
            "gateway", "--model", str(tiny_llama_dir), "--served-model-name", "tiny",
            "--host", "127.0.0.1", "--port", str(gateway_port), "--metrics-port",
            str(metrics_port), *RUNTIME,
            "--replica", replicas["prefill"].target, "--replica", replicas["decode"].target]))
        processes.append(spawn_module(logs, "envoy", [
            "deploy.envoy_runner", "--http-port", str(http_port), "--upstream",
            f"127.0.0.1:{gateway_port}", "--concurrency", "1"]))
        wait_serving(replicas)
        deadline = time.monotonic() + 120
        wait_until(lambda: is_serving(f"127.0.0.1:{gateway_port}"), deadline, "gateway", logs)
        wait_until(lambda: envoy_answers(http_port), deadline, "envoy", logs)
        wait_until(lambda: healthy_replicas(metrics_port) == 2, deadline,
                   "the gateway's view of both replicas", logs)
        time.sleep(1.0)  # load reports in: P/D routes
        yield Suite(tiny_llama_dir, logs, replicas, f"127.0.0.1:{gateway_port}", http_port)
    finally:
        stop_all(processes, replicas)


def test_a_loaded_adapter_serves_on_every_replica_through_pd(
        suite: Suite, adapters: dict[str, str], offline: LLM) -> None:
    with Client(suite.gateway, timeout=60) as client:
        assert client.load_lora_adapter("sql", adapters["sql"]) == ["sql"]
        assert suite.adapters_of("prefill") == suite.adapters_of("decode") == ["sql"]
        assert [(m.id, m.parent) for m in client.models()] == [("tiny", None), ("sql", "tiny")]
        transfers_before = _metric(suite.replicas["decode"], "tandem:kv_transfer_bytes_total")
        for model, lora_name in (("sql", "sql"), ("tiny", None)):
            answer = client.complete(PROMPT, model=model, max_tokens=MAX_TOKENS,
                                     temperature=0, ignore_eos=True)
            assert (answer.text, answer.model) == (greedy(offline, lora_name), model)
        assert greedy(offline, "sql") != greedy(offline, None)  # the adapter changes text
        # The prompt's KV came from the prefill replica, computed there under the adapter.
        assert _metric(suite.replicas["decode"], "tandem:kv_transfer_bytes_total") > \
            transfers_before
        # The decode replica reports its cap (--max-loras) as vLLM's metric does.
        assert 'max_lora="2"' in _metrics_text(suite.replicas["decode"])

        with pytest.raises(TandemError) as exists:
            client.load_lora_adapter("sql", adapters["poet"])
        assert exists.value.code == grpc.StatusCode.ALREADY_EXISTS
        assert "'sql' is already served by every replica" in exists.value.details
        assert client.unload_lora_adapter("sql") == []
        assert suite.adapters_of("prefill") == suite.adapters_of("decode") == []
        with pytest.raises(InvalidRequestError, match="'sql' is not served here"):
            client.complete(PROMPT, model="sql", max_tokens=2)


def test_refusals_name_the_problem_and_serving_goes_on(
        suite: Suite, adapters: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "PREFIX_TUNING"}))
    refusals = {
        ("load", "", adapters["sql"]): (grpc.StatusCode.INVALID_ARGUMENT, "lora_name is required"),
        ("load", "x", ""): (grpc.StatusCode.INVALID_ARGUMENT, "lora_path is required"),
        ("load", "tiny", adapters["sql"]): (grpc.StatusCode.INVALID_ARGUMENT,
                                            "'tiny' is the base model's name"),
        ("load", "x", str(tmp_path / "missing")): (grpc.StatusCode.INVALID_ARGUMENT,
                                                   "missing"),
        ("load", "x", str(tmp_path)): (grpc.StatusCode.INVALID_ARGUMENT, "PREFIX_TUNING"),
        ("unload", "nope", ""): (grpc.StatusCode.NOT_FOUND,
                                 "no replica serves LoRA adapter 'nope'"),
    }
    with Client(suite.gateway, timeout=60) as client:
        for (action, name, path), (code, message) in refusals.items():
            with pytest.raises(TandemError) as refused:
                if action == "load":
                    client.load_lora_adapter(name, path)
                else:
                    client.unload_lora_adapter(name)
            assert refused.value.code == code, (action, name, path)
            assert message in refused.value.details, refused.value.details
        assert suite.adapters_of("prefill") == suite.adapters_of("decode") == []
        assert client.complete(PROMPT, max_tokens=2).finish_reason == "length"
    # A server started without --allow-runtime-lora-updating says how to turn it on, on the
    # public API and on the internal one.
    with Client(suite.replicas["fixed"].target, timeout=30) as client:
        with pytest.raises(TandemError, match="--allow-runtime-lora-updating") as off:
            client.load_lora_adapter("sql", adapters["sql"])
        assert off.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with grpc.insecure_channel(suite.replicas["fixed"].target) as channel:
        with pytest.raises(grpc.RpcError) as internal:
            engine_pb2_grpc.EngineStub(channel).UnloadLora(
                engine_pb2.UnloadLoraRequest(lora_name="sql"), timeout=30)
    assert internal.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_a_load_one_replica_refuses_is_taken_back_everywhere(
        suite: Suite, adapters: dict[str, str]) -> None:
    """The gateway's rollout over the prefill replica (which loads) and the fixed one (which
    refuses): the prefill replica unloads it again, and the refusal says which replica."""

    async def load() -> ReplicaRefusal:
        registry = ReplicaRegistry([suite.replicas["prefill"].target,
                                    suite.replicas["fixed"].target])
        await registry.start()
        try:
            assert await registry.wait_until(lambda reg: len(reg.routable()) == 2, 30)
            model = ServedModel.for_directory(str(suite.model_dir), 256, "tiny")
            rollout = ClusterLoraUpdates(registry, lambda: model, lambda: None)
            with pytest.raises(ReplicaRefusal) as refused:
                await rollout.load("poet", adapters["poet"])
            assert rollout.runtime_adapters == {}
            return refused.value
        finally:
            await registry.stop()

    refusal = asyncio.run(load())
    assert refusal.code == grpc.StatusCode.FAILED_PRECONDITION
    assert f"replica {suite.replicas['fixed'].target}: FAILED_PRECONDITION" in refusal.message
    assert suite.adapters_of("prefill") == []


def test_over_http_as_vllm_serves_it(suite: Suite, adapters: dict[str, str],
                                     offline: LLM) -> None:
    status, body = suite.post("/v1/load_lora_adapter",
                              {"lora_name": "poet", "lora_path": adapters["poet"]})
    assert (status, body["lora_adapters"]) == (200, ["poet"]), body
    assert "'poet' loaded on 2 replicas" in str(body["message"])
    status, body = suite.post("/v1/load_lora_adapter",
                              {"lora_name": "poet", "lora_path": adapters["poet"]})
    assert status == 409, body
    status, completion = suite.post("/v1/completions", {
        "model": "poet", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True})
    assert status == 200, completion
    assert completion["choices"][0]["text"] == greedy(offline, "poet")
    status, body = suite.post("/v1/unload_lora_adapter", {"lora_name": "poet"})
    assert (status, body["lora_adapters"]) == (200, []), body
    status, body = suite.post("/v1/unload_lora_adapter", {"lora_name": "poet"})
    assert status == 404, body


def test_unloading_lets_a_running_request_finish_with_the_adapter(
        suite: Suite, adapters: dict[str, str], offline: LLM) -> None:
    long = 400  # tokens: still running when the unload arrives
    want = greedy(offline, "sql", long)
    with Client(suite.gateway, timeout=120) as client:
        client.load_lora_adapter("sql", adapters["sql"])
        stream = iter(client.complete_stream(PROMPT, model="sql", max_tokens=long,
                                             temperature=0, ignore_eos=True))
        first = next(stream)
        assert client.unload_lora_adapter("sql") == []
        with pytest.raises(InvalidRequestError, match="'sql' is not served here"):
            client.complete(PROMPT, model="sql", max_tokens=2)
        rest = list(stream)
    assert first.text + "".join(chunk.text for chunk in rest) == want
    assert rest[-1].usage is not None and rest[-1].usage.completion_tokens == long


def test_a_restarted_replica_gets_the_gateways_adapters_back(
        suite: Suite, adapters: dict[str, str], offline: LLM) -> None:
    with Client(suite.gateway, timeout=60) as client:
        client.load_lora_adapter("poet", adapters["poet"])
        suite.replicas["decode"] = restart_replica(
            suite.replicas["decode"], suite.model_dir, suite.logs, "decode",
            [*COMMON, *RUNTIME, "--role", "decode"])
        wait_until(lambda: suite.adapters_of("decode") == ["poet"], time.monotonic() + 30,
                   "the adapter on the restarted replica", suite.logs)
        answer = client.complete(PROMPT, model="poet", max_tokens=MAX_TOKENS, temperature=0,
                                 ignore_eos=True)
        assert answer.text == greedy(offline, "poet")
        client.unload_lora_adapter("poet")


def test_a_replica_away_during_an_unload_loses_the_adapter_on_return(
        suite: Suite, adapters: dict[str, str]) -> None:
    """The decode replica is down while the gateway unloads an adapter, and comes back
    serving it (its flags load it at start): the gateway unloads it there too."""
    with Client(suite.gateway, timeout=60) as client:
        client.load_lora_adapter("sql", adapters["sql"])
        suite.replicas["decode"].kill()
        time.sleep(1.0)  # the gateway's health watch sees it go
        served = client.unload_lora_adapter("sql")
    assert served == [] and suite.adapters_of("prefill") == []
    suite.replicas["decode"] = restart_replica(
        suite.replicas["decode"], suite.model_dir, suite.logs, "decode",
        [*COMMON, *RUNTIME, "--role", "decode", "--lora-modules", f"sql={adapters['sql']}"])
    wait_until(lambda: suite.adapters_of("decode") == [], time.monotonic() + 30,
               "the adapter unloaded from the returning replica", suite.logs)


def test_the_cli_loads_and_unloads(suite: Suite, adapters: dict[str, str]) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "deploy.cli", "lora", *args,
                               "--target", suite.gateway],
                              capture_output=True, text=True, timeout=120)

    loaded = cli("load", "sql", adapters["sql"])
    assert (loaded.returncode, loaded.stdout) == (0, "LoRA adapters served: sql\n"), loaded
    again = cli("load", "sql", adapters["sql"])
    assert again.returncode == 1 and "ALREADY_EXISTS" in again.stderr
    unloaded = cli("unload", "sql")
    assert (unloaded.returncode, unloaded.stdout) == (0, "LoRA adapters served: none\n")


def test_the_syncer_rolls_a_file_out_over_the_suite(suite: Suite, adapters: dict[str, str],
                                                    tmp_path: Path) -> None:
    """``tandem lora sync`` against the gateway: every replica follows the file."""
    config = tmp_path / "adapters.yaml"

    def sync() -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "deploy.cli", "lora", "sync", "--once",
                               "--config", str(config), "--target", suite.gateway],
                              capture_output=True, text=True, timeout=120)

    config.write_text(render_config({"poet": adapters["poet"]}))
    loaded = sync()
    assert (loaded.returncode, loaded.stdout) == (0, "loaded: poet; unloaded: none\n"), loaded
    assert suite.adapters_of("prefill") == suite.adapters_of("decode") == ["poet"]
    config.write_text(render_config({}, frozenset({"poet"})))
    unloaded = sync()
    assert (unloaded.returncode, unloaded.stdout) == (0, "loaded: none; unloaded: poet\n")
    assert suite.adapters_of("prefill") == suite.adapters_of("decode") == []


def _metrics_text(replica: ReplicaProcess) -> str:
    return urllib.request.urlopen(replica.metrics_url, timeout=5).read().decode()


def _metric(replica: ReplicaProcess, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in _metrics_text(replica).splitlines()
               if line.startswith(name))
