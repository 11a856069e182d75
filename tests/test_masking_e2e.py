"""End to end: masking rules through a real gatewayd to a real PostgreSQL 15, read by psql, asyncpg and pgjdbc.

Each test checks that the clear value reaches neither the client, the recording
(the session's event stream) nor the daemon's log.
"""

from __future__ import annotations

import asyncio
import base64
import shutil
import subprocess
import uuid
from pathlib import Path

import asyncpg
import pytest

from proxies.postgres import codec as pg
from tests import clients
from tests.apiclient import PostgresApi, admin_http, of_kind
from tests.conftest import proxy_daemon
from tests.pgpeer import unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")

CARD = "4111111111111111"
BAD_CARD = "4111111111111112"  # fails Luhn: left alone
EMAIL = "jane.doe@example.com"
SSN = "078-05-1120"
CLEAR = (CARD, EMAIL, SSN)
JDBC_JARS = [Path("/usr/share/java/postgresql.jar"),  # Debian's libpostgresql-jdbc-java (tests/peers.txt)
             *sorted(Path.home().glob(".m2/repository/org/postgresql/postgresql/*/postgresql-*.jar"))]

DETECTORS = {"type": "mask", "patterns": ["card_number", "email"]}
BY_COLUMN = {"type": "mask", "columns": ["ssn", "salary"], "style": "last4"}


@pytest.fixture(scope="module")
def cluster(pg_target):
    """The session's PostgreSQL target (conftest): this module's tables have names of their own."""
    return pg_target


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    daemon = proxy_daemon(tmp_path_factory, "masking", "postgres")
    daemon.pg_port = daemon.proxy_port
    yield daemon
    assert daemon.stop() == 0


@pytest.fixture(scope="module")
async def api(gateway, cluster):
    async with admin_http(gateway) as http:
        yield PostgresApi(gateway, http, cluster)


@pytest.fixture(scope="module")
async def table(cluster):
    """``people``: a note with a card number, an e-mail, an SSN, a salary (int), a card number as bigint."""
    name = f"people_{uuid.uuid4().hex[:6]}"
    connection = await asyncpg.connect(cluster.dsn())
    await connection.execute(f"""
        CREATE TABLE {name} (id int, note text, email varchar(80), ssn text, salary int, card bigint, doc jsonb);
        INSERT INTO {name} VALUES
          (1, 'paid with {CARD}', '{EMAIL}', '{SSN}', 98765, {CARD}, '{{"mail": "{EMAIL}"}}'),
          (2, 'not a card {BAD_CARD}', 'none', NULL, 1, {BAD_CARD}, '{{}}')""")
    await connection.close()
    return name


async def masked_role(api: PostgresApi, *rules: dict) -> tuple[dict, str, str]:
    role = await api.role()
    await api.guardrail(role, output_rules=list(rules))
    secret, session_id = await api.credential(role)
    return role, secret, session_id


def psql(gateway, secret: str, *args: str) -> subprocess.CompletedProcess[str]:
    return clients.psql(gateway.pg_port, secret, "-At", *args)


async def assert_nowhere_in_clear(api: PostgresApi, session_id: str, *seen_by_client: str) -> dict:
    """The clear values are in none of the client's output, the recording or the daemon's log."""
    session = await api.done_session(session_id)
    status, utf8 = await api("GET", f"/sessions/{session_id}?event_stream=utf8")
    assert status == 200
    recorded = "".join(of_kind(session, "o")) + str(utf8["event_stream"])
    log = api.daemon.log_path.read_text(errors="replace")
    for clear in CLEAR:
        for text in (*seen_by_client, recorded, log):
            assert clear not in text
    assert "****" in recorded or "#" in recorded
    return session


async def test_psql_text_rows_are_masked_and_flow_on(api, gateway, table):
    _, secret, session_id = await masked_role(api, DETECTORS, BY_COLUMN)
    done = psql(gateway, secret, "-c", f"select id, note, email, ssn, salary, card, doc from {table} order by id")
    assert done.returncode == 0 and "42501" not in done.stderr, done.stderr
    lines = done.stdout.splitlines()
    # salary (int4) masked by name: NULL (empty in -A); card bigint matched by detector: NULL
    assert lines[0] == '1|paid with ****|****|*******1120|||{"mail": "****"}'
    assert lines[1] == f"2|not a card {BAD_CARD}|none|||{BAD_CARD}|{{}}"
    session = await assert_nowhere_in_clear(api, session_id, done.stdout, done.stderr)
    assert session["metrics"]["masked"] == 7  # note, email, ssn, salary, card, doc; salary of row 2


async def test_a_column_masked_by_name_stays_masked_under_an_alias_a_subquery_and_a_cte(api, gateway, table):
    """The RowDescription names what the query calls a column; its source (table OID, column number) is the column."""
    _, secret, session_id = await masked_role(api, BY_COLUMN)
    queries = [f"select ssn as x, salary as pay from {table} where id = 1",
               f"select y from (select ssn as y from {table} where id = 1) sub",
               f"with c as (select ssn as z from {table} where id = 1) select z as w from c",
               f'select "SSN" from (select ssn as "SSN" from {table} where id = 1) q']
    done = psql(gateway, secret, *[arg for query in queries for arg in ("-c", query)])
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["*******1120|", "*******1120", "*******1120", "*******1120"]
    await assert_nowhere_in_clear(api, session_id, done.stdout, done.stderr)


async def test_psql_copy_to_stdout_is_masked_by_pattern(api, gateway, table):
    _, secret, session_id = await masked_role(api, DETECTORS)
    done = psql(gateway, secret, "-c", f"copy (select id, note, email from {table} order by id) to stdout")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["1\tpaid with ****\t****", f"2\tnot a card {BAD_CARD}\tnone"]
    await assert_nowhere_in_clear(api, session_id, done.stdout)


