"""The floor of any asyncio proxy: a byte forwarder on uvloop that looks at nothing (bench reference only).

    python bench/postgres/forwarder.py LISTEN_PORT TARGET_PORT
"""

from __future__ import annotations

import asyncio
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


async def main(listen_port: int, target_port: int) -> None:
    loop = asyncio.get_running_loop()

    class Client(Side):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            loop.create_task(self.connect())

        async def connect(self) -> None:
            target = Side()
            target.peer = self
            await loop.create_connection(lambda: target, "127.0.0.1", target_port)
            self.peer = target
            if self.early:
                target.transport.write(bytes(self.early))  # type: ignore[union-attr]

    server = await loop.create_server(Client, "127.0.0.1", listen_port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    runner = uvloop.run if uvloop is not None else asyncio.run
    runner(main(int(sys.argv[1]), int(sys.argv[2])))
