"""Tags split across streamed pieces of text (``<think>``, ``<tool_call>``, ...).

A stream that parses tags out of a model's text must hold back an end of text that may be
the start of a tag, until the next piece says whether it is. Owns measuring that end; the
parsers that use it own their tags and states.
"""

from __future__ import annotations


def partial_tag_length(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could begin ``tag`` (0 if none)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