async def test_copy_under_a_column_rule_is_withheld(api, gateway, table):
    _, secret, session_id = await masked_role(api, BY_COLUMN)
    done = psql(gateway, secret, "-c", f"copy (select ssn from {table}) to stdout")
    assert "cannot read COPY output" in done.stderr and SSN not in done.stdout
    await api.done_session(session_id)


async def test_asyncpg_binary_results_and_a_prepared_statement(api, gateway, table):
    _, secret, session_id = await masked_role(api, DETECTORS, BY_COLUMN)
    connection = await asyncpg.connect(host="127.0.0.1", port=gateway.pg_port, user=secret, password="any",
                                       database="postgres", timeout=15)
    try:
        rows = await connection.fetch(f"select id, note, email, ssn, salary, card, doc from {table} order by id")
        statement = await connection.prepare(f"select email, salary, note from {table} where id = $1")
        prepared = [await statement.fetchrow(1) for _ in range(3)]  # the same named statement, executed again
    finally:
        await connection.close()
    first = dict(rows[0])
    assert first == {"id": 1, "note": "paid with ****", "email": "****", "ssn": "*******1120", "salary": None,
                     "card": None, "doc": '{"mail": "****"}'}
    assert dict(rows[1])["card"] == int(BAD_CARD) and dict(rows[1])["salary"] is None
    assert all(dict(row) == {"email": "****", "salary": None, "note": "paid with ****"} for row in prepared)
    await assert_nowhere_in_clear(api, session_id, repr([dict(r) for r in rows]), repr(prepared))


JAVA = """
import java.sql.*;
public class Masked {
    public static void main(String[] args) throws Exception {
        try (Connection c = DriverManager.getConnection(args[0])) {
            PreparedStatement s = c.prepareStatement("select email, salary, ssn from " + args[1] + " where id = ?");
            for (int i = 0; i < 3; i++) {
                s.setInt(1, 1);
                try (ResultSet r = s.executeQuery()) {
                    while (r.next()) System.out.println(r.getString(1) + "|" + r.getObject(2) + "|" + r.getString(3));
                }
            }
        }
    }
}
"""


