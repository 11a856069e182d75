"""What the target's catalog tells the masker: where the columns a rule names are, and what its types are.

A RowDescription names each result column as the query spelled it (``select email as e``), but
for a column taken from a table it also carries the table's OID and the column's number, which
PostgreSQL follows through aliases, subqueries and CTEs. One query on a connection of its own,
when a session under mask rules starts, maps those (table OID, column number) pairs to the names
the rules know; the relay then masks a column by its source as well as by its name. What a query
computes (``lower(email)``) has no source column: it is masked whole when its statement names a masked column
or runs what the database defined (computed.py: ``BUILTINS_QUERY`` says what is built in); a view's column has the
view as its source: ``VIEWS_QUERY`` reads the views over a masked column, for computed.view_sources.

A column keeps its (table OID, column number) when it is renamed: the pairs found are remembered
per connection and database (``SessionPipeline.remember``), and the next sessions look them up
by that identity as well as by name, so ``ALTER TABLE ... RENAME COLUMN ssn TO s`` does not turn
the rule off.

The same query reads the database's own types (``TYPES_QUERY``): a binary value of a domain, a
range, a composite or an enum is known by its type OID only through the catalog
(proxies/postgres/values.py); and, under rules by column name, the types whose values hold a rule's
column (``HOLDERS_QUERY``): ``select p from people p`` has one column, of the table's row type, which
names no column and has no source, yet holds ``ssn``.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Iterable

from gatewayd.dialer import Dialer
from proxies.postgres.computed import BuiltIns, View, view_sources
from proxies.postgres.codec import CommandComplete, DataRow, ErrorResponse, ReadyForQuery, decode_backend, encode_query
from proxies.postgres.upstream import TargetSettings, UpstreamError, connect_target, terminate
from proxies.postgres.values import TypeShapes

Sources = dict[tuple[int, int], str]  # (table OID, column number) -> the lower-case column name a rule names
Holders = dict[int, tuple[tuple[int, int], ...]]  # type OID -> the (table OID, column number) its values hold
Column = tuple[int, int, str]  # (table OID, column number, the name a rule knows it by)
MEMORY_TOPIC = "postgres.masked-columns"  # what ``SessionPipeline.remember`` keeps: {database: [Column, ...]}
MAX_REMEMBERED = 10_000  # columns remembered per connection and database (the oldest are forgotten first)

# the database's types the built-in ones do not cover (values.TypeShapes.from_catalog): table row types, domains,
# enums, ranges, multiranges, and every type and array type a database made (OIDs from 10000 on are made by initdb
# or later); ``{multirange}`` is empty before PostgreSQL 14 (no multiranges)
TYPES_QUERY = (
    "SELECT t.oid::int8, t.typtype::text, t.typbasetype::int8, coalesce(r.rngsubtype, 0)::int8, {multirange}, "
    "p.prosrc FROM pg_catalog.pg_type t "
    "LEFT JOIN pg_catalog.pg_range r ON r.rngtypid = t.oid "
    "LEFT JOIN pg_catalog.pg_proc p ON p.oid = t.typsend AND p.prolang = 12 "  # an internal send function
    "WHERE t.oid >= 10000 OR t.typtype IN ('c', 'd', 'e', 'r', 'm')")
_MULTIRANGE_14 = "coalesce((SELECT m.rngtypid FROM pg_catalog.pg_range m WHERE m.rngmultitypid = t.oid), 0)::int8"

# the types whose values hold a column the rules name, each with the (table OID, column number) it holds: the row
# type of its table (view, composite type), then to any depth every array, domain, range, multirange and row type
# over one (``{where}``: ``_where``'s, over pg_attribute; ``{multirange}`` empty before PostgreSQL 14)
HOLDERS_QUERY = (
    "WITH RECURSIVE edges(outside, inside) AS {materialized}("
    "SELECT t.oid, t.typelem FROM pg_catalog.pg_type t WHERE t.typelem <> 0 AND t.typlen = -1 "  # arrays
    "UNION ALL SELECT t.oid, t.typbasetype FROM pg_catalog.pg_type t WHERE t.typtype = 'd' "
    "UNION ALL SELECT r.rngtypid, r.rngsubtype FROM pg_catalog.pg_range r {multirange}"
    "UNION ALL SELECT c.reltype, a.atttypid FROM pg_catalog.pg_attribute a "
    "JOIN pg_catalog.pg_class c ON c.oid = a.attrelid WHERE c.reltype <> 0 AND a.attnum > 0 AND NOT a.attisdropped), "
    "held(holder, relid, attnum) AS ("
    "SELECT c.reltype, attrelid, attnum FROM pg_catalog.pg_attribute JOIN pg_catalog.pg_class c ON c.oid = attrelid "
    "WHERE c.reltype <> 0 AND attnum > 0 AND NOT attisdropped AND {where} "
    "UNION SELECT e.outside, h.relid, h.attnum FROM held h JOIN edges e ON e.inside = h.holder) "
    "SELECT holder::int8, relid::int8, attnum::int8 FROM held")
_MULTIRANGE_EDGE_14 = "UNION ALL SELECT r.rngmultitypid, r.rngtypid FROM pg_catalog.pg_range r "

# under rules by column name, what a statement may call and compute nothing from a column (computed.BuiltIns): the
# functions and operators of the catalog or of an extension (an administrator's) that no one defined again under
# the same name, and the types a cast to runs a function someone defined
BUILTINS_QUERY = (
    "WITH installed AS (SELECT classid, objid FROM pg_catalog.pg_depend WHERE deptype = 'e') "
    "SELECT 'f'::text, p.proname::text FROM pg_catalog.pg_proc p LEFT JOIN installed e "
    "ON e.classid = 'pg_catalog.pg_proc'::regclass AND e.objid = p.oid GROUP BY p.proname "
    "HAVING bool_and(p.pronamespace IN ('pg_catalog'::regnamespace, 'information_schema'::regnamespace) "
    "OR e.objid IS NOT NULL) "
    "UNION ALL SELECT 'o', o.oprname::text FROM pg_catalog.pg_operator o LEFT JOIN installed e "
    "ON e.classid = 'pg_catalog.pg_operator'::regclass AND e.objid = o.oid GROUP BY o.oprname "
    "HAVING bool_and(o.oprnamespace = 'pg_catalog'::regnamespace OR e.objid IS NOT NULL) "
    "UNION ALL SELECT 'c', t.typname::text FROM pg_catalog.pg_cast c "
    "JOIN pg_catalog.pg_proc p ON p.oid = c.castfunc JOIN pg_catalog.pg_type t ON t.oid = c.casttarget "
    "LEFT JOIN installed e ON e.classid = 'pg_catalog.pg_cast'::regclass AND e.objid = c.oid "
    "WHERE p.pronamespace <> 'pg_catalog'::regnamespace AND e.objid IS NULL")

# the views and materialized views that read, to any depth, a relation with a column the rules name (``{where}``):
# each with its definition and the relations it reads (OID -> [OID, schema, name, {column: number}]), for
# computed.view_sources
VIEWS_QUERY = (
    "WITH RECURSIVE marked(relid) AS ("
    "SELECT attrelid FROM pg_catalog.pg_attribute WHERE attnum > 0 AND NOT attisdropped AND {where} "
    "UNION SELECT r.ev_class FROM marked m JOIN pg_catalog.pg_depend d ON d.refobjid = m.relid "
    "AND d.refclassid = 'pg_catalog.pg_class'::regclass AND d.classid = 'pg_catalog.pg_rewrite'::regclass "
    "JOIN pg_catalog.pg_rewrite r ON r.oid = d.objid) "
    "SELECT v.oid::int8, pg_catalog.pg_get_viewdef(v.oid), (SELECT pg_catalog.json_object_agg(c.oid::text, "
    "pg_catalog.json_build_array(c.oid::int8, n.nspname::text, c.relname::text, coalesce((SELECT "
    "pg_catalog.json_object_agg(a.attname::text, a.attnum::int8) FROM pg_catalog.pg_attribute a "
    "WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped), '{{}}'::json))) "
    "FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
    "WHERE c.oid = v.oid OR c.oid IN (SELECT d.refobjid FROM pg_catalog.pg_rewrite r "
    "JOIN pg_catalog.pg_depend d ON d.objid = r.oid AND d.classid = 'pg_catalog.pg_rewrite'::regclass "
    "AND d.refclassid = 'pg_catalog.pg_class'::regclass WHERE r.ev_class = v.oid)) "
    "FROM (SELECT DISTINCT relid FROM marked) m JOIN pg_catalog.pg_class v ON v.oid = m.relid "
    "AND v.relkind IN ('v', 'm')")


@dataclass(slots=True)
class Catalog:
    """What one look at the catalog found: the rules' columns (``sources``) and the types (``shapes``)."""

    sources: Sources = field(default_factory=dict)
    shapes: TypeShapes | None = None  # None: not asked
    holders: Holders = field(default_factory=dict)  # the types whose values hold a column of ``sources``
    views: Sources = field(default_factory=dict)  # views' columns that may carry one of ``sources`` (not remembered)
    computed: frozenset[tuple[int, int]] = frozenset()  # those of ``views`` a view computes: masked whole
    newest: int = 0  # the greatest relation OID then (0: not asked): a relation made since is not known
    builtins: BuiltIns | None = None  # what a statement may call, under rules by column name (None: not asked)


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _where(names: Iterable[str], remembered: Iterable[Column]) -> str:
    """The pg_attribute rows of ``names`` (lower case) and the ``remembered`` columns (by identity)."""
    literals = ", ".join(_literal(name) for name in sorted(set(names)))
    where = f"lower(attname::text) IN ({literals})"
    pairs = sorted({(relid, attnum) for relid, attnum, _ in remembered})
    if pairs:
        values = ", ".join(f"({int(relid)}::oid, {int(attnum)}::int2)" for relid, attnum in pairs)
        where = f"({where} OR (attrelid, attnum) IN (VALUES {values}))"
    return where


