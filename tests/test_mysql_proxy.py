"""End to end: PyMySQL, the mariadb client, mariadb-dump and MariaDB Connector/J through the MySQL proxy of a real
gatewayd to a real MariaDB (Debian's).

One MariaDB (tests/mypeer.py, shared by the session) and one ``gatewayd run``
with the mysql listener serve the whole module; each test makes its own
connection so guard rails never leak between tests.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pymysql
import pytest

from tests.apiclient import MySqlApi, admin_http, of_kind
from tests.conftest import Daemon, proxy_daemon
from tests.llmpeer import API_KEY, FakeLLM
from proxies.mysql import codec
from tests.mypeer import CONNECTOR_J

RECORDING_CAP = 4 << 20


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    daemon = proxy_daemon(tmp_path_factory, "myproxy", "mysql", {"sessions.recording_cap_bytes": RECORDING_CAP},
                          wait=True)
    yield daemon
    assert daemon.stop() == 0


@pytest.fixture(scope="module")
async def api(gateway, mysql_target):
    async with admin_http(gateway) as http:
        yield MySqlApi(gateway, http, mysql_target)


def connect(gateway: Daemon, secret: str, password: str = "any", database: str | None = "app",
            **kwargs: Any) -> pymysql.Connection:
    kwargs.setdefault("client_flag", pymysql.constants.CLIENT.MULTI_STATEMENTS)
    return pymysql.connect(host="127.0.0.1", port=gateway.proxy_port, user=secret, password=password,
                           database=database, connect_timeout=15, read_timeout=60, **kwargs)


def direct(server: Any, database: str = "app", **kwargs: Any) -> pymysql.Connection:
    return pymysql.connect(host="127.0.0.1", port=server.port, user="root", password=server.password,
                           database=database, client_flag=pymysql.constants.CLIENT.MULTI_STATEMENTS, **kwargs)


def query(connection: pymysql.Connection, sql: str, args: Any = None) -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute(sql, args)
        return list(cursor.fetchall())


def cli(gateway: Daemon, secret: str, *args: str, stdin: str | None = None, program: str = "mariadb",
        timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([program, "--no-defaults", "-h", "127.0.0.1", "-P", str(gateway.proxy_port), "-u", secret,
                           "--password=any", "--skip-ssl", *args], capture_output=True, text=True, input=stdin,
                          timeout=timeout, check=False)


def answer(connection: pymysql.Connection, sql: str) -> Any:
    """``sql``'s rows, or the error's (code, message): a statement a test expects to be interrupted."""
    try:
        return query(connection, sql)
    except pymysql.err.MySQLError as exc:
        return exc.args


def raw_command(gateway: Daemon, secret: str, command: int, body: bytes, before: str | None = None) -> tuple:
    """Send one command as a client library would not (``before``: a statement first); the error it gets."""
    connection = connect(gateway, secret)
    try:
        if before is not None:
            query(connection, before)
        connection._execute_command(command, body)
        with pytest.raises(pymysql.err.MySQLError) as raised:
            connection._read_ok_packet()
        return raised.value.args
    finally:
        connection.close()


async def in_thread(function: Any, *args: Any, **kwargs: Any) -> Any:
    return await asyncio.to_thread(function, *args, **kwargs)


# --------------------------------------------------------------------------- logins and statements


async def test_pymysql_secret_as_user_runs_statements_and_records_them(api, gateway):
    role = await api.role()
    secret, session_id = await api.credential(role)

    def work() -> list[tuple]:
        with connect(gateway, secret) as connection:
            query(connection, "CREATE TABLE people (id INT PRIMARY KEY, name VARCHAR(40), born DATE)")
            query(connection, "INSERT INTO people VALUES (1, 'ada', '1815-12-10'), (2, NULL, NULL)")
            return query(connection, "SELECT id, name, born FROM people ORDER BY id")

    rows = await in_thread(work)
    assert [(r[0], r[1], str(r[2]) if r[2] else None) for r in rows] == [(1, "ada", "1815-12-10"), (2, None, None)]
    session = await api.done_session(session_id)
    inputs = [e for e in of_kind(session, "i")]
    assert "SELECT id, name, born FROM people ORDER BY id" in inputs
    outputs = "".join(of_kind(session, "o"))
    assert "id\tname\tborn\n1\tada\t1815-12-10\n2\tNULL\tNULL\n(2 rows)\n" in outputs
    assert "OK, 2 rows affected" in outputs
    assert session["status"] == "done" and session["exit_code"] == 0


async def test_secret_as_password_is_asked_in_clear(api, gateway):
    role = await api.role()
    secret, session_id = await api.credential(role)

    def work() -> list[tuple]:
        with connect(gateway, "someone", password=secret) as connection:
            return query(connection, "SELECT 40 + 2")

    assert await in_thread(work) == [(42,)]
    await api.done_session(session_id)


async def test_unknown_secret_is_refused_with_1045(api, gateway):
    with pytest.raises(pymysql.err.OperationalError) as raised:
        await in_thread(connect, gateway, "my-" + "A" * 43)
    assert raised.value.args[0] == 1045
    assert "invalid credential" in raised.value.args[1]


async def test_multi_statements_each_result_recorded_and_errors_are_e_events(api, gateway):
    role = await api.role()
    secret, session_id = await api.credential(role)

    def work() -> list[Any]:
        with connect(gateway, secret) as connection:
            with connection.cursor() as cursor:
                cursor.execute("SELECT 1 AS a; SELECT 'x' AS b, 2 AS c; DO 1")
                results = [cursor.fetchall()]
                while cursor.nextset():
                    results.append(cursor.fetchall())
            with pytest.raises(pymysql.err.ProgrammingError):
                query(connection, "SELECT * FROM no_such_table")
            results.append(query(connection, "SELECT 'after'"))
            return results

    results = await in_thread(work)
    assert results[:2] == [((1,),), (("x", 2),)] and results[-1] == [("after",)]
    session = await api.done_session(session_id)
    output = "".join(of_kind(session, "o"))
    assert "a\n1\n(1 row)\n" in output and "b\tc\nx\t2\n(1 row)\n" in output
    errors = of_kind(session, "e")
    assert any("ERROR 1146 (42S02)" in e and "no_such_table" in e for e in errors), errors


async def test_mariadb_cli_and_init_db_held_to_the_connections_database(api, gateway, mysql_target):
    role = await api.role()
    secret, _ = await api.credential(role)
    result = await in_thread(cli, gateway, secret, "app", "-e", "SELECT DATABASE(), 6 * 7")
    assert result.returncode == 0, result.stderr
    assert "app\t42" in result.stdout.replace(" ", "\t") or "42" in result.stdout
    # another database: refused at login (the client's choice) and by COM_INIT_DB
    refused = await in_thread(cli, gateway, secret, "other", "-e", "SELECT 1")
    assert refused.returncode != 0 and "not reachable" in refused.stderr

    def init_db() -> str:
        with connect(gateway, secret) as connection:
            with pytest.raises(pymysql.err.OperationalError) as raised:
                connection.select_db("other")
            return raised.value.args[1]

    assert "not reachable" in await in_thread(init_db)
    allowed = await api.role(settings={"mysql": {"databases": ["other"]}})
    secret2, _ = await api.credential(allowed)

    def init_allowed() -> list[tuple]:
        with connect(gateway, secret2) as connection:
            connection.select_db("other")
            return query(connection, "SELECT DATABASE()")

    assert await in_thread(init_allowed) == [("other",)]


# --------------------------------------------------------------------------- guard rails on MySQL's reading


def blocked(connection: pymysql.Connection, sql: str) -> str:
    """The gateway's refusal of ``sql`` (ERR 1227)."""
    with pytest.raises(pymysql.err.MySQLError) as raised:
        query(connection, sql)
    assert raised.value.args[0] == 1227, raised.value.args
    return raised.value.args[1]


def tables(server: Any) -> set[str]:
    return set(server.sql("SHOW TABLES", "app").split())


