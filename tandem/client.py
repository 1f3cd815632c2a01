"""The Tandem Python SDK: ``Client`` (blocking) and ``AsyncClient`` (asyncio) over the public
``tandem.v1.Generation`` gRPC service.

Owns the channel, the per-call timeout and metadata, how each client invokes a stub (blocking
or awaited) and the translation of failed calls into ``tandem.errors``. What each method sends
and returns is ``calls``', written once for both clients: the methods here only pass their
arguments on. A generation call returns its first choice, and all ``n`` of them in
``choices`` (streams: each chunk names its choice's ``index``). It does not own the
HTTP/OpenAI path (use the ``openai`` SDK against Envoy for that).

    with Client("localhost:50051") as client:
        print(client.complete("Once upon a time", max_tokens=16, temperature=0).text)
        for chunk in client.chat_stream([{"role": "user", "content": "Hi"}]):
            print(chunk.content, end="")
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar, Unpack

import grpc
import grpc.aio

from protos.tandem.v1 import generation_pb2_grpc as pb_grpc
from tandem import calls
from tandem.calls import Call
from tandem.channel_security import TlsConfig, open_aio_channel, open_channel, resolve_tls
from tandem.errors import error_from_rpc
from tandem.request_builders import ChatMessages, GenerationOptions, Prompts
from tandem.responses import (
    Response,
    ResponseEvent,
    ResponseInput,
    ResponseItemPage,
    ResponseOptions,
)
from tandem.results import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
    ModelInfo,
)
from tandem.streams import AsyncResponseStream, ResponseStream

Metadata = Mapping[str, str] | Sequence[tuple[str, str]]
R = TypeVar("R")


def _call_options(timeout: float | None, metadata: Metadata | None,
                  api_key: str | None) -> dict[str, Any]:
    """The keywords every stub call takes: the timeout and the metadata (the API key last)."""
    pairs = list((metadata.items() if isinstance(metadata, Mapping) else metadata) or ())
    if api_key is not None:
        pairs.append(("authorization", f"Bearer {api_key}"))  # as Envoy's key check reads it
    return {"timeout": timeout, "metadata": tuple((key, value) for key, value in pairs) or None}


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
        self._options = _call_options(timeout, metadata, api_key)

    def _unary(self, call: Call[R]) -> R:
        try:
            answer = getattr(self._stub, call.rpc)(call.request, **self._options)
        except grpc.RpcError as error:
            raise error_from_rpc(error) from error
        return call.convert(answer)

    def _stream(self, call: Call[R]) -> ResponseStream[R]:
        # A stream's failure surfaces while iterating: ResponseStream maps it.
        return ResponseStream(getattr(self._stub, call.rpc)(call.request, **self._options),
                              call.convert)

    def complete(self, prompt: Prompts, *, model: str | None = None,
                 logprobs: int | None = None,
                 **options: Unpack[GenerationOptions]) -> Completion:
        """Completes a text prompt (or a list of prompt token ids, or a list of several
        prompts: choice j of prompt i is ``choices[i * n + j]``)."""
        return self._unary(calls.complete(prompt, model=model, logprobs=logprobs,
                                          options=options))

    def complete_stream(self, prompt: Prompts, *, model: str | None = None,
                        logprobs: int | None = None, include_usage: bool = True,
                        **options: Unpack[GenerationOptions],
                        ) -> ResponseStream[CompletionChunk]:
        """Streams a completion; with ``include_usage`` the last chunk carries the usage.
        Leaving the loop early (or ``close()``) cancels the request on the server."""
        return self._stream(calls.complete_stream(prompt, model=model, logprobs=logprobs,
                                                  include_usage=include_usage,
                                                  options=options))

    def chat(self, messages: ChatMessages, *, model: str | None = None, logprobs: bool = False,
             top_logprobs: int | None = None,
             **options: Unpack[GenerationOptions]) -> ChatCompletion:
        """Answers OpenAI-style messages (``[{"role": "user", "content": "..."}]``)."""
        return self._unary(calls.chat(messages, model=model, logprobs=logprobs,
                                      top_logprobs=top_logprobs, options=options))

    def chat_stream(self, messages: ChatMessages, *, model: str | None = None,
                    logprobs: bool = False, top_logprobs: int | None = None,
                    include_usage: bool = True, **options: Unpack[GenerationOptions],
                    ) -> ResponseStream[ChatCompletionChunk]:
        """Streams a chat answer; see ``complete_stream`` for usage and cancellation."""
        return self._stream(calls.chat_stream(messages, model=model, logprobs=logprobs,
                                              top_logprobs=top_logprobs,
                                              include_usage=include_usage, options=options))

    def respond(self, input: ResponseInput, *, model: str | None = None,
                **options: Unpack[ResponseOptions]) -> Response:
        """OpenAI's Responses API: answers a string or a list of input items (messages,
        earlier ``function_call`` items and their ``function_call_output``), after the
        conversation of ``previous_response_id`` if given."""
        return self._unary(calls.respond(input, model=model, options=options))

    def respond_stream(self, input: ResponseInput, *, model: str | None = None,
                       **options: Unpack[ResponseOptions]) -> ResponseStream[ResponseEvent]:
        """Streams a response's events, in OpenAI's order; the last ("response.completed" or
        "response.incomplete") carries the whole response. See ``complete_stream`` for
        cancellation."""
        return self._stream(calls.respond_stream(input, model=model, options=options))

    def get_response(self, response_id: str) -> Response:
        """A response the server stored (``respond`` without ``store=False``)."""
        return self._unary(calls.get_response(response_id))

    def delete_response(self, response_id: str) -> None:
        self._unary(calls.delete_response(response_id))

    def cancel_response(self, response_id: str) -> Response:
        """Stops a background response (``respond(..., background=True)``); the response as
        it stands, "cancelled" (a finished one as it finished)."""
        return self._unary(calls.cancel_response(response_id))

    def follow_response(self, response_id: str, *,
                        starting_after: int | None = None) -> ResponseStream[ResponseEvent]:
        """A background response's events: those after the one numbered ``starting_after``
        (all of them without), then each as it comes, to the last. Resumes a stream lost
        midway (``respond_stream(..., background=True)``)."""
        return self._stream(calls.follow_response(response_id, starting_after))

    def list_response_input_items(self, response_id: str, *, after: str | None = None,
                                  limit: int | None = None, order: str | None = None,
                                  include: Sequence[str] | None = None) -> ResponseItemPage:
        """One page of a stored response's input items, as OpenAI's ``input_items.list``:
        ``limit`` 1 to 100 (default 20), ``order`` "asc" or "desc" (the default, newest
        first), the page after the item ``after``; ``include`` may name
        "message.output_text.logprobs" to keep the logprobs of earlier output."""
        return self._unary(calls.list_response_input_items(
            response_id, after=after, limit=limit, order=order, include=include))

    def models(self) -> list[ModelInfo]:
        return self._unary(calls.models())

    def model(self, model_id: str) -> ModelInfo:
        """One served model (the base model or a LoRA adapter); InvalidRequestError (NOT_FOUND)
        for another."""
        return self._unary(calls.model(model_id))

    def tokenize(self, text: str, *, model: str | None = None,
                 add_special_tokens: bool | None = None) -> list[int]:
        return self._unary(calls.tokenize(text, model=model,
                                          add_special_tokens=add_special_tokens))

    def detokenize(self, token_ids: Sequence[int], *, model: str | None = None) -> str:
        return self._unary(calls.detokenize(token_ids, model=model))

    def load_lora_adapter(self, name: str, path: str) -> list[str]:
        """Loads the PEFT adapter in directory ``path`` (on the server) under ``name``, on
        every replica behind a gateway; the adapters served afterwards. The server must run
        with --allow-runtime-lora-updating."""
        return self._unary(calls.load_lora_adapter(name, path))

    def unload_lora_adapter(self, name: str) -> list[str]:
        """Stops serving adapter ``name`` (requests running with it finish); the adapters
        served afterwards."""
        return self._unary(calls.unload_lora_adapter(name))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class AsyncClient:
    """The asyncio twin of ``Client``: the same methods, awaited; the ``*_stream`` methods
    and ``follow_response`` return async iterators (``async for chunk in
    client.complete_stream(...)``). Each method is documented on ``Client``."""

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
        self._options = _call_options(timeout, metadata, api_key)

    async def _unary(self, call: Call[R]) -> R:
        try:
            answer = await getattr(self._stub, call.rpc)(call.request, **self._options)
        except grpc.RpcError as error:  # grpc.aio.AioRpcError
            raise error_from_rpc(error) from error
        return call.convert(answer)

    def _stream(self, call: Call[R]) -> AsyncResponseStream[R]:
        return AsyncResponseStream(getattr(self._stub, call.rpc)(call.request, **self._options),
                                   call.convert)

    async def complete(self, prompt: Prompts, *, model: str | None = None,
                       logprobs: int | None = None,
                       **options: Unpack[GenerationOptions]) -> Completion:
        return await self._unary(calls.complete(prompt, model=model, logprobs=logprobs,
                                                options=options))

    def complete_stream(self, prompt: Prompts, *, model: str | None = None,
                        logprobs: int | None = None, include_usage: bool = True,
                        **options: Unpack[GenerationOptions],
                        ) -> AsyncResponseStream[CompletionChunk]:
        return self._stream(calls.complete_stream(prompt, model=model, logprobs=logprobs,
                                                  include_usage=include_usage,
                                                  options=options))

    async def chat(self, messages: ChatMessages, *, model: str | None = None,
                   logprobs: bool = False, top_logprobs: int | None = None,
                   **options: Unpack[GenerationOptions]) -> ChatCompletion:
        return await self._unary(calls.chat(messages, model=model, logprobs=logprobs,
                                            top_logprobs=top_logprobs, options=options))

    def chat_stream(self, messages: ChatMessages, *, model: str | None = None,
                    logprobs: bool = False, top_logprobs: int | None = None,
                    include_usage: bool = True, **options: Unpack[GenerationOptions],
                    ) -> AsyncResponseStream[ChatCompletionChunk]:
        return self._stream(calls.chat_stream(messages, model=model, logprobs=logprobs,
                                              top_logprobs=top_logprobs,
                                              include_usage=include_usage, options=options))

    async def respond(self, input: ResponseInput, *, model: str | None = None,
                      **options: Unpack[ResponseOptions]) -> Response:
        return await self._unary(calls.respond(input, model=model, options=options))

    def respond_stream(self, input: ResponseInput, *, model: str | None = None,
                       **options: Unpack[ResponseOptions],
                       ) -> AsyncResponseStream[ResponseEvent]:
        return self._stream(calls.respond_stream(input, model=model, options=options))

    async def get_response(self, response_id: str) -> Response:
        return await self._unary(calls.get_response(response_id))

    async def delete_response(self, response_id: str) -> None:
        await self._unary(calls.delete_response(response_id))

    async def cancel_response(self, response_id: str) -> Response:
        return await self._unary(calls.cancel_response(response_id))

    def follow_response(self, response_id: str, *, starting_after: int | None = None,
                        ) -> AsyncResponseStream[ResponseEvent]:
        return self._stream(calls.follow_response(response_id, starting_after))

    async def list_response_input_items(self, response_id: str, *, after: str | None = None,
                                        limit: int | None = None, order: str | None = None,
                                        include: Sequence[str] | None = None,
                                        ) -> ResponseItemPage:
        return await self._unary(calls.list_response_input_items(
            response_id, after=after, limit=limit, order=order, include=include))

    async def models(self) -> list[ModelInfo]:
        return await self._unary(calls.models())

    async def model(self, model_id: str) -> ModelInfo:
        return await self._unary(calls.model(model_id))

    async def tokenize(self, text: str, *, model: str | None = None,
                       add_special_tokens: bool | None = None) -> list[int]:
        return await self._unary(calls.tokenize(text, model=model,
                                                add_special_tokens=add_special_tokens))

    async def detokenize(self, token_ids: Sequence[int], *, model: str | None = None) -> str:
        return await self._unary(calls.detokenize(token_ids, model=model))

    async def load_lora_adapter(self, name: str, path: str) -> list[str]:
        return await self._unary(calls.load_lora_adapter(name, path))

    async def unload_lora_adapter(self, name: str) -> list[str]:
        return await self._unary(calls.unload_lora_adapter(name))

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()
