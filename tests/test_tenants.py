"""Hostile tenants and identities (issue 12, items 5-11): attacks through a plain HTTP client against a real
``gatewayd run`` in multi-tenant and single-tenant OIDC mode, with the test identity provider.

Each test replays the attack as it was found and asserts the refusal.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

import aiohttp
import pytest
import pytest_asyncio

from tests.apiclient import b64
from tests.conftest import Daemon, accepts, free_port, wait_port
from tests.llmpeer import FakeLLM
from tests.oidc_provider import OIDCProvider

DENIED = (401, {"message": "access denied"})


@pytest_asyncio.fixture(scope="module")
async def provider() -> AsyncIterator[OIDCProvider]:
    idp = await OIDCProvider().start()
    yield idp
    await idp.stop()


def _oidc(provider: OIDCProvider) -> dict[str, Any]:
    return {"auth.issuer": "oidc", "auth.oidc.issuer_url": provider.url, "auth.oidc.client_id": provider.client_id,
            "auth.oidc.client_secret": provider.client_secret}


@pytest_asyncio.fixture(scope="module")
async def saas(provider: OIDCProvider, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Daemon]:
    """A multi-tenant gateway with a PostgreSQL and an HTTP listener every tenant shares, and its metrics."""
    daemon = Daemon(tmp_path_factory.mktemp("saas") / "data", {
        **_oidc(provider), "auth.multi_tenant": True, "listeners.postgres": f"127.0.0.1:{free_port()}",
        "listeners.http": f"127.0.0.1:{free_port()}", "metrics.listen": f"127.0.0.1:{free_port()}"})
    await asyncio.to_thread(daemon.start)
    daemon.pg_port = int(daemon.settings["listeners.postgres"].rsplit(":", 1)[1])
    daemon.http_port = int(daemon.settings["listeners.http"].rsplit(":", 1)[1])
    daemon.metrics_port = int(daemon.settings["metrics.listen"].rsplit(":", 1)[1])
    await asyncio.to_thread(wait_port, daemon.pg_port, daemon.process, "gatewayd")
    await asyncio.to_thread(wait_port, daemon.http_port, daemon.process, "gatewayd")
    yield daemon
    await asyncio.to_thread(daemon.stop)


@pytest_asyncio.fixture(scope="module")
async def single(provider: OIDCProvider, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Daemon]:
    """A single-tenant gateway in OIDC mode."""
    daemon = Daemon(tmp_path_factory.mktemp("single") / "data", _oidc(provider))
    await asyncio.to_thread(daemon.start)
    yield daemon
    await asyncio.to_thread(daemon.stop)


@pytest_asyncio.fixture(scope="module")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


async def call(http: aiohttp.ClientSession, gw: Daemon, method: str, path: str, token: str | None = None,
               body: Any = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with http.request(method, f"{gw.url}{path}", headers=headers, json=body) as response:
        text = await response.text()
        return response.status, json.loads(text) if text else None


async def cli_token(gw: Daemon, email: str, groups: str | None = None, *extra: str) -> str:
    args = ["token", "create", "--email", email, *(["--groups", groups] if groups is not None else []), *extra]
    return (await asyncio.to_thread(gw.cli, *args)).stdout.strip()


async def found_org(http, gw: Daemon, provider: OIDCProvider, sub: str, groups: list[str] | None = None,
                    org: str = "") -> tuple[str, str]:
    """A self-service tenant: an identity-provider user signs up and founds an organization. (token, org id)"""
    token = provider.mint(sub, f"{sub}@tenant.example", sub.title(), groups, email_verified=True)
    status, body = await call(http, gw, "POST", "/signup", token, {"org_name": org or f"org of {sub}"})
    assert status == 201, body
    return token, body["org_id"]


# --- 5. gateway-wide settings belong to operators ------------------------------------------------------------


async def test_a_signed_up_admin_cannot_read_or_change_gateway_settings(http, saas, provider):
    founder, _ = await found_org(http, saas, provider, "mallory")
    status, body = await call(http, saas, "GET", "/serverconfig/misc", founder)
    assert status == 403 and "operator" in body["message"], body
    assert "hosts_key" not in json.dumps(body)
    status, body = await call(http, saas, "PUT", "/serverconfig/misc", founder,
                              {"postgres_server_config": {"listen_address": ""}})
    assert status == 403, body
    assert accepts(saas.pg_port), "a tenant stopped the PostgreSQL listener of every tenant"
    status, info = await call(http, saas, "GET", "/serverinfo", founder)
    assert status == 200 and "listeners" not in info
    status, me = await call(http, saas, "GET", "/userinfo", founder)
    assert status == 200 and me["is_admin"] and not me["is_operator"]

    # an admin of the default organization is no operator either in multi-tenant mode ...
    host_admin = await cli_token(saas, "host-admin@ops.example", "admin")
    assert (await call(http, saas, "GET", "/serverconfig/misc", host_admin))[0] == 403
    # ... an operator is made on the host, and may be unmade there
    operator = await cli_token(saas, "root@ops.example", "", "--operator")
    status, me = await call(http, saas, "GET", "/userinfo", operator)
    assert status == 200 and me["is_operator"] and not me["is_admin"]
    status, misc = await call(http, saas, "GET", "/serverconfig/misc", operator)
    assert status == 200 and misc["ssh_server_config"]["hosts_key"]
    status, info = await call(http, saas, "GET", "/serverinfo", operator)
    assert info["listeners"]["postgres"]["status"] == "running"
    # an admin of the operator's organization cannot take the operator's account over (password, e-mail) nor delete it
    for method, body in (("PUT", {"password": "taken-over-now"}), ("PUT", {"email": "mine@ops.example"}),
                         ("DELETE", None)):
        status, answer = await call(http, saas, method, "/users/root@ops.example", host_admin, body)
        assert status == 403 and "operator" in answer["message"], (method, answer)
    assert (await call(http, saas, "POST", "/localauth/login", None,
                       {"email": "root@ops.example", "password": "taken-over-now"}))[0] == 401
    await asyncio.to_thread(saas.cli, "user", "operator", "--email", "root@ops.example", "--revoke")
    assert (await call(http, saas, "GET", "/serverconfig/misc", operator))[0] == 403
    await asyncio.to_thread(saas.cli, "user", "operator", "--email", "host-admin@ops.example")
    assert (await call(http, saas, "GET", "/serverconfig/misc", host_admin))[0] == 200
    # an identity-provider user, named by its subject, made an operator on the host
    assert (await call(http, saas, "GET", "/serverconfig/misc", founder))[0] == 403
    await asyncio.to_thread(saas.cli, "user", "operator", "--subject", "mallory")
    assert (await call(http, saas, "GET", "/serverconfig/misc", founder))[0] == 200
    await asyncio.to_thread(saas.cli, "user", "operator", "--subject", "mallory", "--revoke")
    assert (await call(http, saas, "GET", "/serverconfig/misc", founder))[0] == 403


async def test_the_api_cannot_grant_the_operator_role(http, saas, provider):
    founder, _ = await found_org(http, saas, provider, "grabby")
    status, body = await call(http, saas, "POST", "/users", founder,
                              {"email": "crony@tenant.example", "operator": True})
    assert status == 422 and "operator" in body["message"], body
    status, me = await call(http, saas, "GET", "/userinfo", founder)
    status, body = await call(http, saas, "PUT", f"/users/{me['id']}", founder, {"operator": True})
    assert status == 422, body


# --- 6. no capture into an organization by e-mail ------------------------------------------------------------


async def test_an_org_admin_cannot_capture_a_person_by_email(http, saas, provider):
    attacker, attacker_org = await found_org(http, saas, provider, "trapper")
    status, body = await call(http, saas, "POST", "/users", attacker, {"email": "victim@corp.example"})
    assert status == 201, body

    # the victim's first sign-in, with a verified e-mail: a person of their own, in no organization yet
    victim = provider.mint("victim-sub", "victim@corp.example", "Vic", ["dev"], email_verified=True)
    status, me = await call(http, saas, "GET", "/userinfo", victim)
    assert status == 200, me
    assert me["org_id"] != attacker_org and me["org_id"] is None and me["subject"] == "victim-sub"
    status, users = await call(http, saas, "GET", "/users", attacker)
    assert "victim-sub" not in [u["subject"] for u in users]
    # the victim founds an organization of their own
    status, body = await call(http, saas, "POST", "/signup", victim, {"org_name": "victim's"})
    assert status == 201 and body["org_id"] != attacker_org


async def test_a_provider_using_emails_as_subjects_neither_captures_nor_locks_out(http, saas, provider):
    # a person whose provider subject is their e-mail signs in again and again, and founds an organization
    person = provider.mint("self@tenant.example", "self@tenant.example", "Self", None, email_verified=True)
    for _ in range(2):
        status, me = await call(http, saas, "GET", "/userinfo", person)
        assert status == 200 and me["subject"] == "self@tenant.example", me
    assert (await call(http, saas, "POST", "/signup", person, {"org_name": "self's"}))[0] == 201
    assert (await call(http, saas, "GET", "/users", person))[0] == 200

    # a user an admin created by e-mail is not taken through a subject equal to that e-mail
    attacker, attacker_org = await found_org(http, saas, provider, "subjecttrap")
    assert (await call(http, saas, "POST", "/users", attacker, {"email": "mark@corp.example"}))[0] == 201
    mark = provider.mint("mark@corp.example", "mark@corp.example", "Mark", None, email_verified=True)
    status, me = await call(http, saas, "GET", "/userinfo", mark)
    assert status == 401 or me["org_id"] != attacker_org, me


async def test_a_service_account_lives_in_its_organizations_namespace(http, saas, provider):
    """A tenant's admin made a service account of a person's provider subject before the person's first sign-in,
    and the sign-in landed in her organization with her groups; a 409 told her that another tenant's person
    existed. A tenant's service account is ``<org id>/<subject>``, and its client signs in with that ``sub``."""
    mallory, mallory_org = await found_org(http, saas, provider, "sa-mallory")
    bob, bob_org = await found_org(http, saas, provider, "sa-bob")
    status, account = await call(http, saas, "POST", "/serviceaccounts", mallory,
                                 {"subject": "sa-victim", "name": "bot", "status": "active", "groups": ["admin"]})
    assert status == 201 and account["subject"] == f"{mallory_org}/sa-victim", account
    victim = provider.mint("sa-victim", "victim@people.example", "Victim", email_verified=True)
    status, me = await call(http, saas, "GET", "/userinfo", victim)
    assert status == 200 and me["org_id"] is None and me["id"] != account["id"] and not me["is_admin"], me

    # another tenant's person or service account is not "taken": there is nothing to learn
    status, made = await call(http, saas, "POST", "/serviceaccounts", mallory, {"subject": "sa-bob", "status": "active"})
    assert status == 201 and made["subject"] == f"{mallory_org}/sa-bob", made
    status, made = await call(http, saas, "POST", "/serviceaccounts", bob, {"subject": "sa-victim", "status": "active"})
    assert status == 201 and made["subject"] == f"{bob_org}/sa-victim", made
    status, again = await call(http, saas, "POST", "/serviceaccounts", bob, {"subject": "sa-victim", "status": "active"})
    assert status == 409 and bob_org in again["message"], again  # within the organization, one account a subject
    status, me = await call(http, saas, "GET", "/userinfo", bob)
    assert status == 200 and me["org_id"] == bob_org and me["subject"] == "sa-bob"  # the person is untouched

    # the organization's client signs in with the subject in its namespace and gets the account's groups
    client = provider.mint(f"{mallory_org}/sa-victim")
    status, me = await call(http, saas, "GET", "/userinfo", client)
    assert status == 200 and (me["id"], me["org_id"], me["groups"]) == (account["id"], mallory_org, ["admin"]), me
    status, narrowed = await call(http, saas, "PUT", "/serviceaccounts/sa-victim", mallory,
                                  {"status": "active", "groups": ["readers"]})
    assert status == 200 and narrowed["id"] == account["id"], narrowed
    status, me = await call(http, saas, "GET", "/userinfo", client)
    assert status == 200 and me["groups"] == ["readers"], me


