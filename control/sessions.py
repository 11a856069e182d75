"""Sessions: list with the spec's filters, one session with its event stream, kill."""

from __future__ import annotations

import base64
import csv
import io
from typing import Any

from aiohttp import web

from control.asciicast import CONTENT_TYPE as ASCIICAST
from control.asciicast import render_asciicast
from control.audit_logs import parse_moment
from control.http import (INT64_MAX, SLICE, ApiError, Field, Param, RouteSet, Schema, gateway_of, off_loop, ok,
                          ok_in_slices, query_int, user_of)
from control.schemas import SESSION_OUT, VERIFICATION_OUT
from gatewayd import protocols
from gatewayd.languages import SQL
from gatewayd.models import Review, Session, SessionEvent, User
from gatewayd.reviews import review_json
from gatewayd.store import SessionFilter

routes = RouteSet("Sessions", audit="sessions")

MAX_LIMIT = 100


def can_see(user: User, session: Session) -> bool:
    return user.is_admin or user.is_auditor or session.user_id == user.subject


def session_json(session: Session, events: list[SessionEvent] | None = None,
                 review: Review | None = None) -> dict[str, Any]:
    metrics = dict(session.metrics)
    metrics.setdefault("event_size", session.event_size)
    data: dict[str, Any] = {
        "id": session.id, "org_id": session.org_id, "user": session.user_email, "user_id": session.user_id,
        "user_name": session.user_name, "connection": session.connection, "role_name": session.connection,
        "resource_name": session.resource_name, "connection_subtype": session.subtype,
        "connection_tags": session.tags, "type": session.type, "verb": session.verb, "status": session.status,
        "script": {"data": session.script or ""} if session.verb == "exec" else {},
        "script_size": len((session.script or "").encode()), "start_date": session.start_date,
        "end_date": session.end_date, "event_size": session.event_size, "exit_code": session.exit_code,
        "review": review_json(review) if review else None, "session_batch_id": session.session_batch_id,
        "labels": session.labels,
        "metadata": session.metadata, "metrics": metrics, "integrations_metadata": session.integrations_metadata,
    }
    if session.ai_analysis:
        data["ai_analysis"] = session.ai_analysis
    if events is not None:
        data["event_stream"] = [[e.offset_ms, e.kind, base64.b64encode(e.data).decode()] for e in events]
    return data


@routes.get("/sessions", "List sessions, newest first", query=[
    Param("user", description="subject id"), Param("connection"), Param("type"), Param("review.approver"),
    Param("review.status"), Param("tracker_issue_key"), Param("start_date"), Param("end_date"),
    Param("limit", "integer", f"sessions per page (default 20, more than {MAX_LIMIT} counts as {MAX_LIMIT})",
          minimum=1, maximum=INT64_MAX), Param("offset", "integer", minimum=0, maximum=INT64_MAX)],
             response=Schema("SessionPage", {"data": Field("array", True, items=SESSION_OUT),
                                            "has_next_page": Field("boolean", True),
                                            "total": Field("integer", True, minimum=0)}))
async def list_sessions(request: web.Request) -> web.Response:
    user = user_of(request)
    q = request.query
    limit = min(query_int(request, "limit", 20), MAX_LIMIT)
    offset = query_int(request, "offset", 0)
    query = SessionFilter(
        org_id=user.org_id, user_id=q.get("user") or None,
        only_user_id=None if user.is_admin or user.is_auditor else user.subject,
        connection=q.get("connection") or None, type=q.get("type") or None,
        review_approver=q.get("review.approver") or None,
        review_status=(q.get("review.status") or "").upper() or None,
        tracker_issue_key=q.get("tracker_issue_key") or None,
        start_date=parse_moment(q.get("start_date"), "start_date"),
        end_date=parse_moment(q.get("end_date"), "end_date", end_of_day=True), limit=limit, offset=offset)
    store = gateway_of(request).store
    page = await store.list_sessions(query)
    reviews = await store.reviews_by_ids(s.review_id for s in page.items if s.review_id)
    return ok({"data": [session_json(s, review=reviews.get(s.review_id or "")) for s in page.items],
               "has_next_page": offset + len(page.items) < page.total, "total": page.total})


async def review_of(store: Any, session: Session) -> Review | None:
    """The session's review, if it has one."""
    return await store.get_review(session.review_id) if session.review_id else None


async def session_in_org(request: web.Request, session_id: str) -> Session:
    """The session of the caller's organization, or 404 (visibility is the caller's to check)."""
    session = await gateway_of(request).store.get_session(session_id)
    if session is None or session.org_id != user_of(request).org_id:
        raise ApiError(404, f"session {session_id!r} not found")
    return session


async def find_session(request: web.Request) -> Session:
    """The session named in the path, if the caller may see it (``can_see``)."""
    session = await session_in_org(request, request.match_info["id"])
    user = user_of(request)
    if not can_see(user, session):
        raise ApiError(403, "access denied: this session belongs to another user")
    return session


