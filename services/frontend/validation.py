"""Checks on the shape of incoming requests, before any tokenization or engine work.

Owns the limits a request must fit (message size, prompt characters, a seed that leaves room
for ``n`` choices), the decoding of the loosely typed ``google.protobuf.Value`` fields
(``prompt``, ``stop``, chat ``content``) and of the output constraints (``response_format``,
``structured_outputs``) into what the engine takes.
Every failure is an ``InvalidArgument`` whose message names the field and says what to change.
It does not own sampling-value ranges (``SamplingParams.validate``) or the checks that need
token ids (``InputProcessor.validate_prompt``: empty, out of vocabulary, over the context).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

from google.protobuf import json_format, struct_pb2

from engine_common.structured_output.spec import StructuredOutputError, StructuredOutputSpec
from protos.tandem.v1 import generation_pb2 as pb
from services.frontend.errors import InvalidArgument, quoted
from services.frontend.request_limits import (
    GRAMMAR_CHARS,
    MAX_STOP_STRINGS,
    SCHEMA_CHARS,
    STOP_CHARS,
)

# gRPC's receive limit for one request message; a bigger one fails with RESOURCE_EXHAUSTED
# before any handler runs.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# The wire type of a seed (int64): choice i samples with seed + i, which must still fit.
MAX_SEED = 2**63 - 1
# No tokenizer's tokens average this many characters, so a text longer than
# max_model_len * MAX_CHARS_PER_TOKEN cannot fit the context: reject it without spending
# the event loop's time on tokenizing it.
MAX_CHARS_PER_TOKEN = 64
# Prompts one completion request may carry (each prompt's n choices run side by side).
MAX_PROMPTS = 128


def prompts_from_value(value: struct_pb2.Value | None,
                       field: str = "prompt") -> list[str | list[int]]:
    """A completion's prompts, as OpenAI takes them: a string, a list of token ids, or a list
    of either (several prompts, each answered by its own choices)."""
    if value is None or value.WhichOneof("kind") in (None, "null_value"):
        raise InvalidArgument(f"{field} is required: give a string or a list of token ids")
    kind = value.WhichOneof("kind")
    if kind != "list_value":
        return [_one_prompt(value, field)]
    items = list(value.list_value.values)
    if not items:
        raise InvalidArgument(f"{field} is empty")
    kinds = {item.WhichOneof("kind") for item in items}
    if kinds == {"number_value"}:
        return [_token_ids(items, field)]
    if kinds == {"string_value"} or kinds == {"list_value"}:
        if len(items) > MAX_PROMPTS:
            raise InvalidArgument(f"{field} holds {len(items)} prompts; send at most "
                                  f"{MAX_PROMPTS} per request")
        return [_one_prompt(item, f"{field}[{i}]") for i, item in enumerate(items)]
    raise InvalidArgument(f"{field} must be a string, a list of token ids, or a list of "
                          "either (not a mix)")


def _one_prompt(value: struct_pb2.Value, field: str) -> str | list[int]:
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        if not value.string_value:
            raise InvalidArgument(f"{field} is empty")
        return value.string_value
    if kind != "list_value":
        raise InvalidArgument(f"{field} must be a string or a list of token ids, got a {kind}")
    items = list(value.list_value.values)
    if not items:
        raise InvalidArgument(f"{field} is empty")
    if {item.WhichOneof("kind") for item in items} != {"number_value"}:
        raise InvalidArgument(f"{field} must be a list of token ids")
    return _token_ids(items, field)


def _token_ids(items: Iterable[struct_pb2.Value], field: str) -> list[int]:
    ids = []
    for i, item in enumerate(items):
        number = item.number_value
        if not math.isfinite(number) or number != int(number) or number < 0:
            raise InvalidArgument(f"{field}[{i}] must be a non-negative integer token id, "
                                  f"got {quoted(number, 32)}")
        ids.append(int(number))
    return ids


def stop_from_value(value: struct_pb2.Value | None) -> list[str]:
    """``stop``: unset, null, a string or a list of strings (at most ``MAX_STOP_STRINGS`` of
    at most ``STOP_CHARS`` characters: the detokenizer looks for each after every token)."""
    if value is None or value.WhichOneof("kind") in (None, "null_value"):
        return []
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        _check_stop(value.string_value, "stop")
        return [value.string_value] if value.string_value else []
    if kind == "list_value":
        items = value.list_value.values
        if len(items) > MAX_STOP_STRINGS:
            raise InvalidArgument(f"stop holds {len(items):,} strings; at most "
                                  f"{MAX_STOP_STRINGS} are allowed")
        stops = []
        for i, item in enumerate(items):
            if item.WhichOneof("kind") != "string_value" or not item.string_value:
                raise InvalidArgument(f"stop[{i}] must be a non-empty string")
            _check_stop(item.string_value, f"stop[{i}]")
            stops.append(item.string_value)
        return stops
    raise InvalidArgument(f"stop must be a string or a list of strings, got a {kind}")


def _check_stop(text: str, field: str) -> None:
    if len(text) > STOP_CHARS:
        raise InvalidArgument(f"{field} is {len(text):,} characters long; a stop string may "
                              f"have at most {STOP_CHARS:,}")


def content_from_value(value: struct_pb2.Value, field: str) -> str:
    """A chat message's ``content``: unset, null, a string, or a list of text parts
    (``{"type": "text", "text": ...}``) whose texts are joined with newlines, as vLLM joins
    them. Other parts (images, audio) are for multimodal models, which Tandem does not serve."""
    kind = value.WhichOneof("kind")
    if kind in (None, "null_value"):
        return ""
    if kind == "string_value":
        return value.string_value
    if kind != "list_value":
        raise InvalidArgument(f"{field} must be a string or a list of content parts, got a {kind}")
    texts = []
    for i, item in enumerate(value.list_value.values):
        part = item.struct_value.fields if item.WhichOneof("kind") == "struct_value" else None
        if part is None or "type" not in part:
            raise InvalidArgument(f'{field}[{i}] must be an object like {{"type": "text", '
                                  f'"text": "..."}}')
        part_type = part["type"].string_value
        if part_type != "text":
            raise InvalidArgument(f"{field}[{i}] has type {quoted(part_type)}; this model reads text "
                                  f'only, so every part must have type "text"')
        if "text" not in part or part["text"].WhichOneof("kind") != "string_value":
            raise InvalidArgument(f'{field}[{i}] needs a string "text"')
        texts.append(part["text"].string_value)
    return "\n".join(texts)


def structured_output_from_request(
    response_format: pb.ResponseFormat, structured_outputs: pb.StructuredOutputs,
) -> StructuredOutputSpec | None:
    """OpenAI's ``response_format`` or vLLM's ``structured_outputs`` (at most one constraint
    in all) as the engine's spec, or None for unconstrained text."""
    found: list[tuple[str, str]] = []
    kind = response_format.type
    if kind == "json_object":
        found.append(("json_object", ""))
    elif kind == "json_schema":
        if not response_format.json_schema.HasField("schema"):
            raise InvalidArgument('response_format of type "json_schema" needs '
                                  "json_schema.schema")
        found.append(("json_schema", _schema_text(response_format.json_schema.schema)))
    elif kind not in ("", "text"):
        raise InvalidArgument(f"response_format.type must be text, json_object or json_schema; "
                              f"got {quoted(kind)}")
    wanted = structured_outputs
    if wanted.HasField("json"):
        json_kind = wanted.json.WhichOneof("kind")
        if json_kind == "string_value":
            found.append(("json_schema", wanted.json.string_value))
        elif json_kind == "struct_value":
            found.append(("json_schema", _schema_text(wanted.json.struct_value)))
        else:
            raise InvalidArgument("structured_outputs.json must be a JSON schema (an object)")
    if wanted.regex:
        found.append(("regex", wanted.regex))
    if wanted.choice:
        found.append(("choice", json.dumps(list(wanted.choice))))
    if wanted.grammar:
        found.append(("grammar", wanted.grammar))
    if len(found) > 1:
        raise InvalidArgument("give one output constraint: response_format json_object or "
                              "json_schema, or one of structured_outputs' json, regex, choice "
                              "and grammar")
    if not found:
        return None
    check_constraint_size(*found[0])
    try:
        return StructuredOutputSpec.parse(*found[0])
    except StructuredOutputError as error:
        raise InvalidArgument(str(error)) from error


