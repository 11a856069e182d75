"""The PostgreSQL store (asyncpg): the shared queries on a PostgreSQL dialect and an asyncpg pool.

Several gateways may share one database: every write is one transaction on a pooled connection;
what SQLite gets from its single writer (the audit chain's read-then-insert, the migrations) is
taken here with a transaction-scoped advisory lock, and the claim is one conditional
``UPDATE ... RETURNING`` (see docs/store.md).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import re
from typing import Any, Sequence, TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit

import asyncpg

from gatewayd.crypto import SecretBox
from gatewayd.store.base import Conflict, StoreError, StoreUnavailable
from gatewayd.store.bus import CHANNEL, BusTransport, NotifyBus
from gatewayd.store.queries import SQLStore
from gatewayd.store.search import POSTGRES_INSERT, POSTGRES_MATCHES, POSTGRES_SCHEMA, like_pattern
from gatewayd.store.sql import Dialect, Result, Statement, Work, numbered

T = TypeVar("T")

POOL_SIZE = 10  # connections per process; a transaction holds one only while it runs
TIMEOUT = 4.0  # seconds a query or transaction may take before the store counts as unavailable
SLOW_READ = 15  # times that for a read that may take long by itself (a whole recording)
MIGRATION_TIMEOUT = 3600.0  # seconds a migration may take (an index built over millions of rows)

# What the driver raises when the server is not there to answer (down, shutting down, cut off); a query's own
# failure (a syntax error, a constraint) is not among them.
_UNREACHABLE = (OSError, asyncio.TimeoutError, asyncpg.PostgresConnectionError, asyncpg.InterfaceError,
                asyncpg.CannotConnectNowError, asyncpg.AdminShutdownError, asyncpg.CrashShutdownError)

# The portable migration scripts in PostgreSQL's types (see PostgresDialect.ddl): whole upper-case words,
# as the migrations spell their types (gatewayd/store/migrations.py).
_DDL = (
    (re.compile(r"\bCREATE TABLE (\w+) \("), r"CREATE TABLE \1 (\n    row_order BIGINT GENERATED ALWAYS AS IDENTITY,"),
    (re.compile(r"\bBLOB\b"), "BYTEA"),
    (re.compile(r"\bREAL\b"), "DOUBLE PRECISION"),
    (re.compile(r"\bINTEGER\b"), "BIGINT"),
    (re.compile(r"\bTEXT\b"), 'TEXT COLLATE "C"'),
)
_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&#]*", re.IGNORECASE)
# Statements whose rows are wanted (the others are run for their command status, ``UPDATE 3``).
_ROWS = re.compile(r"^\s*(SELECT|WITH|VALUES)\b|\bRETURNING\b", re.IGNORECASE)


def redact(url: str) -> str:
    """A store URL fit for a log line or an error: the password (``user:password@`` or ``?password=``)
    replaced by ``***``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable store URL>"
    if parts.password is not None:
        netloc = parts.netloc.rpartition("@")
        parts = parts._replace(netloc=f"{netloc[0].partition(':')[0]}:***@{netloc[2]}")
    return _QUERY_PASSWORD.sub(r"\1***", parts.geturl())


