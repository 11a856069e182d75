"""End to end: guard rail patterns that would freeze a backtracking engine, and blocks on the record, through
psql, OpenSSH ssh and curl of one real gatewayd (all three listeners) to a real PostgreSQL, sshd and HTTP app.

The daemon runs every proxy on one event loop: a pattern that backtracks for
minutes on one session stalls every other one.  Each test makes its own
connections (roles), so rules never leak between tests.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import time

import asyncpg
import pytest

from tests import clients
from tests.apiclient import PostgresApi, SshApi, admin_http, events
from tests.conftest import free_port, proxy_daemon
from tests.pgpeer import unavailable_reason as pg_unavailable
from tests.sshpeer import unavailable_reason as ssh_unavailable
from tests.test_http_proxy import HttpApi

pytestmark = pytest.mark.skipif(pg_unavailable() is not None or ssh_unavailable() is not None,
                                reason=pg_unavailable() or ssh_unavailable() or "")

EVIL = "x" * 30 + "!"  # 30 characters: hours for a backtracking engine with the patterns below
CATASTROPHIC = [r"(x+)+$", r"(x|xx)+$", r"(.*x){40}", r"^(([a-z])+.)+[A-Z]([a-z])+$"]


@pytest.fixture(scope="module")
def cluster(pg_target):
    return pg_target  # conftest's, shared with the other modules that need one cluster


@pytest.fixture(scope="module")
def sshd(ssh_target):
    return ssh_target


@pytest.fixture(scope="module")
def web_target(http_target):
    return http_target


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    ssh_port, http_port = free_port(), free_port()
    daemon = proxy_daemon(tmp_path_factory, "rails", "postgres", {
        "listeners.ssh": f"127.0.0.1:{ssh_port}", "listeners.http": f"127.0.0.1:{http_port}"}, wait=True)
    daemon.pg_port, daemon.ssh_port, daemon.http_url = daemon.proxy_port, ssh_port, f"http://127.0.0.1:{http_port}"
    yield daemon
    assert daemon.stop() == 0


@pytest.fixture(scope="module")
async def apis(gateway, cluster, sshd, web_target):
    async with admin_http(gateway) as http:
        yield PostgresApi(gateway, http, cluster), SshApi(gateway, http, sshd), HttpApi(gateway, http, web_target)


def psql(gateway, secret: str, sql: str) -> subprocess.CompletedProcess[str]:
    return clients.psql(gateway.pg_port, secret, "-A", "-t", "-c", sql, timeout=120)


def ssh(gateway, secret: str, command: str) -> subprocess.CompletedProcess[str]:
    return clients.ssh(gateway.ssh_port, secret, command, text=True, timeout=120)


def curl(gateway, secret: str, path: str, *args: str) -> subprocess.CompletedProcess[str]:
    return clients.curl("-w", "\n%{http_code}", "-H", f"Authorization: {secret}", *args, gateway.http_url + path,
                        text=True, timeout=120)


async def test_patterns_re2_cannot_run_are_refused_with_400(apis):
    pg_api, _, _ = apis
    role = await pg_api.role()
    body = {"name": "lookaround", "connection_ids": [role["id"]],
            "input": {"rules": [{"type": "pattern_match", "pattern_regex": r"(a)\1"}]}}
    status, error = await pg_api("POST", "/guardrails", body)
    assert status == 400 and "backreferences not supported" in error["message"], error
    assert "input.rules[0].pattern_regex" in error["message"]
    rail = await pg_api.guardrail(role, input_rules=[{"type": "pattern_match", "pattern_regex": "ok"}])
    body["output"] = {"rules": [{"type": "pattern_match", "pattern_regex": r"(?<=secret-)\d+"}]}
    body["input"] = {"rules": []}
    status, error = await pg_api("PUT", f"/guardrails/{rail['id']}", body)
    assert status == 400 and "lookbehind not supported" in error["message"], error
    status, kept = await pg_api("GET", f"/guardrails/{rail['id']}")
    assert status == 200 and kept["input"]["rules"][0]["pattern_regex"] == "ok"


async def test_catastrophic_patterns_cannot_stall_the_daemon(apis, gateway):
    pg_api, ssh_api, http_api = apis
    rules = [{"type": "pattern_match", "pattern_regex": p} for p in CATASTROPHIC]
    roles = [await pg_api.role(), await ssh_api.role(), await http_api.role()]
    for role in roles:
        await pg_api.guardrail(role, input_rules=rules, output_rules=rules)
    (pg_secret, _), (ssh_secret, _), (http_secret, _) = [await api.credential(role) for api, role in
                                                         zip(apis, roles)]

    # another session keeps working meanwhile; its latencies are printed, never asserted
    bystander_role = await pg_api.role()
    bystander_secret, _ = await pg_api.credential(bystander_role)
    bystander = await asyncpg.connect(host="127.0.0.1", port=gateway.pg_port, user=bystander_secret,
                                      password="any", database="postgres", timeout=15, command_timeout=120)
    latencies: dict[str, list[float]] = {"bystander select": [], "api healthz": []}
    done = asyncio.Event()

    async def keep_working() -> None:
        while not done.is_set():
            start = time.perf_counter()
            assert await bystander.fetchval("select 1") == 1
            latencies["bystander select"].append(time.perf_counter() - start)
            start = time.perf_counter()
            status, _ = await pg_api("GET", "/healthz")
            assert status == 200
            latencies["api healthz"].append(time.perf_counter() - start)
            await asyncio.sleep(0.02)

    worker = asyncio.create_task(keep_working())
    try:
        timings = {}
        start = time.perf_counter()
        result = await asyncio.to_thread(psql, gateway, pg_secret, f"select '{EVIL}' as evil")
        timings["psql"] = time.perf_counter() - start
        assert result.returncode == 0 and result.stdout.strip() == EVIL, result.stderr
        start = time.perf_counter()
        result = await asyncio.to_thread(ssh, gateway, ssh_secret, f"echo '{EVIL}'")
        timings["ssh"] = time.perf_counter() - start
        assert result.returncode == 0 and result.stdout.strip() == EVIL, result.stderr
        start = time.perf_counter()
        result = await asyncio.to_thread(curl, gateway, http_secret, f"/text?say={EVIL}")
        timings["http"] = time.perf_counter() - start
        assert result.stdout.split("\n") == [EVIL, "200"], (result.stdout, result.stderr)
    finally:
        done.set()
        await worker
        await bystander.close()
    for name, seconds in timings.items():
        print(f"{name}: {seconds * 1000:.0f} ms for {EVIL!r} against {len(CATASTROPHIC)} patterns in and out")
    for name, values in latencies.items():
        assert values, name  # it kept working
        print(f"{name}: {len(values)} calls, max {max(values) * 1000:.0f} ms")


async def test_blocked_input_is_recorded_then_blocked_in_every_protocol(apis):
    """``i`` (what was tried), then ``e`` (the block), and the audit entry names the input."""
    pg_api, ssh_api, http_api = apis
    words = [{"type": "deny_words_list", "words": ["forbidden thing"]}]
    message = "validation error, match guard rails input rule, type=deny_words_list, words=[forbidden thing]"
    roles = [await pg_api.role(), await ssh_api.role(), await http_api.role()]
    for role in roles:
        await pg_api.guardrail(role, input_rules=words)
    (pg_secret, pg_session), (ssh_secret, ssh_session), (http_secret, http_session) = [
        await api.credential(role) for api, role in zip(apis, roles)]

    sql = "select 'forbidden/**/thing'"
    result = await asyncio.to_thread(psql, pg_api.daemon, pg_secret, sql)
    assert message in result.stderr
    result = await asyncio.to_thread(ssh, ssh_api.daemon, ssh_secret, "echo forbidden   thing")
    assert result.returncode == 254 and message in result.stderr
    result = await asyncio.to_thread(curl, http_api.daemon, http_secret, "/echo/a", "-H", "X-Note: forbidden thing",
                                     "-H", "Cookie: target_session=target-secret-42")
    assert result.stdout.endswith("403") and message in result.stdout

    session = await pg_api.done_session(pg_session)
    assert events(session) == [("i", sql), ("e", message)]
    session = await ssh_api.done_session(ssh_session)
    assert events(session) == [("i", "echo forbidden   thing"), ("e", message)]
    session = await http_api.session(http_session, until=lambda s: any(k == "e" for k, _ in events(s)))
    (kind, head), block = events(session)
    assert kind == "i" and head.startswith("GET /echo/a HTTP/1.1") and "X-Note: forbidden thing" in head
    assert block == ("e", message)
    status, logs = await pg_api("GET", "/audit/logs?action=guardrail.block&page_size=100")
    assert status == 200
    inputs = {e["request_payload_redacted"]["session_id"]: e["request_payload_redacted"].get("input")
              for e in logs["data"]}
    assert inputs[pg_session] == sql and inputs[ssh_session] == "echo forbidden   thing"
    assert "X-Note: forbidden thing" in inputs[http_session] and http_secret not in inputs[http_session]
    assert "target-secret-42" not in inputs[http_session]  # the audit entry holds the redacted head, as recorded


async def test_statement_rules_keep_the_table_through_psql_and_asyncpg(apis, cluster, gateway):
    """require_where / statement_kinds: simple Query (psql) and Parse (asyncpg) refused; the table survives."""
    pg_api, _, _ = apis
    status, error = await pg_api("POST", "/guardrails", {
        "name": "bad-kind", "input": {"rules": [{"type": "statement_kinds", "deny": ["DropTable"]}]}})
    assert status == 400 and "unknown statement node 'DropTable'" in error["message"] and "DropStmt" in error["message"]
    status, error = await pg_api("POST", "/guardrails", {
        "name": "bad-where", "input": {"rules": [{"type": "require_where", "statements": ["merge"]}]}})
    assert status == 400 and "one of delete, update" in error["message"], error

    table = f"keep_{os.urandom(4).hex()}"
    direct = await asyncpg.connect(host="127.0.0.1", port=cluster.port, user="postgres", password=cluster.password,
                                   database="postgres", ssl=False)
    try:
        await direct.execute(f"create table {table} (a int); insert into {table} values (1), (2)")
        role = await pg_api.role()
        await pg_api.guardrail(role, input_rules=[{"type": "require_where", "statements": ["delete", "update"]},
                                                  {"type": "statement_kinds", "deny": ["DropStmt", "TruncateStmt"]}])
        secret, session_id = await pg_api.credential(role)
        for sql in [f"DELETE FROM {table}", f'with x as (delete from only "{table}" t returning *) select 1',
                    f"select 1; explain analyze update {table} set a = 0", f"drop/**/table {table}",
                    f"do $$ begin delete from {table}; end $$"]:
            result = await asyncio.to_thread(psql, gateway, secret, sql)
            assert result.returncode != 0 and "guard rails input rule" in result.stderr, (sql, result.stderr)
        result = await asyncio.to_thread(psql, gateway, secret, f"select 1; truncate {table}")
        assert "statement=TruncateStmt (statement 2 of 2)" in result.stderr, result.stderr
        result = await asyncio.to_thread(psql, gateway, secret,
                                         f"delete from {table} where a = 2; select count(*) from {table}")
        assert result.returncode == 0 and result.stdout.split() == ["DELETE", "1", "1"], result.stderr

        client = await asyncpg.connect(host="127.0.0.1", port=gateway.pg_port, user=secret, password="any",
                                       database="postgres", ssl=False, timeout=15)
        try:
            with pytest.raises(asyncpg.PostgresError, match="delete without WHERE"):
                await client.prepare(f"delete from {table}")  # refused at Parse
            with pytest.raises(asyncpg.PostgresError, match="update without WHERE"):
                await client.fetch(f"update {table} set a = $1 returning a", 0)
            assert await client.fetchval(f"select count(*) from {table} where a = $1", 1) == 1  # still usable
        finally:
            await client.close()
        assert await direct.fetch(f"select a from {table}") == [(1,)]
    finally:
        await direct.execute(f"drop table if exists {table}")
        await direct.close()


@pytest.mark.parametrize("rule, says", [
    ({"type": "statement_kinds", "deny": ["UpdateStmt"]}, "statement={} (it has the effect of UpdateStmt)"),
    ({"type": "require_where", "statements": ["update"]}, "update without WHERE ({})"),
])
async def test_what_has_an_updates_effect_is_refused_and_the_rows_stay(apis, cluster, gateway, rule, says):
    """An upsert updates every row its SELECT meets, a column's type changed ``USING`` an expression writes every
    row's value anew: refused where updates are (psql's Query, asyncpg's Parse); ``ON CONFLICT DO NOTHING`` is
    an insert and passes."""
    pg_api, _, _ = apis
    table = f"upsert_{os.urandom(4).hex()}"
    direct = await asyncpg.connect(host="127.0.0.1", port=cluster.port, user="postgres", password=cluster.password,
                                   database="postgres", ssl=False)
    try:
        await direct.execute(f"create table {table} (id int primary key, a int); "
                             f"insert into {table} values (1, 1), (2, 2)")
        role = await pg_api.role()
        await pg_api.guardrail(role, input_rules=[rule])
        secret, _ = await pg_api.credential(role)
        attacks = {f"insert into {table} select * from {table} on conflict (id) do update set a = 0":
                   "InsertStmt ON CONFLICT DO UPDATE",
                   f"alter table {table} alter column a type int using 0": "AlterTableStmt ALTER COLUMN TYPE USING"}
        for sql, node in attacks.items():
            result = await asyncio.to_thread(psql, gateway, secret, sql)
            assert result.returncode != 0 and says.format(node) in result.stderr, (sql, result.stderr)
        client = await asyncpg.connect(host="127.0.0.1", port=gateway.pg_port, user=secret, password="any",
                                       database="postgres", ssl=False, timeout=15)
        try:
            for sql, node in attacks.items():
                with pytest.raises(asyncpg.PostgresError, match=re.escape(says.format(node))):
                    await client.prepare(sql)  # refused at Parse
            await client.execute(f"insert into {table} select * from {table} on conflict do nothing")
        finally:
            await client.close()
        assert await direct.fetch(f"select id, a from {table} order by id") == [(1, 1), (2, 2)]
    finally:
        await direct.execute(f"drop table if exists {table}")
        await direct.close()


async def test_statement_rules_are_refused_on_ssh_and_the_words_alone_apply(apis):
    """A rail mixing deny words and statement rules cannot attach to an ssh connection (422: a shell has no
    statements, and a rule never silently applies some other way); the words alone attach and apply."""
    _, ssh_api, _ = apis
    role = await ssh_api.role()
    status, body = await ssh_api("POST", "/guardrails", {
        "name": f"mixed-{role['name']}", "connection_ids": [role["id"]],
        "input": {"rules": [{"type": "require_where", "statements": ["delete"]},
                            {"type": "deny_words_list", "words": ["forbidden thing"]}]}})
    assert status == 422 and "require_where reads SQL statements" in body["message"], body
    await ssh_api.guardrail(role, input_rules=[{"type": "deny_words_list", "words": ["forbidden thing"]}])
    secret, _ = await ssh_api.credential(role)
    result = await asyncio.to_thread(ssh, ssh_api.daemon, secret, "echo delete from t")
    assert result.returncode == 0 and result.stdout.strip() == "delete from t", result.stderr
    secret, _ = await ssh_api.credential(role)
    result = await asyncio.to_thread(ssh, ssh_api.daemon, secret, "echo forbidden thing")
    assert result.returncode == 254 and "words=[forbidden thing]" in result.stderr