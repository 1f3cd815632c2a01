"""Multi-LoRA serving: the engine with PEFT adapters against Hugging Face + PEFT.

Two adapters are trained-looking (random, nonzero B) PEFT adapters of the tiny Llama:
"alpha" adapts the attention projections with r=8, its rank_pattern / alpha_pattern giving
the fused q|k|v shards different ranks and scalings; "beta" is an rsLoRA of r=4 on v and
the MLP. In float32 the engine's greedy tokens must equal PEFT's ``generate`` with requests
of both adapters and of the base model in the same batches, under chunked prefill,
preemption and speculative decoding, and decode steps with adapter tokens must not replay
the (LoRA-less) decode graphs. Adapters never share prefix-cache blocks with each other or
the base model. Adapters Tandem cannot serve, and unknown adapter names, are refused with
messages that say why. In bf16 with oneDNN-packed weights, the base model's output does not
change by a bit when adapters are loaded. ``vllm:lora_requests_info`` reports the adapters.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine_common.config import (
    CacheConfig,
    EngineConfig,
    ModelSettings,
    SchedulerConfig,
    SpeculativeConfig,
)
from engine_common.generation_request import GenerationRequest
from engine_common.llm import LLM
from engine_common.lora.linear_delta import (
    LoraLinearWeights,
    StackedLoraWeights,
    add_lora_deltas,
)
from engine_common.lora.step_batch import BASE_MODEL_SLOT, LoraBatch
from engine_common.model.packed_linear import bf16_packing_supported
from engine_common.outputs import EngineCoreRequest
from engine_common.sampling_params import SamplingParams
from tests.hf_reference import random_prompts
from tests.model_factory import write_lora_adapter

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
ADAPTERS = ("alpha", "beta", None)  # None: the base model


def write_alpha_and_beta(model_dir: Path, root: Path) -> dict[str, str]:
    """The two adapters this module's tests serve, by name (tests/test_lora_runtime.py
    serves them too)."""
    alpha = write_lora_adapter(model_dir, root / "alpha", seed=1, r=8, lora_alpha=16,
                               target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                               rank_pattern={"k_proj": 2}, alpha_pattern={"v_proj": 4})
    beta = write_lora_adapter(model_dir, root / "beta", seed=2, r=4, lora_alpha=8,
                              use_rslora=True,
                              target_modules=["v_proj", "gate_proj", "up_proj", "down_proj"])
    return {"alpha": str(alpha), "beta": str(beta)}


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return write_alpha_and_beta(tiny_llama_dir, tmp_path_factory.mktemp("lora"))


def peft_model(model_dir: Path, adapter_dir: str | None) -> torch.nn.Module:
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = base if adapter_dir is None else PeftModel.from_pretrained(base, adapter_dir)
    return model.eval()


def peft_greedy(model_dir: Path, adapter_dir: str | None, prompts: list[list[int]],
                max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """HF (+ PEFT) greedy ``generate``, one prompt at a time, EOS suppressed."""
    model = peft_model(model_dir, adapter_dir)
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=0)
            outs.append(out[0, len(prompt):].tolist())
    return outs


def engine(model_dir: Path, lora_modules: dict[str, str], *, budget: int = 512,
           num_blocks: int = 512, dtype: str = "float32",
           speculative: SpeculativeConfig | None = None, policy: str = "fcfs",
           max_loras: int | None = None, allow_runtime_lora_updating: bool = False,
           max_lora_rank: int | None = None, reserve_output_room: bool = True,
           **config: object) -> LLM:
    return LLM(EngineConfig(
        model=str(model_dir), dtype=dtype,
        cache=CacheConfig(block_size=4, num_gpu_blocks_override=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=64,
                                  policy=policy, reserve_output_room=reserve_output_room),
        model_settings=ModelSettings(lora_modules=lora_modules, max_loras=max_loras,
                                     max_lora_rank=max_lora_rank,
                                     allow_runtime_lora_updating=allow_runtime_lora_updating),
        speculative=speculative or SpeculativeConfig(), **config))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def prompts_and_expected(tiny_llama_dir, adapters):
    prompts = random_prompts(400, [3, 9, 17, 30], seed=11)
    expected = {name: peft_greedy(tiny_llama_dir, adapters[name] if name else None, prompts)
                for name in ADAPTERS}
    # The adapters matter: otherwise nothing below would tell them apart.
    for i in range(len(prompts)):
        assert len({tuple(expected[name][i]) for name in ADAPTERS}) == 3
    return prompts, expected


def mixed(prompts: list[list[int]]) -> tuple[list[list[int]], list[str | None]]:
    """Every prompt under every adapter and the base model, interleaved."""
    return ([p for p in prompts for _ in ADAPTERS], [name for _ in prompts for name in ADAPTERS])


def expected_of(expected: dict, prompts: list[list[int]], names: list[str | None],
                all_prompts: list[list[int]]) -> list[list[int]]:
    return [expected[name][all_prompts.index(p)] for p, name in zip(prompts, names, strict=True)]


def record_lora_batches(llm: LLM) -> list[LoraBatch | None]:
    """Every step's ``LoraBatch``, as the model receives it."""
    model = llm.core.model_runner.model
    seen: list[LoraBatch | None] = []
    forward = model.forward

    def recording(*args, **kwargs):
        seen.append(args[4] if len(args) > 4 else kwargs.get("lora"))
        return forward(*args, **kwargs)

    model.forward = recording  # type: ignore[method-assign]
    return seen


