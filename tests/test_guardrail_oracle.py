"""The differential oracle: nothing the guard rails deny ever executes on the target, whatever the session does.

A real gatewayd in front of a real PostgreSQL 15 whose database logs what the
server actually ran: an event trigger on ``ddl_command_start`` and one on
``sql_drop``, and statement-level triggers on the guarded table.  Real clients
(psql, asyncpg, psycopg 3 in pipeline mode, pgjdbc's Fastpath) send attacks
that leave the defaults: ``standard_conforming_strings = off`` from the
start-up packet or a ``SET`` (answered or pipelined), client encodings that
are not ASCII-safe, PL/pgSQL bodies of functions that return something,
``EXECUTE`` in ``DO``, ``MERGE``, ``DROP OWNED``, another database in the
start-up packet, the fast-path FunctionCall message.  After each one the
target's own log must show no denied statement run and the guarded table
intact; every refusal is recorded as ``i`` then ``e``.  The rules are the
issue's: deny words ``drop table``, ``statement_kinds`` denying ``DropStmt``
and ``TruncateStmt``, ``require_where`` on delete.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import asyncpg
import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import clients
from tests.apiclient import PostgresApi, admin_http, events
from tests.conftest import proxy_daemon
from tests.pgpeer import unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")

DB = "oracle"
APP_PASSWORD = "app-secret-31"
ROWS = 5
RULES = [{"type": "deny_words_list", "words": ["drop table"]},
         {"type": "statement_kinds", "deny": ["DropStmt", "TruncateStmt"]},
         {"type": "require_where", "statements": ["delete"]}]
SJIS_BACKSLASH = "ソ"  # 0x83 0x5C in SJIS: its second byte is a backslash
JDBC_JARS = [Path("/usr/share/java/postgresql.jar"), *sorted(Path.home().glob(
    ".m2/repository/org/postgresql/postgresql/*/postgresql-*.jar"))]

SETUP = f"""
CREATE ROLE app LOGIN PASSWORD '{APP_PASSWORD}';
CREATE DATABASE {DB} OWNER app;
"""
# run in the oracle database, as postgres: the log and its triggers belong to the superuser
TRIGGERS = """
CREATE TABLE executed (at timestamptz DEFAULT clock_timestamp(), what text);
GRANT SELECT ON executed TO app;
CREATE FUNCTION log_ddl() RETURNS event_trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN INSERT INTO executed(what) VALUES ('ddl ' || tg_tag); END $$;
CREATE EVENT TRIGGER oracle_ddl ON ddl_command_start EXECUTE FUNCTION log_ddl();
CREATE FUNCTION log_drop() RETURNS event_trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE r record;
BEGIN FOR r IN SELECT * FROM pg_event_trigger_dropped_objects() LOOP
  INSERT INTO executed(what) VALUES ('dropped ' || r.object_type || ' ' || r.object_identity);
END LOOP; END $$;
CREATE EVENT TRIGGER oracle_drop ON sql_drop EXECUTE FUNCTION log_drop();
CREATE FUNCTION log_dml() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN INSERT INTO executed(what) VALUES (TG_OP || ' ' || TG_TABLE_NAME); RETURN NULL; END $$;
"""
VICTIM = f"""
CREATE SCHEMA IF NOT EXISTS s;
CREATE TABLE IF NOT EXISTS s.keep (id int);
CREATE TABLE IF NOT EXISTS victim (id int PRIMARY KEY, email text);
TRUNCATE victim;
INSERT INTO victim SELECT g, 'user' || g || '@example.com' FROM generate_series(1, {ROWS}) g;
CREATE OR REPLACE FUNCTION purge() RETURNS int LANGUAGE sql AS 'DELETE FROM victim RETURNING 1';
"""
STATEMENT_TRIGGER = """
DROP TRIGGER IF EXISTS victim_dml ON victim;
CREATE TRIGGER victim_dml AFTER DELETE OR UPDATE OR TRUNCATE ON victim
  FOR EACH STATEMENT EXECUTE FUNCTION log_dml();
"""
# what a server that reads the statement differently from the gateway would run; each part is denied
PAYLOAD = "delete from victim; truncate victim; drop schema s cascade"


@pytest.fixture(scope="module")
def cluster(pg_target):
    return pg_target


@pytest.fixture(scope="module")
async def oracle(cluster):
    """The oracle database: its log and triggers (as postgres), its guarded table (as app, its owner)."""
    admin = await asyncpg.connect(cluster.dsn())
    try:
        for statement in SETUP.strip().splitlines():
            await admin.execute(statement)
    finally:
        await admin.close()
    admin = await asyncpg.connect(cluster.dsn(database=DB))
    try:
        await admin.execute(TRIGGERS)
        await admin.execute(VICTIM)
        await admin.execute("ALTER TABLE victim OWNER TO app; ALTER SCHEMA s OWNER TO app; "
                            "ALTER TABLE s.keep OWNER TO app; ALTER FUNCTION purge() OWNER TO app")
        await admin.execute(STATEMENT_TRIGGER)
    finally:
        await admin.close()
    return cluster


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    daemon = proxy_daemon(tmp_path_factory, "oracle", "postgres", wait=True)
    yield daemon
    assert daemon.stop() == 0


@pytest.fixture(scope="module")
async def api(gateway, oracle):
    async with admin_http(gateway) as http:
        yield PostgresApi(gateway, http, oracle)


async def reset_target(oracle) -> None:
    """The guarded table whole again, the log of what ran empty (the triggers off while it is set up)."""
    admin = await asyncpg.connect(oracle.dsn(database=DB))
    try:
        await admin.execute("ALTER EVENT TRIGGER oracle_ddl DISABLE; ALTER EVENT TRIGGER oracle_drop DISABLE")
        await admin.execute(VICTIM + STATEMENT_TRIGGER)
        await admin.execute("ALTER TABLE victim OWNER TO app; ALTER FUNCTION purge() OWNER TO app; "
                            "ALTER EVENT TRIGGER oracle_ddl ENABLE; ALTER EVENT TRIGGER oracle_drop ENABLE; "
                            "DELETE FROM executed")
    finally:
        await admin.close()


@pytest.fixture
async def guarded(api, oracle):
    """A connection to the oracle database as app under the issue's rules; the log emptied, the table whole."""
    role = await api.role(user="app", password=APP_PASSWORD, db=DB)
    await api.guardrail(role, input_rules=RULES)
    await reset_target(oracle)
    return role


async def assert_nothing_denied_ran(oracle) -> None:
    """The target's own log: no DROP, TRUNCATE or whole-table DELETE ran; the guarded table is whole."""
    admin = await asyncpg.connect(oracle.dsn(database=DB))
    try:
        ran = [r["what"] for r in await admin.fetch("SELECT what FROM executed ORDER BY at")]
        rows = await admin.fetchval("SELECT count(*) FROM victim")
        schema = await admin.fetchval("SELECT count(*) FROM pg_namespace WHERE nspname = 's'")
    finally:
        await admin.close()
    denied = [what for what in ran if what.startswith(("dropped", "ddl DROP", "TRUNCATE", "ddl TRUNCATE"))]
    assert not denied, f"the target ran what the rules deny: {ran}"
    assert rows == ROWS and schema == 1, f"the guarded table lost rows ({rows}) or the schema is gone; log: {ran}"


async def assert_refused_on_record(api, session_id: str, fragment: str) -> None:
    """The refused statement is recorded as ``i``, then its refusal as ``e``."""
    session = await api.done_session(session_id, timeout=20)
    stream = events(session)
    index = next((i for i, (kind, text) in enumerate(stream) if kind == "i" and fragment in text), None)
    assert index is not None, f"{fragment!r} not recorded: {stream}"
    assert any(kind == "e" and "validation error" in text for kind, text in stream[index + 1:]), stream


def psql(gateway, secret: str, *commands: str | bytes, env: dict[str, str] | None = None,
         database: str = DB) -> subprocess.CompletedProcess[bytes]:
    args = [part for command in commands for part in ("-c", command)]
    return clients.psql(gateway.proxy_port, secret, "-A", "-t", *args, text=False, env=env, database=database)


async def credential(api, role) -> tuple[str, str]:
    return await api.credential(role)


