"""The MySQL dialect (gatewayd/sql/mysql*.py): its scanner held to a real MariaDB, its statement kinds, its secrets.

The differential tests run a text on the server under a ``sql_mode``, and the
canonical text the gateway's scanner makes of it under the default mode: the
server must answer both the same way (the same result sets, or an error for
both).  What the gateway reads is then what the server runs.
"""

from __future__ import annotations

from typing import Any

import pymysql
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gatewayd.guardrails import RuleSet
from gatewayd.models import GuardRail
from gatewayd.sql import mysql_scan
from gatewayd.sql.mysql import MYSQL, MYSQL_DIALECT
from gatewayd.sql.mysql_scan import ANSI_QUOTES, MODES, NO_BACKSLASH_ESCAPES, Server, Unreadable
from proxies.mysql.reading import SessionReading, mode_of

MARIADB = Server("mariadb", 101119)
SQL_MODES = {0: "", ANSI_QUOTES: "ANSI_QUOTES", NO_BACKSLASH_ESCAPES: "NO_BACKSLASH_ESCAPES",
             ANSI_QUOTES | NO_BACKSLASH_ESCAPES: "ANSI_QUOTES,NO_BACKSLASH_ESCAPES"}


def kinds(text: str) -> list[set[str]]:
    parsed = MYSQL_DIALECT.parse(text)
    assert parsed is not None
    return [set(statement.counts_as) for statement in parsed]


# --------------------------------------------------------------------------- the scanner alone


@pytest.mark.parametrize("text, server, expected", [
    ("SELECT 1 /*!50000 +1 */", MARIADB, ["SELECT 1 +1"]),
    ("SELECT 1 /*!999999 +1 */", MARIADB, ["SELECT 1"]),
    ("SELECT 1 /*!100000 +1 */", MARIADB, ["SELECT 1 +1"]),  # MariaDB reads six digits
    ("SELECT 1 /*M!100000 +1 */", MARIADB, ["SELECT 1 +1"]),
    ("SELECT 1 /*M!100000 +1 */", Server("mysql", 80036), ["SELECT 1"]),  # MySQL: a plain comment
    ("SELECT 1 /*!50000 +1 */", Server(), ["SELECT 1 +1", "SELECT 1"]),  # no version known: both readings
    ("SELECT 1 /*! /* x */ +1 */", MARIADB, ["SELECT 1 +1"]),
    ("SELECT 1 /*!50000 '*/' */", MARIADB, ["SELECT 1 '*/'"]),  # a string in code: its */ is text
])
def test_executable_comments_read_by_the_servers_version(text: str, server: Server, expected: list[str]) -> None:
    assert [mysql_scan.canonical(tokens) for tokens in mysql_scan.readings(text, 0, server)] == expected


def test_what_the_server_refuses_the_scanner_refuses() -> None:
    for text in ("SELECT 'open", "SELECT 1 /* open", "SELECT 1 /*!50000 open", "SELECT 1 /*! /*! x */ */"):
        with pytest.raises(Unreadable):
            mysql_scan.readings(text, 0, MARIADB)
    with pytest.raises(Unreadable):  # six digits: MySQL and MariaDB differ, and the server is not known
        mysql_scan.readings("SELECT 1 /*!100000 +1 */", 0, Server())


def test_sql_mode_changes_where_strings_end() -> None:
    attack = "SELECT 'a\\'; DROP TABLE t; -- '"
    assert len(mysql_scan.statements(mysql_scan.scan(attack, 0)[0])) == 1
    assert len(mysql_scan.statements(mysql_scan.scan(attack, NO_BACKSLASH_ESCAPES)[0])) == 2
    assert mode_of("REAL_AS_FLOAT,PIPES_AS_CONCAT,ANSI_QUOTES,IGNORE_SPACE,ANSI") == ANSI_QUOTES
    assert mode_of("NO_BACKSLASH_ESCAPES,STRICT_TRANS_TABLES") == NO_BACKSLASH_ESCAPES


