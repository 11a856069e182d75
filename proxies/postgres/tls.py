"""TLS for PostgreSQL clients: the listener's certificate, configured or generated once in the data dir."""

from __future__ import annotations

import ssl
from pathlib import Path

from gatewayd import tls

CERT_NAME = "postgres-tls.crt"
KEY_NAME = "postgres-tls.key"
generate_self_signed = tls.generate_self_signed


def certificate_paths(data_dir: Path, cert: str, key: str) -> tuple[Path, Path]:
    """The configured pair, or the data dir's pair generated on first use."""
    return tls.certificate_paths(data_dir, cert, key, "postgres-tls", "postgres.tls_cert and postgres.tls_key")


def server_context(data_dir: Path, cert: str = "", key: str = "") -> ssl.SSLContext:
    """The server-side TLS context of the PostgreSQL listener (TLS 1.2 or newer)."""
    cert_path, key_path = certificate_paths(data_dir, cert, key)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_path, key_path)
    return context
