"""Hostile requests for the fuzz suite (``test_fuzz_grpc``, ``test_fuzz_http``), as hypothesis
strategies, and the statuses they may get.

Every RPC of ``tandem.v1.Generation`` and ``tandem.v1.Engine`` gets requests of three kinds:
a valid request of that RPC with some of its fields (top-level, or in its first nested
message) replaced by hostile values of the field's type (huge and odd strings, extreme
integers, NaN and infinities, deep and wide JSON, long lists); a message of random fields;
and bytes that are no such message (random bytes, a valid request with bits flipped or cut
short, invalid UTF-8 in a string). The HTTP routes Envoy serves get the same requests as
JSON, with wrong JSON types, invalid UTF-8 and bytes that are not JSON. Built from the
protos' descriptors, so a field added to a request is fuzzed without a change here.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import json_format, struct_pb2
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from protos.tandem.v1 import engine_pb2, generation_pb2

# Examples per fuzz test: a quick run in make test, a long one in make fuzz, which also
# draws them afresh each time (make test's are the same on every run: no flaky CI).
EXAMPLES = int(os.environ.get("TANDEM_FUZZ_EXAMPLES", "150"))
RANDOM = os.environ.get("TANDEM_FUZZ_RANDOM") == "1"
TIMEOUT_S = max(900, EXAMPLES * 4)
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, database=None, derandomize=not RANDOM,
    print_blob=True, suppress_health_check=[
        HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])

# What a client's mistake may be answered with (a 4xx over HTTP), or OK when the hostile
# values happened to make a request that can be served. Never UNKNOWN, INTERNAL, DATA_LOSS
# (a server bug) or UNAVAILABLE (a process down).
ACCEPTABLE_CODES = frozenset({
    grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.UNIMPLEMENTED,
})

GENERATION = generation_pb2.DESCRIPTOR.services_by_name["Generation"]
ENGINE = engine_pb2.DESCRIPTOR.services_by_name["Engine"]
MODEL = "tiny"
_HI = {"role": "user", "content": "hi"}

# A valid request of each RPC, which mutations start from (most refusals would otherwise
# come from the first check a request meets, leaving the later ones unexercised).
TEMPLATES: dict[str, dict[str, Any]] = {
    "CompletionRequest": {"model": MODEL, "prompt": "hi", "max_tokens": 4},
    "ChatCompletionRequest": {"model": MODEL, "messages": [_HI], "max_tokens": 4},
    "ResponseRequest": {"model": MODEL, "input": "hi", "max_output_tokens": 4},
    "GetResponseRequest": {"response_id": "resp_0123"},
    "CancelResponseRequest": {"response_id": "resp_0123"},
    "DeleteResponseRequest": {"response_id": "resp_0123"},
    "ListResponseInputItemsRequest": {"response_id": "resp_0123", "limit": 2},
    "ListModelsRequest": {},
    "GetModelRequest": {"model": MODEL},
    "TokenizeRequest": {"model": MODEL, "prompt": "hi"},
    "DetokenizeRequest": {"model": MODEL, "tokens": [5, 6]},
    "LoadLoraAdapterRequest": {"lora_name": "fuzz", "lora_path": "/nonexistent"},
    "UnloadLoraAdapterRequest": {"lora_name": "fuzz"},
    "GenerateRequest": {"request_id": "fuzz-generate", "prompt_token_ids": [5, 6, 7],
                        "sampling_params": {"max_tokens": 4}},
    "PrefillRequest": {"request_id": "fuzz-prefill", "prompt_token_ids": [5, 6, 7],
                       "sampling_params": {"max_tokens": 1}},
    "ReleaseKvRequest": {"request_id": "fuzz-prefill"},
    "AbortRequest": {"request_ids": ["fuzz-generate"]},
    "GetLoadRequest": {},
    "WatchLoadRequest": {"min_interval_s": 0.05, "heartbeat_s": 0.5},
    "WatchKvEventsRequest": {"since_seq": 0},
    "GetInfoRequest": {},
    "LoadLoraRequest": {"lora_name": "fuzz", "lora_path": "/nonexistent"},
    "UnloadLoraRequest": {"lora_name": "fuzz"},
}

# Fields a fuzzer must not aim anywhere it likes: a prefill peer is dialed (the suite's own
# checks on it are tested elsewhere); hostile values of it are garbage or closed ports here.
_PEERS = ["", "nonsense", "x" * 300, "127.0.0.1:1", "[::1]:1", "127.0.0.1:99999", ":",
          "a:b:c"]

_INT_LIMITS = {
    FieldDescriptor.TYPE_INT32: (-2**31, 2**31 - 1), FieldDescriptor.TYPE_SINT32: (-2**31, 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-2**31, 2**31 - 1), FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1), FieldDescriptor.TYPE_INT64: (-2**63, 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-2**63, 2**63 - 1), FieldDescriptor.TYPE_SFIXED64: (-2**63, 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1), FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
_FLOAT_TYPES = (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT)
_JSON_TYPES = ("google.protobuf.Value", "google.protobuf.Struct", "google.protobuf.ListValue")


@dataclass(frozen=True)
class Rpc:
    """One RPC: its path and how its messages travel."""

    method: MethodDescriptor

    @property
    def path(self) -> str:
        return f"/{self.method.containing_service.full_name}/{self.method.name}"

    @property
    def request_class(self) -> type[Message]:
        return GetMessageClass(self.method.input_type)

    @property
    def streams(self) -> bool:
        return bool(self.method.server_streaming)

    @property
    def endless(self) -> bool:
        """A stream that only ends when the caller leaves (KV events, load reports)."""
        return self.method.name in ("WatchKvEvents", "WatchLoad")


def rpcs(service: Any) -> list[Rpc]:
    return [Rpc(method) for method in service.methods]


# --------------------------------------------------------------------------- scalars


def hostile_text(max_huge: int = 200_000) -> st.SearchStrategy[str]:
    """Strings a field may not expect: empty, odd characters, format and path tricks, and
    huge ones (up to ``max_huge`` characters)."""
    odd = st.sampled_from([
        "", " ", "\x00", "\u202e", "\ufeff", "%s%n%x", "../../../../etc/passwd", "' OR 1=1 --",
        "{{ 7*7 }}", "${jndi:x}", "<|im_end|>", "\r\nx-header: 1", "🙂" * 50, "tiny", "resp_",
        "NaN", "-1", "null", "\\", "\"", "a" * 257])
    huge = st.integers(1_000, max_huge).flatmap(
        lambda n: st.sampled_from(["x", "é", "🙂", "<|im_start|>"]).map(lambda c: c * (n // len(c))))
    return st.one_of(odd, st.text(max_size=40), huge)


def hostile_int(field_type: int) -> st.SearchStrategy[int]:
    low, high = _INT_LIMITS.get(field_type, (-2**31, 2**31 - 1))
    return st.one_of(st.sampled_from([low, high, 0, -1, 1, 2, 16, 512, 513, 4096, 10**6]),
                     st.integers(low, high)).filter(lambda n: low <= n <= high)


def hostile_float() -> st.SearchStrategy[float]:
    return st.one_of(st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e308, -1e308,
                                      5e-324, 2.0, 100.0, 1e9]),
                     st.floats(allow_nan=True, allow_infinity=True))


# --------------------------------------------------------------------------- JSON


def hostile_json() -> st.SearchStrategy[Any]:
    """JSON-shaped values with NaN and infinities in them, very deep ones and wide ones."""
    scalars = st.one_of(st.none(), st.booleans(), hostile_float(), st.integers(-2**70, 2**70),
                        hostile_text(20_000))
    nested = st.recursive(scalars, lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
        max_leaves=12)
    deep = st.integers(20, 140).map(_deep)
    wide = st.integers(100, 80_000).map(lambda n: list(range(n)))
    return st.one_of(nested, deep, wide)


def _deep(levels: int) -> Any:
    value: Any = "bottom"
    for i in range(levels):
        value = {"a": value} if i % 2 else [value]
    return value


def to_value(obj: Any) -> struct_pb2.Value:
    """A Python JSON-like value as a protobuf Value, NaN and infinities kept (ParseDict would
    refuse them, and a client with its own encoder need not)."""
    value = struct_pb2.Value()
    stack: list[tuple[Any, struct_pb2.Value]] = [(obj, value)]
    while stack:
        item, into = stack.pop()
        if item is None:
            into.null_value = struct_pb2.NULL_VALUE
        elif isinstance(item, bool):
            into.bool_value = item
        elif isinstance(item, int | float):
            into.number_value = float(item)
        elif isinstance(item, str):
            into.string_value = item
        elif isinstance(item, list):
            into.list_value.SetInParent()
            for entry in item:
                stack.append((entry, into.list_value.values.add()))
        else:
            into.struct_value.SetInParent()
            for key, entry in item.items():
                stack.append((entry, into.struct_value.fields[key]))
    return value


# --------------------------------------------------------------------------- messages


def field_value(field: FieldDescriptor, depth: int = 0) -> st.SearchStrategy[Any]:
    """A hostile value for ``field`` (a list of them for a repeated field, a dict for a map)."""
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        key, value = (field.message_type.fields_by_name[name] for name in ("key", "value"))
        return st.one_of(
            st.dictionaries(_single(key, depth), _single(value, depth), max_size=4),
            st.integers(17, 3000).map(lambda n: {_key(key, i): _small(value)
                                                  for i in range(n)}))
    if field.is_repeated:
        # Long lists of small entries: a long list of huge ones is only a message too big.
        return st.one_of(st.lists(_single(field, depth), max_size=4),
                         st.integers(65, 5000).map(lambda n: [_small(field)] * n))
    return _single(field, depth)


def _key(field: FieldDescriptor, i: int) -> Any:
    return str(i) if field.type == FieldDescriptor.TYPE_STRING else i


def _small(field: FieldDescriptor) -> Any:
    """A short value of ``field``'s type."""
    if field.message_type is not None:
        if field.message_type.full_name in _JSON_TYPES:
            return _json_message(1, field.message_type.full_name)
        return GetMessageClass(field.message_type)()
    if field.type == FieldDescriptor.TYPE_STRING:
        return "s"
    if field.type == FieldDescriptor.TYPE_BYTES:
        return b"s"
    if field.type == FieldDescriptor.TYPE_BOOL:
        return True
    if field.type in _FLOAT_TYPES:
        return 1.0
    if field.type == FieldDescriptor.TYPE_ENUM:
        return field.enum_type.values[0].number
    return 1


