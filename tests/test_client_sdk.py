"""The SDK's request mapping, response mapping, error mapping and stream cancellation.

The server here is a tiny in-test servicer of ``tandem.v1.Generation`` that records what it
receives and answers canned messages: it checks the SDK's side of the wire only. The
end-to-end SDK tests against a real replica come with the services.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from google.protobuf import json_format

import tandem
from protos.tandem.v1 import generation_pb2 as pb
from protos.tandem.v1 import generation_pb2_grpc as pb_grpc


def logprob_entry(token: str, logprob: float, *tops: tuple[str, float]) -> dict[str, object]:
    """A Responses logprob entry, as the server writes it (with each token's UTF-8 bytes)."""
    return {"token": token, "logprob": logprob, "bytes": list(token.encode()),
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                             for t, lp in tops]}


# Every kind of output item, two messages among them (their text is joined, as the openai
# SDK's output_text joins it), cut by the limit.
RESPONSE = {
    "id": "resp_1", "object": "response", "model": "m", "status": "incomplete",
    "incomplete_details": {"reason": "max_output_tokens"},
    "output": [
        {"type": "reasoning", "id": "rs_1", "status": "completed", "summary": [],
         "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "Hel", "annotations": [],
                      "logprobs": [logprob_entry("Hel", -0.5, ("Hel", -0.5), ("Hi", -1.5))]}]},
        {"type": "function_call", "id": "fc_1", "status": "completed", "call_id": "call_1",
         "name": "f", "arguments": '{"x": 1}'},
        {"type": "message", "id": "msg_2", "status": "incomplete", "role": "assistant",
         "content": [{"type": "output_text", "text": "lo", "annotations": [],
                      "logprobs": [logprob_entry("lo", -0.25)]}]},
    ],
    "usage": {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 4},
              "output_tokens": 3, "output_tokens_details": {"reasoning_tokens": 0},
              "total_tokens": 8},
}
CALL_ITEM = {"type": "function_call", "id": "fc_2", "call_id": "call_2", "name": "g"}
RESPONSE_EVENTS = [
    {"type": "response.created", "sequence_number": 0,
     "response": {"id": "resp_2", "model": "m", "status": "in_progress"}},
    {"type": "response.output_item.added", "sequence_number": 1, "output_index": 0,
     "item": {**CALL_ITEM, "status": "in_progress", "arguments": ""}},
    {"type": "response.function_call_arguments.delta", "sequence_number": 2,
     "output_index": 0, "item_id": "fc_2", "delta": "{}"},
    {"type": "response.function_call_arguments.done", "sequence_number": 3,
     "output_index": 0, "item_id": "fc_2", "arguments": "{}"},
    {"type": "response.output_item.done", "sequence_number": 4, "output_index": 0,
     "item": {**CALL_ITEM, "status": "completed", "arguments": "{}"}},
    {"type": "response.output_item.added", "sequence_number": 5, "output_index": 1,
     "item": {"type": "message", "id": "msg_3", "status": "in_progress",
              "role": "assistant"}},
    {"type": "response.output_text.delta", "sequence_number": 6, "output_index": 1,
     "content_index": 0, "item_id": "msg_3", "delta": "Hi",
     "logprobs": [logprob_entry("Hi", -0.75, ("Hi", -0.75), ("Yo", -2.0))]},
    {"type": "response.output_text.done", "sequence_number": 7, "output_index": 1,
     "content_index": 0, "item_id": "msg_3", "text": "Hi"},
    {"type": "response.completed", "sequence_number": 8,
     "response": {"id": "resp_2", "model": "m", "status": "completed", "output": [
         {**CALL_ITEM, "status": "completed", "arguments": "{}"},
         {"type": "message", "id": "msg_3", "status": "completed", "role": "assistant",
          "content": [{"type": "output_text", "text": "Hi"}]}],
         "usage": {"input_tokens": 2, "output_tokens": 1, "total_tokens": 3}}},
]


