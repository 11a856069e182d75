"""Statements as PostgreSQL parses them: what the statement rules (``statement_kinds``, ``require_where``) read.

Each statement of a query text is parsed by PostgreSQL's own parser (pglast,
libpg_query) into the statement nodes it holds, nested ones included, and
what runs later from it is read too:

* the bodies of ``DO`` blocks and of functions and procedures in ``LANGUAGE
  sql`` and ``plpgsql`` (PL/pgSQL through PostgreSQL's own PL/pgSQL parser,
  with the function's real signature, so a function that returns something
  or a trigger function is read like any other), under both values of
  ``standard_conforming_strings`` (a body is scanned again each time it runs,
  under the setting of that moment);
* constant strings that read as SQL where they may be run: ``EXECUTE
  'TRUNCATE t'`` in a body, and a function's argument
  (``dblink_exec('...', 'DELETE FROM t')``, a procedure that EXECUTEs its
  argument); a literal elsewhere (``INSERT ... VALUES ('delete from t')``)
  is only data;
* and ``MAX_BODY_DEPTH`` levels of that.

What the parser cannot read is said in ``ParsedStatement.unreadable`` and
refused by every statement rule (fail closed): a body in another language,
``EXECUTE`` of a string built at run time, a body that does not parse, a tree
nested too deeply to walk.  ``effects`` lists what a statement does beyond its
node's name, so a rule denying a kind also denies what has its effect
(docs/guardrails.md, "Statement kinds and their effects").
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from pglast import parser as pg_parser

from gatewayd.languages import ParsedStatement
from gatewayd.sql.pg_escapes import escape_reading, readings_differ

MAX_BODY_DEPTH = 3  # bodies and SQL literals are read this deep
PARSE_CACHE_SIZE = 4096  # parsed statements remembered by text (per process)
CACHE_CHARS = 4096  # ... up to this size
WHERE_STATEMENTS = {"delete": "DeleteStmt", "update": "UpdateStmt"}

# A node that has the effect of another kind: denied with it.
COUNTS_AS = {
    "DropOwnedStmt": "DropStmt", "DropdbStmt": "DropStmt", "DropRoleStmt": "DropStmt",
    "DropTableSpaceStmt": "DropStmt", "DropSubscriptionStmt": "DropStmt", "DropUserMappingStmt": "DropStmt",
    "TruncateStmt": "DeleteStmt",
}
_UPSERT = "InsertStmt ON CONFLICT DO UPDATE"
_RETYPE = "AlterTableStmt ALTER COLUMN TYPE USING"
_MERGE_ACTIONS = {"CMD_DELETE": "DeleteStmt", "CMD_UPDATE": "UpdateStmt", "CMD_INSERT": "InsertStmt"}
_WHERE_NODES = frozenset(WHERE_STATEMENTS.values())
_READ_FURTHER = frozenset(("MergeStmt", "AlterTableStmt", "CopyStmt", "DoStmt", "CreateFunctionStmt"))
# a constant (an A_Const string in pglast's JSON) whose text begins like a statement: the full walk looks at it
_SQL_WORDS = ("abort|alter|analy[sz]e|begin|call|checkpoint|close|cluster|comment|commit|copy|create|deallocate|"
              "declare|delete|discard|do|drop|end|execute|explain|fetch|grant|import|insert|listen|load|lock|merge|"
              "move|notify|prepare|reassign|refresh|reindex|release|reset|revoke|rollback|savepoint|security|"
              "select|set|show|start|table|truncate|unlisten|update|vacuum|values|with")
_SQL_CONSTANT = re.compile(r'"sval":\{"sval":"(?:\\[nrtf]|[ (]|/\*)*(?i:' + _SQL_WORDS + r')\b')
_SQL_TEXT = re.compile(r"(?:\s|\(|/\*.*?\*/|--[^\n]*\n)*(?i:" + _SQL_WORDS + r")\b", re.S)
_ASSIGNMENT = re.compile(r"^[^:=]*?:?=(?!=)", re.S)  # ``target := `` before a PL/pgSQL assignment's expression
_TOO_DEEP = "the statement is nested too deeply for the gateway to read"


@functools.cache
def statement_node_names() -> tuple[str, ...]:
    """pglast's statement node names (``DropStmt``, ``TruncateStmt``...): what a statement_kinds rule may deny."""
    from pglast import ast
    return tuple(sorted(name for name in dir(ast) if name.endswith("Stmt") and isinstance(getattr(ast, name), type)))


