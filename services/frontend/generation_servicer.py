"""The public ``tandem.v1.Generation`` service over any ``GenerateFn``.

Owns the RPC handlers: check the model name, resolve the request (``openai_api``), run its
``n`` choices through the ``GenerateFn`` (``choices.generate_choices``) and write
OpenAI-shaped responses; every failure becomes a status (``errors.rpc_handler``). The
Responses API runs as the chat request it translates to (``responses_api``), after the
conversation of a stored response it continues; finished responses are stored
(``response_store``) unless the request says not to, their input items with ids so that
they can be listed a page at a time (``response_input_items``). Loading and unloading LoRA
adapters is handed to a ``LoraUpdates`` where the server allows it. The ``*Events`` RPCs
write the streams' chunks as server-sent events for HTTP clients (``server_sent_events``).
Streams are closed explicitly, so a client that cancels or runs out of deadline aborts every
choice of its request in the engine at once. The replica builds it over its local engine;
the gateway can build it over a remote replica's ``Engine.Generate``, with the same
tokenizer (``InputProcessor``) and served model. It does not own tokenization rules
(``InputProcessor``), admission or the engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import TypeVar

import grpc.aio
from google.protobuf import struct_pb2
from google.protobuf.message import Message

from engine_common.input_processor import InputProcessor
from protos.tandem.v1 import generation_pb2 as pb
from protos.tandem.v1 import generation_pb2_grpc as pb_grpc
from services.frontend.chat.request import (
    ChatRequest,
    chat_to_engine_request,
    new_chat_completion_id,
)
from services.frontend.chat.response import chat_response
from services.frontend.chat.stream import chat_chunks
from services.frontend.choices import generate_choices
from services.frontend.completions.request import completion_to_engine_request, new_completion_id
from services.frontend.completions.response import completion_chunks, completion_response
from services.frontend.engine_seam import CallContext, GenerateFn
from services.frontend.errors import InvalidArgument, NotFound, rpc_handler
from services.frontend.lora_updates import LoraUpdates, runtime_updates_off
from services.frontend.models import (
    detokenize_response,
    model_card,
    models_response,
    tokenize_response,
)
from services.frontend.responses import input_items as response_input_items
from services.frontend.responses import translate as responses_api
from services.frontend.responses.background import BackgroundResponses
from services.frontend.responses.store import ResponseStore, StoredResponse
from services.frontend.served_model import ServedModel
from services.frontend.server_sent_events import write_events

M = TypeVar("M", bound=Message)
CallContextFn = Callable[[grpc.aio.ServicerContext], CallContext]


def default_call_context(context: grpc.aio.ServicerContext) -> CallContext:
    """The call's deadline; no routing hint."""
    return CallContext.within(context.time_remaining())


