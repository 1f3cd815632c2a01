"""The suite's mutual TLS: every internal gRPC hop proves it is a member of the suite.

A suite's members (replicas, gateways, endpoint pickers, and Envoy where it calls replicas
directly) share one certificate authority. Each member holds a certificate it signed, issued
for ``SUITE_NAME``, and the CA's certificate; files in one directory laid out as a
Kubernetes TLS Secret (``tls.crt``, ``tls.key``, ``ca.crt``, as cert-manager writes them), given
with ``--tls-dir``. A replica serves only callers presenting such a certificate (its public and
internal APIs share its port); gateways, pickers and decode replicas dial replicas with theirs
and accept only a server whose certificate the CA signed for ``SUITE_NAME``, so a decode
replica pulls KV handles only from suite members, whatever address a request names. Without
``--tls-dir`` every hop is plaintext (tests, a trusted network). Every internal channel
carries the suite's client interceptors: the W3C trace context of each call
(``services.observability.trace_interceptors``) and the replica each request went to, for its
log line (``peer_interceptor``). It does not own making the files (``deploy.local_ca``) or the
clients' edge (API keys at Envoy).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from services.observability.peer_interceptor import peer_interceptors
from services.observability.trace_interceptors import trace_client_interceptors

# The name every member's certificate is issued for: members are dialed by IP (pod IPs),
# so the name checked is the suite's, not the address's.
SUITE_NAME = "tandem.internal"
CA_FILE, CERT_FILE, KEY_FILE = "ca.crt", "tls.crt", "tls.key"


@dataclass(frozen=True)
class SuiteTls:
    """A member's certificate, key and the suite CA, read from ``--tls-dir``."""

    ca: bytes
    cert: bytes
    key: bytes

    @classmethod
    def load(cls, directory: Path) -> SuiteTls:
        files = {name: directory / name for name in (CA_FILE, CERT_FILE, KEY_FILE)}
        missing = [str(path) for path in files.values() if not path.is_file()]
        if missing:
            raise ValueError(f"--tls-dir {directory} lacks {', '.join(missing)}: it needs "
                             f"{CA_FILE}, {CERT_FILE} and {KEY_FILE} (tandem tls init DIR "
                             "makes a set)")
        return cls(files[CA_FILE].read_bytes(), files[CERT_FILE].read_bytes(),
                   files[KEY_FILE].read_bytes())

    def server_credentials(self) -> grpc.ServerCredentials:
        """Serve with this member's certificate; require a client certificate the CA signed."""
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)


CHANNEL_NAME_OPTION = ("grpc.ssl_target_name_override", SUITE_NAME)
# A member that vanishes without closing its connections (its host lost, a partition) is
# noticed by pings while a call is open: within about ten seconds, not when TCP gives up
# (minutes). The servers accept pings this often (``services.frontend.grpc_server``).
KEEPALIVE_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", 5_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
)


def aio_channel(target: str, tls: SuiteTls | None,
                options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """A channel to a suite member: mutual TLS when the suite has it, else plaintext; with
    keepalive pings unless ``options`` set them otherwise."""
    options = list({**dict(KEEPALIVE_OPTIONS), **dict(options)}.items())
    interceptors = [*trace_client_interceptors(target), *peer_interceptors(target)]
    if tls is None:
        return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(target, tls.channel_credentials(),
                                   options=[*options, CHANNEL_NAME_OPTION],
                                   interceptors=interceptors)


def channel(target: str, tls: SuiteTls | None) -> grpc.Channel:
    """The blocking kind of ``aio_channel`` (health checks from a supervisor, tests)."""
    if tls is None:
        return grpc.insecure_channel(target)
    return grpc.secure_channel(target, tls.channel_credentials(), options=[CHANNEL_NAME_OPTION])


def add_port(server: grpc.aio.Server, address: str, tls: SuiteTls | None) -> int:
    """Listen on ``address``: mutual TLS when the suite has it, else plaintext."""
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.server_credentials())


def add_tls_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tls-dir", type=Path, default=None,
                        help=f"mutual TLS with the suite's other processes: a directory holding "
                             f"{CERT_FILE}, {KEY_FILE} and {CA_FILE} (a Kubernetes TLS Secret's "
                             "layout; tandem up makes a throwaway set; default: plaintext)")


def tls_from_args(args: argparse.Namespace) -> SuiteTls | None:
    return None if args.tls_dir is None else SuiteTls.load(args.tls_dir)