async def test_deny_words_read_the_dialects_tokens_and_executable_comments(api, gateway):
    role = await api.role()
    await api.guardrail(role, input_rules=[{"type": "deny_words_list", "words": ["drop table"]}])
    secret, session_id = await api.credential(role)

    def work() -> list[str]:
        with connect(gateway, secret) as connection:
            messages = [blocked(connection, sql) for sql in (
                "DROP/**/TABLE t1", "DROP#x\nTABLE t1", "DROP -- x\nTABLE t1", "/*!50000 DROP */ TABLE t1",
                "DROP /*M!100000 TABLE */ t1", "PREPARE s FROM 'drop table t1'")]
            assert query(connection, "SELECT 'drop' AS a, 'table' AS b") == [("drop", "table")]
            return messages

    messages = await in_thread(work)
    assert all("words=[drop table]" in m for m in messages), messages
    session = await api.done_session(session_id)
    assert of_kind(session, "e").count(
        "validation error, match guard rails input rule, type=deny_words_list, words=[drop table]") == 6


async def test_statement_kinds_and_require_where_read_mysqls_parse(api, gateway, mysql_target):
    mysql_target.sql("CREATE TABLE IF NOT EXISTS kinds (id INT); INSERT INTO kinds VALUES (1), (2)", "app")
    role = await api.role()
    await api.guardrail(role, input_rules=[{"type": "statement_kinds", "deny": ["DropStmt"]},
                                           {"type": "require_where", "statements": ["delete", "update"]}])
    secret, _ = await api.credential(role)

    def work() -> list[str]:
        with connect(gateway, secret, autocommit=True) as connection:
            messages = [blocked(connection, sql) for sql in (
                "/*!50000 DROP */ TABLE kinds", "DROP DATABASE app", "DELETE FROM kinds", "UPDATE kinds SET id = 3",
                "TRUNCATE kinds", "SELECT 1; DELETE FROM kinds", "PREPARE s FROM 'DELETE FROM kinds'",
                "PREPARE s FROM @sql", "ALTER TABLE kinds DROP COLUMN id")]
            assert query(connection, "DELETE FROM kinds WHERE id = 2") == []
            assert query(connection, "SELECT id FROM kinds") == [(1,)]
            return messages

    messages = await in_thread(work)
    assert "statement=DropStmt" in messages[0] and "statement=DropdbStmt" in messages[1], messages
    assert "delete without WHERE" in messages[2] and "update without WHERE" in messages[3], messages
    assert "delete without WHERE (TruncateStmt)" in messages[4], messages
    assert "(statement 2 of 2)" in messages[5], messages
    assert "only a constant string can be read" in messages[7], messages
    assert "it has the effect of DropStmt" in messages[8], messages
    assert "kinds" in tables(mysql_target)


DROPS = {"type": "statement_kinds", "deny": ["DropStmt"]}
UPDATES = {"type": "statement_kinds", "deny": ["UpdateStmt"]}


@pytest.mark.parametrize("rule, sql, says", [
    (DROPS, "CREATE OR REPLACE TABLE {t} (id INT, a INT)", "statement=CREATE OR REPLACE TABLE (it has the effect of "
     "DropStmt)"),
    (DROPS, "CREATE OR REPLACE TABLE {t} AS SELECT 1 AS id, 0 AS a", "statement=CREATE OR REPLACE TABLE"),
    (UPDATES, "INSERT INTO {t} SELECT id, a FROM {t} ON DUPLICATE KEY UPDATE a = 0",
     "statement=INSERT ON DUPLICATE KEY UPDATE (it has the effect of UpdateStmt)"),
    ({"type": "require_where", "statements": ["update"]},
     "INSERT INTO {t} SELECT id, a FROM {t} ON DUPLICATE KEY UPDATE a = 0",
     "update without WHERE (INSERT ON DUPLICATE KEY UPDATE)"),
    ({"type": "require_where", "statements": ["delete"]}, "REPLACE INTO {t} (id) SELECT id FROM {t}",
     "delete without WHERE (REPLACE)"),
    (UPDATES, "ALTER TABLE {t} MODIFY a INT GENERATED ALWAYS AS (0) VIRTUAL",
     "(it has the effect of UpdateStmt)"),
])
async def test_what_has_a_denied_kinds_effect_is_refused_and_the_rows_stay(api, gateway, mysql_target, rule, sql,
                                                                           says):
    """A statement that does what a denied kind does (MariaDB's ``CREATE OR REPLACE`` drops the table there is;
    an upsert updates, a ``REPLACE`` deletes and inserts again, every row its SELECT meets) is refused with it:
    the table keeps its rows."""
    table = f"effect_{os.urandom(3).hex()}"
    mysql_target.sql(f"CREATE TABLE {table} (id INT PRIMARY KEY, a INT); INSERT INTO {table} VALUES (1, 1), (2, 2)",
                     "app")
    role = await api.role()
    await api.guardrail(role, input_rules=[rule])
    secret, _ = await api.credential(role)

    def work() -> str:
        with connect(gateway, secret, autocommit=True) as connection:
            return blocked(connection, sql.format(t=table))

    assert says in await in_thread(work)
    assert mysql_target.sql(f"SELECT id, a FROM {table} ORDER BY id", "app") == "1\t1\n2\t2\n"


@pytest.mark.parametrize("switch, attack", [
    ("SET sql_mode = 'NO_BACKSLASH_ESCAPES'", "SELECT 'a\\'; DROP TABLE victim; -- '"),
    ("SET SESSION sql_mode = 'ANSI_QUOTES'", 'SELECT "a\\"; DROP TABLE victim; -- "'),
    ("SET @@session.sql_mode = CONCAT('ANSI', '_QUOTES')", 'SELECT "a\\"; DROP TABLE victim; -- "'),
])
async def test_sql_mode_is_followed_so_quoting_reads_as_the_server_reads_it(api, gateway, mysql_target, switch,
                                                                            attack):
    """Without following sql_mode, the gateway would read one string where the server runs a DROP."""
    mysql_target.sql("CREATE TABLE IF NOT EXISTS victim (id INT)", "app")
    role = await api.role()
    await api.guardrail(role, input_rules=[{"type": "statement_kinds", "deny": ["DropStmt"]}])
    secret, _ = await api.credential(role)

    def work() -> tuple[str, str]:
        with connect(gateway, secret, autocommit=True) as connection:
            query(connection, switch)
            first = blocked(connection, attack)
        with connect(gateway, secret, autocommit=True) as connection:  # the switch and the attack in one query
            second = blocked(connection, f"{switch}; {attack}")
        return first, second

    first, second = await in_thread(work)
    assert "statement=DropStmt" in first and "statement=DropStmt" in second, (first, second)
    assert "victim" in tables(mysql_target)


async def test_a_character_set_the_gateway_cannot_read_is_refused_under_rules(api, gateway):
    role = await api.role()
    await api.guardrail(role, input_rules=[{"type": "deny_words_list", "words": ["nothing here"]}])
    secret, _ = await api.credential(role)

    def work() -> str:
        with connect(gateway, secret) as connection:
            query(connection, "SET NAMES sjis")
            return blocked(connection, "SELECT 1")

    assert "the client character set sjis" in await in_thread(work)


async def test_the_session_cannot_stop_the_gateway_following_its_settings(api, gateway, mysql_target):
    """Turning the target's reports off is not reported itself: the gateway asks, and turns them on again."""
    mysql_target.sql("CREATE TABLE IF NOT EXISTS victim (id INT)", "app")
    role = await api.role()
    await api.guardrail(role, input_rules=[{"type": "statement_kinds", "deny": ["DropStmt"]}])
    secret, _ = await api.credential(role)

    def work() -> tuple[str, list[tuple]]:
        with connect(gateway, secret, autocommit=True) as connection:
            query(connection, "SET session_track_system_variables = ''")
            query(connection, "SET sql_mode = 'NO_BACKSLASH_ESCAPES'")
            message = blocked(connection, "SELECT 'a\\'; DROP TABLE victim; -- '")
            return message, query(connection, "SELECT @@session.session_track_system_variables")

    message, tracked = await in_thread(work)
    assert "statement=DropStmt" in message and "sql_mode" in tracked[0][0], (message, tracked)
    assert "victim" in tables(mysql_target)


