"""The tunnel listener: each stream of an agent on a TLS connection of its own, beside the gRPC port.

The gRPC ``Tunnel`` call costs grpc.aio's per-message work on both ends (docs/agents.md); a stream's
bytes go faster over a TLS connection of their own, which the agent opens to the port its ``Open``
names (``tunnel_port``) with the certificate it trusts for gRPC.  Its first record is a
``TunnelStart`` (the agent's token and the frame a ``Tunnel`` would start with), bounded in size
(``START_LIMIT``) and in time (``START_TIMEOUT``, the TLS handshake's too), and checked by
``AgentService.admit`` as a Tunnel's first frame is; every record after it is a ``Frame``, carried by
``pump.Splice``.  TCP's flow control is each connection's own, so a slow stream holds back only
itself.  A refusal is said in one error frame, then the connection closes; but a connection from an
address past its refusals (the throttle the Tunnel calls share) is closed as it is accepted, before its
TLS handshake costs the event loop anything.  The handshake is bounded, and the first record is read in
the transport's callbacks: nothing waits on a client that says nothing.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from pathlib import Path
from typing import Any, Awaitable, Callable, Protocol

from google.protobuf.message import DecodeError

from gatewayd.agent import agent_pb2 as pb
from gatewayd.agent.pump import HEADER, Splice, keep_alive, record
from gatewayd.agent.registry import STREAM_REFUSED
from gatewayd.tasks import BackgroundTasks

log = logging.getLogger("gatewayd.grpc")

START_LIMIT = 4096  # the first record's bound: a token, a stream id and a dial's error fit many times over
START_TIMEOUT = 5.0  # the TLS handshake, then the first record, each within this (the agent sends it at once)


class AgentService(Protocol):
    """What the listener asks of gatewayd.agent.server's AgentService (which starts it): the same checks as a
    Tunnel call's."""

    def throttled(self, client_ip: str) -> str: ...

    async def refusal(self, client_ip: str, message: str, action: str) -> None: ...

    async def admit(self, client_ip: str, token: str,
                    first_frame: Callable[[], Awaitable[Any]]) -> tuple[Any, Any] | None: ...

    async def carry(self, pending: Any, first: Any, relay: Splice) -> None: ...


