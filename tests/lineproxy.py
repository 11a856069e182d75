"""A minimal line-protocol proxy: the reference of how a proxy uses the core (the session pipeline).

First line: the credential secret.  When the connection's target names a
``PORT``, the proxy dials ``HOST:PORT`` through the pipeline (an unreachable
target is ``unreachable: <reason>``); each later line is the user's input and
goes through the session's policy chain (recorded as ``i``, checked by the
input rules: a block is answered ``blocked: <why>``).  The answer -- the
target's line, or ``echo: <line>`` without a target -- is the output (checked
by the output rules, recorded as ``o``).  The gateway can end the session
(kill, expiry, shutdown): the client then reads ``closed: <reason>``.
"""

from __future__ import annotations

import asyncio

from gatewayd.dialer import Dialer
from gatewayd.pipeline import AccessDenied, GatewayClosing, ProxyContext, TargetUnreachable

Target = tuple[asyncio.StreamReader, asyncio.StreamWriter] | None


class LineListener:
    def __init__(self, server: asyncio.base_events.Server) -> None:
        self.server = server

    async def close(self) -> None:
        # Stop accepting only.  No ``wait_closed()``: since Python 3.12 it waits for every connection
        # accepted by this server to end, so a listener restart with sessions open would never return.
        self.server.close()


async def start(context: ProxyContext, host: str, port: int, *, subtype: str = "ssh") -> LineListener:
    """Serve ``subtype`` connections (tests/test_protocols.py: a protocol of its own) with the pipeline of ``context``."""
    pipeline = context.pipeline

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")[0]

        def say(line: str) -> None:
            if not writer.is_closing():
                writer.write(f"{line}\n".encode())

        try:
            secret = (await reader.readline()).decode().strip()
            try:
                grant = await pipeline.admit(secret, subtype, peer)
            except AccessDenied as exc:
                return say(f"denied: {exc}")
            address = grant.connection.target()

            async def dial(dialer: Dialer) -> Target:
                if not address.get("PORT"):
                    return None
                return await dialer.open_stream(address.get("HOST") or "127.0.0.1", int(address["PORT"]),
                                                connection=grant.connection.name)

            def kill(reason: str) -> None:
                say(f"closed: {reason}")
                writer.close()

            try:
                run = await pipeline.start(grant, peer, dial=dial, drop=lambda t: t and t[1].close(), on_kill=kill)
            except TargetUnreachable as exc:
                return say(f"unreachable: {exc.message}")
            except GatewayClosing as exc:
                return say(f"closed: {exc}")
            async with run:
                say(f"session {run.id}")
                policy, target = run.policy, run.target
                while line := await reader.readline():
                    text = line.decode().rstrip("\n")
                    if verdict := policy.input(line, text):  # blocked or not: what was sent is on the record
                        await policy.blocked(verdict)
                        say(f"blocked: {verdict.message}")
                        continue
                    if target is None:
                        answer = f"echo: {text}\n"
                    else:
                        target[1].write(line)
                        answer = (await target[0].readline()).decode()
                    if verdict := policy.output(answer):
                        await policy.blocked(verdict)
                        say(f"blocked: {verdict.message}")
                        continue
                    writer.write(answer.encode())
                    await writer.drain()
                    await policy.drain()
                await run.close(exit_code=0)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            if "run" in locals():
                await run.close(exit_code=0)
                if run.target is not None:
                    run.target[1].close()
            writer.close()

    return LineListener(await asyncio.start_server(handle, host, port))
