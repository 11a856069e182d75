"""Which statements may compute a value from a column a rule masks by name (docs/masking.md, PostgreSQL).

A RowDescription gives a column taken from a table its table's OID and column number, which the relay maps to
the names the rules know (catalog.py); a value the query computes -- ``upper(ssn)``, ``ssn::text``, a UNION's
column, a scalar subquery's -- has neither. Such a column is masked whole when its statement names a column a
rule masks, selects a star inside an expression (``t.*``, a subquery's ``*``: not ``count(*)``) or reads a
custom setting (``current_setting('app.v')``: set from data earlier); ``count(*)``, ``now()`` or ``select 1`` of a
statement naming none pass, read by the patterns, and so does what a query of the catalog alone computes (a
driver's type query, which names ``name`` and ``kind``). Text too long to scan on the loop counts as naming one.

A statement's results may also come from SQL the gateway read earlier: ``EXECUTE`` of an SQL ``PREPARE``, and
``FETCH`` of a ``DECLARE``'s cursor. Each name is remembered with what its statement named; a name the gateway
never saw defined (a cursor a function opened, a statement prepared in dynamic SQL) counts as naming one.
A function, an operator or a cast the database defined runs what SQL it likes (``get_ssn(1)`` names nothing), and so
does a built-in that runs SQL or reads a table it is given by name (``query_to_xml``): a statement that calls one
counts as naming a masked column, as does a table's whole row by its bare name (``row_to_json(p)``, ``p::text``).
What is built in is what the target's catalog says (``BuiltIns``, read with the columns: catalog.py); a name it
did not say (a function made since) is the database's.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from pglast import parser as pg_scanner

from gatewayd.sql.pg_scan import MAX_SCAN_CHARS, SCAN_CACHE_CHARS, normalize_sql, string_constant

_SETTINGS = re.compile(r"(?<![\w$])current_setting(?![\w$])|(?:^|;)\s*show\s+[\w$]+\s*\.")
_BUILT_IN = re.compile(r"[a-z_]+")  # a setting PostgreSQL defines: a custom one's name has a dot
# PostgreSQL's catalog tables and views (15's, in ``pg_catalog``) but those that hold data or statements a
# session wrote (statistics' sample values, large objects, settings, other sessions' and cursors' statement text)
CATALOG = frozenset((
    "pg_aggregate", "pg_am", "pg_amop", "pg_amproc", "pg_attrdef", "pg_attribute", "pg_auth_members", "pg_authid",
    "pg_available_extension_versions", "pg_available_extensions", "pg_backend_memory_contexts", "pg_cast",
    "pg_class", "pg_collation", "pg_config", "pg_constraint", "pg_conversion", "pg_database", "pg_default_acl",
    "pg_depend", "pg_description", "pg_enum", "pg_event_trigger", "pg_extension", "pg_foreign_data_wrapper",
    "pg_foreign_server", "pg_foreign_table", "pg_group", "pg_hba_file_rules", "pg_ident_file_mappings", "pg_index",
    "pg_indexes", "pg_inherits", "pg_init_privs", "pg_language", "pg_locks", "pg_matviews", "pg_namespace",
    "pg_opclass", "pg_operator", "pg_opfamily", "pg_parameter_acl", "pg_partitioned_table", "pg_policies",
    "pg_policy", "pg_prepared_xacts", "pg_proc", "pg_publication", "pg_publication_namespace", "pg_publication_rel",
    "pg_publication_tables", "pg_range", "pg_replication_origin", "pg_replication_origin_status",
    "pg_replication_slots", "pg_rewrite", "pg_roles", "pg_rules", "pg_seclabel", "pg_seclabels", "pg_sequence",
    "pg_sequences", "pg_shadow", "pg_shdepend", "pg_shdescription", "pg_shmem_allocations", "pg_shseclabel",
    "pg_stat_all_indexes", "pg_stat_all_tables", "pg_stat_archiver", "pg_stat_bgwriter", "pg_stat_database",
    "pg_stat_database_conflicts", "pg_stat_gssapi", "pg_stat_progress_analyze", "pg_stat_progress_basebackup",
    "pg_stat_progress_cluster", "pg_stat_progress_copy", "pg_stat_progress_create_index", "pg_stat_progress_vacuum",
    "pg_stat_recovery_prefetch", "pg_stat_replication", "pg_stat_replication_slots", "pg_stat_slru", "pg_stat_ssl",
    "pg_stat_subscription", "pg_stat_subscription_stats", "pg_stat_sys_indexes", "pg_stat_sys_tables",
    "pg_stat_user_functions", "pg_stat_user_indexes", "pg_stat_user_tables", "pg_stat_wal", "pg_stat_wal_receiver",
    "pg_stat_xact_all_tables", "pg_stat_xact_sys_tables", "pg_stat_xact_user_functions", "pg_stat_xact_user_tables",
    "pg_statio_all_indexes", "pg_statio_all_sequences", "pg_statio_all_tables", "pg_statio_sys_indexes",
    "pg_statio_sys_sequences", "pg_statio_sys_tables", "pg_statio_user_indexes", "pg_statio_user_sequences",
    "pg_statio_user_tables", "pg_statistic_ext", "pg_subscription", "pg_subscription_rel", "pg_tables",
    "pg_tablespace", "pg_timezone_abbrevs", "pg_timezone_names", "pg_transform", "pg_trigger", "pg_ts_config",
    "pg_ts_config_map", "pg_ts_dict", "pg_ts_parser", "pg_ts_template", "pg_type", "pg_user", "pg_user_mapping",
    "pg_user_mappings", "pg_views",
))
# the functions of PostgreSQL and of its contributed extensions that run SQL they are given (``dblink``'s,
# ``crosstab``), or read a table or a cursor they are given by name
DATA_FUNCTIONS = frozenset((
    "connectby", "crosstab", "crosstab2", "crosstab3", "crosstab4", "cursor_to_xml", "cursor_to_xmlschema",
    "database_to_xml", "database_to_xml_and_xmlschema", "database_to_xmlschema", "dblink", "dblink_exec",
    "dblink_get_result", "dblink_open", "dblink_fetch", "dblink_send_query", "query_to_xml",
    "query_to_xml_and_xmlschema", "query_to_xmlschema", "schema_to_xml", "schema_to_xml_and_xmlschema",
    "schema_to_xmlschema", "table_to_xml", "table_to_xml_and_xmlschema", "table_to_xmlschema", "ts_rewrite",
    "ts_stat", "xpath_table",
))
# ``a BETWEEN b AND c`` names no operator: it runs ``>=`` and ``<=``
_BETWEEN = frozenset(("AEXPR_BETWEEN", "AEXPR_NOT_BETWEEN", "AEXPR_BETWEEN_SYM", "AEXPR_NOT_BETWEEN_SYM"))


@dataclass(frozen=True, slots=True)
class BuiltIns:
    """What a statement may call and compute nothing from a table's column, as the target's catalog says: the
    functions and operators of ``pg_catalog`` and of the extensions an administrator installed (``hstore``'s
    ``=``) that no one defined again under the same name, and the types a cast to runs a function someone
    defined (``CREATE CAST ... WITH FUNCTION``)."""

    functions: frozenset[str]  # as the catalog names them (DATA_FUNCTIONS are read as the database's)
    operators: frozenset[str]
    cast_types: frozenset[str]  # a cast to one of these runs the database's function


# statements that start so (``FETCH FIRST n ROWS`` inside a query is no cursor's)
_DEFINES = re.compile(r"(?:^|;)\s*(prepare|declare)\s+([\w$]+)")
_EXECUTE = re.compile(r"(?:^|;)\s*execute\s+([\w$]+)")
_FETCH = re.compile(r"(?:^|;)\s*(?:fetch|move)(?![\w$])([^;]*)")
_WORD = re.compile(r"[\w$]+")
MAX_NAMES = 1024  # SQL-level names remembered per session (then forgotten: each counts as naming a column)


@functools.lru_cache(maxsize=64)
def _naming(watched: frozenset[str]) -> re.Pattern[str]:
    """A search for any of ``watched`` (lower case) as a word of SQL."""
    words = "|".join(re.escape(name) for name in sorted(watched, key=len, reverse=True))
    return re.compile(f"(?<![\\w$])(?:{words})(?![\\w$])")


def _catalog_only(text: str) -> bool:
    """Whether ``text`` reads only PostgreSQL's catalog (``CATALOG``, ``information_schema``, its own CTEs): a
    driver's or a tool's query about types and tables (asyncpg's names ``name`` and ``kind``), which computes
    nothing from a table's column. A table of the database's, a function in FROM, text that does not parse or
    over ``MAX_SCAN_CHARS`` (not parsed on the loop) make it not so."""
    if len(text) > MAX_SCAN_CHARS or "pg_" not in text and "information_schema" not in text.lower():
        return False
    return _catalog_only_cached(text) if len(text) <= SCAN_CACHE_CHARS else _reads_catalog_only(text)


def _reads_catalog_only(text: str) -> bool:
    try:
        tree = json.loads(pg_scanner.parse_sql_json(text))
    except (pg_scanner.ParseError, UnicodeError, ValueError):
        return False
    relations: list[tuple[str | None, str]] = []
    ctes: set[str] = set()
    if not _walk(tree, relations, ctes):
        return False
    return bool(relations) and all(
        schema == "information_schema" or schema in (None, "pg_catalog") and name in CATALOG
        or schema is None and name in ctes for schema, name in relations)


_catalog_only_cached = functools.lru_cache(maxsize=256)(_reads_catalog_only)


def _nodes(tree: Any) -> Iterator[tuple[str, Any]]:
    """Every (key, value) of a parse tree's JSON (iteratively: a deep expression must not exhaust the stack)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                yield key, value
                if isinstance(value, (dict, list)):
                    stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)


