"""The proxy manager: a user's local client (``gatewayd proxy-manager``) that opens local ports for connections.

The user's process holds a ``Manage`` channel, authenticated with the user's own bearer token.
``POST /api/proxymanager/connect`` issues a credential of that user on the connection and sends
``Listen {port, secret}``; the process opens ``127.0.0.1:port`` and forwards each local client
over a ``Forward`` call.  The gateway reads the client's opening with the protocol's
``forward_opening`` (the credential put in place: PostgreSQL's start-up user), then relays it to
its own listener of that protocol, so the session is the user's, recorded and guarded as any.

Each call is refused as the agents' are (``Refuse``: the server's audited, throttled refusal): an unknown token, a
hello that does not come within ``HELLO_TIMEOUT`` or names its host in more than ``AGENT_TEXT_LIMIT`` characters
(``proxymanager.refused``), a Forward naming no open port of the user's (``proxymanager.forward_refused``). A
forwarding's credential is checked at each Forward with the client's own address (``access.resolve``, its refusal
audited as the protocol's login and counted against that address): the gateway's own listener, which the bytes reach
next, sees only the gateway's loopback, so one user's refused clients there would throttle every user's.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import grpc

from gatewayd import protocols
from gatewayd.access import AccessDenied
from gatewayd.agent import agent_pb2 as pb
from gatewayd.agent.pump import pump
from gatewayd.agent.server import (FIRST_FRAME_TIMEOUT, HELLO_TIMEOUT, bearer, hello_fault, read_first,
                                   peer_ip, read_message, said)
from gatewayd.config import split_listen
from gatewayd.models import rfc3339, utcnow

if TYPE_CHECKING:
    from gatewayd.access import AccessService
    from gatewayd.identity import Identity
    from gatewayd.models import Connection, User

log = logging.getLogger("gatewayd.proxymanager")

LISTEN_TIMEOUT = 15.0
OPENING_TIMEOUT = 10.0  # a forwarded client's opening (a PostgreSQL start-up) comes within this after its Forward
REFUSED = "proxymanager.refused"  # a Manage call's refusal (audit action)
FORWARD_REFUSED = "proxymanager.forward_refused"  # a Forward call's
Refuse = Callable[..., Awaitable[None]]  # AgentService._refuse: audit entry (throttled per address), then the status


class ManagerError(Exception):
    """What the API answers when a connect or disconnect cannot be done (``status``, ``message``)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(slots=True, eq=False)
class Forwarding:
    """One open local port of a user's proxy manager."""

    listen_id: str
    connection: Connection
    port: int
    bind: str
    secret: str
    credential_id: str
    session_id: str  # the credential's (what revokes it)
    since: str

    def json(self) -> dict[str, Any]:
        return {"connection_name": self.connection.name, "connection_subtype": self.connection.subtype,
                "port": self.port, "bind": self.bind, "since": self.since}


@dataclass(slots=True, eq=False)
class ManagerLink:
    """One user's connected proxy manager."""

    user: User
    hostname: str
    connected_at: str
    outbox: asyncio.Queue[pb.ManagerCommand] = field(default_factory=asyncio.Queue)
    results: dict[str, asyncio.Future[pb.ListenResult]] = field(default_factory=dict)
    forwardings: dict[str, Forwarding] = field(default_factory=dict)  # by connection name
    gone: asyncio.Future[None] | None = None  # its forwardings' revocation, once started


