"""What every part of the PostgreSQL v3 codec shares: the error malformed input raises, and the protocol's
numbers (version codes, start-up request codes, size limits, authentication kinds, formats)."""

from __future__ import annotations

# --------------------------------------------------------------------------- errors


class ProtocolError(Exception):
    """The peer sent bytes that are not valid protocol-3 framing or message layout.

    ``sqlstate`` is what a server should put in the ``ErrorResponse`` it sends
    before closing: ``08P01`` (protocol_violation) unless stated otherwise,
    e.g. ``0A000`` for an unsupported protocol version.  Once a reader raised
    it, the reader is dead and raises the same error again.
    """

    def __init__(self, message: str, sqlstate: str = "08P01") -> None:
        super().__init__(message)
        self.message = message
        self.sqlstate = sqlstate


# --------------------------------------------------------------------------- constants

PROTOCOL_3_0 = 196608  # 3 << 16
PROTOCOL_3_2 = 196610  # PostgreSQL 18: variable-length cancel keys
CANCEL_REQUEST_CODE = 80877102  # 1234 << 16 | 5678
SSL_REQUEST_CODE = 80877103  # 1234 << 16 | 5679
GSSENC_REQUEST_CODE = 80877104  # 1234 << 16 | 5680

DEFAULT_MAX_FRONTEND_MESSAGE = 64 * 1024 * 1024
DEFAULT_MAX_BACKEND_MESSAGE = 1024 * 1024 * 1024
DEFAULT_MAX_STARTUP_MESSAGE = 10_000  # PostgreSQL's MAX_STARTUP_PACKET_LENGTH

MIN_CANCEL_KEY = 4
MAX_CANCEL_KEY = 256

AUTH_OK = 0
AUTH_KERBEROS_V5 = 2
AUTH_CLEARTEXT_PASSWORD = 3
AUTH_MD5_PASSWORD = 5
AUTH_GSS = 7
AUTH_GSS_CONTINUE = 8
AUTH_SSPI = 9
AUTH_SASL = 10
AUTH_SASL_CONTINUE = 11
AUTH_SASL_FINAL = 12

FORMAT_TEXT = 0
FORMAT_BINARY = 1
TEXT_OID = 25
