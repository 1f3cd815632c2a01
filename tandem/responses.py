"""OpenAI's Responses API in the SDK: the ``ResponseRequest`` built from keyword arguments, and
the records a response and its stream events become.

Owns ``response_request`` (input as a string or OpenAI's input items; instructions, the flat
function tools, ``tool_choice``, ``text.format``, ``include`` and the sampling knobs in
``ResponseOptions``; a knob left out stays unset on the wire, so the server applies its
default), ``input_items_request`` (a page of a stored response's input items),
``follow_request`` (a background response's events again) and
``Response``, ``ResponseEvent``, ``FunctionCall``, ``ResponseUsage``, ``ResponseItemPage``
with their conversion from the wire.
A ``Response`` flattens the output items the way the openai SDK reads them: ``output_text``
joins the messages' text, ``reasoning`` the reasoning items', ``function_calls`` lists the
calls. It does not validate input items, tools or ranges (the server does, and answers
INVALID_ARGUMENT naming the field), keeps no conversation state (the server stores
responses: ``previous_response_id``), and does not own the transport (``client``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

from google.protobuf import json_format, struct_pb2

from protos.tandem.v1 import generation_pb2 as pb
from tandem.request_builders import set_field
from tandem.results import TokenLogprob

# The include value that asks for the output text's token logprobs.
OUTPUT_TEXT_LOGPROBS = "message.output_text.logprobs"

# A string (one user message), or OpenAI's input items: messages {"role": ..., "content":
# text or [{"type": "input_text", "text": ...}]}, an earlier turn's calls {"type":
# "function_call", "call_id": ..., "name": ..., "arguments": ...} and their results
# {"type": "function_call_output", "call_id": ..., "output": ...}.
ResponseInput = str | Sequence[Mapping[str, Any]]
# Function tools in the Responses API's flat shape: [{"type": "function", "name": ...,
# "description": ..., "parameters": schema, "strict": bool}].
ResponseTools = Sequence[Mapping[str, Any]]


class ResponseOptions(TypedDict, total=False):
    instructions: str  # a system message before the input
    max_output_tokens: int
    tools: ResponseTools
    # "auto", "none", "required" or {"type": "function", "name": ...}.
    tool_choice: str | Mapping[str, Any]
    # OpenAI's {"format": {"type": "json_schema", "name": ..., "schema": {...}}} (or type
    # "json_object", "text").
    text: Mapping[str, Any]
    include: Sequence[str]  # e.g. [OUTPUT_TEXT_LOGPROBS]
    # Alone, it also asks for the output text's logprobs (adds OUTPUT_TEXT_LOGPROBS to
    # include), as chat's does, where OpenAI's API needs both.
    top_logprobs: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    repetition_penalty: float
    parallel_tool_calls: bool
    metadata: Mapping[str, str]  # echoed in the response
    user: str
    cache_salt: str
    priority: int
    # Extra variables for the model's chat template, e.g. {"enable_thinking": False}.
    chat_template_kwargs: Mapping[str, Any]
    # Continue a stored response's conversation (its input and output come first).
    previous_response_id: str
    store: bool  # default true: the server keeps the response (Client.get_response)
    # Answer at once with the response "queued"; it runs on in the server (get_response
    # shows how far it got, cancel_response stops it; streamed, follow_response resumes).
    background: bool


_OPTION_NAMES = frozenset(ResponseOptions.__annotations__)


def response_request(input: ResponseInput, *, model: str | None,
                     options: Mapping[str, Any]) -> pb.ResponseRequest:
    """A ResponseRequest for ``input`` with ``options`` (``ResponseOptions``'s names; None
    means not given, as in the openai SDK)."""
    unknown = set(options) - _OPTION_NAMES
    if unknown:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(unknown))}")
    request = pb.ResponseRequest(model=model or "")
    if isinstance(input, str):
        request.input.string_value = input
    else:  # the server reads the items and names the one it cannot serve
        items = [dict(item) for item in input]
        json_format.ParseDict(items, request.input)  # type: ignore[arg-type]  # a JSON list
    for name, value in options.items():
        if value is not None:
            set_field(request, name, value)
    if request.HasField("top_logprobs") and OUTPUT_TEXT_LOGPROBS not in request.include:
        request.include.append(OUTPUT_TEXT_LOGPROBS)
    return request


def input_items_request(response_id: str, *, after: str | None, limit: int | None,
                        order: str | None,
                        include: Sequence[str] | None) -> pb.ListResponseInputItemsRequest:
    """The request for one page of ``response_id``'s input items; None leaves a parameter
    to the server's default (the newest 20 first)."""
    request = pb.ListResponseInputItemsRequest(response_id=response_id, after=after or "",
                                               order=order or "", include=include or ())
    if limit is not None:
        request.limit = limit
    return request


def follow_request(response_id: str, starting_after: int | None) -> pb.GetResponseRequest:
    """The request for a background response's events after ``starting_after`` (a
    sequence number; None: from the first)."""
    request = pb.GetResponseRequest(response_id=response_id, stream=True)
    if starting_after is not None:
        request.starting_after = starting_after
    return request


@dataclass(frozen=True)
class ResponseItemPage:
    """One page of a stored response's input items (``Client.list_response_input_items``):
    the items as OpenAI's JSON objects, each with its ``id``; for a response that continued
    another, the conversation's items come first (oldest first, in order "asc"). Ask for the
    next page with ``after=last_id`` while ``has_more``."""

    items: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


