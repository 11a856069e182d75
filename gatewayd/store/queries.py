"""The queries of every SQL backend, written once; a backend brings a ``Dialect`` and a ``Connector``.

See ``gatewayd.store.sql`` for the seams and how the PostgreSQL backend plugs in. Reads go
through ``Connector.fetch``; every write is one ``Work`` driven by ``Connector.transact``.
"""

from __future__ import annotations

import asyncio
import json
from operator import itemgetter
from typing import Any, Iterable, Sequence

from gatewayd.crypto import SecretBox
from gatewayd.evidence import (
    LATE_BASE,
    SEALED,
    BatchLink,
    EventBatch,
    audit_hash,
    chain_hash,
    pack_events,
    unpack_events,
)
from gatewayd.models import (
    CHAIN_GENESIS,
    AccessRequestRule,
    Agent,
    AIAnalyzerRule,
    AIProvider,
    ApiKey,
    AuditEntry,
    Connection,
    Credential,
    Delivery,
    GuardRail,
    Node,
    Organization,
    Page,
    Plugin,
    PluginConnection,
    Resource,
    Review,
    ReviewGroup,
    RunbookRepository,
    RunbookRule,
    Session,
    SessionEvent,
    User,
    WebhookEndpoint,
    new_id,
    parse_time,
    rfc3339,
    utcnow,
)
from gatewayd.store.base import REPORT_GROUPS, AuditFilter, NotFound, ReportFilter, SessionFilter, Store
from gatewayd.store.bus import BusTransport, TableBus
from gatewayd.store.migrations import MIGRATIONS, Migration
from gatewayd.store.search import MIN_SEARCH, TEXT_COUNT_CAP, TEXT_PROBE, input_text, like_pattern
from gatewayd.store.sql import (
    Connector,
    Row,
    Statement,
    Work,
    assign,
    build,
    columns,
    decode,
    encode,
    in_order,
    insert,
    update,
)

DEFAULT_ORG_NAME = "default"
GUARDRAILS = "guardrails"  # the store_counters row of the guard-rail generation
ANY = "*"  # a rollup total's protocol or verb when it counts every one
ROLLUP_MIGRATION = 16  # the migration that makes session_rollup (gatewayd.store.migrations): its backfill follows it
# Session columns a recording flush may write beside its events (its progress, not its state).
RECORDING_FIELDS = frozenset({"event_size", "metrics", "chain_head"})
_seq_of = itemgetter(0)

# A session a connection may claim: issued ready, or open with its jit credentials handed out, not
# ended, not claimed, no kill asked for.
CLAIMABLE = ("claimed_at IS NULL AND kill_requested_at IS NULL AND end_date IS NULL "
             "AND status IN ('ready', 'open')")


def _number_events(rows: list[Any], batches: list[Any], kinds: str | None) -> list[tuple[int, SessionEvent]]:
    """A session's (sequence number, event) pairs from its rows of one event each and its packed batches (of
    ``kinds`` only, when given)."""
    found = [(r[0], SessionEvent(r[1], r[2], bytes(r[3]))) for r in rows]
    for (packed,) in batches:
        found += unpack_events(bytes(packed))
    if rows and len(found) > len(rows):
        found.sort(key=_seq_of)
    return found if kinds is None else [pair for pair in found if pair[1].kind in kinds]


