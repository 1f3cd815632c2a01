"""LoRA adapters loaded and unloaded while the engine serves, and ``max_loras``.

A runtime-loaded adapter gives, in float32, the same greedy tokens as Hugging Face + PEFT
and as the same adapter loaded at start, with base-model requests in the same batches.
Unloading refuses the name at once, while a request already running with it finishes with
its weights; the weights leave the model once it has, and a later adapter takes the freed
slot (a hole in the middle of the stacked weights meanwhile). A name served again with
other weights never hits prefix-cache blocks computed with the old ones. Each refusal
(name taken or draining, name unknown, an adapter Tandem cannot serve) raises its own
exception and leaves the engine serving as before. ``max_loras`` keeps the running
requests to that many adapters, while base-model requests run beside them and skipped
requests keep their places under both scheduling policies. The same operations go through
the real engine-core process from ``AsyncLLM``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from pathlib import Path

import pytest
from safetensors.torch import load_file

from engine_common.async_llm import AsyncLLM
from engine_common.config import CacheConfig, EngineConfig, ModelSettings
from engine_common.core_process import EngineDeadError
from engine_common.generation_request import GenerationRequest
from engine_common.kv_events import BlockRemoved
from engine_common.llm import LLM
from engine_common.lora.errors import LoraAdapterExists, LoraAdapterNotFound
from engine_common.model.layers.linear import Linear
from engine_common.request import Request
from engine_common.scheduler import SchedulerOutput, WaitingQueue
from tests.hf_reference import random_prompts
from tests.model_factory import write_lora_adapter
from tests.test_lora import (
    BAD_ADAPTERS,
    GREEDY,
    engine,
    peft_greedy,
    write_alpha_and_beta,
)

pytestmark = pytest.mark.timeout(120)

# The second prompt has 7 full blocks of 4 tokens: a prefix-cache hit of 28 tokens.
PROMPTS = random_prompts(400, [5, 30, 11], seed=21)
LONG = 1


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora-runtime")
    paths = write_alpha_and_beta(tiny_llama_dir, root)
    paths["gamma"] = str(write_lora_adapter(
        tiny_llama_dir, root / "gamma", seed=3, r=4, lora_alpha=8,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"]))
    paths["delta"] = str(write_lora_adapter(
        tiny_llama_dir, root / "delta", seed=4, r=2, lora_alpha=4,
        target_modules=["q_proj", "v_proj", "down_proj"]))
    return paths


@pytest.fixture(scope="module")
def expected(tiny_llama_dir: Path, adapters: dict[str, str]) -> dict[str | None, list[list[int]]]:
    """PEFT's greedy tokens of every prompt under each adapter, and HF's (None)."""
    out: dict[str | None, list[list[int]]] = {
        name: peft_greedy(tiny_llama_dir, path, PROMPTS) for name, path in adapters.items()}
    out[None] = peft_greedy(tiny_llama_dir, None, PROMPTS)
    # Every adapter changes every prompt's tokens: otherwise nothing here tells them apart.
    for i in range(len(PROMPTS)):
        assert len({tuple(tokens[i]) for tokens in out.values()}) == len(out)
    return out


def linears(llm: LLM) -> list[Linear]:
    return [m for m in llm.core.model_runner.model.modules() if isinstance(m, Linear)]


def run(llm: LLM, tokens: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
    """Step until every request has finished; each request's tokens (added to ``tokens``)."""
    tokens = {} if tokens is None else tokens
    while llm.outputs.num_unfinished:
        for out in llm.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def generate(llm: LLM, names: list[str | None]) -> list[list[int]]:
    """Every prompt under each of ``names``, all in one batch."""
    results = llm.generate([p for _ in names for p in PROMPTS], GREEDY,
                           lora_name=[name for name in names for _ in PROMPTS])
    return [r.token_ids for r in results]


def expected_of(expected: dict[str | None, list[list[int]]],
                names: list[str | None]) -> list[list[int]]:
    return [tokens for name in names for tokens in expected[name]]


# ----------------------------------------------------------------------------- loading


def test_runtime_loaded_adapter_matches_peft_and_start_up_loading(tiny_llama_dir, adapters,
                                                                  expected):
    llm = engine(tiny_llama_dir, {}, allow_runtime_lora_updating=True)
    assert llm.lora_names == []
    llm.generate(PROMPTS, GREEDY)  # serving before the load changes nothing
    llm.load_lora_adapter("alpha", adapters["alpha"])
    assert llm.lora_names == ["alpha"]
    names: list[str | None] = ["alpha", None]
    assert generate(llm, names) == expected_of(expected, names)
    at_start = engine(tiny_llama_dir, {"alpha": adapters["alpha"]})
    assert generate(at_start, names) == expected_of(expected, names)
    # The statistics count it (no max_loras: the adapters served).
    assert llm.core.scheduler.make_stats().max_lora == 1


