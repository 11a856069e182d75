"""The gateway's own TLS certificates: configured, or generated once in the data dir (PostgreSQL listener, gRPC)."""

from __future__ import annotations

import datetime
import fcntl
import hashlib
import ipaddress
import os
import ssl
from pathlib import Path


def generate_self_signed(cert_path: Path, key_path: Path, common_name: str = "gatewayd",
                         names: tuple[str, ...] = ()) -> None:
    """A self-signed ECDSA P-256 certificate for localhost (and ``names``), valid ten years; the key is written 0600."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    alternatives: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                            x509.IPAddress(ipaddress.ip_address("::1"))]
    for extra in names:
        try:
            alternatives.append(x509.IPAddress(ipaddress.ip_address(extra)))
        except ValueError:
            alternatives.append(x509.DNSName(extra))
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.SubjectAlternativeName(alternatives), critical=False)
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


def certificate_paths(data_dir: Path, cert: str, key: str, base: str, settings: str,
                      names: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """The configured pair, or ``<data_dir>/<base>.crt`` and ``.key`` generated on first use.

    ``settings`` names the two configuration keys in the error when only one is set.
    """
    if bool(cert) != bool(key):
        raise ValueError(f"{settings}: set both or neither")
    if cert:
        return Path(cert).expanduser(), Path(key).expanduser()
    cert_path, key_path = data_dir / f"{base}.crt", data_dir / f"{base}.key"
    if cert_path.exists() and key_path.exists():
        return cert_path, key_path
    data_dir.mkdir(parents=True, exist_ok=True)
    # the workers of a node start at once: one generates the pair, the others wait and read it
    with open(data_dir / f"{base}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (cert_path.exists() and key_path.exists()):
            generate_self_signed(cert_path, key_path, names=names)
    return cert_path, key_path


def fingerprint(pem: bytes) -> str:
    """SHA-256 of a PEM certificate's DER bytes, in hex: what a client pins (``--tls-fingerprint``)."""
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem.decode())).hexdigest()


VERIFIED_MODES = ("verify-ca", "verify-full")  # the SSLMODEs whose TLS verifies the target's certificate


def target_context(sslmode: str, rootcert: str = "") -> ssl.SSLContext:
    """The TLS context toward a database target under libpq's SSLMODE words (``verify-full`` checks the name
    too, ``verify-ca`` the chain only, any other nothing); ``rootcert``: PEM certificates to trust, else the
    system's.  ValueError when ``rootcert`` is not PEM."""
    try:
        context = ssl.create_default_context(cadata=rootcert or None)
    except (ssl.SSLError, ValueError):
        raise ValueError("not a PEM certificate") from None
    if sslmode != "verify-full":
        context.check_hostname = False
    if sslmode not in VERIFIED_MODES:
        context.verify_mode = ssl.CERT_NONE
    return context
