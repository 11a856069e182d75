"""Pure codec for the PostgreSQL frontend/backend protocol, version 3.

Bytes in, messages out; messages in, bytes out.  No sockets, no asyncio, no
clock: the asyncio server owns the I/O and calls into this module, so every
edge case is a two-line unit test and the framers can be fuzzed (in the manner
of h11's ``_events`` / ``_readers`` / ``_writers``).

Layout of this module:

* ``ProtocolError`` -- malformed input; carries a SQLSTATE (``08P01``) so a
  server can answer with an ``ErrorResponse`` before it closes.
* Message classes -- what can happen on the wire.  A message is a *view* of
  its raw frame (``msg.frame`` is a ``memoryview``, no copy) and decodes its
  fields lazily, on first access, caching the result.  Unknown type bytes
  frame fine and come out as ``UnknownMessage``.
* Readers -- ``FrontendReader`` (client to server, with the untyped start-up
  phase) and ``BackendReader`` (server to client).  ``feed(data)`` then
  ``next_message()`` (or iterate) until it returns ``None``.
* Writers -- ``encode_*`` functions returning ``bytes`` ready to send.
* ``render_row`` -- cheap text rendering of a ``DataRow`` for recording and
  guard rails.
* Authentication helpers the gateway needs as a client of the target:
  ``ScramSha256Client`` (RFC 5802 / RFC 7677) and ``md5_password``.

Zero copy on the hot path: fed ``bytes`` chunks are kept as they are, and a
frame that lies inside one chunk is handed out as (chunk, start, end) -- the
relay forwards ``msg.frame`` (or ``coalesce_frames(msgs)``) and nothing is
copied or parsed unless a rule or the recorder asks for the fields.  Only a
frame that straddles two chunks is joined (one copy of that frame), and tiny
feeds are coalesced so a trickling peer cannot make the buffer quadratic or
balloon into millions of small objects.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import stringprep
import struct
import unicodedata
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = [
    "AUTH_CLEARTEXT_PASSWORD",
    "AUTH_GSS",
    "AUTH_GSS_CONTINUE",
    "AUTH_KERBEROS_V5",
    "AUTH_MD5_PASSWORD",
    "AUTH_OK",
    "AUTH_SASL",
    "AUTH_SASL_CONTINUE",
    "AUTH_SASL_FINAL",
    "AUTH_SSPI",
    "BACKEND_TYPES",
    "CANCEL_REQUEST_CODE",
    "DEFAULT_MAX_BACKEND_MESSAGE",
    "DEFAULT_MAX_FRONTEND_MESSAGE",
    "DEFAULT_MAX_STARTUP_MESSAGE",
    "ERROR_FIELD_NAMES",
    "FORMAT_BINARY",
    "FORMAT_TEXT",
    "FRONTEND_TYPES",
    "GSSENC_REQUEST_CODE",
    "PROTOCOL_3_0",
    "PROTOCOL_3_2",
    "SSL_REQUEST_CODE",
    "TEXT_OID",
    "Authentication",
    "BackendKeyData",
    "BackendReader",
    "Bind",
    "BindComplete",
    "CancelRequest",
    "Close",
    "CloseComplete",
    "CommandComplete",
    "CopyBothResponse",
    "CopyData",
    "CopyDone",
    "CopyFail",
    "CopyInResponse",
    "CopyOutResponse",
    "DataRow",
    "Describe",
    "EmptyQueryResponse",
    "ErrorResponse",
    "Execute",
    "FieldDescription",
    "Flush",
    "FrameBatch",
    # readers
    "FrontendReader",
    "FunctionCall",
    "FunctionCallResponse",
    "GSSENCRequest",
    # messages
    "Message",
    "NegotiateProtocolVersion",
    "NoData",
    "NoticeResponse",
    "NotificationResponse",
    "ParameterDescription",
    "ParameterStatus",
    "Parse",
    "ParseComplete",
    "PasswordMessage",
    "PortalSuspended",
    # errors and constants
    "ProtocolError",
    "Query",
    "ReadyForQuery",
    "RowDescription",
    "SSLRequest",
    "ScramError",
    "ScramSha256Client",
    "StartupMessage",
    "Sync",
    "Terminate",
    "UnknownMessage",
    "coalesce_frames",
    "decode_backend",
    "decode_frontend",
    "encode_authentication_cleartext_password",
    "encode_authentication_md5_password",
    "encode_authentication_ok",
    "encode_authentication_sasl",
    "encode_authentication_sasl_continue",
    "encode_authentication_sasl_final",
    "encode_backend_key_data",
    "encode_bind",
    "encode_bind_complete",
    "encode_cancel_request",
    "encode_close",
    "encode_close_complete",
    "encode_command_complete",
    "encode_copy_both_response",
    "encode_copy_data",
    "encode_copy_done",
    "encode_copy_fail",
    "encode_copy_in_response",
    "encode_copy_out_response",
    "encode_data_row",
    "encode_describe",
    "encode_empty_query_response",
    "encode_error_response",
    "encode_execute",
    "encode_flush",
    "encode_function_call",
    "encode_function_call_response",
    "encode_gssenc_request",
    # writers
    "encode_message",
    "encode_negotiate_protocol_version",
    "encode_no_data",
    "encode_notice_response",
    "encode_notification_response",
    "encode_parameter_description",
    "encode_parameter_status",
    "encode_parse",
    "encode_parse_complete",
    "encode_password",
    "encode_portal_suspended",
    "encode_query",
    "encode_ready_for_query",
    "encode_row_description",
    "encode_sasl_initial_response",
    "encode_sasl_response",
    "encode_ssl_request",
    "encode_startup_message",
    "encode_sync",
    "encode_terminate",
    "is_direct_tls_start",
    "md5_password",
    # helpers
    "render_row",
    "render_text_row",
    "resolve_formats",
    "saslprep",
]

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


class ScramError(ProtocolError):
    """The SCRAM exchange with the target failed (malformed message, bad nonce or server signature)."""

    def __init__(self, message: str, sqlstate: str = "28000") -> None:
        super().__init__(message, sqlstate)


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

_AUTH_KINDS = {
    AUTH_OK: "ok",
    AUTH_KERBEROS_V5: "kerberos_v5",
    AUTH_CLEARTEXT_PASSWORD: "cleartext",
    AUTH_MD5_PASSWORD: "md5",
    AUTH_GSS: "gss",
    AUTH_GSS_CONTINUE: "gss_continue",
    AUTH_SSPI: "sspi",
    AUTH_SASL: "sasl",
    AUTH_SASL_CONTINUE: "sasl_continue",
    AUTH_SASL_FINAL: "sasl_final",
}

FORMAT_TEXT = 0
FORMAT_BINARY = 1
TEXT_OID = 25

_COALESCE_BELOW = 4096  # feeds smaller than this are copied into an accumulator
_ACCUMULATOR_SIZE = 256 * 1024  # ... that is sealed once it reaches this size

_i16 = struct.Struct("!h").unpack_from
_u16 = struct.Struct("!H").unpack_from
_i32 = struct.Struct("!i").unpack_from
_u32 = struct.Struct("!I").unpack_from
_HEADER = struct.Struct("!ci")  # type byte + length (signed, so garbage shows as negative)
_FIELD = struct.Struct("!IhIhih")  # a RowDescription field after its name


def _text(raw: bytes) -> str:
    if type(raw) is bytes:
        data = raw  # typed when compiled: decoded by a C call
        return data.decode("utf-8", "replace")
    return bytes(raw).decode("utf-8", "replace")


# Integers read in place from a ``bytes`` frame whose length the caller checked (compiled, each is a few C
# operations): the fast paths' readers. ``_Cursor`` and the ``_i32``-style struct readers take any buffer.
def _int32_at(buf: bytes, pos: int) -> int:
    return ((buf[pos] ^ 0x80) - 0x80) * 0x1000000 + ((buf[pos + 1] << 16) | (buf[pos + 2] << 8) | buf[pos + 3])


def _uint32_at(buf: bytes, pos: int) -> int:
    return (buf[pos] << 24) | (buf[pos + 1] << 16) | (buf[pos + 2] << 8) | buf[pos + 3]


def _int16_at(buf: bytes, pos: int) -> int:
    return ((buf[pos] ^ 0x80) - 0x80) * 0x100 + buf[pos + 1]


def _uint16_at(buf: bytes, pos: int) -> int:
    return (buf[pos] << 8) | buf[pos + 1]


# --------------------------------------------------------------------------- field cursor


class _Cursor:
    """Reads the fields of one message body; every short read is a ProtocolError."""

    __slots__ = ("buf", "end", "pos", "what")

    def __init__(self, buf: bytes, pos: int, end: int, what: str) -> None:
        self.buf = buf
        self.pos = pos
        self.end = end
        self.what = what

    def fail(self, why: str) -> ProtocolError:
        return ProtocolError(f"malformed {self.what} message: {why}")

    def _need(self, n: int) -> int:
        pos = self.pos
        if n < 0 or pos + n > self.end:
            raise self.fail("unexpected end of message")
        self.pos = pos + n
        return pos

    def byte(self) -> int:
        return self.buf[self._need(1)]

    def int16(self) -> int:
        return _i16(self.buf, self._need(2))[0]

    def uint16(self) -> int:
        return _u16(self.buf, self._need(2))[0]

    def int32(self) -> int:
        return _i32(self.buf, self._need(4))[0]

    def uint32(self) -> int:
        return _u32(self.buf, self._need(4))[0]

    def take(self, n: int) -> bytes:
        pos = self._need(n)
        return self.buf[pos : pos + n]

    def cbytes(self) -> bytes:
        nul = self.buf.find(b"\0", self.pos, self.end)
        if nul < 0:
            raise self.fail("string is not NUL-terminated")
        value = self.buf[self.pos : nul]
        self.pos = nul + 1
        return value

    def cstring(self) -> str:
        return _text(self.cbytes())

    def rest(self) -> bytes:
        value = self.buf[self.pos : self.end]
        self.pos = self.end
        return value

    def value(self) -> bytes | None:
        """An Int32-length-prefixed value, -1 meaning NULL."""
        n = self.int32()
        if n == -1:
            return None
        if n < 0:
            raise self.fail(f"negative value length {n}")
        return self.take(n)

    def int16_list(self) -> list[int]:
        n = self.uint16()
        pos = self._need(2 * n)
        return list(struct.unpack_from(f"!{n}h", self.buf, pos))

    def uint32_list(self, n: int) -> list[int]:
        pos = self._need(4 * n)
        return list(struct.unpack_from(f"!{n}I", self.buf, pos))

    def finish(self) -> None:
        if self.pos != self.end:
            raise self.fail(f"{self.end - self.pos} trailing bytes")


# --------------------------------------------------------------------------- messages


class Message:
    """One framed message: a view of its raw bytes plus lazily decoded fields.

    ``frame`` is the whole message as sent (type byte, length, body) and can be
    forwarded as is; ``body`` is what follows the length.  Field properties of
    the subclasses decode on first access and cache; malformed bodies raise
    ``ProtocolError`` at that point, never earlier, so relaying costs nothing.
    """

    __slots__ = ("_buf", "_cache", "_end", "_start")

    TYPE: ClassVar[bytes] = b""  # the type byte; b"" for the untyped start-up messages
    _HEADER: ClassVar[int] = 5  # bytes in front of the body
    _FIELDS: ClassVar[tuple[str, ...]] = ()  # decoded fields, for to_dict() / repr()
    _SECRET: ClassVar[bool] = False  # never show the fields (passwords)

    def __init__(self, buf: bytes, start: int = 0, end: int | None = None) -> None:
        self._buf = buf
        self._start = start
        self._end = len(buf) if end is None else end
        self._cache: Any = None

    @property
    def frame(self) -> memoryview:
        """The complete raw message, without copying."""
        return memoryview(self._buf)[self._start : self._end]

    @property
    def body(self) -> memoryview:
        """The message contents after the type byte and the length."""
        return memoryview(self._buf)[self._start + self._HEADER : self._end]

    @property
    def type_code(self) -> bytes:
        """The type byte (``b"Q"``, ``b"D"``, ...); ``b""`` for start-up messages."""
        return self.TYPE

    def __len__(self) -> int:
        return self._end - self._start

    def __bytes__(self) -> bytes:
        return self._buf[self._start : self._end]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Message):
            return NotImplemented
        return type(self) is type(other) and bytes(self) == bytes(other)

    def __hash__(self) -> int:
        return hash((type(self), bytes(self)))

    def _cursor(self) -> _Cursor:
        return _Cursor(self._buf, self._start + self._HEADER, self._end, type(self).__name__)

    def _decoded(self) -> Any:
        cache = self._cache
        if cache is None:
            cache = self._cache = self._decode()
        return cache

    def _decode(self) -> Any:
        return ()

    def validate(self) -> None:
        """Decode every field now; raise ``ProtocolError`` if the body is malformed."""
        self._decoded()

    def to_dict(self) -> dict[str, Any]:
        """All decoded fields (for logs, tests and recordings); secrets are left out."""
        self._decoded()
        if self._SECRET:
            return {"length": len(self)}
        return {name: getattr(self, name) for name in self._FIELDS}

    def __repr__(self) -> str:
        try:
            fields = ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items())
        except ProtocolError as exc:
            fields = f"<malformed: {exc.message}>"
        return f"{type(self).__name__}({fields})"


class _Empty(Message):
    """A message whose body must be empty."""

    __slots__ = ()

    def _decode(self) -> Any:
        self._cursor().finish()
        return True


class UnknownMessage(Message):
    """A typed message whose type byte this codec does not know; framed, not interpreted."""

    __slots__ = ()
    _FIELDS = ("type_code", "length")

    @property
    def type_code(self) -> bytes:
        return self._buf[self._start : self._start + 1]

    @property
    def length(self) -> int:
        return len(self)


# ----- start-up phase (frontend, untyped)


class _Untyped(Message):
    __slots__ = ()
    _HEADER = 4

    @property
    def code(self) -> int:
        """The request code / protocol version that follows the length."""
        return _u32(self._buf, self._start + 4)[0]


class StartupMessage(_Untyped):
    """The client's first message: protocol version and connection parameters (user, database, ...)."""

    __slots__ = ()
    _FIELDS = ("protocol", "parameters")

    @property
    def protocol(self) -> int:
        return self.code

    @property
    def major(self) -> int:
        return self.code >> 16

    @property
    def minor(self) -> int:
        return self.code & 0xFFFF

    def _decode(self) -> dict[str, str]:
        cur = self._cursor()
        cur.uint32()
        params: dict[str, str] = {}
        while True:
            name = cur.cstring()
            if not name:
                break
            params[name] = cur.cstring()
        cur.finish()
        return params

    @property
    def parameters(self) -> dict[str, str]:
        """Parameters in wire order (a fresh dict each call)."""
        return dict(self._decoded())

    @property
    def user(self) -> str | None:
        return self._decoded().get("user")

    @property
    def database(self) -> str | None:
        params = self._decoded()
        return params.get("database", params.get("user"))


