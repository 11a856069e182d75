"""End to end: psql, asyncpg and pgbench through the PostgreSQL proxy of a real gatewayd to a real PostgreSQL 15.

One PostgreSQL cluster (SCRAM, a password, fsync off) and one ``gatewayd run``
subprocess with the postgres listener serve the whole module; each test makes
its own connection (role) so guard rails never leak between tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import io
import json
import os
import signal
import socket
import struct
import subprocess
import uuid
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any, AsyncIterator

import asyncpg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxies.postgres import codec as pg
from tests import clients
from tests.apiclient import PostgresApi, admin_http, events, of_kind
from tests.conftest import Daemon, accepts, free_port, proxy_daemon
from tests.pgpeer import PgCluster, unavailable_reason, wait_for_backends

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")

RECORDING_CAP = 1 << 20  # small enough for the 1,000,000-row test to hit it


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def cluster(pg_target):
    """The session's PostgreSQL target (conftest): started once for every module."""
    return pg_target


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    daemon = proxy_daemon(tmp_path_factory, "pgproxy", "postgres", {"sessions.recording_cap_bytes": RECORDING_CAP})
    daemon.pg_port = daemon.proxy_port
    yield daemon
    assert daemon.stop() == 0


@pytest.fixture(scope="module")
async def api(gateway, cluster):
    async with admin_http(gateway) as http:
        yield PostgresApi(gateway, http, cluster)


@pytest.fixture(scope="module")
async def admin(cluster):
    """A direct connection to the target, to look behind the gateway's back."""
    connection = await asyncpg.connect(cluster.dsn())
    yield connection
    await connection.close()


