"""What every SQL backend shares: record<->row mapping, the dialect seam and the connection seam.

A backend is three things:

- a ``Dialect``: the few spellings that differ between databases (placeholders, JSON-array
  tests, NULL ordering and collation, bulk insert of session events, schema types, RETURNING,
  the lock that serialises a read-then-write such as the audit chain);
- a ``Connector``: the driver adapter, which runs a read (``fetch``) or drives one write
  transaction (``transact``) and turns a unique violation into ``Conflict``;
- the queries, written once in ``gatewayd.store.queries.SQLStore`` with ``?`` placeholders.

A write transaction is written once as a generator (``Work``): it yields statements and
receives each one's ``Result``; the connector drives it inside one transaction (the SQLite
connector in its writer thread, synchronously; an asyncpg connector with ``await`` per
statement). So the claim, the audit chain's read-then-insert and the migrations carry their
logic to every backend unchanged, sans I/O, the way the codecs do.

The PostgreSQL backend (``gatewayd.store.postgres``) is a ``PostgresDialect`` (``$n``
placeholders via ``render``, ``jsonb_exists_any`` for JSON-array tests, ``COLLATE "C"`` and
explicit NULLS placement in ``sort``, BYTEA/DOUBLE PRECISION and an identity ``row_order``
column in ``ddl``, ``unnest`` in ``event_inserts``,
``pg_advisory_xact_lock`` in ``lock``) and an asyncpg ``Connector`` (a pool; ``transact``
runs the work in ``conn.transaction()``), under ``SQLStore(connector, box)``. Every backend
passes ``tests/test_store_contract.py`` unchanged.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, fields
from typing import Any, Callable, Generator, Iterable, Iterator, Protocol, Sequence, TypeVar

T = TypeVar("T")

# Record fields stored as JSON text.
JSON_FIELDS = frozenset({
    "env_vars", "command", "tags", "settings", "attributes", "input", "output", "metadata",
    "metrics", "labels", "integrations_metadata", "ai_analysis", "request_payload_redacted",
    "force_approval_groups", "time_window", "connection_names", "reviewers_groups", "risk_evaluation",
    "granted_groups", "listeners", "runbooks", "connections", "user_groups",
    "config", "event_types",
})

# A statement: SQL with ``?`` placeholders, and its parameters (a tuple) or rows of them (a list:
# executed once per row).
Statement = tuple[str, Any]


class Row(Protocol):
    """A result row as both drivers give it (sqlite3.Row, asyncpg.Record): by name and by position."""

    def keys(self) -> Any: ...

    def __getitem__(self, key: Any) -> Any: ...


@dataclass(slots=True)
class Result:
    """What one statement of a write transaction gave back: its rows (RETURNING, SELECT) and the rows
    it changed (sqlite3's ``rowcount``; asyncpg's command status, ``UPDATE 3``)."""

    rows: list[Any]
    rowcount: int


# A write transaction: yields statements, is sent each one's Result, returns its answer.
Work = Generator[Statement, Result, T]


class Connector(Protocol):
    """The driver adapter a backend brings (aiosqlite and a writer thread; an asyncpg pool)."""

    dialect: "Dialect"

    async def connect(self) -> None: ...

    async def close(self) -> None: ...

    async def fetch(self, sql: str, params: Sequence[Any] = (), *, slow: bool = False) -> list[Any]:
        """Run a read outside any write transaction; rows as ``Row``. ``slow``: a read that may take long by
        itself (a whole recording), given more time than the store's timeout."""

    async def transact(self, work: Work[T], *, migration: bool = False) -> T:
        """Drive ``work`` inside one write transaction, committed when it returns, rolled back if it raises.

        The transaction completes even if the awaiting task is cancelled (a write is never half
        done); a unique violation is raised as ``Conflict``. ``migration``: a schema migration, which may
        build an index over millions of rows, given far longer than the store's timeout.
        """


