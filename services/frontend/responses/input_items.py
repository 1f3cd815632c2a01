"""OpenAI's list of a stored response's input items: ``GET /v1/responses/{id}/input_items``.

Owns the items as they are listed, and one page of them:

- ``identified``: a request's input items as they are stored and listed, each with an id
  (``msg_...``, ``fc_...``, ``fco_...``, ``rs_...``; an item the client sent with an id keeps
  it) and in OpenAI's listed shape (a message has its ``type``, a ``status`` and its content
  as a list of parts). It runs once, when the response is stored, so that an item's id is the
  same in every listing and ``after`` can name it.
- ``output_items``: a response's output items as listed items (the JSON that ``GET
  /v1/responses/{id}`` gives them): an earlier response's output is listed in the
  conversation of the responses that continue it.
- ``ItemQuery`` and ``page``: the query (``after``, ``limit``, ``order``, ``include``)
  checked, and one page of a list in OpenAI's shape (``first_id``, ``last_id``,
  ``has_more``).

Which items a response lists (its conversation's, then its own) is ``response_store``'s; the
RPC is ``generation_servicer``'s. Items reach ``identified`` already checked by
``responses_api.chat_request``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf import struct_pb2
from google.protobuf.json_format import MessageToDict, ParseDict

from protos.tandem.v1 import generation_pb2 as pb
from services.frontend.errors import InvalidArgument

DEFAULT_LIMIT = 20
MAX_LIMIT = 100
# OpenAI's default order: the newest items first.
DEFAULT_ORDER = "desc"
_ORDERS = ("asc", "desc")
# The include value that keeps the output text's logprobs in listed assistant messages.
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# OpenAI's ResponseIncludable values; the others name items Tandem never makes (searches,
# images, code interpreter outputs, encrypted reasoning), so they have nothing to add.
_INCLUDABLE = frozenset({
    "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
    "message.input_image.image_url", "computer_call_output.output.image_url",
    "code_interpreter_call.outputs", "reasoning.encrypted_content", LOGPROBS_INCLUDE})
# The prefixes of the ids given to items sent without one, per item type (those the
# Responses API accepts as input: ``responses_api``).
_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                "reasoning": "rs"}


def identified(items: Iterable[struct_pb2.Value],
               taken: Iterable[str] = ()) -> list[struct_pb2.Value]:
    """Copies of a request's input ``items`` as they are listed: each with an id, messages
    in OpenAI's shape (``{"type": "message", "role", "content": [parts], "status"}``, a
    string content as one ``input_text`` part, ``output_text`` for the assistant's), calls
    and their outputs with a ``status``. ``taken``: the ids of the items listed before
    them (the conversation they continue)."""
    seen = set(taken)
    listed = []
    for value in items:
        item = struct_pb2.Value()
        item.CopyFrom(value)
        fields = item.struct_value
        item_type = str(_field(fields, "type") or "message")
        fields["type"] = item_type
        content = _field(fields, "content")
        if item_type == "message" and isinstance(content, str):
            assistant = _field(fields, "role") == "assistant"
            part: dict[str, Any] = {"type": "output_text" if assistant else "input_text",
                                    "text": content}
            if assistant:
                part["annotations"] = []
            fields["content"] = [part]
        if item_type != "reasoning" and "status" not in fields:
            fields["status"] = "completed"
        item_id = _field(fields, "id")
        # A second item with the same id would make ``after`` ambiguous, and a pager that
        # follows last_id could go round in circles: it gets an id of its own. (OpenAI
        # refuses such a request; Tandem has always served it, and still does.)
        if not isinstance(item_id, str) or not item_id or item_id in seen:
            item_id = f"{_ID_PREFIXES.get(item_type, 'item')}_{uuid.uuid4().hex}"
            fields["id"] = item_id
        seen.add(item_id)
        listed.append(item)
    return listed


def _field(fields: struct_pb2.Struct, key: str) -> object:
    """``fields[key]`` as a Python value, None if absent (indexing a Struct adds the key)."""
    return fields[key] if key in fields else None


def output_items(output: Sequence[pb.ResponseOutputItem]) -> list[struct_pb2.Value]:
    """A response's output items as listed items, in the JSON the HTTP edge gives them
    (field names as in the proto, empty lists and strings included)."""
    return [ParseDict(MessageToDict(item, preserving_proto_field_name=True,
                                    always_print_fields_with_no_presence=True),
                      struct_pb2.Value())
            for item in output]


def item_id(item: struct_pb2.Value) -> str:
    """The id of a listed item (``identified`` or ``output_items`` gave it one)."""
    return item.struct_value.fields["id"].string_value


@dataclass(frozen=True)
class ItemQuery:
    """A checked ``ListResponseInputItemsRequest``: the page after ``after`` (an item id;
    "" from the first) in ``order``, at most ``limit`` items."""

    after: str = ""
    limit: int = DEFAULT_LIMIT
    order: str = DEFAULT_ORDER
    logprobs: bool = False  # keep the output text's logprobs

    @classmethod
    def of(cls, request: pb.ListResponseInputItemsRequest) -> ItemQuery:
        """The request's query; raises InvalidArgument naming the parameter it cannot
        serve."""
        limit = request.limit if request.HasField("limit") else DEFAULT_LIMIT
        if not 1 <= limit <= MAX_LIMIT:
            raise InvalidArgument(f"limit must be between 1 and {MAX_LIMIT} (default "
                                  f"{DEFAULT_LIMIT}); got {limit}")
        order = request.order or DEFAULT_ORDER
        if order not in _ORDERS:
            raise InvalidArgument('order must be "asc" (oldest first) or "desc" (newest '
                                  f"first, the default); got {request.order!r}")
        return cls(after=request.after, limit=limit, order=order,
                   logprobs=includes_logprobs(request.include))


def includes_logprobs(include: Sequence[str]) -> bool:
    """Whether ``include`` (a query's, OpenAI's values) asks for the output text's logprobs;
    raises InvalidArgument naming a value OpenAI does not define."""
    unknown = [value for value in include if value not in _INCLUDABLE]
    if unknown:
        raise InvalidArgument(f"include has {', '.join(map(repr, unknown))}, which OpenAI "
                              f"does not define; its values are "
                              f"{', '.join(sorted(_INCLUDABLE))}")
    return LOGPROBS_INCLUDE in include


def page(items: Sequence[struct_pb2.Value], query: ItemQuery,
         response_id: str) -> pb.ResponseItemList:
    """One page of ``items`` (the response's listed items, oldest first) for ``query``;
    raises InvalidArgument when ``after`` is none of them."""
    ordered = list(items) if query.order == "asc" else list(reversed(items))
    start = 0
    if query.after:
        ids = [item_id(item) for item in ordered]
        if query.after not in ids:
            # Not NOT_FOUND: the response is there, the cursor is what is wrong (an id of
            # another response's items, or mistyped); clients read a 404 as "no such
            # response".
            raise InvalidArgument(f"after {query.after!r} is not an item of response "
                                  f"{response_id!r}: pass the id of one of its items (a "
                                  "page's last_id), or leave after out to start from the "
                                  "first")
        start = ids.index(query.after) + 1
    chosen = ordered[start:start + query.limit]
    listing = pb.ResponseItemList(object="list",
                                  has_more=start + query.limit < len(ordered))
    for item in chosen:
        listing.data.append(item if query.logprobs else _without_logprobs(item))
    if chosen:
        listing.first_id, listing.last_id = item_id(chosen[0]), item_id(chosen[-1])
    return listing


def _without_logprobs(item: struct_pb2.Value) -> struct_pb2.Value:
    """``item`` without its text parts' logprobs (OpenAI lists them only when include asks);
    ``item`` itself when it has none, so that the stored items stay as they were."""
    content = item.struct_value.fields.get("content")
    if content is None or not any(
            "logprobs" in part.struct_value.fields for part in content.list_value.values):
        return item
    copy = struct_pb2.Value()
    copy.CopyFrom(item)
    for part in copy.struct_value.fields["content"].list_value.values:
        if "logprobs" in part.struct_value.fields:
            del part.struct_value.fields["logprobs"]
    return copy
