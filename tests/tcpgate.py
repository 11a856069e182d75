"""A TCP forwarder a test can freeze: a network link between a gateway and its store that stops carrying bytes.

``TcpGate(target_port).start()`` listens on a free port of 127.0.0.1 and forwards every connection to the target.
``freeze()`` stops carrying bytes both ways and leaves every socket open (a cut link, as a dead switch or a
firewall dropping packets makes it: no RST, no FIN, the peers wait); new connections are accepted and wait too.
``thaw()`` carries on, nothing lost. It runs its own event loop in a thread, so that sync and async tests can
both drive it.
"""

from __future__ import annotations

import asyncio
import threading

from tests.ports import free_port


class TcpGate:
    """127.0.0.1:``port`` -> 127.0.0.1:``target``, freezable."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self._open: asyncio.Event | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, name="tcpgate", daemon=True)
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    def start(self) -> "TcpGate":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self.loop).result(10)
        return self

    async def _listen(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", self.port)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}
        await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer), return_exceptions=True)
        self._writers -= {writer, up_writer}

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self._open is not None
        try:
            while True:
                await self._open.wait()
                data = await reader.read(65536)
                await self._open.wait()  # read while frozen: held here, not delivered
                if not data:
                    break
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    def freeze(self) -> None:
        """No byte passes either way from now on; sockets stay open."""
        self.loop.call_soon_threadsafe(self._open.clear)  # type: ignore[union-attr]

    def thaw(self) -> None:
        self.loop.call_soon_threadsafe(self._open.set)  # type: ignore[union-attr]

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for writer in list(self._writers):
                writer.close()
            self._open.set()  # type: ignore[union-attr]

        asyncio.run_coroutine_threadsafe(close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