class SSLRequest(_Untyped):
    """The client asks for TLS; the server answers with the single byte ``S`` or ``N``.

    After answering ``S`` the server must check that nothing is buffered in
    the reader (``reader.buffered == 0``): plaintext sent before the TLS
    handshake is a man-in-the-middle injection (CVE-2021-23214).
    """

    __slots__ = ()

    def _decode(self) -> Any:
        cur = self._cursor()
        cur.uint32()
        cur.finish()
        return True


class GSSENCRequest(SSLRequest):
    """The client asks for GSSAPI encryption; a gateway declines with ``N``."""

    __slots__ = ()


class CancelRequest(_Untyped):
    """Sent on a fresh connection to cancel the query running on another one; the server then closes.

    The secret key is 4 bytes in protocol 3.0 and up to 256 bytes in 3.2.
    """

    __slots__ = ()
    _FIELDS = ("process_id", "secret_key")

    def _decode(self) -> tuple[int, bytes]:
        cur = self._cursor()
        cur.uint32()
        pid = cur.int32()
        key = cur.rest()
        if not MIN_CANCEL_KEY <= len(key) <= MAX_CANCEL_KEY:
            raise cur.fail(f"cancel key of {len(key)} bytes")
        return pid, key

    @property
    def process_id(self) -> int:
        return self._decoded()[0]

    @property
    def secret_key(self) -> bytes:
        return self._decoded()[1]


# ----- frontend, typed


class Query(Message):
    """Simple query: one string that may hold several statements."""

    __slots__ = ()
    TYPE = b"Q"
    _FIELDS = ("sql",)

    def _decode(self) -> bytes:
        buf, start, end = self._buf, self._start + 5, self._end
        if end > start and buf.find(b"\0", start, end) == end - 1:  # fast path: one NUL, at the end
            return buf[start : end - 1]
        cur = self._cursor()
        sql = cur.cbytes()
        cur.finish()
        return sql

    @property
    def sql_bytes(self) -> bytes:
        return self._decoded()

    @property
    def sql(self) -> str:
        return _text(self._decoded())