def check_constraint_size(kind: str, text: str) -> None:
    """An output constraint no bigger than compiles in a moment (see ``request_limits``):
    a JSON schema of at most ``SCHEMA_CHARS`` characters as JSON, choices of at most
    ``GRAMMAR_CHARS`` in all (a regex or grammar is held to that by the request guard)."""
    limit, what = (SCHEMA_CHARS, "the JSON schema the output must follow") \
        if kind == "json_schema" else (GRAMMAR_CHARS, f"the output's {kind} constraint")
    if len(text) > limit:
        raise InvalidArgument(f"{what} is {len(text):,} characters long (as JSON); at most "
                              f"{limit:,} are allowed: it is compiled before the request runs")


def _schema_text(schema: struct_pb2.Struct) -> str:
    return json.dumps(struct_to_dict(schema))


def struct_to_dict(struct: struct_pb2.Struct) -> dict[str, Any]:
    """A JSON schema sent as a Struct (a JSON object in a request), as a dict in a canonical
    key order. A Struct is a map, whose order no transport keeps (Envoy's transcoder and the
    gRPC SDK deliver the same object's keys in different orders), yet the order matters: the
    grammar emits an object's properties in schema order, and the chat template prints the
    schema. So keys are sorted, except that a ``properties`` object lists the names in its
    sibling ``required`` first, in that list's order (lists keep theirs), as the author most
    likely meant them. Struct also holds every number as a double: integral ones go back to
    integers, as the client wrote them ("maxLength": 5, not 5.0)."""
    def canonical(value: Any) -> Any:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, list):
            return [canonical(item) for item in value]
        if not isinstance(value, dict):
            return value
        ordered = {key: canonical(value[key]) for key in sorted(value)}
        properties, required = ordered.get("properties"), ordered.get("required")
        if isinstance(properties, dict) and isinstance(required, list):
            first = [name for name in required if name in properties]
            ordered["properties"] = {name: properties[name]
                                     for name in [*first, *sorted(set(properties) - set(first))]}
        return ordered

    return dict(canonical(json_format.MessageToDict(struct)))


