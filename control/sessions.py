"""Sessions: list with the spec's filters, one session with its event stream, kill."""

from __future__ import annotations

import asyncio
import base64
import csv
import io
import json
import re
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from datetime import timedelta
from typing import Any

from aiohttp import web

from control.asciicast import CONTENT_TYPE as ASCIICAST
from control.asciicast import render_asciicast
from control.audit_logs import parse_moment
from control.http import (BEARER, INT64_MAX, SLICE, ApiError, Field, Param, RouteSet, Schema, json_body, off_loop,
                          ok, ok_in_slices, query_int, services_of, user_of)
from control.schemas import SESSION_OUT, VERIFICATION_OUT
from gatewayd import protocols
from gatewayd.crypto import hash_secret
from gatewayd.identity import AuthError
from gatewayd.languages import SQL
from gatewayd.protocols import FRAMES, TERMINAL
from gatewayd.models import Review, Session, SessionEvent, User, parse_time, rfc3339, utcnow
from gatewayd.watch import Recorded, Status, Update
from gatewayd.reviews import review_json, reviews_for
from gatewayd.store import SessionFilter
from gatewayd.store.search import MIN_SEARCH

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


STATUSES = ("ready", "open", "done")
DOWNLOAD_LINK = Schema("SessionDownloadLink", {"download_url": Field("string", True),
                                               "expire_at": Field("string", True)})


@routes.get("/sessions", "List sessions, newest first", query=[
    Param("user", description="a subject id, or part of a user's e-mail or name (any case)"),
    Param("connection"), Param("type"),
    Param("protocol", description="the connection subtype (GET /protocols lists them)"),
    Param("status", description="ready (a credential issued, not used yet), open or done", enum=STATUSES),
    Param("search", description=f"text typed in the session, anywhere (a statement, a command, a URL; at least "
                                f"{MIN_SEARCH} characters, any case)"),
    Param("review.approver"),
    Param("review.status"), Param("tracker_issue_key"),
    Param("start_date", description="started at or after: RFC 3339 (to the second) or YYYY-MM-DD"),
    Param("end_date", description="started at or before: RFC 3339, or YYYY-MM-DD (the whole day)"),
    Param("limit", "integer", f"sessions per page (default 20, more than {MAX_LIMIT} counts as {MAX_LIMIT})",
          minimum=1, maximum=INT64_MAX), Param("offset", "integer", minimum=0, maximum=INT64_MAX)],
             response=Schema("SessionPage", {"data": Field("array", True, items=SESSION_OUT),
                                            "has_next_page": Field("boolean", True),
                                            "total": Field("integer", True, minimum=0),
                                            "total_exact": Field("boolean", description="false: total is "
                                                                 "a lower bound (the matches were counted up to "
                                                                 "the store's cap, store.count_cap, or a common "
                                                                 "text's first matches)")}))
async def list_sessions(request: web.Request) -> web.Response:
    user = user_of(request)
    q = request.query
    limit = min(query_int(request, "limit", 20), MAX_LIMIT)
    offset = query_int(request, "offset", 0)
    search = (q.get("search") or "").strip() or None
    if search is not None and len(search) < MIN_SEARCH:
        raise ApiError(422, f"query parameter 'search': at least {MIN_SEARCH} characters")
    query = SessionFilter(
        org_id=user.org_id, user_search=q.get("user") or None,
        only_user_id=None if user.is_admin or user.is_auditor else user.subject,
        connection=q.get("connection") or None, type=q.get("type") or None,
        protocol=q.get("protocol") or None, status=q.get("status") or None, text=search,
        review_approver=q.get("review.approver") or None,
        review_status=(q.get("review.status") or "").upper() or None,
        tracker_issue_key=q.get("tracker_issue_key") or None,
        start_date=parse_moment(q.get("start_date"), "start_date"),
        end_date=parse_moment(q.get("end_date"), "end_date", end_of_day=True), limit=limit, offset=offset)
    store = services_of(request).store
    page = await store.list_sessions(query, reviews=True)
    return ok({"data": [session_json(s, review=page.reviews.get(s.review_id or "")) for s in page.items],
               "has_next_page": page.more, "total": page.total,
               "total_exact": page.total_exact})


async def review_of(store: Any, session: Session) -> Review | None:
    """The session's review, if it has one: of the session's own organization only, as the session lists join it
    (a review id naming another's is none; no gateway writes one)."""
    review = await store.get_review(session.review_id) if session.review_id else None
    return review if review is not None and review.org_id == session.org_id else None


