"""Property-based fuzzing of every HTTP route Envoy serves for ``tandem.v1.Generation``.

Each route of Envoy's transcoder (completions, chat, responses and their ids, models,
tokenize, detokenize, LoRA loading) gets hostile requests (``tests.fuzz_requests``): valid
bodies with fields made hostile or of the wrong JSON type, deep nesting, huge strings,
invalid UTF-8, bytes that are no JSON; hostile ids in the path and hostile query strings on
the GET and DELETE routes. Every answer must be a 2xx or a 4xx with a bounded body (never a
5xx), no process may die, and afterwards the replicas are idle as before and a normal request
is served (``tests.fuzz_stack``). The routes' methods are right: what Envoy answers to a wrong
method or an oversized URL is the edge's (``test_envoy_e2e``).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz_requests import (
    FUZZ_SETTINGS,
    TIMEOUT_S,
    Route,
    as_json,
    http_bodies,
    http_ids,
    http_routes,
    mutated,
)
from tests.fuzz_stack import Baseline, assert_alive, assert_whole
from tests.openai_http import Stack

pytestmark = pytest.mark.timeout(TIMEOUT_S)

# An error's body: OpenAI's error object around a status message of at most 1 KiB.
MAX_ERROR_BODY_BYTES = 4096


@pytest.fixture(scope="module")
def baseline(openai_stack: Stack) -> Iterator[Baseline]:
    yield Baseline.of(openai_stack)


def send(stack: Stack, verb: str, path: str, body: bytes | None) -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{stack.http_port}{path}", data=body,
                                     method=verb,
                                     headers={"Content-Type": "application/json"} if body
                                     is not None else {})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as error:
        with error:
            return error.code, error.read()


def _query(values: dict[str, Any]) -> str:
    """A query string of a request's scalar fields (lists repeat the key)."""
    pairs = []
    for key, value in values.items():
        for item in value if isinstance(value, list) else [value]:
            if not isinstance(item, dict | list):
                pairs.append((key, json.dumps(item) if not isinstance(item, str) else item))
    return urllib.parse.urlencode(pairs)[:4000]


def hostile_call(route: Route) -> st.SearchStrategy[tuple[str, bytes | None]]:
    """A path (an id filled in, a query for the methods without a body) and a body."""
    if route.verb == "POST" and route.id_field is None:
        return http_bodies(route).map(lambda body: (route.path, body))
    ids = http_ids().map(lambda value: urllib.parse.quote(value, safe=""))
    fields = mutated(route.rpc).map(as_json)
    garbage = st.text(max_size=200).map(lambda text: urllib.parse.quote(text, safe="=&"))
    query = st.one_of(fields.map(_query), garbage)
    return st.tuples(ids, query).map(
        lambda pair: (route.path.replace("{}", pair[0] or "x") + f"?{pair[1]}", None))


def test_every_route_answers_hostile_requests_with_a_4xx(openai_stack: Stack,
                                                        baseline: Baseline) -> None:
    @FUZZ_SETTINGS
    @given(st.data())
    def fuzz(data: st.DataObject) -> None:
        route = data.draw(st.sampled_from(http_routes()), label="route")
        path, body = data.draw(hostile_call(route), label="path and body")
        status, answer = send(openai_stack, route.verb, path, body)
        assert status < 500, f"{route.verb} {path[:200]} answered {status}: {answer[:500]!r}"
        if status >= 400:
            assert len(answer) <= MAX_ERROR_BODY_BYTES, (
                f"{route.verb} {path[:200]} answered a {len(answer)}-byte error")
        assert_alive(openai_stack)

    fuzz()
    assert_whole(openai_stack, baseline)