# --- 7. the founder's admin survives the provider's groups ---------------------------------------------------


async def test_a_founder_keeps_admin_when_the_token_carries_groups(http, saas, provider):
    founder, org = await found_org(http, saas, provider, "founder", groups=["dev"])
    status, me = await call(http, saas, "GET", "/userinfo", founder)  # the next request: groups are synced
    assert status == 200 and me["is_admin"] and me["groups"] == ["admin", "dev"], me
    assert (await call(http, saas, "GET", "/users", founder))[0] == 200

    # the provider still decides its own groups: dev goes, ops comes, the organization's admin stays
    moved = provider.mint("founder", "founder@tenant.example", "Founder", ["ops"], email_verified=True)
    status, me = await call(http, saas, "GET", "/userinfo", moved)
    assert me["groups"] == ["admin", "ops"] and me["org_id"] == org


# --- 8. linking by e-mail needs email_verified ---------------------------------------------------------------


async def test_an_unverified_email_does_not_take_over_an_admin(http, single, provider):
    admin = await cli_token(single, "boss@corp.example", "admin")
    for claims in ({}, {"email_verified": False}, {"email_verified": "true"}):
        impostor = provider.mint("impostor-sub", "boss@corp.example", "Impostor", None, **claims)
        assert await call(http, single, "GET", "/userinfo", impostor) == DENIED, claims
    # a provider subject that happens to be the e-mail is no way around it
    assert await call(http, single, "GET", "/userinfo",
                      provider.mint("boss@corp.example", "boss@corp.example", "Impostor", None)) == DENIED
    status, me = await call(http, single, "GET", "/userinfo", admin)
    assert status == 200 and me["subject"] == "boss@corp.example"

    # the real person, verified by the provider, claims the account
    real = provider.mint("boss-real-sub", "boss@corp.example", "Boss", None, email_verified=True)
    status, me = await call(http, single, "GET", "/userinfo", real)
    assert status == 200 and me["subject"] == "boss-real-sub" and me["is_admin"]


