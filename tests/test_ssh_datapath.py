"""proxies/ssh/datapath.py: the relayed channels' data packets sent and taken in by the gateway, not asyncssh.

An asyncssh server and client in this process on loopback, each side with or without the data path, the server's
channel echoing what the client's sends (so each byte crosses both paths of both sides): every byte comes back in
order across key renewals, stderr between the data, and a peer without the data path; a packet changed on the
wire ends the connection before its bytes are delivered; a peer that sends past the window is refused as asyncssh
refuses it; and the packets went through the data path (its counts), not through asyncssh's.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import asyncssh
import pytest
from prometheus_client import REGISTRY

from proxies.ssh import datapath, gcm
from proxies.ssh.packets import as_the_gateway_relays_it, as_the_gateway_runs_it

CIPHER = "aes128-gcm@openssh.com"
WINDOW = 256 * 1024
PACKET = 32768


@pytest.fixture(scope="module")
def host_key() -> asyncssh.SSHKey:
    return asyncssh.generate_private_key("ssh-ed25519")


@pytest.fixture(autouse=True)
def gateway_gcm():
    """asyncssh's cipher table with ``GatewayGCM`` in it, as the SSH listener leaves it (put back after)."""
    installed = gcm.install()
    yield
    if installed:
        gcm.uninstall()


class Pair:
    """One asyncssh connection pair; ``fast``: which sides (``server``, ``client``) run the data path; each of them
    renews its keys after ``rekey_bytes`` sent (a side without the data path never does, so every renewal is
    started by a data path's side)."""

    def __init__(self, fast: set[str], rekey_bytes: int = 1 << 30) -> None:
        self.fast = fast
        self.rekey_bytes = rekey_bytes
        self.conns: dict[str, Any] = {}
        self.chans: dict[str, Any] = {}
        self.received = bytearray()
        self.stderr = bytearray()
        loop = asyncio.get_running_loop()
        self.lost: dict[str, asyncio.Future[Exception | None]] = {"server": loop.create_future(),
                                                                  "client": loop.create_future()}
        self.server: Any = None

    def connected(self, side: str, conn: Any) -> None:
        """A side's connection is made: noted, and run as the gateway runs its connections where it is fast."""
        self.conns[side] = conn
        if side in self.fast:
            as_the_gateway_runs_it(conn, [CIPHER])

    def disconnected(self, side: str, exc: Exception | None) -> None:
        if not self.lost[side].done():
            self.lost[side].set_result(exc)

    def opened(self, side: str, chan: Any) -> None:
        """A side's channel is open: noted, and relayed as the gateway relays its channels where it is fast."""
        self.chans[side] = chan
        if side in self.fast:
            as_the_gateway_relays_it(chan)

    def options(self, side: str) -> dict[str, Any]:
        return {"encryption_algs": [CIPHER], "compression_algs": None, "window": WINDOW, "max_pktsize": PACKET,
                "rekey_bytes": self.rekey_bytes if side in self.fast else 1 << 30}

    async def open(self, host_key: asyncssh.SSHKey, proxy_port: int | None = None,
                   listening: asyncio.Future[int] | None = None) -> None:
        pair = self

        class Server(asyncssh.SSHServer):
            def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
                pair.connected("server", conn)

            def connection_lost(self, exc: Exception | None) -> None:
                pair.disconnected("server", exc)

            def begin_auth(self, username: str) -> bool:
                return False

            def session_requested(self) -> Echo:
                return Echo()

        class Echo(asyncssh.SSHServerSession):  # type: ignore[type-arg]
            """Writes back what it takes in; every 5th piece also to stderr, as a marker."""

            pieces = 0

            def connection_made(self, chan: Any) -> None:
                self.chan = chan
                pair.opened("server", chan)

            def shell_requested(self) -> bool:
                return True

            def data_received(self, data: bytes, datatype: Any) -> None:
                self.chan.write(data)
                self.pieces += 1
                if self.pieces % 5 == 0:
                    self.chan.write_stderr(b"<%d>" % len(data))

            def eof_received(self) -> bool:
                self.chan.exit(0)
                return False

        class Client(asyncssh.SSHClient):
            def connection_made(self, conn: asyncssh.SSHClientConnection) -> None:
                pair.connected("client", conn)

            def connection_lost(self, exc: Exception | None) -> None:
                pair.disconnected("client", exc)

        class Reader(asyncssh.SSHClientSession):  # type: ignore[type-arg]
            def connection_made(self, chan: Any) -> None:
                pair.opened("client", chan)

            def data_received(self, data: bytes, datatype: Any) -> None:
                (pair.stderr if datatype == asyncssh.EXTENDED_DATA_STDERR else pair.received).extend(data)

        self.server = await asyncssh.create_server(Server, "127.0.0.1", 0, server_host_keys=[host_key],
                                                   encoding=None, line_editor=False, **self.options("server"))
        port = self.server.sockets[0].getsockname()[1]
        if listening is not None:
            listening.set_result(port)
        self.client = await asyncssh.connect("127.0.0.1", proxy_port or port, known_hosts=None, username="t",
                                             client_factory=Client, **self.options("client"))
        self.chan, _ = await self.client.create_session(Reader, encoding=None, window=WINDOW, max_pktsize=PACKET)

    async def send(self, data: bytes, sizes: list[int]) -> None:
        """Write ``data`` in pieces of ``sizes`` (cycled), a turn of the loop between them now and then."""
        at = index = 0
        while at < len(data):
            size = sizes[index % len(sizes)]
            self.chan.write(data[at:at + size])
            at += size
            if index % 3 == 0:
                await asyncio.sleep(0)
            index += 1
            while self.chan.get_write_buffer_size() > 4 * WINDOW:
                await asyncio.sleep(0.001)

    async def close(self) -> None:
        self.client.close()
        await self.client.wait_closed()
        self.server.close()
        await self.server.wait_closed()