class FoundNodes:
    """What the walk of one statement found so far (any dialect's: MySQL's maps its parse through it too)."""

    __slots__ = ("effects", "kinds", "unreadable", "whole")

    def __init__(self) -> None:
        self.kinds: set[str] = set()
        self.whole: set[tuple[str, str]] = set()
        self.effects: set[tuple[str, str]] = set()
        self.unreadable = ""

    def cannot_read(self, why: str) -> None:
        if not self.unreadable:
            self.unreadable = why

    def statement(self) -> ParsedStatement:
        whole = frozenset(self.whole)
        effects = set(self.effects)
        for kind in self.kinds:
            if kind in COUNTS_AS:
                effects.add((COUNTS_AS[kind], kind))
        for kind, node in self.effects:  # the effect of a DROP USER is a DROP's too
            if kind in COUNTS_AS:
                effects.add((COUNTS_AS[kind], node))
        for kind, node in whole:
            if kind == "DeleteStmt":
                effects.add(("TruncateStmt", node if node != "DeleteStmt" else "DeleteStmt without WHERE"))
        kinds = frozenset(self.kinds)
        return ParsedStatement(kinds, frozenset(kind for kind, _ in whole), whole, frozenset(effects),
                               self.unreadable, kinds.union(kind for kind, _ in effects))


def _parse_json(text: str) -> dict[str, Any] | None:
    """pglast's tree of ``text``; None when it does not parse."""
    if "\x00" in text:
        return None
    try:
        return json.loads(pg_parser.parse_sql_json(text))
    except (pg_parser.ParseError, UnicodeError, ValueError):
        return None


def _variants(text: str) -> list[str]:
    """``text`` as the server may scan it when it runs later: under the setting of that moment."""
    if not readings_differ(text):
        return [text]
    other = escape_reading(text)
    return [text] if other is None or other == text else [text, other]


def _walk(root: Any, found: FoundNodes, source: str, depth: int) -> None:
    """Every node under ``root`` (iteratively: a deep expression must not exhaust Python's stack)."""
    stack = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            if isinstance(value, dict):
                if key.endswith("Stmt") and key[0].isupper():
                    _statement_node(key, value, found, source, depth)
                elif (key == "FuncCall" or key == "funccall") and depth < MAX_BODY_DEPTH:  # ``funccall``: CALL's
                    for argument in value.get("args", []):
                        constant = _constant(argument)
                        if constant is not None:
                            _read_constant(constant, found, depth)
                stack.append(value)
            elif isinstance(value, list):
                stack.append(value)


