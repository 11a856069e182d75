"""Reports (admins and auditors): finished sessions counted by connection, user, protocol or day, and per session.

Both read what each session's close added to the store's per-day rollup (``session_rollup``) or, per session,
a page of the sessions' index: never a scan of every session, whatever their number (bench/reports).
"""

from __future__ import annotations

from datetime import date, timedelta
from typing import Any

from aiohttp import web

from control.http import (
    ApiError,
    Field,
    Param,
    RouteSet,
    Schema,
    ok,
    query_int,
    services_of,
    user_of,
)
from gatewayd.models import User, parse_time, utcnow
from gatewayd.store.base import REPORT_GROUPS, ReportFilter

routes = RouteSet("Reports", audit="reports")

DEFAULT_DAYS = 7
COUNT = Field("integer", True, minimum=0)
_SUMS = {"sessions": COUNT, "duration_ms": COUNT, "duration_seconds": COUNT, "bytes": COUNT, "blocks": COUNT,
         "masked": COUNT, "masked_sessions": COUNT}
ITEM = Schema("SessionReportItem", {"resource": Field("string", True), **_SUMS,
                                    "redact_total": Field("integer", True, minimum=0,
                                                          description="masked values (hoop.dev's name)")})
REPORT_OUT = Schema("SessionReport", {
    "group_by": Field("string", True), "start_date": Field("string", True), "end_date": Field("string", True),
    "items": Field("array", True, items=ITEM), "totals": Field("object", True, schema=Schema("SessionReportTotals",
                                                                                            _SUMS)),
    "total_redact_count": COUNT})
FILTERS = [
    Param("start_date", description=f"YYYY-MM-DD (UTC), the first day counted (default: {DEFAULT_DAYS - 1} days "
                                    "before end_date)"),
    Param("end_date", description="YYYY-MM-DD (UTC), the last day counted (default: today)"),
    Param("connection_name"), Param("user_email"), Param("connection_subtype", description="the protocol"),
    Param("verb", enum=("connect", "exec"))]
AGGREGATE_OUT = Schema("SessionMetricsAggregated", {
    "total_sessions": COUNT, "total_masked": COUNT, "sessions_with_masking": COUNT, "total_blocks": COUNT,
    "total_bytes": COUNT, "avg_session_duration_sec": Field("integer", True, nullable=True, minimum=0)})
METRIC = Schema("SessionMetric", {
    "session_id": Field("string", True), "org_id": Field("string", True), "connection_type": Field("string", True),
    "connection_subtype": Field("string", True), "connection_name": Field("string", True),
    "user_email": Field("string", True), "verb": Field("string", True), "count_masked": COUNT,
    "is_masked": Field("boolean", True), "blocks": COUNT, "bytes": COUNT, "session_created_at": Field("string", True),
    "session_ended_at": Field("string", True, nullable=True),
    "session_duration_sec": Field("integer", True, nullable=True, minimum=0)})
METRICS_OUT = Schema("SessionMetricsPage", {
    "data": Field("array", True, items=METRIC), "pages": Field("object", True, schema=Schema("SessionMetricsPages", {
        "total": COUNT, "page": Field("integer", True, minimum=1), "size": Field("integer", True, minimum=1)}))})


def _reader(request: web.Request) -> User:
    user = user_of(request)
    if not (user.is_admin or user.is_auditor):
        raise ApiError(403, "access denied: reports are for the admin and auditor groups")
    return user


def _day(text: str | None, name: str, default: date) -> date:
    if not text:
        return default
    try:  # a day, or the day of an RFC 3339 moment
        if len(text) != 10 and text[10:11] != "T":
            raise ValueError(text)
        return date.fromisoformat(text[:10])
    except ValueError:
        raise ApiError(422, f"query parameter '{name}': expected a date (YYYY-MM-DD)") from None


