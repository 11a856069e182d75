"""How the guard rails read SQL the way the server will: readings under session settings, held to a real server.

* ``escape_reading`` (gatewayd/sql/pg_escapes.py) against PostgreSQL 15 itself with
  ``standard_conforming_strings = off``: hypothesis writes statements of
  literals with quotes, backslashes, prefixes, comments and continuations; where
  the server accepts one, the gateway's reading has the same statements and the
  same literal values;
* the encodings that are not ASCII-safe, read by their character lengths, against
  a server in SJIS;
* statement rules on what the server runs later (PL/pgSQL bodies of every return
  type, ``EXECUTE``, a function's SQL argument) and on what has the effect of a
  denied kind (gatewayd/sql/pg_statements.py);
* the fast-path allow list's OIDs against the server's catalog.
"""

from __future__ import annotations

import json
import os

import asyncpg
import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pglast import parser as pg

from gatewayd.guardrails import RuleSet
from gatewayd.sql.postgresql import POSTGRESQL
from gatewayd.models import GuardRail
from gatewayd.sql.pg_escapes import escape_reading
from gatewayd.sql.pg_statements import parse_statements
from proxies.postgres.fastpath import FUNCTIONS
from proxies.postgres.reading import _SJIS, CODECS, SessionReading, _structural, codec_known
from tests.pgpeer import unavailable_reason

KINDS = {"type": "statement_kinds", "deny": ["DropStmt", "TruncateStmt"]}
WHERE = {"type": "require_where", "statements": ["delete", "update"]}
INSERTS = {"type": "statement_kinds", "deny": ["InsertStmt", "DeleteStmt"]}


def rules(*input_rules: dict) -> RuleSet:
    return RuleSet([GuardRail(id="g", org_id="o", name="rail", input={"rules": list(input_rules)})], language=POSTGRESQL)


def refused(rule: dict, sql: str) -> str:
    verdict = rules(rule).check_input(sql)
    assert not verdict.allowed, sql
    return verdict.message


# -- standard_conforming_strings = off

@pytest.mark.parametrize("text, reading", [
    ("select 'a\\''; delete from t; --'", "select  E'a\\''; delete from t; --'"),
    ("select E'x\\\\', 'y'", "select E'x\\\\',  E'y'"),
    ("select 'a'\n'b'", "select  E'a'\n'b'"),
    ("select N'a\\'b'", "select E'a\\'b'"),
    ("select $$a\\'$$, 'b'", "select $$a\\'$$,  E'b'"),
    ("select b'01', x'ff'", "select b'01', x'ff'"),
    ("select/*'*/'a\\'b'", "select/*'*/ E'a\\'b'"),
    ('select "a\'b" from t', 'select "a\'b" from t'),
    ("select 1", "select 1"),
])
def test_escape_reading(text: str, reading: str) -> None:
    assert escape_reading(text) == reading


@pytest.mark.parametrize("text", ["select U&'x'", "select 'open", "select 'a' /* open", 'select \'a\', "open',
                                  "select 'a', $$x"])
def test_what_a_server_with_the_setting_off_refuses_has_no_reading(text: str) -> None:
    assert escape_reading(text) is None


@pytest.fixture(scope="module")
async def escaping_server(pg_target):
    conn = await asyncpg.connect(pg_target.dsn(), server_settings={"standard_conforming_strings": "off",
                                                                  "escape_string_warning": "off"})
    yield conn
    await conn.close()


CONTENT = st.lists(st.sampled_from(["a", "\\", "''", "\\'", "\\\\", " ", ";", "--", "\n", "/*", "*/", "$$", "'"]),
                   max_size=6).map("".join)
LITERAL = st.tuples(st.sampled_from(["", "E", "N", "e", "x", "U&"]), CONTENT).map(lambda p: f"{p[0]}'{p[1]}'")
GAP = st.sampled_from([", ", ",", " ", ",\n", ", /* c */ ", ", -- c\n", "\n"])
STATEMENT = st.lists(st.tuples(LITERAL, GAP), min_size=1, max_size=4).map(
    lambda items: "select " + "".join(lit + gap for lit, gap in items).rstrip(", \n"))


def _constants(reading: str) -> list[list[str | None]] | None:
    """Each statement's constants as the gateway reads them (None: it does not parse)."""
    try:
        tree = json.loads(pg.parse_sql_json(reading))
    except pg.ParseError:
        return None
    found = []
    for raw in tree["stmts"]:
        targets = raw["stmt"].get("SelectStmt", {}).get("targetList", [])
        found.append([target["ResTarget"]["val"].get("A_Const", {}).get("sval", {}).get("sval")
                      for target in targets])
    return found


# a longer run (bench/README.md, "Guard-rail readings"): GATEWAYD_FUZZ_EXAMPLES=20000 pytest tests/test_sql_readings.py
FUZZ_EXAMPLES = int(os.environ.get("GATEWAYD_FUZZ_EXAMPLES", "300"))


@pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")
@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=STATEMENT)
async def test_escape_reading_reads_what_the_server_reads(escaping_server, text: str) -> None:
    try:
        statement = await escaping_server.prepare(text)
    except asyncpg.PostgresSyntaxError as exc:
        if "multiple commands" in str(exc):  # the server saw more than one statement: so must the gateway
            reading = escape_reading(text)
            assert reading is not None and len(_constants(reading) or [[]]) > 1, text
        return
    except asyncpg.PostgresError:
        return  # refused (a bit string that is not bits, an escape that is not UTF-8...): nothing runs
    values = list(await statement.fetchrow())
    reading = escape_reading(text)
    assert reading is not None, text
    read = _constants(reading)
    assert read is not None and len(read) == 1, (text, reading)
    assert len(read[0]) == len(values), (text, reading)
    for ours, theirs in zip(read[0], values):
        if ours is not None and isinstance(theirs, str):  # an N'' literal is bpchar: trailing blanks dropped
            assert ours.rstrip(" ") == theirs.rstrip(" "), (text, reading)


# -- client encodings

def test_every_readable_encoding_has_a_python_codec() -> None:
    assert all(codec_known(codec) for codec in CODECS.values())


def test_sjis_character_lengths() -> None:
    raw = "select E'ソ'; delete from t; --'".encode("shift_jis")
    reading = _structural(raw, _SJIS)
    assert reading is not None and reading.startswith("select E'\ufffd'; delete from t")
    assert _structural("select 'é'".encode("utf-8"), _SJIS) is None  # no ASCII byte swallowed: reads as UTF-8


@pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")
async def test_the_server_reads_sjis_by_character_lengths(pg_target) -> None:
    """What the structural reading says an SJIS server sees, a real one sees."""
    raw = "select E'ソ', 'b'".encode("shift_jis")
    async with await psycopg.AsyncConnection.connect(pg_target.dsn(), client_encoding="SJIS") as conn:
        row = await (await conn.execute(raw)).fetchone()
    assert row == ("ソ", "b")
    reading = _structural(raw, _SJIS)
    assert reading is not None and _constants(reading) == [["\ufffd", "b"]]
    assert _constants(raw.decode("utf-8", "replace")) is None  # read as UTF-8, the literal never closes


def test_readings_when_settings_may_have_changed() -> None:
    reading = SessionReading()
    attack = "select 'a\\''; delete from t; --'".encode()
    assert reading.read(attack, certain=True).readings is None  # nothing in flight, the setting is on: one reading
    both = reading.read(attack, certain=False).readings
    assert both is not None and len(both) == 2 and escape_reading(attack.decode()) in both
    sjis = "select E'ソ'; delete from t; --'".encode("shift_jis")
    assert reading.read(sjis, certain=True).refusal == "the statement is not valid UTF8 (client_encoding)"
    reading.observe("client_encoding", "SJIS")
    assert "client_encoding SJIS" in (reading.read(sjis, certain=True).refusal or "")
    assert reading.read(b"select 1", certain=True).refusal is None  # plain ASCII reads the same in any encoding
    reading.observe("client_encoding", "LATIN1")
    assert reading.read("select 'café'".encode("latin-1"), certain=True).text == "select 'café'"


def test_a_refused_reading_blocks_with_the_original_text_in_the_verdict() -> None:
    text = "select 'a\\''; delete from t; --'"
    verdict = rules(WHERE).check_input(text, readings=(text, escape_reading(text) or ""))
    assert not verdict.allowed and verdict.text == text
    assert rules(WHERE).check_input(text).allowed  # the default reading alone: one SELECT


# -- what the server runs later, and what has a denied kind's effect

@pytest.mark.parametrize("sql", [
    "CREATE FUNCTION f() RETURNS int LANGUAGE plpgsql AS $$ BEGIN TRUNCATE t; RETURN 1; END $$",
    "CREATE FUNCTION f() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN TRUNCATE t; RETURN new; END $$",
    "CREATE FUNCTION f(a int) RETURNS SETOF int LANGUAGE plpgsql AS $$ BEGIN a := a + 1; TRUNCATE t; "
    "RETURN NEXT a; END $$",
    "CREATE PROCEDURE p(INOUT n int) LANGUAGE plpgsql AS $$ BEGIN n := 1; DROP INDEX i; END $$",
    "CREATE FUNCTION f() RETURNS int LANGUAGE sql AS 'TRUNCATE t; SELECT 1'",
    "CREATE FUNCTION f() RETURNS int LANGUAGE plpgsql AS $$ BEGIN PERFORM 'a\\''; TRUNCATE t; --';\nRETURN 1; END $$",
    "DO $$ BEGIN EXECUTE 'TRUNCATE t'; END $$",
    "DO $$ BEGIN EXECUTE 'TRUN' || 'CATE t'; END $$",
    "DO $$ BEGIN FOR r IN EXECUTE 'DROP TABLE t' LOOP END LOOP; END $$",
    "SELECT dblink_exec('dbname=shop', 'TRUNCATE t')",
    "CALL run_sql(sql => 'DROP TABLE t')",
    "DROP OWNED BY CURRENT_USER",
    "DROP DATABASE shop WITH (FORCE)",
    "ALTER TABLE t DROP COLUMN a",
    "DELETE FROM t",
    "MERGE INTO t USING u ON true WHEN MATCHED THEN DELETE",
])
def test_statement_kinds_deny_what_runs_later_and_what_has_the_effect(sql: str) -> None:
    refused(KINDS, sql)


