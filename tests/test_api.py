"""The control API of a real ``gatewayd run`` subprocess, spoken to over HTTP."""

from __future__ import annotations

import asyncio
import base64
import json
import sqlite3
import time
import uuid
from typing import Any

import aiohttp
import jwt
import pytest

from tests.conftest import Daemon
from tests.oidc_provider import respellings
from tests.openapi_check import check_answer


class Client:
    """JSON over HTTP with a bearer token; returns (status, body)."""

    def __init__(self, daemon: Daemon, http: aiohttp.ClientSession) -> None:
        self.daemon = daemon
        self.http = http

    async def __call__(self, method: str, path: str, token: str | None = None, body: Any = None,
                       raw: bytes | None = None) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if raw is not None:
            headers["Content-Type"] = "application/json"
        async with self.http.request(method, self.daemon.url + path, headers=headers, data=raw,
                                     json=body if raw is None else None, allow_redirects=False) as response:
            text = await response.text()
            data = json.loads(text) if text else None
            check_answer(self.daemon.url, method, path, response.status, data)
            return response.status, data


@pytest.fixture
async def api(daemon):
    async with aiohttp.ClientSession() as http:
        yield Client(daemon, http)


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


PG_SECRET = {"envvar:HOST": b64("127.0.0.1"), "envvar:PORT": b64("5432"), "envvar:USER": b64("app"),
             "envvar:PASS": b64("pg-target-password-42"), "envvar:DB": b64("appdb")}
PG_SECRET_SHOWN = {**PG_SECRET, "envvar:PASS": "[REDACTED]"}  # what an admin reads back: never the password


async def make_resource(api: Client, token: str, subtype: str = "postgres") -> tuple[str, str]:
    name = unique("res")
    role = unique("role")
    status, body = await api("POST", "/resources", token, {
        "name": name, "type": "database", "subtype": subtype, "env_vars": {"team": "data"},
        "roles": [{"name": role, "type": "database", "subtype": subtype, "secret": PG_SECRET}]})
    assert status == 201, body
    return name, role


# ------------------------------------------------------------------ basics


async def test_health_needs_no_auth_and_everything_else_does(api):
    assert await api("GET", "/healthz") == (200, {"status": "ok"})
    for path in ("/sessions", "/userinfo", "/connections", "/guardrails", "/audit/logs", "/serverinfo"):
        assert await api("GET", path) == (401, {"message": "access denied"}), path
    assert await api("GET", "/userinfo", "not-a-token") == (401, {"message": "access denied"})


async def test_every_401_names_the_bearer_scheme(api, daemon):
    """RFC 7235: a 401 carries a challenge; the API's is ``Bearer`` (no token, a bad one, a refused login)."""
    for headers, method, path, body in (({}, "GET", "/sessions", None),
                                        ({"Authorization": "Bearer not-a-token"}, "GET", "/userinfo", None),
                                        ({"Authorization": "Basic dXNlcjpwdw=="}, "GET", "/connections", None),
                                        ({}, "POST", "/localauth/login", {"email": "no@example.com",
                                                                          "password": "not the password"})):
        async with api.http.request(method, daemon.url + path, headers=headers, json=body) as response:
            assert response.status == 401, path
            assert response.headers.get("WWW-Authenticate", "").startswith("Bearer"), (path, response.headers)


async def test_the_openapi_document_states_the_password_length_the_api_enforces(api, admin_token):
    status, doc = await api("GET", "/openapi.json")
    schemas = doc["components"]["schemas"]
    for name in ("UserCreate", "UserUpdate"):
        assert schemas[name]["properties"]["password"]["minLength"] == 8, schemas[name]
    email = f"{unique('short')}@example.com"
    status, body = await api("POST", "/users", admin_token, {"email": email, "password": "seven77"})
    assert status == 422 and "at least 8 characters" in body["message"], body
    assert (await api("POST", "/users", admin_token, {"email": email, "password": "eight888"}))[0] == 201


async def test_unknown_routes_and_methods_answer_json(api, admin_token):
    assert await api("GET", "/no/such/route", admin_token) == (404, {"message": "not found"})
    assert (await api("GET", "/../../etc/passwd"))[0] == 404
    status, body = await api("PATCH", "/healthz")
    assert status == 405 and body == {"message": "method not allowed"}


async def test_openapi_documents_every_registered_route(api, daemon):
    from control.app import make_app
    from gatewayd.config import load_config
    from gatewayd.daemon import Gateway

    status, doc = await api("GET", "/openapi.json")
    assert status == 200 and doc["openapi"].startswith("3.1")
    root = make_app(Gateway(load_config(None, environ={})).services())
    api_app = next(r._app for r in root.router.resources() if hasattr(r, "_app"))
    registered = {(route.method.lower(), route.resource.canonical)
                  for route in api_app.router.routes() if route.method != "HEAD"}
    documented = {(method, path) for path, ops in doc["paths"].items() for method in ops}
    assert registered == documented
    assert len(registered) >= 35
    create = doc["paths"]["/api/guardrails"]["post"]
    schema = doc["components"]["schemas"][create["requestBody"]["content"]["application/json"]["schema"]["$ref"]
                                          .rsplit("/", 1)[1]]
    assert schema["required"] == ["name"] and "connection_ids" in schema["properties"]