# --------------------------------------------------------------------------- masking, prepared statements


MASKS = [{"type": "mask", "patterns": ["card_number", "email"]},
         {"type": "mask", "columns": ["salary", "ssn"], "style": "last4"}]
CLEAR = ("jane@example.com", "4111111111111111", "123-45-6789", "98765")


@pytest.fixture(scope="module")
def people(mysql_target) -> str:
    mysql_target.sql("CREATE TABLE masked (id INT PRIMARY KEY, email VARCHAR(80), card VARCHAR(30), ssn VARCHAR(20), "
                     "salary INT, note TEXT, born DATE);"
                     "INSERT INTO masked VALUES (1, 'jane@example.com', '4111111111111111', '123-45-6789', 98765, "
                     "'write to jane@example.com', '1990-01-02'), (2, NULL, 'none', NULL, NULL, 'plain', NULL)",
                     "app")
    return "masked"


async def nowhere_in_clear(api: MySqlApi, session_id: str, *seen: str) -> dict:
    session = await api.done_session(session_id)
    recorded = "".join(of_kind(session, "o")) + "".join(of_kind(session, "e"))  # output (input is as sent)
    for clear in CLEAR:
        for text in (*seen, recorded):
            assert clear not in text, (clear, text)
    return session


async def test_text_results_are_masked_per_cell_and_recorded_masked(api, gateway, people):
    role = await api.role()
    await api.guardrail(role, output_rules=MASKS)
    secret, session_id = await api.credential(role)

    def work() -> list[tuple]:
        with connect(gateway, secret) as connection:
            rows = query(connection, "SELECT id, email, card, ssn, salary, note, born FROM masked ORDER BY id")
            rows += query(connection, "SELECT 'jane@example.com'")  # a column named after its value
            with connection.cursor() as cursor:
                cursor.execute("SELECT 'jane@example.com' AS x")
                rows.append(tuple(d[0] for d in cursor.description))
            return rows

    rows = await in_thread(work)
    assert rows[0][:6] == (1, "****", "****", "*******6789", None, "write to ****"), rows
    assert rows[1] == (2, None, "none", None, None, "plain", None), rows
    # computed, by a statement naming no masked column: read by the patterns alone
    assert rows[2] == ("****",) and rows[3] == ("x",), rows
    session = await nowhere_in_clear(api, session_id, repr(rows))
    assert session["metrics"].get("masked", 0) >= 6, session["metrics"]


def raw_answer(connection: pymysql.Connection, sql: str) -> list[bytes]:
    """The packets of ``sql``'s answer as the client gets them (an OK, an ERR, or a result set to its last EOF):
    what a client library would decode in the character set it believes in."""
    connection._execute_command(3, sql.encode())
    packets = []
    while True:
        packet = connection._read_packet()
        data = packet.get_all_data()
        packets.append(data)
        if len(packets) == 1 and (packet.is_ok_packet() or packet.is_error_packet()):
            return packets
        if packet.is_eof_packet() and sum(codec.is_eof(p) for p in packets) == 2:
            return packets


async def test_values_are_read_in_the_character_set_the_session_has_them_sent_in(api, gateway, mysql_target,
                                                                                  people):
    """``character_set_results = utf16`` sends ASCII as two bytes a character: the patterns read it decoded;
    ``binary`` sends a column in its own character set without naming it: withheld."""
    mysql_target.sql("CREATE TABLE IF NOT EXISTS masked16 (id INT, e VARCHAR(80) CHARACTER SET utf16);"
                     "REPLACE INTO masked16 VALUES (1, 'jane@example.com')", "app")
    role = await api.role()
    await api.guardrail(role, output_rules=MASKS)
    secret, session_id = await api.credential(role)

    def work() -> tuple[dict[str, bytes], list[bytes]]:
        with connect(gateway, secret) as connection:
            seen = {}
            for setting in ("utf16", "utf32", "NULL"):
                raw_answer(connection, f"SET character_set_results = {setting}")
                seen[setting] = b"".join(raw_answer(connection, "SELECT note, ssn FROM masked WHERE id = 1"))
            seen["NULL16"] = b"".join(raw_answer(connection, "SELECT e FROM masked16"))  # its own utf16, named
            raw_answer(connection, "SET character_set_results = binary")
            binary = raw_answer(connection, "SELECT e FROM masked16")
            raw_answer(connection, "SET character_set_results = utf8mb4")
            seen["after"] = repr(query(connection, "SELECT note, ssn FROM masked WHERE id = 1")).encode()
            return seen, binary

    seen, binary = await in_thread(work)
    assert "****".encode("utf-16-be") in seen["NULL16"], seen["NULL16"]
    assert binary[3] == b"\xfb", binary  # the row: one NULL
    seen["binary"] = b"".join(binary)
    for setting, codec_name in (("utf16", "utf-16-be"), ("utf32", "utf-32-be")):
        assert "write to ****".encode(codec_name) in seen[setting], seen[setting]
        assert "*******6789".encode(codec_name) in seen[setting], seen[setting]
    assert "write to ****".encode() in seen["NULL"], seen["NULL"]  # the columns' own utf8mb4
    assert b"write to ****" in seen["after"] and b"*******6789" in seen["after"], seen
    for text in seen.values():
        for clear in CLEAR:
            for codec_name in ("utf-8", "utf-16-be", "utf-32-be"):
                assert clear.encode(codec_name) not in text, (clear, text)
    session = await nowhere_in_clear(api, session_id)
    assert any("withheld values under a mask rule (sent as NULL): result column 1 (character set not named: "
               "character_set_results is binary)" in e for e in of_kind(session, "e")), of_kind(session, "e")


async def test_a_rule_by_column_name_masks_what_it_cannot_place_in_a_base_table(api, gateway, mysql_target, people):
    """MariaDB names a derived table's, a CTE's or a view's alias as a column's table (even one named like a base
    table), and no table for a computed column: only a base table's column is read by its source's name."""
    mysql_target.sql("CREATE OR REPLACE VIEW masked_view AS SELECT id, ssn AS x FROM masked;"
                     "CREATE TABLE IF NOT EXISTS plain (id INT, code VARCHAR(20));"
                     "REPLACE INTO plain VALUES (1, '987-65-4321')", "app")
    role = await api.role()
    await api.guardrail(role, output_rules=MASKS)
    secret, session_id = await api.credential(role)
    hidden = ("SELECT x FROM (SELECT ssn AS x FROM masked WHERE id = 1) d",
              "WITH c AS (SELECT ssn AS x FROM masked WHERE id = 1) SELECT x FROM c",
              "SELECT x FROM masked_view WHERE id = 1",
              "SELECT ssn AS x FROM masked WHERE id = 1 UNION ALL SELECT 'a'",
              "SELECT MAX(ssn) FROM masked",
              "SELECT note FROM (SELECT ssn AS note FROM masked WHERE id = 1) masked")  # named as the base table
    clear = ("SELECT code FROM plain WHERE id = 1", "SELECT p.note FROM masked p WHERE id = 2",
             "SELECT d.code FROM plain d WHERE id = 1",
             "SELECT COUNT(*), 6 * 7, 'a' AS b FROM masked")  # computed, naming no masked column

    def work() -> tuple[list[Any], list[Any], Any]:
        with connect(gateway, secret) as connection:
            masked = [query(connection, sql) for sql in hidden]
            plain = [query(connection, sql) for sql in clear]
            # computed (a UNION's), named by its first branch (0, 0...): only the star says a masked column is in it
            starred = query(connection, "SELECT 0, 0, 0, 0, 0, 0, 0 FROM DUAL WHERE 0 UNION ALL "
                                        "SELECT * FROM masked WHERE id = 1")
            masked.append(starred)
            with connection.cursor(pymysql.cursors.SSCursor) as cursor:  # a prepared statement: binary rows
                cursor.execute("PREPARE s FROM 'SELECT x FROM (SELECT ssn AS x FROM masked WHERE id = 1) d'")
            return masked, plain, query(connection, "EXECUTE s")

    masked, plain, executed = await in_thread(work)
    assert masked[:-1] == [[("*******6789",)]] * 3 + [[("*******6789",), ("*",)], [("*******6789",)],
                                                     [("*******6789",)]], masked
    starred = masked[-1]
    assert starred[0][3] == "*******6789" and not any(clear in repr(starred) for clear in CLEAR), starred
    assert plain == [[("987-65-4321",)], [("plain",)], [("987-65-4321",)], [(2, 42, "a")]], plain
    assert executed == [("*******6789",)], executed  # EXECUTE's statement is not read: nothing placed
    await nowhere_in_clear(api, session_id, repr(masked))