def _statement_node(key: str, value: dict[str, Any], found: FoundNodes, source: str, depth: int) -> None:
    found.kinds.add(key)
    if key in _WHERE_NODES and "whereClause" not in value:
        found.whole.add((key, key))
    elif key == "TruncateStmt":
        found.whole.add(("DeleteStmt", key))
    elif key == "MergeStmt":
        for clause in value.get("mergeWhenClauses", []):
            when = clause.get("MergeWhenClause", {})
            kind = _MERGE_ACTIONS.get(when.get("commandType", ""))
            if kind is not None:
                found.effects.add((kind, key))
                if kind in _WHERE_NODES and "condition" not in when:
                    found.whole.add((kind, key))
    elif key == "InsertStmt" and value.get("onConflictClause", {}).get("action") == "ONCONFLICT_UPDATE":
        found.effects.add(("UpdateStmt", _UPSERT))  # an update of the rows it meets, like MERGE's
        if "whereClause" not in value["onConflictClause"]:
            found.whole.add(("UpdateStmt", _UPSERT))
    elif key == "CopyStmt" and value.get("is_from"):
        found.effects.add(("InsertStmt", "CopyStmt FROM"))
    elif key == "AlterTableStmt":
        for command in value.get("cmds", []):
            change = command.get("AlterTableCmd", {})
            if change.get("subtype") == "AT_DropColumn":
                found.effects.add(("DropStmt", "AlterTableStmt DROP COLUMN"))
            elif change.get("subtype") == "AT_AlterColumnType" and "raw_default" in change.get(
                    "def", {}).get("ColumnDef", {}):  # ``USING expr``: every row's value is written anew
                found.effects.add(("UpdateStmt", _RETYPE))
                found.whole.add(("UpdateStmt", _RETYPE))
    elif key in ("DoStmt", "CreateFunctionStmt"):
        _read_bodies(key, value, found, source, depth)


def _constant(node: Any) -> str | None:
    """The string of a constant argument (``'...'``, ``'...'::text``, ``name => '...'``), or None."""
    while isinstance(node, dict):
        if "A_Const" in node:
            value = node["A_Const"].get("sval")
            return value.get("sval") if isinstance(value, dict) and isinstance(value.get("sval"), str) else None
        inner = node.get("TypeCast") or node.get("NamedArgExpr")
        node = inner.get("arg") if isinstance(inner, dict) else None
    return None


def _read_constant(text: str, found: FoundNodes, depth: int) -> None:
    """A constant string that reads as SQL counts as SQL (it may be run: ``EXECUTE``, ``query_to_xml``...)."""
    if _SQL_TEXT.match(text) is None:
        return
    for variant in _variants(text):
        tree = _parse_json(variant)
        if tree is not None:
            _read_tree(tree, variant, found, depth + 1)


def _read_tree(tree: dict[str, Any], text: str, found: FoundNodes, depth: int) -> None:
    encoded = text.encode("utf-8", "surrogatepass")
    for raw in tree.get("stmts", []):
        _walk(raw.get("stmt", {}), found, _source(raw, encoded), depth)


def _source(raw: dict[str, Any], encoded: bytes) -> str:
    """One statement's text, cut from the query text (UTF-8: libpg_query's locations are byte offsets)."""
    start = raw.get("stmt_location", 0)
    length = raw.get("stmt_len", 0)
    return encoded[start:start + length if length else None].decode("utf-8", "replace")


def _language_and_bodies(node: dict[str, Any]) -> tuple[str | None, list[str]]:
    """A DoStmt's or CreateFunctionStmt's language and body strings."""
    language = None
    bodies: list[str] = []
    for option in node.get("options", []) + node.get("args", []):
        elem = option.get("DefElem", {})
        arg = elem.get("arg", {})
        if elem.get("defname") == "language" and "String" in arg:
            language = arg["String"].get("sval", "").lower()
        elif elem.get("defname") == "as":
            items = arg.get("List", {}).get("items", []) if "List" in arg else [arg]
            bodies += [item["String"]["sval"] for item in items if "String" in item and "sval" in item["String"]]
    return language, bodies


def _read_bodies(key: str, node: dict[str, Any], found: FoundNodes, source: str, depth: int) -> None:
    language, bodies = _language_and_bodies(node)
    if key == "DoStmt":
        language = language or "plpgsql"
    if not bodies:
        return  # BEGIN ATOMIC (its statements are in the tree) or no body
    if depth >= MAX_BODY_DEPTH:
        found.cannot_read(f"bodies nested more than {MAX_BODY_DEPTH} levels deep")
        return
    if language not in ("sql", "plpgsql"):
        found.cannot_read(f"a body in LANGUAGE {language} (statement rules read only sql and plpgsql)")
        return
    for index, body in enumerate(bodies[:1]):  # a C function's second string is its symbol
        for number, variant in enumerate(_variants(body)):
            if language == "sql":
                tree = _parse_json(variant)
                if tree is None:
                    if number == 0:
                        found.cannot_read("a function body that does not parse")
                    continue
                _read_tree(tree, variant, found, depth + 1)
            else:
                function = _plpgsql(key, source, variant)
                if function is None:
                    if number == 0:
                        found.cannot_read("a PL/pgSQL body that does not parse")
                    continue
                _read_plpgsql(function, found, depth + 1)


