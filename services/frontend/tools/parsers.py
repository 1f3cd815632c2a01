"""Tool calls out of a model's own text, for ``tool_choice: "auto"`` (vLLM's tool parsers).

Under ``auto`` the model decides whether to call, and writes a call in its family's syntax,
which its chat template teaches it. Three syntaxes are read, each recognised in the template:

- Hermes (Qwen2.5, Qwen3, Hermes, many others; vLLM's ``hermes``): text, then
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks;
- Mistral (vLLM's ``mistral``): text, then ``[TOOL_CALLS]`` and either a JSON list of
  ``{"name": ..., "arguments": {...}}`` objects (Mistral 7B v0.3, Nemo, Small 2501) or, with
  tokenizers v11 on (Small 3.1 / 3.2, Magistral, Devstral), ``name[ARGS]{...}`` after each
  ``[TOOL_CALLS]`` (a ``[CALL_ID]...`` after the name is dropped). Those tags are special
  tokens: the request decodes with ``skip_special_tokens`` off (``openai_api``), and its ids
  are 9 letters and digits, the only ids Mistral's templates accept;
- Llama 3 JSON (Llama 3.1 / 3.2 / 3.3 Instruct; vLLM's ``llama3_json``): the whole answer is
  ``{"name": ..., "parameters": {...}}``, several joined by ``;``, maybe after
  ``<|python_tag|>``; an answer that does not begin with ``{`` is plain content.

All stream: the content up to the first call (never a piece of a tag), then each call's id
and name as soon as its ``"arguments":`` (or ``"parameters":``) is read, then its arguments
as the model writes them, holding back only what may be the call object's closing brace or
a closing tag. A call in another key order is parsed whole when it ends; one that is no call
is dropped. A choice that made no call shows its whole text as content at the end. The
arguments are the model's text: cut short when max_tokens cut the call, as OpenAI's may be.
A whole text is parsed by streaming it in one piece, so a stream says what the response says.

It does not own ``tools`` / ``tool_choice`` (``tool_calls``) or the response messages.
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass

from protos.tandem.v1 import generation_pb2 as pb
from services.frontend.streamed_tags import partial_tag_length

HERMES_FORMAT = "hermes"
MISTRAL_FORMAT = "mistral"
LLAMA3_JSON_FORMAT = "llama3_json"
CALL_FORMATS = (HERMES_FORMAT, MISTRAL_FORMAT, LLAMA3_JSON_FORMAT)
_MISTRAL_CALLS = "[TOOL_CALLS]"
_MISTRAL_ARGS = "[ARGS]"
_MISTRAL_CALL_ID = "[CALL_ID]"
_MISTRAL_ID_LENGTH = 9
_ID_ALPHABET = string.ascii_letters + string.digits
_HERMES_OPEN = "<tool_call>"
_HERMES_CLOSE = "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
# Llama 3.1-3.3's templates tell the model the call's shape in these words.
_LLAMA3_JSON_MARKER = '"parameters": dictionary of argument name and its value'
# A call's JSON as models write it, up to where its arguments begin: their text can then be
# streamed as it comes.
_HEADER = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
# The end of a call's text that may be the object's closing brace (and the space around it),
# not its arguments: held back until what follows says.
_CLOSING_BRACE = re.compile(r"(\s*\})?\s*$")


def chat_template_call_format(chat_template: object) -> str | None:
    """The tool-call syntax a chat template teaches its model, or None (none Tandem reads)."""
    if not isinstance(chat_template, str):
        return None
    if _HERMES_OPEN in chat_template:
        return HERMES_FORMAT
    if _MISTRAL_CALLS in chat_template:
        return MISTRAL_FORMAT
    if _LLAMA3_JSON_MARKER in chat_template:
        return LLAMA3_JSON_FORMAT
    return None


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def new_mistral_call_id() -> str:
    """Nine letters and digits: Mistral's chat templates refuse any other call id."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(_MISTRAL_ID_LENGTH))