async def test_an_operator_may_allow_unverified_links_for_a_provider(http, provider, tmp_path):
    """auth.oidc.link_unverified_email: for a provider that lets nobody register an address they do not own."""
    daemon = Daemon(tmp_path / "data", {**_oidc(provider), "auth.oidc.link_unverified_email": True})
    await asyncio.to_thread(daemon.start)
    try:
        await cli_token(daemon, "lead@corp.example", "admin")
        token = provider.mint("lead-sub", "lead@corp.example", "Lead", None)
        status, me = await call(http, daemon, "GET", "/userinfo", token)
        assert status == 200 and me["subject"] == "lead-sub" and me["is_admin"]
        # still a one-time link: another identity with the same e-mail is refused
        assert await call(http, daemon, "GET", "/userinfo", provider.mint("other-sub", "lead@corp.example")) == DENIED
    finally:
        await asyncio.to_thread(daemon.stop)


# --- 9. a deleted user's token stays dead ---------------------------------------------------------------------


async def test_a_deleted_users_token_does_not_come_back_with_the_email(http, single):
    admin = await cli_token(single, "keeper@corp.example", "admin")
    old = await cli_token(single, "leaver@corp.example", "admin")
    assert (await call(http, single, "GET", "/users", old))[0] == 200
    assert (await call(http, single, "DELETE", "/users/leaver@corp.example", admin))[0] == 204
    assert await call(http, single, "GET", "/userinfo", old) == DENIED

    # the e-mail is reused for a new, unprivileged person: the old token still names the deleted user
    status, body = await call(http, single, "POST", "/users", admin, {"email": "leaver@corp.example"})
    assert status == 201, body
    assert await call(http, single, "GET", "/userinfo", old) == DENIED
    assert await call(http, single, "GET", "/users", old) == DENIED


