"""``gatewayd proxy-manager``: on a user's machine, opens the local ports the gateway asks for.

It holds a ``Manage`` channel to the gateway with the user's own bearer token; for each
``Listen`` it opens ``bind:port`` (127.0.0.1 by default) and forwards every local client over a
``Forward`` call; ``Unlisten`` closes the port.  A lost channel closes every port (the gateway
forgets them too) and is retried with backoff; a refused token ends the process (exit 3).
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
from dataclasses import dataclass, field

import grpc

from gatewayd import __version__
from gatewayd.agent import agent_pb2 as pb
from gatewayd.agent import agent_pb2_grpc as pb_grpc
from gatewayd.agent.channel import ChannelError, open_channel
from gatewayd.agent.pump import StreamBroken, pump
from gatewayd.agent.runner import BACKOFF_FIRST, BACKOFF_MAX, REFUSED_EXIT

log = logging.getLogger("gatewayd.proxy-manager")


@dataclass(slots=True)
class ProxyManagerProcess:
    url: str
    token: str
    fingerprint: str = ""
    ca_file: str = ""
    servers: dict[str, asyncio.Server] = field(default_factory=dict)  # by listen id

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),)

    async def run(self) -> int:
        delay = BACKOFF_FIRST
        while True:
            try:
                await self.session()
                delay = BACKOFF_FIRST
            except grpc.aio.AioRpcError as exc:
                if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    log.error("the gateway refused this token", extra={"reason": exc.details()})
                    return REFUSED_EXIT
                log.warning("gateway connection lost", extra={"reason": exc.details() or exc.code().name})
            except ChannelError as exc:
                log.error("cannot reach the gateway", extra={"reason": str(exc)})
                return 2
            except (OSError, TimeoutError) as exc:
                log.warning("gateway unreachable", extra={"reason": str(exc) or type(exc).__name__})
            finally:
                for server in self.servers.values():
                    server.close()
                self.servers.clear()
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, BACKOFF_MAX)

    async def session(self) -> None:
        channel = await open_channel(self.url, self.fingerprint, self.ca_file)
        try:
            stub = pb_grpc.AgentGatewayStub(channel)
            call = stub.Manage(metadata=self.metadata)
            await call.write(pb.ManagerMessage(hello=pb.ManagerHello(version=__version__,
                                                                     hostname=socket.gethostname())))
            log.info("connected to the gateway", extra={"url": self.url})
            async for command in call:
                if command.HasField("listen"):
                    await call.write(pb.ManagerMessage(result=await self.listen(stub, command.listen)))
                elif command.HasField("unlisten"):
                    server = self.servers.pop(command.unlisten.listen_id, None)
                    if server is not None:
                        server.close()
                        log.info("port closed", extra={"listen_id": command.unlisten.listen_id})
        finally:
            await channel.close(grace=None)

    async def listen(self, stub: pb_grpc.AgentGatewayStub, request: pb.Listen) -> pb.ListenResult:
        async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            call = stub.Forward(metadata=self.metadata)
            try:
                await call.write(pb.Frame(stream_id=request.listen_id))
                await pump(reader, writer, call.read, call.write)
                await call.done_writing()
                await call.code()
            except grpc.aio.AioRpcError as exc:  # the gateway's word (its credential expired, revoked) said to the user
                log.info("forwarding ended", extra={"connection": request.connection_name,
                                                    "reason": exc.details() or exc.code().name})
            except (StreamBroken, grpc.aio.UsageError) as exc:
                log.info("forwarding ended", extra={"connection": request.connection_name,
                                                    "reason": type(exc).__name__})
            finally:
                writer.close()
                if not call.done():
                    call.cancel()

        try:
            server = await asyncio.start_server(client, request.bind or "127.0.0.1", request.port,
                                                reuse_address=True)
        except OSError as exc:
            return pb.ListenResult(listen_id=request.listen_id, ok=False, error=exc.strerror or str(exc))
        self.servers[request.listen_id] = server
        log.info("port open", extra={"connection": request.connection_name, "port": request.port})
        return pb.ListenResult(listen_id=request.listen_id, ok=True)
