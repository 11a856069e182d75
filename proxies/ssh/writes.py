"""Gathered writes for the gateway's SSH connections: what one turn of the event loop sends leaves in one send call.

asyncssh hands each SSH packet to its transport on its own, and puts an
``SSH_MSG_IGNORE`` packet before every one it encrypts: relaying 32 KiB
channel packets makes two ``send`` calls per packet, each its own TCP segment
(the socket has ``TCP_NODELAY``), and the peer reads them one by one.
OpenSSH instead writes its whole output buffer when the socket is writable.
``gather_writes`` puts a ``GatheredTransport`` between an asyncssh connection
and its socket's transport: the packets written while a callback runs (the
target's read of up to 256 KiB, decrypted and re-encrypted for the client)
leave together in one ``writelines`` (one ``writev``) once the callbacks ready
now have run, before the loop polls again. Nothing is held past that turn, so
an interactive keystroke's echo is not delayed, and order is kept: every write
of the connection goes through the same list.

Measured in bench/README.md ("SSH proxy"): it cuts the gateway's and, above
all, the client's CPU per relayed byte.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import asyncssh

log = logging.getLogger("gatewayd.ssh")


class GatheredTransport:
    """A transport whose writes are gathered until the end of the event loop's turn, then sent in one call."""

    __slots__ = ("transport", "pending", "loop")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self.transport = transport
        self.pending: list[bytes] = []
        self.loop = loop

    def write(self, data: bytes) -> None:
        if not self.pending:
            self.loop.call_soon(self.flush)
        self.pending.append(data)

    def writelines(self, lines: list[bytes]) -> None:
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        """Send what is gathered (dropped once the transport is closing, as its own write would drop it)."""
        pending = self.pending
        if not pending:
            return
        self.pending = []
        if not self.transport.is_closing():
            self.transport.writelines(pending)

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def abort(self) -> None:
        self.flush()  # what was written before is handed over first, as an unwrapped transport would have it
        self.transport.abort()

    def __getattr__(self, name: str) -> Any:  # get_extra_info, is_closing, pause_reading...: the transport's own
        return getattr(self.transport, name)


def gather_writes(conn: asyncssh.SSHClientConnection | asyncssh.SSHServerConnection) -> None:
    """Put a ``GatheredTransport`` under ``conn`` (from its owner's ``connection_made``, before any packet).

    asyncssh keeps its transport in ``_transport`` and offers no hook for it: where a later asyncssh has
    no such attribute, the connection is left as it is (correct, one send call per packet again).
    """
    transport = getattr(conn, "_transport", None)
    if transport is None or isinstance(transport, GatheredTransport):
        return
    if not hasattr(transport, "writelines"):
        log.debug("asyncssh transport without writelines: writes not gathered")
        return
    conn._transport = GatheredTransport(transport, asyncio.get_running_loop())  # type: ignore[union-attr,assignment]
