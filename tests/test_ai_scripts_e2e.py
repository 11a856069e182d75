"""End to end: one-time scripts analysed before they run, with a real gatewayd, a real PostgreSQL and the fake LLM.

The daemon runs as a subprocess; the fake provider is an aiohttp server of
this process on a free port, which the daemon reaches like any provider.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import asyncpg
import pytest

from tests.apiclient import Api, of_kind, postgres_env
from tests.conftest import proxy_daemon
from tests.llmpeer import API_KEY, FakeLLM
from tests.pgpeer import PgCluster, unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")

USERS = {"admin": ("ada@example.com", "admin", "Ada Admin"), "rita": ("rita@example.com", "dev", "Rita Requester"),
         "dora": ("dora@example.com", "dba", "Dora DBA")}
BLOCK_HIGH = {"low_risk_action": "allow_execution", "medium_risk_action": "allow_execution",
              "high_risk_action": "block_execution"}


@pytest.fixture(scope="module")
def cluster(pg_target):
    """The session's PostgreSQL target (conftest): started once for every module."""
    return pg_target


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    daemon = proxy_daemon(tmp_path_factory, "ai-scripts", "postgres", {"sessions.exec_wait": "30s"})
    daemon.tokens = {who: daemon.token(email, groups=groups, name=name)
                     for who, (email, groups, name) in USERS.items()}
    yield daemon
    assert daemon.stop() == 0


@pytest.fixture(scope="module")
async def llm():
    server = await FakeLLM().start()
    yield server
    await server.stop()


@pytest.fixture(scope="module")
async def as_(gateway):
    async with aiohttp.ClientSession() as http:
        yield {who: Api(gateway, http, token) for who, token in gateway.tokens.items()}


async def analysed_connection(as_, cluster, risk_evaluation=None, **settings) -> tuple[dict, str]:
    conn = await as_["admin"].connection("pg", "database", "postgres", postgres_env(cluster), settings or None)
    name = f"rule-{conn['name']}"
    status, rule = await as_["admin"]("POST", "/ai/session-analyzer/rules", {
        "name": name, "connection_names": [conn["name"]], "risk_evaluation": risk_evaluation or BLOCK_HIGH})
    assert status == 201, rule
    return conn, name


async def audit_of(as_, action: str, session_id: str) -> list[dict]:
    status, body = await as_["admin"]("GET", f"/audit/logs?action={action}&page_size=100")
    assert status == 200, body
    return [e for e in body["data"] if (e["request_payload_redacted"] or {}).get("session_id") == session_id]


async def run(as_, who: str, conn: dict, script: str) -> tuple[dict, dict]:
    status, answer = await as_[who]("POST", "/sessions", {"connection": conn["name"], "script": script})
    assert status == 200, answer
    return answer, await as_[who].done_session(answer["session_id"], 20)


async def count_rows(cluster: PgCluster, table: str) -> int | None:
    connection = await asyncpg.connect(cluster.dsn())
    try:
        if await connection.fetchval("select to_regclass($1)", table) is None:
            return None
        return await connection.fetchval(f"select count(*) from {table}")
    finally:
        await connection.close()


