"""What `make demo` shows: real requests through a running suite, then a metrics summary.

Sends, through the SDK, a streamed chat request, two completions that share a long prefix
(the second should hit the prefix cache), a few concurrent requests and one request that
scores answers to a question by their log-likelihood (what evaluation harnesses do); prints
the text as it streams and then tokens/s, time to first token, and each replica's load and
prefix-cache counters read over the internal ``GetLoad`` RPC.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from protos.tandem.v1 import engine_pb2, engine_pb2_grpc
from services.suite_tls import SuiteTls, channel
from tandem.channel_security import TlsConfig
from tandem.client import Client

SHARED_PREFIX = (
    "You are a concise assistant for a train operator. Answer in one or two sentences, "
    "mention the platform number when you know it, and never invent timetable data. "
    "Trains to the airport leave every fifteen minutes from platform four. "
)


@dataclass
class Timing:
    label: str
    ttft: float
    seconds: float
    tokens: int
    text: str = ""


def stream_completion(client: Client, label: str, prompt: str, echo: bool) -> Timing:
    start = time.perf_counter()
    ttft = 0.0
    tokens = 0
    if echo:
        print(f"\n[{label}] {prompt[-60:]!r} ->", flush=True)
    text = []
    for chunk in client.complete_stream(prompt, max_tokens=40, temperature=0.0):
        if not ttft:
            ttft = time.perf_counter() - start
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        text.append(chunk.text)
        if echo:
            print(chunk.text, end="", flush=True)
    return Timing(label, ttft, time.perf_counter() - start, tokens, "".join(text))


def stream_chat(client: Client, label: str, content: str, system: str | None = None) -> Timing:
    start = time.perf_counter()
    ttft = 0.0
    tokens = 0
    print(f"\n[{label}] user: {content}\nassistant: ", end="", flush=True)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": content}]
    for chunk in client.chat_stream(messages, max_tokens=60, temperature=0.0):
        if not ttft:
            ttft = time.perf_counter() - start
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        print(chunk.content, end="", flush=True)
    return Timing(label, ttft, time.perf_counter() - start, tokens)


def print_replica_loads(replicas: list[str], tls: SuiteTls | None) -> None:
    print("\nreplicas (GetLoad):")
    for target in replicas:
        with channel(target, tls) as replica:
            load = engine_pb2_grpc.EngineStub(replica).GetLoad(engine_pb2.GetLoadRequest(), timeout=5)
        hit_rate = load.prefix_cache_hits / load.prefix_cache_queries if load.prefix_cache_queries else 0.0
        print(f"  {load.engine_id:10s} role={load.role:8s} kv_usage={load.kv_cache_usage_perc:5.1%} "
              f"prefix_cache hits/queries={load.prefix_cache_hits}/{load.prefix_cache_queries} "
              f"({hit_rate:.0%}) preemptions={load.num_preemptions}")


def show_pd_transfer(client: Client, replicas: list[str], tls: SuiteTls | None) -> None:
    """One request sent straight to a decode replica naming a prefill replica, to show the
    KV transfer it reports (the gateway does the same for every request it routes P/D)."""
    roles: dict[str, list[str]] = {}
    for target in replicas:
        with channel(target, tls) as replica:
            role = engine_pb2_grpc.EngineStub(replica).GetInfo(engine_pb2.GetInfoRequest(), timeout=5).role
        roles.setdefault(role, []).append(target)
    if not roles.get("prefill") or not roles.get("decode"):
        return
    prompt = SHARED_PREFIX * 3 + "Question: is there a night train? Answer:"
    request = engine_pb2.GenerateRequest(
        request_id=f"demo-pd-{time.time_ns()}", prompt_token_ids=client.tokenize(prompt),
        sampling_params=engine_pb2.SamplingParams(max_tokens=24, temperature=0.0),
        prefill_peer=roles["prefill"][0])
    print(f"\n\n[P/D] {len(request.prompt_token_ids)}-token prompt: prefill on {roles['prefill'][0]}, "
          f"decode on {roles['decode'][0]} ->", flush=True)
    with channel(roles["decode"][0], tls) as decode:
        for response in engine_pb2_grpc.EngineStub(decode).Generate(request, timeout=300):
            print(response.delta_text, end="", flush=True)
            if response.HasField("kv_transfer"):
                info = response.kv_transfer
                note = (f"fallback: {info.fallback_reason}" if info.fallback_reason else
                        f"{info.blocks_pulled} blocks ({info.bytes / 2**20:.2f} MiB) pulled over UCX "
                        f"in {info.seconds * 1000:.1f} ms, {info.blocks_local} already on the decode replica")
                print(f" <KV transfer: {note}> ", end="", flush=True)
    print()


def score_answers(client: Client, question: str, answers: list[str]) -> None:
    """One request of several prompts (the question followed by each answer, as token ids),
    echoed and scored without generating: each answer's log-likelihood given the question."""
    context = client.tokenize(question)
    prompts = [context + client.tokenize(answer, add_special_tokens=False) for answer in answers]
    scored = client.complete(prompts, echo=True, max_tokens=0, logprobs=0)
    print(f"\n[scoring, one request of {len(prompts)} prompts] {question!r}")
    for answer, choice in zip(answers, scored.choices, strict=True):
        loglikelihood = sum(t.logprob or 0.0 for t in choice.logprobs[len(context):])
        print(f"  {answer!r:12s} log-likelihood {loglikelihood:7.2f}")


def run_demo(target: str, replicas: list[str], tls: SuiteTls | None = None,
             client_tls: TlsConfig | bool = False) -> None:
    """``tls``: the suite's certificates, to call the replicas' Engine API; ``client_tls``:
    the SDK's, where ``target`` is a replica of a suite with mutual TLS (no gateway)."""
    timings: list[Timing] = []
    with Client(target, timeout=300, tls=client_tls) as client:
        model = client.models()[0].id
        print(f"\nserving {model} through {target}")
        timings.append(stream_chat(client, "chat", "What is the capital of France?"))
        timings.append(stream_chat(
            client, "shared system prompt 1", "Where do airport trains leave from?", SHARED_PREFIX))
        timings.append(stream_chat(
            client, "shared system prompt 2 (prefix-cache hit)", "How often do airport trains run?",
            SHARED_PREFIX))
        print("\n\n[8 concurrent completions, streamed at once; their texts when all are done]", flush=True)
        prompts = [f"Write one sentence about the number {n}:" for n in range(8)]
        started = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            batch = list(pool.map(lambda p: stream_completion(client, p, p, False), prompts))
        wall = time.perf_counter() - started
        for timing in batch:
            print(f"{timing.label} {timing.text.strip()[:100]!r}")
        timings.extend(batch)
        score_answers(client, "The capital of France is", [" Paris", " Rome", " Berlin"])
        show_pd_transfer(client, replicas, tls)
    print("\nsummary:")
    for t in timings[:3]:
        print(f"  {t.label:42s} TTFT {t.ttft * 1000:7.1f} ms, {t.tokens} tokens in {t.seconds:.2f} s")
    batch_tokens = sum(t.tokens for t in batch)
    ttfts = sorted(t.ttft for t in batch)
    print(f"  8 concurrent: {batch_tokens} tokens in {wall:.2f} s = {batch_tokens / wall:.1f} tok/s, "
          f"TTFT median {ttfts[len(ttfts) // 2] * 1000:.1f} ms")
    print_replica_loads(replicas, tls)