class Parse(Message):
    """Extended protocol: prepare ``sql`` as statement ``name`` ('' is the unnamed statement)."""

    __slots__ = ()
    TYPE = b"P"
    _FIELDS = ("name", "sql", "param_types")

    def _decode(self) -> tuple[str, str, list[int]]:
        raw, start, end = self._buf, self._start + 5, self._end
        if type(raw) is bytes:  # fast path, falling back to the cursor for its errors
            buf = raw
            nul = buf.find(b"\0", start, end)
            nul2 = buf.find(b"\0", nul + 1, end) if nul >= 0 else -1
            if nul2 >= 0 and nul2 + 3 <= end:
                n = _uint16_at(buf, nul2 + 1)
                if nul2 + 3 + 4 * n == end:
                    types = [_uint32_at(buf, at) for at in range(nul2 + 3, end, 4)]
                    return _text(buf[start:nul]), _text(buf[nul + 1 : nul2]), types
        cur = self._cursor()
        name = cur.cstring()
        sql = cur.cstring()
        types = cur.uint32_list(cur.uint16())
        cur.finish()
        return name, sql, types

    @property
    def name(self) -> str:
        return self._decoded()[0]

    @property
    def sql(self) -> str:
        return self._decoded()[1]

    @property
    def sql_bytes(self) -> bytes:
        """The statement's bytes as sent (``sql`` is their UTF-8 reading)."""
        cur = self._cursor()
        cur.cbytes()
        return cur.cbytes()

    @property
    def param_types(self) -> list[int]:
        return self._decoded()[2]


def resolve_formats(formats: Sequence[int], count: int) -> list[int]:
    """Expand a Bind/Copy format-code list: none means all text, one applies to all, else one each."""
    if not formats:
        return [FORMAT_TEXT] * count
    if len(formats) == 1:
        return [formats[0]] * count
    return list(formats)


class Bind(Message):
    """Extended protocol: bind parameter values to a statement, creating a portal."""

    __slots__ = ()
    TYPE = b"B"
    _FIELDS = ("portal", "statement", "param_formats", "params", "result_formats")

    def _decode(self) -> tuple[str, str, list[int], list[bytes | None], list[int]]:
        fast = self._decode_fast()
        if fast is not None:
            return fast
        cur = self._cursor()
        portal = cur.cstring()
        statement = cur.cstring()
        formats = cur.int16_list()
        params = [cur.value() for _ in range(cur.uint16())]
        results = cur.int16_list()
        cur.finish()
        if len(formats) > 1 and len(formats) != len(params):
            raise cur.fail(f"{len(formats)} parameter formats for {len(params)} parameters")
        return portal, statement, formats, params, results

    def _decode_fast(self) -> tuple[str, str, list[int], list[bytes | None], list[int]] | None:
        """The fields of a well-formed Bind without a cursor; None for anything odd (the cursor then says why)."""
        raw, start, end = self._buf, self._start + 5, self._end
        if type(raw) is not bytes:
            return None
        buf = raw
        nul = buf.find(b"\0", start, end)
        if nul < 0:
            return None
        nul2 = buf.find(b"\0", nul + 1, end)
        if nul2 < 0:
            return None
        pos = nul2 + 1
        if pos + 2 > end:
            return None
        n = _uint16_at(buf, pos)
        pos += 2
        if pos + 2 * n + 2 > end:
            return None
        formats = [_int16_at(buf, at) for at in range(pos, pos + 2 * n, 2)]
        pos += 2 * n
        count = _uint16_at(buf, pos)
        pos += 2
        params: list[bytes | None] = []
        for _ in range(count):
            if pos + 4 > end:
                return None
            size = _int32_at(buf, pos)
            pos += 4
            if size == -1:
                params.append(None)
                continue
            if size < 0 or pos + size > end:
                return None
            params.append(buf[pos : pos + size])
            pos += size
        if pos + 2 > end:
            return None
        n = _uint16_at(buf, pos)
        pos += 2
        if pos + 2 * n != end or (len(formats) > 1 and len(formats) != count):
            return None
        results = [_int16_at(buf, at) for at in range(pos, end, 2)]
        return _text(buf[start:nul]), _text(buf[nul + 1 : nul2]), formats, params, results

    @property
    def portal(self) -> str:
        return self._decoded()[0]

    @property
    def statement(self) -> str:
        return self._decoded()[1]

    @property
    def param_formats(self) -> list[int]:
        return self._decoded()[2]

    @property
    def params(self) -> list[bytes | None]:
        return self._decoded()[3]

    @property
    def result_formats(self) -> list[int]:
        return self._decoded()[4]

    def param_is_binary(self, index: int) -> bool:
        formats = self.param_formats
        if not formats:
            return False
        return (formats[0] if len(formats) == 1 else formats[index]) == FORMAT_BINARY


class _KindName(Message):
    __slots__ = ()
    _FIELDS = ("kind", "name")

    def _decode(self) -> tuple[str, str]:
        raw, start, end = self._buf, self._start + 5, self._end
        if type(raw) is bytes:
            buf = raw
            if end - start >= 2 and buf[start] in (0x53, 0x50) and buf.find(b"\0", start + 1, end) == end - 1:
                return chr(buf[start]), buf[start + 1 : end - 1].decode("utf-8", "replace")
        cur = self._cursor()
        kind = cur.byte()
        if kind not in (0x53, 0x50):  # 'S' statement, 'P' portal
            raise cur.fail(f"kind {kind!r} is neither 'S' nor 'P'")
        name = cur.cstring()
        cur.finish()
        return chr(kind), name

    @property
    def kind(self) -> str:
        """``"S"`` for a prepared statement, ``"P"`` for a portal."""
        return self._decoded()[0]

    @property
    def name(self) -> str:
        return self._decoded()[1]


class Describe(_KindName):
    """Extended protocol: ask for the description of a statement ('S') or portal ('P')."""

    __slots__ = ()
    TYPE = b"D"


class Close(_KindName):
    """Extended protocol: close a statement ('S') or portal ('P')."""

    __slots__ = ()
    TYPE = b"C"


class Execute(Message):
    """Extended protocol: run a portal, returning at most ``max_rows`` rows (0 = all)."""

    __slots__ = ()
    TYPE = b"E"
    _FIELDS = ("portal", "max_rows")

    def _decode(self) -> tuple[str, int]:
        raw, start, end = self._buf, self._start + 5, self._end
        if type(raw) is bytes:
            buf = raw
            nul = buf.find(b"\0", start, end)
            if nul >= 0 and nul + 5 == end:
                return _text(buf[start:nul]), _int32_at(buf, nul + 1)
        cur = self._cursor()
        portal = cur.cstring()
        rows = cur.int32()
        cur.finish()
        return portal, rows

    @property
    def portal(self) -> str:
        return self._decoded()[0]

    @property
    def max_rows(self) -> int:
        return self._decoded()[1]


class Sync(_Empty):
    """Extended protocol: end of a pipeline segment; the server answers ReadyForQuery."""

    __slots__ = ()
    TYPE = b"S"


class Flush(_Empty):
    """Extended protocol: ask the server to send what it has buffered."""

    __slots__ = ()
    TYPE = b"H"


class Terminate(_Empty):
    """The client is closing the connection."""

    __slots__ = ()
    TYPE = b"X"


class CopyData(Message):
    """A chunk of COPY data (both directions); ``data`` is a view, not a copy."""

    __slots__ = ()
    TYPE = b"d"
    _FIELDS = ("length",)

    @property
    def data(self) -> memoryview:
        return self.body

    @property
    def length(self) -> int:
        return len(self) - 5


class CopyDone(_Empty):
    """End of COPY data (both directions)."""

    __slots__ = ()
    TYPE = b"c"


class CopyFail(Message):
    """The client aborts COPY FROM STDIN with an error message."""

    __slots__ = ()
    TYPE = b"f"
    _FIELDS = ("message",)

    def _decode(self) -> str:
        cur = self._cursor()
        message = cur.cstring()
        cur.finish()
        return message

    @property
    def message(self) -> str:
        return self._decoded()


class FunctionCall(Message):
    """Legacy fast-path function call (used by large-object APIs)."""

    __slots__ = ()
    TYPE = b"F"
    _FIELDS = ("function_oid", "arg_formats", "args", "result_format")

    def _decode(self) -> tuple[int, list[int], list[bytes | None], int]:
        cur = self._cursor()
        oid = cur.uint32()
        formats = cur.int16_list()
        args = [cur.value() for _ in range(cur.uint16())]
        result = cur.int16()
        cur.finish()
        return oid, formats, args, result

    @property
    def function_oid(self) -> int:
        return self._decoded()[0]

    @property
    def arg_formats(self) -> list[int]:
        return self._decoded()[1]

    @property
    def args(self) -> list[bytes | None]:
        return self._decoded()[2]

    @property
    def result_format(self) -> int:
        return self._decoded()[3]


