"""Plugins, webhooks and Slack: events leave a real ``gatewayd run`` signed, retried and logged, and reach local
HTTPS receivers that check them (tests/webhookpeer.py)."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from typing import Any, AsyncIterator, Callable

import aiohttp
import pytest
import pytest_asyncio

from tests.apiclient import Api, postgres_env
from tests.conftest import Daemon
from tests.pgpeer import unavailable_reason
from tests.ports import free_port
from tests.webhookpeer import Receiver


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


@pytest_asyncio.fixture(scope="module")
async def receiver(tmp_path_factory) -> AsyncIterator[Receiver]:
    peer = await Receiver(tmp_path_factory.mktemp("receiver")).start()
    yield peer
    await peer.stop()


@pytest_asyncio.fixture(scope="module")
async def gw(receiver, tmp_path_factory) -> AsyncIterator[Daemon]:
    daemon = Daemon(tmp_path_factory.mktemp("webhooks") / "data", {
        "webhooks.ca_file": str(receiver.cert), "webhooks.retry_base": "100ms", "webhooks.poll_interval": "100ms",
        "webhooks.max_attempts": 4, "webhooks.cache_seconds": 0, "sessions.exec_wait": "20s",
        "webhooks.slack_api_url": f"{receiver.url}/slack/api", "api.public_url": "https://gateway.example"})
    await asyncio.to_thread(daemon.start)
    daemon.tokens = {"admin": await asyncio.to_thread(daemon.token, "ada@example.com", "admin"),
                     "dba": await asyncio.to_thread(daemon.token, "dora@example.com", "dba"),
                     "dev": await asyncio.to_thread(daemon.token, "dev@example.com", "dev")}
    yield daemon
    assert await asyncio.to_thread(daemon.stop) == 0
    assert "whsec_" not in daemon.log_text() and "xoxb-" not in daemon.log_text()


@pytest_asyncio.fixture(scope="module")
async def as_(gw) -> AsyncIterator[dict[str, Api]]:
    async with aiohttp.ClientSession() as http:
        yield {who: Api(gw, http, token) for who, token in gw.tokens.items()}


async def eventually(check: Callable[[], Any], timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        assert time.monotonic() < deadline, "never happened"
        await asyncio.sleep(0.05)


async def endpoint(as_, receiver: Receiver, name: str, **fields: Any) -> dict:
    status, made = await as_["admin"]("POST", "/webhooks/endpoints", {"url": f"{receiver.url}/hooks/{name}",
                                                                      **fields})
    assert status == 201 and made["secret"].startswith("whsec_"), made
    receiver.secrets[name] = made["secret"]
    return made


@pytest_asyncio.fixture(scope="module")
async def webhooks_on(as_) -> None:
    status, plugin = await as_["admin"]("POST", "/plugins", {"name": "webhooks"})
    assert status == 201, plugin


def events_at(receiver: Receiver, name: str, kind: str) -> list[dict]:
    return [a.json for a in receiver.of(f"/hooks/{name}") if a.signed and a.json["type"] == kind]


async def test_nothing_leaves_without_the_webhooks_plugin(as_, receiver):
    made = await endpoint(as_, receiver, "early")
    await as_["admin"]("POST", "/users/groups", {"name": "quiet-group"})
    status, sent = await as_["admin"]("POST", "/webhooks/messages", {})
    assert status == 409, sent
    await asyncio.sleep(0.5)
    assert receiver.of("/hooks/early") == []
    assert (await as_["admin"]("DELETE", f"/webhooks/endpoints/{made['id']}"))[0] == 204


async def test_access_changes_and_sessions_arrive_signed(as_, receiver, webhooks_on, gw):
    made = await endpoint(as_, receiver, "all")
    status, listed = await as_["admin"]("GET", "/webhooks/endpoints")
    assert status == 200 and "secret" not in listed[0] and made["id"] in [e["id"] for e in listed]
    raw = b"".join(p.read_bytes() for p in gw.data_dir.glob("*.db*"))
    assert made["secret"].encode() not in raw  # sealed

    await as_["admin"]("POST", "/users/groups", {"name": "auditors-2"})
    [change] = await eventually(lambda: [e for e in events_at(receiver, "all", "access.change")
                                         if e["data"]["http_path"] == "/api/users/groups"])
    assert change["data"]["actor"] == "ada@example.com" and change["data"]["action"] == "users.create_group"

    # a script on a target that is not there: its session opens and closes
    conn = await as_["admin"].connection("nowhere", "database", "postgres", {
        "HOST": "127.0.0.1", "PORT": str(free_port()), "USER": "x", "PASS": "y", "DB": "z"})
    status, ran = await as_["dev"]("POST", "/sessions", {"connection": conn["name"], "script": "SELECT 1"})
    assert status == 200 and ran["exit_code"] == 254, ran
    opened = await eventually(lambda: [e for e in events_at(receiver, "all", "session.open")
                                       if e["data"]["session_id"] == ran["session_id"]])
    closed = await eventually(lambda: [e for e in events_at(receiver, "all", "session.close")
                                       if e["data"]["session_id"] == ran["session_id"]])
    assert opened[0]["data"]["user"] == "dev@example.com" and closed[0]["data"]["exit_code"] == 254
    assert closed[0]["data"]["status"] == "done" and "script" not in json.dumps(closed[0]["data"])
    arrival = next(a for a in receiver.of("/hooks/all") if a.json["id"] == closed[0]["id"])
    assert arrival.headers["webhook-id"] == closed[0]["id"] and arrival.signed

    status, log = await as_["admin"]("GET", f"/webhooks/messages?endpoint_id={made['id']}&status=delivered")
    assert status == 200 and log["total"] >= 4, log
    status, one = await as_["admin"]("GET", f"/webhooks/messages/{log['data'][0]['id']}")
    assert status == 200 and one["payload"]["id"] == one["event_id"] and one["attempts"] == 1


async def test_a_failing_endpoint_is_retried_with_back_off_then_given_up(as_, receiver, webhooks_on):
    flaky = await endpoint(as_, receiver, "flaky", event_types=["ping"])
    receiver.failures["flaky"] = 2
    status, sent = await as_["admin"]("POST", "/webhooks/messages", {"endpoint_id": flaky["id"], "data": {"n": 1}})
    assert status == 202 and len(sent) == 1, sent

    async def state(delivery_id: str) -> dict:
        return (await as_["admin"]("GET", f"/webhooks/messages/{delivery_id}"))[1]

    deadline = time.monotonic() + 20
    while (found := await state(sent[0]["id"]))["status"] == "pending":
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    assert found["status"] == "delivered" and found["attempts"] == 3, found
    times = [float(a.headers["webhook-timestamp"]) for a in receiver.of("/hooks/flaky")]
    assert len(times) == 3  # the same event three times, each signed
    assert len({a.headers["webhook-id"] for a in receiver.of("/hooks/flaky")}) == 1

    dead = await endpoint(as_, receiver, "dead", event_types=["ping"])
    receiver.failures["dead"] = 100
    status, sent = await as_["admin"]("POST", "/webhooks/messages", {"endpoint_id": dead["id"]})
    deadline = time.monotonic() + 30
    while (found := await state(sent[0]["id"]))["status"] == "pending":
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    assert found["status"] == "failed" and found["attempts"] == 4 and found["last_status"] == 500, found
    assert "try again later" in found["last_error"]


async def test_an_endpoint_gets_only_the_types_it_asked_for_and_a_wrong_secret_is_caught(as_, receiver, webhooks_on):
    picky = await endpoint(as_, receiver, "picky", event_types=["review.create"])
    await as_["admin"]("POST", "/users/groups", {"name": "not-for-picky"})
    await asyncio.sleep(0.5)
    assert receiver.of("/hooks/picky") == []
    receiver.secrets["picky"] = "whsec_" + base64.b64encode(b"x" * 32).decode()  # the receiver has the wrong one
    await as_["admin"]("POST", "/webhooks/messages", {"endpoint_id": picky["id"]})
    arrival = (await eventually(lambda: receiver.of("/hooks/picky")))[0]
    assert arrival.signed is False  # the signature is really checked: a wrong secret does not verify
    status, bad = await as_["admin"]("POST", "/webhooks/endpoints", {"url": "http://127.0.0.1:1/x"})
    assert status == 422 and "https" in bad["message"]


async def test_a_plugins_settings_are_redacted_in_the_audit_log_as_in_the_answer(as_, receiver):
    """Slack's ``SLACK_WEBHOOK_URL`` (a bearer URL: whoever has it posts to the channel) was in the audit log of
    ``POST /plugins`` and ``PUT /plugins/{name}/config`` while the API showed ``[REDACTED]``: every setting's
    value is now redacted in both."""
    hook, bot = f"{receiver.url}/slack/T0/B0/hook-secret-77", "xoxb-bot-token-77"
    status, slack = await as_["admin"]("POST", "/plugins", {"name": "slack", "config": {"envvars": {
        "SLACK_WEBHOOK_URL": b64(hook)}}})
    assert status == 201 and slack["config"]["envvars"] == {"SLACK_WEBHOOK_URL": "[REDACTED]"}, slack
    try:
        status, shown = await as_["admin"]("PUT", "/plugins/slack/config", {"envvars": {
            "SLACK_WEBHOOK_URL": "[REDACTED]", "SLACK_BOT_TOKEN": b64(bot), "SLACK_CHANNEL": b64("C-ops")}})
        assert status == 200 and set(shown["config"]["envvars"].values()) == {"[REDACTED]"}, shown
        status, logs = await as_["admin"]("GET", "/audit/logs?resource_type=plugins&page_size=100")
        payloads: dict[str, Any] = {}
        for entry in logs["data"]:  # newest first: this test's
            payloads.setdefault(entry["action"], entry["request_payload_redacted"])
        assert payloads["plugins.create_plugin"]["config"] == {"envvars": {"SLACK_WEBHOOK_URL": "[REDACTED]"}}
        assert payloads["plugins.configure_plugin"] == {"envvars": dict.fromkeys(
            ("SLACK_WEBHOOK_URL", "SLACK_BOT_TOKEN", "SLACK_CHANNEL"), "[REDACTED]")}, payloads
        assert not any(secret in json.dumps(logs) for secret in (hook, b64(hook), bot, b64(bot)))
    finally:
        assert (await as_["admin"]("DELETE", "/plugins/slack"))[0] == 204


pg_only = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")


@pg_only
async def test_reviews_and_blocks_reach_webhooks_and_slack(as_, receiver, webhooks_on, pg_target):
    hooked = await endpoint(as_, receiver, "reviews", event_types=["review.create", "review.update",
                                                                   "guardrail.block"])
    status, slack = await as_["admin"]("POST", "/plugins", {"name": "slack", "config": {"envvars": {
        "SLACK_WEBHOOK_URL": b64(f"{receiver.url}/slack/hook")}}})
    assert status == 201 and slack["config"]["envvars"] == {"SLACK_WEBHOOK_URL": "[REDACTED]"}, slack
    conn = await as_["admin"].connection("reviewed", "database", "postgres", postgres_env(pg_target),
                                         {"reviewers": ["dba"]})
    status, pending = await as_["dev"]("POST", "/sessions", {"connection": conn["name"], "script": "SELECT 1"})
    assert status == 202, pending
    [created] = await eventually(lambda: [e for e in events_at(receiver, "reviews", "review.create")
                                          if e["data"]["review_id"] == pending["review_id"]])
    assert created["data"]["reviewers"] == ["dba"] and created["data"]["actor"] == "dev@example.com"
    message = (await eventually(lambda: receiver.of("/slack/hook")))[-1].json
    assert f"https://gateway.example/?review={pending['review_id']}" in json.dumps(message["blocks"])
    assert "dev@example.com" in message["text"] and conn["name"] in message["text"]

    assert (await as_["dba"]("PUT", f"/reviews/{pending['review_id']}", {"status": "APPROVED"}))[0] == 200
    [updated] = await eventually(lambda: [e for e in events_at(receiver, "reviews", "review.update")
                                          if e["data"]["review_id"] == pending["review_id"]])
    assert updated["data"]["review_status"] == "APPROVED" and updated["data"]["actor"] == "dora@example.com"

    # Slack through a bot token, the connection's own channel
    await as_["admin"]("PUT", "/plugins/slack/config", {"envvars": {
        "SLACK_BOT_TOKEN": b64(receiver.bot_token), "SLACK_CHANNEL": b64("C-default")}})
    assert (await as_["admin"]("PUT", f"/plugins/slack/conn/{conn['name']}", {"config": ["C-dba-reviews"]}))[0] == 200
    status, again = await as_["dev"]("POST", "/sessions", {"connection": conn["name"], "script": "SELECT 2"})
    posted = await eventually(lambda: [a.json for a in receiver.of("/slack/api/chat.postMessage")
                                       if again["review_id"] in json.dumps(a.json)])
    assert posted[0]["channel"] == "C-dba-reviews"
    status, log = await as_["admin"]("GET", "/webhooks/messages?status=delivered&limit=100")
    assert any(d["channel"] == "slack" for d in log["data"])

    rail = await as_["admin"].guardrail(conn, [{"type": "deny_words_list", "words": ["drop"]}])
    plain = await as_["admin"].connection("plain", "database", "postgres", postgres_env(pg_target))
    await as_["admin"]("PUT", f"/guardrails/{rail['id']}", {"name": rail["name"], "connection_ids": [plain["id"]],
                                                             "input": rail["input"], "output": rail["output"]})
    status, blocked = await as_["dev"]("POST", "/sessions", {"connection": plain["name"], "script": "DROP TABLE x"})
    assert status == 200 and blocked["exit_code"] == 254, blocked
    [block] = await eventually(lambda: [e for e in events_at(receiver, "reviews", "guardrail.block")
                                        if e["data"]["session_id"] == blocked["session_id"]])
    assert block["data"]["guardrail"] == rail["name"] and "DROP TABLE x" not in json.dumps(block)
    assert (await as_["admin"]("DELETE", "/plugins/slack"))[0] == 204
    del hooked


async def test_plugins_are_gatewayds_own_and_admins_only(as_):
    status, refused = await as_["admin"]("POST", "/plugins", {"name": "dlp"})
    assert status == 422 and "datamasking" in refused["message"]
    assert (await as_["dev"]("POST", "/plugins", {"name": "runbooks"}))[0] == 403
    status, bad = await as_["admin"]("POST", "/plugins", {"name": "runbooks", "config": {"envvars": {
        "GIT_URL": b64("https://example.com/r.git")}}})
    assert status == 422 and "/api/runbooks/configurations" in bad["message"]
    status, listed = await as_["dev"]("GET", "/plugins")
    assert status == 200 and all(set(p["config"]["envvars"].values()) <= {"[REDACTED]"} for p in listed
                                 if p["config"])


async def test_a_tenants_endpoint_never_reaches_the_gateways_host(receiver):
    from gatewayd.config import load_config
    from gatewayd.tenancy import Tenancy
    from gatewayd.webhooks import Notifier

    config = load_config(None, environ={}, overrides={"webhooks.ca_file": str(receiver.cert)})
    notifier = Notifier(None, config, Tenancy(True, "operators"))  # type: ignore[arg-type]
    try:
        status, error = await notifier._post("a-tenant", f"{receiver.url}/hooks/tenant", b"{}", {})
        assert status == 0 and "its host is a loopback address" in error, error  # final: not retried
        status, _ = await notifier._post("operators", f"{receiver.url}/hooks/tenant", b"{}", {})
        assert status == 401  # the operators' organization reaches it (and the receiver checks the signature)
    finally:
        await notifier.stop()
    assert len(receiver.of("/hooks/tenant")) == 1  # the operators' only: the tenant's never left the gateway


async def test_the_delivery_log_on_the_command_line(gw, as_, receiver, webhooks_on, tmp_path):
    import os

    from tests.conftest import BIN, gatewayd_command

    login = tmp_path / "login.json"
    login.write_text(json.dumps({"url": gw.url.removesuffix("/api"), "token": gw.tokens["admin"]}))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("GATEWAYD_")},
           "GATEWAYD_CLIENT_CONFIG": str(login)}
    shown = await asyncio.to_thread(gatewayd_command, [str(BIN / "gatewayd"), "webhooks", "--status", "delivered"],
                                    env)
    assert shown.returncode == 0 and "delivered" in shown.stdout and "access.change" in shown.stdout, shown
