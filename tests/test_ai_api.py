"""The AI session analysis API of a real ``gatewayd run``: the provider, the rules, a connection's rule."""

from __future__ import annotations

import json
import uuid

import aiohttp
import pytest

from tests.apiclient import Api

KEY = "sk-live-this-key-must-never-leave-the-store-7Q2x"


@pytest.fixture
async def as_admin(daemon, admin_token):
    async with aiohttp.ClientSession() as http:
        yield Api(daemon, http, admin_token)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def pg_connection(api: Api) -> dict:
    return await api.connection("ai", "database", "postgres", {"HOST": "127.0.0.1", "PORT": "5432", "USER": "u",
                                                                "PASS": "target-password"})


async def test_the_provider_is_set_by_admins_kept_encrypted_and_shown_masked(daemon, as_admin, user_token):
    path = "/ai/session-analyzer/providers"
    await as_admin("DELETE", path)
    assert (await as_admin("GET", path))[0] == 404
    status, body = await as_admin("PUT", path, {"provider": "openai", "model": "gpt-4o-mini"})
    assert status == 400 and body == {"message": "field 'api_key' is required"}
    status, body = await as_admin("PUT", path, {"provider": "custom", "model": "m", "api_key": KEY})
    assert status == 422 and "api_url" in body["message"] and "custom" in body["message"]
    status, body = await as_admin("PUT", path, {"provider": "azure-openai", "model": "m", "api_key": KEY,
                                                "api_url": "ftp://example.invalid"})
    assert status == 422 and "http" in body["message"]
    status, body = await as_admin("PUT", path, {"provider": "gemini", "model": "m", "api_key": KEY})
    assert status == 422

    status, created = await as_admin("PUT", path, {"provider": "openai", "model": "gpt-4o-mini", "api_key": KEY})
    assert status == 200, created
    assert created["api_key"] == "****" + KEY[-4:] and created["provider"] == "openai" and created["api_url"] is None
    # a change of model without a key keeps the stored key (a console can send back what it shows) ...
    status, changed = await as_admin("POST", path, {"provider": "openai", "model": "gpt-4.1"})
    assert status == 200 and changed["id"] == created["id"] and changed["api_key"] == created["api_key"]
    # ... a change of kind needs the key again, and with it is made
    status, body = await as_admin("POST", path, {"provider": "anthropic", "model": "claude-sonnet-4-5"})
    assert status == 400 and "api_key" in body["message"], body
    status, changed = await as_admin("POST", path, {"provider": "anthropic", "model": "claude-sonnet-4-5",
                                                    "api_key": KEY})
    assert status == 200 and changed["id"] == created["id"]
    status, shown = await as_admin("GET", path)
    assert status == 200 and shown["model"] == "claude-sonnet-4-5" and shown["provider"] == "anthropic"

    for method in ("GET", "PUT", "DELETE"):
        status, body = await as_admin(method, path, {"provider": "openai", "model": "x", "api_key": "k"},
                                      token=user_token)
        assert status == 403, (method, body)

    # the key is in no API answer, no audit payload and nowhere in the data dir in clear
    status, logs = await as_admin("GET", "/audit/logs?resource_type=ai_session_analyzer&page_size=100")
    assert status == 200 and logs["data"]
    assert KEY not in json.dumps(logs)
    assert any((e["request_payload_redacted"] or {}).get("api_key") == "[REDACTED]" for e in logs["data"])
    for file in daemon.data_dir.rglob("*"):
        if file.is_file():
            assert KEY.encode() not in file.read_bytes(), file
    assert KEY not in daemon.log_text()

    assert (await as_admin("DELETE", path))[0] == 204
    assert (await as_admin("DELETE", path))[0] == 404


async def test_a_new_address_for_the_provider_needs_the_key_again(as_admin):
    """Issue 31, item 6: a PUT that changed only api_url kept the stored key, which then went to the new address."""
    path = "/ai/session-analyzer/providers"
    status, body = await as_admin("PUT", path, {"provider": "custom", "model": "m", "api_key": KEY,
                                                "api_url": "https://llm.corp.example/v1"})
    assert status == 200, body
    for change in ({"api_url": "https://collector.attacker.example/v1"}, {"provider": "azure-openai"},
                   {"api_url": "https://llm.corp.example/v1/../v2"}):
        status, body = await as_admin("PUT", path, {"provider": "custom", "model": "m",
                                                    "api_url": "https://llm.corp.example/v1", **change})
        assert status == 400 and "api_key" in body["message"], (change, body)
    status, shown = await as_admin("GET", path)
    assert shown["api_url"] == "https://llm.corp.example/v1" and shown["provider"] == "custom"
    # the same address (the console sending back what it shows) keeps the key
    status, body = await as_admin("PUT", path, {"provider": "custom", "model": "m2",
                                                "api_url": "https://llm.corp.example/v1"})
    assert status == 200 and body["model"] == "m2" and body["api_key"] == "****" + KEY[-4:], body
    assert (await as_admin("DELETE", path))[0] == 204


