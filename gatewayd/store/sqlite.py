"""The embedded SQLite store (WAL mode): a writer thread with its own connection, an aiosqlite reader."""

from __future__ import annotations

import asyncio
import functools
import json
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from pathlib import Path
from typing import Any, Iterable

import aiosqlite

from gatewayd.crypto import SecretBox
from gatewayd.evidence import BatchLink, EventBatch, audit_hash
from gatewayd.models import (
    CHAIN_GENESIS,
    AccessRequestRule,
    AIAnalyzerRule,
    AIProvider,
    AuditEntry,
    Connection,
    Credential,
    GuardRail,
    Organization,
    Page,
    Resource,
    Review,
    ReviewGroup,
    Session,
    SessionEvent,
    User,
    new_id,
    rfc3339,
    utcnow,
)
from gatewayd.store.base import AuditFilter, Conflict, NotFound, SessionFilter, Store
from gatewayd.store.migrations import MIGRATIONS

_JSON_FIELDS = {
    "env_vars", "command", "tags", "settings", "attributes", "input", "output", "metadata",
    "metrics", "labels", "integrations_metadata", "ai_analysis", "request_payload_redacted",
    "force_approval_groups", "time_window", "connection_names", "reviewers_groups", "risk_evaluation",
    "granted_groups",
}
DEFAULT_ORG_NAME = "default"
# Session events go in as multi-row INSERTs: one sqlite3_step, so one GIL hand-over between the
# writer thread and the event loop, per chunk rather than per event.  Few chunk sizes: each
# statement is prepared once and stays in the connection's statement cache.
_EVENT_CHUNKS = (256, 64, 16, 4, 1)
_EVENT_INSERTS = {n: "INSERT INTO session_events (session_id, seq, offset_ms, kind, data) VALUES "
                     + ",".join(["(?, ?, ?, ?, ?)"] * n) for n in _EVENT_CHUNKS}
_PRAGMAS = (
    "PRAGMA busy_timeout = 10000",
    "PRAGMA journal_mode = WAL",
    "PRAGMA synchronous = NORMAL",
    "PRAGMA foreign_keys = ON",
    "PRAGMA cache_size = -65536",  # 64 MiB: the session indexes stay in memory
    "PRAGMA mmap_size = 268435456",
)


def _encode(name: str, value: Any) -> Any:
    return json.dumps(value) if name in _JSON_FIELDS else value


def _decode(name: str, value: Any) -> Any:
    if name in _JSON_FIELDS and value is not None:
        return json.loads(value)
    return value


@functools.cache
def _columns(cls: type) -> list[str]:
    return [f.name for f in fields(cls)]


@functools.cache
def _plan(cls: type, keys: tuple[str, ...]) -> tuple[tuple[int, str, bool], ...]:
    """Which row positions fill which fields of ``cls``, and which are JSON: computed once per query shape."""
    wanted = set(_columns(cls))
    return tuple((i, name, name in _JSON_FIELDS) for i, name in enumerate(keys) if name in wanted)


def _event_inserts(session_id: str, first_seq: int, events: list[SessionEvent]) -> list[tuple[str, Any]]:
    """The INSERTs of a session's events, ``_EVENT_CHUNKS`` rows at a time."""
    statements: list[tuple[str, Any]] = []
    start, count = 0, len(events)
    for size in _EVENT_CHUNKS:
        while count - start >= size:
            params: list[Any] = []
            for seq, event in enumerate(events[start : start + size], first_seq + start):
                params += (session_id, seq, event.offset_ms, event.kind, event.data)
            statements.append((_EVENT_INSERTS[size], tuple(params)))
            start += size
    return statements