# ----------------------------------------------------------------------------- outputs


def test_mixed_adapter_batches_match_hf_peft(tiny_llama_dir, adapters, prompts_and_expected):
    prompts, expected = prompts_and_expected
    llm = engine(tiny_llama_dir, adapters)
    batches = record_lora_batches(llm)
    batch, names = mixed(prompts)
    results = llm.generate(batch, GREEDY, lora_name=names)
    assert [r.token_ids for r in results] == expected_of(expected, batch, names, prompts)
    # One step ran every prefill: both adapters on some rows, the base model on the rest.
    first = batches[0]
    assert first is not None and len(first.groups) == 2
    assert all(group.rows is not None for group in first.groups)
    covered = sum(len(group.rows) for group in first.groups if group.rows is not None)
    assert covered == 2 * sum(len(p) for p in prompts)  # two of three copies of each prompt
    # And plain HF for the base model (PEFT's reference is its base there): no adapter leaks.
    assert expected[None] == peft_greedy(tiny_llama_dir, None, prompts)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_other_families_match_hf_peft(family: str, request: pytest.FixtureRequest,
                                      tmp_path: Path) -> None:
    """Qwen2 (biased q/k/v: the delta adds after the bias, as PEFT's), Qwen3 (q/k norms
    after the projection) and Mistral take adapters on every projection the same way."""
    model_dir = request.getfixturevalue(f"tiny_{family}_dir")
    adapter = write_lora_adapter(model_dir, tmp_path / "all", seed=3, r=4, lora_alpha=8,
                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                 "gate_proj", "up_proj", "down_proj"])
    prompts = random_prompts(400, [5, 19], seed=5)
    llm = engine(model_dir, {"all": str(adapter)})
    results = llm.generate(prompts * 2, GREEDY, lora_name=["all", "all", None, None])
    assert [r.token_ids for r in results] == [
        *peft_greedy(model_dir, str(adapter), prompts), *peft_greedy(model_dir, None, prompts)]


def test_prompt_logprobs_match_peft(tiny_llama_dir, adapters, prompts_and_expected):
    """The numbers, not just the argmax: each position's logprob of the next prompt token."""
    prompt = prompts_and_expected[0][3]
    llm = engine(tiny_llama_dir, adapters)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    results = llm.generate([prompt] * 3, params, lora_name=list(ADAPTERS))
    for name, result in zip(ADAPTERS, results, strict=True):
        with torch.inference_mode():
            logits = peft_model(tiny_llama_dir, adapters[name] if name else None)(
                torch.tensor([prompt])).logits[0].float()
        reference = torch.log_softmax(logits, dim=-1)[torch.arange(len(prompt) - 1),
                                                       torch.tensor(prompt[1:])]
        assert result.prompt_logprobs is not None
        mine = torch.tensor([lp.logprob for lp in result.prompt_logprobs[1:]])
        torch.testing.assert_close(mine, reference, rtol=0, atol=1e-5)


