"""Reasoning output: a <think> block split from the content, whole and streamed in pieces.

The expected splits are written out by hand; a stream fed the same text in pieces of 1, 3
and 7 characters must say what the whole split says, so no piece of a tag ever shows.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from engine_common.input_processor import InputProcessor
from engine_common.tokenizer import load_tokenizer
from protos.tandem.v1 import generation_pb2 as pb
from services.frontend.chat.request import ChatRequest, chat_to_engine_request
from services.frontend.chat.response import chat_response
from services.frontend.chat.stream import chat_chunks
from services.frontend.choices import ChoiceDelta
from services.frontend.engine_seam import GenerationDelta
from services.frontend.reasoning.plan import ReasoningPlan, reasoning_plan
from services.frontend.tools.plan import ToolPlan
from tandem.request_builders import chat_message
from tests.chat_replay import chunks_and_response
from tests.model_factory import build_tokenizer

THINKING_TEMPLATE = "{{ messages }}{% if enable_thinking %}<think>\n{% endif %} ... </think>"

# (opened, output, expected reasoning, expected content)
CASES = [
    (False, "<think>\nweigh it\n</think>\n\nThe answer.", "\nweigh it\n", "\n\nThe answer."),
    (False, "  <think>x</think>y", "x", "y"),  # leading whitespace before the block
    (False, "plain answer", None, "plain answer"),
    (False, "a <think>late</think> tag", None, "a <think>late</think> tag"),  # not at the start
    (False, "<thin", None, "<thin"),  # ended on what looked like a tag
    (False, "   ", None, "   "),
    (False, "<think>cut off by max_tokens", "cut off by max_tokens", ""),
    (False, "<think></think>", None, ""),
    (True, "still thinking</think>Done", "still thinking", "Done"),
    (True, "never closed </thi", "never closed </thi", ""),
    (True, "</think>", None, ""),
    (True, "a</think>b</think>c", "a", "b</think>c"),  # the first close ends it
]


@pytest.mark.parametrize(("opened", "output", "reasoning", "content"), CASES)
def test_whole_output_split(opened, output, reasoning, content):
    assert ReasoningPlan(enabled=True, opened=opened).split(output) == (reasoning, content)


@pytest.mark.parametrize("size", [1, 3, 7])
@pytest.mark.parametrize(("opened", "output", "reasoning", "content"), CASES)
def test_stream_in_pieces_says_what_the_whole_split_says(opened, output, reasoning, content,
                                                         size):
    stream = ReasoningPlan(enabled=True, opened=opened).stream()
    assert stream is not None
    shown_reasoning, shown_content = [], []
    for start in range(0, len(output), size):
        piece_reasoning, piece_content = stream.feed(output[start:start + size])
        shown_reasoning.append(piece_reasoning)
        shown_content.append(piece_content)
    rest_reasoning, rest_content = stream.finish()
    assert "".join(shown_reasoning) + rest_reasoning == (reasoning or "")
    assert "".join(shown_content) + rest_content == content


@pytest.mark.parametrize(("opened", "output", "reasoning", "content"), CASES)
def test_left_out_reasoning_leaves_the_content_alone(opened, output, reasoning, content):
    plan = ReasoningPlan(enabled=True, opened=opened, include=False)
    assert plan.split(output) == (None, content)


def test_reasoning_streams_before_the_block_closes():
    stream = ReasoningPlan(enabled=True, opened=False).stream()
    assert stream is not None
    assert stream.feed("<think>first ") == ("first ", "")
    assert stream.feed("second</th") == ("second", "")  # a possible close tag is held
    assert stream.feed("ink>answer") == ("", "answer")


def test_plan_from_the_template_and_the_rendered_prompt():
    assert reasoning_plan(THINKING_TEMPLATE, "user: hi\n<think>\n", constrained=False) \
        == ReasoningPlan(enabled=True, opened=True)
    # Thinking switched off: the prompt closes an empty block, the output is the answer.
    assert reasoning_plan(THINKING_TEMPLATE, "hi\n<think>\n\n</think>\n\n", constrained=False) \
        == ReasoningPlan(enabled=True, opened=False)
    assert reasoning_plan(THINKING_TEMPLATE, "hi\n", constrained=False) \
        == ReasoningPlan(enabled=True, opened=False)
    # Constrained: where </think> is one token, the model thinks first and the grammar
    # starts after that token, unless the prompt closed the block (thinking off); where it
    # is several tokens, the grammar rules the output from its first token.
    assert reasoning_plan(THINKING_TEMPLATE, "hi\n<think>\n", constrained=True,
                          think_tokens=(6, 7)) \
        == ReasoningPlan(enabled=True, opened=True, think_tokens=(6, 7))
    assert reasoning_plan(THINKING_TEMPLATE, "hi\n", constrained=True, think_tokens=(6, 7)) \
        == ReasoningPlan(enabled=True, opened=False, think_tokens=(6, 7))
    assert not reasoning_plan(THINKING_TEMPLATE, "hi\n<think>\n\n</think>\n\n",
                              constrained=True, think_tokens=(6, 7)).enabled
    assert not reasoning_plan(THINKING_TEMPLATE, "hi\n<think>\n", constrained=True).enabled
    # A template without the tags has no reasoning to parse.
    assert not reasoning_plan("{{ messages }}", "hi", constrained=False).enabled
    assert not reasoning_plan(None, "hi", constrained=False).enabled
    assert ReasoningPlan().split("<think>x</think>y") == (None, "<think>x</think>y")


@pytest.mark.parametrize("size", [1, 4])
def test_a_thinking_model_calls_tools_after_its_reasoning(size):
    """The reasoning is split off first; the content after it is parsed for Hermes calls,
    streamed or not alike."""
    text = ('<think>the user wants the time</think>\n\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>')
    tools = ToolPlan("auto", [{"type": "function", "function": {"name": "get_time"}}])
    reasoning = ReasoningPlan(enabled=True, opened=False)
    chunks, response = chunks_and_response(text, size, tools, reasoning)
    message = response.choices[0].message
    assert message.reasoning == "the user wants the time" and message.content == "\n\n"
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("get_time", '{"zone": "UTC"}')]
    assert response.choices[0].finish_reason == "tool_calls"
    assert "".join(c.choices[0].delta.reasoning for c in chunks) == message.reasoning
    assert "".join(c.choices[0].delta.content for c in chunks) == message.content
    assert "".join(d.function.arguments for c in chunks
                   for d in c.choices[0].delta.tool_calls) == '{"zone": "UTC"}'
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_constrained_chat_of_a_thinking_model_defers_its_grammar(tiny_llama_dir, tmp_path):
    """With the tags tokens of their own (as in Qwen3's vocabulary and the test models'), a
    constrained chat's grammar starts after </think> unless the prompt switched thinking
    off; where the tags are several tokens it starts at once."""
    tokenizer = load_tokenizer(tiny_llama_dir)
    # Qwen3's way: thinking unless switched off, the model opening the block itself.
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:"
        "{% if enable_thinking is defined %}"
        "{{ '<think>\n' if enable_thinking else '<think>\n\n</think>\n\n' }}"
        "{% endif %}{% endif %}")
    inputs = InputProcessor(tokenizer, 512, len(tokenizer))
    think = (tokenizer.convert_tokens_to_ids("<think>"),
             tokenizer.convert_tokens_to_ids("</think>"))
    plain = build_tokenizer(tmp_path, think_tokens=False)
    multi_token = InputProcessor(plain, 512, len(plain))
    assert (inputs.single_token("<think>"), inputs.single_token("</think>")) == think
    assert multi_token.single_token("</think>") is None

    def chat(processor: InputProcessor, thinking: bool | None) -> ChatRequest:
        request = pb.ChatCompletionRequest(
            messages=[chat_message({"role": "user", "content": "hi"})],
            response_format=pb.ResponseFormat(type="json_object"))
        if thinking is not None:
            request.chat_template_kwargs.update({"enable_thinking": thinking})
        return chat_to_engine_request(request, processor)

    # The prompt opens the block: the grammar waits for </think>. The prompt leaves it to
    # the model: its first token decides (<think> waits, anything else starts the grammar).
    for thinking, opened, waits_if_first in ((True, True, None), (None, False, think[0])):
        resolved = chat(inputs, thinking)
        spec = resolved.request.params.structured_output
        assert spec is not None
        assert (spec.starts_after, spec.waits_if_first) == ((think[1],), waits_if_first)
        assert resolved.reasoning == ReasoningPlan(enabled=True, opened=opened,
                                                   think_tokens=think)
    for resolved in (chat(inputs, False), chat(multi_token, True)):
        assert resolved.request.params.structured_output is not None
        assert resolved.request.params.structured_output.starts_after == ()
        assert not resolved.reasoning.enabled


# (opened, the output's tokens as text pieces, how many are the reasoning's)
TOKEN_CASES = [
    (False, ["<think>", "\n", "weigh", "</think>", "\n\n", "The", " answer."], 4),
    (False, ["<", "think", ">", "x", "</", "think", ">", "y"], 7),  # tags of several tokens
    (False, ["  ", "<think>", "x", "</think>", "y"], 4),  # the whitespace before the block
    (False, ["plain", " answer"], 0),
    (False, ["<thin", "g"], 0),  # looked like a tag, was not
    (True, ["still", " thinking"], 2),  # cut off inside the block
    (True, ["</think>", "Done"], 1),
]


@pytest.mark.parametrize(("opened", "pieces", "reasoning_tokens"), TOKEN_CASES)
@pytest.mark.parametrize("include", [True, False])
def test_the_usage_counts_the_reasoning_tokens(opened, pieces, reasoning_tokens, include):
    """completion_tokens_details.reasoning_tokens: the output tokens from the one that opens
    the block to the one that closes it, streamed or not, shown or left out alike."""
    deltas = [GenerationDelta(piece, [i], completion_tokens=i + 1)
              for i, piece in enumerate(pieces)]
    deltas.append(GenerationDelta("", [], finish_reason="stop", completion_tokens=len(pieces)))
    plan = ReasoningPlan(enabled=True, opened=opened, include=include)

    async def stream() -> AsyncIterator[ChoiceDelta]:
        for delta in deltas:
            yield ChoiceDelta(0, delta)

    async def usages() -> tuple[pb.Usage, pb.Usage]:
        chunks = [c async for c in chat_chunks(stream(), response_id="r", model="m",
                                               include_usage=True, reasoning=plan)]
        response = await chat_response(stream(), response_id="r", model="m", logprobs=False,
                                       reasoning=plan)
        return chunks[-1].usage, response.usage

    for usage in asyncio.run(usages()):
        assert usage.completion_tokens == len(pieces)
        assert usage.completion_tokens_details.reasoning_tokens == reasoning_tokens
    plain = ReasoningPlan()  # a template without a <think> block: no details at all
    response = asyncio.run(chat_response(stream(), response_id="r", model="m", logprobs=False,
                                         reasoning=plain))
    assert not response.usage.HasField("completion_tokens_details")