async def test_a_stored_functions_result_is_masked_under_a_rule_by_column_name(api, gateway, mysql_target, people):
    """A stored function's result is computed and names no column: a statement calling a routine the database
    defines (read when the session starts, or created in it) counts as naming a masked column."""
    mysql_target.sql("CREATE OR REPLACE FUNCTION masked_ssn(i INT) RETURNS TEXT READS SQL DATA "
                     "RETURN (SELECT ssn FROM masked WHERE id = i)", "app")
    role = await api.role()
    await api.guardrail(role, output_rules=MASKS)
    secret, session_id = await api.credential(role)

    def work() -> tuple[list[Any], Any]:
        with connect(gateway, secret) as connection:
            query(connection, "CREATE OR REPLACE FUNCTION session_ssn(i INT) RETURNS TEXT READS SQL DATA "
                              "RETURN (SELECT CONCAT('', ssn) FROM masked WHERE id = i)")
            masked = [query(connection, sql) for sql in (
                "SELECT masked_ssn(1)", "SELECT upper(masked_ssn(1))",
                "SELECT CONCAT('', `app`.`masked_ssn`(1)) AS y", "SELECT LOWER(app.masked_ssn (1))",
                "SELECT TRIM(session_ssn(1))")]
            return masked, query(connection, "SELECT COUNT(*), 'a' FROM masked")

    masked, plain = await in_thread(work)
    assert masked == [[("*******6789",)]] * 5, masked
    assert plain == [(2, "a")], plain  # computed, calling no routine: passes
    await nowhere_in_clear(api, session_id, repr(masked))


async def test_a_procedures_results_are_masked_under_a_rule_by_column_name(api, gateway, mysql_target, people):
    """``CALL``'s results come from statements the gateway never reads: a computed column (``upper(ssn)``) is
    masked whole, a base column renamed (``ssn AS x``) by its source's name."""
    mysql_target.sql("CREATE OR REPLACE PROCEDURE masked_rows() "
                     "SELECT upper(ssn), ssn AS x, id FROM masked WHERE id = 1", "app")
    role = await api.role()
    await api.guardrail(role, output_rules=MASKS)
    secret, session_id = await api.credential(role)

    def work() -> list[Any]:
        with connect(gateway, secret) as connection:
            return [query(connection, sql) for sql in ("CALL masked_rows()", "CALL `app`.masked_rows")]

    called = await in_thread(work)
    assert called == [[("*******6789", "*******6789", None)]] * 2, called  # nothing placed: the number id NULL
    await nowhere_in_clear(api, session_id, repr(called))


async def test_a_variable_set_from_data_is_masked_under_a_rule_by_column_name(api, gateway, people):
    """A user variable or a system variable set from a masked column carries it: read back (``SELECT @v``,
    ``SELECT @@name``, ``SHOW VARIABLES``, ``information_schema``) it is masked whole; so is what ``JSON_TABLE``
    or ``VALUES`` makes of a masked column. A server setting's value passes."""
    role = await api.role()
    await api.guardrail(role, output_rules=MASKS)
    secret, session_id = await api.credential(role)
    reads = ("SELECT @v", "SELECT CONCAT(@v, '')", "SHOW USER_VARIABLES",
             "SELECT VARIABLE_VALUE FROM information_schema.USER_VARIABLES WHERE VARIABLE_NAME = 'v'",
             "SELECT @@default_master_connection", "SELECT CONCAT(@@session.default_master_connection) AS c",
             "SHOW VARIABLES LIKE 'default_master_connection'",
             "SELECT VARIABLE_VALUE FROM information_schema.SESSION_VARIABLES "
             "WHERE VARIABLE_NAME = 'default_master_connection'",
             "SELECT CONCAT(VARIABLE_VALUE) FROM `information_schema`.`user_variables` WHERE VARIABLE_NAME = 'v'",
             "SELECT * FROM JSON_TABLE((SELECT JSON_ARRAY(ssn) FROM masked WHERE id = 1), '$[*]' "
             "COLUMNS (x TEXT PATH '$')) j",
             "SELECT * FROM (VALUES ((SELECT ssn FROM masked WHERE id = 1))) v")

    def work() -> tuple[list[Any], Any]:
        with connect(gateway, secret) as connection:
            query(connection, "SELECT ssn INTO @v FROM masked WHERE id = 1")
            query(connection, "SET SESSION default_master_connection = (SELECT ssn FROM masked WHERE id = 1)")
            return [query(connection, sql) for sql in reads], query(connection, "SELECT @@autocommit, 7")

    masked, setting = await in_thread(work)
    assert all("*******6789" in repr(rows) for rows in masked), masked
    assert setting == [(0, 7)], setting  # PyMySQL turns autocommit off
    await nowhere_in_clear(api, session_id, repr(masked))


async def test_a_value_computed_from_a_view_is_masked_under_a_rule_by_column_name(api, gateway, mysql_target,
                                                                                  people):
    """A view's column names no source: masked whole, and so is a value a statement computes from it (the view's
    name counts as naming a masked column), for the target's views and those the session makes or renames; a
    table the session fills from a masked column likewise."""
    mysql_target.sql("CREATE OR REPLACE VIEW masked_ssn_view AS SELECT id, ssn AS x FROM masked", "app")
    role = await api.role()
    await api.guardrail(role, output_rules=MASKS)
    secret, session_id = await api.credential(role)

    def work() -> tuple[list[Any], Any]:
        with connect(gateway, secret) as connection:
            query(connection, "CREATE OR REPLACE VIEW session_view AS SELECT id, upper(ssn) AS u FROM masked;"
                              "CREATE OR REPLACE VIEW renamed_view AS SELECT ssn AS r FROM masked WHERE id = 1")
            query(connection, "DROP VIEW IF EXISTS later_view; RENAME TABLE renamed_view TO later_view")
            query(connection, "CREATE TEMPORARY TABLE session_copy AS SELECT ssn AS q FROM masked WHERE id = 1")
            masked = [query(connection, sql) for sql in (
                "SELECT x FROM masked_ssn_view WHERE id = 1", "SELECT CONCAT(x) FROM masked_ssn_view WHERE id = 1",
                "SELECT LOWER(v.x) AS y FROM `app`.`masked_ssn_view` v WHERE id = 1",
                "SELECT TRIM(u) FROM session_view WHERE id = 1", "SELECT CONCAT(r, '') FROM later_view",
                "SELECT q FROM session_copy", "SELECT CONCAT(q) FROM session_copy")]
            return masked, query(connection, "SELECT COUNT(*) FROM masked")

    masked, plain = await in_thread(work)
    assert masked == [[("*******6789",)]] * 7, masked
    assert plain == [(2,)], plain  # computed from a base table, naming no masked column: passes
    await nowhere_in_clear(api, session_id, repr(masked))


