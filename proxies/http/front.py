"""The listener's front end: plain keep-alive requests served on a bare protocol, the rest handed to aiohttp.

aiohttp's ``web.Server`` costs about 20 us of CPU per request on its own (a
``BaseRequest``, the request-handler task's bookkeeping, response
preparation, keep-alive timers) -- a fifth of a proxied request. Most proxied
requests are the plain case: one complete HTTP/1.1 head without a body, no
upgrade, no ``Expect``, arriving in one piece while nothing else is in flight
on the connection. Those are parsed with aiohttp's own C request parser and
served here, by one task per connection: the handler gets a ``FrontRequest`` (the few attributes of
``BaseRequest`` the proxy reads) and answers with the bytes of a small
answer (``FrontRequest.answer``), a ``web.Response`` (serialized the way
aiohttp would write it) or a ``FrontStream`` for a streamed one.

Anything else (a body, a websocket, ``Expect: 100-continue``, HTTP/1.0,
``Connection: close``, a head split over reads, pipelining, a parse error)
hands the connection, from the bytes of that request on, to aiohttp's
``RequestHandler`` for good, so every other path is aiohttp's own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

from aiohttp import web
from aiohttp.helpers import EMPTY_BODY_STATUS_CODES, rfc822_formatted_time
from aiohttp.http import SERVER_SOFTWARE, HttpVersion11
from aiohttp.http_parser import HttpRequestParser, RawRequestMessage
from aiohttp.streams import EMPTY_PAYLOAD
from aiohttp.tcp_helpers import tcp_keepalive
from multidict import CIMultiDict, CIMultiDictProxy

from gatewayd import metrics
from gatewayd.tasks import BackgroundTasks

log = logging.getLogger("gatewayd.http")

_END = b"\r\n\r\n"


class FrontRequest:
    """A plain request served by the front end: the attributes of ``web.BaseRequest`` the proxy reads."""

    __slots__ = ("protocol", "headers", "method", "raw_path", "version", "host", "raw")

    scheme = "http"
    content_length = None
    body_exists = False

    def __init__(self, message: RawRequestMessage, protocol: FrontProtocol, raw: bytes = b"") -> None:
        self.protocol = protocol  # the connection it came on (``complete`` / ``serve_later`` end a request
        # taken over by ``fast``)
        self.raw = raw  # the request's head as it came, whole: it alone says what the message is
        self.headers: CIMultiDictProxy[str] = message.headers
        self.method: str = message.method
        self.raw_path: str = message.path
        self.version = message.version
        self.host: str = message.headers["Host"]

    @property
    def remote(self) -> str:
        return self.protocol.remote

    @property
    def transport(self) -> asyncio.Transport | None:
        return self.protocol.transport

    def answer(self, status: int, reason: str, headers: list[tuple[str, str]], body: bytes,
               head_length: int | None) -> bytes:
        """A whole answer on the wire, as ``web.Response`` would write it (``head_length``: a HEAD's length)."""
        head, body, _ = self.answer_parts(status, reason, headers, body, head_length)
        return head + body

    def answer_parts(self, status: int, reason: str, headers: list[tuple[str, str]], body: bytes,
                     head_length: int | None) -> tuple[bytes, bytes, bool]:
        """``answer`` as its head and the body sent after it, and whether the head is the same for the same
        arguments at any time (False: the gateway dated it, as the headers have no ``Date``)."""
        lines = [f"HTTP/1.1 {status} {reason}"]
        present = set()
        for name, value in headers:
            if "\n" in value or "\r" in value:
                raise ValueError("a newline in a header value")
            present.add(name.lower())
            lines.append(f"{name}: {value}")
        dated = "date" not in present
        if dated:
            lines.append(f"Date: {rfc822_formatted_time()}")
        if "server" not in present:
            lines.append(f"Server: {SERVER_SOFTWARE}")
        if status in EMPTY_BODY_STATUS_CODES:
            body = b""
        elif self.method == "HEAD":
            body = b""
            if head_length is not None:
                lines.append(f"Content-Length: {head_length}")
        else:
            lines.append(f"Content-Length: {len(body)}")
            if body and "content-type" not in present:
                lines.append("Content-Type: application/octet-stream")
        lines.append("\r\n")
        return "\r\n".join(lines).encode("utf-8", "surrogateescape"), body, not dated

    def start_stream(self, status: int, reason: str, headers: CIMultiDict[str], length: int | None) -> FrontStream:
        """A streamed answer: ``prepare`` sends its head, ``write`` and ``write_eof`` its body."""
        return FrontStream(self.protocol, status, reason, headers, length)


class FrontStream:
    """A streamed answer on a front-end connection: ``Content-Length`` when known, else chunked."""

    __slots__ = ("_protocol", "_chunked", "_head", "eof")

    def __init__(self, protocol: FrontProtocol, status: int, reason: str, headers: CIMultiDict[str],
                 length: int | None) -> None:
        self._protocol = protocol
        self._chunked = length is None
        self.eof = False
        if length is None:
            headers["Transfer-Encoding"] = "chunked"
        else:
            headers["Content-Length"] = str(length)
        if length != 0:
            headers.setdefault("Content-Type", "application/octet-stream")
        self._head = _head(status, reason, headers)

    async def prepare(self, request: FrontRequest) -> None:
        """Send the head (as ``StreamResponse.prepare`` does)."""
        self._protocol.send(self._head)

    async def write(self, data: bytes) -> None:
        if data:
            self._protocol.send(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)
            await self._protocol.drain()

    async def write_eof(self) -> None:
        if self._chunked:
            self._protocol.send(b"0\r\n\r\n")
        self.eof = True


def _head(status: int, reason: str, headers: CIMultiDict[str]) -> bytes:
    """The status line and headers as aiohttp writes them (``Date`` and ``Server`` added when missing).

    Bytes that are not UTF-8 in a target's header value go out as they came
    (aiohttp's private ``_serialize_headers`` drops them), as in ``FrontRequest.answer``.
    """
    if "Date" not in headers:
        headers["Date"] = rfc822_formatted_time()
    headers.setdefault("Server", SERVER_SOFTWARE)
    lines = [f"HTTP/1.1 {status} {reason}"]
    for name, value in headers.items():
        if "\n" in value or "\r" in value or "\n" in name or "\r" in name:
            raise ValueError("a newline in a header")
        lines.append(f"{name}: {value}")
    lines.append("\r\n")
    return "\r\n".join(lines).encode("utf-8", "surrogateescape")


def serialize(response: web.Response, method: str) -> bytes:
    """A ``web.Response`` on the wire, with the headers aiohttp's ``prepare`` would add."""
    status = response.status
    headers = response.headers
    body = response.body
    if not isinstance(body, (bytes, bytearray)):
        body = b""
    if status in EMPTY_BODY_STATUS_CODES:
        headers.pop("Content-Length", None)
        headers.pop("Transfer-Encoding", None)
        return _head(status, response.reason, headers)
    if method == "HEAD":
        headers.pop("Transfer-Encoding", None)
        if "Content-Length" not in headers and body:
            headers["Content-Length"] = str(len(body))
        return _head(status, response.reason, headers)
    headers["Content-Length"] = str(len(body))
    if body:
        headers.setdefault("Content-Type", "application/octet-stream")
    return _head(status, response.reason, headers) + body


Answer = web.StreamResponse | FrontStream | bytes
Handler = Callable[[FrontRequest], Awaitable[Answer]]
Fast = Callable[[FrontRequest], bool]


class Front:
    """The listener's front end: serves plain requests with ``handler``, hands the rest to ``fallback``.

    ``fast``: tried first for each plain request; True when it took the request over without a task
    (it then ends it with ``FrontProtocol.complete`` or ``serve_later``), False to leave it to ``handler``.
    """

    def __init__(self, handler: Handler, fallback: web.Server, fast: Fast | None = None, idle: float = 75.0) -> None:
        self.handler = handler
        self.idle = idle  # seconds a connection may wait for its next request (``http.idle_timeout``)
        self.fallback = fallback
        self.fast = fast
        # a new connection's first bytes, before anything else: True when taken (served later, or handed to
        # another worker: proxies/http/handover.py); None: no look
        self.first: Callable[[FrontProtocol, bytes], bool] | None = None
        self.connections: set[FrontProtocol] = set()
        self.runners = BackgroundTasks("http front")  # each connection's task serving its requests
        self.closing = False
        self._sweeper: asyncio.TimerHandle | None = None

    def protocol(self) -> FrontProtocol:
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().call_later(self.idle / 5, self._sweep)
        return FrontProtocol(self)

    def _sweep(self) -> None:
        """Close front-end connections idle for longer than the keep-alive time."""
        horizon = time.monotonic() - self.idle
        for connection in [c for c in self.connections if not c.busy and c.idle_since < horizon]:
            connection.close()
        self._sweeper = asyncio.get_running_loop().call_later(self.idle / 5, self._sweep)

    async def close(self, grace: float) -> None:
        """Close idle connections now, let requests in flight finish for up to ``grace`` seconds, then cut them."""
        self.closing = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        busy: list[asyncio.Future[Any]] = []
        later: dict[asyncio.Future[Any], asyncio.Task[None] | None] = {}
        for connection in list(self.connections):
            if not connection.busy:
                connection.close()
            elif connection.runner is not None and not connection.runner.done() and connection._next is None:
                busy.append(connection.runner)  # its runner serves the request
            else:  # taken over by ``fast`` (perhaps with a task after all): its end is awaited the same way
                connection.ended = asyncio.get_running_loop().create_future()
                busy.append(connection.ended)
                later[connection.ended] = connection.later
        if busy:
            _, pending = await asyncio.wait(busy, timeout=grace)
            for waiter in pending:
                waiter.cancel()
                task = later.get(waiter)
                if task is not None:
                    task.cancel()
            if pending:
                await asyncio.wait([*pending, *(t for w in pending if (t := later.get(w)) is not None)])
        for connection in list(self.connections):
            connection.close()


class FrontProtocol(asyncio.Protocol):
    """One client connection, served here while its requests stay plain (see the module docstring)."""

    def __init__(self, front: Front) -> None:
        self.front = front
        self.transport: asyncio.Transport | None = None
        self.remote = ""
        self.busy = False  # a request is being served
        self.runner: asyncio.Task[None] | None = None  # serves this connection's requests one after the other
        self._next: asyncio.Future[FrontRequest] | None = None  # the runner waits here between requests
        self.idle_since = time.monotonic()
        self._loop = asyncio.get_running_loop()
        self._parser = HttpRequestParser(self, self._loop, 2**16, max_line_size=8190, max_field_size=8190)
        self._pending = b""
        self._paused = False
        self._drained: asyncio.Future[None] | None = None
        self.ended: asyncio.Future[None] | None = None  # set when the gateway closes while a fast request runs
        self.later: asyncio.Task[None] | None = None  # the task of a fast request that needed one (``serve_later``)
        self.sent: Any = None  # what ``fast`` made of this connection's last request and answer (its own memo)
        self.answered: Any = None
        # the last plain request's head and what the parser made of it: the same bytes again are that message
        # (the parser is between messages after a plain request, and parsing is a function of the bytes)
        self._last_raw = b""
        self._last_message: RawRequestMessage | None = None
        self.handed = False  # True: handed to this worker by another, or looked at already (never handed on)

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.remote = str(peer[0]) if isinstance(peer, (list, tuple)) else str(peer or "")
        tcp_keepalive(self.transport)  # type: ignore[arg-type]
        self.front.connections.add(self)
        metrics.connection_opened("http")

    def connection_lost(self, exc: BaseException | None) -> None:
        self.transport = None
        self.front.connections.discard(self)
        metrics.connection_closed("http")
        self._wake_writer(ConnectionResetError("the client closed the connection"))
        self._stop_runner()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake_writer(None)

    def data_received(self, data: bytes) -> None:
        if not self.handed:  # a new connection's first bytes: whose session is it? (handover.py)
            self.handed = True
            first = self.front.first
            if first is not None and first(self, data):
                return
        if self.busy:  # the next request before this answer ends: kept until then
            self._pending += data
            if self.transport is not None:
                self.transport.pause_reading()
            return
        message = self._last_message
        if message is None or data != self._last_raw:
            message = self._plain(data)
            if message is None:
                return
        request = FrontRequest(message, self, data)
        self.busy = True
        fast = self.front.fast
        if fast is not None and fast(request):
            return  # answered from the target's protocol (``complete``), no task woken
        if self._next is not None:
            self._next.set_result(request)
        else:
            self.runner = self.front.runners.spawn(self._run(request))

    def served_here(self, data: bytes) -> None:
        """The first bytes ``Front.first`` took are served here after all."""
        if self.transport is None:
            return
        self.transport.resume_reading()
        self.data_received(data)

    def handed_away(self) -> None:
        """The connection went to another worker: forget it here without ending it (that worker holds it now)."""
        transport, self.transport = self.transport, None
        self.front.connections.discard(self)
        if transport is not None:
            transport.abort()  # closes this process's descriptor only: the other worker's copy keeps it open

    def _plain(self, data: bytes) -> RawRequestMessage | None:
        """``data`` parsed when it is one whole plain request (kept for the same bytes again); else None, and the
        connection is aiohttp's from ``data`` on."""
        if data.find(_END) != len(data) - 4:  # not exactly one whole head
            self._hand_over(data)
            return None
        try:
            messages, upgraded, _ = self._parser.feed_data(data)
        except Exception:
            self._hand_over(data)  # aiohttp answers it with its own 400
            return None
        if len(messages) != 1 or upgraded:
            self._hand_over(data)
            return None
        message, payload = messages[0]
        headers = message.headers
        if (payload is not EMPTY_PAYLOAD or message.version != HttpVersion11 or message.should_close
                or message.upgrade or message.method == "CONNECT" or "Host" not in headers
                or "Expect" in headers or "Upgrade" in headers):
            self._hand_over(data)
            return None
        self._last_raw, self._last_message = data, message
        return message

    # -- serving

    async def _run(self, request: FrontRequest) -> None:
        """Serve requests as they come (one task per connection, not one per request)."""
        while True:
            keep = await self._serve(request)
            if not self._done(keep):
                return
            self._next = self._loop.create_future()
            try:
                self._go_on()
                request = await self._next
            except asyncio.CancelledError:
                return  # the connection closed, or went to aiohttp
            finally:
                self._next = None

    def _done(self, keep: bool) -> bool:
        """A request was answered: whether the connection serves the next (else it is closed)."""
        self.busy = False
        self.idle_since = time.monotonic()
        ended, self.ended = self.ended, None
        if ended is not None and not ended.done():
            ended.set_result(None)
        if not keep or self.front.closing or self.transport is None:
            self.close()
            return False
        return True

    def _go_on(self) -> None:
        """Serve what arrived while the last answer was being sent."""
        if self._pending and self.transport is not None:
            data, self._pending = self._pending, b""
            self.transport.resume_reading()
            self.data_received(data)

    def complete(self, data: bytes) -> None:
        """End a request ``fast`` took over with the whole answer ``data`` (its connection goes on)."""
        try:
            self.send(data)
        except ConnectionError:  # the client went away
            self._done(False)
            return
        if self._done(True):
            self._go_on()

    def serve_later(self, request: FrontRequest, work: Awaitable[Answer]) -> None:
        """End a request ``fast`` took over with a task after all: ``work`` gives its answer, as ``handler`` would."""
        async def serve() -> None:
            keep = await self._serve(request, work)
            self.later = None
            if self._done(keep):
                self._go_on()

        self.later = self.front.runners.spawn(serve())

    def _stop_runner(self) -> None:
        if self._next is not None and not self._next.done():
            self._next.cancel()

    async def _serve(self, request: FrontRequest, work: Awaitable[Answer] | None = None) -> bool:
        """Answer one request (``work``: its answer, when not the handler's); whether the connection goes on."""
        keep = False
        try:
            response = await (self.front.handler(request) if work is None else work)
            if isinstance(response, bytes):
                self.send(response)
                keep = True
            elif isinstance(response, FrontStream):
                keep = response.eof
            elif isinstance(response, web.Response) and not response.prepared:
                self.send(serialize(response, request.method))
                keep = response.keep_alive is not False
            else:  # nothing else is produced for a plain request
                raise TypeError(f"unexpected response {type(response).__name__}")
        except asyncio.CancelledError:
            pass  # a kill of the session or a shutdown: the connection goes
        except ConnectionError:
            pass  # the client went away
        except Exception:
            log.exception("http request failed")
            if self.transport is not None and not self.transport.is_closing():
                self.transport.write(serialize(web.Response(status=500, text="500 Internal Server Error"),
                                               request.method))
        return keep

    def send(self, data: bytes) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        transport.write(data)

    async def drain(self) -> None:
        """Wait while the client reads slower than the answer arrives."""
        if self.transport is None:
            raise ConnectionResetError("the client closed the connection")
        if self._paused:
            self._drained = self._loop.create_future()
            await self._drained

    def _wake_writer(self, exc: BaseException | None) -> None:
        waiter, self._drained = self._drained, None
        if waiter is not None and not waiter.done():
            if exc is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(exc)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _hand_over(self, data: bytes) -> None:
        """From ``data`` on, the connection is aiohttp's."""
        transport = self.transport
        self.front.connections.discard(self)
        self._stop_runner()
        if transport is None or transport.is_closing():
            return
        handler = self.front.fallback()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        if self._paused:
            handler.pause_writing()
        self.transport = None
        handler.data_received(data)