def test_unloading_drains_the_requests_already_running(tiny_llama_dir, adapters, expected):
    llm = engine(tiny_llama_dir, {"alpha": adapters["alpha"], "beta": adapters["beta"]})
    assert llm.core.model_runner.lora_adapters.slots == {"alpha": 0, "beta": 1}
    on_alpha, _ = llm.add_request(PROMPTS[LONG], GREEDY, lora_name="alpha")
    on_beta, _ = llm.add_request(PROMPTS[0], GREEDY, lora_name="beta")
    tokens = {out.request_id: list(out.new_token_ids) for out in llm.step()}
    assert len(tokens[on_alpha]) == 1  # prefilled, seven tokens to go

    llm.unload_lora_adapter("alpha")
    assert llm.lora_names == ["beta"]
    with pytest.raises(ValueError, match="unknown LoRA adapter 'alpha'; this engine serves: beta"):
        llm.add_request(PROMPTS[2], GREEDY, lora_name="alpha")
    with pytest.raises(LoraAdapterExists, match=r"'alpha' is still being unloaded: 1 request\(s\) "
                                                "still run with it; try again once they finish"):
        llm.load_lora_adapter("alpha", adapters["alpha"])
    for out in llm.step():
        tokens[out.request_id].extend(out.new_token_ids)
    # No adapter served at all now, and both requests still run with theirs.
    llm.unload_lora_adapter("beta")
    assert llm.lora_names == []
    with pytest.raises(ValueError, match="unknown LoRA adapter 'beta': this engine serves no"):
        llm.add_request(PROMPTS[2], GREEDY, lora_name="beta")
    assert {slot for linear in linears(llm) for slot in linear.lora} == {0, 1}

    run(llm, tokens)
    assert tokens[on_alpha] == expected["alpha"][LONG]
    assert tokens[on_beta] == expected["beta"][0]
    # Drained: the weights left every projection, which are the base model's again.
    assert not llm.core.model_runner.lora_adapters.has_weights
    assert all(not linear.lora and linear.lora_stacked is None for linear in linears(llm))
    assert generate(llm, [None]) == expected[None]