SHORT_ID = re.compile(r"[0-9a-f][0-9a-f-]{3,34}")  # the start of an id, at least 4 characters


async def full_id(request: web.Request, table: str, key: str) -> str:
    """The id ``key`` is the start of, where only one id of the caller's organization starts so (``5f0afc22``
    names the session or review ``5f0afc22-...``); else ``key`` as given. 409 when several do."""
    if not SHORT_ID.fullmatch(key):
        return key
    found = await services_of(request).store.ids_with_prefix(table, user_of(request).org_id, key, limit=3)
    if len(found) > 1:
        raise ApiError(409, f"{key!r} is the start of several ids ({', '.join(found[:2])}, ...): give more of it")
    return found[0] if found else key


async def session_in_org(request: web.Request, session_id: str) -> Session:
    """The session of the caller's organization (by its id or, where it is unambiguous, the start of it), or 404
    (visibility is the caller's to check)."""
    store = services_of(request).store
    session = await store.get_session(session_id)
    if session is None and len(session_id) < 36:
        session = await store.get_session(await full_id(request, "sessions", session_id))
    if session is None or session.org_id != user_of(request).org_id:
        raise ApiError(404, f"session {session_id!r} not found")
    return session


async def may_read(request: web.Request, session: Session, user: User) -> bool:
    """Whether ``user`` may read ``session``: one who may see it (``can_see``), or a reviewer of its review."""
    if can_see(user, session):
        return True
    review = await review_of(services_of(request).store, session)
    return review is not None and reviews_for(user, review)


async def find_session(request: web.Request) -> Session:
    """The session named in the path, if the caller may read it (``may_read``)."""
    session = await session_in_org(request, request.match_info["id"])
    if not await may_read(request, session, user_of(request)):
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


def _statements(session: Session) -> bool:
    """Whether a session's input is SQL statements (its protocol's language says): csv and json render them."""
    return protocols.language_of(session.subtype).family == SQL


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
                         enum=("csv", "json")),
                   Param("extension", description="a download link instead (txt, csv, json...): "
                                                  "GET /sessions/{id}/download takes it once, within 5 minutes"),
                   Param("blob-type", description="session_input: the link downloads the input (the script)"),
                   Param("newline", description="1: a line break after each event (download)"),
                   Param("event-time", description="1: each event after its time (download)"),
                   Param("events", description="the kinds of events downloaded: i, o, e (default o,e)")],
            response=Field("object", True, any_of=(SESSION_OUT, DOWNLOAD_LINK, Schema("SessionStatements", {
                "id": Field("string", True), "connection": Field("string", True), "user": Field("string", True),
                "start_date": Field("string", True), "end_date": Field("string", True, nullable=True),
                "statements": Field("array", True, items=Schema("Statement", {
                    "offset_ms": Field("integer", True, minimum=0), "statement": Field("string", True),
                    "output": Field("string", True), "error": Field("string", True)}))}))),
            media=("text/csv", ASCIICAST))
async def get(request: web.Request) -> web.Response:
    session = await find_session(request)
    store = services_of(request).store
    if request.query.get("extension"):
        return await download_link(request, session)
    rendering = request.query.get("format")
    if rendering:
        if rendering not in ("csv", "json"):
            raise ApiError(422, "query parameter 'format': expected csv or json")
        if not _statements(session):  # the protocol says its input is SQL statements
            raise ApiError(422, "query parameter 'format': csv and json render database (SQL) sessions only")
        events = await store.read_events(session.id)
        return await off_loop(lambda: statements_response(session, events, rendering))
    rendering = request.query.get("event_stream")
    if rendering == "asciicast":
        if protocols.presentation_of(session.subtype) != TERMINAL:
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
    return ok((await services_of(request).recording.verify(session)).as_json())


@routes.post("/sessions/{id}/kill", "End a running session (admin or its owner)", response=SESSION_OUT)
async def kill(request: web.Request) -> web.Response:
    session = await find_session(request)
    user = user_of(request)
    if not user.is_admin and session.user_id != user.subject:
        raise ApiError(403, "access denied: only an admin or the session's owner may kill it")
    services = services_of(request)
    if session.status == "done":
        raise ApiError(409, "the session is already done")
    await services.sessions.kill(session.id, f"session killed by {user.email}")
    return ok(session_json(await services.store.get_session(session.id)))  # type: ignore[arg-type]


KEEPALIVE = 15.0  # seconds of silence after which a stream sends a comment (proxies keep it open)
RECHECK = 3.0  # seconds after which a stream checks its caller again (token, user, right to the session)
STREAM_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-store",
                  "X-Accel-Buffering": "no"}