# --- 10. the last active admin stays --------------------------------------------------------------------------


async def test_the_last_admin_of_an_organization_cannot_lock_it_out(http, saas, provider):
    founder, org = await found_org(http, saas, provider, "solo")
    status, me = await call(http, saas, "GET", "/userinfo", founder)
    for method, body in (("DELETE", None), ("PUT", {"groups": ["dev"]}), ("PUT", {"status": "inactive"})):
        status, answer = await call(http, saas, method, f"/users/{me['id']}", founder, body)
        assert status == 409 and "last active admin" in answer["message"], (method, body, answer)
    status, me = await call(http, saas, "GET", "/userinfo", founder)
    assert status == 200 and me["is_admin"] and me["status"] == "active"

    # nor by deleting the admin group, which would demote every admin at once
    status, answer = await call(http, saas, "DELETE", "/users/groups/admin", founder)
    assert status == 409 and "admin group" in answer["message"], answer
    assert (await call(http, saas, "GET", "/users", founder))[0] == 200

    # once another active admin exists, stepping down is allowed
    status, body = await call(http, saas, "POST", "/users", founder,
                              {"email": "deputy@tenant.example", "groups": ["admin"]})
    assert status == 201, body
    status, body = await call(http, saas, "PUT", f"/users/{me['id']}", founder, {"groups": ["dev"]})
    assert status == 200 and not body["is_admin"], body


