"""What a request asks its output to follow, as the engine receives it.

Owns ``StructuredOutputSpec`` (one kind of constraint and its text) and the checks that need no
tokenizer: a known kind, a JSON schema or choice list that parses. It does not own compiling
the grammar or enforcing it while sampling (``grammar``), nor the public API's field names
(``services.replica.openai_api`` maps OpenAI's ``response_format`` and vLLM's
``structured_outputs`` onto it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal, cast, get_args

StructuredOutputKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = get_args(StructuredOutputKind)


class StructuredOutputError(ValueError):
    """A constraint that cannot be compiled or makes no sense; the message says why."""


@dataclass(frozen=True)
class StructuredOutputSpec:
    """``kind`` and its ``value``: a JSON schema as JSON text, nothing for ``json_object``, a
    regular expression, a JSON list of strings for ``choice``, or an EBNF grammar.

    ``starts_after``: token ids after which, once the output has them in a row, the
    constraint begins (a reasoning model's end-of-thinking token: it thinks freely, then
    answers under the grammar, as vLLM does); empty: from the first output token.
    ``waits_if_first``: with ``starts_after``, the wait is the output's choice: a first token
    of this id (the start-of-thinking token) makes the grammar wait, any other starts it at
    once (the first token may be the grammar's or this one); None: it waits from the start.
    """

    kind: StructuredOutputKind
    value: str = ""
    starts_after: tuple[int, ...] = ()
    waits_if_first: int | None = None

    @classmethod
    def parse(cls, kind: str, value: str, starts_after: tuple[int, ...] = (),
              waits_if_first: int | None = None) -> StructuredOutputSpec:
        """Checks ``kind`` and the shape of ``value``; raises StructuredOutputError."""
        if kind not in KINDS:
            raise StructuredOutputError(
                f"unknown structured output kind {kind!r}; use one of {', '.join(KINDS)}")
        spec = cls(cast(StructuredOutputKind, kind), value, tuple(starts_after),
                   waits_if_first if starts_after else None)
        if kind == "json_schema":
            try:
                schema = json.loads(value)
            except json.JSONDecodeError as error:
                raise StructuredOutputError(f"the JSON schema is not valid JSON: {error}") \
                    from error
            if not isinstance(schema, dict | bool):
                raise StructuredOutputError("a JSON schema must be an object")
        elif kind == "choice":
            choices = spec.choices()
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise StructuredOutputError("choice must be a non-empty list of non-empty strings")
        elif kind in ("regex", "grammar") and not value:
            raise StructuredOutputError(f"the {kind} is empty")
        return spec

    def choices(self) -> list[str]:
        try:
            parsed = json.loads(self.value)
        except json.JSONDecodeError:
            return []
        return parsed if isinstance(parsed, list) else []
