"""Envoy's bootstrap for Tandem's OpenAI-compatible HTTP edge, rendered as a plain dict.

Owns the one Envoy configuration of the project, in two variants that share every filter:

- ``render_envoy_bootstrap``: HTTP on a listener port, ``grpc_json_transcoder`` turning
  OpenAI-style JSON into ``tandem.v1.Generation`` calls, sent over HTTP/2 to one upstream (the
  gateway, or a replica); gRPC clients may use the same port (reflection, health, the SDK).
- ``render_picker_bootstrap``: the same edge in front of replicas chosen per request by an
  ``ext_proc`` endpoint picker (``gateway.endpoint_picker``): the picker names the replica in
  the ``x-gateway-destination-endpoint`` header and an ``ORIGINAL_DST`` cluster connects there.

The HTTP semantics that the transcoder alone lacks live in one Lua script (``OPENAI_LUA``),
which runs before the transcoder on requests and after it on responses:

- ``"stream": true`` in a completions, chat or responses body moves the request to the
  ``:stream`` path, the ``*Events`` RPC: the server writes the server-sent events itself
  (each a ``google.api.HttpBody`` the transcoder passes through), ``data: [DONE]`` last,
  and the script labels them ``text/event-stream``.
- A list in a query as the openai SDK writes it (``include[]=a&include[]=b``) becomes the
  repeated parameter the transcoder reads (``include=a&include=b``); a parameter no field
  takes is the transcoder's 400 naming it.
- ``GET /v1/responses/{id}?stream=true`` (a background response's events again) moves to
  the ``/v1/responses/{id}:stream`` path, the ``GetResponseEvents`` RPC, labelled the same.
- Every error (a gRPC status the transcoder turned into an HTTP status with
  ``convert_grpc_status``, the transcoder's own 400 for bad JSON, Envoy's 503 when the
  upstream is down) leaves with OpenAI's body, ``{"error": {"message", "type", "param",
  "code"}}``.

With ``api_keys``, every request but gRPC health checks must carry one of them, as OpenAI's
clients send it (``Authorization: Bearer KEY``) or in ``x-api-key`` (``api_key_auth``, after
the Lua script so that a 401 leaves in OpenAI's shape too); Envoy strips the key before
forwarding, so it reaches no log upstream.

It does not own running Envoy (``envoy_runner``) or writing files (``render``).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DESCRIPTOR = REPO_ROOT / "protos" / "tandem.binpb"
GENERATION_SERVICE = "tandem.v1.Generation"
HEALTH_SERVICE = "grpc.health.v1.Health"
API_KEY_FILTER = "envoy.filters.http.api_key_auth"
LUA_FILTER = "envoy.filters.http.lua"
# Paths the transcoder serves (from generation.proto's google.api.http rules) and the gRPC
# services reachable through the same port.
OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models",
                "/tokenize", "/detokenize", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")
GRPC_SERVICES = (GENERATION_SERVICE, HEALTH_SERVICE, "grpc.reflection.v1alpha.ServerReflection",
                 "grpc.reflection.v1.ServerReflection")
DESTINATION_HEADER = "x-gateway-destination-endpoint"
SERVED_HEADER = "x-gateway-destination-endpoint-served"
PICKER_CLUSTER = "endpoint_picker"
UPSTREAM_CLUSTER = "tandem_upstream"
# A request body Envoy buffers whole (the Lua script and the picker read it); the gRPC
# servers' own receive limit.
MAX_REQUEST_BYTES = 4 * 1024 * 1024

# Runs before the transcoder (requests) and after it (responses). Kept small and free of JSON
# parsing beyond two patterns: Envoy's Lua has no JSON library.
OPENAI_LUA = r"""
local STREAM_PATHS = {
  ["/v1/completions"] = "/v1/completions:stream",
  ["/v1/chat/completions"] = "/v1/chat/completions:stream",
  ["/v1/responses"] = "/v1/responses:stream",
}
local OPENAI_PATHS = {
  ["/v1/completions"] = true, ["/v1/chat/completions"] = true, ["/v1/responses"] = true,
  ["/v1/models"] = true, ["/tokenize"] = true, ["/detokenize"] = true,
  ["/v1/load_lora_adapter"] = true, ["/v1/unload_lora_adapter"] = true,
}
local NAMESPACE = "tandem.openai"
local GRPC_CODES = {
  [1] = "cancelled", [2] = "unknown", [3] = "invalid_argument", [4] = "deadline_exceeded",
  [5] = "not_found", [6] = "already_exists", [7] = "permission_denied",
  [8] = "resource_exhausted", [9] = "failed_precondition", [10] = "aborted",
  [11] = "out_of_range", [12] = "unimplemented", [13] = "internal", [14] = "unavailable",
  [15] = "data_loss", [16] = "unauthenticated",
}