class Seen:
    """A connection's transport, with the packet lengths of what is handed to it in pieces noted, and the most
    bytes the connection had sent under its keys before one of them (``counts``)."""

    def __init__(self, conn: Any, lengths: list[int], counts: list[int]) -> None:
        self.conn = conn
        self.transport = conn._transport
        self.lengths = lengths
        self.counts = counts

    def writelines(self, pieces: Any) -> None:
        self.lengths.append(int.from_bytes(pieces[0], "big"))
        self.counts.append(self.conn._rekey_bytes_sent)
        self.transport.writelines(pieces)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


def counted(direction: str) -> float:
    return REGISTRY.get_sample_value("gatewayd_ssh_datapath_packets_total", {"direction": direction}) or 0.0


@pytest.mark.parametrize("fast", [{"server", "client"}, {"server"}, {"client"}], ids=["both", "server", "client"])
@pytest.mark.parametrize("rekey_bytes", [1 << 30, 300_000], ids=["keys-kept", "keys-renewed"])
async def test_every_byte_comes_back_in_order_through_the_data_path(host_key, fast, rekey_bytes, monkeypatch):
    """3 MB in pieces of 1 byte to 200 KB, echoed: the same bytes back in the same order, the stderr markers
    between them intact, across key renewals every 300 KB (each one a new cipher state both ways, and data
    held by asyncssh while it runs), with a peer that has no data path; the data path carried the packets."""
    made = []
    real_init = gcm.GatewayGCM.__init__

    def counting_init(self: gcm.GatewayGCM, key: bytes, iv: bytes) -> None:
        made.append(self)
        real_init(self, key, iv)

    monkeypatch.setattr(gcm.GatewayGCM, "__init__", counting_init)
    rng = random.Random(7)
    data = rng.randbytes(3_000_000)
    sizes = [rng.choice([1, 17, 4096, 32768, 32769, 65536, 200_000]) for _ in range(50)]
    before = counted("in"), counted("out")
    pair = Pair(fast, rekey_bytes)
    await pair.open(host_key)
    lengths: list[int] = []
    counts: list[int] = []
    for side in fast:  # the data path hands the transport each packet as (its length, the sealed rest)
        pair.conns[side]._transport = Seen(pair.conns[side], lengths, counts)
    try:
        await pair.send(data, sizes)
        pair.chan.write_eof()
        await asyncio.wait_for(pair.chan.wait_closed(), 60)
        readers = [pair.conns[side].gateway_reader for side in fast]
        taken, sent = sum(reader.taken for reader in readers), sum(reader.sent for reader in readers)
        if "client" in fast:  # a closed channel is no longer the data path's to deliver to
            assert pair.conns["client"].gateway_reader.channels == {}
    finally:
        await pair.close()
    assert bytes(pair.received) == data
    markers = bytes(pair.stderr)
    assert markers.startswith(b"<") and markers.endswith(b">") and markers.count(b"<") >= 10
    if rekey_bytes < 1 << 30:
        assert len(made) >= 2 * 2 * 5, len(made)  # both sides, both directions, at least five renewals
    else:
        assert len(made) == 4
    # the bytes crossed each fast side once each way: most of its 32 KiB packets in and out were the data path's
    # (asyncssh's while keys are renewed: it holds the data and sends it itself once the new keys are in use)
    least = len(fast) * len(data) // PACKET * (0.6 if rekey_bytes == 1 << 30 else 0.3)
    assert taken >= least and sent >= least, (taken, sent, least)
    # each packet as RFC 5647 (AES-GCM) frames it, which OpenSSH checks: whole blocks of 16, 4 to 19 bytes of
    # padding (the data's own length and type are read back above)
    assert len(lengths) == sent and all(length % 16 == 0 and 16 <= length <= PACKET + 64 for length in lengths)
    # and none sent under keys due for renewal: as asyncssh's own send_packet, the renewal starts first
    assert max(counts) < rekey_bytes
    # and each connection's counts reach the node's metrics when it closes
    await asyncio.wait_for(asyncio.gather(pair.lost["client"], pair.lost["server"]), 10)
    assert (counted("in") - before[0], counted("out") - before[1]) == (taken, sent)


