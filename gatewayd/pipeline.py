"""The session pipeline: the one lifecycle every protocol's session goes through.

::

    admit      secret -> credential -> user and connection   (refusals audited, throttled per address)
    dial       the target, through the gateway's Dialer       (unreachable: a session with an ``e``, exit 254)
    open       claim the session issued with the credential, or open a new one
    arm        how the proxy is told to end it (kill, expiry, shutdown); the guard rails it runs under
    relay      the proxy's own work: wire messages become reports to the session's policy chain
    close      status done, exit code, the last ``e``; the recording sealed

A proxy calls ``admit`` and ``start`` and gets a ``SessionRun``: the live
session, its ``SessionPolicy`` (gatewayd.policy) and the dialed target.  It
never opens a session, loads rules or dials by itself.  Where protocols really
differ, ``start`` has an explicit option:

* ``open_first`` -- RDP opens the session before dialing (its screen capture
  needs the session id while pyrdp connects);
* ``resume`` -- HTTP keeps one session per credential, resumed by each request;
* ``existing`` -- a reviewed one-time script runs in the session stored with its review.

Errors a proxy translates into its protocol's words: ``AccessDenied`` (admit),
``TargetUnreachable`` (dial, the session is already closed and recorded) and
``GatewayClosing`` (the gateway is shutting down; no session was opened) or its kind
``GatewayUnavailable`` (the store does not answer, or this node is fenced: its message says which).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Generic, Protocol, TypeVar

from gatewayd import metrics, protocols
from gatewayd.access import AccessDenied, AccessGrant
from gatewayd.dialer import DialError, Dialer, Routes
from gatewayd.guardrails import ObservedRules, RuleSet
from gatewayd.languages import NONE
from gatewayd.policy import SessionPolicy
from gatewayd.sessions import (
    BLOCKED_EXIT_CODE,
    STORE_UNAVAILABLE,
    GatewayClosing,
    GatewayUnavailable,
    KillCallback,
    LiveSession,
)
from gatewayd.store import StoreUnavailable

if TYPE_CHECKING:
    from pathlib import Path

    from gatewayd.access import AccessService
    from gatewayd.audit import AuditLog
    from gatewayd.frames import FrameStore
    from gatewayd.guardrails import GuardRailService
    from gatewayd.models import Connection, Session
    from gatewayd.sessions import SessionManager
    from gatewayd.tenancy import Tenancy

__all__ = ["AccessDenied", "AccessGrant", "BLOCKED_EXIT_CODE", "GatewayClosing", "GatewayUnavailable", "ProxyContext",
           "SessionPipeline", "SessionRun", "TargetUnreachable"]

log = logging.getLogger("gatewayd.pipeline")

T = TypeVar("T")

INTERNAL_ERROR = "the gateway ended the session on an internal error"


class TargetUnreachable(Exception):
    """The target could not be reached (or refused the gateway's login); the session is closed already.

    ``message`` is safe to show the client; ``cause`` is the proxy's own error, for its protocol's
    details (a PostgreSQL SQLSTATE).
    """

    def __init__(self, message: str, cause: BaseException | None = None, session_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.cause = cause
        self.session_id = session_id  # the closed session (a one-time script answers with it)


class SessionRun(Generic[T]):
    """One session from its open to its close, as a proxy holds it.

    As an async context manager it closes the session with exit code 254 and
    an ``e`` event if the proxy's work raises (the error is not swallowed).
    """

    __slots__ = ("live", "policy", "target")

    def __init__(self, live: LiveSession, policy: SessionPolicy, target: T) -> None:
        self.live = live
        self.policy = policy
        self.target = target

    @property
    def id(self) -> str:
        return self.live.id

    @property
    def ended(self) -> bool:
        """The session is ending or ended (killed, expired, closed): take no more input. A kill is ending it from
        its start, while its proxy still stops the target (``on_kill``), before the close."""
        return self.live.done.is_set() or self.live.end_reason is not None

    @property
    def end_reason(self) -> str | None:
        """Why the gateway ended it (kill, expiry, shutdown), once it did."""
        return self.live.end_reason

    async def close(self, exit_code: int | None = 0, error: str | None = None) -> None:
        """Status done with ``exit_code``, an ``e`` event when ``error``; idempotent."""
        await self.live.close(exit_code=exit_code, error=error)

    async def kill(self, reason: str) -> None:
        """End it from the gateway side (a credential revoked meanwhile): ``on_kill``, then 254 and ``reason``."""
        await self.live.kill(reason)

    async def __aenter__(self) -> SessionRun[T]:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: Any) -> None:
        if kind is not None and not self.live.done.is_set():
            await self.live.close(exit_code=BLOCKED_EXIT_CODE, error=INTERNAL_ERROR)


def _memory_key(connection: Connection, topic: str) -> str:
    return f"memory.{topic}.{connection.id}"


def _client_message(error: BaseException) -> str:
    message = getattr(error, "message", None)
    return message if isinstance(message, str) and message else str(error) or type(error).__name__


class SessionPipeline:
    """admit -> dial -> open/claim -> arm -> (relay) -> close, for every proxy and script runner."""

    def __init__(self, access: AccessService, sessions: SessionManager, guardrails: GuardRailService,
                 dialer: Dialer, audit: AuditLog, agents: Routes | None = None,
                 tenancy: Tenancy | None = None) -> None:
        self.access = access
        self.sessions = sessions
        self.guardrails = guardrails
        self.dialer = dialer
        self.agents = agents  # connections that name an agent are dialled through it
        self.tenancy = tenancy  # a tenant's connections are dialled under its address policy
        self.audit_log = audit
        self.tasks = sessions.tasks  # expiry kills and what proxies hand over; shutdown waits for them

    # -- admit

    async def admit(self, secret: str, protocol: str, client_ip: str = "", *,
                    audit_success: bool = True) -> AccessGrant:
        """The grant of ``secret`` on a ``protocol`` connection; raises AccessDenied (audited, throttled).

        ``audit_success=False``: a proxy re-checking a credential it let in already (HTTP's requests).
        GatewayUnavailable when the store does not answer or this node is fenced (nothing is refused: the
        client is told to come back).
        """
        fence = self.sessions.cluster.fence_reason
        if fence is not None:
            raise GatewayUnavailable(f"{fence}: no session can be opened on it now")
        try:
            return await self.access.resolve(secret, protocol, client_ip, audit_success=audit_success)
        except AccessDenied:
            metrics.login_refused(protocol)
            raise
        except StoreUnavailable as exc:
            raise self._unavailable(exc) from None

    @staticmethod
    def _unavailable(exc: StoreUnavailable) -> GatewayUnavailable:
        """What a client is told when the store does not answer (the store's address stays in the log)."""
        log.error("the store did not answer: a client is told to come back", extra={"error": str(exc)})
        return GatewayUnavailable(STORE_UNAVAILABLE)

    async def refuse(self, grant: AccessGrant, protocol: str, reason: str, client_ip: str = "") -> None:
        """Audit a refusal the proxy decided after ``admit`` (the credential's one session is closed)."""
        metrics.login_refused(protocol)
        await self.access.refused(grant, protocol, reason, client_ip)

    # -- dial, open, arm

    def dialer_for(self, connection: Connection) -> Dialer:
        """What reaches ``connection``'s target: its agent when it names one (refused at once when offline),
        else the gateway's own dialer -- for a tenant's connection, one that reaches only the addresses the
        tenancy's policy allows (never the gateway's host or its network)."""
        if connection.agent_id and self.agents is not None:
            return self.agents.dialer_for(connection)
        if self.tenancy is not None and self.tenancy.is_tenant(connection.org_id):
            return self.tenancy.dialer
        return self.dialer

    async def start(self, grant: AccessGrant, client_ip: str = "", *,
                    dial: Callable[[Dialer], Awaitable[T]] | None = None,
                    unreachable: tuple[type[BaseException], ...] = (DialError,),
                    drop: Callable[[T], Any] | None = None,
                    on_kill: KillCallback | None = None,
                    open_first: bool = False, observe: bool = True,
                    existing: Session | None = None, verb: str = "connect",
                    script: str | None = None, metadata: dict[str, Any] | None = None,
                    batch_id: str | None = None) -> SessionRun[T]:
        """Dial the target and open (or claim) the session; the run the proxy relays in.

        ``dial`` gets the gateway's dialer and returns the proxy's target (a link, a client
        connection); what it raises of ``unreachable`` (DialError always) closes the session
        with that message and exit code 254, then raises TargetUnreachable.  ``drop`` releases a
        dialed target when no session can be opened (GatewayClosing).  ``on_kill`` is how the
        gateway tells the proxy to end the session.  ``observe``: native input is offered to AI
        analysis (scripts are analysed as a whole instead).  A grant without a credential (an API
        user's one-time script) opens a new session with ``verb``, ``script``, ``metadata`` and
        ``batch_id``.
        """
        live = None
        if open_first:
            live = await self._open(grant, client_ip, existing, verb, script, metadata, batch_id)
        target: Any = None
        if dial is not None:
            try:
                target = await dial(self.dialer_for(grant.connection))
            except (DialError, *unreachable) as exc:  # type: ignore[misc]  # (a tuple of exception classes)
                message = _client_message(exc)
                log.info("target unreachable", extra={"connection": grant.connection.name, "error": message})
                if live is None:
                    live = await self._open(grant, client_ip, existing, verb, script, metadata, batch_id)
                await live.close(exit_code=BLOCKED_EXIT_CODE, error=message)
                raise TargetUnreachable(message, exc, live.id) from None
            except BaseException:
                if live is not None:
                    await live.close(exit_code=BLOCKED_EXIT_CODE, error=INTERNAL_ERROR)
                raise
        if live is None:
            try:
                live = await self._open(grant, client_ip, existing, verb, script, metadata, batch_id)
            except BaseException:
                if drop is not None and target is not None:
                    drop(target)
                raise
        try:
            return await self._arm(live, target, on_kill, observe, client_ip)
        except BaseException:
            if drop is not None and target is not None:
                drop(target)
            raise

    async def resume(self, grant: AccessGrant, client_ip: str = "", *,
                     on_kill: KillCallback | None = None) -> SessionRun[None] | None:
        """HTTP's one session per credential: the live one, or claimed now; None once it is done.

        The run's policy holds the rules of the moment: a proxy that keeps the session across
        requests asks ``policy_for`` per request.  ``on_kill`` replaces the one of an earlier
        resume (a listener started again takes over its live sessions).
        """
        assert grant.credential is not None, "resume takes a credential's grant"
        live = self.sessions.live.get(grant.credential.session_id)
        fresh = live is None
        if fresh:
            try:
                live = await self.sessions.resume(grant.user, grant.connection, grant.credential, client_ip)
            except StoreUnavailable as exc:
                raise self._unavailable(exc) from None
            if live is None:
                return None
        assert live is not None
        if not fresh:
            if on_kill is not None:
                live.on_kill(on_kill)
            return SessionRun(live, await self.policy_for(live, client_ip), None)
        return await self._arm(live, None, on_kill, False, client_ip)

    async def sibling_holding(self, secret: str) -> str | None:
        """The node id of another worker of this ``gatewayd run`` (same host, same node name before ``/wN``)
        whose process holds the open session of the credential ``secret`` -- where HTTP hands a connection
        so that a credential keeps one session; None when this process holds it, when no sibling does, or when
        the secret names no credential (the request is refused here, as usual)."""
        from gatewayd.crypto import hash_secret

        store, me = self.sessions.store, self.sessions.cluster.node
        credential = await store.get_credential(hash_secret(secret))
        if credential is None or credential.session_id in self.sessions.live:
            return None
        session = await store.get_session(credential.session_id)
        if session is None or session.status != "open" or not session.node_id or session.node_id == me.id:
            return None
        run = me.name.rsplit("/w", 1)[0]
        for node in await store.list_nodes(up_only=True):
            if node.id == session.node_id:
                return node.id if node.host == me.host and node.name.rsplit("/w", 1)[0] == run else None
        return None

    async def policy_for(self, live: LiveSession, client_ip: str = "", *, observe: bool = False,
                         fresh: bool = False) -> SessionPolicy:
        """The session's policy chain under its connection's rules as they are now.

        ``fresh`` (a session starting): the rules as the store has them, whichever process changed
        them last; else (per request) this process's compiled rules when it has them.
        """
        connection = live.connection
        rules: RuleSet | ObservedRules | None = self.guardrails.cached(connection.id) if not (observe or fresh) else None
        if rules is None:
            rules = await self.guardrails.rules_for(connection,
                                                    live=live if observe else None)
        policy = SessionPolicy(live, rules, client_ip)
        await policy.open_clear_recording()  # only under a mask rule that records the clear text
        return policy

    async def _open(self, grant: AccessGrant, client_ip: str, existing: Session | None, verb: str,
                    script: str | None, metadata: dict[str, Any] | None, batch_id: str | None) -> LiveSession:
        try:
            if existing is not None:
                return await self.sessions.open(grant.user, grant.connection, existing=existing, client_ip=client_ip)
            return await self.sessions.open(grant.user, grant.connection, credential=grant.credential, verb=verb,
                                            script=script, metadata=metadata, batch_id=batch_id, client_ip=client_ip)
        except StoreUnavailable as exc:
            raise self._unavailable(exc) from None

    async def _arm(self, live: LiveSession, target: T, on_kill: KillCallback | None, observe: bool,
                   client_ip: str) -> SessionRun[T]:
        metrics.track_session(live)  # open until it closes, whatever closes it
        if on_kill is not None:
            live.on_kill(on_kill)
            if live.done.is_set() and live.end_reason:  # ended before the proxy could be told (a revocation)
                told = on_kill(live.end_reason)
                if told is not None:
                    await told
        try:
            policy = await self.policy_for(live, client_ip, observe=observe, fresh=True)
        except StoreUnavailable as exc:  # its rules cannot be read: it does not start (fail closed)
            await live.close(exit_code=BLOCKED_EXIT_CODE, error=STORE_UNAVAILABLE)
            raise self._unavailable(exc) from None
        except BaseException:
            await live.close(exit_code=BLOCKED_EXIT_CODE, error=INTERNAL_ERROR)
            raise
        language = protocols.language_of(live.connection.subtype)
        rules = policy.rules
        if language.family == NONE and (rules.input_rules or rules.output_rules or rules.masker is not None):
            # stored before the API refused such rules (422): its proxy reads nothing, so no session starts under them
            message = (f'connection "{live.connection.name}" has guard rails its protocol cannot apply (its input is '
                       f"{language.title}): an admin must detach them")
            await live.close(exit_code=BLOCKED_EXIT_CODE, error=message)
            raise TargetUnreachable(message, None, live.id)
        live.reload_rules = functools.partial(self._reload_rules, live, policy)
        return SessionRun(live, policy, target)

    async def _reload_rules(self, live: LiveSession, policy: SessionPolicy) -> None:
        """A rule of the session's connection changed (here or on another node): its policy adopts the new rules.

        An observed session keeps its observer (what AI analysis saw and decided stays)."""
        connection = live.connection
        rules: Any = await self.guardrails.rules_for(connection)
        if isinstance(policy.rules, ObservedRules):
            rules = ObservedRules(rules, policy.rules.observe)
        policy.adopt(rules)

    # -- what a proxy remembers of a connection's target from one session to the next

    async def recall(self, connection: Connection, topic: str) -> Any:
        """What was remembered of ``connection``'s target under ``topic`` (``remember``), or None."""
        return await self.sessions.store.get_setting(_memory_key(connection, topic))

    async def remember(self, connection: Connection, topic: str, value: Any) -> None:
        """Keep ``value`` (JSON) for the next sessions of ``connection``, in the store every node shares: a
        PostgreSQL column masked by name, found by its identity after a rename (proxies/postgres/catalog.py).
        The last write wins: two sessions writing at once may lose one's news (found again next time)."""
        await self.sessions.store.put_setting(_memory_key(connection, topic), value)

    # -- what proxies audit beyond sessions and blocks

    async def audit(self, live: LiveSession, action: str, message: str, *, outcome: str = "failure",
                    client_ip: str = "", **payload: Any) -> None:
        """An audit entry about ``live`` (a refused port forwarding): who, which session and connection."""
        await self.audit_log.record(
            org_id=live.session.org_id, actor=live.user, action=action, resource_type="session", outcome=outcome,
            error_message=message, client_ip=client_ip or live.client_ip,
            payload={"session_id": live.id, "connection": live.connection.name, **payload})


class ClusterLink(Protocol):
    """What a proxy may use of the cluster: this node's slot and the bus (gatewayd.cluster.Cluster)."""

    @property
    def slot(self) -> int: ...

    def on(self, topic: str, handler: Callable[[dict[str, Any]], Awaitable[None] | None]) -> None: ...

    async def publish(self, topic: str, **payload: Any) -> None: ...

    async def request(self, topic: str, targets: Any = None, wait: float = ..., **payload: Any) -> list[str]: ...

    async def node_of_slot(self, slot: int) -> str | None: ...


@dataclass(slots=True)
class ProxyContext:
    """What a protocol proxy gets from the daemon: the pipeline, its own settings, the few services it uses.

    ``settings`` are the proxy's own configuration keys without their section (``ssh.ciphers`` is
    ``settings["ciphers"]``); ``server_config`` is its part of the serverconfig document.
    """

    pipeline: SessionPipeline
    settings: dict[str, Any]
    server_config: dict[str, Any]
    data_dir: Path
    frames: FrameStore | None = None  # RDP's screen captures
    host_key: Callable[[], Awaitable[bytes]] | None = None  # SSH's host key (OpenSSH PEM)
    cluster: ClusterLink | None = None  # this process among the others: its slot, the bus (PostgreSQL's cancels)
    reuse_port: bool = False  # listen with SO_REUSEPORT: the workers of one `gatewayd run` share the address
