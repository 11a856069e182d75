"""Pooled keep-alive HTTP/1.1 connections to targets, on aiohttp's client protocol and C response parser.

``ClientSession.request`` costs about three times the CPU of the server side
of a proxied request (URL handling, cookie and trace hooks, per-request
objects); the proxy already has the method, the raw path and the final
header list, so it writes the request head itself and lets aiohttp's
``ResponseHandler`` parse the answer into a ``(message, StreamReader)`` just
as ``ClientResponse`` would. Websockets still go through ``ClientSession``.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from aiohttp import ClientConnectionError, ServerDisconnectedError
from aiohttp.client_proto import ResponseHandler
from aiohttp.http_parser import RawResponseMessage
from aiohttp.streams import StreamReader

READ_BUFSIZE = 256 * 1024
WRITE_HIGH_WATER = 256 * 1024
IDLE_SECONDS = 30.0
CONNECT_TIMEOUT = 15.0


class TargetProtocol(ResponseHandler):
    """aiohttp's client protocol, plus: the answer to a HEAD is its head alone.

    Some servers (aiohttp's own ``StreamResponse`` among them) send a body
    after the head of a HEAD answer; the parser would read it as a malformed
    next response. Those bytes are dropped and the connection is not reused.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self.head_only = False
        self._head = b""
        self._discard = False

    def data_received(self, data: bytes) -> None:
        if self._discard:
            return
        if not self.head_only:
            super().data_received(data)
            return
        self._head += data
        end = self._head.find(b"\r\n\r\n")
        if end < 0 and len(self._head) < 65536:
            return  # the head is not complete yet
        cut = end + 4 if end >= 0 else len(self._head)
        head, extra = self._head[:cut], self._head[cut:]
        self._head, self.head_only = b"", False
        if extra:  # a body after a HEAD answer: dropped, and the connection with it
            self.force_close()
            self._discard = True
        super().data_received(head)


class UpstreamError(Exception):
    """The target could not be reached or broke the exchange before answering."""


@dataclass(slots=True, eq=False)
class UpstreamConnection:
    """One keep-alive connection to a target."""

    key: tuple[str, str, int, bool]
    protocol: TargetProtocol
    idle_since: float = 0.0
    reused: bool = False

    @property
    def usable(self) -> bool:
        return self.protocol.is_connected() and not self.protocol.should_close

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
        if self.content.is_eof() and not self.message.should_close:
            self.pool.put(self.connection)
        else:
            self.connection.close()

    def close(self) -> None:
        self.released = True
        self.connection.close()


class UpstreamPool:
    """Idle keep-alive connections per (scheme, host, port, insecure)."""

    def __init__(self) -> None:
        self.idle: dict[tuple[str, str, int, bool], list[UpstreamConnection]] = {}
        self._insecure = ssl.create_default_context()
        self._insecure.check_hostname = False
        self._insecure.verify_mode = ssl.CERT_NONE
        self._verified = ssl.create_default_context()

    async def _connect(self, key: tuple[str, str, int, bool]) -> UpstreamConnection:
        scheme, host, port, insecure = key
        loop = asyncio.get_running_loop()
        context = (self._insecure if insecure else self._verified) if scheme == "https" else None
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT):
                _, protocol = await loop.create_connection(lambda: TargetProtocol(loop), host, port, ssl=context,
                                                           server_hostname=host if context else None)
        except TimeoutError:
            raise UpstreamError(f"connection timed out after {CONNECT_TIMEOUT:.0f} s") from None
        except ssl.SSLError as exc:
            raise UpstreamError(f"TLS handshake failed ({exc.reason or exc})") from None
        except OSError as exc:
            raise UpstreamError(exc.strerror or str(exc) or type(exc).__name__) from None
        return UpstreamConnection(key, protocol)

    def _take(self, key: tuple[str, str, int, bool]) -> UpstreamConnection | None:
        idle = self.idle.get(key)
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            if connection.usable and now - connection.idle_since < IDLE_SECONDS:
                connection.reused = True
                return connection
            connection.close()
        return None

    def put(self, connection: UpstreamConnection) -> None:
        if not connection.usable:
            connection.close()
            return
        connection.idle_since = time.monotonic()
        self.idle.setdefault(connection.key, []).append(connection)

    def close(self) -> None:
        for connections in self.idle.values():
            for connection in connections:
                connection.close()
        self.idle.clear()

    async def request(self, scheme: str, host: str, port: int, insecure: bool, head: bytes,
                      body: bytes | AsyncIterator[bytes] | None, chunked: bool, skip_body: bool) -> UpstreamResponse:
        """Send ``head`` (request line and headers, CRLF-terminated) and the body; the parsed answer.

        A request whose body is replayable is retried once on a fresh
        connection when a pooled one turns out closed by the target.
        """
        key = (scheme, host, port, insecure)
        replayable = body is None or isinstance(body, bytes)
        while True:
            connection = self._take(key) or await self._connect(key)
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
        protocol.head_only = skip_body
        protocol.set_response_params(skip_payload=skip_body, read_until_eof=True, auto_decompress=False,
                                     read_bufsize=READ_BUFSIZE,
                                     max_line_size=16384, max_field_size=16384)
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
                    await protocol._drain_helper()
                if protocol.transport is None:
                    raise ServerDisconnectedError()
            if chunked:
                transport.write(b"0\r\n\r\n")
        while True:
            message, payload = await protocol.read()
            if not 100 <= message.code < 200 or message.code == 101:
                break
        return UpstreamResponse(message, payload, connection, self)