class PasswordMessage(Message):
    """Every client authentication answer ('p'): password, SASLInitialResponse, SASLResponse, GSSResponse.

    Which one it is depends on the authentication request the server sent, so
    the reader cannot tell; pick the matching accessor.  Never shown by repr.
    """

    __slots__ = ()
    TYPE = b"p"
    _SECRET = True

    def _decode(self) -> Any:
        return True

    @property
    def password_bytes(self) -> bytes:
        """As PasswordMessage (cleartext or ``md5...``)."""
        cur = self._cursor()
        value = cur.cbytes()
        cur.finish()
        return value

    @property
    def password(self) -> str:
        return _text(self.password_bytes)

    def sasl_initial_response(self) -> tuple[str, bytes | None]:
        """As SASLInitialResponse: (mechanism, initial client data or None)."""
        cur = self._cursor()
        mechanism = cur.cstring()
        data = cur.value()
        cur.finish()
        return mechanism, data

    @property
    def data(self) -> bytes:
        """As SASLResponse / GSSResponse: the raw payload."""
        return self._buf[self._start + 5 : self._end]


# ----- backend


class Authentication(Message):
    """An authentication request or result ('R'); ``code`` says which (``AUTH_*``)."""

    __slots__ = ()
    TYPE = b"R"
    _FIELDS = ("code", "kind")

    def _decode(self) -> Any:
        cur = self._cursor()
        code = cur.int32()
        if code == AUTH_MD5_PASSWORD:
            result: Any = cur.take(4)
        elif code == AUTH_SASL:
            mechanisms = []
            while True:
                name = cur.cstring()
                if not name:
                    break
                mechanisms.append(name)
            result = mechanisms
        elif code in (AUTH_GSS_CONTINUE, AUTH_SASL_CONTINUE, AUTH_SASL_FINAL) or code not in _AUTH_KINDS:
            result = cur.rest()
        else:
            result = None
        cur.finish()
        return code, result

    @property
    def code(self) -> int:
        return self._decoded()[0]

    @property
    def kind(self) -> str:
        """``ok``, ``cleartext``, ``md5``, ``sasl``, ``sasl_continue``, ``sasl_final``, ... or ``unknown``."""
        return _AUTH_KINDS.get(self.code, "unknown")

    @property
    def salt(self) -> bytes:
        """The 4-byte salt of AuthenticationMD5Password."""
        code, value = self._decoded()
        if code != AUTH_MD5_PASSWORD:
            raise ProtocolError(f"authentication request {code} carries no MD5 salt")
        return value

    @property
    def mechanisms(self) -> list[str]:
        """The SASL mechanisms offered by AuthenticationSASL."""
        code, value = self._decoded()
        if code != AUTH_SASL:
            raise ProtocolError(f"authentication request {code} carries no SASL mechanisms")
        return list(value)

    @property
    def data(self) -> bytes:
        """The payload of AuthenticationSASLContinue / SASLFinal / GSSContinue."""
        value = self._decoded()[1]
        return value if isinstance(value, bytes) else b""

    def to_dict(self) -> dict[str, Any]:
        code, value = self._decoded()
        out: dict[str, Any] = {"code": code, "kind": self.kind}
        if code == AUTH_MD5_PASSWORD:
            out["salt"] = value
        elif code == AUTH_SASL:
            out["mechanisms"] = list(value)
        elif value is not None:
            out["data_length"] = len(value)
        return out


class ParameterStatus(Message):
    """A run-time parameter's current value (server_version, client_encoding, TimeZone, ...)."""

    __slots__ = ()
    TYPE = b"S"
    _FIELDS = ("name", "value")

    def _decode(self) -> tuple[str, str]:
        cur = self._cursor()
        name = cur.cstring()
        value = cur.cstring()
        cur.finish()
        return name, value

    @property
    def name(self) -> str:
        return self._decoded()[0]

    @property
    def value(self) -> str:
        return self._decoded()[1]


class BackendKeyData(Message):
    """Process id and secret key a client needs to send a CancelRequest later."""

    __slots__ = ()
    TYPE = b"K"
    _FIELDS = ("process_id",)

    def _decode(self) -> tuple[int, bytes]:
        cur = self._cursor()
        pid = cur.int32()
        key = cur.rest()
        if not MIN_CANCEL_KEY <= len(key) <= MAX_CANCEL_KEY:
            raise cur.fail(f"cancel key of {len(key)} bytes")
        return pid, key

    @property
    def process_id(self) -> int:
        return self._decoded()[0]

    @property
    def secret_key(self) -> bytes:
        return self._decoded()[1]


class ReadyForQuery(Message):
    """The server is idle; ``status`` is 'I' (idle), 'T' (in a transaction) or 'E' (failed transaction)."""

    __slots__ = ()
    TYPE = b"Z"
    _FIELDS = ("status",)

    def _decode(self) -> str:
        cur = self._cursor()
        status = cur.byte()
        cur.finish()
        if status not in (0x49, 0x54, 0x45):
            raise cur.fail(f"unknown transaction status {status!r}")
        return chr(status)

    @property
    def status(self) -> str:
        return self._decoded()

    @property
    def in_transaction(self) -> bool:
        return self._decoded() != "I"


@dataclass(slots=True, frozen=True)
class FieldDescription:
    """One column of a RowDescription."""

    name: str
    table_oid: int = 0
    column: int = 0
    type_oid: int = TEXT_OID
    type_size: int = -1  # typlen
    type_modifier: int = -1  # typmod
    format: int = FORMAT_TEXT


class RowDescription(Message):
    """The columns of the rows that follow (or, after Describe of a statement, that would follow)."""

    __slots__ = ()
    TYPE = b"T"
    _FIELDS = ("fields",)

    def _decode(self) -> tuple[FieldDescription, ...]:
        cur = self._cursor()
        count = cur.uint16()
        fields = []
        for _ in range(count):
            name = cur.cstring()
            fields.append(
                FieldDescription(name, cur.uint32(), cur.int16(), cur.uint32(), cur.int16(), cur.int32(), cur.int16())
            )
        cur.finish()
        return tuple(fields)

    @property
    def column_count(self) -> int:
        if self._end - self._start < 7:
            raise ProtocolError("malformed RowDescription message: unexpected end of message")
        return _u16(self._buf, self._start + 5)[0]

    @property
    def fields(self) -> list[FieldDescription]:
        return list(self._decoded())

    @property
    def names(self) -> list[str]:
        return [f.name for f in self._decoded()]

    @property
    def formats(self) -> tuple[int, ...]:
        return tuple(f.format for f in self._decoded())

    def summary(self) -> tuple[list[str], tuple[int, ...], tuple[int, ...]]:
        """(names, type OIDs, formats) read straight from the frame: no FieldDescription objects (hot path)."""
        buf, pos, end = self._buf, self._start + 7, self._end
        if pos > end:
            raise ProtocolError("malformed RowDescription message: unexpected end of message")
        count = _u16(buf, pos - 2)[0]
        names, oids, formats = [], [], []
        for _ in range(count):
            nul = buf.find(b"\0", pos, end)
            if nul < 0 or nul + 19 > end:
                raise ProtocolError("malformed RowDescription message: unexpected end of message")
            names.append(_text(buf[pos:nul]))
            _table_oid, _column, type_oid, _size, _modifier, fmt = _FIELD.unpack_from(buf, nul + 1)
            oids.append(type_oid)
            formats.append(fmt)
            pos = nul + 19
        if pos != end:
            raise ProtocolError("malformed RowDescription message: trailing bytes")
        return names, tuple(oids), tuple(formats)


class DataRow(Message):
    """One result row.  Columns are not parsed unless asked for (``columns`` / ``column_views``)."""

    __slots__ = ()
    TYPE = b"D"
    _FIELDS = ("columns",)

    @property
    def column_count(self) -> int:
        """Read straight from the frame; nothing else is decoded."""
        if self._end - self._start < 7:
            raise ProtocolError("malformed DataRow message: unexpected end of message")
        return _u16(self._buf, self._start + 5)[0]

    def _spans(self) -> list[tuple[int, int] | None]:
        cur = self._cursor()
        spans: list[tuple[int, int] | None] = []
        for _ in range(cur.uint16()):
            n = cur.int32()
            if n == -1:
                spans.append(None)
                continue
            if n < 0:
                raise cur.fail(f"negative column length {n}")
            start = cur._need(n)
            spans.append((start, start + n))
        cur.finish()
        return spans

    def _decode(self) -> list[bytes | None]:
        buf = self._buf
        return [None if s is None else buf[s[0] : s[1]] for s in self._spans()]

    @property
    def columns(self) -> list[bytes | None]:
        """Column values as bytes (None for NULL); decoded once, then cached."""
        return self._decoded()

    def column_views(self) -> list[memoryview | None]:
        """Column values as views into the frame: no copy at all."""
        view = memoryview(self._buf)
        return [None if s is None else view[s[0] : s[1]] for s in self._spans()]