class TunnelListener:
    """The started listener; ``stop`` closes it and the connections it serves."""

    def __init__(self, service: AgentService) -> None:
        self.service = service
        self.server: socket.socket | None = None
        self.context: ssl.SSLContext | None = None
        self.port = 0
        self.connections: set[asyncio.Transport] = set()
        self.tasks = BackgroundTasks("agent tunnel listener")  # each connection's handshake and service
        self.accepting: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int, cert_path: Path, key_path: Path) -> int:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(cert_path, key_path)
        self.context = context
        # no SO_REUSEPORT: a stream must reach the process whose dial waits for it
        bare = host.strip("[]")
        family = socket.AF_INET6 if ":" in bare else socket.AF_INET
        self.server = socket.create_server((bare, port), family=family, backlog=1024)
        self.server.setblocking(False)
        self.port = self.server.getsockname()[1]
        self.accepting = asyncio.ensure_future(self._accept(self.server))
        return self.port

    async def stop(self) -> None:
        if self.server is not None:
            if self.accepting is not None:
                self.accepting.cancel()
                await asyncio.gather(self.accepting, return_exceptions=True)
            self.server.close()
            for transport in list(self.connections):
                transport.close()
            await self.tasks.cancel()
            self.server = None

    async def _accept(self, server: socket.socket) -> None:
        """Accept connections: one from an address past its refusals is closed at once (no TLS handshake, no word:
        the throttle's audit entry was written when it began); the others shake hands (``_secure``)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, address = await loop.sock_accept(server)
            except OSError as exc:  # out of file descriptors and the like: said, and the moment let pass
                log.warning("agent tunnel listener cannot accept", extra={"error": exc.strerror or str(exc)})
                await asyncio.sleep(0.1)
                continue
            if self.service.throttled(str(address[0])):
                conn.close()
                continue
            conn.setblocking(False)
            self.tasks.spawn(self._secure(conn))

    async def _secure(self, conn: socket.socket) -> None:
        """The TLS handshake (bounded), then the first record's wait (``_Opening``); a failed or late handshake
        closes the connection without a word (nothing can be said before TLS)."""
        try:
            await asyncio.get_running_loop().connect_accepted_socket(
                lambda: _Opening(self), conn, ssl=self.context, ssl_handshake_timeout=START_TIMEOUT)
        except (OSError, ssl.SSLError, TimeoutError):
            conn.close()

    def opened(self, opening: _Opening, start: pb.TunnelStart | None, refused: str, rest: bytes) -> None:
        """The first record came (``start``, and the bytes after it), or the connection is refused (``refused``)."""
        self.tasks.spawn(self._serve(opening, start, refused, rest))

    async def _serve(self, opening: _Opening, start: pb.TunnelStart | None, refused: str, rest: bytes) -> None:
        transport, client_ip = opening.transport, opening.client_ip
        assert transport is not None
        try:
            if start is None:
                if refused:
                    await self.service.refusal(client_ip, refused, "agent.stream_refused")
                    _say(transport, refused)
                return
            admitted = await self.service.admit(client_ip, start.token, _frame(start.first))
            if admitted is None:
                _say(transport, STREAM_REFUSED)
                return
            splice = Splice()
            splice.adopt(transport, rest)
            pending, first = admitted
            await self.service.carry(pending, first, splice)
        except Exception:  # a stream's failure is its own: the listener serves the others
            log.exception("agent tunnel failed", extra={"client": client_ip})
        finally:
            self.connections.discard(transport)
            transport.close()


class _Opening(asyncio.Protocol):
    """A tunnel connection until its first record: its bytes gathered, bounded in size and time; then the
    listener's (which hands the transport to a Splice)."""

    def __init__(self, listener: TunnelListener) -> None:
        self.listener = listener
        self.transport: asyncio.Transport | None = None
        self.client_ip = ""
        self.buffer = bytearray()
        self.timer: asyncio.TimerHandle | None = None
        self.over = False  # the first record was handed on, or the connection refused

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.listener.connections.add(self.transport)  # type: ignore[arg-type]
        keep_alive(transport)
        peer = transport.get_extra_info("peername")
        self.client_ip = str(peer[0]) if peer else ""
        throttled = self.listener.service.throttled(self.client_ip)
        if throttled:  # throttled during its handshake: said over TLS; no token lookup, no audit entry each
            self.over = True
            _say(self.transport, throttled)  # type: ignore[arg-type]
            self.transport.close()  # type: ignore[union-attr]
            return
        self.timer = asyncio.get_running_loop().call_later(
            START_TIMEOUT, self._refuse, f"the tunnel's first record did not come within {START_TIMEOUT:g} s")

    def data_received(self, data: bytes) -> None:
        if self.over:
            return
        self.buffer += data
        if len(self.buffer) < HEADER.size:
            return
        (length,) = HEADER.unpack_from(self.buffer)
        if length > START_LIMIT:
            self._refuse(f"the tunnel's first record is too long ({length} bytes, past the bound of {START_LIMIT})")
            return
        if len(self.buffer) < HEADER.size + length:
            return
        try:
            start = pb.TunnelStart.FromString(bytes(self.buffer[HEADER.size:HEADER.size + length]))
        except DecodeError:
            self._refuse("the tunnel's first record does not parse")
            return
        self._hand_on(start, "", bytes(self.buffer[HEADER.size + length:]))

    def eof_received(self) -> bool:
        if not self.over:
            self._refuse("the tunnel connection ended before its first record")
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.listener.connections.discard(self.transport)  # type: ignore[arg-type]
        if not self.over and self.transport is not None:  # gone before its first record: said as such
            self._refuse("the tunnel connection ended before its first record")

    def _refuse(self, reason: str) -> None:
        if not self.over:
            self._hand_on(None, reason, b"")

    def _hand_on(self, start: pb.TunnelStart | None, refused: str, rest: bytes) -> None:
        self.over = True
        if self.timer is not None:
            self.timer.cancel()
        assert self.transport is not None
        if not self.transport.is_closing():
            self.transport.pause_reading()
        self.buffer.clear()
        self.listener.opened(self, start, refused, rest)


def _frame(frame: pb.Frame) -> Any:
    async def first_frame() -> pb.Frame:  # already read: the record held it with the token
        return frame

    return first_frame


def _say(transport: asyncio.Transport, reason: str) -> None:
    """The refusal's reason to the peer, as an error frame (the transport's close sends it, then ends)."""
    if not transport.is_closing():
        transport.write(record(pb.Frame(error=reason)))