def sse(event: str, data: Any, event_id: int | None = None) -> bytes:
    """One server-sent event: its name, its JSON data, and its id (a reconnect sends it back as Last-Event-ID)."""
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def event_json(session: Session, seq: int, event: SessionEvent) -> dict[str, Any]:
    """A recorded event as a stream sends it: its sequence number, offset, moment, kind and bytes (base64)."""
    start = parse_time(session.start_date)
    moment = rfc3339(start + timedelta(milliseconds=event.offset_ms)) if start is not None else ""
    return {"seq": seq, "offset_ms": event.offset_ms, "time": moment, "type": event.kind,
            "payload": base64.b64encode(event.data).decode()}


async def followed(request: web.Request, session: Session, after: int,
                   may: Callable[[User], Awaitable[bool]]) -> AsyncIterator[Update]:
    """``SessionWatch.follow`` for as long as the caller may follow: a stream outlives the check of its request, so
    every RECHECK seconds its token is authenticated again (signed out, expired, its user deactivated) and ``may``
    (the user, as now) asked again (a group lost); a refusal ends the stream and is audited as a refused watch."""
    services, checked = services_of(request), time.monotonic()
    async with aclosing(services.watch.follow(session.id, after)) as updates:
        async for update in updates:
            if time.monotonic() - checked >= RECHECK:
                checked = time.monotonic()
                status, why = 200, ""
                try:
                    user = await services.identity.authenticate(request[BEARER])
                    if not await may(user):
                        status, why = 403, "the user may no longer read this session"
                except AuthError as exc:
                    status, why = 401, f"its token is refused now: {exc}"
                if status != 200:
                    await services.audit.record(
                        org_id=session.org_id, actor=user_of(request), action="session.watch",
                        resource_type="sessions", outcome="failure", error_message=f"the stream was ended: {why}",
                        http_method=request.method, http_path=request.path, http_status=status,
                        client_ip=request.remote or "", payload={"session_id": session.id})
                    return
            yield update


LAST_SEQ = INT64_MAX - 1  # the highest ``after`` a store query can add one to


def _after(request: web.Request) -> int:
    """Where a stream resumes: after ``Last-Event-ID`` (an EventSource reconnecting) or ``?after=``."""
    raw = request.headers.get("Last-Event-ID", "").strip()
    if raw:
        try:
            # no event is numbered past the store's integers: after the last one there is nothing to send
            return min(max(int(raw), -1), LAST_SEQ)
        except ValueError:
            raise ApiError(400, "Last-Event-ID: expected the sequence number of an event") from None
    return min(max(query_int(request, "after", -1), -1), LAST_SEQ)


@routes.get("/sessions/{id}/stream", "Follow a session as it happens, as server-sent events (text/event-stream): "
            "'session' (the session, first and on each change of status), 'event' (each recorded event: seq, "
            "offset_ms, time, type i/o/e, payload in base64; the SSE id is its seq, so a reconnect with "
            "Last-Event-ID resumes after it), 'frames' (an RDP session's frame count as it grows), 'end' (the "
            "session, done: the stream closes). Read-only: nothing sent here reaches the session",
            query=[Param("after", "integer", "start after this sequence number (default: from the first event)",
                         minimum=-1, maximum=INT64_MAX)],
            media=("text/event-stream",))
async def stream(request: web.Request) -> web.StreamResponse:
    session = await find_session(request)
    after = _after(request)
    services = services_of(request)
    user = user_of(request)
    if session.status != "done":  # someone watches a live session: the audit log says who
        await services.audit.record(org_id=session.org_id, actor=user, action="session.watch",
                                   resource_type="sessions", outcome="success", http_method=request.method,
                                   http_path=request.path, http_status=200, client_ip=request.remote or "",
                                   payload={"session_id": session.id, "connection": session.connection,
                                            "owner": session.user_email})
    response = web.StreamResponse(headers=STREAM_HEADERS)
    await response.prepare(request)
    await response.write(b": following\n\n")
    frames = services.frames.reader(session.id) if protocols.presentation_of(session.subtype) == FRAMES else None
    shown_frames, quiet_since = -1, time.monotonic()
    review = await review_of(services.store, session)
    try:
        async for update in followed(request, session, after, lambda now: may_read(request, session, now)):
            if isinstance(update, Recorded):
                await response.write(sse("event", event_json(session, update.seq, update.event), update.seq))
                quiet_since = time.monotonic()
            elif isinstance(update, Status):
                session = update.session
                done = session.status == "done"
                if frames is not None:
                    shown_frames = await _frames_grew(response, frames, shown_frames)
                await response.write(sse("end" if done else "session", session_json(session, review=review)))
                quiet_since = time.monotonic()
            else:
                if frames is not None and (grown := await _frames_grew(response, frames, shown_frames)) != shown_frames:
                    shown_frames, quiet_since = grown, time.monotonic()
                if time.monotonic() - quiet_since > KEEPALIVE:
                    await response.write(b": keep-alive\n\n")
                    quiet_since = time.monotonic()
        await response.write_eof()
    except ConnectionResetError:  # the watcher went away
        pass
    return response


