"""The tunnel listener: each stream of an agent on a TLS connection of its own, beside the gRPC port.

The gRPC ``Tunnel`` call costs grpc.aio's per-message work on both ends (docs/agents.md); a stream's
bytes go faster over a TLS connection of their own, which the agent opens to the port its ``Open``
names (``tunnel_port``) with the certificate it trusts for gRPC.  Its first record is a
``TunnelStart`` (the agent's token and the frame a ``Tunnel`` would start with), bounded in size
(``START_LIMIT``) and in time (``START_TIMEOUT``, the TLS handshake's too), and checked by
``AgentService.admit`` as a Tunnel's first frame is; every record after it is a ``Frame``, carried by
``pump.Splice``.  TCP's flow control is each connection's own, so a slow stream holds back only
itself.  A refusal is said in one error frame, then the connection closes.  The handshake and the
first record are read in the transport's callbacks: nothing waits on a client that says nothing.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from pathlib import Path
from typing import Any, Awaitable, Callable, Protocol

from google.protobuf.message import DecodeError

from gatewayd.agent import agent_pb2 as pb
from gatewayd.agent.pump import HEADER, Splice, keep_alive, record
from gatewayd.agent.registry import STREAM_REFUSED

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
        self.server: asyncio.Server | None = None
        self.port = 0
        self.connections: set[asyncio.Transport] = set()
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int, cert_path: Path, key_path: Path) -> int:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(cert_path, key_path)
        # no SO_REUSEPORT: a stream must reach the process whose dial waits for it
        self.server = await asyncio.get_running_loop().create_server(
            lambda: _Opening(self), host or None, port, ssl=context, ssl_handshake_timeout=START_TIMEOUT)
        self.port = self.server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            for transport in list(self.connections):
                transport.close()
            for task in list(self.tasks):
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            self.server = None

    def opened(self, opening: _Opening, start: pb.TunnelStart | None, refused: str, rest: bytes) -> None:
        """The first record came (``start``, and the bytes after it), or the connection is refused (``refused``)."""
        task = asyncio.ensure_future(self._serve(opening, start, refused, rest))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

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
        if throttled:  # no token lookup, no audit entry each: one was written when the throttle began
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