-- The openai SDK writes a list in a query as include[]=a&include[]=b (brackets, or their
-- percent-encoding); the transcoder fills a repeated field from include=a&include=b.
local function plain_list_keys(path)
  local start = string.find(path, "?", 1, true)
  if start == nil then
    return path
  end
  local query = string.sub(path, start)
  query = string.gsub(query, "%[%]=", "=")
  query = string.gsub(query, "%%5[Bb]%%5[Dd]=", "=")
  return string.sub(path, 1, start - 1) .. query
end

-- Marks HTTP (not gRPC) requests, so responses to gRPC clients pass untouched; moves a body
-- with "stream": true to the streaming RPC's path. A JSON key "stream" whose value is true:
-- inside a JSON string every quote is escaped, so the pattern cannot match a prompt's text.
-- Handles (headers, metadata) taken before a call that yields, such as body(), are invalid
-- after it: take them again.
function envoy_on_request(handle)
  local headers = handle:headers()
  local path = headers:get(":path")
  local bare = string.match(path, "^[^?]*")  -- a query does not change the route
  -- GET and DELETE /v1/responses/{id}, its input_items, its cancel: a stored response;
  -- GET /v1/models/{id}: one model.
  if not OPENAI_PATHS[bare] and not string.find(path, "^/v1/responses/[^/:?]+")
      and not string.find(path, "^/v1/models/[^?]") then
    return
  end
  handle:streamInfo():dynamicMetadata():set(NAMESPACE, "http", true)
  local plain = plain_list_keys(path)
  if plain ~= path then
    headers:replace(":path", plain)
  end
  -- GET /v1/responses/{id}?stream=true: a background response's events again, from the
  -- GetResponseEvents path.
  local id, query = string.match(plain, "^/v1/responses/([^/:?]+)%?(.*)$")
  if id ~= nil and headers:get(":method") == "GET"
      and string.find("&" .. query .. "&", "&stream=true&", 1, true) then
    headers:replace(":path", "/v1/responses/" .. id .. ":stream?" .. query)
    handle:clearRouteCache()
    handle:streamInfo():dynamicMetadata():set(NAMESPACE, "stream", true)
    return
  end
  local stream_path = STREAM_PATHS[bare]
  if stream_path == nil or headers:get(":method") ~= "POST" then
    return
  end
  local body = handle:body()
  if body == nil then
    return
  end
  if string.find(body:getBytes(0, body:length()), '"stream"%s*:%s*true') then
    handle:headers():replace(":path", stream_path .. string.sub(plain, #bare + 1))
    handle:clearRouteCache()
    handle:streamInfo():dynamicMetadata():set(NAMESPACE, "stream", true)
  end
end

local function json_string(text)
  local escaped = string.gsub(text, '[%c"\\]', function(c)
    if c == '"' then return '\\"' end
    if c == "\\" then return "\\\\" end
    if c == "\n" then return "\\n" end
    if c == "\t" then return "\\t" end
    return string.format("\\u%04x", string.byte(c))
  end)
  return '"' .. escaped .. '"'
end

-- The value of a string field in a flat JSON object, still JSON-escaped (so it can be
-- embedded as is), or nil.
local function raw_string_field(text, name)
  local _, stop = string.find(text, '"' .. name .. '"%s*:%s*"')
  if stop == nil then
    return nil
  end
  local i = stop + 1
  while i <= #text do
    local c = string.sub(text, i, i)
    if c == "\\" then
      i = i + 2
    elseif c == '"' then
      return string.sub(text, stop + 1, i - 1)
    else
      i = i + 1
    end
  end
  return nil
end

local function error_type(status)
  if status == 401 then return "authentication_error" end
  if status == 403 then return "permission_error" end
  if status == 404 then return "not_found_error" end
  if status == 429 then return "rate_limit_error" end
  if status >= 500 then return "server_error" end
  return "invalid_request_error"
end

local function openai_error(status, text, content_type)
  local message, code = nil, "null"
  if status == 401 then
    code = '"invalid_api_key"'
  end
  if string.find(content_type, "json", 1, true) then
    -- google.rpc.Status as the transcoder prints it: {"code": N, "message": "..."}
    local raw = raw_string_field(text, "message")
    if raw ~= nil then
      message = '"' .. raw .. '"'
    end
    local grpc_code = tonumber(string.match(text, '"code"%s*:%s*(%d+)'))
    if grpc_code ~= nil and GRPC_CODES[grpc_code] ~= nil then
      code = '"' .. GRPC_CODES[grpc_code] .. '"'
    end
  end
  if message == nil then
    text = string.gsub(text, "^%s+", "")
    text = string.gsub(text, "%s+$", "")
    if text == "" then
      text = "HTTP " .. status
    end
    message = json_string(text)
  end
  return '{"error":{"message":' .. message .. ',"type":"' .. error_type(status) ..
    '","param":null,"code":' .. code .. '}}'
end

-- Leaves the transcoder's gRPC headers out of HTTP responses, labels event streams and
-- rewrites every error body into OpenAI's shape.
function envoy_on_response(handle)
  local meta = handle:streamInfo():dynamicMetadata():get(NAMESPACE)
  if meta == nil or not meta["http"] then
    return
  end
  local headers = handle:headers()
  for _, name in ipairs({"grpc-status", "grpc-message", "grpc-accept-encoding"}) do
    headers:remove(name)
  end
  local status = tonumber(headers:get(":status")) or 0
  if status < 400 then
    if meta["stream"] then
      headers:replace("content-type", "text/event-stream")
      headers:replace("cache-control", "no-cache")
    end
    return
  end
  local content_type = headers:get("content-type") or ""
  local body = handle:body(true)
  local text = body:getBytes(0, body:length())
  if string.find(text, '^%s*{%s*"error"%s*:') then
    return  -- already OpenAI-shaped (the endpoint picker's own replies)
  end
  body:setBytes(openai_error(status, text, content_type))
  handle:headers():replace("content-type", "application/json")
end
"""


@dataclass(frozen=True)
class HostPort:
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> HostPort:
        """``host:port`` or ``[v6]:port``."""
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"expected host:port, got {text!r}")
        return cls(host.strip("[]"), int(port))


@dataclass(frozen=True)
class TlsFiles:
    """A certificate chain and key (PEM files) for an HTTPS listener on ``port``."""

    certificate: str
    private_key: str
    port: int


def _descriptor_source(descriptor: Path | bytes) -> dict[str, str]:
    if isinstance(descriptor, bytes):
        # Inline: the configuration is one self-contained file (a Kubernetes ConfigMap).
        return {"proto_descriptor_bin": base64.b64encode(descriptor).decode("ascii")}
    return {"proto_descriptor": str(Path(descriptor).resolve())}


def _socket_address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _http2_options() -> dict[str, Any]:
    return {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}},
    }}


def _routes(cluster: str) -> list[dict[str, Any]]:
    """The OpenAI paths before transcoding, the gRPC paths after it (the transcoder clears
    the route cache when it rewrites the path) and for gRPC clients; a 404 for the rest."""
    forward = {"cluster": cluster, "timeout": "0s"}  # streams may run for minutes
    routes: list[dict[str, Any]] = [
        {"match": {"path": path}, "route": forward} for path in OPENAI_PATHS]
    routes += [{"match": {"prefix": f"/v1/{name}:stream"}, "route": forward}
               for name in ("completions", "chat/completions", "responses")]
    # Stored responses: /v1/responses/{id}, its input_items, cancel and :stream; one model.
    routes += [{"match": {"prefix": prefix}, "route": forward}
               for prefix in ("/v1/responses/", "/v1/models/")]
    routes += [{"match": {"prefix": f"/{service}/"}, "route": forward}
               for service in GRPC_SERVICES]
    for route in routes:
        if route["match"].get("prefix") == f"/{HEALTH_SERVICE}/":
            # Probes carry no key. (A no-op without the filter: it is optional.)
            route["typed_per_filter_config"] = {API_KEY_FILTER: {
                "@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig",
                "disabled": True}}
    not_found = ('{"error":{"message":"no such endpoint; Tandem serves /v1/completions, '
                 '/v1/chat/completions, /v1/responses (and /v1/responses/{id}, '
                 '/v1/responses/{id}/input_items, /v1/responses/{id}/cancel), /v1/models (and '
                 '/v1/models/{id}), '
                 '/tokenize, /detokenize, '
                 '/v1/load_lora_adapter and /v1/unload_lora_adapter",'
                 '"type":"not_found_error","param":null,"code":null}}')
    routes.append({
        "match": {"prefix": "/"},
        "direct_response": {"status": 404, "body": {"inline_string": not_found}},
        "response_headers_to_add": [{"header": {"key": "content-type",
                                                "value": "application/json"}}],
    })
    return routes


def _transcoder(descriptor: Path | bytes) -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.grpc_json_transcoder",
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


def with_api_keys(bootstrap: dict[str, Any], api_keys: Sequence[str]) -> dict[str, Any]:
    """``bootstrap`` with every listener requiring one of ``api_keys`` (right after the Lua
    script); unchanged when there are none. Also applied to a bootstrap rendered earlier
    (Kubernetes keeps the keys in a Secret, out of the ConfigMap)."""
    keys = check_api_keys(api_keys)
    if not keys:
        return bootstrap
    chains = {id(filters): filters  # listeners may share one list (a YAML alias, too)
              for listener in bootstrap["static_resources"]["listeners"]
              for chain in listener["filter_chains"]
              for filters in [chain["filters"][0]["typed_config"]["http_filters"]]}
    for http_filters in chains.values():
        names = [f["name"] for f in http_filters]
        if API_KEY_FILTER in names:
            raise ValueError("this bootstrap already checks API keys")
        http_filters.insert(names.index(LUA_FILTER) + 1, _api_key_auth(keys))
    return bootstrap


def _api_key_auth(api_keys: Sequence[str]) -> dict[str, Any]:
    return {
        "name": API_KEY_FILTER,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.api_key_auth.v3."
                     "ApiKeyAuth",
            # "Authorization: Bearer KEY": the filter drops the "Bearer " itself.
            "key_sources": [{"header": "authorization"}, {"header": "x-api-key"}],
            "credentials": [{"key": key, "client": f"key-{i}"} for i, key in enumerate(api_keys)],
            "forwarding": {"hide_credentials": True},
        },
    }


def check_api_keys(api_keys: Sequence[str]) -> list[str]:
    """The keys, stripped; raises ValueError for an empty, blank-containing or repeated one."""
    keys = [key.strip() for key in api_keys]
    for key in keys:
        if not key or any(c.isspace() for c in key) or not key.isprintable():
            raise ValueError("an API key must be non-empty printable text without spaces")
    if len(set(keys)) != len(keys):
        raise ValueError("the same API key is given twice")
    return keys


def read_api_keys(path: Path) -> list[str]:
    """One key per line of ``path``; blank lines and ``#`` comments are skipped."""
    lines = [line.strip() for line in path.read_text().splitlines()]
    keys = check_api_keys([line for line in lines if line and not line.startswith("#")])
    if not keys:
        raise ValueError(f"{path} holds no API key")
    return keys


def _lua() -> dict[str, Any]:
    return {
        "name": LUA_FILTER,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
            "default_source_code": {"inline_string": OPENAI_LUA},
        },
    }


def _ext_proc(body_mode: str, timeout_s: float) -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3."
                     "ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": PICKER_CLUSTER},
                             "timeout": f"{timeout_s}s"},
            "failure_mode_allow": False,  # InferencePool's FailClose
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


