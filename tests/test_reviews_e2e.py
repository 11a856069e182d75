"""End to end: review workflows with users of different groups, a real gatewayd and a real PostgreSQL.

One PostgreSQL cluster and one ``gatewayd run`` (postgres listener on) serve the
module.  Users get tokens from ``gatewayd token create`` with their groups:
a requester (dev), two DBAs, a security reviewer, a team lead who may force
approvals, an outsider and an admin.  Jit credentials are used by real psql.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
import uuid
from datetime import UTC, datetime, timedelta

import aiohttp
import pytest

from tests import clients
from tests.apiclient import Api, events, of_kind, postgres_env
from tests.conftest import Daemon, free_port, proxy_daemon
from tests.pgpeer import unavailable_reason, wait_for_backends

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")

USERS = {
    "admin": ("ada@example.com", "admin", "Ada Admin"),
    "rita": ("rita@example.com", "dev", "Rita Requester"),
    "dora": ("dora@example.com", "dba", "Dora DBA"),
    "dan": ("dan@example.com", "dba", "Dan DBA"),
    "sam": ("sam@example.com", "security", "Sam Security"),
    "lea": ("lea@example.com", "leads", "Lea Lead"),
    "otto": ("otto@example.com", "sales", "Otto Outsider"),
    "devdba": ("devdba@example.com", "dev,dba", "Devi DevDBA"),
}


@pytest.fixture(scope="module")
def cluster(pg_target):
    """The session's PostgreSQL target (conftest): started once for every module."""
    return pg_target


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    daemon = proxy_daemon(tmp_path_factory, "reviews", "postgres", {"sessions.exec_wait": "2s"})
    daemon.pg_port = daemon.proxy_port
    daemon.tokens = {who: daemon.token(email, groups=groups, name=name)
                     for who, (email, groups, name) in USERS.items()}
    yield daemon
    assert daemon.stop() == 0


@pytest.fixture(scope="module")
async def as_(gateway):
    async with aiohttp.ClientSession() as http:
        yield {who: Api(gateway, http, token) for who, token in gateway.tokens.items()}


async def make_connection(as_, cluster, **settings) -> dict:
    return await as_["admin"].connection("pg", "database", "postgres", postgres_env(cluster), settings)


async def audit(as_, action: str, review_id: str) -> list[dict]:
    status, body = await as_["admin"]("GET", f"/audit/logs?action={action}&page_size=100")
    assert status == 200, body
    return [e for e in body["data"] if (e["request_payload_redacted"] or {}).get("review_id") == review_id]


def window_around(now: datetime, inside: bool) -> dict:
    start = now - timedelta(hours=1) if inside else now + timedelta(hours=1)
    end = now + timedelta(hours=1) if inside else now + timedelta(hours=2)
    return {"type": "time_range", "configuration": {"start_time": start.strftime("%H:%M"),
                                                    "end_time": end.strftime("%H:%M")}}


def psql_env(gateway: Daemon, secret: str) -> dict[str, str]:
    return clients.psql_env(gateway.pg_port, secret)


def psql(gateway: Daemon, secret: str, sql: str) -> subprocess.CompletedProcess[str]:
    return clients.psql(gateway.pg_port, secret, "-At", "-c", sql, timeout=30)