def _filter(request: web.Request, group_by: str = "connection") -> ReportFilter:
    user = _reader(request)
    q = request.query
    end = _day(q.get("end_date"), "end_date", utcnow().date())
    start = _day(q.get("start_date"), "start_date", end - timedelta(days=DEFAULT_DAYS - 1))
    if start > end:
        raise ApiError(422, "query parameter 'start_date': after end_date")
    return ReportFilter(user.org_id or "", start.isoformat(), end.isoformat(), group_by,
                        connection=q.get("connection_name") or None, user_email=q.get("user_email") or None,
                        subtype=q.get("connection_subtype") or None, verb=q.get("verb") or None)


def _with_seconds(sums: dict[str, int]) -> dict[str, int]:
    return {**sums, "duration_seconds": sums["duration_ms"] // 1000}


@routes.get("/reports/sessions", "Finished sessions grouped by connection, user, protocol or day, with their "
            "counts, durations, bytes, guard-rail blocks and masked values", query=[
                Param("group_by", description="connection (default), user, protocol or day (hoop.dev's "
                                              "connection_type and user_email too)", enum=tuple(REPORT_GROUPS)),
                *FILTERS], response=REPORT_OUT)
async def session_report(request: web.Request) -> web.Response:
    query = _filter(request, request.query.get("group_by") or "connection")
    rows = await services_of(request).store.session_report(query)
    totals = {name: sum(r[name] for r in rows) for name in ("sessions", "duration_ms", "bytes", "blocks", "masked",
                                                            "masked_sessions")}
    return ok({"group_by": query.group_by, "start_date": query.start_day, "end_date": query.end_day,
               "items": [{**_with_seconds(r), "redact_total": r["masked"]} for r in rows],
               "totals": _with_seconds(totals), "total_redact_count": totals["masked"]})


def _duration(start: str, end: str | None) -> int | None:
    began, ended = parse_time(start), parse_time(end)
    return max(int((ended - began).total_seconds()), 0) if began and ended else None


@routes.get("/metrics/sessions", "Per finished session: bytes, masked values and blocks (or, aggregated=true, "
            "their totals over the range)", query=[
                Param("aggregated", enum=("true", "false")), *FILTERS,
                Param("page", "integer", minimum=1, maximum=1_000_000),
                Param("limit", "integer", "per page (default 100)", minimum=1, maximum=1000)],
            response=Field("object", True, any_of=(AGGREGATE_OUT, METRICS_OUT)))
async def session_metrics(request: web.Request) -> web.Response:
    query = _filter(request)
    store = services_of(request).store
    if request.query.get("aggregated") == "true":
        rows = await store.session_report(query)
        sums = {name: sum(r[name] for r in rows) for name in ("sessions", "duration_ms", "bytes", "blocks",
                                                              "masked", "masked_sessions")}
        answer: dict[str, Any] = {
            "total_sessions": sums["sessions"], "total_masked": sums["masked"],
            "sessions_with_masking": sums["masked_sessions"], "total_blocks": sums["blocks"],
            "total_bytes": sums["bytes"],
            "avg_session_duration_sec": sums["duration_ms"] // 1000 // sums["sessions"] if sums["sessions"] else None}
        return ok(answer)
    page, size = query_int(request, "page", 1), query_int(request, "limit", 100)
    found = await store.session_metrics(query, size, (page - 1) * size)
    return ok({"pages": {"total": found.total, "page": page, "size": size}, "data": [{
        "session_id": m["session_id"], "org_id": m["org_id"], "connection_type": m["connection_type"],
        "connection_subtype": m["connection_subtype"], "connection_name": m["connection_name"],
        "user_email": m["user_email"], "verb": m["verb"], "count_masked": int(m["count_masked"]),
        "is_masked": int(m["count_masked"]) > 0, "blocks": int(m["blocks"]), "bytes": int(m["bytes"] or 0),
        "session_created_at": m["start_date"], "session_ended_at": m["end_date"],
        "session_duration_sec": _duration(m["start_date"], m["end_date"])} for m in found.items]})
