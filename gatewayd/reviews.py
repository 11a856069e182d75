"""Reviews: who must approve a session, the state machine of a decision, time windows, jit expiry.

The first half is pure logic (no store, no clock of its own: ``now`` is passed
in), so every transition is a unit test.  ``ReviewService`` at the end wires it
to the store, the audit log, the credentials and the live sessions: a jit
review that is revoked or reaches the end of its duration closes every live
proxy session opened with it, in every protocol.  It also runs one-time
scripts, reviewed or not, through the session pipeline (``run_script``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import datetime, time, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from gatewayd.access import AccessGrant
from gatewayd.cluster import NotConfirmed
from gatewayd.models import (
    AccessRequestRule,
    Connection,
    Review,
    ReviewGroup,
    Session,
    User,
    new_id,
    parse_time,
    rfc3339,
    utcnow,
)
from gatewayd.pipeline import GatewayClosing, TargetUnreachable
from gatewayd.scripts import RedactingRecorder, Redaction, ScriptResult
from gatewayd.sessions import BLOCKED_EXIT_CODE, SessionUnavailable
from gatewayd.store import Conflict
from gatewayd.tasks import BackgroundTasks

if TYPE_CHECKING:
    from gatewayd.analysis import AnalysisService
    from gatewayd.audit import AuditLog
    from gatewayd.pipeline import SessionPipeline, SessionRun
    from gatewayd.scripts import ScriptRunner
    from gatewayd.sessions import LiveSession, SessionManager
    from gatewayd.store import Store

log = logging.getLogger("gatewayd.reviews")
T = TypeVar("T")

PENDING, APPROVED, REJECTED, REVOKED = "PENDING", "APPROVED", "REJECTED", "REVOKED"
PROCESSING, EXECUTED, UNKNOWN = "PROCESSING", "EXECUTED", "UNKNOWN"
STATUSES = (PENDING, APPROVED, REJECTED, REVOKED, PROCESSING, EXECUTED, UNKNOWN)
DECISIONS = (APPROVED, REJECTED, REVOKED)
JIT, ONETIME = "jit", "onetime"
NS = 1_000_000_000
DEFAULT_ACCESS_DURATION = 1800 * NS  # the spec's default: 30 minutes, in nanoseconds
DEFAULT_JIT_MAX_SECONDS = 48 * 3600
_HHMM = re.compile(r"^([01]\d|2[0-3]):([0-5]\d)$")


class ReviewError(Exception):
    """A decision or request that cannot be made; ``status`` is the HTTP status, the message is for the user."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


# --------------------------------------------------------------------------- who reviews what


@dataclass(slots=True)
class ReviewPolicy:
    """What a connection (or an access request rule) asks of a review."""

    reviewers: list[str]
    min_approvals: int
    force_approval_groups: list[str] = field(default_factory=list)
    max_duration_seconds: int = DEFAULT_JIT_MAX_SECONDS
    rule_name: str | None = None


def _strings(value: Any) -> list[str]:
    return [v.strip() for v in value if isinstance(v, str) and v.strip()] if isinstance(value, list) else []


REVIEW_SETTINGS = ("reviewers", "force_approval_groups", "min_approvals", "jit_max_duration", "jit_review",
                   "exec_review")  # a connection's ``settings`` that ask for reviews (``check_review_settings``)


def check_review_settings(settings: dict[str, Any]) -> str | None:
    """Why a connection's review settings are unusable, or None."""
    for key in ("reviewers", "force_approval_groups"):
        value = settings.get(key)
        if value is not None and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            return f"field 'settings.{key}': expected a list of group names"
    for key in ("min_approvals", "jit_max_duration"):
        value = settings.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            return f"field 'settings.{key}': expected a positive integer"
    for key in ("jit_review", "exec_review"):
        value = settings.get(key)
        if value is not None and not isinstance(value, bool):
            return f"field 'settings.{key}': expected true or false"
    return None


