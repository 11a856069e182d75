"""One session per HTTP credential across the workers of one ``gatewayd run``: a connection handed to its holder.

With ``workers = N`` the kernel spreads the HTTP listener's connections over the workers (SO_REUSEPORT), but a
credential's session -- its recording, its policy, its kill -- lives in the one process that claimed it. A
connection whose first request carries a credential whose session another worker of the same node holds is
handed to that worker: the socket (SCM_RIGHTS over an abstract Unix socket named after the worker's node id)
with the bytes read from it so far, which the holder serves as if it had accepted the connection itself. So
every exchange of a credential is recorded in its one session, whichever worker the connection reached.

Only a connection's first request is looked at (a browser's later requests on it carry the same cookie), and
only when its head came whole in the first read; a credential's holder is asked of the store once and
remembered for ``REMEMBER`` seconds. A connection handed over is never handed again. Other nodes sharing a
PostgreSQL store are other hosts: a credential used through two nodes still has a session on each.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
import time
from typing import TYPE_CHECKING, Awaitable, Callable

from proxies.http.messages import extract_credential

if TYPE_CHECKING:
    from proxies.http.front import FrontProtocol

log = logging.getLogger("gatewayd.http")

REMEMBER = 5.0  # seconds a credential's holder is remembered
_LENGTH = struct.Struct(">I")
_END = b"\r\n\r\n"


def address(node_id: str) -> str:
    """The abstract Unix socket (Linux) where the worker with ``node_id`` takes connections handed to it."""
    return f"\0gatewayd-http-handover-{node_id}"


def presented_secret(data: bytes) -> str | None:
    """The gateway credential of the request whose head starts ``data`` (whole), or None."""
    end = data.find(_END)
    if end < 0:
        return None
    lines = data[:end].decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3:
        return None
    authorization = cookie = None
    for line in lines[1:]:
        name, _, value = line.partition(":")
        lowered = name.strip().lower()
        if lowered == "authorization":
            authorization = value.strip()
        elif lowered == "cookie":
            cookie = value.strip() if cookie is None else f"{cookie}; {value.strip()}"
    presented = extract_credential(authorization, cookie, parts[1])
    return presented.secret if presented is not None else None


def _send(node_id: str, fd: int, data: bytes) -> None:
    """Hand ``fd`` and the bytes already read from it to the worker ``node_id`` (blocking: run in a thread)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as channel:
        channel.settimeout(5)
        channel.connect(address(node_id))
        socket.send_fds(channel, [_LENGTH.pack(len(data))], [fd])
        channel.sendall(data)


def _receive(channel: socket.socket) -> tuple[int, bytes] | None:
    """One handed connection: its descriptor and its bytes read so far (blocking: run in a thread)."""
    with channel:
        channel.settimeout(5)
        credentials = channel.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", credentials)
        if uid != os.getuid():  # only this gateway's own workers hand connections over
            return None
        head, fds, _flags, _address = socket.recv_fds(channel, _LENGTH.size, 1)
        if len(head) < _LENGTH.size or not fds:
            for fd in fds:
                os.close(fd)
            return None
        (size,) = _LENGTH.unpack(head)
        data = bytearray()
        try:
            while len(data) < size:
                chunk = channel.recv(min(size - len(data), 1 << 16))
                if not chunk:
                    raise ConnectionError("the handing worker went away")
                data += chunk
        except OSError:
            os.close(fds[0])
            return None
        return fds[0], bytes(data)


class Handover:
    """This worker's side of the handover: where to hand a connection, and what it takes from its siblings."""

    def __init__(self, node_id: str, holder: Callable[[str], Awaitable[str | None]],
                 protocol: Callable[[], FrontProtocol]) -> None:
        self.node_id = node_id
        self.holder = holder  # the pipeline's sibling_holding: a secret -> the sibling holding its session
        self.protocol = protocol  # the front end's protocol factory: a connection handed here is served by it
        self._known: dict[str, tuple[str | None, float]] = {}  # secret -> (holder or None, until)
        self._server: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(address(self.node_id))
        server.listen(128)
        server.setblocking(False)
        self._server = server
        self._accepting = asyncio.get_running_loop().create_task(self._accept())

    async def close(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
        if self._server is not None:
            self._server.close()
        for task in list(self.tasks):
            task.cancel()

    def _spawn(self, coroutine: Awaitable[None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)  # type: ignore[arg-type]
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # -- a connection's first bytes, here

    def first(self, protocol: FrontProtocol, data: bytes) -> bool:
        """Look at a new connection's first bytes: True when they went to be looked up (the connection is then
        served here or handed over by ``_route``), False when it is served here as it is."""
        secret = presented_secret(data)
        if secret is None:
            return False
        known = self._known.get(secret)
        if known is not None and known[1] > time.monotonic() and known[0] is None:
            return False  # held here, or by nobody: the usual path, no task
        transport = protocol.transport
        if transport is None:
            return False
        transport.pause_reading()
        self._spawn(self._route(protocol, data, secret))
        return True

    async def _route(self, protocol: FrontProtocol, data: bytes, secret: str) -> None:
        holder = None
        try:
            known = self._known.get(secret)
            if known is not None and known[1] > time.monotonic():
                holder = known[0]
            else:
                holder = await self.holder(secret)
                if len(self._known) > 10_000:
                    self._known.clear()
                self._known[secret] = (holder, time.monotonic() + REMEMBER)
            if holder is not None and await self._hand(protocol, holder, data):
                return
        except Exception:
            log.exception("http handover failed; the connection is served here")
        protocol.served_here(data)

    async def _hand(self, protocol: FrontProtocol, holder: str, data: bytes) -> bool:
        """Send the connection to ``holder``; True when it took it (the connection is closed here, not ended)."""
        transport = protocol.transport
        if transport is None:
            return True  # the client went away meanwhile
        sock = transport.get_extra_info("socket")
        if sock is None:
            return False
        fd = os.dup(sock.fileno())
        try:
            await asyncio.to_thread(_send, holder, fd, data)
        except OSError as exc:  # the holder went away: ask again next time
            self._known.pop(presented_secret(data) or "", None)
            log.info("http handover refused; the connection is served here", extra={"node": holder,
                                                                                    "error": str(exc)})
            return False
        finally:
            os.close(fd)
        protocol.handed_away()
        log.debug("http connection handed to the worker holding its session", extra={"node": holder})
        return True

    # -- connections handed here

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._server is not None
        while True:
            channel, _ = await loop.sock_accept(self._server)
            channel.setblocking(True)
            self._spawn(self._take(channel))

    async def _take(self, channel: socket.socket) -> None:
        received = await asyncio.to_thread(_receive, channel)
        if received is None:
            return
        fd, data = received
        sock = socket.socket(fileno=fd)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        try:
            _transport, protocol = await loop.connect_accepted_socket(self.protocol, sock)
        except OSError:
            sock.close()
            return
        protocol.handed = True  # never handed again, whatever this worker believes
        protocol.data_received(data)
