"""The audit log: a hash chain per organization (its links keyed by ``Store.audit_key``), sealings, search."""

from __future__ import annotations

import json
from typing import Any

from gatewayd.evidence import SEALED, audit_hash
from gatewayd.models import CHAIN_GENESIS, AuditEntry, Page
from gatewayd.store.base import AuditFilter
from gatewayd.store.sql import Work, built, columns, encode, insert
from gatewayd.store.queries.core import SQLCore
from gatewayd.tasks import together

class AuditQueries(SQLCore):
    """The audit log."""

    async def append_audit(self, entry: AuditEntry) -> None:
        await self.db.transact(self._append_audit(entry))

    def _append_audit(self, entry: AuditEntry) -> Work[None]:
        """The org's last hash and the insert in one write transaction, under the audit chain's lock."""
        lock = self.dialect.lock("audit_logs")
        if lock is not None:
            yield lock
        there = yield ("SELECT 1 FROM audit_logs WHERE id = ?", (entry.id,))
        if there.rows:
            return  # stored already (an entry kept through an outage, sent again)
        last = yield (f"SELECT hash FROM audit_logs WHERE org_id = ? ORDER BY {self.dialect.row_order} DESC LIMIT 1",
                      (entry.org_id,))
        entry.prev_hash = last.rows[0][0] if last.rows and last.rows[0][0] else CHAIN_GENESIS
        stored = {name: encode(name, getattr(entry, name)) for name in columns(AuditEntry)}
        entry.hash = audit_hash(entry.prev_hash, stored, self.audit_key)  # over the values as they are stored
        yield insert("audit_logs", entry)

    async def audit_chain(self, org_id: str) -> list[dict[str, Any]]:
        rows = await self._all(f"SELECT * FROM audit_logs WHERE org_id = ? ORDER BY {self.dialect.row_order}",
                               (org_id,))
        return [dict(zip(r.keys(), tuple(r))) for r in rows]

    async def sealings(self, session_id: str) -> list[dict[str, Any]]:
        # the payload is {"session_id": ..., "seal": ...} as json.dumps writes it: matched by its start
        start = json.dumps({"session_id": session_id})[:-1] + ","
        pattern = start.replace("!", "!!").replace("%", "!%").replace("_", "!_") + "%"
        rows = await self._all(
            "SELECT id, org_id, created_at, request_payload_redacted FROM audit_logs WHERE action = ? "
            f"AND outcome = 'success' AND request_payload_redacted LIKE ? ESCAPE '!' ORDER BY {self.dialect.row_order}",
            (SEALED, pattern))
        found = []
        for row in rows:
            payload = json.loads(row[3])  # SQLite's LIKE ignores case: the id is compared here again
            if payload.get("session_id") == session_id:
                found.append({"seal": payload.get("seal"), "sealed_at": row[2], "org_id": row[1], "entry": row[0]})
        return found

    async def list_audit(self, query: AuditFilter) -> Page:
        """Entries newest first, the total counted up to ``count_cap`` (``total_exact`` False past it). An actor is
        a subject or an e-mail: two arms, the entries of the subject and those of the e-mail under another
        subject, each read from its own index in the page's order and merged (an OR of the two is read from
        neither index in order: every entry of the actor is read and sorted)."""
        where, params = ["1 = 1"], []
        if query.org_id:
            where.append("org_id = ?")
            params.append(query.org_id)
        for column, value in (("resource_type", query.resource_type), ("action", query.action),
                              ("outcome", query.outcome)):
            if value:
                where.append(f"{column} = ?")
                params.append(value)
        if query.created_after:
            where.append("created_at >= ?")
            params.append(query.created_after)
        if query.created_before:
            where.append("created_at <= ?")
            params.append(query.created_before)
        clause = " AND ".join(where)
        arms: list[tuple[str, list[Any]]] = [("1 = 1", [])]
        if query.actor:
            arms = [("actor_subject = ?", [query.actor]),
                    ("lower(actor_email) = lower(?) AND actor_subject != ?", [query.actor, query.actor])]
        counted = self._capped_count(
            " UNION ALL ".join(f"SELECT 1 FROM audit_logs WHERE {clause} AND {arm}" for arm, _ in arms),
            [value for _, extra in arms for value in params + extra])
        row = self.dialect.row_order
        order = f"ORDER BY created_at DESC, {row} DESC"
        offset, wanted = (query.page - 1) * query.page_size, query.page_size + 1
        if len(arms) > 1 and offset + wanted <= self.count_cap:
            # each arm up to the page's end, merged here (PostgreSQL 15 sorts a UNION of the two, whole); past the
            # cap the database sorts them, so that no page brings more than twice the cap into this process
            (total, exact), *found = await together(counted, *(
                self._all(f"SELECT *, {row} AS list_order FROM audit_logs WHERE {clause} AND {arm} {order} LIMIT ?",
                          tuple(params + extra) + (offset + wanted,)) for arm, extra in arms))
            merged = [entry for rows in found for entry in rows]
            merged.sort(key=lambda r: (r["created_at"], r["list_order"]), reverse=True)
            rows = merged[offset:offset + wanted]
        else:
            # the page's row numbers first, from an index alone (a deep page skips index entries, not rows), then
            # those rows (on PostgreSQL by the index (org_id, row_order))
            either = " OR ".join(f"({arm})" for arm, _ in arms)
            of_org, org_params = ("org_id = ? AND ", [query.org_id]) if query.org_id else ("", [])
            (total, exact), rows = await together(counted, self._all(
                f"SELECT * FROM audit_logs WHERE {of_org}{row} IN (SELECT {row} FROM audit_logs WHERE {clause} "
                f"AND ({either}) {order} LIMIT ? OFFSET ?) {order}",
                tuple(org_params + params + [v for _, extra in arms for v in extra]) + (wanted, offset)))
        return Page(items=built(AuditEntry, rows[:query.page_size]), total=total, total_exact=exact,
                    more=len(rows) > query.page_size)
