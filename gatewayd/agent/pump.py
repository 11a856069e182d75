"""One stream's bytes between a socket and its peer's ``Frame``s, both ways, with back-pressure.

The frames go over a gRPC call (``Tunnel``, ``Forward``: ``pump`` on an asyncio stream pair, the call's
``read`` and ``write``) or over a tunnel connection of their own (``Splice``: records, each a Frame
prefixed by its length, on a TLS connection; asyncio protocols, no task step per message: the agent's
CPU per round trip about a third below ``pump``'s on the same connection, bench/README.md).  Both keep the
same rules: a frame says ``eof`` (a TCP half-close) or ``error`` (the socket failed at that end: this
stream ends, its peer acknowledges with ``eof``); after this side's socket failed, the peer's frames
are dropped until it is done.  Each direction waits for its sink before it reads more (a socket's
write buffer, HTTP/2 flow control or the tunnel connection's write buffer), and every stream is an
HTTP/2 stream or a TCP connection of its own, so a stream whose reader is slow holds back only itself.
"""

from __future__ import annotations

import asyncio
import struct
import socket
from typing import Any, Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError

from gatewayd.agent import agent_pb2 as pb

CHUNK = 64 * 1024
HEADER = struct.Struct(">I")  # a record's length, before its bytes (a tunnel connection)
MAX_RECORD = 4 * CHUNK  # a data Frame is CHUNK bytes and a few more: a longer record is a broken or hostile peer

ATTACH_TIMEOUT = 10.0  # a stream's end handed to a dial (``Splice.end``) is taken within this, or the stream ends
ReadFrame = Callable[[], Awaitable[Any]]  # a Frame, or grpc.aio.EOF when the call ended
WriteFrame = Callable[[pb.Frame], Awaitable[None]]


class StreamBroken(Exception):
    """The call ended without saying it was done (the peer went away)."""


def record(message: Any) -> bytes:
    """A message as a tunnel connection's record: its length (4 bytes, big-endian), then its bytes."""
    body = message.SerializeToString()
    return HEADER.pack(len(body)) + body


EOF_RECORD = record(pb.Frame(eof=True))
DATA_TAG = 0x0A  # a Frame's ``data`` (field 1, length-delimited): the first byte of a data frame's encoding


def data_record(data: bytes) -> bytes:
    """``record(Frame(data=data))``, byte for byte, without building the message (the one record of the hot path:
    protobuf encodes a message with only ``data`` set as its tag, the length as a varint, then the bytes)."""
    size = len(data)
    if 0 < size < 0x80:
        head = bytes((DATA_TAG, size))
    elif 0x80 <= size < 0x4000:
        head = bytes((DATA_TAG, size & 0x7F | 0x80, size >> 7))
    elif 0x4000 <= size < 0x200000:
        head = bytes((DATA_TAG, size & 0x7F | 0x80, (size >> 7) & 0x7F | 0x80, size >> 14))
    else:  # empty (protobuf writes no field at all) or past any record's bound
        return record(pb.Frame(data=data))
    return b"".join((HEADER.pack(len(head) + size), head, data))


def data_of(record_: bytes, start: int, end: int) -> bytes | None:
    """The bytes of the data frame encoded in ``record_[start:end]`` when it is one whose ``data`` is its only field
    (as ``data_record`` writes it, and protobuf), else None (the caller parses it as a Frame)."""
    if end - start < 2 or record_[start] != DATA_TAG:
        return None
    first = record_[start + 1]
    if first < 0x80:
        size, at = first, start + 2
    elif end - start >= 3 and record_[start + 2] < 0x80:
        size, at = (first & 0x7F) | (record_[start + 2] << 7), start + 3
    elif end - start >= 4 and record_[start + 2] >= 0x80 and record_[start + 3] < 0x80:
        size, at = (first & 0x7F) | ((record_[start + 2] & 0x7F) << 7) | (record_[start + 3] << 14), start + 4
    else:
        return None
    return record_[at:end] if at + size == end else None

