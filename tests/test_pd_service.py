"""P/D across real replica processes: a decode replica pulls KV from a prefill replica.

Real ``python -m services.replica`` processes on loopback (role prefill and role decode) on a
tiny model; the KV moves over real UCX. Checked: greedy output equals the aggregated engine
and Hugging Face; decode-side prefix hits shrink the pull; cancelling streams at random
points leaves no block held on either side; SIGKILLing the prefill replica mid-flight still
completes every request (through the local fallback), and the fallbacks are counted.
"""

from __future__ import annotations

import asyncio
import random
import re
import urllib.request

import grpc
import grpc.aio
import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_common.config import CacheConfig, EngineConfig
from engine_common.llm import LLM
from engine_common.sampling_params import SamplingParams
from protos.tandem.v1 import engine_pb2 as epb
from protos.tandem.v1 import engine_pb2_grpc as epb_grpc
from tests.replica_process import start_replicas, wait_all_free

REPLICA_ARGS = ["--num-kv-blocks", "256", "--max-num-seqs", "32"]


@pytest.fixture(scope="module")
def pd(tiny_llama_dir, tmp_path_factory):
    replicas = start_replicas(tiny_llama_dir, tmp_path_factory.mktemp("pd-logs"), {
        "prefill-a": ["--role", "prefill", *REPLICA_ARGS],
        "decode-a": ["--role", "decode", "--kv-pull-timeout", "5", *REPLICA_ARGS],
    })
    yield replicas["prefill-a"], replicas["decode-a"]
    for replica in replicas.values():
        replica.stop()


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    return LLM(EngineConfig(model=str(tiny_llama_dir), cache=CacheConfig(num_gpu_blocks_override=256)))


def stub(target: str) -> epb_grpc.EngineStub:
    return epb_grpc.EngineStub(grpc.insecure_channel(target))


def generate(target: str, request_id: str, prompt: list[int], max_tokens: int, peer: str | None):
    # min_tokens = max_tokens suppresses EOS as HF's min_new_tokens does.
    request = epb.GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt,
        sampling_params=epb.SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens,
                                           temperature=0),
        output_options=epb.OutputOptions(return_token_ids=True))
    if peer:
        request.prefill_peer = peer
    responses = list(stub(target).Generate(request, timeout=120))
    tokens = [t for r in responses for t in r.new_token_ids]
    transfer = next((r.kv_transfer for r in responses if r.HasField("kv_transfer")), None)
    return tokens, transfer


def metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)]
    return sum(values)