def policy_for(connection: Connection, kind: str, rules: list[AccessRequestRule]) -> ReviewPolicy | None:
    """The review a ``jit`` (native access) or ``onetime`` (script) request on ``connection`` needs, or None.

    An access request rule naming the connection, for that kind of access,
    wins over the connection's own ``settings``.
    """
    access_type = "jit" if kind == JIT else "command"
    for rule in sorted(rules, key=lambda r: r.name):
        if rule.access_type == access_type and connection.name in rule.connection_names and rule.reviewers_groups:
            reviewers = list(dict.fromkeys(rule.reviewers_groups))
            return ReviewPolicy(
                reviewers=reviewers,
                min_approvals=max(1, min(rule.min_approvals or len(reviewers), len(reviewers))),
                force_approval_groups=list(rule.force_approval_groups),
                max_duration_seconds=rule.access_max_duration or DEFAULT_JIT_MAX_SECONDS,
                rule_name=rule.name,
            )
    settings = connection.settings or {}
    reviewers = list(dict.fromkeys(_strings(settings.get("reviewers"))))
    if not reviewers or settings.get("jit_review" if kind == JIT else "exec_review", True) is False:
        return None
    wanted = settings.get("min_approvals")
    return ReviewPolicy(
        reviewers=reviewers,
        min_approvals=max(1, min(wanted if isinstance(wanted, int) and not isinstance(wanted, bool)
                                 else len(reviewers), len(reviewers))),
        force_approval_groups=_strings(settings.get("force_approval_groups")),
        max_duration_seconds=int(settings.get("jit_max_duration") or DEFAULT_JIT_MAX_SECONDS),
    )


def review_summary(connection: Connection, rules: list[AccessRequestRule]) -> dict[str, Any]:
    """Who reviews access to ``connection``: for native access (``jit``) and for scripts (``exec``), the groups, the
    approvals needed and the access request rule that asks it (None: its own settings); None where none is needed."""
    summary: dict[str, Any] = {}
    for kind, name in ((JIT, "jit"), (ONETIME, "exec")):
        policy = policy_for(connection, kind, rules)
        summary[name] = None if policy is None else {
            "reviewers": policy.reviewers, "min_approvals": policy.min_approvals, "rule": policy.rule_name}
    return summary


def request_key(connection: Connection, owner: User, kind: str, script: str | None) -> str:
    """What a request asks, as a key: the same person, connection and kind of access (and script, for a
    one-time review) make the same key, so that asking again finds the request already open."""
    what = "\0".join((connection.org_id, connection.id, owner.id, kind, script or ""))
    return hashlib.sha256(what.encode()).hexdigest()


def reusable(review: Review | None, now: datetime) -> Review | None:
    """An open request the same person may be handed again: PENDING, or APPROVED and usable now (a jit access
    not over yet; a script not run yet, inside its time window)."""
    if review is None or review.status not in (PENDING, APPROVED) or jit_ended(review, now):
        return None
    if review.status == APPROVED and review.type == ONETIME and not in_time_window(review.time_window, now):
        return None  # asking again asks for another window
    return review


def new_review(policy: ReviewPolicy, owner: User, connection: Connection, session_id: str, kind: str,
               now: datetime, access_duration: int | None = None) -> Review:
    """A PENDING review of ``session_id``, one group entry per reviewer group."""
    review_id = new_id()
    return Review(
        id=review_id, org_id=connection.org_id, session_id=session_id, connection_id=connection.id, type=kind,
        status=PENDING, owner_id=owner.id, created_at=rfc3339(now), updated_at=rfc3339(now),
        connection_name=connection.name, owner_email=owner.email, owner_name=owner.name,
        owner_slack_id=owner.slack_id, access_duration=(access_duration or DEFAULT_ACCESS_DURATION)
        if kind == JIT else None, access_request_rule_name=policy.rule_name, min_approvals=policy.min_approvals,
        force_approval_groups=list(policy.force_approval_groups),
        groups=[ReviewGroup(id=new_id(), review_id=review_id, group_name=g) for g in policy.reviewers],
    )


# --------------------------------------------------------------------------- time windows


