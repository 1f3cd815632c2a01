"""The Tandem Python SDK: ``Client`` (blocking) and ``AsyncClient`` (asyncio) over the public
``tandem.v1.Generation`` gRPC service.

Owns the channel, the per-call timeout and metadata, and the translation of failed calls into
``tandem.errors``. Requests are built by ``request_builders`` and responses turned into the
records of ``results``: a generation call returns its first choice, and all ``n`` of them in
``choices`` (streams: each chunk names its choice's ``index``); the Responses API's requests
and records are ``responses``'. It does not own the HTTP/OpenAI path (use the ``openai`` SDK
against Envoy for that).

    with Client("localhost:50051") as client:
        print(client.complete("Once upon a time", max_tokens=16, temperature=0).text)
        for chunk in client.chat_stream([{"role": "user", "content": "Hi"}]):
            print(chunk.content, end="")
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar, Unpack

import grpc
import grpc.aio

from protos.tandem.v1 import generation_pb2 as pb
from protos.tandem.v1 import generation_pb2_grpc as pb_grpc
from tandem.channel_security import TlsConfig, open_aio_channel, open_channel, resolve_tls
from tandem.errors import error_from_rpc
from tandem.request_builders import (
    ChatMessages,
    GenerationOptions,
    Prompts,
    chat_request,
    completion_request,
)
from tandem.responses import (
    Response,
    ResponseEvent,
    ResponseInput,
    ResponseItemPage,
    ResponseOptions,
    follow_request,
    input_items_request,
    item_page_from_pb,
    response_event_from_pb,
    response_from_pb,
    response_request,
)
from tandem.results import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
    ModelInfo,
    chat_chunk_from_pb,
    chat_completion_from_pb,
    completion_chunk_from_pb,
    completion_from_pb,
    model_from_pb,
)
from tandem.streams import AsyncResponseStream, ResponseStream

Metadata = Mapping[str, str] | Sequence[tuple[str, str]]
R = TypeVar("R")


def _metadata_pairs(metadata: Metadata | None,
                    api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    pairs = list((metadata.items() if isinstance(metadata, Mapping) else metadata) or ())
    if api_key is not None:
        pairs.append(("authorization", f"Bearer {api_key}"))  # as Envoy's key check reads it
    return tuple((key, value) for key, value in pairs) or None


class Client:
    """A blocking client. ``timeout`` (seconds) bounds each call, a whole stream included;
    ``metadata`` is sent with every call, and ``api_key`` as ``authorization: Bearer KEY``
    (Envoy's edge checks it when started with API keys). ``tls``: ``True`` for TLS with the
    system's CAs (or ``root_certificates``), or a ``TlsConfig``, e.g. ``TlsConfig.from_dir``
    for mutual TLS with a suite's replicas."""

    def __init__(
        self,
        target: str,
        *,
        tls: bool | TlsConfig = False,
        root_certificates: bytes | None = None,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        api_key: str | None = None,
    ) -> None:
        self._channel = open_channel(target, resolve_tls(tls, root_certificates))
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._timeout = timeout
        self._metadata = _metadata_pairs(metadata, api_key)

    def _unary(self, method: Callable[..., Any], request: Any) -> Any:
        try:
            return method(request, timeout=self._timeout, metadata=self._metadata)
        except grpc.RpcError as error:
            raise error_from_rpc(error) from error

    def _stream(
        self, method: Callable[..., Any], request: Any, convert: Callable[[Any], R]
    ) -> ResponseStream[R]:
        call = method(request, timeout=self._timeout, metadata=self._metadata)
        return ResponseStream(call, convert)

    def complete(
        self,
        prompt: Prompts,
        *,
        model: str | None = None,
        logprobs: int | None = None,
        **options: Unpack[GenerationOptions],
    ) -> Completion:
        """Completes a text prompt (or a list of prompt token ids, or a list of several
        prompts: choice j of prompt i is ``choices[i * n + j]``)."""
        request = completion_request(
            prompt,
            model=model,
            logprobs=logprobs,
            stream=False,
            include_usage=False,
            options=options,
        )
        return completion_from_pb(self._unary(self._stub.Complete, request))

    def complete_stream(
        self,
        prompt: Prompts,
        *,
        model: str | None = None,
        logprobs: int | None = None,
        include_usage: bool = True,
        **options: Unpack[GenerationOptions],
    ) -> ResponseStream[CompletionChunk]:
        """Streams a completion; with ``include_usage`` the last chunk carries the usage.
        Leaving the loop early (or ``close()``) cancels the request on the server."""
        request = completion_request(
            prompt, model=model, logprobs=logprobs, stream=True, include_usage=include_usage,
            options=options,
        )  # fmt: skip
        return self._stream(self._stub.CompleteStream, request, completion_chunk_from_pb)

    def chat(
        self,
        messages: ChatMessages,
        *,
        model: str | None = None,
        logprobs: bool = False,
        top_logprobs: int | None = None,
        **options: Unpack[GenerationOptions],
    ) -> ChatCompletion:
        """Answers OpenAI-style messages (``[{"role": "user", "content": "..."}]``)."""
        request = chat_request(
            messages, model=model, logprobs=logprobs, top_logprobs=top_logprobs, stream=False,
            include_usage=False, options=options,
        )  # fmt: skip
        return chat_completion_from_pb(self._unary(self._stub.ChatComplete, request))

    def chat_stream(
        self,
        messages: ChatMessages,
        *,
        model: str | None = None,
        logprobs: bool = False,
        top_logprobs: int | None = None,
        include_usage: bool = True,
        **options: Unpack[GenerationOptions],
    ) -> ResponseStream[ChatCompletionChunk]:
        """Streams a chat answer; see ``complete_stream`` for usage and cancellation."""
        request = chat_request(
            messages, model=model, logprobs=logprobs, top_logprobs=top_logprobs, stream=True,
            include_usage=include_usage, options=options,
        )  # fmt: skip
        return self._stream(self._stub.ChatCompleteStream, request, chat_chunk_from_pb)

    def respond(
        self,
        input: ResponseInput,
        *,
        model: str | None = None,
        **options: Unpack[ResponseOptions],
    ) -> Response:
        """OpenAI's Responses API: answers a string or a list of input items (messages,
        earlier ``function_call`` items and their ``function_call_output``), after the
        conversation of ``previous_response_id`` if given."""
        request = response_request(input, model=model, options=options)
        return response_from_pb(self._unary(self._stub.CreateResponse, request))

    def respond_stream(
        self,
        input: ResponseInput,
        *,
        model: str | None = None,
        **options: Unpack[ResponseOptions],
    ) -> ResponseStream[ResponseEvent]:
        """Streams a response's events, in OpenAI's order; the last ("response.completed" or
        "response.incomplete") carries the whole response. See ``complete_stream`` for
        cancellation."""
        request = response_request(input, model=model, options=options)
        return self._stream(self._stub.CreateResponseStream, request, response_event_from_pb)

    def get_response(self, response_id: str) -> Response:
        """A response the server stored (``respond`` without ``store=False``)."""
        request = pb.GetResponseRequest(response_id=response_id)
        return response_from_pb(self._unary(self._stub.GetResponse, request))

    def delete_response(self, response_id: str) -> None:
        self._unary(self._stub.DeleteResponse, pb.DeleteResponseRequest(response_id=response_id))

    def cancel_response(self, response_id: str) -> Response:
        """Stops a background response (``respond(..., background=True)``); the response as
        it stands, "cancelled" (a finished one as it finished)."""
        request = pb.CancelResponseRequest(response_id=response_id)
        return response_from_pb(self._unary(self._stub.CancelResponse, request))

    def follow_response(self, response_id: str, *,
                        starting_after: int | None = None) -> ResponseStream[ResponseEvent]:
        """A background response's events: those after the one numbered ``starting_after``
        (all of them without), then each as it comes, to the last. Resumes a stream lost
        midway (``respond_stream(..., background=True)``)."""
        request = follow_request(response_id, starting_after)
        return self._stream(self._stub.GetResponseStream, request, response_event_from_pb)

    def list_response_input_items(
        self,
        response_id: str,
        *,
        after: str | None = None,
        limit: int | None = None,
        order: str | None = None,
        include: Sequence[str] | None = None,
    ) -> ResponseItemPage:
        """One page of a stored response's input items, as OpenAI's ``input_items.list``:
        ``limit`` 1 to 100 (default 20), ``order`` "asc" or "desc" (the default, newest
        first), the page after the item ``after``; ``include`` may name
        "message.output_text.logprobs" to keep the logprobs of earlier output."""
        request = input_items_request(response_id, after=after, limit=limit, order=order,
                                      include=include)
        return item_page_from_pb(self._unary(self._stub.ListResponseInputItems, request))

    def models(self) -> list[ModelInfo]:
        response = self._unary(self._stub.ListModels, pb.ListModelsRequest())
        return [model_from_pb(m) for m in response.data]

    def model(self, model_id: str) -> ModelInfo:
        """One served model (the base model or a LoRA adapter); InvalidRequestError (NOT_FOUND)
        for another."""
        return model_from_pb(self._unary(self._stub.GetModel, pb.GetModelRequest(model=model_id)))

    def tokenize(
        self, text: str, *, model: str | None = None, add_special_tokens: bool | None = None
    ) -> list[int]:
        request = pb.TokenizeRequest(model=model or "", prompt=text)
        if add_special_tokens is not None:
            request.add_special_tokens = add_special_tokens
        return list(self._unary(self._stub.Tokenize, request).tokens)

    def detokenize(self, token_ids: Sequence[int], *, model: str | None = None) -> str:
        request = pb.DetokenizeRequest(model=model or "", tokens=token_ids)
        return str(self._unary(self._stub.Detokenize, request).prompt)

    def load_lora_adapter(self, name: str, path: str) -> list[str]:
        """Loads the PEFT adapter in directory ``path`` (on the server) under ``name``, on
        every replica behind a gateway; the adapters served afterwards. The server must run
        with --allow-runtime-lora-updating."""
        request = pb.LoadLoraAdapterRequest(lora_name=name, lora_path=path)
        return list(self._unary(self._stub.LoadLoraAdapter, request).lora_adapters)

    def unload_lora_adapter(self, name: str) -> list[str]:
        """Stops serving adapter ``name`` (requests running with it finish); the adapters
        served afterwards."""
        request = pb.UnloadLoraAdapterRequest(lora_name=name)
        return list(self._unary(self._stub.UnloadLoraAdapter, request).lora_adapters)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class AsyncClient:
    """The asyncio twin of ``Client``: the same methods, awaited; the ``*_stream`` methods
    return async iterators (``async for chunk in client.complete_stream(...)``)."""

    def __init__(
        self,
        target: str,
        *,
        tls: bool | TlsConfig = False,
        root_certificates: bytes | None = None,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        api_key: str | None = None,
    ) -> None:
        self._channel = open_aio_channel(target, resolve_tls(tls, root_certificates))
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._timeout = timeout
        self._metadata = _metadata_pairs(metadata, api_key)

    async def _unary(self, method: Callable[..., Any], request: Any) -> Any:
        try:
            return await method(request, timeout=self._timeout, metadata=self._metadata)
        except grpc.RpcError as error:
            raise error_from_rpc(error) from error

    def _stream(
        self, method: Callable[..., Any], request: Any, convert: Callable[[Any], R]
    ) -> AsyncResponseStream[R]:
        call = method(request, timeout=self._timeout, metadata=self._metadata)
        return AsyncResponseStream(call, convert)

    async def complete(
        self,
        prompt: Prompts,
        *,
        model: str | None = None,
        logprobs: int | None = None,
        **options: Unpack[GenerationOptions],
    ) -> Completion:
        request = completion_request(
            prompt,
            model=model,
            logprobs=logprobs,
            stream=False,
            include_usage=False,
            options=options,
        )
        return completion_from_pb(await self._unary(self._stub.Complete, request))

    def complete_stream(
        self,
        prompt: Prompts,
        *,
        model: str | None = None,
        logprobs: int | None = None,
        include_usage: bool = True,
        **options: Unpack[GenerationOptions],
    ) -> AsyncResponseStream[CompletionChunk]:
        request = completion_request(
            prompt, model=model, logprobs=logprobs, stream=True, include_usage=include_usage,
            options=options,
        )  # fmt: skip
        return self._stream(self._stub.CompleteStream, request, completion_chunk_from_pb)

    async def chat(
        self,
        messages: ChatMessages,
        *,
        model: str | None = None,
        logprobs: bool = False,
        top_logprobs: int | None = None,
        **options: Unpack[GenerationOptions],
    ) -> ChatCompletion:
        request = chat_request(
            messages, model=model, logprobs=logprobs, top_logprobs=top_logprobs, stream=False,
            include_usage=False, options=options,
        )  # fmt: skip
        return chat_completion_from_pb(await self._unary(self._stub.ChatComplete, request))

    def chat_stream(
        self,
        messages: ChatMessages,
        *,
        model: str | None = None,
        logprobs: bool = False,
        top_logprobs: int | None = None,
        include_usage: bool = True,
        **options: Unpack[GenerationOptions],
    ) -> AsyncResponseStream[ChatCompletionChunk]:
        request = chat_request(
            messages, model=model, logprobs=logprobs, top_logprobs=top_logprobs, stream=True,
            include_usage=include_usage, options=options,
        )  # fmt: skip
        return self._stream(self._stub.ChatCompleteStream, request, chat_chunk_from_pb)

    async def respond(
        self,
        input: ResponseInput,
        *,
        model: str | None = None,
        **options: Unpack[ResponseOptions],
    ) -> Response:
        request = response_request(input, model=model, options=options)
        return response_from_pb(await self._unary(self._stub.CreateResponse, request))

    def respond_stream(
        self,
        input: ResponseInput,
        *,
        model: str | None = None,
        **options: Unpack[ResponseOptions],
    ) -> AsyncResponseStream[ResponseEvent]:
        request = response_request(input, model=model, options=options)
        return self._stream(self._stub.CreateResponseStream, request, response_event_from_pb)

    async def get_response(self, response_id: str) -> Response:
        """See ``Client.get_response``."""
        request = pb.GetResponseRequest(response_id=response_id)
        return response_from_pb(await self._unary(self._stub.GetResponse, request))

    async def delete_response(self, response_id: str) -> None:
        await self._unary(self._stub.DeleteResponse,
                          pb.DeleteResponseRequest(response_id=response_id))

    async def cancel_response(self, response_id: str) -> Response:
        """See ``Client.cancel_response``."""
        request = pb.CancelResponseRequest(response_id=response_id)
        return response_from_pb(await self._unary(self._stub.CancelResponse, request))

    def follow_response(self, response_id: str, *, starting_after: int | None = None,
                        ) -> AsyncResponseStream[ResponseEvent]:
        """See ``Client.follow_response``."""
        request = follow_request(response_id, starting_after)
        return self._stream(self._stub.GetResponseStream, request, response_event_from_pb)

    async def list_response_input_items(
        self,
        response_id: str,
        *,
        after: str | None = None,
        limit: int | None = None,
        order: str | None = None,
        include: Sequence[str] | None = None,
    ) -> ResponseItemPage:
        """See ``Client.list_response_input_items``."""
        request = input_items_request(response_id, after=after, limit=limit, order=order,
                                      include=include)
        return item_page_from_pb(
            await self._unary(self._stub.ListResponseInputItems, request))

    async def models(self) -> list[ModelInfo]:
        response = await self._unary(self._stub.ListModels, pb.ListModelsRequest())
        return [model_from_pb(m) for m in response.data]

    async def model(self, model_id: str) -> ModelInfo:
        """One served model (the base model or a LoRA adapter); InvalidRequestError (NOT_FOUND)
        for another."""
        return model_from_pb(
            await self._unary(self._stub.GetModel, pb.GetModelRequest(model=model_id)))

    async def tokenize(
        self, text: str, *, model: str | None = None, add_special_tokens: bool | None = None
    ) -> list[int]:
        request = pb.TokenizeRequest(model=model or "", prompt=text)
        if add_special_tokens is not None:
            request.add_special_tokens = add_special_tokens
        return list((await self._unary(self._stub.Tokenize, request)).tokens)

    async def detokenize(self, token_ids: Sequence[int], *, model: str | None = None) -> str:
        request = pb.DetokenizeRequest(model=model or "", tokens=token_ids)
        return str((await self._unary(self._stub.Detokenize, request)).prompt)

    async def load_lora_adapter(self, name: str, path: str) -> list[str]:
        """See ``Client.load_lora_adapter``."""
        request = pb.LoadLoraAdapterRequest(lora_name=name, lora_path=path)
        return list((await self._unary(self._stub.LoadLoraAdapter, request)).lora_adapters)

    async def unload_lora_adapter(self, name: str) -> list[str]:
        """See ``Client.unload_lora_adapter``."""
        request = pb.UnloadLoraAdapterRequest(lora_name=name)
        return list((await self._unary(self._stub.UnloadLoraAdapter, request)).lora_adapters)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
