"""OIDC mode against a real (in-process) identity provider and a real ``gatewayd run``.

Covers token verification (signature, algorithm, audience, issuer, expiry, key
rotation), sign-up and group sync, inactive users, and the browser login flow
with state and PKCE, including its audit trail.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from typing import Any, AsyncIterator, Callable
from urllib.parse import parse_qs, urlsplit

import aiohttp
import jwt
import pytest
import pytest_asyncio
from cryptography.hazmat.primitives import serialization

from tests.conftest import Daemon, write_config
from tests.oidc_provider import OIDCProvider, forge_hs256, forge_unsigned, new_rsa_key, respellings

DENIED = {"message": "access denied"}
DONE = "http://127.0.0.1:1/done"


# --- fixtures ----------------------------------------------------------------------------------------------


@pytest_asyncio.fixture(scope="module")
async def provider() -> AsyncIterator[OIDCProvider]:
    idp = await OIDCProvider().start()
    yield idp
    await idp.stop()


@pytest_asyncio.fixture(scope="module")
async def gw(provider: OIDCProvider, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Daemon]:
    """One daemon in OIDC mode. Blocking subprocess work runs in a thread: the provider shares this loop."""
    daemon = Daemon(tmp_path_factory.mktemp("oidc") / "data", {
        "auth.issuer": "oidc", "auth.oidc.issuer_url": provider.url,
        "auth.oidc.client_id": provider.client_id, "auth.oidc.client_secret": provider.client_secret,
        "auth.oidc.allowed_redirects": ["http://127.0.0.1:1"]})  # no trailing slash, as an operator may write it
    await asyncio.to_thread(daemon.start)
    yield daemon
    await asyncio.to_thread(daemon.stop)


@pytest_asyncio.fixture(scope="module")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


@pytest_asyncio.fixture(scope="module")
async def admin(gw: Daemon) -> str:
    """A local-issuer admin token from the CLI (accepted in OIDC mode too)."""
    return await asyncio.to_thread(gw.token, "ops@example.com", "admin")


# --- helpers -----------------------------------------------------------------------------------------------


async def call(http: aiohttp.ClientSession, method: str, url: str, token: str | None = None,
               **kwargs: Any) -> tuple[int, Any, Any]:
    """(status, JSON body or None, headers); never follows redirects."""
    headers = dict(kwargs.pop("headers", {}))
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    async with http.request(method, url, headers=headers, allow_redirects=False, **kwargs) as response:
        text = await response.text()
        try:
            body = json.loads(text) if text else None
        except ValueError:
            body = text
        return response.status, body, response.headers


async def userinfo(http: aiohttp.ClientSession, gw: Daemon, token: str | None) -> tuple[int, Any]:
    status, body, _ = await call(http, "GET", f"{gw.url}/userinfo", token)
    return status, body


async def user_exists(http: aiohttp.ClientSession, gw: Daemon, admin: str, email: str) -> bool:
    status, _, _ = await call(http, "GET", f"{gw.url}/users/{email}", admin)
    assert status in (200, 404)
    return status == 200


async def past_jwks_throttle(provider: OIDCProvider) -> None:
    """The daemon refetches the JWKS at most once a second; wait until a refetch is allowed."""
    await asyncio.sleep(max(0.0, provider.last_jwks_fetch + 1.1 - time.monotonic()))


async def login(http: aiohttp.ClientSession, gw: Daemon, provider: OIDCProvider,
                redirect: str = DONE) -> tuple[int, str, dict[str, str]]:
    """The browser's part of the login: /login, the provider's /authorize, then /callback.

    Returns the callback's status, its Location and the authorization request's query.
    """
    status, body, _ = await call(http, "GET", f"{gw.url}/login", params={"redirect": redirect})
    assert status == 200, body
    login_url = body["login_url"]
    assert login_url.startswith(f"{provider.url}/authorize?")
    auth_query = {k: v[0] for k, v in parse_qs(urlsplit(login_url).query).items()}

    status, body, headers = await call(http, "GET", login_url)
    assert status == 302, body
    callback = headers["Location"]
    assert callback.startswith(f"http://127.0.0.1:{gw.api_port}/api/callback?")
    assert parse_qs(urlsplit(callback).query)["state"] == [auth_query["state"]]

    status, body, headers = await call(http, "GET", callback)
    return status, headers.get("Location", ""), auth_query


# --- tokens from the provider ------------------------------------------------------------------------------


async def test_first_token_signs_the_user_up(http, gw, provider, admin):
    assert not await user_exists(http, gw, admin, "alice@example.com")
    token = provider.mint("alice-sub", "alice@example.com", "Alice Liddell", ["dev"])

    status, me = await userinfo(http, gw, token)

    assert status == 200, me
    assert (me["email"], me["name"], me["subject"]) == ("alice@example.com", "Alice Liddell", "alice-sub")
    assert me["groups"] == ["dev"] and me["status"] == "active" and me["org_id"]
    assert me["is_admin"] is False
    assert await user_exists(http, gw, admin, "alice@example.com")


async def test_groups_are_synced_at_each_authentication(http, gw, provider):
    status, me = await userinfo(http, gw, provider.mint("bob-sub", "bob@example.com", "Bob", ["dev"]))
    assert status == 200 and me["groups"] == ["dev"]

    status, me = await userinfo(http, gw, provider.mint("bob-sub", "bob@example.com", "Bob", ["ops", "dev"]))
    assert status == 200 and me["groups"] == ["dev", "ops"]

    status, me = await userinfo(http, gw, provider.mint("bob-sub", "bob@example.com", "Bob", []))
    assert status == 200 and me["groups"] == []

    # a token without the groups claim leaves the groups alone; the name still follows the token
    await userinfo(http, gw, provider.mint("bob-sub", "bob@example.com", "Bob", ["ops"]))
    status, me = await userinfo(http, gw, provider.mint("bob-sub", "bob@example.com", "Robert"))
    assert status == 200 and me["groups"] == ["ops"] and me["name"] == "Robert"


async def test_admin_group_from_the_token_grants_admin_routes(http, gw, provider):
    as_admin = provider.mint("carol-sub", "carol@example.com", "Carol", ["admin"])
    status, body, _ = await call(http, "GET", f"{gw.url}/audit/logs", as_admin)
    assert status == 200, body
    assert "data" in body

    # the same user, demoted by the identity provider, loses it at the next request
    as_user = provider.mint("carol-sub", "carol@example.com", "Carol", ["dev"])
    status, body, _ = await call(http, "GET", f"{gw.url}/audit/logs", as_user)
    assert status == 403, body


def _claims(provider: OIDCProvider, sub: str) -> dict[str, Any]:
    now = int(time.time())
    return {"iss": provider.url, "aud": provider.client_id, "sub": sub, "email": f"{sub}@example.com",
            "groups": ["admin"], "iat": now, "exp": now + 300}


def _public_pem(provider: OIDCProvider) -> bytes:
    return provider.current.private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


REFUSED: dict[str, Callable[[OIDCProvider, str], str | None]] = {
    "expired": lambda p, sub: p.mint(sub, f"{sub}@example.com", groups=["admin"], exp_delta=-3600),
    "signed by a key not in the JWKS, same kid": lambda p, sub: p.mint(
        sub, f"{sub}@example.com", groups=["admin"], key=new_rsa_key()),
    "signed by a key not in the JWKS, unknown kid": lambda p, sub: p.mint(
        sub, f"{sub}@example.com", groups=["admin"], key=new_rsa_key(), kid="not-published"),
    "alg none": lambda p, sub: forge_unsigned(_claims(p, sub)),
    "HS256 keyed with the provider's public key": lambda p, sub: forge_hs256(
        _claims(p, sub), _public_pem(p), p.current.kid),
    "wrong audience": lambda p, sub: p.mint(sub, f"{sub}@example.com", groups=["admin"], aud="another-client"),
    "wrong issuer": lambda p, sub: p.mint(sub, f"{sub}@example.com", groups=["admin"],
                                          iss="http://evil.example"),
    "provider key posing as the local issuer": lambda p, sub: p.mint(
        sub, f"{sub}@example.com", groups=["admin"], iss="gatewayd", aud="gatewayd-api"),
    "tampered payload": lambda p, sub: _tamper(p.mint(sub, f"{sub}@example.com", groups=["dev"])),
    "garbage": lambda p, sub: "not-a-jwt",
    "missing Authorization header": lambda p, sub: None,
}


def _tamper(token: str) -> str:
    """Swap the payload of a valid token for one granting admin, keeping the signature."""
    header, payload, signature = token.split(".")
    claims = jwt.decode(token, options={"verify_signature": False})
    claims["groups"] = ["admin"]
    forged = forge_unsigned(claims).split(".")[1]
    return f"{header}.{forged}.{signature}"


@pytest.mark.parametrize("case", list(REFUSED))
async def test_invalid_tokens_are_refused(http, gw, provider, admin, case):
    sub = "refused-" + "".join(c if c.isalnum() else "-" for c in case.lower())
    token = REFUSED[case](provider, sub)

    assert await userinfo(http, gw, token) == (401, DENIED)
    status, body, _ = await call(http, "GET", f"{gw.url}/audit/logs", token)
    assert (status, body) == (401, DENIED)
    assert not await user_exists(http, gw, admin, f"{sub}@example.com"), "a refused token signed the user up"

    # control: the same identity with a proper token is accepted
    status, me = await userinfo(http, gw, provider.mint(sub, f"{sub}@example.com", groups=["dev"]))
    assert status == 200 and me["subject"] == sub


async def test_key_rotation(http, gw, provider):
    old_key = provider.current
    assert (await userinfo(http, gw, provider.mint("rot-sub", "rot@example.com")))[0] == 200

    # the provider publishes a new key next to the old one and signs with it: the daemon fetches it
    await past_jwks_throttle(provider)
    fetches = provider.jwks_fetches
    new_key = provider.rotate(keep_old=True)
    assert new_key.kid != old_key.kid
    status, me = await userinfo(http, gw, provider.mint("rot-sub", "rot@example.com"))
    assert status == 200, me
    assert provider.jwks_fetches == fetches + 1
    old_token = provider.mint("rot-sub", "rot@example.com", kid=old_key.kid, key=old_key.private)
    assert (await userinfo(http, gw, old_token))[0] == 200

    # the provider retires the old key: once the daemon has refetched, old-key tokens are refused
    await past_jwks_throttle(provider)
    newest = provider.rotate(keep_old=False)
    status, me = await userinfo(http, gw, provider.mint("rot-sub", "rot@example.com"))
    assert status == 200, me
    assert provider.jwks_fetches == fetches + 2 and newest.kid != new_key.kid
    old_token = provider.mint("rot-sub", "rot@example.com", kid=old_key.kid, key=old_key.private)
    assert await userinfo(http, gw, old_token) == (401, DENIED)


async def test_inactive_user_is_refused(http, gw, provider, admin):
    email = "dora@example.com"
    token = provider.mint("dora-sub", email, "Dora", ["dev"])
    assert (await userinfo(http, gw, token))[0] == 200

    status, body, _ = await call(http, "PUT", f"{gw.url}/users/{email}", admin, json={"status": "inactive"})
    assert status == 200 and body["status"] == "inactive", body

    assert await userinfo(http, gw, token) == (401, DENIED)
    # a fresh token does not reactivate the user, nor does the browser login
    assert await userinfo(http, gw, provider.mint("dora-sub", email, "Dora", ["admin"])) == (401, DENIED)
    provider.set_user("dora-sub", email, "Dora", ["dev"])
    status, location, _ = await login(http, gw, provider)
    assert status == 401 and "token=" not in location

    status, body, _ = await call(http, "PUT", f"{gw.url}/users/{email}", admin, json={"status": "active"})
    assert status == 200, body
    assert (await userinfo(http, gw, token))[0] == 200


async def test_a_signed_out_provider_token_is_refused_in_every_spelling(http, gw, provider):
    """A provider's token signed out stays out whatever its spelling (a padded signature used to work on)."""
    token = provider.mint("leaver-sub", "leaver@example.com", "Leaver", ["dev"])
    assert (await userinfo(http, gw, token))[0] == 200
    assert [await userinfo(http, gw, other) for other in respellings(token)] == [(401, DENIED)] * 4
    status, _, _ = await call(http, "POST", f"{gw.url}/logout", token)
    assert status == 204
    for spelling in (token, *respellings(token)):
        assert await userinfo(http, gw, spelling) == (401, DENIED), spelling[-6:]


