"""Reviews decided and run on a ``gatewayd run`` with several workers: one review, one outcome, one run.

A real ``workers = 2`` daemon on SQLite (tests/test_workers.py's ``workers_daemon``) and the session's
PostgreSQL target. Concurrent API calls, each on a connection of its own, land on both workers; the
review's state is the store's, so a decision or an execution made on one worker holds on the other.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests import clients
from tests.apiclient import PostgresApi, admin_http
from tests.conftest import free_port
from tests.test_workers import workers_daemon

ROUNDS = 24  # races tried; each fires its calls at once on connections of their own
DECIDERS = {"rex": "REJECTED", "ria": "REJECTED", "roy": "REJECTED", "amy": "APPROVED", "abe": "APPROVED",
            "ann": "APPROVED"}  # reviewers, each the only member of a reviewer group named after them


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, pg_target):
    port = free_port()
    daemon = workers_daemon(tmp_path_factory.mktemp("reviews-workers"), {"sessions.exec_wait": "10s",
                                                                         "listeners.postgres": f"127.0.0.1:{port}"})
    daemon.start()
    daemon.pg_port = port
    daemon.tokens = {who: daemon.token(f"{who}@example.com", groups=who) for who in ("rita", *DECIDERS)}
    yield daemon
    assert daemon.stop() == 0


async def at_once(gateway, calls: list[tuple[str, str, str, dict | None]]) -> list[tuple[int, dict]]:
    """``(who, method, path, body)`` calls sent together, each on a TCP connection of its own."""
    async def one(who: str, method: str, path: str, body: dict | None) -> tuple[int, dict]:
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector) as http:
            async with http.request(method, gateway.url + path, json=body,
                                    headers={"Authorization": f"Bearer {gateway.tokens[who]}"}) as response:
                return response.status, await response.json()
    return list(await asyncio.gather(*(one(*call) for call in calls)))


async def test_an_approved_script_runs_once_when_its_exec_is_sent_to_both_workers_at_once(gateway, pg_target):
    """Six execs of one approved script at once: one runs it, the others are told it was run already (400)."""
    async with admin_http(gateway) as http:
        pg = PostgresApi(gateway, http, pg_target)
        conn = await pg.role(settings={"reviewers": ["amy"]})
        twice = []
        for round in range(ROUNDS):
            status, asked = await pg("POST", "/sessions", {"connection": conn["name"],
                                                           "script": f"select {round} as round"},
                                     token=gateway.tokens["rita"])
            assert status == 202, asked
            status, body = await pg("PUT", f"/reviews/{asked['review_id']}", {"status": "APPROVED"},
                                    token=gateway.tokens["amy"])
            assert status == 200 and body["status"] == "APPROVED", body
            answers = await at_once(gateway, [("rita", "POST", f"/sessions/{asked['session_id']}/exec", None)] * 6)
            statuses = sorted(status for status, _ in answers)
            if statuses[0] not in (200, 202) or statuses[1:] != [400] * (len(answers) - 1):
                twice.append((round, answers))
        assert not twice, f"an approved script's exec was not answered once: {twice[:2]}"


async def test_rejections_and_approvals_made_at_once_on_both_workers_decide_the_review_once(gateway, pg_target):
    """Three reviewer groups reject while three approve, all at once (any one decides: ``min_approvals`` 1): one
    decision is made, the others are refused as the decided review's; the requester gets credentials only when
    that one was an approval."""
    async with admin_http(gateway) as http:
        pg = PostgresApi(gateway, http, pg_target)
        twice = []
        for round in range(ROUNDS):  # a connection each: a request asked again would get the same review
            conn = await pg.role(settings={"reviewers": list(DECIDERS), "min_approvals": 1})
            status, asked = await pg("POST", f"/connections/{conn['name']}/credentials",
                                     {"access_duration_seconds": 600}, token=gateway.tokens["rita"])
            assert status == 202, asked
            path = f"/reviews/{asked['review_id']}"
            answers = await at_once(gateway, [(who, "PUT", path, {"status": decision})
                                              for who, decision in DECIDERS.items()])
            assert all(status in (200, 400) for status, _ in answers), answers
            made = [decision for decision, (status, _) in zip(DECIDERS.values(), answers) if status == 200]
            status, review = await pg("GET", path)
            creds, body = await pg("POST", f"/connections/{conn['name']}/credentials/{asked['session_id']}",
                                   token=gateway.tokens["rita"])
            if len(made) != 1 or review["status"] != made[0] or creds != (201 if made[0] == "APPROVED" else 403):
                twice.append((round, made, review["status"], creds))
        assert not twice, f"a review was decided more than once: {twice[:3]}"


async def test_credentials_asked_while_a_jit_review_is_revoked_on_another_worker_let_nobody_in(gateway, pg_target):
    """A revocation and credential requests at once: a secret answered 201 either is revoked with the others or
    was never handed out (410) -- none lets psql in once the revocation answered."""
    async with admin_http(gateway) as http:
        pg = PostgresApi(gateway, http, pg_target)
        let_in = []
        for round in range(ROUNDS):
            conn = await pg.role(settings={"reviewers": ["amy"]})
            status, asked = await pg("POST", f"/connections/{conn['name']}/credentials",
                                     {"access_duration_seconds": 600}, token=gateway.tokens["rita"])
            assert status == 202, asked
            path = f"/reviews/{asked['review_id']}"
            status, body = await pg("PUT", path, {"status": "APPROVED"}, token=gateway.tokens["amy"])
            assert status == 200, body
            creds = f"/connections/{conn['name']}/credentials/{asked['session_id']}"
            answers = await at_once(gateway, [("amy", "PUT", path, {"status": "REVOKED"})]
                                    + [("rita", "POST", creds, None)] * 6)
            assert answers[0][0] == 200, answers[0]
            for status, body in answers[1:]:
                assert status in (201, 410), body
                if status == 201:
                    secret = body["connection_credentials"]["username"]
                    ran = await asyncio.to_thread(clients.psql, gateway.pg_port, secret, "-At", "-c", "select 1",
                                                  timeout=30)
                    if ran.returncode == 0:
                        let_in.append((round, body["id"]))
        assert not let_in, f"credentials of a revoked review still let psql in: {let_in}"