KEEPALIVE_IDLE = 60  # seconds a tunnel connection may be idle before TCP probes it (see keep_alive)


def keep_alive(transport: asyncio.BaseTransport) -> None:
    """TCP keepalives on a tunnel connection (both ends): an idle session's connection keeps its place in the NATs
    and firewalls between agent and gateway (which forget idle flows after minutes), and a peer gone without a
    word is found within about two minutes, not never."""
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE), ("TCP_KEEPINTVL", 20), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):  # Linux's names; elsewhere the system's defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


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
        if not up.done():  # only when this coroutine itself is cancelled or failed: the call is ending anyway
            up.cancel()
        # its end is taken here: a call this side aborted fails both directions, and ``up``'s error, left unread,
        # was logged with a traceback ("Task exception was never retrieved")
        await asyncio.gather(up, return_exceptions=True)


async def _until_end(read: ReadFrame) -> None:
    """The peer's frames, dropped, until it says it is done (eof or error) or the call ends."""
    while True:
        frame = await read()
        if frame is grpc.aio.EOF or frame.eof or frame.error:
            return


def failure(exc: BaseException | None) -> str:
    """An error frame's words for this side's socket failing (never an address)."""
    return f"the connection failed ({type(exc).__name__})"


class CallRelay:
    """A stream over a gRPC call: ``pump`` between a socket and the call's ``read`` and ``write``."""

    def __init__(self, read: ReadFrame, write: WriteFrame) -> None:
        self.read = read
        self.write = write
        self.writer: asyncio.StreamWriter | None = None
        self.reader: asyncio.StreamReader | None = None

    async def attach(self, sock: socket.socket) -> None:
        self.reader, self.writer = await asyncio.open_connection(sock=sock, limit=256 * 1024)

    async def run(self) -> None:
        assert self.reader is not None and self.writer is not None
        await pump(self.reader, self.writer, self.read, self.write)

    async def fail(self, reason: str) -> None:
        await self.write(pb.Frame(error=reason))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class Splice:
    """A stream over a tunnel connection: bytes between a socket's transport and the connection's records of
    Frames, both ways, in the transports' callbacks (no task per message).  Each side's transport stops reading
    while the other's write buffer is full (TCP's own flow control then holds the sender back).  ``done``
    completes once both ends said they are done; StreamBroken when the connection ended without the peer
    saying so, or it sent a record past ``MAX_RECORD`` or one that does not parse."""

    def __init__(self) -> None:
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.socket: asyncio.Transport | None = None
        self.tunnel: asyncio.Transport | None = None
        self.plain = _SocketSide(self)
        self.framed = _TunnelSide(self)
        self.buffer = bytearray()  # a record's bytes received so far
        self.rest = b""  # the tunnel connection's bytes read before the start (before this side became its protocol)
        self.early = bytearray()  # the socket's bytes read before the start (its reading is paused until then)
        self.ending: pb.Frame | None = None  # this side's end, said before the start
        self.started = False
        self.said = False  # this side's end was sent (eof or error)
        self.heard = False  # the peer's end was received (eof or error)
        self.held = False  # the proxy's end stopped reading (``end``): records wait in ``buffer``
        self.attached: asyncio.Future[None] | None = None  # ``end``'s: its protocol is there

    # -- what a relay does (gatewayd.agent.server.carry)

    async def attach(self, sock: socket.socket) -> None:
        """The socket's end, as a transport (reading once ``start`` is called)."""
        await asyncio.get_running_loop().create_connection(lambda: self.plain, sock=sock)

    def end(self) -> TunnelTransport:
        """The socket's end as a transport of this process, for a protocol here (the gateway's proxy): what it writes
        becomes frames and the frames' bytes are its ``data_received``, with no ``socketpair()`` between (two more
        writes, reads and loop wake-ups per message).  Bytes flow once a protocol is attached (``attached``)."""
        transport = TunnelTransport(self)
        self.socket = transport.inward  # type: ignore[assignment]
        self.attached = asyncio.get_running_loop().create_future()
        return transport

    def adopt(self, transport: asyncio.Transport, rest: bytes = b"") -> None:
        """The tunnel connection's transport, whose protocol this side becomes (reading once ``start`` is called);
        ``rest``: its bytes read past its first record."""
        transport.set_protocol(self.framed)
        self.framed.connection_made(transport)
        self.rest = rest

    def start(self) -> None:
        """Bytes flow (what either side received before, kept until now, first)."""
        self.started = True
        rest, early = self.rest, bytes(self.early)
        self.rest = b""
        self.early.clear()
        if early:
            self.send(early)
        if self.ending is not None:
            self.say(self.ending)
        if rest:
            self.received(rest)
        for transport in (self.socket, self.tunnel):
            if transport is not None and not transport.is_closing() and not (transport is self.tunnel and self.held):
                transport.resume_reading()

    async def run(self) -> None:
        if self.attached is not None:  # the proxy's end (``end``): once its protocol is there, bounded
            try:
                async with asyncio.timeout(ATTACH_TIMEOUT):
                    await self.attached
            except TimeoutError:
                raise StreamBroken("the gateway's end of the stream was never taken") from None
        self.start()
        await self.done

    async def fail(self, reason: str) -> None:
        self.say(pb.Frame(error=reason))

    def close(self) -> None:
        for transport in (self.socket, self.tunnel):
            if transport is not None:
                transport.close()

    # -- the rules

    def send(self, data: bytes) -> None:
        if not self.started or self.tunnel is None:
            self.early += data
            return
        if len(data) <= CHUNK:
            self.tunnel.write(data_record(data))
            return
        for at in range(0, len(data), CHUNK):
            self.tunnel.write(data_record(data[at:at + CHUNK]))

    def say(self, frame: pb.Frame) -> None:
        """This side's end (eof or error), once (after the bytes received before the start, when it comes first)."""
        if not self.started:
            self.ending = self.ending or frame
            return
        if not self.said:
            self.said = True
            if self.tunnel is not None and not self.tunnel.is_closing():
                self.tunnel.write(EOF_RECORD if frame.eof else record(frame))
        self.finish()

    def finish(self, exc: BaseException | None = None) -> None:
        if self.done.done():
            return
        if exc is not None:
            self.done.set_exception(exc)
        elif self.said and self.heard:
            self.done.set_result(None)

    def received(self, data: bytes) -> None:
        """The tunnel connection's bytes: each whole record handled, the rest kept."""
        if not self.started:
            self.rest += data
            return
        if self.buffer:
            self.buffer += data
            data = bytes(self.buffer)
            self.buffer.clear()
        at, size = 0, len(data)
        while size - at >= HEADER.size and not self.held and not self.done.done():
            (length,) = HEADER.unpack_from(data, at)
            if length > MAX_RECORD:
                self.broken(f"a record of {length} bytes, past the bound of {MAX_RECORD}")
                return
            end = at + HEADER.size + length
            if size < end:
                break
            payload = data_of(data, at + HEADER.size, end)
            if payload is not None:  # a data frame (nearly every record): its bytes, no message built
                at = end
                if not self.heard:  # as ``frame`` does with a Frame that has only data
                    socket = self.socket
                    if payload and socket is not None and not socket.is_closing():
                        socket.write(payload)
                continue
            try:
                frame = pb.Frame.FromString(memoryview(data)[at + HEADER.size:end])  # not a data frame: rare
            except DecodeError:
                self.broken("a record that does not parse")
                return
            at = end
            self.frame(frame)
        if at < size:
            self.buffer += memoryview(data)[at:]

    def frame(self, frame: pb.Frame) -> None:
        if self.heard:
            return  # nothing comes after the peer's end
        socket = self.socket
        open_ = socket is not None and not socket.is_closing()
        if frame.error:  # the peer's socket failed: ours closes, and its loss says eof (the acknowledgement)
            self.heard = True
            if open_:
                socket.close()  # type: ignore[union-attr]
            self.say(pb.Frame(eof=True))
            return
        data = frame.data
        if data and open_:
            socket.write(data)  # type: ignore[union-attr]
        if frame.eof:
            self.heard = True
            if open_ and socket.can_write_eof():  # type: ignore[union-attr]
                socket.write_eof()  # type: ignore[union-attr]
            self.finish()

    def broken(self, reason: str) -> None:
        self.finish(StreamBroken(reason))
        if self.tunnel is not None:
            self.tunnel.close()


