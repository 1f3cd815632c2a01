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
from services.frontend.chat.request import chat_messages, chat_to_engine_request
from services.frontend.errors import InvalidArgument
from services.frontend.tools.parsers import chat_template_call_format
from services.frontend.tools.plan import tool_plan
from services.frontend.validation import struct_to_dict
from tandem.request_builders import chat_message
from tests.chat_replay import chunks_and_response

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
    assert named.finish_reason("stop", True) == "stop"
    assert named.finish_reason("length", True) == "length"
    content, calls = named.split('{"city": "Oslo"')
    assert content is None and [c.function.arguments for c in calls] == ['{"city": "Oslo"']

    required = tool_plan(chat_request(tools=[WEATHER, CLOCK], tool_choice="required"))
    constraint = required.constraint()
    assert constraint is not None
    schema = json.loads(constraint.value)
    assert schema["minItems"] == 1 and "maxItems" not in schema
    # A function without parameters takes an empty object (OpenAI: an empty parameter list).
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {
        "type": "object", "properties": {}, "additionalProperties": False}
    assert required.finish_reason("stop", True) == "tool_calls"
    assert required.finish_reason("stop", False) == "stop"
    content, calls = required.split('[{"name": "get_time", "parameters": {}}, '
                                    '{"name": "get_weather", "parameters": {"city": "Ålesund"}}]')
    assert content is None
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_time", "{}"), ("get_weather", '{"city": "Ålesund"}')]
    assert len({c.id for c in calls}) == 2
    assert required.split('[{"name": "get_ti') == ('[{"name": "get_ti', [])
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
    # A function without parameters is called with an empty object, nothing else.
    matcher.reset()
    assert matcher.accept_string('[{"name": "get_time", "parameters": {')
    assert not matcher.accept_string('"')
    assert matcher.accept_string('}}]')