def _router() -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.router",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
    }


def _listener(name: str, listen_host: str, port: int, cluster: str,
              http_filters: list[dict[str, Any]], tls: TlsFiles | None = None,
              response_headers: dict[str, str] | None = None) -> dict[str, Any]:
    virtual_host: dict[str, Any] = {"name": "tandem", "domains": ["*"],
                                    "routes": _routes(cluster)}
    if response_headers:
        virtual_host["response_headers_to_add"] = [
            {"header": {"key": key, "value": value}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
            for key, value in response_headers.items()]
    chain: dict[str, Any] = {"filters": [{
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network."
                     "http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": name,
            "codec_type": "AUTO",  # HTTP/1.1 for OpenAI clients, h2c (or h2) for gRPC ones
            "route_config": {"name": "tandem", "virtual_hosts": [virtual_host]},
            "http_filters": http_filters,
        },
    }]}
    if tls is not None:
        chain["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3."
                         "DownstreamTlsContext",
                "common_tls_context": {
                    "tls_certificates": [{"certificate_chain": {"filename": tls.certificate},
                                          "private_key": {"filename": tls.private_key}}],
                    "alpn_protocols": ["h2", "http/1.1"],
                },
            },
        }
    return {
        "name": name,
        "address": _socket_address(listen_host, port),
        "per_connection_buffer_limit_bytes": MAX_REQUEST_BYTES,
        "filter_chains": [chain],
    }


