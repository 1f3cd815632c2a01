"""KV tiers on a multi-turn chat: TTFT and hit rates per tier, with and without tiers.

The workload is LMBenchmark's multi-round QA, on token ids: ``--users`` users share a system
prompt; each turn appends the user's previous answer and ``--turn-tokens`` new tokens, and
asks for ``--output-tokens`` greedy tokens. Users are interleaved (turn 1 of every user,
then turn 2 of every user, ...), one request at a time, so that between two turns of one
user the other users' contexts pass through the engine's KV pool (``--kv-blocks``, at most
a quarter of the working set): without tiers a user's previous context is gone by the time
they come back, and their next turn is recomputed.

Scenarios, each on the real engine (``LLM``) with its real tiers, in this order:
  none    one engine, no tiers (the prefix cache alone);
  host    one engine with a host-memory tier holding the working set;
  disk    one engine with the disk tier only, rebuilt (a new engine, a new KV pool, the
          same LMDB directory) before the last turn: the last turn's hits are a restarted
          replica's;
  shared  two engines with the shared tier only (a loopback redis-server), a user's turns
          alternating between them: what one computed the other loads;
with rounds repeated (``--rounds``). Within a round every scenario's engines run side by
side in this process, and each turn is served by one scenario after the other, so the
machine's drift reaches all scenarios alike (their tiers' background stores overlap the
next scenario's turn, as other tenants' work would).

Reported per scenario: TTFT p50 and p95 over turns >= 2 (from submission to the first
token, one request at a time: the tier load's wait and the prefill), the hit rate over
turns >= 2 against the theoretical maximum (every block of the prompt computed before, up
to its last token), split by tier (device, host, disk, shared), and the router's prediction:
the gateway's prefix index fed the engines' own KV events (``medium`` per tier) before each
turn, against the blocks the engine then took from each tier. Ratios: none over host (TTFT),
shared over host (hit rate), disk after restart over the maximum.

Results: ``bench/results/kv_tiers.json``. The machine is shared (other tenants' load is in
the results' ``load_average_at_end``): read TTFT ratios within a round, not across runs.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.chat_workload import ChatWorkload  # noqa: E402
from bench.report import write_report  # noqa: E402
from deploy.kv_store import free_port, redis_server  # noqa: E402
from engine_common.block_hash import hash_prompt_blocks  # noqa: E402
from engine_common.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from engine_common.kv_events import KVEventBatch  # noqa: E402
from engine_common.kv_tiers.config import KvTiersConfig  # noqa: E402
from engine_common.llm import LLM  # noqa: E402
from engine_common.sampling_params import SamplingParams  # noqa: E402
from gateway.prefix_index import PrefixIndex  # noqa: E402
from services.engine_api.messages import kv_event_batch_to_pb  # noqa: E402

MEDIA = ("device", "host", "disk", "shared")


@dataclass
class TurnResult:
    user: int
    turn: int
    ttft: float
    prompt_tokens: int
    max_hit_tokens: int  # every full block computed before, short of the last token
    hit_tokens: dict[str, int]  # by medium
    predicted_blocks: dict[str, int]  # by medium, the router's view before the turn
    tokens: list[int] = field(default_factory=list)


class IndexedEngine:
    """An engine whose every step's KV events feed the shared prefix index, as a gateway's
    watcher would (through the wire format)."""

    def __init__(self, name: str, llm: LLM, index: PrefixIndex) -> None:
        self.name, self.llm, self.index = name, llm, index
        self.seq = 0

    def step(self):  # type: ignore[no-untyped-def]
        outputs = self.llm.step()
        events = self.llm.last_kv_events
        if events:
            self.seq += 1
            self.index.apply(self.name, kv_event_batch_to_pb(KVEventBatch(self.seq, 0.0, events)))
        return outputs


def make_llm(args: argparse.Namespace, tiers: KvTiersConfig, engine_id: str) -> LLM:
    llm = LLM(EngineConfig(
        model=args.model, dtype=args.dtype, engine_id=engine_id,
        cache=CacheConfig(block_size=args.block_size, num_gpu_blocks_override=args.kv_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=4),
        kv_tiers=tiers))
    # NOTE: the offline LLM drops KV events; keep each step's for the index.
    core_step = llm.core.step

    def step_keeping_events():  # type: ignore[no-untyped-def]
        outputs = core_step()
        llm.last_kv_events = outputs.kv_events  # type: ignore[attr-defined]
        return outputs

    llm.core.step = step_keeping_events  # type: ignore[method-assign]
    llm.last_kv_events = []  # type: ignore[attr-defined]
    return llm


def one_turn(engine: IndexedEngine, prompt: list[int], params: SamplingParams,
             block_size: int) -> tuple[float, list[int], int, dict[str, int], dict[str, int]]:
    """TTFT, tokens, cached tokens, tier hits (tokens, by medium), the router's prediction."""
    llm = engine.llm
    hashes = hash_prompt_blocks(prompt, block_size)[:(len(prompt) - 1) // block_size]
    tiers = engine.index.prefix_tiers(engine.name, hashes)
    predicted = {m: tiers.count(m) for m in MEDIA}
    before = llm.core.kv_tiers.totals() if llm.core.kv_tiers is not None else {}
    started = time.perf_counter()
    request_id, _ = llm.add_request(prompt, params)
    ttft = None
    tokens: list[int] = []
    cached = 0
    while True:
        for out in engine.step():
            if out.request_id != request_id:
                continue
            if out.new_token_ids and ttft is None:
                ttft = time.perf_counter() - started
            tokens.extend(out.new_token_ids)
            if out.finished:
                cached = out.num_cached_tokens
        if llm.outputs.num_unfinished == 0:
            break
    after = llm.core.kv_tiers.totals() if llm.core.kv_tiers is not None else {}
    hits = {m: (after[m].hits - before[m].hits) * block_size for m in after}
    hits["device"] = cached - sum(hits.values())
    assert ttft is not None
    return ttft, tokens, cached, hits, predicted


class Scenario:
    """One scenario's engines and its turns so far; ``turn`` serves the next one."""

    def __init__(self, args: argparse.Namespace, name: str, scratch: Path,
                 redis_url: str | None) -> None:
        self.args, self.name, self.chat = args, name, workload(args)
        self.params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens,
                                     min_tokens=args.output_tokens)
        self.index = PrefixIndex()
        self.disk_dir = scratch / f"{name}-disk"
        self.tiers = {
            "none": KvTiersConfig(),
            "host": KvTiersConfig(memory_bytes=args.host_bytes),
            "disk": KvTiersConfig(disk_dir=str(self.disk_dir), disk_bytes=args.disk_bytes),
            "shared": KvTiersConfig(store_url=redis_url, store_timeout_seconds=0.5),
        }[name]
        count = 2 if name == "shared" else 1
        self.engines = [self._engine(f"{name}-{i}") for i in range(count)]
        self.results: list[TurnResult] = []

    def _engine(self, engine_id: str) -> IndexedEngine:
        return IndexedEngine(engine_id, make_llm(self.args, self.tiers, engine_id), self.index)

    def turn(self, user: int, turn: int) -> None:
        if self.name == "disk" and user == 0 and turn == self.args.turns - 1:
            self.engines[0].llm.core.close()  # a restart: a new engine over the same store
            self.engines = [self._engine("disk-restarted")]
        engine = self.engines[(user + turn) % len(self.engines)]
        prompt = self.chat.prompt(user, turn)
        max_hit = self.chat.max_hit(user, prompt, self.args.block_size)
        ttft, tokens, _, hits, predicted = one_turn(engine, prompt, self.params,
                                                    self.args.block_size)
        self.results.append(TurnResult(user, turn, ttft, len(prompt), max_hit, hits,
                                       predicted, tokens))
        self.chat.answered(user, prompt, tokens)

    def close(self) -> None:
        for engine in self.engines:
            engine.llm.core.close()
        shutil.rmtree(self.disk_dir, ignore_errors=True)


