"""The one seam through which every proxy reaches its target.

A proxy never opens a TCP connection to a target itself: it asks a ``Dialer``
for a connected socket (``open_socket``) or an asyncio stream pair
(``open_stream``). A socket is what every client library we drive can adopt:
``loop.create_connection(sock=...)`` (PostgreSQL, the HTTP pool),
``asyncssh.connect(sock=...)`` and Twisted's ``adoptStreamConnection`` (RDP).
An implementation that does not hold a local TCP socket (reaching a target
through an agent) hands out one end of a ``socket.socketpair()`` and relays
the other end over its own stream; the proxies do not see the difference.
A proxy that starts no TLS of its own on the connection may ask for a
transport instead (``open_transport``): an agent's dialer then serves it on
its tunnel connection's own end, with no socketpair between.

Every failure is one ``DialError`` whose message is safe to show the client:
``could not connect to the target of connection "X": <reason>``.

A ``DirectDialer`` may hold an ``AddressPolicy``: each address a name resolves to is checked before the
socket connects to that very address (so a name that resolves again differently changes nothing), and an
address the policy refuses is never connected to. ``DialerConnector`` gives aiohttp clients the same dial.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, TypeVar

from aiohttp import ClientConnectorError, TCPConnector
from aiohttp.abc import AbstractResolver, ResolveResult

if TYPE_CHECKING:
    from gatewayd.models import Connection

DIAL_TIMEOUT = 10.0
STREAM_LIMIT = 1 << 16  # what asyncio.open_connection buffers by default
P = TypeVar("P", bound=asyncio.BaseProtocol)


class DialError(Exception):
    """The target of a connection could not be reached; ``message`` names the connection, never a secret."""

    def __init__(self, connection: str, reason: str) -> None:
        self.connection = connection
        self.reason = reason
        self.message = f'could not connect to the target of connection "{connection}": {reason}'
        super().__init__(self.message)


class AddressRefused(DialError):
    """Every address the host resolved to is one the dialer's policy refuses: nothing was connected to; ``kind``
    says which kind of address (``a loopback address``), never the address."""

    def __init__(self, connection: str, kind: str) -> None:
        super().__init__(connection, f"its host is {kind}, which this organization's connections may not reach "
                                     "from the gateway")
        self.kind = kind


class Dialer(Protocol):
    """Opens connections to targets on behalf of a named connection."""

    async def open_socket(self, host: str, port: int, *, connection: str,
                          timeout: float = DIAL_TIMEOUT) -> socket.socket:
        """A connected, non-blocking socket to ``host:port``; raises DialError."""
        ...

    async def open_transport(self, protocol_factory: Callable[[], P], host: str, port: int, *, connection: str,
                             timeout: float = DIAL_TIMEOUT) -> tuple[asyncio.Transport, P]:
        """A transport to ``host:port`` served by a new ``protocol_factory()``; raises DialError.  It may not be a
        socket's (an agent's tunnel): ``loop.start_tls`` does not take it, so a caller that upgrades to TLS asks for
        ``open_socket``."""
        ...

    async def open_stream(self, host: str, port: int, *, connection: str, timeout: float = DIAL_TIMEOUT,
                          limit: int = STREAM_LIMIT) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """An asyncio stream pair to ``host:port`` (its reader buffering up to ``limit`` bytes); raises DialError."""
        ...


async def adopt(sock: socket.socket, protocol_factory: Callable[[], P], connection: str) -> tuple[asyncio.Transport, P]:
    """A connected socket as the loop's transport of a new ``protocol_factory()`` (closed on failure); DialError."""
    try:
        return await asyncio.get_running_loop().create_connection(protocol_factory, sock=sock)  # type: ignore[return-value]
    except OSError as exc:
        sock.close()
        raise DialError(connection, reason_of(exc)) from None


class Routes(Protocol):
    """Where connections that name an agent are dialled from (gatewayd.agent.registry.AgentRegistry)."""

    def dialer_for(self, connection: Connection) -> Dialer:
        """The dialer that reaches ``connection``'s target through its agent."""
        ...


_SHARED_ADDRESS_SPACE = ipaddress.ip_network("100.64.0.0/10")  # RFC 6598 (carrier-grade NAT): not in is_private