# --- 11. e-mails are validated ----------------------------------------------------------------------------------


@pytest.mark.parametrize("email", ["", " ", "not-an-email", "a@", "@example.com", "two@at@example.com",
                                   "space @example.com", "line\n@example.com"])
async def test_malformed_emails_are_refused(http, single, email):
    admin = await cli_token(single, "validator@corp.example", "admin")
    status, body = await call(http, single, "POST", "/users", admin, {"email": email})
    assert status == 422 and body["message"].startswith("field 'email': "), body
    status, body = await call(http, single, "PUT", "/users/validator@corp.example", admin, {"email": email})
    assert status == 422, body

    result = await asyncio.to_thread(single.cli, "token", "create", "--email", email, "--groups", "admin",
                                     check=False)
    assert result.returncode == 2 and "--email" in result.stderr and not result.stdout, result
    assert "Traceback" not in result.stderr


# --- grants and deleted groups ----------------------------------------------------------------------------------


async def test_a_deleted_group_is_no_grant_any_more(tmp_path):
    """Deleting a group also withdraws it from the grants, so the next provider sync does not bring it back."""
    from gatewayd.identity import Claims
    from tests.conftest import core_gateway

    async with core_gateway(tmp_path) as gateway:
        user = await gateway.identity.sign_in(Claims("g-sub", "g@corp.example", "G", ["ops"], email_verified=True))
        user.grant_groups(["dev", "oncall"])
        await gateway.store.save_user(user)
        await gateway.store.delete_group(user.org_id, "oncall")
        user = await gateway.identity.sign_in(Claims("g-sub", "g@corp.example", "G", ["ops"], email_verified=True))
        assert (user.groups, user.granted_groups) == (["dev", "ops"], ["dev"])
        stored = await gateway.store.get_user(id=user.id)
        assert (stored.groups, stored.granted_groups, stored.federated) == (["dev", "ops"], ["dev"], True)


# --- issue 31, item 5: everything tenant-scoped is scoped ----------------------------------------------------