def _plpgsql(key: str, source: str, body: str) -> Any:
    """PostgreSQL's PL/pgSQL parse of ``body``, in the function of ``source`` (its signature) or as a DO block."""
    try:
        if key == "DoStmt":
            tag = "$gw$"
            while tag in body:
                tag = tag[:-1] + "x$"
            return json.loads(pg_parser.parse_plpgsql_json(f"DO {tag}{body}{tag}"))
        from pglast import parse_sql
        from pglast.ast import DefElem, String
        from pglast.stream import RawStream

        statement: Any = parse_sql(source)[0].stmt  # a CreateFunctionStmt (pglast's nodes are untyped here)
        if statement is None:
            return None
        statement.options = tuple(DefElem(defname="as", arg=(String(sval=body),)) if option.defname == "as"
                                  else option for option in statement.options)
        return json.loads(pg_parser.parse_plpgsql_json(RawStream()(statement)))
    except (pg_parser.ParseError, UnicodeError, ValueError, IndexError, AttributeError, TypeError):
        return None


def _read_plpgsql(function: Any, found: FoundNodes, depth: int) -> None:
    """The SQL a PL/pgSQL function runs: its statements, its expressions, the strings it EXECUTEs."""
    stack: list[tuple[Any, str]] = [(function, "")]
    while stack:
        node, parent = stack.pop()
        if isinstance(node, list):
            stack.extend((item, parent) for item in node)
            continue
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            dynamic = key == "dynquery" or (key == "query" and parent in ("PLpgSQL_stmt_dynexecute",
                                                                           "PLpgSQL_stmt_dynfors"))
            expression = value.get("PLpgSQL_expr") if isinstance(value, dict) else None
            if isinstance(expression, dict) and isinstance(expression.get("query"), str):
                _read_expression(expression["query"], expression.get("parseMode", 0), dynamic, found, depth)
            elif isinstance(value, (dict, list)):
                stack.append((value, key))


def _read_expression(query: str, mode: int, dynamic: bool, found: FoundNodes, depth: int) -> None:
    if mode == 0:  # a statement
        tree = _parse_json(query)
        if tree is None:
            found.cannot_read("a PL/pgSQL statement that does not parse")
        else:
            _read_tree(tree, query, found, depth)
        return
    if mode != 2:  # an assignment: ``target := expression``
        assigned = _ASSIGNMENT.match(query)
        query = query[assigned.end():] if assigned is not None else query
    tree = _parse_json(f"SELECT {query}")
    if tree is None:
        found.cannot_read("a PL/pgSQL expression that does not parse")
        return
    if not dynamic:
        for raw in tree.get("stmts", []):  # not the SELECT around it: only what it holds
            _walk(raw["stmt"]["SelectStmt"].get("targetList", []), found, query, depth)
        return
    strings = _constant_strings(tree)
    if strings is None:
        found.cannot_read("EXECUTE of a string built at run time")
        return
    for variant in _variants("".join(strings)):
        executed = _parse_json(variant)
        if executed is not None:
            _read_tree(executed, variant, found, depth + 1)


