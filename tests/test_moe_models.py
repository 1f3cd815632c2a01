"""Mixture-of-experts networks (Mixtral, Qwen3-MoE, GPT-OSS plain and MXFP4) are greedy
token-identical to Hugging Face ``transformers`` on tiny random float32 checkpoints that
transformers' own classes wrote; MXFP4 pairs that do not fit are refused by name.

Each model runs a batch of mixed lengths (GPT-OSS's longer than its 16-token sliding
window, so the window and the sinks decide tokens), then prompts sharing a prefix (prefix
cache hits asserted) with every prefill chunked.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_common.config import CacheConfig, EngineConfig, SchedulerConfig
from engine_common.llm import LLM
from engine_common.model.arch_config import ModelArchConfig
from engine_common.model.loader import load_model
from engine_common.sampling_params import SamplingParams
from tests.hf_reference import hf_greedy, random_prompts
from tests.moe_factory import (
    GPT_OSS_WINDOW,
    MIXTRAL_WINDOW,
    MOE_ARCHITECTURES,
    build_tiny_moe_model,
)

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)


def _engine(model_dir: Path, budget: int = 512) -> LLM:
    return LLM(EngineConfig(
        model=str(model_dir), dtype="float32",
        cache=CacheConfig(block_size=4, num_gpu_blocks_override=256),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=16),
    ))


@pytest.fixture(scope="module", params=MOE_ARCHITECTURES)
def moe_dir(request, tmp_path_factory) -> Path:
    return build_tiny_moe_model(tmp_path_factory.mktemp(request.param), request.param)


def test_greedy_matches_hf(moe_dir):
    prompts = random_prompts(400, [1, 6, 2 * GPT_OSS_WINDOW + 3, 45], seed=1)
    shared = random_prompts(400, [GPT_OSS_WINDOW + 4], seed=2)[0]
    prefixed = [shared + tail for tail in random_prompts(400, [3, 9], seed=3)]
    expected = hf_greedy(moe_dir, prompts + prefixed, MAX_TOKENS)
    llm = _engine(moe_dir)
    assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == expected[:len(prompts)]
    chunked = _engine(moe_dir, budget=7)
    first = chunked.generate(prefixed[:1], GREEDY)
    second = chunked.generate(prefixed[1:], GREEDY)
    assert [r.token_ids for r in first + second] == expected[len(prompts):]
    assert second[0].num_cached_tokens > 0


def test_moe_arch_fields():
    qwen = ModelArchConfig.from_hf_config(dict(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=10, hidden_size=8,
        intermediate_size=16, num_hidden_layers=6, num_attention_heads=2, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=4, decoder_sparse_step=2,
        mlp_only_layers=[3], sliding_window=4, use_sliding_window=False))
    assert [qwen.is_sparse_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    assert qwen.qk_norm and qwen.sliding_window is None
    oss = ModelArchConfig.from_hf_config(dict(
        architectures=["GptOssForCausalLM"], vocab_size=10, hidden_size=8,
        intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"]))
    assert [oss.layer_window(i) for i in range(2)] == [128, None]
    assert oss.sliding_window is None and oss.attention_sinks
    with pytest.raises(ValueError, match="unsupported quantization 'fp8'"):
        ModelArchConfig.from_hf_config({**oss.__dict__, **dict(
            architectures=["GptOssForCausalLM"], vocab_size=10, hidden_size=8,
            intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
            num_local_experts=4, num_experts_per_tok=2),
            "quantization_config": {"quant_method": "fp8"}})


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory) -> Path:
    return build_tiny_moe_model(tmp_path_factory.mktemp("mxfp4"), "gpt_oss_mxfp4")


@pytest.mark.parametrize("damage, message", [
    ("scales_shape", "MXFP4 tensor 'model.layers.1.mlp.experts.down_proj'.*do not pair"),
    ("no_scales", "MXFP4 tensor 'model.layers.1.mlp.experts.down_proj_blocks' has no "
                  "'model.layers.1.mlp.experts.down_proj_scales'"),
    ("dtype", "MXFP4 tensor 'model.layers.1.mlp.experts.down_proj'.*uint8"),
])
def test_malformed_mxfp4_is_refused_by_name(mxfp4_dir, tmp_path, damage, message):
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in mxfp4_dir.iterdir():
        (broken / path.name).write_bytes(path.read_bytes())
    tensors = load_file(mxfp4_dir / "model.safetensors")
    name = "model.layers.1.mlp.experts.down_proj_scales"
    if damage == "scales_shape":
        tensors[name] = tensors[name][:, :, :1].contiguous()
    elif damage == "no_scales":
        del tensors[name]
    else:
        tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ValueError, match=message):
        load_model(broken, torch.float32, "cpu", "torch")


def test_mxfp4_weight_memory_is_reported(mxfp4_dir):
    memory = load_model(mxfp4_dir, torch.float32, "cpu", "torch").weight_memory
    assert memory is not None
    # 2 layers x 8 experts x (gate_up 128x64 + down 64x64) values at 4 bits + one scale per 32.
    values = 2 * 8 * (128 * 64 + 64 * 64)
    assert memory.mxfp4_packed_bytes == values // 2 + values // 32
    assert memory.expert_bytes >= values * 4 and memory.dense_bytes > 0


def test_startup_summary_names_layers_memory_kv_and_backend(mxfp4_dir):
    from engine_common.model.startup_summary import startup_summary

    model = load_model(mxfp4_dir, torch.float32, "cpu", "torch")
    lines = startup_summary(model, num_blocks=100, block_size=4, max_model_len=64)
    assert lines[0] == ("architecture GptOssForCausalLM: 1 x sliding-window attention "
                        f"({GPT_OSS_WINDOW} tokens), 1 x full attention, attention sinks; "
                        "2 MoE layers of 8 experts, top-2")
    assert lines[1].startswith("weights: dense ") and "MXFP4 packed" in lines[1]
    assert lines[2] == ("KV cache: 100 blocks of 4 tokens; maximum concurrency at "
                        "max_model_len 64: 6 sequences")
    assert lines[3].startswith("attention backend: torch")


@pytest.mark.parametrize("arch", ["gpt_oss", "qwen3_moe"])
def test_speculative_decoding_matches_hf(tmp_path, arch):
    """n-gram drafts are verified as multi-token queries over the cache (through the
    sink/sliding-window path on GPT-OSS): the greedy tokens stay HF's with drafts run
    (random weights rarely repeat, so few or none are kept)."""
    from engine_common.config import SpeculativeConfig

    model_dir = build_tiny_moe_model(tmp_path / arch, arch)
    prompts = [p * 3 for p in random_prompts(390, [6, 9], seed=5)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24)
    llm = LLM(EngineConfig(
        model=str(model_dir), dtype="float32",
        cache=CacheConfig(block_size=4, num_gpu_blocks_override=256),
        speculative=SpeculativeConfig(num_tokens=4, ngram_min=1, ngram_max=3,
                                      max_batch_size=8)))
    results = llm.generate(prompts, greedy)
    assert [r.token_ids for r in results] == hf_greedy(model_dir, prompts, 24)
    labels = {"model_name": model_dir.name, "engine": "engine-0"}
    drafted = llm.metrics.registry.get_sample_value(
        "vllm:spec_decode_num_draft_tokens_total", labels)
    assert drafted and drafted > 0


def test_lora_is_refused_on_moe_models(mxfp4_dir):
    model = load_model(mxfp4_dir, torch.float32, "cpu", "torch")
    with pytest.raises(ValueError, match="LoRA adapters are not supported for GptOssForCausalLM"):
        model.lora_projection_shapes()


def test_grouped_and_looped_experts_equal_a_per_token_reference():
    from engine_common.model.layers import fused_moe

    torch.manual_seed(0)
    x, w13, w2 = torch.randn(9, 16), torch.randn(4, 16, 16), torch.randn(4, 16, 8)
    b13, b2 = torch.randn(4, 16), torch.randn(4, 16)
    ids = torch.stack([torch.randperm(4)[:2] for _ in range(9)])
    weights = torch.rand(9, 2)
    act = fused_moe.clamped_swiglu(1.702, 7.0)
    want = torch.zeros_like(x)
    for t in range(9):
        for k in range(2):
            e = int(ids[t, k])
            h = act(x[t] @ w13[e].T + b13[e]) @ w2[e].T + b2[e]
            want[t] += weights[t, k] * h
    rows_order = torch.sort(ids.reshape(-1), stable=True)
    rows = x.index_select(0, rows_order.indices // 2)
    grouped = fused_moe._grouped_experts(rows, rows_order.values, 4, w13, w2, act, b13, b2)
    looped = fused_moe._expert_loop(rows, ids.reshape(-1), 4,
                                     fused_moe.plain_projection(w13, w2), act, b13, b2)
    assert torch.equal(grouped, looped)
    got = fused_moe.fused_experts(x, w13, w2, ids, weights, act, b13, b2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_moe_and_sink_models_are_never_captured_in_cuda_graphs(mxfp4_dir, tiny_llama_dir):
    """Their layers plan on the host from each step's routing and lengths: a captured graph
    would replay the capture step's plan."""
    from engine_common.model.attention.torch_backend import TorchAttentionBackend
    from engine_common.model.registry import network_class

    class Capturable(TorchAttentionBackend):
        supports_cuda_graphs = True

    for model_dir, capturable in ((mxfp4_dir, False), (tiny_llama_dir, True)):
        arch = ModelArchConfig.from_model_dir(model_dir)
        model = network_class(arch.architecture)(arch, Capturable, torch.float32,
                                                 torch.device("cpu"))
        assert model.supports_cuda_graphs is capturable