@pytest.mark.parametrize("raw, status, message", [
    (b"{not json", 400, "malformed JSON body"),
    (b"[1, 2]", 400, "body: expected a JSON object"),
    (b'{"type": "database"}', 400, "field 'name' is required"),
    (b'{"name": 5, "type": "database"}', 422, "field 'name': expected string, got int"),
    (b'{"name": "x", "type": "database", "colour": "red"}', 422, "unknown field 'colour'"),
    (b'{"name": "x", "type": "database", "roles": [{"name": "r"}]}', 400, "field 'roles[0].type' is required"),
    (b'{"name": "x", "type": "database", "roles": [{"name": "r", "type": "t", "secret": {"k": 1}}]}', 422,
     "field 'roles[0].secret': keys and values must be strings (\"envvar:KEY\": base64)"),
])
async def test_bad_bodies_get_a_clear_message(api, admin_token, raw, status, message):
    assert await api("POST", "/resources", admin_token, raw=raw) == (status, {"message": message})


async def _targets(api: Client, token: str) -> dict[str, str]:
    """Path parameter values naming real objects, so that each route reaches its body."""
    resource, role = await make_resource(api, token)
    status, rule = await api("POST", "/guardrails", token, {"name": unique("gr")})
    assert status == 201, rule
    name = unique("rule")
    status, body = await api("POST", "/access-requests/rules", token, {
        "name": name, "access_type": "jit", "reviewers_groups": ["admin"]})
    assert status == 201, body
    return {"/users/{id}": "admin@example.com", "/resources/{name}": resource, "/connections/{name}": role,
            "/guardrails/{id}": rule["id"], "/access-requests/rules/{name}": name}


async def test_deeply_nested_json_is_a_400_on_every_route_with_a_body(api, admin_token):
    status, doc = await api("GET", "/openapi.json")
    targets = await _targets(api, admin_token)
    checked = []
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            if "requestBody" not in operation:
                continue
            route = path.removeprefix("/api")
            for template, value in targets.items():
                route = route.replace(template, template.split("{")[0] + value)
            for raw in (b"[" * 50_000, b'{"a":' * 100 + b"1" + b"}" * 100, b"[" * 33 + b"]" * 33):
                status, body = await api(method.upper(), route, admin_token, raw=raw)
                if "{" in route:  # a review of nothing: no such object, before any body is read
                    assert status == 404, (method, route, status, body)
                    continue
                if route == "/signup":  # refused outside multi-tenant mode before any body is read
                    assert status == 403, body
                    continue
                assert (status, body) == (400, {"message": "malformed JSON body: nested deeper than 32 levels"}), \
                    (method, route)
            checked.append((method, route))
    assert ("post", "/localauth/login") in checked and len(checked) >= 18, checked
    # 32 levels are still a body (a free-form object may nest)
    nested: dict = {}
    for _ in range(30):
        nested = {"k": nested}
    status, body = await api("POST", "/resources", admin_token, {"name": unique("deep"), "type": "database",
                                                                  "env_vars": nested})
    assert status == 201, body


@pytest.mark.parametrize("path", [
    "/sessions?offset=18446744073709551616", "/sessions?limit=18446744073709551616",
    "/sessions?offset=-1", "/audit/logs?page=18446744073709551616", "/audit/logs?page_size=9223372036854775808",
    "/reviews?offset=18446744073709551616", "/reviews?limit=-18446744073709551616",
    "/sessions/x/rdp-frames?offset=18446744073709551616", "/sessions?offset=1e3",
])
async def test_huge_integers_in_query_parameters_are_a_422(api, admin_token, path):
    status, body = await api("GET", path, admin_token)
    name = path.split("?")[1].split("=")[0]
    assert status == 422 and body["message"].startswith(f"query parameter '{name}': "), (status, body)


async def test_huge_integers_in_bodies_and_paths_are_refused(api, admin_token):
    big = 2**64
    for field in ("min_approvals", "access_max_duration"):
        status, body = await api("POST", "/access-requests/rules", admin_token, {
            "name": unique("rule"), "access_type": "jit", "reviewers_groups": ["admin"], field: big})
        assert (status, body) == (422, {"message": f"field '{field}': must be "
                                        f"{1000 if field == 'min_approvals' else 316224000} or less"})
    _, role = await make_resource(api, admin_token)
    status, body = await api("POST", f"/connections/{role}/credentials", admin_token,
                             {"access_duration_seconds": big})
    assert status == 422, body
    status, body = await api("GET", f"/sessions/x/rdp-frames/{big}.png", admin_token)
    assert (status, body) == (400, {"message": "index: must be 9223372036854775807 or less"})


def _integers(node: object, where: str = "") -> list[tuple[str, dict]]:
    if isinstance(node, dict):
        found = [(where, node)] if node.get("type") == "integer" else []
        for key, value in node.items():
            found += _integers(value, f"{where}/{key}")
        return found
    if isinstance(node, list):
        return [hit for index, item in enumerate(node) for hit in _integers(item, f"{where}/{index}")]
    return []


async def test_openapi_bounds_every_integer_and_describes_every_answer(api):
    status, doc = await api("GET", "/openapi.json")
    integers = _integers(doc)
    assert len(integers) > 20
    for where, schema in integers:
        assert isinstance(schema.get("minimum"), int) and isinstance(schema.get("maximum"), int), where
        assert -2**63 <= schema["minimum"] <= schema["maximum"] <= 2**63 - 1, where
    rule = doc["components"]["schemas"]["AccessRequestRule"]["properties"]
    assert rule["reviewers_groups"]["minItems"] == 1 and rule["min_approvals"]["anyOf"][0]["maximum"] == 1000
    params = {p["name"]: p["schema"] for p in doc["paths"]["/api/audit/logs"]["get"]["parameters"]}
    assert params["page_size"] == {"type": "integer", "minimum": 1, "maximum": 100}
    assert params["outcome"] == {"type": "string", "enum": ["success", "failure"]}
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            answers = {k: v for k, v in operation["responses"].items() if k != "default"}
            for status, answer in answers.items():
                if status in ("204", "302"):
                    assert "content" not in answer, (method, path)
                elif path.endswith(".png"):
                    assert list(answer["content"]) == ["image/png"], (method, path)
                elif path.endswith("/stream") and "event" in operation["summary"]:  # a live session (issue 34)
                    assert list(answer["content"]) == ["text/event-stream"], (method, path)
                elif "/download" in path or path.endswith("/result/stream"):  # files and text (issue 35, item 5)
                    assert answer["content"] and "application/json" not in answer["content"], (method, path)
                else:
                    assert answer["content"]["application/json"]["schema"], (method, path, status)
    user = doc["components"]["schemas"]["User"]
    assert user["additionalProperties"] is False and "is_admin" in user["required"]


