"""OpenAI's Responses API (``/v1/responses``), served by the chat completions machinery.

Owns the translation both ways, and nothing else:

- in: ``chat_request`` turns a ``ResponseRequest`` into the ``ChatCompletionRequest`` that
  asks for the same thing (instructions as a system message, input items as messages,
  function call items as an assistant turn's ``tool_calls``, their outputs as tool turns,
  the flat function tools and ``tool_choice`` in the chat shape, ``text.format`` as
  ``response_format``, ``max_output_tokens`` as ``max_completion_tokens``), rejecting what
  cannot be served with a message that names the input field. Without ``max_output_tokens``
  a response gets the chat's default: the model's ``max_new_tokens`` (its
  generation_config.json, or ``--override-generation-config``), cut to the room the context
  leaves; a model that sets none runs to the context, as vLLM's chat does and as OpenAI's
  Responses API does (its only cap is the model's). A response cut there is ``incomplete``
  (``max_output_tokens``), as one cut by its own limit;
- out: ``response_events`` folds the chat chunks of that request into the Responses stream
  (``response.created`` ... ``response.completed``), building the ``Response`` as it goes:
  reasoning as a ``reasoning`` item, the text as a ``message`` item, each tool call as a
  ``function_call`` item; ``final_response`` is the last event's response, for the
  non-streaming call, so that both calls answer from the same code.

A request that continues a stored response (``previous_response_id``) gets that
conversation's items before its own (``history``, from ``response_store``); ``input_items``
and ``output_as_input`` give the items a response is stored and replayed as. Templates, tool
parsing, reasoning separation, structured output and validation of the chat request are
``openai_api``'s.
"""

from __future__ import annotations

import itertools
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

from google.protobuf import struct_pb2
from google.protobuf.json_format import MessageToDict, ParseDict

from protos.tandem.v1 import generation_pb2 as pb
from services.frontend.errors import InvalidArgument, quoted
from services.frontend.request_limits import MAX_MESSAGES
from services.frontend.tools.parsers import new_tool_call_id

_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
# The include value that asks for the output text's logprobs.
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# The chat finish reason that makes a response incomplete, and the reason OpenAI gives.
_CUT_BY_LIMIT = "length"
_INCOMPLETE_REASON = "max_output_tokens"
# The events that end a stream, carrying the finished response.
FINAL_EVENTS = frozenset({"response.completed", "response.incomplete"})


def new_response_id(responder: str = "") -> str:
    """A fresh id; ``responder`` (a replica's engine id, where the response is stored) is
    written into it, so that a picker in front of several replicas can send
    ``previous_response_id`` and ``GET /v1/responses/{id}`` to the one that has it."""
    suffix = f"_{responder}" if _RESPONDER.fullmatch(responder) else ""
    return f"resp_{uuid.uuid4().hex}{suffix}"


def responder_of(response_id: str) -> str:
    """The engine id ``new_response_id`` wrote into ``response_id`` ("" if none)."""
    match = _RESPONSE_ID.fullmatch(response_id)
    return match.group(1) if match else ""


# Engine ids that may stand in an id (a URL path segment): Kubernetes pod names, say.
_RESPONDER = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]{0,99}")
_RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}_(" + _RESPONDER.pattern + ")")


# --------------------------------------------------------------------------- requests in

# Chat options a Responses request carries under its own name, but resolved below, not copied:
# top_logprobs counts only with the include value that asks for logprobs.
_TRANSLATED = frozenset({"top_logprobs"})


def _optional_scalar(field: Any) -> bool:
    """``field`` (a protobuf FieldDescriptor, pure-Python or upb) is an optional scalar."""
    return field.has_presence and not field.is_repeated and field.message_type is None


def _copied_options() -> tuple[str, ...]:
    """The fields a Responses request and a chat request both carry as an optional scalar of
    the same name and type (the sampling knobs, parallel_tool_calls): copied as they stand
    where set. Read off the two messages, as ``request_params.SAMPLING_FIELDS`` is, so that a
    sampling field added to both needs no edit here."""
    chat = pb.ChatCompletionRequest.DESCRIPTOR.fields_by_name
    return tuple(
        field.name for field in pb.ResponseRequest.DESCRIPTOR.fields
        if field.name not in _TRANSLATED and field.name in chat
        and _optional_scalar(field) and _optional_scalar(chat[field.name])
        and chat[field.name].type == field.type)