def _listeners(listen_host: str, http_port: int, cluster: str,
               http_filters: list[dict[str, Any]], tls: TlsFiles | None,
               response_headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Plain HTTP, and HTTPS on ``tls.port`` when ``tls`` is given, serving the same routes."""
    listeners = [_listener("openai_http", listen_host, http_port, cluster, http_filters,
                           response_headers=response_headers)]
    if tls is not None:
        listeners.append(_listener("openai_https", listen_host, tls.port, cluster,
                                   http_filters, tls, response_headers))
    return listeners


def _admin(admin_port: int) -> dict[str, Any]:
    # Loopback only: the admin interface can stop Envoy and change its state.
    return {"address": _socket_address("127.0.0.1", admin_port)}


def _grpc_cluster(name: str, target: HostPort) -> dict[str, Any]:
    return {
        "name": name,
        "type": "STRICT_DNS",  # an IP or a name (a Kubernetes Service)
        "dns_lookup_family": "V4_PREFERRED",
        "connect_timeout": "2s",
        "typed_extension_protocol_options": _http2_options(),
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": _socket_address(target.host, target.port)}}]}]},
    }


def render_envoy_bootstrap(
    http_port: int,
    upstream: str,
    *,
    admin_port: int = 9901,
    listen_host: str = "0.0.0.0",
    descriptor: Path | bytes = DEFAULT_DESCRIPTOR,
    tls: TlsFiles | None = None,
    api_keys: Sequence[str] = (),
) -> dict[str, Any]:
    """Envoy in front of one gRPC upstream (``host:port``: the gateway, or a single replica).

    ``descriptor``: the path of ``protos/tandem.binpb``, or its bytes to inline them.
    ``admin_port`` 0 lets the kernel pick one. ``tls``: also serve HTTPS. ``api_keys``:
    the keys a request must carry one of (none: no check).
    """
    target = HostPort.parse(upstream)
    return with_api_keys({
        "admin": _admin(admin_port),
        "static_resources": {
            "listeners": _listeners(listen_host, http_port, UPSTREAM_CLUSTER,
                                    [_lua(), _transcoder(descriptor), _router()], tls),
            "clusters": [_grpc_cluster(UPSTREAM_CLUSTER, target)],
        },
    }, api_keys)


def render_picker_bootstrap(
    http_port: int,
    picker: str,
    *,
    admin_port: int = 9901,
    listen_host: str = "0.0.0.0",
    descriptor: Path | bytes = DEFAULT_DESCRIPTOR,
    body_mode: str = "BUFFERED",
    picker_timeout_s: float = 10.0,
    tls: TlsFiles | None = None,
    api_keys: Sequence[str] = (),
) -> dict[str, Any]:
    """Envoy that asks an ``ext_proc`` endpoint picker (``host:port``) where each request
    goes and connects straight to that replica.

    ``body_mode``: how the picker sees the request body, ``BUFFERED`` (one message) or
    ``FULL_DUPLEX_STREAMED`` (chunks, as Gateway API implementations run endpoint pickers).
    """
    if body_mode not in ("BUFFERED", "FULL_DUPLEX_STREAMED"):
        raise ValueError(f"body_mode must be BUFFERED or FULL_DUPLEX_STREAMED, not {body_mode!r}")
    replicas = "picked_replica"
    return with_api_keys({
        "admin": _admin(admin_port),
        "static_resources": {
            "listeners": _listeners(
                listen_host, http_port, replicas,
                # The picker reads the body after Lua chose the RPC, before the transcoder
                # turns it into gRPC frames.
                [_lua(), _ext_proc(body_mode, picker_timeout_s), _transcoder(descriptor),
                 _router()], tls,
                # Which replica served the request, as the protocol's "served" metadata has it.
                response_headers={SERVED_HEADER: "%UPSTREAM_HOST%"}),
            "clusters": [
                _grpc_cluster(PICKER_CLUSTER, HostPort.parse(picker)),
                {
                    "name": replicas,
                    "type": "ORIGINAL_DST",
                    "lb_policy": "CLUSTER_PROVIDED",
                    "connect_timeout": "2s",
                    "original_dst_lb_config": {"use_http_header": True,
                                               "http_header_name": DESTINATION_HEADER},
                    "typed_extension_protocol_options": _http2_options(),
                },
            ],
        },
    }, api_keys)


def dump_bootstrap(config: dict[str, Any]) -> str:
    """YAML text (block style, key order kept) for ``envoy -c``."""
    return yaml.safe_dump(config, sort_keys=False, width=100)
