"""The engine on an NVIDIA GPU: Triton attention and CUDA-graph decode against HF on the GPU.

Runs only where CUDA is present; off the GPU, tests/test_decode_graphs.py runs the same
Triton kernels (interpreted) and the same padded static decode path (not captured), and
tests/test_triton_attention.py runs the kernels on both.

In float32 the engine must equal Hugging Face's greedy tokens exactly: the kernels use
IEEE fp32 dots (no TF32), and a tiny random model's top two logits are rarely within
float32 noise. In bfloat16 two correct implementations may round differently: there the
engine may leave HF's greedy path only at a near-tie, a step where HF's own logits for the
two tokens differ by at most a few bf16 rounding steps of the logits' scale.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_common.config import CacheConfig, EngineConfig, SchedulerConfig
from engine_common.llm import LLM
from engine_common.sampling_params import SamplingParams
from tests.hf_reference import hf_greedy, random_prompts

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (the CPU path of the same code: tests/test_decode_graphs.py)")

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
# bf16 keeps 8 significant bits: a near-tie is within a few of its steps at the logits' scale.
BF16_TIE_TOLERANCE = 4 * 2.0**-8


def gpu_engine(model_dir: Path, dtype: str, *, enforce_eager: bool = False,
               budget: int = 512) -> LLM:
    return LLM(EngineConfig(
        model=str(model_dir), dtype=dtype, device="cuda", enforce_eager=enforce_eager,
        cache=CacheConfig(block_size=16, num_gpu_blocks_override=1024),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=32),
    ))


def workload(vocab: int) -> list[list[int]]:
    prompts = random_prompts(vocab, [1, 3, 7, 16, 17, 33, 50, 129, 5], seed=11)
    shared = random_prompts(vocab, [40], seed=12)[0]
    return prompts + [shared + tail for tail in random_prompts(vocab, [1, 8, 23], seed=13)]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "mistral"])
def model_dir(request) -> Path:
    return request.getfixturevalue(f"tiny_{request.param}_dir")


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
def test_fp32_greedy_equals_hf_on_gpu(model_dir: Path, enforce_eager: bool):
    llm = gpu_engine(model_dir, "float32", enforce_eager=enforce_eager)
    runner = llm.core.model_runner
    assert runner.model.attention_backend.name == "triton"
    assert (runner.decode_graphs is None) == enforce_eager
    prompts = workload(llm.core.arch.vocab_size)
    expected = hf_greedy(model_dir, prompts, MAX_TOKENS, device="cuda")
    assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == expected
    if runner.decode_graphs is not None:
        assert runner.decode_graphs.num_steps >= MAX_TOKENS - 1


def test_fp32_chunked_prefill_equals_hf_on_gpu(model_dir: Path):
    llm = gpu_engine(model_dir, "float32", budget=16)
    prompts = workload(llm.core.arch.vocab_size)
    expected = hf_greedy(model_dir, prompts, MAX_TOKENS, device="cuda")
    assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == expected


def near_tie(model: torch.nn.Module, context: list[int], a: int, b: int) -> bool:
    """Whether HF's next-token logits after ``context`` make ``a`` and ``b`` a bf16 tie."""
    with torch.inference_mode():
        logits = model(torch.tensor([context], device="cuda")).logits[0, -1].float()
    return bool((logits[a] - logits[b]).abs() <= BF16_TIE_TOLERANCE * logits.abs().max())


def test_bf16_greedy_leaves_hf_only_at_near_ties(model_dir: Path):
    llm = gpu_engine(model_dir, "bfloat16")
    prompts = workload(llm.core.arch.vocab_size)
    expected = hf_greedy(model_dir, prompts, MAX_TOKENS, device="cuda", dtype=torch.bfloat16)
    results = llm.generate(prompts, GREEDY)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).cuda().eval()
    identical = 0
    for prompt, ours, theirs in zip(prompts, (r.token_ids for r in results), expected,
                                    strict=True):
        if ours == theirs:
            identical += 1
            continue
        step = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
        assert near_tie(hf, prompt + theirs[:step], ours[step], theirs[step]), (
            f"left HF's greedy path at step {step} where HF's logits are not a near-tie")
    assert identical >= len(prompts) // 2