class Tamper:
    """A TCP relay between client and server that flips one bit of the server's bytes at ``at``."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.seen = 0

    async def start(self, server_port: asyncio.Future[int]) -> int:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", await server_port)

            async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, flip: bool) -> None:
                try:
                    while data := await src.read(65536):
                        if flip and self.seen <= self.at < self.seen + len(data):
                            changed = bytearray(data)
                            changed[self.at - self.seen] ^= 0x10
                            data = bytes(changed)
                        if flip:
                            self.seen += len(data)
                        dst.write(data)
                        await dst.drain()
                except ConnectionError:
                    pass
                finally:
                    dst.close()

            await asyncio.gather(pipe(reader, up_writer, False), pipe(up_reader, writer, True))

        self.relay = await asyncio.start_server(serve, "127.0.0.1", 0)
        return self.relay.sockets[0].getsockname()[1]


@pytest.mark.parametrize("fast", [{"client"}, set()], ids=["data-path", "asyncssh"])
async def test_a_packet_changed_on_the_wire_ends_the_connection_and_is_not_delivered(host_key, fast):
    """One bit flipped in the server's bytes 1 MB into the echo: the client's connection ends with asyncssh's MAC
    error, what it had received is an unchanged prefix of what was sent, and nothing after the changed packet
    arrived: the same with the data path as without it."""
    rng = random.Random(11)
    data = rng.randbytes(2_000_000)
    before = counted("in")
    tamper = Tamper(1_000_000)
    port: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    relay_port = await tamper.start(port)
    pair = Pair(fast)
    try:
        await pair.open(host_key, proxy_port=relay_port, listening=port)
        sending = asyncio.ensure_future(pair.send(data, [65536]))
        exc = await asyncio.wait_for(pair.lost["client"], 30)
        sending.cancel()
        await asyncio.gather(sending, return_exceptions=True)
    finally:
        await pair.close()
        tamper.relay.close()
    assert isinstance(exc, asyncssh.MACError), repr(exc)
    received = bytes(pair.received)
    assert 0 < len(received) < 1_000_000 and received == data[:len(received)]
    # with the data path, the packets before the changed one came through it (counted as the connection closed)
    assert (counted("in") - before > 0) == bool(fast)


async def test_a_peer_past_the_window_is_refused_as_asyncssh_refuses_it(host_key):
    """A client that ignores the server's window (its own count of it raised tenfold) and sends 1 MB: the
    server's data path takes no packet past the window; asyncssh refuses it ("Window exceeded") and the
    connection ends, with no more than a window's worth of bytes echoed."""
    before = counted("in")
    pair = Pair({"server", "client"})
    await pair.open(host_key)
    try:
        pair.chans["server"].pause_reading()  # nothing is consumed, so the server's window is not reopened
        pair.chan._send_window = 10 * WINDOW
        pair.chan.write(bytes(1_000_000))
        exc = await asyncio.wait_for(pair.lost["server"], 30)
        await asyncio.wait_for(pair.lost["client"], 10)
    finally:
        await pair.close()
    assert isinstance(exc, asyncssh.ProtocolError) and "Window exceeded" in str(exc), repr(exc)
    assert len(pair.received) == 0  # the server read nothing (paused), so nothing was echoed
    # the data path took the packets within the window (32 KiB each), and left the one past it to asyncssh
    assert 0 < counted("in") - before <= WINDOW // PACKET


def test_an_asyncssh_without_the_state_the_data_path_reads_is_left_as_it_is():
    """Where the installed asyncssh lacks a name the data path reads, its connections read as before; and a
    release it was not written for is not read at all, whatever names it has (the installed one is one it was)."""

    class Reads:
        reader = None

    class Connection:
        _inpbuf = b""

    reads = Reads()
    datapath.read_channel_data(Connection(), reads)  # type: ignore[arg-type]
    assert reads.reader is None and not datapath.usable(Connection())
    complete = Connection()
    for name in datapath.CONNECTION_NAMES:
        setattr(complete, name, None)
    assert datapath.usable(complete), "the installed asyncssh is not one the data path was written for"
    for other in ("2.25.0", "3.0.0", "2.23.1", "2.24", "garbage", ""):
        assert datapath.usable(complete, other) == (other == "2.24"), other
