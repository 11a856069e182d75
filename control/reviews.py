"""Reviews: decisions on reviews, one-time scripts (``POST /sessions``), jit credentials, access request rules."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiohttp import web

from control.connections import CREDENTIALS_OUT, MAX_DURATION_SECONDS
from control.http import (
    AUDIT_ACTION,
    AUDIT_PAYLOAD,
    INT64_MAX,
    ApiError,
    Field,
    Param,
    RouteSet,
    Schema,
    array_of,
    json_body,
    ok,
    query_int,
    require_admin,
    services_of,
    user_of,
)
from control.schemas import JIT_PENDING_OUT, REVIEW_FULL_OUT, SCRIPT_RESULT_OUT, TEXT
from control.sessions import full_id, review_of, session_in_org
from gatewayd.access import credential_prefix
from gatewayd.models import AccessRequestRule, Connection, Review, User, new_id, parse_time, rfc3339, utcnow
from gatewayd.reviews import (
    APPROVED,
    DECISIONS,
    JIT,
    ONETIME,
    PENDING,
    REJECTED,
    REVOKED,
    STATUSES,
    ReviewError,
    ScriptJob,
    jit_ended,
    review_json,
    reviews_for,
)
from gatewayd.protocols import session_for
from gatewayd.scripts import Redaction
from gatewayd.services import Services
from gatewayd.sessions import SessionUnavailable
from gatewayd.store import Conflict

log = logging.getLogger("gatewayd.api.reviews")

routes = RouteSet("Reviews", audit="reviews")

MAX_APPROVALS = 1000  # more approvals than any organization has reviewers
DECISION = Schema("ReviewDecision", {
    "status": Field("string", True, enum=DECISIONS), "time_window": Field("object", nullable=True),
    "force_review": Field("boolean"),
})
EXEC = Schema("SessionExec", {
    "connection": Field("string", True), "script": Field("string", True, min_length=1),
    "session_batch_id": Field("string", nullable=True), "metadata": Field("object", nullable=True),
    "reason": Field("string", nullable=True, description="why you ask (shown to the reviewers of a reviewed script)"),
})
RULE = Schema("AccessRequestRule", {
    "name": Field("string", True), "description": Field("string"),
    "access_type": Field("string", True, enum=("jit", "command")),
    "connection_names": Field("array", items="string"),
    "reviewers_groups": Field("array", True, items="string", min_length=1),
    "force_approval_groups": Field("array", items="string"),
    "min_approvals": Field("integer", nullable=True, minimum=1, maximum=MAX_APPROVALS),
    "access_max_duration": Field("integer", nullable=True, minimum=1, maximum=MAX_DURATION_SECONDS,
                                 description="seconds (jit)"),
})
RULE_OUT = Schema("AccessRequestRuleOut", {
    "id": TEXT, "name": TEXT, "description": TEXT, "access_type": Field("string", True, enum=("jit", "command")),
    "connection_names": Field("array", True, items="string"), "reviewers_groups": Field("array", True, items="string"),
    "force_approval_groups": Field("array", True, items="string"),
    "min_approvals": Field("integer", True, nullable=True, minimum=1, maximum=MAX_APPROVALS),
    "access_max_duration": Field("integer", True, nullable=True, minimum=1, maximum=MAX_DURATION_SECONDS),
    "created_at": TEXT, "updated_at": TEXT,
})


def _error(exc: ReviewError) -> ApiError:
    return ApiError(exc.status, exc.message)


def may_see(user: User, review: Review) -> bool:
    """Admins and auditors, the requester, and members of its reviewer or force-approval groups."""
    return user.is_admin or user.is_auditor or review.owner_id == user.id or reviews_for(user, review)


async def _review_in_org(request: web.Request, key: str) -> Review:
    """The review of the caller's organization by its id or, where it is unambiguous, the start of it; else 404."""
    store = services_of(request).store
    review = await store.get_review(key)
    if review is None and len(key) < 36:
        review = await store.get_review(await full_id(request, "reviews", key))
    if review is None or review.org_id != user_of(request).org_id:
        raise ApiError(404, f"review {key!r} not found")
    return review


async def _visible_review(request: web.Request, key: str) -> Review:
    user = user_of(request)
    review = await _review_in_org(request, key)
    if not may_see(user, review):
        raise ApiError(403, "access denied: you are neither the requester nor a reviewer of this review")
    return review


