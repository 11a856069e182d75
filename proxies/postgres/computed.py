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
A stored function's result names nothing: pair a rule by name with patterns.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any, Iterable

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


def _walk(node: Any, relations: list[tuple[str | None, str]], ctes: set[str]) -> bool:
    """The relations (schema, name) and CTE names ``node`` names; False at a function in FROM."""
    stack = [node]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "RangeVar":
                    relations.append((value.get("schemaname"), value.get("relname", "")))
                elif key == "CommonTableExpr":
                    ctes.add(value.get("ctename", ""))
                elif key in ("RangeFunction", "RangeTableFunc"):
                    return False
                stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)
    return True


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


class Mentions:
    """Per session: whether a statement may compute a value from a column a rule masks by name."""

    __slots__ = ("cursors", "prepared", "statements", "watched")

    def __init__(self) -> None:
        self.watched: frozenset[str] = frozenset()  # the names the answers below were worked out for
        self.statements: dict[str, bool] = {}  # the protocol's prepared statements (Parse) -> what they name
        self.prepared: dict[str, bool] = {}  # SQL ``PREPARE`` names -> what their statement named
        self.cursors: dict[str, bool] = {}  # SQL ``DECLARE`` names -> what their statement named

    def read(self, text: str, watched: Iterable[str]) -> bool:
        """Whether the values ``text`` computes may carry a ``watched`` column's (lower-case names); the names it
        defines (``PREPARE``, ``DECLARE``) are remembered with the answer."""
        names = frozenset(watched)
        if names != self.watched:  # the rules changed: what was worked out for others is not known
            self.statements.clear()
            self.prepared.clear()
            self.cursors.clear()
            self.watched = names
        normal = normalize_sql(text).lower()
        found = (bool(names) and _naming(names).search(normal) is not None and not _catalog_only(text)
                 or "*" in text and _inner_star(text)
                 or _SETTINGS.search(normal) is not None and _custom_setting(text))
        defined = [(self.prepared if kind == "prepare" else self.cursors, name)
                   for kind, name in _DEFINES.findall(normal)]
        self._define(defined, found)  # first: a FETCH may follow its DECLARE in the same text
        if not found:
            found = any(self.prepared.get(name, True) for name in _EXECUTE.findall(normal)) or any(
                self.cursors.get(words[-1], True) if (words := _WORD.findall(rest)) else True
                for rest in _FETCH.findall(normal))
            if found:
                self._define(defined, found)
        return found

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

    def statement(self, name: str | None) -> bool:
        """Whether statement ``name`` names a masked column; one the gateway did not see parsed does."""
        return True if name is None else self.statements.get(name, True)
