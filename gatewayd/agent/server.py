"""The gateway's gRPC server (``[grpc] listen``, TLS): agents' control channels and tunnels.

Beside it, the tunnel listener (gatewayd.agent.tunnel) carries streams on TLS connections of their
own; ``AgentService.admit`` and ``carry`` serve a stream's opening and bytes for both.

``AgentService`` implements agent.proto's ``AgentGateway`` on grpc.aio.  Every refusal (an
unknown or revoked token, a tunnel the gateway did not ask for) is an audit entry, up to the
address's throttle (counted before anything is written: past it, one ``agent.throttle`` entry and
no more); connects and disconnects are audited by the registry.  A call is refused before the
gateway reads from it unless its token is one the gateway waits for, and what it must send first
comes within a short deadline, so calls that send nothing hold nothing.  A message that does not
parse ends its call with INVALID_ARGUMENT and one info line.  The proxy manager's two calls are served by the
``ManagerService`` the server is given (gatewayd.agent.manager), when it has one, under the same throttle, and its
refusals are audited the same way (``refusal``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable
from urllib.parse import unquote

import grpc
from google.protobuf.message import DecodeError

from gatewayd import __version__, tls
from gatewayd.agent import agent_pb2 as pb
from gatewayd.agent import agent_pb2_grpc as pb_grpc
from gatewayd.agent.pump import CallRelay, Splice, StreamBroken, StreamFailed
from gatewayd.agent.registry import (STREAM_REFUSED, TOKEN_PREFIX, TOKEN_REFUSED, AgentRegistry, PendingStream,
                                     TokenRevoked)
from gatewayd.agent.tunnel import TunnelListener
from gatewayd.crypto import hash_secret
from gatewayd.dialer import DialError
from gatewayd.throttle import Throttle

if TYPE_CHECKING:
    from gatewayd.audit import AuditLog
    from gatewayd.models import User
    from gatewayd.store import Store

log = logging.getLogger("gatewayd.grpc")

HELLO_TIMEOUT = 15.0  # an agent's hello comes within this after its Connect (a proxy manager's after its Manage)
AGENT_TEXT_LIMIT = 255  # characters of what an agent says (a hello's hostname and version, a dial's error), a DNS
# name's bound: stored, audited, logged, recorded and said to clients as the agent's words
FIRST_FRAME_TIMEOUT = 10.0  # a Tunnel's first frame (the agent's answer to an Open) comes within this
CUT_GRACE = 2.0  # a cut tunnel connection waits this long for its agent's link to be found lost too (_cut_alone)
PEERS_REFRESH = 30.0  # how often an agent's channel is told the nodes up again (Welcome)
CERT_BASE = "grpc-tls"
SERVER_OPTIONS = [
    ("grpc.http2.min_ping_interval_without_data_ms", 1_000),  # agents may ping this often (their --keepalive)
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 4 * 1024 * 1024),
    # grpc binds with SO_REUSEPORT by default: a second process on the same address would take a share of
    # the agents silently, and a session on one could not reach an agent held by the other. Refused instead.
    ("grpc.so_reuseport", 0),
]


def keepalive_options(interval: float) -> list[tuple[str, int]]:
    """Ping every ``interval`` seconds; a link whose ping is not answered within min(interval, 10 s) is dead.

    A killed agent's link closes at once (its TCP connection); a network cut is found this way.
    """
    milliseconds = max(int(interval * 1000), 1000)
    return [("grpc.keepalive_time_ms", milliseconds), ("grpc.keepalive_timeout_ms", min(milliseconds, 10_000))]


def bearer(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            scheme, _, token = str(value).partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return ""


def peer_ip(context: grpc.aio.ServicerContext) -> str:
    """``ipv4:1.2.3.4:5`` / ``ipv6:%5B::1%5D:5`` (gRPC's URI form, brackets escaped) as the address alone."""
    peer = unquote(context.peer() or "")
    kind, _, rest = peer.partition(":")
    if kind == "ipv6":
        return rest.rpartition(":")[0].strip("[]")
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    return rest


async def read_message(context: grpc.aio.ServicerContext) -> Any:
    """The call's next message (``grpc.aio.EOF`` at its end). One that does not parse ends the call with
    INVALID_ARGUMENT and an info line: a peer's junk is not the gateway's error (grpc.aio would log a traceback
    at error level and answer UNKNOWN)."""
    try:
        return await context.read()
    except DecodeError:
        log.info("malformed gRPC message", extra={"client": peer_ip(context), "reason": "it does not parse"})
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a message of this call does not parse")


async def read_first(context: grpc.aio.ServicerContext, timeout: float) -> Any:
    """The call's first message, or ``grpc.aio.EOF`` when none came within ``timeout`` seconds: a call that sends
    nothing holds nothing for longer."""
    try:
        async with asyncio.timeout(timeout):
            return await read_message(context)
    except TimeoutError:
        return grpc.aio.EOF


def hello_fault(first: Any, who: str = "an agent") -> str:
    """Why a Connect's (or a Manage's: ``who``) first message is refused as its hello, or "": what it says of the
    agent is stored, audited and logged at each connect, so it is bounded (a hostname of megabytes once went into
    each; a proxy manager's is kept and shown by the API)."""
    if first is grpc.aio.EOF or not first.HasField("hello"):
        return f"{who} says hello first"
    if max(len(first.hello.hostname), len(first.hello.version)) > AGENT_TEXT_LIMIT:
        return f"{who}'s hello names its host and version in at most {AGENT_TEXT_LIMIT} characters each"
    return ""


def said(text: str) -> str:
    """An agent's words as the gateway repeats them: at most ``AGENT_TEXT_LIMIT`` characters (a Tunnel call's
    message may be megabytes; it once went whole into the client's error, the log and the session's recording)."""
    return text if len(text) <= AGENT_TEXT_LIMIT else text[:AGENT_TEXT_LIMIT] + "…"


class AgentService(pb_grpc.AgentGatewayServicer):  # type: ignore[misc]  # (generated, untyped)
    """The AgentGateway service: ``Connect`` and ``Tunnel`` for agents; ``Manage``/``Forward`` handed on."""

    def __init__(self, registry: AgentRegistry, store: Store, audit: AuditLog, manager: Any = None,
                 throttle: Throttle | None = None) -> None:
        self.registry = registry
        self.store = store
        self.audit = audit
        self.manager = manager
        self.throttle = throttle or Throttle(0, 0)  # refused calls per client address (the proxies' own)

    def throttled(self, client_ip: str) -> str:
        """Why a call or tunnel connection from this address is refused at once (past its refusals), or ""."""
        wait = self.throttle.retry_after(f"address:{client_ip}")
        return f"too many refused calls from this address: try again in {math.ceil(wait)} s" if wait else ""

    async def _throttled(self, context: grpc.aio.ServicerContext) -> bool:
        """Refuse a call from an address past its refusals (no token lookup, no audit entry each: one was
        written when the throttle began), as the proxies refuse its credentials."""
        message = self.throttled(peer_ip(context))
        if message:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        return bool(message)

    async def _refuse(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str, action: str,
                      org_id: str = "", actor_hint: str = "agent (unknown token)", *, actor: User | None = None,
                      resource_type: str = "agents", **payload: Any) -> None:
        """Refuse the call: ``refusal``'s audit entry, then the status."""
        await self.refusal(peer_ip(context), message, action, org_id, actor_hint, actor=actor,
                           resource_type=resource_type, **payload)
        await context.abort(code, message)

    async def refusal(self, client_ip: str, message: str, action: str, org_id: str = "",
                      actor_hint: str = "agent (unknown token)", *, actor: User | None = None,
                      resource_type: str = "agents", **payload: Any) -> None:
        """A refused call or tunnel connection: an audit entry, unless its address is past its refusals (counted
        first, so a flood writes one ``agent.throttle`` entry, not a row per call: calls admitted before the
        throttle began end here too)."""
        address = f"address:{client_ip}"
        if self.throttle.retry_after(address):
            return
        newly = self.throttle.failed(address)
        org_id = org_id or (await self.store.default_org()).id
        await self.audit.record(org_id=org_id, actor=actor, actor_hint=actor_hint, action=action,
                                resource_type=resource_type, outcome="failure", error_message=message,
                                client_ip=client_ip, payload=payload or None)
        log.warning("agent refused", extra={"client": client_ip, "reason": message})
        if newly:
            await self.audit.record(
                org_id=org_id, actor=None, action="agent.throttle", resource_type="agents", outcome="failure",
                client_ip=client_ip, error_message=f"too many refused calls from {client_ip}: refused for "
                                                   f"{int(self.throttle.window)} s", payload={"throttled": [address]})

    async def Connect(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:  # noqa: N802
        if await self._throttled(context):
            return
        token = bearer(context)
        agent = await self.store.agent_by_token(hash_secret(token)) if token.startswith(f"{TOKEN_PREFIX}-") else None
        if agent is None:
            await self._refuse(context, grpc.StatusCode.UNAUTHENTICATED, TOKEN_REFUSED, "agent.refused")
            return
        first = await read_first(context, HELLO_TIMEOUT)
        fault = hello_fault(first)
        if fault:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, fault, "agent.refused", agent.org_id,
                               f"agent {agent.name}", agent=agent.name)
            return
        try:
            link = await self.registry.attach(agent, peer_ip(context), first.hello.hostname, first.hello.version)
        except TokenRevoked:  # rotated or deleted while the hello was awaited
            await self._refuse(context, grpc.StatusCode.PERMISSION_DENIED, TOKEN_REFUSED, "agent.refused",
                               agent.org_id, f"agent {agent.name}", agent=agent.name)
            return
        reason = "the agent closed its connection"
        reader = asyncio.ensure_future(self._until_eof(context))
        closed = asyncio.ensure_future(link.closed.wait())
        getter: asyncio.Future[Any] | None = None
        try:
            await context.write(await self._welcome(agent))
            while True:
                getter = asyncio.ensure_future(link.outbox.get())
                done, _ = await asyncio.wait({getter, closed, reader}, timeout=PEERS_REFRESH,
                                             return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    await context.write(getter.result())
                    continue
                getter.cancel()
                if not done:  # a node that joined since is said to the agent, which connects to it too
                    await context.write(await self._welcome(agent))
                    continue
                break
            if link.closing:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, link.closing)
        except asyncio.CancelledError:
            reason = "the connection to the agent was lost"
            raise
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            reason = f"the connection to the agent failed ({type(exc).__name__})"
        finally:
            reader.cancel()
            closed.cancel()
            if getter is not None:  # cancelled mid-wait: its pending get must not outlive the link
                getter.cancel()
            await self.registry.detach(link, reason)

    async def _welcome(self, agent: Any) -> pb.GatewayMessage:
        return pb.GatewayMessage(welcome=pb.Welcome(agent_id=agent.id, agent_name=agent.name, org_id=agent.org_id,
                                                    peers=await self.registry.peers()))

    @staticmethod
    async def _until_eof(context: grpc.aio.ServicerContext) -> None:
        """Read what the agent sends after its hello (nothing yet) until its side ends."""
        try:
            while await read_message(context) is not grpc.aio.EOF:
                pass
        except grpc.aio.AbortError:  # a message that did not parse ended the call (said by read_message)
            pass

    async def Tunnel(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:  # noqa: N802
        if await self._throttled(context):
            return
        first_frame = partial(read_first, context, FIRST_FRAME_TIMEOUT)
        admitted = await self.admit(peer_ip(context), bearer(context), first_frame)
        if admitted is None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, STREAM_REFUSED)
            return
        await self.carry(*admitted, CallRelay(partial(read_message, context), context.write))

    async def admit(self, client_ip: str, token: str,
                    first_frame: Callable[[], Awaitable[Any]]) -> tuple[PendingStream, Any] | None:
        """A stream's opening (a Tunnel call's or a tunnel connection's): the pending stream its first frame claims
        and that frame, or None, refused (audited, counted against its address). ``first_frame`` is read only when
        a dial of this node waits for a stream of the agent whose token it is: anyone else is refused before a
        byte of theirs is read."""
        token_hash = hash_secret(token)
        if self.registry.expects(token_hash):
            first = await first_frame()
            pending = None if first is grpc.aio.EOF else self.registry.claim(first.stream_id, token_hash)
            if pending is not None:
                return pending, first
        agent = await self.store.agent_by_token(token_hash) if token.startswith(f"{TOKEN_PREFIX}-") else None
        await self.refusal(client_ip, STREAM_REFUSED, "agent.stream_refused", agent.org_id if agent else "",
                           f"agent {agent.name}" if agent else "agent (unknown token)")
        return None

    async def carry(self, pending: PendingStream, first: Any, relay: CallRelay | Splice) -> None:
        """An admitted stream: the dial's answer, then its bytes between a socketpair (the proxy's end is the dial's
        result) and the agent's frames (``relay``: over the Tunnel call or the tunnel connection) until both ends
        are done; a dial that takes a transport gets the tunnel connection's own (``Splice.end``: no socketpair).
        The relay is closed when the agent's link is lost."""
        link, name = pending.link, pending.link.agent.name
        if not first.connected:
            if not pending.answer.done():
                pending.answer.set_exception(DialError(pending.connection,
                                                       f'through agent "{name}": {said(first.error) or "refused"}'))
            return
        if pending.transport and isinstance(relay, Splice):  # the proxy's protocol on the stream itself
            if pending.answer.done():  # the dial gave up meanwhile
                relay.close()
                return
            pending.answer.set_result(relay.end())
        else:
            ours, theirs = socket.socketpair()
            ours.setblocking(False)
            theirs.setblocking(False)
            try:
                await relay.attach(ours)
            except BaseException:
                ours.close()
                theirs.close()
                raise
            if pending.answer.done():  # the dial gave up meanwhile
                relay.close()
                theirs.close()
                return
            pending.answer.set_result(theirs)
        link.streams.add(relay)
        if link.closed.is_set():  # the link was lost while this stream was admitted: its detach has closed the rest
            relay.close()
        broken = ""
        try:
            await relay.run()
        except (StreamBroken, asyncio.CancelledError) as exc:
            broken = str(exc) or "the stream was cut"
            if isinstance(exc, asyncio.CancelledError):
                raise
        except StreamFailed:
            pass  # the target's connection failed at the agent: this stream ends here
        except (ConnectionError, OSError, RuntimeError) as exc:  # the proxy's end failed: the agent closes the target's
            try:
                await relay.fail(f"the gateway's end failed ({type(exc).__name__})")
            except Exception:
                pass
        finally:
            if broken and isinstance(relay, Splice):
                await self._cut_alone(link, name, broken)
            elif broken:  # the agent or its link went away: the sessions end naming it before their sockets close
                await self.registry.detach(link, f"a stream broke off ({broken})")
            link.streams.discard(relay)
            relay.close()

    @staticmethod
    async def _cut_alone(link: Any, name: str, broken: str) -> None:
        """A tunnel connection cut without its end (a reset; a NAT or firewall that forgot it while idle) is one TCP
        connection of its own, not the agent's link: it ends its own stream only. When the agent itself went away,
        its link is found lost at the same moment (the control channel's connection ends with its process): it is
        given ``CUT_GRACE`` to be, before the proxy's end closes, so that its sessions end naming the agent (the
        link's detach), not as a target that closed the connection."""
        try:
            async with asyncio.timeout(CUT_GRACE):
                await link.closed.wait()
            return
        except TimeoutError:
            pass
        log.warning("an agent's tunnel connection was cut; its stream ends, the agent's link stays",
                    extra={"agent": name, "reason": broken})

    async def Manage(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:  # noqa: N802
        if self.manager is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this gateway has no proxy manager service")
        if not await self._throttled(context):
            await self.manager.manage(context, self._refuse)

    async def Forward(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:  # noqa: N802
        if self.manager is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this gateway has no proxy manager service")
        if not await self._throttled(context):
            await self.manager.forward(context, self._refuse)


class GrpcServer:
    """The started gRPC listener, and the tunnel listener beside it; ``stop`` ends their calls and connections
    (agents reconnect to the next start)."""

    def __init__(self, service: AgentService) -> None:
        self.service = service
        self.server: grpc.aio.Server | None = None
        self.tunnels: TunnelListener | None = None
        self.port = 0
        self.fingerprint = ""  # of the certificate it presents (what a generated one's agents pin)

    async def start(self, host: str, port: int, data_dir: Path, cert: str = "", key: str = "",
                    names: tuple[str, ...] = (), keepalive: float = 20.0, tunnel_port: int | None = None) -> None:
        """``tunnel_port``: the tunnel listener's (0: any free one), None: none (streams go over Tunnel calls). A
        tunnel port already taken is logged and the streams go over Tunnel calls."""
        cert_path, key_path = await asyncio.to_thread(
            tls.certificate_paths, data_dir, cert, key, CERT_BASE, "grpc.tls_cert and grpc.tls_key", names)
        cert_pem, key_pem = cert_path.read_bytes(), key_path.read_bytes()
        self.fingerprint = tls.fingerprint(cert_pem)
        server = grpc.aio.server(options=SERVER_OPTIONS + keepalive_options(keepalive))
        pb_grpc.add_AgentGatewayServicer_to_server(self.service, server)
        credentials = grpc.ssl_server_credentials([(key_pem, cert_pem)])
        try:
            bound = server.add_secure_port(f"[{host}]:{port}" if ":" in host else f"{host or '0.0.0.0'}:{port}",
                                           credentials)
        except RuntimeError:
            bound = 0
        if not bound:
            raise OSError(f"cannot listen on {host}:{port}")
        await server.start()
        self.server, self.port = server, bound
        log.info("grpc listener started", extra={"address": f"{host}:{bound}", "version": __version__})
        if tunnel_port is not None:
            tunnels = TunnelListener(self.service)
            try:
                self.service.registry.tunnel_port = await tunnels.start(host, tunnel_port, cert_path, key_path)
            except OSError as exc:
                log.error("agent tunnel listener failed to start: streams go over gRPC Tunnel calls",
                          extra={"address": f"{host}:{tunnel_port}", "error": exc.strerror or str(exc)})
            else:
                self.tunnels = tunnels
                log.info("agent tunnel listener started", extra={"address": f"{host}:{tunnels.port}"})

    async def stop(self, grace: float | None = 1.0) -> None:
        if self.tunnels is not None:
            self.service.registry.tunnel_port = 0
            await self.tunnels.stop()
            self.tunnels = None
        if self.server is not None:
            await self.server.stop(grace)
            self.server = None
        if self.service.registry is not None:  # the calls just cancelled leave their agents' departures
            await self.service.registry.depart_all("the gateway stopped")
        if self.service.manager is not None:  # and their proxy managers' credentials to revoke
            await self.service.manager.depart_all()