def parse_time_window(value: Any) -> dict[str, Any]:
    """A validated ``{type: time_range, configuration: {start_time, end_time}}`` (``HH:MM`` UTC)."""
    if not isinstance(value, dict) or value.get("type") != "time_range":
        raise ReviewError(400, "time_window: expected {\"type\": \"time_range\", \"configuration\": "
                               "{\"start_time\": \"HH:MM\", \"end_time\": \"HH:MM\"}}")
    config = value.get("configuration")
    if not isinstance(config, dict):
        raise ReviewError(400, "time_window.configuration: expected an object with start_time and end_time")
    times = []
    for key in ("start_time", "end_time"):
        text = config.get(key)
        if not isinstance(text, str) or not _HHMM.match(text):
            raise ReviewError(400, f"time_window.configuration.{key}: expected HH:MM (00:00 to 23:59, UTC)")
        times.append(text)
    if times[0] == times[1]:
        raise ReviewError(400, "time_window: start_time and end_time must differ")
    return {"type": "time_range", "configuration": {"start_time": times[0], "end_time": times[1]}}


def _clock(text: str) -> time:
    hours, minutes = text.split(":")
    return time(int(hours), int(minutes))


def in_time_window(window: dict[str, Any] | None, now: datetime) -> bool:
    """Whether ``now`` (UTC) is inside ``[start_time, end_time)``; a window may span midnight."""
    if not window:
        return True
    config = window["configuration"]
    start, end = _clock(config["start_time"]), _clock(config["end_time"])
    moment = now.time().replace(tzinfo=None)
    if start < end:
        return start <= moment < end
    return moment >= start or moment < end


# --------------------------------------------------------------------------- decisions


@dataclass(slots=True)
class Decision:
    """What one reviewer's call did: the groups they decided for, and whether the review changed status."""

    action: str  # approve, force_approve, reject, revoke
    groups: list[str]
    previous: str
    status: str

    @property
    def completed(self) -> bool:
        return self.previous != self.status


def jit_ended(review: Review, now: datetime) -> bool:
    """An approved jit review whose access duration is over."""
    end = parse_time(review.revoke_at)
    return review.type == JIT and review.status == APPROVED and end is not None and end <= now


def approvals(review: Review) -> int:
    return sum(1 for g in review.groups if g.status == APPROVED and not g.forced_review)


def _mark(group: ReviewGroup, status: str, actor: User, now: datetime, forced: bool = False) -> None:
    group.status = status
    group.review_date = rfc3339(now)
    group.reviewed_by_id = actor.id
    group.reviewed_by_email = actor.email
    group.reviewed_by_name = actor.name
    group.forced_review = group.forced_review or forced


