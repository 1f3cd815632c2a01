"""A real replica (``python -m services.replica`` on a tiny Llama, loopback) through the SDK
and the internal Engine API: greedy output equals the offline engine's, concurrency,
cancellation and deadlines free the engine's blocks, every invalid input gets the right
status, health, reflection and /metrics answer. One replica serves the whole module.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from google.protobuf import struct_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from engine_common.config import CacheConfig, EngineConfig
from engine_common.llm import LLM
from engine_common.sampling_params import SamplingParams
from protos.tandem.v1 import engine_pb2 as epb
from protos.tandem.v1 import engine_pb2_grpc as epb_grpc
from protos.tandem.v1 import generation_pb2 as pb
from protos.tandem.v1 import generation_pb2_grpc as pb_grpc
from tandem.client import AsyncClient, Client
from tandem.errors import TandemError
from tandem.request_builders import chat_message
from tests.reflection_client import VERSIONS, defines_service, reflect
from tests.replica_process import ReplicaProcess, start_replicas

MAX_MODEL_LEN = 512
PROMPTS = [
    "The quick brown fox",
    "Once upon a time there was",
    "In a hole in the ground",
    "It was the best of times, it was the worst of times",
]


@pytest.fixture(scope="module")
def replica(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    replicas = start_replicas(tiny_llama_dir, tmp_path_factory.mktemp("replica-logs"), {
        "svc": ["--dtype", "float32", "--kv-cache-memory", "16MiB",
                "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", "tiny"],
    })
    yield replicas["svc"]
    replicas["svc"].kill()  # graceful shutdown has its own test (test_replica_lifecycle)


@pytest.fixture(scope="module")
def offline(tiny_llama_dir: Path) -> LLM:
    return LLM(EngineConfig(model=str(tiny_llama_dir), dtype="float32",
                            max_model_len=MAX_MODEL_LEN,
                            cache=CacheConfig(num_gpu_blocks_override=1024)))


@pytest.fixture(scope="module")
def client(replica: ReplicaProcess):
    with Client(replica.target, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def channel(replica: ReplicaProcess):
    with grpc.insecure_channel(replica.target) as ch:
        yield ch


@pytest.fixture(scope="module")
def engine(channel: grpc.Channel) -> epb_grpc.EngineStub:
    return epb_grpc.EngineStub(channel)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def wait_engine_idle(engine: epb_grpc.EngineStub, timeout: float = 20.0) -> epb.LoadReport:
    """Poll GetLoad until nothing runs and every block is free again."""
    deadline = time.monotonic() + timeout
    while True:
        load = engine.GetLoad(epb.GetLoadRequest())
        if load.num_requests_running == 0 and load.num_free_blocks == load.num_total_blocks:
            return load
        assert time.monotonic() < deadline, f"the engine still holds the request: {load}"
        time.sleep(0.05)


# --------------------------------------------------------------------------- correctness


def test_stream_text_and_token_ids_equal_offline_greedy(client, engine, offline):
    expected = offline.generate(PROMPTS, greedy(24))
    for prompt, want in zip(PROMPTS, expected, strict=True):
        chunks = list(client.complete_stream(prompt, max_tokens=24, temperature=0,
                                             ignore_eos=True))
        assert "".join(c.text for c in chunks) == want.text
        assert chunks[-2].finish_reason == "length"
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens == 24
        assert usage.prompt_tokens == len(want.prompt_token_ids)

        request = epb.GenerateRequest(
            request_id=f"greedy-{prompt[:8]}", prompt_token_ids=want.prompt_token_ids,
            sampling_params=epb.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
            output_options=epb.OutputOptions(return_token_ids=True))
        responses = list(engine.Generate(request, timeout=60))
        assert [t for r in responses for t in r.new_token_ids] == want.token_ids
        assert "".join(r.delta_text for r in responses) == want.text
        assert responses[-1].finish_reason == "length"


def test_unary_and_chat_equal_offline_greedy(client, offline):
    want = offline.generate([PROMPTS[0]], greedy(10))[0]
    completion = client.complete(PROMPTS[0], max_tokens=10, temperature=0, ignore_eos=True)
    assert completion.text == want.text
    assert completion.id.startswith("cmpl-") and completion.model == "tiny"
    assert completion.usage is not None and completion.usage.total_tokens == (
        len(want.prompt_token_ids) + 10)

    messages = [{"role": "user", "content": "Tell me a story"}]
    chat_ids = offline.inputs.tokenize_chat(messages)
    want_chat = offline.generate([chat_ids], greedy(10))[0]
    chat = client.chat(messages, max_tokens=10, temperature=0, ignore_eos=True)
    assert chat.id.startswith("chatcmpl-")
    assert (chat.role, chat.content, chat.finish_reason) == ("assistant", want_chat.text, "length")
    chunks = list(client.chat_stream(messages, max_tokens=10, temperature=0, ignore_eos=True))
    assert chunks[0].role == "assistant"
    assert "".join(c.content for c in chunks) == want_chat.text


def test_chat_content_parts_are_the_joined_text(client, channel, offline):
    joined = [{"role": "system", "content": "Be brief.\nAnswer in French."},
              {"role": "user", "content": "Tell me a story"}]
    want = offline.generate([offline.inputs.tokenize_chat(joined)], greedy(10))[0]
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."},
                                            {"type": "text", "text": "Answer in French."}]},
             {"role": "user", "content": [{"type": "text", "text": "Tell me a story"}]}]
    chat = client.chat(parts, max_tokens=10, temperature=0, ignore_eos=True)
    assert chat.content == want.text
    assert chat.usage is not None and chat.usage.prompt_tokens == len(want.prompt_token_ids)
    tokenized = pb_grpc.GenerationStub(channel).Tokenize(
        pb.TokenizeRequest(messages=[chat_message(m) for m in parts]), timeout=30)
    assert list(tokenized.tokens) == want.prompt_token_ids


def test_chat_without_max_tokens_runs_to_the_context(client, offline):
    # OpenAI's chat default: no max_tokens means up to the context length (ignore_eos keeps
    # the random model from stopping early). A long prompt keeps the generation short.
    def chat_of(words: int) -> list[dict[str, str]]:
        return [{"role": "user", "content": " ".join(["story"] * words)}]

    per_word = (len(offline.inputs.tokenize_chat(chat_of(11)))
                - len(offline.inputs.tokenize_chat(chat_of(1)))) / 10
    words = int((MAX_MODEL_LEN - 8) / per_word)
    while len(offline.inputs.tokenize_chat(chat_of(words))) > MAX_MODEL_LEN - 8:
        words -= 1
    messages = chat_of(words)
    prompt_len = len(offline.inputs.tokenize_chat(messages))
    assert prompt_len < MAX_MODEL_LEN
    chat = client.chat(messages, temperature=0, ignore_eos=True)
    assert chat.finish_reason == "length"
    assert chat.usage is not None and chat.usage.completion_tokens == MAX_MODEL_LEN - prompt_len


def test_completion_default_max_tokens_is_16(client):
    completion = client.complete(PROMPTS[1], temperature=0, ignore_eos=True)
    assert completion.usage is not None and completion.usage.completion_tokens == 16


async def _stream_all(target: str, prompts: list[str], max_tokens: int) -> list[str]:
    async with AsyncClient(target, timeout=120) as client:
        async def one(prompt: str) -> str:
            stream = client.complete_stream(prompt, max_tokens=max_tokens, temperature=0,
                                            ignore_eos=True)
            return "".join([chunk.text async for chunk in stream])

        return list(await asyncio.gather(*(one(p) for p in prompts)))


def test_truncate_prompt_tokens_keeps_the_end_of_the_prompt(client, offline):
    """vLLM's truncate_prompt_tokens: only the prompt's last k tokens run (completions,
    echo and chat alike); -1 keeps as many as leave room for max_tokens."""
    ids = offline.inputs.tokenize("the tandem project serves models over grpc " * 4)
    want = offline.generate([ids[-6:]], greedy(5))[0]
    got = client.complete(ids, truncate_prompt_tokens=6, max_tokens=5, temperature=0,
                          ignore_eos=True)
    assert got.text == want.text
    assert got.usage is not None and got.usage.prompt_tokens == 6
    echoed = client.complete(ids, truncate_prompt_tokens=6, max_tokens=0, echo=True)
    assert echoed.text == offline.inputs.detokenize(ids[-6:])

    too_long = (ids * 100)[:MAX_MODEL_LEN + 50]
    kept = MAX_MODEL_LEN - 4
    want = offline.generate([too_long[-kept:]], greedy(4))[0]
    got = client.complete(too_long, truncate_prompt_tokens=-1, max_tokens=4, temperature=0,
                          ignore_eos=True)
    assert (got.text, got.usage.prompt_tokens) == (want.text, kept)  # type: ignore[union-attr]

    rendered = offline.inputs.tokenize_chat([{"role": "user", "content": "hi " * 40}])
    want = offline.generate([rendered[-10:]], greedy(4))[0]
    chat = client.chat([{"role": "user", "content": "hi " * 40}], truncate_prompt_tokens=10,
                       max_tokens=4, temperature=0, ignore_eos=True)
    assert chat.content == want.text


def test_64_concurrent_streams_all_correct(replica, offline):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} number {i}" for i in range(64)]
    expected = [r.text for r in offline.generate(prompts, greedy(12))]
    assert asyncio.run(_stream_all(replica.target, prompts, 12)) == expected


def test_logprobs_in_openai_shapes(client):
    completion = client.complete(PROMPTS[0], max_tokens=4, temperature=0, logprobs=3)
    assert len(completion.logprobs) == 4
    for position in completion.logprobs:
        # Greedy: the sampled token is the most likely one, listed among the top 3. The dict
        # is keyed by text, as OpenAI's is: ids that decode to the same text (partial UTF-8
        # bytes of the tiny tokenizer) share a key, so the sampled value bounds the rest.
        assert position.token in position.top_logprobs
        assert max(position.top_logprobs.values()) <= position.logprob + 1e-5
        assert len(position.top_logprobs) <= 3
    chat = client.chat([{"role": "user", "content": "hi"}], max_tokens=3, temperature=0,
                       logprobs=True, top_logprobs=2)
    assert len(chat.logprobs) == 3
    assert all(p.logprob <= 0 for p in chat.logprobs)
    assert client.chat([{"role": "user", "content": "hi"}], max_tokens=3).logprobs == []


def test_repeated_prompt_reports_cached_tokens(client, engine):
    prompt = "A long shared prefix that spans more than one block of sixteen tokens " * 3
    client.complete(prompt, max_tokens=2, temperature=0)
    before = engine.GetLoad(epb.GetLoadRequest())
    again = client.complete(prompt, max_tokens=2, temperature=0)
    assert again.usage is not None and again.usage.cached_tokens >= 16
    after = engine.GetLoad(epb.GetLoadRequest())
    assert after.prefix_cache_hits - before.prefix_cache_hits >= 16


def test_models_tokenize_detokenize(client, offline, tiny_llama_dir):
    [model] = client.models()
    assert (model.id, model.max_model_len) == ("tiny", MAX_MODEL_LEN)
    tokens = client.tokenize("Hello there")
    assert tokens == offline.inputs.tokenize("Hello there")
    assert client.detokenize(tokens) == offline.tokenizer.decode(tokens)
    assert "Hello there" in client.detokenize(tokens)
    # The served name, the directory's name and no name all mean the one model.
    for name in ("tiny", tiny_llama_dir.name, None):
        assert client.tokenize("Hello there", model=name) == tokens


# --------------------------------------------------------------------------- cancellation


def test_cancelling_a_stream_frees_its_blocks(client, engine):
    stream = client.complete_stream(PROMPTS[2], max_tokens=480, temperature=0, ignore_eos=True)
    next(stream)
    next(stream)
    busy = engine.GetLoad(epb.GetLoadRequest())
    assert busy.num_requests_running >= 1 and busy.num_free_blocks < busy.num_total_blocks
    stream.cancel()
    wait_engine_idle(engine)


def test_deadline_aborts_the_request(engine, replica):
    # 480 tokens take the engine well over 0.2 s, even on a fast machine.
    with Client(replica.target, timeout=0.2) as hasty:
        with pytest.raises(TandemError) as error:
            list(hasty.complete_stream(PROMPTS[3], max_tokens=480, temperature=0,
                                       ignore_eos=True))
    assert error.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_engine_idle(engine)


def test_abort_rpc_ends_the_stream_with_abort(client, engine, offline):
    request = epb.GenerateRequest(
        request_id="to-abort", prompt_token_ids=offline.inputs.tokenize(PROMPTS[0]),
        sampling_params=epb.SamplingParams(max_tokens=480, temperature=0, ignore_eos=True))
    responses = engine.Generate(request, timeout=60)
    next(responses)
    assert list(engine.Abort(epb.AbortRequest(request_ids=["to-abort", "unknown"]))
                .aborted_request_ids) == ["to-abort"]
    rest = list(responses)
    assert rest[-1].finish_reason == "abort"
    assert rest[-1].completion_tokens < 480
    wait_engine_idle(engine)


def test_prefill_peer_falls_back_to_a_local_prefill(engine, offline):
    want = offline.generate([PROMPTS[1]], greedy(5))[0]
    request = epb.GenerateRequest(
        request_id="pd", prompt_token_ids=want.prompt_token_ids, prefill_peer="127.0.0.1:1",
        sampling_params=epb.SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
        output_options=epb.OutputOptions(return_token_ids=True))
    responses = list(engine.Generate(request, timeout=60))
    assert responses[0].kv_transfer.fallback_reason == "not_a_decode_replica"
    assert [t for r in responses for t in r.new_token_ids] == want.token_ids


def test_resumed_stream_continues_where_the_dead_replica_stopped(engine, offline):
    want = offline.generate([PROMPTS[3]], greedy(10))[0]
    request = epb.GenerateRequest(
        request_id="resume", prompt_token_ids=want.prompt_token_ids,
        resume_output_token_ids=want.token_ids[:4],
        sampling_params=epb.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
        output_options=epb.OutputOptions(return_token_ids=True))
    responses = list(engine.Generate(request, timeout=60))
    assert [t for r in responses for t in r.new_token_ids] == want.token_ids[4:]
    assert (responses[-1].completion_tokens, responses[-1].prompt_tokens) == (
        10, len(want.prompt_token_ids))


# --------------------------------------------------------------------------- invalid input


def _value(item: object) -> struct_pb2.Value:
    value = struct_pb2.Value()
    if isinstance(item, str):
        value.string_value = item
    elif isinstance(item, int | float):
        value.number_value = item
    else:
        value.list_value.SetInParent()  # an empty list is still a list
        value.list_value.extend(item)  # type: ignore[arg-type]
    return value


def _completion(**fields: object) -> pb.CompletionRequest:
    prompt = fields.pop("prompt", "hello")
    return pb.CompletionRequest(prompt=_value(prompt), **fields)  # type: ignore[arg-type]


def _chat(**fields: object) -> pb.ChatCompletionRequest:
    fields.setdefault("messages", [chat_message({"role": "user", "content": "hi"})])
    return pb.ChatCompletionRequest(**fields)  # type: ignore[arg-type]


def _generate(**fields: object) -> epb.GenerateRequest:
    fields.setdefault("prompt_token_ids", [5, 6, 7])
    return epb.GenerateRequest(**fields)  # type: ignore[arg-type]


INVALID = grpc.StatusCode.INVALID_ARGUMENT
# (case, service, method, request, expected code, words the message must mention)
INVALID_CASES = [
    ("negative temperature", "gen", "Complete", _completion(temperature=-1), INVALID,
     "temperature"),
    ("top_p zero", "gen", "CompleteStream", _completion(top_p=0), INVALID, "top_p"),
    ("max_tokens zero", "gen", "Complete", _completion(max_tokens=0), INVALID, "max_tokens"),
    ("too many logprobs", "gen", "Complete", _completion(logprobs=50), INVALID, "logprobs"),
    ("n of 0", "gen", "Complete", _completion(n=0), INVALID, "between 1 and 128"),
    ("prompt_logprobs out of range", "gen", "Complete", _completion(prompt_logprobs=21),
     INVALID, "prompt_logprobs"),
    ("prompt_logprobs streamed", "gen", "CompleteStream", _completion(prompt_logprobs=1),
     INVALID, "not available with stream"),
    ("chat prompt_logprobs streamed", "gen", "ChatCompleteStream", _chat(prompt_logprobs=0),
     INVALID, "not available with stream"),
    ("echo with a negative max_tokens", "gen", "Complete", _completion(echo=True, max_tokens=-1),
     INVALID, "max_tokens"),
    ("truncate_prompt_tokens of 0", "gen", "Complete", _completion(truncate_prompt_tokens=0),
     INVALID, "truncate_prompt_tokens must be -1 or between 1 and"),
    ("chat truncate_prompt_tokens over the context", "gen", "ChatComplete",
     _chat(truncate_prompt_tokens=10**6), INVALID, "truncate_prompt_tokens"),
    ("empty prompt", "gen", "Complete", _completion(prompt=""), INVALID, "prompt"),
    ("no prompt", "gen", "Complete", pb.CompletionRequest(), INVALID, "prompt"),
    ("empty token list", "gen", "Complete", _completion(prompt=[]), INVALID, "prompt"),
    ("prompts mixing text and token ids", "gen", "Complete", _completion(prompt=["a", [5, 6]]),
     INVALID, "not a mix"),
    ("an empty prompt among several", "gen", "Complete", _completion(prompt=["a", ""]), INVALID,
     "prompt[1] is empty"),
    ("a prompt among several out of the vocabulary", "gen", "CompleteStream",
     _completion(prompt=[[5, 6], [10**6]]), INVALID, "prompt[1]: token ids"),
    ("prompts x n over 128 sequences", "gen", "Complete", _completion(prompt=["a"] * 3, n=50),
     INVALID, "150 sequences"),
    ("fractional token id", "gen", "Complete", _completion(prompt=[1.5]), INVALID, "prompt[0]"),
    ("token id out of vocabulary", "gen", "Complete", _completion(prompt=[10**6]), INVALID,
     "token ids"),
    ("prompt over the context", "gen", "Complete", _completion(prompt=[5] * 600), INVALID,
     "context length"),
    ("prompt plus max_tokens over the context", "gen", "CompleteStream",
     _completion(prompt=[5] * 500, max_tokens=100), INVALID, "max_tokens"),
    ("prompt of absurd length", "gen", "Complete", _completion(prompt="x" * 200_000), INVALID,
     "prompt"),
    ("stop of the wrong type", "gen", "Complete", _completion(stop=_value(3)), INVALID, "stop"),
    ("unknown model", "gen", "Complete", _completion(model="gpt-4"), grpc.StatusCode.NOT_FOUND,
     "gpt-4"),
    ("chat without messages", "gen", "ChatComplete", _chat(messages=[]), INVALID, "messages"),
    ("chat with a bad role", "gen", "ChatCompleteStream",
     _chat(messages=[chat_message({"role": "wizard", "content": "hi"})]), INVALID, "role"),
    ("chat with an image part", "gen", "ChatComplete", _chat(messages=[chat_message(
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]})]),
     INVALID, "messages[0].content[0] has type 'image_url'"),
    ("chat with a part that is not an object", "gen", "ChatCompleteStream",
     _chat(messages=[chat_message({"role": "user", "content": ["hi"]})]), INVALID,
     "messages[0].content[0] must be an object"),
    ("chat with a text part without text", "gen", "ChatComplete", _chat(messages=[
        chat_message({"role": "user", "content": [{"type": "text", "text": 3}]})]), INVALID,
     'needs a string "text"'),
    ("chat content of the wrong type", "gen", "ChatComplete", _chat(messages=[
        pb.ChatMessage(role="user", content=_value(3))]), INVALID, "content must be a string"),
    ("top_logprobs without logprobs", "gen", "ChatComplete", _chat(top_logprobs=2), INVALID,
     "logprobs"),
    ("chat with an unknown model", "gen", "ChatComplete", _chat(model="nope"),
     grpc.StatusCode.NOT_FOUND, "nope"),
    ("detokenize out of vocabulary", "gen", "Detokenize",
     pb.DetokenizeRequest(tokens=[10**6]), INVALID, "tokens"),
    ("tokenize nothing", "gen", "Tokenize", pb.TokenizeRequest(), INVALID, "prompt"),
    ("oversized message", "gen", "Complete", _completion(prompt="x" * (5 * 2**20)),
     grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"),
    ("engine: empty prompt", "engine", "Generate", _generate(prompt_token_ids=[]), INVALID,
     "prompt"),
    ("engine: several choices", "engine", "Generate",
     _generate(sampling_params=epb.SamplingParams(n=2)), INVALID, "Generation API"),
    ("engine: bad sampling", "engine", "Generate",
     _generate(sampling_params=epb.SamplingParams(top_k=-5)), INVALID, "top_k"),
    ("engine: prompt_logprobs out of range", "engine", "Generate",
     _generate(sampling_params=epb.SamplingParams(prompt_logprobs=-1)), INVALID,
     "prompt_logprobs"),
    ("engine: prefill on a both replica", "engine", "Prefill", epb.PrefillRequest(),
     grpc.StatusCode.FAILED_PRECONDITION, "served by prefill replicas"),
    ("engine: release on a both replica", "engine", "ReleaseKv", epb.ReleaseKvRequest(),
     grpc.StatusCode.FAILED_PRECONDITION, "pins no KV blocks"),
    ("engine: negative since_seq", "engine", "WatchKvEvents",
     epb.WatchKvEventsRequest(since_seq=-1), INVALID, "since_seq"),
]


@pytest.mark.parametrize(("case", "service", "method", "request_message", "code", "words"),
                         INVALID_CASES, ids=[c[0] for c in INVALID_CASES])
def test_invalid_input_gets_the_right_status(channel, case, service, method, request_message,
                                             code, words):
    stub = (pb_grpc.GenerationStub if service == "gen" else epb_grpc.EngineStub)(channel)
    call = getattr(stub, method)
    with pytest.raises(grpc.RpcError) as error:
        result = call(request_message, timeout=30)
        if not hasattr(result, "SerializeToString"):
            list(result)  # a stream fails when read
    assert error.value.code() == code, error.value.details()
    assert words in error.value.details()


def test_an_error_names_its_reason_and_field_in_the_status_details(channel):
    """gRPC clients read what the HTTP edge turns into OpenAI's ``code`` and ``param``: a
    google.rpc.ErrorInfo in the status details (grpc-status-details-bin)."""
    stub = pb_grpc.GenerationStub(channel)
    cases = [(_completion(model="gpt-4"), grpc.StatusCode.NOT_FOUND, "model_not_found", "model"),
             (_completion(temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT,
              "invalid_argument", "temperature")]
    for message, code, reason, param in cases:
        with pytest.raises(grpc.RpcError) as error:
            stub.Complete(message, timeout=30)
        details = dict(error.value.trailing_metadata())["grpc-status-details-bin"]
        status = status_pb2.Status.FromString(details)
        info = error_details_pb2.ErrorInfo()
        assert status.code == code.value[0] and status.details[0].Unpack(info)
        assert (info.reason, info.metadata["param"]) == (reason, param)


def test_bad_requests_do_not_hurt_the_others(client):
    # After every rejected request above, the replica still serves.
    assert client.complete("still fine", max_tokens=2).finish_reason is not None


# --------------------------------------------------------------------------- operations


def test_health_and_reflection(replica, channel):
    for service in ("", "tandem.v1.Generation", "tandem.v1.Engine"):
        assert replica.health(service) == health_pb2.HealthCheckResponse.SERVING
    services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"tandem.v1.Generation", "tandem.v1.Engine", "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection"} <= services


@pytest.mark.parametrize("version", VERSIONS)
def test_reflection_v1_and_v1alpha_list_and_describe(channel, version):
    """grpcurl and Postman ask v1 first: both versions list every service and resolve the
    file that defines one (with its dependencies), the reflection service's own included."""
    symbols = ("tandem.v1.Generation", "tandem.v1.Engine", f"grpc.reflection.{version}"
               ".ServerReflection", "tandem.v1.NoSuchService")
    answer = reflect(channel, version, symbols)
    assert {"tandem.v1.Generation", "tandem.v1.Engine", "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"} <= set(answer.services)
    for symbol in symbols[:3]:
        assert defines_service(answer.files[symbol][0], symbol), answer.files[symbol][0].name
    generation = answer.files["tandem.v1.Generation"]
    assert "google/api/annotations.proto" in {f.name for f in generation}  # dependencies too
    assert answer.errors["tandem.v1.NoSuchService"][0] == grpc.StatusCode.NOT_FOUND.value[0]


