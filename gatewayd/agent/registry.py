"""Which agents are connected to this node, the streams they carry, and the dialer that goes through them.

An agent holds one control channel (``Connect``) per gateway node; ``AgentLink`` is one of
them.  To reach a target through an agent, the gateway sends ``Open`` on the link with a new
stream id; the agent dials the target inside its network and opens a ``Tunnel`` naming that
id (the only way a tunnel is accepted: an agent cannot open a stream the gateway did not ask
for).  The tunnel's bytes are relayed to one end of a ``socket.socketpair()``; the other end is
what the proxy gets from ``AgentDialer.open_socket``, as it would get a TCP socket.  When this node has
a tunnel listener (gatewayd.agent.tunnel), ``Open`` names its port and the agent carries the stream
over a TLS connection of its own to it instead, checked as a tunnel is.

When a link is lost, the sessions of the agent's connections are killed first, with an ``e``
event naming the agent (when the agent has no other link left), then the link's streams close.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from gatewayd.agent import agent_pb2 as pb
from gatewayd.dialer import DIAL_TIMEOUT, STREAM_LIMIT, DialError, P, adopt
from gatewayd.models import Agent, rfc3339, utcnow

if TYPE_CHECKING:
    from gatewayd.audit import AuditLog
    from gatewayd.models import Connection
    from gatewayd.sessions import LiveSession, SessionManager
    from gatewayd.store import Store

log = logging.getLogger("gatewayd.agents")

TOKEN_PREFIX = "agt"


def offline_reason(name: str) -> str:
    return f'agent "{name}" is offline'


def lost_reason(name: str) -> str:
    return f'agent "{name}" went offline: its connection to the gateway was lost'


STREAM_REFUSED = "no stream of that id was asked of this agent: only the gateway opens streams"
TOKEN_REFUSED = "the gateway refused this agent's token"
DROP = "agent.drop"  # the bus topic: an agent deleted or its token rotated, on any node: every node cuts its links


class TokenRevoked(Exception):
    """The agent's token was rotated, or the agent deleted, between its channel's token check and its hello."""


@dataclass(slots=True, eq=False)
class AgentLink:
    """One control channel of one agent to this node."""

    agent: Agent
    client_ip: str
    hostname: str = ""
    version: str = ""
    outbox: asyncio.Queue[pb.GatewayMessage] = field(default_factory=asyncio.Queue)
    streams: set[Any] = field(default_factory=set)  # its streams' relays here (pump.CallRelay, pump.Splice): close()
    closing: str = ""  # why the gateway is closing it (deleted, token rotated), "" while it serves
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    lost: asyncio.Future[None] | None = None  # the loss handling, once started (idempotent)

    def close(self, reason: str) -> None:
        """Ask the control channel to end (its handler sees ``closing``)."""
        self.closing = reason
        self.closed.set()


@dataclass(slots=True, eq=False)
class PendingStream:
    link: AgentLink
    connection: str
    answer: asyncio.Future[Any]  # the proxy's end: a socket, or (``transport``) a pump.TunnelTransport when it can be
    transport: bool = False  # the dial takes a transport (``AgentDialer.open_transport``): no socketpair on a tunnel


def matches(agent: Agent, reference: str) -> bool:
    """A connection's ``agent_id`` names its agent by id or by name."""
    return reference in (agent.id, agent.name)


async def _no_peers() -> list[str]:
    return []


