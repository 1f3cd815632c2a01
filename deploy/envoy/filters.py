"""The HTTP filters of the edge, one function each, and the order they run in.

A request passes, in order:

1. ``openai_edge.lua``: size limits (414, 431), the API key's scheme, HTTP vs gRPC, a JSON
   body's content type (415), query lists; on the way back, OpenAI-shaped errors.
2. ``health_check``: answers ``/health`` and ``/ping`` itself, 200 while the upstream cluster's
   host passes Envoy's active gRPC health check, else 503 (before the API key: probes carry
   none).
3. ``api_key_auth`` (only with API keys; ``deploy.envoy_config.with_api_keys`` inserts it).
4. ``json_to_metadata``: parses a JSON body and puts its top-level ``stream`` under
   ``tandem.openai/body_stream`` (after the key check: no parsing for strangers).
5. ``stream_route.lua``: ``"stream": true`` moves the request to its ``:stream`` RPC.
6. ``ext_proc`` (the endpoint picker variant only): where the request goes.
7. ``grpc_json_transcoder``, then the router.

It does not own the routes (``deploy.envoy.routes``) or listeners and clusters
(``deploy.envoy_config``).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from deploy.envoy.http_rules import HttpRule, json_body_paths, stream_paths
from deploy.envoy.lua import lua_script
from deploy.envoy.routes import API_KEY_FILTER, EXT_PROC_FILTER, PROBE_PATHS

EDGE_LUA_FILTER = "envoy.filters.http.lua"
HEALTH_CHECK_FILTER = "envoy.filters.http.health_check"
JSON_TO_METADATA_FILTER = "envoy.filters.http.json_to_metadata"
STREAM_LUA_FILTER = "tandem.stream_route"  # a second Lua filter needs a name of its own
TRANSCODER_FILTER = "envoy.filters.http.grpc_json_transcoder"
ROUTER_FILTER = "envoy.filters.http.router"
LUA_NAMESPACE = "tandem.openai"
GENERATION_SERVICE = "tandem.v1.Generation"
# A request body Envoy buffers whole (the JSON parse, the endpoint picker); the gRPC
# servers' own receive limit.
MAX_REQUEST_BYTES = 4 * 1024 * 1024
# What the edge accepts and forwards: the gRPC servers behind accept 8 KiB of metadata
# (gRPC's default), the headers Envoy forwards are these plus ~0.5 KiB of its own, and a
# transcoded request's URL is not forwarded (its path becomes the RPC's).
MAX_URL_BYTES = 8192
MAX_HEADER_BYTES = 6144
# Header fields (pseudo-headers included) the edge accepts: HTTP/1 and HTTP/2 servers commonly
# stop at 100 (Envoy's own default), and no client of ours sends a tenth of that.
MAX_HEADER_COUNT = 100
# The longest error message the edge passes on (an upstream's, or the transcoder's, which
# may quote the request).
MAX_MESSAGE_BYTES = 2048


def _lua(name: str, script: str, prelude: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
            "default_source_code": {"inline_string": lua_script(script, prelude)},
        },
    }


def edge_lua(rules: Sequence[HttpRule]) -> dict[str, Any]:
    return _lua(EDGE_LUA_FILTER, "openai_edge.lua", {
        "MAX_URL_BYTES": MAX_URL_BYTES, "MAX_HEADER_BYTES": MAX_HEADER_BYTES,
        "MAX_HEADER_COUNT": MAX_HEADER_COUNT,
        "MAX_MESSAGE_BYTES": MAX_MESSAGE_BYTES,
        "JSON_BODY_PATHS": dict.fromkeys(json_body_paths(rules), True)})


def stream_lua(rules: Sequence[HttpRule]) -> dict[str, Any]:
    return _lua(STREAM_LUA_FILTER, "stream_route.lua", {"STREAM_PATHS": stream_paths(rules)})


def health_check(cluster: str) -> dict[str, Any]:
    """``/health`` and ``/ping`` (as vLLM serves both): 200 while ``cluster``'s host passes
    its active health check, 503 otherwise."""
    return {
        "name": HEALTH_CHECK_FILTER,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.health_check.v3."
                     "HealthCheck",
            "pass_through_mode": False,
            "headers": [{"name": ":path", "string_match": {
                "safe_regex": {"regex": "|".join(PROBE_PATHS)}}}],
            "cluster_min_healthy_percentages": {cluster: {"value": 100.0}},
        },
    }


def json_to_metadata() -> dict[str, Any]:
    return {
        "name": JSON_TO_METADATA_FILTER,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.json_to_metadata.v3."
                     "JsonToMetadata",
            # openai_edge.lua spells every JSON content type application/json.
            "request_rules": {"rules": [{
                "selectors": [{"key": "stream"}],
                "on_present": {"metadata_namespace": LUA_NAMESPACE, "key": "body_stream"},
            }]},
        },
    }


def _descriptor_source(descriptor: Path | bytes) -> dict[str, str]:
    if isinstance(descriptor, bytes):
        # Inline: the configuration is one self-contained file (a Kubernetes ConfigMap).
        return {"proto_descriptor_bin": base64.b64encode(descriptor).decode("ascii")}
    return {"proto_descriptor": str(Path(descriptor).resolve())}


def transcoder(descriptor: Path | bytes) -> dict[str, Any]:
    return {
        "name": TRANSCODER_FILTER,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.grpc_json_transcoder."
                     "v3.GrpcJsonTranscoder",
            **_descriptor_source(descriptor),
            "services": [GENERATION_SERVICE],
            "print_options": {
                "preserve_proto_field_names": True,  # OpenAI's snake_case field names
                "always_print_primitive_fields": True,  # e.g. "index": 0
            },
            "convert_grpc_status": True,  # a gRPC error becomes its HTTP status + JSON body
            # A query parameter no field takes is a 400 that names it (by default the
            # request would pass through untranscoded and fail upstream as a 503).
            "request_validation_options": {"reject_unknown_query_parameters": True},
            # The openai SDK escapes a path parameter's slashes: GET /v1/models/org%2Fname
            # asks for the model "org/name".
            "url_unescape_spec": "ALL_CHARACTERS",
            "max_request_body_size": MAX_REQUEST_BYTES,
        },
    }


def api_key_auth(api_keys: Sequence[str]) -> dict[str, Any]:
    return {
        "name": API_KEY_FILTER,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.api_key_auth.v3."
                     "ApiKeyAuth",
            # "Authorization: Bearer KEY" (the filter drops the "Bearer "; openai_edge.lua has
            # made the scheme's case right and dropped any other scheme), or x-api-key.
            "key_sources": [{"header": "authorization"}, {"header": "x-api-key"}],
            "credentials": [{"key": key, "client": f"key-{i}"} for i, key in enumerate(api_keys)],
            "forwarding": {"hide_credentials": True},
        },
    }


def ext_proc(body_mode: str, timeout_s: float, picker_cluster: str) -> dict[str, Any]:
    return {
        "name": EXT_PROC_FILTER,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3."
                     "ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": picker_cluster},
                             "timeout": f"{timeout_s}s"},
            "failure_mode_allow": False,  # InferencePool's FailClose
            # An unreachable picker is an outage (503), not an internal error. Envoy also
            # shows the picker the replies the edge makes itself (401, 414, 415, 431) on the
            # routes it forwards, so while the picker is down those are 503 too.
            "status_on_error": {"code": 503},
            # Take the picker's choice (envoy.lb) and pass it a subset hint, if one is set.
            "metadata_options": {
                "receiving_namespaces": {"untyped": ["envoy.lb"]},
                "forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint"]},
            },
            "message_timeout": f"{timeout_s}s",
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": body_mode,
                "request_trailer_mode": "SEND" if body_mode == "FULL_DUPLEX_STREAMED" else "SKIP",
                # The picker counts a request in flight on its replica until the response
                # starts (the stream to the picker stays open until then).
                "response_header_mode": "SEND",
                "response_body_mode": "NONE",
                "response_trailer_mode": "SKIP",
            },
        },
    }


def router() -> dict[str, Any]:
    return {
        "name": ROUTER_FILTER,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
    }


def edge_filters(rules: Sequence[HttpRule], descriptor: Path | bytes, health_cluster: str,
                 picker: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The chain, in the order above (without ``api_key_auth``); ``picker``: the ext_proc
    filter, in the endpoint picker variant."""
    return [edge_lua(rules), health_check(health_cluster), json_to_metadata(),
            stream_lua(rules), *([picker] if picker else []), transcoder(descriptor), router()]
