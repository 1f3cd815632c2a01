"""The multi-turn chat served over HTTP: Tandem with and without its host tier against
`vllm serve` with prefix caching, the same KV pool for all (issue 37's last goal).

The workload is ``bench.chat_workload`` (the one ``bench/kv_tiers.py`` runs on the offline
engine): ``--users`` users, a shared system prompt, ``--turn-tokens`` new tokens a turn,
users interleaved so the working set is several times the pool. One request at a time,
streamed, greedy with EOS ignored, prompts as token ids, answers read back as token ids
(``return_token_ids``) so every server gets the same next-turn prompts as long as its
greedy answers agree (whether they did is reported).

Servers, each started fresh and stopped in turn (this machine has 2 cores), rounds
interleaved (vllm, tandem, tandem_host, vllm, ...):
  vllm         `vllm serve` (eager; prefix caching is on by default in its V1 engine), its
               KV pool set to ``--kv-blocks`` x ``--block-size`` tokens in blocks of
               ``--vllm-block-size`` (128: its CPU default);
  tandem       `tandem up --both 1 --envoy`'s layout, ``--num-kv-blocks`` the same pool;
  tandem_host  the same with ``--kv-offload-memory`` (a host tier holding the working set).
Measured by the client: TTFT (request sent to first streamed token) over turns >= 2, p50
and p95; each server's own count of cached prompt tokens
(``usage.prompt_tokens_details.cached_tokens``) against what a cache could hold. Results:
``bench/results/kv_tiers_serving.json`` with the machine and every command line.

    python bench/kv_tiers_serving.py --turns 8        # ~15 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx2

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.chat_workload import ChatWorkload  # noqa: E402
from bench.online_serving import PEER_VLLM, tandem_server, vllm_server  # noqa: E402
from bench.report import write_report  # noqa: E402
from engine_common.default_model import ensure_default_model  # noqa: E402

SERVERS = ("vllm", "tandem", "tandem_host")


@dataclass
class Turn:
    user: int
    turn: int
    ttft_s: float
    prompt_tokens: int
    max_hit_tokens: int
    cached_tokens: int
    answer: list[int]


async def chat_turn(client: httpx2.AsyncClient, base_url: str, model: str, prompt: list[int],
                    max_tokens: int) -> tuple[float, list[int], int]:
    """TTFT, the answer's token ids, and the server's cached prompt tokens."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    ttft, answer, usage = None, [], {}
    async with client.stream("POST", f"{base_url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            detail = (await response.aread()).decode(errors="replace")[:300]
            raise RuntimeError(f"HTTP {response.status_code}: {detail}")
        async for line in response.aiter_lines():
            payload = line.removeprefix("data:").strip()
            if not line.startswith("data:") or payload == "[DONE]":
                continue
            event = json.loads(payload)
            for choice in event.get("choices") or []:
                if choice.get("token_ids"):
                    ttft = ttft if ttft is not None else time.perf_counter() - sent
                    answer.extend(choice["token_ids"])
            usage = event.get("usage") or usage
    if ttft is None or len(answer) != max_tokens:
        raise RuntimeError(f"the stream gave {len(answer)} of {max_tokens} tokens")
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return ttft, answer, cached


async def run_chat(base_url: str, model: str, chat: ChatWorkload, block_size: int) -> list[Turn]:
    turns = []
    async with httpx2.AsyncClient(timeout=httpx2.Timeout(600.0)) as client:
        for user, turn in chat.schedule():
            prompt = chat.prompt(user, turn)
            ttft, answer, cached = await chat_turn(client, base_url, model, prompt,
                                                   chat.output_tokens)
            turns.append(Turn(user, turn, ttft, len(prompt),
                              chat.max_hit(user, prompt, block_size), cached, answer))
            chat.answered(user, prompt, answer)
    return turns


def summarize(turns: list[Turn]) -> dict:
    later = [t for t in turns if t.turn >= 1]
    ttfts = sorted(t.ttft_s for t in later)
    max_hit = sum(t.max_hit_tokens for t in later)
    return {"turns": len(later), "ttft_p50_s": statistics.median(ttfts),
            "ttft_p95_s": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))],
            "cached_tokens": sum(t.cached_tokens for t in later), "max_hit_tokens": max_hit,
            "hit_rate_of_max": sum(t.cached_tokens for t in later) / max_hit}