class SQLiteStore(Store):
    """Store backed by one SQLite file."""

    def __init__(self, path: Path, box: SecretBox) -> None:
        self.path = path
        self.box = box
        self._writer: sqlite3.Connection | None = None
        self._write_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite-writer")
        self._reader: aiosqlite.Connection | None = None
        self._default_org: Organization | None = None

    # ---------------------------------------------------------------- lifecycle
    async def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._writer = await self._in_writer(self._open_writer)
        self._reader = await aiosqlite.connect(self.path, isolation_level=None)
        self._reader.row_factory = sqlite3.Row
        for pragma in _PRAGMAS:
            await self._reader.execute(pragma)

    def _open_writer(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        for pragma in _PRAGMAS:
            conn.execute(pragma)
        self._migrate(conn)
        return conn

    @staticmethod
    def _migrate(db: sqlite3.Connection) -> None:
        db.execute("CREATE TABLE IF NOT EXISTS schema_migrations "
                   "(version INTEGER PRIMARY KEY, applied_at TEXT NOT NULL)")
        (current,) = db.execute("SELECT COALESCE(MAX(version), 0) FROM schema_migrations").fetchone()
        for version, script in MIGRATIONS:
            if version <= current:
                continue
            db.execute("BEGIN IMMEDIATE")
            try:
                for statement in filter(None, (s.strip() for s in script.split(";"))):
                    db.execute(statement)
                db.execute("INSERT INTO schema_migrations (version, applied_at) VALUES (?, ?)",
                           (version, rfc3339(utcnow())))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    async def close(self) -> None:
        if self._reader is not None:
            await self._reader.close()
        if self._writer is not None:
            await self._in_writer(self._writer.close)
        self._reader = self._writer = None

    @property
    def _r(self) -> aiosqlite.Connection:
        if self._reader is None:
            raise RuntimeError("store is not open")
        return self._reader

    async def _in_writer(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._write_thread, fn, *args)

    async def _write(self, statements: list[tuple[str, Any]]) -> None:
        """Run statements in one transaction, in one trip to the writer thread.

        Unique violations become Conflict. The transaction completes even if
        the awaiting task is cancelled, so a write is never half done.
        """
        if self._writer is None:
            raise RuntimeError("store is not open")
        await self._in_writer(self._transaction, self._writer, statements)

    @staticmethod
    def _transaction(db: sqlite3.Connection, statements: list[tuple[str, Any]]) -> None:
        db.execute("BEGIN IMMEDIATE")
        try:
            for sql, params in statements:
                if isinstance(params, list):
                    db.executemany(sql, params)
                else:
                    db.execute(sql, params)
            db.execute("COMMIT")
        except sqlite3.IntegrityError as exc:
            db.execute("ROLLBACK")
            if "UNIQUE" in str(exc):
                raise Conflict(str(exc)) from None
            raise
        except BaseException:
            db.execute("ROLLBACK")
            raise

    async def _one(self, sql: str, params: tuple = ()) -> sqlite3.Row | None:
        rows = await self._r.execute_fetchall(sql, params)  # one worker round trip
        return rows[0] if rows else None

    async def _all(self, sql: str, params: tuple = ()) -> list[sqlite3.Row]:
        return list(await self._r.execute_fetchall(sql, params))

    async def _count(self, sql: str, params: Any) -> int:
        return (await self._r.execute_fetchall(sql, params))[0][0]

    @staticmethod
    def _insert(table: str, record: Any, skip: tuple[str, ...] = ()) -> tuple[str, tuple]:
        names = [n for n in _columns(type(record)) if n not in skip]
        sql = f"INSERT INTO {table} ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})"
        return sql, tuple(_encode(n, getattr(record, n)) for n in names)

    @staticmethod
    def _update(table: str, record: Any, key: str = "id", skip: tuple[str, ...] = ()) -> tuple[str, tuple]:
        names = [n for n in _columns(type(record)) if n not in skip and n != key]
        sql = f"UPDATE {table} SET {', '.join(f'{n} = ?' for n in names)} WHERE {key} = ?"
        return sql, tuple(_encode(n, getattr(record, n)) for n in names) + (getattr(record, key),)

    @staticmethod
    def _build(cls: type, row: sqlite3.Row, **extra: Any) -> Any:
        values = {name: (json.loads(row[i]) if is_json and row[i] is not None else row[i])
                  for i, name, is_json in _plan(cls, tuple(row.keys()))}
        values.update(extra)
        return cls(**values)

    # ---------------------------------------------------------------- organizations
    async def default_org(self) -> Organization:
        if self._default_org is None:
            row = await self._one("SELECT * FROM orgs ORDER BY created_at LIMIT 1")
            if row is None:
                await self.create_org(DEFAULT_ORG_NAME)
                row = await self._one("SELECT * FROM orgs ORDER BY created_at LIMIT 1")
            self._default_org = self._build(Organization, row)
        return self._default_org

    async def create_org(self, name: str) -> Organization:
        org = Organization(id=new_id(), name=name, created_at=rfc3339(utcnow()))
        await self._write([self._insert("orgs", org)])
        return org

    async def get_org(self, org_id: str) -> Organization | None:
        row = await self._one("SELECT * FROM orgs WHERE id = ?", (org_id,))
        return self._build(Organization, row) if row else None

    # ---------------------------------------------------------------- users and groups
    async def _user_from(self, row: sqlite3.Row | None) -> User | None:
        if row is None:
            return None
        groups = [r[0] for r in await self._all(
            "SELECT group_name FROM user_groups WHERE user_id = ? ORDER BY group_name", (row["id"],))]
        return self._build(User, row, groups=groups, operator=bool(row["operator"]), federated=bool(row["federated"]))

    async def get_user(self, *, id: str | None = None, subject: str | None = None,
                       email: str | None = None) -> User | None:
        if id is not None:
            return await self._user_from(await self._one("SELECT * FROM users WHERE id = ?", (id,)))
        if subject is not None:
            return await self._user_from(await self._one("SELECT * FROM users WHERE subject = ?", (subject,)))
        if email is not None:
            return await self._user_from(
                await self._one("SELECT * FROM users WHERE lower(email) = lower(?)", (email,)))
        raise ValueError("get_user needs id, subject or email")

    async def list_users(self, org_id: str) -> list[User]:
        rows = await self._all("SELECT * FROM users WHERE org_id = ? ORDER BY email", (org_id,))
        memberships: dict[str, list[str]] = {}
        for r in await self._all(
            "SELECT ug.user_id, ug.group_name FROM user_groups ug JOIN users u ON u.id = ug.user_id "
            "WHERE u.org_id = ? ORDER BY ug.group_name", (org_id,)):
            memberships.setdefault(r[0], []).append(r[1])
        return [self._build(User, r, groups=memberships.get(r["id"], []), operator=bool(r["operator"]),
                            federated=bool(r["federated"])) for r in rows]

    async def save_user(self, user: User) -> User:
        now = rfc3339(utcnow())
        user.updated_at = now
        exists = await self._one("SELECT 1 FROM users WHERE id = ?", (user.id,))
        if not exists:
            user.created_at = user.created_at or now
        statement = self._update("users", user, skip=("groups",)) if exists else \
            self._insert("users", user, skip=("groups",))
        group_rows = [(user.org_id, g, now) for g in user.groups] if user.org_id else []
        await self._write([
            statement,
            ("DELETE FROM user_groups WHERE user_id = ?", (user.id,)),
            ("INSERT INTO groups (org_id, name, created_at) VALUES (?, ?, ?) ON CONFLICT DO NOTHING", group_rows),
            ("INSERT INTO user_groups (user_id, group_name) VALUES (?, ?)", [(user.id, g) for g in user.groups]),
        ])
        return user

    async def delete_user(self, user_id: str) -> None:
        await self._write([("DELETE FROM users WHERE id = ?", (user_id,))])

    async def list_groups(self, org_id: str) -> list[str]:
        return [r[0] for r in await self._all("SELECT name FROM groups WHERE org_id = ? ORDER BY name", (org_id,))]

    async def create_group(self, org_id: str, name: str) -> None:
        await self._write([("INSERT INTO groups (org_id, name, created_at) VALUES (?, ?, ?)",
                            (org_id, name, rfc3339(utcnow())))])

    async def delete_group(self, org_id: str, name: str) -> None:
        if not await self._one("SELECT 1 FROM groups WHERE org_id = ? AND name = ?", (org_id, name)):
            raise NotFound(name)
        await self._write([
            ("DELETE FROM user_groups WHERE group_name = ? AND user_id IN (SELECT id FROM users WHERE org_id = ?)",
             (name, org_id)),
            ("UPDATE users SET granted_groups = (SELECT json_group_array(value) FROM json_each(users.granted_groups) "
             "WHERE value != ?) WHERE org_id = ? AND EXISTS (SELECT 1 FROM json_each(users.granted_groups) "
             "WHERE value = ?)", (name, org_id, name)),
            ("DELETE FROM groups WHERE org_id = ? AND name = ?", (org_id, name)),
        ])

    # ---------------------------------------------------------------- resources and connections
    def _connection_row(self, conn: Connection) -> Connection:
        sealed = self.box.seal(json.dumps(conn.secret).encode(), conn.id.encode())
        clone = Connection(**{n: getattr(conn, n) for n in _columns(Connection)})
        clone.secret = sealed  # type: ignore[assignment]
        return clone

    def _connection_from(self, row: sqlite3.Row | None) -> Connection | None:
        if row is None:
            return None
        secret = json.loads(self.box.open(row["secret"], row["id"].encode())) if row["secret"] else {}
        values = {n: _decode(n, row[n]) for n in _columns(Connection) if n != "secret"}
        return Connection(secret=secret, **values)

    async def create_resource(self, resource: Resource, connections: list[Connection]) -> None:
        await self._write([self._insert("resources", resource)] +
                          [self._insert("connections", self._connection_row(c)) for c in connections])

    async def update_resource(self, resource: Resource, connections: list[Connection] | None) -> None:
        statements = [self._update("resources", resource, skip=("created_at",))]
        if connections is not None:
            statements.append(("DELETE FROM connections WHERE org_id = ? AND resource_name = ?",
                               (resource.org_id, resource.name)))
            statements += [self._insert("connections", self._connection_row(c)) for c in connections]
        await self._write(statements)

    async def get_resource(self, org_id: str, name: str) -> Resource | None:
        row = await self._one("SELECT * FROM resources WHERE org_id = ? AND name = ?", (org_id, name))
        return self._build(Resource, row) if row else None

    async def list_resources(self, org_id: str) -> list[Resource]:
        rows = await self._all("SELECT * FROM resources WHERE org_id = ? ORDER BY name", (org_id,))
        return [self._build(Resource, r) for r in rows]

    async def delete_resource(self, org_id: str, name: str) -> None:
        await self._write([
            ("DELETE FROM connections WHERE org_id = ? AND resource_name = ?", (org_id, name)),
            ("DELETE FROM resources WHERE org_id = ? AND name = ?", (org_id, name)),
        ])

    async def create_connection(self, connection: Connection) -> None:
        await self._write([self._insert("connections", self._connection_row(connection))])

    async def update_connection(self, connection: Connection) -> None:
        await self._write([self._update("connections", self._connection_row(connection), skip=("created_at",))])

    async def get_connection(self, org_id: str, name_or_id: str) -> Connection | None:
        row = await self._one("SELECT * FROM connections WHERE org_id = ? AND (name = ? OR id = ?)",
                              (org_id, name_or_id, name_or_id))
        return self._connection_from(row)

    async def list_connections(self, org_id: str, resource_name: str | None = None) -> list[Connection]:
        if resource_name is None:
            rows = await self._all("SELECT * FROM connections WHERE org_id = ? ORDER BY name", (org_id,))
        else:
            rows = await self._all("SELECT * FROM connections WHERE org_id = ? AND resource_name = ? ORDER BY name",
                                   (org_id, resource_name))
        return [self._connection_from(r) for r in rows]  # type: ignore[misc]

    async def delete_connection(self, org_id: str, name_or_id: str) -> None:
        await self._write([("DELETE FROM connections WHERE org_id = ? AND (name = ? OR id = ?)",
                            (org_id, name_or_id, name_or_id))])

    # ---------------------------------------------------------------- credentials
    async def create_credential(self, credential: Credential, session: Session | None) -> None:
        statements = [self._insert("sessions", session)] if session is not None else []
        await self._write(statements + [self._insert("credentials", credential)])

    async def get_credential(self, secret_hash: str) -> Credential | None:
        row = await self._one("SELECT * FROM credentials WHERE secret_hash = ?", (secret_hash,))
        return self._build(Credential, row) if row else None

    async def revoke_credentials(self, *, session_id: str | None = None, review_id: str | None = None,
                                 revoked_at: str) -> int:
        column, value = ("session_id", session_id) if session_id else ("review_id", review_id)
        count = await self._count(f"SELECT COUNT(*) FROM credentials WHERE {column} = ? AND revoked_at IS NULL",
                                  (value,))
        await self._write([(f"UPDATE credentials SET revoked_at = ? WHERE {column} = ? AND revoked_at IS NULL",
                            (revoked_at, value))])
        return count

    # ---------------------------------------------------------------- guard rails
    async def save_guardrail(self, rule: GuardRail, *, create: bool) -> None:
        statement = self._insert("guardrails", rule, skip=("connection_ids",)) if create else \
            self._update("guardrails", rule, skip=("connection_ids", "created_at"))
        await self._write([
            statement,
            ("DELETE FROM guardrail_connections WHERE guardrail_id = ?", (rule.id,)),
            ("INSERT INTO guardrail_connections (guardrail_id, connection_id) VALUES (?, ?)",
             [(rule.id, c) for c in dict.fromkeys(rule.connection_ids)]),
        ])

    async def _guardrails_from(self, rows: list[sqlite3.Row]) -> list[GuardRail]:
        result = []
        for row in rows:
            ids = [r[0] for r in await self._all(
                "SELECT connection_id FROM guardrail_connections WHERE guardrail_id = ? ORDER BY rowid", (row["id"],))]
            result.append(self._build(GuardRail, row, connection_ids=ids))
        return result

    async def get_guardrail(self, org_id: str, rule_id: str) -> GuardRail | None:
        rows = await self._all("SELECT * FROM guardrails WHERE org_id = ? AND (id = ? OR name = ?)",
                               (org_id, rule_id, rule_id))
        found = await self._guardrails_from(rows)
        return found[0] if found else None

    async def list_guardrails(self, org_id: str, connection_id: str | None = None) -> list[GuardRail]:
        if connection_id is None:
            rows = await self._all("SELECT * FROM guardrails WHERE org_id = ? ORDER BY name", (org_id,))
        else:
            rows = await self._all(
                "SELECT g.* FROM guardrails g JOIN guardrail_connections gc ON gc.guardrail_id = g.id "
                "WHERE g.org_id = ? AND gc.connection_id = ? ORDER BY g.name", (org_id, connection_id))
        return await self._guardrails_from(rows)

    async def delete_guardrail(self, org_id: str, rule_id: str) -> None:
        await self._write([
            ("DELETE FROM guardrail_connections WHERE guardrail_id = ?", (rule_id,)),
            ("DELETE FROM guardrails WHERE org_id = ? AND id = ?", (org_id, rule_id)),
        ])

    # ---------------------------------------------------------------- sessions
    async def create_session(self, session: Session) -> None:
        await self._write([self._insert("sessions", session)])

    async def get_session(self, session_id: str) -> Session | None:
        row = await self._one("SELECT * FROM sessions WHERE id = ?", (session_id,))
        return self._build(Session, row) if row else None

    async def list_sessions(self, query: SessionFilter) -> Page:
        where, params = ["org_id = ?"], [query.org_id]
        for column, value in (("user_id", query.user_id), ("user_id", query.only_user_id),
                              ("connection", query.connection), ("type", query.type),
                              ("status", query.status), ("tracker_issue_key", query.tracker_issue_key)):
            if value is not None:
                where.append(f"{column} = ?")
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
        total = await self._count(f"SELECT COUNT(*) FROM sessions WHERE {clause}", params)
        columns = ", ".join(n for n in _columns(Session) if n != "script")
        rows = await self._all(
            f"SELECT {columns}, script FROM sessions WHERE {clause} ORDER BY start_date DESC, id LIMIT ? OFFSET ?",
            tuple(params) + (query.limit, query.offset))
        return Page(items=[self._build(Session, r) for r in rows], total=total)

    async def update_session(self, session_id: str, **values: Any) -> None:
        allowed = set(_columns(Session))
        unknown = set(values) - allowed
        if unknown:
            raise ValueError(f"unknown session fields: {sorted(unknown)}")
        assignments = ", ".join(f"{n} = ?" for n in values)
        await self._write([(f"UPDATE sessions SET {assignments} WHERE id = ?",
                            tuple(_encode(n, v) for n, v in values.items()) + (session_id,))])

    async def append_events(self, batches: Iterable[EventBatch]) -> None:
        statements: list[tuple[str, Any]] = []
        for batch in batches:
            if batch.events:
                statements += _event_inserts(batch.session_id, batch.first_seq, batch.events)
                statements.append(("INSERT INTO session_event_batches (session_id, first_seq, count, prev_hash, "
                                   "hash) VALUES (?, ?, ?, ?, ?)", (batch.session_id, batch.first_seq,
                                                                    len(batch.events), batch.previous_hash,
                                                                    batch.hash)))
            if batch.session_fields:
                assignments = ", ".join(f"{n} = ?" for n in batch.session_fields)
                statements.append((f"UPDATE sessions SET {assignments} WHERE id = ?",
                                   tuple(_encode(n, v) for n, v in batch.session_fields.items()) + (batch.session_id,)))
        if statements:
            await self._write(statements)

    async def read_events(self, session_id: str, kinds: str | None = None) -> list[SessionEvent]:
        rows = await self._all(
            "SELECT offset_ms, kind, data FROM session_events WHERE session_id = ? ORDER BY seq", (session_id,))
        return [SessionEvent(r[0], r[1], bytes(r[2])) for r in rows if kinds is None or r[1] in kinds]

    async def read_event_chain(self, session_id: str) -> tuple[list[BatchLink], list[tuple[int, SessionEvent]]]:
        links = await self._all("SELECT first_seq, count, prev_hash, hash FROM session_event_batches "
                                "WHERE session_id = ? ORDER BY first_seq", (session_id,))
        rows = await self._all(
            "SELECT seq, offset_ms, kind, data FROM session_events WHERE session_id = ? ORDER BY seq", (session_id,))
        return ([BatchLink(r[0], r[1], r[2], r[3]) for r in links],
                [(r[0], SessionEvent(r[1], r[2], bytes(r[3]))) for r in rows])

    async def last_event_seq(self, session_id: str) -> tuple[int, int]:
        row = await self._one(
            "SELECT seq, offset_ms FROM session_events WHERE session_id = ? ORDER BY seq DESC LIMIT 1", (session_id,))
        return (row[0] + 1, row[1]) if row else (0, 0)

    async def sessions_with_status(self, status: str) -> list[Session]:
        rows = await self._all("SELECT * FROM sessions WHERE status = ?", (status,))
        return [self._build(Session, r) for r in rows]

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
        statements = [self._insert("sessions", session)] if session is not None else []
        statements.append(self._insert("reviews", review, skip=("groups",)))
        await self._write(statements + self._review_statements(review))

    async def _reviews_from(self, rows: list[sqlite3.Row]) -> list[Review]:
        if not rows:
            return []
        ids = [r["id"] for r in rows]
        groups: dict[str, list[ReviewGroup]] = {}
        marks = ", ".join("?" * len(ids))
        for g in await self._all(f"SELECT * FROM review_groups WHERE review_id IN ({marks}) ORDER BY rowid",
                                 tuple(ids)):
            group = self._build(ReviewGroup, g)
            group.forced_review = bool(group.forced_review)
            groups.setdefault(g["review_id"], []).append(group)
        return [self._build(Review, r, groups=groups.get(r["id"], [])) for r in rows]

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
                           f" OR EXISTS (SELECT 1 FROM json_each(reviews.force_approval_groups) "
                           f"WHERE json_each.value IN ({marks}))")
                params += list(groups) * 2
            where.append(f"({clause})")
        sql = " AND ".join(where)
        total = await self._count(f"SELECT COUNT(*) FROM reviews WHERE {sql}", params)
        rows = await self._all(f"SELECT * FROM reviews WHERE {sql} ORDER BY created_at DESC, id LIMIT ? OFFSET ?",
                               tuple(params) + (limit, offset))
        return Page(items=await self._reviews_from(rows), total=total)

    async def save_review(self, review: Review) -> None:
        await self._write([(
            "UPDATE reviews SET status = ?, time_window = ?, revoke_at = ?, updated_at = ?, "
            "force_approval_groups = ? WHERE id = ?",
            (review.status, _encode("time_window", review.time_window), review.revoke_at, review.updated_at,
             _encode("force_approval_groups", review.force_approval_groups), review.id),
        )] + self._review_statements(review))

    async def reviews_with_status(self, status: str, type: str | None = None) -> list[Review]:
        if type is None:
            rows = await self._all("SELECT * FROM reviews WHERE status = ?", (status,))
        else:
            rows = await self._all("SELECT * FROM reviews WHERE status = ? AND type = ?", (status, type))
        return await self._reviews_from(rows)

    async def save_access_rule(self, rule: AccessRequestRule, *, create: bool) -> None:
        statement = self._insert("access_request_rules", rule) if create else \
            self._update("access_request_rules", rule, skip=("created_at",))
        await self._write([statement])

    async def get_access_rule(self, org_id: str, name: str) -> AccessRequestRule | None:
        row = await self._one("SELECT * FROM access_request_rules WHERE org_id = ? AND (name = ? OR id = ?)",
                              (org_id, name, name))
        return self._build(AccessRequestRule, row) if row else None

    async def list_access_rules(self, org_id: str) -> list[AccessRequestRule]:
        rows = await self._all("SELECT * FROM access_request_rules WHERE org_id = ? ORDER BY name", (org_id,))
        return [self._build(AccessRequestRule, r) for r in rows]

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
        return self._build(AIProvider, row, api_key=key)

    async def save_ai_provider(self, provider: AIProvider) -> None:
        sealed = self.box.seal(provider.api_key.encode(), self._provider_context(provider.org_id))
        await self._write([(
            "INSERT INTO ai_providers (id, org_id, provider, model, api_url, api_key, created_at, updated_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (org_id) DO UPDATE SET provider = excluded.provider, "
            "model = excluded.model, api_url = excluded.api_url, api_key = excluded.api_key, "
            "updated_at = excluded.updated_at",
            (provider.id, provider.org_id, provider.provider, provider.model, provider.api_url, sealed,
             provider.created_at, provider.updated_at))])

    async def delete_ai_provider(self, org_id: str) -> bool:
        if not await self._one("SELECT 1 FROM ai_providers WHERE org_id = ?", (org_id,)):
            return False
        await self._write([("DELETE FROM ai_providers WHERE org_id = ?", (org_id,))])
        return True

    async def save_ai_rule(self, rule: AIAnalyzerRule, *, create: bool) -> None:
        statement = self._insert("ai_analyzer_rules", rule) if create else \
            self._update("ai_analyzer_rules", rule, skip=("created_at",))
        await self._write([statement])

    async def get_ai_rule(self, org_id: str, name: str) -> AIAnalyzerRule | None:
        row = await self._one("SELECT * FROM ai_analyzer_rules WHERE org_id = ? AND (name = ? OR id = ?)",
                              (org_id, name, name))
        return self._build(AIAnalyzerRule, row) if row else None

    async def list_ai_rules(self, org_id: str) -> list[AIAnalyzerRule]:
        rows = await self._all("SELECT * FROM ai_analyzer_rules WHERE org_id = ? ORDER BY name", (org_id,))
        return [self._build(AIAnalyzerRule, r) for r in rows]

    async def delete_ai_rule(self, org_id: str, name: str) -> None:
        await self._write([("DELETE FROM ai_analyzer_rules WHERE org_id = ? AND (name = ? OR id = ?)",
                            (org_id, name, name))])

    # ---------------------------------------------------------------- audit log
    async def append_audit(self, entry: AuditEntry) -> None:
        if self._writer is None:
            raise RuntimeError("store is not open")
        await self._in_writer(self._append_audit_chained, self._writer, entry)

    @classmethod
    def _append_audit_chained(cls, db: sqlite3.Connection, entry: AuditEntry) -> None:
        """In the writer thread: the org's last hash and the insert, in one IMMEDIATE transaction."""
        db.execute("BEGIN IMMEDIATE")
        try:
            row = db.execute("SELECT hash FROM audit_logs WHERE org_id = ? ORDER BY rowid DESC LIMIT 1",
                             (entry.org_id,)).fetchone()
            entry.prev_hash = row[0] if row and row[0] else CHAIN_GENESIS
            stored = {name: _encode(name, getattr(entry, name)) for name in _columns(AuditEntry)}
            entry.hash = audit_hash(entry.prev_hash, stored)  # over the values as they are stored
            db.execute(*cls._insert("audit_logs", entry))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    async def audit_chain(self, org_id: str) -> list[dict[str, Any]]:
        rows = await self._all("SELECT * FROM audit_logs WHERE org_id = ? ORDER BY rowid", (org_id,))
        return [dict(zip(r.keys(), tuple(r))) for r in rows]

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
            f"SELECT * FROM audit_logs WHERE {clause} ORDER BY created_at DESC, rowid DESC LIMIT ? OFFSET ?",
            tuple(params) + (query.page_size, (query.page - 1) * query.page_size))
        return Page(items=[self._build(AuditEntry, r) for r in rows], total=total)

    # ---------------------------------------------------------------- settings and keys
    async def get_setting(self, key: str) -> Any:
        row = await self._one("SELECT value FROM server_settings WHERE key = ?", (key,))
        return json.loads(row[0]) if row else None

    async def put_setting(self, key: str, value: Any) -> None:
        await self._write([(
            "INSERT INTO server_settings (key, value, updated_at) VALUES (?, ?, ?) "
            "ON CONFLICT (key) DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at",
            (key, json.dumps(value), rfc3339(utcnow())))])

    async def get_key(self, name: str) -> bytes | None:
        row = await self._one("SELECT material FROM signing_keys WHERE name = ?", (name,))
        return self.box.open(row[0], name.encode()) if row else None

    async def put_key(self, name: str, material: bytes) -> None:
        await self._write([(
            "INSERT INTO signing_keys (name, material, created_at) VALUES (?, ?, ?) "
            "ON CONFLICT (name) DO UPDATE SET material = excluded.material",
            (name, self.box.seal(material, name.encode()), rfc3339(utcnow())))])

    async def delete_key(self, name: str) -> bool:
        existed = await self._one("SELECT 1 FROM signing_keys WHERE name = ?", (name,)) is not None
        await self._write([("DELETE FROM signing_keys WHERE name = ?", (name,))])
        return existed