class Dialect:
    """The spellings that differ between databases; this base speaks SQLite (and standard SQL).

    Queries are written with ``?`` placeholders and the fragments below; ``render`` turns them
    into the driver's placeholders. No fragment contains a literal ``?`` (PostgreSQL's jsonb
    operators are spelled as functions), so ``render`` may number every ``?`` it sees.
    """

    name = "sqlite"
    returning = True  # UPDATE ... RETURNING (SQLite >= 3.35, PostgreSQL)
    row_order = "rowid"  # a column that grows with insertion order
    clock = "SELECT strftime('%Y-%m-%dT%H:%M:%fZ', 'now')"  # the database's time now, UTC, as RFC 3339 text

    def render(self, sql: str) -> str:
        """The SQL in the driver's placeholder style (``?`` here)."""
        return sql

    def ddl(self, script: str) -> str:
        """A migration script in this database's types (written portable, with BLOB and REAL)."""
        return script

    def sort(self, column: str, descending: bool = False, text: bool = False) -> str:
        """An ORDER BY term ordered the same in every backend: NULLs are the smallest value, and
        text compares by code point (SQLite's BINARY collation)."""
        return f"{column} DESC" if descending else column

    def json_has_any(self, column: str, count: int) -> str:
        """True when the JSON array of text in ``column`` holds any of ``count`` ``?`` values."""
        marks = ", ".join("?" * count)
        return f"EXISTS (SELECT 1 FROM json_each({column}) WHERE json_each.value IN ({marks}))"

    def json_without(self, column: str) -> str:
        """The JSON array of text in ``column`` less the value ``?``."""
        return f"(SELECT json_group_array(value) FROM json_each({column}) WHERE value != ?)"

    def upsert(self, table: str, columns: Sequence[str], key: Sequence[str], update: Sequence[str]) -> str:
        """INSERT of one row that updates ``update`` (or does nothing, when empty) if ``key`` exists."""
        sql = (f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))}) "
               f"ON CONFLICT ({', '.join(key)}) DO ")
        if not update:
            return sql + "NOTHING"
        return sql + "UPDATE SET " + ", ".join(f"{c} = excluded.{c}" for c in update)

    def lock(self, name: str) -> Statement | None:
        """A statement that serialises the transactions taking lock ``name`` (None: every write
        transaction is serialised already, as SQLite's BEGIN IMMEDIATE does)."""
        return None

    def duration_ms(self, start: str, end: str) -> str:
        """Milliseconds from the RFC 3339 text in column ``start`` to the one in ``end``, as an integer."""
        return f"CAST(ROUND((julianday({end}) - julianday({start})) * 86400000) AS INTEGER)"

    def json_int(self, column: str, key: str) -> str:
        """The integer at top-level ``key`` of the JSON text in ``column`` (0 when absent). ``key`` is a
        constant of the caller's, never a value from outside."""
        return f"COALESCE(CAST(json_extract({column}, '$.{key}') AS INTEGER), 0)"

    def search_schema(self) -> list[str]:
        """The statements that make the session text index (``gatewayd.store.search``): FTS5, trigrams."""
        from gatewayd.store.search import SQLITE_SCHEMA

        return SQLITE_SCHEMA

    def search_insert(self, session_id: str, text: str) -> list[Statement]:
        """The statements that index ``text`` as typed in ``session_id``."""
        from gatewayd.store.search import SQLITE_INSERT

        return [(SQLITE_INSERT[0], (session_id,)), (SQLITE_INSERT[1], (text,))]

    def text_matches(self, text: str) -> tuple[str, str]:
        """A query of the session ids whose indexed text holds ``text`` (any case), and its parameter."""
        from gatewayd.store.search import SQLITE_MATCHES, fts_phrase

        return SQLITE_MATCHES, fts_phrase(text)

    def driven_by_text(self, column: str) -> str:
        """``column`` in a condition beside a text search, so that the planner starts from the text index (its
        matches, then the sessions by primary key) rather than scanning an organization's sessions: SQLite's
        unary ``+`` keeps it off an index."""
        return f"+{column}"


_PLACEHOLDER = re.compile(r"\?")


def numbered(sql: str) -> str:
    """``?`` placeholders as ``$1, $2, ...`` (for a PostgreSQL dialect's ``render``)."""
    counter = iter(range(1, 1 << 30))
    return _PLACEHOLDER.sub(lambda _: f"${next(counter)}", sql)


# ---------------------------------------------------------------------------- record <-> row

def encode(name: str, value: Any) -> Any:
    """A field's value as stored."""
    return json.dumps(value) if name in JSON_FIELDS else value


# Most stored JSON values are an empty map or list, or no value (a session's tags, labels, metrics...): these are
# made directly, without the json module's checks and scanner for each (3 us a value, six values a session)
_PLAIN_JSON: dict[Any, Callable[[], Any]] = {"{}": dict, "[]": list, "null": lambda: None}


def loads(text: str | bytes) -> Any:
    """A stored JSON value."""
    make = _PLAIN_JSON.get(text)
    return make() if make is not None else json.loads(text)


def decode(name: str, value: Any) -> Any:
    """A stored value as the field's."""
    if name in JSON_FIELDS and value is not None:
        return loads(value)
    return value


@functools.cache
def columns(cls: Any) -> tuple[str, ...]:
    """The stored columns of a record type: its fields, in order."""
    return tuple(f.name for f in fields(cls))


@functools.cache
def _plan(cls: Any, keys: tuple[str, ...], prefix: str = "") -> tuple[tuple[int, str, bool], ...]:
    """Which row positions fill which fields of ``cls`` (its columns named ``prefix`` + the field), and which are
    JSON: computed once per query shape."""
    wanted = {prefix + name: name for name in columns(cls)}
    return tuple((i, wanted[key], wanted[key] in JSON_FIELDS) for i, key in enumerate(keys) if key in wanted)


