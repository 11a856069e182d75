"""The floor of any asyncio proxy: a byte forwarder on uvloop that looks at nothing (bench reference only).

    python bench/postgres/forwarder.py LISTEN_PORT TARGET_PORT [--tls-in CERT KEY] [--tls-out]

``--tls-in``: its listener speaks TLS with that certificate; ``--tls-out``: it dials its target over TLS
(no verification: a bench reference). Two of them chained with TLS between them are the floor of a
raw TLS tunnel between a gateway and an agent (``bench_agent.py --floor``).
"""

from __future__ import annotations

import asyncio
import ssl
import sys

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None


class Side(asyncio.Protocol):
    """One socket; what it receives goes to its peer as is."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: Side | None = None
        self.early = bytearray()  # bytes received before the peer connected

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.peer is None or self.peer.transport is None:
            self.early += data
        else:
            self.peer.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()


async def main(listen_port: int, target_port: int, server_tls: ssl.SSLContext | None = None,
               client_tls: ssl.SSLContext | None = None) -> None:
    loop = asyncio.get_running_loop()

    class Client(Side):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            loop.create_task(self.connect())

        async def connect(self) -> None:
            target = Side()
            target.peer = self
            await loop.create_connection(lambda: target, "127.0.0.1", target_port, ssl=client_tls)
            self.peer = target
            if self.early:
                target.transport.write(bytes(self.early))  # type: ignore[union-attr]

    server = await loop.create_server(Client, "127.0.0.1", listen_port, ssl=server_tls)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    args = sys.argv[1:]
    server_tls = client_tls = None
    if "--tls-in" in args:
        at = args.index("--tls-in")
        server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server_tls.load_cert_chain(args[at + 1], args[at + 2])
    if "--tls-out" in args:
        client_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        client_tls.check_hostname = False
        client_tls.verify_mode = ssl.CERT_NONE
    runner = uvloop.run if uvloop is not None else asyncio.run
    runner(main(int(args[0]), int(args[1]), server_tls, client_tls))