# ------------------------------------------------------------------ identity


async def test_userinfo_and_serverinfo(api, admin_token, user_token):
    status, me = await api("GET", "/userinfo", admin_token)
    assert status == 200 and me["email"] == "admin@example.com" and me["is_admin"] and me["groups"] == ["admin"]
    assert me["name"] == "Ada Admin" and me["tenancy_type"] == "selfhosted"
    status, info = await api("GET", "/serverinfo", user_token)
    assert status == 200 and info["auth_method"] == "local" and info["version"] == "0.1.0"
    assert "listeners" not in info
    status, info = await api("GET", "/serverinfo", admin_token)
    assert set(info["listeners"]) == {"postgres", "ssh", "rdp", "http", "mysql"}


async def test_local_login_with_a_password_set_by_an_admin(api, admin_token):
    email = f"{unique('pw')}@example.com"
    status, user = await api("POST", "/users", admin_token, {"email": email, "name": "Pat", "groups": ["dev"],
                                                             "password": "a long passphrase"})
    assert status == 201 and user["groups"] == ["dev"] and "password" not in json.dumps(user)
    assert (await api("POST", "/users", admin_token, {"email": email}))[0] == 409
    status, body = await api("POST", "/localauth/login", body={"email": email, "password": "a long passphrase"})
    assert status == 200
    token = body["token"]
    status, me = await api("GET", "/userinfo", token)
    assert me["email"] == email and me["groups"] == ["dev"]
    assert await api("POST", "/localauth/login", body={"email": email, "password": "wrong"}) == \
        (401, {"message": "access denied"})
    # an inactive user is refused even with a token that has not expired
    status, _ = await api("PUT", f"/users/{email}", admin_token, {"status": "inactive"})
    assert status == 200
    assert await api("GET", "/userinfo", token) == (401, {"message": "access denied"})
    assert (await api("POST", "/localauth/login", body={"email": email, "password": "a long passphrase"}))[0] == 401
    status, logs = await api("GET", f"/audit/logs?action=auth.local_login&actor={email}", admin_token)
    outcomes = sorted(e["outcome"] for e in logs["data"])
    assert outcomes == ["failure", "failure", "success"]
    assert all(e["request_payload_redacted"]["password"] == "[REDACTED]" for e in logs["data"])


async def _user_with_password(api, admin_token: str, password: str):
    """A new user with ``password``, and a function that logs in as them with a password (their token)."""
    email = f"{unique('out')}@example.com"
    assert (await api("POST", "/users", admin_token, {"email": email, "password": password}))[0] == 201

    async def login(password: str) -> str:
        status, body = await api("POST", "/localauth/login", body={"email": email, "password": password})
        assert status == 200, body
        return body["token"]

    return email, login


async def test_sign_out_ends_the_token_at_the_gateway(api, admin_token):
    """Issue 31, item 8: a token stayed valid after its sign-out."""
    email, login = await _user_with_password(api, admin_token, "first passphrase")
    leaving, staying = await login("first passphrase"), await login("first passphrase")
    assert (await api("POST", "/logout", leaving))[0] == 204
    assert await api("GET", "/userinfo", leaving) == (401, {"message": "access denied"})
    assert await api("POST", "/logout", leaving) == (401, {"message": "access denied"})
    assert (await api("GET", "/userinfo", staying))[0] == 200  # only the token signed out
    status, logs = await api("GET", f"/audit/logs?action=auth.logout&actor={email}", admin_token)
    assert [e["outcome"] for e in logs["data"]] == ["success"]  # the refused second one names no user


async def test_a_signed_out_token_is_refused_in_every_spelling(api, daemon):
    """A sign-out (``POST /logout``, or ``/token/refresh`` of a longer-lived token) holds for every spelling of the
    token: a padded signature, which PyJWT takes, was hashed apart from the one signed out and still worked. Only
    the canonical spelling is taken, even of a token in force."""
    for leave in ("/logout", "/token/refresh"):
        token = daemon.token(f"{unique('leaver')}@example.com")
        assert [await api("GET", "/userinfo", other) for other in respellings(token)] == [(401, {"message": "access denied"})] * 4
        assert (await api("POST", leave, token))[0] in (200, 204)
        for spelling in (token, *respellings(token)):
            assert await api("GET", "/userinfo", spelling) == (401, {"message": "access denied"}), (leave, spelling[-6:])


def test_a_sign_out_is_kept_under_what_the_signature_covers():
    """The second guard: whatever spelling ``authenticate`` were to let through, the sign-out's name is the same."""
    from gatewayd.identity import _revoked_key, is_compact

    token = jwt.encode({"sub": "u", "iat": 0, "exp": 60}, "k" * 32, algorithm="HS256")
    assert is_compact(token) and not any(is_compact(other) for other in respellings(token))
    assert {_revoked_key(other, {"iat": 0, "exp": 60}) for other in respellings(token)} == {
        _revoked_key(token, {"iat": 0, "exp": 60})}