def psql(gateway: Daemon, secret: str, *args: str, database: str = "postgres", sslmode: str = "disable",
         user: str | None = None, password: str | None = None, stdin: str | None = None,
         timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return clients.psql(gateway.pg_port, secret, "-v", "ON_ERROR_STOP=0", *args, database=database, sslmode=sslmode,
                        user=user, password=password, stdin=stdin, timeout=timeout)


async def connect(gateway: Daemon, secret: str, database: str = "postgres", **kwargs: Any) -> asyncpg.Connection:
    kwargs.setdefault("command_timeout", 30)
    return await asyncpg.connect(host="127.0.0.1", port=gateway.pg_port, user=secret, password="any",
                                 database=database, timeout=15, **kwargs)


class RawClient:
    """A bare protocol-3 client built on the codec, for what real clients never send."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.backend = pg.BackendReader()

    @classmethod
    async def open(cls, gateway: Daemon) -> RawClient:
        return cls(*await asyncio.open_connection("127.0.0.1", gateway.pg_port))

    async def login(self, secret: str, database: str = "postgres") -> list[pg.Message]:
        self.writer.write(pg.encode_startup_message({"user": secret, "database": database}))
        return await self.until_ready()

    def send(self, *frames: bytes) -> None:
        self.writer.write(b"".join(frames))

    async def message(self, timeout: float = 10) -> pg.Message | None:
        while (message := self.backend.next_message()) is None:
            data = await asyncio.wait_for(self.reader.read(65536), timeout)
            if not data:
                return None
            self.backend.feed(data)
        return message

    async def until_ready(self, timeout: float = 10) -> list[pg.Message]:
        out = []
        while True:
            message = await self.message(timeout)
            if message is None:
                return out
            out.append(message)
            if isinstance(message, pg.ReadyForQuery):
                return out

    async def rest(self, timeout: float = 10) -> list[pg.Message]:
        """Everything until the gateway closes the connection."""
        out = []
        while (message := await self.message(timeout)) is not None:
            out.append(message)
        return out

    def close(self) -> None:
        self.writer.close()


def kinds(messages: list[pg.Message]) -> list[str]:
    return [type(m).__name__ for m in messages]


# --------------------------------------------------------------------------- psql


async def test_psql_commands_and_files_are_relayed_and_recorded(gateway, api, tmp_path):
    role = await api.role()
    secret, session_id = await api.credential(role)
    result = psql(gateway, secret, "-A", "-c", "select 1 as one, 'two' as two")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[:2] == ["one|two", "1|two"]
    session = await api.done_session(session_id)
    assert session["exit_code"] == 0 and session["end_date"] and session["connection"] == role["name"]
    assert events(session) == [("i", "select 1 as one, 'two' as two"), ("o", "one\ttwo\n1\ttwo\nSELECT 1\n")]

    script = tmp_path / "several.sql"
    script.write_text("create table psql_file (id int primary key, name text);\n"
                      "insert into psql_file values (1, 'ada'), (2, 'bob');\n"
                      "update psql_file set name = 'eve' where id = 2;\n"
                      "select name from psql_file order by id;\n"
                      "select 'a;b' as semi; select 3 as three;\n")
    secret, session_id = await api.credential(role)
    result = psql(gateway, secret, "-A", "-t", "-f", str(script))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["CREATE", "TABLE", "INSERT", "0", "2", "UPDATE", "1", "ada", "eve", "a;b", "3"]
    session = await api.done_session(session_id)
    inputs = of_kind(session, "i")
    assert inputs[0].startswith("create table psql_file") and "update psql_file" in inputs[2]
    outputs = of_kind(session, "o")
    assert "CREATE TABLE\n" in outputs and "INSERT 0 2\n" in outputs and "name\nada\neve\nSELECT 2\n" in outputs

    # an auditor opens the statements and their results as JSON or CSV
    status, document = await api("GET", f"/sessions/{session_id}?format=json")
    assert status == 200 and document["id"] == session_id and document["connection"] == role["name"]
    assert [s["statement"] for s in document["statements"]] == inputs
    assert document["statements"][3]["output"] == "name\nada\neve\nSELECT 2\n"
    status, text = await api("GET", f"/sessions/{session_id}?format=csv")
    rows = list(csv.DictReader(io.StringIO(text)))
    assert status == 200 and [r["statement"] for r in rows] == inputs
    assert rows[3]["output"] == "name\nada\neve\nSELECT 2\n" and rows[3]["error"] == ""
    status, error = await api("GET", f"/sessions/{session_id}?format=xml")
    assert status == 422 and "csv or json" in error["message"]


async def test_psql_error_mid_script_and_the_connection_goes_on(gateway, api, tmp_path):
    role = await api.role()
    secret, session_id = await api.credential(role)
    script = tmp_path / "error.sql"
    script.write_text("select 1;\nselect * from no_such_table;\nselect 2 as after_error;\n")
    result = psql(gateway, secret, "-A", "-t", "-f", str(script))
    assert 'relation "no_such_table" does not exist' in result.stderr
    assert result.stdout.split() == ["1", "2"]
    session = await api.done_session(session_id)
    assert session["exit_code"] == 0
    assert of_kind(session, "e") == ['ERROR: relation "no_such_table" does not exist']
    assert of_kind(session, "i")[-1] == "select 2 as after_error;"
    _, document = await api("GET", f"/sessions/{session_id}?format=json")
    assert document["statements"][1] == {"offset_ms": document["statements"][1]["offset_ms"],
                                         "statement": "select * from no_such_table;", "output": "",
                                         "error": 'ERROR: relation "no_such_table" does not exist'}


async def test_psql_copy_both_ways(gateway, api, admin, tmp_path):
    role = await api.role()
    secret, session_id = await api.credential(role)
    source = tmp_path / "in.csv"
    source.write_text("".join(f"{n},name {n}\n" for n in range(1, 5001)))
    target = tmp_path / "out.csv"
    result = psql(gateway, secret, "-c", "create table copied (id int, name text)",
                  "-c", f"\\copy copied from '{source}' csv",
                  "-c", f"\\copy (select * from copied order by id) to '{target}' csv")
    assert result.returncode == 0, result.stderr
    assert "COPY 5000" in result.stdout
    assert target.read_text() == source.read_text()
    assert await admin.fetchval("select count(*) from copied") == 5000
    session = await api.done_session(session_id)
    assert "1,name 1\n" in "".join(of_kind(session, "i"))  # the copied-in data is input
    assert any("5000,name 5000" in text for text in of_kind(session, "o"))


async def test_secret_as_password_with_any_user_name(gateway, api):
    role = await api.role()
    secret, session_id = await api.credential(role)
    result = psql(gateway, secret, "-A", "-t", "-c", "select current_user", user="alice", password=secret)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "postgres"  # the role's user on the target
    assert (await api.done_session(session_id))["exit_code"] == 0
    refused = psql(gateway, secret, "-c", "select 1", user="alice", password="not-the-secret")
    assert refused.returncode != 0 and "invalid credential: unknown secret" in refused.stderr


async def test_wrong_and_expired_secrets_are_fatal_28P01(gateway, api):
    role = await api.role()
    with pytest.raises(asyncpg.InvalidPasswordError, match="invalid credential: unknown secret") as err:
        await connect(gateway, "pg-" + "A" * 43)
    assert err.value.sqlstate == "28P01" and err.value.severity == "FATAL"
    secret, _ = await api.credential(role, seconds=1)
    await asyncio.sleep(1.2)
    with pytest.raises(asyncpg.InvalidPasswordError, match="invalid credential: it has expired"):
        await connect(gateway, secret)
    result = psql(gateway, secret, "-c", "select 1")
    assert result.returncode != 0 and "it has expired" in result.stderr
    status, logs = await api("GET", "/audit/logs?action=postgres.login&outcome=failure")
    assert status == 200 and logs["pages"]["total"] >= 3
    assert all(secret not in json.dumps(entry) and "A" * 43 not in json.dumps(entry) for entry in logs["data"])


async def test_tls_with_sslmode_require_and_disable(gateway, api):
    role = await api.role()
    secret, _ = await api.credential(role)
    secure = psql(gateway, secret, "-c", "\\conninfo", "-c", "select 41 + 1", sslmode="require")
    assert secure.returncode == 0, secure.stderr
    assert "SSL connection (protocol: TLSv1.3" in secure.stdout and "42" in secure.stdout
    plain = psql(gateway, secret, "-c", "\\conninfo", "-c", "select 43", sslmode="disable")
    assert plain.returncode == 0, plain.stderr
    assert "SSL connection" not in plain.stdout and "43" in plain.stdout
    assert (gateway.data_dir / "postgres-tls.crt").exists()
    assert (gateway.data_dir / "postgres-tls.key").stat().st_mode & 0o077 == 0
    # asyncpg negotiates TLS by default (sslmode prefer)
    connection = await connect(gateway, secret)
    try:
        assert connection._transport.get_extra_info("sslcontext") is not None
        assert await connection.fetchval("select 44") == 44
    finally:
        await connection.close()


async def test_upstream_md5_and_cleartext_authentication(gateway, api, admin, cluster):
    """A cleartext or MD5 password goes to the target only over TLS that verified it, or where the role allows it
    (issue 31: SSLMODE prefer sent it to whoever answered); SCRAM goes anywhere (no password leaves), with channel
    binding over TLS (the target offers SCRAM-SHA-256-PLUS there, and checks the binding)."""
    await admin.execute("set password_encryption = 'md5'; create role md5user login password 'md5-pass'")
    await admin.execute("reset password_encryption; create role plainuser login password 'plain-pass'")
    for user, password, method in (("md5user", "md5-pass", "MD5"), ("plainuser", "plain-pass", "cleartext")):
        for sslmode in ("prefer", "require"):
            role = await api.role(user=user, password=password, sslmode=sslmode)
            secret, _ = await api.credential(role)
            result = psql(gateway, secret, "-A", "-t", "-c", "select current_user")
            assert result.returncode != 0 and f"the target asks for a{'n' if method == 'MD5' else ''} {method} " \
                "password over a link the gateway has not verified, and the password was not sent" in result.stderr
            assert password not in result.stderr
        for extra in ({"ALLOW_UNVERIFIED_PASSWORD": "true"}, {"SSLMODE": "verify-full", "SSLROOTCERT": cluster.root_cert()},
                      {"SSLMODE": "verify-ca", "SSLROOTCERT": cluster.root_cert()}):
            role = await api.role(user=user, password=password, **extra)
            secret, _ = await api.credential(role)
            result = psql(gateway, secret, "-A", "-t", "-c", "select current_user")
            assert result.returncode == 0, (extra, result.stderr)
            assert result.stdout.strip() == user
    for extra in ({}, {"SSLMODE": "verify-full", "SSLROOTCERT": cluster.root_cert()}, {"SSLMODE": "disable"}):
        role = await api.role(**extra)  # SCRAM: -PLUS over TLS, plain without
        secret, _ = await api.credential(role)
        result = psql(gateway, secret, "-A", "-t", "-c", "select current_user")
        assert result.returncode == 0 and result.stdout.strip() == "postgres", (extra, result.stderr)
    role = await api.role(sslmode="verify-full")  # the system's CAs do not know the cluster's certificate
    secret, _ = await api.credential(role)
    assert "TLS failed" in psql(gateway, secret, "-c", "select 1").stderr
    role = await api.role(sslmode="verify_full")  # a typo does not fall back to a weaker mode
    secret, _ = await api.credential(role)
    assert "its SSLMODE is not one of" in psql(gateway, secret, "-c", "select 1").stderr


async def test_a_target_that_skips_its_scram_proof_is_refused(gateway, api):
    """An impostor that asks for SCRAM, takes the client's proof and answers AuthenticationOk without its own proof
    (AuthenticationSASLFinal: only a server that knows the password can make it) is not taken for the target."""
    proofs: list[bytes] = []

    async def impostor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            (length,) = struct.unpack(">i", await reader.readexactly(4))
            await reader.readexactly(length - 4)  # the start-up message (SSLMODE disable: no SSLRequest)
            writer.write(pg.encode_message(b"R", struct.pack(">i", 10) + b"SCRAM-SHA-256\0\0"))
            kind, body = await read_frame(reader)  # SASLInitialResponse: "n,,n=,r=<nonce>"
            nonce = body.split(b"r=", 1)[1].decode()
            writer.write(pg.encode_message(b"R", struct.pack(">i", 11) +
                                           f"r={nonce}impostor,s=c2FsdA==,i=4096".encode()))
            proofs.append((await read_frame(reader))[1])  # SASLResponse with the proof
            writer.write(pg.encode_message(b"R", struct.pack(">i", 0)) + pg.encode_message(b"Z", b"I"))
            await reader.read()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(impostor, "127.0.0.1", 0)
    try:
        role = await api.role(port=server.sockets[0].getsockname()[1], sslmode="disable")
        secret, _ = await api.credential(role)
        result = await asyncio.to_thread(psql, gateway, secret, "-c", "select 1")
        assert result.returncode != 0 and "it ended SCRAM without proving that it knows the password" in \
            result.stderr, result.stderr
        assert len(proofs) == 1  # it got a proof (bound to this exchange), never the password
    finally:
        server.close()


async def read_frame(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    kind = await reader.readexactly(1)
    (length,) = struct.unpack(">i", await reader.readexactly(4))
    return kind, await reader.readexactly(length - 4)


async def test_upstream_sslmode_of_the_role(gateway, api, admin):
    for sslmode, encrypted in (("require", True), ("prefer", True), ("disable", False)):
        role = await api.role(sslmode=sslmode)
        secret, _ = await api.credential(role)
        connection = await connect(gateway, secret)
        try:
            assert await connection.fetchval("select ssl from pg_stat_ssl where pid = pg_backend_pid()") is encrypted
        finally:
            await connection.close()
    plain = await asyncio.to_thread(PgCluster(tls=False).start)
    try:
        role = await api.role(port=plain.port, sslmode="require")
        secret, _ = await api.credential(role)
        with pytest.raises(asyncpg.PostgresError, match="the target does not accept TLS") as err:
            await connect(gateway, secret)
        assert err.value.sqlstate == "08001"
        role = await api.role(port=plain.port, sslmode="prefer")
        secret, _ = await api.credential(role)
        connection = await connect(gateway, secret)
        assert await connection.fetchval("select ssl from pg_stat_ssl where pid = pg_backend_pid()") is False
        await connection.close()
    finally:
        await asyncio.to_thread(plain.destroy)


async def test_unreachable_or_refusing_target_is_fatal_08001(gateway, api):
    down = await api.role(port=free_port())
    secret, session_id = await api.credential(down)
    with pytest.raises(asyncpg.PostgresError) as err:
        await connect(gateway, secret)
    assert err.value.sqlstate == "08001"
    assert f'could not connect to the target of connection "{down["name"]}"' in str(err.value)
    session = await api.done_session(session_id)
    assert session["exit_code"] == 254 and "could not connect" in of_kind(session, "e")[0]

    wrong = await api.role(password="not-the-target-password")
    secret, _ = await api.credential(wrong)
    result = psql(gateway, secret, "-c", "select 1")
    assert result.returncode != 0
    assert f'could not connect to the target of connection "{wrong["name"]}"' in result.stderr
    assert "not-the-target-password" not in result.stderr and "postgres" not in result.stderr.split(":", 2)[-1]

    typo = await api.role(port="54x32")  # told, not replaced by 5432 (the cluster may well listen there)
    secret, session_id = await api.credential(typo)
    result = psql(gateway, secret, "-c", "select 1")
    assert result.returncode != 0
    assert f'connection "{typo["name"]}": its PORT is not a port number' in result.stderr
    session = await api.done_session(session_id)
    assert session["exit_code"] == 254 and "its PORT is not a port number" in of_kind(session, "e")[0]

    missing_db = await api.role(db="no_such_db")  # the role's own database: the target says it is missing
    secret, _ = await api.credential(missing_db)
    result = psql(gateway, secret, "-c", "select 1", database="no_such_db")
    assert result.returncode != 0 and 'database "no_such_db" does not exist' in result.stderr


# --------------------------------------------------------------------------- asyncpg


async def test_asyncpg_prepared_statements_binary_types_and_transactions(gateway, api):
    role = await api.role()
    secret, session_id = await api.credential(role)
    connection = await connect(gateway, secret)
    try:
        await connection.execute("create table typed (id int primary key, amount numeric, at timestamptz, "
                                 "doc jsonb, raw bytea, ids uuid[], ok bool, ratio float8)")
        now = datetime(2024, 5, 6, 7, 8, 9, tzinfo=UTC)
        rows = [(n, Decimal(f"{n}.25"), now, json.dumps({"n": n}), bytes([n, 0, 255]), [uuid.UUID(int=n)],
                 n % 2 == 0, n / 3) for n in range(1, 101)]
        await connection.executemany("insert into typed values ($1, $2, $3, $4, $5, $6, $7, $8)", rows)
        statement = await connection.prepare("select * from typed where id = $1")
        for n in (1, 50, 100):
            record = await statement.fetchrow(n)
            assert tuple(record) == rows[n - 1]
        assert await connection.fetchval("select sum(amount) from typed where id <= $1", 2) == Decimal("3.50")
        async with connection.transaction():
            await connection.execute("delete from typed where id > 90")
            with pytest.raises(ZeroDivisionError):
                async with connection.transaction():  # a savepoint, rolled back
                    await connection.execute("delete from typed")
                    raise ZeroDivisionError
        assert await connection.fetchval("select count(*) from typed") == 90
        await connection.execute("truncate typed")
        with pytest.raises(asyncpg.UniqueViolationError):
            async with connection.transaction():
                await connection.execute("insert into typed (id) values (1)")
                await connection.execute("insert into typed (id) values (1)")
        assert await connection.fetchval("select count(*) from typed") == 0
        await connection.executemany("insert into typed (id) values ($1)", [(n,) for n in range(1000)])
        async with connection.transaction():  # a cursor fetches through a suspended portal
            seen = [r["id"] async for r in connection.cursor("select id from typed order by id", prefetch=100)]
        assert seen == list(range(1000))
    finally:
        await connection.close()
    session = await api.done_session(session_id)
    inputs = of_kind(session, "i")
    assert any(text.startswith("select * from typed where id = $1\n-- parameters: $1 = '\\x00000032'")
               for text in inputs), inputs[:20]
    assert any("-- parameters: $1 = '\\x00000001', $2 = " in text for text in inputs)
    outputs = "".join(of_kind(session, "o"))  # binary results are recorded as text, by column type
    assert 'id\tamount\tat\tdoc\traw\tids\tok\tratio\n' in outputs
    assert '50\t50.25\t2024-05-06 07:08:09+00:00\t{"n": 50}\t\\x3200ff\t' in outputs


async def test_asyncpg_timeout_cancels_pg_sleep_on_the_target(gateway, api, admin):
    role = await api.role()
    secret, _ = await api.credential(role)
    connection = await connect(gateway, secret)
    try:
        # prepared first: the timeout runs from the Execute, not from a prepare round trip a loaded machine may
        # stretch until the Execute and the cancel reach the gateway together (a cancel read before its statement
        # finds nothing running and is not sent on, as PostgreSQL ignores one that comes before its query)
        sleep = await connection.prepare("select pg_sleep(30)")
        with pytest.raises(asyncio.TimeoutError):
            await sleep.fetchval(timeout=0.3)
        for _ in range(200):  # the target stops running it long before its 30 s: the cancel reached it
            if not await admin.fetchval("select count(*) from pg_stat_activity where query = 'select pg_sleep(30)' "
                                        "and state = 'active'"):
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("pg_sleep(30) still runs on the target 10 s after the client's cancel")
        assert await connection.fetchval("select 7") == 7  # the cancel ended the statement, not the session
    finally:
        await connection.close()


async def test_notice_notify_and_parameter_status_are_relayed(gateway, api, admin):
    role = await api.role()
    secret, _ = await api.credential(role)
    connection = await connect(gateway, secret)
    try:
        notes, notifications = [], asyncio.Queue()
        connection.add_log_listener(lambda _c, message: notes.append(message.message))
        await connection.add_listener("gw_channel", lambda *args: notifications.put_nowait(args[-1]))
        await connection.execute("do $$ begin raise notice 'hello from the target'; end $$")
        await admin.execute("notify gw_channel, 'ping'")
        assert await asyncio.wait_for(notifications.get(), 5) == "ping"
        assert notes == ["hello from the target"]
        await connection.execute("set application_name = 'renamed'")
        assert connection.get_settings().application_name == "renamed"
        assert connection.get_server_pid() != await connection.fetchval("select pg_backend_pid()")
    finally:
        await connection.close()


# --------------------------------------------------------------------------- pgbench


async def test_pgbench_initialises_and_runs_in_every_query_mode(gateway, api, admin):
    await admin.execute("create database bench")
    role = await api.role(db="bench")
    secret, _ = await api.credential(role)
    env = {**os.environ, "PGPASSWORD": "any", "PGSSLMODE": "disable"}
    base = ["-h", "127.0.0.1", "-p", str(gateway.pg_port), "-U", secret]

    def pgbench(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["pgbench", *base, *args, "bench"], capture_output=True, text=True, env=env,
                              timeout=120, check=False)

    init = await asyncio.to_thread(pgbench, "-i", "-s", "1")  # DDL, COPY FROM STDIN, VACUUM
    assert init.returncode == 0, init.stderr
    assert "done in" in init.stderr
    direct = await asyncpg.connect(api.cluster.dsn(database="bench"))
    try:  # the client's database was used, not the role's
        assert await direct.fetchval("select count(*) from pgbench_accounts") == 100_000
    finally:
        await direct.close()
    for mode in ("simple", "extended", "prepared"):
        run = await asyncio.to_thread(pgbench, "-S", "-M", mode, "-c", "2", "-t", "200")
        assert run.returncode == 0, run.stderr
        assert "number of transactions actually processed: 400/400" in run.stdout, run.stdout


# --------------------------------------------------------------------------- guard rails


DROP_RULE = [{"type": "deny_words_list", "words": ["drop table"]}]
DROP_MESSAGE = "validation error, match guard rails input rule, type=deny_words_list, words=[drop table]"


async def test_input_guard_rail_blocks_simple_and_extended_statements(gateway, api, admin):
    await admin.execute("create table keep_me (id int); insert into keep_me values (1)")
    role = await api.role()
    await api.guardrail(role, input_rules=DROP_RULE)
    secret, session_id = await api.credential(role)

    result = psql(gateway, secret, "-A", "-t", "-c", "DROP /* sneaky */  TABLE keep_me", "-c", "select 5")
    assert DROP_MESSAGE in result.stderr and result.stdout.strip() == "5"
    session = await api.done_session(session_id)
    assert of_kind(session, "e") == [DROP_MESSAGE]
    assert of_kind(session, "i") == ["DROP /* sneaky */  TABLE keep_me", "select 5"]  # the blocked one too

    connection = await connect(gateway, secret)
    try:
        with pytest.raises(asyncpg.InsufficientPrivilegeError, match="words=\\[drop table\\]"):
            await connection.execute("drop table keep_me")  # simple Query
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await connection.fetch("drop table keep_me")  # Parse
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await connection.fetch("drop table keep_me where $1", 1)
        async with connection.transaction():
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await connection.execute("drop table keep_me")
            assert await connection.fetchval("select 1 + $1", 1) == 2  # the transaction goes on
        assert await connection.fetchval("select count(*) from keep_me") == 1
    finally:
        await connection.close()

    # pipelined: what was sent before the blocked Parse is answered, then the error, then ReadyForQuery
    client = await RawClient.open(gateway)
    try:
        await client.login(secret)
        client.send(pg.encode_parse("", "select 10"), pg.encode_bind("", ""), pg.encode_execute(),
                    pg.encode_parse("", "drop table keep_me"), pg.encode_bind("", ""), pg.encode_execute(),
                    pg.encode_sync(), pg.encode_query("select 11"))
        first = await client.until_ready()
        assert kinds(first) == ["ParseComplete", "BindComplete", "DataRow", "CommandComplete", "ErrorResponse",
                                "ReadyForQuery"]
        assert first[2].columns == [b"10"] and first[4].sqlstate == "42501" and first[4].message == DROP_MESSAGE
        second = await client.until_ready()
        assert kinds(second) == ["RowDescription", "DataRow", "CommandComplete", "ReadyForQuery"]
        assert second[1].columns == [b"11"]
        client.send(pg.encode_query("drop table keep_me"), pg.encode_query("select 12"))  # simple, pipelined
        third = await client.until_ready()
        assert kinds(third) == ["ErrorResponse", "ReadyForQuery"] and third[1].status == "I"
        fourth = await client.until_ready()
        assert fourth[1].columns == [b"12"]
    finally:
        client.close()
    assert await admin.fetchval("select count(*) from keep_me") == 1  # never reached the target
    status, logs = await api("GET", "/audit/logs?action=guardrail.block")
    assert status == 200 and logs["pages"]["total"] >= 7


async def test_start_up_settings_are_read_by_the_input_rules_as_the_set_they_are(gateway, api):
    role = await api.role()
    await api.guardrail(role, input_rules=[{"type": "statement_kinds", "deny": ["VariableSetStmt"]}])
    refused = "validation error, match guard rails input rule, type=statement_kinds, statement=VariableSetStmt"
    secret, session_id = await api.credential(role)
    # psql's own start-up settings (application_name, client_encoding) pass, unrecorded; the SET it refuses does not
    assert psql(gateway, secret, "-A", "-t", "-c", "select 1").stdout.strip() == "1"
    assert of_kind(await api.done_session(session_id), "i") == ["select 1"]
    secret, session_id = await api.credential(role)
    options = clients.psql(gateway.pg_port, secret, "-A", "-t", "-c", "select 2",
                           PGOPTIONS=r"-c session_replication_role=replica -c search_path=public,\ pg_catalog")
    assert options.returncode != 0 and f"FATAL:  {refused}" in options.stderr, options
    session = await api.done_session(session_id)
    assert session["exit_code"] == 254
    assert of_kind(session, "i") == ["SET session_replication_role TO 'replica'; SET search_path TO 'public, "
                                     "pg_catalog'"] and of_kind(session, "e") == [f"{refused} (statement 1 of 2)"]
    secret, _ = await api.credential(role)
    with pytest.raises(asyncpg.InsufficientPrivilegeError, match="statement=VariableSetStmt"):
        await connect(gateway, secret, server_settings={"session_replication_role": "replica"})
    secret, _ = await api.credential(role)
    switch = clients.psql(gateway.pg_port, secret, "-c", "select 3", PGOPTIONS="-O")  # allow_system_table_mods
    assert "cannot read the start-up settings" in switch.stderr and "'-O'" in switch.stderr, switch
    _, logs = await api("GET", "/audit/logs?action=guardrail.block&page_size=100")
    assert any(entry["request_payload_redacted"].get("input") == "SET session_replication_role TO 'replica'"
               for entry in logs["data"]), logs


BYPASSES = [  # issue 13: a comment marker inside a literal once hid the DROP from the deny word
    "select '/*'; drop/**/table bypass_me; select '*/'",
    "select '--' as c; drop/**/table bypass_me",
    "select $$/*$$; drop/**/table bypass_me",
    'select 1 as "--"; drop/**/table bypass_me',
]
BYPASS_BLOCKS = [f"{DROP_MESSAGE} (statement 2 of {n})" for n in (3, 2, 2, 2)]  # the block names the statement


async def test_comment_markers_inside_literals_do_not_bypass_deny_words(gateway, api, admin):
    await admin.execute("create table bypass_me (id int); insert into bypass_me values (1)")
    role = await api.role()
    await api.guardrail(role, input_rules=DROP_RULE)
    secret, session_id = await api.credential(role)
    args = [arg for sql in ["select 1 as before", *BYPASSES, "select 2 as after"] for arg in ("-c", sql)]
    result = psql(gateway, secret, "-A", "-t", *args)
    assert result.stderr.count(DROP_MESSAGE) == len(BYPASSES), result.stderr
    assert result.stdout.split() == ["1", "2"]
    assert await admin.fetchval("select count(*) from bypass_me") == 1  # the table survived

    # each blocked statement is on the record as ``i``, then the block as ``e``; the exports give it its own row
    session = await api.done_session(session_id)
    assert events(session)[2:] == [kind_text for sql, block in zip(BYPASSES, BYPASS_BLOCKS)
                                   for kind_text in (("i", sql), ("e", block))] \
        + [("i", "select 2 as after"), ("o", "after\n2\nSELECT 1\n")]
    _, document = await api("GET", f"/sessions/{session_id}?format=json")
    rows = document["statements"]
    assert [(r["statement"], r["output"], r["error"]) for r in rows] == [
        ("select 1 as before", "before\n1\nSELECT 1\n", ""),
        *[(sql, "", block) for sql, block in zip(BYPASSES, BYPASS_BLOCKS)],
        ("select 2 as after", "after\n2\nSELECT 1\n", "")]
    _, text = await api("GET", f"/sessions/{session_id}?format=csv")
    assert [(r["statement"], r["error"]) for r in csv.DictReader(io.StringIO(text))][1:-1] == \
        list(zip(BYPASSES, BYPASS_BLOCKS))
    # the audit entry names what was blocked
    _, logs = await api("GET", "/audit/logs?action=guardrail.block&page_size=100")
    mine = [e for e in logs["data"] if (e["request_payload_redacted"] or {}).get("session_id") == session_id]
    assert sorted(e["request_payload_redacted"]["input"] for e in mine) == sorted(BYPASSES)
    assert all(e["request_payload_redacted"]["rule_type"] == "deny_words_list" for e in mine)


async def test_output_guard_rail_cuts_results_in_both_protocols(gateway, api, admin):
    await admin.execute("create table leaky (v text); "
                        "insert into leaky select 'public-' || g from generate_series(1, 100) g; "
                        "insert into leaky values ('secret-7'); "
                        "insert into leaky select 'public-' || g from generate_series(101, 200) g")
    role = await api.role()
    await api.guardrail(role, output_rules=[{"type": "pattern_match", "pattern_regex": r"secret-\d+"}])
    message = r"validation error, match guard rails output rule, type=pattern_match, pattern=secret-\d+"
    secret, session_id = await api.credential(role)

    result = psql(gateway, secret, "-A", "-t", "-c", "select v from leaky; select 'after' as x", "-c", "select 99")
    assert message in result.stderr and "secret-7" not in result.stdout
    assert result.stdout.split() == ["99"]
    session = await api.done_session(session_id)
    assert of_kind(session, "e") == [message]
    assert "secret-7" not in "".join(of_kind(session, "o"))

    connection = await connect(gateway, secret)
    try:
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await connection.fetch("select v from leaky where v like $1", "%")
        assert await connection.fetchval("select count(*) from leaky where v like $1", "secret%") == 1
        rows = await connection.fetch("select v from leaky where v like 'public-%'")
        assert len(rows) == 200
        with pytest.raises(asyncpg.InsufficientPrivilegeError):  # COPY TO STDOUT rows are checked too
            await connection.copy_from_query("select v from leaky", output=io.BytesIO())
        assert await connection.fetchval("select 3") == 3
    finally:
        await connection.close()


# --------------------------------------------------------------------------- lifecycle


async def test_target_backend_terminated_mid_query(gateway, api, admin):
    role = await api.role()
    secret, session_id = await api.credential(role)
    connection = await connect(gateway, secret, server_settings={"application_name": "doomed"})
    query = asyncio.ensure_future(connection.fetchval("select pg_sleep(60)"))
    # Mid-query means inside pg_sleep: `query` shows the text from the Parse on, while asyncpg is still
    # between its prepare and its execute; a FATAL landing there is asyncpg's own race (it fails with
    # InternalClientError "cannot switch to state 12" straight to PostgreSQL too).
    for _ in range(200):
        if await admin.fetchval("select count(*) from pg_stat_activity where application_name = 'doomed' "
                                "and wait_event = 'PgSleep'"):
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the query never started sleeping on the target")
    await admin.execute("select pg_terminate_backend(pid) from pg_stat_activity where application_name = 'doomed'")
    with pytest.raises((asyncpg.AdminShutdownError, asyncpg.ConnectionDoesNotExistError)):
        await asyncio.wait_for(query, 10)
    await connection.close()
    session = await api.done_session(session_id)
    assert session["exit_code"] == 254 and session["end_date"]
    errors = of_kind(session, "e")
    assert errors[0] == "FATAL: terminating connection due to administrator command"
    assert errors[-1] == f'the target of connection "{role["name"]}" closed the connection unexpectedly'


async def test_target_backend_terminated_between_prepare_and_execute(gateway, api, admin):
    """The client idles after Parse/Describe/Flush (asyncpg's prepare): it gets the target's FATAL, then EOF."""
    role = await api.role()
    secret, session_id = await api.credential(role)
    client = await RawClient.open(gateway)
    client.send(pg.encode_startup_message({"user": secret, "database": "postgres",
                                           "application_name": "doomed-idle"}))
    assert kinds(await client.until_ready())[-1] == "ReadyForQuery"
    client.send(pg.encode_parse("", "select pg_sleep(60)"), pg.encode_describe("S"), pg.encode_flush())
    answers = [await client.message() for _ in range(3)]
    assert kinds(answers) == ["ParseComplete", "ParameterDescription", "RowDescription"]
    await admin.execute("select pg_terminate_backend(pid) from pg_stat_activity "
                        "where application_name = 'doomed-idle'")
    messages = await client.rest()
    client.close()
    assert kinds(messages) == ["ErrorResponse"]  # as PostgreSQL itself: one FATAL, then the socket closes
    assert (messages[0].severity, messages[0].sqlstate) == ("FATAL", "57P01")
    session = await api.done_session(session_id)
    assert session["exit_code"] == 254
    assert of_kind(session, "e") == ["FATAL: terminating connection due to administrator command",
                                     f'the target of connection "{role["name"]}" closed the connection unexpectedly']


async def test_target_cluster_dying_mid_query_ends_the_session(gateway, api):
    doomed = PgCluster().start()
    try:
        role = await api.role(port=doomed.port, password=doomed.password)
        secret, session_id = await api.credential(role)
        client = await RawClient.open(gateway)
        await client.login(secret)
        client.send(pg.encode_query("select pg_sleep(60)"))
        await wait_for_backends(doomed.dsn(), "select pg_sleep(60)", running=True)  # it runs on the target
        await asyncio.to_thread(doomed.stop, "immediate")
        messages = await client.rest()
        client.close()
        errors = [m for m in messages if isinstance(m, pg.ErrorResponse)]
        assert errors and errors[-1].severity == "FATAL"
        session = await api.done_session(session_id)
        assert session["exit_code"] == 254
        assert of_kind(session, "e")[-1] == f'the target of connection "{role["name"]}" closed the connection unexpectedly'
    finally:
        doomed.destroy()


async def test_kill_from_the_api_sends_fatal_57P01(gateway, api):
    role = await api.role()
    secret, session_id = await api.credential(role)
    client = await RawClient.open(gateway)
    greeting = await client.login(secret)
    assert kinds(greeting)[0] == "Authentication" and greeting[0].code == pg.AUTH_OK and "BackendKeyData" in kinds(greeting)
    status, body = await api("POST", f"/sessions/{session_id}/kill")
    assert status == 200 and body["exit_code"] == 254
    messages = await client.rest()
    client.close()
    assert len(messages) == 1 and messages[0].severity == "FATAL" and messages[0].sqlstate == "57P01"
    assert messages[0].message == "session killed by admin@example.com"


SHUTTING_DOWN = "gateway shutting down: the session was closed"


@contextlib.asynccontextmanager
async def held_on_a_daemon_of_its_own(tmp_path_factory, cluster, name: str,
                                      grace: str) -> AsyncIterator[tuple[Daemon, Any, str]]:
    """A daemon of its own (``grace``: its ``sessions.shutdown_grace``) with a psql session held open on it:
    (the daemon, the raw client, the session's id); the daemon is stopped at the end."""
    daemon = proxy_daemon(tmp_path_factory, name, "postgres", {"sessions.shutdown_grace": grace}, wait=True)
    daemon.pg_port = daemon.proxy_port
    try:
        async with admin_http(daemon) as http:
            api = PostgresApi(daemon, http, cluster)
            secret, session_id = await api.credential(await api.role())
        client = await RawClient.open(daemon)
        await client.login(secret)
        yield daemon, client, session_id
    finally:
        daemon.stop()


async def closed_by_the_stop(client: Any) -> None:
    """The client read FATAL 57P01 and why, and nothing else."""
    messages = await client.rest()
    client.close()
    assert [(m.severity, m.sqlstate, m.message) for m in messages] == [("FATAL", "57P01", SHUTTING_DOWN)], messages


@contextlib.asynccontextmanager
async def started_again(daemon: Daemon, cluster) -> AsyncIterator[PostgresApi]:
    """The stopped daemon started again on the same store, and an admin's API on it."""
    await asyncio.to_thread(daemon.start)
    async with admin_http(daemon) as http:
        yield PostgresApi(daemon, http, cluster)


async def test_the_daemons_stop_ends_a_held_session_with_57P01_recorded_and_sealed(tmp_path_factory, cluster):
    """A stop (SIGTERM) with a psql session held past the grace: the client reads FATAL 57P01 and why; the session
    is done with 254, its last event that reason, sealed, and its sealing in the audit chain (``verify``, read
    after the next start on the same store)."""
    async with held_on_a_daemon_of_its_own(tmp_path_factory, cluster, "pgstop", "0s") as (daemon, client, session_id):
        assert await asyncio.to_thread(daemon.stop) == 0
        await closed_by_the_stop(client)
        async with started_again(daemon, cluster) as api:
            session = await api.done_session(session_id)
            assert session["exit_code"] == 254, session
            assert of_kind(session, "e")[-1] == SHUTTING_DOWN, session
            status, result = await api("GET", f"/sessions/{session_id}/verify")
            assert status == 200 and result["verified"] and result["sealed"], result


async def test_a_second_stop_signal_closes_the_sessions_without_the_rest_of_their_grace(tmp_path_factory, cluster):
    """An operator's second Ctrl-C (or SIGTERM) while the daemon waits out a long grace for a live session: the
    session is closed at once as at the grace's end (57P01, recorded), and the daemon finishes its stop."""
    async with held_on_a_daemon_of_its_own(tmp_path_factory, cluster, "pgstop2", "10m") as (daemon, client,
                                                                                            session_id):
        daemon.process.send_signal(signal.SIGINT)
        deadline = asyncio.get_running_loop().time() + 30
        while accepts(daemon.proxy_port):  # the stop is under way: its listeners closed first
            assert asyncio.get_running_loop().time() < deadline, "the listener never closed"
            await asyncio.sleep(0.05)
        assert daemon.process.poll() is None  # waiting out the grace for the live session
        assert await asyncio.to_thread(daemon.stop, signal.SIGINT) == 0  # the second; bounded by stop's 20 s
        await closed_by_the_stop(client)
        assert "stop signal again" in daemon.log_text()
        async with started_again(daemon, cluster) as api:
            session = await api.done_session(session_id)
            assert of_kind(session, "e")[-1] == SHUTTING_DOWN, session


async def test_a_kill_cancels_the_query_running_on_the_target(gateway, api, cluster):
    """PostgreSQL notices a closed client only when its query ends: the kill cancels it as well."""
    role = await api.role()
    secret, session_id = await api.credential(role)
    connection = await connect(gateway, secret)
    query = "select pg_sleep(30) as killed_mid_sleep"
    running = asyncio.ensure_future(connection.execute(query))
    await wait_for_backends(cluster.dsn(), query, running=True)
    status, body = await api("POST", f"/sessions/{session_id}/kill")
    assert status == 200 and body["exit_code"] == 254
    with pytest.raises((asyncpg.AdminShutdownError, asyncpg.ConnectionDoesNotExistError)):
        await asyncio.wait_for(running, 10)
    await wait_for_backends(cluster.dsn(), query, running=False)  # not left to sleep its 30 s
    connection.terminate()


async def test_credential_expiring_mid_session_ends_it_with_57P01(gateway, api):
    role = await api.role()
    secret, session_id = await api.credential(role, seconds=1)
    client = await RawClient.open(gateway)
    await client.login(secret)
    messages = await client.rest()
    client.close()
    assert [(m.severity, m.sqlstate, m.message) for m in messages] == [
        ("FATAL", "57P01", "credential expired: the session was closed")]
    session = await api.done_session(session_id)
    assert session["exit_code"] == 254 and of_kind(session, "e")[-1] == "credential expired: the session was closed"


async def test_malformed_client_bytes_get_08P01_and_the_daemon_goes_on(gateway, api):
    role = await api.role()
    secret, session_id = await api.credential(role)
    client = await RawClient.open(gateway)
    await client.login(secret)
    client.send(b"Q\x00\x00\x00\x02garbage")  # a length shorter than the length field itself
    messages = await client.rest()
    client.close()
    assert [(m.severity, m.sqlstate) for m in messages] == [("FATAL", "08P01")]
    session = await api.done_session(session_id)
    assert session["exit_code"] == 254 and of_kind(session, "e")[-1].startswith("protocol violation: ")

    for garbage in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"\x00\x00\x00\x08\x00\x00\x00\x00",
                    os.urandom(64), b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"):
        raw = await RawClient.open(gateway)
        raw.send(garbage)
        answer = await raw.rest()
        raw.close()
        assert answer and isinstance(answer[0], pg.ErrorResponse) and answer[0].severity == "FATAL"
    result = psql(gateway, secret, "-A", "-t", "-c", "select 'still serving'")
    assert result.stdout.strip() == "still serving"


async def test_million_rows_stream_in_bounded_memory_and_the_recording_truncates(gateway, api, tmp_path):
    role = await api.role()
    secret, session_id = await api.credential(role)
    output = tmp_path / "rows.txt"
    result = psql(gateway, secret, "-A", "-t", "-o", str(output),
                  "-c", "select g, md5(g::text) from generate_series(1, 1000000) g", timeout=180)
    assert result.returncode == 0, result.stderr
    assert output.read_bytes().count(b"\n") == 1_000_000
    session = await api.done_session(session_id)
    assert session["metrics"]["truncated"] is True
    assert session["event_size"] <= RECORDING_CAP + 200
    assert "recording truncated" in of_kind(session, "e")[-1]
    status_file = Path(f"/proc/{gateway.process.pid}/status").read_text()
    peak_kb = int(next(line for line in status_file.splitlines() if line.startswith("VmHWM:")).split()[1])
    print(f"gatewayd peak RSS after 1,000,000 rows: {peak_kb / 1024:.1f} MiB")
    assert peak_kb < 150 * 1024



def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) / 1024


async def test_a_client_that_stops_reading_holds_the_target_back(gateway, api):
    """Flow control: 220 MB of rows wait in the target and the kernel, not in the gateway."""
    role = await api.role()
    secret, _ = await api.credential(role)
    client = await RawClient.open(gateway)
    try:
        await client.login(secret)
        before = rss_mib(gateway.process.pid)
        client.send(pg.encode_query("select g, repeat('x', 200) from generate_series(1, 1000000) g"))
        await asyncio.sleep(1.5)  # not reading
        assert rss_mib(gateway.process.pid) - before < 40
        rows = 0
        while not isinstance(message := await client.message(), pg.ReadyForQuery):
            rows += isinstance(message, pg.DataRow)
        assert rows == 1_000_000
    finally:
        client.close()


async def test_listener_moves_and_stops_live_without_cutting_open_sessions(gateway, api):
    role = await api.role()
    secret, _ = await api.credential(role)
    connection = await connect(gateway, secret)
    status, misc = await api("GET", "/serverconfig/misc")
    old = misc["postgres_server_config"]["listen_address"]
    new_port = free_port()
    try:
        misc["postgres_server_config"]["listen_address"] = f"127.0.0.1:{new_port}"
        status, _ = await api("PUT", "/serverconfig/misc", misc)
        assert status == 200
        moved = await asyncpg.connect(host="127.0.0.1", port=new_port, user=secret, password="any",
                                      database="postgres", timeout=15)
        assert await moved.fetchval("select 'moved'") == "moved"
        await moved.close()
        with pytest.raises(OSError):
            await connect(gateway, secret)
        misc["postgres_server_config"]["listen_address"] = ""
        status, _ = await api("PUT", "/serverconfig/misc", misc)
        assert status == 200
        with pytest.raises(OSError):
            await asyncpg.connect(host="127.0.0.1", port=new_port, user=secret, password="any", timeout=15)
        assert await connection.fetchval("select 'still open'") == "still open"
    finally:
        misc["postgres_server_config"]["listen_address"] = old
        status, _ = await api("PUT", "/serverconfig/misc", misc)
        assert status == 200
        await connection.close()
    status, info = await api("GET", "/serverinfo")
    assert info["listeners"]["postgres"]["status"] == "running"


@pytest.fixture(scope="module")
async def fuzz_secret(api):
    role = await api.role()
    secret, _ = await api.credential(role, seconds=3600)
    return secret


FRONTEND_TYPES = [b"Q", b"P", b"B", b"D", b"E", b"C", b"S", b"H", b"d", b"c", b"f", b"p", b"X", b"\x00", b"\xff"]
FRAMES = st.one_of(
    st.binary(max_size=48),
    st.builds(lambda kind, length, body: kind + struct.pack("!i", length) + body, st.sampled_from(FRONTEND_TYPES),
              st.integers(-(2**31), 2**31 - 1) | st.integers(0, 40), st.binary(max_size=40)),
    st.builds(lambda length, code, body: struct.pack("!iI", length, code) + body,  # start-up packets
              st.integers(-8, 20_000) | st.integers(8, 40), st.sampled_from([80877103, 80877102, 80877104, 196608,
                                                                            196610, 0]) | st.integers(0, 2**32 - 1),
              st.binary(max_size=40)),
)


@settings(max_examples=int(os.environ.get("GATEWAYD_FUZZ_EXAMPLES", "60")), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chunks=st.lists(FRAMES, min_size=1, max_size=4), login=st.booleans())
def test_fuzzed_client_bytes_never_hang_or_crash_the_daemon(gateway, fuzz_secret, chunks, login):
    """Random, truncated and oversized frames, before or after login: an answer or a FATAL, then a close."""
    with socket.create_connection(("127.0.0.1", gateway.pg_port), timeout=10) as sock:
        backend = pg.BackendReader()
        if login:
            sock.sendall(pg.encode_startup_message({"user": fuzz_secret, "database": "postgres"}))
            while not any(isinstance(m, pg.ReadyForQuery) for m in backend):
                backend.feed(sock.recv(65536))
        sock.sendall(b"".join(chunks))
        sock.shutdown(socket.SHUT_WR)  # a frame left incomplete ends at the end of the stream
        received = b""
        while data := sock.recv(65536):  # a hang would raise socket.timeout here
            received += data
    if login:
        backend.feed(received)
        for message in backend:
            if isinstance(message, pg.ErrorResponse) and message.severity == "FATAL":
                assert message.sqlstate == "08P01", message.message
    assert gateway.process.poll() is None


def test_the_daemon_logged_no_unexpected_error(gateway):
    """Last in the module: everything above ended in protocol terms, never in a traceback."""
    log = gateway.log_text()
    assert "Traceback" not in log and "postgres connection failed" not in log, log[-5000:]