class SQLStore(Store):
    """The Store over any SQL database: the shared queries on a backend's connector and dialect."""

    def __init__(self, connector: Connector, box: SecretBox) -> None:
        self.db = connector
        self.dialect = connector.dialect
        self.box = box
        self._default_org: Organization | None = None
        sort = self.dialect.sort
        self._by_name, self._by_email = sort("name", text=True), sort("email", text=True)
        self._by_group, self._by_user_group = sort("group_name", text=True), sort("ug.group_name", text=True)

    @property
    def reachable(self) -> bool:  # type: ignore[override]
        return getattr(self.db, "failing_since", None) is None

    # ---------------------------------------------------------------- lifecycle
    async def open(self) -> None:
        await self.db.connect()
        try:
            await self.db.transact(self._migration_table())
            for version, script in MIGRATIONS:
                await self.db.transact(self._migrate(version, script))
            await self.db.transact(self._backfill_rollup())
        except BaseException:
            await self.db.close()
            raise

    async def close(self) -> None:
        await self.db.close()

    def _migration_table(self) -> Work[None]:
        """The table of applied migrations, made under the migration lock (a concurrent CREATE TABLE IF NOT
        EXISTS can fail in PostgreSQL)."""
        lock = self.dialect.lock("schema_migrations")
        if lock is not None:
            yield lock
        yield ("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, applied_at TEXT NOT NULL)",
               ())

    def _migrate(self, version: int, script: Migration) -> Work[bool]:
        """Apply one migration unless it is applied already (checked under the migration lock: several
        processes may start at once)."""
        lock = self.dialect.lock("schema_migrations")
        if lock is not None:
            yield lock
        done = yield ("SELECT 1 FROM schema_migrations WHERE version = ?", (version,))
        if done.rows:
            return False
        statements = script(self.dialect) if callable(script) else self.dialect.ddl(script).split(";")
        for statement in filter(None, (s.strip() for s in statements)):
            yield statement, ()
        yield "INSERT INTO schema_migrations (version, applied_at) VALUES (?, ?)", (version, rfc3339(utcnow()))
        return True

    async def _write(self, batch: list[Statement]) -> None:
        """Run statements in one transaction (unique violations become Conflict)."""
        await self.db.transact(in_order(batch))

    async def _changed(self, statement: Statement) -> int:
        """Run one UPDATE or DELETE in its own transaction; how many rows it changed."""
        return await self.db.transact(self._rowcount(statement))

    @staticmethod
    def _rowcount(statement: Statement) -> Work[int]:
        done = yield statement
        return done.rowcount

    async def _one(self, sql: str, params: tuple[Any, ...] = ()) -> Any:
        rows = await self.db.fetch(sql, params)
        return rows[0] if rows else None

    async def _all(self, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
        return list(await self.db.fetch(sql, params))

    async def _count(self, sql: str, params: Any) -> int:
        return (await self.db.fetch(sql, tuple(params)))[0][0]

    _insert = staticmethod(insert)  # kept for bench/api's bulk loader

    # ---------------------------------------------------------------- organizations
    async def default_org(self) -> Organization:
        if self._default_org is None:
            row = await self._one("SELECT * FROM orgs ORDER BY created_at LIMIT 1")
            if row is None:
                await self.create_org(DEFAULT_ORG_NAME)
                row = await self._one("SELECT * FROM orgs ORDER BY created_at LIMIT 1")
            self._default_org = build(Organization, row)
        return self._default_org

    async def create_org(self, name: str) -> Organization:
        org = Organization(id=new_id(), name=name, created_at=rfc3339(utcnow()))
        await self._write([insert("orgs", org)])
        return org

    async def get_org(self, org_id: str) -> Organization | None:
        row = await self._one("SELECT * FROM orgs WHERE id = ?", (org_id,))
        return build(Organization, row) if row else None

    # ---------------------------------------------------------------- users and groups
    async def _user_from(self, row: Row | None) -> User | None:
        if row is None:
            return None
        groups = [r[0] for r in await self._all(
            f"SELECT group_name FROM user_groups WHERE user_id = ? ORDER BY {self._by_group}", (row["id"],))]
        return build(User, row, groups=groups, operator=bool(row["operator"]), federated=bool(row["federated"]),
                     service_account=bool(row["service_account"]))

    async def get_user(self, *, id: str | None = None, subject: str | None = None,
                       email: str | None = None, org_id: str | None = None) -> User | None:
        if id is not None:
            return await self._user_from(await self._one("SELECT * FROM users WHERE id = ?", (id,)))
        if subject is not None:
            return await self._user_from(await self._one("SELECT * FROM users WHERE subject = ?", (subject,)))
        if email is not None and org_id is not None:
            return await self._user_from(
                await self._one("SELECT * FROM users WHERE lower(email) = lower(?) AND org_id = ?", (email, org_id)))
        if email is not None:
            return await self._user_from(
                await self._one("SELECT * FROM users WHERE lower(email) = lower(?)", (email,)))
        raise ValueError("get_user needs id, subject or email")

    async def list_users(self, org_id: str) -> list[User]:
        rows = await self._all(f"SELECT * FROM users WHERE org_id = ? ORDER BY {self._by_email}", (org_id,))
        memberships: dict[str, list[str]] = {}
        for r in await self._all(
            "SELECT ug.user_id, ug.group_name FROM user_groups ug JOIN users u ON u.id = ug.user_id "
            f"WHERE u.org_id = ? ORDER BY {self._by_user_group}", (org_id,)):
            memberships.setdefault(r[0], []).append(r[1])
        return [build(User, r, groups=memberships.get(r["id"], []), operator=bool(r["operator"]),
                      federated=bool(r["federated"]), service_account=bool(r["service_account"])) for r in rows]

    async def save_user(self, user: User) -> User:
        now = rfc3339(utcnow())
        user.updated_at = now
        exists = await self._one("SELECT 1 FROM users WHERE id = ?", (user.id,))
        if not exists:
            user.created_at = user.created_at or now
        statement = update("users", user, skip=("groups",)) if exists else \
            insert("users", user, skip=("groups",))
        group_rows = [(user.org_id, g, now) for g in user.groups] if user.org_id else []
        await self._write([
            statement,
            ("DELETE FROM user_groups WHERE user_id = ?", (user.id,)),
            (self.dialect.upsert("groups", ("org_id", "name", "created_at"), ("org_id", "name"), ()), group_rows),
            ("INSERT INTO user_groups (user_id, group_name) VALUES (?, ?)", [(user.id, g) for g in user.groups]),
        ])
        return user

    async def delete_user(self, user_id: str) -> None:
        await self._write([("DELETE FROM users WHERE id = ?", (user_id,))])

    async def list_groups(self, org_id: str) -> list[str]:
        rows = await self._all(f"SELECT name FROM groups WHERE org_id = ? ORDER BY {self._by_name}", (org_id,))
        return [r[0] for r in rows]

    async def create_group(self, org_id: str, name: str) -> None:
        await self._write([("INSERT INTO groups (org_id, name, created_at) VALUES (?, ?, ?)",
                            (org_id, name, rfc3339(utcnow())))])

    async def delete_group(self, org_id: str, name: str) -> None:
        if not await self._one("SELECT 1 FROM groups WHERE org_id = ? AND name = ?", (org_id, name)):
            raise NotFound(name)
        await self._write([
            ("DELETE FROM user_groups WHERE group_name = ? AND user_id IN (SELECT id FROM users WHERE org_id = ?)",
             (name, org_id)),
            (f"UPDATE users SET granted_groups = {self.dialect.json_without('users.granted_groups')} "
             f"WHERE org_id = ? AND {self.dialect.json_has_any('users.granted_groups', 1)}", (name, org_id, name)),
            ("DELETE FROM groups WHERE org_id = ? AND name = ?", (org_id, name)),
        ])

    # ---------------------------------------------------------------- resources and connections
    def _connection_row(self, conn: Connection) -> Connection:
        sealed = self.box.seal(json.dumps(conn.secret).encode(), conn.id.encode())
        clone = Connection(**{n: getattr(conn, n) for n in columns(Connection)})
        clone.secret = sealed  # type: ignore[assignment]
        return clone

    def _connection_from(self, row: Row | None) -> Connection | None:
        if row is None:
            return None
        secret = json.loads(self.box.open(row["secret"], row["id"].encode())) if row["secret"] else {}
        values = {n: decode(n, row[n]) for n in columns(Connection) if n != "secret"}
        return Connection(secret=secret, **values)

    async def create_resource(self, resource: Resource, connections: list[Connection]) -> None:
        await self._write([insert("resources", resource)] +
                          [insert("connections", self._connection_row(c)) for c in connections])

    async def update_resource(self, resource: Resource, connections: list[Connection] | None) -> None:
        statements = [update("resources", resource, skip=("created_at",))]
        if connections is not None:
            statements.append(("DELETE FROM connections WHERE org_id = ? AND resource_name = ?",
                               (resource.org_id, resource.name)))
            statements += [insert("connections", self._connection_row(c)) for c in connections]
        await self._write(statements)

    async def get_resource(self, org_id: str, name: str) -> Resource | None:
        row = await self._one("SELECT * FROM resources WHERE org_id = ? AND name = ?", (org_id, name))
        return build(Resource, row) if row else None

    async def list_resources(self, org_id: str) -> list[Resource]:
        rows = await self._all(f"SELECT * FROM resources WHERE org_id = ? ORDER BY {self._by_name}", (org_id,))
        return [build(Resource, r) for r in rows]

    async def delete_resource(self, org_id: str, name: str) -> None:
        await self._write([
            ("DELETE FROM connections WHERE org_id = ? AND resource_name = ?", (org_id, name)),
            ("DELETE FROM resources WHERE org_id = ? AND name = ?", (org_id, name)),
        ])

    async def create_connection(self, connection: Connection) -> None:
        await self._write([insert("connections", self._connection_row(connection))])

    async def update_connection(self, connection: Connection) -> None:
        await self._write([update("connections", self._connection_row(connection), skip=("created_at",))])

    async def get_connection(self, org_id: str, name_or_id: str) -> Connection | None:
        row = await self._one("SELECT * FROM connections WHERE org_id = ? AND (name = ? OR id = ?)",
                              (org_id, name_or_id, name_or_id))
        return self._connection_from(row)

    async def list_connections(self, org_id: str, resource_name: str | None = None) -> list[Connection]:
        if resource_name is None:
            rows = await self._all(f"SELECT * FROM connections WHERE org_id = ? ORDER BY {self._by_name}", (org_id,))
        else:
            rows = await self._all("SELECT * FROM connections WHERE org_id = ? AND resource_name = ? "
                                   f"ORDER BY {self._by_name}",
                                   (org_id, resource_name))
        return [self._connection_from(r) for r in rows]  # type: ignore[misc]

    async def delete_connection(self, org_id: str, name_or_id: str) -> None:
        await self._write([("DELETE FROM connections WHERE org_id = ? AND (name = ? OR id = ?)",
                            (org_id, name_or_id, name_or_id))])

    # ---------------------------------------------------------------- credentials
    async def create_credential(self, credential: Credential, session: Session | None) -> None:
        statements = [insert("sessions", session)] if session is not None else []
        await self._write(statements + [insert("credentials", credential)])

    async def get_credential(self, secret_hash: str) -> Credential | None:
        row = await self._one("SELECT * FROM credentials WHERE secret_hash = ?", (secret_hash,))
        return build(Credential, row) if row else None

    async def revoke_credentials(self, *, session_id: str | None = None, review_id: str | None = None,
                                 revoked_at: str) -> int:
        column, value = ("session_id", session_id) if session_id else ("review_id", review_id)
        return await self._changed((f"UPDATE credentials SET revoked_at = ? WHERE {column} = ? AND revoked_at IS NULL",
                                    (revoked_at, value)))

    # ---------------------------------------------------------------- guard rails
    _BUMP_GUARDRAILS: Statement = ("UPDATE store_counters SET value = value + 1 WHERE name = ?", (GUARDRAILS,))

    async def save_guardrail(self, rule: GuardRail, *, create: bool) -> None:
        statement = insert("guardrails", rule, skip=("connection_ids",)) if create else \
            update("guardrails", rule, skip=("connection_ids", "created_at"))
        await self._write([
            statement,
            ("DELETE FROM guardrail_connections WHERE guardrail_id = ?", (rule.id,)),
            ("INSERT INTO guardrail_connections (guardrail_id, connection_id) VALUES (?, ?)",
             [(rule.id, c) for c in dict.fromkeys(rule.connection_ids)]),
            self._BUMP_GUARDRAILS,
        ])

    async def _guardrails_from(self, rows: list[Row]) -> list[GuardRail]:
        result = []
        for row in rows:
            ids = [r[0] for r in await self._all(
                "SELECT connection_id FROM guardrail_connections WHERE guardrail_id = ? "
                f"ORDER BY {self.dialect.row_order}", (row["id"],))]
            result.append(build(GuardRail, row, connection_ids=ids))
        return result

    async def get_guardrail(self, org_id: str, rule_id: str) -> GuardRail | None:
        rows = await self._all("SELECT * FROM guardrails WHERE org_id = ? AND (id = ? OR name = ?)",
                               (org_id, rule_id, rule_id))
        found = await self._guardrails_from(rows)
        return found[0] if found else None

    async def list_guardrails(self, org_id: str, connection_id: str | None = None) -> list[GuardRail]:
        order = self.dialect.sort("g.name", text=True)
        if connection_id is None:
            rows = await self._all(f"SELECT * FROM guardrails g WHERE g.org_id = ? ORDER BY {order}", (org_id,))
        else:
            rows = await self._all(
                "SELECT g.* FROM guardrails g JOIN guardrail_connections gc ON gc.guardrail_id = g.id "
                f"WHERE g.org_id = ? AND gc.connection_id = ? ORDER BY {order}", (org_id, connection_id))
        return await self._guardrails_from(rows)

    async def delete_guardrail(self, org_id: str, rule_id: str) -> None:
        await self._write([
            ("DELETE FROM guardrail_connections WHERE guardrail_id = ?", (rule_id,)),
            ("DELETE FROM guardrails WHERE org_id = ? AND id = ?", (org_id, rule_id)),
            self._BUMP_GUARDRAILS,
        ])

    async def guardrail_generation(self) -> int:
        row = await self._one("SELECT value FROM store_counters WHERE name = ?", (GUARDRAILS,))
        return int(row[0]) if row else 0

    # ---------------------------------------------------------------- sessions
    async def create_session(self, session: Session) -> None:
        await self._write([insert("sessions", session)])

    async def get_session(self, session_id: str) -> Session | None:
        row = await self._one("SELECT * FROM sessions WHERE id = ?", (session_id,))
        return build(Session, row) if row else None

    async def list_sessions(self, query: SessionFilter) -> Page:
        """Sessions newest first. A text search first asks the text index for at most TEXT_PROBE matches: fewer
        (a rare text), and the sessions are those, counted exactly; more (a common one), and the sessions are
        read newest first, each checked against the text's matches, and counted among its first TEXT_COUNT_CAP
        index rows only (``total_exact`` False when it has more)."""
        where, params = ["org_id = ?"], [query.org_id]
        for column, value in (("user_id", query.user_id), ("user_id", query.only_user_id),
                              ("connection", query.connection), ("type", query.type), ("subtype", query.protocol),
                              ("status", query.status), ("tracker_issue_key", query.tracker_issue_key)):
            if value is not None:
                where.append(f"{column} = ?")
                params.append(value)
        if query.user_search:  # the subject itself, or part of an e-mail or name (users: a small table)
            where.append("user_id IN (SELECT ? UNION SELECT subject FROM users WHERE org_id = ? AND "
                         "(lower(email) LIKE ? ESCAPE '!' OR lower(name) LIKE ? ESCAPE '!'))")
            pattern = like_pattern(query.user_search.lower())
            params += [query.user_search, query.org_id, pattern, pattern]
        capped = False
        if query.text:
            if len(query.text) < MIN_SEARCH:
                raise ValueError(f"a search needs at least {MIN_SEARCH} characters")
            matches, value = self.dialect.text_matches(query.text)
            probe = await self._all(f"{matches} LIMIT ?", (value, TEXT_PROBE + 1))
            if len(probe) <= TEXT_PROBE:  # a rare text: its sessions, by primary key
                found = list(dict.fromkeys(r[0] for r in probe)) or [""]
                where[0] = f"{self.dialect.driven_by_text('org_id')} = ?"
                where.append(f"id IN ({', '.join('?' * len(found))})")
                params += found
            else:  # a common one: newest first through the other filters, each session checked
                capped = True
                text_at = len(where)
                where.append(f"id IN ({matches})")
                params.append(value)
        if query.start_date:
            where.append("start_date >= ?")
            params.append(query.start_date)
        if query.end_date:
            where.append("start_date <= ?")
            params.append(query.end_date)
        if query.review_status:
            where.append("review_id IN (SELECT id FROM reviews WHERE status = ?)")
            params.append(query.review_status)
        if query.review_approver:
            where.append("review_id IN (SELECT review_id FROM review_groups WHERE lower(reviewed_by_email) = lower(?))")
            params.append(query.review_approver)
        clause = " AND ".join(where)
        exact = True
        if capped:  # counted from the text's first TEXT_COUNT_CAP index rows, by primary key
            bounded = list(where)
            bounded[0] = f"{self.dialect.driven_by_text('org_id')} = ?"
            bounded[text_at] = f"id IN ({matches} LIMIT {TEXT_COUNT_CAP})"
            total = await self._count(f"SELECT COUNT(*) FROM sessions WHERE {' AND '.join(bounded)}", params)
            exact = await self._count(f"SELECT COUNT(*) FROM ({matches} LIMIT {TEXT_COUNT_CAP + 1}) AS rows_found",
                                      [value]) <= TEXT_COUNT_CAP
        else:
            total = await self._count(f"SELECT COUNT(*) FROM sessions WHERE {clause}", params)
        names = ", ".join(n for n in columns(Session) if n != "script")
        order = f"{self.dialect.sort('start_date', descending=True)}, {self.dialect.sort('id', text=True)}"
        rows = await self._all(
            f"SELECT {names}, script FROM sessions WHERE {clause} ORDER BY {order} LIMIT ? OFFSET ?",
            tuple(params) + (query.limit, query.offset))
        return Page(items=[build(Session, r) for r in rows], total=total, total_exact=exact)

    def _returning(self, statement: Statement, key: str) -> Work[Session | None]:
        """An UPDATE of one session, and the session as it is after it (None when no row matched).

        ``RETURNING *`` where the dialect has it; else the UPDATE and a SELECT in the same write
        transaction, which holds the row.
        """
        sql, params = statement
        if self.dialect.returning:
            done = yield sql + " RETURNING *", params
            return build(Session, done.rows[0]) if done.rows else None
        done = yield sql, params
        if done.rowcount != 1:
            return None
        row = yield "SELECT * FROM sessions WHERE id = ?", (key,)
        return build(Session, row.rows[0]) if row.rows else None

    async def claim_session(self, session_id: str, start_date: str, node_id: str | None = None) -> Session | None:
        return await self.db.transact(self._returning((
            "UPDATE sessions SET status = 'open', start_date = ?, claimed_at = ?, node_id = ? "
            f"WHERE id = ? AND {CLAIMABLE}", (start_date, rfc3339(utcnow()), node_id, session_id)), session_id))

    async def start_session(self, session_id: str, start_date: str) -> bool:
        done = await self.db.transact(self._returning((
            "UPDATE sessions SET status = 'open', start_date = ? WHERE id = ? AND status = 'ready' "
            "AND kill_requested_at IS NULL", (start_date, session_id)), session_id))
        return done is not None

    async def request_kill(self, session_id: str, reason: str, requested_at: str) -> Session | None:
        return await self.db.transact(self._returning((
            "UPDATE sessions SET kill_requested_at = COALESCE(kill_requested_at, ?), "
            "kill_reason = COALESCE(kill_reason, ?) WHERE id = ? AND status != 'done'",
            (requested_at, reason, session_id)), session_id))

    async def set_ai_analysis(self, session_id: str, analysis: dict[str, Any] | None, *,
                              status: str | None = None) -> bool:
        where, params = "id = ?", [session_id]
        if status is not None:
            where += " AND status = ?"
            params.append(status)
        done = await self.db.transact(self._returning(
            ("UPDATE sessions SET ai_analysis = ? WHERE " + where, (encode("ai_analysis", analysis), *params)),
            session_id))
        return done is not None

    def _store_batches(self, batches: Iterable[EventBatch], diverged: set[str]) -> Work[None]:
        """Insert each batch unless it is stored already; a session whose numbers hold another hash is
        ``diverged``: none of its later batches nor its fields are written."""
        for batch in batches:
            unknown = set(batch.session_fields) - RECORDING_FIELDS
            if unknown:
                raise ValueError(f"a recording batch may not write session fields {sorted(unknown)}")
            sid = batch.session_id
            if sid in diverged:
                continue
            if batch.count:
                done = yield ("INSERT INTO session_event_batches (session_id, first_seq, count, prev_hash, hash, events) "
                              "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (session_id, first_seq) DO NOTHING",
                              (sid, batch.first_seq, batch.count, batch.previous_hash, batch.hash, batch.packed))
                if done.rowcount != 1:
                    there = yield ("SELECT hash FROM session_event_batches WHERE session_id = ? AND first_seq = ?",
                                   (sid, batch.first_seq))
                    if not there.rows or there.rows[0][0] != batch.hash:
                        diverged.add(sid)
                        continue
                elif batch.sizes.get("i") and (text := input_text(batch.packed)):  # what was typed, searchable
                    for statement in self.dialect.search_insert(sid, text):  # once: not again on a replay
                        yield statement
            if batch.session_fields:
                yield assign("sessions", batch.session_fields, "id = ? AND status != 'done'", (sid,))

    def _append(self, batches: Iterable[EventBatch]) -> Work[set[str]]:
        diverged: set[str] = set()
        yield from self._store_batches(batches, diverged)
        return diverged

    async def append_events(self, batches: Iterable[EventBatch]) -> set[str]:
        batches = list(batches)
        if not batches:
            return set()
        return await self.db.transact(self._append(batches))

    def _close(self, batches: Sequence[EventBatch], end_date: str, exit_code: int | None,
               seal: str | None) -> Work[bool]:
        """The last events and the end, and (the first time it ends) the session counted in ``session_rollup``."""
        diverged: set[str] = set()
        sid = batches[-1].session_id
        before = yield ("SELECT status, org_id, start_date, connection, user_email, subtype, verb, event_size, "
                        "metrics FROM sessions WHERE id = ?", (sid,))
        # the fields first: a close stored already (a retry after an unknown outcome) leaves them as they are
        yield from self._store_batches(batches, diverged)
        if diverged:
            return False
        done = yield assign("sessions", {"status": "done", "end_date": end_date, "exit_code": exit_code, "seal": seal},
                            "id = ? AND status != 'done'", (sid,))
        if done.rowcount == 1:
            if before.rows and before.rows[0][0] != "done":
                yield from self._counted(before.rows[0], batches[-1], end_date)
            return True
        row = yield ("SELECT seal, end_date FROM sessions WHERE id = ?", (sid,))
        return bool(row.rows) and (row.rows[0][0], row.rows[0][1]) == (seal, end_date)  # this close, stored before

    async def close_session(self, batches: Sequence[EventBatch], *, end_date: str, exit_code: int | None,
                            seal: str | None) -> bool:
        return await self.db.transact(self._close(list(batches), end_date, exit_code, seal))

    def _late(self, session_id: str, events: Sequence[tuple[int, SessionEvent]], note: str) -> Work[int]:
        last = yield ("SELECT first_seq, count, hash FROM session_event_batches WHERE session_id = ? "
                      "ORDER BY first_seq DESC LIMIT 1", (session_id,))
        previous, covered = CHAIN_GENESIS, -1
        if last.rows:
            first, count, previous = int(last.rows[0][0]), int(last.rows[0][1]), last.rows[0][2]
            if first >= LATE_BASE:  # own number n is kept as LATE_BASE + 1 + n (the note before the first)
                covered = first + count - 1 - LATE_BASE - 1  # the last own number kept late already
        fresh = sorted(((seq, e) for seq, e in events if seq > covered), key=lambda pair: pair[0])
        if not fresh:
            return 0
        if covered < 0:
            first_seq = LATE_BASE + fresh[0][0]
            numbered = [SessionEvent(fresh[0][1].offset_ms, "e", note.encode())] + [e for _, e in fresh]
        else:
            first_seq = LATE_BASE + 1 + covered + 1
            numbered = [e for _, e in fresh]
        packed = pack_events(first_seq, numbered)
        link = chain_hash(previous, session_id, packed)
        yield ("INSERT INTO session_event_batches (session_id, first_seq, count, prev_hash, hash, events) "
               "VALUES (?, ?, ?, ?, ?, ?)", (session_id, first_seq, len(numbered), previous, link, packed))
        return len(fresh)

    async def append_late(self, session_id: str, events: Sequence[tuple[int, SessionEvent]], note: str) -> int:
        return await self.db.transact(self._late(session_id, events, note))

    async def chain_tail(self, session_id: str) -> tuple[int, str]:
        last = await self._one("SELECT first_seq, count, hash FROM session_event_batches WHERE session_id = ? "
                               "AND first_seq < ? ORDER BY first_seq DESC LIMIT 1", (session_id, LATE_BASE))
        return (int(last[0]) + int(last[1]), last[2]) if last is not None else (0, CHAIN_GENESIS)

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

    async def _numbered_events(self, session_id: str, kinds: str | None = None) -> list[tuple[int, SessionEvent]]:
        """A session's (sequence number, event) pairs in order (of ``kinds`` only, when given): packed per batch,
        and before that (recordings stored before batches held their events) one row each."""
        rows = await self.db.fetch(
            "SELECT seq, offset_ms, kind, data FROM session_events WHERE session_id = ? ORDER BY seq", (session_id,),
            slow=True)
        batches = await self.db.fetch("SELECT events FROM session_event_batches WHERE session_id = ? "
                                      "AND events IS NOT NULL ORDER BY first_seq", (session_id,), slow=True)
        # a recording runs to tens of megabytes: unpacked off the event loop, which serves every proxy
        return await asyncio.to_thread(_number_events, rows, batches, kinds)

    async def read_events(self, session_id: str, kinds: str | None = None) -> list[SessionEvent]:
        return [event for _, event in await self._numbered_events(session_id, kinds)]

    async def read_events_after(self, session_id: str, after: int) -> list[tuple[int, SessionEvent]]:
        rows = await self._all("SELECT seq, offset_ms, kind, data FROM session_events WHERE session_id = ? AND seq > ? "
                               "ORDER BY seq", (session_id, after))
        # from the batch holding the first event wanted (found on the primary key), not the whole recording
        batches = await self._all(
            "SELECT events FROM session_event_batches WHERE session_id = ? AND events IS NOT NULL AND first_seq >= "
            "COALESCE((SELECT MAX(first_seq) FROM session_event_batches WHERE session_id = ? AND first_seq <= ?), 0) "
            "ORDER BY first_seq", (session_id, session_id, after + 1))
        if not rows and not batches:
            return []
        found = await asyncio.to_thread(_number_events, rows, batches, None)
        return [pair for pair in found if pair[0] > after]

    async def read_event_chain(self, session_id: str) -> tuple[list[BatchLink], list[tuple[int, SessionEvent]]]:
        links = await self._all("SELECT first_seq, count, prev_hash, hash FROM session_event_batches "
                                "WHERE session_id = ? ORDER BY first_seq", (session_id,))
        return [BatchLink(r[0], r[1], r[2], r[3]) for r in links], await self._numbered_events(session_id)

    async def last_event_seq(self, session_id: str) -> tuple[int, int]:
        last = await self._one("SELECT first_seq, count, events FROM session_event_batches WHERE session_id = ? "
                               "AND events IS NOT NULL AND first_seq < ? ORDER BY first_seq DESC LIMIT 1",
                               (session_id, LATE_BASE))
        if last is not None:
            numbered = unpack_events(bytes(last[2]))
            if numbered and numbered[-1][0] == last[0] + last[1] - 1:
                return numbered[-1][0] + 1, numbered[-1][1].offset_ms
            return last[0] + last[1], 0  # an altered batch (verification says so): numbered on after its link
        row = await self._one(
            "SELECT seq, offset_ms FROM session_events WHERE session_id = ? ORDER BY seq DESC LIMIT 1", (session_id,))
        return (row[0] + 1, row[1]) if row else (0, 0)

    async def sessions_with_status(self, status: str) -> list[Session]:
        rows = await self._all("SELECT * FROM sessions WHERE status = ?", (status,))
        return [build(Session, r) for r in rows]

    async def open_sessions_of(self, node_ids: Iterable[str]) -> list[Session]:
        wanted = list(node_ids)
        if not wanted:
            return []
        rows = await self._all(f"SELECT * FROM sessions WHERE status = 'open' AND node_id IN "
                               f"({', '.join('?' * len(wanted))})", tuple(wanted))
        return [build(Session, r) for r in rows]

    async def open_session_holders(self, *, review_id: str | None = None, connection_id: str | None = None) -> set[str]:
        column, value = ("review_id", review_id) if review_id is not None else ("connection_id", connection_id)
        rows = await self._all(f"SELECT DISTINCT node_id FROM sessions WHERE status = 'open' AND {column} = ? "
                               "AND node_id IS NOT NULL", (value,))
        return {row[0] for row in rows}

    async def open_sessions_unheld(self) -> list[Session]:
        rows = await self._all("SELECT * FROM sessions WHERE status = 'open' AND (node_id IS NULL OR node_id NOT IN "
                               "(SELECT id FROM nodes WHERE status = 'up'))")
        return [build(Session, r) for r in rows]

    # ---------------------------------------------------------------- the cluster
    def _register_node(self, node: Node) -> Work[Node]:
        """The smallest slot no node that is up holds, under the nodes' lock (nodes may start at once)."""
        lock = self.dialect.lock("nodes")
        if lock is not None:
            yield lock
        taken = yield ("SELECT slot FROM nodes WHERE status = 'up'", ())
        used = {int(row[0]) for row in taken.rows}
        node.slot = next(slot for slot in range(1, len(used) + 2) if slot not in used)
        yield insert("nodes", node)
        return node

    async def register_node(self, node: Node) -> Node:
        return await self.db.transact(self._register_node(node))

    async def node_heartbeat(self, node_id: str, at: str) -> bool:
        return await self._changed(("UPDATE nodes SET heartbeat_at = ? WHERE id = ? AND status = 'up'",
                                    (at, node_id))) == 1

    async def stop_node(self, node_id: str, at: str, *, status: str = "stopped", reason: str = "",
                        heartbeat_before: str | None = None) -> bool:
        sql = "UPDATE nodes SET status = ?, stopped_at = ?, stop_reason = ? WHERE id = ? AND status = 'up'"
        params: tuple[Any, ...] = (status, at, reason, node_id)
        if heartbeat_before is not None:
            sql += " AND heartbeat_at < ?"
            params += (heartbeat_before,)
        return await self._changed((sql, params)) == 1

    async def list_nodes(self, *, up_only: bool = False) -> list[Node]:
        where = " WHERE status = 'up'" if up_only else ""
        rows = await self._all(f"SELECT * FROM nodes{where} ORDER BY started_at DESC, name")
        return [build(Node, r) for r in rows]

    async def open_sessions_by_node(self) -> dict[str | None, int]:
        rows = await self._all("SELECT node_id, COUNT(*) FROM sessions WHERE status = 'open' GROUP BY node_id")
        return {row[0]: int(row[1]) for row in rows}

    async def forget_nodes(self, before: str) -> int:
        return await self._changed((
            "DELETE FROM nodes WHERE status != 'up' AND stopped_at < ? AND NOT EXISTS "
            "(SELECT 1 FROM sessions WHERE sessions.node_id = nodes.id AND sessions.status = 'open')", (before,)))

    def bus(self) -> BusTransport:
        return TableBus(self)

    def _bus_append(self, topic: str, payload: str, origin: str, at: str) -> Work[int]:
        lock = self.dialect.lock("bus_events")
        if lock is not None:
            yield lock
        last = yield ("SELECT COALESCE(MAX(seq), 0) FROM bus_events", ())
        seq = int(last.rows[0][0]) + 1
        yield ("INSERT INTO bus_events (seq, topic, payload, origin, created_at) VALUES (?, ?, ?, ?, ?)",
               (seq, topic, payload, origin, at))
        return seq

    async def bus_publish(self, topic: str, payload: str, origin: str, at: str) -> int:
        return await self.db.transact(self._bus_append(topic, payload, origin, at))

    async def bus_read(self, after: int, limit: int = 500) -> list[tuple[int, str, str, str]]:
        rows = await self._all("SELECT seq, topic, payload, origin FROM bus_events WHERE seq > ? ORDER BY seq "
                               "LIMIT ?", (after, limit))
        return [(int(r[0]), r[1], r[2], r[3]) for r in rows]

    async def bus_last(self) -> int:
        row = await self._one("SELECT COALESCE(MAX(seq), 0) FROM bus_events")
        return int(row[0]) if row else 0

    async def bus_prune(self, before: str) -> int:
        return await self._changed(("DELETE FROM bus_events WHERE created_at < ? AND seq < "
                                    "(SELECT MAX(seq) FROM bus_events)", (before,)))

    # ---------------------------------------------------------------- reviews
    def _review_statements(self, review: Review) -> list[tuple[str, Any]]:
        return [
            ("DELETE FROM review_groups WHERE review_id = ?", (review.id,)),
            ("INSERT INTO review_groups (id, review_id, group_name, forced_review, status, review_date, "
             "reviewed_by_id, reviewed_by_email, reviewed_by_name) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
             [(g.id, review.id, g.group_name, int(g.forced_review), g.status, g.review_date, g.reviewed_by_id,
               g.reviewed_by_email, g.reviewed_by_name) for g in review.groups]),
        ]

    async def create_review(self, review: Review, session: Session | None = None) -> None:
        statements = [insert("sessions", session)] if session is not None else []
        statements.append(insert("reviews", review, skip=("groups",)))
        await self._write(statements + self._review_statements(review))

    async def _reviews_from(self, rows: list[Row]) -> list[Review]:
        if not rows:
            return []
        ids = [r["id"] for r in rows]
        groups: dict[str, list[ReviewGroup]] = {}
        marks = ", ".join("?" * len(ids))
        for g in await self._all(f"SELECT * FROM review_groups WHERE review_id IN ({marks}) "
                                 f"ORDER BY {self.dialect.row_order}", tuple(ids)):
            group = build(ReviewGroup, g)
            group.forced_review = bool(group.forced_review)
            groups.setdefault(g["review_id"], []).append(group)
        return [build(Review, r, groups=groups.get(r["id"], [])) for r in rows]

    async def get_review(self, review_id: str) -> Review | None:
        found = await self._reviews_from(await self._all("SELECT * FROM reviews WHERE id = ?", (review_id,)))
        return found[0] if found else None

    async def get_review_by_session(self, session_id: str) -> Review | None:
        found = await self._reviews_from(await self._all(
            "SELECT * FROM reviews WHERE session_id = ? ORDER BY created_at DESC LIMIT 1", (session_id,)))
        return found[0] if found else None

    async def reviews_by_ids(self, review_ids: Iterable[str]) -> dict[str, Review]:
        ids = list(dict.fromkeys(i for i in review_ids if i))
        if not ids:
            return {}
        rows = await self._all(f"SELECT * FROM reviews WHERE id IN ({', '.join('?' * len(ids))})", tuple(ids))
        return {r.id: r for r in await self._reviews_from(rows)}

    async def list_reviews(self, org_id: str, *, status: str | None = None, type: str | None = None,
                           visible_to: tuple[str, list[str]] | None = None, limit: int = 100,
                           offset: int = 0) -> Page:
        where, params = ["org_id = ?"], [org_id]
        for column, value in (("status", status), ("type", type)):
            if value:
                where.append(f"{column} = ?")
                params.append(value)
        if visible_to is not None:
            owner, groups = visible_to
            clause = "owner_id = ?"
            params.append(owner)
            if groups:
                marks = ", ".join("?" * len(groups))
                clause += (f" OR id IN (SELECT review_id FROM review_groups WHERE group_name IN ({marks}))"
                           f" OR {self.dialect.json_has_any('reviews.force_approval_groups', len(groups))}")
                params += list(groups) * 2
            where.append(f"({clause})")
        sql = " AND ".join(where)
        total = await self._count(f"SELECT COUNT(*) FROM reviews WHERE {sql}", params)
        rows = await self._all(f"SELECT * FROM reviews WHERE {sql} ORDER BY created_at DESC, "
                               f"{self.dialect.sort('id', text=True)} LIMIT ? OFFSET ?",
                               tuple(params) + (limit, offset))
        return Page(items=await self._reviews_from(rows), total=total)

    async def save_review(self, review: Review) -> None:
        await self._write([(
            "UPDATE reviews SET status = ?, time_window = ?, revoke_at = ?, updated_at = ?, "
            "force_approval_groups = ? WHERE id = ?",
            (review.status, encode("time_window", review.time_window), review.revoke_at, review.updated_at,
             encode("force_approval_groups", review.force_approval_groups), review.id),
        )] + self._review_statements(review))

    async def transition_review(self, review_id: str, from_status: str, to_status: str, at: str) -> bool:
        return await self._changed(("UPDATE reviews SET status = ?, updated_at = ? WHERE id = ? AND status = ?",
                                    (to_status, at, review_id, from_status))) == 1

    async def reviews_with_status(self, status: str, type: str | None = None) -> list[Review]:
        if type is None:
            rows = await self._all("SELECT * FROM reviews WHERE status = ?", (status,))
        else:
            rows = await self._all("SELECT * FROM reviews WHERE status = ? AND type = ?", (status, type))
        return await self._reviews_from(rows)

    async def open_review_for(self, request_key: str) -> Review | None:
        found = await self._reviews_from(await self._all(
            "SELECT * FROM reviews WHERE request_key = ? AND status IN ('PENDING', 'APPROVED') "
            "ORDER BY created_at DESC LIMIT 1", (request_key,)))
        return found[0] if found else None

    async def ids_with_prefix(self, table: str, org_id: str, prefix: str, limit: int = 3) -> list[str]:
        if table not in ("reviews", "sessions"):
            raise ValueError(f"no short ids in {table}")
        # a range on the primary key (code point order in both backends): '~' sorts after every id character
        rows = await self._all(f"SELECT id FROM {table} WHERE id >= ? AND id < ? AND org_id = ? "
                               f"ORDER BY {self.dialect.sort('id', text=True)} LIMIT ?",
                               (prefix, prefix + "~", org_id, limit))
        return [r[0] for r in rows]

    async def sessions_by_ids(self, session_ids: Iterable[str]) -> dict[str, Session]:
        ids = list(dict.fromkeys(i for i in session_ids if i))
        if not ids:
            return {}
        rows = await self._all(f"SELECT * FROM sessions WHERE id IN ({', '.join('?' * len(ids))})", tuple(ids))
        return {r["id"]: build(Session, r) for r in rows}

    async def set_session_metadata(self, session_id: str, metadata: dict[str, Any]) -> bool:
        return await self._changed(assign("sessions", {"metadata": metadata}, "id = ?", (session_id,))) == 1

    async def save_access_rule(self, rule: AccessRequestRule, *, create: bool) -> None:
        statement = insert("access_request_rules", rule) if create else \
            update("access_request_rules", rule, skip=("created_at",))
        await self._write([statement])

    async def get_access_rule(self, org_id: str, name: str) -> AccessRequestRule | None:
        row = await self._one("SELECT * FROM access_request_rules WHERE org_id = ? AND (name = ? OR id = ?)",
                              (org_id, name, name))
        return build(AccessRequestRule, row) if row else None

    async def list_access_rules(self, org_id: str) -> list[AccessRequestRule]:
        rows = await self._all(f"SELECT * FROM access_request_rules WHERE org_id = ? ORDER BY {self._by_name}",
                               (org_id,))
        return [build(AccessRequestRule, r) for r in rows]

    async def delete_access_rule(self, org_id: str, name: str) -> None:
        await self._write([("DELETE FROM access_request_rules WHERE org_id = ? AND (name = ? OR id = ?)",
                            (org_id, name, name))])

    # ---------------------------------------------------------------- AI session analysis
    @staticmethod
    def _provider_context(org_id: str) -> bytes:
        return f"ai-provider:{org_id}".encode()

    async def get_ai_provider(self, org_id: str) -> AIProvider | None:
        row = await self._one("SELECT * FROM ai_providers WHERE org_id = ?", (org_id,))
        if row is None:
            return None
        key = self.box.open(row["api_key"], self._provider_context(org_id)).decode() if row["api_key"] else ""
        return build(AIProvider, row, api_key=key)

    async def save_ai_provider(self, provider: AIProvider) -> None:
        sealed = self.box.seal(provider.api_key.encode(), self._provider_context(provider.org_id))
        await self._write([(
            self.dialect.upsert("ai_providers", ("id", "org_id", "provider", "model", "api_url", "api_key",
                                                 "created_at", "updated_at"), ("org_id",),
                                ("provider", "model", "api_url", "api_key", "updated_at")),
            (provider.id, provider.org_id, provider.provider, provider.model, provider.api_url, sealed,
             provider.created_at, provider.updated_at))])

    async def delete_ai_provider(self, org_id: str) -> bool:
        return await self._changed(("DELETE FROM ai_providers WHERE org_id = ?", (org_id,))) > 0

    async def save_ai_rule(self, rule: AIAnalyzerRule, *, create: bool) -> None:
        statement = insert("ai_analyzer_rules", rule) if create else \
            update("ai_analyzer_rules", rule, skip=("created_at",))
        await self._write([statement])

    async def get_ai_rule(self, org_id: str, name: str) -> AIAnalyzerRule | None:
        row = await self._one("SELECT * FROM ai_analyzer_rules WHERE org_id = ? AND (name = ? OR id = ?)",
                              (org_id, name, name))
        return build(AIAnalyzerRule, row) if row else None

    async def list_ai_rules(self, org_id: str) -> list[AIAnalyzerRule]:
        rows = await self._all(f"SELECT * FROM ai_analyzer_rules WHERE org_id = ? ORDER BY {self._by_name}", (org_id,))
        return [build(AIAnalyzerRule, r) for r in rows]

    async def delete_ai_rule(self, org_id: str, name: str) -> None:
        await self._write([("DELETE FROM ai_analyzer_rules WHERE org_id = ? AND (name = ? OR id = ?)",
                            (org_id, name, name))])

    # ---------------------------------------------------------------- agents
    async def create_agent(self, agent: Agent) -> None:
        await self._write([insert("agents", agent)])

    async def get_agent(self, org_id: str, name_or_id: str) -> Agent | None:
        row = await self._one("SELECT * FROM agents WHERE org_id = ? AND (name = ? OR id = ?)",
                              (org_id, name_or_id, name_or_id))
        return build(Agent, row) if row else None

    async def agent_by_token(self, token_hash: str) -> Agent | None:
        row = await self._one("SELECT * FROM agents WHERE token_hash = ?", (token_hash,))
        return build(Agent, row) if row else None

    async def list_agents(self, org_id: str) -> list[Agent]:
        rows = await self._all(f"SELECT * FROM agents WHERE org_id = ? ORDER BY {self._by_name}", (org_id,))
        return [build(Agent, r) for r in rows]

    async def save_agent(self, agent: Agent) -> None:
        await self._write([update("agents", agent, skip=("created_at", "org_id"))])

    async def delete_agent(self, org_id: str, name_or_id: str) -> bool:
        return await self._changed(("DELETE FROM agents WHERE org_id = ? AND (name = ? OR id = ?)",
                                    (org_id, name_or_id, name_or_id))) > 0

    # ---------------------------------------------------------------- audit log
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
        where, params = ["1 = 1"], []
        if query.org_id:
            where.append("org_id = ?")
            params.append(query.org_id)
        if query.actor:
            where.append("(actor_subject = ? OR lower(actor_email) = lower(?))")
            params += [query.actor, query.actor]
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
        total = await self._count(f"SELECT COUNT(*) FROM audit_logs WHERE {clause}", params)
        rows = await self._all(
            f"SELECT * FROM audit_logs WHERE {clause} ORDER BY created_at DESC, "
            f"{self.dialect.row_order} DESC LIMIT ? OFFSET ?",
            tuple(params) + (query.page_size, (query.page - 1) * query.page_size))
        return Page(items=[build(AuditEntry, r) for r in rows], total=total)

    # ---------------------------------------------------------------- settings and keys
    async def get_setting(self, key: str) -> Any:
        row = await self._one("SELECT value FROM server_settings WHERE key = ?", (key,))
        return json.loads(row[0]) if row else None

    async def put_setting(self, key: str, value: Any) -> None:
        await self._write([(
            self.dialect.upsert("server_settings", ("key", "value", "updated_at"), ("key",), ("value", "updated_at")),
            (key, json.dumps(value), rfc3339(utcnow())))])

    async def get_key(self, name: str) -> bytes | None:
        row = await self._one("SELECT material FROM signing_keys WHERE name = ?", (name,))
        return self.box.open(row[0], name.encode()) if row else None

    async def put_key(self, name: str, material: bytes) -> None:
        await self._write([(
            self.dialect.upsert("signing_keys", ("name", "material", "created_at"), ("name",), ("material",)),
            (name, self.box.seal(material, name.encode()), rfc3339(utcnow())))])

    async def delete_key(self, name: str) -> bool:
        return await self._changed(("DELETE FROM signing_keys WHERE name = ?", (name,))) > 0

    async def prune_keys(self, prefix: str, before: str) -> int:
        return await self._changed(("DELETE FROM signing_keys WHERE substr(name, 1, ?) = ? AND created_at < ?",
                                    (len(prefix), prefix, before)))

    # ---------------------------------------------------------------- runbooks
    def _runbook_repository_row(self, repo: RunbookRepository) -> Statement:
        sql, params = insert("runbook_repositories", repo)
        names = columns(RunbookRepository)
        position = names.index("credentials")
        sealed = self.box.seal(json.dumps(repo.credentials).encode(), f"runbooks:{repo.org_id}:{repo.id}".encode()) \
            if repo.credentials else None
        return sql, params[:position] + (sealed,) + params[position + 1:]

    def _runbook_repository_from(self, row: Row) -> RunbookRepository:
        values = {n: row[n] for n in columns(RunbookRepository) if n != "credentials"}
        sealed = row["credentials"]
        credentials = json.loads(self.box.open(bytes(sealed), f"runbooks:{row['org_id']}:{row['id']}".encode())) \
            if sealed else {}
        return RunbookRepository(credentials=credentials, **values)

    async def list_runbook_repositories(self, org_id: str) -> list[RunbookRepository]:
        rows = await self._all("SELECT * FROM runbook_repositories WHERE org_id = ? ORDER BY "
                               f"{self.dialect.sort('repository', text=True)}", (org_id,))
        return [self._runbook_repository_from(r) for r in rows]

    async def save_runbook_repository(self, repo: RunbookRepository, *, create: bool) -> None:
        statements = [] if create else [("DELETE FROM runbook_repositories WHERE org_id = ? AND id = ?",
                                         (repo.org_id, repo.id))]
        await self._write(statements + [self._runbook_repository_row(repo)])

    async def replace_runbook_repositories(self, org_id: str, repos: list[RunbookRepository]) -> None:
        await self._write([("DELETE FROM runbook_repositories WHERE org_id = ?", (org_id,))] +
                          [self._runbook_repository_row(r) for r in repos])

    async def delete_runbook_repository(self, org_id: str, repo_id: str) -> bool:
        return await self._changed(("DELETE FROM runbook_repositories WHERE org_id = ? AND id = ?",
                                    (org_id, repo_id))) > 0

    async def save_runbook_rule(self, rule: RunbookRule, *, create: bool) -> None:
        await self._write([insert("runbook_rules", rule) if create else
                           update("runbook_rules", rule, skip=("created_at", "org_id"))])

    async def get_runbook_rule(self, org_id: str, rule_id: str) -> RunbookRule | None:
        row = await self._one("SELECT * FROM runbook_rules WHERE org_id = ? AND (id = ? OR name = ?)",
                              (org_id, rule_id, rule_id))
        return build(RunbookRule, row) if row else None

    async def list_runbook_rules(self, org_id: str) -> list[RunbookRule]:
        rows = await self._all(f"SELECT * FROM runbook_rules WHERE org_id = ? ORDER BY {self._by_name}", (org_id,))
        return [build(RunbookRule, r) for r in rows]

    async def delete_runbook_rule(self, org_id: str, rule_id: str) -> bool:
        return await self._changed(("DELETE FROM runbook_rules WHERE org_id = ? AND id = ?", (org_id, rule_id))) > 0

    # ---------------------------------------------------------------- API keys
    async def create_api_key(self, key: ApiKey, *, replace_pending: bool = False) -> None:
        statements = [("DELETE FROM api_keys WHERE org_id = ? AND kind = ? AND status = 'pending'",
                       (key.org_id, key.kind))] if replace_pending else []
        await self._write(statements + [insert("api_keys", key)])

    async def get_api_key(self, key_hash: str) -> ApiKey | None:
        row = await self._one("SELECT * FROM api_keys WHERE key_hash = ?", (key_hash,))
        return build(ApiKey, row) if row else None

    async def api_keys_of(self, org_id: str, kind: str, status: str) -> list[ApiKey]:
        rows = await self._all("SELECT * FROM api_keys WHERE org_id = ? AND kind = ? AND status = ? "
                               "ORDER BY created_at DESC", (org_id, kind, status))
        return [build(ApiKey, r) for r in rows]

    async def revoke_api_keys(self, org_id: str, kind: str, at: str) -> int:
        return await self._changed(("UPDATE api_keys SET status = 'revoked', revoked_at = ? "
                                    "WHERE org_id = ? AND kind = ? AND status = 'active'", (at, org_id, kind)))

    async def promote_api_key(self, org_id: str, kind: str, key_hash: str, at: str) -> bool:
        return await self.db.transact(self._promote(org_id, kind, key_hash, at))

    def _promote(self, org_id: str, kind: str, key_hash: str, at: str) -> Work[bool]:
        """The pending key with ``key_hash`` becomes the active one (the previous one revoked), in one transaction."""
        found = yield ("SELECT id FROM api_keys WHERE org_id = ? AND kind = ? AND status = 'pending' "
                       "AND key_hash = ?", (org_id, kind, key_hash))
        if not found.rows:
            return False
        yield ("UPDATE api_keys SET status = 'revoked', revoked_at = ? WHERE org_id = ? AND kind = ? "
               "AND status = 'active'", (at, org_id, kind))
        yield ("UPDATE api_keys SET status = 'active' WHERE id = ?", (found.rows[0][0],))
        return True

    async def touch_api_key(self, key_id: str, at: str) -> None:
        await self._write([("UPDATE api_keys SET last_used_at = ? WHERE id = ?", (at, key_id))])

    # ---------------------------------------------------------------- plugins
    def _sealed_row(self, table: str, record: Any, name: str, context: bytes) -> Statement:
        """The INSERT of ``record`` with its field ``name`` (a dict or a string) sealed."""
        sql, params = insert(table, record)
        position = columns(type(record)).index(name)  # type: ignore[arg-type]
        value = getattr(record, name)
        clear = (json.dumps(value) if isinstance(value, dict) else value).encode()
        return sql, params[:position] + (self.box.seal(clear, context) if value else None,) + params[position + 1:]

    def _opened(self, cls: type, row: Row, name: str, context: bytes, as_json: bool) -> Any:
        values = {n: decode(n, row[n]) for n in columns(cls) if n != name}
        sealed = row[name]
        clear = self.box.open(bytes(sealed), context).decode() if sealed else ""
        values[name] = (json.loads(clear) if clear else {}) if as_json else clear
        return cls(**values)

    @staticmethod
    def _plugin_context(org_id: str, name: str) -> bytes:
        return f"plugin:{org_id}:{name}".encode()

    async def save_plugin(self, plugin: Plugin, *, create: bool) -> None:
        sql, params = self._sealed_row("plugins", plugin, "config", self._plugin_context(plugin.org_id, plugin.name))
        if not create:  # its own row only: a DELETE and INSERT would take its connections with it
            sql, params = ("UPDATE plugins SET config = ?, updated_at = ? WHERE id = ?",
                           (params[columns(Plugin).index("config")], plugin.updated_at, plugin.id))
        await self._write([(sql, params)])

    async def get_plugin(self, org_id: str, name: str) -> Plugin | None:
        row = await self._one("SELECT * FROM plugins WHERE org_id = ? AND name = ?", (org_id, name))
        return self._opened(Plugin, row, "config", self._plugin_context(org_id, name), True) if row else None

    async def list_plugins(self, org_id: str) -> list[Plugin]:
        rows = await self._all(f"SELECT * FROM plugins WHERE org_id = ? ORDER BY {self._by_name}", (org_id,))
        return [self._opened(Plugin, r, "config", self._plugin_context(org_id, r["name"]), True) for r in rows]

    async def delete_plugin(self, org_id: str, name: str) -> bool:
        found = await self._one("SELECT id FROM plugins WHERE org_id = ? AND name = ?", (org_id, name))
        if found is None:
            return False
        await self._write([("DELETE FROM plugin_connections WHERE plugin_id = ?", (found[0],)),
                           ("DELETE FROM plugins WHERE id = ?", (found[0],))])
        return True

    async def list_plugin_connections(self, org_id: str, plugin_id: str | None = None) -> list[PluginConnection]:
        if plugin_id is None:
            rows = await self._all("SELECT * FROM plugin_connections WHERE org_id = ?", (org_id,))
        else:
            rows = await self._all("SELECT * FROM plugin_connections WHERE org_id = ? AND plugin_id = ? "
                                   f"ORDER BY {self.dialect.row_order}", (org_id, plugin_id))
        return [build(PluginConnection, r) for r in rows]

    async def save_plugin_connection(self, link: PluginConnection) -> None:
        await self._write([
            ("DELETE FROM plugin_connections WHERE plugin_id = ? AND connection_id = ?",
             (link.plugin_id, link.connection_id)), insert("plugin_connections", link)])

    async def replace_plugin_connections(self, org_id: str, plugin_id: str, links: list[PluginConnection]) -> None:
        await self._write([("DELETE FROM plugin_connections WHERE org_id = ? AND plugin_id = ?", (org_id, plugin_id))]
                          + [insert("plugin_connections", link) for link in links])

    async def delete_plugin_connection(self, org_id: str, plugin_id: str, connection_id: str) -> bool:
        return await self._changed(("DELETE FROM plugin_connections WHERE org_id = ? AND plugin_id = ? "
                                    "AND connection_id = ?", (org_id, plugin_id, connection_id))) > 0

    # ---------------------------------------------------------------- webhooks
    @staticmethod
    def _endpoint_context(endpoint_id: str) -> bytes:
        return f"webhook:{endpoint_id}".encode()

    def _endpoint_from(self, row: Row) -> WebhookEndpoint:
        endpoint = self._opened(WebhookEndpoint, row, "secret", self._endpoint_context(row["id"]), False)
        endpoint.disabled = bool(endpoint.disabled)
        return endpoint

    async def save_webhook_endpoint(self, endpoint: WebhookEndpoint, *, create: bool) -> None:
        statements = [] if create else [("DELETE FROM webhook_endpoints WHERE org_id = ? AND id = ?",
                                         (endpoint.org_id, endpoint.id))]
        sql, params = self._sealed_row("webhook_endpoints", endpoint, "secret", self._endpoint_context(endpoint.id))
        position = columns(WebhookEndpoint).index("disabled")
        params = params[:position] + (int(endpoint.disabled),) + params[position + 1:]
        await self._write(statements + [(sql, params)])

    async def get_webhook_endpoint(self, org_id: str, endpoint_id: str) -> WebhookEndpoint | None:
        row = await self._one("SELECT * FROM webhook_endpoints WHERE org_id = ? AND id = ?", (org_id, endpoint_id))
        return self._endpoint_from(row) if row else None

    async def list_webhook_endpoints(self, org_id: str) -> list[WebhookEndpoint]:
        rows = await self._all("SELECT * FROM webhook_endpoints WHERE org_id = ? ORDER BY created_at, id", (org_id,))
        return [self._endpoint_from(r) for r in rows]

    async def delete_webhook_endpoint(self, org_id: str, endpoint_id: str) -> bool:
        return await self._changed(("DELETE FROM webhook_endpoints WHERE org_id = ? AND id = ?",
                                    (org_id, endpoint_id))) > 0

    async def add_deliveries(self, deliveries: list[Delivery]) -> None:
        if deliveries:
            await self._write([insert("webhook_deliveries", d) for d in deliveries])

    async def claim_deliveries(self, now: str, until: str, limit: int) -> list[Delivery]:
        return await self.db.transact(self._claim_deliveries(now, until, limit))

    def _claim_deliveries(self, now: str, until: str, limit: int) -> Work[list[Delivery]]:
        """Due deliveries no node holds, held until ``until`` by this one (one attempt more each)."""
        lock = self.dialect.lock("webhook_deliveries")
        if lock is not None:
            yield lock
        due = yield ("SELECT id FROM webhook_deliveries WHERE status = 'pending' AND next_attempt_at <= ? "
                     "AND (claimed_until IS NULL OR claimed_until < ?) ORDER BY next_attempt_at LIMIT ?",
                     (now, now, limit))
        ids = [r[0] for r in due.rows]
        if not ids:
            return []
        marks = ", ".join("?" * len(ids))
        yield (f"UPDATE webhook_deliveries SET claimed_until = ?, attempts = attempts + 1 WHERE id IN ({marks})",
               (until, *ids))
        rows = yield (f"SELECT * FROM webhook_deliveries WHERE id IN ({marks})", tuple(ids))
        return [build(Delivery, r) for r in rows.rows]

    async def finish_delivery(self, delivery: Delivery) -> None:
        await self._write([assign("webhook_deliveries", {
            "status": delivery.status, "last_status": delivery.last_status, "last_error": delivery.last_error,
            "next_attempt_at": delivery.next_attempt_at, "delivered_at": delivery.delivered_at,
            "claimed_until": None}, "id = ?", (delivery.id,))])

    async def list_deliveries(self, org_id: str, *, endpoint_id: str | None = None, status: str | None = None,
                              event_type: str | None = None, limit: int = 50, offset: int = 0) -> Page:
        where, params = ["org_id = ?"], [org_id]
        for column, value in (("endpoint_id", endpoint_id), ("status", status), ("event_type", event_type)):
            if value:
                where.append(f"{column} = ?")
                params.append(value)
        clause = " AND ".join(where)
        total = await self._count(f"SELECT COUNT(*) FROM webhook_deliveries WHERE {clause}", params)
        rows = await self._all(f"SELECT * FROM webhook_deliveries WHERE {clause} ORDER BY created_at DESC, "
                               f"{self.dialect.sort('id', text=True)} LIMIT ? OFFSET ?", tuple(params) + (limit, offset))
        return Page(items=[build(Delivery, r) for r in rows], total=total)

    async def get_delivery(self, org_id: str, delivery_id: str) -> Delivery | None:
        row = await self._one("SELECT * FROM webhook_deliveries WHERE org_id = ? AND id = ?", (org_id, delivery_id))
        return build(Delivery, row) if row else None

    # ---------------------------------------------------------------- reports
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