def run_round(args: argparse.Namespace, names: list[str], scratch: Path,
              redis_url: str) -> dict[str, list[TurnResult]]:
    """Every scenario's engines side by side, each turn served by one scenario after the
    other: a shared machine's drift then reaches every scenario alike."""
    scenarios = [Scenario(args, name, scratch, redis_url) for name in names]
    try:
        for user, turn in workload(args).schedule():
            for scenario in scenarios:
                scenario.turn(user, turn)
    finally:
        for scenario in scenarios:
            scenario.close()
    return {scenario.name: scenario.results for scenario in scenarios}


def workload(args: argparse.Namespace) -> ChatWorkload:
    return ChatWorkload(args.users, args.turns, args.system_tokens, args.turn_tokens,
                        args.output_tokens, args.seed)


def summarize(results: list[TurnResult], block_size: int, last_turn_only: bool = False) -> dict:
    later = [r for r in results if r.turn >= 1]
    if last_turn_only:
        last = max(r.turn for r in results)
        later = [r for r in results if r.turn == last]
    ttfts = sorted(r.ttft for r in later)
    max_hit = sum(r.max_hit_tokens for r in later)
    by_tier = {m: sum(r.hit_tokens.get(m, 0) for r in later) for m in MEDIA}
    # The router's per-tier prediction against what the engine took, in blocks per turn.
    errors = [sum(abs(r.predicted_blocks[m] - r.hit_tokens.get(m, 0) // block_size)
                  for m in MEDIA) for r in later]
    return {
        "turns": len(later),
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p95_s": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))],
        "hit_tokens_by_tier": by_tier,
        "max_hit_tokens": max_hit,
        "hit_rate_of_max": sum(by_tier.values()) / max_hit if max_hit else None,
        "router_prediction_within_one_block": sum(e <= 1 for e in errors) / len(errors),
        "router_prediction_mean_abs_error_blocks": statistics.mean(errors),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from engine_common.default_model import default_model_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(default_model_dir()))
    p.add_argument("--dtype", default="auto")
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=128)
    p.add_argument("--turn-tokens", type=int, default=200)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-blocks", type=int, default=192, help="the engine's KV pool")
    p.add_argument("--host-bytes", type=int, default=2 << 30)
    p.add_argument("--disk-bytes", type=int, default=4 << 30)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scenarios", default="none,host,disk,shared")
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/kv_tiers.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    scenarios = args.scenarios.split(",")
    chat = workload(args)
    working_set, longest = chat.working_set(), chat.longest_conversation()
    pool = args.kv_blocks * args.block_size
    if longest > pool:
        raise SystemExit(f"error: a conversation grows to {longest} tokens, more than the "
                         f"KV pool's {pool}: raise --kv-blocks")
    print(f"working set {working_set} tokens, KV pool {pool} tokens "
          f"({working_set / pool:.1f}x)", flush=True)
    rounds: list[dict[str, dict]] = []
    outputs: dict[str, list[list[int]]] = {}
    with tempfile.TemporaryDirectory(prefix="kv-tiers-bench-") as scratch:
        port = free_port()
        with redis_server(port, maxmemory="4gb"):
            for round_index in range(args.rounds):
                summary: dict[str, dict] = {}
                started = time.monotonic()
                by_name = run_round(args, scenarios, Path(scratch),
                                    f"redis://127.0.0.1:{port}/{round_index % 16}")
                for name, results in by_name.items():
                    summary[name] = summarize(results, args.block_size)
                    if name == "disk":
                        summary["disk_after_restart"] = summarize(results, args.block_size,
                                                                  last_turn_only=True)
                    outputs[name] = [r.tokens for r in results]
                    print(f"round {round_index} {name}: {summary[name]}", flush=True)
                print(f"round {round_index}: {time.monotonic() - started:.0f} s", flush=True)
                rounds.append(summary)
    write_report(args.out, "kv_tiers", settings=vars(args) | {"out": str(args.out)},
                 working_set_tokens=working_set, kv_pool_tokens=pool, rounds=rounds,
                 goals=goals(rounds),
                 greedy_outputs_identical=all(o == outputs[scenarios[0]]
                                              for o in outputs.values()),
                 note="Shared 2-core machine with other tenants' work running: TTFT is "
                      "noisy; compare scenarios within one round.")
    return 0


def goals(rounds: list[dict[str, dict]]) -> dict:
    out: dict[str, object] = {}
    for i, summary in enumerate(rounds):
        none, host = summary.get("none"), summary.get("host")
        if none and host:
            out[f"round{i}_ttft_p50_none_over_host"] = none["ttft_p50_s"] / host["ttft_p50_s"]
            out[f"round{i}_ttft_p95_none_over_host"] = none["ttft_p95_s"] / host["ttft_p95_s"]
            out[f"round{i}_host_hit_rate_of_max"] = host["hit_rate_of_max"]
        if host and summary.get("shared"):
            out[f"round{i}_shared_hit_rate_over_host"] = (
                summary["shared"]["hit_rate_of_max"] / host["hit_rate_of_max"])
        if summary.get("disk_after_restart"):
            out[f"round{i}_disk_after_restart_hit_rate_of_max"] = \
                summary["disk_after_restart"]["hit_rate_of_max"]
    return out


if __name__ == "__main__":
    raise SystemExit(main())