COPIED_OPTIONS = _copied_options()



def chat_request(request: pb.ResponseRequest,
                 history: Sequence[struct_pb2.Value] = ()) -> pb.ChatCompletionRequest:
    """The chat completions request that asks what ``request`` asks, after the input items
    of ``history`` (the conversation of its previous response); raises InvalidArgument for
    what the Responses API allows and Tandem cannot serve."""
    chat = pb.ChatCompletionRequest(model=request.model, user=request.user,
                                    cache_salt=request.cache_salt, priority=request.priority)
    if request.instructions:
        chat.messages.add(role="system",
                          content=struct_pb2.Value(string_value=request.instructions))
    kind = request.input.WhichOneof("kind")
    if kind != "string_value" and (kind != "list_value" or not request.input.list_value.values):
        raise InvalidArgument("input must be a string or a non-empty list of input items "
                              '(messages like {"role": "user", "content": "..."}, '
                              "function_call and function_call_output items)")
    if kind == "list_value" and len(request.input.list_value.values) > MAX_MESSAGES:
        raise InvalidArgument(f"input holds {len(request.input.list_value.values):,} items; "
                              f"at most {MAX_MESSAGES:,} are allowed (continue a long "
                              "conversation with previous_response_id)")
    for i, item in enumerate(history):
        _add_item(chat, item, f"the conversation of previous_response_id, item {i}")
    for i, item in enumerate(input_items(request)):
        _add_item(chat, item, f"input[{i}]")
    if request.HasField("max_output_tokens"):
        chat.max_completion_tokens = request.max_output_tokens
    for name in COPIED_OPTIONS:
        if request.HasField(name):
            setattr(chat, name, getattr(request, name))
    for i, tool in enumerate(request.tools):
        if tool.type != "function":
            raise InvalidArgument(f"tools[{i}] has type {quoted(tool.type)}; Tandem serves "
                                  'function tools only ({"type": "function", "name": ..., '
                                  '"parameters": ...})')
        function = chat.tools.add(type="function").function
        function.name, function.description = tool.name, tool.description
        if tool.HasField("parameters"):
            function.parameters.CopyFrom(tool.parameters)
        if tool.HasField("strict"):
            function.strict = tool.strict
    if request.HasField("tool_choice"):
        chat.tool_choice.CopyFrom(_chat_tool_choice(request.tool_choice))
    if request.HasField("chat_template_kwargs"):
        chat.chat_template_kwargs.CopyFrom(request.chat_template_kwargs)
    if LOGPROBS_INCLUDE in request.include:
        chat.logprobs = True
        if request.HasField("top_logprobs"):
            chat.top_logprobs = request.top_logprobs
    _set_response_format(chat.response_format, request.text.format)
    chat.stream_options.include_usage = True
    return chat


def input_items(request: pb.ResponseRequest) -> list[struct_pb2.Value]:
    """The request's input as input items (a string as one user message)."""
    if request.input.WhichOneof("kind") == "string_value":
        return [ParseDict({"role": "user", "content": request.input.string_value},
                          struct_pb2.Value())]
    return list(request.input.list_value.values)


def output_as_input(output: Sequence[pb.ResponseOutputItem]) -> list[struct_pb2.Value]:
    """A response's output as the input items that replay it: a message as an assistant
    message, a function call as a function_call item; reasoning is left out, as chat
    templates drop an earlier turn's thinking."""
    items = []
    for item in output:
        if item.type == "message":
            value: dict[str, Any] = {
                "type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": "".join(p.text for p in item.content)}]}
        elif item.type == "function_call":
            value = {"type": "function_call", "call_id": item.call_id, "name": item.name,
                     "arguments": item.arguments}
        else:
            continue
        items.append(ParseDict(value, struct_pb2.Value()))
    return items