def item_page_from_pb(page: pb.ResponseItemList) -> ResponseItemPage:
    return ResponseItemPage(
        items=[json_format.MessageToDict(item) for item in page.data],
        first_id=page.first_id if page.HasField("first_id") else None,
        last_id=page.last_id if page.HasField("last_id") else None,
        has_more=page.has_more,
    )


@dataclass(frozen=True)
class FunctionCall:
    """A function the model called; send it back as a {"type": "function_call", ...} input
    item, with its result as a {"type": "function_call_output", "call_id": ...} one."""

    call_id: str
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class ResponseUsage:
    input_tokens: int
    output_tokens: int
    total_tokens: int
    cached_tokens: int = 0  # input tokens served from the prefix cache
    reasoning_tokens: int = 0  # output tokens of the reasoning


@dataclass(frozen=True)
class Response:
    """A response, its output items read as the openai SDK reads them. ``status`` is
    "completed", "incomplete" (``incomplete_reason`` says why: "max_output_tokens"), or
    "in_progress" in a stream's first events; a background response is "queued" at first,
    and may end "failed" (``error`` says why) or "cancelled"."""

    id: str
    model: str
    status: str
    output_text: str  # every message item's output_text, joined
    reasoning: str | None = None  # the reasoning items' text; None when there are none
    function_calls: list[FunctionCall] = field(default_factory=list)
    usage: ResponseUsage | None = None
    incomplete_reason: str | None = None
    # The output text's tokens, with include OUTPUT_TEXT_LOGPROBS (or top_logprobs).
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    stored: bool = False  # kept by the server: a later request may continue it
    previous_response_id: str | None = None
    background: bool = False
    error: str | None = None  # a failed background response's "code: message"


@dataclass(frozen=True)
class ResponseEvent:
    """One event of a streamed response (``type`` as OpenAI's, e.g.
    "response.output_text.delta"); the fields an event type does not carry are unset."""

    type: str
    sequence_number: int
    delta: str = ""  # the *.delta events' text or arguments
    text: str | None = None  # output_text.done / reasoning_text.done: the whole text
    arguments: str | None = None  # function_call_arguments.done: the whole arguments
    output_index: int | None = None
    item_id: str | None = None
    # created, in_progress, completed, incomplete: the response as it stands.
    response: Response | None = None
    # output_item.added / output_item.done of a function_call item.
    function_call: FunctionCall | None = None
    # output_text.delta, with include OUTPUT_TEXT_LOGPROBS: its tokens'.
    logprobs: list[TokenLogprob] = field(default_factory=list)


def _token_logprobs(entries: struct_pb2.ListValue) -> list[TokenLogprob]:
    """Entries {"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", ...}]}."""
    logprobs = []
    for entry in entries.values:
        fields = entry.struct_value.fields
        tops = (top.struct_value.fields for top in fields["top_logprobs"].list_value.values)
        logprobs.append(TokenLogprob(
            token=fields["token"].string_value, logprob=fields["logprob"].number_value,
            top_logprobs={top["token"].string_value: top["logprob"].number_value
                          for top in tops}))
    return logprobs


def _function_call(item: pb.ResponseOutputItem) -> FunctionCall:
    return FunctionCall(call_id=item.call_id, name=item.name, arguments=item.arguments)


def _parts(items: Sequence[pb.ResponseOutputItem], item_type: str,
           part_type: str) -> list[pb.ResponseContentPart]:
    """The ``part_type`` parts of the ``item_type`` items, in output order."""
    return [part for item in items if item.type == item_type
            for part in item.content if part.type == part_type]


def response_from_pb(response: pb.Response) -> Response:
    output = list(response.output)
    texts = _parts(output, "message", "output_text")
    has_reasoning = any(item.type == "reasoning" for item in output)
    usage = None
    if response.HasField("usage"):
        usage = ResponseUsage(
            input_tokens=response.usage.input_tokens,
            output_tokens=response.usage.output_tokens,
            total_tokens=response.usage.total_tokens,
            cached_tokens=response.usage.input_tokens_details.cached_tokens,
            reasoning_tokens=response.usage.output_tokens_details.reasoning_tokens,
        )
    return Response(
        id=response.id,
        model=response.model,
        status=response.status,
        output_text="".join(part.text for part in texts),
        reasoning=("".join(part.text for part in _parts(output, "reasoning", "reasoning_text"))
                   if has_reasoning else None),
        function_calls=[_function_call(i) for i in output if i.type == "function_call"],
        usage=usage,
        incomplete_reason=(response.incomplete_details.reason
                           if response.HasField("incomplete_details") else None),
        output_logprobs=[entry for part in texts for entry in _token_logprobs(part.logprobs)],
        stored=response.store,
        previous_response_id=(response.previous_response_id
                              if response.HasField("previous_response_id") else None),
        background=response.background,
        error=(f"{response.error.code}: {response.error.message}"
               if response.HasField("error") else None),
    )


def response_event_from_pb(event: pb.ResponseStreamEvent) -> ResponseEvent:
    carries_call = event.HasField("item") and event.item.type == "function_call"
    return ResponseEvent(
        type=event.type,
        sequence_number=event.sequence_number,
        delta=event.delta,
        text=event.text if event.HasField("text") else None,
        arguments=event.arguments if event.HasField("arguments") else None,
        output_index=event.output_index if event.HasField("output_index") else None,
        item_id=event.item_id if event.HasField("item_id") else None,
        response=response_from_pb(event.response) if event.HasField("response") else None,
        function_call=_function_call(event.item) if carries_call else None,
        logprobs=_token_logprobs(event.logprobs),
    )