# --- the browser login flow --------------------------------------------------------------------------------


async def test_login_flow_with_pkce(http, gw, provider, admin):
    provider.set_user("erin-sub", "erin@example.com", "Erin Flow", ["dev", "ops"])
    assert not await user_exists(http, gw, admin, "erin@example.com")

    status, location, auth_query = await login(http, gw, provider, redirect=f"{DONE}?keep=1")

    assert auth_query["code_challenge_method"] == "S256" and len(auth_query["code_challenge"]) == 43
    assert auth_query["client_id"] == provider.client_id
    assert auth_query["redirect_uri"] == f"http://127.0.0.1:{gw.api_port}/api/callback"
    assert status == 302
    assert location.startswith(f"{DONE}?")
    query = parse_qs(urlsplit(location).query)
    assert query["keep"] == ["1"]
    token = query["token"][0]
    assert jwt.get_unverified_header(token)["kid"] == provider.current.kid
    assert jwt.decode(token, options={"verify_signature": False})["iss"] == provider.url
    assert not provider.codes, "the code was not exchanged"

    status, me = await userinfo(http, gw, token)
    assert status == 200, me
    assert (me["email"], me["name"], me["subject"], me["groups"]) == \
        ("erin@example.com", "Erin Flow", "erin-sub", ["dev", "ops"])


