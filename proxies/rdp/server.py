"""The RDP listener: pyrdp's man-in-the-middle served by Twisted's reactor on the daemon's loop.

``start`` is the listener factory registered as ``rdp``. It puts the reactor
on the running loop first (``reactor.ensure_reactor``), and only then imports
pyrdp (``proxies.rdp.mitm``), which would otherwise install a reactor of its
own. Each accepted connection is one ``mitm.GatewayMITM``. The workers of one
``gatewayd run`` share the address: the socket is made here with SO_REUSEPORT
and handed to the reactor.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import TYPE_CHECKING, Any

from proxies.rdp.reactor import ensure_reactor

if TYPE_CHECKING:
    from gatewayd.pipeline import ProxyContext
    from gatewayd.tasks import BackgroundTasks

log = logging.getLogger("gatewayd.rdp")


class RDPListener:
    """A started RDP listener; ``close`` stops accepting (sessions in progress go on)."""

    def __init__(self, port: Any, tasks: BackgroundTasks) -> None:
        self.port = port
        self.tasks = tasks  # its connections' background work (admissions, closes, screen captures)

    async def close(self) -> None:
        from twisted.internet.defer import Deferred

        result = self.port.stopListening()
        if isinstance(result, Deferred):
            await Deferred.asFuture(result, asyncio.get_running_loop())


async def start(context: ProxyContext, host: str, port: int) -> RDPListener:
    """Listener factory registered as ``rdp``; of ``gateway`` it uses only its ProxyContext."""
    reactor = ensure_reactor()
    from proxies.rdp.mitm import GatewayMITMFactory

    factory = GatewayMITMFactory(context)
    await factory.prepare()
    if context.reuse_port:  # Twisted's listenTCP has no SO_REUSEPORT: it adopts a socket made here instead
        with shared_socket(host, port) as sock:
            listening = reactor.adoptStreamPort(sock.fileno(), sock.family, factory)  # it keeps a duplicate
    else:
        listening = reactor.listenTCP(port, factory, interface=host)
    return RDPListener(listening, factory.tasks)


def shared_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` with SO_REUSEPORT, so that every worker can bind the address."""
    family, kind, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock
