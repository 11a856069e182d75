"""Statements as a MySQL server reads them: what the statement rules (``statement_kinds``, ``require_where``) read.

The text is read by the gateway's MySQL scanner first (mysql_scan: comments,
executable comments, quoting under the session's ``sql_mode``), cut into
statements and written in a canonical form; each statement is then parsed by
sqlparser-rs's MySQL grammar (the ``sqloxide`` bindings: a maintained parser,
strict, about ten times faster than sqlglot's -- docs/mysql-proxy.md says how it
was chosen) and its tree mapped onto the shared vocabulary of statement kinds
(pglast's node names, gatewayd.languages): ``DELETE`` is ``DeleteStmt``, ``DROP
DATABASE`` is ``DropdbStmt`` (it counts as ``DropStmt``), ``TRUNCATE`` has the
effect of a ``DELETE`` without ``WHERE``, ``REPLACE`` that of a ``DELETE`` and ``INSERT ... ON DUPLICATE KEY
UPDATE`` that of an ``UPDATE``, both without ``WHERE`` (nothing narrows the rows they meet), ``ALTER
TABLE ... DROP COLUMN`` that of a ``DROP``, MariaDB's ``CREATE OR REPLACE TABLE`` (it drops the table
there is, rows and all) that of a ``DROP`` and ``CREATE OR REPLACE USER`` that of a ``DROP USER``.

What runs later is read too: ``PREPARE s FROM '...'`` and ``EXECUTE IMMEDIATE
'...'`` read their string as SQL (``MAX_DEPTH`` deep); from a variable, they
cannot be read.  What the parser cannot parse (stored programs' bodies,
``LOAD DATA``, ``SELECT ... INTO OUTFILE`` and what else its grammar lacks), and
a statement it parses into a kind the gateway does not map, is
``unreadable``: every statement rule refuses it (fail closed).
"""

from __future__ import annotations

import functools
from typing import Any

from gatewayd.sql import mysql_scan
from gatewayd.sql.mysql_scan import NAME, STRING, VAR, WORD, Server, Token, Unreadable
from gatewayd.languages import ParsedStatement
from gatewayd.sql.pg_statements import FoundNodes

MAX_DEPTH = 3
PARSE_CACHE_SIZE = 4096
CACHE_CHARS = 4096

# sqlparser-rs's statement names -> the shared vocabulary (None: a statement no rule can name: USE, KILL...)
_KINDS: dict[str, str | None] = {
    "Query": "SelectStmt", "Insert": "InsertStmt", "Update": "UpdateStmt", "Delete": "DeleteStmt",
    "Truncate": "TruncateStmt", "CreateTable": "CreateStmt", "CreateView": "ViewStmt", "CreateIndex": "IndexStmt",
    "CreateDatabase": "CreatedbStmt", "CreateSchema": "CreateSchemaStmt", "CreateRole": "CreateRoleStmt",
    "CreateUser": "CreateRoleStmt", "CreateFunction": "CreateFunctionStmt", "CreateProcedure": "CreateFunctionStmt",
    "CreateTrigger": "CreateTrigStmt", "AlterTable": "AlterTableStmt", "AlterView": "ViewStmt",
    "AlterIndex": "AlterTableStmt", "AlterRole": "AlterRoleStmt", "AlterUser": "AlterRoleStmt",
    "RenameTable": "RenameStmt", "Grant": "GrantStmt", "Revoke": "GrantStmt", "Set": "VariableSetStmt",
    "SetVariable": "VariableSetStmt", "SetNames": "VariableSetStmt", "SetNamesDefault": "VariableSetStmt",
    "SetTransaction": "VariableSetStmt", "SetTimeZone": "VariableSetStmt", "SetRole": "VariableSetStmt",
    "Explain": "ExplainStmt", "ExplainTable": "ExplainStmt", "StartTransaction": "TransactionStmt",
    "Commit": "TransactionStmt", "Rollback": "TransactionStmt", "Savepoint": "TransactionStmt",
    "ReleaseSavepoint": "TransactionStmt", "Call": "CallStmt", "Prepare": "PrepareStmt", "Execute": "ExecuteStmt",
    "Deallocate": "DeallocateStmt", "LockTables": "LockStmt", "UnlockTables": "LockStmt", "Analyze": "VacuumStmt",
    "Copy": "CopyStmt", "LoadData": "CopyStmt", "Merge": "MergeStmt", "Comment": "CommentStmt",
    "Use": None, "Kill": None, "Flush": None, "Cache": None, "UNCache": None, "OptimizeTable": "VacuumStmt",
}
# ``CREATE OR REPLACE`` of these drops what there is first (MariaDB): the kind of that drop
_REPLACES = {"CreateTable": ("DropStmt", "CREATE OR REPLACE TABLE"),
             "CreateUser": ("DropRoleStmt", "CREATE OR REPLACE USER")}
