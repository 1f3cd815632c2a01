"""The command-line flags of Envoy's bootstrap, shared by ``tandem render envoy`` and
``python -m deploy.envoy_runner``, and the bootstrap they describe.

Owns one definition of each flag that shapes the bootstrap (the target, metrics, retries,
upstream TLS, body mode, addresses, descriptor, API keys) and turning parsed flags into a
bootstrap. The two commands differ only in defaults (a rendered file is for a pod, listening
on every interface with the admin on 9901; the runner is local, on 127.0.0.1 with a free
admin port) and in their own extras (``render``: ``--bootstrap``, HTTPS, an inlined
descriptor, ``-o``; the runner: Envoy's threads and log level). It does not own the
configuration itself (``envoy_config``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deploy.envoy.routes import DEFAULT_UPSTREAM_RETRIES
from deploy.envoy_config import (
    DEFAULT_DESCRIPTOR,
    TlsFiles,
    read_api_keys,
    render_envoy_bootstrap,
    render_picker_bootstrap,
)
from services.suite_tls import SuiteTls


@dataclass(frozen=True)
class EnvoyArgDefaults:
    """Where the two commands differ. ``http_port`` None: the flag is required."""

    http_port: int | None
    listen_host: str
    admin_port: int
    admin_help: str


def add_envoy_args(parser: argparse.ArgumentParser,
                   defaults: EnvoyArgDefaults) -> argparse._MutuallyExclusiveGroup:
    """Adds the shared flags; returns the required target group (``--upstream``, ``--picker``)
    so that a command can add a target of its own."""
    port_help = "HTTP (and h2c gRPC) port"
    if defaults.http_port is None:
        parser.add_argument("--http-port", type=int, required=True, help=port_help)
    else:
        parser.add_argument("--http-port", type=int, default=defaults.http_port,
                            help=port_help + " (default: %(default)s)")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--upstream", metavar="HOST:PORT",
                        help="the gRPC server behind Envoy: the gateway, or one replica")
    target.add_argument("--picker", metavar="HOST:PORT",
                        help="an ext_proc endpoint picker; Envoy connects to the replica it names")
    parser.add_argument(
        "--upstream-metrics", metavar="HOST:PORT", default=None,
        help="a Prometheus endpoint that GET /metrics on the HTTP port returns (the gateway's "
             "or the picker's --metrics-port; default: none, /metrics is a 404)")
    parser.add_argument(
        "--upstream-retries", type=int, default=DEFAULT_UPSTREAM_RETRIES,
        help="how often a request that never reached the upstream (connection refused) is "
             "tried again, every half second on average (default: %(default)s, ~20 s: time "
             "for a restarted gateway to come back; 0: never; not with --picker)")
    parser.add_argument(
        "--upstream-tls-dir", type=Path, default=None, metavar="DIR",
        help="the suite's certificate (tls.crt, tls.key, ca.crt, as --tls-dir for the other "
             "processes): mutual TLS to replicas started with --tls-dir (the one --picker "
             "picks, or an --upstream that is a replica)")
    parser.add_argument("--picker-body-mode", choices=("BUFFERED", "FULL_DUPLEX_STREAMED"),
                        default="BUFFERED",
                        help="how the picker receives bodies (default: %(default)s)")
    parser.add_argument("--listen-host", default=defaults.listen_host,
                        help="address to listen on (default: %(default)s)")
    parser.add_argument("--admin-port", type=int, default=defaults.admin_port,
                        help=defaults.admin_help)
    parser.add_argument("--descriptor", type=Path, default=DEFAULT_DESCRIPTOR,
                        help="the descriptor set of tandem.v1 (default: %(default)s)")
    parser.add_argument("--api-key-file", type=Path, default=None,
                        help="require one of the API keys in this file (one per line) on every "
                             "request (Authorization: Bearer KEY, or x-api-key)")
    return target


def bootstrap_from_args(args: argparse.Namespace, *, descriptor: Path | bytes | None = None,
                        tls: TlsFiles | None = None, local: bool = True) -> dict[str, Any]:
    """The bootstrap the shared flags describe. ``descriptor``: bytes to inline (default:
    ``--descriptor``'s path); ``tls``: also serve HTTPS. ``local``: Envoy runs here, so
    ``--upstream-tls-dir`` is checked now and written as an absolute path; a rendered file
    (``local=False``) names it as given, as the machine that runs Envoy sees it (a pod's
    mounted Secret). Raises ``OSError`` / ``ValueError`` for unreadable files and bad values."""
    api_keys = read_api_keys(args.api_key_file) if args.api_key_file else []
    tls_dir = None
    if args.upstream_tls_dir is not None:
        tls_dir = str(args.upstream_tls_dir)
        if local:
            SuiteTls.load(args.upstream_tls_dir)  # the files are there and readable
            tls_dir = str(args.upstream_tls_dir.resolve())
    described = args.descriptor if descriptor is None else descriptor
    if args.picker:
        return render_picker_bootstrap(
            args.http_port, args.picker, admin_port=args.admin_port,
            listen_host=args.listen_host, descriptor=described, body_mode=args.picker_body_mode,
            tls=tls, api_keys=api_keys, metrics=args.upstream_metrics, upstream_tls_dir=tls_dir)
    return render_envoy_bootstrap(
        args.http_port, args.upstream, admin_port=args.admin_port, listen_host=args.listen_host,
        descriptor=described, tls=tls, api_keys=api_keys, metrics=args.upstream_metrics,
        upstream_retries=args.upstream_retries, upstream_tls_dir=tls_dir)