def _walk(node: Any, relations: list[tuple[str | None, str]], ctes: set[str]) -> bool:
    """The relations (schema, name) and CTE names ``node`` names; False at a function in FROM."""
    for key, value in _nodes(node):
        if key == "RangeVar":
            relations.append((value.get("schemaname"), value.get("relname", "")))
        elif key == "CommonTableExpr":
            ctes.add(value.get("ctename", ""))
        elif key in ("RangeFunction", "RangeTableFunc"):
            return False
    return True


MAX_PARSE_CHARS = 8192  # longer text is not parsed on the loop for what it calls: it counts as naming a column


class Later:
    """A statement's answer left until a result of it has a computed column (most have none, and reading what it
    calls parses it: about 0.1 ms a statement): whether it runs what the database defined (``_runs_other``)."""

    __slots__ = ("answer", "builtins", "text")

    def __init__(self, text: str, builtins: BuiltIns) -> None:
        self.text = text
        self.builtins = builtins
        self.answer: bool | None = None

    def __bool__(self) -> bool:
        if self.answer is None:
            self.answer = _runs_other(self.text, self.builtins)
        return self.answer


Answer = bool | Later  # whether a statement may compute a value from a masked column (Later: worked out when asked)


def _runs_other(text: str, builtins: BuiltIns | None) -> bool:
    """Whether ``text`` calls a function or an operator ``builtins`` does not hold, casts to one of its
    ``cast_types``, or names a table's whole row by its bare name; so too when either is not known: text that does
    not parse or over ``MAX_PARSE_CHARS`` (not parsed on the loop), or ``builtins`` not read."""
    if builtins is None or len(text) > MAX_PARSE_CHARS:
        return True
    return (_runs_other_cached(text, builtins) if len(text) <= SCAN_CACHE_CHARS
            else _reads_other(text, builtins))


