"""The size limits every request must fit, checked when it arrives, before any handler runs.

Owns the table of per-field limits on the requests of ``tandem.v1`` (the characters of a
name, an id or a stop string; the entries of a list; the pairs of a map), the limits on
JSON values (``google.protobuf.Value`` / ``Struct`` / ``ListValue`` fields: JSON schemas,
chat template kwargs, tool parameters, ``tool_choice``, input items, prompts): at most
``MAX_JSON_DEPTH`` levels of nesting, and only finite numbers, and ``check_request``, which
walks a decoded request against all of them. A field is named by its path in the request
(``messages[3].tool_calls[0].function.name``), with the limit it broke, in an
``InvalidArgument``; the value itself is never echoed.

What bounds a text that becomes part of the prompt (a message's content, instructions, a
tool's description) is the model's context (``validation.check_text_length``, the engine's
token count) and the message size (``validation.MAX_MESSAGE_BYTES``); those fields are listed
in ``CONTEXT_BOUNDED`` so that every string field of every request is one or the other (a
test holds the protos to that). It does not own the decoding of the loosely typed fields
(``validation``) or when a request is checked (``request_guard``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from google.protobuf import struct_pb2
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from services.frontend.errors import InvalidArgument, quoted

# JSON nesting: protobuf's decoder (upb) stops at 100 message levels, which a JSON object
# spends 3 of per level (Struct, map entry, Value); 32 levels decode wherever a JSON field
# sits in a request, and no schema or template variable a person writes comes near.
MAX_JSON_DEPTH = 32

# Characters of one name or id: a role, a type, a tool or function name, a tool call id, a
# response id, a request id, cache_salt, user, an include value...
NAME_CHARS = 256
# A model name: a served name, an alias (the model's directory, a path) or a LoRA adapter.
MODEL_CHARS = 1024
# A file system path (PATH_MAX).
PATH_CHARS = 4096
# A stop string, a choice of structured_outputs.choice.
STOP_CHARS = 1024
MAX_STOP_STRINGS = 64
# A regular expression or grammar of structured outputs, and the choices of one request
# together. Compiling one costs time superlinear in its length, and the engine core compiles
# it between two steps of every running request: bench/constraint_compile_cost.py measures
# 8x (regex, choices) to 40x (grammar) the time at 4x this length.
GRAMMAR_CHARS = 16384
# A JSON schema (response_format, structured_outputs.json, a forced tool call's
# parameters), as JSON text: compiled too (bench/constraint_compile_cost.py).
SCHEMA_CHARS = 32768
# OpenAI's limits on the Responses API's metadata.
MAX_METADATA_PAIRS = 16
METADATA_KEY_CHARS = 64
METADATA_VALUE_CHARS = 512
# Chat messages (and Responses input items): far more than any context holds (every message
# costs a few tokens of its template), few enough to render in a moment.
MAX_MESSAGES = 4096
MAX_TOOLS = 128  # OpenAI's
MAX_TOOL_CALLS = 128  # in one assistant message
MAX_INCLUDES = 16
MAX_CHOICES_LISTED = 256  # structured_outputs.choice
# Bad words are tokenized on the event loop, twice each (as written and after a space).
MAX_BAD_WORDS = 256
BAD_WORD_CHARS = 256
# Token ids the engine tests every new token against (stop_token_ids) on each step.
MAX_STOP_TOKEN_IDS = 1024
MAX_ABORTED_IDS = 1024  # Engine.Abort's request_ids
# JSON values in one request (its schemas, tool parameters, template kwargs, input items...,
# not counting the prompt): bounds the time spent reading them, on the event loop every
# stream shares.
MAX_JSON_VALUES = 65536


@dataclass(frozen=True)
class FieldLimit:
    """What one field may hold: ``chars`` per string (each entry of a repeated one, each map
    key), ``items`` entries (a repeated field's, a map's pairs), ``value_chars`` per map
    value."""

    chars: int | None = None
    items: int | None = None
    value_chars: int | None = None


_NAME = FieldLimit(chars=NAME_CHARS)

# By field name, in every request message that has the field.
FIELD_LIMITS: dict[str, FieldLimit] = {
    **{name: _NAME for name in (
        "role", "type", "name", "id", "tool_call_id", "user", "cache_salt",
        "previous_response_id", "response_id", "after", "order", "request_id", "engine_id",
        "incarnation", "kind", "prefill_peer")},
    "model": FieldLimit(chars=MODEL_CHARS),
    "lora_name": FieldLimit(chars=MODEL_CHARS),
    "lora_path": FieldLimit(chars=PATH_CHARS),
    "include": FieldLimit(chars=NAME_CHARS, items=MAX_INCLUDES),
    "request_ids": FieldLimit(chars=NAME_CHARS, items=MAX_ABORTED_IDS),
    "stop": FieldLimit(chars=STOP_CHARS, items=MAX_STOP_STRINGS),  # the Engine API's
    "bad_words": FieldLimit(chars=BAD_WORD_CHARS, items=MAX_BAD_WORDS),
    # Each bad word is banned as written and after a space: up to two sequences a word.
    "bad_words_token_ids": FieldLimit(items=2 * MAX_BAD_WORDS),
    "choice": FieldLimit(chars=STOP_CHARS, items=MAX_CHOICES_LISTED),
    "regex": FieldLimit(chars=GRAMMAR_CHARS),
    "grammar": FieldLimit(chars=GRAMMAR_CHARS),
    "stop_token_ids": FieldLimit(items=MAX_STOP_TOKEN_IDS),
    "metadata": FieldLimit(chars=METADATA_KEY_CHARS, items=MAX_METADATA_PAIRS,
                           value_chars=METADATA_VALUE_CHARS),
    "messages": FieldLimit(items=MAX_MESSAGES),
    "tools": FieldLimit(items=MAX_TOOLS),
    "tool_calls": FieldLimit(items=MAX_TOOL_CALLS),
}

# String fields bounded by the model's context and the message size instead: texts that
# become part of the prompt, and the structured output the Engine API carries as text (a
# JSON schema, which the public API sends as a Struct, bounded the same way).
CONTEXT_BOUNDED = frozenset({
    "prompt", "instructions", "description", "arguments", "reasoning", "reasoning_content",
    "value",
})

# JSON fields whose shape validation reads itself, value by value (a prompt: a string, token
# ids or a list of either); walking them here too would only double the cost of a long one.
SHAPE_CHECKED_JSON = frozenset({"prompt"})

_JSON_TYPES = frozenset({"google.protobuf.Value", "google.protobuf.Struct",
                         "google.protobuf.ListValue"})
_FLOATS = frozenset({FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT})


def check_request(request: Message) -> None:
    """Raise InvalidArgument for the first field of ``request`` over its limit (see the module
    docstring); a request within every limit passes unchanged."""
    json_budget = MAX_JSON_VALUES
    pending: list[tuple[Message, str]] = [(request, "")]
    while pending:
        message, path = pending.pop()
        for field, value in message.ListFields():
            where = f"{path}{field.name}"
            kind = field.message_type.full_name if field.message_type is not None else None
            if kind in _JSON_TYPES:
                if field.name not in SHAPE_CHECKED_JSON:
                    for item, item_path in _entries(field, value, where):
                        json_budget -= check_json(item, item_path, json_budget)
                continue
            _check_counts(field, value, where)
            if field.message_type is not None and field.message_type.GetOptions().map_entry:
                _check_map(field.message_type, value, FIELD_LIMITS.get(field.name), where)
            elif field.message_type is not None:
                pending.extend((item, f"{item_path}.")
                               for item, item_path in _entries(field, value, where))
            elif field.type == FieldDescriptor.TYPE_STRING:
                for text, item_path in _entries(field, value, where):
                    _check_chars(text, FIELD_LIMITS.get(field.name), item_path)
            elif field.type in _FLOATS and not field.is_repeated and not math.isfinite(value):
                raise InvalidArgument(f"{where} is {value}; give a finite number")


def _entries(field: FieldDescriptor, value: Any, where: str) -> Iterator[tuple[Any, str]]:
    """A field's values with their paths (``where[i]`` for a repeated field's)."""
    if not field.is_repeated:
        yield value, where
        return
    for i, item in enumerate(value):
        yield item, f"{where}[{i}]"


def _check_counts(field: FieldDescriptor, value: Any, where: str) -> None:
    limit = FIELD_LIMITS.get(field.name)
    if limit is not None and limit.items is not None and field.is_repeated:
        if len(value) > limit.items:
            raise InvalidArgument(f"{where} holds {len(value):,} entries; at most "
                                  f"{limit.items:,} are allowed")


def _check_chars(text: str, limit: FieldLimit | None, where: str,
                 chars: int | None = None) -> None:
    allowed = chars if chars is not None else (limit.chars if limit is not None else None)
    if allowed is not None and len(text) > allowed:
        raise InvalidArgument(f"{where} is {len(text):,} characters long; at most {allowed:,} "
                              "are allowed")


def _check_map(entry: Descriptor, value: Any, limit: FieldLimit | None, where: str) -> None:
    """A map's keys and values (``metadata``'s strings, ``logit_bias``'s numbers)."""
    key_field, value_field = entry.fields_by_name["key"], entry.fields_by_name["value"]
    for key, item in value.items():
        if key_field.type == FieldDescriptor.TYPE_STRING:
            _check_chars(key, limit, f"a key of {where} ({quoted(key)})")
        if value_field.type == FieldDescriptor.TYPE_STRING and limit is not None:
            _check_chars(item, limit, f"{where}[{quoted(key)}]", chars=limit.value_chars)
        elif value_field.type in _FLOATS and not math.isfinite(item):
            raise InvalidArgument(f"{where}[{key}] is {item}; give a finite number")