# -- 1. session settings that change how the server reads a statement

ESCAPED = f"select 'a\\''; {PAYLOAD}; --'"  # one literal with the setting on; a literal, then the payload, off


async def test_standard_conforming_strings_off_from_the_start_up_packet(api, gateway, guarded, oracle):
    secret, session_id = await credential(api, guarded)
    done = psql(gateway, secret, ESCAPED, env={"PGOPTIONS": "-c standard_conforming_strings=off"})
    assert b"validation error" in done.stderr, done
    await assert_nothing_denied_ran(oracle)
    await assert_refused_on_record(api, session_id, "select 'a")


async def test_standard_conforming_strings_off_by_set_then_the_statement(api, gateway, guarded, oracle):
    secret, session_id = await credential(api, guarded)
    done = psql(gateway, secret, "set standard_conforming_strings = off", ESCAPED)
    assert b"validation error" in done.stderr, done
    await assert_nothing_denied_ran(oracle)
    await assert_refused_on_record(api, session_id, "select 'a")


async def test_set_pipelined_with_the_statement_psycopg(api, gateway, guarded, oracle):
    """The SET and the statement in one pipeline: the gateway reads the statement before any answer says the
    setting changed, so it reads it under both values."""
    secret, session_id = await credential(api, guarded)
    conninfo = f"host=127.0.0.1 port={gateway.proxy_port} dbname={DB} user={secret} password=any sslmode=disable"
    async with await psycopg.AsyncConnection.connect(conninfo, autocommit=True) as conn:
        with pytest.raises(psycopg.Error, match="validation error"):
            async with conn.pipeline():
                await conn.execute("set standard_conforming_strings = off")
                await conn.execute(f"select 'a\\''; {PAYLOAD.split(';')[0]}; --'")  # extended: one statement
    await assert_nothing_denied_ran(oracle)
    await assert_refused_on_record(api, session_id, "select 'a")


async def test_set_config_in_the_same_query_asyncpg(api, gateway, guarded, oracle):
    """set_config and then the statement, sent by asyncpg's extended protocol with no answer in between."""
    secret, _ = await credential(api, guarded)
    conn = await asyncpg.connect(host="127.0.0.1", port=gateway.proxy_port, user=secret, password="any",
                                 database=DB, ssl=False, server_settings={"standard_conforming_strings": "off"})
    try:
        with pytest.raises(asyncpg.PostgresError, match="validation error"):
            await conn.execute(ESCAPED)
        with pytest.raises(asyncpg.PostgresError, match="validation error"):
            await conn.fetch("select 'a\\''; delete from victim; --'")
    finally:
        await conn.close()
    await assert_nothing_denied_ran(oracle)


async def test_sjis_second_byte_backslash_at_the_default_setting(api, gateway, guarded, oracle):
    secret, session_id = await credential(api, guarded)
    attack = f"select E'{SJIS_BACKSLASH}'; {PAYLOAD}; --'".encode("shift_jis")
    done = psql(gateway, secret, attack, env={"PGCLIENTENCODING": "SJIS"})
    assert b"client_encoding SJIS" in done.stderr, done
    await assert_nothing_denied_ran(oracle)
    await assert_refused_on_record(api, session_id, "select E'")


async def test_sjis_set_in_a_pipeline_then_the_statement(api, gateway, guarded, oracle):
    """psycopg encodes each statement in the encoding of the moment: the SET is pipelined before the attack."""
    secret, _ = await credential(api, guarded)
    conninfo = f"host=127.0.0.1 port={gateway.proxy_port} dbname={DB} user={secret} password=any sslmode=disable"
    attack = f"select E'{SJIS_BACKSLASH}'; delete from victim; --'".encode("shift_jis")
    async with await psycopg.AsyncConnection.connect(conninfo, autocommit=True) as conn:
        with pytest.raises(psycopg.Error, match="validation error"):
            async with conn.pipeline():
                await conn.execute("set client_encoding = 'SJIS'")
                await conn.execute(attack)  # bytes, sent before the SET is answered
    await assert_nothing_denied_ran(oracle)


