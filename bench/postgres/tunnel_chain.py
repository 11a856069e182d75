"""The prototype of the agents' tunnel transport, kept to measure it (bench reference only).

gatewayd now carries each stream this way (gatewayd/agent/tunnel.py, ``pump.Splice`` on asyncio
protocols); this prototype keeps the stream pump it was first measured with, the "framed chain" of
``bench_agent.py --floor`` (bench/README.md, "the tunnel listener").

Two processes carry a stream's bytes as ``agent.proto`` Frames, each prefixed by its length (4 bytes,
big-endian), over one TLS connection per stream, with ``gatewayd.agent.pump``'s stream pump: ``front``
stands in the gateway's place (it accepts pgbench, then opens a TLS connection to ``back`` and says
the stream's first Frame), ``back`` in the agent's (it dials the target and answers ``connected``).
No gateway work, no tokens, no refusals: only the data path, for ``bench_agent.py --floor``.

    python bench/postgres/tunnel_chain.py back LISTEN_PORT TARGET_PORT CERT KEY
    python bench/postgres/tunnel_chain.py front LISTEN_PORT BACK_PORT
"""

from __future__ import annotations

import asyncio
import ssl
import struct
import sys
from pathlib import Path
from typing import Any, Awaitable, Callable

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from gatewayd.agent import agent_pb2 as pb  # noqa: E402
from gatewayd.agent.pump import pump  # noqa: E402


def framed(reader: asyncio.StreamReader,
           writer: asyncio.StreamWriter) -> tuple[Callable[[], Awaitable[Any]], Callable[[pb.Frame], Awaitable[None]]]:
    """The pump's ``read`` and ``write`` over a length-prefixed TLS stream (``grpc.aio.EOF`` at its end)."""
    async def read() -> Any:
        try:
            (length,) = struct.unpack(">I", await reader.readexactly(4))
            return pb.Frame.FromString(await reader.readexactly(length))
        except (asyncio.IncompleteReadError, ConnectionError):
            return grpc.aio.EOF

    async def write(frame: pb.Frame) -> None:
        body = frame.SerializeToString()
        writer.write(struct.pack(">I", len(body)) + body)
        await writer.drain()

    return read, write


async def carry(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, tunnel: asyncio.StreamWriter,
                read: Callable[[], Awaitable[Any]], write: Callable[[pb.Frame], Awaitable[None]]) -> None:
    try:
        await pump(reader, writer, read, write)
    except Exception:  # a bench reference: a broken stream just ends
        pass
    finally:
        writer.close()
        tunnel.close()


async def main(role: str, listen: int, target: int, cert: str = "", key: str = "") -> None:
    if role == "back":
        server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server_tls.load_cert_chain(cert, key)

        async def serve_back(tunnel_reader: asyncio.StreamReader, tunnel: asyncio.StreamWriter) -> None:
            read, write = framed(tunnel_reader, tunnel)
            first = await read()
            reader, writer = await asyncio.open_connection("127.0.0.1", target, limit=256 * 1024)
            await write(pb.Frame(stream_id=first.stream_id, connected=True))
            await carry(reader, writer, tunnel, read, write)

        server = await asyncio.start_server(serve_back, "127.0.0.1", listen, ssl=server_tls)
    else:
        client_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        client_tls.check_hostname = False
        client_tls.verify_mode = ssl.CERT_NONE  # a bench reference on loopback

        async def serve_front(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            tunnel_reader, tunnel = await asyncio.open_connection("127.0.0.1", target, ssl=client_tls,
                                                                  limit=256 * 1024)
            read, write = framed(tunnel_reader, tunnel)
            await write(pb.Frame(stream_id="bench"))
            await read()  # connected
            await carry(reader, writer, tunnel, read, write)

        server = await asyncio.start_server(serve_front, "127.0.0.1", listen, limit=256 * 1024)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    import uvloop

    uvloop.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:6]))