async def test_a_tenants_local_logins_are_in_its_own_log(http, saas, provider):
    """Every organization's local logins, success and failure with the client address, were audited in the
    default organization's log: the tenant never saw them, the operators saw every tenant's."""
    founder, org = await found_org(http, saas, provider, "logger")
    operator = await cli_token(saas, "log-root@ops.example", "admin", "--operator")
    email = "clerk@logger.example"
    assert (await call(http, saas, "POST", "/users", founder, {"email": email, "password": "clerk passphrase"}))[0] == 201
    for password, expected in (("clerk passphrase", 200), ("not the passphrase", 401)):
        status, body = await call(http, saas, "POST", "/localauth/login", None,
                                  {"email": email, "password": password, "org_id": org})
        assert status == expected, body
    status, logs = await call(http, saas, "GET", "/audit/logs?action=auth.local_login&page_size=100", founder)
    assert status == 200, logs
    mine = sorted((e["outcome"], e["org_id"], e["client_ip"]) for e in logs["data"] if e["actor_email"] == email)
    assert mine == [("failure", org, "127.0.0.1"), ("success", org, "127.0.0.1")], logs["data"]
    status, logs = await call(http, saas, "GET", f"/audit/logs?actor={email}&page_size=100", operator)
    assert status == 200 and logs["data"] == [], logs["data"]  # nothing of it in the operators' log


async def test_an_email_another_organization_holds_tells_nothing_and_is_no_squat(http, saas, provider):
    """Creating a user whose e-mail another organization held answered 409 (an oracle, and a squat: the other
    could never have that person); the host's CLI took a tenant's user for the operator's e-mail."""
    first, first_org = await found_org(http, saas, provider, "emailer-a")
    second, second_org = await found_org(http, saas, provider, "emailer-b")
    answers = []
    for founder in (first, second):
        status, made = await call(http, saas, "POST", "/users", founder,
                                  {"email": "Shared@Corp.example", "password": "the same passphrase"})
        assert status == 201, made
        answers.append(sorted(made))
    assert answers[0] == answers[1]  # the second organization is answered as the first was: nothing to tell
    status, again = await call(http, saas, "POST", "/users", second, {"email": "shared@corp.example"})
    assert status == 409  # within one organization an e-mail is still one user

    async def login(org_id: str | None, password: str = "the same passphrase") -> tuple[int, Any]:
        return await call(http, saas, "POST", "/localauth/login", None, {
            "email": "shared@corp.example", "password": password, **({"org_id": org_id} if org_id else {})})

    for org_id in (first_org, second_org):  # each organization's person signs in to their own account
        status, body = await login(org_id)
        assert status == 200, body
        status, me = await call(http, saas, "GET", "/userinfo", body["token"])
        assert me["org_id"] == org_id and me["email"] == "Shared@Corp.example"
    assert (await login(None))[0] == 401  # without its organization, an account of none

    # a tenant holding the e-mail an operator will be made with gets nothing from it
    status, made = await call(http, saas, "POST", "/users", first, {"email": "ops-next@ops.example"})
    assert status == 201
    await cli_token(saas, "ops-next@ops.example", "", "--operator")
    status, squatter = await call(http, saas, "GET", "/users/ops-next@ops.example", first)
    assert status == 200 and not squatter["is_operator"], squatter
    await asyncio.to_thread(saas.cli, "user", "operator", "--email", "ops-next@ops.example", "--revoke")
    status, squatter = await call(http, saas, "GET", "/users/ops-next@ops.example", first)
    assert status == 200 and not squatter["is_operator"]


