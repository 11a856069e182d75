"""Organization management: API keys (the organization's and the operators'), service accounts, feature switches,
the sign-in configuration; against a real ``gatewayd run`` (and a real OIDC provider, tests/oidc_provider.py).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

import aiohttp
import pytest
import pytest_asyncio

from tests.apiclient import postgres_env
from tests.conftest import Daemon
from tests.oidc_provider import OIDCProvider
from tests.openapi_check import check_answer
from tests.pgpeer import unavailable_reason


@pytest_asyncio.fixture(scope="module")
async def provider() -> AsyncIterator[OIDCProvider]:
    idp = await OIDCProvider().start()
    yield idp
    await idp.stop()


@pytest_asyncio.fixture(scope="module")
async def gw(tmp_path_factory) -> AsyncIterator[Daemon]:
    daemon = Daemon(tmp_path_factory.mktemp("orgs") / "data")
    await asyncio.to_thread(daemon.start)
    daemon.admin = await asyncio.to_thread(daemon.token, "ada@example.com", "admin")
    daemon.dev = await asyncio.to_thread(daemon.token, "dev@example.com", "dev")
    yield daemon
    assert await asyncio.to_thread(daemon.stop) == 0


@pytest_asyncio.fixture(scope="module")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


async def call(http: aiohttp.ClientSession, gw: Daemon, method: str, path: str, token: str | None = None,
               body: Any = None, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    sent = dict(headers or {})
    if token:
        sent["Authorization"] = f"Bearer {token}"
    async with http.request(method, f"{gw.url}{path}", headers=sent, json=body) as response:
        text = await response.text()
        data = json.loads(text) if text else None
        check_answer(gw.url, method, path, response.status, data)
        return response.status, data


async def audit(http, gw: Daemon, query: str) -> list[dict]:
    status, body = await call(http, gw, "GET", f"/audit/logs?page_size=100&{query}", gw.admin)
    assert status == 200, body
    return body["data"]


async def test_the_organizations_key_is_shown_once_kept_hashed_and_works_until_revoked(http, gw):
    status, made = await call(http, gw, "POST", "/orgs/keys", gw.admin)
    assert status == 201 and made["key"].startswith("xorg-") and made["key_prefix"] == made["key"][:12], made
    key = made["key"]
    assert (await call(http, gw, "POST", "/orgs/keys", gw.admin))[0] == 409  # one at a time
    status, shown = await call(http, gw, "GET", "/orgs/keys", gw.admin)
    assert status == 200 and shown["key"] is None and shown["id"] == made["id"]
    assert (await call(http, gw, "GET", "/orgs/keys", gw.dev))[0] == 403

    # hoop.dev's header and the bearer scheme both authenticate as the organization's service account
    for headers in ({"Api-Key": key}, {"Authorization": f"Bearer {key}"}):
        status, me = await call(http, gw, "GET", "/userinfo", headers=headers)
        assert status == 200 and me["subject"] == shown["service_account"] and me["is_admin"], me
    status, group = await call(http, gw, "POST", "/users/groups", body={"name": "made-by-key"},
                               headers={"Api-Key": key})
    assert status == 201, group
    [entry] = [e for e in await audit(http, gw, "action=users.create_group")
               if e["request_payload_redacted"] == {"name": "made-by-key"}]
    assert entry["actor_subject"] == shown["service_account"]
    [made_entry] = await audit(http, gw, "action=orgs.create_key&outcome=success")
    assert key not in json.dumps(made_entry) and made_entry["request_payload_redacted"]["key_prefix"] == key[:12]

    raw = b"".join(p.read_bytes() for p in gw.data_dir.glob("*.db*"))
    assert key.encode() not in raw and key[:12].encode() in raw  # only its hash and prefix are kept

    status, accounts = await call(http, gw, "GET", "/serviceaccounts", gw.admin)
    [account] = [a for a in accounts if a["subject"] == shown["service_account"]]
    status, narrowed = await call(http, gw, "PUT", f"/serviceaccounts/{account['subject']}", gw.admin,
                                  {"status": "active", "groups": ["readers"]})
    assert status == 200 and narrowed["groups"] == ["readers"]
    assert (await call(http, gw, "POST", "/users/groups", body={"name": "nope"}, headers={"Api-Key": key}))[0] == 403
    status, users = await call(http, gw, "GET", "/users", gw.admin)
    assert not any(u["subject"] == account["subject"] for u in users)  # not a person

    assert (await call(http, gw, "DELETE", "/orgs/keys", gw.admin))[0] == 204
    assert (await call(http, gw, "GET", "/userinfo", headers={"Api-Key": key}))[0] == 401
    refused = [e for e in await audit(http, gw, "outcome=failure") if e["http_status"] == 401
               and e["http_path"] == "/api/userinfo"]
    assert refused and refused[0]["error_message"] == "unknown or revoked API key"
    assert (await call(http, gw, "GET", "/orgs/keys", gw.admin))[0] == 404


async def test_an_api_key_is_neither_refreshed_nor_signed_out(http, gw):
    """``/token/refresh`` and ``/logout`` are for sign-ins' tokens: an API key there is a 400 that says so (it was a
    500, the key read as a JWT, with a traceback in the log), and the key works on."""
    status, made = await call(http, gw, "POST", "/orgs/keys", gw.admin)
    assert status == 201, made
    key = made["key"]
    try:
        for headers in ({"Api-Key": key}, {"Authorization": f"Bearer {key}"}):
            for path in ("/token/refresh", "/logout"):
                status, answer = await call(http, gw, "POST", path, headers=headers)
                assert status == 400 and answer["message"].startswith("API keys are not "), (path, answer)
        assert (await call(http, gw, "GET", "/userinfo", headers={"Api-Key": key}))[0] == 200
        refused = [e for e in await audit(http, gw, "outcome=failure") if e["http_path"] == "/api/token/refresh"]
        assert len(refused) == 2 and refused[0]["http_status"] == 400
        assert key not in gw.log_text() and "Traceback" not in gw.log_text()
    finally:
        assert (await call(http, gw, "DELETE", "/orgs/keys", gw.admin))[0] == 204


async def test_a_tenant_key_stays_in_its_organization(http, provider, tmp_path):
    daemon = Daemon(tmp_path / "saas", {"auth.issuer": "oidc", "auth.oidc.issuer_url": provider.url,
                                        "auth.oidc.client_id": provider.client_id,
                                        "auth.oidc.client_secret": provider.client_secret, "auth.multi_tenant": True})
    await asyncio.to_thread(daemon.start)
    try:
        keys = {}
        for founder in ("alpha", "beta"):
            token = provider.mint(founder, f"{founder}@tenant.example", founder, email_verified=True)
            status, org = await call(http, daemon, "POST", "/signup", token, {"org_name": founder})
            assert status == 201, org
            status, made = await call(http, daemon, "POST", "/orgs/keys", token)
            assert status == 201, made
            status, created = await call(http, daemon, "POST", "/connections", body={
                "name": f"{founder}-db", "type": "database", "subtype": "postgres"}, headers={"Api-Key": made["key"]})
            assert status == 201, created
            keys[founder] = made["key"]
        status, seen = await call(http, daemon, "GET", "/connections", headers={"Api-Key": keys["alpha"]})
        assert [c["name"] for c in seen] == ["alpha-db"]
        assert (await call(http, daemon, "GET", "/connections/beta-db", headers={"Api-Key": keys["alpha"]}))[0] == 404
        # a tenant's key is no operator: gateway-wide settings stay closed
        assert (await call(http, daemon, "GET", "/serverconfig/auth", headers={"Api-Key": keys["alpha"]}))[0] == 403
    finally:
        await asyncio.to_thread(daemon.stop)


async def test_the_server_key_is_rolled_out_in_two_steps(http, gw):
    status, first = await call(http, gw, "POST", "/serverconfig/auth/apikey", gw.admin)
    assert status == 201 and first["rollout_api_key"].startswith("xapi-"), first
    key = first["rollout_api_key"]
    assert (await call(http, gw, "GET", "/serverinfo", headers={"Api-Key": key}))[0] == 401  # not in force yet
    status, doc = await call(http, gw, "GET", "/serverconfig/auth", gw.admin)
    assert doc["api_key"] is None and doc["rollout_api_key"] == key[:12] + "..." and doc["auth_method"] == "local"
    assert (await call(http, gw, "PUT", "/serverconfig/auth", gw.admin,
                       {"auth_method": "local", "rollout_api_key": "xapi-not-the-one"}))[0] == 422
    status, doc = await call(http, gw, "PUT", "/serverconfig/auth", gw.admin,
                             {"auth_method": "local", "rollout_api_key": key})
    assert status == 200 and doc["api_key"] == key[:12] + "..." and doc["rollout_api_key"] is None, doc
    status, info = await call(http, gw, "GET", "/serverinfo", headers={"Api-Key": key})
    assert status == 200 and "listeners" in info  # an operator
    [rolled] = await audit(http, gw, "action=serverconfig.rollout_api_key")
    assert key not in json.dumps(rolled)

    status, second = await call(http, gw, "POST", "/serverconfig/auth/apikey", headers={"Api-Key": key})
    assert status == 201
    assert (await call(http, gw, "PUT", "/serverconfig/auth", headers={"Api-Key": key},
                       body={"auth_method": "local", "rollout_api_key": second["rollout_api_key"]}))[0] == 200
    assert (await call(http, gw, "GET", "/serverinfo", headers={"Api-Key": key}))[0] == 401  # the old one ended
    assert (await call(http, gw, "GET", "/serverinfo", headers={"Api-Key": second["rollout_api_key"]}))[0] == 200
    assert (await call(http, gw, "GET", "/serverconfig/auth", gw.dev))[0] == 403


async def test_sign_in_moves_to_an_identity_provider_live_and_service_accounts_sign_in(http, gw, provider):
    assert await call(http, gw, "GET", "/publicserverinfo") == (200, {"auth_method": "local"})
    status, account = await call(http, gw, "POST", "/serviceaccounts", gw.admin,
                                 {"subject": "ci-robot", "name": "CI", "status": "active", "groups": ["deployers"]})
    assert status == 201, account
    assert (await call(http, gw, "POST", "/serviceaccounts", gw.admin,
                       {"subject": "gatewayd:org-key:x", "status": "active"}))[0] == 422
    oidc = {"issuer_url": provider.url, "client_id": provider.client_id, "client_secret": provider.client_secret}
    status, doc = await call(http, gw, "PUT", "/serverconfig/auth", gw.admin, {"auth_method": "oidc",
                                                                               "oidc_config": oidc})
    try:
        assert status == 200 and doc["oidc_config"]["client_secret"] == "[REDACTED]", doc
        assert await call(http, gw, "GET", "/publicserverinfo") == (200, {"auth_method": "oidc"})
        status, me = await call(http, gw, "GET", "/userinfo", provider.mint("ci-robot", "ci@example.com"))
        assert status == 200 and me["id"] == account["id"] and me["groups"] == ["deployers"], me
        assert (await call(http, gw, "GET", "/userinfo", provider.mint("gatewayd:server-key")))[0] == 401
        status, login = await call(http, gw, "GET", "/login?redirect=/")
        assert status == 200 and login["login_url"].startswith(provider.url)
        raw = b"".join(p.read_bytes() for p in gw.data_dir.glob("*.db*"))
        assert provider.client_secret.encode() not in raw
        # sent back as shown, the stored secret stays
        status, kept = await call(http, gw, "PUT", "/serverconfig/auth", gw.admin, {
            "auth_method": "oidc", "oidc_config": {**oidc, "client_secret": "[REDACTED]"}})
        assert status == 200 and kept["oidc_config"]["client_secret"] == "[REDACTED]"
        assert (await call(http, gw, "PUT", "/serverconfig/auth", gw.admin, {"auth_method": "saml"}))[0] == 422
    finally:
        status, doc = await call(http, gw, "PUT", "/serverconfig/auth", gw.admin, {"auth_method": "local"})
    assert status == 200 and doc["oidc_config"] is None
    assert (await call(http, gw, "GET", "/userinfo", provider.mint("ci-robot", "ci@example.com")))[0] == 401


@pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")
async def test_switching_the_ai_analyzer_off_stops_it_for_the_organization(http, gw, pg_target):
    status, conn = await call(http, gw, "POST", "/connections", gw.admin, {
        "name": "analysed", "type": "database", "subtype": "postgres",
        "secret": {f"envvar:{k}": __import__("base64").b64encode(v.encode()).decode()
                   for k, v in postgres_env(pg_target).items()}})
    assert status == 201, conn
    assert (await call(http, gw, "POST", "/ai/session-analyzer/rules", gw.admin, {
        "name": "block-high", "connection_names": ["analysed"], "risk_evaluation": {
            "low_risk_action": "allow_execution", "medium_risk_action": "allow_execution",
            "high_risk_action": "block_execution"}}))[0] == 201
    script = {"connection": "analysed", "script": "CREATE TABLE keepme (x int); DROP TABLE keepme"}
    status, blocked = await call(http, gw, "POST", "/sessions", gw.dev, script)
    assert status == 200 and blocked["exit_code"] == 254 and blocked["ai_analysis"]["risk_level"] == "high"
    status, switched = await call(http, gw, "PUT", "/orgs/features", gw.admin,
                                  {"name": "ai-session-analyzer", "status": "disabled"})
    assert status == 200 and {"name": "ai-session-analyzer", "status": "disabled",
                              "description": switched[1]["description"]} in switched
    try:
        status, ran = await call(http, gw, "POST", "/sessions", gw.dev, script)
        assert status == 200 and ran["exit_code"] == 0 and "ai_analysis" not in ran, ran
        assert (await call(http, gw, "PUT", "/orgs/features", gw.dev,
                           {"name": "ai-session-analyzer", "status": "enabled"}))[0] == 403
        assert (await call(http, gw, "PUT", "/orgs/features", gw.admin, {"name": "ask-ai", "status": "enabled"}))[0] \
            == 422
        [entry] = await audit(http, gw, "action=feature.disable")
        assert entry["request_payload_redacted"] == {"name": "ai-session-analyzer", "status": "disabled"}
    finally:
        await call(http, gw, "PUT", "/orgs/features", gw.admin, {"name": "ai-session-analyzer", "status": "enabled"})
    status, listed = await call(http, gw, "GET", "/orgs/features", gw.dev)
    assert status == 200 and {f["name"]: f["status"] for f in listed} == {"runbooks": "enabled",
                                                                          "ai-session-analyzer": "enabled"}


async def test_an_unreachable_identity_provider_is_said_not_a_server_error(http, gw, provider):
    from tests.ports import free_port

    gone = {"issuer_url": f"http://127.0.0.1:{free_port()}", "client_id": "x", "client_secret": "y"}
    assert (await call(http, gw, "PUT", "/serverconfig/auth", gw.admin, {"auth_method": "oidc",
                                                                          "oidc_config": gone}))[0] == 200
    try:
        status, refused = await call(http, gw, "GET", "/login?redirect=/")
        assert status == 400 and "discovery failed" in refused["message"], refused
        assert (await call(http, gw, "GET", "/userinfo", provider.mint("someone", "s@example.com")))[0] == 401
        assert (await call(http, gw, "GET", "/userinfo", gw.admin))[0] == 200  # the gateway's own tokens still work
    finally:
        assert (await call(http, gw, "PUT", "/serverconfig/auth", gw.admin, {"auth_method": "local"}))[0] == 200


async def test_a_key_s_service_account_never_stands_in_for_the_last_admin(http, gw):
    status, made = await call(http, gw, "POST", "/orgs/keys", gw.admin)
    assert status in (201, 409), made
    status, accounts = await call(http, gw, "GET", "/serviceaccounts", gw.admin)
    [account] = [a for a in accounts if a["subject"].startswith("gatewayd:org-key:")]
    await call(http, gw, "PUT", f"/serviceaccounts/{account['subject']}", gw.admin, {"status": "active",
                                                                                   "groups": ["admin"]})
    status, users = await call(http, gw, "GET", "/users", gw.admin)
    admins = [u for u in users if u["is_admin"] and u["status"] == "active"]
    assert [u["email"] for u in admins] == ["ada@example.com"], admins
    status, refused = await call(http, gw, "PUT", f"/users/{admins[0]['id']}", gw.admin, {"groups": ["dev"]})
    assert status == 409 and "last active admin" in refused["message"], refused


async def test_the_organizations_key_on_the_command_line(http, gw, tmp_path):
    import os

    from tests.conftest import BIN, gatewayd_command

    await call(http, gw, "DELETE", "/orgs/keys", gw.admin)
    login = tmp_path / "login.json"
    login.write_text(json.dumps({"url": gw.url.removesuffix("/api"), "token": gw.admin}))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("GATEWAYD_")},
           "GATEWAYD_CLIENT_CONFIG": str(login)}

    def cli(*args: str):
        return gatewayd_command([str(BIN / "gatewayd"), "org-key", *args], env, check=False)

    made = await asyncio.to_thread(cli, "create")
    key = made.stdout.strip()
    assert made.returncode == 0 and key.startswith("xorg-") and "shown this once" in made.stderr, made
    assert (await call(http, gw, "GET", "/userinfo", headers={"Api-Key": key}))[0] == 200
    shown = await asyncio.to_thread(cli, "show")
    assert shown.returncode == 0 and key[:12] in shown.stdout and key not in shown.stdout, shown
    assert (await asyncio.to_thread(cli, "revoke")).returncode == 0
    assert (await call(http, gw, "GET", "/userinfo", headers={"Api-Key": key}))[0] == 401