async def test_rules_are_listed_by_anyone_changed_by_admins_and_one_per_connection(as_admin, user_token):
    conn = await pg_connection(as_admin)
    other = await pg_connection(as_admin)
    name = unique("rule")
    body = {"name": name, "description": "block what is risky", "connection_names": [conn["name"]],
            "risk_evaluation": {"low_risk_action": "allow_execution", "medium_risk_action": "block_execution",
                                "high_risk_action": "block_execution"}}
    status, refused = await as_admin("POST", "/ai/session-analyzer/rules", body, token=user_token)
    assert status == 403, refused
    status, created = await as_admin("POST", "/ai/session-analyzer/rules", body)
    assert status == 201, created
    assert created["risk_evaluation"] == body["risk_evaluation"] and created["on_failure"] is None
    assert created["native_mode"] == "async"  # the default: native input is analysed in the background
    assert (await as_admin("POST", "/ai/session-analyzer/rules", body))[0] == 409

    twin = {**body, "name": unique("twin")}
    status, conflict = await as_admin("POST", "/ai/session-analyzer/rules", twin)
    assert status == 409 and conn["name"] in conflict["message"] and name in conflict["message"]

    status, bad = await as_admin("POST", "/ai/session-analyzer/rules", {
        **twin, "connection_names": [other["name"]], "risk_evaluation": {"high_risk_action": "maybe"}})
    assert status == 422 and "risk_evaluation.high_risk_action" in bad["message"]
    status, bad = await as_admin("POST", "/ai/session-analyzer/rules", {**twin, "connection_names": [],
                                                                         "on_failure": "sideways"})
    assert status == 422
    status, bad = await as_admin("POST", "/ai/session-analyzer/rules", {**twin, "connection_names": [],
                                                                         "timeout": 0})
    assert status == 422 and "timeout" in bad["message"]
    status, bad = await as_admin("POST", "/ai/session-analyzer/rules", {**twin, "connection_names": [],
                                                                         "native_mode": "later"})
    assert status == 422 and "native_mode" in bad["message"]

    status, listed = await as_admin("GET", f"/ai/session-analyzer/rules?connection_names={conn['name']}",
                                    token=user_token)
    assert status == 200 and [r["name"] for r in listed["data"]] == [name] and listed["pages"]["total"] == 1
    status, page = await as_admin("GET", "/ai/session-analyzer/rules?page=1&page_size=1")
    assert status == 200 and len(page["data"]) == 1 and page["pages"]["size"] == 1

    status, rule = await as_admin("GET", f"/connections/{conn['name']}/ai-session-analyzer-rule", token=user_token)
    assert status == 200 and rule["name"] == name
    status, rule = await as_admin("GET", f"/connections/{conn['id']}/ai-session-analyzer-rule")
    assert status == 200 and rule["name"] == name
    status, none = await as_admin("GET", f"/connections/{other['name']}/ai-session-analyzer-rule")
    assert status == 404 and other["name"] in none["message"]
    assert (await as_admin("GET", "/connections/no-such-connection/ai-session-analyzer-rule"))[0] == 404

    status, updated = await as_admin("PUT", f"/ai/session-analyzer/rules/{name}", {
        **body, "connection_names": [other["name"]], "risk_evaluation": {}, "on_failure": "open", "timeout": 2.5,
        "native_mode": "sync"})
    assert status == 200, updated
    assert updated["risk_evaluation"] == {"low_risk_action": "allow_execution",
                                          "medium_risk_action": "allow_execution",
                                          "high_risk_action": "block_execution"}  # the defaults
    assert updated["on_failure"] == "open" and updated["timeout"] == 2.5 and updated["id"] == created["id"]
    assert updated["native_mode"] == "sync"
    assert (await as_admin("GET", f"/connections/{other['name']}/ai-session-analyzer-rule"))[1]["native_mode"] == "sync"
    assert (await as_admin("GET", f"/connections/{conn['name']}/ai-session-analyzer-rule"))[0] == 404
    assert (await as_admin("GET", f"/connections/{other['name']}/ai-session-analyzer-rule"))[0] == 200

    assert (await as_admin("DELETE", f"/ai/session-analyzer/rules/{name}", token=user_token))[0] == 403
    assert (await as_admin("DELETE", f"/ai/session-analyzer/rules/{name}"))[0] == 204
    assert (await as_admin("GET", f"/ai/session-analyzer/rules/{name}"))[0] == 404
    status, logs = await as_admin("GET", "/audit/logs?resource_type=ai_session_analyzer&page_size=100")
    actions = {e["action"] for e in logs["data"]}
    assert {"ai_session_analyzer.create_rule", "ai_session_analyzer.update_rule",
            "ai_session_analyzer.delete_rule"} <= actions
