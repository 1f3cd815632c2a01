"""The Responses API's stored responses: what ``previous_response_id``, ``GET`` and ``DELETE
/v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items`` read.

Owns keeping the latest responses a server answered with ``store`` true (the default, as
OpenAI's), each with its own input items, the id of the response it continued and the items
of the conversation it continued as they are listed, in memory and bounded (the oldest go
first), and rebuilding a conversation from a chain of them: each response's input, then its
output as input items (``responses_api.output_as_input``). The instructions of earlier
responses are not carried, as OpenAI documents. It does not own translating requests and
responses (``responses_api``), the listed shape of items and their pages
(``response_input_items``) or the RPCs (``generation_servicer``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from google.protobuf import struct_pb2

from protos.tandem.v1 import generation_pb2 as pb
from services.frontend.errors import InvalidArgument, NotFound
from services.frontend.responses.input_items import output_items
from services.frontend.responses.translate import output_as_input

DEFAULT_MAX_STORED_RESPONSES = 1024
# The statuses of a background response that may still change.
RUNNING_STATUSES = frozenset({"queued", "in_progress"})
STORE_HELP = ("Responses API responses kept in memory (the latest N) for previous_response_id "
              "and GET /v1/responses/{id}, unless a request says store false; 0 keeps none "
              "(default: %(default)s)")


@dataclass(frozen=True)
class StoredResponse:
    response: pb.Response
    # The request's own input items (a string input as one user message); stored as they
    # are listed, with their ids (``response_input_items.identified``).
    input_items: list[struct_pb2.Value]
    previous_response_id: str = ""
    # The conversation it continued as listed items, oldest first: each earlier response's
    # input items, then its output items. OpenAI lists them before the response's own in
    # GET /v1/responses/{id}/input_items: its list is "the items used to generate this
    # response", and its docs say a conversation's items "are prepended to input_items"
    # of the response that continues it. Taken when the request came, so a listing
    # outlives the earlier responses' eviction; the items are shared along a chain, not
    # copied.
    earlier_items: Sequence[struct_pb2.Value] = ()

    def listed_items(self) -> list[struct_pb2.Value]:
        """What GET /v1/responses/{id}/input_items lists, oldest first."""
        return [*self.earlier_items, *self.input_items]

    def conversation_items(self) -> tuple[struct_pb2.Value, ...]:
        """The listed items of its conversation so far, its own output last: the
        ``earlier_items`` of a response that continues it."""
        return (*self.earlier_items, *self.input_items, *output_items(self.response.output))


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"the response store needs room for at least one, got {capacity}")
        self.capacity = capacity
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    @classmethod
    def sized(cls, capacity: int) -> ResponseStore | None:
        """A store for ``capacity`` responses; None for 0 (keep none)."""
        if capacity < 0:
            raise ValueError(f"--max-stored-responses must be 0 or more, got {capacity}")
        return cls(capacity) if capacity else None

    def __len__(self) -> int:
        return len(self._responses)

    def put(self, stored: StoredResponse) -> None:
        self._responses[stored.response.id] = stored
        while len(self._responses) > self.capacity:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse:
        stored = self._responses.get(response_id)
        if stored is None:
            raise NotFound(f"no stored response {response_id!r}: it was created with store "
                           "false, deleted, or dropped (this server keeps the latest "
                           f"{self.capacity}; --max-stored-responses)")
        return stored

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._responses[response_id]

    def conversation(self, response_id: str) -> list[struct_pb2.Value]:
        """The input items that continue the conversation ending with ``response_id``:
        every response of the chain, oldest first, as its input then its output."""
        chain = []
        while response_id:  # a response only continues an earlier one: no cycles
            stored = self.get(response_id)
            if stored.response.status in RUNNING_STATUSES:  # a background one
                raise InvalidArgument(f"response {response_id!r} is still "
                                      f"{stored.response.status}: continue it once it has "
                                      "finished (GET /v1/responses/{id} shows its status)")
            chain.append(stored)
            response_id = stored.previous_response_id
        items: list[struct_pb2.Value] = []
        for stored in reversed(chain):
            items.extend(stored.input_items)
            items.extend(output_as_input(stored.response.output))
        return items
