"""Carrying a stream's bytes on a tunnel connection, in the agent's own process or in carrier processes.

One event loop carries about 30k round trips a second at best (bench/README.md, "Through an agent"): an agent
with busy targets needs more than one core.  ``gatewayd agent --workers N`` (N > 1) starts N carrier
processes beside the main one.  The main process keeps what it always did (the control channels, every dial
of a target, the answers to the gateway, the streams that go over Tunnel calls); each stream whose target
answered and whose Open names a tunnel port is handed to a carrier, round robin: the target's connected socket
(passed over a Unix socket, ``SCM_RIGHTS``) with its Open and the node's URL.  The carrier opens the tunnel
connection and carries the bytes (``carry_on_tunnel``, as the main process does with one worker).  A carrier
that cannot reach the tunnel port hands the socket back, and the main process carries that stream over a Tunnel
call (and the node's port is not tried for ``TUNNEL_RETRY``).  The token and the TLS trust reach a carrier over
that socket, never in its command line or environment.

A carrier that dies takes its streams with it (their sessions end; the gateway sees their tunnel connections
cut) and is started again; the main process's end of the socket closing (it stopped, or was killed) ends every
carrier.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import socket
import subprocess
import sys
import time
from typing import Callable

from gatewayd.agent import agent_pb2 as pb
from gatewayd.agent.channel import TUNNEL_RETRY, ChannelError, TunnelDialer
from gatewayd.agent.pump import Splice, StreamBroken, record
from gatewayd.tasks import BackgroundTasks

log = logging.getLogger("gatewayd.agent")

MESSAGE_LIMIT = 64 * 1024  # a control message: JSON with an Open (a host name, a stream id...) or the set-up
RESTART_FIRST = 1.0  # a carrier that died is started again after this, doubling up to RESTART_MAX while it keeps dying
RESTART_MAX = 30.0
STEADY = 10.0  # a carrier that lived this long died of something else than its start: the next wait is RESTART_FIRST
STOP_TIMEOUT = 10.0

HandBack = Callable[[str, pb.Open, socket.socket], None]


async def open_tunnel(tunnels: TunnelDialer, token: str, request: pb.Open, protocol: asyncio.Protocol,
                      first: pb.Frame) -> asyncio.Transport | None:
    """A tunnel connection to the port the Open names, served by ``protocol``, its first record sent (the token
    and ``first``); None when it cannot be made (the stream goes over a Tunnel call: a port the network does
    not let through costs speed, not the stream)."""
    try:
        transport = await tunnels.connect(request.tunnel_port, request.timeout or 10.0, protocol)
    except (OSError, TimeoutError, ChannelError) as exc:
        log.warning(f"cannot reach the gateway's tunnel port: streams go over gRPC for {TUNNEL_RETRY:g} s",
                    extra={"port": request.tunnel_port, "reason": str(exc) or type(exc).__name__})
        tunnels.unreachable()
        return None
    transport.write(record(pb.TunnelStart(token=token, first=first)))
    return transport


async def carry_on_tunnel(tunnels: TunnelDialer, token: str, request: pb.Open, sock: socket.socket) -> bool:
    """The connected target's bytes on a tunnel connection of their own until both ends are done; False (``sock``
    untouched) when the tunnel port cannot be reached."""
    splice = Splice()
    try:
        opened = await open_tunnel(tunnels, token, request, splice.framed,
                                   pb.Frame(stream_id=request.stream_id, connected=True))
    except BaseException:
        sock.close()
        raise
    if opened is None:
        return False
    try:
        try:
            await splice.attach(sock)
        except BaseException:
            sock.close()
            raise
        await splice.run()  # a target's reset ends this stream only
    except (StreamBroken, OSError) as exc:
        log.info("stream ended by the gateway", extra={"connection": request.connection,
                                                       "reason": str(exc) or type(exc).__name__})
    finally:
        splice.close()
    return True


def _next_message(sock: socket.socket) -> tuple[bytes, list[int]] | None:
    """The next message on a carrier's socket and the descriptors that came with it; None when none is waiting,
    ``(b"", [])`` once the other end closed."""
    try:
        data, fds, _, _ = socket.recv_fds(sock, MESSAGE_LIMIT, 1)
    except BlockingIOError:
        return None
    except OSError:
        return b"", []
    return data, fds


def _message(payload: dict[str, str]) -> bytes:
    return json.dumps(payload).encode()


def _open_of(payload: dict[str, str]) -> pb.Open:
    return pb.Open.FromString(base64.b64decode(payload["open"]))


def _encoded(request: pb.Open) -> str:
    return base64.b64encode(request.SerializeToString()).decode()


class Carrier:
    """One carrier process, seen from the main one: its process and our end of its socket."""

    def __init__(self, process: subprocess.Popen[bytes], sock: socket.socket) -> None:
        self.process = process
        self.sock = sock
        self.alive = True
        self.started = time.monotonic()


class Carriers:
    """The main process's carriers: started, handed streams round robin, started again when one dies."""

    def __init__(self, count: int, token: str, fingerprint: str, ca_file: str, handed_back: HandBack,
                 log_format: str = "plain", log_level: str = "info") -> None:
        self.count = count
        self.setup = _message({"token": token, "fingerprint": fingerprint, "ca_file": ca_file})
        self.handed_back = handed_back
        self.log_format, self.log_level = log_format, log_level
        self.carriers: list[Carrier | None] = [None] * count
        self.waits = [0.0] * count  # each carrier's last wait before it was started again (the back-off)
        self.turn = 0
        self.stopping = False
        self.restarts = BackgroundTasks("agent carriers")

    async def start(self) -> None:
        for index in range(self.count):
            await self._spawn(index)

    async def _spawn(self, index: int) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            environment = {name: value for name, value in os.environ.items() if name != "GATEWAYD_AGENT_TOKEN"}
            process = await asyncio.to_thread(
                subprocess.Popen, [sys.executable, "-m", "gatewayd.agent.carriers", str(theirs.fileno()),
                                   self.log_format, self.log_level], pass_fds=[theirs.fileno()], env=environment)
        except BaseException:
            ours.close()
            theirs.close()
            raise
        theirs.close()
        ours.setblocking(False)
        ours.send(self.setup)  # the first message; the carrier reads it before anything else
        carrier = Carrier(process, ours)
        self.carriers[index] = carrier
        asyncio.get_running_loop().add_reader(ours, self._readable, index, carrier)
        log.info("carrier process started", extra={"carrier": index, "pid": process.pid})

    def hand(self, url: str, request: pb.Open, sock: socket.socket) -> bool:
        """Hand the stream to the next live carrier (``sock`` is closed here once it is theirs); False when none
        can take it now (the caller carries it)."""
        for _ in range(self.count):
            carrier = self.carriers[self.turn % self.count]
            self.turn += 1
            if carrier is None or not carrier.alive:
                continue
            try:
                socket.send_fds(carrier.sock, [_message({"url": url, "open": _encoded(request)})], [sock.fileno()])
            except OSError:  # its queue is full (a carrier stuck) or it is gone: the next one
                continue
            sock.close()
            return True
        return False

    def _readable(self, index: int, carrier: Carrier) -> None:
        """A stream handed back (the carrier could not reach the tunnel port), or the carrier's end closed."""
        while (received := _next_message(carrier.sock)) is not None:
            data, fds = received
            if not data and not fds:
                self._lost(index, carrier)
                return
            returned = [socket.socket(fileno=fd) for fd in fds]
            try:
                payload = json.loads(data)
                request = _open_of(payload)
            except (ValueError, KeyError):
                for sock in returned:
                    sock.close()
                continue
            if returned:
                returned[0].setblocking(False)
                self.handed_back(str(payload.get("url", "")), request, returned[0])
            for sock in returned[1:]:
                sock.close()

    def _lost(self, index: int, carrier: Carrier) -> None:
        """A carrier's end closed: it is started again, at once after a long life, later and later while it keeps
        dying young (a crash at its start is not retried every second for good)."""
        carrier.alive = False
        asyncio.get_running_loop().remove_reader(carrier.sock)
        carrier.sock.close()
        if self.stopping:
            return
        young = time.monotonic() - carrier.started < STEADY
        delay = min(max(self.waits[index] * 2, RESTART_FIRST), RESTART_MAX) if young else RESTART_FIRST
        self.waits[index] = delay
        log.warning("a carrier process ended: the streams it carried ended with it; it is started again",
                    extra={"carrier": index, "pid": carrier.process.pid, "in_seconds": delay})
        self.restarts.spawn(self._restart(index, carrier, delay))

    async def _restart(self, index: int, carrier: Carrier, delay: float) -> None:
        await asyncio.to_thread(carrier.process.wait)
        await asyncio.sleep(delay)
        if self.stopping:
            return
        try:
            await self._spawn(index)
        except OSError as exc:
            log.error("cannot start a carrier process", extra={"carrier": index, "error": str(exc)})
            self.restarts.spawn(self._restart(index, carrier, min(delay * 2, RESTART_MAX)))

    async def stop(self) -> None:
        """Every carrier ends (its socket's end closes: it closes its streams and exits); waited for, bounded."""
        self.stopping = True
        await self.restarts.cancel()
        carriers = [carrier for carrier in self.carriers if carrier is not None]
        for carrier in carriers:
            if carrier.alive:
                carrier.alive = False
                asyncio.get_running_loop().remove_reader(carrier.sock)
                carrier.sock.close()

        def wait(process: subprocess.Popen[bytes]) -> None:
            try:
                process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

        await asyncio.gather(*(asyncio.to_thread(wait, carrier.process) for carrier in carriers))