def _reads_other(text: str, builtins: BuiltIns) -> bool:
    try:
        tree = json.loads(pg_scanner.parse_sql_json(text))
    except (pg_scanner.ParseError, UnicodeError, ValueError):
        return True
    tables: set[str] = set()  # the names and aliases of the relations read
    bare: set[str] = set()  # the one-word column references (``p`` in ``row_to_json(p)``)
    for key, value in _nodes(tree):
        if key == "CallStmt" or key == "FuncCall" and not _built_in(value.get("funcname"), builtins.functions):
            return True  # (a procedure's OUT values come back as a row)
        if key == "A_Expr":
            if value.get("kind") in _BETWEEN:
                if not {">=", "<="} <= builtins.operators:
                    return True
            elif not _built_in(value.get("name"), builtins.operators):
                return True
        elif key == "TypeCast":
            names = _names(value.get("typeName", {}).get("names"))
            if names and names[-1] in builtins.cast_types:
                return True
        elif key == "RangeVar":
            tables.add(value.get("alias", {}).get("aliasname") or value.get("relname", ""))
        elif key == "ColumnRef":
            fields = _names(value.get("fields"))
            if len(fields) == 1:
                bare.add(fields[0])
    return not bare.isdisjoint(tables)


_runs_other_cached = functools.lru_cache(maxsize=256)(_reads_other)