async def test_jdbc_extended_protocol_prepared_statement(api, gateway, table, tmp_path):
    jar = next((path for path in JDBC_JARS if path.exists()), None)
    if shutil.which("java") is None or jar is None:
        pytest.skip("pgjdbc needs java and its driver (default-jre-headless, libpostgresql-jdbc-java: tests/peers.txt)")
    _, secret, session_id = await masked_role(api, DETECTORS, BY_COLUMN)
    source = tmp_path / "Masked.java"
    source.write_text(JAVA)
    url = (f"jdbc:postgresql://127.0.0.1:{gateway.pg_port}/postgres?user={secret}&password=any&sslmode=disable"
           f"&prepareThreshold=1")  # a named server-side statement from the first run, binary ints
    done = subprocess.run(["java", "-cp", str(jar), str(source), url, table], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["****|null|*******1120"] * 3
    await assert_nowhere_in_clear(api, session_id, done.stdout, done.stderr)


async def test_a_deny_output_rule_still_cuts_beside_a_mask(api, gateway, table):
    _, secret, session_id = await masked_role(api, DETECTORS, {"type": "pattern_match", "pattern_regex": "98765"})
    done = psql(gateway, secret, "-c", f"select note, salary from {table} order by id")
    assert "42501" in done.stderr or "validation error" in done.stderr
    await api.done_session(session_id)


async def test_guardrail_api_validates_mask_rules(api):
    role = await api.role()
    for rule, named in [({"type": "mask"}, "needs 'patterns'"), ({"type": "mask", "patterns": ["phone"]}, "phone"),
                        ({"type": "mask", "pattern_regex": "(?=x)"}, "lookahead"),
                        ({"type": "mask", "columns": ["a"], "style": "blur"}, "style")]:
        status, body = await api("POST", "/guardrails", {"name": f"m-{uuid.uuid4().hex[:6]}",
                                                          "connection_ids": [role["id"]],
                                                          "output": {"rules": [rule]}})
        assert status == 400 and named in body["message"], body


async def test_datamasking_rules_crud_and_masking(api, gateway, table):
    role = await api.role()
    name = f"dm-{uuid.uuid4().hex[:6]}"
    body = {"name": name, "description": "cards and mail", "connection_ids": [role["id"]],
            "supported_entity_types": [{"name": "PII", "entity_types": ["CREDIT_CARD", "EMAIL_ADDRESS"]}],
            "custom_entity_types": [{"name": "SSN_ISH", "regex": r"\d{3}-\d{2}-\d{4}", "score": 0.9}],
            "score_threshold": 0.5}
    status, rule = await api("POST", "/datamasking-rules", body)
    assert status == 201, rule
    assert rule["name"] == name and rule["connection_ids"] == [role["id"]] and rule["score_threshold"] == 0.5
    assert (await api("POST", "/datamasking-rules", body))[0] == 409
    assert rule["id"] in [r["id"] for r in (await api("GET", "/datamasking-rules"))[1]]
    assert rule["id"] not in [r["id"] for r in (await api("GET", "/guardrails"))[1]]
    assert (await api("GET", f"/guardrails/{rule['id']}"))[0] == 404
    status, bad = await api("POST", "/datamasking-rules", {**body, "name": "x",
                                                             "supported_entity_types": [
                                                                 {"name": "p", "entity_types": ["PERSON"]}]})
    assert status == 400 and "PERSON" in bad["message"]
    status, bad = await api("POST", "/datamasking-rules", {**body, "name": "y", "custom_entity_types": [
        {"name": "c", "regex": "(a)\\1"}]})
    assert status == 400 and "backreferences" in bad["message"]

    secret, session_id = await api.credential(role)
    done = psql(gateway, secret, "-c", f"select note, email, ssn from {table} where id = 1")
    assert done.stdout.strip() == "paid with ****|****|****", done.stderr
    await assert_nowhere_in_clear(api, session_id, done.stdout)

    status, put = await api("PUT", f"/datamasking-rules/{rule['id']}", {**body, "custom_entity_types": []})
    assert status == 200 and put["custom_entity_types"] == []
    assert (await api("GET", f"/datamasking-rules/{rule['id']}"))[1]["custom_entity_types"] == []
    secret, session_id = await api.credential(role)
    done = psql(gateway, secret, "-c", f"select ssn from {table} where id = 1")
    assert done.stdout.strip() == SSN  # the custom entity is gone
    await api.done_session(session_id)
    assert (await api("DELETE", f"/datamasking-rules/{rule['id']}"))[0] == 204
    assert (await api("GET", f"/datamasking-rules/{rule['id']}"))[0] == 404
    status, logs = await api("GET", "/audit/logs?action=datamasking.create")
    assert status == 200 and logs["data"], logs


async def test_hash_style_is_keyed_and_stable_across_sessions(api, gateway, table):
    rule = {"type": "mask", "patterns": ["email"], "style": "hash"}
    role, secret, session_id = await masked_role(api, rule)
    first = psql(gateway, secret, "-c", f"select email from {table} where id = 1").stdout.strip()
    await api.done_session(session_id)
    secret, session_id = await api.credential(role)
    again = psql(gateway, secret, "-c", f"select email from {table} where id = 1").stdout.strip()
    assert first == again and first.startswith("#") and len(first) == 17
    import hashlib
    assert hashlib.sha256(EMAIL.encode()).hexdigest()[:16] != first[1:]  # keyed, not a plain hash
    await assert_nowhere_in_clear(api, session_id, first)


async def test_a_one_time_script_answer_is_masked(api, table):
    role, _, _ = await masked_role(api, DETECTORS, BY_COLUMN)
    status, body = await api("POST", "/sessions", {"connection": role["name"],
                                                    "script": f"select note, email, ssn from {table} where id = 1"})
    assert status in (200, 201), body
    assert "paid with ****" in body["output"] and "*******1120" in body["output"], body
    session = await assert_nowhere_in_clear(api, body["session_id"], body["output"])
    assert session["metrics"]["masked"] == 3


async def test_a_value_quoted_in_an_error_is_masked(api, gateway, table):
    _, secret, session_id = await masked_role(api, DETECTORS)
    done = psql(gateway, secret, "-c", f"select email::int from {table} where id = 1",
                "-c", f"do $$ begin raise notice 'mail %', (select email from {table} where id = 1); end $$")
    assert 'invalid input syntax for type integer: "****"' in done.stderr, done.stderr
    assert "NOTICE:  mail ****" in done.stderr, done.stderr
    await assert_nowhere_in_clear(api, session_id, done.stdout, done.stderr)


async def test_record_clear_keeps_the_clear_text_sealed_for_admins(api, gateway, table):
    rule = {**DETECTORS, "record_clear": True}
    _, secret, session_id = await masked_role(api, rule)
    done = psql(gateway, secret, "-c", f"select note, email from {table} where id = 1")
    assert done.stdout.strip() == "paid with ****|****", done.stderr
    await assert_nowhere_in_clear(api, session_id, done.stdout)  # the recording and the log stay masked
    for path in gateway.data_dir.rglob("*"):  # in the store, only sealed
        if path.is_file():
            assert EMAIL.encode() not in path.read_bytes(), path
    status, unmasked = await api("POST", f"/sessions/{session_id}/unmasked")
    assert status == 200, unmasked
    clear = [base64.b64decode(data).decode() for _, kind, data in unmasked["event_stream"]]
    assert clear == [f"paid with {CARD}\t{EMAIL}"]
    user = gateway.token("someone@example.com", groups="dev")
    assert (await api("POST", f"/sessions/{session_id}/unmasked", token=user))[0] == 403
    _, logs = await api("GET", "/audit/logs?action=sessions.unmasked")
    assert any(entry["outcome"] == "success" for entry in logs["data"]), logs


async def test_a_mask_rule_added_while_a_session_runs_masks_its_next_results(api, gateway, table):
    """A rule change reaches live sessions (the bus): the relay masks by the rules the session now has."""
    import asyncio
    import time

    role = await api.role()
    secret, session_id = await api.credential(role)
    connection = await asyncpg.connect(host="127.0.0.1", port=gateway.pg_port, user=secret, password="any",
                                       database="postgres", ssl=False)
    try:
        query = f"select ssn from {table} where id = 1"
        assert await connection.fetchval(query) == SSN  # no rule yet
        await api.guardrail(role, output_rules=[BY_COLUMN])
        deadline = time.monotonic() + 20
        while (seen := await connection.fetchval(query)) == SSN and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert seen == "*******1120"
        query = f"select ssn, note as other from {table} where id = 1"  # (a computed column would be masked)
        while (row := await connection.fetchrow(query))["other"] != f"paid with {CARD}" and (
                time.monotonic() < deadline):
            await asyncio.sleep(0.05)  # the catalog lookup of the rule's column names (fail closed meanwhile)
        assert (row["ssn"], row["other"]) == ("*******1120", f"paid with {CARD}")  # by the rule, not failing closed
        renamed = await connection.fetchval(f"select ssn as renamed from {table} where id = 1")
        assert renamed == "*******1120"  # a column named by a rule added mid-session is found under an alias too
    finally:
        await connection.close()


async def test_asyncpg_without_its_statement_cache_gets_columns_masked_by_name_only(api, gateway, table):
    """It parses each statement twice (prepare, then execute): the second Parse keeps what Describe said."""
    _, secret, session_id = await masked_role(api, BY_COLUMN)
    connection = await asyncpg.connect(host="127.0.0.1", port=gateway.pg_port, user=secret, password="any",
                                       database="postgres", ssl=False, statement_cache_size=0)
    try:
        row = await connection.fetchrow(f"select ssn as renamed, id as other, note from {table} where id = 1")
    finally:
        await connection.close()
    assert (row["renamed"], row["other"]) == ("*******1120", 1)  # not every value masked (failing closed)
    assert row["note"] == f"paid with {CARD}"  # no pattern rule here


# -- binary containers: arrays, records, composites, ranges, multiranges, domains (issue 29)


@pytest.fixture(scope="module")
async def typed(cluster, table):
    """``typed_*``: a table of the database's own types holding the clear values, beside ``people``."""
    suffix = uuid.uuid4().hex[:6]
    names = {"name": f"typed_{suffix}", "mail": f"mail_{suffix}", "mood": f"mood_{suffix}",
             "contact": f"contact_{suffix}", "textrange": f"textrange_{suffix}", "opaque": f"opaque_{suffix}"}
    connection = await asyncpg.connect(cluster.dsn())
    await connection.execute(f"""
        CREATE EXTENSION IF NOT EXISTS hstore;
        CREATE DOMAIN {names['mail']} AS text;
        CREATE TYPE {names['mood']} AS ENUM ('calm', '{EMAIL}');
        CREATE TYPE {names['contact']} AS (mail {names['mail']}, card int8, tags text[]);
        CREATE TYPE {names['textrange']} AS RANGE (subtype = text);
        CREATE TYPE {names['opaque']};
        CREATE FUNCTION {names['opaque']}_in(cstring) RETURNS {names['opaque']} AS 'int4in' LANGUAGE internal STRICT;
        CREATE FUNCTION {names['opaque']}_out({names['opaque']}) RETURNS cstring AS 'int4out' LANGUAGE internal STRICT;
        CREATE FUNCTION {names['opaque']}_recv(internal) RETURNS {names['opaque']} AS 'int4recv' LANGUAGE internal STRICT;
        CREATE FUNCTION {names['opaque']}_send({names['opaque']}) RETURNS bytea AS 'int4send' LANGUAGE internal STRICT;
        CREATE TYPE {names['opaque']} (input = {names['opaque']}_in, output = {names['opaque']}_out,
                                       receive = {names['opaque']}_recv, send = {names['opaque']}_send,
                                       internallength = 4, passedbyvalue, alignment = int4);
        CREATE TABLE {names['name']} (id int, mails {names['mail']}[], mood {names['mood']}, contact {names['contact']},
                                      span {names['textrange']}, kv hstore, opaque {names['opaque']});
        INSERT INTO {names['name']} VALUES
          (1, ARRAY['{EMAIL}', 'x'], '{EMAIL}', ROW('{EMAIL}', {CARD}, ARRAY['a', '{EMAIL}'])::{names['contact']},
           {names['textrange']}('a', '{EMAIL}'), '"k"=>"{EMAIL}"', '7');""")
    await connection.close()
    return names


async def test_asyncpg_binary_containers_are_masked_element_by_element(api, gateway, table, typed):
    """asyncpg reads every result in binary: arrays, records, composites, ranges, multiranges and domains are
    decoded by their types (the catalog's for the database's own) and masked value by value."""
    _, secret, session_id = await masked_role(api, DETECTORS)
    connection = await asyncpg.connect(host="127.0.0.1", port=gateway.pg_port, user=secret, password="any",
                                       database="postgres", ssl=False, timeout=15)
    try:
        row = await connection.fetchrow(f"""
            select array[email, 'x'] as mails, array[card, 7] as cards, row(email, card, 'ok') as rec,
                   int8range(card, card + 1) as span, int8multirange(int8range(card, card + 1)) as spans,
                   array[row(email, 1)::record] as recs, array[[note], ['y']] as grid
            from {table} where id = 1""")
        own = await connection.fetchrow(f"select mails, contact, span, array[contact] as contacts from {typed['name']}")
        untouched = await connection.fetchval("select array['plain', 'text']")
    finally:
        await connection.close()
    assert row["mails"] == ["****", "x"]
    assert row["cards"] == [None, 7]  # an int8 element cannot hold '****': NULL
    assert tuple(row["rec"]) == ("****", None, "ok")
    assert row["span"] is None and row["spans"] is None  # a range bound cannot be NULL: the range is
    assert [tuple(r) for r in row["recs"]] == [("****", 1)]
    assert row["grid"] == [["paid with ****"], ["y"]]
    assert own["mails"] == ["****", "x"]  # an array of a domain over text
    assert tuple(own["contact"]) == ("****", None, ["a", "****"])  # a composite, its domain and array fields
    assert own["span"] is None  # a range of text with a masked bound
    assert [tuple(c) for c in own["contacts"]] == [("****", None, ["a", "****"])]
    assert untouched == ["plain", "text"]
    await assert_nowhere_in_clear(api, session_id, repr(dict(row)), repr(dict(own)))


async def test_psycopg_binary_results_and_a_type_it_cannot_read_is_withheld(api, gateway, table, typed):
    """psycopg 3 with ``binary=True`` asks for every column in binary: a value of a type the masker cannot read
    (hstore's own format, a base type sent as a bare int4) is withheld -- NULL, and a notice says why."""
    import psycopg

    _, secret, session_id = await masked_role(api, DETECTORS)
    notices: list[str] = []
    async with await psycopg.AsyncConnection.connect(host="127.0.0.1", port=gateway.pg_port, user=secret,
                                                     password="any", dbname="postgres", sslmode="disable") as conn:
        conn.add_notice_handler(lambda diag: notices.append(diag.message_primary or ""))
        async with conn.cursor(binary=True) as cursor:
            await cursor.execute(f"select array[email] as a, row(email, 2) as r, id, note from {table} where id = %s",
                                 (1,))
            first = await cursor.fetchone()
            await cursor.execute(f"select kv, opaque, mails, id from {typed['name']}")
            second = await cursor.fetchone()
    assert first == (["****"], ("****", 2), 1, "paid with ****")
    assert second[0] is None and second[1] is None and second[3] == 1
    assert b"****" in second[2]  # an array of a domain psycopg has no loader for: its bytes, masked
    assert any("withheld" in notice and "is not known" in notice for notice in notices), notices
    session = await assert_nowhere_in_clear(api, session_id, repr(first), repr(second), repr(notices))
    assert any("withheld" in text for text in of_kind(session, "e"))


JAVA_ARRAYS = """
import java.sql.*;
import java.util.Arrays;
public class Arrays2 {
    public static void main(String[] args) throws Exception {
        try (Connection c = DriverManager.getConnection(args[0])) {
            PreparedStatement s = c.prepareStatement(
                "select array[email, 'x']::text[], array[card, 7]::int8[], array[note]::varchar[] from " + args[1]
                + " where id = ?");
            for (int i = 0; i < 2; i++) {
                s.setInt(1, 1);
                try (ResultSet r = s.executeQuery()) {
                    while (r.next()) System.out.println(Arrays.toString((Object[]) r.getArray(1).getArray()) + "|"
                        + Arrays.toString((Object[]) r.getArray(2).getArray()) + "|"
                        + Arrays.toString((Object[]) r.getArray(3).getArray()));
                }
            }
        }
    }
}
"""


async def test_jdbc_binary_transfer_of_arrays(api, gateway, table, tmp_path):
    jar = next((path for path in JDBC_JARS if path.exists()), None)
    if shutil.which("java") is None or jar is None:
        pytest.skip("pgjdbc needs java and its driver (default-jre-headless, libpostgresql-jdbc-java: tests/peers.txt)")
    _, secret, session_id = await masked_role(api, DETECTORS)
    source = tmp_path / "Arrays2.java"
    source.write_text(JAVA_ARRAYS)
    url = (f"jdbc:postgresql://127.0.0.1:{gateway.pg_port}/postgres?user={secret}&password=any&sslmode=disable"
           "&prepareThreshold=-1&binaryTransferEnable=TEXT_ARRAY,INT8_ARRAY,VARCHAR_ARRAY")
    done = subprocess.run(["java", "-cp", str(jar), str(source), url, table], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["[****, x]|[null, 7]|[paid with ****]"] * 2
    await assert_nowhere_in_clear(api, session_id, done.stdout, done.stderr)


# -- what the target names after data: settings, channels, error fields, column names (issue 29)


async def test_settings_channels_error_fields_and_column_names_built_from_data_are_masked(api, gateway, table):
    """The e-mail never appears in what the user typed: the target takes it from the table into a setting
    (``set_config``), a notification channel, a column name in an error, and a view's column name."""
    suffix = uuid.uuid4().hex[:6]
    role, secret, session_id = await masked_role(api, DETECTORS)
    mail = f"(select email from {table} where id = 1)"
    done = psql(gateway, secret, "-v", "VERBOSITY=verbose",
                "-c", f"do $$ begin execute format('listen %I', {mail}); perform pg_notify({mail}, 'hi'); end $$",
                "-c", f"do $$ begin execute format('create table nn_{suffix} (%I int not null)', {mail}); end $$",
                "-c", f"insert into nn_{suffix} values (null)")
    assert 'Asynchronous notification "****" with payload "hi"' in done.stdout, done.stdout + done.stderr
    assert "COLUMN NAME:  ****" in done.stderr, done.stderr
    await assert_nowhere_in_clear(api, session_id, done.stdout, done.stderr)
    secret, session_id = await api.credential(role)
    connection = await asyncpg.connect(host="127.0.0.1", port=gateway.pg_port, user=secret, password="any",
                                       database="postgres", ssl=False, timeout=15)
    try:
        await connection.execute(f"select set_config('application_name', email, false) from {table} where id = 1")
        application = connection.get_settings().application_name
        await connection.execute(f"do $$ begin execute format('create view v_{suffix} as select 1 as %I', {mail}); "
                                 "end $$")
        row = await connection.fetchrow(f"select * from v_{suffix}")
    finally:
        await connection.close()
    assert application == "****"
    assert list(row.keys()) == ["****"]
    session = await assert_nowhere_in_clear(api, session_id, application, repr(list(row.keys())))
    assert "****" in "".join(of_kind(session, "o"))  # the view's masked column name is the recorded header


async def test_a_renamed_column_stays_masked_for_later_sessions_and_within_a_session(api, gateway, cluster):
    """A rule by column name follows the column's identity (table OID, column number): remembered from the
    session that saw it for the next ones, and learned from a result for a table made during the session."""
    name = f"renamed_{uuid.uuid4().hex[:6]}"
    direct = await asyncpg.connect(cluster.dsn())
    await direct.execute(f"create table {name} (id int, ssn text); insert into {name} values (1, '{SSN}')")
    role, secret, session_id = await masked_role(api, BY_COLUMN)
    assert psql(gateway, secret, "-c", f"select ssn from {name}").stdout.strip() == "*******1120"
    await api.done_session(session_id)
    await direct.execute(f"alter table {name} rename column ssn to s")  # behind the gateway's back
    await direct.close()
    secret, session_id = await api.credential(role)
    done = psql(gateway, secret, "-c", f"select s, s as again from {name}",
                "-c", f"create table {name}_new (id int, ssn text)",
                "-c", f"insert into {name}_new select id, s from {name}",
                "-c", f"select ssn from {name}_new",
                "-c", f"alter table {name}_new rename column ssn to t",
                "-c", f"select t from {name}_new")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["*******1120|*******1120", "CREATE TABLE", "INSERT 0 1", "*******1120",
                                        "ALTER TABLE", "*******1120"]
    await assert_nowhere_in_clear(api, session_id, done.stdout, done.stderr)


async def test_a_value_holding_a_table_row_with_a_masked_column_is_masked_whole(api, gateway, cluster, table):
    """``select p from people p`` has one column, of the table's row type: it names no column and has no source
    column, yet holds ssn. A value of a type that holds a rule's column (a row type, an array or domain of one, a
    composite type with such a field, a row holding those) is masked whole, in text and in binary; so is one of
    a type made during the session until the catalog, read again, says what it holds."""
    suffix = uuid.uuid4().hex[:6]
    pair, holder, made = f"pair_{suffix}", f"holder_{suffix}", f"made_{suffix}"
    direct = await asyncpg.connect(cluster.dsn())
    await direct.execute(f"create type {pair} as (ssn text, x int); create table {holder} (v {pair});"
                         f"insert into {holder} values (row('{SSN}', 1))")
    await direct.close()
    role, secret, session_id = await masked_role(api, DETECTORS, BY_COLUMN)
    done = psql(gateway, secret, "-c", f"select p from {table} p where id = 1",
                "-c", f"select array_agg(p order by id) from {table} p",
                "-c", f"select (p).ssn, (p).ssn as s, p.id from {table} p where id = 1",
                "-c", f"select v, h from {holder} h",
                "-c", f"create table {made} (id int, ssn text)",
                "-c", f"insert into {made} values (1, '{SSN}')",
                "-c", f"select m from {made} m",
                "-c", f"select row(id, ssn) from {table} where id = 2")  # computed from ssn: masked whole
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["****", "****", "*******1120|*******1120|1", "****|****", "CREATE TABLE",
                                        "INSERT 0 1", "****", "****"]
    await assert_nowhere_in_clear(api, session_id, done.stdout, done.stderr)
    secret, session_id = await api.credential(role)
    connection = await asyncpg.connect(host="127.0.0.1", port=gateway.pg_port, user=secret, password="any",
                                       database="postgres", ssl=False, timeout=15)
    try:
        row = await connection.fetchval(f"select p from {table} p where id = 1")
        rows = await connection.fetchval(f"select array_agg(p order by id) from {table} p")
        held = await connection.fetchrow(f"select v, h, m from {holder} h, {made} m")
        plain = await connection.fetchval("select row(1, 'x')")
    finally:
        await connection.close()
    # text leaves in the rule's style (last4 would show the end of whichever field ends the value: fixed), the
    # others NULL, the jsonb field a JSON string
    assert tuple(row) == (None, "****", "****", "****", None, None, '"****"')
    assert [tuple(r) for r in rows] == [tuple(row), (None, "****", "****", None, None, None, '"****"')]
    assert tuple(held["v"]) == ("****", None) and tuple(held["h"]["v"]) == ("****", None)
    assert tuple(held["m"]) == (None, "****")
    assert tuple(plain) == (1, "x")  # a record that holds no table's row: masked by the patterns only
    await assert_nowhere_in_clear(api, session_id, repr(row), repr(rows), repr(dict(held)))


async def test_a_value_computed_by_a_statement_naming_a_masked_column_is_masked_whole(api, gateway, table):
    """``upper(ssn)``, ``ssn || ''``, a UNION's column, a scalar subquery: computed, no source column. Masked whole
    when the statement names a column a rule masks -- or runs one that does (``EXECUTE`` of an SQL ``PREPARE``,
    ``FETCH`` of a cursor, psql's ``FETCH_COUNT`` among them); ``count(*)`` and ``1 + 1`` of a statement naming
    none pass, and so do a driver's queries of the catalog alone, which name ``name`` and ``kind`` (asyncpg's type
    introspection, for an enum). Simple and extended protocol (asyncpg: a statement described once, executed
    twice)."""
    role, secret, session_id = await masked_role(api, BY_COLUMN, {"type": "mask", "columns": ["name", "kind"]})
    one = f"from {table} where id = 1"
    mood = f"mood_{uuid.uuid4().hex[:6]}"
    done = psql(gateway, secret, "-c", f"select upper(ssn) {one}", "-c", f"select ssn || '' {one}",
                "-c", f"select 'x' as v union all select ssn {one} order by 1 desc",
                "-c", f"select (select ssn {one}) as s, 1 + 1 as two",
                "-c", f"select count(*), max(id) + 0 from {table}",
                "-c", f"prepare q as select lower(ssn) {one}", "-c", "execute q",
                "-c", f"prepare c as select count(*) from {table}", "-c", "execute c",
                "-c", f"begin; declare cur cursor for select ssn::varchar(20) as v {one}; fetch all from cur; commit",
                "-c", r"\set FETCH_COUNT 10", "-c", f"select count(*) from {table}",
                "-c", f"select coalesce(ssn, '') {one}", "-c", f"create type {mood} as enum ('calm', 'glad')")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["****", "****", "****", "****", "****|", "2|2", "PREPARE", "****",
                                        "PREPARE", "2", "BEGIN", "DECLARE CURSOR", "****", "COMMIT", "2", "****",
                                        "CREATE TYPE"]
    secret, _ = await api.credential(role)
    connection = await asyncpg.connect(host="127.0.0.1", port=gateway.pg_port, user=secret, password="any",
                                       database="postgres", ssl=False, timeout=15)
    try:
        statement = await connection.prepare(f"select trim(ssn) as t, id {one}")
        twice = [tuple(await statement.fetchrow()) for _ in range(2)]
        counted = await connection.fetchval(f"select count(*) from {table}")
        glad = await connection.fetchval(f"select 'glad'::{mood}")  # asyncpg reads the enum's type first
    finally:
        await connection.close()
    assert twice == [("****", 1)] * 2 and counted == 2 and glad == "glad"
    await assert_nowhere_in_clear(api, session_id, done.stdout, done.stderr)


async def test_what_the_database_defined_that_may_read_a_masked_column_is_masked(api, gateway, cluster, table):
    """A stored function's result, a procedure's, an operator's or a cast's of the database's own, a view's or a
    materialized view's column that follows ``ssn`` under another name or computes from it, a whole row by its bare
    name: each passed ``ssn`` in clear, as none names it. Each is masked whole now; a view's plain column of
    another, and what the built-ins compute, pass."""
    suffix = uuid.uuid4().hex[:6]
    fn, view, matview, op_fn = f"get_{suffix}", f"v_{suffix}", f"mv_{suffix}", f"op_{suffix}"
    direct = await asyncpg.connect(cluster.dsn())
    await direct.execute(f"""
        create function {fn}(i int) returns text language sql as $$ select ssn from {table} where id = i $$;
        create function {op_fn}(i int) returns text language sql as $$ select ssn from {table} where id = i $$;
        create operator #@# (rightarg = int, function = {op_fn});
        create view {view} as select p.id, p.note, p.ssn as tax_id, p.ssn || '' as copy from {table} p;
        create materialized view {matview} as select id, ssn as kept from {table};
        create procedure proc_{suffix}(inout v text) language sql as $$ select ssn from {table} where id = 1 $$;""")
    await direct.close()
    role, secret, session_id = await masked_role(api, BY_COLUMN)
    done = psql(gateway, secret, "-c", f"select {fn}(1)", "-c", f"select upper({fn}(1)) as u",
                "-c", f"select #@# 1 as o",
                "-c", f"select id, tax_id, copy from {view} where id = 1",
                "-c", f"select kept from {matview} where id = 1",
                "-c", f"select row_to_json(p) from {table} p where id = 1",
                "-c", f"call proc_{suffix}(null)",
                "-c", f"select id, length(note) from {view} where id = 1",
                "-c", f"create view {view}_made as select ssn as hidden from {table}",  # after the catalog read
                "-c", f"select hidden from {view}_made where hidden is not null")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:-2] == ["****", "****", "****", "1|*******1120|****", "*******1120", '"****"',
                          "****", f"1|{len(f'paid with {CARD}')}"], done.stdout
    assert lines[-2] == "CREATE VIEW" and lines[-1] in ("****", "*******1120")  # whole, or followed once read
    secret, _ = await api.credential(role)
    connection = await asyncpg.connect(host="127.0.0.1", port=gateway.pg_port, user=secret, password="any",
                                       database="postgres", ssl=False, timeout=15)
    try:
        row = await connection.fetchrow(f"select tax_id, {fn}(id) as f from {view} where id = 1")
    finally:
        await connection.close()
    assert tuple(row) == ("*******1120", "****")  # binary, and extended
    await assert_nowhere_in_clear(api, session_id, done.stdout, done.stderr)


class RawSession:
    """A frontend speaking the wire protocol itself, for message orders no driver sends."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.backend = pg.BackendReader()

    @classmethod
    async def open(cls, gateway, secret: str) -> RawSession:
        session = cls(*await asyncio.open_connection("127.0.0.1", gateway.pg_port))
        await session.batch(pg.encode_startup_message({"user": secret, "database": "postgres"}))
        return session

    async def batch(self, *frames: bytes) -> list[pg.Message]:
        """Send ``frames``; the answers up to the next ReadyForQuery."""
        self.writer.write(b"".join(frames))
        got: list[pg.Message] = []
        while not got or not isinstance(got[-1], pg.ReadyForQuery):
            message = self.backend.next_message()
            if message is None:
                self.backend.feed(await asyncio.wait_for(self.reader.read(65536), 15))
                continue
            got.append(message)
        return got

    async def rows(self, *frames: bytes) -> list[list[bytes | None]]:
        """The DataRows' values of ``frames``' answers (with no ErrorResponse among them)."""
        answer = await self.batch(*frames)
        assert not [m for m in answer if isinstance(m, pg.ErrorResponse)], answer
        return [m.columns for m in answer if isinstance(m, pg.DataRow)]

    def close(self) -> None:
        self.writer.write(pg.encode_terminate())
        self.writer.close()


async def test_a_simple_query_inside_a_failed_extended_batch_does_not_unmask_the_next_statements(api, gateway, table):
    """Bind to a statement that does not exist, then a simple Query, then Sync: PostgreSQL skips the Query and
    answers both with one ReadyForQuery. Later extended queries stay masked by their own columns."""
    _, secret, session_id = await masked_role(api, BY_COLUMN)
    raw = await RawSession.open(gateway, secret)
    try:
        for statement, sql in (("s1", f"select ssn from {table} where id = 1"),
                               ("s2", f"select id::text from {table} where id = 1")):
            await raw.batch(pg.encode_parse(statement, sql), pg.encode_describe("S", statement), pg.encode_sync())
        desync = await raw.batch(pg.encode_bind("", "nope"), pg.encode_query("select 1"), pg.encode_sync())
        assert any(isinstance(m, pg.ErrorResponse) for m in desync)
        rows = []
        for statement in ("s2", "s1", "s1", "s2"):
            rows += await raw.rows(pg.encode_bind("", statement), pg.encode_execute(""), pg.encode_sync())
    finally:
        raw.close()
    assert SSN.encode() not in repr(rows).encode()
    assert rows[1:3] == [[b"*******1120"], [b"*******1120"]]
    assert rows[3] == [b"1"]  # in step again: s2's own column is not masked
    await assert_nowhere_in_clear(api, session_id, repr(rows))


@pytest.mark.parametrize("replace", [
    "deallocate {name}; prepare {name} as select ssn from {table} where id = 1",
    "do $$ begin execute 'deallocate {name}'; execute 'prep' || 'are {name} as select ssn from {table} where id = 1';"
    " end $$",
], ids=["sql", "dynamic sql"])
async def test_a_prepared_statement_replaced_by_sql_is_masked_by_what_it_runs_now(api, gateway, table, replace):
    """SQL's PREPARE and DEALLOCATE share the protocol's statement names: a statement described as harmless,
    replaced behind the protocol's back (the gateway cannot see a function's dynamic SQL), then executed with
    Bind and Execute alone, is masked by the columns it returns now."""
    _, secret, session_id = await masked_role(api, BY_COLUMN)
    raw = await RawSession.open(gateway, secret)
    try:
        await raw.batch(pg.encode_parse("harmless", f"select id::text from {table} where id = 1"),
                        pg.encode_describe("S", "harmless"), pg.encode_sync())
        before = await raw.rows(pg.encode_bind("", "harmless"), pg.encode_execute(""), pg.encode_sync())
        await raw.rows(pg.encode_query(replace.format(name="harmless", table=table)))
        after = await raw.rows(pg.encode_bind("", "harmless"), pg.encode_execute(""), pg.encode_sync())
        binary = await raw.rows(pg.encode_bind("", "harmless", result_formats=[1]), pg.encode_execute(""),
                                pg.encode_sync())
    finally:
        raw.close()
    assert before == [[b"1"]]
    assert after == [[b"*******1120"]] and binary == [[b"*******1120"]]
    await assert_nowhere_in_clear(api, session_id, repr(after + binary))


async def test_a_portal_made_by_sql_and_run_by_execute_is_masked_by_its_own_columns(api, gateway, table):
    """A cursor DECLAREd in SQL is a portal the protocol's Execute can run, and a portal bound by the protocol
    can be replaced by one SQL makes: each is masked by what it returns, not by the last description seen."""
    _, secret, session_id = await masked_role(api, BY_COLUMN)
    raw = await RawSession.open(gateway, secret)
    try:
        await raw.rows(pg.encode_query(f"begin; declare c cursor for select ssn from {table} where id = 1"))
        await raw.batch(pg.encode_parse("harmless", f"select id::text from {table} where id = 1"),
                        pg.encode_describe("S", "harmless"), pg.encode_sync())  # the last description: no mask
        cursor = await raw.rows(pg.encode_execute("c"), pg.encode_sync())
        await raw.rows(pg.encode_bind("p", "harmless"), pg.encode_sync())
        await raw.rows(pg.encode_query(f"close p; declare p cursor for select ssn from {table} where id = 1"))
        portal = await raw.rows(pg.encode_execute("p"), pg.encode_sync())
        await raw.rows(pg.encode_query("commit"))
    finally:
        raw.close()
    assert cursor == [[b"*******1120"]] and portal == [[b"*******1120"]]
    await assert_nowhere_in_clear(api, session_id, repr(cursor + portal))


async def test_a_value_too_long_to_mask_on_the_loop_is_withheld_with_a_warning(api, gateway, table):
    _, secret, session_id = await masked_role(api, DETECTORS)
    done = psql(gateway, secret, "-c", f"select repeat('x', 5 * 1024 * 1024) || email, email from {table} where id = 1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "|****"
    assert "withheld" in done.stderr and "mask_row_bytes" in done.stderr
    await assert_nowhere_in_clear(api, session_id, done.stdout, done.stderr)


async def test_a_setting_the_target_reports_at_start_up_is_masked(api, gateway, cluster):
    """A role whose settings were made from data (``ALTER ROLE ... SET application_name``): the start-up's
    ParameterStatus carries the value; it is masked like one sent later."""
    user = f"mailer_{uuid.uuid4().hex[:6]}"
    direct = await asyncpg.connect(cluster.dsn())
    await direct.execute(f"create role {user} login password 'pw'; alter role {user} set application_name = '{EMAIL}'")
    await direct.close()
    role = await api.role(user=user, password="pw")
    await api.guardrail(role, output_rules=[DETECTORS])
    secret, session_id = await api.credential(role)
    connection = await asyncpg.connect(host="127.0.0.1", port=gateway.pg_port, user=secret, password="any",
                                       database="postgres", ssl=False, timeout=15)
    try:
        application = connection.get_settings().application_name
    finally:
        await connection.close()
    assert application == "****"
    await api.done_session(session_id)