async def test_ascii_statements_still_pass_in_an_unreadable_encoding(api, gateway, guarded):
    secret, _ = await credential(api, guarded)
    done = psql(gateway, secret, "select count(*) from victim", "set client_encoding to 'UTF8'",
                f"select '{SJIS_BACKSLASH}'", env={"PGCLIENTENCODING": "SJIS"})
    assert done.returncode == 0, done
    assert done.stdout.decode().split() == [str(ROWS), "SET", SJIS_BACKSLASH]


async def test_a_latin1_session_is_read_in_latin1(api, gateway, guarded, oracle):
    secret, _ = await credential(api, guarded)
    done = psql(gateway, secret, "select 'caf\u00e9' as word, count(*) from victim".encode("latin-1"),
                env={"PGCLIENTENCODING": "LATIN1"})
    assert done.returncode == 0 and done.stdout.decode("latin-1").strip() == f"caf\u00e9|{ROWS}", done
    done = psql(gateway, secret, f"select 'caf\u00e9'; {PAYLOAD}".encode("latin-1"), env={"PGCLIENTENCODING": "LATIN1"})
    assert b"validation error" in done.stderr
    await assert_nothing_denied_ran(oracle)


# -- 2. PL/pgSQL bodies, DO and EXECUTE

@pytest.mark.parametrize("body", [
    "CREATE FUNCTION f_int() RETURNS int LANGUAGE plpgsql AS $$ BEGIN DELETE FROM victim; RETURN 1; END $$",
    "CREATE FUNCTION f_trg() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN TRUNCATE victim; RETURN new; END $$",
    "CREATE FUNCTION f_set() RETURNS SETOF int LANGUAGE plpgsql AS $$ BEGIN DELETE FROM victim; RETURN NEXT 1; END $$",
    "CREATE FUNCTION f_out(OUT n int) LANGUAGE plpgsql AS $$ BEGIN n := 1; TRUNCATE victim; END $$",
    # read under standard_conforming_strings off too: the body is scanned again when it runs
    "CREATE FUNCTION f_late() RETURNS int LANGUAGE plpgsql AS $$ BEGIN PERFORM 'a\\''; TRUNCATE victim; --';\n"
    " RETURN 1; END $$",
    "DO $$ BEGIN EXECUTE 'TRUNCATE victim'; END $$",
    "DO $$ BEGIN EXECUTE 'trunc' || 'ate victim'; END $$",
    "DO $$ DECLARE t text := 'victim'; BEGIN EXECUTE format('TRUNCATE %I', t); END $$",
    "CREATE FUNCTION f_py() RETURNS int LANGUAGE plpython3u AS 'plpy.execute(\"truncate victim\")'",
])
async def test_bodies_are_read_as_the_server_will_run_them(api, gateway, guarded, oracle, body):
    secret, session_id = await credential(api, guarded)
    done = psql(gateway, secret, body, "SELECT f_int()", "SELECT f_late()",
                env={"PGOPTIONS": "-c standard_conforming_strings=off"} if "f_late" in body else None)
    assert b"validation error" in done.stderr, done
    await assert_nothing_denied_ran(oracle)
    await assert_refused_on_record(api, session_id, body[:20])


async def test_a_trigger_function_and_its_trigger(api, gateway, guarded, oracle):
    secret, _ = await credential(api, guarded)
    done = psql(gateway, secret, "CREATE FUNCTION wipe() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                "DELETE FROM victim; RETURN new; END $$",
                "CREATE TRIGGER w AFTER UPDATE ON victim FOR EACH STATEMENT EXECUTE FUNCTION wipe()",
                "UPDATE victim SET email = email WHERE id = 1")
    assert b"validation error" in done.stderr, done
    await assert_nothing_denied_ran(oracle)


# -- 3. statements outside the rule's vocabulary

@pytest.mark.parametrize("sql", [
    "MERGE INTO victim v USING (SELECT 1 AS id) s ON true WHEN MATCHED THEN DELETE",
    "CREATE RULE r AS ON UPDATE TO victim DO ALSO DELETE FROM victim",
    "DROP OWNED BY CURRENT_USER",
    "ALTER TABLE victim DROP COLUMN email",
    "SELECT 1; TRUNCATE victim",
])
async def test_statements_with_the_effect_of_a_denied_kind(api, gateway, guarded, oracle, sql):
    secret, session_id = await credential(api, guarded)
    done = psql(gateway, secret, sql)
    assert b"validation error" in done.stderr, done
    await assert_nothing_denied_ran(oracle)
    await assert_refused_on_record(api, session_id, sql[:12])