def test_chunked_prefill_keeps_the_adapter(tiny_llama_dir, adapters, prompts_and_expected):
    prompts, expected = prompts_and_expected
    llm = engine(tiny_llama_dir, adapters, budget=5)  # prompts over 5 tokens are chunked
    batch, names = mixed(prompts)
    results = llm.generate(batch, GREEDY, lora_name=names)
    assert [r.token_ids for r in results] == expected_of(expected, batch, names, prompts)


def test_preemption_keeps_the_adapter(tiny_llama_dir, adapters, prompts_and_expected):
    prompts, expected = prompts_and_expected
    llm = engine(tiny_llama_dir, adapters, num_blocks=20, reserve_output_room=False)
    batch, names = mixed(prompts)
    results = llm.generate(batch, GREEDY, lora_name=names)
    assert [r.token_ids for r in results] == expected_of(expected, batch, names, prompts)
    preemptions = llm.metrics.registry.get_sample_value(
        "vllm:num_preemptions_total", {"model_name": tiny_llama_dir.name, "engine": "engine-0"})
    assert preemptions and preemptions > 0


def test_speculative_drafts_run_their_requests_adapter(tiny_llama_dir, adapters):
    # Prompts that repeat themselves, so the n-gram drafter proposes drafts.
    prompts = [p * 3 for p in random_prompts(390, [6, 9], seed=5)]
    max_tokens = 16
    spec = SpeculativeConfig(num_tokens=4, ngram_min=1, ngram_max=3, max_batch_size=8)
    llm = engine(tiny_llama_dir, adapters, speculative=spec)
    batch, names = mixed(prompts)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)
    results = llm.generate(batch, params, lora_name=names)
    expected = {name: peft_greedy(tiny_llama_dir, adapters[name] if name else None, prompts,
                                  max_tokens) for name in ADAPTERS}
    assert [r.token_ids for r in results] == expected_of(expected, batch, names, prompts)
    drafted = llm.metrics.registry.get_sample_value(
        "vllm:spec_decode_num_draft_tokens_total",
        {"model_name": tiny_llama_dir.name, "engine": "engine-0"})
    assert drafted and drafted > 0


def test_decode_steps_with_adapters_run_eagerly(tiny_llama_dir, adapters, prompts_and_expected):
    """The decode graphs were captured without LoRA: a step with adapter tokens must not
    replay them (the static runner, uncaptured, stands in for them on a CPU)."""
    prompts, expected = prompts_and_expected
    llm = engine(tiny_llama_dir, adapters, attention_backend="triton")
    runner = llm.core.model_runner
    graphs = runner.decode_graphs = runner.static_decode_runner(llm.core.max_model_len,
                                                                capture=False)
    results = llm.generate(prompts[:2], GREEDY, lora_name=["alpha", None])
    assert [r.token_ids for r in results] == [expected["alpha"][0], expected[None][1]]
    assert graphs.num_steps == 0
    results = llm.generate(prompts[:2], GREEDY)  # base model only: the graphs serve it
    assert [r.token_ids for r in results] == expected[None][:2]
    assert graphs.num_steps == MAX_TOKENS - 1


# ----------------------------------------------------------------------------- prefix cache


def test_adapters_never_share_prefix_cache_blocks(tiny_llama_dir, adapters,
                                                  prompts_and_expected):
    prompts, expected = prompts_and_expected
    prompt = prompts[3]  # 30 tokens: 7 full blocks of 4 can be reused
    llm = engine(tiny_llama_dir, adapters)

    def run(name: str | None) -> int:
        result = llm.generate([prompt], GREEDY, lora_name=name)[0]
        assert result.token_ids == expected[name][3]
        return result.num_cached_tokens

    assert run("alpha") == 0
    assert run("beta") == 0  # the same tokens under another adapter: other KV
    assert run(None) == 0
    assert run("beta") == 28  # the same adapter again: its own blocks
    assert run("alpha") == 28
    assert run(None) == 28


# ----------------------------------------------------------------------------- refusals


