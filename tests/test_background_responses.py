"""OpenAI's background mode for the Responses API, end to end: the real ``openai`` SDK ->
Envoy -> gateway -> P/D replicas (``tests.openai_http``'s cluster, whose decode replica runs
one request at a time and queues none).

A background response answers at once, "queued", runs on in the server and is polled with
``retrieve`` to the offline engine's answer; it cannot be continued before it finishes;
``cancel`` stops it (the replica is free again) and answers it "cancelled", again and again; one the replica refuses ends "failed" with the
reason; a background stream dropped midway resumes with ``retrieve(stream=True,
starting_after=N)``, nothing lost or repeated; the gRPC SDK does the same. What does not
apply is a 400 that says why, a missing response a 404.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from engine_common.llm import LLM
from engine_common.sampling_params import SamplingParams
from protos.tandem.v1 import engine_pb2, engine_pb2_grpc, generation_pb2, generation_pb2_grpc
from tandem import Client, InvalidRequestError
from tests.openai_http import Stack, offline_engine
from tests.replica_process import ReplicaProcess

QUESTION = "Tell me a story about a lighthouse"
LONG = 400  # output tokens: still running when the test acts on it

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def want(tiny_llama_dir: Path) -> str:
    """The offline engine's greedy answer to QUESTION in 12 tokens."""
    offline: LLM = offline_engine(tiny_llama_dir)
    prompt = offline.inputs.tokenize_chat([{"role": "user", "content": QUESTION}])
    return offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12))[0].text


def until(client: openai.OpenAI, response_id: str, done: Any, timeout: float = 60) -> Any:
    """Polls the response until ``done(response)``; returns it."""
    deadline = time.monotonic() + timeout
    while True:
        response = client.responses.retrieve(response_id)
        if done(response):
            return response
        assert time.monotonic() < deadline, f"still {response.status}"
        time.sleep(0.05)


def finished(response: Any) -> bool:
    return response.status not in ("queued", "in_progress")


def running_requests(openai_stack: Stack, only: ReplicaProcess | None = None) -> int:
    """Requests the replicas' engines run (``only``'s, when given)."""
    total = 0
    for replica in [only] if only is not None else openai_stack.replicas.values():
        with grpc.insecure_channel(replica.target) as channel:
            load = engine_pb2_grpc.EngineStub(channel).GetLoad(engine_pb2.GetLoadRequest(),
                                                               timeout=10)
        total += load.num_requests_running
    return total


def test_a_background_response_answers_at_once_and_is_polled_to_the_answer(
        openai_stack: Stack, want: str) -> None:
    client = openai_stack.client()
    queued = client.responses.create(model="tiny", input=QUESTION, max_output_tokens=12,
                                     temperature=0, background=True)
    assert (queued.status, queued.background, queued.output) == ("queued", True, [])
    done = until(client, queued.id, finished)
    assert done.status in ("completed", "incomplete") and done.background
    assert done.output_text == want
    assert done.usage is not None and done.usage.output_tokens > 0


def test_cancel_stops_it_and_frees_the_replica(openai_stack: Stack) -> None:
    client = openai_stack.client()
    started = client.responses.create(model="tiny", input=QUESTION, max_output_tokens=LONG,
                                      temperature=0, background=True)
    until(client, started.id, lambda r: r.status == "in_progress")
    with pytest.raises(openai.BadRequestError, match="is still in_progress: continue it once"):
        client.responses.create(model="tiny", input="and then?", max_output_tokens=2,
                                previous_response_id=started.id)
    cancelled = client.responses.cancel(started.id)
    assert (cancelled.id, cancelled.status) == (started.id, "cancelled")
    assert client.responses.retrieve(started.id).status == "cancelled"
    assert client.responses.cancel(started.id).status == "cancelled"  # again: as it stands
    # The engine request was aborted: the replicas run nothing, and serve the next at once.
    deadline = time.monotonic() + 10
    while running_requests(openai_stack):
        assert time.monotonic() < deadline, "the cancelled response still runs"
        time.sleep(0.05)
    assert client.responses.create(model="tiny", input=QUESTION, max_output_tokens=2,
                                   temperature=0).status == "incomplete"


