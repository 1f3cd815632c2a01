"""The HTTP edge the end-to-end tests run against, and the chat data they share.

``running_stack`` starts real processes on loopback: a prefill and a decode replica on a tiny
model, the gateway in front of them and Envoy (``deploy.envoy_runner``) in front of the
gateway. The decode replica admits one request at a time and the gateway tries one replica,
so that overload is easy to provoke. ``offline_engine`` is the same model in process, whose
greedy text the served one must equal; the tools, schema and messages are the function-calling
conversation both the chat and the Responses tests send.
"""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
from google.protobuf import json_format
from prometheus_client.parser import text_string_to_metric_families

from engine_common.config import CacheConfig, EngineConfig, ModelSettings
from engine_common.llm import LLM
from engine_common.sampling_params import SamplingParams
from protos.tandem.v1 import generation_pb2
from services.frontend.tools.plan import tool_plan
from tests.replica_process import (
    ReplicaProcess,
    envoy_answers,
    free_port,
    healthy_replicas,
    is_serving,
    launch_replicas,
    spawn_module,
    stop_all,
    wait_serving,
    wait_until,
)


@dataclass
class Stack:
    replicas: dict[str, ReplicaProcess]
    gateway: str
    gateway_metrics_port: int
    http_port: int
    logs: Path

    def prefill_hops(self) -> float:
        url = f"http://127.0.0.1:{self.gateway_metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        return sum(sample.value for family in text_string_to_metric_families(text)
                   for sample in family.samples
                   if sample.name == "tandem:gateway_routing_decisions_total"
                   and sample.labels.get("pd") == "prefill_hop")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key="unused", max_retries=0,
                             timeout=120)


def http_status(port: int, path: str) -> int:
    """The status of ``GET path`` on loopback ``port`` (0 when nothing answers)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return 0


@contextmanager
def running_stack(model_dir: Path, logs: Path) -> Iterator[Stack]:
    """The cluster, up until the block ends; every process stopped after it."""
    common = ["--dtype", "float32", "--kv-cache-memory", "16MiB", "--served-model-name", "tiny",
              "--log-level", "WARNING"]
    # Every process starts at once (the gateway and Envoy retry their upstreams until they
    # answer), so that their imports overlap; the waits below say when the whole is ready.
    replicas = launch_replicas(model_dir, logs, {
        "prefill": [*common, "--role", "prefill"],
        "decode": [*common, "--role", "decode", "--max-num-seqs", "1", "--max-waiting", "0"],
    })
    gateway_port, gateway_metrics_port, http_port = free_port(), free_port(), free_port()
    processes: list[subprocess.Popen[bytes]] = []

    def spawn(name: str, argv: list[str]) -> None:
        processes.append(spawn_module(logs, name, argv))

    try:
        spawn("gateway", ["gateway", "--model", str(model_dir), "--served-model-name",
                          "tiny", "--host", "127.0.0.1", "--port", str(gateway_port),
                          "--metrics-port", str(gateway_metrics_port), "--max-attempts", "1",
                          *[a for r in replicas.values() for a in ("--replica", r.target)]])
        spawn("envoy", ["deploy.envoy_runner", "--http-port", str(http_port), "--upstream",
                        f"127.0.0.1:{gateway_port}", "--upstream-metrics",
                        f"127.0.0.1:{gateway_metrics_port}", "--concurrency", "1"])
        wait_serving(replicas)
        deadline = time.monotonic() + 120
        wait_until(lambda: is_serving(f"127.0.0.1:{gateway_port}"), deadline, "gateway", logs)
        wait_until(lambda: envoy_answers(http_port), deadline, "envoy", logs)
        # /health: Envoy's own health check of the gateway says a decode replica is ready.
        wait_until(lambda: http_status(http_port, "/health") == 200, deadline, "envoy /health",
                   logs)
        wait_until(lambda: healthy_replicas(gateway_metrics_port) == len(replicas), deadline,
                   "the gateway's view of every replica", logs)
        time.sleep(1.0)  # load reports in
        yield Stack(replicas, f"127.0.0.1:{gateway_port}", gateway_metrics_port, http_port, logs)
    finally:
        stop_all(processes, replicas)


def offline_engine(model_dir: Path, lora_modules: dict[str, str] | None = None) -> LLM:
    """The engine the cluster's replicas run, in process: greedy text to compare with;
    ``lora_modules`` (name -> adapter directory) served from the start."""
    return LLM(EngineConfig(model=str(model_dir), dtype="float32",
                            cache=CacheConfig(num_gpu_blocks_override=512),
                            model_settings=ModelSettings(lora_modules=lora_modules or {})))


CITY_SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]},
                                               "days": {"type": "integer"}},
               "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"enum": ["Oslo", "Lima"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
TOOL_MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]


def expected_tool_text(offline: LLM, tool_choice: Any, max_tokens: int = 48,
                       **extra: Any) -> str:
    """The offline engine's greedy text under the schema a forced call is generated with, on
    the prompt the replica renders (the tiny model's template, with the tools)."""
    request = generation_pb2.ChatCompletionRequest()
    json_format.ParseDict({"messages": TOOL_MESSAGES, "tools": [WEATHER, CLOCK],
                           "tool_choice": tool_choice, **extra}, request)
    plan = tool_plan(request)
    prompt = offline.inputs.tokenize_chat(TOOL_MESSAGES, plan.tools)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                            structured_output=plan.constraint())
    return offline.generate([prompt], params)[0].text
