"""Sessions: open and done transitions, the registry of live sessions, kill and shutdown."""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import time
from typing import Any, Awaitable, Callable

from gatewayd.audit import AuditLog
from gatewayd.cluster import Cluster, NotConfirmed
from gatewayd.evidence import GAP, SEALED
from gatewayd.guardrails import GuardVerdict
from gatewayd.protocols import session_for
from gatewayd.models import Connection, Credential, Node, Session, User, parse_time, rfc3339, utcnow
from gatewayd.recording import RecordingService, SessionRecorder
from gatewayd.store import Store
from gatewayd.tasks import BackgroundTasks, together

log = logging.getLogger("gatewayd.sessions")

BLOCKED_EXIT_CODE = 254
KILL_WAIT = 10.0  # a second kill waits this long for the first (its proxy's bounded stop), then closes the session
KillCallback = Callable[[str], Awaitable[None] | None]
# The confirmations a control action started in this task waits for before it answers (set by the API for
# each call: a rule changed through ``GuardRailService.invalidate`` answers once every node applies it).
CONFIRMATIONS: contextvars.ContextVar[list[asyncio.Task[None]] | None] = contextvars.ContextVar(
    "gatewayd_confirmations", default=None)


async def _nothing() -> None:
    """An awaitable of None, where ``together`` reads something only in some cases."""


class SessionUnavailable(RuntimeError):
    """A stored session asked to run cannot be claimed: it ran, ended or was killed already."""


class GatewayClosing(RuntimeError):
    """The gateway is shutting down: no new session is opened (a proxy says so in its protocol's words)."""

    def __init__(self) -> None:
        super().__init__("the gateway is shutting down")


class GatewayUnavailable(GatewayClosing):
    """No session can be opened now: the store does not answer, or this node is fenced (it could not renew its
    lease). A proxy says so in its protocol's words, as for a gateway shutting down; ``str()`` is the reason."""

    def __init__(self, reason: str) -> None:
        RuntimeError.__init__(self, reason)


STORE_UNAVAILABLE = "the gateway's store is unavailable: no session can be opened now, try again later"


