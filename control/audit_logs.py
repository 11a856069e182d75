"""The security audit log (admin only)."""

from __future__ import annotations

from datetime import datetime, timezone

from aiohttp import web

from control.http import ApiError, Field, Param, RouteSet, Schema, ok, query_int, require_admin, services_of
from control.schemas import OPT_TEXT, TEXT, VERIFICATION_OUT
from gatewayd.models import rfc3339
from gatewayd.store import AuditFilter

routes = RouteSet("Audit Logs", audit="audit")

OUTCOMES = ("success", "failure")
MAX_PAGE = 10**12  # page * page_size stays far below what the store can count to
ENTRY_OUT = Schema("AuditEntry", {
    "id": TEXT, "org_id": TEXT, "actor_subject": OPT_TEXT, "actor_email": OPT_TEXT, "actor_name": OPT_TEXT,
    "created_at": TEXT, "resource_type": TEXT, "action": TEXT, "http_method": TEXT, "http_path": TEXT,
    "http_status": Field("integer", True, minimum=0, maximum=999), "client_ip": TEXT,
    "request_payload_redacted": Field("any", True), "outcome": Field("string", True, enum=OUTCOMES),
    "error_message": TEXT,
})


def parse_moment(raw: str | None, name: str, end_of_day: bool = False) -> str | None:
    """RFC 3339 or ``YYYY-MM-DD`` to the store's UTC form; 422 otherwise."""
    if not raw:
        return None
    try:
        if len(raw) == 10:
            day = datetime.strptime(raw, "%Y-%m-%d").replace(tzinfo=timezone.utc)
            moment = day.replace(hour=23, minute=59, second=59, microsecond=999999) if end_of_day else day
        else:
            moment = datetime.fromisoformat(raw.replace("Z", "+00:00").replace(" ", "+"))
            if moment.tzinfo is None:
                raise ValueError("no time zone")
    except ValueError:
        raise ApiError(422, f"query parameter '{name}': expected RFC 3339 or YYYY-MM-DD, got {raw!r}") from None
    return rfc3339(moment)


@routes.get("/audit/logs", "Security audit log, newest first (admin only)", query=[
    Param("page", "integer", minimum=1, maximum=MAX_PAGE), Param("page_size", "integer", minimum=1, maximum=100),
    Param("actor", description="subject or email"), Param("resource_type"), Param("action"),
    Param("outcome", description="success or failure", enum=OUTCOMES),
    Param("created_after"), Param("created_before")], response=Schema("AuditPage", {
        "pages": Field("object", True, schema=Schema("AuditPages", {
            "total": Field("integer", True, minimum=0), "page": Field("integer", True, minimum=1, maximum=MAX_PAGE),
            "size": Field("integer", True, minimum=1, maximum=100),
            "total_exact": Field("boolean", True, description="false: total is a lower bound (the entries were counted "
                                 "up to the store's cap, store.count_cap)"),
            "has_next_page": Field("boolean", True, description="entries follow this page")})),
        "data": Field("array", True, items=ENTRY_OUT)}))
async def list_logs(request: web.Request) -> web.Response:
    admin = require_admin(request)
    page = query_int(request, "page", 1)
    size = query_int(request, "page_size", 50)
    outcome = request.query.get("outcome") or None
    query = AuditFilter(
        org_id=admin.org_id, actor=request.query.get("actor") or None,
        resource_type=request.query.get("resource_type") or None, action=request.query.get("action") or None,
        outcome=outcome, created_after=parse_moment(request.query.get("created_after"), "created_after"),
        created_before=parse_moment(request.query.get("created_before"), "created_before", end_of_day=True),
        page=page, page_size=size)
    result = await services_of(request).store.list_audit(query)
    return ok({
        "pages": {"total": result.total, "page": page, "size": size, "total_exact": result.total_exact,
                  "has_next_page": result.more},
        "data": [{
            "id": e.id, "org_id": e.org_id, "actor_subject": e.actor_subject, "actor_email": e.actor_email,
            "actor_name": e.actor_name, "created_at": e.created_at, "resource_type": e.resource_type,
            "action": e.action, "http_method": e.http_method, "http_path": e.http_path,
            "http_status": e.http_status, "client_ip": e.client_ip,
            "request_payload_redacted": e.request_payload_redacted, "outcome": e.outcome,
            "error_message": e.error_message,
        } for e in result.items],
    })


@routes.get("/audit/verify", "Whether the organization's audit log was altered: its hash chain re-computed "
            "(admin only)", response=VERIFICATION_OUT)
async def verify(request: web.Request) -> web.Response:
    admin = require_admin(request)
    return ok((await services_of(request).audit.verify(admin.org_id)).as_json())
