"""The session rollup: counted when a session ends, backfilled once after its migration, read by the reports."""

from __future__ import annotations

import json
from typing import Any, Sequence

from gatewayd.evidence import EventBatch
from gatewayd.models import Page, parse_time
from gatewayd.store.base import REPORT_GROUPS, ReportFilter
from gatewayd.store.sql import Work
from gatewayd.store.queries.core import SQLCore

ANY = "*"  # a rollup total's protocol or verb when it counts every one
ROLLUP_MIGRATION = 16  # the migration that makes session_rollup (gatewayd.store.migrations): its backfill follows it


class ReportQueries(SQLCore):
    """The session rollup and the reports read from it."""

    def _counted(self, before: Sequence[Any], batch: EventBatch, end_date: str) -> Work[None]:
        """A session that ended now, added to ``session_rollup`` and its totals (reports read them)."""
        status, org_id, start, connection, email, subtype, verb, size, stored_metrics = before
        metrics = batch.session_fields.get("metrics")
        if not isinstance(metrics, dict):
            metrics = json.loads(stored_metrics) if stored_metrics else {}
        began, ended = parse_time(start), parse_time(end_date)
        duration = int((ended - began).total_seconds() * 1000) if began and ended and ended > began else 0
        masked = int(metrics.get("masked") or 0)
        sums = (1, duration, int(batch.session_fields.get("event_size", size) or 0), int(metrics.get("blocked") or 0),
                masked, 1 if masked else 0)
        yield self._ROLLUP_ADD, (org_id, start[:10], connection, email, subtype, verb, *sums)
        yield self._TOTALS_ADD, [(org_id, dimension, start[:10], value, kind, how, *sums)
                                 for dimension, value in (("connection", connection), ("user", email), ("all", ""))
                                 for kind in (subtype, ANY) for how in (verb, ANY)]

    _ROLLUP_COLUMNS = ("org_id", "day", "connection", "user_email", "subtype", "verb", "sessions", "duration_ms",
                       "bytes", "blocks", "masked", "masked_sessions")
    _ROLLUP_SUMS = ("sessions", "duration_ms", "bytes", "blocks", "masked", "masked_sessions")
    _ROLLUP_ADD = (f"INSERT INTO session_rollup ({', '.join(_ROLLUP_COLUMNS)}) VALUES "
                   f"({', '.join('?' * len(_ROLLUP_COLUMNS))}) ON CONFLICT "
                   "(org_id, day, connection, user_email, subtype, verb) DO UPDATE SET "
                   + ", ".join(f"{c} = session_rollup.{c} + excluded.{c}" for c in _ROLLUP_SUMS))

    _TOTALS_COLUMNS = ("org_id", "dimension", "day", "value", "subtype", "verb", *_ROLLUP_SUMS)
    _TOTALS_ADD = (f"INSERT INTO session_rollup_totals ({', '.join(_TOTALS_COLUMNS)}) VALUES "
                   f"({', '.join('?' * len(_TOTALS_COLUMNS))}) ON CONFLICT "
                   "(org_id, dimension, subtype, verb, day, value) DO UPDATE SET "
                   + ", ".join(f"{c} = session_rollup_totals.{c} + excluded.{c}" for c in _ROLLUP_SUMS))

    def _backfill_rollup(self) -> Work[bool]:
        """Count the sessions that ended before ``session_rollup`` existed, once (under the migration lock)."""
        lock = self.dialect.lock("schema_migrations")
        if lock is not None:
            yield lock
        made = yield ("SELECT 1 FROM schema_migrations WHERE version = ?", (ROLLUP_MIGRATION,))
        if not made.rows:  # a store opened with older migrations only (a test of an upgrade)
            return False
        marker = yield ("SELECT value FROM store_counters WHERE name = 'session_rollup'", ())
        if not marker.rows or marker.rows[0][0]:
            return False
        d = self.dialect
        masked = d.json_int("metrics", "masked")
        yield (f"INSERT INTO session_rollup ({', '.join(self._ROLLUP_COLUMNS)}) "
               "SELECT org_id, substr(start_date, 1, 10), connection, user_email, subtype, verb, COUNT(*), "
               f"SUM(CASE WHEN end_date > start_date THEN {d.duration_ms('start_date', 'end_date')} ELSE 0 END), "
               f"SUM(event_size), SUM({d.json_int('metrics', 'blocked')}), SUM({masked}), "
               f"SUM(CASE WHEN {masked} > 0 THEN 1 ELSE 0 END) FROM sessions WHERE status = 'done' "
               "GROUP BY org_id, substr(start_date, 1, 10), connection, user_email, subtype, verb", ())
        sums = ", ".join(f"SUM({c})" for c in self._ROLLUP_SUMS)
        for dimension, column in (("connection", "connection"), ("user", "user_email"), ("all", None)):
            for kind in ("subtype", None):
                for how in ("verb", None):
                    grouped = ", ".join(c for c in ("org_id", "day", column, kind, how) if c)
                    yield (f"INSERT INTO session_rollup_totals ({', '.join(self._TOTALS_COLUMNS)}) "
                           f"SELECT org_id, '{dimension}', day, {column or chr(39) * 2}, {kind or repr(ANY)}, "
                           f"{how or repr(ANY)}, {sums} FROM session_rollup GROUP BY {grouped}", ())
        yield "UPDATE store_counters SET value = 1 WHERE name = 'session_rollup'", ()
        return True

    async def session_report(self, query: ReportFilter) -> list[dict[str, Any]]:
        """From ``session_rollup`` when a connection or a user is named (its indexes find their rows), else from
        the per-connection or per-user totals (a few rows per day and connection or user, whatever the count)."""
        column = REPORT_GROUPS[query.group_by]
        where, params = ["org_id = ?", "day >= ?", "day <= ?"], [query.org_id, query.start_day, query.end_day]
        if query.connection or query.user_email:
            table = "session_rollup"
            for name, value in (("connection", query.connection), ("user_email", query.user_email),
                                ("subtype", query.subtype), ("verb", query.verb)):
                if value:
                    where.append(f"{name} = ?")
                    params.append(value)
        else:  # the totals: one row per day and group for "any" protocol and verb (ANY), or the one asked for
            table = "session_rollup_totals"
            dimension = {"connection": "connection", "user_email": "user"}.get(column, "all")
            where += ["dimension = ?", "subtype = ?" if query.subtype or column != "subtype" else "subtype <> ?",
                      "verb = ?"]
            params += [dimension, query.subtype or ANY, query.verb or ANY]
            column = "value" if dimension != "all" else column
        sums = ", ".join(f"CAST(SUM({c}) AS BIGINT)" for c in self._ROLLUP_SUMS)
        rows = await self._all(f"SELECT {column}, {sums} FROM {table} WHERE {' AND '.join(where)} GROUP BY {column} "
                               f"ORDER BY {self.dialect.sort(column, text=True)}", tuple(params))
        return [{"resource": r[0], **{name: int(r[i + 1] or 0) for i, name in enumerate(self._ROLLUP_SUMS)}}
                for r in rows]

    async def session_metrics(self, query: ReportFilter, limit: int, offset: int) -> Page:
        """Finished sessions of the range, newest first, with what the report counts of each."""
        where = ["org_id = ?", "status = 'done'", "start_date >= ?", "start_date < ?"]
        params: list[Any] = [query.org_id, query.start_day, query.end_day + "\x7f"]
        for column, value in (("connection", query.connection), ("user_email", query.user_email),
                              ("subtype", query.subtype), ("verb", query.verb)):
            if value:
                where.append(f"{column} = ?")
                params.append(value)
        clause = " AND ".join(where)
        total = sum(r["sessions"] for r in await self.session_report(query))  # the rollup counts them already
        rows = await self._all(
            "SELECT id, org_id, type, subtype, connection, user_email, verb, start_date, end_date, event_size, "
            f"{self.dialect.json_int('metrics', 'masked')}, {self.dialect.json_int('metrics', 'blocked')} "
            f"FROM sessions WHERE {clause} ORDER BY start_date DESC, {self.dialect.sort('id', text=True)} "
            "LIMIT ? OFFSET ?", tuple(params) + (limit, offset))
        return Page(items=[dict(zip(("session_id", "org_id", "connection_type", "connection_subtype",
                                     "connection_name", "user_email", "verb", "start_date", "end_date", "bytes",
                                     "count_masked", "blocks"), tuple(r))) for r in rows], total=total)