@pytest.mark.parametrize("fields, message", [
    ({"tools": [WEATHER]}, 'tool_choice "auto" (the default when tools are given)'),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "writes none that Tandem knows"),
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


def test_tools_and_earlier_calls_and_reasoning_reach_the_chat_template(tiny_llama_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_llama_dir)
    tokenizer.chat_template = (
        "{% if tools %}TOOLS {{ tools | map(attribute='function.name') | join(',') }}"
        "{{ '\\n' }}{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% if m.reasoning_content %}THOUGHT {{ m.reasoning_content }} {% endif %}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} "
        "city={{ c.function.arguments.city }}{% endfor %}"
        "{% if m.tool_call_id %} (answers {{ m.tool_call_id }}){% endif %}{{ '\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}")
    inputs = InputProcessor(tokenizer, max_model_len=512, vocab_size=len(tokenizer))
    request = chat_request(
        messages=[{"role": "user", "content": "weather?"},
                  {"role": "assistant", "reasoning": "ask the weather tool",
                   "tool_calls": [{"id": "call_1", "type": "function",
                   "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
        tools=[WEATHER, CLOCK], tool_choice="required")
    prompt = inputs.tokenize_chat(chat_messages(request.messages, 512), tool_plan(request).tools)
    # Arguments reach the template as an object, as templates index into them.
    assert tokenizer.decode(prompt) == (
        "TOOLS get_weather,get_time\nuser: weather?\n"
        "assistant: THOUGHT ask the weather tool CALL get_weather city=Oslo\n"
        "tool: sunny (answers call_1)\nassistant:")
    # Under its older name too (DeepSeek's API).
    request.messages[1].reasoning_content, request.messages[1].reasoning = "why not", ""
    assert chat_messages(request.messages, 512)[1]["reasoning_content"] == "why not"
    # The gRPC SDK sends an earlier turn's reasoning the same way.
    assert chat_message({"role": "assistant", "content": "x", "reasoning": "why"}) \
        == pb.ChatMessage(role="assistant", reasoning="why",
                          content=struct_pb2.Value(string_value="x"))
    tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(InvalidRequestError, match="chat template refused.*roles must alternate"):
        inputs.tokenize_chat([{"role": "user", "content": "hi"}])
    # A template variable of the wrong type (chat_template_kwargs come from the client).
    tokenizer.chat_template = "{{ messages[0].content }}{{ 1 + depth }}"
    assert inputs.tokenize_chat([{"role": "user", "content": "hi"}], template_kwargs={"depth": 2})
    with pytest.raises(InvalidRequestError, match="template failed on this request: TypeError"):
        inputs.tokenize_chat([{"role": "user", "content": "hi"}], template_kwargs={"depth": "x"})
    with pytest.raises(InvalidRequestError, match="may not set add_generation_prompt, tools"):
        inputs.tokenize_chat([{"role": "user", "content": "hi"}],
                             template_kwargs={"tools": [], "add_generation_prompt": False})


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


# --------------------------------------------------------------------------- auto (Hermes)

HERMES_TEXTS = [
    "The weather is fine.",
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
    '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Lima", "days": 2}}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {"city": ',  # cut off by max_tokens
    "a < b and <tool_ca is not a tag",
    '<tool_call>{"arguments": {}}</tool_call>',  # no name: not a call
    # Arguments as written (compact, braces inside strings); a block in another key order,
    # parsed whole; arguments sent as a JSON string, decoded.
    'On it.<tool_call>{"name":"get_weather","arguments":{"city":"}{ Lima","days":3} }'
    '</tool_call><tool_call>{"arguments": {"zone": "CET"}, "name": "get_time"}</tool_call>'
    '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}</tool_call>',
]


LLAMA3_TEXTS = [
    "The weather is fine.",
    '{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
    '{"name": "get_time", "parameters": {}}',
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima", "days": 2}}',
    '  {"name": "get_weather", "parameters": {"city": ',  # cut off by max_tokens
    "<|python_ta is not the tag",
    '{"parameters": {}}',  # no name: not a call
    '{"name":"get_weather","parameters":{"city":"}{ Lima","days":3} };'
    '{"parameters": {"zone": "CET"}, "name": "get_time"}',
]
# (content, [(name, arguments)]) of each text above.
LLAMA3_SPLITS = [
    ("The weather is fine.", []),
    (None, [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]),
    (None, [("get_weather", '{"city": "Lima", "days": 2}')]),
    (None, [("get_weather", '{"city": ')]),
    ("<|python_ta is not the tag", []),
    ('{"parameters": {}}', []),
    (None, [("get_weather", '{"city":"}{ Lima","days":3}'), ("get_time", '{"zone": "CET"}')]),
]


MISTRAL_TEXTS = [
    "The weather is fine.",
    # Mistral 7B v0.3 / Nemo: a JSON list after the tag.
    'Let me check.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
    '{"name": "get_time", "arguments": {}}]',
    # Tokenizers v11 on: name[ARGS]arguments after each tag, maybe a [CALL_ID].
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Lima", "days": 2}[TOOL_CALLS]get_time[ARGS]{}',
    '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS] {"city": "Oslo"} ',
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": ',  # cut off by max_tokens
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Li',  # cut off by max_tokens
    "a [TOOL_CALL is not the tag",
    # Mistral 7B v0.3 may write its call id after the arguments: not part of them.
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}, '
    '"id": "a1b2c3d4e"}]',
]
# (content, [(name, arguments)]) of each text above.
MISTRAL_SPLITS = [
    ("The weather is fine.", []),
    ("Let me check.", [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]),
    (None, [("get_weather", '{"city": "Lima", "days": 2}'), ("get_time", "{}")]),
    (None, [("get_weather", '{"city": "Oslo"}')]),
    (None, [("get_weather", '{"city": ')]),
    (None, [("get_weather", '{"city": "Li')]),
    ("a [TOOL_CALL is not the tag", []),
    (None, [("get_weather", '{"city": "Oslo", "days": 2}')]),
]


def test_mistral_text_splits_into_content_and_calls() -> None:
    plan = tool_plan(chat_request(tools=[WEATHER, CLOCK]), "mistral")
    for text, (content, calls) in zip(MISTRAL_TEXTS, MISTRAL_SPLITS, strict=True):
        got_content, got_calls = plan.split(text)
        assert (got_content, [(c.function.name, c.function.arguments) for c in got_calls]) \
            == (content, calls), text
        # Mistral's templates take back only ids of 9 letters and digits.
        assert all(len(c.id) == 9 and c.id.isalnum() for c in got_calls)


def test_a_mistral_template_gets_its_tags_and_its_call_ids(tiny_llama_dir: Path) -> None:
    """Under "auto" a Mistral model's request keeps special tokens in its text (the call
    tags are special tokens), and earlier turns' call ids reach the template as the 9 letters
    and digits it insists on, the call and its result still paired."""
    tokenizer = load_tokenizer(tiny_llama_dir)
    tokenizer.chat_template = (
        "{% for m in messages %}{% for c in m.tool_calls or [] %}"
        "{% if c.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric "
        "strings with length 9!') }}{% endif %}[TOOL_CALLS]{{ c.function.name }}:{{ c.id }}"
        "{% endfor %}{% if m.role == 'tool' %} result {{ m.tool_call_id }}"
        "{% else %} {{ m.content }}{% endif %}{% endfor %}")
    assert chat_template_call_format(tokenizer.chat_template) == "mistral"
    inputs = InputProcessor(tokenizer, max_model_len=512, vocab_size=len(tokenizer))
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "tool_calls": [{
                   "id": "call_0123456789abcdef", "type": "function",
                   "function": {"name": "get_weather", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "call_0123456789abcdef", "content": "sunny"}]
    chat = chat_to_engine_request(chat_request(messages=history, tools=[WEATHER]), inputs)
    assert chat.tools.mode == "auto" and chat.tools.call_format == "mistral"
    assert not chat.request.params.skip_special_tokens
    assert tokenizer.decode(chat.request.prompt_token_ids).endswith(
        "[TOOL_CALLS]get_weather:789abcdef  result 789abcdef")
    history[1]["tool_calls"][0]["id"] = history[2]["tool_call_id"] = "call_1"  # too short
    short = chat_to_engine_request(chat_request(messages=history, tools=[WEATHER]), inputs)
    assert tokenizer.decode(short.request.prompt_token_ids).endswith(
        "[TOOL_CALLS]get_weather:0000call1  result 0000call1")
    asked = chat_to_engine_request(chat_request(messages=history, tools=[WEATHER],
                                                skip_special_tokens=True), inputs)
    assert asked.request.params.skip_special_tokens  # the client's choice stands
    plain = chat_to_engine_request(chat_request(messages=history), inputs)
    assert plain.request.params.skip_special_tokens  # no tools: nothing to parse


def test_a_server_told_the_call_syntax_serves_auto_whatever_the_template(
        tiny_llama_dir: Path) -> None:
    """--tool-call-parser: a template Tandem cannot read a syntax off (the tiny model's)
    refuses "auto"; told the model writes Hermes calls, the server parses them."""
    tokenizer = load_tokenizer(tiny_llama_dir)
    assert chat_template_call_format(tokenizer.chat_template) is None
    request = chat_request(tools=[WEATHER])
    with pytest.raises(InvalidArgument, match='tool_choice "auto"'):
        chat_to_engine_request(request, InputProcessor(tokenizer, 512, len(tokenizer)))
    told = InputProcessor(tokenizer, 512, len(tokenizer), tool_call_parser="hermes")
    chat = chat_to_engine_request(request, told)
    assert (chat.tools.mode, chat.tools.call_format) == ("auto", "hermes")
    assert chat.tools.split('<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
                            )[1][0].function.name == "get_weather"


def test_auto_is_served_for_templates_whose_call_syntax_is_known(tiny_llama_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_llama_dir)
    assert chat_template_call_format(tokenizer.chat_template) is None
    tokenizer.chat_template = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                               "{% if tools %}Call tools as <tool_call>{json}</tool_call>"
                               "{% endif %}")
    assert chat_template_call_format(tokenizer.chat_template) == "hermes"
    plan = tool_plan(chat_request(tools=[WEATHER]), chat_template_call_format(
        tokenizer.chat_template))
    assert plan.mode == "auto" and not plan.forced and plan.constraint() is None
    # Llama 3.1-3.3's templates describe the call in these words.
    llama3 = ('Respond in the format {"name": function name, "parameters": dictionary of '
              'argument name and its value}. Do not use variables.')
    assert chat_template_call_format(llama3) == "llama3_json"
    assert tool_plan(chat_request(tools=[WEATHER]), "llama3_json").call_format == "llama3_json"


def test_llama3_json_text_splits_into_content_and_calls() -> None:
    plan = tool_plan(chat_request(tools=[WEATHER, CLOCK]), "llama3_json")
    for text, (content, calls) in zip(LLAMA3_TEXTS, LLAMA3_SPLITS, strict=True):
        got_content, got_calls = plan.split(text)
        assert (got_content, [(c.function.name, c.function.arguments) for c in got_calls]) \
            == (content, calls), text
        assert all(c.id.startswith("call_") for c in got_calls)


def test_hermes_text_splits_into_content_and_calls() -> None:
    plan = tool_plan(chat_request(tools=[WEATHER, CLOCK]), "hermes")
    results = [plan.split(text) for text in HERMES_TEXTS]
    assert results[0] == ("The weather is fine.", [])
    content, calls = results[1]
    assert content == "Let me check.\n"
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]
    assert results[2][0] is None and results[2][1][0].function.arguments == (
        '{"city": "Lima", "days": 2}')
    # Cut off by max_tokens: the call keeps its cut arguments (finish_reason stays "length").
    assert results[3][0] is None
    assert [(c.function.name, c.function.arguments) for c in results[3][1]] == [
        ("get_weather", '{"city": ')]
    for text, (content, calls) in zip(HERMES_TEXTS[4:6], results[4:6], strict=True):
        assert (content, calls) == (text, [])
    content, calls = results[6]
    assert content == "On it."
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", '{"city":"}{ Lima","days":3}'), ("get_time", '{"zone": "CET"}'),
        ("get_time", '{"zone": "UTC"}')]
    assert len({c.id for c in calls}) == 3
    assert plan.finish_reason("stop", True) == "tool_calls"
    assert plan.finish_reason("stop", False) == "stop"


@pytest.mark.parametrize(("call_format", "text"), [
    *(("hermes", text) for text in HERMES_TEXTS),
    *(("llama3_json", text) for text in LLAMA3_TEXTS),
    *(("mistral", text) for text in MISTRAL_TEXTS)])
@pytest.mark.parametrize("piece", [1, 3, 7])
def test_a_streamed_auto_choice_says_what_the_response_says(call_format: str, text: str,
                                                            piece: int) -> None:
    """Fed in pieces of every size, the stream's content and calls equal the unstreamed
    response's: content is never shown past a (possibly partial) <tool_call>."""
    plan = tool_plan(chat_request(tools=[WEATHER, CLOCK]), call_format)
    chunks, response = chunks_and_response(text, piece, plan)
    message = response.choices[0].message
    streamed_content = "".join(c.choices[0].delta.content for c in chunks)
    assert streamed_content == (message.content if message.HasField("content") else "")
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls]
    streamed_calls: dict[int, list[str]] = {}
    for d in deltas:  # a call's first delta has its id and name, the others its arguments
        assert bool(d.id) == (d.index not in streamed_calls) == bool(d.function.name)
        streamed_calls.setdefault(d.index, [d.function.name, ""])[1] += d.function.arguments
    assert [tuple(call) for call in streamed_calls.values()] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls]
    if piece == 1 and message.tool_calls and '"days": 2' in text:
        assert len(deltas) > 10  # the arguments came as they were written, not at the end
    # Nothing of a tag is ever shown as content.
    assert "<|python_tag|>" not in streamed_content
    assert chunks[-1].choices[0].finish_reason == response.choices[0].finish_reason
    # Nothing of a tag is ever shown as content.
    assert "<tool_call>" not in streamed_content or not message.tool_calls
    assert "[TOOL_CALLS]" not in streamed_content