async def wait_exit(process: subprocess.Popen, timeout: float = 5) -> int:
    """The process's exit code, polled up to ``timeout`` seconds (a bound, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while process.poll() is None:
        assert time.monotonic() < deadline, "psql is still connected"
        await asyncio.sleep(0.02)
    return process.returncode


async def wait_connected(api: Api, session_id: str, timeout: float = 10) -> None:
    """Until the gateway has claimed ``session_id`` for a live connection (its start_date moves)."""
    status, first = await api("GET", f"/sessions/{session_id}")
    deadline = time.monotonic() + timeout
    while True:
        await asyncio.sleep(0.1)
        status, body = await api("GET", f"/sessions/{session_id}?expand=event_stream")
        if of_kind(body, "i"):
            return
        assert time.monotonic() < deadline, "the psql connection never reached the gateway"


# --------------------------------------------------------------------------- one-time scripts, no review


async def test_script_without_review_runs_through_guard_rails_and_is_recorded(as_, cluster):
    conn = await make_connection(as_, cluster)
    status, body = await as_["rita"]("POST", "/sessions", {
        "connection": conn["name"], "script": "select 41 + 1 as answer", "metadata": {"ticket": "T-1"}})
    assert status == 200, body
    assert body["exit_code"] == 0 and body["output_status"] == "success" and body["has_review"] is False
    assert "answer" in body["output"] and "42" in body["output"]
    assert isinstance(body["execution_time"], int)
    session = await as_["rita"].done_session(body["session_id"], 15)
    assert session["verb"] == "exec" and session["script"] == {"data": "select 41 + 1 as answer"}
    assert session["exit_code"] == 0 and session["metadata"] == {"ticket": "T-1"} and session["review"] is None
    assert of_kind(session, "i") == ["select 41 + 1 as answer"]
    assert "42" in "".join(of_kind(session, "o"))

    status, body = await as_["rita"]("POST", "/sessions", {"connection": conn["name"], "script": "select nope"})
    assert status == 200 and body["exit_code"] == 1 and body["output_status"] == "failed"
    assert "nope" in body["output"]
    assert any("nope" in e for e in of_kind(await as_["rita"].done_session(body["session_id"], 15), "e"))

    await as_["admin"].guardrail(conn, [{"type": "deny_words_list", "words": ["drop table"]}])
    status, body = await as_["rita"]("POST", "/sessions", {"connection": conn["name"],
                                                           "script": "create table keepme (i int); DROP  TABLE keepme"})
    assert status == 200 and body["exit_code"] == 254
    assert "validation error, match guard rails input rule" in body["output"]
    blocked = await as_["rita"].done_session(body["session_id"], 15)
    assert blocked["exit_code"] == 254  # what was blocked is recorded (i), then the block (e), as in psql
    assert [k for k, _ in events(blocked)] == ["i", "e"]
    assert of_kind(blocked, "i") == ["create table keepme (i int); DROP  TABLE keepme"]
    assert "drop table" in "".join(of_kind(blocked, "e"))


async def test_script_copy_from_stdin_fails_cleanly_and_big_output_is_capped(as_, cluster):
    conn = await make_connection(as_, cluster)
    status, body = await as_["rita"]("POST", "/sessions", {
        "connection": conn["name"], "script": "create temp table t (i int); copy t from stdin"})
    assert status == 200, body
    assert body["exit_code"] == 1 and "COPY FROM STDIN is not available" in body["output"]
    status, body = await as_["rita"]("POST", "/sessions", {
        "connection": conn["name"], "script": "select repeat('x', 1000) from generate_series(1, 2000)"})
    assert status == 200 and body["exit_code"] == 0
    assert len(body["output"]) < 1_100_000 and "[output truncated" in body["output"]
    session = await as_["rita"].done_session(body["session_id"], 15)
    assert sum(len(o) for o in of_kind(session, "o")) > 2_000_000  # the recording has all of it


async def test_script_past_the_wait_limit_answers_202_and_keeps_running(as_, cluster):
    conn = await make_connection(as_, cluster)
    status, body = await as_["rita"]("POST", "/sessions", {"connection": conn["name"],
                                                           "script": "select pg_sleep(3.5), 'late' as word"})
    assert status == 202, body
    assert body["output_status"] == "running" and body["exit_code"] is None
    session = await as_["rita"].done_session(body["session_id"], 15)
    assert session["exit_code"] == 0 and "late" in "".join(of_kind(session, "o"))


async def test_scripts_need_a_runner_and_a_known_connection(as_):
    status, conn = await as_["admin"]("POST", "/connections", {"name": f"desk-{uuid.uuid4().hex[:6]}",
                                                               "type": "custom", "subtype": "rdp"})
    assert status == 201
    status, body = await as_["rita"]("POST", "/sessions", {"connection": conn["name"], "script": "dir"})
    assert status == 422 and "cannot run scripts" in body["message"]
    status, body = await as_["rita"]("POST", "/sessions", {"connection": "no-such", "script": "select 1"})
    assert status == 404
    status, body = await as_["rita"]("POST", "/sessions", {"connection": conn["name"]})
    assert status == 400 and "script" in body["message"]


async def test_killing_a_running_script_ends_its_session_with_the_reason(as_, cluster):
    """...and the query it was running on the target: PostgreSQL would sleep on after a mere close."""
    conn = await make_connection(as_, cluster)
    script = "select pg_sleep(30), 'never' as word"
    status, body = await as_["rita"]("POST", "/sessions", {"connection": conn["name"], "script": script})
    assert status == 202, body
    await wait_for_backends(cluster.dsn(), script, running=True)
    status, killed = await as_["admin"]("POST", f"/sessions/{body['session_id']}/kill")
    assert status == 200, killed
    session = await as_["rita"].done_session(body["session_id"], 15)
    assert session["exit_code"] == 254 and "never" not in "".join(of_kind(session, "o"))
    assert of_kind(session, "e")[-1] == "session killed by ada@example.com"
    await wait_for_backends(cluster.dsn(), script, running=False)  # cancelled, not left to run its 30 s


# --------------------------------------------------------------------------- one-time scripts with review


async def test_onetime_review_partial_full_approval_time_window_and_execution(as_, cluster, gateway):
    conn = await make_connection(as_, cluster, reviewers=["dba", "security"], force_approval_groups=["leads"])
    script = "select 'reviewed' as what"
    status, body = await as_["rita"]("POST", "/sessions", {"connection": conn["name"], "script": script})
    assert status == 202, body
    assert body["has_review"] is True and body["review"]["status"] == "PENDING"
    session_id, review_id = body["session_id"], body["review_id"]
    review = body["review"]
    assert review["type"] == "onetime" and review["min_approvals"] == 2
    assert review["force_approval_groups"] == ["leads"] and review["revoke_at"] == ""
    assert [g["group"] for g in review["review_groups_data"]] == ["dba", "security"]
    status, session = await as_["rita"]("GET", f"/sessions/{session_id}")
    assert session["status"] == "ready" and session["review"]["id"] == review_id
    assert set(session["review"]) == {"id", "type", "status", "created_at", "revoke_at", "access_duration",
                                      "access_request_rule_name", "min_approvals", "force_approval_groups",
                                      "review_groups_data", "time_window"}

    # the reviewers see it; the outsider neither sees nor decides it
    status, listed = await as_["dora"]("GET", "/reviews?status=PENDING")
    assert status == 200 and review_id in [r["id"] for r in listed]
    status, listed = await as_["otto"]("GET", "/reviews")
    assert review_id not in [r["id"] for r in listed]
    status, body = await as_["otto"]("PUT", f"/reviews/{review_id}", {"status": "APPROVED"})
    assert status == 403 and "reviewer group" in body["message"]
    status, body = await as_["rita"]("PUT", f"/reviews/{review_id}", {"status": "APPROVED"})
    assert status == 403

    # not yet approved: no execution
    status, body = await as_["rita"]("POST", f"/sessions/{session_id}/exec")
    assert status == 403 and "pending" in body["message"]

    # partial approval, then the same group again
    status, body = await as_["dora"]("PUT", f"/reviews/{review_id}", {"status": "APPROVED"})
    assert status == 200 and body["status"] == "PENDING", body
    dba = body["review_groups_data"][0]
    assert dba["status"] == "APPROVED" and dba["reviewed_by"]["email"] == "dora@example.com" and dba["review_date"]
    status, body = await as_["dan"]("PUT", f"/reviews/{review_id}", {"status": "APPROVED"})
    assert status == 400 and "already decided" in body["message"]
    status, body = await as_["sam"]("PUT", f"/reviews/{review_id}", {"status": "MAYBE"})
    assert status == 422

    # full approval, with a window that is not now
    now = datetime.now(UTC)
    status, body = await as_["sam"]("PUT", f"/sessions/{session_id}/review",
                                    {"status": "APPROVED", "time_window": window_around(now, inside=False)})
    assert status == 200 and body["status"] == "APPROVED", body
    assert body["time_window"]["type"] == "time_range"
    status, body = await as_["rita"]("POST", f"/sessions/{session_id}/exec")
    assert status == 403 and "time window" in body["message"]
    status, session = await as_["rita"]("GET", f"/sessions/{session_id}")
    assert session["status"] == "ready" and session["review"]["status"] == "APPROVED"

    # decisions after approval are refused
    status, body = await as_["dan"]("PUT", f"/reviews/{review_id}", {"status": "REJECTED"})
    assert status == 400 and "pending" in body["message"]

    # approval and the decisions in the audit log
    approvals = await audit(as_, "review.approve", review_id)
    assert sorted((e["actor_email"], e["outcome"]) for e in approvals) == [
        ("dan@example.com", "failure"), ("dora@example.com", "success"), ("otto@example.com", "failure"),
        ("rita@example.com", "failure"), ("sam@example.com", "success")]

    # a second request, approved inside its window, runs once
    status, body = await as_["rita"]("POST", "/sessions", {"connection": conn["name"], "script": script})
    session_id, review_id = body["session_id"], body["review_id"]
    await as_["dora"]("PUT", f"/reviews/{review_id}", {"status": "APPROVED"})
    status, body = await as_["sam"]("PUT", f"/reviews/{review_id}",
                                    {"status": "APPROVED", "time_window": window_around(datetime.now(UTC), True)})
    assert status == 200 and body["status"] == "APPROVED"
    status, body = await as_["dora"]("POST", f"/sessions/{session_id}/exec")
    assert status == 403  # only the requester runs it
    status, body = await as_["rita"]("POST", f"/sessions/{session_id}/exec")
    assert status == 200, body
    assert body["exit_code"] == 0 and "reviewed" in body["output"]
    session = await as_["rita"].done_session(session_id, 15)
    assert session["review"]["status"] == "EXECUTED" and session["script"] == {"data": script}
    assert of_kind(session, "i") == [script]
    status, body = await as_["rita"]("POST", f"/sessions/{session_id}/exec")
    assert status == 400 and "already" in body["message"]

    # the session list filters by review status and approver
    status, page = await as_["admin"]("GET", "/sessions?review.status=executed&limit=100")
    assert session_id in [s["id"] for s in page["data"]]
    assert all(s["review"]["status"] == "EXECUTED" for s in page["data"])
    status, page = await as_["admin"]("GET", "/sessions?review.approver=sam@example.com&limit=100")
    assert session_id in [s["id"] for s in page["data"]]
    status, page = await as_["admin"]("GET", "/sessions?review.approver=lea@example.com&limit=100")
    assert session_id not in [s["id"] for s in page["data"]]


async def test_a_reviewed_script_on_an_unreachable_target_is_executed_with_its_error(as_, cluster):
    conn = await as_["admin"].connection("pg", "database", "postgres", postgres_env(cluster, port=free_port()),
                                         {"reviewers": ["dba"]})
    status, body = await as_["rita"]("POST", "/sessions", {"connection": conn["name"], "script": "select 1"})
    assert status == 202, body
    session_id, review_id = body["session_id"], body["review_id"]
    status, body = await as_["dora"]("PUT", f"/reviews/{review_id}", {"status": "APPROVED"})
    assert status == 200 and body["status"] == "APPROVED", body
    status, body = await as_["rita"]("POST", f"/sessions/{session_id}/exec")
    assert status == 200, body
    assert body["exit_code"] == 254 and body["session_id"] == session_id
    assert f'could not connect to the target of connection "{conn["name"]}"' in body["output"]
    session = await as_["rita"].done_session(session_id, 15)
    assert session["exit_code"] == 254 and session["review"]["status"] == "EXECUTED"
    assert of_kind(session, "e") == [body["output"].strip()] and not of_kind(session, "i")


async def test_a_reviewed_script_whose_session_was_killed_is_gone_with_the_kill_reason(as_, cluster):
    """The kill of its ``ready`` session spends the one run an approval gives: exec answers 410 and why (not a
    503 that left the review PROCESSING for ever), the review is EXECUTED, and asking again asks anew."""
    conn = await make_connection(as_, cluster, reviewers=["dba"])
    ask = {"connection": conn["name"], "script": "select 'killed before it ran'"}
    status, body = await as_["rita"]("POST", "/sessions", ask)
    assert status == 202, body
    session_id, review_id = body["session_id"], body["review_id"]
    status, body = await as_["dora"]("PUT", f"/reviews/{review_id}", {"status": "APPROVED"})
    assert status == 200 and body["status"] == "APPROVED", body
    status, killed = await as_["admin"]("POST", f"/sessions/{session_id}/kill")
    assert status == 200, killed
    status, body = await as_["rita"]("POST", f"/sessions/{session_id}/exec")
    assert status == 410 and "(session killed by ada@example.com)" in body["message"], body
    status, review = await as_["rita"]("GET", f"/reviews/{review_id}")
    assert status == 200 and review["status"] == "EXECUTED", review
    session = await as_["rita"].done_session(session_id, 15)
    assert not of_kind(session, "i") and "killed before it ran" not in "".join(of_kind(session, "o"))
    assert [e["outcome"] for e in await audit(as_, "session.exec", review_id)] == ["failure"]
    status, again = await as_["rita"]("POST", f"/sessions/{session_id}/exec")
    assert status == 400 and "already run" in again["message"], again
    status, body = await as_["rita"]("POST", "/sessions", ask)
    assert status == 202 and body["review_id"] != review_id and body["session_id"] != session_id, body


async def test_rejection_is_final(as_, cluster):
    conn = await make_connection(as_, cluster, reviewers=["dba", "security"])
    status, body = await as_["rita"]("POST", "/sessions", {"connection": conn["name"], "script": "select 1"})
    session_id, review_id = body["session_id"], body["review_id"]
    status, body = await as_["dora"]("PUT", f"/reviews/{review_id}", {"status": "REJECTED"})
    assert status == 200 and body["status"] == "REJECTED"
    assert body["review_groups_data"][0]["status"] == "REJECTED"
    status, body = await as_["sam"]("PUT", f"/reviews/{review_id}", {"status": "APPROVED"})
    assert status == 400 and "final" in body["message"]
    status, body = await as_["rita"]("POST", f"/sessions/{session_id}/exec")
    assert status == 403 and "rejected" in body["message"]
    assert [e["outcome"] for e in await audit(as_, "review.reject", review_id)] == ["success"]


async def test_self_approval_is_refused_and_admins_may(as_, cluster):
    conn = await make_connection(as_, cluster, reviewers=["dba"])
    status, body = await as_["devdba"]("POST", "/sessions", {"connection": conn["name"], "script": "select 1"})
    review_id = body["review_id"]
    status, body = await as_["devdba"]("PUT", f"/reviews/{review_id}", {"status": "APPROVED"})
    assert status == 403 and "own request" in body["message"]
    status, body = await as_["dora"]("GET", f"/reviews/{review_id}")
    assert body["status"] == "PENDING" and body["review_owner"]["email"] == "devdba@example.com"
    assert body["input"] == "select 1"

    status, body = await as_["admin"]("POST", "/sessions", {"connection": conn["name"], "script": "select 2"})
    status, body = await as_["admin"]("PUT", f"/reviews/{body['review_id']}", {"status": "APPROVED"})
    assert status == 200 and body["status"] == "APPROVED"  # auth.admins_can_self_approve defaults to true


async def test_forced_approval(as_, cluster):
    conn = await make_connection(as_, cluster, reviewers=["dba", "security"], force_approval_groups=["leads"])
    status, body = await as_["rita"]("POST", "/sessions", {"connection": conn["name"], "script": "select 'forced'"})
    session_id, review_id = body["session_id"], body["review_id"]
    status, body = await as_["dora"]("PUT", f"/reviews/{review_id}", {"status": "APPROVED", "force_review": True})
    assert status == 403 and "force-approval group" in body["message"]
    status, body = await as_["lea"]("PUT", f"/reviews/{review_id}", {"status": "APPROVED", "force_review": True})
    assert status == 200 and body["status"] == "APPROVED", body
    forced = [g for g in body["review_groups_data"] if g["forced_review"]]
    assert [(g["group"], g["status"], g["reviewed_by"]["email"]) for g in forced] == [
        ("leads", "APPROVED", "lea@example.com")]
    status, body = await as_["rita"]("POST", f"/sessions/{session_id}/exec")
    assert status == 200 and "forced" in body["output"]
    assert [e["actor_email"] for e in await audit(as_, "review.force_approve", review_id)] == [
        "lea@example.com", "dora@example.com"]


async def test_access_request_rule_decides_the_reviewers(as_, cluster):
    conn = await make_connection(as_, cluster)
    rule = {"name": f"rule-{uuid.uuid4().hex[:6]}", "access_type": "command", "connection_names": [conn["name"]],
            "reviewers_groups": ["security"], "min_approvals": 1}
    status, body = await as_["rita"]("POST", "/access-requests/rules", rule)
    assert status == 403
    status, body = await as_["admin"]("POST", "/access-requests/rules", rule)
    assert status == 201, body
    status, body = await as_["admin"]("POST", "/access-requests/rules", rule)
    assert status == 409
    status, body = await as_["rita"]("POST", "/sessions", {"connection": conn["name"], "script": "select 1"})
    assert status == 202 and body["review"]["access_request_rule_name"] == rule["name"]
    assert [g["group"] for g in body["review"]["review_groups_data"]] == ["security"]
    status, _ = await as_["admin"]("DELETE", f"/access-requests/rules/{rule['name']}")
    assert status == 204
    status, body = await as_["rita"]("POST", "/sessions", {"connection": conn["name"], "script": "select 1"})
    assert status == 200 and body["exit_code"] == 0

    jit_rule = {"name": f"jit-{uuid.uuid4().hex[:6]}", "access_type": "jit", "connection_names": [conn["name"]],
                "reviewers_groups": ["dba"], "access_max_duration": 60}
    status, body = await as_["admin"]("POST", "/access-requests/rules", jit_rule)
    assert status == 201, body
    status, body = await as_["rita"]("GET", "/access-requests/rules")
    assert jit_rule["name"] in [r["name"] for r in body["data"]]
    path = f"/connections/{conn['name']}/credentials"
    status, body = await as_["rita"]("POST", path, {"access_duration_seconds": 61})
    assert status == 422 and "60" in body["message"]
    status, body = await as_["rita"]("POST", path, {"access_duration_seconds": 60})
    assert status == 202 and body["review"]["access_request_rule_name"] == jit_rule["name"]
    assert body["review"]["access_duration"] == 60_000_000_000


# --------------------------------------------------------------------------- just-in-time access


async def jit_request(as_, conn: dict, seconds: int | None = None) -> tuple[str, str]:
    body = {"access_duration_seconds": seconds} if seconds else {}
    status, answer = await as_["rita"]("POST", f"/connections/{conn['name']}/credentials", body)
    assert status == 202, answer
    assert answer["has_review"] is True and "connection_credentials" not in answer
    return answer["session_id"], answer["review_id"]


async def test_jit_approval_gives_credentials_that_psql_uses_and_revocation_closes_it(as_, cluster, gateway):
    conn = await make_connection(as_, cluster, reviewers=["dba"])
    session_id, review_id = await jit_request(as_, conn)
    status, session = await as_["rita"]("GET", f"/sessions/{session_id}")
    assert session["status"] == "ready" and session["review"]["type"] == "jit"
    assert session["review"]["access_duration"] == 1_800_000_000_000
    path = f"/connections/{conn['name']}/credentials/{session_id}"
    status, body = await as_["rita"]("POST", path)
    assert status == 202 and body["review"]["status"] == "PENDING"
    status, body = await as_["dora"]("POST", path)
    assert status == 403  # somebody else's request

    status, body = await as_["dora"]("PUT", f"/reviews/{review_id}", {"status": "APPROVED"})
    assert status == 200 and body["status"] == "APPROVED" and body["revoke_at"]
    status, body = await as_["rita"]("POST", path)
    assert status == 201, body
    assert body["has_review"] is True and body["session_id"] == session_id
    secret = body["connection_credentials"]["username"]
    status, session = await as_["rita"]("GET", f"/sessions/{session_id}")
    assert session["status"] == "open"

    # real psql, held in a long statement, is closed by the revocation
    process = subprocess.Popen(["psql", "-X", "-At", "-c", "select pg_sleep(20)"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=psql_env(gateway, secret))
    try:
        await wait_connected(as_["rita"], session_id)
        revoked_at = time.monotonic()
        status, body = await as_["dora"]("PUT", f"/sessions/{session_id}/review", {"status": "REVOKED"})
        assert status == 200 and body["status"] == "REVOKED", body
        assert body["review_groups_data"][0]["status"] == "REVOKED"
        code = await wait_exit(process)
        print(f"psql ended {(time.monotonic() - revoked_at) * 1000:.0f} ms after the revoke call was sent")
    finally:
        if process.poll() is None:
            process.kill()
        out, err = process.communicate()
    assert code != 0
    assert "revoked" in err
    session = await as_["rita"].done_session(session_id, 15)
    assert any("just-in-time access revoked by dora@example.com" in e for e in of_kind(session, "e"))
    assert session["review"]["status"] == "REVOKED" and session["review"]["revoke_at"]

    # the secret is dead, and no new one is handed out
    result = psql(gateway, secret, "select 1")
    assert result.returncode != 0 and "revoked" in result.stderr
    status, body = await as_["rita"]("POST", path)
    assert status == 410 and "revoked" in body["message"]
    status, body = await as_["dora"]("PUT", f"/reviews/{review_id}", {"status": "REVOKED"})
    assert status == 400
    assert [e["actor_email"] for e in await audit(as_, "review.revoke", review_id)] == [
        "dora@example.com", "dora@example.com"]


async def test_jit_credentials_work_with_psql_and_rejection_gives_403(as_, cluster, gateway):
    conn = await make_connection(as_, cluster, reviewers=["dba"])
    session_id, review_id = await jit_request(as_, conn, seconds=600)
    await as_["dan"]("PUT", f"/reviews/{review_id}", {"status": "APPROVED"})
    status, body = await as_["rita"]("POST", f"/connections/{conn['name']}/credentials/{session_id}")
    assert status == 201
    result = psql(gateway, body["connection_credentials"]["username"], "select 'jit ok'")
    assert result.returncode == 0 and result.stdout.strip() == "jit ok", result.stderr
    # asking again while the access lasts hands the same approved request back (issue 34, item 3)
    assert await jit_request(as_, conn) == (session_id, review_id)

    conn = await make_connection(as_, cluster, reviewers=["dba"])
    session_id, review_id = await jit_request(as_, conn)
    status, body = await as_["dora"]("PUT", f"/reviews/{review_id}", {"status": "REJECTED"})
    assert status == 200
    status, body = await as_["rita"]("POST", f"/connections/{conn['name']}/credentials/{session_id}")
    assert status == 403 and "rejected" in body["message"]
    status, body = await as_["rita"]("POST", f"/connections/{conn['name']}/credentials",
                                     {"access_duration_seconds": 49 * 3600})
    assert status == 422


async def test_jit_expiry_closes_the_live_session(as_, cluster, gateway):
    conn = await make_connection(as_, cluster, reviewers=["dba"], jit_max_duration=60)
    session_id, review_id = await jit_request(as_, conn, seconds=4)
    status, body = await as_["dora"]("PUT", f"/reviews/{review_id}", {"status": "APPROVED"})
    assert status == 200 and body["access_duration"] == 4_000_000_000
    status, body = await as_["rita"]("POST", f"/connections/{conn['name']}/credentials/{session_id}")
    assert status == 201
    secret = body["connection_credentials"]["username"]
    process = subprocess.Popen(["psql", "-X", "-At", "-c", "select pg_sleep(20)"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=psql_env(gateway, secret))
    try:
        code = await wait_exit(process, timeout=15)
    finally:
        if process.poll() is None:
            process.kill()
        out, err = process.communicate()
    assert code != 0 and "expired" in err
    session = await as_["rita"].done_session(session_id, 15)
    assert any("expired" in e for e in of_kind(session, "e"))
    status, body = await as_["rita"]("POST", f"/connections/{conn['name']}/credentials/{session_id}")
    assert status == 410 and "expired" in body["message"]
    status, review = await as_["dora"]("GET", f"/reviews/{review_id}")
    assert review["status"] == "REVOKED"
    status, body = await as_["admin"]("GET", "/audit/logs?action=review.expire&page_size=100")
    assert review_id in [(e["request_payload_redacted"] or {}).get("review_id") for e in body["data"]]