def test_a_response_the_replica_refuses_ends_failed_with_the_reason(openai_stack: Stack) -> None:
    client = openai_stack.client()
    decode = openai_stack.replicas["decode"]
    busy = client.responses.create(model="tiny", input=QUESTION, max_output_tokens=LONG,
                                   temperature=0, background=True)
    # NOTE: the decode replica's engine core is frozen (SIGSTOP) once it runs the busy
    # response, so that the busy one holds the replica's one slot until the end: "in
    # progress" is said before the request reaches the decode replica, and a fresh make test
    # under load once saw all 400 tokens finish before the next request came, which was then
    # served ("incomplete", not refused). Once the core runs it, it has most tokens to go.
    deadline = time.monotonic() + 60
    while running_requests(openai_stack, decode) == 0:
        assert time.monotonic() < deadline, f"the busy response never ran: {busy.status}"
        time.sleep(0.02)
    core = decode.engine_core_pid()
    os.kill(core, signal.SIGSTOP)
    try:
        # The decode replica runs one request and queues none: this one is refused.
        refused = client.responses.create(model="tiny", input="and another",
                                          max_output_tokens=4, background=True)
        assert refused.status == "queued"
        failed = until(client, refused.id, finished)
        assert failed.status == "failed" and failed.error is not None
        assert failed.error.code == "resource_exhausted", failed.error
        assert failed.error.message
    finally:
        os.kill(core, signal.SIGCONT)
        client.responses.cancel(busy.id)


def test_a_dropped_background_stream_resumes_where_it_stopped(openai_stack: Stack,
                                                             want: str) -> None:
    client = openai_stack.client()
    first: list[Any] = []
    with client.responses.create(model="tiny", input=QUESTION, max_output_tokens=12,
                                 temperature=0, background=True, stream=True) as stream:
        for event in stream:
            first.append(event)
            if event.type == "response.output_text.delta":
                break  # the client goes away midway; the response runs on
    response_id = first[0].response.id
    assert first[0].response.background
    rest = list(client.responses.retrieve(response_id, stream=True,
                                          starting_after=first[-1].sequence_number))
    events = first + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.output_text == want and events[-1].response.background
    # From the start again, the same events.
    again = list(client.responses.retrieve(response_id, stream=True))
    assert [e.sequence_number for e in again] == [e.sequence_number for e in events]


def test_what_does_not_apply_is_refused_with_the_reason(openai_stack: Stack) -> None:
    client = openai_stack.client()
    with pytest.raises(openai.BadRequestError, match="background needs store"):
        client.responses.create(model="tiny", input=QUESTION, max_output_tokens=2,
                                background=True, store=False)
    foreground = client.responses.create(model="tiny", input=QUESTION, max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="only background responses can be "
                                                     "cancelled"):
        client.responses.cancel(foreground.id)
    with pytest.raises(openai.BadRequestError, match="only a background response's events"):
        list(client.responses.retrieve(foreground.id, stream=True))
    with pytest.raises(openai.NotFoundError, match="no stored response"):
        client.responses.cancel("resp_missing")


def test_the_grpc_sdk_starts_follows_and_cancels(openai_stack: Stack, want: str) -> None:
    with Client(openai_stack.gateway, timeout=60) as client:
        queued = client.respond(QUESTION, model="tiny", max_output_tokens=12, temperature=0,
                                background=True)
        assert (queued.status, queued.background) == ("queued", True)
        events = list(client.follow_response(queued.id))
        assert events[-1].response is not None
        assert events[-1].response.output_text == want
        later = list(client.follow_response(queued.id, starting_after=events[-3].sequence_number))
        assert [e.type for e in later] == [e.type for e in events[-2:]]
        done = client.get_response(queued.id)
        assert done.output_text == want and done.background and done.error is None
        assert client.cancel_response(queued.id).status == done.status  # finished: as is
        with pytest.raises(InvalidRequestError, match="no stored response"):
            client.cancel_response("resp_missing")
    # The unary GetResponse does not stream: it says which RPC does.
    with grpc.insecure_channel(openai_stack.gateway) as channel, pytest.raises(grpc.RpcError) as raw:
        generation_pb2_grpc.GenerationStub(channel).GetResponse(
            generation_pb2.GetResponseRequest(response_id=queued.id, stream=True), timeout=10)
    assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "GetResponseStream" in (raw.value.details() or "")
