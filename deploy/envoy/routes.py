"""The routes of the edge's one virtual host, in the order Envoy tries them.

- ``GET /version``: Tandem's version, answered by Envoy. (``/health`` and ``/ping`` never
  reach a route: the ``health_check`` filter answers them.)
- ``GET /metrics``: the Prometheus text of the metrics upstream (the gateway's, or the
  picker's), when one is given.
- Every HTTP rule of ``tandem.v1.Generation`` (read from the descriptor set), for its own
  method only, to the upstream; any other method on its path is a 405 naming the allowed
  ones in ``Allow``.
- The gRPC services, for gRPC requests (``content-type: application/grpc...``) only; anything
  else on their paths is a 415.
- Anything else: a 404 listing what is served.

A request that Envoy answers itself is never shown to the endpoint picker, and the answers
are OpenAI-shaped JSON with fixed texts (no part of the request is echoed). It does not own
the filters (``deploy.envoy_config``) or reading the rules (``deploy.envoy.http_rules``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from deploy.envoy.http_rules import HttpRule, path_match

API_KEY_FILTER = "envoy.filters.http.api_key_auth"
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
HEALTH_SERVICE = "grpc.health.v1.Health"
GRPC_SERVICES = ("tandem.v1.Generation", HEALTH_SERVICE,
                 "grpc.reflection.v1alpha.ServerReflection", "grpc.reflection.v1.ServerReflection")
PROBE_PATHS = ("/health", "/ping")
GRPC_CONTENT_TYPE = "application/grpc"
# gRPC proper (application/grpc, application/grpc+proto; parameters after ";"), never gRPC-Web
# (application/grpc-web...): the servers behind speak only gRPC, and a gRPC-Web request
# forwarded to them came back as a 503. It gets the 415 below.
GRPC_CONTENT_TYPE_REGEX = r"application/grpc(\+[A-Za-z0-9._-]+)?(\s*;.*)?"

# Only requests that never reached the upstream are tried again: a refused connection, a
# stream the upstream refused unprocessed (HTTP/2 REFUSED_STREAM), a reset before the request
# was sent. A request the upstream received is never sent twice: it may have started a
# generation, and one that crashed the gateway would crash the restarted gateway too.
RETRY_ON = "connect-failure,refused-stream,reset-before-request"
# Before each try Envoy waits a random time below an interval that doubles from the base up to
# the max: with these, half a second on average, so N retries span about N / 2 seconds.
RETRY_BACK_OFF = {"base_interval": "0.5s", "max_interval": "1s"}
# ~20 s: time for a supervisor to restart a gateway (which takes seconds to start); a request
# to a gateway that stays down gets its 503 after that.
DEFAULT_UPSTREAM_RETRIES = 40


@dataclass(frozen=True)
class RouteTargets:
    """Where the routes send what they forward."""

    cluster: str  # the gRPC upstream: the gateway, a replica, or the picked replica
    retries: int  # how often to retry what never reached it (0 for a replica the picker named)
    metrics_cluster: str | None  # serves /metrics (plain HTTP); None: no /metrics
    version: str  # Tandem's version, for /version


def _disabled(*filters: str) -> dict[str, Any]:
    """Per-route config turning off ``filters`` (no-ops for filters not in the chain)."""
    return {name: {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig",
                   "disabled": True} for name in filters}


def _error_body(status: int, message: str, error_type: str) -> str:
    return json.dumps({"error": {"message": message, "type": error_type, "param": None,
                                 "code": None}}, separators=(",", ":"))


def _answer(match: dict[str, Any], status: int, body: str,
            headers: dict[str, str] | None = None, *, open_to_all: bool = False
            ) -> dict[str, Any]:
    """A route Envoy answers itself with ``body`` (JSON); ``open_to_all``: no API key."""
    route: dict[str, Any] = {
        "match": match,
        "direct_response": {"status": status, "body": {"inline_string": body}},
        "response_headers_to_add": [
            {"header": {"key": key, "value": value}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
            for key, value in {"content-type": "application/json", **(headers or {})}.items()],
        "typed_per_filter_config": _disabled(
            EXT_PROC_FILTER, *([API_KEY_FILTER] if open_to_all else [])),
    }
    return route


def _method_is(method: str) -> dict[str, Any]:
    return {"name": ":method", "string_match": {"exact": method}}


def _forward(targets: RouteTargets) -> dict[str, Any]:
    forward: dict[str, Any] = {"cluster": targets.cluster, "timeout": "0s"}  # streams run long
    if targets.retries:
        forward["retry_policy"] = {"retry_on": RETRY_ON, "num_retries": targets.retries,
                                   "retry_back_off": dict(RETRY_BACK_OFF)}
    return forward


def _method_not_allowed(template: str, methods: Sequence[str]) -> dict[str, Any]:
    allowed = ", ".join(methods)
    return _answer(path_match(template), 405, _error_body(
        405, f"{template} takes {allowed} only", "invalid_request_error"), {"allow": allowed})


def _openai_routes(rules: Sequence[HttpRule], targets: RouteTargets) -> list[dict[str, Any]]:
    templates: dict[str, list[str]] = {}
    for rule in rules:
        templates.setdefault(rule.template, [])
        if rule.method not in templates[rule.template]:
            templates[rule.template].append(rule.method)
    # A template with a verb (/v1/responses/{id}:stream) before the one it extends.
    ordered = sorted(templates, key=lambda t: not HttpRule("", t, "", "").has_verb)
    routes: list[dict[str, Any]] = []
    for template in ordered:
        routes += [{"match": {**path_match(template), "headers": [_method_is(method)]},
                    "route": _forward(targets)} for method in templates[template]]
        routes.append(_method_not_allowed(template, templates[template]))
    return routes


def _grpc_routes(targets: RouteTargets) -> list[dict[str, Any]]:
    routes: list[dict[str, Any]] = []
    for service in GRPC_SERVICES:
        route: dict[str, Any] = {
            "match": {"prefix": f"/{service}/", "headers": [
                {"name": "content-type", "string_match": {"safe_regex": {
                    "regex": GRPC_CONTENT_TYPE_REGEX}}}]},
            "route": _forward(targets),
            # Transcoded requests carried their HTTP path here; the gRPC servers count it
            # against their metadata limit and nothing reads it.
            "request_headers_to_remove": ["x-envoy-original-path"],
        }
        if service == HEALTH_SERVICE:
            route["typed_per_filter_config"] = _disabled(API_KEY_FILTER)  # probes carry no key
        routes.append(route)
    routes += [_answer({"prefix": f"/{service}/"}, 415, _error_body(
        415, f"/{service}/ is a gRPC service: call it with a gRPC client (content-type "
             f"{GRPC_CONTENT_TYPE}); OpenAI-style JSON goes to the /v1/ paths",
        "invalid_request_error")) for service in GRPC_SERVICES]
    return routes


def _served_paths(rules: Sequence[HttpRule], metrics: bool) -> str:
    paths = list(dict.fromkeys(re.sub(r"=\*\*?\}", "}", r.template) for r in rules
                               if not r.has_verb))
    extras = [*PROBE_PATHS, "/version", *(["/metrics"] if metrics else [])]
    return ", ".join(paths + extras)


def _tandem_routes(targets: RouteTargets) -> list[dict[str, Any]]:
    version = json.dumps({"version": targets.version})
    routes = [
        _answer({"path": "/version", "headers": [_method_is("GET")]}, 200, version,
                open_to_all=True),
        _method_not_allowed("/version", ["GET"]),
    ]
    if targets.metrics_cluster is None:
        routes.append(_answer({"path": "/metrics"}, 404, _error_body(
            404, "no metrics upstream is configured for this Envoy (deploy.envoy_runner "
                 "--upstream-metrics HOST:PORT, e.g. the gateway's --metrics-port)",
            "not_found_error")))
    else:
        routes += [
            {"match": {"path": "/metrics", "headers": [_method_is("GET")]},
             "route": {"cluster": targets.metrics_cluster, "timeout": "10s"},
             "typed_per_filter_config": _disabled(EXT_PROC_FILTER)},
            _method_not_allowed("/metrics", ["GET"]),
        ]
    return routes


def edge_routes(rules: Sequence[HttpRule], targets: RouteTargets) -> list[dict[str, Any]]:
    """Every route of the virtual host, a 404 last."""
    not_found = _error_body(404, "no such endpoint; Tandem serves " + _served_paths(
        rules, targets.metrics_cluster is not None), "not_found_error")
    return [*_tandem_routes(targets), *_openai_routes(rules, targets), *_grpc_routes(targets),
            _answer({"prefix": "/"}, 404, not_found)]