def test_pd_greedy_output_equals_aggregated_and_hf(pd, offline, tiny_llama_dir):
    prefill, decode = pd
    rng = random.Random(7)
    vocab = offline.core.arch.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (3, 16, 17, 40, 63)]
    want = [r.token_ids for r in offline.generate(prompts, SamplingParams(
        temperature=0, max_tokens=10, min_tokens=10))]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    for prompt, expected in zip(prompts, want, strict=True):
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                          min_new_tokens=10, do_sample=False, pad_token_id=0)
        assert out[0, len(prompt):].tolist() == expected
    for i, (prompt, expected) in enumerate(zip(prompts, want, strict=True)):
        tokens, transfer = generate(decode.target, f"pd-{i}", prompt, 10, prefill.target)
        assert tokens == expected
        assert transfer is not None and transfer.fallback_reason == ""
        assert transfer.blocks_pulled == -(-len(prompt) // 16)
        assert transfer.bytes > 0
    wait_all_free(prefill.target, decode.target)
    assert metric(decode.metrics_url, "tandem:kv_transfer_bytes_total") > 0


def test_decode_side_prefix_hits_reduce_the_blocks_pulled(pd, offline):
    prefill, decode = pd
    rng = random.Random(11)
    vocab = offline.core.arch.vocab_size
    shared = [rng.randrange(3, vocab) for _ in range(48)]  # 3 full blocks of 16
    first = shared + [rng.randrange(3, vocab) for _ in range(5)]
    second = shared + [rng.randrange(3, vocab) for _ in range(9)]
    want = [r.token_ids for r in offline.generate([first, second], SamplingParams(
        temperature=0, max_tokens=6, min_tokens=6))]
    tokens1, transfer1 = generate(decode.target, "shared-1", first, 6, prefill.target)
    tokens2, transfer2 = generate(decode.target, "shared-2", second, 6, prefill.target)
    assert [tokens1, tokens2] == want
    assert (transfer1.blocks_local, transfer1.blocks_pulled) == (0, 4)
    assert (transfer2.blocks_local, transfer2.blocks_pulled) == (3, 1)
    wait_all_free(prefill.target, decode.target)


def test_cancelling_at_random_points_frees_every_block(pd, offline):
    prefill, decode = pd
    rng = random.Random(3)
    vocab = offline.core.arch.vocab_size

    async def one(i: int, channel: grpc.aio.Channel) -> None:
        request = epb.GenerateRequest(
            request_id=f"cancel-{i}",
            prompt_token_ids=[rng.randrange(3, vocab) for _ in range(rng.randrange(1, 120))],
            sampling_params=epb.SamplingParams(max_tokens=200, temperature=0, ignore_eos=True),
            prefill_peer=prefill.target)
        call = epb_grpc.EngineStub(channel).Generate(request, timeout=120)
        point = rng.choice(["before_first", "after_first", "mid"])
        if point == "before_first":
            await asyncio.sleep(rng.uniform(0, 0.05))
            call.cancel()
            return
        count = 0
        async for _ in call:
            count += 1
            if point == "after_first" or count >= rng.randrange(2, 20):
                call.cancel()
                return

    async def run() -> None:
        async with grpc.aio.insecure_channel(decode.target) as channel:
            await asyncio.gather(*(one(i, channel) for i in range(24)), return_exceptions=True)

    asyncio.run(run())
    # Well inside the 30 s lease: a cancelled prefill frees its blocks itself.
    wait_all_free(prefill.target, decode.target, timeout=10)


def test_killing_the_prefill_replica_mid_flight_falls_back(tiny_llama_dir, tmp_path_factory, pd, offline):
    _, decode = pd
    [doomed] = start_replicas(tiny_llama_dir, tmp_path_factory.mktemp("doomed"), {
        "prefill-doomed": ["--role", "prefill", *REPLICA_ARGS]}).values()
    rng = random.Random(5)
    vocab = offline.core.arch.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(100, 250))] for _ in range(32)]
    want = [r.token_ids for r in offline.generate(prompts, SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True))]
    fallbacks_before = metric(decode.metrics_url, "tandem:kv_transfer_fallbacks_total")

    async def run() -> list[list[int]]:
        async with grpc.aio.insecure_channel(decode.target) as channel:
            engine = epb_grpc.EngineStub(channel)

            first_token = asyncio.Event()

            async def one(i: int) -> list[int]:
                request = epb.GenerateRequest(
                    request_id=f"kill-{i}", prompt_token_ids=prompts[i],
                    sampling_params=epb.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                    prefill_peer=doomed.target, output_options=epb.OutputOptions(return_token_ids=True))
                tokens = []
                async for response in engine.Generate(request, timeout=120):
                    first_token.set()
                    tokens.extend(response.new_token_ids)
                return tokens

            tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
            # Kill P as soon as the first of 32 prefills came back: the rest are in flight.
            await first_token.wait()
            doomed.kill()
            return await asyncio.gather(*tasks)

    got = asyncio.run(run())
    assert got == want
    assert metric(decode.metrics_url, "tandem:kv_transfer_fallbacks_total") > fallbacks_before
    wait_all_free(decode.target)