class _SocketSide(asyncio.Protocol):
    """The socket's end of a Splice (the proxy's socketpair on the gateway, the target's socket on the agent)."""

    def __init__(self, splice: Splice) -> None:
        self.splice = splice

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.splice.socket = transport  # type: ignore[assignment]
        if not self.splice.started:
            transport.pause_reading()  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        self.splice.send(data)

    def eof_received(self) -> bool:
        self.splice.say(pb.Frame(eof=True))
        return True  # half-closed: the peer's bytes may still come

    def connection_lost(self, exc: Exception | None) -> None:
        self.splice.say(pb.Frame(error=failure(exc)) if exc is not None else pb.Frame(eof=True))

    def pause_writing(self) -> None:
        if self.splice.tunnel is not None:
            self.splice.tunnel.pause_reading()

    def resume_writing(self) -> None:
        if self.splice.tunnel is not None and not self.splice.tunnel.is_closing():
            self.splice.tunnel.resume_reading()


class _TunnelSide(asyncio.Protocol):
    """The tunnel connection's end of a Splice."""

    def __init__(self, splice: Splice) -> None:
        self.splice = splice

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.splice.tunnel = transport  # type: ignore[assignment]
        if not self.splice.started:
            transport.pause_reading()  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        self.splice.received(data)

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        splice = self.splice
        if not splice.heard:
            splice.finish(StreamBroken("the stream ended without its end of data"))
        else:
            splice.said = True  # nothing more can be said: the stream is over
            splice.finish()

    def pause_writing(self) -> None:
        if self.splice.socket is not None:
            self.splice.socket.pause_reading()

    def resume_writing(self) -> None:
        if self.splice.socket is not None and not self.splice.socket.is_closing():
            self.splice.socket.resume_reading()