async def _frames_grew(response: web.StreamResponse, frames: Any, shown: int) -> int:
    """Send an RDP session's frame count when it changed; the count shown now."""
    count = await asyncio.to_thread(frames.count)
    if count != shown:
        await response.write(sse("frames", {"total_frames": count}))
    return count


# ------------------------------------------------------------------ downloads, the result as text, metadata

DOWNLOAD_PREFIX = "download:"  # signing_keys rows of the download links: name prefix + SHA-256 of the link's token
DOWNLOAD_SECONDS = 300
_EXTENSION = re.compile(r"[a-z0-9]{1,10}")
EVENT_KINDS = "ioe"


def may_download(user: User, session: Session) -> bool:
    """Its owner, admins and auditors (a reviewer reads a session, and does not take its recording away)."""
    return user.is_admin or user.is_auditor or session.user_id == user.subject


async def _may_download_now(session: Session, user: User) -> bool:
    return may_download(user, session)


def _kinds(raw: str | None) -> str:
    """The kinds of events asked for (``i,o,e``); default the output (``o`` and ``e``)."""
    kinds = "".join(k for k in EVENT_KINDS if k in (raw or "").split(","))
    return kinds or "oe"


async def download_link(request: web.Request, session: Session) -> web.Response:
    """``GET /sessions/{id}?extension=``: a link that downloads the session once, within DOWNLOAD_SECONDS, without
    a bearer token (a browser's download). Its token is kept hashed in the store: any node serves it."""
    user = user_of(request)
    if not may_download(user, session):
        raise ApiError(403, "access denied: only the session's owner, an admin or an auditor may download it")
    extension = request.query["extension"].lower()
    if not _EXTENSION.fullmatch(extension):
        raise ApiError(422, "query parameter 'extension': a file extension such as txt, csv or json")
    q = request.query
    as_input = q.get("blob-type") == "session_input"
    token = secrets.token_urlsafe(32)
    expires = utcnow() + timedelta(seconds=DOWNLOAD_SECONDS)
    services = services_of(request)
    await services.store.prune_keys(DOWNLOAD_PREFIX, rfc3339(utcnow() - timedelta(seconds=DOWNLOAD_SECONDS)))
    await services.store.put_key(DOWNLOAD_PREFIX + hash_secret(token), json.dumps({
        "session_id": session.id, "org_id": session.org_id, "user_id": user.id, "expires": rfc3339(expires),
        "extension": extension, "input": as_input, "newline": q.get("newline") == "1",
        "event_time": q.get("event-time") == "1", "events": _kinds(q.get("events"))}).encode())
    path = f"/api/sessions/{session.id}/download{'/input' if as_input else ''}"
    return ok({"download_url": f"{services.config.public_url}{path}?token={token}", "expire_at": rfc3339(expires)})


async def _take_download(request: web.Request, as_input: bool) -> tuple[Session, dict[str, Any]]:
    """The session and options of a download link, used up here (once): 404 unknown or used, 410 expired."""
    token = request.query.get("token", "")
    services = services_of(request)
    name = DOWNLOAD_PREFIX + hash_secret(token)
    raw = await services.store.get_key(name) if token else None
    if raw is None or not await services.store.delete_key(name):  # the one call that deletes it downloads
        raise ApiError(404, "not found: the download link is unknown or was used already")
    link = json.loads(raw)
    if link["session_id"] != request.match_info["id"] or link["input"] != as_input:
        raise ApiError(404, "not found: the download link is unknown or was used already")
    if (parse_time(link["expires"]) or utcnow()) <= utcnow():
        raise ApiError(410, "the download link has expired: ask for another")
    session = await services.store.get_session(link["session_id"])
    if session is None or session.org_id != link["org_id"]:
        raise ApiError(404, "not found: the session is gone")
    return session, link


def _attachment(session: Session, extension: str, body: bytes) -> web.Response:
    moment = utcnow().strftime("%Y%m%d-%H%M%S")
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{session.connection}-{session.id}-{moment}.{extension}")
    return web.Response(body=body, content_type="application/octet-stream", headers={
        "Content-Disposition": f'attachment; filename="{name}"', "Accept-Length": str(len(body))})


