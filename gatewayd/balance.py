"""New connections spread evenly over the workers of one ``gatewayd run``, whatever their addresses hash to.

With ``workers = N`` every worker listens on each address with SO_REUSEPORT, and the kernel picks the worker by
a hash of the connection's addresses. Few long-lived connections (an application's pool, pgbench's clients)
land unevenly: 16 connections over 4 workers came as 9/4/3/0 and 7/6/2/1 (bench/README.md, "connections spread
evenly over the workers"), and the busiest worker's one core caps what the group carries.

So a worker that accepts a connection while it holds more live client connections than its least loaded
sibling hands the socket to that sibling (SCM_RIGHTS, a datagram to the sibling's Unix socket in the run's
private directory), before reading a byte of it; the sibling serves it as if it had accepted it. A handed
connection is never handed again. Where the hand-off fails (the sibling is gone, restarting or its queue is
full) the connection is served where it was accepted, as before. Each worker's load is read from a file the
supervisor makes (``prepare``), a row per worker written by that worker alone (``Balancer``): its client
connections of every protocol (``gatewayd.metrics`` counts them), read by its siblings at each accept.

Listeners that take a protocol factory use it through ``create_server`` (PostgreSQL, MySQL), which with one
process, or without the supervisor's directory, is ``loop.create_server`` unchanged; the SSH listener through
``listen`` with asyncssh's ``run_server`` for a socket, where ``balanced`` says so.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import mmap
import os
import socket
import struct
from functools import partial
from pathlib import Path
from typing import Any, Awaitable, Callable

log = logging.getLogger("gatewayd.balance")

DIRECTORY_ENV = "GATEWAYD_BALANCE_DIR"  # the supervisor's: where the loads and the workers' sockets are

LOADS = "load"
RETIRED = 1 << 40  # added to the load of a worker whose listeners are closed: no sibling is heavier
_SLOT = struct.Struct("=q")
_NAME_LIMIT = 64
# a connection handed for a listener this worker has not started yet (its listeners start one by one) waits this
# long for it, at most this many at once; then it is closed
PENDING_SECONDS = 5.0
MAX_PENDING = 64


def prepare(directory: Path, workers: int) -> None:
    """The supervisor's part: the directory (private: the run's own) and the load file, one row per worker."""
    directory.mkdir(mode=0o700, exist_ok=True)
    (directory / LOADS).write_bytes(bytes(_SLOT.size * workers * (workers + 2)))


def socket_path(directory: Path, index: int) -> Path:
    return directory / f"w{index}.sock"


class Balancer:
    """This worker among its siblings: its row of the load file, its socket, the listeners that take handed
    connections.

    The load file has a row per worker, written by that worker alone: its live client connections, how many
    connections it took from siblings, and how many it handed to each sibling. A worker's load is its live
    connections and those handed to it that it has not taken yet: a burst of connections is not all handed to
    the one sibling that looked idlest before any of them arrived."""

    def __init__(self, directory: Path, index: int) -> None:
        self.directory = directory
        self.index = index
        self.live = 0  # this worker's client connections now
        self.reserved = 0  # of them, those accepted here that their proxy has not counted yet (``opened``)
        self.adopters: dict[str, Callable[[socket.socket], None]] = {}  # by listener name
        with open(directory / LOADS, "r+b") as file:
            self.loads = mmap.mmap(file.fileno(), 0)
        count = 1
        while _SLOT.size * count * (count + 2) < len(self.loads):
            count += 1
        self.count = count
        self.row = struct.Struct(f"={count + 2}q")  # live, taken, handed to each sibling
        self.table = struct.Struct(f"={count * (count + 2)}q")
        table = self.table.unpack_from(self.loads)
        # a dead predecessor's in this slot: what it handed stays handed (its siblings took it), and what was handed
        # to it counts as taken (what it had not taken went with it)
        self.handed = list(table[index * (count + 2) + 2:(index + 1) * (count + 2)])
        self.taken = sum(table[i * (count + 2) + 2 + index] for i in range(count))
        # no listener takes handed connections yet: siblings read this worker as full until one does (``take``)
        self.retired = True
        # handed connections for a listener not started here yet, by listener name (``PENDING_SECONDS``)
        self.pending: dict[str, list[tuple[socket.socket, asyncio.TimerHandle]]] = {}
        self._write()
        self.sock = self._bind()

    def _bind(self) -> socket.socket:
        """This worker's socket for handed connections (a dead predecessor's in the slot is replaced)."""
        path = socket_path(self.directory, self.index)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(str(path))
        sock.setblocking(False)
        asyncio.get_running_loop().add_reader(sock.fileno(), self._receive)
        return sock

    def take(self, name: str, adopt: Callable[[socket.socket], None]) -> None:
        """Connections handed for the listener ``name`` are served by ``adopt`` (again, after ``retire``)."""
        self.adopters[name] = adopt
        if self.retired and not self.loads.closed:
            self.retired = False
            if self.sock.fileno() < 0:
                self.sock = self._bind()
            self._write()
        for sock, timer in self.pending.pop(name, []):
            timer.cancel()
            adopt(sock)

    def retire(self) -> None:
        """This worker's listeners are closed (its stop): its socket closes and its load reads as full, so a
        sibling serves what it accepts itself or hands it to another, instead of handing it here to be closed."""
        if self.retired:
            return
        self.retired = True
        self._close_socket()
        self._write()

    def _close_socket(self) -> None:
        if self.sock.fileno() >= 0:
            asyncio.get_running_loop().remove_reader(self.sock.fileno())
            self.sock.close()

    def close(self) -> None:
        """Leave (idempotent): handed connections are no longer taken, the loads no longer written."""
        if self.loads.closed:
            return
        self.retire()
        self.adopters.clear()
        for name in list(self.pending):
            for sock, timer in self.pending.pop(name):
                timer.cancel()
                sock.close()
        self.loads.close()

    def _write(self) -> None:
        if self.loads.closed:  # a connection that ends after the worker left (its stop): nobody reads it now
            return
        self.row.pack_into(self.loads, self.index * self.row.size, self.live + (RETIRED if self.retired else 0),
                           self.taken, *self.handed)

    def accepted(self) -> None:
        """A connection is served here: counted at once, so that a burst of them spreads too (its proxy counts
        it a moment later, through ``opened``, which then takes this reservation instead)."""
        self.live += 1
        self.reserved += 1
        self._write()

    def opened(self) -> None:
        if self.reserved:
            self.reserved -= 1
        else:
            self.live += 1
            self._write()

    def closed(self) -> None:
        self.live -= 1
        self._write()

    def loads_now(self) -> list[int]:
        """Each worker's load: its live connections, and those handed to it it has not taken yet."""
        width = self.count + 2
        table = self.table.unpack_from(self.loads)
        # worker j's row starts at j * width (live, taken); what each worker handed to j is column 2 + j
        return [live + sum(table[2 + j::width]) - taken
                for j, (live, taken) in enumerate(zip(table[::width], table[1::width]))]

    def lighter(self) -> int | None:
        """The least loaded sibling, where it holds fewer connections than this worker; else None."""
        if self.count < 2:
            return None
        loads = self.loads_now()
        best = min((load, index) for index, load in enumerate(loads) if index != self.index)
        return best[1] if best[0] < loads[self.index] else None

    def hand(self, name: str, sock: socket.socket) -> bool:
        """``sock`` (just accepted by the listener ``name``) to a lighter sibling; False: it is served here."""
        sibling = self.lighter()
        if sibling is None:
            return False
        try:  # (socket.send_fds leaves the address out)
            self.sock.sendmsg([name.encode()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [sock.fileno()]))],
                              0, str(socket_path(self.directory, sibling)))
        except OSError:  # gone, restarting, its queue full: served here
            return False
        sock.close()
        self.handed[sibling] += 1
        self._write()
        return True

    def _receive(self) -> None:
        while True:
            try:
                data, fds, _flags, _address = socket.recv_fds(self.sock, _NAME_LIMIT, 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                log.exception("a handed connection could not be read")
                return
            if not fds:
                continue
            sock = socket.socket(fileno=fds[0])
            name = data.decode(errors="replace")
            adopt = self.adopters.get(name)
            self.taken += 1
            if adopt is not None and sock.type == socket.SOCK_STREAM:
                adopt(sock)  # counted there (``accepted``), with the taking
                continue
            self._write()
            if sock.type == socket.SOCK_STREAM and sum(map(len, self.pending.values())) < MAX_PENDING:
                # its listener may be starting here (they start one by one): held until it takes, or closed
                timer = asyncio.get_running_loop().call_later(PENDING_SECONDS, self._expire, name, sock)
                self.pending.setdefault(name, []).append((sock, timer))
                continue
            self._refuse(name, sock)

    def _expire(self, name: str, sock: socket.socket) -> None:
        """A handed connection whose listener did not start here in time."""
        held = self.pending.get(name, [])
        self.pending[name] = [(s, t) for s, t in held if s is not sock]
        if not self.pending[name]:
            del self.pending[name]
        self._refuse(name, sock)

    @staticmethod
    def _refuse(name: str, sock: socket.socket) -> None:
        sock.close()  # a listener this worker does not run: the client sees the connection end
        log.warning("a handed connection was closed: this worker runs no such listener",
                    extra={"listener": name[:64]})


BALANCER: Balancer | None = None


def join(index: int, environ: dict[str, str] | None = None) -> Balancer | None:
    """This worker's balancer, where its supervisor made the directory (``DIRECTORY_ENV``); None otherwise."""
    global BALANCER
    directory = (environ if environ is not None else os.environ).get(DIRECTORY_ENV)
    if not directory or BALANCER is not None:
        return BALANCER
    BALANCER = Balancer(Path(directory), index)
    return BALANCER


def leave() -> None:
    global BALANCER
    if BALANCER is not None:
        BALANCER.close()
        BALANCER = None


def opened() -> None:
    """A client connection of this process began (``gatewayd.metrics.connection_opened``)."""
    if BALANCER is not None:
        BALANCER.opened()


def closed() -> None:
    if BALANCER is not None:
        BALANCER.closed()


class BalancedServer:
    """A listener's sockets in this worker, whose accepted connections a lighter sibling may serve instead;
    ``serve`` serves one here (the listener's own accept path for an accepted socket)."""

    def __init__(self, name: str, serve: Callable[[socket.socket], Awaitable[Any]], sockets: list[socket.socket],
                 balancer: Balancer) -> None:
        self.name = name
        self.serve = serve
        self.sockets = sockets
        self.balancer = balancer
        self.tasks: set[asyncio.Task[Any]] = set()
        balancer.take(name, self.adopt)
        loop = asyncio.get_running_loop()
        self._accepting = [loop.create_task(self._accept(sock), name=f"{name} accept") for sock in sockets]

    def adopt(self, sock: socket.socket) -> None:
        """Serve ``sock`` here, as the listener's own accepted connection."""
        sock.setblocking(False)
        self.balancer.accepted()
        task = asyncio.get_running_loop().create_task(self._serve(sock))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _serve(self, sock: socket.socket) -> None:
        try:
            await self.serve(sock)
        except Exception as exc:  # it ended before or while its proxy took it (a handshake that failed)
            sock.close()
            log.warning("a connection ended as it was taken", extra={"listener": self.name, "error": repr(exc)})
            # as its proxy counts one that opens and closes: the count ends right whether the proxy got to count
            # it or not (``accepted`` reserved it)
            self.balancer.opened()
            self.balancer.closed()

    async def _accept(self, listening: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listening)
            except (ConnectionAbortedError, InterruptedError):
                continue
            except OSError as exc:  # out of descriptors: as asyncio's own accept loop, wait and go on
                log.error("accept failed", extra={"listener": self.name, "error": str(exc)})
                await asyncio.sleep(1.0)
                continue
            if not self.balancer.hand(self.name, sock):
                self.adopt(sock)

    def close(self) -> None:
        """Stop accepting (connections in progress go on); connections handed here later are refused."""
        if self.balancer.adopters.get(self.name) == self.adopt:
            del self.balancer.adopters[self.name]
            if not self.balancer.adopters:
                self.balancer.retire()
        for task in self._accepting:
            task.cancel()
        for sock in self.sockets:
            sock.close()

    async def wait_closed(self) -> None:
        await asyncio.gather(*self._accepting, return_exceptions=True)


def balanced(reuse_port: bool) -> bool:
    """Whether a listener started with ``reuse_port`` accepts through this module (a worker among siblings)."""
    return BALANCER is not None and reuse_port


async def listen(name: str, serve: Callable[[socket.socket], Awaitable[Any]], host: str | None, port: int, *,
                 backlog: int = 100) -> BalancedServer:
    """The listener ``name``'s sockets in this worker (``balanced``), as asyncio makes them: one per address ``host``
    resolves to, IPv6 ones IPv6 only; each connection accepted is served by ``serve`` here or by a sibling."""
    assert BALANCER is not None
    infos = await asyncio.get_running_loop().getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(backlog)
            sock.setblocking(False)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return BalancedServer(name, serve, sockets, BALANCER)


async def create_server(name: str, factory: Callable[[], asyncio.Protocol], host: str | None, port: int, *,
                        reuse_port: bool = False, backlog: int = 100) -> Any:
    """``loop.create_server`` for the listener ``name``, balanced over the workers where this is one of them."""
    loop = asyncio.get_running_loop()
    if not balanced(reuse_port):
        return await loop.create_server(factory, host or None, port, reuse_address=True,
                                        reuse_port=reuse_port or None, backlog=backlog)
    return await listen(name, partial(loop.connect_accepted_socket, factory), host, port, backlog=backlog)
