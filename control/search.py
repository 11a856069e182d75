"""``GET /search``: connections, resources, runbooks and sessions by name, for a search box (hoop.dev's shape)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from control.connections import connection_status
from control.http import ApiError, Field, Param, RouteSet, Schema, ok, services_of, user_of
from control.schemas import SESSION_OUT, TEXT
from control.sessions import session_json
from gatewayd.models import Session
from gatewayd.store import SessionFilter

routes = RouteSet("Search", audit="search")

LIMIT = 10  # of each kind
_CONNECTION = Schema("ConnectionSearch", {
    "id": TEXT, "name": TEXT, "resource_name": TEXT, "status": TEXT, "type": TEXT, "subtype": TEXT,
    "access_mode_runbooks": TEXT, "access_mode_exec": TEXT, "access_mode_connect": TEXT})
_RESOURCE = Schema("ResourceSearch", {"id": TEXT, "name": TEXT, "type": TEXT, "subtype": TEXT})
_RUNBOOK = Schema("RunbookSearch", {"repository": TEXT, "name": TEXT})


def _has(term: str, *texts: str) -> bool:
    return any(term in (text or "").lower() for text in texts)


@routes.get("/search", "Connections, resources, runbooks and sessions whose name holds a term (any case); sessions "
            "also by the start of their id or part of their user (newest first)",
            query=[Param("term", description="what to look for")],
            response=Schema("SearchResponse", {
                "errors": Field("array", True, items="string"),
                "connections": Field("array", True, items=_CONNECTION),
                "resources": Field("array", True, items=_RESOURCE),
                "runbooks": Field("array", True, items=_RUNBOOK),
                "sessions": Field("array", True, items=SESSION_OUT)}))
async def search(request: web.Request) -> web.Response:
    term = request.query.get("term", "").strip()
    if not term:
        raise ApiError(400, "term parameter is required")
    user = user_of(request)
    store = services_of(request).store
    needle = term.lower()
    connections = [c for c in await store.list_connections(user.org_id) if _has(needle, c.name, c.resource_name)]
    resources = [r for r in await store.list_resources(user.org_id) if _has(needle, r.name)]
    found: dict[str, Session] = {}
    only = None if user.is_admin or user.is_auditor else user.subject
    # the start of an id, part of a user, or a connection found above: the newest of each, merged
    asks = [SessionFilter(org_id=user.org_id, user_search=term, only_user_id=only, limit=LIMIT)]
    asks += [SessionFilter(org_id=user.org_id, connection=c.name, only_user_id=only, limit=LIMIT)
             for c in connections[:3]]
    for ask in asks:
        for session in (await store.list_sessions(ask)).items:
            found[session.id] = session
    if 4 <= len(term) < 36:
        for session_id in await store.ids_with_prefix("sessions", user.org_id, needle, limit=LIMIT):
            session = await store.get_session(session_id)
            if session is not None and (only is None or session.user_id == only):
                found[session.id] = session
    sessions = sorted(found.values(), key=lambda s: (s.start_date or "", s.id), reverse=True)[:LIMIT]
    return ok({
        "errors": [],
        "connections": [_connection(c, connection_status(services_of(request), c)) for c in connections[:LIMIT]],
        "resources": [{"id": r.id, "name": r.name, "type": r.type, "subtype": r.subtype} for r in resources[:LIMIT]],
        "runbooks": [],  # runbooks live elsewhere (issue 35); none are searched here yet
        "sessions": [session_json(s) for s in sessions],
    })


def _connection(conn: Any, status: str) -> dict[str, Any]:
    return {"id": conn.id, "name": conn.name, "resource_name": conn.resource_name, "status": status,
            "type": conn.type, "subtype": conn.subtype, "access_mode_runbooks": "enabled",
            "access_mode_exec": "enabled", "access_mode_connect": "enabled"}