async def test_a_token_taken_before_is_refused_from_its_expiry_on(api, daemon):
    """A token verified once is taken again without its signature checked (identity.LocalIssuer.verify), never past
    its expiry: the third request, after it, is refused as an unknown token would be."""
    token = daemon.token(f"{unique('brief')}@example.com", ttl="2s")
    expiry = jwt.decode(token, options={"verify_signature": False})["exp"]
    assert (await api("GET", "/userinfo", token))[0] == 200
    assert (await api("GET", "/userinfo", token))[0] == 200  # the remembered verification
    while time.time() < int(expiry) + 0.05:
        await asyncio.sleep(0.1)
    assert await api("GET", "/userinfo", token) == (401, {"message": "access denied"})


def test_a_remembered_token_is_one_verified_and_the_memory_is_bounded(monkeypatch):
    """Only a token whose signature verified is remembered (by its hash), a tampered one never; past
    ``VERIFIED_CAP`` tokens the memory starts over."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from gatewayd import identity
    from gatewayd.models import User

    monkeypatch.setattr(identity, "VERIFIED_CAP", 3)
    issuer, other = identity.LocalIssuer(Ed25519PrivateKey.generate(), "k1"), \
        identity.LocalIssuer(Ed25519PrivateKey.generate(), "k2")
    user = User(id="u1", org_id="o", subject="s", email="a@example.com")
    token = issuer.issue(user, 60)
    assert issuer.verify(token)["sub"] == "u1" and issuer.remembers(token)
    assert not [key for key in issuer._verified if token in repr(key)]  # its hash, not the bearer secret itself
    assert issuer.verify(token) == issuer.verify(token)
    forged = other.issue(user, 60)  # the same claims signed by another key
    for _ in range(2):
        with pytest.raises(identity.AuthError):
            issuer.verify(forged)
        assert not issuer.remembers(forged)
    head, claims, signature = token.split(".")
    with pytest.raises(identity.AuthError):
        issuer.verify(f"{head}.{claims}.{signature[:-4]}AAAA")
    for _ in range(5):
        issuer.verify(issuer.issue(user, 60))
        assert len(issuer._verified) <= 3


async def test_a_password_change_ends_the_users_tokens(api, daemon, admin_token):
    """Issue 31, item 8: a token stayed valid after its user's password changed."""
    email, login = await _user_with_password(api, admin_token, "first passphrase")
    one, two = await login("first passphrase"), await login("first passphrase")
    # a change of anything else ends nothing
    assert (await api("PUT", f"/users/{email}", admin_token, {"name": "Renamed"}))[0] == 200
    assert (await api("GET", "/userinfo", one))[0] == 200
    # an admin sets a new password: every token of the user ends, a login with the new one works
    status, body = await api("PUT", f"/users/{email}", admin_token, {"password": "second passphrase"})
    assert status == 200, body
    for token in (one, two):
        assert await api("GET", "/userinfo", token) == (401, {"message": "access denied"})
    fresh = await login("second passphrase")
    assert (await api("GET", "/userinfo", fresh))[0] == 200
    # and the host's `gatewayd user passwd` ends them too
    daemon.cli("user", "passwd", "--email", email, "--password-stdin", input="third passphrase\n")
    assert await api("GET", "/userinfo", fresh) == (401, {"message": "access denied"})
    assert (await api("GET", "/userinfo", await login("third passphrase")))[0] == 200


async def test_users_and_groups_are_admin_only(api, admin_token, user_token):
    assert await api("GET", "/users", user_token) == (403, {"message": "access denied: this requires the admin group"})
    group = unique("grp")
    assert await api("POST", "/users/groups", admin_token, {"name": group}) == (201, {"name": group})
    assert (await api("POST", "/users/groups", admin_token, {"name": group}))[0] == 409
    assert group in (await api("GET", "/users/groups", admin_token))[1]
    assert (await api("DELETE", f"/users/groups/{group}", admin_token))[0] == 204
    assert (await api("DELETE", f"/users/groups/{group}", admin_token))[0] == 404
    status, users = await api("GET", "/users", admin_token)
    assert "admin@example.com" in [u["email"] for u in users]
    assert (await api("GET", "/users/nobody@example.com", admin_token))[0] == 404


async def test_signup_is_refused_outside_multi_tenant_mode(api, user_token):
    assert await api("POST", "/signup", user_token, {"org_name": "acme"}) == \
        (403, {"message": "signup is only available in multi-tenant mode"})


# ------------------------------------------------------------------ resources and connections


