"""Mixture-of-experts models on every serving path, exact against Hugging Face float32.

Started once for the module, all real processes on loopback: one real ``tandem up`` per
architecture (a prefill and a decode replica, the gateway, Envoy), all three started side by
side (their imports and loads overlap):

- GPT-OSS with MXFP4 experts (sinks, a 16-token sliding window on alternate layers, YaRN);
- Mixtral with a 16-token window on every layer (its blocks behind the window released as
  it runs);
- Qwen3-MoE (a dense layer between sparse ones, q/k norm, ``norm_topk_prob``).

For each: a decode replica told to pull from the prefill replica (KV over UCX), the
gateway's gRPC API (which sends long prompts through the prefill replica itself) and Envoy's
HTTP (gRPC-JSON transcoding) with the real ``openai`` SDK, streamed and not, each return
HF's greedy tokens (for prompts several windows long where the model has a window). And
Mixtral's decode replica, told to pull from GPT-OSS's prefill replica (the same model
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
from tests.replica_process import REPO_ROOT, free_port, free_ports, wait_until

pytestmark = pytest.mark.timeout(400)
MAX_TOKENS = 8
ENGINE = ["--dtype", "float32", "--num-kv-blocks", "256", "--max-num-seqs", "16",
          "--kv-pull-timeout", "10"]
# The tiny checkpoint each suite serves (``moe_factory``), by architecture.
CHECKPOINTS = {"gpt_oss": "gpt_oss_mxfp4", "mixtral": "mixtral", "qwen3_moe": "qwen3_moe"}
# Direct P/D prompts' lengths: past the windows (several of them for Mixtral, whose every
# layer slides), and past a KV block for the others.
PD_LENGTHS = {"gpt_oss": (5, GPT_OSS_WINDOW + 9, 50),
              "mixtral": (MIXTRAL_WINDOW + 3, 3 * MIXTRAL_WINDOW + 5),
              "qwen3_moe": (6, 29)}


@dataclass
class Up:
    """One ``tandem up`` of one architecture's tiny checkpoint."""

    model_dir: Path
    served: str
    base_port: int  # the replicas: prefill-0 here, decode-1 next
    gateway_port: int
    metrics_base: int  # prefill-0, decode-1, the gateway
    http_port: int
    output: Path  # tandem up's own output
    process: subprocess.Popen[bytes]

    @property
    def prefill(self) -> str:
        return f"127.0.0.1:{self.base_port}"

    @property
    def decode(self) -> str:
        return f"127.0.0.1:{self.base_port + 1}"

    def healthy(self) -> bool:
        return "all healthy after" in self.output.read_text(errors="replace")

    def metric(self, port: int, name: str, **labels: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            text = answer.read().decode()
        return sum(sample.value for family in text_string_to_metric_families(text)
                   for sample in family.samples if sample.name == name
                   and all(sample.labels.get(k) == v for k, v in labels.items()))


def _start_up(root: Path, arch: str) -> Up:
    # Every checkpoint in a directory named "model": the layouts' fingerprints differ only
    # by KV shapes (the refusal test).
    model_dir = build_tiny_moe_model(root / arch / "model", CHECKPOINTS[arch])
    served = f"{arch.replace('_', '-')}-tiny"
    base, gateway, metrics, http = free_ports(2), free_port(), free_ports(4), free_port()
    output = root / f"{arch}-up.out"
    command = [sys.executable, "-m", "deploy.cli", "up", "--model", str(model_dir),
               "--served-model-name", served, "--prefill", "1", "--decode", "1", "--envoy",
               "--no-suite-tls", "--base-port", str(base), "--gateway-port", str(gateway),
               "--metrics-base-port", str(metrics), "--http-port", str(http),
               "--log-dir", str(root / f"{arch}-logs"), *ENGINE]
    with output.open("wb") as out:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return Up(model_dir, served, base, gateway, metrics, http, output, process)


def _stop(ups: list[Up]) -> None:
    for up in ups:  # SIGTERM to all first: the supervisors drain their children side by side
        if up.process.poll() is None:
            up.process.send_signal(signal.SIGTERM)
    for up in ups:
        try:
            up.process.wait(60)
        except subprocess.TimeoutExpired:
            up.process.kill()


@pytest.fixture(scope="module")
def suites(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Up]]:
    root = tmp_path_factory.mktemp("moe-serving")
    ups: dict[str, Up] = {}
    try:
        for arch in CHECKPOINTS:
            ups[arch] = _start_up(root, arch)
        for arch, up in ups.items():
            wait_until(lambda up=up: up.healthy() or up.process.poll() is not None,
                       time.monotonic() + 240, f"tandem up of {arch}", root / f"{arch}-logs")
            assert up.process.poll() is None, up.output.read_text(errors="replace")[-3000:]
        yield ups
    finally:
        _stop(list(ups.values()))


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