def _single(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if field.name == "prefill_peer":
        return st.sampled_from(_PEERS)
    if field.message_type is not None:
        if field.message_type.full_name in _JSON_TYPES:
            return hostile_json().map(lambda obj, kind=field.message_type.full_name:
                                      _json_message(obj, kind))
        if depth >= 2:
            return st.just(GetMessageClass(field.message_type)())
        return random_message(field.message_type, depth + 1)
    if field.type == FieldDescriptor.TYPE_STRING:
        return hostile_text()
    if field.type == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if field.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if field.type in _FLOAT_TYPES:
        return hostile_float()
    if field.type == FieldDescriptor.TYPE_ENUM:
        return st.sampled_from([v.number for v in field.enum_type.values])
    return hostile_int(field.type)


def _json_message(obj: Any, kind: str) -> Message:
    value = to_value(obj)
    if kind == "google.protobuf.Value":
        return value
    if kind == "google.protobuf.Struct":
        return value.struct_value if value.WhichOneof("kind") == "struct_value" else \
            to_value({"k": obj}).struct_value
    return value.list_value if value.WhichOneof("kind") == "list_value" else \
        to_value([obj]).list_value


def random_message(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    """A message of ``descriptor``'s type with a random subset of its fields set hostile."""
    optional = {field.name: st.deferred(lambda f=field: field_value(f, depth))
                for field in descriptor.fields}
    return st.fixed_dictionaries({}, optional=optional).map(
        lambda values: _build(descriptor, values))


def _build(descriptor: Descriptor, values: dict[str, Any]) -> Message:
    message = GetMessageClass(descriptor)()
    for name, value in values.items():
        set_field(message, descriptor.fields_by_name[name], value)
    return message


def set_field(message: Message, field: FieldDescriptor, value: Any) -> None:
    """Set ``field`` of ``message`` to ``value`` (replacing what it held); a value protobuf
    itself refuses (a lone surrogate) leaves the field as it was."""
    try:
        message.ClearField(field.name)
        target = getattr(message, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            for key, item in value.items():
                if value_field.message_type is not None:
                    target[key].CopyFrom(item)
                else:
                    target[key] = item
        elif field.is_repeated and field.message_type is not None:
            for item in value:
                target.add().CopyFrom(item)
        elif field.is_repeated:
            target.extend(value)
        elif field.message_type is not None:
            target.CopyFrom(value)
        else:
            setattr(message, field.name, value)
    except (ValueError, TypeError, UnicodeEncodeError):
        message.ClearField(field.name)


def template(rpc: Rpc) -> Message:
    request = rpc.request_class()
    json_format.ParseDict(TEMPLATES[rpc.method.input_type.name], request)
    return request


def mutated(rpc: Rpc) -> st.SearchStrategy[Message]:
    """The RPC's valid template with one to three fields replaced by hostile values; a field
    of the template's nested messages (``messages[0]``, ``sampling_params``) is one too."""
    descriptor = rpc.method.input_type
    targets: list[tuple[str | None, FieldDescriptor]] = [(None, f) for f in descriptor.fields]
    base = template(rpc)
    for field, _ in base.ListFields():
        if field.message_type is not None and field.message_type.full_name not in _JSON_TYPES \
                and not field.message_type.GetOptions().map_entry:
            targets += [(field.name, f) for f in field.message_type.fields]
    if not targets:
        return st.just(base)

    def apply(choices: list[tuple[tuple[str | None, FieldDescriptor], Any]]) -> Message:
        request = template(rpc)
        for (parent, field), value in choices:
            set_field(request if parent is None else _child(request, parent), field, value)
        return request

    one = st.sampled_from(targets).flatmap(
        lambda target: field_value(target[1]).map(lambda value: (target, value)))
    return st.lists(one, min_size=1, max_size=3).map(apply)


def _child(request: Message, name: str) -> Message:
    """The nested message ``name`` of ``request`` (the first, for a repeated field)."""
    owner = getattr(request, name)
    if isinstance(owner, Message):
        return owner
    return owner[0] if len(owner) else owner.add()


def hostile_bytes(rpc: Rpc) -> st.SearchStrategy[bytes]:
    """Bytes that are not the RPC's request: random, a valid one with bits flipped or cut
    short, or with invalid UTF-8 in a string field."""
    valid = template(rpc).SerializeToString()
    flipped = st.lists(st.integers(0, max(0, len(valid) * 8 - 1)), min_size=1, max_size=4).map(
        lambda bits: _flip(valid, bits))
    cut = st.integers(0, max(0, len(valid) - 1)).map(lambda n: valid[:n])
    return st.one_of(st.binary(min_size=1, max_size=300), flipped, cut,
                     st.just(_bad_utf8(rpc)), st.just(b"\xff" * 20),
                     st.just(b"\x0a\xff\xff\xff\xff\x0f"))


def _flip(data: bytes, bits: list[int]) -> bytes:
    out = bytearray(data)
    for bit in bits:
        if out:
            out[bit // 8 % len(out)] ^= 1 << (bit % 8)
    return bytes(out)


def _bad_utf8(rpc: Rpc) -> bytes:
    """The template with its first string field's text replaced by an invalid UTF-8 pair."""
    request = template(rpc)
    for field in rpc.method.input_type.fields:
        if field.type == FieldDescriptor.TYPE_STRING and not field.is_repeated:
            setattr(request, field.name, "ZQ")
            return request.SerializeToString().replace(b"ZQ", b"\xc3\x28", 1)
    return b"\x0a\x02\xc3\x28"


def targeted(rpc: Rpc) -> st.SearchStrategy[Message]:
    """The RPC's template with one of its JSON fields made very deep, wide or NaN, or one of
    its string fields 100,000 characters long: the known ways past a limit, drawn often."""
    base = template(rpc)
    targets = [(None, f) for f in rpc.method.input_type.fields]
    for field, _ in base.ListFields():
        if field.message_type is not None and field.message_type.full_name not in _JSON_TYPES \
                and not field.message_type.GetOptions().map_entry:
            targets += [(field.name, f) for f in field.message_type.fields]
    json_fields = [t for t in targets if t[1].message_type is not None
                   and t[1].message_type.full_name in _JSON_TYPES]
    string_fields = [t for t in targets if t[1].type == FieldDescriptor.TYPE_STRING]
    bombs = st.one_of(st.integers(31, 60).map(_deep), st.just([math.nan]),
                      st.just({"x": [1, math.inf]}), st.just(list(range(70_000))))
    choices = []
    if json_fields:
        choices.append(st.tuples(st.sampled_from(json_fields), bombs).map(
            lambda pair: (pair[0], _json_message(pair[1], pair[0][1].message_type.full_name)
                          if not pair[0][1].is_repeated else
                          [_json_message(pair[1], pair[0][1].message_type.full_name)])))
    if string_fields:
        choices.append(st.sampled_from(string_fields).map(
            lambda target: (target, ["y" * 100_000] if target[1].is_repeated
                            else "y" * 100_000)))
    if not choices:
        return st.just(base)

    def apply(choice: tuple[tuple[str | None, FieldDescriptor], Any]) -> Message:
        (parent, field), value = choice
        request = template(rpc)
        set_field(request if parent is None else _child(request, parent), field, value)
        return request

    return st.one_of(*choices).map(apply)


def requests(rpc: Rpc) -> st.SearchStrategy[bytes]:
    """Every kind of hostile request for ``rpc``, as the bytes sent."""
    messages = st.one_of(mutated(rpc), mutated(rpc), targeted(rpc),
                         random_message(rpc.method.input_type))
    return st.one_of(messages.map(lambda m: m.SerializeToString()), hostile_bytes(rpc))


def as_json(message: Message) -> Any:
    """A request as the JSON body an HTTP client sends (NaN and infinities as JSON can't
    say them: the strings a JSON encoder of another language might write)."""
    return json_format.MessageToDict(_finite(message), preserving_proto_field_name=True)


def _finite(message: Message) -> Message:
    copy = type(message)()
    copy.CopyFrom(message)
    _replace_non_finite(copy)
    return copy


def _replace_non_finite(message: Message) -> None:
    for field, value in message.ListFields():
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            for key in list(value):
                if value_field.message_type is not None:
                    _replace_non_finite(value[key])
                elif value_field.type in _FLOAT_TYPES and not math.isfinite(value[key]):
                    value[key] = 0.0
        elif field.message_type is not None:
            for item in (value if field.is_repeated else [value]):
                _replace_non_finite(item)
        elif field.type in _FLOAT_TYPES and field.is_repeated:
            value[:] = [v if math.isfinite(v) else 0.0 for v in value]
    if message.DESCRIPTOR.full_name == "google.protobuf.Value" and \
            message.WhichOneof("kind") == "number_value" and not math.isfinite(message.number_value):  # type: ignore[attr-defined]
        message.string_value = "NaN"  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- HTTP


@dataclass(frozen=True)
class Route:
    """An HTTP route of Envoy's transcoder: its verb, its path (``{}`` where an id goes) and
    the RPC whose request its body or path fills."""

    verb: str
    path: str
    rpc: Rpc
    id_field: str | None = None


def http_routes() -> list[Route]:
    by_name = {rpc.method.name: rpc for rpc in rpcs(GENERATION)}
    return [
        Route("POST", "/v1/completions", by_name["Complete"]),
        Route("POST", "/v1/chat/completions", by_name["ChatComplete"]),
        Route("POST", "/v1/responses", by_name["CreateResponse"]),
        Route("GET", "/v1/responses/{}", by_name["GetResponse"], "response_id"),
        Route("POST", "/v1/responses/{}/cancel", by_name["CancelResponse"], "response_id"),
        Route("DELETE", "/v1/responses/{}", by_name["DeleteResponse"], "response_id"),
        Route("GET", "/v1/responses/{}/input_items", by_name["ListResponseInputItems"],
              "response_id"),
        Route("GET", "/v1/models", by_name["ListModels"]),
        Route("GET", "/v1/models/{}", by_name["GetModel"], "model"),
        Route("POST", "/tokenize", by_name["Tokenize"]),
        Route("POST", "/detokenize", by_name["Detokenize"]),
        Route("POST", "/v1/load_lora_adapter", by_name["LoadLoraAdapter"]),
        Route("POST", "/v1/unload_lora_adapter", by_name["UnloadLoraAdapter"]),
    ]


def _wrong_types(body: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """``body`` with one field given a JSON value of another type (or a hostile one)."""
    if not body:
        return st.just(body)
    replacement = st.one_of(hostile_json(), st.sampled_from(
        [None, True, "text", 1.5, -1, 2**64, [], {}, [[]], {"a": {}}, "NaN", "Infinity"]))
    return st.tuples(st.sampled_from(sorted(body)), replacement).map(
        lambda pair: {**body, pair[0]: pair[1]})


def http_bodies(route: Route) -> st.SearchStrategy[bytes]:
    """Request bodies for a route: hostile requests as JSON, wrong JSON types, invalid UTF-8
    in a JSON string, deep nesting, and bytes that are no JSON."""
    as_dict = st.one_of(mutated(route.rpc), targeted(route.rpc)).map(as_json)
    base = TEMPLATES[route.rpc.method.input_type.name]
    encoded = st.one_of(as_dict, as_dict.flatmap(_wrong_types), _wrong_types(base),
                        st.just({**base, "stream": True})).map(
        lambda body: json.dumps(body, allow_nan=True).encode())
    raw = st.one_of(st.binary(max_size=300), st.just(b""), st.just(b"{"), st.just(b"[]"),
                    st.just(b"null"), st.just(b'{"model": "\xff\xfe"}'),
                    st.just(json.dumps(base).encode().replace(b"hi", b"h\xc3\x28", 1)),
                    st.integers(30, 3000).map(lambda n: b"[" * n + b"]" * n),
                    st.integers(30, 3000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n))
    return st.one_of(encoded, encoded, raw)


def http_ids() -> st.SearchStrategy[str]:
    """Path ids: odd, encoded and long (below the URL limits the edge enforces)."""
    return st.one_of(hostile_text(2_000).map(lambda s: s[:2_000]),
                     st.sampled_from(["resp_0123", MODEL, "..", "%00", "%ff%fe", "a/b/c",
                                      "%2F%2F", "?x=1", "#frag"]))

