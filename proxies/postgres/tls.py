"""TLS for PostgreSQL clients: the listener's certificate, configured or generated once in the data dir."""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
from pathlib import Path

CERT_NAME = "postgres-tls.crt"
KEY_NAME = "postgres-tls.key"


def generate_self_signed(cert_path: Path, key_path: Path, common_name: str = "gatewayd") -> None:
    """A self-signed ECDSA P-256 certificate for localhost, valid ten years; the key is written 0600."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            x509.IPAddress(ipaddress.ip_address("::1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_path.parent.mkdir(parents=True, exist_ok=True)
    key_bytes = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption())
    temporary = key_path.with_suffix(".tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(key_bytes)
    os.replace(temporary, key_path)
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))


def certificate_paths(data_dir: Path, cert: str, key: str) -> tuple[Path, Path]:
    """The configured pair, or the data dir's pair generated on first use."""
    if bool(cert) != bool(key):
        raise ValueError("postgres.tls_cert and postgres.tls_key: set both or neither")
    if cert:
        return Path(cert).expanduser(), Path(key).expanduser()
    cert_path, key_path = data_dir / CERT_NAME, data_dir / KEY_NAME
    if not (cert_path.exists() and key_path.exists()):
        generate_self_signed(cert_path, key_path)
    return cert_path, key_path


def server_context(data_dir: Path, cert: str = "", key: str = "") -> ssl.SSLContext:
    """The server-side TLS context of the PostgreSQL listener (TLS 1.2 or newer)."""
    cert_path, key_path = certificate_paths(data_dir, cert, key)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_path, key_path)
    return context
