"""Function calling in the chat API: OpenAI's ``tools`` and ``tool_choice``.

Owns reading ``tools`` and ``tool_choice`` into a ``ToolPlan``, the tools and earlier turns'
calls as a chat template takes them, the output constraint that makes the model's text a call
(a JSON schema, compiled and enforced like any ``response_format``), and turning the text
into ``tool_calls``. As in vLLM, a forced call is generated under a schema: a named function
(``{"type": "function", "function": {"name": ...}}``) gives its arguments object, ``required``
a JSON list of ``{"name", "parameters"}`` objects, one per call. ``auto`` (the model decides
whether to call) needs a parser of the model's own call syntax, which differs between model
families: it is served for models whose chat template uses the Hermes format (Qwen2.5,
Hermes, many others: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, vLLM's
``hermes`` parser) and refused for the others, as vLLM refuses it without a parser.

It does not own the chat template (``InputProcessor``), sampling or the response messages
(``openai_api``).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from google.protobuf import json_format

from engine_common.structured_output.spec import StructuredOutputSpec
from protos.tandem.v1 import generation_pb2 as pb
from services.replica.errors import InvalidArgument
from services.replica.streamed_tags import partial_tag_length
from services.replica.validation import struct_to_dict

_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# OpenAI: "omitting parameters defines a function with an empty parameter list". An empty
# object, not any object: under a forced call the grammar then ends the arguments at "{}"
# instead of letting the model invent properties until max_tokens.
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {},
                                  "additionalProperties": False}

ToolMode = Literal["none", "named", "required", "auto"]
HERMES_FORMAT = "hermes"
_HERMES_OPEN = "<tool_call>"
_HERMES_CLOSE = "</tool_call>"


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools make of its output."""

    mode: ToolMode = "none"
    # The tools as the chat template takes them (OpenAI's shape); empty for "none".
    tools: list[dict[str, Any]] = field(default_factory=list)
    # The forced function (mode "named").
    function: str | None = None
    # Mode "required": at most one call.
    single_call: bool = False

    @property
    def forced(self) -> bool:
        return self.mode in ("named", "required")

    def constraint(self) -> StructuredOutputSpec | None:
        """The JSON schema the output must follow, or None when no call is forced."""
        if self.mode == "named":
            schema = next(t["function"]["parameters"] for t in self.tools
                          if t["function"]["name"] == self.function)
        elif self.mode == "required":
            schema = {
                "type": "array", "minItems": 1,
                "items": {"anyOf": [{
                    "type": "object",
                    "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                   "parameters": t["function"]["parameters"]},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                } for t in self.tools]},
            }
            if self.single_call:
                schema["maxItems"] = 1
        else:
            return None  # "auto": the model writes freely, calls are parsed out of its text
        return StructuredOutputSpec("json_schema", json.dumps(schema))

    def finish_reason(self, generated: str, made_calls: bool) -> str:
        """OpenAI's: "tool_calls" when calls ended the choice normally, but "stop" for a
        named function (as OpenAI reports a forced call); "length" stays."""
        if generated == "stop" and made_calls and self.mode != "named":
            return "tool_calls"
        return generated

    def split(self, text: str) -> tuple[str | None, list[pb.ToolCall]]:
        """A choice's finished text as (content, calls). A named function's call holds its
        arguments as generated (cut short when max_tokens ended them, as OpenAI's are); a
        ``required`` list cut off before it closes, or ``auto`` text with no call in it
        (``split_hermes``), gives no calls and the text as content."""
        if self.mode == "named":
            assert self.function is not None
            return None, [new_tool_call(self.function, text)]
        if self.mode == "auto":
            return split_hermes(text)
        if self.mode == "none":
            return text, []
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError:
            return text, []
        return None, [new_tool_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                      for c in parsed]


# A call's JSON as Hermes models write it, up to where its arguments begin: their text can
# then be streamed as it comes.
_HERMES_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
# The end of a call's text that may be the object's closing brace (and the space around it),
# not its arguments: held back until what follows says.
_CLOSING_BRACE = re.compile(r"(\s*\})?\s*$")


def split_hermes(text: str) -> tuple[str | None, list[pb.ToolCall]]:
    """Hermes-format text as (content, calls), as ``HermesStream`` streams it (fed in one
    piece): the content is what precedes the first ``<tool_call>`` (None when nothing does
    and there are calls); without any call, the whole text is content."""
    stream = HermesStream()
    content, deltas = stream.feed(text)
    rest, more = stream.finish()
    calls: list[pb.ToolCall] = []
    for delta in deltas + more:
        if delta.index == len(calls):
            calls.append(pb.ToolCall(id=delta.id, type=delta.type,
                                     function=pb.FunctionCall(name=delta.function.name)))
        calls[delta.index].function.arguments += delta.function.arguments
    content += rest
    return (content or None) if calls else content, calls


@dataclass
class _OpenCall:
    """The call of the block being read: where its arguments begin, what was streamed."""

    index: int
    arguments_at: int  # offset of the arguments in the block's text
    streamed: str = ""


class HermesStream:
    """One choice's text under ``auto``, turned into content and tool-call deltas as it comes
    (vLLM's ``hermes`` parser). The content is the text before the first ``<tool_call>``
    (never a piece of that tag); each block then becomes a call: its header (id and name)
    once ``{"name": ..., "arguments": `` is read, then its arguments as written, holding
    back only what may be the object's closing brace or the closing tag. A block in another
    shape is parsed whole when it closes (dropped if it is no call). A choice that made no
    call shows its whole text as content at the end. The arguments are the model's text:
    cut short when max_tokens cut the call, as OpenAI's may be."""

    def __init__(self) -> None:
        self._text = ""
        self._shown = 0  # content characters shown
        self._in_calls = False  # a <tool_call> was seen: no more content
        self._block: int | None = None  # where the open block's text begins
        self._scan = 0  # where to look for the next block
        self._call: _OpenCall | None = None
        self.num_calls = 0

    def feed(self, piece: str) -> tuple[str, list[pb.ToolCallDelta]]:
        """The content and the call deltas this piece lets the stream show now."""
        self._text += piece
        return self._advance(final=False)

    def finish(self) -> tuple[str, list[pb.ToolCallDelta]]:
        """At the choice's end: what is still to show."""
        content, deltas = self._advance(final=True)
        if not self.num_calls:
            content += self._text[self._shown:]  # no call after all: the tags were content
            self._shown = len(self._text)
        return content, deltas

    def _advance(self, final: bool) -> tuple[str, list[pb.ToolCallDelta]]:
        text, content = self._text, ""
        deltas: list[pb.ToolCallDelta] = []
        if not self._in_calls:
            start = text.find(_HERMES_OPEN, self._shown)
            if start < 0:
                end = len(text) if final else len(text) - partial_tag_length(text, _HERMES_OPEN)
                content, self._shown = text[self._shown:end], max(self._shown, end)
                return content, deltas
            content, self._shown = text[self._shown:start], start
            self._in_calls, self._scan = True, start
        while True:
            if self._block is None:
                start = text.find(_HERMES_OPEN, self._scan)
                if start < 0:
                    return content, deltas
                self._block = start + len(_HERMES_OPEN)
            close = text.find(_HERMES_CLOSE, self._block)
            body = text[self._block:] if close < 0 else text[self._block:close]
            deltas += self._read_block(body, closed=close >= 0 or final)
            if close < 0:
                return content, deltas
            self._block, self._call, self._scan = None, None, close + len(_HERMES_CLOSE)

    def _read_block(self, body: str, closed: bool) -> list[pb.ToolCallDelta]:
        deltas: list[pb.ToolCallDelta] = []
        if self._call is None:
            header = _HERMES_HEADER.match(body)
            name = _json_string(header.group(1)) if header else None
            if header is None or name is None:
                return self._whole_call(body) if closed else []
            self._call = _OpenCall(self.num_calls, header.end())
            self.num_calls += 1
            deltas.append(pb.ToolCallDelta(
                index=self._call.index, id=new_tool_call_id(), type="function",
                function=pb.FunctionCallDelta(name=name)))
        call = self._call
        # The header's match may end before the space that follows "arguments": in a later
        # piece: the arguments begin at their first non-space character.
        arguments = body[call.arguments_at:].lstrip()
        if closed:
            shown = _final_arguments(arguments)
        elif arguments.startswith('"'):
            shown = ""  # arguments as a JSON string: decoded when the block closes
        else:
            visible = arguments[:len(arguments) - partial_tag_length(arguments, _HERMES_CLOSE)]
            brace = _CLOSING_BRACE.search(visible)
            shown = visible[:brace.start()] if brace else visible
        if len(shown) > len(call.streamed) and shown.startswith(call.streamed):
            deltas.append(pb.ToolCallDelta(index=call.index, function=pb.FunctionCallDelta(
                arguments=shown[len(call.streamed):])))
            call.streamed = shown
        return deltas

    def _whole_call(self, body: str) -> list[pb.ToolCallDelta]:
        """A closed block not in the streamable shape: a call if it parses as one."""
        try:
            call = json.loads(body)
            name, arguments = call["name"], call.get("arguments", {})
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            return []
        if not isinstance(name, str):
            return []
        index, self.num_calls = self.num_calls, self.num_calls + 1
        return [pb.ToolCallDelta(index=index, id=new_tool_call_id(), type="function",
                                 function=pb.FunctionCallDelta(name=name, arguments=(
                                     arguments if isinstance(arguments, str)
                                     else json.dumps(arguments, ensure_ascii=False))))]


def _json_string(escaped: str) -> str | None:
    """The text of a JSON string's inside (escapes decoded); None if it is not one."""
    try:
        value = json.loads(f'"{escaped}"')
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, str) else None


def _final_arguments(text: str) -> str:
    """A closed (or cut-off) call's arguments from the text after ``"arguments":``: the JSON
    value without the call object's closing brace, a JSON string decoded, or the text as it
    is when it is not JSON (cut short)."""
    without_brace = re.sub(r"\s*\}\s*$", "", text)
    for candidate in (without_brace, text.rstrip()):
        try:
            value = json.loads(candidate)
        except json.JSONDecodeError:
            continue
        return value if isinstance(value, str) else candidate
    return text


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def new_tool_call(name: str, arguments: str) -> pb.ToolCall:
    return pb.ToolCall(id=new_tool_call_id(), type="function",
                       function=pb.FunctionCall(name=name, arguments=arguments))


def chat_template_call_format(chat_template: object) -> str | None:
    """How a chat template has the model write tool calls: "hermes" when it uses
    ``<tool_call>`` tags (Qwen2.5, Hermes and others), else None (no format Tandem parses)."""
    if isinstance(chat_template, str) and _HERMES_OPEN in chat_template:
        return HERMES_FORMAT
    return None


def tool_plan(request: pb.ChatCompletionRequest, call_format: str | None = None) -> ToolPlan:
    """Checks ``tools``, ``tool_choice`` and ``parallel_tool_calls`` against a model whose
    chat template writes calls in ``call_format`` (None: no known format); raises
    InvalidArgument."""
    tools = [_tool_dict(i, tool) for i, tool in enumerate(request.tools)]
    names = [t["function"]["name"] for t in tools]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise InvalidArgument(f"tools name the function {duplicates[0]!r} more than once")
    choice: Any = (json_format.MessageToDict(request.tool_choice)
                   if request.HasField("tool_choice") else None)
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolPlan()
    if not tools:
        raise InvalidArgument(f"tool_choice {json.dumps(choice)} needs tools")
    if choice == "auto":
        if call_format == HERMES_FORMAT:
            return ToolPlan("auto", tools)
        raise InvalidArgument(
            'tool_choice "auto" (the default when tools are given) lets the model decide '
            "whether to call a tool, which needs a parser of the model's tool-call syntax; "
            "this model's chat template writes none that Tandem knows (the Hermes "
            '<tool_call> format). Send tool_choice "required", or {"type": "function", '
            '"function": {"name": ...}} to force one function, or "none"')
    if request.response_format.type not in ("", "text") or request.HasField("structured_outputs"):
        raise InvalidArgument("a forced tool call already constrains the output; drop "
                              "response_format / structured_outputs or set tool_choice none")
    if choice == "required":
        return ToolPlan("required", tools,
                        single_call=request.HasField("parallel_tool_calls")
                        and not request.parallel_tool_calls)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type", "function") != "function" \
            or not isinstance(name, str):
        raise InvalidArgument('tool_choice must be "none", "auto", "required" or '
                              '{"type": "function", "function": {"name": ...}}; got '
                              f"{json.dumps(choice)}")
    if name not in names:
        raise InvalidArgument(f"tool_choice names the function {name!r}, which is not among "
                              f"the tools ({', '.join(names)})")
    return ToolPlan("named", tools, function=name)


def _tool_dict(index: int, tool: pb.Tool) -> dict[str, Any]:
    where = f"tools[{index}]"
    if tool.type not in ("", "function"):
        raise InvalidArgument(f'{where}.type must be "function", got {tool.type!r}')
    function = tool.function
    if not _FUNCTION_NAME.match(function.name):
        raise InvalidArgument(f"{where}.function.name must be 1 to 64 letters, digits, _ or -; "
                              f"got {function.name!r}")
    parameters = (struct_to_dict(function.parameters) if function.HasField("parameters")
                  else dict(_NO_PARAMETERS))
    definition: dict[str, Any] = {"name": function.name, "parameters": parameters}
    if function.description:
        definition["description"] = function.description
    return {"type": "function", "function": definition}


def template_tool_calls(calls: list[pb.ToolCall]) -> list[dict[str, Any]]:
    """An earlier assistant turn's calls as chat templates take them: arguments as an object
    where they parse (the templates of Llama, Qwen, Hermes... expect a mapping)."""
    converted = []
    for call in calls:
        try:
            arguments: Any = json.loads(call.function.arguments)
        except json.JSONDecodeError:
            arguments = call.function.arguments
        converted.append({"id": call.id, "type": call.type or "function",
                          "function": {"name": call.function.name, "arguments": arguments}})
    return converted
