"""The Responses API's stored responses: what ``previous_response_id``, ``GET`` and ``DELETE
/v1/responses/{id}`` read.

Owns keeping the latest responses a server answered with ``store`` true (the default, as
OpenAI's), each with its own input items and the id of the response it continued, in memory
and bounded (the oldest go first), and rebuilding a conversation from a chain of them: each
response's input, then its output as input items (``responses_api.output_as_input``). The
instructions of earlier responses are not carried, as OpenAI documents. It does not own
translating requests and responses (``responses_api``) or the RPCs
(``generation_servicer``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from google.protobuf import struct_pb2

from protos.tandem.v1 import generation_pb2 as pb
from services.replica.errors import NotFound
from services.replica.responses_api import output_as_input

DEFAULT_MAX_STORED_RESPONSES = 1024
STORE_HELP = ("Responses API responses kept in memory (the latest N) for previous_response_id "
              "and GET /v1/responses/{id}, unless a request says store false; 0 keeps none "
              "(default: %(default)s)")


@dataclass(frozen=True)
class StoredResponse:
    response: pb.Response
    # The request's own input items (a string input as one user message).
    input_items: list[struct_pb2.Value]
    previous_response_id: str = ""


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
            chain.append(stored)
            response_id = stored.previous_response_id
        items: list[struct_pb2.Value] = []
        for stored in reversed(chain):
            items.extend(stored.input_items)
            items.extend(output_as_input(stored.response.output))
        return items