def sources_query(names: Iterable[str], remembered: Iterable[Column] = ()) -> str:
    """The catalog query for ``names`` (lower case) and the ``remembered`` columns (by identity)."""
    return ("SELECT attrelid::oid::int8, attnum::int8, lower(attname::text) FROM pg_catalog.pg_attribute "
            f"WHERE attnum > 0 AND NOT attisdropped AND {_where(names, remembered)}")


def holders_query(names: Iterable[str], remembered: Iterable[Column], major: int) -> str:
    """``HOLDERS_QUERY`` for those columns, on a server of that major version."""
    return HOLDERS_QUERY.format(materialized="MATERIALIZED " if major >= 12 else "",
                                multirange=_MULTIRANGE_EDGE_14 if major >= 14 else "",
                                where=_where(names, remembered))


_SOURCES, _HOLDERS, _TYPES, _BUILTINS, _VIEWS, _NEWEST = range(6)  # what a statement of the catalog query reads
# the newest relation the catalog holds: one made after has a greater OID (the counter only grows, until it wraps)
NEWEST_QUERY = "SELECT max(oid)::int8 FROM pg_catalog.pg_class"


def _major_version(startup_frames: list[bytes]) -> int:
    for frame in startup_frames:
        message = decode_backend(frame)
        if getattr(message, "name", None) == "server_version":
            try:
                return int(message.value.split(".")[0].split()[0])  # type: ignore[attr-defined]
            except ValueError:
                return 0
    return 0


