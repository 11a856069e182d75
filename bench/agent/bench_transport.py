"""The gateway's CPU per round trip on the transports a proxy's target can sit on, in isolation.

A protocol in this process sends a 61-byte message and waits for its echo, ``--count`` times, on:
``plain`` (a TCP transport to an echo server: the direct path), ``tls`` (the same over TLS: a tunnel with
nothing but TLS, the floor), ``tunnel`` (``pump.TunnelTransport``: the proxy on a tunnel connection's own
end, frames over TLS, as through an agent) and ``pair`` (the proxy on one end of a ``socketpair()``, a Splice on
the other: what a proxy that adopts a socket gets through an agent). The echo servers run in processes of their own; this process's
CPU (user + system, ``getrusage``) per round trip is what each transport costs the gateway, without
pgbench, PostgreSQL or the agent sharing the measurement. ``tunnel`` minus ``tls`` is the framing's cost;
``tls`` minus ``plain`` is TLS's (uvloop's SSL protocol and OpenSSL).

    .venv/bin/python bench/agent/bench_transport.py [--rounds 3] [--count 20000]
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import uvloop  # noqa: E402

from gatewayd.agent import agent_pb2 as pb  # noqa: E402
from gatewayd.agent.pump import HEADER, Splice, record  # noqa: E402
from gatewayd.tls import generate_self_signed  # noqa: E402
from tests.ports import free_port  # noqa: E402

MESSAGE = b"Q" + b"x" * 60  # about a pgbench -S query


def serve(kind: str, port: int, cert: str, key: str) -> None:
    """An echo server: bytes as they come (``plain``, ``tls``) or each data frame's bytes as a frame (``tunnel``)."""
    async def main() -> None:
        context = None
        if kind != "plain":
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(cert, key)
        if kind == "tunnel":
            class Framed(asyncio.Protocol):
                def connection_made(self, transport: asyncio.BaseTransport) -> None:
                    self.transport, self.buffer = transport, b""

                def data_received(self, data: bytes) -> None:
                    self.buffer += data
                    while len(self.buffer) >= HEADER.size:
                        (length,) = HEADER.unpack_from(self.buffer)
                        if len(self.buffer) < HEADER.size + length:
                            break
                        frame = pb.Frame.FromString(self.buffer[HEADER.size:HEADER.size + length])
                        self.buffer = self.buffer[HEADER.size + length:]
                        if frame.data:
                            self.transport.write(record(pb.Frame(data=frame.data)))  # type: ignore[attr-defined]

            server = await asyncio.get_running_loop().create_server(Framed, "127.0.0.1", port, ssl=context)
        else:
            async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                while data := await reader.read(65536):
                    writer.write(data)

            server = await asyncio.start_server(echo, "127.0.0.1", port, ssl=context)
        async with server:
            await server.serve_forever()

    uvloop.run(main())


class PingPong(asyncio.Protocol):
    """Sends the message again on each echo, ``count`` times."""

    def __init__(self, count: int, done: asyncio.Future[None]) -> None:
        self.count, self.done, self.seen = count, done, 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.seen += 1
        if self.seen >= self.count:
            self.done.set_result(None)
        else:
            self.transport.write(MESSAGE)  # type: ignore[union-attr]


async def measure(kind: str, port: int, count: int) -> float:
    """This process's CPU per round trip (µs) on ``kind``."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    protocol = PingPong(count, done)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname, client.verify_mode = False, ssl.CERT_NONE
    splice = None
    if kind in ("tunnel", "pair"):
        splice = Splice()
        tunnel, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", port, ssl=client)
        splice.adopt(tunnel)  # type: ignore[arg-type]
        if kind == "tunnel":
            splice.end().attach(protocol)
        else:  # the proxy on one end of a socketpair, the Splice on the other (what a proxy adopting a socket gets)
            ours, theirs = socket.socketpair()
            ours.setblocking(False)
            theirs.setblocking(False)
            await splice.attach(ours)
            await loop.create_connection(lambda: protocol, sock=theirs)
        running = asyncio.ensure_future(splice.run())
    else:
        await loop.create_connection(lambda: protocol, "127.0.0.1", port, ssl=client if kind == "tls" else None)
    await asyncio.sleep(0.2)
    before = resource.getrusage(resource.RUSAGE_SELF)
    protocol.transport.write(MESSAGE)  # type: ignore[union-attr]
    await done
    after = resource.getrusage(resource.RUSAGE_SELF)
    protocol.transport.close()  # type: ignore[union-attr]
    if splice is not None:
        splice.close()
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
    return ((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)) / count * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--count", type=int, default=20000, help="round trips per run")
    parser.add_argument("--kinds", default="plain,tls,tunnel,pair", help="which transports (comma-separated)")
    parser.add_argument("serve", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(*args.serve[:1], int(args.serve[1]), *args.serve[2:4])
        return 0
    folder = Path(tempfile.mkdtemp(prefix="bench-transport-"))
    cert, key = folder / "echo.crt", folder / "echo.key"
    generate_self_signed(cert, key, "bench")
    ports = {kind: free_port() for kind in args.kinds.split(",")}
    servers = [subprocess.Popen([sys.executable, __file__, "tunnel" if kind == "pair" else kind, str(port), str(cert),
                                 str(key)]) for kind, port in ports.items()]
    try:
        time.sleep(1.5)
        figures: dict[str, list[float]] = {kind: [] for kind in ports}
        for _ in range(args.rounds):
            for kind, port in ports.items():
                figures[kind].append(uvloop.run(measure(kind, port, args.count)))
        print(f"CPU per round trip of this process, {args.count} round trips, medians of {args.rounds}:")
        for kind, values in figures.items():
            print(f"  {kind:<7} {statistics.median(values):5.1f} us   ({' '.join(f'{v:.1f}' for v in values)})")
        if set(figures) >= {"plain", "tls", "tunnel", "pair"}:
            plain, tls, tunnel, pair = (statistics.median(figures[k]) for k in ("plain", "tls", "tunnel", "pair"))
            print(f"  TLS adds {tls - plain:+.1f} us, the tunnel's frames {tunnel - tls:+.1f} us more; a socketpair "
                  f"between the proxy and the tunnel {pair - tunnel:+.1f} us more again")
    finally:
        for server in servers:
            server.terminate()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
