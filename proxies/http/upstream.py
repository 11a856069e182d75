"""Pooled keep-alive HTTP/1.1 connections to targets, on aiohttp's C response parser.

``ClientSession.request`` costs about three times the CPU of the server side
of a proxied request (URL handling, cookie and trace hooks, per-request
objects); the proxy already has the method, the raw path and the final
header list, so it writes the request head itself and has aiohttp's C
parser turn the answer into a ``(message, StreamReader)`` just as
``ClientResponse`` would get it. Websockets still go through ``ClientSession``.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from aiohttp import ClientConnectionError, ClientError, ClientPayloadError, ServerDisconnectedError
from aiohttp.base_protocol import BaseProtocol
from aiohttp.helpers import EMPTY_BODY_STATUS_CODES, set_exception
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.http_parser import HttpResponseParser, RawResponseMessage
from aiohttp.streams import EMPTY_PAYLOAD, StreamReader

from gatewayd.dialer import DialError, Dialer, direct

READ_BUFSIZE = 256 * 1024
WRITE_HIGH_WATER = 256 * 1024
IDLE_SECONDS = 30.0
CONNECT_TIMEOUT = 15.0
# what talking to a target can raise past the pool: a streamed answer's body read, the websocket client
CLIENT_ERRORS = (ClientError, OSError, asyncio.TimeoutError)


class TargetProtocol(BaseProtocol):
    """One target connection: aiohttp's C response parser fed straight from the socket.

    aiohttp's ``ResponseHandler`` re-runs its whole ``data_received`` on
    every body read (``resume_reading`` nudges the parser) and builds a new
    parser per request; here the parser lives as long as the connection (a
    new one only when a HEAD changes whether answers have bodies) and a
    resume that follows no pause costs nothing. The answer to a HEAD is its
    head alone: some servers (aiohttp's own ``StreamResponse`` among them)
    send a body after it, which the parser would read as a malformed next
    response; those bytes are dropped, and a connection that answered a HEAD
    is never reused (the body may come in a later segment, after the answer
    was handed on, where nothing can tell it from the next answer).

    One request, one answer: bytes that arrive while no request waits (the
    connection idle in the pool, or after the end of the answer in the same
    read), or a second final answer to one request, are not an answer to
    anything; the connection is closed and never handed out again, so such
    an answer never reaches the next request (another user's, perhaps).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self.should_close = False
        self.head_only = False
        self._head = b""
        self._discard = False
        self._with_body: bool | None = None
        self._answers: deque[tuple[RawResponseMessage, StreamReader]] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._payload: StreamReader | None = None
        self._error: BaseException | None = None
        self.on_answer: Callable[[], None] | None = None  # called (once) when an answer or an error arrives
        # the last answer when it was a whole Content-Length answer in one read: its head bytes, its message and
        # its size; the same head again, as long, is that message with this body (the parser is between messages
        # after it, and parsing is a function of the bytes): no parse, no StreamReader (``answer``)
        self._again_head = b""
        self._again_message: RawResponseMessage | None = None
        self._again_size = 0
        self.waiting = False  # a request was sent whose final answer has not ended yet (``expect``)
        self._final: StreamReader | None = None  # the body of the final answer to the request waiting

    def is_connected(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.should_close = True

    def force_close(self) -> None:
        self.should_close = True

    async def drain(self) -> None:
        """Wait while the target reads slower than the body is written (``BaseProtocol``'s flow control)."""
        await self._drain_helper()

    def expect(self, head_only: bool) -> None:
        """Get ready for the next answer (``head_only``: the answer to a HEAD, no body; the connection
        goes once that answer is done)."""
        self.head_only = head_only
        self.waiting = True
        self._final = None
        if head_only:
            self.should_close = True
        if self._with_body is not (not head_only):
            self._parser = HttpResponseParser(
                self, self._loop, READ_BUFSIZE, payload_exception=ClientPayloadError,
                response_with_body=not head_only, read_until_eof=True, auto_decompress=False,
                max_line_size=16384, max_field_size=16384)
            self._with_body = not head_only

    def answer(self) -> tuple[RawResponseMessage, StreamReader | bytes] | None:
        """The next final answer if it has arrived (interim 1xx answers skipped), else None; raises a failure.

        Its body is a StreamReader, or the whole body as bytes when the answer repeated the last one's head
        (``whole`` makes it a stream)."""
        answers = self._answers
        while answers:
            message, payload = answers.popleft()
            if not 100 <= message.code < 200 or message.code == 101:
                return message, payload
        if self._error is not None:
            raise self._error
        return None

    def _tell(self) -> None:
        callback, self.on_answer = self.on_answer, None
        if callback is not None:
            callback()

    async def read(self) -> tuple[RawResponseMessage, StreamReader]:
        """The next answer's head and its body as a stream."""
        while not self._answers:
            if self._error is not None:
                raise self._error
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        message, payload = self._answers.popleft()
        return message, self.whole(payload) if type(payload) is bytes else payload

    def whole(self, body: bytes) -> StreamReader:
        """A body that arrived whole, as the stream the parser would have made of it."""
        stream = StreamReader(self, READ_BUFSIZE, loop=self._loop)
        if body:
            stream.feed_data(body)
        stream.feed_eof()
        return stream

    def resume_reading(self, resume_parser: bool = True) -> None:
        if self._reading_paused:  # every body read calls this; only a real pause needs the work
            super().resume_reading(resume_parser)

    def data_received(self, data: bytes) -> None:
        if self._discard:
            return
        if not self.waiting and data:  # nothing was asked: not an answer to anything
            self._unsolicited()
            return
        # (``resume_reading`` calls this with no bytes: never a repeated answer)
        if self._again_size and len(data) == self._again_size and not self.head_only and data.startswith(
                self._again_head):
            self._answers.append((self._again_message, data[len(self._again_head):]))  # type: ignore[arg-type]
            self.waiting = False  # the whole answer, exactly (its size is the last one's)
            self._arrived()
            return
        self._again_size = 0
        if self.head_only and data:
            self._head += data
            end = self._head.find(b"\r\n\r\n")
            if end < 0 and len(self._head) < 65536:
                return  # the head is not complete yet
            cut = end + 4 if end >= 0 else len(self._head)
            data, extra = self._head[:cut], self._head[cut:]
            self._head, self.head_only = b"", False
            if extra:  # a body after a HEAD answer: dropped, and the connection with it
                self.should_close = True
                self._discard = True
        assert self._parser is not None
        started = self._final  # the final answer's body, when it began in an earlier read
        before = started.total_bytes if started is not None and started is not EMPTY_PAYLOAD else 0
        try:
            messages, upgraded, _ = self._parser.feed_data(data)
        except BaseException as exc:
            if self.transport is not None:
                self.transport.close()
            if not isinstance(exc, Exception):
                raise
            error = (HttpProcessingError(code=exc.code, message=exc.message, headers=exc.headers)
                     if isinstance(exc, HttpProcessingError) else HttpProcessingError())
            self._fail(error, ClientPayloadError(f"the response body was malformed ({type(exc).__name__})"))
            return
        queued = 0
        for message, payload in messages:
            if self._final is not None:  # a second final answer to one request: nobody asked for it
                self._unsolicited()
                break
            if message.should_close:
                self.should_close = True
            if not self._with_body or message.code in EMPTY_BODY_STATUS_CODES:
                payload = EMPTY_PAYLOAD
            else:
                self._payload = payload
            if not 100 <= message.code < 200 or message.code == 101:
                self._final = payload
            self._answers.append((message, payload))
            queued += 1
        if upgraded:
            self.should_close = True
        elif queued == 1 and len(messages) == 1 and payload is not EMPTY_PAYLOAD and not message.should_close:
            self._keep_for_again(data, message, payload)
        final = self._final
        if final is not None and self.waiting and (final is EMPTY_PAYLOAD or final.is_eof()) and data:
            self.waiting = False  # the answer ended in this read: what follows it in the read answers nothing
            fed = 0 if final is EMPTY_PAYLOAD else final.total_bytes - (before if final is started else 0)
            if not _ends_with(data, final, fed):
                self.should_close = True
        if queued:
            self._arrived()

    def _unsolicited(self) -> None:
        """Bytes nobody asked for: the connection is closed and its answers after this one are dropped."""
        self.should_close = True
        self._discard = True
        if self.transport is not None:
            self.transport.close()

    def _keep_for_again(self, data: bytes, message: RawResponseMessage, payload: StreamReader) -> None:
        """Keep an answer that was ``data`` whole, framed by its Content-Length, for the same head again."""
        length = message.headers.get("Content-Length")
        end = data.find(b"\r\n\r\n") + 4
        if (length is not None and length.isdigit() and end >= 4 and len(data) - end == int(length)
                and not message.chunked and payload.is_eof() and not 100 <= message.code < 200):
            self._again_head, self._again_message, self._again_size = data[:end], message, len(data)

    def _arrived(self) -> None:
        """Answers were queued: wake their reader."""
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        elif self.on_answer is not None:
            self._tell()

    def _fail(self, error: BaseException, body_error: BaseException) -> None:
        self.should_close = True
        self._error = error
        payload, self._payload = self._payload, None
        if payload is not None and not payload.is_eof():
            set_exception(payload, body_error)
        if self._waiter is not None and not self._waiter.done():
            set_exception(self._waiter, error)
        elif self.on_answer is not None:
            self._tell()

    def connection_lost(self, exc: BaseException | None) -> None:
        payload = self._payload
        if payload is not None and not payload.is_eof() and self._parser is not None:
            try:
                self._parser.feed_eof()  # ends a body that runs to the end of the connection
            except Exception:
                pass
        self._fail(ServerDisconnectedError(), ClientPayloadError("Response payload is not completed"))
        super().connection_lost(exc)


def _ends_with(data: bytes, body: StreamReader, fed: int) -> bool:
    """Whether a read in which an answer ended holds nothing after it: it ends with the end of a head or of a
    chunked body (CRLF CRLF: no start of a next answer ends so), or with the ``fed`` body bytes the parser
    took from it, after nothing or a head. Anything else (an answer's first bytes after it, or a framing
    this does not tell) is taken as more: the connection is not reused."""
    if data.endswith(b"\r\n\r\n"):
        return True
    if fed <= 0 or fed > len(data):
        return False
    buffered = body._buffer  # the parser feeds one read's body bytes in one piece
    if not buffered or len(buffered[-1]) != fed or not data.endswith(buffered[-1]):
        return False
    return fed == len(data) or data[:len(data) - fed].endswith(b"\r\n\r\n")


class UpstreamError(Exception):
    """The target could not be reached or broke the exchange before answering."""


class ConnectFailed(UpstreamError):
    """No connection to the target (refused, no answer, TLS failed): ``str()`` is the reason alone."""


@dataclass(slots=True, eq=False)
class UpstreamConnection:
    """One keep-alive connection to a target."""

    key: tuple[str, str, int, bool, str]  # scheme, host, port, insecure, the dialer's route
    protocol: TargetProtocol
    idle_since: float = 0.0
    reused: bool = False

    @property
    def usable(self) -> bool:
        """Connected, kept alive, and holding no answer nor awaiting one (only such a connection is handed out)."""
        protocol = self.protocol
        return (protocol.is_connected() and not protocol.should_close and not protocol.waiting
                and not protocol._answers)

    def close(self) -> None:
        self.protocol.close()


@dataclass(slots=True, eq=False)
class UpstreamResponse:
    """A target's answer: the parsed head and the body as a stream; ``release`` hands the connection back."""

    message: RawResponseMessage
    content: StreamReader
    connection: UpstreamConnection
    pool: "UpstreamPool"
    released: bool = field(default=False)

    def release(self) -> None:
        """Back to the pool when the body was read to its end on a reusable connection, else closed."""
        if self.released:
            return
        self.released = True
        self.pool.release(self.connection, self.message, self.content)

    def close(self) -> None:
        self.released = True
        self.connection.close()


class UpstreamPool:
    """Idle keep-alive connections per (scheme, host, port, insecure, route): a connection dialled through an
    agent is kept apart from a direct one to the same address (two networks may use the same addresses)."""

    def __init__(self, dialer: Dialer = direct) -> None:
        self.dialer = dialer
        self.idle: dict[tuple[str, str, int, bool, str], list[UpstreamConnection]] = {}
        self._insecure = ssl.create_default_context()
        self._insecure.check_hostname = False
        self._insecure.verify_mode = ssl.CERT_NONE
        self._verified = ssl.create_default_context()

    async def _connect(self, key: tuple[str, str, int, bool, str], dialer: Dialer) -> UpstreamConnection:
        scheme, host, port, insecure, _ = key
        loop = asyncio.get_running_loop()
        context = (self._insecure if insecure else self._verified) if scheme == "https" else None
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT):
                if context is None:  # plain HTTP: any transport will do (an agent's tunnel, no socketpair)
                    _, protocol = await dialer.open_transport(lambda: TargetProtocol(loop), host, port,
                                                              connection=f"{host}:{port}", timeout=CONNECT_TIMEOUT)
                else:
                    sock = await dialer.open_socket(host, port, connection=f"{host}:{port}", timeout=CONNECT_TIMEOUT)
                    try:
                        _, protocol = await loop.create_connection(lambda: TargetProtocol(loop), sock=sock,
                                                                   ssl=context, server_hostname=host)
                    except BaseException:
                        sock.close()
                        raise
        except DialError as exc:
            raise ConnectFailed(exc.reason) from None
        except TimeoutError:
            raise ConnectFailed(f"no answer within {CONNECT_TIMEOUT:.0f} seconds") from None
        except ssl.SSLError as exc:
            raise ConnectFailed(f"TLS handshake failed ({exc.reason or exc})") from None
        except OSError as exc:
            raise ConnectFailed(exc.strerror or str(exc) or type(exc).__name__) from None
        return UpstreamConnection(key, protocol)

    def take(self, scheme: str, host: str, port: int, insecure: bool,
             dialer: Dialer | None = None) -> UpstreamConnection | None:
        """An idle connection to the target (reached through ``dialer``) that is still usable, or None."""
        return self._take(self.key(scheme, host, port, insecure, dialer or self.dialer))

    def take_at(self, key: tuple[str, str, int, bool, str]) -> UpstreamConnection | None:
        """``take`` by the pool's key for the target (``key``)."""
        return self._take(key)

    @staticmethod
    def key(scheme: str, host: str, port: int, insecure: bool, dialer: Dialer) -> tuple[str, str, int, bool, str]:
        """The pool's key for a target: the address and how it is reached (a dialer's ``route``)."""
        return scheme, host, port, insecure, getattr(dialer, "route", "")

    def send(self, connection: UpstreamConnection, head: bytes, skip_body: bool,
             on_answer: Callable[[], None]) -> bool:
        """Send a request without a body on ``connection``; ``on_answer`` is called when its answer (or a failure)
        arrives: ``connection.protocol.answer()`` then gives it. False when the connection is gone already."""
        protocol = connection.protocol
        transport = protocol.transport
        if transport is None or transport.is_closing():
            connection.close()
            return False
        protocol.expect(skip_body)
        protocol.on_answer = on_answer
        transport.write(head)
        return True

    def _take(self, key: tuple[str, str, int, bool, str]) -> UpstreamConnection | None:
        idle = self.idle.get(key)
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            if connection.usable and now - connection.idle_since < IDLE_SECONDS:
                connection.reused = True
                return connection
            connection.close()
        return None

    def release(self, connection: UpstreamConnection, message: RawResponseMessage,
                content: StreamReader | bytes) -> None:
        """A connection whose answer was taken: back to the pool when its body was read to the end (or came whole,
        as bytes) and it may be reused, else closed."""
        if (type(content) is bytes or content.is_eof()) and not message.should_close:  # type: ignore[union-attr]
            self.put(connection)
        else:
            connection.close()

    def put(self, connection: UpstreamConnection) -> None:
        if not connection.usable:
            connection.close()
            return
        connection.idle_since = time.monotonic()
        idle = self.idle.get(connection.key)
        if idle is None:
            self.idle[connection.key] = [connection]
        else:
            idle.append(connection)

    def close(self) -> None:
        for connections in self.idle.values():
            for connection in connections:
                connection.close()
        self.idle.clear()

    async def request(self, scheme: str, host: str, port: int, insecure: bool, head: bytes,
                      body: bytes | AsyncIterator[bytes] | None, chunked: bool, skip_body: bool,
                      dialer: Dialer | None = None) -> UpstreamResponse:
        """Send ``head`` (request line and headers, CRLF-terminated) and the body; the parsed answer.

        A request whose body is replayable is retried once on a fresh
        connection when a pooled one turns out closed by the target.
        """
        dialer = dialer or self.dialer
        key = self.key(scheme, host, port, insecure, dialer)
        replayable = body is None or isinstance(body, bytes)
        while True:
            connection = self._take(key) or await self._connect(key, dialer)
            try:
                return await self._exchange(connection, head, body, chunked, skip_body)
            except (ServerDisconnectedError, ClientConnectionError, ConnectionError) as exc:
                connection.close()
                if connection.reused and replayable:
                    continue
                raise UpstreamError(f"the target closed the connection ({type(exc).__name__})") from None
            except BaseException:
                connection.close()
                raise

    async def _exchange(self, connection: UpstreamConnection, head: bytes, body: bytes | AsyncIterator[bytes] | None,
                        chunked: bool, skip_body: bool) -> UpstreamResponse:
        protocol = connection.protocol
        protocol.expect(skip_body)
        transport = protocol.transport
        if transport is None:
            raise ServerDisconnectedError()
        if body is None or isinstance(body, bytes):
            transport.write(head + body if body else head)
        else:
            transport.write(head)
            async for chunk in body:
                if not chunk:
                    continue
                transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunked else chunk)
                if transport.get_write_buffer_size() > WRITE_HIGH_WATER:
                    await protocol.drain()
                if protocol.transport is None:
                    raise ServerDisconnectedError()
            if chunked:
                transport.write(b"0\r\n\r\n")
        while True:
            message, payload = await protocol.read()
            if not 100 <= message.code < 200 or message.code == 101:
                break
        return UpstreamResponse(message, payload, connection, self)