async def test_resource_crud_and_roles_as_connections(api, admin_token, user_token):
    name, role = await make_resource(api, admin_token)
    assert (await api("POST", "/resources", admin_token, {"name": name, "type": "database"}))[0] == 409
    status, res = await api("GET", f"/resources/{name}", admin_token)
    assert status == 200 and res["subtype"] == "postgres" and res["env_vars"] == {"team": "data"}
    assert [r["name"] for r in res["roles"]] == [role]
    status, conn = await api("GET", f"/connections/{role}", admin_token)
    assert conn["resource_name"] == name and conn["secret"] == PG_SECRET_SHOWN
    status, by_id = await api("GET", f"/connections/{conn['id']}", admin_token)
    assert by_id["name"] == role

    status, updated = await api("PUT", f"/resources/{name}", admin_token, {
        "name": name, "type": "database", "agent_id": "agent-1", "env_vars": {},
        "roles": [{"name": role, "type": "database", "subtype": "postgres"},
                  {"name": role + "-ro", "type": "database", "subtype": "postgres", "secret": PG_SECRET}]})
    assert status == 200 and "roles" not in updated and updated["agent_id"] == "agent-1"
    assert set(updated) == {"id", "name", "type", "subtype", "agent_id", "env_vars", "created_at", "updated_at"}
    status, kept = await api("GET", f"/connections/{role}", admin_token)
    assert kept["id"] == conn["id"] and kept["secret"] == PG_SECRET_SHOWN  # same connection, secret kept
    assert (await api("GET", f"/connections/{role}-ro", admin_token))[0] == 200

    assert (await api("PUT", f"/resources/{name}", user_token, {"name": name, "type": "database"}))[0] == 403
    assert (await api("PUT", "/resources/nope", admin_token, {"name": "nope", "type": "database"}))[0] == 404
    assert (await api("DELETE", f"/resources/{name}", admin_token))[0] == 204
    assert (await api("GET", f"/connections/{role}", admin_token))[0] == 404
    assert await api("GET", f"/resources/{name}", admin_token) == (404, {"message": f"resource {name!r} not found"})


async def test_connection_crud(api, admin_token):
    name = unique("conn")
    body = {"name": name, "type": "custom", "subtype": "ssh", "secret": {"envvar:HOST": b64("10.0.0.1")},
            "tags": {"env": "prod"}}
    status, conn = await api("POST", "/connections", admin_token, body)
    assert status == 201 and conn["tags"] == {"env": "prod"} and conn["resource_name"] == name
    assert (await api("POST", "/connections", admin_token, body))[0] == 409
    status, conn = await api("PUT", f"/connections/{name}", admin_token, {**body, "command": ["bash"]})
    assert status == 200 and conn["command"] == ["bash"]
    assert name in [c["name"] for c in (await api("GET", "/connections", admin_token))[1]]
    assert (await api("DELETE", f"/connections/{name}", admin_token))[0] == 204
    assert (await api("DELETE", f"/connections/{name}", admin_token))[0] == 404


async def test_secrets_never_reach_non_admins_nor_the_audit_log(api, daemon, admin_token, user_token):
    name, role = await make_resource(api, admin_token)
    status, conns = await api("GET", "/connections", user_token)
    assert status == 200 and all("secret" not in c for c in conns)
    status, res = await api("GET", f"/resources/{name}", user_token)
    assert all("secret" not in r for r in res["roles"])
    status, logs = await api("GET", "/audit/logs?resource_type=resources&action=resources.create", admin_token)
    entry = next(e for e in logs["data"] if e["request_payload_redacted"]["name"] == name)
    assert entry["request_payload_redacted"]["roles"][0]["secret"] == {k: "[REDACTED]" for k in PG_SECRET}
    assert PG_SECRET["envvar:PASS"] not in json.dumps(logs)
    # and the store holds the role secret only sealed
    db = (daemon.data_dir / "gatewayd.db").read_bytes() + (daemon.data_dir / "gatewayd.db-wal").read_bytes()
    assert b"pg-target-password-42" not in db and PG_SECRET["envvar:PASS"].encode() not in db


PRIVATE_KEY = ("-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW\n"
               "-----END OPENSSH PRIVATE KEY-----\n")


async def test_no_answer_carries_a_target_password_or_private_key(api, admin_token):
    """Issue 31, item 10: POST /connections echoed the private key it was given (and GET showed it again)."""
    name = unique("keyed")
    secret = {"envvar:HOST": b64("10.0.0.7"), "envvar:USER": b64("deploy"), "envvar:PRIVATE_KEY": b64(PRIVATE_KEY),
              "envvar:PASS": b64("ssh-password-77"), "envvar:REMOTE_URL": b64("https://bob:url-password@app.example")}
    status, made = await api("POST", "/connections", admin_token,
                             {"name": name, "type": "custom", "subtype": "ssh", "secret": secret})
    assert status == 201, made
    shown = {"envvar:HOST": b64("10.0.0.7"), "envvar:USER": b64("deploy"), "envvar:PRIVATE_KEY": "[REDACTED]",
             "envvar:PASS": "[REDACTED]", "envvar:REMOTE_URL": "[REDACTED]"}
    assert made["secret"] == shown
    answers = [made]
    for method, path in (("GET", f"/connections/{name}"), ("GET", "/connections")):
        status, body = await api(method, path, admin_token)
        assert status == 200
        answers.append(body)
    # sent back as read (the console's edit, a script's GET-then-PUT), the stored values are kept ...
    status, updated = await api("PUT", f"/connections/{name}", admin_token,
                                {**{k: made[k] for k in ("name", "type", "subtype")}, "secret": made["secret"],
                                 "tags": {"edited": "yes"}})
    assert status == 200 and updated["secret"] == shown and updated["tags"] == {"edited": "yes"}, updated
    answers.append(updated)
    for body in answers:
        text = json.dumps(body)
        for value in (PRIVATE_KEY, "ssh-password-77", "url-password"):
            assert b64(value) not in text and value not in text
    # ... and [REDACTED] where nothing is stored is no value
    status, body = await api("PUT", f"/connections/{name}", admin_token, {
        **{k: made[k] for k in ("name", "type", "subtype")}, "secret": {**made["secret"], "envvar:DB": "[REDACTED]"}})
    assert status == 422 and "envvar:DB" in body["message"], body


