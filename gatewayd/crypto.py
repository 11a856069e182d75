"""Secrets at rest: AES-GCM sealing, credential hashing, password hashing."""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import hmac
import os
import secrets
from pathlib import Path

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

class SecretBox:
    """Encrypts small values (role secrets, signing keys) with AES-256-GCM."""

    __slots__ = ("_aead",)
    _VERSION = b"\x01"

    def __init__(self, key: bytes) -> None:
        if len(key) != 32:
            raise ValueError("the secrets key must be 32 bytes")
        self._aead = AESGCM(key)

    def seal(self, plaintext: bytes, context: bytes = b"") -> bytes:
        nonce = os.urandom(12)
        return self._VERSION + nonce + self._aead.encrypt(nonce, plaintext, context)

    def open(self, sealed: bytes, context: bytes = b"") -> bytes:
        if not sealed or sealed[:1] != self._VERSION:
            raise ValueError("unknown sealed-value format")
        return self._aead.decrypt(sealed[1:13], sealed[13:], context)


def load_or_create_key(configured: str, data_dir: Path) -> bytes:
    """The 32-byte master key: from config (base64) or ``<data_dir>/master.key``."""
    if configured:
        try:
            key = base64.b64decode(configured, validate=True)
        except ValueError:
            key = b""
        if len(key) != 32:
            from gatewayd.settings import ConfigError

            raise ConfigError("secrets.key: expected base64 of 32 random bytes")
        return key
    path = data_dir / "master.key"
    if path.exists():
        key = base64.b64decode(path.read_bytes().strip())
        if len(key) != 32:
            raise ValueError(f"{path}: not a 32-byte base64 key")
        return key
    key = os.urandom(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(base64.b64encode(key) + b"\n")
    return key


def new_credential_secret(prefix: str) -> str:
    """``<prefix>-<43 base64url chars>`` (32 random bytes)."""
    return f"{prefix}-{secrets.token_urlsafe(32)}"


def hash_secret(secret: str) -> str:
    """The only form in which a credential secret is stored."""
    return hashlib.sha256(secret.encode()).hexdigest()


_SCRYPT_N, _SCRYPT_R, _SCRYPT_P = 2**14, 8, 1
MIN_PASSWORD_LENGTH = 8  # characters of a local password (the API, whose OpenAPI document states it, and the CLI)


def hash_password(password: str) -> str:
    salt = os.urandom(16)
    digest = hashlib.scrypt(password.encode(), salt=salt, n=_SCRYPT_N, r=_SCRYPT_R, p=_SCRYPT_P, dklen=32)
    return "scrypt${}${}${}${}${}".format(
        _SCRYPT_N, _SCRYPT_R, _SCRYPT_P, base64.b64encode(salt).decode(), base64.b64encode(digest).decode()
    )


def verify_password(password: str, encoded: str | None) -> bool:
    if not encoded:
        return False
    try:
        scheme, n, r, p, salt, digest = encoded.split("$")
        if scheme != "scrypt":
            return False
        expected = base64.b64decode(digest)
        actual = hashlib.scrypt(
            password.encode(), salt=base64.b64decode(salt), n=int(n), r=int(r), p=int(p), dklen=len(expected)
        )
    except (ValueError, TypeError):
        return False
    return hmac.compare_digest(actual, expected)


@functools.cache
def _decoy_hash() -> str:
    """A real scrypt hash of nothing anyone knows: an unknown e-mail is checked against it, so that it
    costs what a known one costs (no timing oracle)."""
    return hash_password(base64.b64encode(os.urandom(24)).decode())


class PasswordWork:
    """scrypt (about 50 ms of CPU each) in worker threads, at most ``limit`` at once: a login flood waits
    here instead of stalling the event loop that every proxy shares."""

    def __init__(self, limit: int = 2) -> None:
        self._slots = asyncio.Semaphore(limit)

    async def verify(self, password: str, encoded: str | None) -> bool:
        """Whether ``password`` matches; a missing hash is checked against a decoy at the same cost."""
        async with self._slots:
            if not encoded:
                await asyncio.to_thread(verify_password, password, await asyncio.to_thread(_decoy_hash))
                return False
            return await asyncio.to_thread(verify_password, password, encoded)

    async def hash(self, password: str) -> str:
        async with self._slots:
            return await asyncio.to_thread(hash_password, password)