async def test_a_merge_with_a_condition_on_its_delete_passes(api, gateway, guarded):
    secret, _ = await credential(api, guarded)
    done = psql(gateway, secret, "MERGE INTO victim v USING (SELECT 99 AS id) s ON v.id = s.id "
                "WHEN MATCHED AND v.id = 99 THEN DELETE")
    assert done.returncode == 0, done


async def test_another_database_in_the_start_up_packet_is_refused(api, gateway, guarded, oracle):
    secret, _ = await credential(api, guarded)
    done = psql(gateway, secret, "DROP DATABASE oracle WITH (FORCE)", database="postgres")
    assert b'database "postgres" is not reachable through connection' in done.stderr, done
    assert b"settings.postgres.databases" in done.stderr
    status, logs = await api("GET", "/audit/logs?action=postgres.login&outcome=failure&page_size=100")
    assert status == 200
    assert any('database "postgres" is not reachable' in (entry.get("error_message") or "") for entry in logs["data"])
    await assert_nothing_denied_ran(oracle)


async def test_a_connection_may_allow_other_databases(api, gateway, oracle):
    role = await api.role(user="app", password=APP_PASSWORD, db=DB, settings={"postgres": {"databases": ["postgres"]}})
    secret, _ = await api.credential(role)
    done = psql(gateway, secret, "select current_database()", database="postgres")
    assert done.returncode == 0 and done.stdout.strip() == b"postgres", done


# -- 4. the fast-path FunctionCall message

def large_object(oracle) -> int:
    done = subprocess.run(["psql", "-X", "-A", "-t", "-d", DB, "-c",
                           "select lo_from_bytea(0, convert_to(string_agg(email, ','), 'UTF8')) from victim"],
                          env=oracle.env(), capture_output=True, text=True, check=True, timeout=30)
    oid = int(done.stdout.strip())
    subprocess.run(["psql", "-X", "-d", DB, "-c", f"alter large object {oid} owner to app"], env=oracle.env(),
                   capture_output=True, check=True, timeout=30)
    return oid


async def test_lo_export_is_refused_under_input_rules_and_recorded(api, gateway, guarded, oracle, tmp_path):
    oid = large_object(oracle)
    secret, session_id = await credential(api, guarded)
    out = tmp_path / "export"
    done = psql(gateway, secret, f"\\lo_export {oid} {out}")
    assert b"fast-path function call of pg_catalog.lo_open is refused" in done.stderr, done
    assert not out.exists() or b"@example.com" not in out.read_bytes()
    session = await api.done_session(session_id, timeout=20)
    stream = events(session)
    assert any(kind == "i" and "lo_open" in text for kind, text in stream), stream
    assert any(kind == "e" and "fast-path function call" in text for kind, text in stream), stream


async def test_lo_export_through_an_allow_list_is_recorded_and_masked(api, gateway, oracle, tmp_path):
    oid = large_object(oracle)
    role = await api.role(user="app", password=APP_PASSWORD, db=DB,
                          settings={"postgres": {"function_calls": ["large_objects"]}})
    await api.guardrail(role, input_rules=RULES, output_rules=[{"type": "mask", "patterns": ["email"]}])
    secret, session_id = await api.credential(role)
    out = tmp_path / "export"
    done = psql(gateway, secret, f"\\lo_export {oid} {out}")
    assert done.returncode == 0, done
    exported = out.read_bytes()
    assert b"@example.com" not in exported and b"****" in exported
    session = await api.done_session(session_id, timeout=20)
    stream = events(session)
    assert any(kind == "i" and "pg_catalog.loread" in text for kind, text in stream), stream
    assert not any("@example.com" in text for _, text in stream)