def _add_item(chat: pb.ChatCompletionRequest, value: struct_pb2.Value, where: str) -> None:
    if value.WhichOneof("kind") != "struct_value":
        raise InvalidArgument(f"{where} must be an object (an input item)")
    item = MessageToDict(value.struct_value)
    item_type = item.get("type", "message")
    if item_type == "message":
        _add_message(chat, item, where)
    elif item_type == "function_call":
        call_id, name, arguments = (_string(item, key, where)
                                    for key in ("call_id", "name", "arguments"))
        last = chat.messages[-1] if chat.messages else None
        # Calls right after an assistant message (or after each other) are that turn's.
        turn = (last if last is not None and last.role == "assistant"
                else chat.messages.add(role="assistant"))
        turn.tool_calls.add(id=call_id, type="function").function.CopyFrom(
            pb.FunctionCall(name=name, arguments=arguments))
    elif item_type == "function_call_output":
        output = item.get("output")
        chat.messages.add(
            role="tool", tool_call_id=_string(item, "call_id", where),
            content=struct_pb2.Value(string_value=output if isinstance(output, str)
                                     else _text_of(output, f"{where}.output")))
    elif item_type != "reasoning":  # an earlier turn's reasoning: not rendered
        raise InvalidArgument(
            f"{where} has type {quoted(item_type)}; Tandem reads messages, function_call and "
            "function_call_output items (continue a stored conversation with "
            "previous_response_id rather than item_reference)")


def _add_message(chat: pb.ChatCompletionRequest, item: dict[str, object], where: str) -> None:
    role = item.get("role")
    if role not in _ROLES:
        raise InvalidArgument(f"{where}.role must be one of {', '.join(_ROLES)}; "
                              f"got {quoted(role)}")
    content = item.get("content")
    text = content if isinstance(content, str) else _text_of(content, f"{where}.content")
    chat.messages.add(role=_ROLES[str(role)], content=struct_pb2.Value(string_value=text))


def _text_of(parts: object, where: str) -> str:
    """A list of text parts (input_text, output_text) as one string, joined with newlines."""
    if not isinstance(parts, list):
        raise InvalidArgument(f"{where} must be a string or a list of input_text parts")
    texts = []
    for j, part in enumerate(parts):
        part_type = part.get("type") if isinstance(part, dict) else None
        if part_type not in _TEXT_PARTS:
            raise InvalidArgument(f"{where}[{j}] has type {quoted(part_type)}; this model reads "
                                  'text only: every part must be {"type": "input_text", "text": ...}')
        texts.append(_string(part, "text", f"{where}[{j}]"))
    return "\n".join(texts)