async def test_credentials_for_native_access(api, daemon, admin_token, user_token):
    _, role = await make_resource(api, admin_token)
    status, cred = await api("POST", f"/connections/{role}/credentials", user_token, {"access_duration_seconds": 900})
    assert status == 201, cred
    assert cred["connection_name"] == role and cred["connection_type"] == "database"
    assert cred["connection_subtype"] == "postgres" and cred["session_id"] and cred["expire_at"] > cred["created_at"]
    access = cred["connection_credentials"]
    secret = access["username"]
    assert secret.startswith("pg-") and len(secret) == 3 + 43
    # the test daemon runs without a postgres listener, so the advertised port is 0
    assert access["database_name"] == "appdb" and access["hostname"] == "127.0.0.1"
    assert access["connection_string"] == f"postgres://{secret}:any@127.0.0.1:{access['port']}/appdb?sslmode=prefer"
    # stored only as its SHA-256
    with sqlite3.connect(daemon.data_dir / "gatewayd.db") as db:
        rows = db.execute("SELECT secret_hash FROM credentials WHERE id = ?", (cred["id"],)).fetchall()
    import hashlib

    assert rows == [(hashlib.sha256(secret.encode()).hexdigest(),)]
    raw = b"".join(p.read_bytes() for p in daemon.data_dir.glob("gatewayd.db*"))
    assert secret.encode() not in raw
    # the audit entry does not carry the secret
    status, logs = await api("GET", "/audit/logs?resource_type=credentials", admin_token)
    assert secret not in json.dumps(logs) and logs["data"][0]["http_status"] == 201
    # the session it opens is ready, owned by the user
    status, session = await api("GET", f"/sessions/{cred['session_id']}", user_token)
    assert status == 200 and session["status"] == "ready" and session["user"] == "user@example.com"
    status, body = await api("POST", f"/connections/{role}/credentials", user_token, {"access_duration_seconds": 0})
    assert (status, body["message"]) == (422, "field 'access_duration_seconds': must be 1 or more")
    status, body = await api("POST", f"/connections/{role}/credentials", user_token,
                             {"access_duration_seconds": 48 * 3600 + 1})
    assert status == 422 and "between 1 and 172800" in body["message"]
    assert (await api("POST", "/connections/nope/credentials", user_token, {}))[0] == 404


# ------------------------------------------------------------------ guard rails


async def test_guardrail_crud_and_validation(api, admin_token, user_token):
    _, role = await make_resource(api, admin_token)
    _, conn = await api("GET", f"/connections/{role}", admin_token)
    name = unique("rail")
    body = {"name": name, "description": "no drops", "connection_ids": [conn["id"]],
            "input": {"rules": [{"type": "deny_words_list", "words": ["drop table"]}]},
            "output": {"rules": [{"type": "pattern_match", "pattern_regex": r"\d{16}"}]}}
    status, rail = await api("POST", "/guardrails", admin_token, body)
    assert status == 201 and rail["connection_ids"] == [conn["id"]] and rail["created_at"] and rail["id"]
    assert (await api("POST", "/guardrails", admin_token, body))[0] == 409
    assert await api("POST", "/guardrails", admin_token, {**body, "name": ""}) == \
        (400, {"message": "field 'name' is required"})
    status, err = await api("POST", "/guardrails", admin_token, {
        **body, "name": unique("bad"), "input": {"rules": [{"type": "pattern_match", "pattern_regex": "(x"}]}})
    assert status == 400 and "invalid regular expression" in err["message"]
    assert (await api("POST", "/guardrails", user_token, {**body, "name": unique("u")}))[0] == 403

    status, put = await api("PUT", f"/guardrails/{rail['id']}", admin_token, {**body, "connection_ids": []})
    assert status == 200 and put["connection_ids"] == [] and put["id"] == rail["id"]
    assert (await api("PUT", f"/guardrails/{uuid.uuid4()}", admin_token, body))[0] == 404
    assert rail["id"] in [r["id"] for r in (await api("GET", "/guardrails", user_token))[1]]
    assert (await api("GET", f"/guardrails/{rail['id']}", admin_token))[1]["description"] == "no drops"
    assert (await api("DELETE", f"/guardrails/{rail['id']}", admin_token))[0] == 204
    assert (await api("GET", f"/guardrails/{rail['id']}", admin_token))[0] == 404


async def test_a_rule_its_connections_language_cannot_evaluate_is_refused(api, admin_token):
    """Never a silent fallback: statement rules on a shell connection, any rule on an RDP one, are a 422."""
    _, pg = await make_resource(api, admin_token)
    _, ssh = await make_resource(api, admin_token, subtype="ssh")
    _, rdp = await make_resource(api, admin_token, subtype="rdp")
    ids = {}
    for role in (pg, ssh, rdp):
        ids[role] = (await api("GET", f"/connections/{role}", admin_token))[1]["id"]
    statements = {"rules": [{"type": "require_where", "statements": ["delete"]}]}
    words = {"rules": [{"type": "deny_words_list", "words": ["rm -rf"]}]}
    status, _ = await api("POST", "/guardrails", admin_token, {"name": unique("sql"), "connection_ids": [ids[pg]],
                                                               "input": statements})
    assert status == 201
    status, err = await api("POST", "/guardrails", admin_token, {
        "name": unique("sql"), "connection_ids": [ids[pg], ids[ssh]], "input": statements})
    assert status == 422 and f"connection {ssh!r} cannot apply input.rules[0]: require_where reads SQL statements" \
        in err["message"] and "shell commands" in err["message"], err
    status, rail = await api("POST", "/guardrails", admin_token, {"name": unique("sh"), "connection_ids": [ids[ssh]],
                                                                  "input": words})
    assert status == 201
    status, err = await api("PUT", f"/guardrails/{rail['id']}", admin_token, {
        "name": rail["name"], "connection_ids": [ids[ssh], ids[rdp]], "input": words})
    assert status == 422 and "key strokes and screen updates" in err["message"], err
    status, err = await api("POST", "/datamasking-rules", admin_token, {
        "name": unique("dm"), "connection_ids": [ids[rdp]],
        "supported_entity_types": [{"name": "PII", "entity_types": ["EMAIL_ADDRESS"]}]})
    assert status == 422 and f"connection {rdp!r} cannot apply output.rules[0]" in err["message"], err