JAVA_FASTPATH = """
import java.sql.*;
import org.postgresql.PGConnection;
import org.postgresql.fastpath.FastpathArg;
public class Fast {
    public static void main(String[] args) throws Exception {
        try (Connection c = DriverManager.getConnection(args[0])) {
            c.setAutoCommit(true);
            int oid = Integer.parseInt(args[1]);
            try {
                ((PGConnection) c).getFastpathAPI().fastpath(oid, false, new FastpathArg[0]);
                System.out.println("called");
            } catch (SQLException e) {
                System.out.println("refused: " + e.getMessage());
            }
        }
    }
}
"""


async def test_a_function_call_that_deletes_every_row_is_refused_and_recorded(api, gateway, guarded, oracle,
                                                                              tmp_path):
    jar = next((path for path in JDBC_JARS if path.exists()), None)
    if shutil.which("java") is None or jar is None:
        pytest.skip("pgjdbc needs java and its driver (default-jre-headless, libpostgresql-jdbc-java: tests/peers.txt)")
    admin = await asyncpg.connect(oracle.dsn(database=DB))
    try:
        purge = await admin.fetchval("SELECT 'purge()'::regprocedure::oid::int")
    finally:
        await admin.close()
    secret, session_id = await credential(api, guarded)
    source = tmp_path / "Fast.java"
    source.write_text(JAVA_FASTPATH)
    url = f"jdbc:postgresql://127.0.0.1:{gateway.proxy_port}/{DB}?user={secret}&password=any&sslmode=disable"
    done = await asyncio.to_thread(subprocess.run, ["java", "-cp", str(jar), str(source), url, str(purge)],
                                   capture_output=True, text=True, timeout=120, check=False)
    assert "refused:" in done.stdout and "fast-path function call" in done.stdout, (done.stdout, done.stderr)
    await assert_nothing_denied_ran(oracle)
    session = await api.done_session(session_id, timeout=20)
    stream = events(session)
    assert any(kind == "i" and f"function OID {purge}" in text for kind, text in stream), stream


async def test_function_calls_without_rules_are_recorded(api, gateway, oracle, tmp_path):
    oid = large_object(oracle)
    role = await api.role(user="app", password=APP_PASSWORD, db=DB)
    secret, session_id = await api.credential(role)
    out = tmp_path / "export"
    done = psql(gateway, secret, f"\\lo_export {oid} {out}")
    assert done.returncode == 0, done
    session = await api.done_session(session_id, timeout=20)
    stream = events(session)
    assert [text for kind, text in stream if kind == "i" and "fast-path FunctionCall" in text], stream
    assert any(kind == "o" and "@example.com" in text for kind, text in stream), stream


# -- 6. cost on the loop

async def test_long_and_deep_statements_neither_stall_others_nor_drop_the_client(api, gateway, guarded, oracle):
    """A statement over 64 KiB is read in a worker thread (another session's ``select 1`` goes on; its latencies
    are printed, never asserted); one over ``postgres.max_statement_bytes`` (1 MiB) is refused with a clear error;
    one too deep for the gateway to read is refused, recorded, and the session goes on."""
    secret, session_id = await credential(api, guarded)
    bystander_role = await api.role(user="app", password=APP_PASSWORD, db=DB)
    bystander_secret, _ = await api.credential(bystander_role)
    connect = dict(host="127.0.0.1", port=gateway.proxy_port, password="any", database=DB, ssl=False, timeout=15)
    bystander = await asyncpg.connect(user=bystander_secret, **connect)
    conn = await asyncpg.connect(user=secret, **connect, command_timeout=120)
    latencies: list[float] = []
    done = asyncio.Event()

    async def keep_working() -> None:
        loop = asyncio.get_running_loop()
        while not done.is_set():
            start = loop.time()
            assert await bystander.fetchval("select 1") == 1
            latencies.append(loop.time() - start)
            await asyncio.sleep(0.005)

    worker = asyncio.create_task(keep_working())
    try:
        rows = ", ".join(f"({i}, 'row {i}')" for i in range(40000))  # about 700 KB
        long = f"select count(*) from (values {rows}) v(a, b)"
        assert 64 * 1024 < len(long) < 1024 * 1024
        assert await conn.fetchval(long) == 40000  # extended protocol: a Parse read in a thread
        await conn.execute(long.replace("select count(*)", "select 1 from victim where id = 1 and 1 in (select a"
                                        ).replace(" v(a, b)", " v(a, b))"))  # simple protocol: a Query
        too_long = "select 1 where 'x' = '" + "x" * (1024 * 1024 + 10) + "'"
        with pytest.raises(asyncpg.PostgresError, match="postgres.max_statement_bytes = 1048576"):
            await conn.execute(too_long)
        # deep enough for every Python the project runs on (3.12 reads 600 terms whole, 3.13 2,000)
        deep = "select 1; delete from victim where id = " + " + ".join(["1"] * 5000)
        with pytest.raises(asyncpg.PostgresError, match="nested too deeply"):
            await conn.execute(deep)
        assert await conn.fetchval("select count(*) from victim") == ROWS  # the session goes on
    finally:
        done.set()
        await worker
        await conn.close()
        await bystander.close()
    latencies.sort()
    print(f"bystander select 1 during long statements: {len(latencies)} queries, "
          f"median {latencies[len(latencies) // 2] * 1000:.1f} ms, max {latencies[-1] * 1000:.1f} ms")
    await assert_nothing_denied_ran(oracle)
    session = await api.done_session(session_id, timeout=20)
    stream = events(session)
    for fragment, error in (("select 1 where 'x'", "max_statement_bytes"), ("select 1; delete", "too deeply")):
        index = next(i for i, (kind, text) in enumerate(stream) if kind == "i" and text.startswith(fragment))
        assert any(kind == "e" and error in text for kind, text in stream[index + 1:]), stream