async def test_a_tenants_http_connection_cannot_reach_the_gateways_host(http, saas, provider):
    """A tenant's HTTP connection to 127.0.0.1 read the gateway's own /metrics and /api/readyz."""
    founder, _ = await found_org(http, saas, provider, "prober")
    host_admin = await cli_token(saas, "probe-admin@ops.example", "admin")
    targets = {"metrics": f"http://127.0.0.1:{saas.metrics_port}", "readyz": f"http://localhost:{saas.api_port}/api",
               "metadata": "http://169.254.169.254/latest", "mapped": f"http://[::ffff:127.0.0.1]:{saas.api_port}/api"}
    paths = {"metrics": "/metrics", "readyz": "/readyz", "metadata": "/meta-data/", "mapped": "/readyz"}
    for name, url in targets.items():
        status, connection = await call(http, saas, "POST", "/connections", founder, {
            "name": f"probe-{name}", "type": "httpproxy", "subtype": "httpproxy",
            "secret": {"envvar:REMOTE_URL": b64(url)}})
        assert status == 201, connection
        status, cred = await call(http, saas, "POST", f"/connections/probe-{name}/credentials", founder, {})
        assert status == 201, cred
        secret = cred["connection_credentials"]["proxy_token"]
        async with http.get(f"http://127.0.0.1:{saas.http_port}{paths[name]}",
                            headers={"Authorization": secret}) as response:
            text = await response.text()
        assert response.status == 502, (name, response.status, text[:300])
        assert "gatewayd_" not in text and '"ready"' not in text and "address" in text, (name, text)
    # the operators' own organization may point at the host (its admins run it)
    status, connection = await call(http, saas, "POST", "/connections", host_admin, {
        "name": "host-metrics", "type": "httpproxy", "subtype": "httpproxy",
        "secret": {"envvar:REMOTE_URL": b64(targets["metrics"])}})
    assert status == 201, connection
    status, cred = await call(http, saas, "POST", "/connections/host-metrics/credentials", host_admin, {})
    async with http.get(f"http://127.0.0.1:{saas.http_port}/metrics",
                        headers={"Authorization": cred["connection_credentials"]["proxy_token"]}) as response:
        assert response.status == 200 and "gatewayd_" in await response.text()


async def test_a_tenants_webhook_endpoint_cannot_reach_the_gateways_host_or_network(http, saas, provider):
    """A tenant's webhook endpoint on 127.0.0.1, 169.254.169.254 or a private address was taken (201) and posted to
    (blind SSRF into the operator's network): an IP address of those kinds is refused when the endpoint is made
    (400, audited), and a name resolving to one fails its delivery at once (logged, in the delivery log), nothing
    sent. The operators' own organization may name them, as before."""
    founder, _ = await found_org(http, saas, provider, "hooker")
    status, plugin = await call(http, saas, "POST", "/plugins", founder, {"name": "webhooks"})
    assert status == 201, plugin
    kinds = {"https://127.0.0.1:1/x": "loopback", "https://169.254.169.254/latest/meta-data/": "link-local",
             "https://10.1.2.3/x": "private", "https://100.64.0.1/x": "private", "https://[fd00::1]/x": "private",
             "https://[::ffff:127.0.0.1]:1/x": "loopback"}
    for url, kind in kinds.items():
        status, body = await call(http, saas, "POST", "/webhooks/endpoints", founder, {"url": url})
        assert status == 400 and f"its host is a {kind} address" in body["message"], (url, status, body)
        assert url not in body["message"]
    status, logs = await call(http, saas, "GET", "/audit/logs?action=webhooks.create_endpoint&outcome=failure",
                              founder)
    assert status == 200 and logs["pages"]["total"] == len(kinds), logs
    # a name that resolves to loopback: taken, but its delivery is refused at the dial, once, and nothing connects
    connected: list[int] = []
    server = await asyncio.start_server(lambda r, w: (connected.append(1), w.close()), "127.0.0.1", free_port())
    port = server.sockets[0].getsockname()[1]
    try:
        status, made = await call(http, saas, "POST", "/webhooks/endpoints", founder,
                                  {"url": f"https://localhost:{port}/hook"})
        assert status == 201, made
        status, sent = await call(http, saas, "POST", "/webhooks/messages", founder, {"endpoint_id": made["id"]})
        assert status == 202 and len(sent) == 1, sent
        for _ in range(200):  # webhooks.retry_base is 5 s: a retried attempt would still be pending
            status, page = await call(http, saas, "GET", f"/webhooks/messages?endpoint_id={made['id']}", founder)
            if page["data"] and page["data"][0]["status"] != "pending":
                break
            await asyncio.sleep(0.05)
        [delivery] = page["data"]
        assert delivery["status"] == "failed" and delivery["attempts"] == 1, delivery
        assert "its host is a loopback address" in delivery["last_error"], delivery
        assert connected == [], "the tenant's webhook reached a listener on the gateway's host"
        assert any(delivery["id"] in line and "loopback address" in line for line in saas.log_text().splitlines())
    finally:
        server.close()
        await server.wait_closed()
    # the operators' organization keeps its say over the host (its admins run it)
    host_admin = await cli_token(saas, "hooks-admin@ops.example", "admin")
    status, made = await call(http, saas, "POST", "/webhooks/endpoints", host_admin, {"url": "https://127.0.0.1:1/x"})
    assert status == 201, made