def test_metrics_endpoint(replica, client):
    client.complete("metrics please", max_tokens=3)
    body = urllib.request.urlopen(replica.metrics_url, timeout=10).read().decode()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:generation_tokens_total",
                 "vllm:request_queue_time_seconds_count", "vllm:request_decode_time_seconds_sum",
                 "vllm:iteration_tokens_total_bucket",
                 "vllm:request_time_per_output_token_seconds_count",
                 "vllm:request_params_max_tokens_count", "vllm:request_params_n_count",
                 "process_cpu_seconds_total",
                 "process_resident_memory_bytes", "python_info"):
        assert name in body, name
    assert 'engine="svc"' in body
    # The served name, as the API calls the model (and vLLM labels it), never the path.
    assert 'model_name="tiny"' in body and "model_name=\"/" not in body


def test_get_info_and_load(engine):
    info = engine.GetInfo(epb.GetInfoRequest())
    assert (info.engine_id, info.role, info.model) == ("svc", "both", "tiny")
    assert (info.max_model_len, info.block_size) == (MAX_MODEL_LEN, 16)
    assert info.kv_layout.dtype == "float32" and len(info.kv_layout.fingerprint) == 32
    load = engine.GetLoad(epb.GetLoadRequest())
    assert (load.engine_id, load.role, load.model, load.block_size) == ("svc", "both", "tiny", 16)
    assert load.num_total_blocks == 16 * 2**20 // (16 * 2 * 2 * 2 * 16 * 4)
    assert load.prefix_cache_queries > 0 and abs(load.timestamp - time.time()) < 60