def test_unknown_adapter_names_are_refused(tiny_llama_dir, adapters):
    llm = engine(tiny_llama_dir, adapters)
    with pytest.raises(ValueError, match=r"unknown LoRA adapter 'gamma'; this engine serves: "
                                         r"alpha, beta"):
        llm.add_request([5, 6, 7], GREEDY, lora_name="gamma")
    with pytest.raises(ValueError, match="unknown LoRA adapter 'gamma'"):
        llm.core.add_request(EngineCoreRequest(
            "r", GenerationRequest([5, 6, 7], GREEDY, lora_name="gamma"), 0.0))
    # A list naming one unknown adapter queues nothing.
    with pytest.raises(ValueError, match="'gamma'"):
        llm.generate([[5, 6], [7, 8]], GREEDY, lora_name=["alpha", "gamma"])
    assert not llm.core.has_unfinished_requests()
    plain = engine(tiny_llama_dir, {})
    with pytest.raises(ValueError, match="this engine serves no LoRA adapters"):
        plain.add_request([5, 6, 7], GREEDY, lora_name="alpha")


def _edit_config(**changes: object) -> Callable[[Path], None]:
    def edit(adapter_dir: Path) -> None:
        path = adapter_dir / "adapter_config.json"
        config = json.loads(path.read_text())
        config.update(changes)
        path.write_text(json.dumps(config))
    return edit