def decide(review: Review, actor: User, status: str, now: datetime, *, force: bool = False,
           time_window: Any = None, admins_can_self_approve: bool = True) -> Decision:
    """Apply ``actor``'s decision to ``review`` in place, or raise ReviewError (400 bad transition, 403 not allowed).

    * Only members of a reviewer group (or of a force-approval group, to force) and admins may decide;
      an admin outside every reviewer group decides for every group still pending.
    * Nobody approves their own request, except admins when ``admins_can_self_approve``.
    * APPROVED marks the actor's groups; the review is APPROVED once ``min_approvals`` groups approved,
      or at once when forced. REJECTED by any group rejects the review, for good.
    * REVOKED only ends an APPROVED jit review whose access has not ended yet.
    """
    if status not in DECISIONS:
        raise ReviewError(400, f"status: expected one of {', '.join(DECISIONS)}, got {status!r}")
    previous = review.status
    mine = set(actor.groups)
    review_groups = [g.group_name for g in review.groups]
    member_of = [g for g in review.groups if g.group_name in mine]
    force_groups = [g for g in review.force_approval_groups if g in mine]
    if not (member_of or actor.is_admin or (force and force_groups)):
        raise ReviewError(403, "access denied: you are not in a reviewer group of this review "
                               f"({', '.join(review_groups)})")
    if time_window is not None and status != APPROVED:
        raise ReviewError(400, "time_window: only an approval sets a time window")
    if force and status != APPROVED:
        raise ReviewError(400, "force_review: only an approval can be forced")

    if status == REVOKED:
        if review.type != JIT:
            raise ReviewError(400, "only a just-in-time (jit) review can be revoked")
        if review.status != APPROVED:
            raise ReviewError(400, f"only an approved review can be revoked; this one is {review.status}")
        if jit_ended(review, now):
            raise ReviewError(400, "the review's access duration is already over")
        acting = member_of or [g for g in review.groups if g.status == APPROVED] or review.groups
        for group in acting:
            _mark(group, REVOKED, actor, now)
        review.status = REVOKED
        review.revoke_at = rfc3339(now)
        review.updated_at = rfc3339(now)
        return Decision("revoke", [g.group_name for g in acting], previous, REVOKED)

    if review.status != PENDING:
        if review.status == REJECTED:
            raise ReviewError(400, "the review was rejected: a rejection is final")
        raise ReviewError(400, f"only a pending review can be {status.lower()}; this one is {review.status}")
    if status == APPROVED and actor.id == review.owner_id and not (actor.is_admin and admins_can_self_approve):
        raise ReviewError(403, "access denied: you cannot approve your own request")
    window = None
    if time_window is not None:
        if review.type != ONETIME:
            raise ReviewError(400, "time_window: applies to one-time (script) reviews only")
        window = parse_time_window(time_window)

    if status == REJECTED:
        acting = member_of or [g for g in review.groups if g.status is None] or review.groups
        for group in acting:
            _mark(group, REJECTED, actor, now)
        review.status = REJECTED
        review.updated_at = rfc3339(now)
        return Decision("reject", [g.group_name for g in acting], previous, REJECTED)

    if force:
        if not force_groups and not actor.is_admin:
            raise ReviewError(403, "access denied: forcing an approval takes a member of a force-approval group "
                                   f"({', '.join(review.force_approval_groups) or 'none is set'})")
        group_name = force_groups[0] if force_groups else "admin"
        entry = next((g for g in review.groups if g.group_name == group_name), None)
        if entry is None:
            entry = ReviewGroup(id=new_id(), review_id=review.id, group_name=group_name)
            review.groups.append(entry)
        _mark(entry, APPROVED, actor, now, forced=True)
        acting = [entry]
    else:
        acting = [g for g in member_of if g.status is None] if member_of else \
            [g for g in review.groups if g.status is None]
        if not acting:
            decided = ", ".join(f"{g.group_name} ({g.status})" for g in member_of)
            raise ReviewError(400, f"your group already decided on this review: {decided}")
        for group in acting:
            _mark(group, APPROVED, actor, now)
    if window is not None:
        review.time_window = window
    if force or approvals(review) >= min(review.min_approvals, len(review.groups)):
        review.status = APPROVED
        if review.type == JIT:
            review.revoke_at = rfc3339(now + timedelta(microseconds=(review.access_duration or
                                                                     DEFAULT_ACCESS_DURATION) // 1000))
    review.updated_at = rfc3339(now)
    return Decision("force_approve" if force else "approve", [g.group_name for g in acting], previous,
                    review.status)


def reviews_for(user: User, review: Review) -> bool:
    """Whether ``user`` is in a reviewer or force-approval group of ``review`` (they may read what it is about)."""
    mine = set(user.groups)
    return any(g.group_name in mine for g in review.groups) or bool(mine & set(review.force_approval_groups))


def check_executable(review: Review, now: datetime) -> None:
    """Raise ReviewError unless a one-time review lets its script run now."""
    if review.status == PENDING:
        raise ReviewError(403, "the review is still pending: the script runs once it is approved")
    if review.status == REJECTED:
        raise ReviewError(403, "the review was rejected: the script will not run")
    if review.status in (PROCESSING, EXECUTED):
        raise ReviewError(400, f"the script was already run (review {review.status})")
    if review.status != APPROVED:
        raise ReviewError(400, f"the review is {review.status}: the script cannot run")
    if not in_time_window(review.time_window, now):
        config = review.time_window["configuration"]  # type: ignore[index]
        raise ReviewError(403, f"outside the review's time window: the script may run between "
                               f"{config['start_time']} and {config['end_time']} UTC")


# --------------------------------------------------------------------------- the API's view


def review_json(review: Review, session: Session | None = None, full: bool = False) -> dict[str, Any]:
    """The spec's session review object; ``full`` adds the owner, connection and session (``/reviews``)."""
    data: dict[str, Any] = {
        "id": review.id, "type": review.type, "status": review.status, "created_at": review.created_at,
        "revoke_at": review.revoke_at or "", "access_duration": review.access_duration if review.type == JIT else 0,
        "access_request_rule_name": review.access_request_rule_name, "min_approvals": review.min_approvals,
        "force_approval_groups": list(review.force_approval_groups),
        "review_groups_data": [{
            "id": g.id, "group": g.group_name, "forced_review": g.forced_review, "review_date": g.review_date or "",
            "status": g.status or "",
            "reviewed_by": {"id": g.reviewed_by_id, "email": g.reviewed_by_email, "name": g.reviewed_by_name or "",
                            "chat_id": ""} if g.reviewed_by_id else None,
        } for g in review.groups],
        "time_window": review.time_window,
    }
    if full:
        data.update({
            "org_id": review.org_id, "session": review.session_id, "session_id": review.session_id,
            "updated_at": review.updated_at,
            "review_connection": {"id": review.connection_id, "name": review.connection_name},
            "review_owner": {"id": review.owner_id, "email": review.owner_email, "name": review.owner_name,
                             "chat_id": review.owner_slack_id},
        })
        data["reason"] = review.reason
        if session is not None:
            data["input"] = session.script or ""
            if session.ai_analysis:  # the AI verdict on the script, for the reviewers (gatewayd.analysis)
                data["ai_analysis"] = session.ai_analysis
    return data


# --------------------------------------------------------------------------- the service


@dataclass(slots=True)
class ScriptJob:
    """A one-time script started: its session and the task that ends with its result (the session closed)."""

    session_id: str
    result: asyncio.Future[ScriptResult]
    live: LiveSession | None = None  # None: the target was unreachable, the session is closed already

    @property
    def truncated(self) -> bool:
        """The recording reached its cap (the answer's output is cut too)."""
        return self.live is not None and self.live.recorder.truncated

    @property
    def ai_analysis(self) -> dict[str, Any] | None:
        """The AI verdict on the script, once it was analysed."""
        return self.live.session.ai_analysis if self.live is not None else None


_CHANGE_TRIES = 5  # a review stored meanwhile by another process: read and changed again, this many times at most
_SEALED_SCRIPT = "script:"  # the store's sealed key of a reviewed script made with secrets (``seal_script``)
ARMED = "review.armed"  # the bus topic: a jit review was approved, every node arms the end of its access


class ReviewService:
    """Decisions with their side effects: audit, jit expiry, revocation of credentials and live sessions.

    It also runs one-time scripts (reviewed or not) through the session pipeline,
    with the runner registered for the connection's subtype.
    """

    def __init__(self, store: Store, audit: AuditLog, sessions: SessionManager, pipeline: SessionPipeline,
                 analysis: AnalysisService, runners: dict[str, ScriptRunner], *,
                 admins_can_self_approve: bool = True) -> None:
        self.store = store
        self.audit = audit
        self.sessions = sessions
        self.pipeline = pipeline
        self.analysis = analysis
        self.runners = runners  # by connection subtype
        self.admins_can_self_approve = admins_can_self_approve
        self._timers: dict[str, asyncio.Task[Any]] = {}  # review id -> the task that ends its jit access
        self._locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}  # review id -> (lock, [holders + waiters])
        self.tasks = BackgroundTasks("reviews")  # scripts running, AI previews
        self.timers = BackgroundTasks("review-expiry")
        sessions.cluster.on(ARMED, self._on_armed)

    async def _on_armed(self, message: dict[str, Any]) -> None:
        review = await self.store.get_review(str(message.get("review_id")))
        if review is not None:
            self.arm(review)

    @contextlib.asynccontextmanager
    async def lock(self, review_id: str) -> AsyncIterator[None]:
        """Decisions on one review are made one at a time; the lock is dropped once nobody holds or waits for it."""
        entry = self._locks.get(review_id)
        if entry is None:
            entry = self._locks[review_id] = (asyncio.Lock(), [0])
        lock, users = entry
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if not users[0] and self._locks.get(review_id) is entry:
                del self._locks[review_id]

    async def start(self) -> None:
        """Arm the expiry of every approved jit review (those already over end now)."""
        for review in await self.store.reviews_with_status(APPROVED, JIT):
            self.arm(review)

    def stop(self) -> None:
        for task in self._timers.values():
            task.cancel()
        self._timers.clear()

    async def finish(self, timeout: float = 5.0) -> None:
        """Let background jobs (a script's end and its EXECUTED, an expiry) reach the store before it closes."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await asyncio.shield(self.tasks.wait())

    def spawn(self, coroutine: Any) -> asyncio.Task[Any]:
        """Run ``coroutine`` in the background, held (and awaited by ``finish``) until it ends."""
        return self.tasks.spawn(coroutine)

    def arm(self, review: Review) -> None:
        """Schedule the end of an approved jit review's access."""
        end = parse_time(review.revoke_at)
        if review.type != JIT or review.status != APPROVED or end is None:
            return
        old = self._timers.pop(review.id, None)
        if old is not None:
            old.cancel()
        self._timers[review.id] = self.timers.spawn(self._expire_at(review.id, end))

    async def _expire_at(self, review_id: str, end: datetime) -> None:
        await asyncio.sleep(max((end - utcnow()).total_seconds(), 0))
        self._timers.pop(review_id, None)
        self.spawn(self.expire(review_id))  # not this task: a later arm or stop must not cancel the expiry midway

    async def apply(self, review_id: str, actor: User, status: str, *, force: bool = False,
                    time_window: Any = None) -> tuple[Review, Decision]:
        """Decide (see ``decide``) on the stored review, store it, and carry out a revocation."""
        async with self.lock(review_id):
            review = await self.store.get_review(review_id)
            if review is None:
                raise ReviewError(404, f"review {review_id!r} not found")
            if jit_ended(review, utcnow()):
                await self.expire(review.id, locked=True)  # stored REVOKED: the decision below is refused
            review, decision = await self._change(review_id, lambda review: decide(
                review, actor, status, utcnow(), force=force, time_window=time_window,
                admins_can_self_approve=self.admins_can_self_approve))
        if review.status == APPROVED and decision.completed:
            await self.sessions.cluster.publish(ARMED, review_id=review.id)  # every node arms its end
        if decision.status == REJECTED and decision.completed:  # it will never run: the session is done
            await self.sessions.kill(review.session_id, f"the review was rejected by {actor.email}: "
                                                                "the session did not run")
            await self.store.delete_key(_SEALED_SCRIPT + review.session_id)  # a runbook's, made with secrets
        if decision.status == REVOKED:
            timer = self._timers.pop(review.id, None)
            if timer is not None:
                timer.cancel()
            await self.end_access(review, f"just-in-time access revoked by {actor.email}: the session was closed")
        return review, decision

    async def ended_meanwhile(self, review: Review) -> Review | None:
        """After a credential of the jit ``review`` was issued: the review as stored now if it no longer gives access,
        with its credentials revoked again (the new one with them), else None. A revocation or an expiry stores
        REVOKED before it revokes the credentials, so one issued after that is caught here, on any worker or node."""
        now = await self.store.get_review(review.id)
        if now is not None and now.status == APPROVED and not jit_ended(now, utcnow()):
            return None
        await self.store.revoke_credentials(review_id=review.id, revoked_at=rfc3339(utcnow()))
        return now or review

    async def end_access(self, review: Review, reason: str) -> None:
        """Refuse the review's credentials from now on and close every live session opened with them, on every node
        (NotConfirmed, once all of it was asked, when a node holding one of them did not confirm)."""
        await self.store.revoke_credentials(review_id=review.id, revoked_at=rfc3339(utcnow()))
        unconfirmed: NotConfirmed | None = None
        try:
            await self.sessions.end(reason, review_id=review.id)
        except NotConfirmed as exc:
            unconfirmed = exc
        await self.sessions.kill(review.session_id, reason)  # its session, if no client ever used it
        if unconfirmed is not None:
            raise unconfirmed

    async def expire(self, review_id: str, locked: bool = False) -> None:
        """The access duration of a jit review is over: REVOKED (at its scheduled time), sessions closed."""
        self._timers.pop(review_id, None)
        if locked:
            review = await self._revoke_if_over(review_id)
        else:
            async with self.lock(review_id):
                review = await self._revoke_if_over(review_id)
        if review is None:
            return
        try:
            await self.end_access(review, "just-in-time access expired: the review's access duration is over, "
                                          "the session was closed")
        except NotConfirmed as exc:  # nobody waits for an answer: said in the log, the audit entry still written
            log.error("a jit review expired: not every node confirmed it ended its sessions",
                      extra={"review_id": review.id, "reason": str(exc)})
        await self.audit.record(
            org_id=review.org_id, actor=None, action="review.expire", resource_type="reviews", outcome="success",
            payload={"review_id": review.id, "session_id": review.session_id, "connection": review.connection_name},
            actor_hint="gatewayd")

    async def _revoke_if_over(self, review_id: str) -> Review | None:
        """Store REVOKED on a jit review whose access is over and return it; else None (re-armed if still on).

        Every node arms the timer of every approved jit review (a node may die); the move to REVOKED is
        one conditional UPDATE, so exactly one of them ends the access and writes ``review.expire``.
        """
        review = await self.store.get_review(review_id)
        if review is None or not jit_ended(review, utcnow()):
            if review is not None:
                self.arm(review)  # approved again later or clock drift: check again at the new end
            return None
        now = rfc3339(utcnow())
        if not await self.store.transition_review(review.id, APPROVED, REVOKED, now):
            return None  # another node expired it, or it was revoked meanwhile
        review.status, review.updated_at = REVOKED, now
        return review

    async def policy(self, connection: Connection, kind: str) -> ReviewPolicy | None:
        """The review ``kind`` of access to ``connection`` needs (rules first, then its settings), or None."""
        return policy_for(connection, kind, await self.store.list_access_rules(connection.org_id))

    async def request(self, policy: ReviewPolicy, owner: User, connection: Connection, session: Session,
                      kind: str, access_duration: int | None = None, reason: str = "") -> Review:
        """Store a PENDING review together with the (``ready``) session it reviews.

        One open request per person, connection and kind (and script): asking again returns the review
        already open -- PENDING, or APPROVED and still usable -- and stores nothing (``review.session_id``
        is then not ``session.id``). Across processes the store's unique index on the PENDING ``request_key``
        makes a second insert a Conflict, answered the same way.
        """
        key = request_key(connection, owner, kind, session.script)
        existing = reusable(await self.store.open_review_for(key), utcnow())
        if existing is not None:
            return existing
        review = new_review(policy, owner, connection, session.id, kind, utcnow(), access_duration)
        review.request_key, review.reason = key, reason.strip()
        session.review_id = review.id
        try:
            await self.store.create_review(review, session)
        except Conflict:  # the same request, stored meanwhile by another call
            session.review_id = None
            existing = reusable(await self.store.open_review_for(key), utcnow())
            if existing is None:
                raise
            return existing
        return review

    async def set_status(self, review_id: str, status: str) -> Review | None:
        """PROCESSING / EXECUTED of a one-time review (not a reviewer's decision)."""
        async with self.lock(review_id):
            review = await self.store.get_review(review_id)
            if review is None:
                return None
            review.status = status
            review.updated_at = rfc3339(utcnow())
            await self.store.save_review(review)
            return review

    async def begin_execution(self, review_id: str) -> Review:
        """Check that a one-time review lets its script run now and mark it PROCESSING (once)."""

        def processing(review: Review) -> None:
            check_executable(review, utcnow())
            review.status = PROCESSING
            review.updated_at = rfc3339(utcnow())

        async with self.lock(review_id):
            return (await self._change(review_id, processing))[0]

    async def _change(self, review_id: str, change: Callable[[Review], T]) -> tuple[Review, T]:
        """``change`` made to the stored review (it raises ReviewError to refuse) and stored, as one step across
        workers and nodes: stored only if nobody stored the review since it was read, else read again and changed
        again -- a decision made meanwhile elsewhere (a rejection, another group's approval) is what it meets."""
        for _ in range(_CHANGE_TRIES):
            review = await self.store.get_review(review_id)
            if review is None:
                raise ReviewError(404, f"review {review_id!r} not found")
            was = (review.status, review.updated_at)
            outcome = change(review)
            if await self.store.save_review(review, was=was):
                return review, outcome
        raise ReviewError(409, "the review kept changing while this was decided: try again")

    # -- one-time scripts

    async def seal_script(self, session_id: str, script: str, secrets: tuple[str, ...]) -> None:
        """Keep a reviewed script made with secrets (a runbook's passwords) sealed until it runs: its session
        stores it with ``[REDACTED]`` in their place, and only ``run_script`` opens this copy (then forgets it)."""
        await self.store.put_key(_SEALED_SCRIPT + session_id, json.dumps({"script": script,
                                                                         "secrets": list(secrets)}).encode())

    async def _sealed_script(self, session_id: str) -> tuple[str, Redaction] | None:
        material = await self.store.get_key(_SEALED_SCRIPT + session_id)
        if material is None:
            return None
        sealed = json.loads(material)
        return sealed["script"], Redaction.of(sealed["secrets"])

    async def run_script(self, user: User, connection: Connection, script: str, *, session: Session | None = None,
                         review: Review | None = None, metadata: dict[str, Any] | None = None,
                         batch_id: str | None = None, client_ip: str = "",
                         secrets: tuple[str, ...] = ()) -> ScriptJob:
        """Start ``script`` on ``connection`` through the session pipeline, with the runner of its subtype.

        ``session``: the stored ``ready`` session of an approved ``review`` (marked EXECUTED once the
        script ended; its sealed script, when ``seal_script`` kept one, runs instead of the stored text);
        else a new session is opened.  ``secrets``: values of the script never recorded (``Redaction``).
        The target is dialed before this returns: an unreachable one gives a finished job (the session
        closed with its ``e`` and exit code 254). Raises KeyError when no runner serves the subtype,
        GatewayClosing when the gateway is shutting down (nothing ran; an approval still stands),
        SessionUnavailable when ``session`` was killed or ended meanwhile (nothing ran; ``review`` is EXECUTED).
        """
        redaction = Redaction.of(secrets)
        if session is not None:
            sealed = await self._sealed_script(session.id)
            if sealed is not None:
                script, redaction = sealed
                await self.store.delete_key(_SEALED_SCRIPT + session.id)  # it runs once
        runner = self.runners[connection.subtype]
        dialed: list[Any] = []

        async def dial(dialer: Any) -> Any:
            target = await runner.dial(dialer, connection)
            dialed.append(target)
            return target

        def kill(reason: str) -> Any:  # a kill, an expiry, the shutdown: stop what runs on the target
            return (runner.kill or runner.stop)(dialed[0]) if dialed else None

        try:
            run = await self.pipeline.start(
                AccessGrant(None, user, connection), client_ip, dial=dial, unreachable=runner.unreachable,
                drop=runner.stop, on_kill=kill, observe=False, existing=session, verb="exec",
                script=redaction.text(script), metadata=metadata, batch_id=batch_id)
        except GatewayClosing:
            if review is not None:
                await self.set_status(review.id, APPROVED)
            raise
        except SessionUnavailable:  # its session was killed (or ended) before it ran: the one run is spent
            if review is not None:
                await self.set_status(review.id, EXECUTED)
            raise
        except TargetUnreachable as exc:
            if review is not None:
                await self.set_status(review.id, EXECUTED)
            done: asyncio.Future[ScriptResult] = asyncio.get_running_loop().create_future()
            done.set_result(ScriptResult(exc.message + "\n", BLOCKED_EXIT_CODE))
            return ScriptJob(exc.session_id or "", done)
        if redaction.secrets:
            run.live.redaction = redaction
            run.policy = run.policy.recording_to(RedactingRecorder(run.policy.recorder, redaction))  # type: ignore[arg-type]
        return ScriptJob(run.id, self.spawn(self._run_script(run, runner, script, review, redaction)), run.live)

    async def _run_script(self, run: SessionRun[Any], runner: ScriptRunner, script: str,
                          review: Review | None, redaction: Redaction) -> ScriptResult:
        """The AI analysis of the whole script, then the runner; the session closed with the script's exit code."""
        async with run:
            try:
                verdict = await self.analysis.check_script(run.live, redaction.text(script))
                if verdict is not None and verdict.blocked:
                    result = ScriptResult(verdict.message() + "\n", BLOCKED_EXIT_CODE)
                else:
                    result = await runner.run(run, script)
            except Exception:
                log.exception("script runner failed", extra={"session_id": run.id})
                result = ScriptResult("the gateway could not run the script\n", BLOCKED_EXIT_CODE)
                run.policy.error(result.output.strip())
            finally:
                runner.stop(run.target)
            await run.close(exit_code=result.exit_code)
        if review is not None:
            await self.set_status(review.id, EXECUTED)
        if redaction.secrets:
            result.output = redaction.text(result.output)
        return result
