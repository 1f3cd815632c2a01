"""Function calling in the chat API: OpenAI's ``tools`` and ``tool_choice``.

Owns reading ``tools`` and ``tool_choice`` into a ``ToolPlan``, the tools and earlier turns'
calls as a chat template takes them, the output constraint that makes the model's text a call
(a JSON schema, compiled and enforced like any ``response_format``), and turning the text
into ``tool_calls``. As in vLLM, a forced call is generated under a schema: a named function
(``{"type": "function", "function": {"name": ...}}``) gives its arguments object, ``required``
a JSON list of ``{"name", "parameters"}`` objects, one per call. ``auto`` (the model decides
whether to call) needs a parser of the model's own call syntax, which differs between model
families: it is served for models whose chat template teaches one that
``tool_call_parsers`` reads (Hermes, Llama 3 JSON) and refused for the others, as vLLM
refuses it without a parser.

It does not own the chat template (``InputProcessor``), sampling or the response messages
(``openai_api``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from google.protobuf import json_format

from engine_common.structured_output.spec import StructuredOutputSpec
from protos.tandem.v1 import generation_pb2 as pb
from services.frontend.errors import InvalidArgument
from services.frontend.tools.parsers import (
    HERMES_FORMAT,
    CallStream,
    call_stream,
    new_tool_call_id,
)
from services.frontend.validation import struct_to_dict

_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# OpenAI: "omitting parameters defines a function with an empty parameter list". An empty
# object, not any object: under a forced call the grammar then ends the arguments at "{}"
# instead of letting the model invent properties until max_tokens.
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {},
                                  "additionalProperties": False}

ToolMode = Literal["none", "named", "required", "auto"]


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
    # Mode "auto": the syntax the model writes calls in (``tool_call_parsers``).
    call_format: str | None = None

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

    def call_stream(self) -> CallStream:
        """A parser of one choice's text under "auto"."""
        return call_stream(self.call_format or HERMES_FORMAT)

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
        (``tool_call_parsers``), gives no calls and the text as content."""
        if self.mode == "named":
            assert self.function is not None
            return None, [new_tool_call(self.function, text)]
        if self.mode == "auto":
            return self.call_stream().split(text)
        if self.mode == "none":
            return text, []
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError:
            return text, []
        return None, [new_tool_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                      for c in parsed]


def new_tool_call(name: str, arguments: str) -> pb.ToolCall:
    return pb.ToolCall(id=new_tool_call_id(), type="function",
                       function=pb.FunctionCall(name=name, arguments=arguments))


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
        if call_format is not None:
            return ToolPlan("auto", tools, call_format=call_format)
        raise InvalidArgument(
            'tool_choice "auto" (the default when tools are given) lets the model decide '
            "whether to call a tool, which needs a parser of the model's tool-call syntax; "
            "this model's chat template writes none that Tandem knows (the Hermes "
            "<tool_call> format, Mistral's [TOOL_CALLS], Llama 3 JSON). Send tool_choice "
            '"required", or {"type": "function", "function": {"name": ...}} to force one '
            'function, or "none"; or serve the model with --tool-call-parser')
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