_DROP_OBJECTS = {"Database": "DropdbStmt", "Schema": "DropStmt", "User": "DropRoleStmt", "Role": "DropRoleStmt"}
_CANNOT = "a statement the gateway's MySQL parser cannot read"


def statement_kinds() -> tuple[str, ...]:
    """The statement kinds this reading tells apart (of the shared vocabulary): what a rule can deny here."""
    return tuple(sorted({kind for kind in _KINDS.values() if kind} | set(_DROP_OBJECTS.values())
                        | {"DropStmt", "VariableShowStmt", "PrepareStmt", "ExecuteStmt"}))


def _kind(name: str, node: Any) -> str | None:
    if name == "Drop" and isinstance(node, dict):
        return _DROP_OBJECTS.get(str(node.get("object_type")), "DropStmt")
    if name.startswith("Drop"):
        return "DropStmt"
    if name.startswith("Show"):
        return "VariableShowStmt"
    return _KINDS[name]


def _walk(node: Any, found: FoundNodes) -> None:
    """Nested queries (a subquery, ``INSERT ... SELECT``) are SELECTs too."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, value in item.items():
                if key == "Query" and isinstance(value, dict):
                    found.kinds.add("SelectStmt")
                if isinstance(value, (dict, list)):
                    stack.append(value)
        elif isinstance(item, list):
            stack.extend(item)


def _tree(name: str, node: Any, found: FoundNodes) -> None:
    try:
        kind = _kind(name, node)
    except KeyError:
        found.cannot_read(f"a {name} statement (a kind the gateway does not map)")
        return
    if kind is None:
        return
    found.kinds.add(kind)
    if not isinstance(node, dict):
        return
    if node.get("or_replace") and name in _REPLACES:
        found.effects.add(_REPLACES[name])
    if kind in ("DeleteStmt", "UpdateStmt") and node.get("selection") is None:
        found.whole.add((kind, kind))
    elif kind == "TruncateStmt":
        found.whole.add(("DeleteStmt", kind))
    elif kind == "InsertStmt" and (node.get("replace_into") or _keyword(node.get("insert_token")) == "REPLACE"):
        found.effects.add(("DeleteStmt", "REPLACE"))  # of every row it meets: no WHERE can narrow it
        found.whole.add(("DeleteStmt", "REPLACE"))
    elif kind == "InsertStmt" and node.get("on") is not None:  # MySQL's only ON: ON DUPLICATE KEY UPDATE
        found.effects.add(("UpdateStmt", "INSERT ON DUPLICATE KEY UPDATE"))
        found.whole.add(("UpdateStmt", "INSERT ON DUPLICATE KEY UPDATE"))
    elif kind == "AlterTableStmt":
        for operation in node.get("operations") or ():
            if isinstance(operation, dict) and any(key.startswith("Drop") and key != "DropConstraint"
                                                   and key != "DropPrimaryKey" and key != "DropIndex"
                                                   for key in operation):
                found.effects.add(("DropStmt", "AlterTableStmt DROP COLUMN"))
            elif isinstance(operation, dict) and _generated(operation.get("ModifyColumn")
                                                            or operation.get("ChangeColumn")):
                # the column's stored values give way to what the expression computes: every row rewritten
                found.effects.add(("UpdateStmt", _GENERATED))
                found.whole.add(("UpdateStmt", _GENERATED))
    elif kind == "CopyStmt":
        found.effects.add(("InsertStmt", "LOAD DATA"))
    _walk(node, found)


_GENERATED = "AlterTableStmt MODIFY COLUMN ... AS (expression)"


def _generated(column: Any) -> bool:
    """Whether a MODIFY or CHANGE COLUMN makes the column generated (``GENERATED ALWAYS AS (...)``, ``AS (...)``)."""
    options = column.get("options") if isinstance(column, dict) else None
    return any(isinstance(option, dict) and ("Generated" in option or "Generated" in (option.get("option") or {}))
               for option in options or ())


def _keyword(token: Any) -> str:
    try:
        return str(token["token"]["Word"]["keyword"])
    except (KeyError, TypeError):
        return ""


def _upper(token: Token | None) -> str:
    return token.value.upper() if token is not None and token.kind == WORD else ""


def _strings(tokens: list[Token]) -> str | None:
    """The value of adjacent strings (``'a' 'b'`` is ``ab``, an introducer before them allowed); None otherwise."""
    if tokens and tokens[0].kind == WORD and tokens[0].value.startswith("_") or tokens[:1] and \
            _upper(tokens[0]) == "N":
        tokens = tokens[1:]
    if not tokens or any(token.kind != STRING for token in tokens):
        return None
    return "".join(token.value for token in tokens)


def _dynamic(tokens: list[Token], found: FoundNodes, server: Server, depth: int) -> bool:
    """``PREPARE s FROM ...`` and ``EXECUTE IMMEDIATE ...``: their SQL read (True), or nothing to do (False)."""
    first, second = _upper(tokens[0]), _upper(tokens[1]) if len(tokens) > 1 else ""
    if first == "PREPARE" and len(tokens) >= 3 and (tokens[1].kind in (WORD, NAME)) and _upper(tokens[2]) == "FROM":
        found.kinds.add("PrepareStmt")
        rest = tokens[3:]
    elif first == "EXECUTE" and second == "IMMEDIATE":
        found.kinds.add("ExecuteStmt")
        rest = tokens[2:]
        using = next((i for i, token in enumerate(rest) if _upper(token) == "USING"), None)
        if using is not None:
            rest = rest[:using]
    else:
        return False
    sql = _strings(rest)
    if sql is None:
        kind = "a variable" if rest and rest[0].kind == VAR else "an expression"
        found.cannot_read(f"SQL prepared from {kind} (only a constant string can be read)")
        return True
    if depth >= MAX_DEPTH:
        found.cannot_read(f"SQL prepared from a string more than {MAX_DEPTH} levels deep")
        return True
    inner: list[ParsedStatement] = []
    for mode in mysql_scan.quoting_modes(sql):  # lexed by the server under the session's mode when it runs
        parsed = _parse_text(sql, mode, server, depth + 1)
        if parsed is not None:
            inner += parsed
    if not inner:
        found.cannot_read(_CANNOT)
        return True
    for statement in inner:
        found.kinds.update(statement.kinds)
        found.whole.update(statement.whole)
        found.effects.update(statement.effects)
        if statement.unreadable:
            found.cannot_read(statement.unreadable)
    return True


def _statement(tokens: list[Token], server: Server, depth: int) -> ParsedStatement:
    found = FoundNodes()
    if not _dynamic(tokens, found, server, depth):
        trees = _parse_canonical(mysql_scan.canonical(tokens))
        if trees is None:
            found.cannot_read(_CANNOT)
        else:
            for tree in trees:
                if isinstance(tree, dict):
                    for name, node in tree.items():
                        _tree(name, node, found)
                elif isinstance(tree, str):  # a statement without fields (``UNLOCK TABLES``, ``COMMIT``...)
                    _tree(tree, None, found)
    return found.statement()


@functools.lru_cache(maxsize=PARSE_CACHE_SIZE)
def _parse_canonical(text: str) -> tuple[Any, ...] | None:
    import sqloxide

    try:
        return tuple(sqloxide.parse_sql(text, dialect="mysql"))
    except Exception:  # sqloxide raises ValueError (and its own errors) for what it cannot parse
        return None


def _parse_text(text: str, mode: int, server: Server, depth: int = 0) -> tuple[ParsedStatement, ...] | None:
    try:
        found = mysql_scan.readings(text, mode, server)
    except Unreadable:
        return None
    out: list[ParsedStatement] = []
    for tokens in found:
        for statement in mysql_scan.statements(tokens):
            out.append(_statement(statement, server, depth))
    return tuple(out) if out else (ParsedStatement(frozenset()),)


_parse_cached = functools.lru_cache(maxsize=PARSE_CACHE_SIZE)(_parse_text)


def parse_statements(text: str, mode: int = 0, server: Server = mysql_scan.UNKNOWN_SERVER
                     ) -> tuple[ParsedStatement, ...] | None:
    """Each statement of ``text`` as the server reads it (every reading of its executable comments the server's
    version leaves open); None when the scanner cannot read it (the server refuses it too)."""
    if len(text) <= CACHE_CHARS:
        return _parse_cached(text, mode, server)
    return _parse_text(text, mode, server)


def split_statements(text: str, mode: int = 0) -> list[str]:
    """The statements of ``text``, each cut from it (the text whole if it cannot be scanned)."""
    try:
        tokens = mysql_scan.readings(text, mode)[0]
    except Unreadable:
        return [text]
    parts = [text[statement[0].start:statement[-1].end] for statement in mysql_scan.statements(tokens)]
    return parts or [text]