# How a rendered chat is named when it is too long: its messages are checked on their own
# first, so what made it long is the rest (tool definitions, the template's text).
RENDERED_CHAT = "the chat as rendered by the template (messages, tools and all)"


def check_text_length(num_chars: int, max_model_len: int, field: str) -> None:
    """A text that will be tokenized on the event loop every stream shares: one far longer
    than the context would hold it there for seconds (4 MB: ~3-10 s), so it is refused by
    its length first."""
    if num_chars > max_model_len * MAX_CHARS_PER_TOKEN:
        raise InvalidArgument(
            f"{field} is {num_chars} characters long, far more than fits this model's context "
            f"of {max_model_len} tokens; shorten it")


def check_seed_for_choices(seed: int | None, n: int) -> None:
    """Choice i of a seeded request samples with ``seed + i`` (vLLM's rule): the last one must
    still be a valid seed."""
    if seed is not None and seed + n - 1 > MAX_SEED:
        raise InvalidArgument(
            f"seed {seed} leaves no room for n={n} choices (choice i samples with seed + i, "
            f"which must not exceed {MAX_SEED}); use a seed of at most {MAX_SEED - n + 1}")


def chat_template_kwargs(request: pb.ChatCompletionRequest | pb.TokenizeRequest) -> dict[str, Any]:
    """A request's extra chat template variables (integral numbers as integers)."""
    if not request.HasField("chat_template_kwargs"):
        return {}
    return struct_to_dict(request.chat_template_kwargs)
