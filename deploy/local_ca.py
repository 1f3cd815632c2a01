"""A throwaway certificate authority for the suite's mutual TLS (``services.suite_tls``).

Owns making a CA and one member certificate it signs for ``SUITE_NAME``, written as
``ca.crt``, ``tls.crt`` and ``tls.key`` (the key readable by its owner only): what
``tandem up`` gives every process it starts, and what ``tandem tls init DIR`` writes for a
Kubernetes Secret (``kubectl create secret generic NAME-tls --from-file=DIR``). The CA's own
key is not kept: nothing can sign another member later, which suits a suite started once. A
production cluster would rather have cert-manager issue them.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from services.suite_tls import CA_FILE, CERT_FILE, KEY_FILE, SUITE_NAME

VALIDITY = datetime.timedelta(days=30)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_suite_certificates(directory: Path) -> Path:
    """Write a fresh CA and member certificate into ``directory``; returns it."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (x509.CertificateBuilder()
               .subject_name(_name("Tandem suite CA")).issuer_name(_name("Tandem suite CA"))
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + VALIDITY)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(_name(SUITE_NAME)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(SUITE_NAME)]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CA_FILE).write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    (directory / CERT_FILE).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path = directory / KEY_FILE
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(key.private_bytes(serialization.Encoding.PEM,
                                    serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))
    return directory