class TunnelTransport(asyncio.Transport):
    """A Splice's socket end as the transport of a protocol in this process (``Splice.end``): the gateway's proxy
    reads and writes its target through it as through a socket's transport (``set_protocol``, flow control both
    ways, ``write_eof``, ``close``).  Not a socket's: ``loop.start_tls`` does not take it (a dial that upgrades to
    TLS asks for a socket)."""

    def __init__(self, splice: Splice) -> None:
        super().__init__()
        self.splice = splice
        self.inward = _ProxySide(self)  # what the Splice drives, as it drives a socket's transport
        self.protocol: asyncio.BaseProtocol | None = None
        self.closing = False
        self.lost = False  # the protocol was told (connection_lost)
        self.reading = True
        self.writing_paused = False  # the protocol was told pause_writing

    def attach(self, protocol: asyncio.BaseProtocol) -> None:
        """``protocol`` becomes this transport's (``connection_made``); the stream's bytes flow from now on."""
        self.protocol = protocol
        protocol.connection_made(self)
        attached = self.splice.attached
        if attached is not None and not attached.done():
            attached.set_result(None)

    # -- asyncio.Transport

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self.closing:
            self.splice.send(data if type(data) is bytes else bytes(data))

    def writelines(self, list_of_data: Any) -> None:
        self.write(b"".join(list_of_data))

    def write_eof(self) -> None:
        if not self.closing:
            self.splice.say(pb.Frame(eof=True))

    def can_write_eof(self) -> bool:
        return True

    def close(self) -> None:
        """As a socket's close: the peer hears this end's eof; the protocol hears ``connection_lost`` soon.  An end
        closed before any protocol was attached (a dial that gave up as it was answered) is done with: the stream
        goes on to its end at once instead of waiting ``ATTACH_TIMEOUT`` for a protocol that will not come."""
        if self.closing:
            return
        self.closing = True
        self.splice.say(pb.Frame(eof=True))
        self._unwaited()
        asyncio.get_running_loop().call_soon(self._lose, None)

    def abort(self) -> None:
        if self.closing:
            return
        self.closing = True
        self.splice.say(pb.Frame(error="the gateway's end failed (aborted)"))
        self._unwaited()
        asyncio.get_running_loop().call_soon(self._lose, None)

    def _unwaited(self) -> None:
        attached = self.splice.attached
        if attached is not None and not attached.done():
            attached.set_result(None)

    def is_closing(self) -> bool:
        return self.closing

    def pause_reading(self) -> None:
        if self.reading:
            self.reading = False
            self.splice.held = True
            tunnel = self.splice.tunnel
            if tunnel is not None and not tunnel.is_closing():
                tunnel.pause_reading()

    def resume_reading(self) -> None:
        if self.reading or self.closing:
            return
        self.reading = True
        splice = self.splice
        splice.held = False
        if splice.buffer:  # records received before the pause and not yet handed on
            splice.received(b"")
        if splice.tunnel is not None and not splice.tunnel.is_closing() and not splice.held:
            splice.tunnel.resume_reading()

    def is_reading(self) -> bool:
        return self.reading

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.protocol = protocol

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self.protocol  # type: ignore[return-value]

    def get_write_buffer_size(self) -> int:
        tunnel = self.splice.tunnel
        return tunnel.get_write_buffer_size() if tunnel is not None else 0

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        tunnel = self.splice.tunnel
        if tunnel is not None:
            tunnel.set_write_buffer_limits(high, low)

    def get_write_buffer_limits(self) -> tuple[int, int]:
        tunnel = self.splice.tunnel
        return tunnel.get_write_buffer_limits() if tunnel is not None else (0, 0)  # type: ignore[attr-defined]

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default  # no socket, no peer address of its own (the agent's dial is the agent's)

    # -- what the Splice does to it (through ``inward``)

    def _lose(self, exc: Exception | None) -> None:
        if not self.lost:
            self.lost = True
            self.closing = True
            if self.protocol is not None:
                self.protocol.connection_lost(exc)