async def test_the_session_state_an_ok_reports_is_masked(api, gateway, people):
    """A client tracking the session's state (CLIENT_SESSION_TRACK) reads a system variable set from data in the
    OK packet: masked as a row's text (the gateway's own tracking still reads the target's values)."""
    role = await api.role()
    await api.guardrail(role, output_rules=MASKS)
    secret, session_id = await api.credential(role)

    def work() -> tuple[list[bytes], Any]:
        with connect(gateway, secret, client_flag=pymysql.constants.CLIENT.MULTI_STATEMENTS | codec.SESSION_TRACK
                     ) as connection:
            seen = []
            for sql in ("SET SESSION session_track_system_variables = '*'",
                        "SET SESSION default_master_connection = (SELECT email FROM masked WHERE id = 1)",
                        "SET SESSION default_master_connection = (SELECT ssn FROM masked WHERE id = 1)",
                        "SET SESSION default_master_connection = 'plain', character_set_results = latin1"):
                seen += raw_answer(connection, sql)
            raw_answer(connection, "SET character_set_results = utf8mb4")
            return seen, query(connection, "SELECT note FROM masked WHERE id = 1")

    seen, after = await in_thread(work)
    changes = [codec.decode_ok(packet, True).variables() for packet in seen]
    assert changes[1]["default_master_connection"] == "************.com", changes  # whole, the first rule's style
    assert changes[2]["default_master_connection"] == "*******6789", changes
    assert changes[3]["character_set_results"] == "latin1", changes  # a setting's name: kept
    assert after == [("write to ****",)], after  # the charset the gateway followed is still right
    await nowhere_in_clear(api, session_id, repr(seen))


JAVA = """
import java.sql.*;

public class MyMasked {
    public static void main(String[] args) throws Exception {
        try (Connection c = DriverManager.getConnection(args[0])) {
            for (int i = 0; i < 3; i++) {
                try (PreparedStatement s = c.prepareStatement(
                        "SELECT id, email, card, ssn, salary, note, born FROM masked WHERE id >= ? ORDER BY id")) {
                    s.setInt(1, 1);
                    try (ResultSet r = s.executeQuery()) {
                        while (r.next()) {
                            System.out.println(r.getInt(1) + "|" + r.getString(2) + "|" + r.getString(3) + "|"
                                + r.getString(4) + "|" + r.getString(5) + "|" + r.getString(6) + "|" + r.getString(7));
                        }
                    }
                }
            }
            try (PreparedStatement s = c.prepareStatement("SELECT ? AS echoed")) {
                s.setString(1, "forbidden thing");
                try (ResultSet r = s.executeQuery()) { r.next(); System.out.println(r.getString(1)); }
            } catch (SQLException e) {
                System.out.println("refused: " + e.getErrorCode() + " " + e.getMessage());
            }
        }
    }
}
"""


async def test_connector_j_server_side_prepared_statements_binary_rows_masked(api, gateway, people, tmp_path):
    if not CONNECTOR_J.exists():
        pytest.skip("MariaDB Connector/J is not installed (libmariadb-java: tests/peers.txt)")
    role = await api.role()
    await api.guardrail(role, input_rules=[{"type": "deny_words_list", "words": ["nothing here"]}],
                        output_rules=MASKS)
    secret, session_id = await api.credential(role)
    source = tmp_path / "MyMasked.java"
    source.write_text(JAVA)
    url = (f"jdbc:mariadb://127.0.0.1:{gateway.proxy_port}/app?user={secret}&password=any"
           "&useServerPrepStmts=true&useSsl=false")
    done = await in_thread(subprocess.run, ["java", "-cp", str(CONNECTOR_J), str(source), url],
                           capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:6] == ["1|****|****|*******6789|null|write to ****|1990-01-02", "2|null|none|null|null|plain|null"] * 3
    assert lines[6] == "forbidden thing"  # computed from a parameter, naming no masked column: not masked
    session = await nowhere_in_clear(api, session_id, done.stdout, done.stderr)
    inputs = of_kind(session, "i")
    assert any("WHERE id >= ? ORDER BY id\n-- parameters: ?1 = 1" in i for i in inputs), inputs
    assert any(i.endswith("-- parameters: ?1 = 'forbidden thing'") for i in inputs), inputs


async def test_connector_j_prepared_statement_blocked_by_input_rules(api, gateway, tmp_path):
    if not CONNECTOR_J.exists():
        pytest.skip("MariaDB Connector/J is not installed (libmariadb-java: tests/peers.txt)")
    role = await api.role()
    await api.guardrail(role, input_rules=[{"type": "deny_words_list", "words": ["echoed"]}])
    secret, session_id = await api.credential(role)
    source = tmp_path / "MyMasked.java"
    source.write_text(JAVA.replace("FROM masked WHERE id >= ? ORDER BY id", "FROM masked WHERE id >= ? AND 0"))
    url = (f"jdbc:mariadb://127.0.0.1:{gateway.proxy_port}/app?user={secret}&password=any"
           "&useServerPrepStmts=true&useSsl=false")
    done = await in_thread(subprocess.run, ["java", "-cp", str(CONNECTOR_J), str(source), url],
                           capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].startswith("refused: 1227 "), done.stdout
    session = await api.done_session(session_id)
    assert "validation error, match guard rails input rule, type=deny_words_list, words=[echoed]" in of_kind(
        session, "e")


# --------------------------------------------------------------------------- the rest of the protocol