async def _review_document(services: Services, review: Review) -> dict[str, Any]:
    return review_json(review, await services.store.get_session(review.session_id), full=True)


# --------------------------------------------------------------------------- reviews


@routes.get("/reviews", "Reviews the caller requested or may review, newest first", query=[
    Param("status", description=f"one of {', '.join(STATUSES)} (any case)"),
    Param("type", description="onetime or jit", enum=(ONETIME, JIT)),
    Param("limit", "integer", "reviews per page, clamped to 1-100 (default 100)", minimum=-INT64_MAX - 1,
          maximum=INT64_MAX),
    Param("offset", "integer", "negative counts as 0", minimum=-INT64_MAX - 1, maximum=INT64_MAX)],
    response=array_of(REVIEW_FULL_OUT))
async def list_reviews(request: web.Request) -> web.Response:
    user = user_of(request)
    services = services_of(request)
    status = request.query.get("status") or None
    if status is not None and status.upper() not in STATUSES:
        raise ApiError(422, f"query parameter 'status': expected one of {', '.join(STATUSES)}")
    kind = request.query.get("type") or None
    limit = min(max(query_int(request, "limit", 100), 1), 100)
    offset = max(query_int(request, "offset", 0), 0)
    everything = user.is_admin or user.is_auditor
    page = await services.store.list_reviews(user.org_id, status=status.upper() if status else None, type=kind,
                                            visible_to=None if everything else (user.id, list(user.groups)),
                                            limit=limit, offset=offset)
    scripts = await services.store.sessions_by_ids(r.session_id for r in page.items if r.type == ONETIME)
    return ok([review_json(r, scripts.get(r.session_id), full=True) for r in page.items])


@routes.get("/reviews/{id}", "A review", response=REVIEW_FULL_OUT)
async def get_review(request: web.Request) -> web.Response:
    key = request.match_info["id"]
    services = services_of(request)
    review = await _visible_review(request, key)
    return ok(await _review_document(services, review))


async def _decide(request: web.Request, review: Review) -> web.Response:
    services = services_of(request)
    user = user_of(request)
    body = await json_body(request, DECISION)
    status, force = body["status"], bool(body.get("force_review"))
    action = {APPROVED: "force_approve" if force else "approve", REJECTED: "reject"}.get(status, "revoke")
    request[AUDIT_ACTION] = f"review.{action}"
    request[AUDIT_PAYLOAD] = {"review_id": review.id, "session_id": review.session_id,
                              "connection": review.connection_name, **body}
    try:
        review, decision = await services.reviews.apply(review.id, user, status, force=force,
                                                       time_window=body.get("time_window"))
    except ReviewError as exc:
        raise _error(exc) from None
    request[AUDIT_PAYLOAD] = {**request[AUDIT_PAYLOAD], "groups": decision.groups,
                              "review_status": review.status}
    return ok(await _review_document(services, review))


@routes.put("/reviews/{id}", "Approve, reject or revoke a review", body=DECISION, response=REVIEW_FULL_OUT)
async def update_review(request: web.Request) -> web.Response:
    key = request.match_info["id"]
    return await _decide(request, await _review_in_org(request, key))


@routes.put("/sessions/{id}/review", "Approve, reject or revoke the review of a session", body=DECISION,
            audit="reviews", response=REVIEW_FULL_OUT)
async def update_session_review(request: web.Request) -> web.Response:
    key = request.match_info["id"]
    services = services_of(request)
    session = await session_in_org(request, key)  # reviewers decide on sessions they may not read
    review = await review_of(services.store, session)
    if review is None:
        raise ApiError(404, f"session {key!r} has no review")
    return await _decide(request, review)


# --------------------------------------------------------------------------- one-time scripts


def _runner_for(services: Services, connection: Connection) -> Any:
    runner = services.script_runners.get(connection.subtype)
    if runner is None:
        available = ", ".join(sorted(services.script_runners)) or "none in this build"
        raise ApiError(422, f"connection {connection.name!r} ({connection.subtype}) cannot run scripts: "
                            f"one-time execution works on {available} connections")
    return runner


