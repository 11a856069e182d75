"""Framing the PostgreSQL v3 byte streams into messages: ``FrontendReader`` (client to server, with the
untyped start-up phase) and ``BackendReader`` (server to client); ``feed(data)`` then ``next_message()``
until it returns ``None``. And the other way, ``FrameBatch`` / ``coalesce_frames``: received frames
gathered for one ``writelines()`` without copying.

Zero copy on the hot path: fed ``bytes`` chunks are kept as they are, and a frame that lies inside one
chunk is handed out as (chunk, start, end) -- the relay forwards ``msg.frame`` (or a ``FrameBatch``) and
nothing is copied or parsed unless a rule or the recorder asks for the fields.  Only a frame that
straddles two chunks is joined (one copy of that frame), and tiny feeds are coalesced so a trickling peer
cannot make the buffer quadratic or balloon into millions of small objects.
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Iterable, Iterator

from proxies.postgres.messages import (
    BACKEND_TYPES,
    FRONTEND_TYPES,
    CancelRequest,
    GSSENCRequest,
    Message,
    SSLRequest,
    StartupMessage,
    _i32,
    _int32_at,
    _u32,
)
from proxies.postgres.wire import (
    CANCEL_REQUEST_CODE,
    DEFAULT_MAX_BACKEND_MESSAGE,
    DEFAULT_MAX_FRONTEND_MESSAGE,
    DEFAULT_MAX_STARTUP_MESSAGE,
    GSSENC_REQUEST_CODE,
    MAX_CANCEL_KEY,
    MIN_CANCEL_KEY,
    SSL_REQUEST_CODE,
    ProtocolError,
)

_COALESCE_BELOW = 4096  # feeds smaller than this are copied into an accumulator
_ACCUMULATOR_SIZE = 256 * 1024  # ... that is sealed once it reaches this size

_HEADER = struct.Struct("!ci")  # type byte + length (signed, so garbage shows as negative)


def _framed(cls: type[Message], buf: bytes, start: int, end: int) -> Message:
    """A ``cls`` message over ``buf[start:end]``: what the readers make of each frame (``Message.__init__``
    without its argument handling; compiled, a C call that fills the typed fields)."""
    message = cls.__new__(cls)
    message._buf = buf
    message._start = start
    message._end = end
    message._cache = None
    return message


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
