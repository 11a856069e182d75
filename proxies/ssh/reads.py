"""Split reads for the gateway's SSH connections: asyncssh is handed what its socket read in pieces of 64 KiB at most.

asyncssh keeps the bytes it has not parsed yet in one ``bytes`` and slices
each packet off its front, copying the rest every time (twice per packet:
the header, then the body). A socket read of 256 KiB (uvloop's read size)
holds about eight 32 KiB packets, so each relayed byte was copied about eight
times over before it was decrypted: about 1 s of CPU per GB on the
development machine, a sixth of the gateway's whole cost of relaying it.
Handed the same bytes in 64 KiB pieces, asyncssh never holds more than a
piece and a packet, and parses the same packets in the same order within the
same callback; what it keeps is bounded as before.

``split_reads`` puts a ``SplitReads`` protocol between the connection's
socket transport and the asyncssh connection (``transport.set_protocol``, the
transport's public way to change who it feeds). Measured in bench/README.md
("SSH proxy"). Where the connection relays channel data, the same protocol
hands each read to datapath.py's reader first, which reads the data packets
itself and hands asyncssh the rest through ``to_asyncssh``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import asyncssh

log = logging.getLogger("gatewayd.ssh")

READ_PIECE = 64 * 1024


def to_asyncssh(conn: asyncssh.SSHClientConnection | asyncssh.SSHServerConnection, data: bytes | memoryview) -> None:
    """Hand ``data`` to ``conn`` in pieces of ``READ_PIECE`` bytes at most."""
    if len(data) <= READ_PIECE:
        conn.data_received(data)  # type: ignore[arg-type]  # it joins with +=
        return
    view = memoryview(data)
    for start in range(0, len(data), READ_PIECE):
        if start and conn._transport is None:  # closed by a packet before: asyncssh stops parsing there too
            return
        conn.data_received(view[start:start + READ_PIECE])  # type: ignore[arg-type]


class SplitReads(asyncio.Protocol):
    """Feeds an asyncssh connection its socket's reads in pieces of ``READ_PIECE`` bytes at most, or through
    ``reader`` (datapath.py's ``ChannelDataReader``) where the gateway relays channel data on it."""

    __slots__ = ("conn", "reader")

    def __init__(self, conn: asyncssh.SSHClientConnection | asyncssh.SSHServerConnection) -> None:
        self.conn = conn
        self.reader: Any = None

    def data_received(self, data: bytes) -> None:
        if self.reader is not None:
            self.reader.received(data)
        else:
            to_asyncssh(self.conn, data)

    def eof_received(self) -> bool | None:
        return self.conn.eof_received()  # type: ignore[func-returns-value]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.reader is not None:
            self.reader.closed()
        self.conn.connection_lost(exc)

    def pause_writing(self) -> None:
        self.conn.pause_writing()

    def resume_writing(self) -> None:
        self.conn.resume_writing()


def split_reads(conn: asyncssh.SSHClientConnection | asyncssh.SSHServerConnection) -> SplitReads | None:
    """Put a ``SplitReads`` between ``conn`` and its socket's transport (from its owner's ``connection_made``,
    before ``gather_writes`` wraps the transport's writes).

    asyncssh keeps its transport in ``_transport`` (None once the connection is closed) and offers no hook for
    it: where a later asyncssh has no such attribute, or the transport cannot change its protocol, the
    connection is left as it is (correct, copying as before)."""
    transport = getattr(conn, "_transport", None)
    if transport is None or not hasattr(transport, "set_protocol"):
        log.debug("asyncssh connection without _transport or transport without set_protocol: reads not split")
        return None
    reads = SplitReads(conn)
    transport.set_protocol(reads)
    return reads
