"""Reports on a real ``gatewayd run``: sessions run through the API, counted as they close."""

from __future__ import annotations

from datetime import UTC, datetime

import aiohttp
import pytest

from tests.apiclient import Api, postgres_env
from tests.conftest import Daemon
from tests.pgpeer import unavailable_reason
from tests.ports import free_port

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    daemon = Daemon(tmp_path_factory.mktemp("reports") / "data", {"sessions.exec_wait": "20s"}).start()
    daemon.tokens = {"admin": daemon.token("ada@example.com", groups="admin"),
                     "auditor": daemon.token("audrey@example.com", groups="auditor"),
                     "dev": daemon.token("dev@example.com", groups="dev")}
    yield daemon
    assert daemon.stop() == 0


@pytest.fixture(scope="module")
async def as_(gateway):
    async with aiohttp.ClientSession() as http:
        yield {who: Api(gateway, http, token) for who, token in gateway.tokens.items()}


async def test_sessions_are_reported_by_connection_user_protocol_and_day(as_, pg_target):
    db = await as_["admin"].connection("rep-db", "database", "postgres", postgres_env(pg_target))
    gone = await as_["admin"].connection("rep-gone", "database", "postgres", {
        "HOST": "127.0.0.1", "PORT": str(free_port()), "USER": "x", "PASS": "y", "DB": "z"})
    await as_["admin"].guardrail(db, [{"type": "deny_words_list", "words": ["drop"]}])
    for who, conn, script in (("dev", db, "SELECT 1"), ("dev", db, "DROP TABLE nothing"),
                              ("admin", gone, "SELECT 1")):
        status, ran = await as_[who]("POST", "/sessions", {"connection": conn["name"], "script": script})
        assert status == 200, ran
        await as_["admin"].done_session(ran["session_id"])
    today = datetime.now(UTC).date().isoformat()

    status, report = await as_["auditor"]("GET", "/reports/sessions?group_by=connection")
    assert status == 200 and report["end_date"] == today, report
    rows = {item["resource"]: item for item in report["items"]}
    assert rows[db["name"]]["sessions"] == 2 and rows[db["name"]]["blocks"] == 1
    assert rows[gone["name"]]["sessions"] == 1 and rows[gone["name"]]["blocks"] == 0
    assert report["totals"]["sessions"] == 3 and report["totals"]["bytes"] == sum(i["bytes"] for i in report["items"])
    status, by_user = await as_["admin"]("GET", "/reports/sessions?group_by=user")
    assert {i["resource"]: i["sessions"] for i in by_user["items"]} == {"dev@example.com": 2, "ada@example.com": 1}
    status, by_day = await as_["admin"]("GET", f"/reports/sessions?group_by=day&start_date={today}&end_date={today}")
    assert [(i["resource"], i["sessions"]) for i in by_day["items"]] == [(today, 3)]
    status, filtered = await as_["admin"]("GET", "/reports/sessions?group_by=protocol&user_email=dev@example.com")
    assert [(i["resource"], i["sessions"], i["blocks"]) for i in filtered["items"]] == [("postgres", 2, 1)]
    status, empty = await as_["admin"]("GET", "/reports/sessions?start_date=2001-01-01&end_date=2001-01-31")
    assert status == 200 and empty["items"] == [] and empty["totals"]["sessions"] == 0

    status, totals = await as_["admin"]("GET", "/metrics/sessions?aggregated=true")
    assert status == 200 and totals["total_sessions"] == 3 and totals["total_blocks"] == 1, totals
    status, page = await as_["admin"]("GET", f"/metrics/sessions?connection_name={db['name']}&limit=1")
    assert status == 200 and page["pages"]["total"] == 2 and len(page["data"]) == 1, page
    assert page["data"][0]["connection_name"] == db["name"] and page["data"][0]["session_ended_at"]

    assert (await as_["dev"]("GET", "/reports/sessions"))[0] == 403
    assert (await as_["dev"]("GET", "/metrics/sessions"))[0] == 403
    assert (await as_["admin"]("GET", "/reports/sessions?start_date=2026-13-01"))[0] == 422
    assert (await as_["admin"]("GET", "/reports/sessions?start_date=2026-02-02&end_date=2026-02-01"))[0] == 422


async def test_reports_on_the_command_line(gateway, as_, tmp_path):
    import asyncio
    import json
    import os

    from tests.conftest import BIN, gatewayd_command

    login = tmp_path / "login.json"
    login.write_text(json.dumps({"url": gateway.url.removesuffix("/api"), "token": gateway.tokens["auditor"]}))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("GATEWAYD_")},
           "GATEWAYD_CLIENT_CONFIG": str(login)}
    shown = await asyncio.to_thread(gatewayd_command, [str(BIN / "gatewayd"), "reports", "--group-by", "user"], env)
    assert shown.returncode == 0 and "dev@example.com" in shown.stdout and "MASKED VALUES" in shown.stdout, shown
    as_json = await asyncio.to_thread(gatewayd_command, [str(BIN / "gatewayd"), "reports", "--json"], env)
    assert json.loads(as_json.stdout)["group_by"] == "connection"
