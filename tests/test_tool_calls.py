"""Function calling's request side: reading ``tools`` / ``tool_choice``, the schema a forced
call is generated under, the tools and earlier calls reaching a chat template, and schemas
arriving in the same order whatever way they travelled. (Through Envoy with the ``openai``
SDK, against the offline engine: tests/test_envoy_e2e.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import xgrammar as xgr
from google.protobuf import json_format, struct_pb2

from engine_common.input_processor import InputProcessor, InvalidRequestError
from engine_common.tokenizer import load_tokenizer
from protos.tandem.v1 import generation_pb2 as pb
from services.replica.errors import InvalidArgument
from services.replica.openai_api import chat_messages
from services.replica.tool_calls import tool_plan
from services.replica.validation import struct_to_dict

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}


def chat_request(**fields: Any) -> pb.ChatCompletionRequest:
    request = pb.ChatCompletionRequest()
    json_format.ParseDict({"messages": [{"role": "user", "content": "hi"}], **fields}, request)
    return request


def test_tool_choice_modes_and_their_constraints() -> None:
    assert not tool_plan(chat_request()).forced
    assert not tool_plan(chat_request(tools=[WEATHER], tool_choice="none")).forced

    named = tool_plan(chat_request(tools=[WEATHER, CLOCK], tool_choice={
        "type": "function", "function": {"name": "get_weather"}}))
    assert named.mode == "named" and named.function == "get_weather"
    constraint = named.constraint()
    assert constraint is not None
    assert json.loads(constraint.value) == WEATHER["function"]["parameters"]
    assert named.finish_reason("stop") == "stop" and named.finish_reason("length") == "length"
    assert [c.function.arguments for c in named.calls('{"city": "Oslo"')] == ['{"city": "Oslo"']

    required = tool_plan(chat_request(tools=[WEATHER, CLOCK], tool_choice="required"))
    constraint = required.constraint()
    assert constraint is not None
    schema = json.loads(constraint.value)
    assert schema["minItems"] == 1 and "maxItems" not in schema
    # A function without parameters takes any object.
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object"}
    assert required.finish_reason("stop") == "tool_calls"
    calls = required.calls('[{"name": "get_time", "parameters": {}}, '
                           '{"name": "get_weather", "parameters": {"city": "Ålesund"}}]')
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_time", "{}"), ("get_weather", '{"city": "Ålesund"}')]
    assert len({c.id for c in calls}) == 2
    assert required.calls('[{"name": "get_ti') == []
    single = tool_plan(chat_request(tools=[WEATHER], tool_choice="required",
                                    parallel_tool_calls=False)).constraint()
    assert single is not None and json.loads(single.value)["maxItems"] == 1


def test_the_required_schema_compiles_and_accepts_only_calls(tiny_llama_dir: Path) -> None:
    constraint = tool_plan(chat_request(tools=[WEATHER, CLOCK],
                                        tool_choice="required")).constraint()
    assert constraint is not None
    tokenizer = load_tokenizer(tiny_llama_dir)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer))
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(constraint.value))
    assert matcher.accept_string('[{"name": "get_weather", "parameters": '
                                 '{"city": "Oslo", "days": 2}}]')
    assert not matcher.accept_string(",")  # the list is complete
    matcher.reset()
    assert not matcher.accept_string('[{"name": "get_date"')


@pytest.mark.parametrize("fields, message", [
    ({"tools": [WEATHER]}, 'tool_choice "auto" (the default when tools are given)'),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "needs a parser"),
    ({"tool_choice": "required"}, 'tool_choice "required" needs tools'),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, 'tool_choice must be "none"'),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "'get_time', which is not among the tools (get_weather)"),
    ({"tools": [{"type": "retrieval", "function": {"name": "x"}}], "tool_choice": "none"},
     'tools[0].type must be "function"'),
    ({"tools": [{"function": {"name": "get weather"}}], "tool_choice": "none"},
     "tools[0].function.name must be 1 to 64 letters"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "none"}, "'get_weather' more than once"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "already constrains the output"),
])
def test_unservable_tools_are_invalid_argument(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgument) as raised:
        tool_plan(chat_request(**fields))
    assert message in str(raised.value)


def test_tools_and_earlier_calls_reach_the_chat_template(tiny_llama_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_llama_dir)
    tokenizer.chat_template = (
        "{% if tools %}TOOLS {{ tools | map(attribute='function.name') | join(',') }}"
        "{{ '\\n' }}{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} "
        "city={{ c.function.arguments.city }}{% endfor %}"
        "{% if m.tool_call_id %} (answers {{ m.tool_call_id }}){% endif %}{{ '\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}")
    inputs = InputProcessor(tokenizer, max_model_len=512, vocab_size=len(tokenizer))
    request = chat_request(
        messages=[{"role": "user", "content": "weather?"},
                  {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                   "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
        tools=[WEATHER, CLOCK], tool_choice="required")
    prompt = inputs.tokenize_chat(chat_messages(request.messages, 512), tool_plan(request).tools)
    # Arguments reach the template as an object, as templates index into them.
    assert tokenizer.decode(prompt) == (
        "TOOLS get_weather,get_time\nuser: weather?\nassistant: CALL get_weather city=Oslo\n"
        "tool: sunny (answers call_1)\nassistant:")
    tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(InvalidRequestError, match="chat template refused.*roles must alternate"):
        inputs.tokenize_chat([{"role": "user", "content": "hi"}])


def test_a_schema_reads_the_same_whatever_order_its_keys_travelled_in() -> None:
    orders = [["days", "city", "zone"], ["zone", "city", "days"]]
    dicts = []
    for order in orders:
        properties = {name: {"type": "string", "maxLength": 5} for name in order}
        struct = struct_pb2.Struct()
        struct.update({"required": ["city", "days"], "type": "object",
                       "properties": properties})
        dicts.append(struct_to_dict(struct))
    assert json.dumps(dicts[0]) == json.dumps(dicts[1])
    # The required names first, in their list's order; integral numbers stay integers.
    assert list(dicts[0]["properties"]) == ["city", "days", "zone"]
    assert dicts[0]["properties"]["city"] == {"maxLength": 5, "type": "string"}