def test_deny_words_read_values_and_executable_code() -> None:
    assert MYSQL_DIALECT.normalize("/*!50000 DROP */ TABLE t") == "DROP TABLE t TABLE t"  # both readings
    assert MYSQL_DIALECT.normalize("SELECT `dr``op`, \"x\" -- c\n") == "SELECT dr`op, x"
    assert "drop table" in MYSQL_DIALECT.normalize("PREPARE s FROM 'drop /**/ table t'").lower()


def test_statement_kinds_map_onto_the_shared_vocabulary() -> None:
    assert kinds("DROP DATABASE d") == [{"DropdbStmt", "DropStmt"}]
    assert kinds("DELETE FROM t") == [{"DeleteStmt", "TruncateStmt"}]
    assert kinds("TRUNCATE t") == [{"TruncateStmt", "DeleteStmt"}]
    assert kinds("REPLACE INTO t VALUES (1)") == [{"InsertStmt", "DeleteStmt", "TruncateStmt"}]  # no WHERE
    assert kinds("INSERT INTO t VALUES (1) ON DUPLICATE KEY UPDATE a = 0") == [{"InsertStmt", "UpdateStmt"}]
    assert kinds("ALTER TABLE t DROP COLUMN a") == [{"AlterTableStmt", "DropStmt"}]
    assert kinds("SELECT 1; UPDATE t SET a = 1 WHERE b") == [{"SelectStmt"}, {"UpdateStmt"}]
    assert kinds("EXECUTE IMMEDIATE 'DROP TABLE t'") == [{"ExecuteStmt", "DropStmt"}]
    [unreadable] = MYSQL_DIALECT.parse("CREATE TRIGGER tr BEFORE INSERT ON t FOR EACH ROW DELETE FROM u") or ()
    assert unreadable.unreadable  # the parser cannot read it: statement rules refuse it
    [variable] = MYSQL_DIALECT.parse("PREPARE s FROM @sql") or ()
    assert "variable" in variable.unreadable


def test_rules_on_a_mysql_connection_read_its_dialect() -> None:
    rail = GuardRail(id="g", org_id="o", name="g", description="", input={"rules": [
        {"type": "statement_kinds", "deny": ["DropStmt"]},
        {"type": "deny_words_list", "words": ["drop table"]}]}, output={"rules": []})
    rules = RuleSet([rail], language=MYSQL)
    assert not rules.check_input("/*!50000 DROP */ TABLE t").allowed
    assert not rules.check_input("DROP#x\nTABLE t").allowed
    assert rules.check_input("SELECT 'drop', 'table'").allowed


def test_typed_secrets_are_redacted() -> None:
    text = ("CREATE USER u IDENTIFIED BY 'pw1'; SET PASSWORD FOR u = PASSWORD('pw2'); "
            "ALTER USER u IDENTIFIED WITH mysql_native_password BY \"pw3\"")
    redacted = MYSQL_DIALECT.redact(text)
    assert not any(secret in redacted for secret in ("pw1", "pw2", "pw3")), redacted


def test_a_session_reads_statements_after_a_switch_every_way() -> None:
    reading = SessionReading("", "utf8mb4", MARIADB)
    found = reading.read(b"SET sql_mode = 'NO_BACKSLASH_ESCAPES'; SELECT 'a\\'; DROP TABLE t; -- '", True)
    assert found.readings is not None and any("DROP TABLE t" in r and "'a\\\\'" in r for r in found.readings)
    assert reading.read("SELECT 'é'".encode(), True).refusal is None
    reading.charset = "sjis"
    assert "sjis" in (reading.read(b"SELECT 1", True).refusal or "")


# --------------------------------------------------------------------------- held to the server


@pytest.fixture(scope="module")
def server(mysql_target: Any) -> Any:
    connection = pymysql.connect(host="127.0.0.1", port=mysql_target.port, user="root",
                                 password=mysql_target.password, client_flag=pymysql.constants.CLIENT.MULTI_STATEMENTS,
                                 autocommit=True)
    yield connection
    connection.close()


