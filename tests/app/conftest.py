"""The fixtures of an app built but not started (tests/app_under_test.py): ``runtime``, its subscribed ``consumer``,
and ``handed_over``; and for the HTTP handler's and client's TLS tests, a self-signed ``certificate``."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import pytest

from tests.app_under_test import consumer, handed_over, runtime

__all__ = ["consumer", "handed_over", "runtime"]

TEST_HOST = "rebound.test"
"""A name the HTTP handler's tests resolve to 127.0.0.1 (their ``resolve_test_host``); :func:`certificate` names it."""


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and :data:`TEST_HOST`, and its key: its PEM is also the CA file."""
    pytest.importorskip("cryptography")
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rebound-test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName(TEST_HOST)]),
            False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path