class AgentRegistry:
    """The agents connected to this node: presence, stream opening, and loss handling."""

    def __init__(self, store: Store, audit: AuditLog, sessions: SessionManager,
                 peers: Callable[[], Awaitable[list[str]]] | None = None) -> None:
        self.store = store
        self.audit = audit
        self.sessions = sessions
        self.peers = peers or _no_peers  # the other nodes' gRPC URLs, said to each agent in Welcome
        self.links: dict[str, list[AgentLink]] = {}  # by agent id
        self.pending: dict[str, PendingStream] = {}  # by stream id
        self.departing: set[asyncio.Future[None]] = set()  # detaches under way (``depart_all`` waits for them)
        self.tunnel_port = 0  # the tunnel listener's, said in each Open (0: none, streams go over Tunnel calls)
        sessions.cluster.on(DROP, self._on_drop)

    # -- presence

    def links_of(self, org_id: str, reference: str) -> list[AgentLink]:
        for links in self.links.values():
            if links and links[0].agent.org_id == org_id and matches(links[0].agent, reference):
                return links
        return []

    def online(self, org_id: str, reference: str) -> bool:
        return bool(self.links_of(org_id, reference))

    async def attach(self, agent: Agent, client_ip: str, hostname: str, version: str) -> AgentLink:
        """A new control channel: audited; a second live one of the same agent is reported and audited. Its
        link counts from the start, so a rotation or deletion from then on drops it; one before (the hello held
        back meanwhile) is found by storing its presence, which holds only while the token is still the agent's:
        TokenRevoked, the link gone unannounced. A channel lost before this returns (the agent gone mid-hello) is
        detached here, since its handler never gets to."""
        link = AgentLink(agent, client_ip, hostname, version)
        others = self.links.setdefault(agent.id, [])
        others.append(link)
        try:
            await self._announce(link, others)
        except TokenRevoked:
            link.close(TOKEN_REFUSED)
            self._unlink(link)
            raise
        except BaseException:
            await self.detach(link, "the connection to the agent was lost")
            raise
        return link

    async def _announce(self, link: AgentLink, others: list[AgentLink]) -> None:
        agent, client_ip, hostname, version = link.agent, link.client_ip, link.hostname, link.version
        agent.status, agent.hostname, agent.version = "online", hostname, version
        agent.connected_at = agent.updated_at = rfc3339(utcnow())
        if not await self.store.save_agent_presence(agent, ("status", "hostname", "version", "connected_at",
                                                            "updated_at")):
            raise TokenRevoked(TOKEN_REFUSED)
        payload = {"agent": agent.name, "agent_id": agent.id, "hostname": hostname, "version": version}
        await self._audit(agent, "agent.connect", "success", client_ip=client_ip, payload=payload)
        if len(others) > 1:
            addresses = sorted({other.client_ip for other in others})
            message = (f'agent "{agent.name}" has {len(others)} live connections (from {", ".join(addresses)}): '
                       "its token may be in use by another process")
            log.warning("agent connected twice", extra={"agent": agent.name, "connections": len(others),
                                                        "addresses": ",".join(addresses)})
            await self._audit(agent, "agent.duplicate", "failure", client_ip=client_ip, error=message,
                              payload={**payload, "connections": len(others), "addresses": addresses})
        log.info("agent connected", extra={"agent": agent.name, "client": client_ip, "hostname": hostname})

    async def detach(self, link: AgentLink, reason: str) -> None:
        """The control channel ended: sessions killed (last link), streams closed, presence and audit. Idempotent."""
        await asyncio.shield(self._departure(link, reason))

    async def depart_all(self, reason: str) -> None:
        """At stop, once the gRPC server has stopped: every link still here detached with ``reason``, and every
        detach under way finished. The server cancels its calls without waiting for them, so without this their
        departures (audit, "offline" in the store) would run on after the store closed."""
        for links in list(self.links.values()):
            for link in list(links):
                self._departure(link, reason)
        await asyncio.gather(*self.departing)

    def _departure(self, link: AgentLink, reason: str) -> asyncio.Future[None]:
        """The link's one detach (started here the first time, with ``reason``)."""
        if link.lost is None:
            link.lost = asyncio.ensure_future(self._detach(link, reason))
            self.departing.add(link.lost)
            link.lost.add_done_callback(self.departing.discard)
        return link.lost

    def _unlink(self, link: AgentLink) -> bool:
        """The link serves no more: out of the agent's links, its waiting dials failed. Whether others are left."""
        agent = link.agent
        links = self.links.get(agent.id, [])
        if link in links:
            links.remove(link)
        if not links:
            self.links.pop(agent.id, None)
        link.closed.set()
        for pending in list(self.pending.values()):
            if pending.link is link and not pending.answer.done():
                pending.answer.set_exception(DialError(pending.connection, lost_reason(agent.name)))
        return bool(links)

    async def _detach(self, link: AgentLink, reason: str) -> None:
        agent = link.agent
        others = self._unlink(link)
        if not others and not link.closing:
            await self.sessions.kill_where(lambda live: self._through(live, agent), lost_reason(agent.name))
        for relay in list(link.streams):
            relay.close()
        link.streams.clear()
        await self._audit(agent, "agent.disconnect", "success" if link.closing else "failure",
                          client_ip=link.client_ip, error=link.closing or reason,
                          payload={"agent": agent.name, "agent_id": agent.id, "reason": link.closing or reason})
        if not others:
            await self._save_offline(agent)
        log.info("agent disconnected", extra={"agent": agent.name, "client": link.client_ip,
                                              "reason": link.closing or reason})

    @staticmethod
    def _through(live: LiveSession, agent: Agent) -> bool:
        connection = live.connection
        return connection.org_id == agent.org_id and bool(connection.agent_id) and matches(agent, connection.agent_id)

    async def drop_everywhere(self, agent: Agent, reason: str) -> None:
        """``drop`` on every worker and node (an agent holds a link to each): the bus carries it to the others."""
        await self.sessions.cluster.publish(DROP, agent_id=agent.id, org_id=agent.org_id, name=agent.name,
                                            reason=reason)

    async def _on_drop(self, message: dict[str, Any]) -> None:
        agent = Agent(id=str(message.get("agent_id")), org_id=str(message.get("org_id")), name=str(message.get("name")))
        await self.drop(agent, str(message.get("reason") or "the agent was disconnected"))

    async def drop(self, agent: Agent, reason: str) -> int:
        """Disconnect every link of ``agent`` here (deleted, token rotated); its sessions end with ``reason``."""
        links = list(self.links.get(agent.id, []))
        for link in links:
            link.close(reason)
        await self.sessions.kill_where(lambda live: self._through(live, agent), reason)
        for link in links:
            await self.detach(link, reason)
        return len(links)

    # -- streams

    def dialer_for(self, connection: Connection) -> AgentDialer:
        return AgentDialer(self, connection.org_id, connection.agent_id)

    async def open(self, org_id: str, reference: str, host: str, port: int, connection: str,
                   timeout: float, transport: bool = False) -> Any:
        """A socket whose bytes go to ``host:port`` through the agent; DialError at once when it is offline.
        ``transport``: a pump.TunnelTransport instead when the stream comes on a tunnel connection (the caller
        attaches its protocol), still a socket when it comes over a Tunnel call."""
        links = self.links_of(org_id, reference)
        if not links:
            agent = await self.store.get_agent(org_id, reference)
            if agent is None:
                raise DialError(connection, f'no agent "{reference}" in this organization')
            raise DialError(connection, offline_reason(agent.name))
        link = links[-1]  # the newest: an agent that reconnected serves on its new channel
        stream_id = secrets.token_urlsafe(18)
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.pending[stream_id] = PendingStream(link, connection, answer, transport)
        try:
            link.outbox.put_nowait(pb.GatewayMessage(open=pb.Open(
                stream_id=stream_id, host=host, port=port, connection=connection, timeout=timeout,
                tunnel_port=self.tunnel_port)))
            try:
                async with asyncio.timeout(timeout + 2):  # the agent's own dial timeout, and its way back
                    return await answer
            except TimeoutError:
                raise DialError(connection, f'agent "{link.agent.name}" did not answer within {timeout:g} seconds') \
                    from None
        except BaseException:
            # answered in the same turn as the dial gave up (its caller's timeout or cancel): nobody takes the end
            if answer.done() and not answer.cancelled() and answer.exception() is None:
                answer.result().close()
            raise
        finally:
            self.pending.pop(stream_id, None)  # a tunnel answering after this finds its answer cancelled

    def expects(self, token_hash: str) -> bool:
        """Whether a dial of this node waits for a tunnel of the agent whose token has this hash (a tunnel of
        any other caller is refused before the gateway reads anything of it)."""
        return any(not pending.answer.done() and hmac.compare_digest(pending.link.agent.token_hash, token_hash)
                   for pending in self.pending.values())

    def claim(self, stream_id: str, token_hash: str) -> PendingStream | None:
        """The pending stream a tunnel names, if the gateway asked this agent for it (token checked)."""
        pending = self.pending.get(stream_id)
        if pending is None or pending.answer.done():
            return None
        if not hmac.compare_digest(pending.link.agent.token_hash, token_hash):
            return None
        return pending

    # -- records

    async def _audit(self, agent: Agent, action: str, outcome: str, *, client_ip: str = "", error: str = "",
                     payload: dict[str, Any] | None = None) -> None:
        try:
            await self.audit.record(org_id=agent.org_id, actor=None, actor_hint=f"agent {agent.name}", action=action,
                                    resource_type="agents", outcome=outcome, error_message=error,
                                    client_ip=client_ip, payload=payload)
        except Exception:
            log.exception("could not audit an agent event", extra={"agent": agent.name, "action": action})

    async def _save_offline(self, agent: Agent) -> None:
        """Offline in the store, unless its token was rotated since (the new token's agent may be online)."""
        agent.status, agent.disconnected_at = "offline", rfc3339(utcnow())
        agent.updated_at = agent.disconnected_at
        try:
            await self.store.save_agent_presence(agent, ("status", "disconnected_at", "updated_at"))
        except Exception:
            log.exception("could not store an agent's presence", extra={"agent": agent.name})