def _passwords(url: str) -> set[str]:
    """Every spelling of the URL's passwords."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return set()
    found = {v for k, v in parse_qsl(parts.query) if k.lower() == "password"}  # decoded
    found |= set(re.findall(r"(?:^|&)password=([^&#]*)", parts.query, re.IGNORECASE))  # as written
    if parts.password:
        found |= {parts.password, unquote(parts.password)}
    return {p for p in found if p and p != "***"}


def _scrub(text: str, url: str) -> str:
    """``text`` without the URL's password in any spelling (a driver message may quote the DSN)."""
    if url:
        text = text.replace(url, redact(url))
    for secret in sorted(_passwords(url), key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


@functools.lru_cache(maxsize=4096)
def _render(sql: str) -> str:
    return numbered(sql)


class PostgresDialect(Dialect):
    """PostgreSQL's spellings. Text columns are ``COLLATE "C"`` (code point order and comparison, as
    SQLite's BINARY, whatever the database's locale); JSON stays TEXT (the audit chain hashes the
    stored text, which ``jsonb`` would re-key); every table has an identity ``row_order``."""

    name = "postgres"
    returning = True
    row_order = "row_order"
    clock = "SELECT to_char(clock_timestamp() AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')"

    def render(self, sql: str) -> str:
        return _render(sql)

    def ddl(self, script: str) -> str:
        for pattern, replacement in _DDL:
            script = pattern.sub(replacement, script)
        return script

    def sort(self, column: str, descending: bool = False, text: bool = False) -> str:
        collate = ' COLLATE "C"' if text else ""
        return f"{column}{collate} DESC NULLS LAST" if descending else f"{column}{collate} ASC NULLS FIRST"

    def json_has_any(self, column: str, count: int) -> str:
        marks = ", ".join("?" * count)
        return f"jsonb_exists_any(CAST({column} AS jsonb), ARRAY[{marks}]::text[])"

    def json_without(self, column: str) -> str:
        return (f"(SELECT COALESCE(jsonb_agg(e.value ORDER BY e.n), '[]'::jsonb)::text "
                f"FROM jsonb_array_elements_text(CAST({column} AS jsonb)) WITH ORDINALITY AS e(value, n) "
                "WHERE e.value <> ?)")

    def lock(self, name: str) -> Statement | None:
        key = int.from_bytes(hashlib.sha256(f"gatewayd:{name}".encode()).digest()[:8], "big", signed=True)
        return f"SELECT pg_advisory_xact_lock({key})", ()

    def duration_ms(self, start: str, end: str) -> str:
        return f"CAST(ROUND(EXTRACT(EPOCH FROM (CAST({end} AS timestamptz) - CAST({start} AS timestamptz))) * 1000) " \
               "AS BIGINT)"

    def json_int(self, column: str, key: str) -> str:
        return f"COALESCE(CAST(CAST({column} AS jsonb) ->> '{key}' AS BIGINT), 0)"

    def search_schema(self) -> list[str]:
        return POSTGRES_SCHEMA

    def search_insert(self, session_id: str, text: str) -> list[Statement]:
        return [(POSTGRES_INSERT, (session_id, text))]

    def text_matches(self, text: str) -> tuple[str, str]:
        return POSTGRES_MATCHES, like_pattern(text)

    def driven_by_text(self, column: str) -> str:
        return column  # the planner weighs the trigram index by its statistics


def _rowcount(status: str) -> int:
    """The rows a command changed, from its status (``UPDATE 3``, ``INSERT 0 1``)."""
    last = status.rpartition(" ")[2]
    return int(last) if last.isdigit() else 0


# asyncpg prepares every statement, and after five runs PostgreSQL may keep one generic plan for it, made for
# any value of its parameters. The lists' filters have values of very different reach (a status held by 100 of
# a million sessions or by all the others; one audit entry in ten a failure): a generic plan reads the index
# that suits the average value, and an audit page filtered by outcome went from 8 to 40 ms after its fifth
# run (bench/README.md, "The API at scale"). Planning each run costs a fraction of a millisecond.
PLAN_CACHE_MODE = "force_custom_plan"


async def _nothing_to_reset(connection: asyncpg.Connection) -> None:
    """What a connection given back to the pool needs beyond asyncpg's own rollback of a transaction left open
    (which it makes before this): nothing. The store keeps no state in a session: its locks are its transactions'
    (``pg_advisory_xact_lock``), the bus listens on a connection of its own, it sets nothing and holds no cursor.
    asyncpg's default (``pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL``) was a round trip after
    every read and every transaction, about 95 us of each call's time (bench/README.md, "The API at scale")."""


class AsyncpgConnector:
    """An asyncpg pool: reads on any pooled connection, each write transaction on one.

    Every call answers within ``timeout``: a server that is down, hung (SIGSTOP) or cut off is
    ``StoreUnavailable`` then, not a wait of minutes. The call itself runs on in a task of its own (asyncpg's
    ``command_timeout`` ends it later); a write whose outcome is therefore unknown may still commit, which
    is why the writes that are sent again (recordings, ends, audit entries) are idempotent.
    ``failing_since`` is set from such a failure until the next answer (``Store.reachable``).
    A connection given back is not reset (``_nothing_to_reset``): no statement may leave state in the session
    (a plain ``SET``, ``LISTEN``, a session advisory lock, a cursor WITH HOLD), or the next caller gets it.
    """

    def __init__(self, url: str, dialect: Dialect | None = None, pool_size: int = POOL_SIZE,
                 timeout: float = TIMEOUT) -> None:
        self.url = url
        self.dialect = dialect or PostgresDialect()
        self.pool_size = pool_size
        self.timeout = timeout
        self.failing_since: float | None = None
        self._pool: asyncpg.Pool | None = None
        self._running: set[asyncio.Task[Any]] = set()

    async def connect(self) -> None:
        try:
            # a transaction left open by a link that froze mid-way is ended by the server, not held (with its
            # locks: another node closing the sessions of this one would wait on them) for the whole cut.
            # Every statement is planned for its values (PLAN_CACHE_MODE).
            self._pool = await asyncpg.create_pool(self.url, min_size=1, max_size=self.pool_size, timeout=self.timeout,
                                                   server_settings={"application_name": "gatewayd",
                                                                    "idle_in_transaction_session_timeout":
                                                                        str(int(self.timeout * 2000)),
                                                                    "plan_cache_mode": PLAN_CACHE_MODE},
                                                   reset=_nothing_to_reset)
        except (OSError, asyncio.TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError, ValueError) as exc:
            # from None: the driver's exception may quote the DSN; the message is scrubbed of the password
            raise StoreError(_scrub(f"cannot open the PostgreSQL store {redact(self.url)}: "
                                    f"{type(exc).__name__}: {exc}", self.url)) from None

    async def close(self) -> None:
        if self._running:
            await asyncio.wait(list(self._running), timeout=self.timeout)
        if self._pool is not None:
            pool, self._pool = self._pool, None
            try:
                async with asyncio.timeout(self.timeout):
                    await pool.close()
            except (asyncio.TimeoutError, *_UNREACHABLE):
                pool.terminate()

    def _open_pool(self) -> asyncpg.Pool:
        if self._pool is None:
            raise RuntimeError("store is not open")
        return self._pool

    async def _bounded(self, call: Any, timeout: float | None = None) -> Any:
        """``call`` in a task of its own, awaited for ``timeout`` at most (it is not waited for past that: a
        cancelled asyncpg call can itself wait on the server it lost)."""
        task = asyncio.ensure_future(call)
        self._running.add(task)
        task.add_done_callback(self._finished)
        try:
            async with asyncio.timeout(timeout or self.timeout):
                result = await asyncio.shield(task)
        except asyncio.TimeoutError:
            raise self._unavailable(f"no answer within {timeout or self.timeout:g} s") from None
        except _UNREACHABLE as exc:
            raise self._unavailable(f"{type(exc).__name__}: {exc}") from None
        self.failing_since = None
        return result

    def _unavailable(self, why: str) -> StoreUnavailable:
        if self.failing_since is None:
            self.failing_since = asyncio.get_running_loop().time()
        return StoreUnavailable(_scrub(f"the PostgreSQL store {redact(self.url)} is unavailable ({why})", self.url))

    async def fetch(self, sql: str, params: Sequence[Any] = (), *, slow: bool = False) -> list[Any]:
        return await self._bounded(self._open_pool().fetch(self.dialect.render(sql), *params),
                                   self.timeout * SLOW_READ if slow else self.timeout)

    async def transact(self, work: Work[T], *, migration: bool = False) -> T:
        # a task of its own, shielded: the transaction completes even when the awaiting task is cancelled
        return await self._bounded(self._drive(self._open_pool(), work), MIGRATION_TIMEOUT if migration else None)

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self._running.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a cancelled caller's write that failed is not "never retrieved"

    async def _drive(self, pool: asyncpg.Pool, work: Work[T]) -> T:
        """``work`` inside one READ COMMITTED transaction on one pooled connection."""
        try:
            async with pool.acquire() as conn, conn.transaction():
                result: Result | None = None
                while True:
                    try:
                        sql, params = work.send(result)  # type: ignore[arg-type]
                    except StopIteration as stop:
                        return stop.value
                    result = await self._run(conn, self.dialect.render(sql), params)
        except asyncpg.UniqueViolationError as exc:
            raise Conflict(str(exc)) from None

    @staticmethod
    async def _run(conn: asyncpg.Connection, sql: str, params: Any) -> Result:
        if isinstance(params, list):  # one statement, once per row
            if params:
                await conn.executemany(sql, params)
            return Result([], len(params))
        if _ROWS.search(sql):
            rows = await conn.fetch(sql, *params)
            return Result(rows, len(rows))
        return Result([], _rowcount(await conn.execute(sql, *params)))


class PostgresStore(SQLStore):
    """Store backed by a PostgreSQL database (several gateways may share it)."""

    def __init__(self, url: str, box: SecretBox, timeout: float = TIMEOUT) -> None:
        super().__init__(AsyncpgConnector(url, timeout=timeout), box)
        self.url = url

    def bus(self) -> BusTransport:
        """LISTEN/NOTIFY: every node hears a change at once, without polling a table."""
        return NotifyBus(self.url, lambda message: self.db.fetch("SELECT pg_notify(?, ?)", (CHANNEL, message)))
