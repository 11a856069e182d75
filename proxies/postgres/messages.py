"""The PostgreSQL v3 messages: what can happen on the wire, each a view of its raw frame.

A message is a *view* of its raw frame (``msg.frame`` is a ``memoryview``, no copy) and decodes its fields
lazily, on first access, caching the result; a malformed body raises ``ProtocolError`` then, never earlier,
so relaying costs nothing. Unknown type bytes frame fine and come out as ``UnknownMessage``. The type
tables map a type byte to its class (what ``framing``'s readers make of a frame), and ``render_row`` /
``render_text_row`` read a ``DataRow``'s frame as text for recording and guard rails.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

try:  # compiled, ``cython.compiled`` is true when Cython compiles this module and picks the C branch below
    import cython
except ImportError:  # Cython is a build-time dependency: without it this module runs as Python
    from gatewayd.hotpath import NO_CYTHON as cython

from proxies.postgres.wire import (
    AUTH_CLEARTEXT_PASSWORD,
    AUTH_GSS,
    AUTH_GSS_CONTINUE,
    AUTH_KERBEROS_V5,
    AUTH_MD5_PASSWORD,
    AUTH_OK,
    AUTH_SASL,
    AUTH_SASL_CONTINUE,
    AUTH_SASL_FINAL,
    AUTH_SSPI,
    FORMAT_BINARY,
    FORMAT_TEXT,
    MAX_CANCEL_KEY,
    MIN_CANCEL_KEY,
    TEXT_OID,
    ProtocolError,
)

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

_i16 = struct.Struct("!h").unpack_from
_u16 = struct.Struct("!H").unpack_from
_i32 = struct.Struct("!i").unpack_from
_u32 = struct.Struct("!I").unpack_from
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


NUL_RUN = 128  # bytes a compiled ``_nul_at`` looks through itself before it asks ``bytes.find``


def _nul_at(buf: bytes, start: int, end: int) -> int:
    """Where the first NUL of ``buf[start:end]`` is, or -1. The strings the fast paths look for are mostly a few
    bytes (a portal's or a statement's name, often empty): ``bytes.find`` with bounds costs about 900
    instructions to take its arguments, so compiled, the first ``NUL_RUN`` bytes are read in C, and only a longer
    string (a statement's text) is left to ``bytes.find``."""
    if cython.compiled:
        stop = min(end, start + NUL_RUN)
        for at in range(start, stop):
            if buf[at] == 0:
                return at
        if stop >= end:
            return -1
        start = stop
    return buf.find(b"\0", start, end)


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
        if start < end <= len(buf) and buf[end - 1] == 0:  # fast path: one NUL, at the end
            sql = buf[start : end - 1]
            if 0 not in sql:  # no other NUL (an int: bytes.__contains__ given bytes first fails to read it as one)
                return sql
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
            nul = _nul_at(buf, start, end)
            nul2 = _nul_at(buf, nul + 1, end) if nul >= 0 else -1
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
        nul = _nul_at(buf, start, end)
        if nul < 0:
            return None
        nul2 = _nul_at(buf, nul + 1, end)
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
            if end - start >= 2 and buf[start] in (0x53, 0x50) and _nul_at(buf, start + 1, end) == end - 1:
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
            nul = _nul_at(buf, start, end)
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
            nul = _nul_at(buf, pos, end) if type(buf) is bytes else buf.find(b"\0", pos, end)
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
            if start < end <= len(buf) and buf[end - 1] == 0:  # fast path: one NUL, at the end
                tag = buf[start : end - 1].decode("utf-8", "replace")
                if "\0" not in tag:  # a NUL byte decodes to U+0000 and nothing else does
                    return tag
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
