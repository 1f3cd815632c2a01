"""The Lua scripts of the HTTP edge (``openai_edge.lua``, ``stream_route.lua``: package data),
as the text Envoy runs: the file after a prelude of ``local`` definitions the renderer
computes (limits, and tables read from the proto's HTTP rules).

The scripts are inlined into the bootstrap rather than referenced by file name, so that a
bootstrap is one self-contained file (a Kubernetes ConfigMap, the official Envoy image).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from importlib import resources

PACKAGE = "deploy.envoy"
LuaValue = int | str | Mapping[str, str | bool]


def _literal(value: LuaValue) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        # A JSON string of ASCII is a Lua string literal (ensure_ascii escapes the rest
        # as \uXXXX, which Lua 5.1 would not read: refuse those).
        if not value.isascii():
            raise ValueError(f"Lua prelude strings must be ASCII: {value!r}")
        return json.dumps(value)
    entries = ", ".join(f"[{_literal(key)}] = {_literal(item)}"
                        for key, item in sorted(value.items()))
    return "{" + entries + "}"


def lua_script(name: str, prelude: Mapping[str, LuaValue]) -> str:
    """The script ``name`` (a file of this package) with ``prelude``'s entries defined before
    it as locals."""
    body = resources.files(PACKAGE).joinpath(name).read_text(encoding="utf-8")
    lines = [f"local {key} = {_literal(value)}" for key, value in prelude.items()]
    return "-- Set by deploy/envoy_config.py:\n" + "\n".join(lines) + "\n\n" + body
