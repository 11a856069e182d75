"""Authentication helpers the gateway needs as a client of a PostgreSQL target: ``ScramSha256Client``
(RFC 5802 / RFC 7677, with SASLprep) and ``md5_password``."""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import stringprep
import unicodedata

from proxies.postgres.wire import ProtocolError


class ScramError(ProtocolError):
    """The SCRAM exchange with the target failed (malformed message, bad nonce or server signature)."""

    def __init__(self, message: str, sqlstate: str = "28000") -> None:
        super().__init__(message, sqlstate)


def md5_password(user: str, password: str, salt: bytes) -> str:
    """The answer to AuthenticationMD5Password: ``"md5" + md5(md5(password + user) + salt)`` in hex."""
    inner = hashlib.md5((password + user).encode()).hexdigest().encode()
    return "md5" + hashlib.md5(inner + bytes(salt)).hexdigest()


_SASLPREP_PROHIBITED = (
    stringprep.in_table_c12, stringprep.in_table_c21, stringprep.in_table_c22, stringprep.in_table_c3,
    stringprep.in_table_c4, stringprep.in_table_c5, stringprep.in_table_c6, stringprep.in_table_c7,
    stringprep.in_table_c8, stringprep.in_table_c9, stringprep.in_table_a1,
)


def saslprep(text: str) -> str:
    """SASLprep (RFC 4013) as PostgreSQL applies it to passwords; ValueError when prohibited.

    Pure ASCII is returned unchanged, as PostgreSQL does.
    """
    if text.isascii():
        return text
    mapped = "".join(
        " " if stringprep.in_table_c12(ch) else ch for ch in text if not stringprep.in_table_b1(ch)
    )
    normalized = unicodedata.normalize("NFKC", mapped)
    if not normalized:
        raise ValueError("empty after SASLprep")
    for ch in normalized:
        if any(check(ch) for check in _SASLPREP_PROHIBITED):
            raise ValueError(f"prohibited character U+{ord(ch):04X}")
    if any(stringprep.in_table_d1(ch) for ch in normalized):
        if any(stringprep.in_table_d2(ch) for ch in normalized):
            raise ValueError("mixed right-to-left and left-to-right text")
        if not (stringprep.in_table_d1(normalized[0]) and stringprep.in_table_d1(normalized[-1])):
            raise ValueError("right-to-left text must start and end with a right-to-left character")
    return normalized


def _normalize_password(password: str | bytes) -> bytes:
    """PostgreSQL's rule: SASLprep when it succeeds, the raw bytes otherwise."""
    if isinstance(password, bytes):
        try:
            text = password.decode("utf-8")
        except UnicodeDecodeError:
            return password
    else:
        text = password
    try:
        return saslprep(text).encode()
    except ValueError:
        return text.encode("utf-8", "surrogateescape")


def _scram_attributes(message: str, expected: str) -> dict[str, str]:
    attrs: dict[str, str] = {}
    for part in message.split(","):
        key, eq, value = part.partition("=")
        if len(key) != 1 or not eq:
            raise ScramError(f"malformed SCRAM message: {part[:20]!r}", "08P01")
        attrs.setdefault(key, value)
    missing = [k for k in expected if k not in attrs]
    if missing:
        raise ScramError(f"SCRAM message lacks attribute(s) {','.join(missing)}", "08P01")
    return attrs


