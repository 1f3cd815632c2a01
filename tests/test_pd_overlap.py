"""P/D with the KV transfer overlapped with the prefill's compute (issue 24 goal 2).

A prefill replica asked to ``announce_kv`` computes a long prompt in chunks and announces the
blocks each chunk made final; the decode replica pulls them while later chunks compute, and
the rest once the prefill replica answers. Two levels, both over real UCX:

- two ``EngineCore``s in one process, stepped in turn (the prefill core's announcements handed
  to the decode core as ``RemoteKvUpdate``s, as ``AsyncLLM`` does), where every lease and
  block can be counted: output equal to an aggregated core's, early pulls really made, an
  abort on either side mid-stream ending every lease and freeing every block;
- real replica processes (``python -m services.replica``): greedy output equal to Hugging
  Face's for prompts of many chunks, a prefill replica SIGKILLed mid-stream (the decode
  replica falls back, output still exact, nothing held), a client cancelling mid-stream.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import replace

import grpc
import grpc.aio
import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_common.config import CacheConfig, EngineConfig, KvTransferConfig, SchedulerConfig
from engine_common.engine_core import EngineCore
from engine_common.generation_request import GenerationRequest
from engine_common.outputs import (
    EngineCoreOutput,
    EngineCoreRequest,
    KvTransferReport,
    RemoteKvChunk,
    RemoteKvUpdate,
    RemotePrefill,
)
from engine_common.sampling_params import SamplingParams
from protos.tandem.v1 import engine_pb2 as epb
from protos.tandem.v1 import engine_pb2_grpc as epb_grpc
from tests.replica_process import start_replicas, wait_all_free

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
CHUNK = 8  # the prefill core's tokens per step: a 40-token prompt is 5 chunks


def make_core(model_dir, engine_id: str, role: str | None, chunk: int = 0, **kv) -> EngineCore:
    return EngineCore(EngineConfig(
        model=str(model_dir), dtype="float32", engine_id=engine_id,
        cache=CacheConfig(block_size=4, num_gpu_blocks_override=128),
        scheduler=SchedulerConfig(max_num_batched_tokens=256, long_prefill_token_threshold=chunk),
        kv_transfer=KvTransferConfig(role=role, **kv)))


@pytest.fixture(scope="module")
def cores(tiny_llama_dir):
    p = make_core(tiny_llama_dir, "prefill-overlap", "producer", CHUNK)
    d = make_core(tiny_llama_dir, "decode-overlap", "consumer", pull_timeout_seconds=5.0)
    both = make_core(tiny_llama_dir, "both-overlap", None)
    yield p, d, both
    p.remote_kv.close()
    d.remote_kv.close()


def reference(core: EngineCore, request_id: str, prompt: list[int]) -> list[int]:
    core.add_request(EngineCoreRequest(request_id, GenerationRequest(prompt, GREEDY),
                                       time.monotonic()))
    outs = run(core, lambda o: any(x.finished for x in o))
    return [t for o in outs for t in o.new_token_ids]


def run(core: EngineCore, done, timeout: float = 30.0) -> list[EngineCoreOutput]:
    outputs: list[EngineCoreOutput] = []
    deadline = time.monotonic() + timeout
    while not done(outputs):
        assert time.monotonic() < deadline, "the engine did not finish in time"
        if not core.has_runnable_requests():
            time.sleep(0.002)
        outputs.extend(core.step().outputs)
    return outputs


class Overlapped:
    """One request through the prefill core (announcing) and the decode core (pulling each
    announcement as it comes), the two stepped in turn."""

    def __init__(self, p: EngineCore, d: EngineCore, request_id: str, prompt: list[int]):
        self.p, self.d, self.request_id, self.prompt = p, d, request_id, prompt
        self.next_block = 0
        self.announcements = 0
        self.result: RemotePrefill | None = None
        self.decoded: list[EngineCoreOutput] = []
        now = time.monotonic()
        p.add_request(EngineCoreRequest(
            request_id, GenerationRequest(prompt, replace(GREEDY, max_tokens=1)), now,
            hold_kv=True, announce_kv=True))
        d.add_request(EngineCoreRequest(request_id, GenerationRequest(prompt, GREEDY), now,
                                        stream_kv=True))

    def step(self) -> None:
        """One prefill step, its announcements passed on, and one decode step."""
        for out in self.p.step().outputs:
            if out.request_id != self.request_id or out.kv_handle is None:
                continue
            if out.new_token_ids:
                self.result = RemotePrefill(out.kv_handle, out.new_token_ids[0])
                continue
            self.d.update_remote_kv(RemoteKvUpdate(self.request_id, chunk=RemoteKvChunk(
                out.kv_handle, self.next_block)))
            self.next_block += len(out.kv_handle.block_ids)
            self.announcements += 1
        time.sleep(0.01)  # a pull's time: the model runs while the blocks move
        self.decoded.extend(self.d.step().outputs)

    def finish(self) -> tuple[list[int], KvTransferReport]:
        while self.result is None:
            self.step()
        self.d.update_remote_kv(RemoteKvUpdate(self.request_id, result=self.result))
        self.decoded += run(self.d, lambda o: any(x.finished for x in self.decoded + o))
        report = next(o.kv_transfer for o in self.decoded if o.kv_transfer is not None)
        return ([self.result.first_token_id] + [t for o in self.decoded for t in o.new_token_ids],
                report)


def wait_cores_free(*engines: EngineCore, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    for core in engines:
        while (core.scheduler.held or core.has_unfinished_requests()
               or (core.remote_kv is not None and core.remote_kv.num_pinned)):
            assert time.monotonic() < deadline, f"{core.info.engine_id} still holds KV"
            core.step()
            time.sleep(0.01)
        assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_blocks


def test_overlapped_output_equals_aggregated_and_pulls_early(cores):
    p, d, both = cores
    rng = random.Random(0)
    shared = [rng.randrange(3, 300) for _ in range(20)]
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (6, 33, 40, 57)]
    prompts.append(shared + prompts[2])  # after prompts[2]: ...
    prompts.insert(3, shared + [7, 8, 9])  # ... D already holds `shared` (5 blocks) here
    early = 0
    for i, prompt in enumerate(prompts):
        flow = Overlapped(p, d, f"o{i}", prompt)
        tokens, report = flow.finish()
        assert tokens == reference(both, f"o{i}", prompt)
        assert report.fallback_reason is None
        assert report.blocks_pulled + report.blocks_local == -(-len(prompt) // 4)
        # Every announcement is of complete blocks, and the last block is never announced.
        assert flow.next_block <= (len(prompt) - 1) // 4
        assert (flow.announcements > 0) == (len(prompt) > CHUNK)
        early += report.blocks_pulled_early
        p.release_kv([f"o{i}"])
    assert early > 0
    wait_cores_free(p, d)


def test_a_prefill_aborted_mid_stream_ends_its_leases_and_the_decode_side_recomputes(cores):
    p, d, both = cores
    prompt = [random.Random(1).randrange(3, 300) for _ in range(60)]
    flow = Overlapped(p, d, "abort-p", prompt)
    while flow.announcements < 2:
        flow.step()
    assert p.remote_kv.num_pinned == 2
    p.abort_requests(["abort-p"])  # the decode replica's stream was cancelled, say
    assert p.remote_kv.num_pinned == 0
    wait_cores_free(p)
    d.update_remote_kv(RemoteKvUpdate("abort-p", failure="prefill_failed"))
    outs = run(d, lambda o: any(x.finished for x in o))
    report = next(o.kv_transfer for o in outs if o.kv_transfer is not None)
    assert report.fallback_reason == "prefill_failed"
    # The first token too is computed here: nothing of the prefill replica's is used.
    assert [t for o in outs for t in o.new_token_ids] == reference(both, "abort-p-ref", prompt)
    wait_cores_free(d)


def test_a_decode_request_aborted_mid_stream_frees_its_blocks(cores):
    p, d, _ = cores
    prompt = [random.Random(2).randrange(3, 300) for _ in range(60)]
    flow = Overlapped(p, d, "abort-d", prompt)
    while flow.announcements < 2:
        flow.step()
    assert d.remote_kv.num_pulls_in_flight == 1  # admitted, pulling
    d.abort_requests(["abort-d"])  # its client went away
    # P goes on: its result comes for a request that is gone.
    while flow.result is None:
        flow.step()
    d.update_remote_kv(RemoteKvUpdate("abort-d", result=flow.result))
    p.release_kv(["abort-d"])
    wait_cores_free(p, d)
    assert d.remote_kv.num_pulls_in_flight == 0


# ------------------------------------------------------------------ real replica processes

REPLICA_ARGS = ["--num-kv-blocks", "256", "--max-num-seqs", "32"]
OVERLAP = ["--kv-overlap", "on"]  # off by default (docs/kv-transfer.md)


@pytest.fixture(scope="module")
def pd(tiny_llama_dir, tmp_path_factory):
    replicas = start_replicas(tiny_llama_dir, tmp_path_factory.mktemp("pd-overlap-logs"), {
        "prefill-o": ["--role", "prefill", *OVERLAP, "--kv-overlap-chunk-tokens", "32",
                      *REPLICA_ARGS],
        "decode-o": ["--role", "decode", *OVERLAP, "--kv-pull-timeout", "5", *REPLICA_ARGS],
    })
    yield replicas["prefill-o"], replicas["decode-o"]
    for replica in replicas.values():
        replica.stop()


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                      min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def stub(target: str) -> epb_grpc.EngineStub:
    return epb_grpc.EngineStub(grpc.insecure_channel(target))


def generate_request(request_id: str, prompt: list[int], n: int, peer: str) -> epb.GenerateRequest:
    return epb.GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, prefill_peer=peer,
        sampling_params=epb.SamplingParams(max_tokens=n, min_tokens=n, temperature=0),
        output_options=epb.OutputOptions(return_token_ids=True))


def test_overlapped_pd_greedy_output_equals_hf(pd, hf):
    prefill, decode = pd
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (31, 97, 250, 400, 480)]
    early = 0
    for i, prompt in enumerate(prompts):
        responses = list(stub(decode.target).Generate(
            generate_request(f"ov-{i}", prompt, 10, prefill.target), timeout=120))
        tokens = [t for r in responses for t in r.new_token_ids]
        transfer = next(r.kv_transfer for r in responses if r.HasField("kv_transfer"))
        assert tokens == hf_greedy(hf, prompt, 10)
        assert transfer.fallback_reason == ""
        assert transfer.blocks_pulled == -(-len(prompt) // 16)
        early += transfer.blocks_pulled_early
    assert early > 0  # some blocks really moved while later chunks were computed
    wait_all_free(prefill.target, decode.target)


def test_killing_the_prefill_replica_mid_stream_falls_back_exactly(
        tiny_llama_dir, tmp_path_factory, pd, hf):
    _, decode = pd
    [doomed] = start_replicas(tiny_llama_dir, tmp_path_factory.mktemp("overlap-doomed"), {
        "prefill-doomed": ["--role", "prefill", *OVERLAP, "--kv-overlap-chunk-tokens", "16",
                           *REPLICA_ARGS]}).values()
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randrange(300, 480))] for _ in range(6)]

    transfers: list[epb.KvTransferInfo] = []

    async def run_all() -> list[list[int]]:
        async with grpc.aio.insecure_channel(decode.target) as channel:
            engine = epb_grpc.EngineStub(channel)

            async def one(i: int) -> list[int]:
                tokens: list[int] = []
                async for response in engine.Generate(
                        generate_request(f"kill-o-{i}", prompts[i], 8, doomed.target),
                        timeout=120):
                    tokens.extend(response.new_token_ids)
                    if response.HasField("kv_transfer"):
                        transfers.append(response.kv_transfer)
                return tokens

            tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
            # Kill P once it has computed (and announced) about a third of the prompts'
            # blocks, in chunks of 16 tokens for all six at once: every stream breaks mid-way.
            await until_used(doomed.target, sum(-(-len(p) // 16) for p in prompts) // 3)
            doomed.kill()
            return await asyncio.gather(*tasks)

    got = asyncio.run(run_all())
    assert got == [hf_greedy(hf, prompt, 8) for prompt in prompts]
    assert len(transfers) == len(prompts)
    assert all(t.fallback_reason == "prefill_failed" for t in transfers)
    assert sum(t.blocks_pulled_early for t in transfers) > 0  # pulls had begun
    wait_all_free(decode.target)


async def until_used(target: str, blocks: int, timeout: float = 30.0) -> None:
    """Until the replica holds at least ``blocks`` KV blocks."""
    deadline = time.monotonic() + timeout
    async with grpc.aio.insecure_channel(target) as channel:
        while True:
            load = await epb_grpc.EngineStub(channel).GetLoad(epb.GetLoadRequest(), timeout=5)
            if load.num_total_blocks - load.num_free_blocks >= blocks:
                return
            assert time.monotonic() < deadline, f"the replica never held {blocks} blocks"
            await asyncio.sleep(0.005)


async def until_running(target: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    async with grpc.aio.insecure_channel(target) as channel:
        while True:
            load = await epb_grpc.EngineStub(channel).GetLoad(epb.GetLoadRequest(), timeout=5)
            if load.num_requests_running > 0 and load.num_free_blocks < load.num_total_blocks:
                return
            assert time.monotonic() < deadline, "the prefill replica never started"
            await asyncio.sleep(0.01)


def test_cancelling_mid_stream_frees_both_sides(pd):
    prefill, decode = pd
    rng = random.Random(9)

    async def cancel(i: int, channel: grpc.aio.Channel) -> bool:
        """Whether the call was cancelled before its first token."""
        prompt = [rng.randrange(3, 250) for _ in range(440)]
        call = epb_grpc.EngineStub(channel).Generate(
            generate_request(f"cancel-o-{i}", prompt, 50, prefill.target), timeout=120)
        await until_running(prefill.target)
        await asyncio.sleep(rng.uniform(0, 0.01))
        call.cancel()
        try:
            await call.read()
        except asyncio.CancelledError:
            return True
        return False

    async def run_all() -> list[bool]:
        async with grpc.aio.insecure_channel(decode.target) as channel:
            return await asyncio.gather(*(cancel(i, channel) for i in range(4)))

    assert any(asyncio.run(run_all()))  # mid-stream, for one at least
    # Well inside the 30 s lease (issue 34: within 2 s): announced and pinned blocks are
    # released, not expired. A cancelled request's Prefill call is cancelled before its
    # ReleaseKv leaves (services/replica/prefill_peers.py), so the release cannot overtake the
    # prompt's end and find nothing to free.
    wait_all_free(prefill.target, decode.target, timeout=2)


def test_gpt_oss_kv_cache_groups_overlap_exactly(tmp_path):
    """GPT-OSS splits its cache into a full and a 16-token sliding-window group on both
    cores: announcements and the result move interleaved pages (two a block) while the
    prompt computes in chunks; the tokens are HF's, a second prompt sharing 40 tokens pulls
    only the pages after the decode core's own hits, and both pools end empty."""
    from tests.hf_reference import hf_greedy as hf_reference_greedy
    from tests.hf_reference import random_prompts
    from tests.moe_factory import GPT_OSS_WINDOW, build_tiny_moe_model

    model_dir = build_tiny_moe_model(tmp_path / "gpt_oss", "gpt_oss")
    p = make_core(model_dir, "prefill-oss-overlap", "producer", CHUNK)
    d = make_core(model_dir, "decode-oss-overlap", "consumer", pull_timeout_seconds=10.0)
    try:
        assert p.kv_cache_manager.pages_per_block == d.kv_cache_manager.pages_per_block == 2
        assert p.info.kv_layout.model.endswith(f"+kv-groups:full/1,sliding{GPT_OSS_WINDOW}/1")
        shared = random_prompts(400, [40], seed=20)[0]  # 10 blocks of 4
        prompts = [shared + tail for tail in random_prompts(400, [1, 10], seed=21)]
        wants = hf_reference_greedy(model_dir, prompts, GREEDY.max_tokens)
        reports = []
        for i, (prompt, want) in enumerate(zip(prompts, wants, strict=True)):
            flow = Overlapped(p, d, f"oss{i}", prompt)
            tokens, report = flow.finish()
            assert tokens == want
            assert report.fallback_reason is None and flow.announcements > 0
            reports.append(report)
            p.release_kv([f"oss{i}"])
        # Pages: 11 blocks of 41 tokens, then 10 of the shared 40 were hits here.
        assert (reports[0].blocks_local, reports[0].blocks_pulled) == (0, 2 * 11)
        assert (reports[1].blocks_local, reports[1].blocks_pulled) == (2 * 10, 2 * 3)
        assert reports[0].blocks_pulled_early > 0
        wait_cores_free(p, d)
    finally:
        p.remote_kv.close()
        d.remote_kv.close()
