"""Mixture-of-experts models on the disaggregated path: prefill and decode replica
processes per model, KV over real UCX, a gateway in front, exact against Hugging Face.

One suite, started once, serves two architectures side by side: GPT-OSS with MXFP4
experts (sinks, a 16-token sliding window on alternate layers, prompts longer than it) and
Qwen3-MoE (a dense layer between sparse ones). For each: a decode replica told to pull
from the prefill replica returns HF's greedy tokens with KV bytes moved; the gateway's
completion (which picks the prefill replica itself) returns HF's greedy tokens.
"""

from __future__ import annotations

import random
import re
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from protos.tandem.v1 import engine_pb2 as epb
from protos.tandem.v1 import engine_pb2_grpc as epb_grpc
from tandem.client import Client
from tests.hf_reference import hf_greedy
from tests.moe_factory import GPT_OSS_WINDOW, build_tiny_moe_model
from tests.replica_process import (
    ReplicaProcess,
    free_port,
    gateway_started,
    healthy_replicas,
    is_serving,
    launch_replicas,
    stop_all,
    wait_serving,
    wait_until,
)

ARCHITECTURES = ("gpt_oss_mxfp4", "qwen3_moe")
MAX_TOKENS = 8
COMMON = ["--dtype", "float32", "--num-kv-blocks", "256", "--max-num-seqs", "16"]


@dataclass
class ModelSuite:
    model_dir: Path
    prefill: ReplicaProcess
    decode: ReplicaProcess
    gateway: str


@pytest.fixture(scope="module")
def suites(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ModelSuite]]:
    logs = tmp_path_factory.mktemp("moe-serving-logs")
    dirs = {a: build_tiny_moe_model(tmp_path_factory.mktemp(a), a) for a in ARCHITECTURES}
    replicas: dict[str, ReplicaProcess] = {}
    for arch, model_dir in dirs.items():
        replicas |= launch_replicas(model_dir, logs, {
            f"{arch}-prefill": ["--role", "prefill", *COMMON],
            f"{arch}-decode": ["--role", "decode", "--kv-pull-timeout", "10", *COMMON]})
    try:
        with ExitStack() as stack:
            result = {}
            for arch, model_dir in dirs.items():
                metrics_port = free_port()
                prefill, decode = replicas[f"{arch}-prefill"], replicas[f"{arch}-decode"]
                gateway = stack.enter_context(gateway_started(
                    model_dir, logs, [prefill.target, decode.target],
                    ["--prefill-min-uncached-tokens", "1", "--metrics-port", str(metrics_port)],
                    name=f"{arch}-gateway"))
                result[arch] = (ModelSuite(model_dir, prefill, decode, gateway), metrics_port)
            wait_serving(replicas)
            for suite, metrics_port in result.values():
                wait_until(lambda s=suite, p=metrics_port: is_serving(s.gateway)
                           and healthy_replicas(p) == 2,
                           time.monotonic() + 60, "the gateway's view of both replicas", logs)
            yield {arch: suite for arch, (suite, _) in result.items()}
    finally:
        stop_all([], replicas)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 400) for _ in range(n)] for n in (5, GPT_OSS_WINDOW + 9, 50)]


def _pd_generate(suite: ModelSuite, request_id: str, prompt: list[int]) -> tuple[list[int], int]:
    request = epb.GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, prefill_peer=suite.prefill.target,
        sampling_params=epb.SamplingParams(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS,
                                           temperature=0),
        output_options=epb.OutputOptions(return_token_ids=True))
    stub = epb_grpc.EngineStub(grpc.insecure_channel(suite.decode.target))
    responses = list(stub.Generate(request, timeout=120))
    transfer = next((r.kv_transfer for r in responses if r.HasField("kv_transfer")), None)
    assert transfer is not None and transfer.fallback_reason == "", transfer
    return [t for r in responses for t in r.new_token_ids], transfer.blocks_pulled


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_pd_and_gateway_match_hf(suites: dict[str, ModelSuite], arch: str) -> None:
    suite = suites[arch]
    prompts = _prompts(seed=len(arch))
    expected = hf_greedy(suite.model_dir, prompts, MAX_TOKENS)
    for i, (prompt, want) in enumerate(zip(prompts, expected, strict=True)):
        tokens, blocks = _pd_generate(suite, f"{arch}-pd-{i}", prompt)
        assert tokens == want
        assert blocks > 0
    gateway_prompts = _prompts(seed=len(arch) + 100)
    expected = hf_greedy(suite.model_dir, gateway_prompts, MAX_TOKENS)
    pulled_before = _metric(suite.decode.metrics_url, "tandem:kv_transfer_bytes_total")
    with Client(suite.gateway, timeout=120) as client:
        for prompt, want in zip(gateway_prompts, expected, strict=True):
            answer = client.complete(prompt, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS,
                                     temperature=0, return_token_ids=True)
            assert answer.choices[0].token_ids == want
    # The gateway sent them through the prefill replica: the decode replica pulled KV.
    assert _metric(suite.decode.metrics_url, "tandem:kv_transfer_bytes_total") > pulled_before


def test_get_info_describes_the_model(suites: dict[str, ModelSuite]) -> None:
    stub = epb_grpc.EngineStub(grpc.insecure_channel(suites["gpt_oss_mxfp4"].prefill.target))
    summary = list(stub.GetInfo(epb.GetInfoRequest(), timeout=30).model_summary)
    assert summary[0] == ("architecture GptOssForCausalLM: 1 x sliding-window attention "
                          f"({GPT_OSS_WINDOW} tokens), 1 x full attention, attention sinks; "
                          "2 MoE layers of 8 experts, top-2")
    assert "experts" in summary[1] and "MXFP4 packed" in summary[1]
    assert summary[2].startswith("KV cache: 256 blocks of ")
    assert summary[3].startswith("attention backend: torch")
    log = suites["gpt_oss_mxfp4"].prefill.log()
    assert all(line in log for line in summary)


def _metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return sum(float(m.group(1)) for m in
               re.finditer(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M))
