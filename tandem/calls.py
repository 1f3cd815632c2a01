"""Each SDK method's call, defined once for ``Client`` and ``AsyncClient``.

Owns, per method: which RPC of ``tandem.v1.Generation`` it makes, the request message built
from the method's arguments (by ``request_builders`` and ``responses``) and the function that
turns the answer into the SDK's record (``results``, ``responses``). It makes no call: the
clients do, blocking or awaited, and own the channel, the timeout, the metadata and the
mapping of a failed call to ``tandem.errors``. So the two clients differ only in how they
invoke a stub, and a method's behaviour is written here once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from google.protobuf.message import Message

from protos.tandem.v1 import generation_pb2 as pb
from tandem.request_builders import ChatMessages, Prompts, chat_request, completion_request
from tandem.responses import (
    Response,
    ResponseEvent,
    ResponseInput,
    ResponseItemPage,
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

R = TypeVar("R")


@dataclass(frozen=True)
class Call(Generic[R]):
    """One RPC to make: ``rpc`` names the stub's method; ``convert`` maps its answer (each
    message of a stream) to what the SDK returns."""

    rpc: str
    request: Message
    convert: Callable[[Any], R]


def complete(prompt: Prompts, *, model: str | None, logprobs: int | None,
             options: Mapping[str, object]) -> Call[Completion]:
    request = completion_request(prompt, model=model, logprobs=logprobs, stream=False,
                                 include_usage=False, options=options)
    return Call("Complete", request, completion_from_pb)


def complete_stream(prompt: Prompts, *, model: str | None, logprobs: int | None,
                    include_usage: bool, options: Mapping[str, object],
                    ) -> Call[CompletionChunk]:
    request = completion_request(prompt, model=model, logprobs=logprobs, stream=True,
                                 include_usage=include_usage, options=options)
    return Call("CompleteStream", request, completion_chunk_from_pb)


def chat(messages: ChatMessages, *, model: str | None, logprobs: bool,
         top_logprobs: int | None, options: Mapping[str, object]) -> Call[ChatCompletion]:
    request = chat_request(messages, model=model, logprobs=logprobs, top_logprobs=top_logprobs,
                           stream=False, include_usage=False, options=options)
    return Call("ChatComplete", request, chat_completion_from_pb)


def chat_stream(messages: ChatMessages, *, model: str | None, logprobs: bool,
                top_logprobs: int | None, include_usage: bool,
                options: Mapping[str, object]) -> Call[ChatCompletionChunk]:
    request = chat_request(messages, model=model, logprobs=logprobs, top_logprobs=top_logprobs,
                           stream=True, include_usage=include_usage, options=options)
    return Call("ChatCompleteStream", request, chat_chunk_from_pb)


def respond(input: ResponseInput, *, model: str | None,
            options: Mapping[str, object]) -> Call[Response]:
    return Call("CreateResponse", response_request(input, model=model, options=options),
                response_from_pb)


def respond_stream(input: ResponseInput, *, model: str | None,
                   options: Mapping[str, object]) -> Call[ResponseEvent]:
    return Call("CreateResponseStream", response_request(input, model=model, options=options),
                response_event_from_pb)


def get_response(response_id: str) -> Call[Response]:
    return Call("GetResponse", pb.GetResponseRequest(response_id=response_id), response_from_pb)


def delete_response(response_id: str) -> Call[None]:
    return Call("DeleteResponse", pb.DeleteResponseRequest(response_id=response_id),
                lambda _: None)


def cancel_response(response_id: str) -> Call[Response]:
    return Call("CancelResponse", pb.CancelResponseRequest(response_id=response_id),
                response_from_pb)


def follow_response(response_id: str, starting_after: int | None) -> Call[ResponseEvent]:
    return Call("GetResponseStream", follow_request(response_id, starting_after),
                response_event_from_pb)


def list_response_input_items(response_id: str, *, after: str | None, limit: int | None,
                              order: str | None, include: Sequence[str] | None,
                              ) -> Call[ResponseItemPage]:
    request = input_items_request(response_id, after=after, limit=limit, order=order,
                                  include=include)
    return Call("ListResponseInputItems", request, item_page_from_pb)


def models() -> Call[list[ModelInfo]]:
    return Call("ListModels", pb.ListModelsRequest(),
                lambda response: [model_from_pb(m) for m in response.data])


def model(model_id: str) -> Call[ModelInfo]:
    return Call("GetModel", pb.GetModelRequest(model=model_id), model_from_pb)


def tokenize(text: str, *, model: str | None, add_special_tokens: bool | None,
             ) -> Call[list[int]]:
    request = pb.TokenizeRequest(model=model or "", prompt=text)
    if add_special_tokens is not None:
        request.add_special_tokens = add_special_tokens
    return Call("Tokenize", request, lambda response: list(response.tokens))


def detokenize(token_ids: Sequence[int], *, model: str | None) -> Call[str]:
    return Call("Detokenize", pb.DetokenizeRequest(model=model or "", tokens=token_ids),
                lambda response: str(response.prompt))


def load_lora_adapter(name: str, path: str) -> Call[list[str]]:
    return Call("LoadLoraAdapter", pb.LoadLoraAdapterRequest(lora_name=name, lora_path=path),
                _adapter_names)


def unload_lora_adapter(name: str) -> Call[list[str]]:
    return Call("UnloadLoraAdapter", pb.UnloadLoraAdapterRequest(lora_name=name),
                _adapter_names)


def _adapter_names(response: pb.LoraAdapterResponse) -> list[str]:
    return list(response.lora_adapters)