@pytest.mark.parametrize(("message", "code", "words"), [
    (epb.PrefillRequest(prompt_token_ids=[5, 6]), grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
    (epb.PrefillRequest(request_id="x"), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    (epb.PrefillRequest(request_id="x", prompt_token_ids=[5],
                        sampling_params=epb.SamplingParams(temperature=-1)),
     grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (epb.PrefillRequest(request_id="x", prompt_token_ids=[10**9]),
     grpc.StatusCode.INVALID_ARGUMENT, "token ids"),
])
def test_bad_prefill_requests_get_clear_errors(pd, message, code, words):
    prefill, decode = pd
    with pytest.raises(grpc.RpcError) as error:
        list(stub(prefill.target).Prefill(message, timeout=30))
    assert error.value.code() == code and words in error.value.details()
    with pytest.raises(grpc.RpcError) as error:  # a decode replica pins nothing
        list(stub(decode.target).Prefill(epb.PrefillRequest(request_id="y", prompt_token_ids=[5]),
                                         timeout=30))
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    wait_all_free(prefill.target)


def complete(target: str, prompt: list[int], max_tokens: int,
             metadata: tuple[tuple[str, str], ...] = ()):
    """The public Complete API (as Envoy's transcoder calls it) with ``metadata``; the
    response and its initial metadata."""
    from google.protobuf import struct_pb2

    from protos.tandem.v1 import generation_pb2 as pb
    from protos.tandem.v1 import generation_pb2_grpc as pb_grpc

    request = pb.CompletionRequest(
        prompt=struct_pb2.Value(list_value=struct_pb2.ListValue(
            values=[struct_pb2.Value(number_value=t) for t in prompt])),
        max_tokens=max_tokens, min_tokens=max_tokens, temperature=0,
        return_token_ids=True)
    with grpc.insecure_channel(target) as channel:
        call = pb_grpc.GenerationStub(channel).Complete.with_call(
            request, metadata=metadata, timeout=120)
    response, rpc = call
    return [int(t) for t in response.choices[0].token_ids], dict(rpc.initial_metadata())


def test_the_endpoint_pickers_prefill_choice_is_honoured_on_the_public_api(pd, offline):
    """Behind Envoy and the endpoint picker, a decode replica gets its prefill peer as the
    ``x-prefiller-host-port`` header (llm-d's): it runs decode-first P/D with it, the prefill
    replica really computes the prompt, and the answer's headers say so."""
    prefill, decode = pd
    rng = random.Random(21)
    vocab = offline.core.arch.vocab_size
    prompt = [rng.randrange(3, vocab) for _ in range(70)]
    [want] = [r.token_ids for r in offline.generate([prompt], SamplingParams(
        temperature=0, max_tokens=8, min_tokens=8))]
    bytes_before = metric(decode.metrics_url, "tandem:kv_transfer_bytes_total")
    prompts_before = metric(prefill.metrics_url, "vllm:prompt_tokens_total")
    tokens, headers = complete(decode.target, prompt, 8,
                               (("x-prefiller-host-port", prefill.target),))
    assert tokens == want
    assert headers.get("x-tandem-prefill") == "remote"
    assert metric(decode.metrics_url, "tandem:kv_transfer_bytes_total") > bytes_before
    assert metric(prefill.metrics_url, "vllm:prompt_tokens_total") >= prompts_before + len(prompt)
    wait_all_free(prefill.target, decode.target)


def test_the_prefill_header_falls_back_when_the_peer_is_dead(pd, offline):
    prefill, decode = pd
    prompt = list(range(5, 45))
    [want] = [r.token_ids for r in offline.generate([prompt], SamplingParams(
        temperature=0, max_tokens=5, min_tokens=5))]
    before = metric(decode.metrics_url, "tandem:kv_transfer_fallbacks_total")
    dead = f"127.0.0.1:{free_dead_port()}"
    tokens, headers = complete(decode.target, prompt, 5, (("x-prefiller-host-port", dead),))
    assert tokens == want
    assert headers.get("x-tandem-prefill", "").startswith("fallback:")
    assert metric(decode.metrics_url, "tandem:kv_transfer_fallbacks_total") == before + 1
    wait_all_free(decode.target)


def free_dead_port() -> int:
    from tests.replica_process import free_port

    return free_port()


@pytest.mark.parametrize("value", ["prefill", "10.0.0.1:99999", "a b:80", "x" * 5000 + ":1"])
def test_a_malformed_prefill_header_is_refused_clearly(pd, value):
    _, decode = pd
    with pytest.raises(grpc.RpcError) as error:
        complete(decode.target, [5, 6, 7], 2, (("x-prefiller-host-port", value),))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "x-prefiller-host-port must be HOST:PORT" in error.value.details()
    assert len(error.value.details()) < 300  # never the whole value back


def test_the_prefill_header_is_ignored_by_a_prefill_replica(pd, offline):
    prefill, decode = pd
    before = metric(prefill.metrics_url, "tandem:kv_transfer_fallbacks_total")
    tokens, headers = complete(prefill.target, [5, 6, 7, 8], 3,
                               (("x-prefiller-host-port", decode.target),))
    [want] = [r.token_ids for r in offline.generate([[5, 6, 7, 8]], SamplingParams(
        temperature=0, max_tokens=3, min_tokens=3))]
    assert tokens == want and "x-tandem-prefill" not in headers
    assert metric(prefill.metrics_url, "tandem:kv_transfer_fallbacks_total") == before
    wait_all_free(prefill.target)


def test_a_second_prefill_under_a_pinned_id_is_refused_and_harms_nothing(pd):
    """A decode replica that retries a Prefill (or a confused caller) must not pin over the
    blocks still held under that id: ALREADY_EXISTS, and the replica keeps serving."""
    prefill, _ = pd
    message = epb.PrefillRequest(request_id="twice", prompt_token_ids=list(range(5, 40)),
                                 sampling_params=epb.SamplingParams(temperature=0))
    first = list(stub(prefill.target).Prefill(message, timeout=60))[-1]
    assert first.HasField("kv_handle")
    with pytest.raises(grpc.RpcError) as error:
        list(stub(prefill.target).Prefill(message, timeout=60))
    assert error.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert prefill.health() == 1  # SERVING
    stub(prefill.target).ReleaseKv(epb.ReleaseKvRequest(
        request_id="twice", engine_id=first.kv_handle.engine_id), timeout=10)
    again = list(stub(prefill.target).Prefill(message, timeout=60))[-1]  # the id is free again
    stub(prefill.target).ReleaseKv(epb.ReleaseKvRequest(
        request_id="twice", engine_id=again.kv_handle.engine_id), timeout=10)
    wait_all_free(prefill.target)