async def test_the_built_in_rules_block_a_destructive_script_before_it_reaches_postgres(as_, cluster):
    await as_["admin"]("DELETE", "/ai/session-analyzer/providers")
    conn, rule = await analysed_connection(as_, cluster)
    answer, session = await run(as_, "rita", conn, "create table keepme (i int)")
    assert answer["exit_code"] == 0 and answer["ai_analysis"]["action"] == "allow_execution"
    assert session["ai_analysis"] == answer["ai_analysis"] and session["ai_analysis"]["risk_level"] == "low"

    answer, session = await run(as_, "rita", conn, "insert into keepme values (1);\n-- cleanup\nDROP TABLE keepme")
    assert answer["exit_code"] == 254 and answer["output_status"] == "failed"
    assert answer["output"].startswith(f"blocked by AI session analysis (rule '{rule}'): high risk, Drops a table")
    assert answer["ai_analysis"] == {"action": "block_execution", "risk_level": "high", "title": "Drops a table",
                                     "explanation": answer["ai_analysis"]["explanation"]}
    assert session["status"] == "done" and session["exit_code"] == 254
    assert session["ai_analysis"] == answer["ai_analysis"]
    assert of_kind(session, "i") == [] and any("high risk, Drops a table" in e for e in of_kind(session, "e"))
    assert await count_rows(cluster, "keepme") == 0  # neither the insert nor the drop reached the target
    (entry,) = await audit_of(as_, "ai.block", session["id"])
    assert entry["outcome"] == "failure" and entry["actor_email"] == "rita@example.com"
    assert entry["request_payload_redacted"]["rule"] == rule
    assert entry["request_payload_redacted"]["risk_level"] == "high"

    status, listed = await as_["admin"]("GET", f"/sessions?connection={conn['name']}")
    assert status == 200 and {s["ai_analysis"]["action"] for s in listed["data"]} == {"allow_execution",
                                                                                        "block_execution"}


async def test_the_providers_verdict_decides_and_a_failing_provider_fails_closed_or_open(as_, cluster, llm):
    status, body = await as_["admin"]("PUT", "/ai/session-analyzer/providers", {
        "provider": "custom", "model": "judge-1", "api_url": f"{llm.url}/v1", "api_key": API_KEY})
    assert status == 200, body
    conn, rule = await analysed_connection(as_, cluster, {"low_risk_action": "allow_execution",
                                                          "medium_risk_action": "block_execution",
                                                          "high_risk_action": "block_execution"})
    llm.requests.clear()
    llm.answer("verdict", "medium", "Reads every salary", "The query returns the salary of every employee.")
    answer, session = await run(as_, "rita", conn, "select 42 as salary")
    assert answer["exit_code"] == 254 and "medium risk, Reads every salary" in answer["output"]
    assert session["ai_analysis"] == {"action": "block_execution", "risk_level": "medium",
                                      "title": "Reads every salary",
                                      "explanation": "The query returns the salary of every employee."}
    (request,) = llm.requests
    sent = json.dumps(request.body)
    assert "select 42 as salary" in sent and "database (postgres)" in sent
    assert cluster.password not in sent and API_KEY not in sent  # the target's secret never goes to the model

    llm.answer("verdict", "low", "Routine read", "Reads one constant.")
    answer, session = await run(as_, "rita", conn, "select 42 as answer")
    assert answer["exit_code"] == 0 and "42" in answer["output"]
    assert session["ai_analysis"]["action"] == "allow_execution"

    llm.answer("error", status=500)
    answer, session = await run(as_, "rita", conn, "select 42 as answer")  # default: fails closed
    assert answer["exit_code"] == 254 and answer["ai_analysis"]["title"] == "Analyzer unavailable"
    assert any("AI session analysis failed: custom answered HTTP 500" in e for e in of_kind(session, "e"))
    (failed,) = await audit_of(as_, "ai.analysis_failed", session["id"])
    assert "HTTP 500" in failed["error_message"] and failed["request_payload_redacted"]["on_failure"] == "closed"
    assert await audit_of(as_, "ai.block", session["id"])

    status, body = await as_["admin"]("PUT", f"/ai/session-analyzer/rules/{rule}", {
        "name": rule, "connection_names": [conn["name"]], "risk_evaluation": BLOCK_HIGH, "on_failure": "open",
        "timeout": 1})
    assert status == 200, body
    answer, session = await run(as_, "rita", conn, "select 42 as answer")  # open: the built-in rules stand in
    assert answer["exit_code"] == 0 and session["ai_analysis"]["action"] == "allow_execution"
    assert any("fails open" in e for e in of_kind(session, "e"))
    assert await audit_of(as_, "ai.analysis_failed", session["id"])
    answer, session = await run(as_, "rita", conn, "truncate pg_catalog.pg_class")  # ...and still block the worst
    assert answer["exit_code"] == 254 and session["ai_analysis"]["risk_level"] == "high"

    llm.answer("timeout")
    answer, session = await run(as_, "rita", conn, "select 42 as answer")
    assert answer["exit_code"] == 0
    assert any("did not answer within 1s" in e for e in of_kind(session, "e"))
    await as_["admin"]("DELETE", "/ai/session-analyzer/providers")


