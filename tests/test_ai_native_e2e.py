"""End to end: native sessions analysed in the background, with real asyncpg and OpenSSH through gatewayd.

What a user sends is analysed after the guard rails let it through; a
verdict that blocks ends the live session (exit 254), so what comes after the
risky statement or command does not run.  Each risky input below is preceded,
in the same message, by a long sleep: the kill, not the clock, decides that
the destructive part never runs.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import uuid

import aiohttp
import asyncpg
import pytest

from tests.apiclient import Api, SshApi, of_kind, postgres_env
from tests.conftest import free_port, proxy_daemon
from tests.llmpeer import API_KEY, FakeLLM
from tests.pgpeer import PgCluster
from tests.pgpeer import unavailable_reason as pg_unavailable
from tests.sshpeer import CLIENT_OPTIONS, SshTarget
from tests.sshpeer import unavailable_reason as ssh_unavailable

_REASON = pg_unavailable() or ssh_unavailable()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")

BLOCK_HIGH = {"low_risk_action": "allow_execution", "medium_risk_action": "allow_execution",
              "high_risk_action": "block_execution"}


@pytest.fixture(scope="module")
def cluster():
    target = PgCluster().start()
    yield target
    target.destroy()


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