def answers(connection: pymysql.Connection, sql_mode: str, text: str) -> tuple[list[Any], bool]:
    """The server's answer to ``text`` under ``sql_mode``: each result set's rows up to the first error, and
    whether there was one (a multi-statement text stops there)."""
    results: list[Any] = []
    failed = False
    with connection.cursor() as cursor:
        cursor.execute("SET SESSION sql_mode = %s", (sql_mode,))
        try:
            cursor.execute(text)
            results.append(cursor.fetchall())
            while cursor.nextset():
                results.append(cursor.fetchall())
        except pymysql.err.MySQLError:
            failed = True
            while True:  # what is left of a multi-statement answer
                try:
                    if not cursor.nextset():
                        break
                except pymysql.err.MySQLError:
                    continue
    return [[tuple(row) for row in rows] for rows in results if rows is not None and len(rows) or rows == ()], failed


def run(connection: pymysql.Connection, sql_mode: str, text: str) -> Any:
    """The server's answer to ``text`` under ``sql_mode``: each result set's rows, or "error"."""
    results, failed = answers(connection, sql_mode, text)
    return "error" if failed else results


def gateway_reading(text: str, mode: int) -> Any:
    try:
        readings = mysql_scan.readings(text, mode, MARIADB)
    except Unreadable:
        return None
    assert len(readings) == 1
    return mysql_scan.canonical(readings[0])


CORPUS = [
    "SELECT 'a\\'; SELECT 2; -- '", 'SELECT "a\\"; SELECT 2; -- "', "SELECT 'it''s', \"say \"\"hi\"\"\"",
    "SELECT 1 /*!50000 +1 */", "SELECT 1 /*!999999 +1 */", "SELECT 1 /*M!100000 +1 */ +2",
    "SELECT 1 /*! /* x */ +1 */", "SELECT 1 /*!50000 +1 -- x */\n+1 */", "SELECT 1 /*!50000 +1 # x */\n+1 */",
    "SELECT 1 --+1", "SELECT 1 -- +1", "SELECT 1 --\t+1", "SELECT 1 #+1\n, 2", "SELECT 1 /* '*/' , 2",
    "SELECT 'a' 'b'", "SELECT _utf8mb4'a' 'b'", "SELECT N'x' 'y'", "SELECT `a``b` FROM (SELECT 1 AS `a``b`) t",
    "SELECT 'a\\\\'; SELECT 'b'", "SELECT '\\%\\_\\n'", "SELECT \"\\\"\"", "SELECT 1;SELECT 2;",
    "SELECT 1 /*!50000 ; SELECT 2 */", "SELECT 1 /*!999999 ; SELECT 2 */", "SELECT 1 /*!12345a */",
]


@pytest.mark.parametrize("text", CORPUS)
def test_the_gateway_reads_what_mariadb_runs(server: pymysql.Connection, text: str) -> None:
    for mode in MODES:
        expected = run(server, SQL_MODES[mode], text)
        canonical = gateway_reading(text, mode)
        got = "error" if canonical is None else run(server, "", canonical)
        assert got == expected, (SQL_MODES[mode], text, canonical)


FRAGMENTS = ["'a'", "'\\''", "'\\\\'", "\"b\"", "\"\\\"\"", "`c`", "/* x */", "/*!50000 1 */", "/*!999999 2 */",
             "/*M!100000 3 */", "-- z\n", "#w\n", ";", " ", "1", ",", "'--'", "'/*'", "\\", "''", "\"\"", "+", "'#'",
             "*/", "'", "\"", "--", "/*!", "SELECT ", "\n"]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=8), st.sampled_from(MODES))
@example(["'a'", ";", ";", "/* x */"], 0)  # the server's "Query was empty" after what it ran (found by a suite run)
def test_the_gateway_reads_what_mariadb_runs_for_any_text(server: pymysql.Connection, parts: list[str],
                                                          mode: int) -> None:
    text = "SELECT " + "".join(parts)
    expected, failed = answers(server, SQL_MODES[mode], text)
    canonical = gateway_reading(text, mode)
    if canonical is None:  # the gateway cannot read it: the server must refuse it too (or it nests executable
        # comments, which the gateway refuses whatever the server does)
        assert failed or text.count("/*!") + text.count("/*M!") > 1, (SQL_MODES[mode], text)
        return
    got, got_failed = answers(server, "", canonical)
    if failed and not got_failed:
        # the server stopped at an error the canonical text does not make (a last statement of only a comment is
        # "Query was empty"): what it ran before the error is what the gateway read first
        assert got[:len(expected)] == expected, (SQL_MODES[mode], text, canonical)
        return
    assert (got, got_failed) == (expected, failed), (SQL_MODES[mode], text, canonical)