@dataclass(slots=True, frozen=True)
class AddressPolicy:
    """Where a dial from this host may go: never loopback, link-local (cloud metadata at 169.254.169.254),
    unspecified, multicast or reserved addresses; private ones (RFC 1918, unique-local, shared address
    space, documentation ranges) unless ``allow_private``."""

    allow_private: bool = False

    def refusal(self, address: str) -> str | None:
        """Why ``address`` (an IP address) may not be dialled, or None."""
        try:
            ip = ipaddress.ip_address(address.split("%", 1)[0])
        except ValueError:
            return "not an IP address"
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if ip.is_loopback:
            return "a loopback address"
        if ip.is_link_local:
            return "a link-local address"
        if ip.is_unspecified or ip.is_multicast or ip.is_reserved:
            return "a reserved address"
        if not self.allow_private and (ip.is_private or (ip.version == 4 and ip in _SHARED_ADDRESS_SPACE)):
            return "a private address"
        return None


class DirectDialer:
    """Reaches targets with a direct TCP connection from this process; with a ``policy``, only the addresses
    it allows (checked on each resolved address, right before connecting to it)."""

    def __init__(self, policy: AddressPolicy | None = None, route: str = "") -> None:
        self.policy = policy
        self.route = route  # what pools key idle connections by besides the address (an agent's dialer: its agent)

    async def open_socket(self, host: str, port: int, *, connection: str,
                          timeout: float = DIAL_TIMEOUT) -> socket.socket:
        """A connected, non-blocking socket to ``host:port``; raises DialError."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                last: OSError | None = None
                refused = ""
                for family, kind, proto, _, address in infos:
                    if self.policy is not None and (why := self.policy.refusal(str(address[0]))):
                        refused = refused or why
                        continue
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
                    if refused:
                        raise AddressRefused(connection, refused)
                    raise DialError(connection, "its host has no address")
                raise last
        except TimeoutError:
            raise DialError(connection, f"no answer within {timeout:g} seconds") from None
        except socket.gaierror as exc:
            raise DialError(connection, f"unknown host ({exc.strerror or exc})") from None
        except OSError as exc:
            raise DialError(connection, _reason(exc)) from None

    async def open_transport(self, protocol_factory: Callable[[], P], host: str, port: int, *, connection: str,
                             timeout: float = DIAL_TIMEOUT) -> tuple[asyncio.Transport, P]:
        """A transport to ``host:port`` served by a new ``protocol_factory()``; raises DialError."""
        sock = await self.open_socket(host, port, connection=connection, timeout=timeout)
        return await adopt(sock, protocol_factory, connection)

    async def open_stream(self, host: str, port: int, *, connection: str, timeout: float = DIAL_TIMEOUT,
                          limit: int = STREAM_LIMIT) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """An asyncio stream pair to ``host:port`` (its reader buffering up to ``limit`` bytes); raises DialError."""
        sock = await self.open_socket(host, port, connection=connection, timeout=timeout)
        try:
            return await asyncio.open_connection(sock=sock, limit=limit)
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


class UnresolvedNames(AbstractResolver):
    """Hands the host name on as it is, for a ``DialerConnector`` whose dialer resolves it (itself, checking each
    address; or an agent, in its own network)."""

    async def resolve(self, host: str, port: int = 0, family: int = socket.AF_INET) -> list[ResolveResult]:
        return [{"hostname": host, "host": host, "port": port, "family": family, "proto": 0, "flags": 0}]

    async def close(self) -> None:
        pass


class RefusedAddressError(ClientConnectorError):
    """aiohttp's connect error for an ``AddressRefused`` dial (``kind``: which kind of address), so that a client
    can tell a policy's refusal, final, from a network failure worth retrying."""

    def __init__(self, connection_key: Any, os_error: OSError, kind: str) -> None:
        super().__init__(connection_key, os_error)
        self.kind = kind


class DialerConnector(TCPConnector):
    """aiohttp's connector reaching its peers through a ``Dialer`` (the HTTP proxy's websockets, AI providers).

    aiohttp has no public hook for an asynchronous dial, so this overrides the one
    method that opens the socket (aiohttp is pinned below 4 in pyproject.toml).
    """

    def __init__(self, dialer: Dialer = direct, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dialer = dialer

    async def _wrap_create_connection(self, *args: Any, addr_infos: Any, req: Any, timeout: Any,
                                      client_error: type[Exception] = ClientConnectorError, **kwargs: Any) -> Any:
        host, port = req.url.raw_host or "", req.url.port or 0
        try:
            sock = await self.dialer.open_socket(host, port, connection=f"{host}:{port}",
                                                 timeout=timeout.sock_connect or DIAL_TIMEOUT)
        except AddressRefused as exc:
            raise RefusedAddressError(req.connection_key, OSError(None, exc.reason), exc.kind) from None
        except DialError as exc:
            raise client_error(req.connection_key, OSError(None, exc.reason)) from None
        try:
            return await self._loop.create_connection(*args, **kwargs, sock=sock)
        except BaseException:
            sock.close()
            raise