class ManagerService:
    """The gateway's side: users' Manage channels, the API's connect/disconnect/status, Forward calls."""

    def __init__(self, identity: Identity, access: AccessService, server_config: Callable[[], dict[str, Any]]) -> None:
        self.identity = identity
        self.access = access
        self.server_config = server_config
        self.links: dict[str, ManagerLink] = {}  # by user id
        self.live: set[ManagerLink] = set()  # every connected one (a user's older one too, until it ends)
        self.departing: set[asyncio.Future[None]] = set()  # revocations under way (``depart_all`` waits for them)

    async def _user(self, context: grpc.aio.ServicerContext, refuse: Refuse, action: str) -> User:
        try:
            return await self.identity.authenticate(bearer(context))
        except Exception:
            await refuse(context, grpc.StatusCode.UNAUTHENTICATED, "access denied: a user's bearer token is needed",
                         action, actor_hint="proxy manager (unknown token)", resource_type="proxymanager")
            raise

    @staticmethod
    async def _refuse(refuse: Refuse, context: grpc.aio.ServicerContext, user: User, code: grpc.StatusCode,
                      message: str, action: str) -> None:
        await refuse(context, code, message, action, user.org_id, actor=user, resource_type="proxymanager")

    # -- the user's channel

    async def manage(self, context: grpc.aio.ServicerContext, refuse: Refuse) -> None:
        user = await self._user(context, refuse, REFUSED)
        first = await read_first(context, HELLO_TIMEOUT)
        fault = hello_fault(first, "a proxy manager")
        if fault:
            await self._refuse(refuse, context, user, grpc.StatusCode.INVALID_ARGUMENT, fault, REFUSED)
        link = ManagerLink(user, first.hello.hostname, rfc3339(utcnow()))
        self.links[user.id] = link  # the newest process of a user is the one the API drives
        self.live.add(link)
        log.info("proxy manager connected", extra={"user": user.email, "hostname": link.hostname})
        reader = asyncio.ensure_future(self._results(context, link))
        getter: asyncio.Future[Any] | None = None
        try:
            while True:
                getter = asyncio.ensure_future(link.outbox.get())
                done, _ = await asyncio.wait({getter, reader}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    break
                await context.write(getter.result())
        finally:
            reader.cancel()
            if getter is not None:  # cancelled mid-wait: its pending get must not outlive the link
                getter.cancel()
            if self.links.get(user.id) is link:
                del self.links[user.id]
            for future in link.results.values():
                if not future.done():
                    future.set_exception(ManagerError(502, "the proxy manager went away"))
            log.info("proxy manager disconnected", extra={"user": user.email})
            # its ports are gone with it: the secrets it held for them must not outlive them
            await asyncio.shield(self._departure(link))

    def _departure(self, link: ManagerLink) -> asyncio.Future[None]:
        """The link's forwardings revoked, once (started here the first time)."""
        if link.gone is None:
            self.live.discard(link)
            link.gone = asyncio.ensure_future(self._revoke(list(link.forwardings.values())))
            self.departing.add(link.gone)
            link.gone.add_done_callback(self.departing.discard)
        return link.gone

    async def depart_all(self) -> None:
        """At stop, once the gRPC server has stopped: every proxy manager's credentials revoked, those of calls
        that ended included. The server cancels its calls without waiting for them, so without this their
        revocations would run on after the store closed, and the credentials stay good for their duration."""
        for link in list(self.live):
            self._departure(link)
        await asyncio.gather(*self.departing)

    @staticmethod
    async def _results(context: grpc.aio.ServicerContext, link: ManagerLink) -> None:
        try:
            while (message := await read_message(context)) is not grpc.aio.EOF:
                if message.HasField("result"):
                    future = link.results.get(message.result.listen_id)
                    if future is not None and not future.done():
                        future.set_result(message.result)
        except grpc.aio.AbortError:  # a message that did not parse ended the call (said by read_message)
            pass

    # -- what the API asks

    def status(self, user: User) -> dict[str, Any]:
        link = self.links.get(user.id)
        if link is None:
            return {"status": "disconnected", "hostname": "", "connected_at": "", "forwardings": []}
        return {"status": "connected", "hostname": link.hostname, "connected_at": link.connected_at,
                "forwardings": [f.json() for f in link.forwardings.values()]}

    async def connect(self, user: User, connection: Connection, port: int, bind: str, duration: float) -> Forwarding:
        link = self.links.get(user.id)
        if link is None:
            raise ManagerError(409, "no proxy manager of yours is connected: run `GATEWAYD_TOKEN=<your token> "
                                    "gatewayd proxy-manager --url <grpc_server_url>` on your machine")
        description = protocols.by_subtype(connection.subtype)
        if description is None or description.forward_opening is None and description.forward_serve is None:
            raise ManagerError(422, f"the proxy manager does not forward {connection.subtype} connections yet")
        if connection.name in link.forwardings:
            raise ManagerError(409, f"connection {connection.name!r} is open already on port "
                                    f"{link.forwardings[connection.name].port}")
        if any(f.port == port for f in link.forwardings.values()):
            raise ManagerError(409, f"port {port} is in use by another connection")
        issued = await self.access.issue(user, connection, duration)
        forwarding = Forwarding(secrets.token_urlsafe(18), connection, port, bind, issued.secret,
                                issued.credential.id, issued.credential.session_id, rfc3339(utcnow()))
        answer: asyncio.Future[pb.ListenResult] = asyncio.get_running_loop().create_future()
        link.results[forwarding.listen_id] = answer
        link.outbox.put_nowait(pb.ManagerCommand(listen=pb.Listen(
            listen_id=forwarding.listen_id, connection_name=connection.name, connection_subtype=connection.subtype,
            port=port, bind=bind, secret=issued.secret)))
        try:
            async with asyncio.timeout(LISTEN_TIMEOUT):
                result = await answer
            if not result.ok:  # its words cut as an agent's are: they go to the API's answer, the audit log and the log
                raise ManagerError(502, f"the proxy manager could not open port {port}: {said(result.error)}")
        except BaseException as exc:  # the secret was sent: revoked, as no port carries it
            await asyncio.shield(self._revoke([forwarding]))
            if isinstance(exc, TimeoutError):
                raise ManagerError(504, "the proxy manager did not answer") from None
            raise
        finally:
            link.results.pop(forwarding.listen_id, None)
        link.forwardings[connection.name] = forwarding
        return forwarding

    async def disconnect(self, user: User, connection_name: str | None) -> list[Forwarding]:
        link = self.links.get(user.id)
        if link is None:
            raise ManagerError(409, "no proxy manager of yours is connected")
        names = [connection_name] if connection_name else list(link.forwardings)
        if connection_name and connection_name not in link.forwardings:
            raise ManagerError(404, f"connection {connection_name!r} is not open in your proxy manager")
        closed = [link.forwardings.pop(name) for name in names]
        for forwarding in closed:
            link.outbox.put_nowait(pb.ManagerCommand(unlisten=pb.Unlisten(listen_id=forwarding.listen_id)))
        await self._revoke(closed)
        return closed

    async def _revoke(self, closed: list[Forwarding]) -> None:
        """The credentials of forwardings closed: refused from now on, to the proxy manager that held them and to
        anyone who read them from it."""
        for forwarding in closed:
            try:
                await self.access.store.revoke_credentials(session_id=forwarding.session_id,
                                                           revoked_at=rfc3339(utcnow()))
            except Exception:  # the store is down: they end with their duration
                log.exception("could not revoke a closed forwarding's credential",
                              extra={"connection": forwarding.connection.name})

    # -- one local client

    async def _serve(self, context: grpc.aio.ServicerContext, serve: Any, forwarding: Forwarding, user: User) -> None:
        """A forwarded client the protocol's proxy serves itself, logged in with the forwarding's credential."""
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        theirs.setblocking(False)
        bridge_reader, bridge_writer = await asyncio.open_connection(sock=ours)
        bridge = asyncio.ensure_future(pump(bridge_reader, bridge_writer, partial(read_message, context), context.write))
        try:
            await _serve_socket(serve, theirs, forwarding, user)
        finally:
            bridge_writer.close()
            await asyncio.gather(bridge, return_exceptions=True)

    async def forward(self, context: grpc.aio.ServicerContext, refuse: Refuse) -> None:
        user = await self._user(context, refuse, FORWARD_REFUSED)
        first = await read_first(context, FIRST_FRAME_TIMEOUT)
        link = self.links.get(user.id)
        forwarding = None
        if first is not grpc.aio.EOF and link is not None:
            forwarding = next((f for f in link.forwardings.values() if f.listen_id == first.stream_id), None)
        if forwarding is None:
            await self._refuse(refuse, context, user, grpc.StatusCode.NOT_FOUND,
                               "no such open port of your proxy manager", FORWARD_REFUSED)
            return
        description = protocols.by_subtype(forwarding.connection.subtype)
        if description is None or description.forward_opening is None and description.forward_serve is None:
            await self._refuse(refuse, context, user, grpc.StatusCode.UNAVAILABLE,
                               "the gateway cannot forward this connection's protocol", FORWARD_REFUSED)
            return
        try:  # here, where the client's address is known (audited with it; its throttle, not the loopback's)
            await self.access.resolve(forwarding.secret, forwarding.connection.subtype, peer_ip(context),
                                      audit_success=False)
        except AccessDenied as exc:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        if description.forward_serve is not None:
            await self._serve(context, description.forward_serve, forwarding, user)
            return
        address = self.server_config().get(description.server_config_key, {}).get("listen_address", "")
        if not address:
            await self._refuse(refuse, context, user, grpc.StatusCode.UNAVAILABLE,
                               f"the gateway's {description.name} listener is stopped", FORWARD_REFUSED)
        host, port = split_listen(address)
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        theirs.setblocking(False)
        bridge_reader, bridge_writer = await asyncio.open_connection(sock=ours)
        client_reader, client_writer = await asyncio.open_connection(sock=theirs)
        bridge = asyncio.ensure_future(pump(bridge_reader, bridge_writer, partial(read_message, context), context.write))
        try:
            opened = False
            try:
                assert description.forward_opening is not None  # (checked above: one of the two is set)
                async with asyncio.timeout(OPENING_TIMEOUT):  # a client that says nothing holds nothing for longer
                    opening = await description.forward_opening(client_reader, client_writer, forwarding.secret)
                opened = True
                target_reader, target_writer = await asyncio.open_connection(
                    "127.0.0.1" if host in ("", "0.0.0.0", "::") else host, port)
            except (ValueError, OSError, asyncio.IncompleteReadError) as exc:
                status, reason = grpc.StatusCode.INVALID_ARGUMENT, f"the forwarded client was refused: {exc}"
                if opened:
                    status, reason = grpc.StatusCode.UNAVAILABLE, f"the gateway's {description.name} listener is down"
                elif isinstance(exc, TimeoutError):
                    reason = f"the forwarded client sent no opening within {OPENING_TIMEOUT:g} s"
                log.info("proxy manager client refused", extra={"user": user.email, "reason": reason})
                client_writer.close()
                bridge_writer.close()
                # the call ends now (its end closes the local client): waiting for the local client's side to end
                # too, as a relay does, held a call and a socket of the gateway for as long as the client stayed
                await context.abort(status, reason)
            target_writer.write(opening)
            await asyncio.gather(_copy(client_reader, target_writer), _copy(target_reader, client_writer))
        finally:
            client_writer.close()
            await asyncio.gather(bridge, return_exceptions=True)


async def _serve_socket(serve: Any, sock: socket.socket, forwarding: Forwarding, user: User) -> None:
    try:
        await serve(sock, forwarding.secret)
    except (ValueError, OSError, asyncio.IncompleteReadError, ConnectionError) as exc:
        log.info("proxy manager client refused", extra={"user": user.email, "reason": str(exc)})
    finally:
        sock.close()


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One direction of a local relay, half-closing the other side at its end."""
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if not writer.is_closing() and writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError, RuntimeError):
        writer.close()