def test_an_all_sliding_model_releases_the_blocks_behind_its_window(tmp_path):
    """Mixtral with a 16-token window on every layer: while a 72-token prompt is prefilled
    in 8-token chunks and decoded, the request holds at most the window's blocks and a
    chunk's (the pool's free count shows the rest released), its tokens stay HF's, and a
    second request with the same prompt hits the released blocks in the prefix cache."""
    model_dir = build_tiny_moe_model(tmp_path / "mixtral", "mixtral")
    prompt = random_prompts(400, [72], seed=7)[0]
    expected = hf_greedy(model_dir, [prompt], MAX_TOKENS)[0]
    llm = _engine(model_dir, budget=8)
    kv = llm.core.kv_cache_manager
    assert kv.sliding_window == MIXTRAL_WINDOW and llm.core.max_model_len > MIXTRAL_WINDOW
    # block_size 4: the window's blocks, one more where it starts mid-block, a chunk's two.
    bound = MIXTRAL_WINDOW // 4 + 1 + 8 // 4
    for run in range(2):
        llm.add_request(prompt, GREEDY, request_id=f"long-{run}")
        tokens: list[int] = []
        held = []
        cached = 0
        while llm.outputs.num_unfinished:
            for out in llm.step():
                tokens.extend(out.new_token_ids)
                cached = out.num_cached_tokens
            held.append(kv.num_blocks - kv.num_free_blocks)
        assert tokens == expected
        assert max(held) <= bound < len(prompt) // 4, held
        assert kv.num_free_blocks == kv.num_blocks
        if run == 1:  # the first run's blocks, released along the way, are hits
            assert cached == (len(prompt) - 1) // 4 * 4