def _names(items: Any) -> list[str]:
    """The words of a parse tree's name list (``[{"String": {"sval": ...}}, ...]``); a star is none."""
    return [item["String"]["sval"] for item in items or () if isinstance(item, dict) and "String" in item]


def _built_in(items: Any, known: frozenset[str]) -> bool:
    """Whether a function's or an operator's name (after its schema, if any) is in ``known`` (each function of
    that name being the catalog's or an extension's, a schema names one of them) and runs no SQL it is given.
    Names as the parser gives them: unquoted ones in lower case, as the catalog holds them."""
    names = _names(items)
    return bool(names) and names[-1] in known and names[-1] not in DATA_FUNCTIONS


def _tokens(text: str) -> list[pg_scanner.Token] | None:
    """``text``'s tokens as PostgreSQL's scanner reads them, comments left out; None when it cannot scan them
    (what reads them then answers as for a statement that names a masked column)."""
    try:
        return [t for t in pg_scanner.scan(text) if t.name not in ("C_COMMENT", "SQL_COMMENT")]
    except (pg_scanner.ParseError, UnicodeError):
        return None


_STAR_AFTER = frozenset(("SELECT", "DISTINCT", "ALL", "RETURNING", "ASCII_44"))


def _inner_star(text: str) -> bool:
    """Whether ``text`` selects a star a computed value may be made of: a qualified one (``row_to_json(p.*)``), or
    one inside parentheses (``array_agg(x) from (select * from people) x``). Not ``count(*)``, and not a star of
    the statement's own select list: its columns keep their sources (asyncpg's ``select distinct *`` over its
    catalog query's CTE)."""
    tokens = _tokens(text) if len(text) <= MAX_SCAN_CHARS else None
    if tokens is None:
        return True
    depth = 0
    previous = ""
    for token in tokens:
        name = token.name
        if name == "ASCII_40":
            depth += 1
        elif name == "ASCII_41":
            depth -= 1
        elif name == "ASCII_42" and (previous == "ASCII_46" or depth > 0 and previous in _STAR_AFTER):
            return True
        previous = name
    return False


def _custom_setting(text: str) -> bool:
    """Whether ``text`` reads a custom setting (``current_setting('app.v')``, ``SHOW app.v``: a variable that may
    have been set from data) or one it does not name plainly; drivers read built-in ones (asyncpg saves ``jit``'s
    value, to restore it after)."""
    tokens = _tokens(text) if len(text) <= MAX_SCAN_CHARS else None
    if tokens is None:
        return True
    for i, token in enumerate(tokens):
        word = text[token.start:token.end + 1].strip('"').lower()
        if word == "show" and i + 2 < len(tokens) and tokens[i + 2].name == "ASCII_46":
            return True
        if word != "current_setting":
            continue
        call = tokens[i + 1:i + 4]
        if (len(call) < 3 or call[0].name != "ASCII_40" or call[1].name != "SCONST"
                or call[2].name not in ("ASCII_41", "ASCII_44")
                or not _BUILT_IN.fullmatch(string_constant(text[call[1].start:call[1].end + 1]).lower())):
            return True
    return False


def _names_one(text: str, normal: str, names: frozenset[str]) -> bool:
    """Whether ``text`` (``normal``: as normalized, in lower case) names a column of ``names``, a star in an
    expression or a custom setting."""
    return (bool(names) and _naming(names).search(normal) is not None and not _catalog_only(text)
            or "*" in text and _inner_star(text)
            or _SETTINGS.search(normal) is not None and _custom_setting(text))


def _computes(text: str, normal: str, names: frozenset[str], builtins: BuiltIns | None) -> bool:
    """Whether what ``text`` (``normal``: as normalized, in lower case) computes may carry a column of ``names``."""
    return _names_one(text, normal, names) or _runs_other(text, builtins)


View = tuple[int, str, dict[str, tuple[int, str, str, dict[str, int]]]]
"""A view (or materialized view) as the catalog gives it: its OID, its definition (``pg_get_viewdef``), and the
relations it reads: their OID, schema, name and columns (name -> number), by OID (as text)."""