def test_watch_kv_events_replays_then_resyncs_with_a_snapshot(engine, client):
    client.complete("Events come from blocks that fill up: " * 4, max_tokens=2)
    last_seq = engine.GetLoad(epb.GetLoadRequest()).kv_events_last_seq
    assert last_seq > 0
    replay = engine.WatchKvEvents(epb.WatchKvEventsRequest(since_seq=0), timeout=30)
    first = next(replay)
    assert first.seq == 1 and not first.resync
    stored = [e.block_stored for e in first.events if e.HasField("block_stored")]
    assert stored and all(len(h) == 32 for s in stored for h in s.block_hashes)
    replay.cancel()

    # A watcher that knew a later seq (a previous incarnation) gets a snapshot of the cache.
    ahead = engine.WatchKvEvents(epb.WatchKvEventsRequest(since_seq=last_seq + 1000), timeout=30)
    resync = next(ahead)
    assert resync.resync and resync.seq >= last_seq and not resync.events
    assert (resync.snapshot.chunk_index, resync.snapshot.num_chunks) == (0, 1)
    # It is exactly the cache that the batches up to its seq leave.
    held: set[bytes] = set()
    replay = engine.WatchKvEvents(epb.WatchKvEventsRequest(since_seq=0), timeout=30)
    for batch in replay:
        for event in batch.events:
            held.update(event.block_stored.block_hashes)
            held.difference_update(event.block_removed.block_hashes)
            if event.HasField("all_blocks_cleared"):
                held.clear()
        if batch.seq == resync.seq:
            break
    replay.cancel()
    assert held and set(resync.snapshot.block_hashes) == held
    # ... and then gets live events.
    client.complete("Fresh new blocks for the live watcher, " * 4, max_tokens=2)
    live = next(ahead)
    assert live.seq == resync.seq + 1 and not live.resync
    ahead.cancel()