def test_a_freed_slot_in_the_middle_is_reused(tiny_llama_dir, adapters, expected):
    llm = engine(tiny_llama_dir, {}, allow_runtime_lora_updating=True)
    for name in ("alpha", "beta", "gamma"):
        llm.load_lora_adapter(name, adapters[name])
    llm.unload_lora_adapter("beta")
    loaded = llm.core.model_runner.lora_adapters
    assert loaded.slots == {"alpha": 0, "gamma": 2}
    # Idle: beta's weights left at once; its slot is a hole of zeros in the stacked weights.
    assert all(1 not in linear.lora for linear in linears(llm))
    down = llm.core.model_runner.model.model.layers[0].mlp.down_proj  # gamma's only
    assert set(down.lora) == {2} and down.lora_stacked is not None
    assert down.lora_stacked.a_t.shape[0] == 3 and not down.lora_stacked.a_t[:2].any()
    # Slots 0 and 2 with a hole between them, in one step.
    names: list[str | None] = ["alpha", "gamma", None]
    assert generate(llm, names) == expected_of(expected, names)

    llm.load_lora_adapter("delta", adapters["delta"])
    assert loaded.slots == {"alpha": 0, "gamma": 2, "delta": 1}
    # Delta's own matrices went to slot 1 (q's A first in the fused q|k|v projection).
    q_a = load_file(str(Path(adapters["delta"]) / "adapter_model.safetensors"))[
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    qkv = llm.core.model_runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.lora[1].a[:2].equal(q_a)
    names = ["alpha", "gamma", "delta", None]
    assert generate(llm, names) == expected_of(expected, names)


def test_a_name_served_again_never_hits_the_old_adapters_cache(tiny_llama_dir, adapters,
                                                               expected):
    llm = engine(tiny_llama_dir, {"x": adapters["alpha"]})
    kv = llm.core.kv_cache_manager
    prompt = PROMPTS[LONG]
    results = llm.generate([prompt, prompt], GREEDY, lora_name=["x", None])
    assert [r.token_ids for r in results] == [expected["alpha"][LONG], expected[None][LONG]]
    assert llm.generate([prompt], GREEDY, lora_name="x")[0].num_cached_tokens == 28
    # A base-model request holds its (cached) blocks across the reload.
    base_id, _ = llm.add_request(prompt, GREEDY)
    tokens = {out.request_id: list(out.new_token_ids) for out in llm.step()}
    held = {b.block_hash for b in kv.get_blocks(base_id) if b.block_hash is not None}
    assert len(held) == 7
    cached = set(kv.get_cached_block_hashes())

    llm.unload_lora_adapter("x")
    llm.load_lora_adapter("x", adapters["beta"])
    removed = [h for event in kv.take_events() if isinstance(event, BlockRemoved)
               for h in event.block_hashes]
    assert sorted(removed) == sorted(cached - held)  # the old x's blocks among them
    assert set(kv.get_cached_block_hashes()) == held

    assert run(llm, tokens)[base_id] == expected[None][LONG]
    result = llm.generate([prompt], GREEDY, lora_name="x")[0]
    assert result.token_ids == expected["beta"][LONG]
    assert result.num_cached_tokens == 0


# ----------------------------------------------------------------------------- refusals


def test_refusals_leave_the_engine_serving(tiny_llama_dir, adapters, expected, tmp_path):
    llm = engine(tiny_llama_dir, {"alpha": adapters["alpha"]})
    before = {id(linear): set(linear.lora) for linear in linears(llm)}
    names: list[str | None] = ["alpha", None]

    def still_serving() -> None:
        assert llm.lora_names == ["alpha"]
        assert {id(linear): set(linear.lora) for linear in linears(llm)} == before
        assert generate(llm, names) == expected_of(expected, names)

    with pytest.raises(LoraAdapterExists, match="LoRA adapter 'alpha' is already loaded"):
        llm.load_lora_adapter("alpha", adapters["beta"])
    still_serving()
    with pytest.raises(LoraAdapterNotFound,
                       match="LoRA adapter 'beta' is not loaded; this engine serves: alpha"):
        llm.unload_lora_adapter("beta")
    with pytest.raises(ValueError, match="a LoRA adapter needs a name"):
        llm.load_lora_adapter("", adapters["beta"])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=f"LoRA adapter 'odd': no adapter_config.json in "
                                         f"'{empty}'"):
        llm.load_lora_adapter("odd", str(empty))
    damaged = tmp_path / "damaged"
    shutil.copytree(adapters["beta"], damaged)
    (damaged / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="LoRA adapter 'odd': cannot read .*adapter_model"):
        llm.load_lora_adapter("odd", str(damaged))
    # Every adapter start-up refuses is refused at runtime, with the same message.
    for case, (spoil, message) in BAD_ADAPTERS.items():
        bad = tmp_path / case.replace(" ", "-")
        shutil.copytree(adapters["alpha"], bad)  # the adapter they spoil
        spoil(bad)
        with pytest.raises(ValueError, match=f"LoRA adapter 'odd'.*{message}"):
            llm.load_lora_adapter("odd", str(bad))
    still_serving()


def test_max_lora_rank_refuses_a_higher_rank_at_start_and_at_run_time(tiny_llama_dir,
                                                                      adapters):
    """alpha: rank 8 (2 on k_proj); beta: rank 4. vLLM's max_lora_rank, checked against the
    largest rank of any projection."""
    with pytest.raises(ValueError, match="LoRA adapter 'alpha' has rank 8, above "
                                         "--max-lora-rank 4"):
        engine(tiny_llama_dir, {"alpha": adapters["alpha"]}, max_lora_rank=4)
    llm = engine(tiny_llama_dir, {"beta": adapters["beta"]}, max_lora_rank=4)
    with pytest.raises(ValueError, match="LoRA adapter 'a' has rank 8, above --max-lora-rank 4"):
        llm.load_lora_adapter("a", adapters["alpha"])
    llm.load_lora_adapter("g", adapters["gamma"])  # rank 4: at the cap
    assert llm.lora_names == ["beta", "g"]


# ----------------------------------------------------------------------------- max_loras


