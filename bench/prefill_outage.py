"""A prefill replica killed under load: the first-token delay of the prompts that were on their
way to it or were sent during its outage, beside the time the same prompt takes to compute on
an idle replica (issue 33, item 3).

Real processes on the default model (SmolLM2-135M-Instruct), as ``tandem up`` runs them (each
replica with a 512 MiB KV cache, the gateway in front, plaintext): the default layout (one
prefill, one decode replica) and one with two prefill replicas. Per layout and placement rule
(``--prefill-placement estimate``, the gateway's default: where the first token is estimated
soonest; ``score``: the best-scoring prefill replica, the rule before), one round:

1. ``--streams`` greedy streams run on the decode replica (the running decodes a fallback
   competes with);
2. ``--in-flight`` prompts of ``--prompt-len`` random tokens (new ones every round: no
   prefix cache helps) are sent at once, and ``--kill-after`` seconds later the first prefill
   replica is SIGKILLed (not restarted during the round);
3. ``--during`` more such prompts are sent, ``--gap`` seconds apart, during the outage.

Measured: each prompt's time to first token (from its send, through the gateway), where the
gateway placed it (routing decisions by ``pd``, hand-backs), the decode replica's prompts
computed after a failed Prefill by reason; then, with everything idle, each prompt computed
again on the decode replica alone (``Engine.Generate`` with no prefill replica, a fresh cache
salt): the recompute time on an idle replica. The killed replica is restarted between rounds.
Results: ``bench/results/prefill_outage.json``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import write_report  # noqa: E402
from engine_common.default_model import ensure_default_model  # noqa: E402
from protos.tandem.v1 import engine_pb2 as epb  # noqa: E402
from protos.tandem.v1 import engine_pb2_grpc as epb_grpc  # noqa: E402
from tandem.client import Client  # noqa: E402
from tests.replica_process import (  # noqa: E402
    free_port,
    gateway_started,
    healthy_replicas,
    restart_replica,
    start_replicas,
    wait_until,
)

REPLICA_ARGS = ["--kv-cache-memory", "512MiB"]


def metric(port: int, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples if s.name == name
               and all(s.labels.get(k) == v for k, v in labels.items()))


def gateway_counts(port: int) -> dict[str, float]:
    counts = {f"pd={pd}": metric(port, "tandem:gateway_routing_decisions_total", pd=pd)
              for pd in ("prefill_hop", "self_prefill_sooner", "no_prefill_replica")}
    counts["handbacks"] = metric(port, "tandem:gateway_retries_total", code="prefill_handback")
    return counts


def first_token_after(target: str, prompt: list[int], sent: float, out: dict[str, object]
                      ) -> None:
    """One prompt through the gateway; its TTFT (from ``sent``) into ``out``."""
    try:
        with Client(target, timeout=600) as client:
            for _ in client.complete_stream(prompt, max_tokens=2, temperature=0,
                                            ignore_eos=True):
                out.setdefault("ttft_s", time.monotonic() - sent)
    except Exception as error:  # noqa: BLE001 - reported
        out["error"] = repr(error)[:200]


def idle_recompute_s(decode_target: str, prompt: list[int]) -> float:
    """Time to the first token of ``prompt`` computed on the (idle) decode replica itself."""
    request = epb.GenerateRequest(
        request_id=f"idle-{time.monotonic_ns()}", prompt_token_ids=prompt,
        cache_salt=f"idle-{time.monotonic_ns()}",
        sampling_params=epb.SamplingParams(max_tokens=1, temperature=0))
    with grpc.insecure_channel(decode_target) as channel:
        started = time.monotonic()
        for _ in epb_grpc.EngineStub(channel).Generate(request, timeout=600):
            return time.monotonic() - started
    raise RuntimeError("no response")


def background_streams(target: str, n: int, vocab: int, rng: random.Random
                       ) -> list[threading.Thread]:
    prompts = [[rng.randrange(10, vocab) for _ in range(40)] for _ in range(n)]

    def stream(prompt: list[int]) -> None:
        with Client(target, timeout=600) as client:
            for _ in client.complete_stream(prompt, max_tokens=400, temperature=0,
                                            ignore_eos=True):
                pass

    threads = [threading.Thread(target=stream, args=(p,), daemon=True) for p in prompts]
    for thread in threads:
        thread.start()
    return threads


def one_round(gateway: str, metrics_port: int, replicas: dict, args: argparse.Namespace,
              rng: random.Random, vocab: int) -> dict[str, object]:
    decode = replicas["decode"]
    before = gateway_counts(metrics_port)
    refused_before = metric(decode.metrics_port, "tandem:kv_transfer_failures_total",
                            reason="unreachable")
    failed_before = metric(decode.metrics_port, "tandem:kv_transfer_failures_total",
                           reason="prefill_failed")
    streams = background_streams(gateway, args.streams, vocab, rng)
    time.sleep(1.0)  # the streams are decoding
    prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_len)]
               for _ in range(args.in_flight + args.during)]
    results: list[dict[str, object]] = [{} for _ in prompts]
    threads = []
    for i in range(args.in_flight):
        results[i]["when"] = "in_flight"
        threads.append(threading.Thread(target=first_token_after, args=(
            gateway, prompts[i], time.monotonic(), results[i])))
        threads[-1].start()
    time.sleep(args.kill_after)
    replicas["prefill-0"].kill()
    for i in range(args.in_flight, len(prompts)):
        time.sleep(args.gap)
        results[i]["when"] = "during_outage"
        threads.append(threading.Thread(target=first_token_after, args=(
            gateway, prompts[i], time.monotonic(), results[i])))
        threads[-1].start()
    for thread in threads + streams:
        thread.join(900)
    after = gateway_counts(metrics_port)
    for prompt, result in zip(prompts, results, strict=True):
        result["idle_recompute_s"] = idle_recompute_s(decode.target, prompt)
    ttfts = [float(r["ttft_s"]) for r in results if "ttft_s" in r]  # type: ignore[arg-type]
    idle = [float(r["idle_recompute_s"]) for r in results]  # type: ignore[arg-type]
    return {
        "prompts": results,
        "ttft_s_median": statistics.median(ttfts) if ttfts else None,
        "ttft_s_max": max(ttfts) if ttfts else None,
        "idle_recompute_s_median": statistics.median(idle),
        "errors": sum("error" in r for r in results),
        "placement": {k: after[k] - before[k] for k in after},
        "decode_fallbacks": {
            "unreachable": metric(decode.metrics_port, "tandem:kv_transfer_failures_total",
                                  reason="unreachable") - refused_before,
            "prefill_failed": metric(decode.metrics_port, "tandem:kv_transfer_failures_total",
                                     reason="prefill_failed") - failed_before},
    }


def run_layout(model: Path, prefills: int, args: argparse.Namespace,
               rng: random.Random, vocab: int) -> dict[str, object]:
    roles = {f"prefill-{i}": ["--role", "prefill", *REPLICA_ARGS] for i in range(prefills)}
    roles["decode"] = ["--role", "decode", *REPLICA_ARGS]
    log_dir = Path(tempfile.mkdtemp(prefix="prefill-outage-"))
    replicas = start_replicas(model, log_dir, roles)
    rounds: dict[str, object] = {}
    try:
        for placement in args.placements:
            metrics_port = free_port()
            with gateway_started(model, log_dir, [r.target for r in replicas.values()],
                                 ["--metrics-port", str(metrics_port),
                                  "--prefill-placement", placement],
                                 name=f"gateway-{placement}") as gateway:
                wait_until(lambda port=metrics_port: healthy_replicas(port) == len(roles),
                           time.monotonic() + 300, "the gateway's replicas", log_dir)
                for _ in range(3):  # warm-up: every replica measures its prompt rate
                    first_token_after(gateway, [rng.randrange(10, vocab) for _ in range(256)],
                                      time.monotonic(), {})
                rounds[placement] = one_round(gateway, metrics_port, replicas, args, rng, vocab)
                print(placement, {k: v for k, v in rounds[placement].items()  # type: ignore[union-attr]
                                  if k != "prompts"}, flush=True)
            replicas["prefill-0"] = restart_replica(replicas["prefill-0"], model, log_dir,
                                                    "prefill-0", roles["prefill-0"])
    finally:
        for replica in replicas.values():
            replica.stop()
    return {"prefill_replicas": prefills, "decode_replicas": 1, "logs": str(log_dir),
            "rounds": rounds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-len", type=int, default=768)
    p.add_argument("--in-flight", type=int, default=4)
    p.add_argument("--during", type=int, default=4)
    p.add_argument("--streams", type=int, default=3)
    p.add_argument("--kill-after", type=float, default=0.3)
    p.add_argument("--gap", type=float, default=0.5)
    p.add_argument("--layouts", type=int, nargs="+", default=[1, 2],
                   help="prefill replicas in each layout (one decode replica)")
    p.add_argument("--placements", nargs="+", default=["estimate", "score"])
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/prefill_outage.json")
    args = p.parse_args()
    model = ensure_default_model()
    from engine_common.model.arch_config import ModelArchConfig

    vocab = ModelArchConfig.from_model_dir(str(model)).vocab_size
    rng = random.Random(33)
    layouts = {f"{n}p1d": run_layout(model, n, args, rng, vocab) for n in args.layouts}
    write_report(args.out, "prefill_outage", settings=vars(args) | {"out": str(args.out)},
                 layouts=layouts)


if __name__ == "__main__":
    main()