def view_sources(views: list[View], sources: dict[tuple[int, int], str], names: Iterable[str],
                 builtins: BuiltIns | None) -> tuple[dict[tuple[int, int], str], set[tuple[int, int]]]:
    """The columns of ``views`` whose values may carry a column of ``sources`` (a view's column has the view as
    its source: ``create view v as select ssn as tax_id from people`` gave ``tax_id`` in clear), each with the name
    of a rule that masks it. A column that is a plain reference to a column of a relation the view reads follows
    it; any other -- computed, or of a view of a UNION, a subquery, a CTE, VALUES -- is masked whole when the
    definition names a masked column, a star in an expression, a custom setting, or a function, operator or cast
    the database defined (as a statement's computed columns are): those are returned apart, masked whole as
    computed values are (never ``last4``: ``left(ssn, 7)`` ends with what ``last4`` hides). Views of views are
    followed, inner first."""
    watched = frozenset(n.lower() for n in names)
    found: dict[tuple[int, int], str] = {}
    computed: set[tuple[int, int]] = set()
    pending = {view[0]: view for view in views}
    while pending:
        ready = [view for view in pending.values() if not any(
            int(oid) in pending and int(oid) != view[0] for oid in view[2])] or list(pending.values())
        for oid, definition, relations in ready:
            del pending[oid]
            columns = _view_columns(oid, definition, relations, {**sources, **found}, computed, watched, builtins)
            found.update((identity, name) for identity, (name, _) in columns.items())
            computed.update(identity for identity, (_, whole) in columns.items() if whole)
    return found, computed


def _view_columns(oid: int, definition: str, relations: dict[str, tuple[int, str, str, dict[str, int]]],
                  sources: dict[tuple[int, int], str], computed: set[tuple[int, int]], watched: frozenset[str],
                  builtins: BuiltIns | None) -> dict[tuple[int, int], tuple[str, bool]]:
    """The columns of view ``oid`` that may carry a masked column: the rule's name, and whether it is computed."""
    own = relations.get(str(oid))
    if own is None:
        return {}
    masked: dict[str, str] = {}  # the masked columns of the relations read, by their names now -> the rule's name
    for relid, _, _, columns in relations.values():
        for column, number in columns.items():
            name = sources.get((relid, number))
            if name is not None and relid != oid:
                masked.setdefault(column.lower(), name)
    style_name = next(iter(sorted(masked.values())), next(iter(sorted(watched)), ""))
    computes = _computes(definition, normalize_sql(definition).lower(), watched | frozenset(masked), builtins)
    plain = _plain_targets(definition) if len(definition) <= MAX_SCAN_CHARS else None
    out: dict[tuple[int, int], tuple[str, bool]] = {}
    for column, number in own[3].items():
        reference = plain[0][number - 1] if plain is not None and number <= len(plain[0]) else None
        if reference is not None and plain is not None:
            relation = _relation(reference, plain[1], relations, oid)
            if relation is not None and reference[-1] in relation[3]:  # not a whole row (``p``)
                name = sources.get((relation[0], relation[3][reference[-1]]))
                if name is not None:
                    out[(oid, number)] = (name, (relation[0], relation[3][reference[-1]]) in computed)
                continue
        if computes:
            out[(oid, number)] = (style_name, True)
    return out


Aliases = dict[str, tuple[str | None, str]]  # a name in FROM (an alias, or the relation's) -> (schema, relation)


def _plain_targets(definition: str) -> tuple[list[tuple[str, ...] | None], Aliases] | None:
    """The select list of a view over tables and joins alone, each item a column reference's words (None where it
    is something else), and its FROM's names; None when the view is a UNION, has a CTE, a subquery or a function
    in FROM, or VALUES."""
    try:
        tree = json.loads(pg_scanner.parse_sql_json(definition))
        select = tree["stmts"][0]["stmt"]["SelectStmt"]
    except (pg_scanner.ParseError, UnicodeError, ValueError, KeyError, IndexError, TypeError):
        return None
    if select.get("op", "SETOP_NONE") != "SETOP_NONE" or "withClause" in select or "valuesLists" in select:
        return None
    aliases: Aliases = {}
    froms = list(select.get("fromClause", ()))
    while froms:
        item = froms.pop()
        if "JoinExpr" in item:
            froms += [item["JoinExpr"]["larg"], item["JoinExpr"]["rarg"]]
        elif "RangeVar" in item:
            table = item["RangeVar"]
            aliases[table.get("alias", {}).get("aliasname") or table.get("relname", "")] = (
                table.get("schemaname"), table.get("relname", ""))
        else:
            return None
    targets: list[tuple[str, ...] | None] = []
    for target in select.get("targetList", ()):
        value = target.get("ResTarget", {}).get("val", {})
        fields = value.get("ColumnRef", {}).get("fields", ()) if isinstance(value, dict) else ()
        words = _names(fields)
        targets.append(tuple(words) if words and len(words) == len(fields) else None)
    return targets, aliases