async def test_callback_refuses_unknown_state_and_replays(http, gw, provider):
    status, body, headers = await call(http, "GET", f"{gw.url}/callback",
                                       params={"code": "whatever", "state": "never-issued"})
    assert (status, body) == (401, DENIED) and "Location" not in headers

    # a real state but a code the provider never issued: the exchange fails
    status, body, _ = await call(http, "GET", f"{gw.url}/login", params={"redirect": DONE})
    state = parse_qs(urlsplit(body["login_url"]).query)["state"][0]
    status, body, _ = await call(http, "GET", f"{gw.url}/callback", params={"code": "forged", "state": state})
    assert (status, body) == (401, DENIED)

    # a completed login's callback cannot be replayed
    provider.set_user("fay-sub", "fay@example.com", "Fay", [])
    status, body, _ = await call(http, "GET", f"{gw.url}/login", params={"redirect": DONE})
    login_url = body["login_url"]
    _, _, headers = await call(http, "GET", login_url)
    callback = headers["Location"]
    assert (await call(http, "GET", callback))[0] == 302
    status, body, _ = await call(http, "GET", callback)
    assert (status, body) == (401, DENIED)
    # ... nor its state reused with a fresh, valid code (same PKCE challenge): a state is good for one login
    _, _, headers = await call(http, "GET", login_url)
    assert headers["Location"] != callback
    status, body, _ = await call(http, "GET", headers["Location"])
    assert (status, body) == (401, DENIED)

    # the provider refusing the login
    status, body, _ = await call(http, "GET", f"{gw.url}/callback", params={"error": "access_denied"})
    assert status == 401


