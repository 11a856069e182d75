"""Secrets at rest, credential hashing, password hashing, redaction and log scrubbing."""

import logging
import os

import pytest
from cryptography.exceptions import InvalidTag

from gatewayd.audit import REDACTED, redact
from gatewayd.crypto import (
    SecretBox,
    hash_password,
    hash_secret,
    load_or_create_key,
    new_credential_secret,
    verify_password,
)
from gatewayd.logs import JSONFormatter, PlainFormatter, scrub


def test_secret_box_round_trip_and_tamper_detection():
    box = SecretBox(os.urandom(32))
    sealed = box.seal(b"hunter2", b"conn-1")
    assert b"hunter2" not in sealed
    assert box.open(sealed, b"conn-1") == b"hunter2"
    with pytest.raises(InvalidTag):
        box.open(sealed, b"conn-2")  # bound to its record
    with pytest.raises(InvalidTag):
        box.open(sealed[:-1] + bytes([sealed[-1] ^ 1]), b"conn-1")
    with pytest.raises(InvalidTag):
        SecretBox(os.urandom(32)).open(sealed, b"conn-1")


def test_master_key_is_created_once_with_private_mode(tmp_path):
    key = load_or_create_key("", tmp_path)
    assert len(key) == 32
    assert (tmp_path / "master.key").stat().st_mode & 0o777 == 0o600
    assert load_or_create_key("", tmp_path) == key


def test_credential_secret_format_and_hash():
    secret = new_credential_secret("pg")
    prefix, rest = secret.split("-", 1)
    assert prefix == "pg" and len(rest) == 43
    assert hash_secret(secret) != secret and len(hash_secret(secret)) == 64
    assert new_credential_secret("pg") != secret


def test_password_hash_uses_scrypt_and_verifies():
    encoded = hash_password("correct horse")
    assert encoded.startswith("scrypt$") and "correct horse" not in encoded
    assert verify_password("correct horse", encoded)
    assert not verify_password("wrong", encoded)
    assert not verify_password("x", None)
    assert not verify_password("x", "garbage")


def test_redact_replaces_secrets_recursively():
    payload = {"name": "db", "password": "p", "roles": [{"name": "r", "secret": {"envvar:PASS": "c2VjcmV0",
                                                                                   "envvar:HOST": "aG9zdA=="}}],
               "ssh_server_config": {"listen_address": "x:1", "hosts_key": "PEM"}, "envvar:PASS": "zzz"}
    out = redact(payload)
    assert out["name"] == "db" and out["password"] == REDACTED and out["envvar:PASS"] == REDACTED
    assert out["roles"][0]["secret"] == {"envvar:PASS": REDACTED, "envvar:HOST": REDACTED}
    assert out["ssh_server_config"] == {"listen_address": "x:1", "hosts_key": REDACTED}
    assert payload["password"] == "p"  # the original is untouched


def test_logs_never_print_credentials_or_tokens():
    secret = new_credential_secret("ssh")
    jwt_like = "eyJhbGciOiJFZERTQSJ9.eyJzdWIiOiJ4In0.c2lnbmF0dXJl"
    assert secret not in scrub(f"login with {secret}")
    assert jwt_like not in scrub(f"token {jwt_like}")
    assert "abc" not in scrub("Authorization: Bearer abc")
    for ending in ("-", "_"):  # a secret ending in a non-word character is found too
        edge = "pg-" + "a" * 42 + ending
        assert scrub(f"user {edge}") == "user [REDACTED]" and scrub(f"/{edge}/x") == "/[REDACTED]/x"
    record = logging.makeLogRecord({"msg": "user sent %s", "args": (secret,), "levelname": "INFO",
                                    "name": "t", "credential": secret})
    for formatter in (JSONFormatter(), PlainFormatter()):
        line = formatter.format(record)
        assert secret not in line and "[REDACTED]" in line