async def test_packets_over_16_mib_both_ways(api, gateway, mysql_target):
    mysql_target.sql("CREATE TABLE IF NOT EXISTS big (id INT, body LONGBLOB)", "app")
    role = await api.role()
    secret, session_id = await api.credential(role)
    body = os.urandom(8) * (20 * 1024 * 1024 // 8)  # 20 MiB: two packets of the protocol each way

    def work() -> bytes:
        with connect(gateway, secret, autocommit=True, max_allowed_packet=64 * 1024 * 1024) as connection:
            query(connection, "INSERT INTO big VALUES (1, %s)", (body,))
            return query(connection, "SELECT body FROM big WHERE id = 1")[0][0]

    assert await in_thread(work) == body
    session = await api.done_session(session_id)
    assert session["exit_code"] == 0


async def test_load_data_local_infile_is_refused_unless_the_connection_allows_it(api, gateway, mysql_target,
                                                                                  tmp_path):
    mysql_target.sql("CREATE TABLE IF NOT EXISTS loaded (a INT, b VARCHAR(10))", "app")
    data = tmp_path / "rows.csv"
    data.write_text("1,one\n2,two\n")
    statement = f"LOAD DATA LOCAL INFILE '{data}' INTO TABLE loaded FIELDS TERMINATED BY ','"

    def load(secret: str) -> Any:
        with connect(gateway, secret, autocommit=True, local_infile=True) as connection:
            try:
                query(connection, statement)
            except pymysql.err.MySQLError as exc:
                return exc.args
            return query(connection, "SELECT COUNT(*) FROM loaded")[0][0]

    refused_role = await api.role()
    secret, _ = await api.credential(refused_role)
    refused = await in_thread(load, secret)
    assert isinstance(refused, tuple) and refused[0] in (1148, 4166), refused  # the target refuses it itself
    allowed_role = await api.role(settings={"mysql": {"local_infile": True}})
    secret, session_id = await api.credential(allowed_role)
    assert await in_thread(load, secret) == 2
    session = await api.done_session(session_id)
    assert "1,one\n2,two\n" in of_kind(session, "i"), of_kind(session, "i")


async def test_change_user_is_refused_and_ends_the_session(api, gateway):
    role = await api.role()
    secret, session_id = await api.credential(role)

    code, message = await in_thread(raw_command, gateway, secret, 0x11, b"root\0\0app\0")  # COM_CHANGE_USER
    assert code == 1227 and "COM_CHANGE_USER is refused" in message
    session = await api.done_session(session_id)
    assert any("COM_CHANGE_USER is refused" in e for e in of_kind(session, "e"))


async def test_kill_query_from_a_second_connection_cancels_the_statement(api, gateway):
    role = await api.role()
    secret, _ = await api.credential(role)
    other_role = await api.role()
    other_secret, _ = await api.credential(other_role)
    first = await in_thread(connect, gateway, secret)
    try:
        thread_id = first.thread_id()  # the id the gateway gave: not the target's
        running = asyncio.ensure_future(in_thread(answer, first, "SELECT SLEEP(60)"))
        await asyncio.sleep(0.5)  # the statement is on its way (what follows holds without it: the kill waits)

        def kill(with_secret: str) -> Any:
            with connect(gateway, with_secret) as second:
                return answer(second, f"KILL QUERY {thread_id}")

        outsider = await in_thread(kill, other_secret)  # another connection's session: not translated
        assert isinstance(outsider, tuple) and outsider[0] == 1094, outsider  # unknown thread id on the target
        assert await in_thread(kill, (await api.credential(role))[0]) == []
        assert await asyncio.wait_for(running, 30) == (1317, "Query execution was interrupted")
    finally:
        first.close()


async def test_mariadb_dump_and_restore_through_the_gateway(api, gateway, mysql_target, people):
    role = await api.role()
    await api.guardrail(role, input_rules=[{"type": "deny_words_list", "words": ["nothing here"]}])
    secret, _ = await api.credential(role)
    dump = await in_thread(subprocess.run, ["mariadb-dump", "--no-defaults", "-h", "127.0.0.1", "-P",
                                            str(gateway.proxy_port), "-u", secret, "--password=any", "--skip-ssl",
                                            "app", "masked"], capture_output=True, text=True, timeout=60,
                           check=False)
    assert dump.returncode == 0, dump.stderr
    assert "CREATE TABLE `masked`" in dump.stdout and "jane@example.com" in dump.stdout
    restore = await in_thread(cli, gateway, secret, "other", stdin=dump.stdout)
    assert "not reachable" in restore.stderr  # the connection's database only
    allowed = await api.role(settings={"mysql": {"databases": ["other"]}})
    await api.guardrail(allowed, input_rules=[{"type": "deny_words_list", "words": ["nothing here"]}])
    restore = await in_thread(cli, gateway, (await api.credential(allowed))[0], "other", stdin=dump.stdout)
    assert restore.returncode == 0, restore.stderr
    assert mysql_target.sql("SELECT email FROM masked WHERE id = 1", "other").strip() == "jane@example.com"


async def test_a_mysql_session_exports_as_statements_like_postgres(api, gateway):
    role = await api.role()
    secret, session_id = await api.credential(role)

    def work() -> None:
        with connect(gateway, secret) as connection:
            query(connection, "SELECT 1 AS one")
            with pytest.raises(pymysql.err.MySQLError):
                query(connection, "SELECT * FROM nowhere")

    await in_thread(work)
    await api.done_session(session_id)
    status, body = await api("GET", f"/sessions/{session_id}?format=json")
    assert status == 200, body
    statements = {row["statement"]: row for row in body["statements"]}
    assert statements["SELECT 1 AS one"]["output"] == "one\n1\n(1 row)\n"
    assert "ERROR 1146 (42S02)" in statements["SELECT * FROM nowhere"]["error"]


async def logged_in(gateway: Daemon, tmp_path: Any) -> Any:
    """Ada, an admin, logged in with the people's CLI (tests/test_people_cli.py's Person)."""
    from tests.test_people_cli import PASSWORDS, Person

    gateway.cli("user", "passwd", "--email", "ada@example.com", "--groups", "admin", "--password-stdin",
                input=PASSWORDS["ada@example.com"] + "\n")
    ada = Person(gateway, tmp_path, "ada@example.com")
    await in_thread(ada.login)
    return ada


async def test_the_cli_connect_launches_the_mysql_client_and_shows_the_session(api, gateway, tmp_path):
    ada = await logged_in(gateway, tmp_path)
    role = await api.role()
    printed = await in_thread(ada.run, "connect", role["name"], "--print")
    assert printed.returncode == 0 and printed.stdout.startswith("mysql -h "), printed
    connected = await in_thread(ada.run, "connect", role["name"], "--", "--skip-ssl", "-N", "-e", "select 6 * 7")
    assert connected.returncode == 0, connected.stderr
    assert connected.stdout.strip() == "42"
    listing = json.loads((await in_thread(ada.run, "sessions", "--connection", role["name"], "--json")).stdout)
    used = next(s for s in listing["data"] if s["verb"] == "connect")
    await api.done_session(used["id"])
    shown = await in_thread(ada.run, "sessions", "show", used["id"])
    assert shown.returncode == 0 and "select 6 * 7" in shown.stdout and "42" in shown.stdout, shown.stdout


async def test_the_cli_finds_and_exports_mysql_sessions_as_the_gateway_describes_them(api, gateway, tmp_path):
    """The CLI names no protocol: --protocol and the export formats come from GET /api/protocols, so a MySQL
    session is found by its protocol and exports its statements as csv, like PostgreSQL's; the API's csv
    download link gives the statements too (the language says SQL, not the subtype's name)."""
    ada = await logged_in(gateway, tmp_path)
    role = await api.role()
    secret, session_id = await api.credential(role)

    def work() -> None:
        with connect(gateway, secret) as connection:
            query(connection, "SELECT 'exported' AS word")

    await in_thread(work)
    await api.done_session(session_id)
    listed = await in_thread(ada.run, "sessions", "--protocol", "mysql", "--connection", role["name"], "--json")
    assert listed.returncode == 0, listed.stderr
    assert [s["id"] for s in json.loads(listed.stdout)["data"]] == [session_id]
    typed = await in_thread(ada.run, "sessions", "--type", "mysql", "--connection", role["name"])
    assert typed.returncode == 0 and session_id[:8] in typed.stdout, typed
    unknown = await in_thread(ada.run, "sessions", "--protocol", "gopher")
    assert unknown.returncode == 2 and "mysql" in unknown.stderr and "postgres" in unknown.stderr, unknown

    exported = await in_thread(ada.run, "sessions", "export", session_id, "--format", "csv", "-o",
                               str(tmp_path / "statements.csv"))
    assert exported.returncode == 0, exported.stderr
    rows = {row["statement"]: row for row in csv.DictReader(io.StringIO((tmp_path / "statements.csv").read_text()))}
    assert rows["SELECT 'exported' AS word"]["output"] == "word\nexported\n(1 row)\n", rows
    wrong = await in_thread(ada.run, "sessions", "export", session_id, "--format", "asciicast")
    assert wrong.returncode == 2 and "use --format csv or json or text" in wrong.stderr, wrong.stderr

    status, link = await api("GET", f"/sessions/{session_id}?extension=csv")
    assert status == 200, link
    async with api.http.get(link["download_url"]) as response:
        assert response.status == 200
        downloaded = {row["statement"]: row for row in csv.DictReader(io.StringIO(await response.text()))}
    assert downloaded == rows  # the statements, as ?format=csv gives them


async def test_a_reset_connection_keeps_the_settings_followed(api, gateway, mysql_target):
    """COM_RESET_CONNECTION clears the target's tracking: the gateway sets it up again."""
    mysql_target.sql("CREATE TABLE IF NOT EXISTS victim (id INT)", "app")
    role = await api.role()
    await api.guardrail(role, input_rules=[{"type": "statement_kinds", "deny": ["DropStmt"]}])
    secret, _ = await api.credential(role)

    def work() -> str:
        with connect(gateway, secret, autocommit=True) as connection:
            connection._execute_command(0x1F, b"")  # COM_RESET_CONNECTION
            connection._read_ok_packet()
            query(connection, "SET sql_mode = 'NO_BACKSLASH_ESCAPES'")
            return blocked(connection, "SELECT 'a\\\\'; DROP TABLE victim; -- '")

    assert "statement=DropStmt" in await in_thread(work)
    assert "victim" in tables(mysql_target)


async def test_long_statements_are_read_off_the_loop_and_the_longest_refused(api, gateway):
    role = await api.role()
    await api.guardrail(role, input_rules=[{"type": "deny_words_list", "words": ["forbidden thing"]}])
    secret, session_id = await api.credential(role)
    padding = "x" * (100 * 1024)  # over 64 KiB: read in a worker thread while the session waits

    def work() -> tuple[Any, str, str]:
        with connect(gateway, secret) as connection:
            allowed = query(connection, f"SELECT LENGTH('{padding}')")
            refused = blocked(connection, f"SELECT '{padding}', 'forbidden thing'")
            too_long = blocked(connection, "SELECT '" + "y" * (1024 * 1024 + 10) + "'")
            return allowed, refused, too_long

    allowed, refused, too_long = await in_thread(work)
    assert allowed == [(len(padding),)] and "words=[forbidden thing]" in refused, (allowed, refused)
    assert "longer than the gateway reads under input rules (mysql.max_statement_bytes" in too_long
    await api.done_session(session_id)


async def test_a_kill_query_reaching_another_worker_is_sent_over_the_bus(tmp_path_factory, mysql_target):
    """With two workers, the cancelling connection may land on the other one: the KILL is routed to the worker
    holding the session (the id the greeting gave carries its slot)."""
    daemon = proxy_daemon(tmp_path_factory, "myworkers", "mysql", {"daemon.workers": 2}, wait=True)
    try:
        async with admin_http(daemon) as http:
            api = MySqlApi(daemon, http, mysql_target)
            role = await api.role()
            secret, _ = await api.credential(role)
            first = await in_thread(connect, daemon, secret)
            slot = first.thread_id() >> 20

            running = asyncio.ensure_future(in_thread(answer, first, "SELECT SLEEP(60)"))
            for _ in range(50):  # until a connection lands on the other worker
                second = await in_thread(connect, daemon, (await api.credential(role))[0])
                if second.thread_id() >> 20 != slot:
                    break
                second.close()
            else:
                pytest.fail("every connection landed on the same worker")
            try:
                assert await in_thread(query, second, f"KILL QUERY {first.thread_id()}") == []
            finally:
                second.close()
            assert await asyncio.wait_for(running, 30) == (1317, "Query execution was interrupted")
            first.close()
    finally:
        assert daemon.stop() == 0


async def test_a_session_the_gateway_kills_has_its_statement_killed_on_the_target(api, gateway, mysql_target):
    role = await api.role()
    secret, session_id = await api.credential(role)
    running_sql = "SELECT SLEEP(600) AS held_for_the_kill"

    def running() -> int:
        return int(mysql_target.sql(f"SELECT COUNT(*) FROM information_schema.processlist WHERE info = "
                                    f"'{running_sql}'").strip())

    def hold() -> Any:
        with connect(gateway, secret) as connection:
            return answer(connection, running_sql)

    held = asyncio.ensure_future(in_thread(hold))
    for _ in range(200):
        if running():
            break
        await asyncio.sleep(0.05)
    status, body = await api("POST", f"/sessions/{session_id}/kill")
    assert status == 200, body
    got = await asyncio.wait_for(held, 30)
    assert got[0] == 1927 and got[1].startswith("session killed by"), got
    for _ in range(200):  # MariaDB would otherwise sleep on: the gateway's KILL QUERY on a second connection
        if not running():
            break
        await asyncio.sleep(0.05)
    assert running() == 0


async def test_tls_toward_the_target_verified_by_the_roles_certificate(api, gateway, mysql_target):
    verified = await api.role(sslmode="verify-full", SSLROOTCERT=mysql_target.root_cert())
    secret, _ = await api.credential(verified)

    def cipher(secret: str) -> Any:
        with connect(gateway, secret) as connection:
            return query(connection, "SHOW SESSION STATUS LIKE 'Ssl_cipher'")

    assert (await in_thread(cipher, secret))[0][1]  # the gateway's own link to MariaDB is TLS
    from gatewayd.tls import generate_self_signed
    other = mysql_target.dir / "other"
    other.mkdir(exist_ok=True)
    generate_self_signed(other / "c.crt", other / "c.key", "someone-else")
    impostor = await api.role(sslmode="verify-ca", SSLROOTCERT=(other / "c.crt").read_text())
    with pytest.raises(pymysql.err.MySQLError) as raised:
        await in_thread(cipher, (await api.credential(impostor))[0])
    assert "TLS failed" in raised.value.args[1], raised.value.args


async def test_a_malformed_command_ends_its_session_recorded_and_the_gateway_serves_on(api, gateway):
    role = await api.role()
    secret, session_id = await api.credential(role)

    code, message = await in_thread(raw_command, gateway, secret, 0x17, b"\x01\x00", "SELECT 1")  # cut short
    assert code == 1043 and message == "protocol violation: a malformed COM_STMT_EXECUTE", (code, message)
    session = await api.done_session(session_id)
    assert session["exit_code"] == 254 and of_kind(session, "e")[-1] == message
    again, _ = await api.credential(role)
    assert await in_thread(lambda: query(connect(gateway, again), "SELECT 2")) == [(2,)]


async def test_an_anchored_mask_pattern_masks_whole_cells(api, gateway):
    """A row's cells are searched together only when no rule is anchored (``^...$`` anchors a cell)."""
    role = await api.role()
    await api.guardrail(role, output_rules=[{"type": "mask", "pattern_regex": "^secret-[0-9]+$"}])
    secret, _ = await api.credential(role)

    def work() -> list[tuple]:
        with connect(gateway, secret) as connection:
            return query(connection, "SELECT 'visible', 'secret-42', 'not secret-42'")

    assert await in_thread(work) == [("visible", "****", "not secret-42")]


async def test_com_field_list_answers_its_columns(api, gateway, people):
    role = await api.role()
    secret, _ = await api.credential(role)

    def work() -> list[str]:
        with connect(gateway, secret) as connection:
            connection._execute_command(0x04, b"masked\0")  # COM_FIELD_LIST, as the mysql client's rehash sends
            names = []
            while True:
                packet = connection._read_packet()
                if packet.is_eof_packet():
                    return names
                names.append(packet.read_length_coded_string() and codec.decode_column(packet.get_all_data()).name)

    assert await in_thread(work) == ["id", "email", "card", "ssn", "salary", "note", "born"]


@pytest.fixture
async def judge(api):
    """A provider for AI rules (tests/llmpeer.py), set for the gateway; removed after the test."""
    server = await FakeLLM().start()
    status, body = await api("PUT", "/ai/session-analyzer/providers", {
        "provider": "openai", "model": "judge-1", "api_url": f"{server.url}/v1", "api_key": API_KEY})
    assert status == 200, body
    yield server
    await api("DELETE", "/ai/session-analyzer/providers")
    await server.stop()


async def sync_rule(api: MySqlApi) -> dict:
    """A new connection under an AI rule in sync mode (high risk blocks): its statements wait for their verdicts."""
    role = await api.role()
    status, rule = await api("POST", "/ai/session-analyzer/rules", {
        "name": f"rule-{role['name']}", "connection_names": [role["name"]], "native_mode": "sync", "timeout": 60,
        "risk_evaluation": {"low_risk_action": "allow_execution", "medium_risk_action": "allow_execution",
                            "high_risk_action": "block_execution"}})
    assert status == 201, rule
    return role


async def test_an_ai_rule_in_sync_mode_holds_each_statement_for_its_verdict(api, gateway, mysql_target, judge):
    """The provider rates "high" what no guard rail refuses: the table not made proves the statement waited."""
    judge.answer("verdict", "low", "Routine query", "Reads data only.", delay=0.3)
    judge.answer_for("create table secret_ai", "high", "Creates a secret table", "The rule forbids it.")
    role = await sync_rule(api)
    secret, session_id = await api.credential(role)

    def work() -> tuple[Any, str, Any]:
        with connect(gateway, secret, autocommit=True) as connection:
            before = query(connection, "SELECT 'before'")
            refused = blocked(connection, "create table secret_ai (i int)")
            return before, refused, query(connection, "SELECT 'after'")

    before, refused, after = await in_thread(work)
    assert before == [("before",)] and after == [("after",)]
    assert "Creates a secret table" in refused, refused
    assert "secret_ai" not in tables(mysql_target)  # refused before MariaDB saw it
    session = await api.done_session(session_id, 30)
    assert session["ai_analysis"]["action"] == "block_execution"


async def test_kill_query_while_the_statement_waits_for_its_verdict_ends_it_before_the_target_has_it(
        api, gateway, mysql_target, judge):
    """KILL QUERY from a second connection while the gateway holds the statement for a sync AI rule's verdict:
    the client gets MariaDB's own answer to a killed statement, which never reaches the target; the session goes
    on, and the same statement sent again waits for its verdict again."""
    role = await sync_rule(api)
    table = f"held_{os.urandom(4).hex()}"
    with direct(mysql_target, autocommit=True) as root:
        query(root, f"CREATE TABLE {table} (i INT); INSERT INTO {table} VALUES (1)")
    statement = f"INSERT INTO {table} VALUES (2)"
    judge.hold(statement, 15)  # it would be allowed, late; every other statement is answered at once
    secret, session_id = await api.credential(role)
    first = await in_thread(connect, gateway, secret, autocommit=True)
    try:
        thread_id = first.thread_id()
        running = asyncio.ensure_future(in_thread(answer, first, statement))
        await judge.asked_about(statement)  # the gateway holds it now
        assert not running.done(), running.result()

        other_secret, _ = await api.credential(role)

        def kill() -> Any:
            with connect(gateway, other_secret) as second:
                return answer(second, f"KILL QUERY {thread_id}")

        assert await in_thread(kill) == []
        assert await asyncio.wait_for(running, 10) == (1317, "Query execution was interrupted")
        judge.answer_for(statement, "high", "Adds a row", "The rule forbids it.")
        judge.holds.clear()
        again = await in_thread(answer, first, statement)  # its verdict is asked again: refused this time
        assert again[0] == 1227 and "Adds a row" in again[1], again
        assert await in_thread(answer, first, "SELECT 40 + 2") == [(42,)]
    finally:
        first.close()
    with direct(mysql_target) as root:
        assert query(root, f"SELECT COUNT(*) FROM {table}") == [(1,)]
    session = await api.done_session(session_id, 30)
    errors = of_kind(session, "e")
    assert any("Query execution was interrupted" in e for e in errors), errors


async def test_the_connections_mysql_settings_are_checked(api):
    for settings, named in (({"mysql": {"local_infile": "yes"}}, "local_infile"),
                            ({"mysql": {"databases": "other"}}, "databases"), ({"mysql": []}, "settings.mysql")):
        status, body = await api("POST", "/connections", {
            "name": f"bad-{named.replace('.', '-')}", "type": "database", "subtype": "mysql",
            "secret": {"envvar:HOST": "MTI3LjAuMC4x"}, "settings": settings})
        assert status == 422 and named in body["message"], body


async def test_the_mariadb_clients_ctrl_c_cancels_its_statement_through_the_gateway(api, gateway, mysql_target):
    """The client's Ctrl-C opens a second connection with the same login and sends KILL QUERY <the id the
    gateway's greeting gave>: the statement ends, and the client is told so."""
    role = await api.role()
    secret, _ = await api.credential(role)
    process = await asyncio.create_subprocess_exec(
        "mariadb", "--no-defaults", "-h", "127.0.0.1", "-P", str(gateway.proxy_port), "-u", secret, "--password=any",
        "--skip-ssl", "-e", "SELECT SLEEP(60) AS held_for_ctrl_c", "app",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    for _ in range(400):  # until MariaDB runs it
        if mysql_target.sql("SELECT COUNT(*) FROM information_schema.processlist "
                            "WHERE info LIKE 'SELECT SLEEP(60) AS held_for_ctrl_c'").strip() != "0":
            break
        await asyncio.sleep(0.05)
    process.send_signal(2)  # SIGINT, as Ctrl-C
    out, err = await asyncio.wait_for(process.communicate(), 30)
    text = (out + err).decode(errors="replace")
    assert "ERROR 1317 (70100)" in text and "Query execution was interrupted" in text, text


class FileAskingTarget:
    """A target that asks for a client's file (a rogue server, or whoever answers as the target): a relay to
    MariaDB that answers ``SELECT 'rogue'`` itself with LOAD DATA LOCAL's file request for ``path``, takes
    what comes up to the empty packet that ends a file, and answers OK."""

    MARKER = b"\x03SELECT 'rogue'"

    def __init__(self, target: int, path: str) -> None:
        from tests.ports import free_port

        self.target, self.path, self.port = target, path, free_port()
        self.received: list[bytes] = []  # the file's packets the target got
        self.server: asyncio.base_events.Server | None = None

    async def __aenter__(self) -> "FileAskingTarget":
        self.server = await asyncio.start_server(self._connection, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self.server is not None
        self.server.close()

    @staticmethod
    async def _packet(reader: asyncio.StreamReader) -> tuple[int, bytes]:
        head = await reader.readexactly(4)
        return head[3], await reader.readexactly(int.from_bytes(head[:3], "little"))

    @staticmethod
    def _frame(seq: int, payload: bytes) -> bytes:
        return len(payload).to_bytes(3, "little") + bytes([seq]) + payload

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)

        async def down() -> None:
            while data := await up_reader.read(65536):
                writer.write(data)
                await writer.drain()

        pumping = asyncio.ensure_future(down())
        try:
            while True:
                seq, payload = await self._packet(reader)
                if payload != self.MARKER:
                    up_writer.write(self._frame(seq, payload))
                    continue
                writer.write(self._frame(1, b"\xfb" + self.path.encode()))  # send me this file
                while True:
                    seq, data = await self._packet(reader)
                    if not data:
                        break
                    self.received.append(data)
                writer.write(self._frame(seq + 1, b"\x00\x00\x00\x02\x00\x00\x00"))  # OK
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            pumping.cancel()
            up_writer.close()
            writer.close()


async def test_a_target_asking_for_a_file_the_connection_does_not_allow_ends_the_session(api, gateway,
                                                                                           mysql_target, tmp_path):
    secret_file = tmp_path / "client-secret.txt"
    secret_file.write_text("the client's private key\n")
    async with FileAskingTarget(mysql_target.port, str(secret_file)) as rogue:
        role = await api.role(port=rogue.port, sslmode="disable")
        secret, session_id = await api.credential(role)

        def work() -> Any:
            with connect(gateway, secret, autocommit=True, local_infile=True) as connection:
                return answer(connection, "SELECT 'rogue'")

        refused = await in_thread(work)
    # not a byte of the client's file reached the target: at most the gateway's COM_QUIT ending the target's
    # connection, which the rogue, still waiting for the file, takes for one of its packets
    assert rogue.received in ([], [b"\x01"]), rogue.received
    assert refused[0] == 1105 and "not told the client may send files" in refused[1], refused
    session = await api.done_session(session_id)
    assert session["exit_code"] == 254
    assert any("client-secret.txt" in e and "not told" in e for e in of_kind(session, "e")), of_kind(session, "e")


async def test_cli_connect_keeps_the_secret_out_of_the_process_list(api, gateway, tmp_path):
    """`gatewayd connect` ran `mysql -u SECRET ...`: for as long as the session lasted, any local user read the
    credential in `ps`. Now the mysql client reads it from an option file, 0600 in a private folder, removed
    when the client ends."""
    from tests.conftest import BIN, ROOT
    from tests.test_people_cli import client_processes

    role = await api.role()
    login = tmp_path / "login.json"
    login.touch(mode=0o600)  # as the CLI keeps it
    login.write_text(json.dumps({"default": "default", "profiles": {"default": {
        "url": gateway.url.removesuffix("/api"), "token": gateway.token("admin@example.com", groups="admin")}}}))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("GATEWAYD_", "MYSQL"))},
           "GATEWAYD_CLIENT_CONFIG": str(login)}
    running = subprocess.Popen([str(BIN / "gatewayd"), "connect", role["name"], "--", "--skip-ssl", "-N", "-e",
                                "SELECT 'in-session', SLEEP(2), 'done-here'"], env=env, cwd=ROOT, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        for _ in range(600):  # a hang guard: the client starts once the credential is issued
            clients = list(client_processes(running.pid).values())
            if clients or running.poll() is not None:
                break
            await asyncio.sleep(0.05)
        assert clients, running.communicate()
        [mysql] = clients
        assert not [arg for arg in mysql if "my-" in arg], mysql  # no secret (my-<random>)
        option_file = Path(next(arg for arg in mysql if arg.startswith("--defaults-extra-file=")).partition("=")[2])
        assert option_file.stat().st_mode & 0o777 == 0o600
        out, err = await asyncio.to_thread(running.communicate, timeout=60)
        assert running.returncode == 0 and "in-session" in out and "done-here" in out, (out, err)
        assert not option_file.parent.exists()
    finally:
        if running.poll() is None:
            running.kill()