def mistral_call_id(call_id: str) -> str:
    """An earlier turn's call id as Mistral's templates accept it: its last nine letters
    and digits (vLLM truncates the same way), zero-padded when it has fewer, so that a call
    and its result still pair up."""
    kept = "".join(c for c in call_id if c in _ID_ALPHABET)[-_MISTRAL_ID_LENGTH:]
    return kept.rjust(_MISTRAL_ID_LENGTH, "0")


@dataclass
class _OpenCall:
    """The call being read: where its arguments begin in its text, what was streamed."""

    index: int
    arguments_at: int
    streamed: str = ""


class CallStream:
    """One choice's text turned into content and tool-call deltas as it comes; a format's
    subclass finds where calls begin and end, this class reads each call's text."""

    # The tag that ends a call's text, of which a partial end is held back ("": none).
    closing_tag = ""

    @staticmethod
    def new_id() -> str:
        return new_tool_call_id()

    def __init__(self) -> None:
        self.text = ""
        self.num_calls = 0
        self._shown = 0  # content characters shown
        self._call: _OpenCall | None = None

    def feed(self, piece: str) -> tuple[str, list[pb.ToolCallDelta]]:
        """The content and the call deltas this piece lets the stream show now."""
        self.text += piece
        return self._advance(final=False)

    def finish(self) -> tuple[str, list[pb.ToolCallDelta]]:
        """At the choice's end: what is still to show (with no call made, all the text not
        shown yet, tags and all, as content)."""
        content, deltas = self._advance(final=True)
        if not self.num_calls:
            content, self._shown = content + self.text[self._shown:], len(self.text)
        return content, deltas

    def split(self, text: str) -> tuple[str | None, list[pb.ToolCall]]:
        """A whole text as (content, calls): this stream fed it in one piece. The content is
        None when there are calls and nothing before them."""
        content, deltas = self.feed(text)
        rest, more = self.finish()
        calls: list[pb.ToolCall] = []
        for delta in deltas + more:
            if delta.index == len(calls):
                calls.append(pb.ToolCall(id=delta.id, type=delta.type,
                                         function=pb.FunctionCall(name=delta.function.name)))
            calls[delta.index].function.arguments += delta.function.arguments
        content += rest
        return (content or None) if calls else content, calls

    def _advance(self, final: bool) -> tuple[str, list[pb.ToolCallDelta]]:
        raise NotImplementedError

    def _end_call(self) -> None:
        self._call = None

    def _read_call(self, body: str, closed: bool) -> list[pb.ToolCallDelta]:
        """The deltas of the call whose text so far is ``body``; ``closed``: it is whole."""
        deltas: list[pb.ToolCallDelta] = []
        if self._call is None:
            header = _HEADER.match(body)
            name = _json_string(header.group(1)) if header else None
            if header is None or name is None:
                return self._whole_call(body) if closed else []
            self._call = _OpenCall(self.num_calls, header.end())
            self.num_calls += 1
            deltas.append(pb.ToolCallDelta(
                index=self._call.index, id=self.new_id(), type="function",
                function=pb.FunctionCallDelta(name=name)))
        call = self._call
        # The header's match may end before the space that follows "arguments": in a later
        # piece: the arguments begin at their first non-space character.
        arguments = body[call.arguments_at:].lstrip()
        if closed:
            shown = _final_arguments(arguments)
        elif arguments.startswith('"'):
            shown = ""  # arguments as a JSON string: decoded when the call ends
        elif (whole := _whole_json_value(arguments)) is not None:
            shown = whole  # not the keys that may follow it (Mistral v0.3 writes "id" last)
        else:
            held = partial_tag_length(arguments, self.closing_tag) if self.closing_tag else 0
            visible = arguments[:len(arguments) - held]
            brace = _CLOSING_BRACE.search(visible)
            shown = visible[:brace.start()] if brace else visible
        if len(shown) > len(call.streamed) and shown.startswith(call.streamed):
            deltas.append(pb.ToolCallDelta(index=call.index, function=pb.FunctionCallDelta(
                arguments=shown[len(call.streamed):])))
            call.streamed = shown
        return deltas

    def _whole_call(self, body: str) -> list[pb.ToolCallDelta]:
        """A whole call not in the streamable shape: a call if it parses as one."""
        try:
            call = json.loads(body)
            name = call["name"]
            arguments = call.get("arguments", call.get("parameters", {}))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            return []
        if not isinstance(name, str):
            return []
        index, self.num_calls = self.num_calls, self.num_calls + 1
        return [pb.ToolCallDelta(index=index, id=self.new_id(), type="function",
                                 function=pb.FunctionCallDelta(name=name, arguments=(
                                     arguments if isinstance(arguments, str)
                                     else json.dumps(arguments, ensure_ascii=False))))]