# ------------------------------------------------------------------ sessions


async def test_session_list_filters_visibility_and_paging(api, daemon, admin_token, user_token, auditor_token):
    _, role = await make_resource(api, admin_token)
    other_token = daemon.token("other@example.com", groups="")
    for token in (user_token, user_token, other_token):
        assert (await api("POST", f"/connections/{role}/credentials", token, {}))[0] == 201

    status, mine = await api("GET", f"/sessions?connection={role}", user_token)
    assert status == 200 and mine["total"] == 2 and {s["user"] for s in mine["data"]} == {"user@example.com"}
    assert "event_stream" not in mine["data"][0]
    status, everyone = await api("GET", f"/sessions?connection={role}", auditor_token)
    assert everyone["total"] == 3
    status, theirs = await api("GET", f"/sessions?connection={role}&user=other@example.com", admin_token)
    assert theirs["total"] == 1 and theirs["data"][0]["user_id"] == "other@example.com"
    status, typed = await api("GET", f"/sessions?connection={role}&type=database", admin_token)
    assert typed["total"] == 3 and typed["data"][0]["connection_subtype"] == "postgres"
    assert (await api("GET", f"/sessions?connection={role}&type=custom", admin_token))[1]["total"] == 0

    status, page = await api("GET", f"/sessions?connection={role}&limit=2", admin_token)
    assert len(page["data"]) == 2 and page["has_next_page"] is True
    dates = [s["start_date"] for s in page["data"]]
    assert dates == sorted(dates, reverse=True)
    status, rest = await api("GET", f"/sessions?connection={role}&limit=2&offset=2", admin_token)
    assert len(rest["data"]) == 1 and rest["has_next_page"] is False
    status, future = await api("GET", f"/sessions?connection={role}&start_date=2999-01-01T00:00:00Z", admin_token)
    assert future["total"] == 0
    status, past = await api("GET", f"/sessions?connection={role}&end_date=2000-01-01", admin_token)
    assert past["total"] == 0
    status, err = await api("GET", "/sessions?start_date=yesterday", admin_token)
    assert status == 422 and "start_date" in err["message"]
    assert (await api("GET", "/sessions?limit=abc", admin_token))[0] == 422

    other_session = theirs["data"][0]["id"]
    status, err = await api("GET", f"/sessions/{other_session}", user_token)
    assert status == 403 and err["message"] == "access denied: this session belongs to another user"
    assert (await api("GET", f"/sessions/{uuid.uuid4()}", admin_token))[0] == 404
    assert (await api("POST", f"/sessions/{other_session}/kill", user_token))[0] == 403


async def test_session_limit_is_clamped_to_100(api, admin_token):
    _, role = await make_resource(api, admin_token)
    for _ in range(101):
        assert (await api("POST", f"/connections/{role}/credentials", admin_token, {}))[0] == 201
    status, page = await api("GET", f"/sessions?connection={role}&limit=1000", admin_token)
    assert status == 200 and len(page["data"]) == 100 and page["total"] == 101 and page["has_next_page"]
    status, default = await api("GET", f"/sessions?connection={role}", admin_token)
    assert len(default["data"]) == 20


async def test_lists_past_the_count_cap_say_their_total_is_a_lower_bound(tmp_path):
    """Issue 36: with store.count_cap at 3 (GATEWAYD_STORE_COUNT_CAP), a list of more sessions or audit entries
    answers total 3 with total_exact false and has_next_page true, its pages still reach every row, the last says
    none follows; a filter under the cap counts exactly. The answers are checked against the OpenAPI document."""
    gw = Daemon(tmp_path / "data")
    gw.extra_env["GATEWAYD_STORE_COUNT_CAP"] = "3"
    gw.start()
    try:
        admin = gw.token("admin@example.com", groups="admin")
        async with aiohttp.ClientSession() as http:
            api = Client(gw, http)
            _, role = await make_resource(api, admin)
            made = [(await api("POST", f"/connections/{role}/credentials", admin, {}))[1]["session_id"]
                    for _ in range(5)]
            seen = []
            for offset in (0, 2, 4):
                status, page = await api("GET", f"/sessions?limit=2&offset={offset}", admin)
                assert status == 200 and (page["total"], page["total_exact"]) == (3, False), page
                assert page["has_next_page"] is (offset < 4)
                seen += [s["id"] for s in page["data"]]
            assert sorted(seen) == sorted(made) and len(seen) == 5
            status, page = await api("GET", f"/sessions?connection={role}&status=done", admin)
            assert (page["total"], page["total_exact"], page["has_next_page"]) == (0, True, False)

            status, page = await api("GET", "/audit/logs?page_size=2", admin)
            assert status == 200 and page["pages"]["total"] == 3 and page["pages"]["total_exact"] is False, page
            assert page["pages"]["has_next_page"] is True
            entries, number = [], 1
            while True:
                _, page = await api("GET", f"/audit/logs?page_size=2&page={number}", admin)
                entries += [e["id"] for e in page["data"]]
                if not page["pages"]["has_next_page"]:
                    break
                number += 1
            assert len(entries) == len(set(entries)) >= 7  # the token minted, the resource, five credentials
            status, page = await api("GET", "/audit/logs?action=resources.create", admin)
            assert page["pages"]["total"] == 1 and page["pages"]["total_exact"] is True
            assert page["pages"]["has_next_page"] is False
    finally:
        gw.stop()