def server_args(name: str, args: argparse.Namespace) -> tuple[str, ...]:
    pool = args.kv_blocks * args.block_size
    if name == "vllm":
        # NOTE: vLLM's block pool keeps block 0 as its null block, never allocated: one more
        # block gives it the same usable pool as Tandem's (which has none).
        return ("--num-gpu-blocks-override", str(pool // args.vllm_block_size + 1),
                "--block-size", str(args.vllm_block_size), "--max-model-len", str(pool),
                "--enable-prompt-tokens-details")
    tier = ("--kv-offload-memory", args.host_memory) if name == "tandem_host" else ()
    return ("--num-kv-blocks", str(args.kv_blocks), "--block-size", str(args.block_size),
            *tier)


def run_server(name: str, args: argparse.Namespace, model: Path, round_index: int
               ) -> tuple[list[Turn], list[list[str]]]:
    logs = args.log_dir / f"kv_tiers_serving-{name}-round{round_index + 1}"
    extra = server_args(name, args)
    launch = (vllm_server(args, model, logs.with_suffix(".log"), extra) if name == "vllm"
              else tandem_server(args, model, logs, replica_args=extra))
    print(f"round {round_index + 1}: starting {name} ...", flush=True)
    with launch as server:
        chat = workload(args)
        turns = asyncio.run(run_chat(server.base_url, server.model, chat, args.block_size))
        return turns, server.commands


def workload(args: argparse.Namespace) -> ChatWorkload:
    return ChatWorkload(args.users, args.turns, args.system_tokens, args.turn_tokens,
                        args.output_tokens, args.seed)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=128)
    p.add_argument("--turn-tokens", type=int, default=200)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16, help="Tandem's KV block")
    p.add_argument("--vllm-block-size", type=int, default=128, help="vLLM-CPU's default")
    p.add_argument("--kv-blocks", type=int, default=192, help="the KV pool, in Tandem blocks")
    p.add_argument("--host-memory", default="2GiB", help="tandem_host's --kv-offload-memory")
    p.add_argument("--servers", nargs="+", default=list(SERVERS), choices=SERVERS)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    # What bench.online_serving's servers read.
    p.add_argument("--kv-cache-gib", type=int, default=1)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--vllm-omp-bind", default="auto")
    p.add_argument("--tandem-cpus", default=None)
    p.add_argument("--tandem-engine-cpus", default="auto")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--log-dir", type=Path, default=ROOT / "bench" / "results" / "logs")
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/kv_tiers_serving.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = args.model.resolve() if args.model else ensure_default_model()
    chat, pool = workload(args), args.kv_blocks * args.block_size
    if chat.longest_conversation() > pool:
        raise SystemExit(f"error: a conversation grows to {chat.longest_conversation()} "
                         f"tokens, more than the KV pool's {pool}: raise --kv-blocks")
    if "vllm" in args.servers and not PEER_VLLM.exists():
        raise SystemExit(f"{PEER_VLLM} is missing: make bench-peer-setup")
    print(f"working set {chat.working_set()} tokens, KV pool {pool} tokens "
          f"({chat.working_set() / pool:.1f}x)", flush=True)
    rounds, answers, commands = [], {}, {}
    for round_index in range(args.rounds):
        summary = {}
        for name in args.servers:
            load = os.getloadavg()
            turns, commands[name] = run_server(name, args, model, round_index)
            summary[name] = summarize(turns) | {"load_average_before": load}
            answers[name] = [t.answer for t in turns]
            print(f"  {name}: {summary[name]}", flush=True)
        rounds.append(summary)
    write_report(args.out, "kv_tiers_serving", settings={k: str(v) if isinstance(v, Path) else v
                                               for k, v in vars(args).items()},
                 working_set_tokens=chat.working_set(), kv_pool_tokens=pool,
                 commands=commands, rounds=rounds, ratios=ratios(rounds),
                 answers_identical_to_first=[
                     sum(a == b for a, b in zip(answers[n], answers[args.servers[0]],
                                                strict=True)) / len(answers[n])
                     for n in args.servers],
                 note="One request at a time; TTFT measured by the client over HTTP.")
    return 0


def ratios(rounds: list[dict]) -> dict:
    out = {}
    for i, summary in enumerate(rounds):
        peer = summary.get("vllm")
        for name, row in summary.items():
            if peer and name != "vllm":
                for key in ("ttft_p50_s", "ttft_p95_s"):
                    out[f"round{i}_{name}_{key}_over_vllm"] = row[key] / peer[key]
        if "tandem" in summary and "tandem_host" in summary:
            out[f"round{i}_tandem_ttft_p50_over_tandem_host"] = (
                summary["tandem"]["ttft_p50_s"] / summary["tandem_host"]["ttft_p50_s"])
    return out


if __name__ == "__main__":
    raise SystemExit(main())