async def test_a_key_the_provider_echoes_lands_in_no_recording_and_a_new_address_needs_the_key(as_, cluster):
    """Issue 31, item 6: an error that quoted the key was cut to 300 characters before the key was taken out, so
    its first characters landed in the user's recording and the audit log; and a PUT changing only api_url sent
    the stored key to the new address."""
    key = "sk-proj-" + "Q7w2E9r4" * 5
    echoing, other = await FakeLLM(api_key=key).start(), await FakeLLM().start()
    try:
        status, body = await as_["admin"]("PUT", "/ai/session-analyzer/providers", {
            "provider": "custom", "model": "judge-1", "api_url": f"{echoing.url}/v1", "api_key": key})
        assert status == 200, body
        conn, _ = await analysed_connection(as_, cluster)
        echoing.answer("echo_key")
        answer, session = await run(as_, "rita", conn, "select 42 as answer")
        assert answer["exit_code"] == 254 and any("answered HTTP 401" in e for e in of_kind(session, "e"))
        (failed,) = await audit_of(as_, "ai.analysis_failed", session["id"])
        seen = json.dumps([answer, of_kind(session, "e"), failed])  # the recording decoded, the audit entry
        pieces = [key[at:at + 8] for at in range(len(key) - 7)]
        assert not [piece for piece in pieces if piece in seen], f"a piece of the key was recorded: {seen}"
        assert "Key given: [REDACTE" in seen  # the key was taken out where it was, then the text cut

        # the address changes without the key: refused, and the next analysis still asks the provider it was for
        status, body = await as_["admin"]("PUT", "/ai/session-analyzer/providers", {
            "provider": "custom", "model": "judge-1", "api_url": f"{other.url}/v1"})
        assert status == 400 and "api_key" in body["message"], body
        echoing.answer("verdict")
        answer, _ = await run(as_, "rita", conn, "select 42 as answer")
        assert answer["exit_code"] == 0 and echoing.requests[-1].headers["Authorization"] == f"Bearer {key}"
        assert other.requests == []
    finally:
        await as_["admin"]("DELETE", "/ai/session-analyzer/providers")
        await echoing.stop()
        await other.stop()


async def test_a_reviewed_script_is_analysed_when_it_runs(as_, cluster):
    await as_["admin"]("DELETE", "/ai/session-analyzer/providers")
    conn, _ = await analysed_connection(as_, cluster, reviewers=["dba"])
    status, body = await as_["rita"]("POST", "/sessions", {"connection": conn["name"],
                                                           "script": "update pg_catalog.pg_authid set rolsuper = true"})
    assert status == 202 and body["has_review"], body
    session_id, review_id = body["session_id"], body["review_id"]
    # the reviewers see the verdict before they decide; nothing ran
    deadline = time.monotonic() + 20
    while True:
        status, review = await as_["dora"]("GET", f"/reviews/{review_id}")
        assert status == 200, review
        if review.get("ai_analysis") or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    assert review["ai_analysis"]["action"] == "block_execution" and review["status"] == "PENDING"
    assert (await as_["rita"].session(session_id))["status"] == "ready"
    assert not await audit_of(as_, "ai.block", session_id)
    status, body = await as_["dora"]("PUT", f"/reviews/{review_id}", {"status": "APPROVED"})
    assert status == 200 and body["status"] == "APPROVED", body
    status, answer = await as_["rita"]("POST", f"/sessions/{session_id}/exec")
    assert status == 200, answer
    assert answer["exit_code"] == 254 and "Update without WHERE" in answer["output"] and answer["has_review"]
    session = await as_["rita"].done_session(session_id, 20)
    assert session["exit_code"] == 254 and session["ai_analysis"]["action"] == "block_execution"
    assert await audit_of(as_, "ai.block", session_id)