def _edit_weights(edit: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    def apply(adapter_dir: Path) -> None:
        path = adapter_dir / "adapter_model.safetensors"
        tensors = load_file(str(path))
        edit(tensors)
        save_file(tensors, str(path))
    return apply


def _rename(old: str, new: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        for key in [k for k in tensors if old in k]:
            tensors[key.replace(old, new)] = tensors.pop(key)
    return edit


_Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
BAD_ADAPTERS = {
    "no config": (lambda d: (d / "adapter_config.json").unlink(), "no adapter_config.json"),
    "no weights": (lambda d: (d / "adapter_model.safetensors").unlink(),
                   "no adapter_model.safetensors"),
    "DoRA": (_edit_config(use_dora=True), r"DoRA \(use_dora\)"),
    "modules_to_save": (_edit_config(modules_to_save=["lm_head"]), "modules_to_save"),
    "lm_head target": (_edit_config(target_modules=["q_proj", "lm_head"]),
                       r"the embeddings or the LM head \(lm_head\)"),
    "embedding target": (_edit_config(target_modules="embed_tokens"),
                         "the embeddings or the LM head"),
    "trained bias": (_edit_config(bias="all"), "bias='all'"),
    "not LoRA": (_edit_config(peft_type="IA3"), "peft_type is 'IA3', not 'LORA'"),
    "a layer the model lacks": (_edit_weights(_rename("layers.1.", "layers.7.")),
                                "layer 7, but the model has 2 layers"),
    "a module the model lacks": (_edit_weights(_rename("q_proj", "qkv_proj")),
                                 "not a LoRA A or B matrix of a projection"),
    "lm_head weights": (_edit_weights(lambda t: t.update(
        {"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)})),
                        "adapts the embeddings or the LM head"),
    "a shape the model lacks": (_edit_weights(lambda t: t.update({_Q_A: torch.zeros(8, 32)})),
                                r"lora_A \(8, 32\) .* needs \[r, 64\]"),
    "a rank the config does not give": (_edit_config(r=6), "with r=6"),
    "half a pair": (_edit_weights(lambda t: t.pop(_Q_A)), "q_proj has no lora_A weight"),
}


@pytest.mark.parametrize("case", list(BAD_ADAPTERS))
def test_adapters_tandem_cannot_serve_are_refused(tiny_llama_dir, adapters, tmp_path, case):
    spoil, message = BAD_ADAPTERS[case]
    bad = tmp_path / "bad"
    shutil.copytree(adapters["alpha"], bad)
    spoil(bad)
    with pytest.raises(ValueError, match=f"LoRA adapter 'odd'.*{message}"):
        engine(tiny_llama_dir, {"alpha": adapters["alpha"], "odd": str(bad)})


# ----------------------------------------------------------------------------- bf16, metrics


def test_bf16_packed_base_output_is_unchanged_by_adapters(tiny_llama_dir, adapters):
    """The delta is added after the packed base output, to adapter rows only: base rows of
    a batch mixed with adapter rows are bitwise those of an engine without adapters."""
    # Distinct prompts: no prefix-cache hits, so both engines run steps of the same shapes.
    batch = random_prompts(400, [3, 9, 17, 30, 5, 12, 21, 2, 8], seed=12)
    names = [ADAPTERS[i % 3] for i in range(len(batch))]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS,
                            logprobs=2)
    with_lora = engine(tiny_llama_dir, adapters, dtype="bfloat16")
    without = engine(tiny_llama_dir, {}, dtype="bfloat16")
    model = with_lora.core.model_runner.model
    packed = bf16_packing_supported()  # else plain F.linear: the same holds
    assert (model.packed_lm_head is not None) == packed
    assert (model.model.layers[0].self_attn.qkv_proj.packed_weight is not None) == packed
    mine = with_lora.generate(batch, params, lora_name=names)
    theirs = without.generate(batch, params)
    for name, a, b in zip(names, mine, theirs, strict=True):
        if name is None:
            assert (a.token_ids, a.logprobs) == (b.token_ids, b.logprobs)
    assert any(a.token_ids != b.token_ids for a, b in zip(mine, theirs, strict=True))


def lora_info(llm: LLM) -> dict[str, str]:
    """The labels of ``vllm:lora_requests_info``'s latest sample."""
    family = next(f for f in llm.metrics.registry.collect() if f.name == "vllm:lora_requests_info")
    return max(family.samples, key=lambda s: s.value).labels


def test_lora_requests_info_metric(tiny_llama_dir, adapters):
    llm = engine(tiny_llama_dir, adapters, budget=6)
    llm.add_request([5] * 6, GREEDY, lora_name="beta")
    llm.add_request([6] * 6, GREEDY, lora_name="alpha")  # waits: the budget is spent
    llm.add_request([7] * 6, GREEDY)
    llm.step()
    info = lora_info(llm)
    assert (info["running_lora_adapters"], info["waiting_lora_adapters"]) == ("beta", "alpha")
    assert info["max_lora"] == "2"
    while llm.outputs.num_unfinished:
        llm.step()
    info = lora_info(llm)
    assert (info["running_lora_adapters"], info["waiting_lora_adapters"]) == ("", "")
    # An engine without adapters has no such metric (as vLLM without --enable-lora).
    plain = engine(tiny_llama_dir, {})
    plain.generate([[5, 6]], GREEDY)
    assert "vllm:lora_requests_info" not in {f.name for f in plain.metrics.registry.collect()}


def test_stacked_groups_add_what_one_group_at_a_time_adds() -> None:
    """Several adapters in one batched matmul (padded groups, a subset of the slots) add
    the same deltas as one adapter's rows at a time."""
    torch.manual_seed(0)
    in_features, out_features = 12, 10

    def weights(rank: int, scalings: tuple[tuple[int, int, float], ...]) -> LoraLinearWeights:
        return LoraLinearWeights(torch.randn(rank, in_features),
                                 torch.randn(out_features, rank), scalings)

    adapters = {0: weights(4, ((0, 10, 2.0),)), 1: weights(2, ((0, 6, 0.5), (6, 10, 1.5))),
                3: weights(3, ((4, 10, 0.25),))}  # slot 2: an adapter not targeting this
    stacked = StackedLoraWeights.stack(adapters, 4, in_features, out_features)
    x, y = torch.randn(9, in_features), torch.randn(9, out_features)
    slots = [3, BASE_MODEL_SLOT, 1, 3, 2, 1, 3]  # requests of 1 or 2 tokens
    batch = LoraBatch.build(slots, np.array([1, 2, 1, 1, 1, 2, 1]), torch.device("cpu"),
                            torch.float32)
    assert batch is not None and batch.stacked is not None
    assert batch.stacked.pad_mask is not None  # groups of 3, 3 and 1 rows
    one_at_a_time = add_lora_deltas(y.clone(), x, adapters, None, batch)
    together = add_lora_deltas(y.clone(), x, adapters, stacked, batch)
    torch.testing.assert_close(together, one_at_a_time, rtol=1e-6, atol=1e-6)
    assert torch.equal(together[1:3], y[1:3])  # the base model's rows: untouched