def statements_of(events: list[SessionEvent]) -> list[dict[str, Any]]:
    """A database session's events grouped per statement: each ``i`` opens one, ``o``/``e`` attach to it."""
    rows: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    for event in events:
        text = event.data.decode("utf-8", "replace")
        if event.kind == "i" or current is None:
            current = {"offset_ms": event.offset_ms, "statement": "", "output": "", "error": ""}
            rows.append(current)
            if event.kind == "i":
                current["statement"] = text
                continue
        if event.kind == "o":
            current["output"] += text
        else:
            current["error"] += ("\n" if current["error"] else "") + text
    return rows


def statements_response(session: Session, events: list[SessionEvent], rendering: str) -> web.Response:
    rows = statements_of(events)
    if rendering == "json":
        return ok_in_slices({"id": session.id, "connection": session.connection, "user": session.user_email,
                             "start_date": session.start_date, "end_date": session.end_date, "statements": rows},
                            "statements")
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=["offset_ms", "statement", "output", "error"], lineterminator="\r\n")
    writer.writeheader()
    for at in range(0, len(rows), SLICE):  # a slice per call: a thread writing it lets the event loop run between
        writer.writerows(rows[at:at + SLICE])
    return web.Response(text=buffer.getvalue(), content_type="text/csv", charset="utf-8", headers={
        "Content-Disposition": f'attachment; filename="session-{session.id}.csv"'})


@routes.get("/sessions/{id}", "A session; its event stream with ?expand=event_stream or ?event_stream=utf8|base64",
            query=[Param("expand"), Param("event_stream", description="utf8 or base64: output concatenated; "
                                          "asciicast: an ssh session as an asciicast v2 file",
                         enum=("utf8", "utf-8", "base64", "asciicast")),
                   Param("format", description="csv or json: a database session's statements and results",
                         enum=("csv", "json"))],
            response=Field("object", True, any_of=(SESSION_OUT, Schema("SessionStatements", {
                "id": Field("string", True), "connection": Field("string", True), "user": Field("string", True),
                "start_date": Field("string", True), "end_date": Field("string", True, nullable=True),
                "statements": Field("array", True, items=Schema("Statement", {
                    "offset_ms": Field("integer", True, minimum=0), "statement": Field("string", True),
                    "output": Field("string", True), "error": Field("string", True)}))}))),
            media=("text/csv", ASCIICAST))
async def get(request: web.Request) -> web.Response:
    session = await find_session(request)
    store = gateway_of(request).store
    rendering = request.query.get("format")
    if rendering:
        if rendering not in ("csv", "json"):
            raise ApiError(422, "query parameter 'format': expected csv or json")
        if protocols.language_of(session.subtype).family != SQL:  # the protocol says its input is SQL statements
            raise ApiError(422, "query parameter 'format': csv and json render database (SQL) sessions only")
        events = await store.read_events(session.id)
        return await off_loop(lambda: statements_response(session, events, rendering))
    rendering = request.query.get("event_stream")
    if rendering == "asciicast":
        if session.subtype != "ssh":
            raise ApiError(422, "query parameter 'event_stream': asciicast renders ssh sessions only")
        events = await store.read_events(session.id)
        return await off_loop(lambda: web.Response(
            text=render_asciicast(session, events), content_type=ASCIICAST, charset="utf-8",
            headers={"Content-Disposition": f'attachment; filename="session-{session.id}.cast"'}))
    if rendering:
        if rendering not in ("utf8", "utf-8", "base64"):
            raise ApiError(422, "query parameter 'event_stream': expected utf8, base64 or asciicast")
        events, review = await store.read_events(session.id, kinds="oe"), await review_of(store, session)

        def concatenated() -> web.Response:
            output = b"".join(e.data for e in events)
            text = base64.b64encode(output).decode() if rendering == "base64" else output.decode("utf-8", "replace")
            return ok_in_slices({**session_json(session, review=review), "event_stream": [text]}, "event_stream")

        return await off_loop(concatenated)
    if "event_stream" not in request.query.get("expand", "").split(","):
        return ok(session_json(session, None, await review_of(store, session)))
    events, review = await store.read_events(session.id), await review_of(store, session)
    return await off_loop(lambda: ok_in_slices(session_json(session, events, review), "event_stream"))


@routes.get("/sessions/{id}/verify", "Whether the session's recording was altered since it was written: its hash "
            "chain re-computed from the stored events and, once done, the gateway's seal checked",
            response=VERIFICATION_OUT)
async def verify(request: web.Request) -> web.Response:
    session = await find_session(request)
    return ok((await gateway_of(request).recording.verify(session)).as_json())


@routes.post("/sessions/{id}/kill", "End a running session (admin or its owner)", response=SESSION_OUT)
async def kill(request: web.Request) -> web.Response:
    session = await find_session(request)
    user = user_of(request)
    if not user.is_admin and session.user_id != user.subject:
        raise ApiError(403, "access denied: only an admin or the session's owner may kill it")
    gateway = gateway_of(request)
    if session.status == "done":
        raise ApiError(409, "the session is already done")
    await gateway.sessions.kill(session.id, f"session killed by {user.email}")
    return ok(session_json(await gateway.store.get_session(session.id)))  # type: ignore[arg-type]
