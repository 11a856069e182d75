"""One stream's bytes between an asyncio stream pair and its peer's ``Frame``s, both ways, with back-pressure.

The frames go either over a gRPC call (``Tunnel``, ``Forward``: its ``read`` and ``write``) or over a
tunnel connection of their own (``Records``: each frame prefixed by its length, on a TLS connection).
Each direction waits for its sink before it reads more: a socket's ``drain`` on one side, the gRPC
``write`` (which returns once HTTP/2 flow control lets the frame go) or the tunnel connection's
``drain`` on the other.  Every stream is an HTTP/2 stream or a TCP connection of its own, so a stream
whose reader is slow holds back only itself.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any, Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError

from gatewayd.agent import agent_pb2 as pb

CHUNK = 64 * 1024
HEADER = struct.Struct(">I")  # a record's length, before its bytes (a tunnel connection)
MAX_RECORD = 4 * CHUNK  # a data Frame is CHUNK bytes and a few more: a longer record is a broken or hostile peer

ReadFrame = Callable[[], Awaitable[Any]]  # a Frame, or grpc.aio.EOF when the call ended
WriteFrame = Callable[[pb.Frame], Awaitable[None]]


class StreamBroken(Exception):
    """The call ended without saying it was done (the peer went away)."""


class Records:
    """The pump's ``read`` and ``write`` over a tunnel connection: protobuf messages, each prefixed by its length
    (4 bytes, big-endian, at most ``MAX_RECORD``).  The end of the connection reads as ``grpc.aio.EOF``, as a
    call's end does; a record past the bound or one that does not parse is StreamBroken."""

    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def record(self, limit: int = MAX_RECORD) -> bytes | None:
        """The next record's bytes; None at the end of the connection; StreamBroken past ``limit``."""
        try:
            (length,) = HEADER.unpack(await self.reader.readexactly(HEADER.size))
            if length > limit:
                raise StreamBroken(f"a record of {length} bytes, past the bound of {limit}")
            return await self.reader.readexactly(length)
        except (asyncio.IncompleteReadError, OSError):  # (ssl.SSLError is an OSError)
            return None

    async def read(self) -> Any:
        data = await self.record()
        if data is None:
            return grpc.aio.EOF
        try:
            return pb.Frame.FromString(data)
        except DecodeError:
            raise StreamBroken("a record that does not parse") from None

    async def write(self, message: Any) -> None:
        body = message.SerializeToString()
        self.writer.write(HEADER.pack(len(body)) + body)
        await self.writer.drain()


class StreamFailed(Exception):
    """The peer ended the stream on an error of its own socket (a target's reset): this stream only."""


async def socket_to_call(reader: asyncio.StreamReader, write: WriteFrame) -> None:
    """Bytes read from the socket as frames; an ``eof`` frame when the socket's reading side ends, an
    ``error`` frame when it fails."""
    while True:
        try:
            data = await reader.read(CHUNK)
        except (ConnectionError, OSError, RuntimeError) as exc:
            await write(pb.Frame(error=f"the connection failed ({type(exc).__name__})"))
            return
        if not data:
            await write(pb.Frame(eof=True))
            return
        await write(pb.Frame(data=data))


async def call_to_socket(read: ReadFrame, writer: asyncio.StreamWriter) -> None:
    """Frames written to the socket; its writing side is shut at the ``eof`` frame; StreamBroken without one."""
    while True:
        frame = await read()
        if frame is grpc.aio.EOF:
            raise StreamBroken("the stream ended without its end of data")
        if frame.error:
            raise StreamFailed(frame.error)
        data = frame.data  # each read of a bytes field copies it (upb)
        if data:
            writer.write(data)
            await writer.drain()
        if frame.eof:
            if not writer.is_closing() and writer.can_write_eof():
                writer.write_eof()
            return


async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, read: ReadFrame,
               write: WriteFrame) -> None:
    """Both directions until both ended.

    Nothing here cancels a gRPC ``read`` or ``write`` in progress (grpc.aio cancels the whole call
    with it, which the other end would take for a lost link): to stop the direction that reads the
    socket, the socket is closed, and that direction ends by saying ``eof``.  When this side's
    socket fails, the peer is told (an ``error`` or ``eof`` frame) and its frames are dropped until
    it is done.  StreamBroken when the call ended without the peer saying it was done.
    """
    up = asyncio.ensure_future(socket_to_call(reader, write))
    try:
        try:
            await call_to_socket(read, writer)
        except StreamFailed:  # the peer's socket failed: ours closes, ``up`` says eof (the acknowledgement)
            writer.close()
        except (ConnectionError, OSError, RuntimeError):  # our socket refused the peer's bytes (closed meanwhile)
            writer.close()
            await up
            await _until_end(read)
            return
        await up
    finally:
        if not up.done():  # only when this coroutine itself is cancelled: the call is ending anyway
            up.cancel()
            await asyncio.gather(up, return_exceptions=True)


async def _until_end(read: ReadFrame) -> None:
    """The peer's frames, dropped, until it says it is done (eof or error) or the call ends."""
    while True:
        frame = await read()
        if frame is grpc.aio.EOF or frame.eof or frame.error:
            return