@pytest.mark.parametrize("misbehaviour", [{"key": "rogue"}, {"aud": "another-client"}, {"exp_delta": -3600}],
                         ids=["rogue key", "wrong audience", "expired"])
async def test_callback_verifies_the_id_token(http, gw, provider, admin, misbehaviour):
    """The ID token from the token endpoint is verified like any bearer token before anyone is signed in."""
    email = f"mallory-{len(str(misbehaviour))}-{next(iter(misbehaviour))}@example.com"
    provider.set_user(email.split("@")[0], email, "Mallory", ["admin"])
    provider.id_token_options = {k: new_rsa_key() if v == "rogue" else v for k, v in misbehaviour.items()}
    try:
        status, location, _ = await login(http, gw, provider)
    finally:
        provider.id_token_options = {}
    assert status == 401 and "token=" not in location
    assert not await user_exists(http, gw, admin, email)


async def test_logins_are_audited(http, gw, provider, admin):
    provider.set_user("gus-sub", "gus@example.com", "Gus", [])
    status, _, _ = await login(http, gw, provider)
    assert status == 302
    await call(http, "GET", f"{gw.url}/callback", params={"code": "x", "state": "bogus-state"})

    status, body, _ = await call(http, "GET", f"{gw.url}/audit/logs", admin,
                                 params={"action": "auth.login", "page_size": "100"})
    assert status == 200, body
    entries = body["data"]
    assert entries and all(e["action"] == "auth.login" for e in entries)
    ok = [e for e in entries if e["actor_email"] == "gus@example.com"]
    assert len(ok) == 1 and ok[0]["outcome"] == "success" and ok[0]["actor_subject"] == "gus-sub"
    assert ok[0]["http_path"] == "/api/callback"
    assert any(e["outcome"] == "failure" and not e["actor_email"] for e in entries)


