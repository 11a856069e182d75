"""asyncssh's CPU per relayed byte in one process: the two halves of what the gateway does with each packet.

An asyncssh server and an asyncssh client in this process, on one loopback TCP connection (uvloop, AES-GCM,
32 KiB packets as the gateway uses them): the server's channel writes ``--megabytes`` MiB, the client's takes
them in. That is one encryption and one decryption per packet, with asyncssh's Python around each: what the
gateway spends on a relayed packet (decrypted from the target, encrypted for the client), without the relay,
the recording or any other process in the measurement. The process's CPU (user + system, ``getrusage``) per
GB is printed for each ``--variant``, interleaved over ``--rounds``:

- ``asyncssh``: the connections as asyncssh makes them;
- ``io``: with the gateway's reads and writes (proxies/ssh/reads.py and writes.py);
- ``ignore``: ``io`` and the sender's ``SSH_MSG_IGNORE`` left out (packets.py ``skip_ignore_packets`` on the server):
  one packet fewer to send and to take in per data packet;
- ``packets``: with everything proxies/ssh/packets.py puts on the gateway's connections and channels, on asyncssh's
  own AES-GCM;
- ``gcm``: ``packets`` with the gateway's AES-GCM packets (proxies/ssh/gcm.py);
- ``gateway``: as the SSH proxy runs: ``gcm`` with the channel's data packets sent and taken in by
  proxies/ssh/datapath.py.

    .venv/bin/python bench/ssh/bench_packets.py [--megabytes 256] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import asyncssh  # noqa: E402
import uvloop  # noqa: E402

from proxies.ssh import gcm  # noqa: E402
from proxies.ssh.packets import (as_the_gateway_relays_it, as_the_gateway_runs_it, skip_ignore_packets,  # noqa: E402
                                 unlogged_packets)
from proxies.ssh.reads import split_reads  # noqa: E402
from proxies.ssh.target import MAX_PACKET, WINDOW  # noqa: E402
from proxies.ssh.writes import gather_writes  # noqa: E402

CIPHER = "aes128-gcm@openssh.com"  # the gateway's default, both sides
PIECE = 256 * 1024


def cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


VARIANTS = ("asyncssh", "io", "ignore", "packets", "gcm", "gateway")


def as_the_gateway(conn: asyncssh.SSHClientConnection | asyncssh.SSHServerConnection, variant: str) -> None:
    if variant == "gateway":
        as_the_gateway_runs_it(conn, [CIPHER])  # what proxies/ssh/server.py does
        return
    if variant == "asyncssh":
        return
    split_reads(conn)
    gather_writes(conn)
    if variant in ("packets", "gcm"):
        skip_ignore_packets(conn, [CIPHER])
        unlogged_packets(conn)
    elif variant == "ignore" and isinstance(conn, asyncssh.SSHServerConnection):
        skip_ignore_packets(conn, [CIPHER])


async def transfer(size: int, variant: str, host_key: asyncssh.SSHKey) -> float:
    """CPU seconds of this process to move ``size`` bytes from the server's channel to the client's."""
    done = asyncio.get_running_loop().create_future()
    if variant in ("gcm", "gateway"):  # asyncssh reads its table of ciphers at each key exchange: set for this one
        gcm.install()
    else:
        gcm.uninstall()

    class Server(asyncssh.SSHServer):
        def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
            as_the_gateway(conn, variant)

        def begin_auth(self, username: str) -> bool:
            return False  # no authentication: the measurement is the data path

        def session_requested(self) -> Writer:
            return Writer()

    class Writer(asyncssh.SSHServerSession):  # type: ignore[type-arg]
        def connection_made(self, chan: asyncssh.SSHServerChannel[bytes]) -> None:  # type: ignore[override]
            self.chan, self.left = chan, size
            if variant in ("packets", "gcm"):
                unlogged_packets(chan)
            elif variant == "gateway":
                as_the_gateway_relays_it(chan)

        def shell_requested(self) -> bool:
            return True

        def session_started(self) -> None:
            self.resume_writing()

        def resume_writing(self) -> None:
            block = bytes(PIECE)
            while self.left > 0 and self.chan.get_write_buffer_size() < 2 * PIECE:
                self.chan.write(block[:min(PIECE, self.left)])
                self.left -= PIECE
            if self.left <= 0:
                self.chan.exit(0)

    class Client(asyncssh.SSHClient):
        def connection_made(self, conn: asyncssh.SSHClientConnection) -> None:
            as_the_gateway(conn, variant)

    class Reader(asyncssh.SSHClientSession):  # type: ignore[type-arg]
        received = 0

        def connection_made(self, chan: asyncssh.SSHClientChannel[bytes]) -> None:  # type: ignore[override]
            if variant in ("packets", "gcm"):
                unlogged_packets(chan)
            elif variant == "gateway":
                as_the_gateway_relays_it(chan)

        def data_received(self, data: bytes, datatype: object) -> None:
            self.received += len(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if not done.done():
                done.set_result(self.received)

    options = {"encryption_algs": [CIPHER], "compression_algs": None, "window": WINDOW, "max_pktsize": MAX_PACKET}
    server = await asyncssh.create_server(Server, "127.0.0.1", 0, server_host_keys=[host_key], line_editor=False,
                                          encoding=None, **options)
    port = server.sockets[0].getsockname()[1]
    try:
        async with asyncssh.connect("127.0.0.1", port, known_hosts=None, username="bench", client_factory=Client,
                                    **options) as conn:
            started = cpu()
            chan, _ = await conn.create_session(Reader, encoding=None, window=WINDOW, max_pktsize=MAX_PACKET)
            received = await done
            spent = cpu() - started
            await chan.wait_closed()
    finally:
        server.close()
        await server.wait_closed()
    assert received == size, (received, size)
    return spent


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    size = args.megabytes << 20
    host_key = asyncssh.generate_private_key("ssh-ed25519")
    await transfer(8 << 20, "gateway", host_key)  # warm: imports, first key exchange
    spent: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name in spent:
            spent[name].append(await transfer(size, name, host_key) / (size / 1e9))
    print(f"asyncssh server -> client in one process, {args.megabytes} MiB x {args.rounds} rounds, {CIPHER}, "
          f"{MAX_PACKET}-byte packets: CPU s/GB")
    for name, values in spent.items():
        print(f"  {name:9} median {statistics.median(values):.3f}  min {min(values):.3f}  "
              f"all {' '.join(f'{v:.3f}' for v in values)}")


if __name__ == "__main__":
    uvloop.run(main())