class ScramSha256Client:
    """The client side of SCRAM-SHA-256 (RFC 5802 / RFC 7677), as PostgreSQL speaks it.

    Use::

        scram = ScramSha256Client(password)
        send(encode_sasl_initial_response(scram.mechanism, scram.client_first_message()))
        # AuthenticationSASLContinue -> auth.data
        send(encode_sasl_response(scram.client_final_message(auth.data)))
        # AuthenticationSASLFinal -> auth.data
        scram.verify_server_final(auth.data)   # raises ScramError on mismatch

    PostgreSQL ignores the SCRAM user name (it uses the startup ``user``), so
    it defaults to empty like libpq.  Pass ``channel_binding=("tls-server-end-point",
    hash_of_server_certificate)`` to use SCRAM-SHA-256-PLUS; ``binding_supported``
    without it says "y" (the client could bind, the server did not offer it: a
    server that does support it then fails the exchange, as a downgrade by someone
    in between would be).  PBKDF2 with the server's iteration count is CPU work:
    run ``client_final_message`` in a thread.
    """

    def __init__(
        self,
        password: str | bytes,
        *,
        username: str = "",
        nonce: str | None = None,
        channel_binding: tuple[str, bytes] | None = None,
        binding_supported: bool = False,
        max_iterations: int = 1_000_000,
    ) -> None:
        self._password = _normalize_password(password)
        self._username = username.replace("=", "=3D").replace(",", "=2C")
        self._nonce = nonce if nonce is not None else base64.b64encode(secrets.token_bytes(18)).decode()
        if not self._nonce or "," in self._nonce:
            raise ValueError("the SCRAM nonce must be non-empty printable text without commas")
        self._binding = channel_binding
        self._max_iterations = max_iterations
        if channel_binding is None:
            self._gs2_header = "y,," if binding_supported else "n,,"
        else:
            self._gs2_header = f"p={channel_binding[0]},,"
        self._client_first_bare = f"n={self._username},r={self._nonce}"
        self._server_signature: bytes | None = None
        self.done = False

    @property
    def mechanism(self) -> str:
        return "SCRAM-SHA-256" if self._binding is None else "SCRAM-SHA-256-PLUS"

    def client_first_message(self) -> bytes:
        return (self._gs2_header + self._client_first_bare).encode()

    def client_final_message(self, server_first: bytes | str) -> bytes:
        """The proof, computed from AuthenticationSASLContinue's data."""
        text = server_first if isinstance(server_first, str) else bytes(server_first).decode("utf-8", "replace")
        if text.startswith("m="):
            raise ScramError("SCRAM mandatory extensions are not supported", "08P01")
        attrs = _scram_attributes(text, "rsi")
        nonce = attrs["r"]
        if not nonce.startswith(self._nonce) or len(nonce) <= len(self._nonce):
            raise ScramError("the server's SCRAM nonce does not extend ours")
        try:
            salt = base64.b64decode(attrs["s"], validate=True)
        except (ValueError, TypeError) as exc:
            raise ScramError(f"invalid SCRAM salt: {exc}", "08P01") from None
        if not (attrs["i"].isascii() and attrs["i"].isdigit()):
            raise ScramError("invalid SCRAM iteration count", "08P01")
        iterations = int(attrs["i"])
        if not 1 <= iterations <= self._max_iterations:
            raise ScramError(f"SCRAM iteration count {iterations} out of range", "08P01")
        cbind = self._gs2_header.encode() + (self._binding[1] if self._binding else b"")
        final_without_proof = f"c={base64.b64encode(cbind).decode()},r={nonce}"
        auth_message = f"{self._client_first_bare},{text},{final_without_proof}".encode()
        salted = hashlib.pbkdf2_hmac("sha256", self._password, salt, iterations)
        client_key = hmac.digest(salted, b"Client Key", "sha256")
        stored_key = hashlib.sha256(client_key).digest()
        client_signature = hmac.digest(stored_key, auth_message, "sha256")
        proof = bytes(a ^ b for a, b in zip(client_key, client_signature))
        server_key = hmac.digest(salted, b"Server Key", "sha256")
        self._server_signature = hmac.digest(server_key, auth_message, "sha256")
        return f"{final_without_proof},p={base64.b64encode(proof).decode()}".encode()

    def verify_server_final(self, server_final: bytes | str) -> None:
        """Check AuthenticationSASLFinal's ``v=`` signature; raise ScramError when it is wrong."""
        if self._server_signature is None:
            raise ScramError("verify_server_final() before client_final_message()", "08P01")
        text = bytes(server_final).decode("utf-8", "replace") if not isinstance(server_final, str) else server_final
        if text.startswith("e="):
            raise ScramError(f"SCRAM authentication failed: {text[2:]}")
        attrs = _scram_attributes(text, "v")
        try:
            signature = base64.b64decode(attrs["v"], validate=True)
        except (ValueError, TypeError):
            raise ScramError("invalid SCRAM server signature encoding", "08P01") from None
        if not hmac.compare_digest(signature, self._server_signature):
            raise ScramError("the server's SCRAM signature is wrong: it does not know the password")
        self.done = True