async def _answer(request: web.Request, job: ScriptJob, review: Review | None = None, *,
                  started: float) -> web.Response:
    """The script's result, or 202 once the wait limit passes (it runs on in the background).

    ``Prefer: respond-async`` (RFC 7240) answers 202 as soon as the script started: the caller follows its
    output as it comes on ``GET /sessions/{id}/stream`` (``gatewayd exec`` does).
    """
    services = services_of(request)
    respond_async = "respond-async" in request.headers.get("Prefer", "").lower()
    try:
        async with asyncio.timeout(0 if respond_async else services.config["sessions.exec_wait"]):
            result = await asyncio.shield(job.result)
    except TimeoutError:
        response = ok({"session_id": job.session_id, "has_review": review is not None, "output": "",
                       "output_status": "running", "exit_code": None,
                       "execution_time": int((time.monotonic() - started) * 1000), "truncated": False}, status=202)
        if respond_async:
            response.headers["Preference-Applied"] = "respond-async"
        return response
    answer = {"session_id": job.session_id, "has_review": review is not None, "output": result.output,
              "output_status": result.output_status, "exit_code": result.exit_code,
              "execution_time": int((time.monotonic() - started) * 1000), "truncated": job.truncated}
    if job.ai_analysis:
        answer["ai_analysis"] = job.ai_analysis
    return ok(answer)


@routes.post("/sessions", "Run a script on a connection (one-time execution); 202 when it needs a review",
             body=EXEC, audit="sessions", response=SCRIPT_RESULT_OUT,
             other_responses={202: SCRIPT_RESULT_OUT})
async def create_session(request: web.Request) -> web.Response:
    user = user_of(request)
    services = services_of(request)
    body = await json_body(request, EXEC)
    connection = await services.store.get_connection(user.org_id, body["connection"])
    if connection is None:
        raise ApiError(404, f"connection {body['connection']!r} not found")
    _runner_for(services, connection)
    script = body["script"]
    if not script.strip():
        raise ApiError(422, "field 'script': must not be empty")
    return await start_script(request, connection, script, metadata=body.get("metadata") or {},
                              batch_id=body.get("session_batch_id") or None, reason=body.get("reason") or "")


async def start_script(request: web.Request, connection: Connection, script: str, *, metadata: dict[str, Any],
                       batch_id: str | None, secrets: tuple[str, ...] = (),
                       audit: dict[str, Any] | None = None, reason: str = "") -> web.Response:
    """Run ``script`` on ``connection`` as the caller, or ask for its review first (202): what ``POST /sessions``
    does, for every way of making a script (a runbook too). ``secrets``: values of the script never recorded
    (gatewayd.scripts.Redaction); ``audit``: more of the audit entry's payload; ``reason``: why the caller asks
    (shown to the reviewers). The same script asked again while its review is open gets that review."""
    user = user_of(request)
    services = services_of(request)
    _runner_for(services, connection)
    shown = Redaction.of(secrets).text(script)
    policy = await services.reviews.policy(connection, ONETIME)
    if policy is not None:
        request[AUDIT_ACTION] = "review.request"
        session = session_for(user, connection, verb="exec", status="ready", script=shown, metadata=metadata,
                              session_batch_id=batch_id)
        if secrets:
            await services.reviews.seal_script(session.id, script, secrets)
        review = await services.reviews.request(policy, user, connection, session, ONETIME, reason=reason)
        asked_before = review.session_id != session.id  # the same script asked again: its open review
        if not asked_before:
            services.reviews.spawn(services.analysis.preview(session, connection, shown))  # for the reviewers to see
        request[AUDIT_PAYLOAD] = {**(audit or {}), "connection": connection.name, "session_id": review.session_id,
                                  "review_id": review.id, "type": ONETIME, "reviewers": policy.reviewers,
                                  **({"asked_before": True} if asked_before else {})}
        return ok({"session_id": review.session_id, "review_id": review.id, "has_review": True,
                   "review": review_json(review), "output": "", "output_status": "",
                   "exit_code": None, "execution_time": 0}, status=202)
    request[AUDIT_ACTION] = "session.exec"
    started = time.monotonic()
    try:
        job = await services.reviews.run_script(user, connection, script, metadata=metadata, batch_id=batch_id,
                                               secrets=secrets)
    except RuntimeError as exc:
        raise ApiError(503, str(exc)) from None
    request[AUDIT_PAYLOAD] = {**(audit or {}), "connection": connection.name, "session_id": job.session_id}
    return await _answer(request, job, started=started)


