"""Mixture-of-experts models on every serving path, exact against Hugging Face float32.

Started once for the module, all real processes on loopback:

- GPT-OSS with MXFP4 experts (sinks, a 16-token sliding window on alternate layers, YaRN)
  under the real ``tandem up`` (a prefill and a decode replica, the gateway, Envoy): a
  decode replica told to pull from the prefill replica (KV over UCX), the gateway's gRPC
  API (which sends long prompts through the prefill replica itself) and Envoy's HTTP
  (gRPC-JSON transcoding) with the real ``openai`` SDK, streamed and not, each return HF's
  greedy tokens for prompts longer than the window;
- Mixtral with a 16-token window on every layer (its blocks behind the window released as
  it runs) on a prefill and a decode replica: P/D of prompts several windows long is exact;
  and its decode replica, told to pull from GPT-OSS's prefill replica (the same model
  directory name, other per-layer KV shapes), refuses the KV by its layout fingerprint,
  recomputes the prompt and counts the fallback.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protos.tandem.v1 import engine_pb2 as epb
from protos.tandem.v1 import engine_pb2_grpc as epb_grpc
from tandem.client import Client
from tests.hf_reference import hf_greedy
from tests.moe_factory import GPT_OSS_WINDOW, MIXTRAL_WINDOW, build_tiny_moe_model
from tests.replica_process import (
    REPO_ROOT,
    ReplicaProcess,
    free_port,
    free_ports,
    launch_replicas,
    stop_all,
    wait_serving,
    wait_until,
)

pytestmark = pytest.mark.timeout(400)
MAX_TOKENS = 8
SERVED = "gpt-oss-tiny"
ENGINE = ["--dtype", "float32", "--num-kv-blocks", "256", "--max-num-seqs", "16",
          "--kv-pull-timeout", "10"]


@dataclass
class Suite:
    oss_dir: Path
    mixtral_dir: Path
    base_port: int  # tandem up's replicas: prefill-0 here, decode-1 next
    gateway_port: int
    metrics_base: int  # prefill-0, decode-1, the gateway
    http_port: int
    output: Path
    mixtral: dict[str, ReplicaProcess]

    @property
    def oss_prefill(self) -> str:
        return f"127.0.0.1:{self.base_port}"

    @property
    def oss_decode(self) -> str:
        return f"127.0.0.1:{self.base_port + 1}"

    def metric(self, port: int, name: str, **labels: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            text = answer.read().decode()
        return sum(sample.value for family in text_string_to_metric_families(text)
                   for sample in family.samples if sample.name == name
                   and all(sample.labels.get(k) == v for k, v in labels.items()))


def _up_command(model: Path, suite_ports: tuple[int, int, int, int], logs: Path) -> list[str]:
    base, gateway, metrics, http = suite_ports
    return [sys.executable, "-m", "deploy.cli", "up", "--model", str(model),
            "--served-model-name", SERVED, "--prefill", "1", "--decode", "1", "--envoy",
            "--no-suite-tls", "--base-port", str(base), "--gateway-port", str(gateway),
            "--metrics-base-port", str(metrics), "--http-port", str(http),
            "--log-dir", str(logs), *ENGINE]


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Suite]:
    root = tmp_path_factory.mktemp("moe-serving")
    logs = root / "logs"
    logs.mkdir()
    # The same directory name: the two layouts' fingerprints differ only by KV shapes.
    oss_dir = build_tiny_moe_model(root / "oss" / "model", "gpt_oss_mxfp4")
    mixtral_dir = build_tiny_moe_model(root / "mixtral" / "model", "mixtral")
    ports = (free_ports(2), free_port(), free_ports(4), free_port())
    output = root / "up.out"
    with output.open("wb") as out:
        up = subprocess.Popen(_up_command(oss_dir, ports, root / "up-logs"), cwd=REPO_ROOT,
                              stdout=out, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    mixtral = launch_replicas(mixtral_dir, logs, {
        "mixtral-prefill": ["--role", "prefill", *ENGINE],
        "mixtral-decode": ["--role", "decode", *ENGINE]})
    try:
        wait_serving(mixtral)
        wait_until(lambda: "all healthy after" in output.read_text(errors="replace")
                   or up.poll() is not None, time.monotonic() + 240, "tandem up", logs)
        assert up.poll() is None, output.read_text(errors="replace")[-3000:]
        yield Suite(oss_dir, mixtral_dir, *ports, output, mixtral)
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)  # the supervisor stops its children
        stop_all([], mixtral)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 400) for _ in range(n)] for n in lengths]


def _pd_generate(decode: str, prefill: str, request_id: str,
                 prompt: list[int]) -> tuple[list[int], epb.KvTransferReport]:
    request = epb.GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, prefill_peer=prefill,
        sampling_params=epb.SamplingParams(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS,
                                           temperature=0),
        output_options=epb.OutputOptions(return_token_ids=True))
    with grpc.insecure_channel(decode) as channel:
        responses = list(epb_grpc.EngineStub(channel).Generate(request, timeout=120))
    transfer = next((r.kv_transfer for r in responses if r.HasField("kv_transfer")), None)
    assert transfer is not None
    return [t for r in responses for t in r.new_token_ids], transfer


def test_gpt_oss_pd_pulls_the_prompts_kv_and_matches_hf(suite: Suite) -> None:
    prompts = _prompts(1, (5, GPT_OSS_WINDOW + 9, 50))
    expected = hf_greedy(suite.oss_dir, prompts, MAX_TOKENS)
    for i, (prompt, want) in enumerate(zip(prompts, expected, strict=True)):
        tokens, transfer = _pd_generate(suite.oss_decode, suite.oss_prefill, f"pd-{i}", prompt)
        assert transfer.fallback_reason == "" and transfer.blocks_pulled > 0, transfer
        assert tokens == want


def test_gpt_oss_through_the_gateway_and_envoy_with_the_openai_sdk(suite: Suite) -> None:
    """Prompts past the gateway's prefill threshold (32 uncached tokens): each goes through
    the prefill replica, and the decode replica pulls its KV."""
    prompts = _prompts(2, (40, 57, 45))
    expected = hf_greedy(suite.oss_dir, prompts, MAX_TOKENS)
    decode_metrics, gateway_metrics = suite.metrics_base + 1, suite.metrics_base + 2
    pulled = suite.metric(decode_metrics, "tandem:kv_transfer_bytes_total")
    hops = suite.metric(gateway_metrics, "tandem:gateway_routing_decisions_total",
                        pd="prefill_hop")
    with Client(f"127.0.0.1:{suite.gateway_port}", timeout=120) as sdk:
        answer = sdk.complete(prompts[0], max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS,
                              temperature=0, return_token_ids=True)
        assert answer.choices[0].token_ids == expected[0]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{suite.http_port}/v1",
                           api_key="unused", max_retries=0, timeout=120)
    extra = {"min_tokens": MAX_TOKENS, "return_token_ids": True}
    completion = client.completions.create(model=SERVED, prompt=prompts[1],
                                           max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body=extra)
    assert (completion.choices[0].model_extra or {})["token_ids"] == expected[1]
    assert completion.usage is not None and completion.usage.prompt_tokens == len(prompts[1])
    chunks = [c for c in client.completions.create(
        model=SERVED, prompt=prompts[2], max_tokens=MAX_TOKENS, temperature=0, stream=True,
        extra_body=extra) if c.choices]
    assert [t for c in chunks for t in (c.choices[0].model_extra or {})["token_ids"]] == (
        expected[2])
    assert suite.metric(gateway_metrics, "tandem:gateway_routing_decisions_total",
                        pd="prefill_hop") >= hops + 3
    assert suite.metric(decode_metrics, "tandem:kv_transfer_bytes_total") > pulled


def test_mixtral_pd_of_prompts_longer_than_its_window_matches_hf(suite: Suite) -> None:
    prompts = _prompts(3, (MIXTRAL_WINDOW + 3, 3 * MIXTRAL_WINDOW + 5))
    expected = hf_greedy(suite.mixtral_dir, prompts, MAX_TOKENS)
    prefill, decode = suite.mixtral["mixtral-prefill"], suite.mixtral["mixtral-decode"]
    for i, (prompt, want) in enumerate(zip(prompts, expected, strict=True)):
        tokens, transfer = _pd_generate(decode.target, prefill.target, f"mix-{i}", prompt)
        assert transfer.fallback_reason == "" and transfer.blocks_pulled > 0, transfer
        assert tokens == want


def test_a_decode_replica_of_another_kv_layout_refuses_the_kv_and_recomputes(
        suite: Suite) -> None:
    """Mixtral's decode replica named GPT-OSS's prefill replica as its peer: the layouts
    (same model name, dtype and block size; other head size) differ, so no byte moves, the
    fallback is counted and the decode replica computes the prompt with its own model (the
    first token is the prefill replica's: HF Mixtral continues from it)."""
    decode = suite.mixtral["mixtral-decode"]
    before = suite.metric(decode.metrics_port, "tandem:kv_transfer_fallbacks_total")
    prompt = _prompts(4, (40,))[0]
    tokens, transfer = _pd_generate(decode.target, suite.oss_prefill, "mismatch", prompt)
    assert transfer.fallback_reason == "layout_mismatch" and transfer.blocks_pulled == 0
    assert suite.metric(decode.metrics_port, "tandem:kv_transfer_fallbacks_total") == before + 1
    want = hf_greedy(suite.mixtral_dir, [prompt + tokens[:1]], MAX_TOKENS - 1)[0]
    assert tokens[1:] == want


def test_get_info_and_the_log_describe_the_model(suite: Suite) -> None:
    with grpc.insecure_channel(suite.oss_prefill) as channel:
        info = epb_grpc.EngineStub(channel).GetInfo(epb.GetInfoRequest(), timeout=30)
    summary = list(info.model_summary)
    assert summary[0] == ("architecture GptOssForCausalLM: 1 x sliding-window attention "
                          f"({GPT_OSS_WINDOW} tokens), 1 x full attention, attention sinks; "
                          "2 MoE layers of 8 experts, top-2")
    assert "experts" in summary[1] and "MXFP4 packed" in summary[1]
    assert summary[2].startswith("KV cache: 256 blocks of ")
    assert summary[3].startswith("attention backend: torch")
    log = (suite.output.parent / "up-logs" / "prefill-0.log").read_text(errors="replace")
    assert all(line in log for line in summary)