def test_a_tenants_webhooks_have_their_own_allowance_of_private_addresses():
    """``tenants.allow_private_targets`` (tenants' connections on the private network) does not open it to their
    webhooks; ``tenants.allow_private_webhooks`` does, never loopback or link-local."""
    from gatewayd.config import load_config
    from gatewayd.tenancy import Tenancy
    from gatewayd.webhooks import literal_refusal

    def refusals(**settings: bool) -> list[str | None]:
        config = load_config(None, environ={}, overrides={"auth.multi_tenant": True, **settings})
        policy = Tenancy.of(config, "operators").webhook_policy
        return [literal_refusal(url, policy) for url in ("https://10.0.0.7/x", "https://127.0.0.1/x",
                                                         "https://169.254.169.254/x", "https://hooks.example/x")]

    link_local = "a link-local address"
    assert refusals(**{"tenants.allow_private_targets": True}) == [
        "a private address", "a loopback address", link_local, None]
    assert refusals(**{"tenants.allow_private_webhooks": True}) == [None, "a loopback address", link_local, None]


async def test_a_tenants_ai_provider_cannot_reach_the_gateways_host(tmp_path):
    """A tenant's AI provider URL on loopback answered up to 300 characters of internal answers into the tenant's
    recording, and worked as a port scanner: it is not dialled now (the operators' own organization's is)."""
    from gatewayd.models import AIAnalyzerRule, AIProvider, Connection, new_id
    from tests.conftest import core_gateway

    internal = await FakeLLM().start()  # a service on the gateway's host, reachable on loopback only
    try:
        async with core_gateway(tmp_path, {"auth.multi_tenant": True}) as gateway:
            tenant = await gateway.store.create_org("a tenant")
            operators = await gateway.store.default_org()
            for org in (tenant, operators):
                await gateway.store.save_ai_provider(AIProvider(
                    id=new_id(), org_id=org.id, provider="custom", model="judge-1",
                    api_url=f"http://localhost:{internal.port}/v1", api_key=internal.api_key))
            seen = {}
            for org in (tenant, operators):
                connection = Connection(id=new_id(), org_id=org.id, name="db", resource_name="db", type="database",
                                        subtype="postgres")
                rule = AIAnalyzerRule(id=new_id(), org_id=org.id, name="judge", connection_names=["db"])
                internal.requests.clear()
                _, failure = await gateway.analysis.evaluate(rule, connection, "select 1")
                seen[org.name] = (failure, len(internal.requests))
            assert seen["a tenant"][1] == 0, "the tenant's provider URL reached a service on the gateway's host"
            assert "loopback address" in seen["a tenant"][0] and "Reads data" not in seen["a tenant"][0], seen
            assert seen[operators.name] == ("", 1), seen
    finally:
        await internal.stop()