class CommandComplete(Message):
    """A statement finished; ``tag`` is e.g. ``SELECT 3``, ``INSERT 0 1``, ``BEGIN``."""

    __slots__ = ()
    TYPE = b"C"
    _FIELDS = ("tag",)

    def _decode(self) -> str:
        raw, start, end = self._buf, self._start + 5, self._end
        if type(raw) is bytes:
            buf = raw
            if end > start and buf.find(b"\0", start, end) == end - 1:
                return buf[start : end - 1].decode("utf-8", "replace")
        cur = self._cursor()
        tag = cur.cstring()
        cur.finish()
        return tag

    @property
    def tag(self) -> str:
        return self._decoded()

    @property
    def command(self) -> str:
        """The first word of the tag (``SELECT``, ``INSERT``, ``COPY``, ...)."""
        return self._decoded().partition(" ")[0]

    @property
    def row_count(self) -> int | None:
        """Rows affected/returned when the tag carries a count, else None."""
        tag = self._decoded()
        last = tag.rpartition(" ")[2]
        return int(last) if " " in tag and last.isascii() and last.isdigit() else None


# Error and notice field codes, by letter (see "Error and Notice Message Fields").
ERROR_FIELD_NAMES = {
    "S": "severity", "V": "severity_nonlocalized", "C": "sqlstate", "M": "message", "D": "detail",
    "H": "hint", "P": "position", "p": "internal_position", "q": "internal_query", "W": "where",
    "s": "schema_name", "t": "table_name", "c": "column_name", "d": "data_type_name",
    "n": "constraint_name", "F": "file", "L": "line", "R": "routine",
}


class _ErrorOrNotice(Message):
    __slots__ = ()
    _FIELDS = ("fields",)

    def _decode(self) -> dict[str, str]:
        cur = self._cursor()
        fields: dict[str, str] = {}
        while True:
            code = cur.byte()
            if code == 0:
                break
            fields[chr(code)] = cur.cstring()
        cur.finish()
        return fields

    @property
    def fields(self) -> dict[str, str]:
        """Field values keyed by their code letter (S, V, C, M, D, H, P, ...); a fresh dict."""
        return dict(self._decoded())

    @property
    def severity(self) -> str:
        fields = self._decoded()
        return fields.get("V") or fields.get("S", "")

    @property
    def sqlstate(self) -> str:
        return self._decoded().get("C", "")

    @property
    def message(self) -> str:
        return self._decoded().get("M", "")

    @property
    def detail(self) -> str | None:
        return self._decoded().get("D")

    @property
    def hint(self) -> str | None:
        return self._decoded().get("H")


class ErrorResponse(_ErrorOrNotice):
    """The server reports an error; a ReadyForQuery follows once it has recovered."""

    __slots__ = ()
    TYPE = b"E"


class NoticeResponse(_ErrorOrNotice):
    """A warning or notice (RAISE NOTICE, ...), same layout as ErrorResponse."""

    __slots__ = ()
    TYPE = b"N"


class NotificationResponse(Message):
    """A NOTIFY delivered to this session's LISTEN."""

    __slots__ = ()
    TYPE = b"A"
    _FIELDS = ("process_id", "channel", "payload")

    def _decode(self) -> tuple[int, str, str]:
        cur = self._cursor()
        pid = cur.int32()
        channel = cur.cstring()
        payload = cur.cstring()
        cur.finish()
        return pid, channel, payload

    @property
    def process_id(self) -> int:
        return self._decoded()[0]

    @property
    def channel(self) -> str:
        return self._decoded()[1]

    @property
    def payload(self) -> str:
        return self._decoded()[2]


class _CopyResponse(Message):
    __slots__ = ()
    _FIELDS = ("format", "column_formats")

    def _decode(self) -> tuple[int, list[int]]:
        cur = self._cursor()
        overall = cur.byte()
        formats = cur.int16_list()
        cur.finish()
        return overall, formats

    @property
    def format(self) -> int:
        """0 textual, 1 binary (overall COPY format)."""
        return self._decoded()[0]

    @property
    def column_formats(self) -> list[int]:
        return self._decoded()[1]


class CopyInResponse(_CopyResponse):
    """COPY FROM STDIN started: the client now sends CopyData then CopyDone or CopyFail."""

    __slots__ = ()
    TYPE = b"G"


class CopyOutResponse(_CopyResponse):
    """COPY TO STDOUT started: CopyData messages follow, then CopyDone."""

    __slots__ = ()
    TYPE = b"H"


class CopyBothResponse(_CopyResponse):
    """Both-ways COPY (streaming replication)."""

    __slots__ = ()
    TYPE = b"W"


class ParseComplete(_Empty):
    __slots__ = ()
    TYPE = b"1"


class BindComplete(_Empty):
    __slots__ = ()
    TYPE = b"2"


class CloseComplete(_Empty):
    __slots__ = ()
    TYPE = b"3"


class NoData(_Empty):
    """Describe: the statement or portal returns no rows."""

    __slots__ = ()
    TYPE = b"n"


class PortalSuspended(_Empty):
    """Execute stopped at its row limit; the portal can be executed again."""

    __slots__ = ()
    TYPE = b"s"


class EmptyQueryResponse(_Empty):
    """The query string was empty (stands in for CommandComplete)."""

    __slots__ = ()
    TYPE = b"I"


class ParameterDescription(Message):
    """Describe of a statement: the type OIDs of its parameters."""

    __slots__ = ()
    TYPE = b"t"
    _FIELDS = ("param_types",)

    def _decode(self) -> list[int]:
        cur = self._cursor()
        types = cur.uint32_list(cur.uint16())
        cur.finish()
        return types

    @property
    def param_types(self) -> list[int]:
        return self._decoded()


class NegotiateProtocolVersion(Message):
    """The server does not support the requested minor version or some ``_pq_.`` options."""

    __slots__ = ()
    TYPE = b"v"
    _FIELDS = ("newest_minor", "unrecognized_options")

    def _decode(self) -> tuple[int, list[str]]:
        cur = self._cursor()
        minor = cur.int32()
        count = cur.int32()
        if count < 0:
            raise cur.fail(f"negative option count {count}")
        options = []
        for _ in range(count):
            options.append(cur.cstring())
        cur.finish()
        return minor, options

    @property
    def newest_minor(self) -> int:
        return self._decoded()[0]

    @property
    def unrecognized_options(self) -> list[str]:
        return self._decoded()[1]


class FunctionCallResponse(Message):
    """Result of a FunctionCall; ``result`` is None for NULL."""

    __slots__ = ()
    TYPE = b"V"
    _FIELDS = ("result",)

    def _decode(self) -> tuple[bytes | None]:
        cur = self._cursor()
        value = cur.value()
        cur.finish()
        return (value,)

    @property
    def result(self) -> bytes | None:
        return self._decoded()[0]


def _framed(cls: type[Message], buf: bytes, start: int, end: int) -> Message:
    """A ``cls`` message over ``buf[start:end]``: what the readers make of each frame (``Message.__init__``
    without its argument handling; compiled, a C call that fills the typed fields)."""
    message = cls.__new__(cls)
    message._buf = buf
    message._start = start
    message._end = end
    message._cache = None
    return message


def _table(*classes: type[Message]) -> tuple[type[Message], ...]:
    table: list[type[Message]] = [UnknownMessage] * 256
    for cls in classes:
        table[cls.TYPE[0]] = cls
    return tuple(table)


FRONTEND_TYPES = _table(
    Bind, Close, CopyData, CopyDone, CopyFail, Describe, Execute, Flush, FunctionCall, Parse,
    PasswordMessage, Query, Sync, Terminate,
)
BACKEND_TYPES = _table(
    Authentication, BackendKeyData, BindComplete, CloseComplete, CommandComplete, CopyData, CopyDone,
    CopyInResponse, CopyOutResponse, CopyBothResponse, DataRow, EmptyQueryResponse, ErrorResponse,
    FunctionCallResponse, NegotiateProtocolVersion, NoData, NoticeResponse, NotificationResponse,
    ParameterDescription, ParameterStatus, ParseComplete, PortalSuspended, ReadyForQuery, RowDescription,
)


# --------------------------------------------------------------------------- readers