def test_the_effect_is_named() -> None:
    assert refused(KINDS, "DROP OWNED BY CURRENT_USER").endswith("statement=DropOwnedStmt (it has the effect of "
                                                                  "DropStmt)")
    assert "statement=TruncateStmt (it has the effect of DeleteStmt)" in refused(INSERTS, "TRUNCATE t")
    assert "statement=CopyStmt FROM (it has the effect of InsertStmt)" in refused(INSERTS, "COPY t FROM STDIN")
    assert "statement=MergeStmt (it has the effect of InsertStmt)" in refused(
        INSERTS, "MERGE INTO t USING u ON t.a = u.a WHEN NOT MATCHED THEN INSERT VALUES (1)")


@pytest.mark.parametrize("sql, says", [
    ("TRUNCATE t", "delete without WHERE (TruncateStmt)"),
    ("MERGE INTO t USING u ON t.a = u.a WHEN MATCHED THEN DELETE", "delete without WHERE (MergeStmt)"),
    ("MERGE INTO t USING u ON t.a = u.a WHEN MATCHED THEN UPDATE SET b = 1", "update without WHERE (MergeStmt)"),
    ("CREATE FUNCTION f() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN DELETE FROM t; RETURN new; END $$",
     "delete without WHERE"),
])
def test_require_where_reads_merge_truncate_and_bodies(sql: str, says: str) -> None:
    assert says in refused(WHERE, sql)


@pytest.mark.parametrize("sql", [
    "MERGE INTO t USING u ON t.a = u.a WHEN MATCHED AND t.b > 1 THEN DELETE",
    "INSERT INTO log VALUES ('delete from t')",
    "SELECT 'truncate t'",
    "CREATE FUNCTION f() RETURNS int LANGUAGE plpgsql AS $$ BEGIN DELETE FROM t WHERE a = 1; RETURN 1; END $$",
    "DO $$ BEGIN RAISE NOTICE 'truncate t'; END $$",
    "CREATE FUNCTION f() RETURNS int LANGUAGE sql BEGIN ATOMIC SELECT 1; END",
])
def test_what_is_only_data_or_qualified_passes(sql: str) -> None:
    assert rules(KINDS, WHERE).check_input(sql).allowed, sql


@pytest.mark.parametrize("sql, says", [
    ("DO $$ DECLARE t text := 't'; BEGIN EXECUTE format('TRUNCATE %I', t); END $$",
     "EXECUTE of a string built at run time"),
    ("CREATE FUNCTION f() RETURNS int LANGUAGE plpython3u AS 'return 1'", "a body in LANGUAGE plpython3u"),
    ("DO LANGUAGE plperl 'print 1'", "a body in LANGUAGE plperl"),
    ("CREATE FUNCTION f() RETURNS int LANGUAGE plpgsql AS $$ BEGIN x := 1; RETURN 1; END $$",
     "a PL/pgSQL body that does not parse"),
    # deep enough for every Python the project runs on (3.12 reads 600 terms whole, 3.13 2,000)
    ("SELECT 1; DELETE FROM t WHERE a = " + " + ".join(["1"] * 5000), "nested too deeply"),
])
def test_what_statement_rules_cannot_read_is_refused(sql: str, says: str) -> None:
    message = refused(KINDS, sql)
    assert says in message and "a statement rule cannot read it" in message


def test_a_deep_expression_without_a_statement_rule_question_is_read() -> None:
    parsed = parse_statements("SELECT " + " + ".join(["1"] * 600))
    assert parsed is not None and parsed[0].kinds == {"SelectStmt"} and not parsed[0].unreadable


# -- the fast path's allow list

@pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")
async def test_fast_path_oids_are_the_servers(pg_target) -> None:
    conn = await asyncpg.connect(pg_target.dsn())
    try:
        rows = await conn.fetch("SELECT proname, oid::int FROM pg_proc WHERE oid = any($1::oid[])",
                                list(FUNCTIONS.values()))
    finally:
        await conn.close()
    assert {row["proname"]: row["oid"] for row in rows} == FUNCTIONS
