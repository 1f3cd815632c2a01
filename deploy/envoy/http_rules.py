"""The HTTP rules of ``tandem.v1.Generation`` (its ``google.api.http`` annotations), read from
the descriptor set Envoy's transcoder is given, so that the routes and the Lua tables of the
edge follow the proto and are never kept by hand.

Owns reading the rules and turning a rule's path template into an Envoy path matcher. It
does not own the routes made from them (``deploy.envoy.routes``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.api import annotations_pb2
from google.protobuf import descriptor_pb2

GENERATION_SERVICE = "tandem.v1.Generation"
STREAM_VERB = ":stream"
# A template variable: {name} or {name=*} is one path segment, {name=**} the rest of the path.
_VARIABLE = re.compile(r"\{[A-Za-z_][A-Za-z0-9_.]*(=\*\*?)?\}")


@dataclass(frozen=True)
class HttpRule:
    method: str  # the HTTP method, upper case
    template: str  # the path template, e.g. /v1/responses/{response_id}
    body: str  # "*" when the whole JSON body is the request message, "" when there is none
    rpc: str  # the RPC it calls, e.g. tandem.v1.Generation/Complete

    @property
    def has_verb(self) -> bool:
        return ":" in self.template.rsplit("/", 1)[-1].split("}")[-1]


def read_http_rules(descriptor: Path | bytes,
                    service: str = GENERATION_SERVICE) -> list[HttpRule]:
    """Every HTTP rule of ``service`` (additional bindings included), in the proto's order."""
    data = descriptor if isinstance(descriptor, bytes) else Path(descriptor).read_bytes()
    descriptor_set = descriptor_pb2.FileDescriptorSet.FromString(data)
    rules: list[HttpRule] = []
    for file in descriptor_set.file:
        for entry in file.service:
            if f"{file.package}.{entry.name}" != service:
                continue
            for method in entry.method:
                if not method.options.HasExtension(annotations_pb2.http):
                    continue
                http = method.options.Extensions[annotations_pb2.http]
                for rule in [http, *http.additional_bindings]:
                    verb = rule.WhichOneof("pattern")
                    if verb is None or verb == "custom":
                        continue
                    rules.append(HttpRule(verb.upper(), getattr(rule, verb), rule.body,
                                          f"{service}/{method.name}"))
    if not rules:
        raise ValueError(f"the descriptor set has no HTTP rules for {service}")
    return rules


def json_body_paths(rules: Sequence[HttpRule]) -> list[str]:
    """The literal paths whose POST takes a JSON body (the whole request message)."""
    return [r.template for r in rules
            if r.method == "POST" and r.body == "*" and not _VARIABLE.search(r.template)]


def stream_paths(rules: Sequence[HttpRule]) -> dict[str, str]:
    """Each POST path that has a streaming twin (the same path with ``:stream``) -> the twin."""
    posts = {r.template for r in rules if r.method == "POST"}
    return {path: path + STREAM_VERB for path in sorted(posts)
            if path + STREAM_VERB in posts and not _VARIABLE.search(path)}


def path_match(template: str) -> dict[str, Any]:
    """The Envoy route match of a path template (matched without the query, as Envoy does):
    an exact path, or an RE2 expression where the template has variables."""
    if not _VARIABLE.search(template):
        return {"path": template}
    parts: list[str] = []
    position = 0
    for variable in _VARIABLE.finditer(template):
        parts.append(re.escape(template[position:variable.start()]))
        parts.append(".+" if variable.group(1) == "=**" else "[^/]+")
        position = variable.end()
    parts.append(re.escape(template[position:]))
    return {"safe_regex": {"regex": "".join(parts)}}