class AgentDialer:
    """The Dialer of one connection whose target is reached through its agent (gatewayd.dialer)."""

    __slots__ = ("registry", "org_id", "reference")

    def __init__(self, registry: AgentRegistry, org_id: str, reference: str) -> None:
        self.registry = registry
        self.org_id = org_id
        self.reference = reference

    @property
    def route(self) -> str:
        """What pools key their idle connections by besides the address (two networks may share addresses)."""
        return f"agent:{self.org_id}:{self.reference}"

    async def open_socket(self, host: str, port: int, *, connection: str,
                          timeout: float = DIAL_TIMEOUT) -> socket.socket:
        return await self.registry.open(self.org_id, self.reference, host, port, connection, timeout)

    async def open_transport(self, protocol_factory: Callable[[], P], host: str, port: int, *, connection: str,
                             timeout: float = DIAL_TIMEOUT) -> tuple[asyncio.Transport, P]:
        end = await self.registry.open(self.org_id, self.reference, host, port, connection, timeout, transport=True)
        if isinstance(end, socket.socket):  # the stream came over a Tunnel call: a socketpair's end
            return await adopt(end, protocol_factory, connection)
        protocol = protocol_factory()
        end.attach(protocol)
        return end, protocol

    async def open_stream(self, host: str, port: int, *, connection: str, timeout: float = DIAL_TIMEOUT,
                          limit: int = STREAM_LIMIT) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        sock = await self.open_socket(host, port, connection=connection, timeout=timeout)
        try:
            return await asyncio.open_connection(sock=sock, limit=limit)
        except OSError as exc:
            sock.close()
            raise DialError(connection, exc.strerror or type(exc).__name__) from None