# --- fixes found while writing these tests -----------------------------------------------------------------


@pytest.mark.parametrize("redirect", ["https://evil.example/", "//evil.example/x", "http://127.0.0.1:2/done",
                                      # past the allowed prefix "http://127.0.0.1:1" as text, not as an address
                                      "http://127.0.0.1:1@evil.example/done", "http://127.0.0.1:19/done",
                                      "http://127.0.0.1:1@evil.example:1/done"])
async def test_login_refuses_redirects_that_would_leak_the_token(http, gw, redirect):
    status, body, _ = await call(http, "GET", f"{gw.url}/login", params={"redirect": redirect})
    assert status == 400 and body["message"].startswith("redirect: not an allowed address")


async def test_login_accepts_a_path_on_the_gateway_itself(http, gw, provider):
    provider.set_user("pathy-sub", "pathy@example.com", "Pathy", [])
    status, location, _ = await login(http, gw, provider, redirect="/console/?tab=1")
    assert status == 302
    assert location.startswith(f"http://127.0.0.1:{gw.api_port}/console/?tab=1&token=")


async def test_an_email_claim_cannot_take_over_another_account(http, gw, provider, admin):
    before = await asyncio.to_thread(gw.token, "boss@example.com", "admin")  # created by email, unclaimed
    claimed = provider.mint("boss-real-sub", "boss@example.com", "Boss", None, email_verified=True)
    status, me = await userinfo(http, gw, claimed)
    assert status == 200 and me["subject"] == "boss-real-sub" and me["is_admin"]  # the first claim links it
    thief = provider.mint("thief-sub", "boss@example.com", "Thief", None, email_verified=True)
    assert await userinfo(http, gw, thief) == (401, {"message": "access denied"})
    assert (await userinfo(http, gw, claimed))[0] == 200
    # the link is one-time and keeps the user: CLI tokens name the user's id, before the link and after it
    status, me = await userinfo(http, gw, before)
    assert status == 200 and me["subject"] == "boss-real-sub"
    fresh = await asyncio.to_thread(gw.token, "boss@example.com", "admin")
    status, me = await userinfo(http, gw, fresh)
    assert status == 200 and me["subject"] == "boss-real-sub"

    await asyncio.to_thread(gw.token, "unverified@example.com", "admin")
    unverified = provider.mint("sneaky-sub", "unverified@example.com", "Sneaky", None, email_verified=False)
    assert await userinfo(http, gw, unverified) == (401, {"message": "access denied"})


async def test_the_command_line_logs_in_through_the_browser(http, gw, provider, tmp_path):
    """``gatewayd login --oidc``: a loopback listener of the CLI receives the token (RFC 8252 redirect)."""
    import subprocess

    from tests.conftest import BIN

    provider.set_user("cli-sub", "cli@example.com", "Cli User", ["dev"])
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAYD_")}
    env["GATEWAYD_CLIENT_CONFIG"] = str(tmp_path / "login.json")
    process = subprocess.Popen([str(BIN / "gatewayd"), "login", "--oidc", "--no-browser", "--url",
                                gw.url.removesuffix("/api")], env=env, stderr=subprocess.PIPE, text=True)
    try:
        await asyncio.to_thread(process.stderr.readline)  # "Open this address to log in ..."
        login_url = (await asyncio.to_thread(process.stderr.readline)).strip()
        assert login_url.startswith(f"{provider.url}/authorize?")
        status, _, headers = await call(http, "GET", login_url)  # the browser, at the provider
        assert status == 302
        status, _, headers = await call(http, "GET", headers["Location"])  # back at the gateway
        assert status == 302 and headers["Location"].startswith("http://127.0.0.1:")
        async with http.get(headers["Location"]) as landing:  # the CLI's loopback page
            assert landing.status == 200 and "Logged in" in await landing.text()
        assert await asyncio.to_thread(process.wait, 30) == 0
    finally:
        if process.poll() is None:
            process.kill()
    saved = json.loads((tmp_path / "login.json").read_text())  # profiles (issue 34): the last login is the default
    status, me = await userinfo(http, gw, saved["profiles"][saved["default"]]["token"])
    assert status == 200 and me["email"] == "cli@example.com"