@functools.cache
def _maker(cls: Any, keys: tuple[str, ...], prefix: str = "", extra: tuple[str, ...] = ()) -> Callable[..., Any]:
    """The function that makes a ``cls`` from a row of this shape (and ``extra``'s fields, which win over the
    row's): made once per query shape, it reads each position straight into the record's ``__init__``.

    A record is built for every row of every page the API lists (100 sessions a page, 32 fields each), so this is
    on the path of ``GET /api/sessions`` at a million rows: a dict of the fields, then ``cls(**fields)``, took
    8 us a session; the fields passed as they are, in order, 4-5 (bench/README.md, "The API at scale"). The source
    holds only the record's field names (identifiers) and row positions, never a value or a column name read from
    the database."""
    given = {name: (f"row[{i}]" if not is_json else f"(loads(row[{i}]) if row[{i}] is not None else None)")
             for i, name, is_json in _plan(cls, keys, prefix)}
    given.update((name, f"extra[{name!r}]") for name in extra)
    positional: list[str] = []
    keywords: list[str] = []
    for name in columns(cls):  # in order while every field is given; by name after the first one that is not
        if name not in given:
            keywords.append("")
        elif keywords:
            keywords.append(f"{name}={given[name]}")
        else:
            positional.append(given[name])
    keywords += [f"{name}={given[name]}" for name in extra if name not in columns(cls)]  # an init-only argument
    arguments = ", ".join(positional + [word for word in keywords if word])
    namespace: dict[str, Any] = {"cls": cls, "loads": loads}
    exec(f"def make(row, extra):\n    return cls({arguments})", namespace)  # noqa: S102  (see the docstring)
    return namespace["make"]  # type: ignore[no-any-return]


def build(cls: type[T], row: Any, **extra: Any) -> T:
    """A record from a row; columns the record does not have are left out, ``extra`` fills the rest."""
    kind: Any = cls
    return _maker(kind, tuple(row.keys()), "", tuple(extra))(row, extra)  # type: ignore[no-any-return]


def built(cls: type[T], rows: Iterable[Any]) -> list[T]:
    """``build(cls, row)`` for each of ``rows`` (all of one query, so of one shape): the maker looked up once."""
    kind: Any = cls
    make = None
    records = []
    for row in rows:
        if make is None:
            make = _maker(kind, tuple(row.keys()))
        records.append(make(row, None))
    return records


def joined(cls: type[T], rows: Sequence[Any], prefix: str) -> Iterator[T]:
    """The records that ``rows`` hold as columns named ``prefix`` + the field (a LEFT JOIN's, named apart from the
    rows' own), leaving out the rows where the join matched nothing (their ``id`` NULL). One plan for all the rows:
    a page without any such record costs a look at one column a row."""
    if not rows:
        return
    kind: Any = cls
    keys = tuple(rows[0].keys())  # type: ignore[attr-defined]
    key = next(i for i, name, _ in _plan(kind, keys, prefix) if name == "id")
    make = _maker(kind, keys, prefix)
    for row in rows:
        if row[key] is not None:
            yield make(row, None)


def joined_columns(cls: Any, table: str, prefix: str, skip: tuple[str, ...] = ()) -> str:
    """``table``'s columns of a record type (less ``skip``) as a select list named ``prefix`` + the field, for
    ``joined``."""
    return ", ".join(f"{table}.{name} AS {prefix}{name}" for name in columns(cls) if name not in skip)


def insert(table: str, record: Any, skip: tuple[str, ...] = ()) -> Statement:
    """The INSERT of a record's fields (less ``skip``)."""
    names = [n for n in columns(type(record)) if n not in skip]  # type: ignore[arg-type]
    sql = f"INSERT INTO {table} ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})"
    return sql, tuple(encode(n, getattr(record, n)) for n in names)


def update(table: str, record: Any, key: str = "id", skip: tuple[str, ...] = ()) -> Statement:
    """The UPDATE of a record's fields (less ``skip``) by ``key``."""
    names = [n for n in columns(type(record)) if n not in skip and n != key]  # type: ignore[arg-type]
    sql = f"UPDATE {table} SET {', '.join(f'{n} = ?' for n in names)} WHERE {key} = ?"
    return sql, tuple(encode(n, getattr(record, n)) for n in names) + (getattr(record, key),)


def assign(table: str, values: dict[str, Any], where: str, params: Iterable[Any]) -> Statement:
    """``UPDATE table SET <values> WHERE <where>`` with the values encoded."""
    sql = f"UPDATE {table} SET {', '.join(f'{n} = ?' for n in values)} WHERE {where}"
    return sql, tuple(encode(n, v) for n, v in values.items()) + tuple(params)


def in_order(batch: list[Statement]) -> Work[None]:
    """The work of running ``batch`` in order, in one transaction."""
    for statement in batch:
        yield statement