class RecordingServicer(pb_grpc.GenerationServicer):
    """Echoes what it can, records every request, and fails on demand: a prompt
    ``"fail:<STATUS_CODE>"`` aborts with that code, a prompt ``"forever"`` streams until
    cancelled and then sets ``cancelled``."""

    def __init__(self) -> None:
        self.requests: list[object] = []
        self.metadata: list[dict[str, str]] = []
        self.cancelled = threading.Event()

    def _record(self, request: object, context: grpc.ServicerContext) -> None:
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))

    def _maybe_fail(self, text: str, context: grpc.ServicerContext) -> None:
        if text.startswith("fail:"):
            context.abort(grpc.StatusCode[text.removeprefix("fail:")], f"told to {text}")

    def Complete(self, request, context):  # noqa: N802 (gRPC's method names)
        self._record(request, context)
        self._maybe_fail(request.prompt.string_value, context)
        logprobs = pb.CompletionLogprobs(tokens=[" b"])
        logprobs.token_logprobs.append(-0.25)
        logprobs.top_logprobs.add_struct().update({" b": -0.25, " c": -2.0})
        return pb.CompletionResponse(
            id="cmpl-1",
            object="text_completion",
            model="m",
            choices=[pb.CompletionChoice(text=" b", finish_reason="length", logprobs=logprobs)],
            usage=pb.Usage(
                prompt_tokens=3,
                completion_tokens=1,
                total_tokens=4,
                prompt_tokens_details=pb.PromptTokensDetails(cached_tokens=2),
            ),
        )

    def CompleteStream(self, request, context) -> Iterator[pb.CompletionResponse]:  # noqa: N802
        self._record(request, context)
        self._maybe_fail(request.prompt.string_value, context)
        if request.prompt.string_value == "forever":
            context.add_callback(self.cancelled.set)
            while context.is_active():
                yield pb.CompletionResponse(id="s", choices=[pb.CompletionChoice(text="x")])
                time.sleep(0.01)
            return
        for piece in ("a", "b"):
            yield pb.CompletionResponse(id="s", choices=[pb.CompletionChoice(text=piece)])
        yield pb.CompletionResponse(
            id="s", choices=[pb.CompletionChoice(text="", finish_reason="stop")]
        )
        yield pb.CompletionResponse(
            id="s", usage=pb.Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3)
        )

    def ChatComplete(self, request, context):  # noqa: N802
        self._record(request, context)
        message = pb.ChatResponseMessage(role="assistant", content="Hello!")
        return pb.ChatCompletionResponse(
            id="chat-1", choices=[pb.ChatChoice(message=message, finish_reason="stop")]
        )

    def ChatCompleteStream(self, request, context):  # noqa: N802
        self._record(request, context)
        yield pb.ChatCompletionChunk(
            choices=[pb.ChatChunkChoice(delta=pb.ChatDelta(role="assistant", content="He"))]
        )
        yield pb.ChatCompletionChunk(
            choices=[pb.ChatChunkChoice(delta=pb.ChatDelta(content="y"), finish_reason="stop")]
        )

    def CreateResponse(self, request, context):  # noqa: N802
        self._record(request, context)
        self._maybe_fail(request.input.string_value, context)
        return json_format.ParseDict(RESPONSE, pb.Response())

    def CreateResponseStream(self, request, context):  # noqa: N802
        self._record(request, context)
        self._maybe_fail(request.input.string_value, context)
        if request.input.string_value == "forever":
            context.add_callback(self.cancelled.set)
            while context.is_active():
                yield pb.ResponseStreamEvent(type="response.output_text.delta", delta="x")
                time.sleep(0.01)
            return
        for event in RESPONSE_EVENTS:
            yield json_format.ParseDict(event, pb.ResponseStreamEvent())

    def ListModels(self, request, context):  # noqa: N802
        return pb.ListModelsResponse(
            object="list", data=[pb.Model(id="m", owned_by="tandem", max_model_len=2048)]
        )

    def Tokenize(self, request, context):  # noqa: N802
        self._record(request, context)
        return pb.TokenizeResponse(tokens=[ord(c) for c in request.prompt])

    def Detokenize(self, request, context):  # noqa: N802
        return pb.DetokenizeResponse(prompt="".join(chr(t) for t in request.tokens))


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, RecordingServicer]]:
    servicer = RecordingServicer()
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_GenerationServicer_to_server(servicer, grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    yield f"127.0.0.1:{port}", servicer
    grpc_server.stop(grace=None)


def test_complete_maps_arguments_and_leaves_the_rest_unset(server) -> None:
    target, servicer = server
    with tandem.Client(target, timeout=10, metadata={"authorization": "Bearer t"}) as client:
        result = client.complete(
            "a", model="m", max_tokens=5, temperature=0.0, stop=["\n", "."], logprobs=1, seed=3
        )
    request = servicer.requests[-1]
    assert request.model == "m" and request.prompt.string_value == "a"
    assert request.HasField("temperature") and request.temperature == 0.0
    assert (request.max_tokens, request.seed, request.logprobs) == (5, 3, 1)
    assert [v.string_value for v in request.stop.list_value.values] == ["\n", "."]
    assert not request.HasField("top_p") and not request.HasField("presence_penalty")
    assert not request.stream
    assert servicer.metadata[-1]["authorization"] == "Bearer t"

    assert result.text == " b" and result.finish_reason == "length"
    assert result.usage == tandem.Usage(3, 1, 4, cached_tokens=2)
    assert result.logprobs == [tandem.TokenLogprob(" b", -0.25, {" b": -0.25, " c": -2.0})]


def test_token_id_prompts_and_unknown_options(server) -> None:
    target, servicer = server
    with tandem.Client(target) as client:
        client.complete([1, 2, 3], stop_token_ids=[7])
        request = servicer.requests[-1]
        assert [v.number_value for v in request.prompt.list_value.values] == [1, 2, 3]
        assert list(request.stop_token_ids) == [7]
        with pytest.raises(TypeError, match="best_of"):
            client.complete("a", best_of=2)  # type: ignore[call-arg]
        with pytest.raises(TypeError, match="tools"):
            client.complete("a", tools=[])  # tools are for chat


def test_chat_maps_tools_and_tool_turns(server) -> None:
    target, servicer = server
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer", "maximum": 3}}}}}
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    with tandem.Client(target) as client:
        client.chat([{"role": "user", "content": "Hi"},
                     {"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "3"}],
                    tools=[tool], tool_choice={"type": "function", "function": {"name": "f"}},
                    parallel_tool_calls=False)
    request = servicer.requests[-1]
    assert [json_format.MessageToDict(t) for t in request.tools] == [tool]
    assert json_format.MessageToDict(request.tool_choice) == {
        "type": "function", "function": {"name": "f"}}
    assert request.HasField("parallel_tool_calls") and not request.parallel_tool_calls
    assert [json_format.MessageToDict(c) for c in request.messages[1].tool_calls] == [call]
    assert request.messages[1].content.string_value == ""
    assert request.messages[2].tool_call_id == "call_1"


def test_streams_chat_and_small_calls(server) -> None:
    target, servicer = server
    with tandem.Client(target) as client:
        chunks = list(client.complete_stream("a", max_tokens=2))
        assert servicer.requests[-1].stream_options.include_usage
        assert [c.text for c in chunks] == ["a", "b", "", ""]
        assert chunks[2].finish_reason == "stop"
        assert chunks[3].usage == tandem.Usage(1, 2, 3)

        answer = client.chat([{"role": "user", "content": "Hi"}], top_logprobs=2, top_k=5)
        request = servicer.requests[-1]
        assert [(m.role, m.content.string_value) for m in request.messages] == [("user", "Hi")]
        assert request.logprobs and request.top_logprobs == 2 and request.top_k == 5
        assert (answer.role, answer.content, answer.finish_reason) == (
            "assistant",
            "Hello!",
            "stop",
        )

        pieces = list(client.chat_stream([{"role": "user", "content": "Hi"}], include_usage=False))
        assert not servicer.requests[-1].stream_options.include_usage
        assert [(p.role, p.content, p.finish_reason) for p in pieces] == [
            ("assistant", "He", None),
            (None, "y", "stop"),
        ]

        assert client.models() == [tandem.ModelInfo("m", "tandem", 0, 2048)]
        assert client.tokenize("hi", add_special_tokens=False) == [104, 105]
        assert servicer.requests[-1].HasField("add_special_tokens")
        assert client.detokenize([104, 105]) == "hi"


ERRORS = [
    ("INVALID_ARGUMENT", tandem.InvalidRequestError),
    ("NOT_FOUND", tandem.InvalidRequestError),
    ("RESOURCE_EXHAUSTED", tandem.OverloadedError),
    ("UNAVAILABLE", tandem.UnavailableError),
    ("INTERNAL", tandem.TandemError),
]


@pytest.mark.parametrize("call", ["complete", "respond"])
@pytest.mark.parametrize(("code", "error_type"), ERRORS)
def test_errors_map_to_exceptions(server, code: str, error_type: type, call: str) -> None:
    """Completions and responses, unary and streamed."""
    target, _ = server
    with tandem.Client(target) as client:
        with pytest.raises(error_type) as unary:
            getattr(client, call)(f"fail:{code}")
        with pytest.raises(error_type) as streamed:
            list(getattr(client, f"{call}_stream")(f"fail:{code}"))
    for raised in (unary.value, streamed.value):
        assert raised.code == grpc.StatusCode[code]
        assert raised.details == f"told to fail:{code}"


def test_deadline_maps_to_deadline_exceeded(server) -> None:
    target, _ = server
    with tandem.Client(target, timeout=0.2) as client:
        with pytest.raises(tandem.DeadlineExceededError):
            list(client.complete_stream("forever"))


def test_breaking_out_of_a_stream_cancels_the_rpc(server) -> None:
    target, servicer = server
    servicer.cancelled.clear()
    with tandem.Client(target) as client:
        for count, _chunk in enumerate(client.complete_stream("forever"), start=1):
            if count == 3:
                break
        assert servicer.cancelled.wait(5), "the server never saw the cancellation"

        servicer.cancelled.clear()
        stream = client.complete_stream("forever")
        next(stream)
        stream.close()
        assert servicer.cancelled.wait(5)
        assert list(stream) == []


def test_async_client(server) -> None:
    target, servicer = server

    async def scenario() -> None:
        async with tandem.AsyncClient(target, timeout=10) as client:
            result = await client.complete("a", temperature=0.5)
            assert result.text == " b" and servicer.requests[-1].temperature == 0.5
            chunks = [c async for c in client.complete_stream("a")]
            assert [c.text for c in chunks] == ["a", "b", "", ""]
            pieces = [
                p.content async for p in client.chat_stream([{"role": "user", "content": "x"}])
            ]
            assert pieces == ["He", "y"]
            assert (await client.chat([{"role": "user", "content": "x"}])).content == "Hello!"
            assert await client.tokenize("hi") == [104, 105]

            with pytest.raises(tandem.OverloadedError):
                await client.complete("fail:RESOURCE_EXHAUSTED")
            with pytest.raises(tandem.UnavailableError):
                [c async for c in client.complete_stream("fail:UNAVAILABLE")]

            servicer.cancelled.clear()
            async with client.complete_stream("forever") as stream:
                async for _chunk in stream:
                    break
            assert await asyncio.to_thread(servicer.cancelled.wait, 5)

            servicer.cancelled.clear()

            async def consume() -> None:
                async for _chunk in client.complete_stream("forever"):
                    pass

            task = asyncio.create_task(consume())
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await asyncio.to_thread(servicer.cancelled.wait, 5)

    asyncio.run(scenario())


def test_respond_maps_arguments_and_leaves_the_rest_unset(server) -> None:
    target, servicer = server
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
             {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    tool = {"type": "function", "name": "f", "description": "the weather",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
            "strict": True}
    text = {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"},
                       "strict": True}}
    with tandem.Client(target) as client:
        client.respond(items, model="m", instructions="be brief", max_output_tokens=7,
                       tools=[tool], tool_choice={"type": "function", "name": "f"}, text=text,
                       top_logprobs=2, temperature=0.0, top_p=0.5, top_k=4, min_p=0.1, seed=9,
                       repetition_penalty=1.1, parallel_tool_calls=False,
                       metadata={"ticket": "42"}, user="u", cache_salt="s", priority=3,
                       chat_template_kwargs={"enable_thinking": False})
        full = servicer.requests[-1]
        client.respond("Hi", include=["reasoning.encrypted_content"], seed=None)
        bare = servicer.requests[-1]
        with pytest.raises(TypeError, match="max_tokens"):
            client.respond("Hi", max_tokens=3)  # type: ignore[call-arg]

    assert json_format.MessageToDict(full.input) == items
    assert (full.model, full.instructions, full.max_output_tokens) == ("m", "be brief", 7)
    assert [json_format.MessageToDict(t) for t in full.tools] == [tool]
    assert json_format.MessageToDict(full.tool_choice) == {"type": "function", "name": "f"}
    assert json_format.MessageToDict(full.text) == text
    # top_logprobs alone asks for the output text's logprobs, as chat's does.
    assert list(full.include) == ["message.output_text.logprobs"] and full.top_logprobs == 2
    assert full.HasField("temperature") and full.temperature == 0.0
    assert (full.top_p, full.top_k, full.min_p, full.seed) == (0.5, 4, pytest.approx(0.1), 9)
    assert full.repetition_penalty == pytest.approx(1.1)
    assert full.HasField("parallel_tool_calls") and not full.parallel_tool_calls
    assert dict(full.metadata) == {"ticket": "42"}
    assert (full.user, full.cache_salt, full.priority) == ("u", "s", 3)
    assert json_format.MessageToDict(full.chat_template_kwargs) == {"enable_thinking": False}

    assert bare.input.string_value == "Hi" and not bare.model and not bare.instructions
    assert list(bare.include) == ["reasoning.encrypted_content"]
    for name in ("max_output_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                 "repetition_penalty", "parallel_tool_calls", "top_logprobs", "tool_choice",
                 "text", "chat_template_kwargs", "store"):
        assert not bare.HasField(name), name
    assert not bare.tools and not bare.metadata and not bare.stream


def test_respond_converts_the_response(server) -> None:
    target, _ = server
    with tandem.Client(target) as client:
        response = client.respond("Hi")
    assert response == tandem.Response(
        id="resp_1", model="m", status="incomplete", output_text="Hello", reasoning="hmm",
        function_calls=[tandem.FunctionCall("call_1", "f", '{"x": 1}')],
        usage=tandem.ResponseUsage(input_tokens=5, output_tokens=3, total_tokens=8,
                                   cached_tokens=4),
        incomplete_reason="max_output_tokens",
        output_logprobs=[tandem.TokenLogprob("Hel", -0.5, {"Hel": -0.5, "Hi": -1.5}),
                         tandem.TokenLogprob("lo", -0.25)])


def test_respond_stream_converts_the_events(server) -> None:
    target, servicer = server
    with tandem.Client(target) as client:
        events = list(client.respond_stream("Hi", max_output_tokens=4))
        assert servicer.requests[-1].max_output_tokens == 4

        servicer.cancelled.clear()
        for count, _event in enumerate(client.respond_stream("forever"), start=1):
            if count == 3:
                break
        assert servicer.cancelled.wait(5), "the server never saw the cancellation"

    call = tandem.FunctionCall("call_2", "g", "")
    assert events[:6] == [
        tandem.ResponseEvent("response.created", 0, response=tandem.Response(
            id="resp_2", model="m", status="in_progress", output_text="")),
        tandem.ResponseEvent("response.output_item.added", 1, output_index=0,
                             function_call=call),
        tandem.ResponseEvent("response.function_call_arguments.delta", 2, delta="{}",
                             output_index=0, item_id="fc_2"),
        tandem.ResponseEvent("response.function_call_arguments.done", 3, arguments="{}",
                             output_index=0, item_id="fc_2"),
        tandem.ResponseEvent("response.output_item.done", 4, output_index=0,
                             function_call=tandem.FunctionCall("call_2", "g", "{}")),
        tandem.ResponseEvent("response.output_item.added", 5, output_index=1),
    ]
    assert events[6] == tandem.ResponseEvent(
        "response.output_text.delta", 6, delta="Hi", output_index=1, item_id="msg_3",
        logprobs=[tandem.TokenLogprob("Hi", -0.75, {"Hi": -0.75, "Yo": -2.0})])
    assert events[7] == tandem.ResponseEvent("response.output_text.done", 7, text="Hi",
                                             output_index=1, item_id="msg_3")
    last = events[8]
    assert (last.type, last.sequence_number, last.delta) == ("response.completed", 8, "")
    assert last.response == tandem.Response(
        id="resp_2", model="m", status="completed", output_text="Hi",
        function_calls=[tandem.FunctionCall("call_2", "g", "{}")],
        usage=tandem.ResponseUsage(2, 1, 3))
    assert len(events) == 9


def test_async_client_responses(server) -> None:
    target, servicer = server

    async def scenario() -> None:
        async with tandem.AsyncClient(target, timeout=10) as client:
            response = await client.respond("Hi", temperature=0.5)
            assert servicer.requests[-1].temperature == 0.5
            events = [e async for e in client.respond_stream("Hi")]
            with tandem.Client(target) as blocking:  # the same records as the blocking twin's
                assert response == blocking.respond("Hi")
                assert events == list(blocking.respond_stream("Hi"))

            with pytest.raises(tandem.InvalidRequestError):
                await client.respond("fail:INVALID_ARGUMENT")
            with pytest.raises(tandem.OverloadedError):
                [e async for e in client.respond_stream("fail:RESOURCE_EXHAUSTED")]

            servicer.cancelled.clear()
            async with client.respond_stream("forever") as stream:
                async for _event in stream:
                    break
            assert await asyncio.to_thread(servicer.cancelled.wait, 5)

    asyncio.run(scenario())