@routes.post("/sessions/{id}/exec", "Run a reviewed script once its review is approved (inside its time window)",
             audit="sessions", response=SCRIPT_RESULT_OUT, other_responses={202: SCRIPT_RESULT_OUT})
async def exec_session(request: web.Request) -> web.Response:
    user = user_of(request)
    services = services_of(request)
    key = request.match_info["id"]
    request[AUDIT_ACTION] = "session.exec"
    request[AUDIT_PAYLOAD] = {"session_id": key}
    session = await session_in_org(request, key)
    if session.user_id != user.subject:
        raise ApiError(403, "access denied: only the user who asked for this script may run it")
    if session.verb != "exec" or not session.review_id:
        raise ApiError(400, "this session is not a reviewed script: run scripts with POST /sessions")
    connection = await services.store.get_connection(user.org_id, session.connection_id)
    if connection is None:
        raise ApiError(404, f"connection {session.connection!r} no longer exists")
    _runner_for(services, connection)
    try:
        review = await services.reviews.begin_execution(session.review_id)
    except ReviewError as exc:
        raise _error(exc) from None
    request[AUDIT_PAYLOAD] = {"session_id": key, "review_id": review.id, "connection": connection.name}
    started = time.monotonic()
    try:
        job = await services.reviews.run_script(user, connection, session.script or "", session=session,
                                               review=review)
    except SessionUnavailable:  # killed before it ran: the review is EXECUTED, the requester asks anew
        stored = await services.store.get_session(session.id)
        why = stored.kill_reason if stored is not None and stored.kill_reason else "it was ended"
        raise ApiError(410, f"the script's session was closed before it ran ({why}): the script did not run, "
                            "ask for it again") from None
    except RuntimeError as exc:  # shutting down: the approval still stands
        raise ApiError(503, str(exc)) from None
    return await _answer(request, job, review, started=started)


# --------------------------------------------------------------------------- jit credentials


def _access_over(review: Review) -> ApiError:
    """The 410 of a jit review whose access was revoked or has expired."""
    revoked = any(g.status == REVOKED for g in review.groups)
    return ApiError(410, f"the just-in-time access {'was revoked' if revoked else 'has expired'}: ask for access again")


@routes.post("/connections/{name}/credentials/{session_id}",
             "Credentials of an approved jit review: 202 pending, 403 rejected, 410 revoked or expired",
             status=201, audit="credentials", response=CREDENTIALS_OUT, other_responses={202: JIT_PENDING_OUT})
async def jit_credentials(request: web.Request) -> web.Response:
    from control.connections import native_access  # the connection area owns the credential format

    user = user_of(request)
    services = services_of(request)
    name, key = request.match_info["name"], request.match_info["session_id"]
    connection = await services.store.get_connection(user.org_id, name)
    if connection is None:
        raise ApiError(404, f"connection {name!r} not found")
    session = await services.store.get_session(key)
    if session is None or session.org_id != user.org_id or session.connection_id != connection.id:
        raise ApiError(404, f"session {key!r} of connection {connection.name!r} not found")
    if session.user_id != user.subject:
        raise ApiError(403, "access denied: this access request belongs to another user")
    review = await review_of(services.store, session)
    if review is None or review.type != JIT:
        raise ApiError(400, f"session {key!r} has no just-in-time review")
    body = {"session_id": session.id, "review_id": review.id, "has_review": True, "review": review_json(review)}
    if review.status == PENDING:
        return ok({**body, "status": PENDING}, status=202)
    if review.status == REJECTED:
        raise ApiError(403, "access denied: the access request was rejected")
    if review.status != APPROVED or jit_ended(review, utcnow()):
        raise _access_over(review)
    try:
        credential_prefix(connection)
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None
    remaining = (parse_time(review.revoke_at) - utcnow()).total_seconds()  # type: ignore[operator]
    issued = await services.access.issue(user, connection, remaining, review_id=review.id, session=session,
                                        session_stored=True)
    ended = await services.reviews.ended_meanwhile(review)  # revoked or expired while it was issued
    if ended is not None:
        raise _access_over(ended)
    if session.status == "ready":
        await services.store.start_session(session.id, rfc3339(utcnow()))
    request[AUDIT_PAYLOAD] = {"session_id": session.id, "review_id": review.id, "connection": connection.name}
    cred = issued.credential
    return ok({
        "id": cred.id, "connection_name": connection.name, "connection_type": connection.type,
        "connection_subtype": connection.subtype, "session_id": session.id, "review_id": review.id,
        "expire_at": cred.expire_at, "created_at": cred.created_at, "has_review": True,
        "connection_credentials": native_access(services, connection, issued.secret),
    }, status=201)