def record_steps(llm: LLM) -> list[tuple[list[str | None], set[str]]]:
    """Each step's scheduled requests' adapters, and the running requests' adapters."""
    scheduler = llm.core.scheduler
    steps: list[tuple[list[str | None], set[str]]] = []
    schedule = scheduler.schedule

    def recording() -> SchedulerOutput:
        out = schedule()
        steps.append(([s.request.lora_name for s in out.scheduled],
                      {r.lora_name for r in scheduler.running if r.lora_name}))
        return out

    scheduler.schedule = recording  # type: ignore[method-assign]
    return steps


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_max_loras_runs_one_adapter_at_a_time_beside_the_base_model(
        tiny_llama_dir, adapters, expected, policy):
    llm = engine(tiny_llama_dir, {"alpha": adapters["alpha"], "beta": adapters["beta"]},
                 max_loras=1, policy=policy)
    steps = record_steps(llm)
    order: list[str | None] = ["alpha", "beta", None, "alpha", "beta", None]
    ids = [llm.add_request(PROMPTS[i % 2], GREEDY, lora_name=name)[0]
           for i, name in enumerate(order)]
    tokens = run(llm)
    assert [tokens[i] for i in ids] == [expected[name][i % 2] for i, name in enumerate(order)]
    assert all(len(running) <= 1 and len({n for n in names if n}) <= 1
               for names, running in steps)
    # Both base requests ran in the first step, beside alpha's (beta's was skipped).
    assert steps[0][0] == ["alpha", None, "alpha", None]
    # Beta's requests waited for alpha's last one, then ran in their order.
    first_beta = next(i for i, (names, _) in enumerate(steps) if "beta" in names)
    assert all("alpha" not in names for names, _ in steps[first_beta:])
    assert steps[first_beta][0] == ["beta", "beta"]
    stats = llm.core.scheduler.make_stats()
    assert stats.max_lora == 1


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_skipped_requests_keep_their_places(policy: str) -> None:
    queue = WaitingQueue(policy)
    # The same arrival time: only the queue's own order tells them apart.
    requests = [Request(f"r{i}", [1], GREEDY, arrival_time=0.0) for i in range(5)]
    for request in requests:
        queue.add(request)
    assert queue.skip() is requests[0]
    assert queue.pop() is requests[1]
    assert queue.skip() is requests[2]
    assert len(queue) == 2 and queue.peek() is requests[3]
    queue.restore_skipped()
    assert [queue.pop() for _ in range(len(queue))] == [requests[0], requests[2], requests[3],
                                                        requests[4]]


# ----------------------------------------------------------------------------- AsyncLLM


async def _tokens(llm: AsyncLLM, request_id: str, prompt: list[int],
                  lora_name: str | None) -> tuple[list[int], str | None]:
    tokens: list[int] = []
    finish_reason = None
    async for out in llm.generate(request_id,
                                  GenerationRequest(prompt, GREEDY, lora_name=lora_name)):
        tokens.extend(out.new_token_ids)
        finish_reason = out.finish_reason
    return tokens, finish_reason


def test_async_llm_loads_and_unloads_through_the_core_process(tiny_llama_dir, adapters,
                                                              expected, tmp_path):
    config = EngineConfig(
        model=str(tiny_llama_dir), dtype="float32",
        cache=CacheConfig(block_size=4, num_gpu_blocks_override=256),
        model_settings=ModelSettings(lora_modules={"beta": adapters["beta"]},
                                     allow_runtime_lora_updating=True))

    async def main() -> None:
        llm = await AsyncLLM.create(config)
        try:
            assert llm.lora_names == ["beta"]
            await llm.load_lora_adapter("alpha", adapters["alpha"])
            assert llm.lora_names == ["alpha", "beta"]
            assert await asyncio.gather(_tokens(llm, "a", PROMPTS[0], "alpha"),
                                        _tokens(llm, "b", PROMPTS[0], None)) == [
                (expected["alpha"][0], "length"), (expected[None][0], "length")]

            with pytest.raises(LoraAdapterExists, match="'alpha' is already loaded"):
                await llm.load_lora_adapter("alpha", adapters["gamma"])
            with pytest.raises(LoraAdapterNotFound,
                               match="'gamma' is not loaded; this engine serves: alpha, beta"):
                await llm.unload_lora_adapter("gamma")
            with pytest.raises(ValueError, match="LoRA adapter 'gamma': no adapter_config"):
                await llm.load_lora_adapter("gamma", str(tmp_path))
            assert llm.lora_names == ["alpha", "beta"]

            # Unloaded while its request runs: the request finishes with it, new ones are
            # refused by the core.
            stream = llm.generate("c", GenerationRequest(PROMPTS[LONG], GREEDY, lora_name="alpha"))
            tokens = list((await anext(stream)).new_token_ids)
            await llm.unload_lora_adapter("alpha")
            assert llm.lora_names == ["beta"]
            async for out in stream:
                tokens.extend(out.new_token_ids)
            assert tokens == expected["alpha"][LONG]
            assert (await _tokens(llm, "d", PROMPTS[0], "alpha")) == ([], "abort")
            # Drained when its request finished: the name is free for other weights.
            await llm.load_lora_adapter("alpha", adapters["gamma"])
            assert (await _tokens(llm, "e", PROMPTS[0], "alpha")) == (expected["gamma"][0],
                                                                       "length")

            # The core dies while a load waits for its answer (stopped first, so it cannot
            # answer before it dies).
            os.kill(llm.core.process.pid, signal.SIGSTOP)
            waiting = asyncio.ensure_future(llm.load_lora_adapter("delta", adapters["delta"]))
            await asyncio.sleep(0.2)
            os.kill(llm.core.process.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(waiting, 30)
            with pytest.raises(EngineDeadError):
                await llm.unload_lora_adapter("beta")
        finally:
            llm.shutdown()

    asyncio.run(main())