async def test_session_fields_follow_the_spec(api, admin_token):
    _, role = await make_resource(api, admin_token)
    _, cred = await api("POST", f"/connections/{role}/credentials", admin_token, {})
    status, session = await api("GET", f"/sessions/{cred['session_id']}?expand=event_stream", admin_token)
    spec_fields = {"id", "org_id", "user", "user_id", "user_name", "connection", "role_name", "resource_name",
                   "connection_subtype", "connection_tags", "type", "verb", "status", "script", "script_size",
                   "start_date", "end_date", "event_size", "event_stream", "exit_code", "review",
                   "session_batch_id", "labels", "metadata", "metrics", "integrations_metadata"}
    assert spec_fields <= set(session)
    assert session["role_name"] == session["connection"] == role and session["verb"] == "connect"
    assert session["event_stream"] == [] and session["review"] is None and session["end_date"] is None
    assert session["metrics"]["event_size"] == 0


# ------------------------------------------------------------------ audit log


async def test_audit_log_is_admin_only_and_refusals_are_audited(api, admin_token, user_token):
    assert await api("GET", "/audit/logs", user_token) == (403, {"message": "access denied: this requires the admin group"})
    assert (await api("DELETE", "/guardrails/whatever"))[0] == 401
    status, logs = await api("GET", "/audit/logs?outcome=failure&resource_type=audit", admin_token)
    refusal = logs["data"][0]
    assert refusal["actor_email"] == "user@example.com" and refusal["http_status"] == 403
    assert refusal["http_method"] == "GET" and refusal["http_path"] == "/api/audit/logs"
    status, logs = await api("GET", "/audit/logs?outcome=failure&action=guardrails.delete", admin_token)
    assert logs["data"][0]["http_status"] == 401 and logs["data"][0]["actor_subject"] == ""


async def test_audit_log_paging_filters_and_order(api, admin_token):
    for _ in range(3):
        await api("POST", "/users/groups", admin_token, {"name": unique("audit-grp")})
    status, page = await api("GET", "/audit/logs?action=users.create_group&page_size=2", admin_token)
    assert status == 200 and len(page["data"]) == 2 and page["pages"]["size"] == 2 and page["pages"]["page"] == 1
    assert page["pages"]["total"] >= 3
    times = [e["created_at"] for e in page["data"]]
    assert times == sorted(times, reverse=True)
    entry = page["data"][0]
    assert set(entry) == {"id", "org_id", "actor_subject", "actor_email", "actor_name", "created_at",
                          "resource_type", "action", "http_method", "http_path", "http_status", "client_ip",
                          "request_payload_redacted", "outcome", "error_message"}
    assert entry["actor_email"] == "admin@example.com" and entry["client_ip"] == "127.0.0.1"
    status, second = await api("GET", "/audit/logs?action=users.create_group&page_size=2&page=2", admin_token)
    assert second["data"][0]["id"] not in {e["id"] for e in page["data"]}
    assert (await api("GET", "/audit/logs?actor=admin@example.com&created_after=2999-01-01", admin_token))[1][
        "pages"]["total"] == 0
    status, today = await api("GET", f"/audit/logs?created_before={entry['created_at'][:10]}&page_size=1", admin_token)
    assert today["pages"]["total"] >= 1
    for bad in ("page_size=0", "page_size=101", "page=0", "outcome=maybe", "created_after=tomorrow"):
        status, err = await api("GET", f"/audit/logs?{bad}", admin_token)
        assert status == 422, bad


# ------------------------------------------------------------------ server configuration


async def test_serverconfig_misc(api, admin_token, user_token):
    assert (await api("GET", "/serverconfig/misc", user_token))[0] == 403
    status, misc = await api("GET", "/serverconfig/misc", admin_token)
    assert status == 200 and misc["product_analytics"] == "inactive"
    key = base64.b64decode(misc["ssh_server_config"]["hosts_key"])
    assert key.startswith(b"-----BEGIN OPENSSH PRIVATE KEY-----")
    misc["grpc_server_url"] = "grpcs://gateway.example.com:8443"
    misc["product_analytics"] = "active"
    status, saved = await api("PUT", "/serverconfig/misc", admin_token, misc)
    assert status == 200 and saved["grpc_server_url"] == "grpcs://gateway.example.com:8443"
    assert (await api("GET", "/serverinfo", admin_token))[1]["grpc_url"] == "grpcs://gateway.example.com:8443"
    bad = {**misc, "postgres_server_config": {"listen_address": "15432"}}
    status, err = await api("PUT", "/serverconfig/misc", admin_token, bad)
    assert status == 400 and "postgres_server_config.listen_address" in err["message"]
    bad = {**misc, "ssh_server_config": {"listen_address": "", "hosts_key": b64("not a key")}}
    assert (await api("PUT", "/serverconfig/misc", admin_token, bad))[0] == 400
    assert (await api("PUT", "/serverconfig/misc", admin_token, {**misc, "product_analytics": "on"}))[0] == 422
    status, logs = await api("GET", "/audit/logs?resource_type=serverconfig&outcome=success", admin_token)
    assert logs["data"][0]["request_payload_redacted"]["ssh_server_config"]["hosts_key"] == "[REDACTED]"
