"""The Responses API's stored responses: what ``previous_response_id``, ``GET`` and ``DELETE
/v1/responses/{id}`` read.

Owns keeping the latest responses a server answered with ``store`` true (the default, as
OpenAI's), each with its own input items and the id of the response it continued, in memory
and bounded (the oldest go first), and rebuilding a conversation from a chain of them: each
response's input, then its output as input items (messages as assistant messages, function
calls as function_call items; reasoning is not carried, as chat templates drop earlier
turns' thinking). The instructions of earlier responses are not carried either, as OpenAI
documents. It does not own translating requests and responses (``responses_api``) or the
RPCs (``generation_servicer``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from google.protobuf import struct_pb2
from google.protobuf.json_format import ParseDict

from protos.tandem.v1 import generation_pb2 as pb
from services.replica.errors import NotFound


@dataclass(frozen=True)
class StoredResponse:
    response: pb.Response
    # The request's own input items (a string input as one user message).
    input_items: tuple[struct_pb2.Value, ...]
    previous_response_id: str = ""


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"the response store needs room for at least one, got {capacity}")
        self.capacity = capacity
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._responses)

    def put(self, stored: StoredResponse) -> None:
        self._responses[stored.response.id] = stored
        self._responses.move_to_end(stored.response.id)
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
        seen = set()
        while response_id:
            if response_id in seen:  # ids are fresh uuids: a cycle cannot be built
                break
            seen.add(response_id)
            stored = self.get(response_id)
            chain.append(stored)
            response_id = stored.previous_response_id
        items: list[struct_pb2.Value] = []
        for stored in reversed(chain):
            items.extend(stored.input_items)
            items.extend(output_as_input(stored.response.output))
        return items


def input_items(request: pb.ResponseRequest) -> tuple[struct_pb2.Value, ...]:
    """The request's input as a list of items (a string as one user message)."""
    if request.input.WhichOneof("kind") == "string_value":
        return (ParseDict({"role": "user", "content": request.input.string_value},
                          struct_pb2.Value()),)
    return tuple(request.input.list_value.values)


def output_as_input(output: Sequence[pb.ResponseOutputItem]) -> list[struct_pb2.Value]:
    """A response's output items as the input items that replay them."""
    items = []
    for item in output:
        if item.type == "message":
            text = "".join(part.text for part in item.content)
            value = {"type": "message", "role": "assistant",
                     "content": [{"type": "output_text", "text": text}]}
        elif item.type == "function_call":
            value = {"type": "function_call", "call_id": item.call_id, "name": item.name,
                     "arguments": item.arguments}
        else:
            continue
        items.append(ParseDict(value, struct_pb2.Value()))
    return items