class LiveSession:
    """A session in progress: its record, its recorder and how to end it."""

    def __init__(self, manager: "SessionManager", session: Session, recorder: SessionRecorder,
                 user: User, connection: Connection, credential: Credential | None, client_ip: str = "") -> None:
        self.manager = manager
        self.client_ip = client_ip
        self.session = session
        self.recorder = recorder
        self.user = user
        self.connection = connection
        self.credential = credential
        self._kill: KillCallback | None = None
        self._expiry: asyncio.TimerHandle | None = None
        self.done = asyncio.Event()  # set as the session starts to end (no more input is taken)
        self.finished = asyncio.Event()  # set once its end is stored (status done, exit code, seal)
        self.end_reason: str | None = None
        # awaited by close before the recording closes (each hook bounds its own wait: AI analysis still running)
        self.before_close: list[Callable[[], Awaitable[None]]] = []
        # loads the connection's rules again into the session's policy (set by the pipeline; a rule changed)
        self.reload_rules: Callable[[], Awaitable[None]] | None = None
        # secret values the session's script was made with (gatewayd.scripts.Redaction): never recorded
        self.redaction: Any = None

    @property
    def id(self) -> str:
        return self.session.id

    def log_fields(self, **more: Any) -> dict[str, Any]:
        """The fields of this session's log lines: who, where from, on what."""
        return {"session_id": self.id, "connection": self.connection.name, "user": self.user.email,
                "client": self.client_ip, **more}

    def on_kill(self, callback: KillCallback) -> None:
        """Register how the proxy tears the connection down when the gateway ends the session."""
        self._kill = callback

    async def blocked(self, verdict: GuardVerdict, client_ip: str = "") -> None:
        """Record a guard-rail block as an ``e`` event and an audit entry.

        The proxy has recorded the blocked input as ``i`` already; the audit entry names it too
        (``input``: the verdict's text, cut at AUDIT_INPUT_CHARS).  Output that was blocked is not copied.
        """
        shown = self.redaction.text if self.redaction is not None else str
        message = shown(verdict.message)
        self.recorder.error(message)
        self.recorder.metrics["blocked"] = self.recorder.metrics.get("blocked", 0) + 1  # reports count them
        payload = {"session_id": self.id, "connection": self.connection.name, "guardrail": verdict.guardrail,
                   "direction": verdict.direction, "rule_type": verdict.rule_type}
        if verdict.text:
            payload["input"] = shown(verdict.text)
        await self.manager.audit.record(
            org_id=self.session.org_id, actor=self.user, action="guardrail.block",
            resource_type="session", outcome="failure", error_message=message, client_ip=client_ip,
            payload=payload,
        )

    async def close(self, exit_code: int | None = None, error: str | None = None) -> None:
        """Mark the session done, with an ``e`` event when it ended on an error; idempotent."""
        if self.done.is_set():
            return
        self.done.set()
        if self._expiry is not None:
            self._expiry.cancel()
        # the manager's task: a cancel of the proxy's task (the listeners' stop ends their connections) does not
        # cut the end short, between the seal and its entry in the audit chain; the shutdown waits for it
        await asyncio.shield(self.manager.tasks.spawn(self._close(exit_code, error)))

    async def _close(self, exit_code: int | None, error: str | None) -> None:
        """The close hooks, the recording closed and sealed, the sealing in the audit chain, the end told."""
        for hook in self.before_close:
            try:
                await hook()
            except Exception:
                log.exception("a close hook failed", extra={"session_id": self.id})
        if error:
            self.recorder.error(error)
        self.manager.live.pop(self.id, None)
        log.info("session closed", extra=self.log_fields(
            outcome="error" if error else "ok", exit_code=exit_code, reason=error or ""))
        try:
            end_date = rfc3339(utcnow())
            await self.manager.recording.close(self.recorder, self.session, end_date=end_date, exit_code=exit_code)
            self.manager.tell("session.close", dataclasses.replace(self.session, status="done", end_date=end_date,
                                                                   exit_code=exit_code))
        except Exception:
            log.exception("could not close session", extra={"session_id": self.id})
        finally:
            self.finished.set()

    async def kill(self, reason: str) -> None:
        """End the session from the gateway side: tell the proxy, then close with ``reason``. A kill while another
        one tells the proxy (it may take a bounded grace: a command signalled on an SSH target) waits for that one,
        whose reason stands."""
        if self.done.is_set():
            return
        if self.end_reason is not None:
            try:
                async with asyncio.timeout(KILL_WAIT):
                    await self.done.wait()
            except TimeoutError:  # the first kill never got to its close (cancelled): this one closes, its reason
                await self.close(exit_code=BLOCKED_EXIT_CODE, error=self.end_reason)
            return
        self.end_reason = reason
        if self._kill is not None:
            try:
                result = self._kill(reason)
                if asyncio.iscoroutine(result):
                    await result
            except Exception:
                log.exception("proxy kill callback failed", extra={"session_id": self.id})
        await self.close(exit_code=BLOCKED_EXIT_CODE, error=reason)