@pytest.mark.parametrize("arch", list(CHECKPOINTS))
def test_pd_pulls_the_prompts_kv_and_matches_hf(suites: dict[str, Up], arch: str) -> None:
    up = suites[arch]
    prompts = _prompts(1, PD_LENGTHS[arch])
    expected = hf_greedy(up.model_dir, prompts, MAX_TOKENS)
    for i, (prompt, want) in enumerate(zip(prompts, expected, strict=True)):
        tokens, transfer = _pd_generate(up.decode, up.prefill, f"pd-{i}", prompt)
        assert transfer.fallback_reason == "" and transfer.blocks_pulled > 0, transfer
        assert tokens == want


@pytest.mark.parametrize("arch", list(CHECKPOINTS))
def test_through_the_gateway_and_envoy_with_the_openai_sdk(suites: dict[str, Up],
                                                           arch: str) -> None:
    """Prompts past the gateway's prefill threshold (32 uncached tokens): each goes through
    the prefill replica, and the decode replica pulls its KV."""
    up = suites[arch]
    prompts = _prompts(2, (40, 57, 45))
    expected = hf_greedy(up.model_dir, prompts, MAX_TOKENS)
    decode_metrics, gateway_metrics = up.metrics_base + 1, up.metrics_base + 2
    pulled = up.metric(decode_metrics, "tandem:kv_transfer_bytes_total")
    hops = up.metric(gateway_metrics, "tandem:gateway_routing_decisions_total",
                     pd="prefill_hop")
    with Client(f"127.0.0.1:{up.gateway_port}", timeout=120) as sdk:
        answer = sdk.complete(prompts[0], max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS,
                              temperature=0, return_token_ids=True)
        assert answer.choices[0].token_ids == expected[0]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{up.http_port}/v1",
                           api_key="unused", max_retries=0, timeout=120)
    extra = {"min_tokens": MAX_TOKENS, "return_token_ids": True}
    completion = client.completions.create(model=up.served, prompt=prompts[1],
                                           max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body=extra)
    assert (completion.choices[0].model_extra or {})["token_ids"] == expected[1]
    assert completion.usage is not None and completion.usage.prompt_tokens == len(prompts[1])
    chunks = [c for c in client.completions.create(
        model=up.served, prompt=prompts[2], max_tokens=MAX_TOKENS, temperature=0,
        stream=True, extra_body=extra) if c.choices]
    assert [t for c in chunks for t in (c.choices[0].model_extra or {})["token_ids"]] == (
        expected[2])
    assert up.metric(gateway_metrics, "tandem:gateway_routing_decisions_total",
                     pd="prefill_hop") >= hops + 3
    assert up.metric(decode_metrics, "tandem:kv_transfer_bytes_total") > pulled


def test_a_decode_replica_of_another_kv_layout_refuses_the_kv_and_recomputes(
        suites: dict[str, Up]) -> None:
    """Mixtral's decode replica named GPT-OSS's prefill replica as its peer: the layouts
    (same model name, dtype and block size; other head size) differ, so no byte moves, the
    fallback is counted and the decode replica computes the prompt with its own model (the
    first token is the prefill replica's: HF Mixtral continues from it)."""
    mixtral = suites["mixtral"]
    decode_metrics = mixtral.metrics_base + 1
    before = mixtral.metric(decode_metrics, "tandem:kv_transfer_fallbacks_total")
    prompt = _prompts(4, (40,))[0]
    tokens, transfer = _pd_generate(mixtral.decode, suites["gpt_oss"].prefill, "mismatch",
                                    prompt)
    assert transfer.fallback_reason == "layout_mismatch" and transfer.blocks_pulled == 0
    assert mixtral.metric(decode_metrics, "tandem:kv_transfer_fallbacks_total") == before + 1
    want = hf_greedy(mixtral.model_dir, [prompt + tokens[:1]], MAX_TOKENS - 1)[0]
    assert tokens[1:] == want


def test_get_info_and_the_log_describe_the_model(suites: dict[str, Up]) -> None:
    up = suites["gpt_oss"]
    with grpc.insecure_channel(up.prefill) as channel:
        info = epb_grpc.EngineStub(channel).GetInfo(epb.GetInfoRequest(), timeout=30)
    summary = list(info.model_summary)
    assert summary[0] == ("architecture GptOssForCausalLM: 1 x sliding-window attention "
                          f"({GPT_OSS_WINDOW} tokens), 1 x full attention, attention sinks; "
                          "2 MoE layers of 8 experts, top-2")
    assert "experts" in summary[1] and "MXFP4 packed" in summary[1]
    assert summary[2].startswith("KV cache: 256 blocks of ")
    assert summary[3].startswith("attention backend: torch")
    log = (up.output.parent / "gpt_oss-logs" / "prefill-0.log").read_text(errors="replace")
    assert all(line in log for line in summary)