class HermesStream(CallStream):
    """Content, then ``<tool_call>...</tool_call>`` blocks (text between blocks is dropped)."""

    closing_tag = _HERMES_CLOSE

    def __init__(self) -> None:
        super().__init__()
        self._in_calls = False  # a <tool_call> was seen: no more content
        self._block: int | None = None  # where the open block's text begins
        self._scan = 0  # where to look for the next block

    def _advance(self, final: bool) -> tuple[str, list[pb.ToolCallDelta]]:
        text, content = self.text, ""
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
            deltas += self._read_call(body, closed=close >= 0 or final)
            if close < 0:
                return content, deltas
            self._block, self._scan = None, close + len(_HERMES_CLOSE)
            self._end_call()


class _JsonObjectsStream(CallStream):
    """Calls written as JSON objects one after another, with ``separators`` (and space)
    between them, read from ``_scan`` on."""

    separators = ""

    def __init__(self) -> None:
        super().__init__()
        self._object: int | None = None  # where the open call object begins
        self._scan = 0  # where to look for the next object

    def _read_objects(self, final: bool) -> list[pb.ToolCallDelta]:
        text = self.text
        deltas: list[pb.ToolCallDelta] = []
        while True:
            if self._object is None:
                start = self._scan
                while start < len(text) and (text[start].isspace()
                                             or text[start] in self.separators):
                    start += 1
                if start >= len(text) or text[start] != "{":
                    return deltas  # more to come, the end, or no call: nothing more to read
                self._object = start
            try:
                _, end = json.JSONDecoder().raw_decode(text, self._object)
            except json.JSONDecodeError:
                end = None
            body = text[self._object:] if end is None else text[self._object:end]
            deltas += self._read_call(body, closed=end is not None or final)
            if end is None:
                return deltas
            self._object, self._scan = None, end
            self._end_call()


class Llama3JsonStream(_JsonObjectsStream):
    """An answer that is ``{"name": ..., "parameters": ...}`` objects joined by ``;`` (maybe
    after ``<|python_tag|>``), or else plain content."""

    separators = ";"

    def __init__(self) -> None:
        super().__init__()
        self._mode = "undecided"  # then "content" or "calls"

    def _advance(self, final: bool) -> tuple[str, list[pb.ToolCallDelta]]:
        text = self.text
        deltas: list[pb.ToolCallDelta] = []
        if self._mode == "undecided":
            lead = text.lstrip()
            lead = lead[len(_PYTHON_TAG):].lstrip() if lead.startswith(_PYTHON_TAG) else lead
            if not lead or (_PYTHON_TAG.startswith(lead) and lead != _PYTHON_TAG):
                return "", deltas  # whitespace, or maybe the tag: not yet known
            if lead.startswith("{"):
                self._mode, self._scan = "calls", len(text) - len(lead)
            else:
                self._mode = "content"
        if self._mode == "content":
            content, self._shown = text[self._shown:], len(text)
            return content, deltas
        return "", self._read_objects(final)