# --------------------------------------------------------------------------- access request rules


def rule_json(rule: AccessRequestRule) -> dict[str, Any]:
    return {"id": rule.id, "name": rule.name, "description": rule.description, "access_type": rule.access_type,
            "connection_names": rule.connection_names, "reviewers_groups": rule.reviewers_groups,
            "force_approval_groups": rule.force_approval_groups, "min_approvals": rule.min_approvals,
            "access_max_duration": rule.access_max_duration, "created_at": rule.created_at,
            "updated_at": rule.updated_at}


def _rule_from(body: dict[str, Any], org_id: str, existing: AccessRequestRule | None) -> AccessRequestRule:
    now = rfc3339(utcnow())
    name = body["name"].strip()
    if not name or "/" in name:
        raise ApiError(422, "field 'name': must be a non-empty name without '/'")
    reviewers = [g.strip() for g in body["reviewers_groups"] if g.strip()]
    if not reviewers:
        raise ApiError(422, "field 'reviewers_groups': at least one group must review")
    for key in ("min_approvals", "access_max_duration"):
        if body.get(key) is not None and body[key] < 1:
            raise ApiError(422, f"field '{key}': must be positive")
    return AccessRequestRule(
        id=existing.id if existing else new_id(), org_id=org_id, name=name, access_type=body["access_type"],
        description=body.get("description") or "", connection_names=list(body.get("connection_names") or []),
        reviewers_groups=reviewers, force_approval_groups=list(body.get("force_approval_groups") or []),
        min_approvals=body.get("min_approvals"), access_max_duration=body.get("access_max_duration"),
        created_at=existing.created_at if existing else now, updated_at=now)


async def _find_rule(request: web.Request) -> AccessRequestRule:
    name = request.match_info["name"]
    rule = await services_of(request).store.get_access_rule(user_of(request).org_id, name)
    if rule is None:
        raise ApiError(404, f"access request rule {name!r} not found")
    return rule


@routes.get("/access-requests/rules", "Access request rules",
            response=Schema("AccessRequestRules", {"data": Field("array", True, items=RULE_OUT)}))
async def list_rules(request: web.Request) -> web.Response:
    rules = await services_of(request).store.list_access_rules(user_of(request).org_id)
    return ok({"data": [rule_json(r) for r in rules]})


@routes.post("/access-requests/rules", "Create an access request rule", body=RULE, status=201,
             audit="access_request_rules", response=RULE_OUT)
async def create_rule(request: web.Request) -> web.Response:
    admin = require_admin(request)
    rule = _rule_from(await json_body(request, RULE), admin.org_id, None)
    try:
        await services_of(request).store.save_access_rule(rule, create=True)
    except Conflict:
        raise ApiError(409, f"access request rule {rule.name!r} already exists") from None
    return ok(rule_json(rule), status=201)


@routes.get("/access-requests/rules/{name}", "An access request rule", response=RULE_OUT)
async def get_rule(request: web.Request) -> web.Response:
    return ok(rule_json(await _find_rule(request)))


@routes.put("/access-requests/rules/{name}", "Replace an access request rule", body=RULE,
            audit="access_request_rules", response=RULE_OUT)
async def update_rule(request: web.Request) -> web.Response:
    admin = require_admin(request)
    existing = await _find_rule(request)
    rule = _rule_from(await json_body(request, RULE), admin.org_id, existing)
    try:
        await services_of(request).store.save_access_rule(rule, create=False)
    except Conflict:
        raise ApiError(409, f"access request rule {rule.name!r} already exists") from None
    return ok(rule_json(rule))


@routes.delete("/access-requests/rules/{name}", "Delete an access request rule", status=204,
               audit="access_request_rules")
async def delete_rule(request: web.Request) -> web.Response:
    admin = require_admin(request)
    rule = await _find_rule(request)
    await services_of(request).store.delete_access_rule(admin.org_id, rule.id)
    return web.Response(status=204)