def _relation(reference: tuple[str, ...], aliases: Aliases,
              relations: dict[str, tuple[int, str, str, dict[str, int]]],
              oid: int) -> tuple[int, str, str, dict[str, int]] | None:
    """The relation a view's column reference reads (``p.ssn``, ``public.people.ssn``, ``ssn``), when exactly one
    of those the view reads is it (pg_get_viewdef qualifies each with its relation's alias or name)."""
    qualifier = reference[:-1]
    schema: str | None
    if len(qualifier) > 2:
        return None
    if len(qualifier) == 2:
        schema, table = qualifier
    elif qualifier:
        schema, table = aliases.get(qualifier[0], (None, qualifier[0]))
    else:
        named = [aliases[name] for name in aliases]
        schema, table = named[0] if len(named) == 1 else (None, "")
    candidates = [r for key, r in relations.items()
                  if int(key) != oid and r[2] == table and (schema is None or r[1] == schema)]
    return candidates[0] if len(candidates) == 1 else None


class Mentions:
    """Per session: whether a statement may compute a value from a column a rule masks by name."""

    __slots__ = ("builtins", "cursors", "prepared", "statements", "watched")

    def __init__(self, builtins: BuiltIns | None = None) -> None:
        self.watched: frozenset[str] = frozenset()  # the names the answers below were worked out for
        self.builtins = builtins  # what the target's catalog says is its own (None: not read, nothing is)
        self.statements: dict[str, Answer] = {}  # the protocol's prepared statements (Parse) -> what they name
        self.prepared: dict[str, bool] = {}  # SQL ``PREPARE`` names -> what their statement named
        self.cursors: dict[str, bool] = {}  # SQL ``DECLARE`` names -> what their statement named

    def read(self, text: str, watched: Iterable[str]) -> Answer:
        """Whether the values ``text`` computes may carry a ``watched`` column's (lower-case names), or ``Later``
        when that depends on what it calls alone; the names it defines (``PREPARE``, ``DECLARE``) are remembered
        with the answer."""
        names = frozenset(watched)
        if names != self.watched:  # the rules changed: what was worked out for others is not known
            self.forget()
            self.watched = names
        normal = normalize_sql(text).lower()
        builtins = self.builtins
        found: Answer = (_names_one(text, normal, names) or builtins is None or len(text) > MAX_PARSE_CHARS
                         or Later(text, builtins))
        defined = [(self.prepared if kind == "prepare" else self.cursors, name)
                   for kind, name in _DEFINES.findall(normal)]
        if defined:  # (what SQL names keeps a plain answer)
            found = bool(found)
            self._define(defined, found)  # first: a FETCH may follow its DECLARE in the same text
        if found is not True and (any(self.prepared.get(name, True) for name in _EXECUTE.findall(normal)) or any(
                self.cursors.get(words[-1], True) if (words := _WORD.findall(rest)) else True
                for rest in _FETCH.findall(normal))):
            found = True
            self._define(defined, found)
        return found

    def learn(self, builtins: BuiltIns | None) -> None:
        """What the target's catalog says is its own, read (again): answers worked out before are forgotten."""
        if builtins != self.builtins:
            self.builtins = builtins
            self.forget()

    def forget(self) -> None:
        self.statements.clear()
        self.prepared.clear()
        self.cursors.clear()

    @staticmethod
    def _define(defined: list[tuple[dict[str, bool], str]], found: bool) -> None:
        for known, name in defined:
            if len(known) >= MAX_NAMES and name not in known:
                known.clear()
            known[name] = known.get(name, False) or found

    def parsed(self, name: str, text: str, watched: Iterable[str]) -> None:
        """A Parse of statement ``name``: what it names, for its Describe."""
        if len(self.statements) >= MAX_NAMES and name not in self.statements:
            self.statements.clear()
        self.statements[name] = self.read(text, watched)

    def statement(self, name: str | None) -> Answer:
        """Whether statement ``name`` names a masked column; one the gateway did not see parsed does."""
        return True if name is None else self.statements.get(name, True)