class _ProxySide:
    """A TunnelTransport as the Splice sees its socket's transport: the frames' bytes go to the protocol (as a
    socket's ``write`` would send them to the proxy), the tunnel's flow control to its ``pause_writing``."""

    __slots__ = ("transport",)

    def __init__(self, transport: TunnelTransport) -> None:
        self.transport = transport

    def write(self, data: bytes) -> None:
        transport = self.transport
        if not transport.closing and transport.protocol is not None:
            transport.protocol.data_received(data)  # type: ignore[attr-defined]

    def write_eof(self) -> None:
        transport = self.transport
        if transport.closing or transport.protocol is None:
            return
        if not transport.protocol.eof_received():  # type: ignore[attr-defined]
            transport.close()

    def can_write_eof(self) -> bool:
        return True

    def close(self) -> None:
        """The stream ended here (the agent's socket failed, the link was lost, the gateway stops)."""
        transport = self.transport
        if not transport.lost:
            transport.closing = True
            asyncio.get_running_loop().call_soon(transport._lose, None)

    def is_closing(self) -> bool:
        return self.transport.closing

    def pause_reading(self) -> None:  # the tunnel's write buffer is full: the protocol stops writing
        transport = self.transport
        if not transport.writing_paused and transport.protocol is not None and not transport.closing:
            transport.writing_paused = True
            transport.protocol.pause_writing()

    def resume_reading(self) -> None:
        transport = self.transport
        if transport.writing_paused and transport.protocol is not None and not transport.closing:
            transport.writing_paused = False
            transport.protocol.resume_writing()