class _FrameBuffer:
    """Incoming bytes as a queue of chunks, handed out as (chunk, start, end) without copying.

    ``bytes`` feeds are kept as they are when large or when nothing is
    pending (the usual case: a read holding whole messages).  Small feeds that
    arrive while a partial message waits go into a bytearray accumulator, so a
    peer trickling one byte at a time costs one copy per byte, not one object
    per byte; frames taken from an accumulator, and frames that straddle
    chunks, are copied once.  ``bytes_copied`` counts
    those copies, ``buffered`` the bytes waiting.
    """

    __slots__ = ("_available", "_chunks", "_eof", "_error", "_pos", "bytes_copied")

    def __init__(self) -> None:
        self._chunks: deque[bytes | bytearray] = deque()
        self._pos = 0  # read offset into _chunks[0]
        self._available = 0
        self._eof = False
        self._error: ProtocolError | None = None
        self.bytes_copied = 0

    @property
    def buffered(self) -> int:
        """Bytes received and not yet handed out as messages."""
        return self._available

    @property
    def at_eof(self) -> bool:
        return self._eof

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Add received bytes.  ``bytes`` are kept without copying when large."""
        if self._eof:
            raise RuntimeError("feed() after feed_eof()")
        n = len(data)
        if not n:
            return
        chunks = self._chunks
        self._available += n
        if type(data) is bytes and (n >= _COALESCE_BELOW or not chunks):
            chunks.append(data)  # kept as is: frames inside it are handed out without copying
        elif n < _COALESCE_BELOW:
            last = chunks[-1] if chunks else None
            if type(last) is bytearray and len(last) < _ACCUMULATOR_SIZE:
                last += data
            else:
                chunks.append(bytearray(data))
            self.bytes_copied += n
        else:
            chunks.append(bytes(data))
            self.bytes_copied += n

    def feed_eof(self) -> None:
        """The peer closed.  A partial message left in the buffer is then a ProtocolError."""
        self._eof = True

    def take_buffered(self) -> bytes:
        """Remove and return every byte not yet handed out (e.g. before a TLS handover)."""
        out = b"".join(self._views(self._available))
        self.bytes_copied += len(out)
        self._chunks.clear()
        self._pos = 0
        self._available = 0
        return out

    def _views(self, n: int) -> list[memoryview]:
        """Views of the first n buffered bytes (n <= _available), without consuming them."""
        out = []
        pos = self._pos
        for chunk in self._chunks:
            if n <= 0:
                break
            piece = memoryview(chunk)[pos : pos + n]
            out.append(piece)
            n -= len(piece)
            pos = 0
        return out

    def _peek(self, n: int) -> bytes:
        """The first n bytes (small n, n <= _available)."""
        first = self._chunks[0]
        pos = self._pos
        if len(first) - pos >= n:
            return bytes(first[pos : pos + n])
        views = self._views(n)
        try:
            return b"".join(views)
        finally:
            for v in views:
                v.release()

    def _take(self, n: int) -> tuple[bytes, int, int]:
        """Consume n bytes (n <= _available) and return them as (buffer, start, end)."""
        chunks = self._chunks
        first = chunks[0]
        pos = self._pos
        end = pos + n
        self._available -= n
        if end <= len(first):
            if end == len(first):
                chunks.popleft()
                self._pos = 0
            else:
                self._pos = end
            if type(first) is bytes:
                return first, pos, end
            self.bytes_copied += n
            with memoryview(first) as view:
                return bytes(view[pos:end]), 0, n
        # The frame straddles chunks: join it (one copy of this frame only).
        pieces = []
        need = n
        while need:
            chunk = chunks[0]
            have = len(chunk) - pos
            if have <= need:
                pieces.append(memoryview(chunk)[pos:])
                chunks.popleft()
                need -= have
                pos = 0
            else:
                pieces.append(memoryview(chunk)[pos : pos + need])
                pos += need
                need = 0
        self._pos = pos
        joined = b"".join(pieces)
        for piece in pieces:
            piece.release()
        self.bytes_copied += n
        return joined, 0, n

    def _fail(self, message: str, sqlstate: str = "08P01") -> ProtocolError:
        self._error = ProtocolError(message, sqlstate)
        return self._error

    def _typed(self, table: tuple[type[Message], ...], limit: int) -> Message | None:
        """The next complete typed message, None when more bytes are needed: the relay's hot loop.

        A frame wholly inside the first chunk, when that is ``bytes``, is cut straight from it (the chunk's
        last frame drops the chunk); anything else (a frame across chunks, one in the accumulator) is copied
        once by ``_take``.
        """
        available = self._available
        if available < 5:
            if self._eof and available:
                raise self._fail(f"connection closed in the middle of a message ({available} bytes left)")
            return None
        chunk = self._chunks[0]
        pos = self._pos
        size = 0  # of the first chunk when it is bytes holding the whole header, else 0
        if type(chunk) is bytes and len(chunk) - pos >= 5:
            first = chunk
            size = len(first)
            kind = first[pos]
            length = _int32_at(first, pos + 1)  # signed, so garbage shows as negative
        else:
            first = None
            head, length = _HEADER.unpack(self._peek(5))
            kind = head[0]
        if length < 4:
            raise self._fail(f"invalid message length {length} for message type {bytes((kind,))!r}")
        if length > limit:
            raise self._fail(f"message of type {bytes((kind,))!r} is {length} bytes, more than the limit of {limit}")
        total = length + 1
        if available < total:
            if self._eof:
                raise self._fail(f"connection closed in the middle of a message ({available} of {total} bytes)")
            return None
        end = pos + total
        if end <= size:
            if end == size:
                self._chunks.popleft()
                self._pos = 0
            else:
                self._pos = end
            self._available = available - total
            return _framed(table[kind], first, pos, end)
        buf, start, stop = self._take(total)
        return _framed(table[buf[start]], buf, start, stop)

    def __iter__(self) -> Iterator[Message]:
        """Every complete message buffered so far."""
        while (message := self.next_message()) is not None:
            yield message

    def next_message(self) -> Message | None:  # pragma: no cover - overridden
        raise NotImplementedError


class FrontendReader(_FrameBuffer):
    """Frames the client-to-server stream, start-up phase included.

    Phases: ``startup`` (untyped messages: SSLRequest, GSSENCRequest,
    CancelRequest, StartupMessage) -> ``messages`` after a StartupMessage
    (typed messages) -> ``done`` after a CancelRequest (anything more is an
    error).  Only protocol major version 3 is accepted; the minor version is
    reported (``StartupMessage.minor``) so the server may answer with
    NegotiateProtocolVersion.  Pass ``expect_startup=False`` to frame typed
    messages only.
    """

    __slots__ = ("max_message_size", "max_startup_size", "phase")

    def __init__(
        self,
        *,
        max_message_size: int = DEFAULT_MAX_FRONTEND_MESSAGE,
        max_startup_size: int = DEFAULT_MAX_STARTUP_MESSAGE,
        expect_startup: bool = True,
    ) -> None:
        super().__init__()
        self.phase = "startup" if expect_startup else "messages"
        self.max_message_size = max_message_size
        self.max_startup_size = max_startup_size

    def next_message(self) -> Message | None:
        """The next complete message, or None when more bytes are needed."""
        if self._error is not None:
            raise self._error
        if self.phase == "messages":
            return self._typed(FRONTEND_TYPES, self.max_message_size)
        if self.phase == "startup":
            return self._startup()
        if self._available:
            raise self._fail("data received after CancelRequest")
        return None

    def _startup(self) -> Message | None:
        available = self._available
        if available < 4:
            if self._eof and available:
                raise self._fail("connection closed in the middle of the startup packet")
            return None
        head = self._peek(min(available, 8))
        if head[0] == 0x16:
            raise self._fail("direct TLS negotiation is not supported (expected a startup packet)")
        (length,) = _i32(head, 0)
        if length < 8 or length > self.max_startup_size:
            raise self._fail(f"invalid length of startup packet: {length}")
        if len(head) < 8:  # implies available < length: the code has not arrived yet
            if self._eof:
                raise self._fail("connection closed in the middle of the startup packet")
            return None
        cls = self._startup_class(_u32(head, 4)[0], length)
        if available < length:
            if self._eof:
                raise self._fail("connection closed in the middle of the startup packet")
            return None
        message = cls(*self._take(length))
        if cls is StartupMessage:
            self.phase = "messages"
        elif cls is CancelRequest:
            self.phase = "done"
        return message

    def _startup_class(self, code: int, length: int) -> type[Message]:
        if code == SSL_REQUEST_CODE or code == GSSENC_REQUEST_CODE:
            if length != 8:
                raise self._fail(f"invalid length {length} of SSL/GSSENC request")
            return SSLRequest if code == SSL_REQUEST_CODE else GSSENCRequest
        if code == CANCEL_REQUEST_CODE:
            if not 12 + MIN_CANCEL_KEY <= length <= 12 + MAX_CANCEL_KEY:
                raise self._fail(f"invalid length {length} of cancel request")
            return CancelRequest
        major, minor = code >> 16, code & 0xFFFF
        if major == 1234:
            raise self._fail(f"unsupported startup request code {minor}")
        if major != 3:
            raise self._fail(f"unsupported frontend protocol {major}.{minor}", "0A000")
        return StartupMessage


class BackendReader(_FrameBuffer):
    """Frames the server-to-client stream (typed messages only).

    The hot path: a frame inside one received chunk is returned as a view of
    that chunk; nothing is decoded until a field is read.  Right after sending
    an SSLRequest or GSSENCRequest, call ``read_ssl_response()`` instead of
    ``next_message()`` for the single-byte answer.
    """

    __slots__ = ("max_message_size",)

    def __init__(self, *, max_message_size: int = DEFAULT_MAX_BACKEND_MESSAGE) -> None:
        super().__init__()
        self.max_message_size = max_message_size

    def next_message(self) -> Message | None:
        """The next complete message, or None when more bytes are needed."""
        if self._error is not None:
            raise self._error
        return self._typed(BACKEND_TYPES, self.max_message_size)

    def read_ssl_response(self) -> bytes | None:
        """The answer to SSLRequest/GSSENCRequest: b"S" (go ahead) or b"N" (declined), consumed.

        Returns b"E" *without* consuming it when the server answered with an
        ErrorResponse (read it with ``next_message()``), None when nothing has
        arrived yet.  After b"S", ``buffered`` must be 0: bytes that came
        before the TLS handshake were not sent by the real server
        (CVE-2021-23222).
        """
        if self._error is not None:
            raise self._error
        if not self._available:
            if self._eof:
                raise self._fail("connection closed before the SSL/GSSENC response")
            return None
        answer = self._peek(1)
        if answer == b"E":
            return answer
        if answer not in (b"S", b"N"):
            raise self._fail(f"unexpected response {answer!r} to SSL/GSSENC request")
        self._take(1)
        return answer


def _decode_one(reader: _FrameBuffer, frame: bytes | bytearray | memoryview) -> Message:
    reader.feed(bytes(frame))
    reader.feed_eof()
    message = reader.next_message()
    if message is None or reader.buffered:
        raise ProtocolError("expected exactly one complete message")
    return message


def decode_frontend(frame: bytes | bytearray | memoryview, *, startup: bool = False) -> Message:
    """Exactly one client message from its complete frame (``startup=True`` for the untyped ones)."""
    return _decode_one(FrontendReader(expect_startup=startup), frame)


def decode_backend(frame: bytes | bytearray | memoryview) -> Message:
    """Exactly one server message from its complete frame."""
    return _decode_one(BackendReader(), frame)


def coalesce_frames(messages: Iterable[Message]) -> list[memoryview]:
    """Raw frames of consecutive messages, adjacent ones merged into one view (for ``writelines``)."""
    out: list[memoryview] = []
    buf: bytes | None = None
    start = end = 0
    for message in messages:
        if message._buf is buf and message._start == end:
            end = message._end
            continue
        if buf is not None:
            out.append(memoryview(buf)[start:end])
        buf, start, end = message._buf, message._start, message._end
    if buf is not None:
        out.append(memoryview(buf)[start:end])
    return out


class FrameBatch:
    """Frames collected for one ``writelines()``, built incrementally: adjacent frames of one
    received chunk merge into a single view (``coalesce_frames`` as a running accumulator),
    and ``add_bytes`` puts gateway-made messages in between, in order.
    """

    __slots__ = ("_buf", "_end", "_start", "parts")

    def __init__(self) -> None:
        self.parts: list[bytes | memoryview] = []
        self._buf: bytes | None = None
        self._start = self._end = 0

    def add(self, message: Message) -> None:
        """Append a received message's raw frame (no copy)."""
        buf = message._buf
        if buf is self._buf and message._start == self._end:
            self._end = message._end
            return
        if self._buf is not None:
            self.parts.append(memoryview(self._buf)[self._start : self._end])
        self._buf, self._start, self._end = buf, message._start, message._end

    def add_bytes(self, data: bytes) -> None:
        """Append bytes made by the gateway (an ErrorResponse, a substituted Sync, ...)."""
        if self._buf is not None:
            self.parts.append(memoryview(self._buf)[self._start : self._end])
            self._buf = None
        self.parts.append(data)

    def take(self) -> list[bytes | memoryview]:
        """Everything collected so far, emptying the batch."""
        buf = self._buf
        if buf is not None:
            if self._start == 0 and self._end == len(buf):
                self.parts.append(buf)  # a whole received chunk: no view needed
            else:
                self.parts.append(memoryview(buf)[self._start : self._end])
            self._buf = None
        parts, self.parts = self.parts, []
        return parts

    def __bool__(self) -> bool:
        return self._buf is not None or bool(self.parts)


