"""End to end: native sessions analysed in the background, with real asyncpg and OpenSSH through gatewayd.

What a user sends is analysed after the guard rails let it through; a
verdict that blocks ends the live session (exit 254), so what comes after the
risky statement or command does not run.  Each risky input below is preceded,
in the same message, by a long sleep: the kill, not the clock, decides that
the destructive part never runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import uuid

import aiohttp
import asyncpg
import pytest

from tests import clients
from tests.apiclient import Api, SshApi, events, of_kind, postgres_env
from tests.conftest import free_port, proxy_daemon
from tests.llmpeer import API_KEY, FakeLLM
from tests.pgpeer import unavailable_reason as pg_unavailable
from tests.sshpeer import CLIENT_OPTIONS, SshTarget
from tests.sshpeer import unavailable_reason as ssh_unavailable

_REASON = pg_unavailable() or ssh_unavailable()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")

BLOCK_HIGH = {"low_risk_action": "allow_execution", "medium_risk_action": "allow_execution",
              "high_risk_action": "block_execution"}


@pytest.fixture(scope="module")
def cluster(pg_target):
    """The session's PostgreSQL target (conftest): started once for every module."""
    return pg_target


@pytest.fixture(scope="module")
def sshd():
    peer = SshTarget().start()
    yield peer
    peer.destroy()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    ssh_port = free_port()
    daemon = proxy_daemon(tmp_path_factory, "ai-native", "postgres", {"listeners.ssh": f"127.0.0.1:{ssh_port}"},
                          wait=True)
    daemon.ssh_port = ssh_port
    daemon.admin = daemon.token("ada@example.com", groups="admin", name="Ada Admin")
    yield daemon
    assert daemon.stop() == 0


@pytest.fixture(scope="module")
async def llm():
    server = await FakeLLM().start()
    yield server
    await server.stop()


@pytest.fixture(scope="module")
async def api(gateway, sshd):
    async with aiohttp.ClientSession() as http:
        yield SshApi(gateway, http, sshd, gateway.admin)


async def analysed(api: Api, conn: dict, **options) -> str:
    name = f"rule-{conn['name']}"
    status, rule = await api("POST", "/ai/session-analyzer/rules", {
        "name": name, "connection_names": [conn["name"]], "risk_evaluation": BLOCK_HIGH, **options})
    assert status == 201, rule
    return name


async def through_gateway(gateway, secret: str) -> asyncpg.Connection:
    return await asyncpg.connect(host="127.0.0.1", port=gateway.proxy_port, user=secret, password="any",
                                 database="postgres", ssl=False)


