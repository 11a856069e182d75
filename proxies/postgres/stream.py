"""One socket before the relay takes it over: what arrives goes straight into the codec's frame reader.

Start-up (TLS negotiation, the credential, the target's authentication) reads
a few messages with ``await stream.next_message()``.  The relay then switches
the transport to its own protocol (``session.RelaySession.start``): whatever
the reader already holds is simply what the relay processes first, so nothing
is buffered anywhere else and no stream internals are touched at the handover.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable

from proxies.postgres.codec import BackendReader, FrontendReader, Message

HIGH_WATER = 256 * 1024  # start-up reads only a few messages: stop reading past this much buffered


class FrameStream(asyncio.Protocol):
    """A transport's bytes framed by ``reader``, awaitable message by message until the relay takes over."""

    def __init__(self, reader: FrontendReader | BackendReader,
                 on_connect: Callable[[FrameStream], None] | None = None) -> None:
        self.reader = reader
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # set by connection_made
        self.closed = False  # the peer sent EOF or the connection is gone
        self._on_connect = on_connect
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False

    # -- protocol callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if self._on_connect is not None:
            self._on_connect(self)

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        if self.reader.buffered >= HIGH_WATER and not self._paused:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.closed = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- for the start-up code

    async def more(self) -> None:
        """Wait until something arrives or the peer goes away (``closed``)."""
        if self.closed:
            return
        self.release()
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def next_message(self) -> Message | None:
        """The next complete message; None when the peer closed first (ProtocolError for garbage)."""
        reader = self.reader
        while (message := reader.next_message()) is None:
            if reader.at_eof:
                return None
            if self.closed:
                reader.feed_eof()  # a partial message left over is a ProtocolError now
            else:
                await self.more()
        return message

    def release(self) -> None:
        """Read again if start-up had stopped reading (before waiting, and before the relay takes over)."""
        if self._paused:
            self._paused = False
            if not self.transport.is_closing():
                self.transport.resume_reading()

    async def start_tls(self, context: ssl.SSLContext, *, server_side: bool = False,
                        server_hostname: str | None = None) -> None:
        """Switch the connection to TLS; what arrives afterwards is decrypted into the same reader."""
        loop = asyncio.get_running_loop()
        self.transport = await loop.start_tls(self.transport, self, context, server_side=server_side,  # type: ignore[assignment]
                                              server_hostname=server_hostname)

    def write(self, data: bytes) -> None:
        if not self.transport.is_closing():
            self.transport.write(data)

    def close(self) -> None:
        self.transport.close()
