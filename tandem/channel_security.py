"""How the SDK's clients secure their channel: plaintext, TLS, or mutual TLS.

Owns ``TlsConfig`` (the CA to trust, an optional client certificate, the name the server's
certificate must carry) and making the channel from it. Mutual TLS is what a Tandem suite's
replicas ask of every caller (``--tls-dir``): ``TlsConfig.from_dir`` reads such a directory
(``ca.crt``, ``tls.crt``, ``tls.key``, a Kubernetes TLS Secret's layout) and checks the
server for the suite's name, as the suite's own processes do.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio

# The name a Tandem suite's certificates are issued for (services.suite_tls.SUITE_NAME).
SUITE_NAME = "tandem.internal"


@dataclass(frozen=True)
class TlsConfig:
    root_certificates: bytes | None = None  # None: the system's CAs
    certificate_chain: bytes | None = None  # with private_key: mutual TLS
    private_key: bytes | None = None
    server_name: str | None = None  # checked instead of the target's host

    @classmethod
    def from_dir(cls, directory: Path, server_name: str = SUITE_NAME) -> TlsConfig:
        """A suite member's files: ``ca.crt``, ``tls.crt``, ``tls.key``."""
        return cls((directory / "ca.crt").read_bytes(), (directory / "tls.crt").read_bytes(),
                   (directory / "tls.key").read_bytes(), server_name)

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key,
                                            self.certificate_chain)

    def options(self) -> list[tuple[str, str]]:
        return [] if self.server_name is None else [
            ("grpc.ssl_target_name_override", self.server_name)]


def resolve_tls(tls: bool | TlsConfig, root_certificates: bytes | None) -> TlsConfig | None:
    """``tls`` as the clients take it (``True``: the system's CAs; ``root_certificates``
    implies TLS), or None for plaintext."""
    if isinstance(tls, TlsConfig):
        return tls
    if not tls and root_certificates is None:
        return None
    return TlsConfig(root_certificates=root_certificates)


def open_channel(target: str, tls: TlsConfig | None) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(target)
    return grpc.secure_channel(target, tls.credentials(), options=tls.options())


def open_aio_channel(target: str, tls: TlsConfig | None) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(target)
    return grpc.aio.secure_channel(target, tls.credentials(), options=tls.options())
