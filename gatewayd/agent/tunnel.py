"""The tunnel listener: each stream of an agent on a TLS connection of its own, beside the gRPC port.

The gRPC ``Tunnel`` call costs grpc.aio's per-message work on both ends (docs/agents.md); a stream's
bytes go faster over a TLS connection of their own, which the agent opens to the port its ``Open``
names (``tunnel_port``) with the certificate it trusts for gRPC.  Its first record is a
``TunnelStart`` (the agent's token and the frame a ``Tunnel`` would start with), bounded in size
and in time, and checked by ``AgentService.admit`` as a Tunnel's first frame is; every record
after it is a ``Frame``, carried by the same pump.  TCP's flow control is each connection's own, so
a slow stream holds back only itself.  A refusal is said in one error frame, then the connection
closes.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from pathlib import Path
from typing import TYPE_CHECKING, Any

from google.protobuf.message import DecodeError

from gatewayd.agent import agent_pb2 as pb
from gatewayd.agent.pump import Records, StreamBroken
from gatewayd.agent.registry import STREAM_REFUSED

if TYPE_CHECKING:
    from gatewayd.agent.server import AgentService

log = logging.getLogger("gatewayd.grpc")

START_LIMIT = 4096  # the first record's bound: a token, a stream id and a dial's error fit many times over
START_TIMEOUT = 5.0  # the TLS handshake, then the first record, each within this (the agent sends it at once)


class TunnelListener:
    """The started listener; ``stop`` closes it and the connections it serves."""

    def __init__(self, service: AgentService) -> None:
        self.service = service
        self.server: asyncio.Server | None = None
        self.port = 0
        self.connections: set[asyncio.StreamWriter] = set()

    async def start(self, host: str, port: int, cert_path: Path, key_path: Path) -> int:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(cert_path, key_path)
        # no SO_REUSEPORT: a stream must reach the process whose dial waits for it
        self.server = await asyncio.start_server(self._serve, host or None, port, ssl=context,
                                                 ssl_handshake_timeout=START_TIMEOUT, limit=256 * 1024)
        self.port = self.server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            for writer in list(self.connections):
                writer.close()
            await self.server.wait_closed()
            self.server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        client_ip = str(peer[0]) if peer else ""
        self.connections.add(writer)
        records = Records(reader, writer)
        try:
            throttled = self.service.throttled(client_ip)
            if throttled:  # no token lookup, no audit entry each: one was written when the throttle began
                await _say(records, throttled)
                return
            start, refused = await self._start(records)
            if start is None:
                await self._refuse(records, client_ip, refused)
                return
            admitted = await self.service.admit(client_ip, start.token, _frame(start.first))
            if admitted is None:
                await _say(records, STREAM_REFUSED)
                return
            await self.service.carry(*admitted, records.read, records.write, connection=writer)
        except Exception:  # a stream's failure is its own: the listener serves the others
            log.exception("agent tunnel failed", extra={"client": client_ip})
        finally:
            self.connections.discard(writer)
            writer.close()

    @staticmethod
    async def _start(records: Records) -> tuple[Any, str]:
        """The first record as a TunnelStart, or None and why it is refused."""
        try:
            async with asyncio.timeout(START_TIMEOUT):
                data = await records.record(START_LIMIT)
        except TimeoutError:
            return None, f"the tunnel's first record did not come within {START_TIMEOUT:g} s"
        except StreamBroken as exc:
            return None, f"the tunnel's first record is too long ({exc})"
        if data is None:
            return None, "the tunnel connection ended before its first record"
        try:
            start = pb.TunnelStart.FromString(data)
        except DecodeError:
            return None, "the tunnel's first record does not parse"
        return start, ""

    async def _refuse(self, records: Records, client_ip: str, reason: str) -> None:
        await self.service.refusal(client_ip, reason, "agent.stream_refused")
        await _say(records, reason)


def _frame(frame: pb.Frame) -> Any:
    async def first_frame() -> pb.Frame:  # already read: the record held it with the token
        return frame

    return first_frame


async def _say(records: Records, reason: str) -> None:
    """The refusal's reason to the peer, as an error frame, when it still listens."""
    try:
        async with asyncio.timeout(START_TIMEOUT):
            await records.write(pb.Frame(error=reason))
    except (OSError, TimeoutError):
        pass

