"""``gatewayd agent``: the process inside a private network that carries the gateway's connections.

It connects out to the gateway's gRPC server, says hello, and serves each ``Open`` the gateway
sends: it dials the named target inside its own network and relays the bytes over a TLS connection
of their own to the node's tunnel listener (the port the ``Open`` names), or over a ``Tunnel`` call
when it names none (flow control per stream either way).  It never opens a stream by itself.  A lost
connection (network cut, gateway restart) is retried with exponential backoff and jitter; a
refused token ends the process (exit code 3).  The gateway's ``Welcome`` names its other nodes:
the agent keeps one connection to each, over TLS as its own URL is (a plain ``grpc://`` one is not
followed: it would carry the token and the streams in clear).  A peer's connection fails as the first one's does:
logged and retried with backoff, a certificate that is not the pinned one included (only the first URL's ends the
process, as a setting that cannot work); a refused token ends the process whichever node refused it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
from dataclasses import dataclass, field

import grpc

from gatewayd import __version__
from gatewayd.agent import agent_pb2 as pb
from gatewayd.agent import agent_pb2_grpc as pb_grpc
from gatewayd.agent.carriers import Carriers, carry_on_tunnel, open_tunnel
from gatewayd.agent.channel import ChannelError, Target, TunnelDialer, open_channel
from gatewayd.agent.pump import StreamBroken, pump
from gatewayd.dialer import DialError, direct

log = logging.getLogger("gatewayd.agent")

BACKOFF_FIRST = 0.5
BACKOFF_MAX = 30.0
REFUSED_EXIT = 3


class TokenRefused(Exception):
    """The gateway does not accept this agent's token (deleted, rotated, never issued)."""