class SessionManager:
    """Creates sessions, tracks the live ones, and ends them on kill, expiry or shutdown.

    A session is held by the process that opened it (its ``node_id``); a kill or an end asked
    anywhere reaches that process through the cluster's bus (topics ``session.kill`` and
    ``sessions.end``), and the sessions of a node that died are closed by the cluster (``close_orphans``).
    """

    KILL = "session.kill"
    END = "sessions.end"
    RULES = "guardrails.changed"
    CONNECTION = "connection.changed"

    def __init__(self, store: Store, recording: RecordingService, audit: AuditLog,
                 cluster: Cluster | None = None, recording_mode: str = "async") -> None:
        self.store = store
        self.recording = recording
        self.audit = audit
        self.cluster = cluster or Cluster(store, "local")
        self.recording_mode = recording_mode  # a connection's settings.recording_mode wins
        recording.on_undurable = self._undurable
        recording.on_sealed = self.sealed
        recording.may_seal = self.may_seal
        self.live: dict[str, LiveSession] = {}
        self.accepting = True
        self.hurried = False  # ``hurry``: the shutdown's grace is over
        self.tasks = BackgroundTasks("sessions")  # expiry kills, sessions' ends
        self.cluster.on(self.KILL, self._on_kill)
        self.cluster.on(self.END, self._on_end)
        self.cluster.on(self.RULES, self._on_rules)
        self.cluster.on(self.CONNECTION, self._on_connection)
        self.cluster.on_node_lost = self.close_orphans
        self.cluster.on_fenced = self._fenced
        self.cluster.on_fence = self._fenced
        self.watchers: list[Callable[[str, Session], None]] = []  # told as sessions open and close (webhooks)

    def tell(self, kind: str, session: Session) -> None:
        """``session.open`` / ``session.close`` to the watchers (they never wait nor raise)."""
        for watcher in self.watchers:
            watcher(kind, session)

    async def open(self, user: User, connection: Connection, *, credential: Credential | None = None,
                   verb: str = "connect", script: str | None = None, metadata: dict[str, Any] | None = None,
                   batch_id: str | None = None, existing: Session | None = None,
                   client_ip: str = "") -> LiveSession:
        """Open a session; a credential's first connection claims the session issued with it.

        ``existing``: a stored ``ready`` session to run now (a reviewed one-time script), claimed
        here (``SessionUnavailable`` if it was claimed, ended or killed meanwhile).
        A session issued ``ready``, or moved to ``open`` when its jit credentials were handed out,
        is claimed by exactly one connection (``Store.claim_session``, atomic across processes);
        the others open sessions of their own. The session is held by this node (``node_id``).
        """
        if not self.accepting:
            raise GatewayClosing()
        if self.cluster.fence_reason is not None:
            raise GatewayUnavailable(f"{self.cluster.fence_reason}: no session can be opened on it now")
        node_id = self.cluster.node_id
        session: Session | None = None
        if existing is not None:
            session = await self.store.claim_session(existing.id, rfc3339(utcnow()), node_id)
            if session is None:
                raise SessionUnavailable(f"session {existing.id} was run, ended or killed already")
            existing.status, existing.start_date = session.status, session.start_date
        claim = credential.session_id if credential is not None else None
        if session is None and claim is not None and claim not in self.live:
            session = await self.store.claim_session(claim, rfc3339(utcnow()), node_id)
        if credential is not None:
            batch_id = batch_id or credential.id
        if session is None:
            session = session_for(user, connection, verb=verb, script=script, metadata=metadata or {},
                                  session_batch_id=batch_id,
                                  credential_id=credential.id if credential else None,
                                  review_id=credential.review_id if credential else None, node_id=node_id)
            await self.store.create_session(session)
        recorder = await self.recording.recorder(session.id, started=time.monotonic())
        recorder.strict = (connection.settings.get("recording_mode") or self.recording_mode) == "strict"
        live = LiveSession(self, session, recorder, user, connection, credential, client_ip)
        self.live[session.id] = live
        log.info("session opened", extra=live.log_fields(verb=verb))
        self.tell("session.open", session)
        if credential is not None:
            self._arm_expiry(live, credential)
        # a revocation or a deactivation between admit and now found no holder here to tell: read them once the
        # session is live
        fresh, holder = await together(
            self.store.get_credential(credential.secret_hash) if credential is not None else _nothing(),
            self.store.get_user(id=user.id))
        if credential is not None and (fresh is None or fresh.revoked_at):
            await live.kill("the credential was revoked while the session opened: the session was closed")
        elif holder is None or holder.status != "active":
            await live.kill("the user was deactivated or deleted while the session opened: the session was closed")
        return live

    async def resume(self, user: User, connection: Connection, credential: Credential,
                     client_ip: str = "") -> LiveSession | None:
        """The credential's own session, live or claimed now; None once it is done (one session per credential)."""
        live = self.live.get(credential.session_id)
        if live is not None:
            return live
        issued = await self.store.get_session(credential.session_id)
        if issued is None or issued.status not in ("ready", "open"):  # open: jit credentials handed out
            return None
        return await self.open(user, connection, credential=credential, client_ip=client_ip)

    def _arm_expiry(self, live: LiveSession, credential: Credential) -> None:
        expire_at = parse_time(credential.expire_at)
        if expire_at is None:
            return
        delay = (expire_at - utcnow()).total_seconds()
        loop = asyncio.get_running_loop()
        live._expiry = loop.call_later(
            max(delay, 0), lambda: self.tasks.spawn(live.kill("credential expired: the session was closed")))

    async def kill(self, session_id: str, reason: str) -> bool:
        """End a session wherever it is held; True if it was not done.

        A session live here is killed here. Otherwise the kill is recorded on the row
        (``Store.request_kill``: it can no longer be claimed); a session held by another node that
        may be serving is ended by that node (the bus carries the kill; it closes the session with
        ``reason`` and confirms), and ``NotConfirmed`` names it when it does not confirm in time: the
        answer never says done while the session may run. One that no serving node holds (its
        holder is gone or fenced: it runs nowhere) is closed now, with ``reason`` as its ``e`` event
        and exit code 254.
        """
        live = self.live.get(session_id)
        if live is not None:
            await live.kill(reason)
            return True
        session = await self.store.request_kill(session_id, reason, rfc3339(utcnow()))
        if session is None:
            return False
        holder = session.node_id
        if session.status == "open" and holder and holder != self.cluster.node_id \
                and holder in await self.cluster.serving():
            missing = await self.cluster.request(self.KILL, [holder], session_id=session_id, reason=reason,
                                                 node=holder)
            if missing:
                raise NotConfirmed(f"the kill of session {session_id} was sent", missing)
            stored = await self.store.get_session(session_id)
            if stored is None or stored.status == "done":
                return True  # else its holder does not run it (it confirmed): closed here
            await self._close_stored(session_id, reason)
            return True
        gap = ""
        if session.status == "open" and holder and holder != self.cluster.node_id:  # fenced or gone
            gap = ("the node that held the session was not serving when it was killed: what it recorded last may be "
                   "missing here (what it kept follows after this close once it reaches the store again)")
        await self._close_stored(session_id, reason, gap)
        return True

    async def _close_stored(self, session_id: str, reason: str, gap: str = "") -> None:
        """Close a session no process holds: ``reason`` as its last ``e`` event (after ``gap``, a ``recording
        gap`` event, when the process that held it may have recorded more), exit code 254.

        A session the audit log says was sealed already is left as it is, never sealed again (``may_seal``)."""
        session = await self.store.get_session(session_id)
        if session is None or not await self.may_seal(session):
            return
        recorder = await self.recording.recorder(session_id)
        if gap:
            recorder.error(GAP + gap.encode())
        recorder.error(reason)
        end_date = rfc3339(utcnow())
        await self.recording.close(recorder, session, end_date=end_date, exit_code=BLOCKED_EXIT_CODE)
        self.tell("session.close", dataclasses.replace(session, status="done", end_date=end_date,
                                                       exit_code=BLOCKED_EXIT_CODE))

    async def may_seal(self, session: Session, seal: str | None = None) -> bool:
        """Whether ``session``, open in the store, may be closed and sealed (with ``seal``, when it is already
        known): not when the audit chain says it was sealed already (with another seal). Its row was then set back
        to open, its seal dropped and its recording perhaps cut, which no gateway does: sealing it again would
        vouch for what an intruder left. The refusal is said (an error line and a ``session.seal`` failure entry);
        ``verify`` tells what changed. Asked by the sweep of sessions left open and by the replay of a journal."""
        sealings = await self.store.sealings(session.id)
        if not sealings or (seal is not None and any(s.get("seal") == seal for s in sealings)):
            return True
        message = (f"session {session.id} was sealed on {sealings[0]['sealed_at']} and is open again: it is not "
                   "sealed again (its stored record was altered)")
        log.error("sealed session found open", extra={"session_id": session.id, "reason": message})
        await self.audit.record(org_id=session.org_id, actor=None, actor_hint="gateway", action=SEALED,
                                resource_type="session", outcome="failure", error_message=message,
                                payload={"session_id": session.id})
        return False

    async def sealed(self, session: Session, seal: str) -> None:
        """Record that ``session`` was sealed with ``seal`` where the sweep cannot undo it: a ``session.seal`` entry
        of the audit chain (``Store.sealings`` finds it)."""
        await self.audit.record(org_id=session.org_id, actor=None, actor_hint="gateway", action=SEALED,
                                resource_type="session", outcome="success",
                                payload={"session_id": session.id, "seal": seal})

    def _undurable(self, session_id: str, reason: str) -> None:
        """The recording cannot be kept as the session asks (strict, or closed by another node): it ends."""
        live = self.live.get(session_id)
        if live is not None:
            self.tasks.spawn(live.kill(reason))

    async def _on_kill(self, message: dict[str, Any]) -> None:
        live = self.live.get(str(message.get("session_id")))
        if live is not None:
            await live.kill(str(message.get("reason") or "session killed"))

    async def end(self, reason: str, *, review_id: str | None = None, connection_id: str | None = None,
                  user: User | None = None) -> None:
        """End the live sessions of a review's credentials, of a connection or of a user (in its organization: a
        user deactivated or deleted), on every node; NotConfirmed when a node holding one of them does not
        confirm it ended them."""
        owner = (user.org_id or "", user.subject) if user is not None else None
        holders = await self._holders(review_id=review_id, connection_id=connection_id, user=owner)
        missing = await self.cluster.request(self.END, holders, reason=reason, review_id=review_id,
                                             connection_id=connection_id, user=list(owner) if owner else None)
        if missing:
            raise NotConfirmed("the sessions were asked to end", missing)

    async def _holders(self, *, review_id: str | None = None, connection_id: str | None = None,
                       user: tuple[str, str] | None = None) -> set[str]:
        """The nodes that may be serving a session of a review, a connection or a user: those that must confirm."""
        held = await self.store.open_session_holders(review_id=review_id, connection_id=connection_id, user=user)
        return held & await self.cluster.serving() if held else set()

    async def _on_end(self, message: dict[str, Any]) -> None:
        review_id, connection_id = message.get("review_id"), message.get("connection_id")
        owner = tuple(message["user"]) if isinstance(message.get("user"), list) and len(message["user"]) == 2 \
            else None
        reason = str(message.get("reason") or "session closed")

        def matches(s: LiveSession) -> bool:
            if review_id is not None and not (s.credential is not None and s.credential.review_id == review_id):
                return False
            if owner is not None and (s.session.org_id, s.session.user_id) != owner:
                return False
            return connection_id is None or s.connection.id == connection_id

        if review_id is None and connection_id is None and owner is None:
            return
        closed = await self.kill_where(matches, reason)
        if closed:
            log.info("closed sessions", extra={"review_id": review_id or "", "connection_id": connection_id or "",
                                               "user": owner[1] if owner else "", "count": closed})

    async def connection_changed(self, connection_id: str, *, deleted_by: str | None = None) -> None:
        """A connection was changed (its live sessions take its new record and rules) or deleted (they end);
        NotConfirmed when a node holding one of its sessions does not confirm it."""
        missing = await self.cluster.request(self.CONNECTION, await self._holders(connection_id=connection_id),
                                             connection_id=connection_id, deleted_by=deleted_by)
        if missing:
            raise NotConfirmed("the connection was " + ("deleted and its sessions asked to end" if deleted_by
                                                        else "changed and its sessions asked to take the change"),
                               missing)

    async def _on_connection(self, message: dict[str, Any]) -> None:
        connection_id, deleted_by = message.get("connection_id"), message.get("deleted_by")
        mine = [s for s in list(self.live.values()) if s.connection.id == connection_id]
        if not mine:
            return
        if deleted_by is not None:
            await self.kill_where(lambda s: s.connection.id == connection_id,
                                  f"the connection {mine[0].connection.name} was deleted by {deleted_by}: "
                                  "the session was closed")
            return
        fresh = await self.store.get_connection(mine[0].connection.org_id, str(connection_id))
        for live in mine:
            if fresh is not None:
                live.connection = fresh
        await self._on_rules({"connection_id": connection_id})

    async def rules_changed(self, connection_id: str | None = None) -> None:
        """Guard rails changed (of one connection, or any): every node drops its compiled rules and its live
        sessions load theirs again; NotConfirmed when a node that may be serving does not confirm it (any of
        them may serve the next statement)."""
        missing = await self.cluster.request(self.RULES, await self.cluster.serving(), connection_id=connection_id)
        if missing:
            raise NotConfirmed("the rule was saved", missing)

    def rules_changed_soon(self) -> None:
        """``rules_changed`` from a synchronous caller (``GuardRailService.invalidate``): awaited by the API call
        that made the change before it answers (CONFIRMATIONS), else run in the background."""
        waiting = CONFIRMATIONS.get()
        if waiting is None:
            self.tasks.spawn(self.rules_changed())
        else:
            waiting.append(asyncio.ensure_future(self.rules_changed()))

    async def _on_rules(self, message: dict[str, Any]) -> None:
        connection_id = message.get("connection_id")
        for live in list(self.live.values()):
            if live.reload_rules is None or live.done.is_set():
                continue
            if connection_id is not None and live.connection.id != connection_id:
                continue
            try:
                await live.reload_rules()
            except Exception:
                log.exception("reloading a session's rules failed", extra=live.log_fields())

    async def kill_where(self, predicate: Callable[[LiveSession], bool], reason: str) -> int:
        """End the sessions live in this process that match ``predicate``."""
        targets = [s for s in list(self.live.values()) if predicate(s)]
        await asyncio.gather(*(s.kill(reason) for s in targets))
        return len(targets)

    async def close_orphans(self, node: Node, reason: str) -> int:
        """Close the sessions left ``open`` by a node that is gone (``node.id`` empty: by no node)."""
        stale = await (self.store.open_sessions_of([node.id]) if node.id else self.store.open_sessions_unheld())
        gap = (f"the process that held the session ({node.name or 'unknown'}) stopped without closing it: what it "
               "recorded last may be missing here (what it kept, in memory or in its journal, follows after this "
               "close once it reaches the store again)")
        for session in stale:
            await self._close_stored(session.id, reason, gap)
        if stale:
            log.warning("closed sessions left open by a previous run",  # of this node, or of one lost
                        extra={"count": len(stale), "node": node.name or "-"})
        return len(stale)

    async def _fenced(self, reason: str) -> None:
        """This node is fenced (it cannot renew its lease) or was declared lost (the others closed its sessions
        in the store): end them here, with ``reason``."""
        await self.kill_where(lambda s: True, reason)

    def hurry(self) -> None:
        """End the shutdown's grace now (the operator's second stop signal): the live sessions are closed as at
        its end."""
        self.hurried = True

    async def shutdown(self, grace: float) -> None:
        """Stop opening sessions, let live ones finish for ``grace`` seconds, then close the rest."""
        self.accepting = False
        deadline = time.monotonic() + grace
        while self.live and time.monotonic() < deadline and not self.hurried:
            await asyncio.sleep(min(0.1, max(deadline - time.monotonic(), 0)))
        await self.kill_where(lambda s: True, "gateway shutting down: the session was closed")
        await self.tasks.wait()
