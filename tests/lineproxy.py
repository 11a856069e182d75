"""A minimal line-protocol proxy for daemon tests: it uses the core exactly as a real proxy must.

First line: the credential secret. Then each line is recorded as ``i``,
checked by the input guard rails (a block follows as ``e``), and answered with ``echo: <line>`` (recorded
as ``o``, checked by the output rules). The gateway can end the session
(kill, expiry, shutdown): the client then reads ``closed: <reason>``.
"""

from __future__ import annotations

import asyncio

from gatewayd.access import AccessDenied
from gatewayd.daemon import Gateway


class LineListener:
    def __init__(self, server: asyncio.base_events.Server) -> None:
        self.server = server

    async def close(self) -> None:
        # Stop accepting only.  No ``wait_closed()``: since Python 3.12 it waits for every connection
        # accepted by this server to end, so a listener restart with sessions open would never return.
        self.server.close()


async def start(gateway: Gateway, host: str, port: int) -> LineListener:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")[0]
        try:
            secret = (await reader.readline()).decode().strip()
            try:
                grant = await gateway.access.resolve(secret, "ssh", client_ip=peer)
            except AccessDenied as exc:
                writer.write(f"denied: {exc}\n".encode())
                return
            live = await gateway.sessions.open(grant.user, grant.connection, credential=grant.credential,
                                               client_ip=peer)

            def kill(reason: str) -> None:
                writer.write(f"closed: {reason}\n".encode())
                writer.close()

            live.on_kill(kill)
            rules = await gateway.guardrails.rules_for(grant.connection.org_id, grant.connection.id)
            writer.write(f"session {live.id}\n".encode())
            async def refused(verdict) -> bool:  # type: ignore[no-untyped-def]
                if verdict.allowed:
                    return False
                await live.blocked(verdict, peer)
                writer.write(f"blocked: {verdict.message}\n".encode())
                return True

            while line := await reader.readline():
                text = line.decode().rstrip("\n")
                live.recorder.input(line)  # blocked or not: what was sent is on the record
                if await refused(rules.check_input(text)):
                    continue
                answer = f"echo: {text}\n"
                if await refused(rules.check_output(answer)):
                    continue
                live.recorder.output(answer)
                writer.write(answer.encode())
                await writer.drain()
                await live.recorder.drain()
            await live.close(exit_code=0)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            if "live" in locals():
                await live.close(exit_code=0)
            writer.close()

    return LineListener(await asyncio.start_server(handle, host, port))