def check_json(value: Message, where: str, budget: int = MAX_JSON_VALUES) -> int:
    """A JSON value (a Value, Struct or ListValue): at most ``MAX_JSON_DEPTH`` levels deep and
    ``budget`` values in all, its numbers finite (JSON has no NaN or Infinity; protobuf's
    Value can hold them, and nothing downstream can print them back as JSON). Returns how
    many values it holds. Walked a level at a time: every value costs one look."""
    root = _container(value, where)
    frontier: list[Any] = [] if root is None else [root]
    count, depth = 1, 0
    while frontier:
        depth += 1
        if depth > MAX_JSON_DEPTH:
            raise InvalidArgument(f"{where} nests JSON objects and lists more than "
                                  f"{MAX_JSON_DEPTH} levels deep; flatten it")
        deeper: list[Any] = []
        for container in frontier:
            items = (container.fields.values() if isinstance(container, struct_pb2.Struct)
                     else container.values)
            count += len(items)
            if count > budget:
                raise InvalidArgument(
                    f"{where} takes the request over {MAX_JSON_VALUES:,} JSON values (in its "
                    "schemas, tool parameters, template kwargs and input items together); "
                    "send less")
            for item in items:
                kind = item.WhichOneof("kind")
                if kind == "number_value":
                    _check_finite(item.number_value, where)
                elif kind == "struct_value":
                    deeper.append(item.struct_value)
                elif kind == "list_value":
                    deeper.append(item.list_value)
        frontier = deeper
    return count


def _container(value: Message, where: str) -> Message | None:
    """The Struct or ListValue a JSON value is (None for a scalar, checked here)."""
    if not isinstance(value, struct_pb2.Value):
        return value
    kind = value.WhichOneof("kind")
    if kind == "number_value":
        _check_finite(value.number_value, where)
    return getattr(value, kind) if kind in ("struct_value", "list_value") else None


def _check_finite(number: float, where: str) -> None:
    if not math.isfinite(number):
        raise InvalidArgument(f"{where} holds NaN or Infinity, which JSON cannot express; "
                              "send finite numbers")
