"""P/D inside the engine: a prefill core pins blocks, a decode core pulls them over real UCX.

Two ``EngineCore`` instances in one process (each with its own KV cache) stand for the
prefill and decode replicas; the transfer between them is the real UCX connector. The
decode core's greedy output must equal an aggregated core's, its own prefix-cache hits must
shrink the pull, a failed pull must fall back to recompute, and no block may stay held.
"""

from __future__ import annotations

import random
import time
from dataclasses import replace

import pytest

from engine_common.config import (
    CacheConfig,
    EngineConfig,
    KvTransferConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from engine_common.engine_core import EngineCore
from engine_common.generation_request import GenerationRequest
from engine_common.lora.loaded_adapters import LoraAdapterExists
from engine_common.outputs import EngineCoreRequest, RemotePrefill
from engine_common.sampling_params import SamplingParams
from tests.model_factory import write_lora_adapter

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def make_core(model_dir, engine_id: str, role: str | None,
              speculative: SpeculativeConfig | None = None, **kv) -> EngineCore:
    return EngineCore(EngineConfig(
        model=str(model_dir), dtype="float32", engine_id=engine_id,
        cache=CacheConfig(block_size=4, num_gpu_blocks_override=128),
        scheduler=SchedulerConfig(max_num_batched_tokens=256),
        kv_transfer=KvTransferConfig(role=role, **kv),
        speculative=speculative or SpeculativeConfig(),
    ))


def run_until(core: EngineCore, done, timeout: float = 30.0, stats: list | None = None) -> list:
    outputs = []
    deadline = time.monotonic() + timeout
    while not done(outputs):
        assert time.monotonic() < deadline, "engine did not finish in time"
        if not core.has_runnable_requests():
            time.sleep(0.002)
        step = core.step()
        outputs.extend(step.outputs)
        if stats is not None and step.stats is not None:
            stats.append(step.stats)
    return outputs


def prefill(core: EngineCore, request_id: str, prompt: list[int],
            params: SamplingParams = GREEDY):
    one = replace(params, max_tokens=1)
    core.add_request(EngineCoreRequest(request_id, GenerationRequest(prompt, one), time.monotonic(),
                                       hold_kv=True))
    outs = run_until(core, lambda o: any(x.finished for x in o))
    final = [o for o in outs if o.finished][0]
    assert final.kv_handle is not None and final.new_token_ids
    return final.new_token_ids[0], final.kv_handle


def decode(core: EngineCore, request_id: str, prompt: list[int], first: int, handle,
           params: SamplingParams = GREEDY, stats: list | None = None,
           ) -> tuple[list[int], object]:
    core.add_request(EngineCoreRequest(
        request_id, GenerationRequest(prompt, params), time.monotonic(),
        remote_prefill=RemotePrefill(handle=handle, first_token_id=first)))
    outs = run_until(core, lambda o: any(x.finished for x in o), stats=stats)
    report = next(o.kv_transfer for o in outs if o.kv_transfer is not None)
    return [first] + [t for o in outs for t in o.new_token_ids], report


@pytest.fixture(scope="module")
def cores(tiny_llama_dir):
    p = make_core(tiny_llama_dir, "prefill-0", "producer", lease_seconds=2.0)
    # NOTE: a generous pull timeout: these tests check what moves, not how fast, and a 3 s
    # one ran out once under a load average of 16 (the pull then fell back).
    d = make_core(tiny_llama_dir, "decode-0", "consumer", pull_timeout_seconds=30.0)
    both = make_core(tiny_llama_dir, "both-0", None)
    yield p, d, both
    p.remote_kv.close()
    d.remote_kv.close()


def reference(core: EngineCore, request_id: str, prompt: list[int],
              params: SamplingParams = GREEDY, num_resumed_tokens: int = 0) -> list[int]:
    core.add_request(EngineCoreRequest(
        request_id, GenerationRequest(prompt, params, num_resumed_tokens=num_resumed_tokens),
        time.monotonic()))
    outs = run_until(core, lambda o: any(x.finished for x in o))
    return [t for o in outs for t in o.new_token_ids]


def wait_released(p: EngineCore, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while p.scheduler.held and time.monotonic() < deadline:
        p.step()
        time.sleep(0.01)
    assert not p.scheduler.held


def test_pd_output_equals_aggregated_and_frees_everything(cores):
    p, d, both = cores
    # The prefill replica's cache, which the connector reads, on huge pages whatever they
    # cost at start; the others' only while the kernel has them free (kv_cache_memory).
    assert p.model_runner.kv_cache_memory.policy == "huge"
    assert d.model_runner.kv_cache_memory.policy == "huge-if-free"
    assert both.model_runner.kv_cache_memory.policy == "huge-if-free"
    rng = random.Random(0)
    for i, n in enumerate([1, 4, 5, 13, 30]):
        prompt = [rng.randrange(3, 300) for _ in range(n)]
        first, handle = prefill(p, f"r{i}", prompt)
        assert p.scheduler.held  # pinned until released
        tokens, report = decode(d, f"r{i}", prompt, first, handle)
        assert report.fallback_reason is None
        assert report.blocks_pulled + report.blocks_local == len(handle.block_ids)
        assert tokens == reference(both, f"r{i}", prompt)
        p.release_kv([f"r{i}"])
        wait_released(p)
    assert p.kv_cache_manager.num_free_blocks == p.kv_cache_manager.num_blocks
    assert d.kv_cache_manager.num_free_blocks == d.kv_cache_manager.num_blocks


SEEDED = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)


def test_seeded_sampling_continues_across_replicas(cores):
    """A seeded request samples the same tokens whether one replica runs it, P and D share
    it (P samples the first token), or a second replica resumes its stream."""
    p, d, both = cores
    prompt = [random.Random(5).randrange(3, 300) for _ in range(11)]
    expected = reference(both, "seeded-both", prompt, SEEDED)
    assert len(set(expected)) > 3  # really sampled, not one repeated token

    first, handle = prefill(p, "seeded-pd", prompt, SEEDED)
    tokens, report = decode(d, "seeded-pd", prompt, first, handle, SEEDED)
    assert report.fallback_reason is None
    assert tokens == expected
    p.release_kv(["seeded-pd"])
    wait_released(p)

    for k in (1, 5):
        resumed = replace(SEEDED, max_tokens=SEEDED.max_tokens - k)
        rest = reference(both, f"seeded-resumed-{k}", prompt + expected[:k], resumed,
                         num_resumed_tokens=k)
        assert expected[:k] + rest == expected
    # Without the skip, the continuation repeats the first draws: a different stream.
    fresh = reference(both, "seeded-fresh", prompt + expected[:5],
                      replace(SEEDED, max_tokens=SEEDED.max_tokens - 5))
    assert expected[:5] + fresh != expected


def test_a_speculating_decode_replica_keeps_the_seeded_stream(cores, tiny_llama_dir):
    """The decode replica speculates (n-gram drafts over a prompt that repeats itself): the
    seeded tokens are still the one-replica ones, as every rejected draft's extra draw is
    rewound, after the skip past the prefill replica's first token."""
    p, _, both = cores
    d = make_core(tiny_llama_dir, "decode-spec", "consumer",
                  SpeculativeConfig(num_tokens=4, ngram_min=1, ngram_max=3),
                  pull_timeout_seconds=30.0)
    try:
        prompt = [random.Random(6).randrange(3, 300) for _ in range(8)] * 3
        params = replace(SEEDED, max_tokens=24, temperature=0.3)
        expected = reference(both, "spec-seeded-both", prompt, params)
        first, handle = prefill(p, "spec-seeded-pd", prompt, params)
        stats: list = []
        tokens, report = decode(d, "spec-seeded-pd", prompt, first, handle, params, stats)
        assert report.fallback_reason is None
        assert tokens == expected
        assert sum(s.num_draft_tokens for s in stats) > 0
        p.release_kv(["spec-seeded-pd"])
        wait_released(p)
    finally:
        d.remote_kv.close()


def test_decode_side_prefix_hits_reduce_pulled_blocks(cores):
    p, d, both = cores
    rng = random.Random(1)
    shared = [rng.randrange(3, 300) for _ in range(16)]  # 4 full blocks of 4
    prompts = [shared + [rng.randrange(3, 300) for _ in range(k)] for k in (3, 6)]
    reports = []
    for i, prompt in enumerate(prompts):
        first, handle = prefill(p, f"s{i}", prompt)
        tokens, report = decode(d, f"s{i}", prompt, first, handle)
        assert tokens == reference(both, f"s{i}", prompt)
        reports.append(report)
        p.release_kv([f"s{i}"])
    assert reports[0].blocks_local == 0
    assert reports[1].blocks_local == 4  # the shared prefix was already on D
    assert reports[1].blocks_pulled == len(range(0, 22, 4)) - 4
    wait_released(p)


def test_failed_pull_falls_back_to_recompute(cores, tiny_llama_dir):
    p, d, both = cores
    prompt = list(range(10, 31))
    first, handle = prefill(p, "f0", prompt)
    p.release_kv(["f0"])  # the lease is gone before D pulls: "unknown_request"
    wait_released(p)
    tokens, report = decode(d, "f0", prompt, first, handle)
    assert report.fallback_reason == "unknown_request"
    assert tokens == reference(both, "f0", prompt)
    assert d.kv_cache_manager.num_free_blocks == d.kv_cache_manager.num_blocks


def test_lease_expires_when_nobody_pulls(cores):
    p, _, _ = cores
    prefill(p, "lease0", list(range(5, 40)))
    assert p.scheduler.held
    wait_released(p, timeout=6.0)  # lease_seconds=2
    assert p.kv_cache_manager.num_free_blocks == p.kv_cache_manager.num_blocks


def test_layout_mismatch_is_detected_and_recomputed(tiny_llama_dir, cores):
    p, _, both = cores
    other = EngineCore(EngineConfig(
        model=str(tiny_llama_dir), dtype="bfloat16", engine_id="decode-bf16",
        cache=CacheConfig(block_size=4, num_gpu_blocks_override=64),
        kv_transfer=KvTransferConfig(role="consumer")))
    try:
        prompt = list(range(40, 60))
        first, handle = prefill(p, "m0", prompt)
        other.add_request(EngineCoreRequest("m0", GenerationRequest(prompt, GREEDY),
                                            time.monotonic(),
                                            remote_prefill=RemotePrefill(handle, first)))
        outs = run_until(other, lambda o: any(x.finished for x in o))
        report = next(o.kv_transfer for o in outs if o.kv_transfer is not None)
        assert report.fallback_reason == "layout_mismatch"
        assert other.kv_cache_manager.num_free_blocks == other.kv_cache_manager.num_blocks
        p.release_kv(["m0"])
        wait_released(p)
    finally:
        other.remote_kv.close()


def test_an_adapters_blocks_held_for_a_decode_replica_keep_its_name_taken(
        cores, tiny_llama_dir, tmp_path):
    """A prefill replica's pinned blocks are cached under their LoRA adapter's name: after
    an unload the name stays taken (a new adapter under it could hit those blocks) until the
    decode side releases them; then it may be loaded again."""
    p, _, _ = cores
    adapter = str(write_lora_adapter(tiny_llama_dir, tmp_path / "a", seed=3, r=4,
                                     target_modules=["q_proj", "v_proj"]))
    p.load_lora_adapter("a", adapter)
    one = replace(GREEDY, max_tokens=1)
    p.add_request(EngineCoreRequest(
        "held-lora", GenerationRequest(list(range(3, 40)), one, lora_name="a"), time.monotonic(),
        hold_kv=True))
    run_until(p, lambda o: any(x.finished for x in o))
    assert "held-lora" in p.scheduler.held
    p.unload_lora_adapter("a")
    with pytest.raises(LoraAdapterExists, match="still being unloaded: 1 request"):
        p.load_lora_adapter("a", adapter)
    p.release_kv(["held-lora"])
    wait_released(p)
    p.load_lora_adapter("a", adapter)
    p.unload_lora_adapter("a")
    assert not p.model_runner.lora_adapters.has_weights