async def test_postgres_connection_settings_are_checked(api):
    for settings, says in [({"postgres": {"function_calls": ["lo_open", "pg_sleep"]}}, "unknown function 'pg_sleep'"),
                           ({"postgres": {"databases": "postgres"}}, "settings.postgres.databases"),
                           ({"postgres": []}, "settings.postgres")]:
        status, body = await api("POST", "/connections", {
            "name": f"pg-bad-{len(says)}", "type": "database", "subtype": "postgres",
            "secret": {"envvar:HOST": "MTI3LjAuMC4x"}, "settings": settings})
        assert status == 422 and says in body["message"], body


# -- generated: literals that read differently under the session's settings, then a payload

LITERAL_BODY = st.lists(st.sampled_from(["a", "\\", "''", "\\'", " ", ";", "--", "\n", "/*", "*/", "$$"]),
                        max_size=5).map("".join)
LITERAL = st.tuples(st.sampled_from(["", "E", "N"]), LITERAL_BODY).map(lambda p: f"{p[0]}'{p[1]}'")
ATTACK = st.tuples(st.lists(LITERAL, min_size=1, max_size=3), st.sampled_from(PAYLOAD.split("; ")),
                   st.sampled_from([" --'", "'", " /*'", ""])).map(
    lambda p: f"select {', '.join(p[0])}; {p[1]};{p[2]}")


@pytest.fixture(scope="module")
async def fuzzed(api, oracle, gateway):
    """Two sessions on one guarded connection: the default settings, and standard_conforming_strings off."""
    role = await api.role(user="app", password=APP_PASSWORD, db=DB)
    await api.guardrail(role, input_rules=RULES)
    await reset_target(oracle)
    sessions = []
    for options in ({}, {"standard_conforming_strings": "off", "escape_string_warning": "off"}):
        secret, _ = await api.credential(role)
        sessions.append(await asyncpg.connect(host="127.0.0.1", port=gateway.proxy_port, user=secret,
                                              password="any", database=DB, ssl=False, server_settings=options))
    yield sessions
    for conn in sessions:
        await conn.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(attack=ATTACK, off=st.booleans(), extended=st.booleans())
async def test_generated_attacks_never_run_a_denied_statement(fuzzed, oracle, attack, off, extended):
    conn = fuzzed[off]
    try:
        if extended:
            await conn.fetch(attack)  # Parse: one statement, or the target refuses it
        else:
            await conn.execute(attack)  # Query: every statement of it
    except (asyncpg.PostgresError, asyncpg.InterfaceError):
        pass
    await assert_nothing_denied_ran(oracle)
