"""Reasoning output: a thinking model's ``<think> ... </think>`` block apart from its answer.

Models such as Qwen3 and DeepSeek-R1 write their thinking inside ``<think>`` tags before the
answer. For a chat whose template knows those tags, the chat API returns the thinking as
``reasoning`` and the rest as ``content`` (vLLM's ``qwen3`` / ``deepseek_r1`` parsers and
field name). Where the block starts depends on the template: Qwen3's lets the model write
``<think>`` itself, DeepSeek-R1's (and Qwen3-Thinking's) ends the prompt with it already
open, and Qwen3's ``enable_thinking: false`` closes an empty block in the prompt. So the
rendered prompt says the state the output starts in.

Owns deciding whether a chat's output is parsed (``reasoning_plan``), where a constrained
output's grammar begins (after the ``</think>`` token, so the model thinks freely first; the
engine holds the grammar back, see ``StructuredOutputSpec``), and splitting the output,
whole or streamed; a whole text is split by streaming it in one piece, so a stream
always says what the response says. An unclosed block (the output ran out of tokens while thinking) is
all reasoning. It does not own tool calls, which are parsed from the content that follows.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.frontend.streamed_tags import partial_tag_length

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@dataclass(frozen=True)
class ReasoningPlan:
    """Whether a chat's output is split into reasoning and content, and how it starts."""

    # The template marks reasoning with <think> tags and nothing constrains the output.
    enabled: bool = False
    # The prompt ends inside an open <think> block: the output starts as reasoning.
    opened: bool = False
    # false: the reasoning is split off and dropped (the request's include_reasoning).
    include: bool = True
    # A constrained output (structured outputs, a forced tool call) whose grammar waits for
    # the end of thinking: the ids of the <think> and </think> tokens. None: no constraint,
    # or one that holds from the first token.
    think_tokens: tuple[int, int] | None = None

    def stream(self) -> ReasoningStream | None:
        return ReasoningStream(self.opened, self.include) if self.enabled else None

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning, content) of a whole output; reasoning None when there is none."""
        stream = self.stream()
        if stream is None:
            return None, text
        reasoning, content = stream.feed(text)
        rest_reasoning, rest_content = stream.finish()
        reasoning += rest_reasoning
        return reasoning or None, content + rest_content


def reasoning_plan(chat_template: object, rendered_prompt: str, constrained: bool,
                   include: bool = True,
                   think_tokens: tuple[int, int] | None = None) -> ReasoningPlan:
    """The plan for a chat rendered as ``rendered_prompt``.

    A constrained output (structured outputs, a forced tool call) of a model that may still
    think (the prompt has not closed a block) and whose tags are tokens of their own
    (``think_tokens``, as in Qwen3's and DeepSeek-R1's vocabularies) thinks freely and
    answers under the grammar from the token after ``</think>``, as vLLM does; where the
    prompt leaves it to the model to open the block, its first token decides. Otherwise the
    grammar holds from the first token and the output is all content."""
    if not isinstance(chat_template, str) or THINK_CLOSE not in chat_template:
        return ReasoningPlan()
    last_open, last_close = rendered_prompt.rfind(THINK_OPEN), rendered_prompt.rfind(THINK_CLOSE)
    opened = last_open > last_close
    if not constrained:
        return ReasoningPlan(enabled=True, opened=opened, include=include)
    if think_tokens is None or (last_close >= 0 and not opened):
        return ReasoningPlan()
    return ReasoningPlan(enabled=True, opened=opened, include=include,
                         think_tokens=think_tokens)


class ReasoningStream:
    """One streamed choice's text, split as it comes. Text that may be the start of a tag is
    held until the next piece (or the end) tells."""

    def __init__(self, opened: bool, include: bool = True):
        self._state = "reasoning" if opened else "start"
        self._held = ""
        self._include = include
        # The output tokens of the thinking, its tags' included (the usage's
        # reasoning_tokens), and those of text before it that may still open it.
        self.num_tokens = 0
        self._undecided_tokens = 0

    def feed(self, piece: str, num_tokens: int = 0) -> tuple[str, str]:
        """(reasoning, content) this piece lets the stream show now; ``num_tokens``: how
        many output tokens the piece is, counted as thinking if the block was open before
        the piece or opened in it (a piece that closes the block counts whole)."""
        was = self._state
        reasoning, content = self._split(piece)
        if "reasoning" in (was, self._state):
            self.num_tokens += self._undecided_tokens + num_tokens
            self._undecided_tokens = 0
        elif self._state == "start":
            self._undecided_tokens += num_tokens
        return (reasoning if self._include else ""), content

    def _split(self, piece: str) -> tuple[str, str]:
        text, self._held = self._held + piece, ""
        reasoning = ""
        if self._state == "start":
            lead = text.lstrip()
            if not lead or (THINK_OPEN.startswith(lead) and lead != THINK_OPEN):
                self._held = text  # whitespace, or maybe the opening tag: not yet known
                return "", ""
            if lead.startswith(THINK_OPEN):
                self._state, text = "reasoning", lead[len(THINK_OPEN):]
            else:
                self._state = "content"
        if self._state == "reasoning":
            end = text.find(THINK_CLOSE)
            if end < 0:
                keep = partial_tag_length(text, THINK_CLOSE)
                self._held = text[len(text) - keep:]
                return text[: len(text) - keep], ""
            reasoning, text = text[:end], text[end + len(THINK_CLOSE):]
            self._state = "content"
        return reasoning, text

    def finish(self) -> tuple[str, str]:
        """At the choice's end: what is still held, as (reasoning, content)."""
        held, self._held = self._held, ""
        if self._state != "reasoning":
            return "", held
        return (held if self._include else ""), ""