def rendered_events(session: Session, events: list[SessionEvent], *, newline: bool, event_time: bool) -> bytes:
    """Events as one text: each one's bytes, after its time (``event_time``), a line break after each (``newline``)."""
    start = parse_time(session.start_date)
    parts: list[bytes] = []
    for event in events:
        if event_time and start is not None:
            parts.append(f"{rfc3339(start + timedelta(milliseconds=event.offset_ms))} ".encode())
        parts.append(event.data)
        if newline:
            parts.append(b"\n")
    return b"".join(parts)


@routes.get("/sessions/{id}/download", "Download a session with the link GET /sessions/{id}?extension= gave (once, "
            "within 5 minutes; no bearer token): its events as text, csv (a database session's statements) or json",
            query=[Param("token", description="the link's token")], public=True, media=("application/octet-stream",))
async def download(request: web.Request) -> web.Response:
    session, link = await _take_download(request, as_input=False)
    store = services_of(request).store
    if link["extension"] == "csv" and _statements(session):  # the statements, as ?format=csv gives them
        every = await store.read_events(session.id)
        answer = await off_loop(lambda: statements_response(session, every, "csv"))
        return _attachment(session, "csv", answer.body)  # type: ignore[arg-type]
    events = await store.read_events(session.id, kinds=link["events"])
    start = parse_time(session.start_date)

    def render() -> bytes:
        if link["extension"] == "json":
            return json.dumps([{"time": rfc3339(start + timedelta(milliseconds=e.offset_ms)) if start else "",
                                "type": e.kind, "stream": e.data.decode("utf-8", "replace")} for e in events]).encode()
        return rendered_events(session, events, newline=link["newline"], event_time=link["event_time"])

    return _attachment(session, link["extension"], await asyncio.to_thread(render))


@routes.get("/sessions/{id}/download/input", "Download a session's input (its script, else what was sent) with the "
            "link GET /sessions/{id}?extension=txt&blob-type=session_input gave (once, within 5 minutes)",
            query=[Param("token", description="the link's token")], public=True, media=("application/octet-stream",))
async def download_input(request: web.Request) -> web.Response:
    session, _link = await _take_download(request, as_input=True)
    if session.script is not None:
        body = session.script.encode()
    else:
        events = await services_of(request).store.read_events(session.id, kinds="i")
        body = await asyncio.to_thread(rendered_events, session, events, newline=False, event_time=False)
    return _attachment(session, "txt", body)


@routes.get("/sessions/{id}/result/stream", "A session's output as plain text (chunked), written as it is recorded "
            "until the session ends (a finished one: at once); its owner, an admin or an auditor",
            query=[Param("newline", description="1: a line break after each event"),
                   Param("event-time", description="1: each event after its time (RFC 3339)"),
                   Param("events", description="the kinds of events: i, o, e (default o,e)")],
            media=("text/plain",))
async def result_stream(request: web.Request) -> web.StreamResponse:
    session = await find_session(request)
    if not may_download(user_of(request), session):
        raise ApiError(403, "access denied: only the session's owner, an admin or an auditor may stream its result")
    kinds, q = _kinds(request.query.get("events")), request.query
    newline, event_time = q.get("newline") == "1", q.get("event-time") == "1"
    response = web.StreamResponse(headers={"Content-Type": "text/plain; charset=utf-8",
                                           "X-Content-Type-Options": "nosniff", "Cache-Control": "no-store"})
    await response.prepare(request)
    try:
        async for update in followed(request, session, -1, lambda now: _may_download_now(session, now)):
            if isinstance(update, Recorded) and update.event.kind in kinds:
                await response.write(rendered_events(session, [update.event], newline=newline, event_time=event_time))
        await response.write_eof()
    except ConnectionResetError:  # the reader went away
        pass
    return response


METADATA = Schema("SessionMetadataUpdate", {"metadata": Field("object", True, description="replaces the session's "
                                                                                          "metadata")})


@routes.patch("/sessions/{id}/metadata", "Replace a session's metadata (its owner only)", body=METADATA, status=204)
async def patch_metadata(request: web.Request) -> web.Response:
    session = await session_in_org(request, request.match_info["id"])
    if session.user_id != user_of(request).subject:
        raise ApiError(404, f"session {request.match_info['id']!r} not found among your sessions")
    body = await json_body(request, METADATA)
    await services_of(request).store.set_session_metadata(session.id, body["metadata"])
    return web.Response(status=204)
