"""Envoy's bootstrap for Tandem's OpenAI-compatible HTTP edge, rendered as a plain dict.

Owns the one Envoy configuration of the project, in two variants that share every filter and
route (``deploy.envoy``: the filter chain, the routes, the Lua scripts):

- ``render_envoy_bootstrap``: HTTP on a listener port, ``grpc_json_transcoder`` turning
  OpenAI-style JSON into ``tandem.v1.Generation`` calls, sent over HTTP/2 to one upstream (the
  gateway, or a replica); gRPC clients may use the same port (reflection, health, the SDK).
  A request that never reached the upstream (refused connection, refused stream) is tried
  again, every half second on average for ~20 s by default, long enough for a restarted gateway to
  come back; a request the upstream received is never sent twice.
- ``render_picker_bootstrap``: the same edge in front of replicas chosen per request by an
  ``ext_proc`` endpoint picker (``gateway.endpoint_picker``): the picker names the replica in
  the ``x-gateway-destination-endpoint`` header and an ``ORIGINAL_DST`` cluster connects there.

On the HTTP port, besides the OpenAI routes: ``/health`` and ``/ping`` (200 while the
upstream, or the picker, passes Envoy's active gRPC health check: the gateway and the picker
report SERVING while a decode-capable replica is routable; 503 otherwise), ``/version`` and,
given a metrics upstream, ``/metrics`` (its Prometheus text, e.g. the gateway's).

With ``api_keys``, every request but health checks (``/health``, ``/ping``, ``/version``,
gRPC ``grpc.health.v1``) must carry one of them: ``Authorization: Bearer KEY`` (any case of
"Bearer") or ``x-api-key: KEY``, as HTTP headers or gRPC metadata; Envoy strips the key before
forwarding, so it reaches no log upstream.

Where Envoy calls replicas itself (the picked replica; or a replica as the one upstream), it
can hold the suite's certificate (``upstream_tls_dir``, laid out as ``--tls-dir`` is for the
other processes, ``services.suite_tls``): it presents it and accepts only a replica whose
certificate the suite CA signed for the suite's name, as gateways and pickers do.

Listeners never share their port (no ``SO_REUSEPORT``): a second Envoy on a busy port fails
to start instead of taking part of the first one's traffic.

It does not own running Envoy (``envoy_runner``) or writing files (``render``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from deploy.envoy import filters
from deploy.envoy.http_rules import HttpRule, read_http_rules
from deploy.envoy.routes import (
    API_KEY_FILTER,
    DEFAULT_UPSTREAM_RETRIES,
    RouteTargets,
    edge_routes,
)
from deploy.yaml_text import dump_yaml
from services.suite_tls import CA_FILE, CERT_FILE, KEY_FILE, SUITE_NAME

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DESCRIPTOR = REPO_ROOT / "protos" / "tandem.binpb"
GENERATION_SERVICE = filters.GENERATION_SERVICE
LUA_FILTER = filters.EDGE_LUA_FILTER
DESTINATION_HEADER = "x-gateway-destination-endpoint"
SERVED_HEADER = "x-gateway-destination-endpoint-served"
PICKER_CLUSTER = "endpoint_picker"
UPSTREAM_CLUSTER = "tandem_upstream"
METRICS_CLUSTER = "tandem_metrics"
PICKED_CLUSTER = "picked_replica"
MAX_REQUEST_BYTES = filters.MAX_REQUEST_BYTES
# The HTTP/1 and HTTP/2 codecs' own limits on request headers: far above what the edge Lua
# accepts (filters.MAX_HEADER_BYTES, MAX_HEADER_COUNT, MAX_URL_BYTES), so that the script
# answers with a reason. NOTE: at the codec's limits an HTTP/1 request gets the codec's 431,
# but HTTP/2 cannot refuse one stream: a header list too large to decode leaves the
# connection's HPACK state unknown, so Envoy closes the whole connection (GOAWAY,
# COMPRESSION_ERROR), and too many fields reset the stream (a gRPC client's INTERNAL). Up to
# 96 KiB and 100 fields that cut a client's other streams; 8192 KiB is Envoy's ceiling.
CODEC_MAX_HEADERS_KB = 8192
CODEC_MAX_HEADERS_COUNT = 65535

__all__ = [
    "API_KEY_FILTER", "DEFAULT_DESCRIPTOR", "DESTINATION_HEADER", "GENERATION_SERVICE",
    "HostPort", "TlsFiles", "check_api_keys", "dump_bootstrap", "read_api_keys",
    "render_envoy_bootstrap", "render_picker_bootstrap", "with_api_keys",
]


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


def tandem_version() -> str:
    """The version of the installed distribution this package comes from."""
    names = metadata.packages_distributions().get(__name__.partition(".")[0], [])
    try:
        return metadata.version(names[0]) if names else "unknown"
    except metadata.PackageNotFoundError:
        return "unknown"


def with_api_keys(bootstrap: dict[str, Any], api_keys: Sequence[str]) -> dict[str, Any]:
    """``bootstrap`` with every listener requiring one of ``api_keys`` (after the edge script
    and the health probes); unchanged when there are none. Also applied to a bootstrap
    rendered earlier (Kubernetes keeps the keys in a Secret, out of the ConfigMap)."""
    keys = check_api_keys(api_keys)
    if not keys:
        return bootstrap
    chains = {id(chain_filters): chain_filters  # listeners may share one list (a YAML alias)
              for listener in bootstrap["static_resources"]["listeners"]
              for chain in listener["filter_chains"]
              for chain_filters in [chain["filters"][0]["typed_config"]["http_filters"]]}
    for http_filters in chains.values():
        names = [f["name"] for f in http_filters]
        if API_KEY_FILTER in names:
            raise ValueError("this bootstrap already checks API keys")
        before = [n for n in (filters.HEALTH_CHECK_FILTER, LUA_FILTER) if n in names][0]
        http_filters.insert(names.index(before) + 1, filters.api_key_auth(keys))
    return bootstrap


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


def _socket_address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _http_connection_manager(name: str, routes: list[dict[str, Any]],
                             http_filters: list[dict[str, Any]],
                             response_headers: dict[str, str] | None) -> dict[str, Any]:
    virtual_host: dict[str, Any] = {"name": "tandem", "domains": ["*"], "routes": routes}
    if response_headers:
        virtual_host["response_headers_to_add"] = [
            {"header": {"key": key, "value": value}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
            for key, value in response_headers.items()]
    return {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network."
                     "http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": name,
            "codec_type": "AUTO",  # HTTP/1.1 for OpenAI clients, h2c (or h2) for gRPC ones
            "max_request_headers_kb": CODEC_MAX_HEADERS_KB,
            "common_http_protocol_options": {"max_headers_count": CODEC_MAX_HEADERS_COUNT},
            "local_reply_config": _codec_replies(),
            "route_config": {"name": "tandem", "virtual_hosts": [virtual_host]},
            "http_filters": http_filters,
        },
    }


def _codec_replies() -> dict[str, Any]:
    """OpenAI's error shape for the one refusal Envoy's codec makes before any filter runs:
    headers over ``CODEC_MAX_HEADERS_KB`` (smaller ones get the edge script's 431)."""
    return {"mappers": [{
        "filter": {"and_filter": {"filters": [
            {"status_code_filter": {"comparison": {
                "op": "EQ", "value": {"default_value": 431, "runtime_key": "tandem.codec_431"}}}},
            # Not the edge script's own 431s (they name the limit); those set this key.
            {"metadata_filter": {"match_if_key_not_found": True, "matcher": {
                "filter": filters.LUA_NAMESPACE, "path": [{"key": "edge_refusal"}],
                "value": {"bool_match": False}}}},
        ]}},
        "body_format_override": {"json_format": {"error": {
            "message": f"the request headers take more than {CODEC_MAX_HEADERS_KB} KiB; at "
                       f"most {filters.MAX_HEADER_BYTES} bytes are accepted",
            "type": "invalid_request_error", "param": None, "code": None}}},
    }]}


def _tls_socket(tls: TlsFiles) -> dict[str, Any]:
    return {
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


def _listener(name: str, listen_host: str, port: int, manager: dict[str, Any],
              tls: TlsFiles | None = None) -> dict[str, Any]:
    chain: dict[str, Any] = {"filters": [manager]}
    if tls is not None:
        chain["transport_socket"] = _tls_socket(tls)
    return {
        "name": name,
        "address": _socket_address(listen_host, port),
        # One socket per port, never shared: with SO_REUSEPORT a second Envoy on a busy port
        # would start and take part of the first one's connections.
        "enable_reuse_port": False,
        "per_connection_buffer_limit_bytes": MAX_REQUEST_BYTES,
        "filter_chains": [chain],
    }


def _listeners(listen_host: str, http_port: int, routes: list[dict[str, Any]],
               http_filters: list[dict[str, Any]], tls: TlsFiles | None,
               response_headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Plain HTTP, and HTTPS on ``tls.port`` when ``tls`` is given, serving the same routes
    through the same filters."""
    listeners = [_listener("openai_http", listen_host, http_port, _http_connection_manager(
        "openai_http", routes, http_filters, response_headers))]
    if tls is not None:
        listeners.append(_listener("openai_https", listen_host, tls.port, _http_connection_manager(
            "openai_https", routes, http_filters, response_headers), tls))
    return listeners


def _admin(admin_port: int) -> dict[str, Any]:
    # Loopback only: the admin interface can stop Envoy and change its state.
    return {"address": _socket_address("127.0.0.1", admin_port)}


def _http2_options() -> dict[str, Any]:
    return {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}},
    }}


def _cluster(name: str, target: HostPort, *, grpc: bool = True) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STRICT_DNS",  # an IP or a name (a Kubernetes Service)
        "dns_lookup_family": "V4_PREFERRED",
        "connect_timeout": "2s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": _socket_address(target.host, target.port)}}]}]},
    }
    if grpc:
        cluster["typed_extension_protocol_options"] = _http2_options()
    return cluster


def _health_checked(cluster: dict[str, Any]) -> dict[str, Any]:
    """``cluster`` (gRPC) with Envoy asking its host ``grpc.health.v1`` for the whole server
    every 2 s; what ``/health`` answers from. A host that fails still gets requests (Envoy's
    panic routing, with one host): its own answer says why it cannot serve them."""
    cluster["health_checks"] = [{
        "timeout": "1s", "interval": "2s", "no_traffic_interval": "2s",
        "unhealthy_threshold": 1, "healthy_threshold": 1,
        "grpc_health_check": {"service_name": ""},
    }]
    return cluster


def _retried(cluster: dict[str, Any]) -> dict[str, Any]:
    """``cluster`` taking as many retries at once as requests may wait for a restarted
    gateway (Envoy's default is 3 across the whole cluster; the routes retry only requests
    that never reached it, see ``deploy.envoy.routes``)."""
    cluster["circuit_breakers"] = {"thresholds": [{"max_retries": 1024}]}
    return cluster


def _suite_tls(directory: str) -> dict[str, Any]:
    """The suite's mutual TLS on a cluster of replicas: ``directory`` as Envoy sees it (a
    mounted Secret in Kubernetes) holds the member certificate, its key and the CA."""
    base = directory.rstrip("/")
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3."
                     "UpstreamTlsContext",
            "sni": SUITE_NAME,
            "common_tls_context": {
                "alpn_protocols": ["h2"],  # gRPC
                "tls_certificates": [{"certificate_chain": {"filename": f"{base}/{CERT_FILE}"},
                                      "private_key": {"filename": f"{base}/{KEY_FILE}"}}],
                # Replicas are dialed by address: the name checked is the suite's.
                "validation_context": {
                    "trusted_ca": {"filename": f"{base}/{CA_FILE}"},
                    "match_typed_subject_alt_names": [
                        {"san_type": "DNS", "matcher": {"exact": SUITE_NAME}}]},
            },
        },
    }


def _with_tls(cluster: dict[str, Any], upstream_tls_dir: str | None) -> dict[str, Any]:
    if upstream_tls_dir is not None:
        cluster["transport_socket"] = _suite_tls(upstream_tls_dir)
    return cluster


def _metrics_cluster(metrics: str | None) -> list[dict[str, Any]]:
    return [] if metrics is None else [_cluster(METRICS_CLUSTER, HostPort.parse(metrics),
                                                grpc=False)]


def render_envoy_bootstrap(
    http_port: int,
    upstream: str,
    *,
    admin_port: int = 9901,
    listen_host: str = "0.0.0.0",
    descriptor: Path | bytes = DEFAULT_DESCRIPTOR,
    tls: TlsFiles | None = None,
    api_keys: Sequence[str] = (),
    metrics: str | None = None,
    upstream_retries: int = DEFAULT_UPSTREAM_RETRIES,
    upstream_tls_dir: str | None = None,
) -> dict[str, Any]:
    """Envoy in front of one gRPC upstream (``host:port``: the gateway, or a single replica).

    ``descriptor``: the path of ``protos/tandem.binpb``, or its bytes to inline them.
    ``admin_port`` 0 lets the kernel pick one. ``tls``: also serve HTTPS. ``api_keys``:
    the keys a request must carry one of (none: no check). ``metrics``: ``host:port`` of a
    Prometheus endpoint ``GET /metrics`` returns (the gateway's ``--metrics-port``).
    ``upstream_retries``: how often a request that never reached the upstream is tried again
    (every half second on average; 0: never). ``upstream_tls_dir``: the suite's certificate
    for an upstream that is a replica started with ``--tls-dir`` (the gateway's port is
    plaintext).
    """
    if upstream_retries < 0:
        raise ValueError(f"upstream_retries must be 0 or more, not {upstream_retries}")
    target = HostPort.parse(upstream)
    rules = read_http_rules(descriptor)
    routes = edge_routes(rules, RouteTargets(UPSTREAM_CLUSTER, retries=upstream_retries,
                                             metrics_cluster=metrics and METRICS_CLUSTER,
                                             version=tandem_version()))
    return with_api_keys({
        "admin": _admin(admin_port),
        "static_resources": {
            "listeners": _listeners(listen_host, http_port, routes, filters.edge_filters(
                rules, descriptor, UPSTREAM_CLUSTER), tls),
            "clusters": [_retried(_health_checked(_with_tls(
                _cluster(UPSTREAM_CLUSTER, target), upstream_tls_dir))),
                *_metrics_cluster(metrics)],
        },
    }, api_keys)


def _picked_replica_cluster() -> dict[str, Any]:
    return {
        "name": PICKED_CLUSTER,
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": "2s",
        "original_dst_lb_config": {"use_http_header": True,
                                   "http_header_name": DESTINATION_HEADER},
        "typed_extension_protocol_options": _http2_options(),
    }


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
    metrics: str | None = None,
    upstream_tls_dir: str | None = None,
) -> dict[str, Any]:
    """Envoy that asks an ``ext_proc`` endpoint picker (``host:port``) where each request
    goes and connects straight to that replica. ``/health`` follows the picker's health.

    ``body_mode``: how the picker sees the request body, ``BUFFERED`` (one message) or
    ``FULL_DUPLEX_STREAMED`` (chunks, as Gateway API implementations run endpoint pickers).
    ``metrics``: as for ``render_envoy_bootstrap`` (e.g. the picker's metrics port).
    ``upstream_tls_dir``: the suite's certificate, for replicas started with ``--tls-dir``.
    A failed connection to the picked replica is not retried: the retry would go to the same
    replica, which the picker already knows to be gone.
    """
    if body_mode not in ("BUFFERED", "FULL_DUPLEX_STREAMED"):
        raise ValueError(f"body_mode must be BUFFERED or FULL_DUPLEX_STREAMED, not {body_mode!r}")
    rules: list[HttpRule] = read_http_rules(descriptor)
    routes = edge_routes(rules, RouteTargets(PICKED_CLUSTER, retries=0,
                                             metrics_cluster=metrics and METRICS_CLUSTER,
                                             version=tandem_version()))
    # The picker reads the body after the scripts chose the RPC, before the transcoder turns
    # it into gRPC frames.
    chain = filters.edge_filters(rules, descriptor, PICKER_CLUSTER, filters.ext_proc(
        body_mode, picker_timeout_s, PICKER_CLUSTER))
    return with_api_keys({
        "admin": _admin(admin_port),
        "static_resources": {
            "listeners": _listeners(
                listen_host, http_port, routes, chain, tls,
                # Which replica served the request, as the protocol's "served" metadata has it.
                response_headers={SERVED_HEADER: "%UPSTREAM_HOST%"}),
            "clusters": [_health_checked(_cluster(PICKER_CLUSTER, HostPort.parse(picker))),
                         _with_tls(_picked_replica_cluster(), upstream_tls_dir),
                         *_metrics_cluster(metrics)],
        },
    }, api_keys)


def dump_bootstrap(config: dict[str, Any]) -> str:
    """YAML text (block style, key order kept, no anchors or aliases) for ``envoy -c``: the
    HTTPS listener shares the HTTP one's routes and filters (the same dicts), which a plain
    dump writes as ``&id001`` / ``*id001``."""
    return dump_yaml(config)