async def test_a_login_begun_on_one_process_completes_on_another(http, gw, provider, tmp_path_factory):
    """Workers and nodes share the store, not memory: the callback may reach another process than /login did."""
    settings = {k: v for k, v in gw.settings.items() if k not in ("api.listen", "data_dir")}
    other = Daemon(tmp_path_factory.mktemp("oidc-other") / "data", settings)
    other.settings["data_dir"] = gw.settings["data_dir"]  # the same SQLite store, as a sibling worker has
    other.settings["api.public_url"] = f"http://127.0.0.1:{gw.api_port}"  # one address in front of both
    write_config(other.config_path, other.settings)
    await asyncio.to_thread(other.start)
    try:
        provider.set_user("gus-sub", "gus@example.com", "Gus Across", ["dev"])
        status, body, _ = await call(http, "GET", f"{gw.url}/login", params={"redirect": DONE})
        assert status == 200, body
        _, _, headers = await call(http, "GET", body["login_url"])
        callback = headers["Location"].replace(f":{gw.api_port}/", f":{other.api_port}/")
        status, _, headers = await call(http, "GET", callback)
        assert status == 302 and headers["Location"].startswith(DONE), headers
        status, _, _ = await call(http, "GET", callback)  # and still once only
        assert status == 401
    finally:
        await asyncio.to_thread(other.stop)


def listening_port(pid: int) -> int:
    """The TCP port a process listens on, as any local user finds it (``ss -ltn``; here /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
            return int(fields[1].split(":")[1], 16)
    raise AssertionError(f"process {pid} listens on no TCP port")


async def test_the_command_lines_loopback_takes_no_token_but_its_logins(http, gw, provider, tmp_path):
    """The loopback listener of ``login --oidc`` took any ?token= on any path: another local user (or a web
    page) who found its port handed it their own token, and the person was logged in as them -- their
    sessions and scripts then recorded as the other's, for the other to read. Now only the answer carrying
    this login's state is taken."""
    import subprocess

    from tests.conftest import BIN

    provider.set_user("cli2-sub", "cli2@example.com", "Cli Two", ["dev"])
    planted = await asyncio.to_thread(gw.token, "mallory@example.com", "dev")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAYD_")}
    env["GATEWAYD_CLIENT_CONFIG"] = str(tmp_path / "login.json")
    process = subprocess.Popen([str(BIN / "gatewayd"), "login", "--oidc", "--no-browser", "--url",
                                gw.url.removesuffix("/api")], env=env, stderr=subprocess.PIPE, text=True)
    try:
        await asyncio.to_thread(process.stderr.readline)  # "Open this address to log in ..."
        login_url = (await asyncio.to_thread(process.stderr.readline)).strip()
        port = listening_port(process.pid)
        for path in ("/callback", "/", "/callback?state=guessed-but-wrong-state"):  # the other user's tries
            joined = "&" if "?" in path else "?"
            async with http.get(f"http://127.0.0.1:{port}{path}{joined}token={planted}") as answer:
                assert answer.status == 400
        assert process.poll() is None  # still waiting for its own answer
        _, _, headers = await call(http, "GET", login_url)  # the browser, at the provider
        _, _, headers = await call(http, "GET", headers["Location"])  # back at the gateway
        assert parse_qs(urlsplit(headers["Location"]).query)["state"]
        async with http.get(headers["Location"]) as landing:  # the CLI's loopback page
            assert landing.status == 200 and "Logged in" in await landing.text()
        assert await asyncio.to_thread(process.wait, 30) == 0
    finally:
        if process.poll() is None:
            process.kill()
    saved = json.loads((tmp_path / "login.json").read_text())
    status, me = await userinfo(http, gw, saved["profiles"][saved["default"]]["token"])
    assert status == 200 and me["email"] == "cli2@example.com"