class MistralStream(_JsonObjectsStream):
    """Content, then ``[TOOL_CALLS]`` and a JSON list of calls, or ``name[ARGS]arguments``
    after each ``[TOOL_CALLS]``; the first tag decides which."""

    separators = ","  # the list's; its closing "]" ends the reading

    def __init__(self) -> None:
        super().__init__()
        self._mode = "content"  # then "deciding", and "list" or "args"

    @staticmethod
    def new_id() -> str:
        return new_mistral_call_id()

    def _advance(self, final: bool) -> tuple[str, list[pb.ToolCallDelta]]:
        text, content = self.text, ""
        if self._mode == "content":
            start = text.find(_MISTRAL_CALLS, self._shown)
            if start < 0:
                end = len(text) if final else len(text) - partial_tag_length(text, _MISTRAL_CALLS)
                content, self._shown = text[self._shown:end], max(self._shown, end)
                return content, []
            content, self._shown = text[self._shown:start], start
            self._mode, self._scan = "deciding", start + len(_MISTRAL_CALLS)
        if self._mode == "deciding":
            lead = text[self._scan:].lstrip()
            if not lead:
                return content, []
            if lead.startswith("["):
                self._mode, self._scan = "list", len(text) - len(lead) + 1
            else:
                self._mode = "args"
        calls = self._read_objects(final) if self._mode == "list" else self._advance_args(final)
        return content, calls

    def _advance_args(self, final: bool) -> list[pb.ToolCallDelta]:
        text = self.text
        deltas: list[pb.ToolCallDelta] = []
        while True:
            if self._call is None:
                args_at = text.find(_MISTRAL_ARGS, self._scan)
                if args_at < 0:
                    return deltas  # the name is still coming (or the text ended without one)
                name = text[self._scan:args_at].split(_MISTRAL_CALL_ID)[0].strip()
                self._call = _OpenCall(self.num_calls, args_at + len(_MISTRAL_ARGS))
                self.num_calls += 1
                deltas.append(pb.ToolCallDelta(
                    index=self._call.index, id=self.new_id(), type="function",
                    function=pb.FunctionCallDelta(name=name)))
            call = self._call
            next_tag = text.find(_MISTRAL_CALLS, call.arguments_at)
            end = next_tag if next_tag >= 0 else len(text)
            if next_tag < 0 and not final:
                end -= partial_tag_length(text, _MISTRAL_CALLS)
            # Space around the arguments is not theirs: held back until more text follows.
            shown = text[call.arguments_at:end].strip()
            if len(shown) > len(call.streamed) and shown.startswith(call.streamed):
                deltas.append(pb.ToolCallDelta(index=call.index, function=pb.FunctionCallDelta(
                    arguments=shown[len(call.streamed):])))
                call.streamed = shown
            if next_tag < 0:
                return deltas
            self._scan = next_tag + len(_MISTRAL_CALLS)
            self._end_call()


def call_stream(call_format: str) -> CallStream:
    """A fresh parser of one choice's text in ``call_format``."""
    if call_format == LLAMA3_JSON_FORMAT:
        return Llama3JsonStream()
    if call_format == MISTRAL_FORMAT:
        return MistralStream()
    return HermesStream()


def _json_string(escaped: str) -> str | None:
    """The text of a JSON string's inside (escapes decoded); None if it is not one."""
    try:
        value = json.loads(f'"{escaped}"')
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, str) else None


def _whole_json_value(text: str) -> str | None:
    """The JSON value ``text`` begins with, as written, once it is whole (None before)."""
    try:
        _, end = json.JSONDecoder().raw_decode(text)
    except json.JSONDecodeError:
        return None
    return text[:end]


def _final_arguments(text: str) -> str:
    """A finished (or cut-off) call's arguments from the text after ``"arguments":``: the
    JSON value, without what follows it (the call object's closing brace, keys after the
    arguments), a JSON string decoded, or the text as it is when it is not JSON (cut
    short)."""
    whole = _whole_json_value(text)
    if whole is None:
        return text
    value = json.loads(whole)
    return value if isinstance(value, str) else whole
