"""One MySQL connection as logical packets over asyncio streams, with the sequence numbers kept per command."""

from __future__ import annotations

import asyncio
import ssl

from proxies.mysql.codec import DEFAULT_MAX_PACKET, PacketReader, ProtocolError, frame

READ_CHUNK = 256 * 1024
WRITE_HIGH_WATER = 256 * 1024


class PacketStream:
    """A socket's logical packets: ``read`` the next one, ``write`` payloads from the current sequence number.

    ``seq`` is the next sequence number to send; reading a packet sets it to follow the one read (a command
    starts at 0, its answer follows on), as both peers number them.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 limit: int = DEFAULT_MAX_PACKET) -> None:
        self.reader = reader
        self.writer = writer
        self.packets = PacketReader(limit)
        self.seq = 0
        self.first = 0  # the sequence number the last packet read began with

    @property
    def closed(self) -> bool:
        return self.writer.is_closing()

    async def read(self) -> bytes | None:
        """The next logical packet's payload; None when the peer closed (a packet cut short is a ProtocolError)."""
        while (packet := self.packets.next_packet()) is None:
            data = await self.reader.read(READ_CHUNK)
            if not data:
                if self.packets.buffered:
                    raise ProtocolError("the connection closed in the middle of a packet")
                return None
            self.packets.feed(data)
        self.first, last, payload = packet
        self.seq = (last + 1) & 0xFF
        return payload

    def ready(self) -> bool:
        """Whether a whole packet is already buffered (``read`` returns it without waiting)."""
        return self.packets.ready()

    @property
    def backed_up(self) -> bool:
        """Whether what was written waits in the transport: time to ``drain``."""
        return self.writer.transport.get_write_buffer_size() > WRITE_HIGH_WATER

    def encode(self, payload: bytes) -> bytes:
        data, self.seq = frame(payload, self.seq)
        return data

    def write(self, payload: bytes) -> None:
        if not self.writer.is_closing():
            self.writer.write(self.encode(payload))

    def write_raw(self, data: bytes) -> None:
        if not self.writer.is_closing():
            self.writer.write(data)

    async def drain(self) -> None:
        try:
            await self.writer.drain()
        except (ConnectionError, RuntimeError):
            pass

    async def start_tls(self, context: ssl.SSLContext, *, server_side: bool = False,
                        server_hostname: str | None = None) -> None:
        """Switch to TLS (a stream a server accepted is the TLS server side, one it opened the client side).

        A MySQL client starts its TLS handshake right after its SSL request, without waiting for an answer:
        what was read beyond the request is the handshake's start, handed to the TLS layer once it is in place.
        """
        early = self.packets.take_buffered() + bytes(self.reader._buffer)  # type: ignore[attr-defined]
        self.reader._buffer.clear()  # type: ignore[attr-defined]
        if early and not server_side:
            raise ProtocolError("unencrypted data after the TLS request")
        if early:
            loop = asyncio.get_running_loop()
            transport = self.writer.transport
            tries = [0]

            def hand_over() -> None:
                protocol = transport.get_protocol()
                if not hasattr(protocol, "buffer_updated") or isinstance(protocol, asyncio.StreamReaderProtocol):
                    tries[0] += 1
                    if tries[0] < 100:  # the TLS layer is not in place yet
                        loop.call_soon(hand_over)
                    return
                data = memoryview(early)
                while data:
                    buffer = protocol.get_buffer(len(data))
                    size = min(len(buffer), len(data))
                    buffer[:size] = data[:size]
                    protocol.buffer_updated(size)
                    data = data[size:]

            loop.call_soon(hand_over)
        await self.writer.start_tls(context, server_hostname=server_hostname)

    def close(self) -> None:
        try:
            self.writer.close()
        except RuntimeError:
            pass

