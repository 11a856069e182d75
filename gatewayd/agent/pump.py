"""One stream's bytes between an asyncio stream pair and a gRPC call, both ways, with back-pressure.

Each direction waits for its sink before it reads more: a socket's ``drain`` on one side, the
gRPC ``write`` (which returns once HTTP/2 flow control lets the frame go) on the other.  Every
stream is an HTTP/2 stream of its own, so a stream whose reader is slow holds back only itself.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

import grpc

from gatewayd.agent import agent_pb2 as pb

CHUNK = 64 * 1024

ReadFrame = Callable[[], Awaitable[Any]]  # a Frame, or grpc.aio.EOF when the call ended
WriteFrame = Callable[[pb.Frame], Awaitable[None]]


class StreamBroken(Exception):
    """The call ended without saying it was done (the peer went away)."""


class StreamFailed(Exception):
    """The peer ended the stream on an error of its own socket (a target's reset): this stream only."""


async def socket_to_call(reader: asyncio.StreamReader, write: WriteFrame) -> None:
    """Bytes read from the socket as frames; an ``eof`` frame when the socket's reading side ends."""
    while True:
        data = await reader.read(CHUNK)
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
        if frame.data:
            writer.write(frame.data)
            await writer.drain()
        if frame.eof:
            if writer.can_write_eof():
                writer.write_eof()
            return


async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, read: ReadFrame,
               write: WriteFrame) -> None:
    """Both directions until both ended; the first failure of either cancels the other and is raised."""
    up = asyncio.ensure_future(socket_to_call(reader, write))
    down = asyncio.ensure_future(call_to_socket(read, writer))
    try:
        pending: set[asyncio.Future[None]] = {up, down}
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                if task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
    finally:
        for task in (up, down):
            if not task.done():
                task.cancel()
        await asyncio.gather(up, down, return_exceptions=True)