# -- the carrier process


class _Carrying:
    """A carrier process's state: its socket to the main process, the set-up it was sent, its streams."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.token = self.fingerprint = self.ca_file = ""
        self.dialers: dict[str, TunnelDialer | None] = {}
        self.streams = BackgroundTasks("agent carrier")
        self.ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def readable(self) -> None:
        while (received := _next_message(self.sock)) is not None:
            data, fds = received
            if not data and not fds:  # the main process is gone or stopping
                if not self.ended.done():
                    self.ended.set_result(None)
                return
            try:
                payload = json.loads(data)
            except ValueError:
                payload = {}
            if "token" in payload:
                self.token, self.fingerprint, self.ca_file = payload["token"], payload["fingerprint"], payload["ca_file"]
            elif fds and "open" in payload:
                target = socket.socket(fileno=fds[0])
                target.setblocking(False)
                self.streams.spawn(self.carry(str(payload["url"]), _open_of(payload), target))
                fds = fds[1:]
            for fd in fds:
                socket.socket(fileno=fd).close()

    async def carry(self, url: str, request: pb.Open, target: socket.socket) -> None:
        if url not in self.dialers:
            self.dialers[url] = TunnelDialer.of(url, self.fingerprint, self.ca_file)
        tunnels = self.dialers[url]
        if tunnels is not None and await carry_on_tunnel(tunnels, self.token, request, target):
            return
        try:  # the tunnel port cannot be reached from here: the main process carries it over a Tunnel call
            socket.send_fds(self.sock, [_message({"url": url, "open": _encoded(request)})], [target.fileno()])
        except OSError as exc:
            log.warning("could not hand a stream back to the agent's main process",
                        extra={"connection": request.connection, "error": str(exc)})
        finally:
            target.close()


async def _carrier(sock: socket.socket) -> None:
    sock.setblocking(False)
    carrying = _Carrying(sock)
    loop = asyncio.get_running_loop()
    loop.add_reader(sock, carrying.readable)
    try:
        await carrying.ended
    finally:
        loop.remove_reader(sock)
        await carrying.streams.cancel()


def main(argv: list[str]) -> int:
    """``python -m gatewayd.agent.carriers FD LOG_FORMAT LOG_LEVEL``: started by the agent's main process only."""
    from gatewayd import logs

    fd, log_format, log_level = int(argv[0]), argv[1], argv[2]
    logs.configure(log_format, log_level)
    carrying = _carrier(socket.socket(fileno=fd))
    try:  # the loop the agent's main process runs (gatewayd.cli.run_loop)
        import uvloop
    except ImportError:
        asyncio.run(carrying)
    else:
        uvloop.run(carrying)
    return 0


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C stops the main process, which ends us
    raise SystemExit(main(sys.argv[1:]))
