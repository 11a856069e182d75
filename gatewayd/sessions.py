"""Sessions: open and done transitions, the registry of live sessions, kill and shutdown."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

from gatewayd.audit import AuditLog
from gatewayd.guardrails import GuardVerdict
from gatewayd import protocols
from gatewayd.models import Connection, Credential, Session, User, new_id, parse_time, rfc3339, utcnow
from gatewayd.recording import RecordingService, SessionRecorder
from gatewayd.store import Store
from gatewayd.tasks import BackgroundTasks

log = logging.getLogger("gatewayd.sessions")

BLOCKED_EXIT_CODE = 254
KillCallback = Callable[[str], Awaitable[None] | None]


class SessionUnavailable(RuntimeError):
    """A stored session asked to run cannot be claimed: it ran, ended or was killed already."""


class GatewayClosing(RuntimeError):
    """The gateway is shutting down: no new session is opened (a proxy says so in its protocol's words)."""

    def __init__(self) -> None:
        super().__init__("the gateway is shutting down")


def session_for(user: User, connection: Connection, *, verb: str = "connect", status: str = "open",
                session_id: str | None = None, **extra: Any) -> Session:
    """A new session record of ``user`` on ``connection``."""
    description = protocols.by_subtype(connection.subtype)
    session_type = description.session_type if description is not None else connection.type
    return Session(
        id=session_id or new_id(), org_id=connection.org_id, user_id=user.subject, user_email=user.email,
        user_name=user.name, connection=connection.name, connection_id=connection.id,
        resource_name=connection.resource_name, type=session_type, subtype=connection.subtype,
        verb=verb, status=status, tags=dict(connection.tags), start_date=rfc3339(utcnow()), **extra,
    )


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
        self.recorder.error(verdict.message)
        payload = {"session_id": self.id, "connection": self.connection.name, "guardrail": verdict.guardrail,
                   "direction": verdict.direction, "rule_type": verdict.rule_type}
        if verdict.text:
            payload["input"] = verdict.text
        await self.manager.audit.record(
            org_id=self.session.org_id, actor=self.user, action="guardrail.block",
            resource_type="session", outcome="failure", error_message=verdict.message, client_ip=client_ip,
            payload=payload,
        )

    async def close(self, exit_code: int | None = None, error: str | None = None) -> None:
        """Mark the session done, with an ``e`` event when it ended on an error; idempotent."""
        if self.done.is_set():
            return
        self.done.set()
        if self._expiry is not None:
            self._expiry.cancel()
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
            await self.manager.recording.close(self.recorder, end_date=rfc3339(utcnow()),
                                               exit_code=exit_code)
        except Exception:
            log.exception("could not close session", extra={"session_id": self.id})
        finally:
            self.finished.set()

    async def kill(self, reason: str) -> None:
        """End the session from the gateway side: tell the proxy, then close with ``reason``."""
        if self.done.is_set():
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
    """Creates sessions, tracks the live ones, and ends them on kill, expiry or shutdown."""

    def __init__(self, store: Store, recording: RecordingService, audit: AuditLog) -> None:
        self.store = store
        self.recording = recording
        self.audit = audit
        self.live: dict[str, LiveSession] = {}
        self.accepting = True
        self.tasks = BackgroundTasks("sessions")  # expiry kills

    async def open(self, user: User, connection: Connection, *, credential: Credential | None = None,
                   verb: str = "connect", script: str | None = None, metadata: dict[str, Any] | None = None,
                   batch_id: str | None = None, existing: Session | None = None,
                   client_ip: str = "") -> LiveSession:
        """Open a session; a credential's first connection claims the session issued with it.

        ``existing``: a stored ``ready`` session to run now (a reviewed one-time script), claimed
        here (``SessionUnavailable`` if it was claimed, ended or killed meanwhile).
        A session issued ``ready``, or moved to ``open`` when its jit credentials were handed out,
        is claimed by exactly one connection (``Store.claim_session``, atomic across processes);
        the others open sessions of their own.
        """
        if not self.accepting:
            raise GatewayClosing()
        session: Session | None = None
        if existing is not None:
            session = await self.store.claim_session(existing.id, rfc3339(utcnow()))
            if session is None:
                raise SessionUnavailable(f"session {existing.id} was run, ended or killed already")
            existing.status, existing.start_date = session.status, session.start_date
        claim = credential.session_id if credential is not None else None
        if session is None and claim is not None and claim not in self.live:
            session = await self.store.claim_session(claim, rfc3339(utcnow()))
        if credential is not None:
            batch_id = batch_id or credential.id
        if session is None:
            session = session_for(user, connection, verb=verb, script=script, metadata=metadata or {},
                                  session_batch_id=batch_id,
                                  credential_id=credential.id if credential else None,
                                  review_id=credential.review_id if credential else None)
            await self.store.create_session(session)
        recorder = await self.recording.recorder(session.id, started=time.monotonic())
        live = LiveSession(self, session, recorder, user, connection, credential, client_ip)
        self.live[session.id] = live
        log.info("session opened", extra=live.log_fields(verb=verb))
        if credential is not None:
            self._arm_expiry(live, credential)
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
        """End a session; True if it was not done.

        A session live here is killed here. Otherwise the kill is recorded on the row
        (``Store.request_kill``: it can no longer be claimed) and, since no process holds it here,
        the row is closed now with ``reason`` as its ``e`` event and exit code 254. (With several
        processes sharing a store, reaching the one that holds the session is the scale-out bus's.)
        """
        live = self.live.get(session_id)
        if live is not None:
            await live.kill(reason)
            return True
        session = await self.store.request_kill(session_id, reason, rfc3339(utcnow()))
        if session is not None:
            recorder = await self.recording.recorder(session_id)
            recorder.error(reason)
            await self.recording.close(recorder, end_date=rfc3339(utcnow()),
                                       exit_code=BLOCKED_EXIT_CODE)
            return True
        return False

    async def kill_where(self, predicate: Callable[[LiveSession], bool], reason: str) -> int:
        targets = [s for s in list(self.live.values()) if predicate(s)]
        await asyncio.gather(*(s.kill(reason) for s in targets))
        return len(targets)

    async def recover(self) -> int:
        """After a crash: close sessions left ``open`` with an ``e`` event; flushed events stay."""
        stale = await self.store.sessions_with_status("open")
        for session in stale:
            recorder = await self.recording.recorder(session.id)
            recorder.error("session closed on gateway restart: the gateway stopped while it was open")
            await self.recording.close(recorder, end_date=rfc3339(utcnow()),
                                       exit_code=BLOCKED_EXIT_CODE)
        if stale:
            log.warning("closed sessions left open by a previous run", extra={"count": len(stale)})
        return len(stale)

    async def shutdown(self, grace: float) -> None:
        """Stop opening sessions, let live ones finish for ``grace`` seconds, then close the rest."""
        self.accepting = False
        deadline = time.monotonic() + grace
        while self.live and time.monotonic() < deadline:
            await asyncio.sleep(min(0.1, max(deadline - time.monotonic(), 0)))
        await self.kill_where(lambda s: True, "gateway shutting down: the session was closed")
        await self.tasks.wait()