@dataclass(slots=True)
class AgentProcess:
    """One agent: its token, and one connection per gateway node (the first URL, then the peers)."""

    url: str
    token: str
    fingerprint: str = ""
    ca_file: str = ""
    keepalive: float = 10.0  # seconds between pings: a cut link is found within about twice that
    hostname: str = field(default_factory=socket.gethostname)
    connections: dict[str, asyncio.Task[None]] = field(default_factory=dict)  # by URL
    streams: set[asyncio.Task[None]] = field(default_factory=set)
    welcomed: asyncio.Event = field(default_factory=asyncio.Event)  # set at the first Welcome (tests, logs)
    workers: int = 1  # processes that carry the streams' bytes (1: this one; more: carriers, gatewayd.agent.carriers)
    log_format: str = "plain"  # the carriers' logging, as this process's
    log_level: str = "info"
    carriers: Carriers | None = None
    nodes: dict[str, tuple[pb_grpc.AgentGatewayStub, TunnelDialer | None]] = field(default_factory=dict)  # by URL
    declined: set[str] = field(default_factory=set)  # peers' URLs not followed (said once each)
    added: asyncio.Event = field(default_factory=asyncio.Event)  # a connection was added: ``run`` waits on it too

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),)

    async def run(self) -> int:
        """Until the token is refused (REFUSED_EXIT) or the process is stopped."""
        if self.workers > 1:
            self.carriers = Carriers(self.workers, self.token, self.fingerprint, self.ca_file, self._handed_back,
                                     self.log_format, self.log_level)
            await self.carriers.start()
        self.connect(self.url)
        try:
            while True:
                # the connections of the peers a Welcome names are added while this waits: it waits on ``added`` too,
                # so a peer's that ends (a refused token) is seen, not left to end unseen beside the first
                self.added.clear()
                added = asyncio.ensure_future(self.added.wait())
                try:
                    done, _ = await asyncio.wait({*self.connections.values(), added},
                                                 return_when=asyncio.FIRST_COMPLETED)
                finally:
                    added.cancel()
                for url, task in [(u, t) for u, t in self.connections.items() if t in done]:
                    del self.connections[url]
                    if isinstance(task.exception(), TokenRefused):
                        log.error("the gateway refused this agent's token",
                                  extra={"url": url, "reason": str(task.exception())})
                        return REFUSED_EXIT
                    if isinstance(task.exception(), ChannelError):
                        log.error("cannot reach the gateway", extra={"url": url, "reason": str(task.exception())})
                        return 2
                    if task.exception() is not None:  # a fault of this process: said, not swallowed
                        log.error("a gateway connection ended", extra={"url": url,
                                                                      "reason": type(task.exception()).__name__})
                if not self.connections:
                    return 0
        finally:
            for task in [*self.connections.values(), *self.streams]:
                task.cancel()
            await asyncio.gather(*self.connections.values(), *self.streams, return_exceptions=True)
            if self.carriers is not None:
                await self.carriers.stop()

    def _handed_back(self, url: str, request: pb.Open, sock: socket.socket) -> None:
        """A stream a carrier could not take to the tunnel port: over a Tunnel call of that node's channel, and the
        port not tried again for a while (said by the carrier)."""
        stub, tunnels = self.nodes.get(url, (None, None))
        if stub is None:  # the node's channel ended meanwhile: the gateway's dial fails with it
            sock.close()
            return
        if tunnels is not None:
            tunnels.unreachable()
        task = asyncio.ensure_future(self.carry_on_call(stub, request, sock))
        self.streams.add(task)
        task.add_done_callback(self.streams.discard)

    def connect(self, url: str) -> None:
        """Keep a connection to the node at ``url`` (``keep_connected``), seen by ``run``."""
        self.connections[url] = asyncio.ensure_future(self.keep_connected(url))
        self.added.set()

    async def keep_connected(self, url: str) -> None:
        """One gateway node's connection, made again after each loss, with backoff; a peer's whose certificate is not
        the pinned one (or whose URL or CA cannot work) too, said each time: only the first URL's ends the process."""
        delay = BACKOFF_FIRST
        while True:
            welcomed = False
            try:
                welcomed = await self.session(url)
            except grpc.aio.AioRpcError as exc:
                if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    raise TokenRefused(exc.details() or exc.code().name) from None
                log.warning("gateway connection lost", extra={"url": url, "reason": exc.details() or exc.code().name})
            except (OSError, TimeoutError) as exc:
                log.warning("gateway unreachable", extra={"url": url, "reason": str(exc) or type(exc).__name__})
            except ChannelError as exc:
                if url == self.url:
                    raise
                log.warning("gateway unreachable", extra={"url": url, "reason": str(exc)})
            if welcomed:
                delay = BACKOFF_FIRST
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, BACKOFF_MAX)

    async def session(self, url: str) -> bool:
        """Connect, hello, then serve Opens until the channel ends; whether the gateway welcomed us."""
        channel = await open_channel(url, self.fingerprint, self.ca_file, self.keepalive)
        tunnels = TunnelDialer.of(url, self.fingerprint, self.ca_file)
        welcomed = False
        try:
            stub = pb_grpc.AgentGatewayStub(channel)
            self.nodes[url] = (stub, tunnels)
            call = stub.Connect(metadata=self.metadata)
            await call.write(pb.AgentMessage(hello=pb.Hello(version=__version__, hostname=self.hostname, url=url)))
            async for message in call:
                kind = message.WhichOneof("kind")
                if kind == "welcome":
                    if not welcomed:
                        log.info("connected to the gateway", extra={"url": url, "agent": message.welcome.agent_name})
                    welcomed = True
                    self.welcomed.set()
                    for peer in message.welcome.peers:
                        if peer and peer not in self.connections and self._follows(peer):
                            self.connect(peer)
                elif kind == "open":
                    task = asyncio.ensure_future(self.serve(stub, message.open, tunnels, url))
                    self.streams.add(task)
                    task.add_done_callback(self.streams.discard)
            return welcomed
        finally:
            self.nodes.pop(url, None)
            await channel.close(grace=None)

    def _follows(self, peer: str) -> bool:
        """Whether a node a Welcome names is connected to: only by a URL that parses, and over TLS when this agent's
        own URL is (the token goes in every call's metadata). One that is not is logged once and left alone."""
        try:
            usable = Target.parse(peer).tls or not Target.parse(self.url).tls
        except ChannelError:
            usable = False
        if not usable and peer not in self.declined:
            self.declined.add(peer)
            log.warning("a gateway node's URL is not followed: not grpcs:// (the token would go in clear) or "
                        "not a URL", extra={"url": peer})
        return usable

    async def serve(self, stub: pb_grpc.AgentGatewayStub, request: pb.Open,
                    tunnels: TunnelDialer | None = None, url: str = "") -> None:
        """Dial the target the gateway names, then relay its bytes on a tunnel connection of their own to the port
        the Open names (``tunnels``: how the node at ``url`` is reached; by a carrier process when there are some),
        else on a Tunnel call."""
        timeout = request.timeout or 10.0
        tunnel = bool(request.tunnel_port and tunnels is not None and tunnels.usable())
        try:
            sock = await direct.open_socket(request.host, request.port, connection=request.connection,
                                            timeout=timeout)
        except DialError as exc:  # the system's words, never the address
            log.info("target unreachable", extra={"connection": request.connection, "reason": exc.reason})
            answer = pb.Frame(stream_id=request.stream_id, error=exc.reason)
            if not (tunnel and await self._answer(tunnels, request, answer)):  # type: ignore[arg-type]
                await self._answer_on_call(stub, answer, timeout)
            return
        if tunnel and self.carriers is not None and self.carriers.hand(url, request, sock):
            return  # a carrier process carries it (or hands it back: ``carry_on_call``)
        if tunnel and await carry_on_tunnel(tunnels, self.token, request, sock):  # type: ignore[arg-type]
            return
        await self.carry_on_call(stub, request, sock)

    async def carry_on_call(self, stub: pb_grpc.AgentGatewayStub, request: pb.Open, sock: socket.socket) -> None:
        """The stream over a Tunnel call (no tunnel port, or it cannot be reached)."""
        try:
            reader, writer = await asyncio.open_connection(sock=sock, limit=256 * 1024)
        except BaseException:
            sock.close()
            raise
        try:
            await self._relay_on_call(stub, request, reader, writer)
        finally:
            writer.close()

    async def _answer(self, tunnels: TunnelDialer, request: pb.Open, answer: pb.Frame) -> bool:
        """A failed dial's answer on a tunnel connection; whether it was sent (the close sends it, then ends)."""
        transport = await open_tunnel(tunnels, self.token, request, asyncio.Protocol(), answer)
        if transport is None:
            return False
        transport.close()
        return True

    async def _answer_on_call(self, stub: pb_grpc.AgentGatewayStub, answer: pb.Frame, timeout: float) -> None:
        call = stub.Tunnel(metadata=self.metadata)
        try:
            await call.write(answer)
            await call.done_writing()
            # the gateway ends the call once it has read the answer: a cancel sent before that races the
            # answer, and a gateway slow to read it would lose it (its client then waits out the dial)
            with contextlib.suppress(TimeoutError):  # past that, the finally below lets go of it
                async with asyncio.timeout(timeout):
                    await call.code()
        except grpc.aio.AioRpcError as exc:
            log.info("stream refused", extra={"reason": exc.details()})
        finally:
            if not call.done():
                call.cancel()

    async def _relay_on_call(self, stub: pb_grpc.AgentGatewayStub, request: pb.Open, reader: asyncio.StreamReader,
                             writer: asyncio.StreamWriter) -> None:
        call = stub.Tunnel(metadata=self.metadata)
        try:
            await call.write(pb.Frame(stream_id=request.stream_id, connected=True))
            await pump(reader, writer, call.read, call.write)  # a target's reset ends this stream only
            await call.done_writing()
            await call.code()  # the gateway ends the call; cancelling it would look like a lost link
        except (StreamBroken, grpc.aio.AioRpcError, grpc.aio.UsageError) as exc:
            log.info("stream ended by the gateway", extra={"connection": request.connection,
                                                           "reason": type(exc).__name__})
        finally:
            if not call.done():  # only on a failure of our own: the gateway takes it for a broken link
                call.cancel()