# As vLLM: the prompt's logprobs belong to a whole response, not to a stream of deltas.
_NO_STREAMED_PROMPT_LOGPROBS = "prompt_logprobs is not available with stream=true"


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, model: ServedModel, inputs: InputProcessor, generate: GenerateFn,
                 lora_updates: LoraUpdates | None = None,
                 responses: ResponseStore | None = None, responder: str = "",
                 call_context: CallContextFn | None = None):
        self.model = model
        self.inputs = inputs
        self.generate = generate
        self.lora_updates = lora_updates  # None: adapters are fixed at start
        self.responses = responses  # None: no response is kept (store is answered false)
        self.background = BackgroundResponses(responses) if responses is not None else None
        # Written into response ids (``responses_api.new_response_id``): the engine id of a
        # replica that serves clients itself, behind an endpoint picker.
        self.responder = responder
        # How a call's context is read (deadline, and on a replica the P/D hint).
        self.call_context = call_context or default_call_context

    @rpc_handler
    async def Complete(self, request: pb.CompletionRequest,  # noqa: N802 (gRPC's names)
                       context: grpc.aio.ServicerContext) -> pb.CompletionResponse:
        plan = completion_to_engine_request(request, self.inputs,
                                                self.model.resolve(request.model))
        response_id = new_completion_id()
        call = self.call_context(context)
        choices = generate_choices(self.generate, response_id, plan.requests, call)
        async with aclosing(choices):
            response = await completion_response(
                choices, response_id=response_id,
                model=self.model.response_name(plan.lora_name),
                logprobs=plan.params.logprobs is not None, num_choices=plan.num_choices,
                choices_per_prompt=plan.params.n, echoes=plan.echoes,
                prompt_logprobs=plan.prompt_logprobs, prompt_token_ids=plan.prompt_token_ids)
        await _send_headers(call, context)
        return response

    @rpc_handler
    async def CompleteStream(self, request: pb.CompletionRequest,  # noqa: N802
                             context: grpc.aio.ServicerContext) -> None:
        call = self.call_context(context)
        await _write_all(_headed(self._completion_chunks(request, call), call, context), context)

    @rpc_handler
    async def CompleteEvents(self, request: pb.CompletionRequest,  # noqa: N802
                             context: grpc.aio.ServicerContext) -> None:
        call = self.call_context(context)
        await write_events(_headed(self._completion_chunks(request, call), call, context),
                           context)

    async def _completion_chunks(self, request: pb.CompletionRequest, call: CallContext,
                                 ) -> AsyncGenerator[pb.CompletionResponse, None]:
        plan = completion_to_engine_request(request, self.inputs,
                                                self.model.resolve(request.model))
        if plan.prompt_logprobs is not None:
            raise InvalidArgument(_NO_STREAMED_PROMPT_LOGPROBS + "; echo with logprobs "
                                  "streams the prompt's logprobs in the first chunk")
        response_id = new_completion_id()
        choices = generate_choices(self.generate, response_id, plan.requests, call)
        chunks = completion_chunks(choices, response_id=response_id,
                                       model=self.model.response_name(plan.lora_name),
                                       include_usage=request.stream_options.include_usage,
                                       choices_per_prompt=plan.params.n, echoes=plan.echoes,
                                       prompt_token_ids=plan.prompt_token_ids)
        async with aclosing(choices), aclosing(chunks):
            async for chunk in chunks:
                yield chunk

    @rpc_handler
    async def ChatComplete(self, request: pb.ChatCompletionRequest,  # noqa: N802
                           context: grpc.aio.ServicerContext) -> pb.ChatCompletionResponse:
        chat = chat_to_engine_request(request, self.inputs,
                                          self.model.resolve(request.model))
        response_id = new_chat_completion_id()
        call = self.call_context(context)
        choices = generate_choices(self.generate, response_id, [chat.request], call)
        async with aclosing(choices):
            response = await chat_response(
                choices, response_id=response_id,
                model=self.model.response_name(chat.request.lora_name),
                logprobs=chat.request.params.logprobs is not None,
                num_choices=chat.request.params.n, tools=chat.tools, reasoning=chat.reasoning,
                prompt_logprobs=chat.request.params.prompt_logprobs,
                prompt_token_ids=chat.request.prompt_token_ids if chat.return_token_ids else None)
        await _send_headers(call, context)
        return response

    @rpc_handler
    async def ChatCompleteStream(self, request: pb.ChatCompletionRequest,  # noqa: N802
                                 context: grpc.aio.ServicerContext) -> None:
        call = self.call_context(context)
        await _write_all(_headed(self._chat_chunks(request, call), call, context), context)

    @rpc_handler
    async def ChatCompleteEvents(self, request: pb.ChatCompletionRequest,  # noqa: N802
                                 context: grpc.aio.ServicerContext) -> None:
        call = self.call_context(context)
        await write_events(_headed(self._chat_chunks(request, call), call, context), context)

    async def _chat_chunks(
            self, request: pb.ChatCompletionRequest, call: CallContext,
    ) -> AsyncGenerator[pb.ChatCompletionChunk, None]:
        chat = self._chat_stream_request(request)
        chunks = self._chat_chunks_of(request, chat, call)
        async with aclosing(chunks):
            async for chunk in chunks:
                yield chunk

    def _chat_stream_request(self, request: pb.ChatCompletionRequest) -> ChatRequest:
        """The chat request resolved for streaming; raises before anything streams."""
        chat = chat_to_engine_request(request, self.inputs,
                                          self.model.resolve(request.model))
        if chat.request.params.prompt_logprobs is not None:
            raise InvalidArgument(_NO_STREAMED_PROMPT_LOGPROBS)
        return chat

    async def _chat_chunks_of(
            self, request: pb.ChatCompletionRequest, chat: ChatRequest, call: CallContext,
    ) -> AsyncGenerator[pb.ChatCompletionChunk, None]:
        response_id = new_chat_completion_id()
        choices = generate_choices(self.generate, response_id, [chat.request], call)
        chunks = chat_chunks(choices, response_id=response_id,
                                 model=self.model.response_name(chat.request.lora_name),
                                 include_usage=request.stream_options.include_usage,
                                 tools=chat.tools, reasoning=chat.reasoning,
                                 prompt_token_ids=(chat.request.prompt_token_ids
                                                   if chat.return_token_ids else None))
        async with aclosing(choices), aclosing(chunks):
            async for chunk in chunks:
                yield chunk

    @rpc_handler
    async def CreateResponse(self, request: pb.ResponseRequest,  # noqa: N802
                             context: grpc.aio.ServicerContext) -> pb.Response:
        call = self.call_context(context)
        if request.background:
            return self._start_background(request, call).response
        events = self._response_events(request, call)
        async with aclosing(events):
            response = await responses_api.final_response(events)
        await _send_headers(call, context)
        return response

    @rpc_handler
    async def CreateResponseStream(self, request: pb.ResponseRequest,  # noqa: N802
                                   context: grpc.aio.ServicerContext) -> None:
        call = self.call_context(context)
        await _write_all(_headed(self._response_stream(request, call), call, context), context)

    @rpc_handler
    async def CreateResponseEvents(self, request: pb.ResponseRequest,  # noqa: N802
                                   context: grpc.aio.ServicerContext) -> None:
        call = self.call_context(context)
        await write_events(_headed(self._response_stream(request, call), call, context),
                           context, name=lambda event: event.type)

    def _response_stream(self, request: pb.ResponseRequest, call: CallContext,
                         ) -> AsyncGenerator[pb.ResponseStreamEvent, None]:
        if request.background:  # the client reads along; it may leave and come back
            started = self._start_background(request, call)
            return self._background_runs().follow(started.response.id)
        return self._response_events(request, call)

    async def _response_events(self, request: pb.ResponseRequest, call: CallContext,
                               ) -> AsyncGenerator[pb.ResponseStreamEvent, None]:
        store = self.responses if not request.HasField("store") or request.store else None
        prepared, events = self._prepare_response(request, store is not None, call)
        async with aclosing(events):
            async for event in events:
                if store is not None and event.type in responses_api.FINAL_EVENTS:
                    store.put(dataclasses.replace(prepared, response=event.response))
                yield event

    def _start_background(self, request: pb.ResponseRequest,
                          call: CallContext) -> StoredResponse:
        if request.HasField("store") and not request.store:
            raise InvalidArgument("background needs store: a background response is read "
                                  "back with GET /v1/responses/{id}; leave store out or "
                                  "set it true")
        runs = self._background_runs()
        # It runs on after the call: the client's deadline does not bound it.
        prepared, events = self._prepare_response(
            request, True, CallContext(prefill_peer=call.prefill_peer))
        prepared.response.status = "queued"
        runs.start(prepared, events)
        return prepared

    def _prepare_response(self, request: pb.ResponseRequest, store: bool,
                          call: CallContext) -> tuple[
            StoredResponse, AsyncGenerator[pb.ResponseStreamEvent, None]]:
        """The response as it will be stored (before any output) and its events. Every
        check is made here, so that a bad request fails with its status before either."""
        chat_request = responses_api.chat_request(request, self._history(request))
        chat = self._chat_stream_request(chat_request)
        # Read now: the response it continues may be dropped from the store while this runs.
        earlier = (self._stored().get(request.previous_response_id).conversation_items()
                   if store and request.previous_response_id else ())
        items = response_input_items.identified(
            responses_api.input_items(request), taken=map(response_input_items.item_id, earlier))
        shell = responses_api.response_shell(
            request, responses_api.new_response_id(self.responder),
            self.model.response_name(chat.request.lora_name), store)
        events = responses_api.response_events(self._chat_chunks_of(chat_request, chat, call),
                                               request=request, shell=shell)
        return StoredResponse(shell, items, request.previous_response_id, earlier), events

    def _history(self, request: pb.ResponseRequest) -> list[struct_pb2.Value]:
        """The conversation ``previous_response_id`` continues (none without one)."""
        if not request.previous_response_id:
            return []
        if self.responses is None:
            raise InvalidArgument("previous_response_id needs a stored response, and this "
                                  "server keeps none (--max-stored-responses 0): send the "
                                  "conversation so far in input")
        return self.responses.conversation(request.previous_response_id)

    @rpc_handler
    async def GetResponse(self, request: pb.GetResponseRequest,  # noqa: N802
                          context: grpc.aio.ServicerContext) -> pb.Response:
        if request.stream:
            raise InvalidArgument("stream is GetResponseStream's (a background response's "
                                  "events); GetResponse answers the response as it stands")
        response_input_items.includes_logprobs(request.include)  # names a value it lacks
        return self._stored().get(request.response_id).response

    @rpc_handler
    async def GetResponseStream(self, request: pb.GetResponseRequest,  # noqa: N802
                                context: grpc.aio.ServicerContext) -> None:
        await _write_all(self._followed(request), context)

    @rpc_handler
    async def GetResponseEvents(self, request: pb.GetResponseRequest,  # noqa: N802
                                context: grpc.aio.ServicerContext) -> None:
        await write_events(self._followed(request), context, name=lambda event: event.type)

    def _followed(
            self, request: pb.GetResponseRequest) -> AsyncGenerator[pb.ResponseStreamEvent, None]:
        response_input_items.includes_logprobs(request.include)
        starting_after = (request.starting_after if request.HasField("starting_after")
                          else None)
        return self._background_runs().follow(request.response_id, starting_after)

    @rpc_handler
    async def CancelResponse(self, request: pb.CancelResponseRequest,  # noqa: N802
                             context: grpc.aio.ServicerContext) -> pb.Response:
        return await self._background_runs().cancel(request.response_id)

    @rpc_handler
    async def DeleteResponse(self, request: pb.DeleteResponseRequest,  # noqa: N802
                             context: grpc.aio.ServicerContext) -> pb.DeleteResponseResponse:
        if self._stored().get(request.response_id).response.background:
            await self._background_runs().cancel(request.response_id)  # if still running
        self._stored().delete(request.response_id)
        return pb.DeleteResponseResponse(id=request.response_id, object="response",
                                         deleted=True)

    @rpc_handler
    async def ListResponseInputItems(  # noqa: N802
            self, request: pb.ListResponseInputItemsRequest,
            context: grpc.aio.ServicerContext) -> pb.ResponseItemList:
        query = response_input_items.ItemQuery.of(request)
        stored = self._stored().get(request.response_id)
        return response_input_items.page(stored.listed_items(), query, request.response_id)

    def _stored(self) -> ResponseStore:
        if self.responses is None:
            raise NotFound("this server keeps no responses (--max-stored-responses 0)")
        return self.responses

    def _background_runs(self) -> BackgroundResponses:
        if self.background is None:
            raise InvalidArgument("background responses are stored, and this server keeps "
                                  "none (--max-stored-responses 0)")
        return self.background

    @rpc_handler
    async def ListModels(self, request: pb.ListModelsRequest,  # noqa: N802
                         context: grpc.aio.ServicerContext) -> pb.ListModelsResponse:
        return models_response(self.model)

    @rpc_handler
    async def GetModel(self, request: pb.GetModelRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> pb.Model:
        return model_card(self.model, request.model)

    @rpc_handler
    async def Tokenize(self, request: pb.TokenizeRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        self.model.resolve(request.model)
        return tokenize_response(request, self.inputs)

    @rpc_handler
    async def Detokenize(self, request: pb.DetokenizeRequest,  # noqa: N802
                         context: grpc.aio.ServicerContext) -> pb.DetokenizeResponse:
        self.model.resolve(request.model)
        return detokenize_response(request, self.inputs)

    @rpc_handler
    async def LoadLoraAdapter(self, request: pb.LoadLoraAdapterRequest,  # noqa: N802
                              context: grpc.aio.ServicerContext) -> pb.LoraAdapterResponse:
        if self.lora_updates is None:
            raise runtime_updates_off()
        message, names = await self.lora_updates.load(request.lora_name, request.lora_path)
        return pb.LoraAdapterResponse(message=message, lora_adapters=names)

    @rpc_handler
    async def UnloadLoraAdapter(self, request: pb.UnloadLoraAdapterRequest,  # noqa: N802
                                context: grpc.aio.ServicerContext) -> pb.LoraAdapterResponse:
        if self.lora_updates is None:
            raise runtime_updates_off()
        message, names = await self.lora_updates.unload(request.lora_name)
        return pb.LoraAdapterResponse(message=message, lora_adapters=names)


async def _send_headers(call: CallContext, context: grpc.aio.ServicerContext) -> None:
    """The response headers the engine set for the call (``CallContext.response_headers``),
    sent as the call's initial metadata."""
    if call.response_headers:
        await context.send_initial_metadata(tuple(call.response_headers.items()))


async def _headed(chunks: AsyncGenerator[M, None], call: CallContext,
                  context: grpc.aio.ServicerContext) -> AsyncGenerator[M, None]:
    """``chunks``, with the call's response headers sent just before the first (the engine
    sets them by then: a decode replica knows how the prompt's KV got there before its
    first token)."""
    async with aclosing(chunks):
        first = True
        async for chunk in chunks:
            if first:
                await _send_headers(call, context)
                first = False
            yield chunk


async def _write_all(chunks: AsyncGenerator[Message, None],
                     context: grpc.aio.ServicerContext) -> None:
    """Writes every chunk as a message of the call's stream; closes ``chunks`` on the way out
    (a cancelled call must abort the generation)."""
    async with aclosing(chunks):
        async for chunk in chunks:
            await context.write(chunk)