def is_direct_tls_start(data: bytes | bytearray | memoryview) -> bool:
    """True when a new connection starts with a TLS handshake record (libpq ``sslnegotiation=direct``)."""
    return len(data) > 0 and data[0] == 0x16


# --------------------------------------------------------------------------- writers


def encode_message(type_code: bytes, body: bytes = b"") -> bytes:
    """A typed message: type byte, Int32 length (itself included), body."""
    return type_code + (len(body) + 4).to_bytes(4, "big") + body


def _cstr(value: str | bytes) -> bytes:
    raw = value.encode() if isinstance(value, str) else bytes(value)
    if b"\0" in raw:
        raise ValueError("protocol strings cannot contain NUL bytes")
    return raw + b"\0"


def _int16s(values: Sequence[int]) -> bytes:
    return struct.pack(f"!H{len(values)}h", len(values), *values)


def _oids(values: Sequence[int]) -> bytes:
    return struct.pack(f"!H{len(values)}I", len(values), *values)


def _values(values: Sequence[bytes | str | None]) -> bytes:
    parts = [len(values).to_bytes(2, "big")]
    for value in values:
        if value is None:
            parts.append(b"\xff\xff\xff\xff")
        else:
            raw = value.encode() if isinstance(value, str) else bytes(value)
            parts.append(len(raw).to_bytes(4, "big"))
            parts.append(raw)
    return b"".join(parts)


def _untyped(code: int, body: bytes = b"") -> bytes:
    return struct.pack("!iI", len(body) + 8, code) + body


# ----- frontend


def encode_startup_message(parameters: Mapping[str, str], protocol: int = PROTOCOL_3_0) -> bytes:
    """StartupMessage with the given parameters (``user`` is required by servers)."""
    body = b"".join(_cstr(k) + _cstr(v) for k, v in parameters.items()) + b"\0"
    return _untyped(protocol, body)


def encode_ssl_request() -> bytes:
    return _untyped(SSL_REQUEST_CODE)


def encode_gssenc_request() -> bytes:
    return _untyped(GSSENC_REQUEST_CODE)


def encode_cancel_request(process_id: int, secret_key: bytes | int) -> bytes:
    """CancelRequest; an int key is packed as the 4-byte key of protocol 3.0."""
    key = secret_key.to_bytes(4, "big", signed=secret_key < 0) if isinstance(secret_key, int) else bytes(secret_key)
    return _untyped(CANCEL_REQUEST_CODE, struct.pack("!i", process_id) + key)


def encode_password(password: str | bytes) -> bytes:
    """PasswordMessage: cleartext, or the ``md5...`` string from ``md5_password``."""
    return encode_message(b"p", _cstr(password))


def encode_sasl_initial_response(mechanism: str, data: bytes | None) -> bytes:
    body = _cstr(mechanism) + (b"\xff\xff\xff\xff" if data is None else len(data).to_bytes(4, "big") + data)
    return encode_message(b"p", body)


def encode_sasl_response(data: bytes) -> bytes:
    return encode_message(b"p", bytes(data))


def encode_query(sql: str | bytes) -> bytes:
    return encode_message(b"Q", _cstr(sql))


def encode_parse(name: str, sql: str | bytes, param_types: Sequence[int] = ()) -> bytes:
    return encode_message(b"P", _cstr(name) + _cstr(sql) + _oids(param_types))


def encode_bind(
    portal: str,
    statement: str,
    params: Sequence[bytes | str | None] = (),
    param_formats: Sequence[int] = (),
    result_formats: Sequence[int] = (),
) -> bytes:
    body = _cstr(portal) + _cstr(statement) + _int16s(param_formats) + _values(params) + _int16s(result_formats)
    return encode_message(b"B", body)


def _kind(kind: str) -> bytes:
    if kind not in ("S", "P"):
        raise ValueError("kind must be 'S' (statement) or 'P' (portal)")
    return kind.encode()


def encode_describe(kind: str, name: str = "") -> bytes:
    return encode_message(b"D", _kind(kind) + _cstr(name))


def encode_close(kind: str, name: str = "") -> bytes:
    return encode_message(b"C", _kind(kind) + _cstr(name))


def encode_execute(portal: str = "", max_rows: int = 0) -> bytes:
    return encode_message(b"E", _cstr(portal) + struct.pack("!i", max_rows))


def encode_sync() -> bytes:
    return b"S\0\0\0\x04"


def encode_flush() -> bytes:
    return b"H\0\0\0\x04"


def encode_terminate() -> bytes:
    return b"X\0\0\0\x04"


def encode_copy_data(data: bytes | bytearray | memoryview) -> bytes:
    return encode_message(b"d", bytes(data))