def test_the_offline_analyzer_rates_mysql_by_its_statement_kinds() -> None:
    from gatewayd.analysis.offline import rate

    assert rate("/*!50000 DROP */ TABLE orders", MYSQL).risk_level == "high"
    assert rate("DELETE FROM orders", MYSQL).risk_level == "high"
    assert rate("SELECT * FROM orders WHERE id = 1", MYSQL).risk_level == "low"


def test_the_kinds_it_tells_apart_are_of_the_shared_vocabulary() -> None:
    from gatewayd.sql.pg_statements import statement_node_names

    assert set(MYSQL_DIALECT.kinds) <= set(statement_node_names())
    assert {"DropStmt", "DropdbStmt", "DeleteStmt", "TruncateStmt", "UpdateStmt", "GrantStmt"} <= set(MYSQL_DIALECT.kinds)


def test_a_prepared_string_is_read_under_every_sql_mode() -> None:
    """The server lexes a prepared string under the session's mode when PREPARE runs: a comment by default can be
    code under NO_BACKSLASH_ESCAPES (``'\\''`` is one string there, two here)."""
    inner = "SELECT '\\''/*' drop table */"
    assert "drop table" not in mysql_scan.words(mysql_scan.readings(inner, 0)[0], 1, 3)
    text = "PREPARE s FROM " + mysql_scan.canonical([mysql_scan.Token(mysql_scan.STRING, 0, 0, inner)])
    assert "drop table" in MYSQL_DIALECT.normalize(text)


def test_a_statement_that_may_compute_a_masked_column_is_told_from_one_that_cannot() -> None:
    """Under a rule by column name a computed result column (no table) is masked whole when its statement names a
    masked column, a variable (set from data before; a server setting's not) or selects a star; COUNT(*), a
    product, a literal not."""
    from proxies.mysql.reading import MENTIONS, derived_names

    watched = frozenset({"ssn"})
    mentions = ["SELECT MAX(ssn) FROM t", "SELECT CONCAT(`SSN`) FROM t", "SELECT @v", "SELECT t.* FROM t",
                "SELECT * FROM t UNION SELECT 1", "SELECT DISTINCT * FROM t", "SELECT 1, * FROM t",
                "SELECT @@session.default_master_connection"]
    not_mentions = ["SELECT COUNT(*) FROM t", "SELECT a * b FROM t", "SELECT 'ssn'", "SELECT NOW()", "SELECT @@port"]
    assert [MENTIONS in (derived_names(sql, watched=watched) or ()) for sql in mentions] == [True] * len(mentions)
    assert [MENTIONS in (derived_names(sql, watched=watched) or ()) for sql in not_mentions] == [False] * 5


def test_the_routines_views_and_tables_a_statement_makes_are_named() -> None:
    """A session may make a stored routine, a view or a table and read a masked column through it: its name (lower
    case), however it is written."""
    from proxies.mysql.reading import created_names

    assert created_names("CREATE OR REPLACE DEFINER=`root`@`%` AGGREGATE FUNCTION IF NOT EXISTS app.`Get_SSN` "
                         "(i INT) RETURNS TEXT RETURN a.b") == {"get_ssn"}
    assert created_names('CREATE PROCEDURE "p"() SELECT 1; CREATE PACKAGE BODY pkg AS') == {"p", "pkg"}
    assert created_names("CREATE FUNCTION u RETURNS STRING SONAME 'u.so'") == {"u"}
    assert created_names("CREATE ALGORITHM=MERGE SQL SECURITY INVOKER VIEW v AS SELECT x.ssn FROM x") == {"v"}
    assert created_names("CREATE TEMPORARY TABLE IF NOT EXISTS t AS SELECT ssn AS q FROM x") == {"t"}
    assert created_names("RENAME TABLE a TO app.b, c TO `D`") == {"b", "d"}
    assert created_names("ALTER TABLE a RENAME e") == {"e"}
    assert created_names("CREATE INDEX i ON t (a); DROP VIEW v") == frozenset()
