"""The one seam through which every proxy reaches its target.

A proxy never opens a TCP connection to a target itself: it asks a ``Dialer``
for a connected socket (``open_socket``) or an asyncio stream pair
(``open_stream``). A socket is what every client library we drive can adopt:
``loop.create_connection(sock=...)`` (PostgreSQL, the HTTP pool),
``asyncssh.connect(sock=...)`` and Twisted's ``adoptStreamConnection`` (RDP).
An implementation that does not hold a local TCP socket (reaching a target
through an agent) hands out one end of a ``socket.socketpair()`` and relays
the other end over its own stream; the proxies do not see the difference.

Every failure is one ``DialError`` whose message is safe to show the client:
``could not connect to the target of connection "X": <reason>``.
"""

from __future__ import annotations

import asyncio
import os
import socket
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from gatewayd.models import Connection

DIAL_TIMEOUT = 10.0


class DialError(Exception):
    """The target of a connection could not be reached; ``message`` names the connection, never a secret."""

    def __init__(self, connection: str, reason: str) -> None:
        self.connection = connection
        self.reason = reason
        self.message = f'could not connect to the target of connection "{connection}": {reason}'
        super().__init__(self.message)


class Dialer(Protocol):
    """Opens connections to targets on behalf of a named connection."""

    async def open_socket(self, host: str, port: int, *, connection: str,
                          timeout: float = DIAL_TIMEOUT) -> socket.socket:
        """A connected, non-blocking socket to ``host:port``; raises DialError."""
        ...

    async def open_stream(self, host: str, port: int, *, connection: str,
                          timeout: float = DIAL_TIMEOUT) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """An asyncio stream pair to ``host:port``; raises DialError."""
        ...


class Routes(Protocol):
    """Where connections that name an agent are dialled from (gatewayd.agent.registry.AgentRegistry)."""

    def dialer_for(self, connection: Connection) -> Dialer:
        """The dialer that reaches ``connection``'s target through its agent."""
        ...


class DirectDialer:
    """Reaches targets with a direct TCP connection from this process."""

    route = ""  # what pools key idle connections by besides the address (an agent's dialer: its agent)

    async def open_socket(self, host: str, port: int, *, connection: str,
                          timeout: float = DIAL_TIMEOUT) -> socket.socket:
        """A connected, non-blocking socket to ``host:port``; raises DialError."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                last: OSError | None = None
                for family, kind, proto, _, address in infos:
                    sock = socket.socket(family, kind, proto)
                    sock.setblocking(False)
                    try:
                        await loop.sock_connect(sock, address)
                    except OSError as exc:
                        sock.close()
                        last = exc
                        continue
                    except BaseException:
                        sock.close()
                        raise
                    if family in (socket.AF_INET, socket.AF_INET6):
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    return sock
                if last is None:
                    raise DialError(connection, "its host has no address")
                raise last
        except TimeoutError:
            raise DialError(connection, f"no answer within {timeout:g} seconds") from None
        except socket.gaierror as exc:
            raise DialError(connection, f"unknown host ({exc.strerror or exc})") from None
        except OSError as exc:
            raise DialError(connection, _reason(exc)) from None

    async def open_stream(self, host: str, port: int, *, connection: str,
                          timeout: float = DIAL_TIMEOUT) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """An asyncio stream pair to ``host:port``; raises DialError."""
        sock = await self.open_socket(host, port, connection=connection, timeout=timeout)
        try:
            return await asyncio.open_connection(sock=sock)
        except OSError as exc:
            sock.close()
            raise DialError(connection, _reason(exc)) from None


def through_agent(dialer: object) -> bool:
    """Whether ``dialer`` reaches its targets through an agent (its ``route`` is not empty): the bytes then cross a
    process inside the target's network that could answer as the target itself, so a target is verified before
    any secret is sent to it (proxies/postgres/upstream.py, proxies/ssh/target.py)."""
    return bool(getattr(dialer, "route", ""))


def reason_of(exc: OSError) -> str:
    """The system's words for a failed connect ("connection refused"), never the address asyncio adds."""
    if isinstance(exc, socket.gaierror):
        return f"unknown host ({exc.strerror or exc})"
    text = os.strerror(exc.errno) if exc.errno else type(exc).__name__
    return text[:1].lower() + text[1:]


_reason = reason_of


direct = DirectDialer()
"""The process's default dialer (direct TCP)."""