def _constant_strings(tree: dict[str, Any]) -> list[str] | None:
    """The pieces of ``SELECT 'a' || 'b'`` (constant strings joined by ``||``); None for anything else."""
    try:
        target = tree["stmts"][0]["stmt"]["SelectStmt"]["targetList"]
        if len(tree["stmts"]) != 1 or len(target) != 1:
            return None
        node = target[0]["ResTarget"]["val"]
    except (KeyError, IndexError, TypeError):
        return None
    pieces: list[str] = []
    stack = [node]
    while stack:
        node = stack.pop()
        const = node.get("A_Const") if isinstance(node, dict) else None
        if const is not None and isinstance(const.get("sval"), dict):
            pieces.append(const["sval"].get("sval", ""))
            continue
        expr = node.get("A_Expr") if isinstance(node, dict) else None
        if (expr is not None and expr.get("kind") == "AEXPR_OP"
                and [n.get("String", {}).get("sval") for n in expr.get("name", [])] == ["||"]):
            stack.append(expr["rexpr"])
            stack.append(expr["lexpr"])
            continue
        return None
    return pieces


def _fast(tree_json: str) -> ParsedStatement | None:
    """One statement with nothing to read further (no body, MERGE, COPY, ALTER TABLE, ON CONFLICT DO UPDATE or
    SQL constant): its nodes from the JSON text, the JSON decoded only for a WHERE.  None when it needs the full
    walk."""
    if (tree_json.count('{"stmt":') != 1 or _SQL_CONSTANT.search(tree_json) is not None
            or '"ONCONFLICT_UPDATE"' in tree_json):
        return None
    names = (piece[piece.rfind('"') + 1:] for piece in tree_json.split('Stmt":{')[:-1])
    kinds = frozenset(name + "Stmt" for name in names if name[:1].isupper())  # not a field (``selectStmt``)
    if not kinds.isdisjoint(_READ_FURTHER):
        return None
    found = FoundNodes()
    found.kinds.update(kinds)
    if "TruncateStmt" in kinds:
        found.whole.add(("DeleteStmt", "TruncateStmt"))
    if not kinds.isdisjoint(_WHERE_NODES):
        if len(kinds) == 1 and tree_json.count('Stmt":{') == 1:
            # a lone DELETE/UPDATE (no subquery, CTE or other statement node): the only WHERE is its own
            if '"whereClause":' not in tree_json:
                found.whole.update((kind, kind) for kind in kinds)
        else:
            return None
    return found.statement()


def _parse_statements(text: str) -> tuple[ParsedStatement, ...] | None:
    """Each statement of ``text`` as PostgreSQL's parser reads it; None when it does not parse."""
    if "\x00" in text:
        return None
    try:
        tree_json = pg_parser.parse_sql_json(text)
    except pg_parser.ParseError as exc:
        if "stack depth" in str(exc):
            return (ParsedStatement(frozenset(), unreadable=_TOO_DEEP),)
        return None
    except (UnicodeError, ValueError):
        return None
    fast = _fast(tree_json)
    if fast is not None:
        return (fast,)
    try:
        tree = json.loads(tree_json)
        statements = []
        encoded = text.encode("utf-8", "surrogatepass")
        for raw in tree.get("stmts", []):
            found = FoundNodes()
            _walk(raw.get("stmt", {}), found, _source(raw, encoded), 0)
            statements.append(found.statement())
    except RecursionError:
        return (ParsedStatement(frozenset(), unreadable=_TOO_DEEP),)
    return tuple(statements)


_parse_cached = functools.lru_cache(maxsize=PARSE_CACHE_SIZE)(_parse_statements)


def parse_statements(text: str) -> tuple[ParsedStatement, ...] | None:
    """``_parse_statements``, remembered by text (bounded): a repeated statement costs a dict lookup."""
    if len(text) <= CACHE_CHARS:
        return _parse_cached(text)
    return _parse_statements(text)  # linear in the text, like PostgreSQL's own parse of it


def split_statements(text: str) -> list[str]:
    """The statements of a multi-statement query text, as PostgreSQL splits them (the text whole if it cannot)."""
    try:
        return list(pg_parser.split(text, with_parser=False)) or [text]
    except (pg_parser.ParseError, UnicodeError, ValueError):
        return [text]