async def asked(llm: FakeLLM, count: int, timeout: float = 30) -> None:
    """Until the fake provider has received ``count`` requests (a bound, not a timing assertion)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while len(llm.requests) < count:
        assert asyncio.get_running_loop().time() < deadline, f"the provider was asked {len(llm.requests)} times"
        await asyncio.sleep(0.02)


async def audit_of(api: Api, action: str, session_id: str) -> list[dict]:
    status, body = await api("GET", f"/audit/logs?action={action}&page_size=100")
    assert status == 200, body
    return [e for e in body["data"] if (e["request_payload_redacted"] or {}).get("session_id") == session_id]


async def test_a_risky_statement_ends_a_postgres_session_before_the_rest_runs(api, gateway, cluster):
    await api("DELETE", "/ai/session-analyzer/providers")
    table = f"victim_{uuid.uuid4().hex[:8]}"
    direct = await asyncpg.connect(cluster.dsn())
    await direct.execute(f"create table {table} (i int); insert into {table} values (1)")
    conn = await api.connection("pg", "database", "postgres", postgres_env(cluster))
    rule = await analysed(api, conn)
    secret, session_id = await api.credential(conn)
    client = await through_gateway(gateway, secret)
    try:
        assert await client.fetchval("select 41 + 1") == 42
        assert await client.fetchval(f"select count(*) from {table} where i = $1", 1) == 1  # extended protocol
        with pytest.raises((asyncpg.exceptions.PostgresError, asyncpg.exceptions.InterfaceError, OSError)):
            await client.execute(f"select pg_sleep(60); drop table {table}")
    finally:
        await client.close(timeout=10)
    session = await api.done_session(session_id, 30)
    assert session["exit_code"] == 254
    assert session["ai_analysis"]["action"] == "block_execution" and session["ai_analysis"]["risk_level"] == "high"
    errors = of_kind(session, "e")
    assert any(f"AI session analysis (rule '{rule}'): high risk, Drops a table" in e for e in errors), errors
    assert any("the session was ended by AI session analysis" in e for e in errors), errors
    assert await direct.fetchval(f"select count(*) from {table}") == 1  # the DROP never ran
    await direct.close()
    (entry,) = await audit_of(api, "ai.block", session_id)
    assert entry["request_payload_redacted"]["rule"] == rule


async def test_routine_statements_leave_the_session_open_with_a_low_analysis(api, gateway, cluster):
    await api("DELETE", "/ai/session-analyzer/providers")
    conn = await api.connection("pg", "database", "postgres", postgres_env(cluster))
    await analysed(api, conn)
    secret, session_id = await api.credential(conn)
    client = await through_gateway(gateway, secret)
    try:
        assert await client.fetchval("select 1") == 1
        session = await api.session(session_id, until=lambda s: bool(s.get("ai_analysis")))
        assert session["status"] == "open" and session["ai_analysis"]["risk_level"] == "low"
        assert session["ai_analysis"]["action"] == "allow_execution"
        assert await client.fetchval("select 2") == 2
    finally:
        await client.close(timeout=10)
    session = await api.done_session(session_id, 30)
    assert session["exit_code"] != 254 and not [e for e in of_kind(session, "e") if "AI session analysis" in e]


async def test_the_providers_verdict_on_a_statement_ends_the_session_and_an_outage_is_told_once(
        api, gateway, cluster, llm):
    status, body = await api("PUT", "/ai/session-analyzer/providers", {
        "provider": "openai", "model": "judge-1", "api_url": f"{llm.url}/v1", "api_key": API_KEY})
    assert status == 200, body
    try:
        conn = await api.connection("pg", "database", "postgres", postgres_env(cluster))
        await analysed(api, conn)
        llm.answer("error", status=503)  # native sessions fail open by default: the built-in rules stand in
        llm.requests.clear()
        secret, session_id = await api.credential(conn)
        client = await through_gateway(gateway, secret)
        try:
            assert await client.fetchval("select 1") == 1
            assert await client.fetchval("select 2") == 2
            await asked(llm, 2)  # both statements got their error before the provider changes its mind
            llm.requests.clear()
            llm.answer("verdict", "high", "Reads payroll", "The statement reads the salary of every employee.")
            with pytest.raises((asyncpg.exceptions.PostgresError, asyncpg.exceptions.InterfaceError, OSError)):
                await client.execute("select 'payroll'; select pg_sleep(60)")
        finally:
            await client.close(timeout=10)
        session = await api.done_session(session_id, 30)
        assert session["exit_code"] == 254
        assert session["ai_analysis"] == {"action": "block_execution", "risk_level": "high", "title": "Reads payroll",
                                          "explanation": "The statement reads the salary of every employee."}
        failures = [e for e in of_kind(session, "e") if "AI session analysis failed" in e]
        assert len(failures) == 1 and "HTTP 503" in failures[0] and "fails open" in failures[0]
        assert len(await audit_of(api, "ai.analysis_failed", session_id)) == 1
        assert any("select 'payroll'" in (r.body or {}).get("messages", [{}])[-1].get("content", "")
                   for r in llm.requests)
    finally:
        await api("DELETE", "/ai/session-analyzer/providers")


async def test_a_risky_ssh_command_is_ended_before_it_deletes_anything(api, gateway, sshd, tmp_path):
    await api("DELETE", "/ai/session-analyzer/providers")
    victim = f"/tmp/ai-victim-{uuid.uuid4().hex[:8]}"
    os.makedirs(victim, mode=0o777)
    os.chmod(victim, 0o777)
    with open(f"{victim}/keep.txt", "w") as handle:
        handle.write("keep me\n")
    try:
        conn = await api.role()
        rule = await analysed(api, conn)
        secret, session_id = await api.credential(conn)
        result = await asyncio.to_thread(
            subprocess.run, ["ssh", *CLIENT_OPTIONS, "-p", str(gateway.ssh_port), f"{secret}@127.0.0.1",
                             f"sleep 60; rm -rf {victim}"], capture_output=True, text=True, timeout=120, check=False)
        assert result.returncode == 254, result.stderr
        assert "AI session analysis" in result.stderr
        assert os.path.exists(f"{victim}/keep.txt")
        session = await api.done_session(session_id, 30)
        assert session["ai_analysis"]["title"] == "Recursive forced delete"
        assert any(f"(rule '{rule}'): high risk, Recursive forced delete" in e for e in of_kind(session, "e"))
        assert await audit_of(api, "ai.block", session_id)
    finally:
        subprocess.run(["rm", "-rf", victim], check=False)


async def test_a_risky_shell_line_ends_an_interactive_ssh_session(api, gateway, sshd):
    await api("DELETE", "/ai/session-analyzer/providers")
    victim = f"/tmp/ai-victim-{uuid.uuid4().hex[:8]}"
    os.makedirs(victim, mode=0o777)
    os.chmod(victim, 0o777)
    with open(f"{victim}/keep.txt", "w") as handle:
        handle.write("keep me\n")
    try:
        conn = await api.role()
        rule = await analysed(api, conn)
        secret, session_id = await api.credential(conn)
        result = await asyncio.to_thread(
            subprocess.run, ["ssh", *CLIENT_OPTIONS, "-tt", "-p", str(gateway.ssh_port), f"{secret}@127.0.0.1"],
            input=f"echo shell-ok\nsleep 60; rm -rf {victim}\nexit\n", capture_output=True, text=True, timeout=120,
            check=False)
        assert result.returncode == 254, (result.stdout, result.stderr)
        assert os.path.exists(f"{victim}/keep.txt")
        session = await api.done_session(session_id, 30)
        assert session["ai_analysis"]["action"] == "block_execution"
        assert any(f"(rule '{rule}'): high risk, Recursive forced delete" in e for e in of_kind(session, "e"))
    finally:
        subprocess.run(["rm", "-rf", victim], check=False)


# ---------------------------------------------------------------------------- synchronous mode
# A rule with ``native_mode: sync`` holds each statement or command until its verdict is known.
# The provider below answers slowly and rates "high" what the built-in rules rate low (creating a
# table or a file): under the asynchronous mode those would run before the verdict lands; here the
# effect that did not happen is the proof that the statement waited.


def psql(gateway, secret: str, script: str) -> subprocess.CompletedProcess[str]:
    return clients.psql(gateway.proxy_port, secret, "-At", "-f", "-", stdin=script, timeout=120)


async def exists(cluster, table: str) -> bool:
    direct = await asyncpg.connect(cluster.dsn())
    try:
        return await direct.fetchval("select to_regclass($1) is not null", table)
    finally:
        await direct.close()


@pytest.fixture
async def provider(api, llm):
    status, body = await api("PUT", "/ai/session-analyzer/providers", {
        "provider": "openai", "model": "judge-1", "api_url": f"{llm.url}/v1", "api_key": API_KEY})
    assert status == 200, body
    llm.answer("verdict", "low", "Routine query", "Reads data only.", delay=0.5)
    llm.requests.clear()
    yield llm
    llm.answer()
    await api("DELETE", "/ai/session-analyzer/providers")


async def test_sync_a_psql_statement_waits_for_its_verdict_and_is_refused_before_it_runs(
        api, gateway, cluster, provider):
    table = f"secret_{uuid.uuid4().hex[:8]}"
    provider.answer_for(f"create table {table}", "high", "Creates a secret table",
                        "The statement creates a table the rule forbids.")
    conn = await api.connection("pg", "database", "postgres", postgres_env(cluster))
    rule = await analysed(api, conn, native_mode="sync", timeout=60)
    secret, session_id = await api.credential(conn)
    done = await asyncio.to_thread(psql, gateway, secret,
                                   f"select 'before';\ncreate table {table} (i int);\nselect 'after';\n")
    assert "before" in done.stdout and "after" in done.stdout, (done.stdout, done.stderr)
    message = (f"blocked by AI session analysis (rule '{rule}'): high risk, Creates a secret table: "
               "The statement creates a table the rule forbids.")
    assert message in done.stderr, done.stderr
    assert not await exists(cluster, table)  # refused before PostgreSQL saw it
    session = await api.done_session(session_id, 30)
    assert session["exit_code"] != 254  # a refused statement, not a killed session
    assert session["ai_analysis"] == {"action": "block_execution", "risk_level": "high",
                                      "title": "Creates a secret table",
                                      "explanation": "The statement creates a table the rule forbids."}
    stream = [(kind, text) for kind, text in events(session) if kind in "ie"]
    at = stream.index(("i", f"create table {table} (i int);"))
    assert stream[at + 1] == ("e", message), stream
    assert ("i", "select 'after';") in stream[at + 2:]
    (entry,) = await audit_of(api, "ai.block", session_id)
    assert entry["request_payload_redacted"]["rule"] == rule
    assert entry["request_payload_redacted"]["risk_level"] == "high"
    assert not await audit_of(api, "guardrail.block", session_id)
    asked = [json.dumps(r.body) for r in provider.requests]
    assert any(f"create table {table}" in a for a in asked) and any("select 'after'" in a for a in asked)


async def test_sync_asyncpg_parse_is_refused_and_what_was_pipelined_after_it_follows(api, gateway, cluster, provider):
    table = f"ledger_{uuid.uuid4().hex[:8]}"
    direct = await asyncpg.connect(cluster.dsn())
    await direct.execute(f"create table {table} (i int); insert into {table} values (1)")
    provider.answer_for(f"insert into {table}", "high", "Writes the ledger", "Adds rows to the ledger.")
    conn = await api.connection("pg", "database", "postgres", postgres_env(cluster))
    await analysed(api, conn, native_mode="sync", timeout=60)
    secret, session_id = await api.credential(conn)
    client = await through_gateway(gateway, secret)
    try:
        assert await client.fetchval(f"select count(*) from {table} where i = $1", 1) == 1
        with pytest.raises(asyncpg.exceptions.InsufficientPrivilegeError, match="Writes the ledger"):
            await client.execute(f"insert into {table} values ($1)", 2)  # Parse, Describe, Sync in one write
        with pytest.raises(asyncpg.exceptions.InsufficientPrivilegeError):
            await client.fetchval(f"insert into {table} values ($1) returning i", 3)
        assert await client.fetchval("select $1::int + 1", 41) == 42  # the session goes on
    finally:
        await client.close(timeout=10)
    assert await direct.fetchval(f"select count(*) from {table}") == 1
    await direct.close()
    session = await api.done_session(session_id, 30)
    assert session["exit_code"] != 254 and session["ai_analysis"]["action"] == "block_execution"
    assert len(await audit_of(api, "ai.block", session_id)) == 2


@pytest.mark.parametrize("on_failure", ["closed", "open"])
async def test_sync_a_provider_that_does_not_answer_in_time_fails_as_the_rule_says(
        api, gateway, cluster, provider, on_failure):
    table = f"slow_{on_failure}_{uuid.uuid4().hex[:8]}"
    provider.answer("timeout")  # never answers: the rule's timeout ends the wait
    conn = await api.connection("pg", "database", "postgres", postgres_env(cluster))
    rule = await analysed(api, conn, native_mode="sync", timeout=1, on_failure=on_failure)
    secret, session_id = await api.credential(conn)
    done = await asyncio.to_thread(psql, gateway, secret, f"create table {table} (i int);\n")
    session = await api.done_session(session_id, 30)
    failures = [e for e in of_kind(session, "e") if "AI session analysis failed" in e]
    assert len(failures) == 1 and f"rule '{rule}' fails {on_failure}" in failures[0], failures
    assert len(await audit_of(api, "ai.analysis_failed", session_id)) == 1
    if on_failure == "closed":
        assert "Analyzer unavailable" in done.stderr, done.stderr
        assert not await exists(cluster, table)
        assert "the statement is refused" in failures[0]
        assert len(await audit_of(api, "ai.block", session_id)) == 1
    else:
        assert done.returncode == 0 and "ERROR" not in done.stderr, done.stderr
        assert await exists(cluster, table)  # the built-in rules rate it low: it ran
        assert not await audit_of(api, "ai.block", session_id)
        stream = [(kind, text) for kind, text in events(session) if kind in "ie"]
        failed = next(i for i, (kind, text) in enumerate(stream) if "AI session analysis failed" in text)
        assert failed < stream.index(("i", f"create table {table} (i int);")), stream  # it waited for the outcome


async def test_sync_a_fast_path_function_call_waits_for_its_verdict_and_is_refused_before_it_runs(
        api, gateway, cluster, provider, tmp_path):
    """A FunctionCall the connection lets through (libpq's ``\\lo_export``: lo_open, loread, lo_close) carries no
    SQL, but it is an input like a statement: under a sync rule it waits for its verdict and a refusal is said
    as for a statement, before the target ran it."""
    direct = await asyncpg.connect(cluster.dsn())
    oid = await direct.fetchval("select lo_from_bytea(0, convert_to('the ledger', 'UTF8'))::int")
    await direct.close()
    # libpq's lo_initialize first reads the functions' OIDs with a query naming them: only the call is refused
    provider.answer_for("pg_catalog.lo_open(", "high", "Opens a large object",
                        "The rule forbids reading large objects.")
    conn = await api.connection("pg", "database", "postgres", postgres_env(cluster),
                                settings={"postgres": {"function_calls": ["large_objects"]}})
    rule = await analysed(api, conn, native_mode="sync", timeout=60)
    secret, session_id = await api.credential(conn)
    out = tmp_path / "export"
    done = await asyncio.to_thread(psql, gateway, secret, f"\\lo_export {oid} {out}\n")
    assert f"blocked by AI session analysis (rule '{rule}'): high risk, Opens a large object" in done.stderr, done
    assert not out.exists() or b"ledger" not in out.read_bytes()
    session = await api.done_session(session_id, 30)
    stream = [(kind, text) for kind, text in events(session) if kind in "ie"]
    at = next(i for i, (kind, text) in enumerate(stream) if kind == "i" and "pg_catalog.lo_open(" in text)
    assert stream[at + 1][0] == "e" and "Opens a large object" in stream[at + 1][1], stream
    assert any("pg_catalog.lo_open(" in json.dumps(r.body) for r in provider.requests)


CANCELLED = "canceling statement due to user request"


async def test_sync_a_statement_cancelled_while_it_waits_for_its_verdict_never_runs(api, gateway, cluster, provider):
    """psql's Ctrl-C while the gateway holds the statement for its verdict: the client gets PostgreSQL's own answer
    to a cancel, the statement never reaches the target (however the verdict would have gone), and it is recorded."""
    table = f"held_{uuid.uuid4().hex[:8]}"
    direct = await asyncpg.connect(cluster.dsn())
    await direct.execute(f"create table {table} (i int); insert into {table} values (1)")
    conn = await api.connection("pg", "database", "postgres", postgres_env(cluster))
    await analysed(api, conn, native_mode="sync", timeout=60)
    secret, session_id = await api.credential(conn)
    provider.answer("verdict", "low", "Routine query", "Writes one row.", delay=15)  # it would be allowed, late
    statement = f"insert into {table} values (2)"
    client = subprocess.Popen(["psql", "-X", "-At", "-c", statement], env=clients.psql_env(gateway.proxy_port, secret),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        await asked(provider, 1)  # the gateway holds it now
        client.send_signal(signal.SIGINT)  # psql sends a CancelRequest
        out, err = await asyncio.to_thread(client.communicate, timeout=60)
    finally:
        client.kill()
    assert client.returncode == 1 and CANCELLED in err, (out, err)
    assert await direct.fetchval(f"select count(*) from {table}") == 1
    await direct.close()
    session = await api.done_session(session_id, 30)
    stream = [(kind, text) for kind, text in events(session) if kind in "ie"]
    at = stream.index(("i", statement))
    assert CANCELLED in stream[at + 1][1] and stream[at + 1][0] == "e", stream
    assert not await audit_of(api, "guardrail.block", session_id)  # the client's own act, not a refusal


async def test_sync_asyncpg_timeout_cancels_a_held_parse_and_the_session_goes_on(api, gateway, cluster, provider):
    """asyncpg's ``timeout=`` sends a CancelRequest while its Parse waits for the verdict: the Parse fails as a
    cancelled statement does, what the driver pipelined after it is skipped to its Sync, and the next statement
    runs at once."""
    conn = await api.connection("pg", "database", "postgres", postgres_env(cluster))
    await analysed(api, conn, native_mode="sync", timeout=60)
    secret, session_id = await api.credential(conn)
    client = await through_gateway(gateway, secret)
    try:
        provider.answer("verdict", "low", "Routine query", "Reads data only.", delay=15)
        with pytest.raises(asyncio.TimeoutError):
            await client.fetchval("select $1::int * 2", 21, timeout=3)  # held 15 s: the timeout falls in the hold
        provider.answer("verdict", "low", "Routine query", "Reads data only.", delay=0.2)
        assert await client.fetchval("select $1::int + 1", 41) == 42
        provider.answer_for("select $1::int * 2", "high", "Doubles", "The rule forbids doubling.")
        with pytest.raises(asyncpg.exceptions.InsufficientPrivilegeError, match="Doubles"):
            await client.fetchval("select $1::int * 2", 21)  # sent again: its verdict is asked again
    finally:
        await client.close(timeout=10)
    session = await api.done_session(session_id, 30)
    stream = [(kind, text) for kind, text in events(session) if kind in "ie"]
    at = stream.index(("i", "select $1::int * 2"))
    assert stream[at + 1][0] == "e" and CANCELLED in stream[at + 1][1], stream


async def test_sync_an_ssh_exec_command_is_refused_before_it_runs(api, gateway, sshd, provider):
    marker = f"/tmp/ai-sync-{uuid.uuid4().hex[:8]}"
    provider.answer_for(f"touch {marker}", "high", "Plants a file", "Creates a file the rule forbids.")
    conn = await api.role()
    rule = await analysed(api, conn, native_mode="sync", timeout=60)
    secret, session_id = await api.credential(conn)
    try:
        result = await asyncio.to_thread(
            subprocess.run, ["ssh", *CLIENT_OPTIONS, "-p", str(gateway.ssh_port), f"{secret}@127.0.0.1",
                             f"touch {marker}"], capture_output=True, text=True, timeout=120,
            stdin=subprocess.DEVNULL, check=False)
        assert result.returncode == 254, result.stderr
        assert f"blocked by AI session analysis (rule '{rule}'): high risk, Plants a file" in result.stderr
        assert not os.path.exists(marker)
        session = await api.done_session(session_id, 30)
        assert session["ai_analysis"]["title"] == "Plants a file"
        assert (await audit_of(api, "ai.block", session_id))[0]["request_payload_redacted"]["rule"] == rule
        secret, session_id = await api.credential(conn)
        result = await asyncio.to_thread(
            subprocess.run, ["ssh", *CLIENT_OPTIONS, "-p", str(gateway.ssh_port), f"{secret}@127.0.0.1",
                             "echo sync-ok"], capture_output=True, text=True, timeout=120,
            stdin=subprocess.DEVNULL, check=False)
        assert result.returncode == 0 and result.stdout.strip() == "sync-ok", result.stderr
    finally:
        subprocess.run(["rm", "-f", marker], check=False)


async def test_sync_ctrl_c_while_a_shell_line_waits_for_its_verdict_cancels_the_line(api, gateway, sshd, provider):
    """A user who presses Ctrl-C while the gateway holds the Enter of a line for its verdict: the line never runs
    (however the verdict would have gone), the shell takes the Ctrl-C as a fresh prompt and goes on."""
    marker = f"/tmp/ai-sync-ctrl-c-{uuid.uuid4().hex[:8]}"
    conn = await api.role()
    await analysed(api, conn, native_mode="sync", timeout=60)
    secret, session_id = await api.credential(conn)
    provider.hold(f"touch {marker}", 15)  # it would be allowed, late; other lines are answered at once
    client = await asyncio.create_subprocess_exec(
        "ssh", *CLIENT_OPTIONS, "-tt", "-p", str(gateway.ssh_port), f"{secret}@127.0.0.1",
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen = bytearray()  # what the terminal showed since the last keys typed
    shown = bytearray()  # all it showed

    async def typed(keys: bytes, then: bytes) -> None:
        """Type ``keys`` as a user does once the shell shows ``then`` (a prompt): not ahead of it."""
        while then not in seen:
            chunk = await asyncio.wait_for(client.stdout.read(4096), 30)
            assert chunk, bytes(shown)
            seen.extend(chunk)
            shown.extend(chunk)
        del seen[:seen.index(then) + len(then)]
        client.stdin.write(keys)
        await client.stdin.drain()

    try:
        assert client.stdin is not None and client.stdout is not None
        await typed(f"touch {marker}\n".encode(), b"$ ")
        await provider.asked_about(f"touch {marker}")  # the gateway holds its Enter now
        await typed(b"\x03", b"")
        await typed(b"echo after-$((40 + 2))\n", b"$ ")  # the fresh prompt the Ctrl-C gave
        await typed(b"exit\n", b"after-42")
        out, err = await asyncio.wait_for(client.communicate(), 60)
        out = bytes(shown) + out
        session = await api.done_session(session_id, 30)
        ran = os.path.exists(marker)  # after the session's end: whether the line ran
    finally:
        if client.returncode is None:
            client.kill()
        subprocess.run(["rm", "-f", marker], check=False)
    assert client.returncode == 0, (out, err)
    assert not ran, out
    assert b"the line was cancelled with Ctrl-C" in out, out  # the user is told why nothing ran
    assert any("cancelled" in e and f"touch {marker}" in e for e in of_kind(session, "e")), of_kind(session, "e")


async def test_sync_a_signal_int_while_a_shell_line_waits_for_its_verdict_cancels_the_line(
        api, gateway, sshd, provider):
    """OpenSSH sends a Ctrl-C as a byte; other clients (PuTTY's Interrupt, asyncssh) as a ``signal`` request: that
    cancels the held line too."""
    import asyncssh

    marker = f"/tmp/ai-sync-int-{uuid.uuid4().hex[:8]}"
    conn = await api.role()
    await analysed(api, conn, native_mode="sync", timeout=60)
    secret, session_id = await api.credential(conn)
    provider.hold(f"touch {marker}", 15)
    try:
        async with asyncssh.connect("127.0.0.1", gateway.ssh_port, username=secret, known_hosts=None,
                                    agent_path=None, client_keys=[]) as client:
            process = await client.create_process(term_type="dumb", encoding=None)
            shown = bytearray()

            async def until(seen: bytes, after: int) -> int:
                """Read what the terminal shows until ``seen`` appears past ``after``; where it ends."""
                while (at := shown.find(seen, after)) < 0:
                    try:
                        chunk = await asyncio.wait_for(process.stdout.read(4096), 30)
                    except TimeoutError:
                        raise AssertionError(f"never shown: {seen!r}; shown: {bytes(shown)!r}") from None
                    assert chunk, bytes(shown)
                    shown.extend(chunk)
                return at + len(seen)

            read = await until(b"$ ", 0)  # typed once the shell shows its prompt, as a person does
            process.stdin.write(f"touch {marker}\n".encode())
            await provider.asked_about(f"touch {marker}")
            process.send_signal("INT")
            await until(b"the line was cancelled", read)
            # and no more typing: the interrupt (a signal, through sshd) and the gateway's ^U (the pty's input)
            # reach bash by different paths, and bash's interrupt may discard what is typed before it takes it
            # (a CI run's next line lost its first letter); the shell's own handling is not the gateway's
        session = await api.done_session(session_id, 30)
        ran = os.path.exists(marker)  # after the session's end: whether the line ran
    finally:
        subprocess.run(["rm", "-f", marker], check=False)
    assert not ran, bytes(shown)
    assert any(e.startswith("the line was cancelled") and f"touch {marker}" in e for e in of_kind(session, "e"))


async def test_sync_a_shell_lines_enter_waits_for_its_verdict_and_a_refused_line_is_not_run(
        api, gateway, sshd, provider):
    marker = f"/tmp/ai-sync-shell-{uuid.uuid4().hex[:8]}"
    provider.answer_for(f"touch {marker}", "high", "Plants a file", "Creates a file the rule forbids.")
    conn = await api.role()
    rule = await analysed(api, conn, native_mode="sync", timeout=60)
    secret, session_id = await api.credential(conn)
    try:
        result = await asyncio.to_thread(
            subprocess.run, ["ssh", *CLIENT_OPTIONS, "-tt", "-p", str(gateway.ssh_port), f"{secret}@127.0.0.1"],
            input=f"echo shell-ok\ntouch {marker}\necho after-$((40 + 2))\nexit\n", capture_output=True, text=True,
            timeout=120, check=False)
        assert result.returncode == 0, (result.stdout, result.stderr)  # the session went on to its exit
        assert "shell-ok" in result.stdout and "after-42" in result.stdout, result.stdout
        assert f"blocked by AI session analysis (rule '{rule}'): high risk, Plants a file" in result.stdout
        assert not os.path.exists(marker)
        session = await api.done_session(session_id, 30)
        assert session["ai_analysis"]["title"] == "Plants a file"
        assert len(await audit_of(api, "ai.block", session_id)) == 1
    finally:
        subprocess.run(["rm", "-f", marker], check=False)