def test_packed_bf16_experts_are_bitwise_the_plain_ones(moe_dir):
    """On the CPU in bf16 each expert's matrices are packed for oneDNN (the plain copies
    freed): every MoE block's output, on a batch spread over the experts, is bitwise the
    unpacked block's (GPT-OSS's biases and clamped SwiGLU included)."""
    from engine_common.model.layers.moe import SparseMoeBlock
    from engine_common.model.packed_linear import bf16_packing_supported

    if not bf16_packing_supported():
        pytest.skip("this CPU has no oneDNN bf16 matmul (AVX512 or AVX-NE-CONVERT): bf16 "
                    "experts stay plain here")
    packed = load_model(moe_dir, torch.bfloat16, "cpu", "torch")
    plain = load_model(moe_dir, torch.bfloat16, "cpu", "torch", pack_weights=False)
    pairs = [(a, b) for a, b in zip(packed.modules(), plain.modules(), strict=True)
             if isinstance(a, SparseMoeBlock)]
    assert pairs and all(a.packed is not None and a.w13.numel() == 0 for a, _ in pairs)
    assert all(b.packed is None for _, b in pairs)
    x = torch.randn(37, packed.arch.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        for ours, reference in pairs:
            assert torch.equal(ours(x.bfloat16()), reference(x.bfloat16()))
    assert packed.weight_memory is not None and plain.weight_memory is not None
    assert packed.weight_memory.expert_bytes >= plain.weight_memory.expert_bytes > 0


def test_gpt_oss_sliding_group_keeps_only_its_window(tmp_path):
    """GPT-OSS alternates a 16-token window and full attention: the cache splits into two
    KV cache groups. A prompt of several windows, prefilled in 8-token chunks and decoded,
    gives HF's tokens while the sliding group's table holds at most the window's blocks
    (and the chunk's) and the full group's holds every block; a second prompt sharing a
    long prefix hits the first one's blocks of both groups and stays exact."""
    model_dir = build_tiny_moe_model(tmp_path / "oss", "gpt_oss")
    prefix = random_prompts(400, [4 * GPT_OSS_WINDOW + 6], seed=11)[0]
    prompts = [prefix + tail for tail in random_prompts(400, [5, 2], seed=12)]
    expected = hf_greedy(model_dir, prompts, MAX_TOKENS)
    llm = _engine(model_dir, budget=8)
    kv = llm.core.kv_cache_manager
    assert [g.window for g in kv.groups.groups] == [None, GPT_OSS_WINDOW]
    assert llm.core.info.model_summary[2] == (
        "KV cache: 256 blocks of 4 tokens x 1 layer in 2 groups: full attention (1 layer) "
        "128 blocks a sequence, sliding window 16 (1 layer) 5 blocks a sequence; maximum "
        "concurrency at max_model_len 512: 1 sequences")
    block = 4
    window_bound = -(-GPT_OSS_WINDOW // block) + 1  # the window's blocks, the one filling
    for run, prompt in enumerate(prompts):
        llm.add_request(prompt, GREEDY, request_id=f"long-{run}")
        tokens: list[int] = []
        cached = 0
        held: list[list[int]] = []
        while llm.outputs.num_unfinished:
            for out in llm.step():
                tokens.extend(out.new_token_ids)
                cached = out.num_cached_tokens
            if llm.outputs.num_unfinished:
                held.append(kv.held_blocks_per_group(f"long-{run}"))
        assert tokens == expected[run]
        # The step before the last (the last one finishes the request): its slots reach the
        # prompt and all outputs but the last two (the one it samples, the next).
        full, sliding = held[-1]
        assert full == -(-(len(prompt) + MAX_TOKENS - 2) // block)
        assert sliding <= window_bound < full // 3, held
        # While prefilling in 8-token chunks: the window's blocks and the chunk's two.
        assert max(s for _, s in held) <= window_bound + 8 // block, held
        assert kv.num_free_blocks == kv.num_blocks
        if run == 1:  # the shared prefix's blocks, of both groups, are hits
            assert cached == len(prefix) // block * block
    # A pool that holds one alone (22 blocks of the full group and up to 7 of the sliding
    # one) but not both, even sharing the prefix's: the scheduler preempts by recompute
    # across both groups, and the re-admitted request's prefix hits (window-only in the
    # sliding group) keep it exact.
    small = LLM(EngineConfig(
        model=str(model_dir), dtype="float32",
        cache=CacheConfig(block_size=block, num_gpu_blocks_override=30),
        scheduler=SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4,
                                  reserve_output_room=False)))
    assert [r.token_ids for r in small.generate(prompts, GREEDY)] == expected
    preemptions = small.metrics.registry.get_sample_value(
        "vllm:num_preemptions_total", {"model_name": model_dir.name, "engine": "engine-0"})
    assert preemptions is not None and preemptions > 0
    assert small.core.kv_cache_manager.num_free_blocks == 30