async def read_catalog(settings: TargetSettings, name: str, dialer: Dialer, names: Iterable[str],
                       remembered: Iterable[Column] = (), types: bool = True) -> Catalog:
    """Every column of the target's database named one of ``names`` or ``remembered`` (by identity) still
    there, by (table OID, column number), under the name the rule knows; and its types when ``types``.

    Raises UpstreamError when the target cannot be asked (the relay then fails closed).
    """
    names = {n.lower() for n in names}
    known = {(relid, attnum): column for relid, attnum, column in remembered if column in names}
    link = await connect_target(settings, {"application_name": "gatewayd-catalog"}, name, dialer=dialer)
    found = Catalog()
    major = _major_version(link.startup_frames)
    queries: list[str] = []
    kinds: list[int] = []  # what each statement's rows are
    if names:
        columns = [(r, a, c) for (r, a), c in known.items()]
        queries += [sources_query(names, columns), holders_query(names, columns, major), BUILTINS_QUERY,
                    VIEWS_QUERY.format(where=_where(names, columns)), NEWEST_QUERY]
        kinds += [_SOURCES, _HOLDERS, _BUILTINS, _VIEWS, _NEWEST]
    if types:
        queries.append(TYPES_QUERY.format(multirange=_MULTIRANGE_14 if major >= 14 else "0::int8"))
        kinds.append(_TYPES)
    if not queries:
        terminate(link)
        return found
    type_rows: list[tuple[int, str, int, int, int, str | None]] = []
    holders: dict[int, list[tuple[int, int]]] = {}
    builtins: dict[bytes, set[str]] = {b"f": set(), b"o": set(), b"c": set()}
    views: list[View] = []
    try:
        link.stream.write(encode_query("; ".join(queries)))
        error: str | None = None
        which = 0  # the statement whose rows arrive
        while True:
            message = await link.stream.next_message()
            if message is None:
                raise UpstreamError(f'the target of connection "{name}" closed the catalog query')
            if isinstance(message, DataRow):
                values = message.columns
                kind = kinds[which] if which < len(kinds) else -1
                if kind == _SOURCES:
                    relid, attnum, column = values
                    if relid is not None and attnum is not None and column is not None:
                        key = (int(relid), int(attnum))
                        current = column.decode()
                        found.sources[key] = current if current in names else known.get(key, current)
                elif kind == _HOLDERS:
                    if None not in values:
                        holder, relid, attnum = values
                        holders.setdefault(int(holder), []).append((int(relid), int(attnum)))  # type: ignore[arg-type]
                elif kind == _BUILTINS and None not in values:
                    builtins[values[0]].add(values[1].decode())  # type: ignore[index, union-attr]
                elif kind == _VIEWS and None not in values:
                    view, definition, relations = values
                    views.append((int(view), definition.decode(),  # type: ignore[arg-type, union-attr]
                                  json.loads(relations)))  # type: ignore[arg-type]
                elif kind == _NEWEST and values[0] is not None:
                    found.newest = int(values[0])
                elif kind == _TYPES and None not in values[:5]:
                    oid, typtype, base, subtype, range_type, send = values
                    type_rows.append((int(oid), typtype.decode(), int(base), int(subtype),  # type: ignore[union-attr]
                                      int(range_type), None if send is None else send.decode()))  # type: ignore[arg-type]
            elif isinstance(message, CommandComplete):
                which += 1
            elif isinstance(message, ErrorResponse):
                error = message.message
            elif isinstance(message, ReadyForQuery):
                break
        if error is not None:
            raise UpstreamError(f'the target of connection "{name}" refused the catalog query: {error}')
        if types:
            found.shapes = TypeShapes.from_catalog(type_rows)
        found.holders = {holder: tuple(pairs) for holder, pairs in holders.items()}
        if names:
            found.builtins = BuiltIns(frozenset(builtins[b"f"]), frozenset(builtins[b"o"]), frozenset(builtins[b"c"]))
            if views:  # each definition parsed: off the loop
                found.views, computed = await asyncio.to_thread(view_sources, views, found.sources, names,
                                                                found.builtins)
                found.computed = frozenset(computed)
        return found
    finally:
        terminate(link)


def merged(remembered: Iterable[Column], sources: Sources, limit: int = MAX_REMEMBERED) -> list[Column] | None:
    """``remembered`` with the columns of ``sources`` it lacks (the newest last, at most ``limit``); None when
    nothing is new."""
    kept = {(relid, attnum): column for relid, attnum, column in remembered}
    new = [(relid, attnum, column) for (relid, attnum), column in sources.items() if kept.get((relid, attnum)) != column]
    if not new:
        return None
    for relid, attnum, column in new:
        kept.pop((relid, attnum), None)
        kept[(relid, attnum)] = column
    return [(relid, attnum, column) for (relid, attnum), column in kept.items()][-limit:]