def _string(item: dict[str, object], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidArgument(f"{where} needs a string {key!r}")
    return value


def _chat_tool_choice(choice: struct_pb2.Value) -> struct_pb2.Value:
    """The flat {"type": "function", "name": ...} as chat's nested one; strings as they are."""
    value = MessageToDict(choice)
    if isinstance(value, dict) and value.get("type") == "function" and "name" in value:
        value = {"type": "function", "function": {"name": value["name"]}}
    return ParseDict(value, struct_pb2.Value())


def _set_response_format(out: pb.ResponseFormat, text_format: pb.ResponseTextFormat) -> None:
    if text_format.type in ("", "text"):
        return
    if text_format.type not in ("json_object", "json_schema"):
        raise InvalidArgument('text.format.type must be "text", "json_object" or '
                              f'"json_schema"; got {quoted(text_format.type)}')
    out.type = text_format.type
    if text_format.type == "json_schema":
        if not text_format.HasField("schema"):
            raise InvalidArgument('text.format of type "json_schema" needs a schema')
        out.json_schema.name = text_format.name
        out.json_schema.description = text_format.description
        out.json_schema.schema.CopyFrom(text_format.schema)
        if text_format.HasField("strict"):
            out.json_schema.strict = text_format.strict


# --------------------------------------------------------------------------- responses out


def response_shell(request: pb.ResponseRequest, response_id: str, model: str,
                   store: bool) -> pb.Response:
    """The response before any output: in progress, the request's settings echoed;
    ``store``: it will be kept, as it says."""
    response = pb.Response(id=response_id, object="response", created_at=int(time.time()),
                           model=model, status="in_progress", tools=request.tools,
                           metadata=request.metadata, store=store,
                           background=request.background,
                           parallel_tool_calls=(request.parallel_tool_calls
                                                if request.HasField("parallel_tool_calls")
                                                else True))
    for name in ("max_output_tokens", "temperature", "top_p"):
        if request.HasField(name):
            setattr(response, name, getattr(request, name))
    if request.instructions:
        response.instructions = request.instructions
    if request.previous_response_id:
        response.previous_response_id = request.previous_response_id
    if request.HasField("tool_choice"):
        response.tool_choice.CopyFrom(request.tool_choice)
    response.text.format.CopyFrom(request.text.format)
    if not response.text.format.type:
        response.text.format.type = "text"
    return response


class _ResponseBuilder:
    """The response being built from chat deltas, and the events that announce each step.

    One item receives text or arguments at a time (the open one); a delta of another kind
    closes it and opens the next, as reasoning precedes the text and calls follow it."""

    def __init__(self, response: pb.Response, logprobs: bool = False) -> None:
        self.response = response
        self._logprobs = logprobs  # output_text parts and deltas carry logprobs
        self._sequence = itertools.count()
        self._open: int | None = None  # output index of the open item
        self._calls: dict[int, int] = {}  # chat tool-call index -> output index

    @property
    def open_type(self) -> str | None:
        """The type of the item receiving text or arguments, if one is open."""
        return None if self._open is None else self.response.output[self._open].type

    def event(self, kind: str, **fields: Any) -> pb.ResponseStreamEvent:
        return pb.ResponseStreamEvent(type=f"response.{kind}",
                                      sequence_number=next(self._sequence), **fields)

    def text(self, item_type: str, delta: str,
             logprobs: Sequence[pb.ChatTokenLogprob] = ()) -> list[pb.ResponseStreamEvent]:
        """``delta`` added to the open message or reasoning item (opened if need be), with
        its tokens' ``logprobs`` where the output text carries them."""
        events: list[pb.ResponseStreamEvent] = []
        if self.open_type != item_type:
            events += self.close()
            events += self._open_text_item(item_type)
        assert self._open is not None
        item = self.response.output[self._open]
        part = item.content[0]
        part.text += delta
        event = self.event(f"{part.type}.delta", item_id=item.id, output_index=self._open,
                           content_index=0, delta=delta)
        if part.HasField("logprobs"):
            entries = [_logprob(entry) for entry in logprobs]
            part.logprobs.extend(entries)
            event.logprobs.extend(entries)
        events.append(event)
        return events

    def _open_text_item(self, item_type: str) -> list[pb.ResponseStreamEvent]:
        prefix, part_type = ("msg", "output_text") if item_type == "message" \
            else ("rs", "reasoning_text")
        item = self.response.output.add(type=item_type, id=f"{prefix}_{uuid.uuid4().hex}",
                                        status="in_progress")
        if item_type == "message":
            item.role = "assistant"
        else:
            item.summary.SetInParent()
        self._open = len(self.response.output) - 1
        events = [self.event("output_item.added", output_index=self._open, item=item)]
        part = item.content.add(type=part_type)
        if self._logprobs and item_type == "message":
            part.logprobs.SetInParent()
        events.append(self.event("content_part.added", item_id=item.id,
                                 output_index=self._open, content_index=0, part=part))
        return events

    def call(self, delta: pb.ToolCallDelta) -> list[pb.ResponseStreamEvent]:
        """A piece of a tool call: the first of an index opens its function_call item."""
        events: list[pb.ResponseStreamEvent] = []
        if delta.index not in self._calls:
            events += self.close()
            item = self.response.output.add(
                type="function_call", id=f"fc_{uuid.uuid4().hex}", status="in_progress",
                call_id=delta.id or new_tool_call_id(), name=delta.function.name, arguments="")
            self._open = self._calls[delta.index] = len(self.response.output) - 1
            events.append(self.event("output_item.added", output_index=self._open, item=item))
        index = self._calls[delta.index]
        item = self.response.output[index]
        if delta.function.arguments:
            item.arguments += delta.function.arguments
            events.append(self.event("function_call_arguments.delta", item_id=item.id,
                                     output_index=index, delta=delta.function.arguments))
        return events

    def close(self, status: str = "completed") -> list[pb.ResponseStreamEvent]:
        """The open item finished: its done events."""
        if self._open is None:
            return []
        index, self._open = self._open, None
        item = self.response.output[index]
        item.status = status
        if item.type == "function_call":
            events = [self.event("function_call_arguments.done", item_id=item.id,
                                 output_index=index, arguments=item.arguments)]
        else:
            part = item.content[0]
            events = [self.event(f"{part.type}.done", item_id=item.id, output_index=index,
                                 content_index=0, text=part.text),
                      self.event("content_part.done", item_id=item.id, output_index=index,
                                 content_index=0, part=part)]
        events.append(self.event("output_item.done", output_index=index, item=item))
        return events


async def response_events(
    chunks: AsyncIterator[pb.ChatCompletionChunk], *, request: pb.ResponseRequest,
    shell: pb.Response,
) -> AsyncGenerator[pb.ResponseStreamEvent, None]:
    """The Responses stream of one chat stream (one choice, usage in its last chunk), the
    response growing from ``shell`` (``response_shell``)."""
    response = pb.Response()
    response.CopyFrom(shell)
    response.status = "in_progress"  # a background shell waits "queued" until now
    builder = _ResponseBuilder(response, logprobs=LOGPROBS_INCLUDE in request.include)
    response = builder.response
    yield builder.event("created", response=response)
    yield builder.event("in_progress", response=response)
    finish_reason = None
    # Logprobs of tokens whose text has not shown yet (an incomplete UTF-8 character).
    pending: list[pb.ChatTokenLogprob] = []
    async for chunk in chunks:
        if chunk.HasField("usage"):
            usage = chunk.usage
            response.usage.CopyFrom(pb.ResponseUsage(
                input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                total_tokens=usage.total_tokens,
                input_tokens_details=pb.ResponseInputTokensDetails(
                    cached_tokens=usage.prompt_tokens_details.cached_tokens),
                output_tokens_details=pb.ResponseOutputTokensDetails(
                    reasoning_tokens=usage.completion_tokens_details.reasoning_tokens)))
        for choice in chunk.choices:
            events: list[pb.ResponseStreamEvent] = []
            if choice.delta.reasoning:
                events += builder.text("reasoning", choice.delta.reasoning)
            if choice.HasField("logprobs"):
                pending.extend(choice.logprobs.content)
            if choice.delta.reasoning and not choice.delta.content:
                pending = []  # the thinking's tokens: not the output text's
            if choice.delta.content:
                events += builder.text("message", choice.delta.content, pending)
                pending = []
            for call in choice.delta.tool_calls:
                events += builder.call(call)
            if choice.HasField("finish_reason"):
                finish_reason = choice.finish_reason
            for event in events:
                yield event
    cut = finish_reason == _CUT_BY_LIMIT
    # Nothing was said (still one, empty, message), or the message's last tokens show no text.
    if not response.output or (pending and builder.open_type == "message"):
        for event in builder.text("message", "", pending):
            if event.type != "response.output_text.delta" or event.logprobs.values:
                yield event
    for event in builder.close("incomplete" if cut else "completed"):
        yield event
    response.status = "incomplete" if cut else "completed"
    if cut:
        response.incomplete_details.reason = _INCOMPLETE_REASON
    yield builder.event(response.status, response=response)


def _logprob(entry: pb.ChatTokenLogprob) -> struct_pb2.Struct:
    """A chat token logprob in the Responses shape (its text's UTF-8 bytes as well)."""
    value = struct_pb2.Struct()
    value.update({"token": entry.token, "logprob": entry.logprob,
                  "bytes": list(entry.token.encode()),
                  "top_logprobs": [{"token": top.token, "logprob": top.logprob,
                                    "bytes": list(top.token.encode())}
                                   for top in entry.top_logprobs]})
    return value


async def final_response(events: AsyncIterator[pb.ResponseStreamEvent]) -> pb.Response:
    """The response the last event carries (``CreateResponse``'s answer)."""
    last = None
    async for event in events:
        last = event
    assert last is not None and last.HasField("response")
    return last.response