def encode_copy_done() -> bytes:
    return b"c\0\0\0\x04"


def encode_copy_fail(message: str) -> bytes:
    return encode_message(b"f", _cstr(message))


def encode_function_call(
    function_oid: int, args: Sequence[bytes | str | None] = (), arg_formats: Sequence[int] = (), result_format: int = 0
) -> bytes:
    body = struct.pack("!I", function_oid) + _int16s(arg_formats) + _values(args) + struct.pack("!h", result_format)
    return encode_message(b"F", body)


# ----- backend


def _auth(code: int, extra: bytes = b"") -> bytes:
    return encode_message(b"R", struct.pack("!i", code) + extra)


def encode_authentication_ok() -> bytes:
    return _auth(AUTH_OK)


def encode_authentication_cleartext_password() -> bytes:
    return _auth(AUTH_CLEARTEXT_PASSWORD)


def encode_authentication_md5_password(salt: bytes) -> bytes:
    if len(salt) != 4:
        raise ValueError("the MD5 salt is 4 bytes")
    return _auth(AUTH_MD5_PASSWORD, bytes(salt))


def encode_authentication_sasl(mechanisms: Sequence[str]) -> bytes:
    return _auth(AUTH_SASL, b"".join(_cstr(m) for m in mechanisms) + b"\0")


def encode_authentication_sasl_continue(data: bytes) -> bytes:
    return _auth(AUTH_SASL_CONTINUE, bytes(data))


def encode_authentication_sasl_final(data: bytes) -> bytes:
    return _auth(AUTH_SASL_FINAL, bytes(data))


def encode_parameter_status(name: str, value: str) -> bytes:
    return encode_message(b"S", _cstr(name) + _cstr(value))


def encode_backend_key_data(process_id: int, secret_key: bytes | int) -> bytes:
    key = secret_key.to_bytes(4, "big", signed=secret_key < 0) if isinstance(secret_key, int) else bytes(secret_key)
    return encode_message(b"K", struct.pack("!i", process_id) + key)


def encode_ready_for_query(status: str = "I") -> bytes:
    if status not in ("I", "T", "E"):
        raise ValueError("status must be 'I', 'T' or 'E'")
    return encode_message(b"Z", status.encode())


def encode_row_description(fields: Sequence[FieldDescription | str]) -> bytes:
    """RowDescription; a plain name stands for a text column."""
    parts = [len(fields).to_bytes(2, "big")]
    for field in fields:
        if isinstance(field, str):
            field = FieldDescription(field)
        parts.append(_cstr(field.name))
        parts.append(
            struct.pack(
                "!IhIhih", field.table_oid, field.column, field.type_oid, field.type_size, field.type_modifier,
                field.format,
            )
        )
    return encode_message(b"T", b"".join(parts))


def encode_data_row(columns: Sequence[bytes | str | None]) -> bytes:
    """DataRow; str values are sent as UTF-8 text, None as NULL."""
    return encode_message(b"D", _values(columns))


def encode_command_complete(tag: str) -> bytes:
    return encode_message(b"C", _cstr(tag))


def encode_empty_query_response() -> bytes:
    return b"I\0\0\0\x04"


def _fields_body(severity: str, sqlstate: str, message: str, extra: Mapping[str, str] | None) -> bytes:
    fields: dict[str, str] = {"S": severity, "V": severity, "C": sqlstate, "M": message}
    if extra:
        for code, value in extra.items():
            if len(code) != 1 or code == "\0":
                raise ValueError(f"error field codes are single letters, not {code!r}")
            fields[code] = value
    # NULs cannot travel in these strings; a message built from user text must not break the frame.
    return b"".join(code.encode() + _cstr(str(value).replace("\0", "\ufffd")) for code, value in fields.items()) + b"\0"


def encode_error_response(
    severity: str = "ERROR", sqlstate: str = "XX000", message: str = "", extra: Mapping[str, str] | None = None
) -> bytes:
    """ErrorResponse with S/V (severity), C (SQLSTATE), M (message) and ``extra`` fields by code letter (D, H, ...)."""
    return encode_message(b"E", _fields_body(severity, sqlstate, message, extra))


def encode_notice_response(
    severity: str = "NOTICE", sqlstate: str = "00000", message: str = "", extra: Mapping[str, str] | None = None
) -> bytes:
    return encode_message(b"N", _fields_body(severity, sqlstate, message, extra))


def encode_notification_response(process_id: int, channel: str, payload: str = "") -> bytes:
    return encode_message(b"A", struct.pack("!i", process_id) + _cstr(channel) + _cstr(payload))


def encode_parse_complete() -> bytes:
    return b"1\0\0\0\x04"


def encode_bind_complete() -> bytes:
    return b"2\0\0\0\x04"


def encode_close_complete() -> bytes:
    return b"3\0\0\0\x04"


def encode_no_data() -> bytes:
    return b"n\0\0\0\x04"


def encode_portal_suspended() -> bytes:
    return b"s\0\0\0\x04"


def encode_parameter_description(param_types: Sequence[int]) -> bytes:
    return encode_message(b"t", _oids(param_types))


def _copy_response(code: bytes, overall: int, column_formats: Sequence[int]) -> bytes:
    return encode_message(code, bytes([overall]) + _int16s(column_formats))


def encode_copy_in_response(overall: int = 0, column_formats: Sequence[int] = ()) -> bytes:
    return _copy_response(b"G", overall, column_formats)


def encode_copy_out_response(overall: int = 0, column_formats: Sequence[int] = ()) -> bytes:
    return _copy_response(b"H", overall, column_formats)


def encode_copy_both_response(overall: int = 0, column_formats: Sequence[int] = ()) -> bytes:
    return _copy_response(b"W", overall, column_formats)


def encode_negotiate_protocol_version(newest_minor: int, unrecognized_options: Sequence[str] = ()) -> bytes:
    body = struct.pack("!ii", newest_minor, len(unrecognized_options)) + b"".join(map(_cstr, unrecognized_options))
    return encode_message(b"v", body)


def encode_function_call_response(result: bytes | None) -> bytes:
    body = b"\xff\xff\xff\xff" if result is None else len(result).to_bytes(4, "big") + bytes(result)
    return encode_message(b"V", body)


# --------------------------------------------------------------------------- rendering


def render_row(
    row_description: RowDescription | Sequence[FieldDescription] | None,
    data_row: DataRow,
    *,
    formats: Sequence[int] | None = None,
    null: str = "NULL",
    separator: str = "\t",
    max_column_bytes: int | None = None,
) -> str:
    """One row as text: text columns as UTF-8 (invalid bytes replaced), binary as ``\\x<hex>``, NULL as ``NULL``.

    Column formats come from ``formats`` when given, else from the row
    description.  In the extended protocol a RowDescription obtained by
    Describe of a *statement* always says text; the real formats are the
    Bind's ``result_formats`` -- pass ``formats=resolve_formats(bind.result_formats, n)``.
    Reads the frame directly (no DataRow decoding, no per-column object
    besides the output string).  ``max_column_bytes`` truncates long values.
    """
    if formats is None:
        if row_description is None:
            formats = ()
        elif isinstance(row_description, RowDescription):
            formats = row_description.formats
        else:
            formats = tuple(f.format for f in row_description)
    return render_text_row(data_row, formats, null, separator, -1 if max_column_bytes is None else max_column_bytes)


def render_text_row(data_row: DataRow, formats: Sequence[int], null: str, separator: str,
                    max_column_bytes: int) -> str:
    """``render_row`` with every argument given (``max_column_bytes`` -1: values whole): the relay's call."""
    buf = data_row._buf
    if type(buf) is not bytes:
        buf = bytes(buf)  # the same offsets
    pos = data_row._start + 5
    end = data_row._end
    if pos + 2 > end:
        raise ProtocolError("malformed DataRow message: unexpected end of message")
    count = _uint16_at(buf, pos)
    pos += 2
    nformats = len(formats)
    parts = []
    for i in range(count):
        if pos + 4 > end:
            raise ProtocolError("malformed DataRow message: unexpected end of message")
        n = _int32_at(buf, pos)
        pos += 4
        if n == -1:
            parts.append(null)
            continue
        if n < 0 or pos + n > end:
            raise ProtocolError("malformed DataRow message: bad column length")
        stop = pos + n if max_column_bytes < 0 or n <= max_column_bytes else pos + max_column_bytes
        if i < nformats and formats[i] == FORMAT_BINARY:
            parts.append("\\x" + buf[pos:stop].hex())
        else:
            parts.append(buf[pos:stop].decode("utf-8", "replace"))
        pos += n
    if pos != end:
        raise ProtocolError("malformed DataRow message: trailing bytes")
    return separator.join(parts)


# --------------------------------------------------------------------------- authentication helpers


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
