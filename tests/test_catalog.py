"""Connections: reaching the target, browsing its catalog through recorded sessions, partial updates, tags."""

from __future__ import annotations

import json
import uuid

import aiohttp
import pytest

from tests.apiclient import Api, b64, of_kind, postgres_env
from tests.conftest import Daemon
from tests.pgpeer import unavailable_reason
from tests.ports import free_port

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    daemon = Daemon(tmp_path_factory.mktemp("catalog") / "data", {"sessions.exec_wait": "20s"}).start()
    daemon.tokens = {"admin": daemon.token("ada@example.com", groups="admin"),
                     "dev": daemon.token("dev@example.com", groups="dev")}
    yield daemon
    assert daemon.stop() == 0


@pytest.fixture(scope="module")
async def as_(gateway):
    async with aiohttp.ClientSession() as http:
        yield {who: Api(gateway, http, token) for who, token in gateway.tokens.items()}


@pytest.fixture(scope="module")
async def db(as_, pg_target):
    conn = await as_["admin"].connection("cat", "database", "postgres", postgres_env(pg_target),
                                         tags={"env": "prod", "team": "data"})
    status, made = await as_["admin"]("POST", "/sessions", {"connection": conn["name"], "script": (
        "CREATE DATABASE catalog_shop; ")})
    assert status == 200 and made["exit_code"] == 0, made
    shop = await as_["admin"].connection("shop", "database", "postgres", postgres_env(pg_target, db="catalog_shop"))
    status, made = await as_["admin"]("POST", "/sessions", {"connection": shop["name"], "script": (
        "CREATE SCHEMA sales; CREATE TABLE sales.\"orders\" (id bigint NOT NULL, note text, \"it's\" int); "
        "CREATE TABLE public.customers (email text NOT NULL)")})
    assert status == 200 and made["exit_code"] == 0, made
    return conn


async def test_a_connection_is_browsed_through_recorded_sessions(as_, db):
    status, found = await as_["dev"]("GET", f"/connections/{db['name']}/databases")
    assert status == 200 and "catalog_shop" in found["databases"] and "postgres" in found["databases"], found
    status, tables = await as_["dev"]("GET", f"/connections/{db['name']}/tables?database=catalog_shop")
    assert status == 200 and tables["schemas"] == [{"name": "public", "tables": ["customers"]},
                                                   {"name": "sales", "tables": ["orders"]}], tables
    status, columns = await as_["dev"]("GET", f"/connections/{db['name']}/columns?database=catalog_shop&schema=sales"
                                              "&table=orders")
    assert status == 200 and columns["columns"] == [
        {"name": "id", "type": "bigint", "nullable": False}, {"name": "note", "type": "text", "nullable": True},
        {"name": "it's", "type": "integer", "nullable": True}], columns
    status, quoted = await as_["dev"]("GET", f"/connections/{db['name']}/columns?table=x'%20OR%20'1'='1")
    assert status == 200 and quoted["columns"] == []  # a name, never SQL

    status, page = await as_["admin"]("GET", f"/sessions?connection={db['name']}&limit=10")
    browsed = [s for s in page["data"] if s["metadata"].get("catalog")]
    assert {s["metadata"]["catalog"]["what"] for s in browsed} >= {"databases", "tables", "columns"}
    assert all(s["user"] == "dev@example.com" and s["verb"] == "exec" for s in browsed)
    session = await as_["admin"].done_session(browsed[0]["id"])
    assert "information_schema" in of_kind(session, "i")[0] or "pg_database" in of_kind(session, "i")[0]
    status, logs = await as_["admin"]("GET", "/audit/logs?action=connections.browse_tables&page_size=5")
    assert logs["data"][0]["actor_email"] == "dev@example.com"
    assert logs["data"][0]["request_payload_redacted"]["database"] == "catalog_shop"


async def test_guard_rails_apply_to_browsing_and_other_protocols_are_refused(as_, db):
    rail = await as_["admin"].guardrail(db, [{"type": "deny_words_list", "words": ["information_schema"]}])
    try:
        status, refused = await as_["dev"]("GET", f"/connections/{db['name']}/tables")
        assert status == 403 and "guard rails" in refused["message"], refused
    finally:
        await as_["admin"]("DELETE", f"/guardrails/{rail['id']}")
    ssh = await as_["admin"].connection("sshbox", "custom", "ssh", {"HOST": "127.0.0.1", "PORT": "22", "USER": "x",
                                                                    "PASS": "y"})
    assert (await as_["dev"]("GET", f"/connections/{ssh['name']}/databases"))[0] == 422
    assert (await as_["dev"]("GET", f"/connections/{db['name']}/columns"))[0] == 422
    assert (await as_["dev"]("GET", "/connections/no-such/databases"))[0] == 404


async def test_the_target_is_tested_as_a_session_would_log_in(as_, db, pg_target):
    assert await as_["dev"]("GET", f"/connections/{db['name']}/test") == (200, {"success": True, "message": ""})
    wrong = await as_["admin"].connection("wrongpw", "database", "postgres",
                                          postgres_env(pg_target, password="not-the-password"))
    status, failed = await as_["dev"]("GET", f"/connections/{wrong['name']}/test")
    assert status == 200 and failed["success"] is False and "refused the credentials" in failed["message"], failed
    assert "not-the-password" not in json.dumps(failed)
    gone = await as_["admin"].connection("gone", "httpproxy", "httpproxy",
                                         {"REMOTE_URL": f"http://127.0.0.1:{free_port()}"})
    status, failed = await as_["dev"]("GET", f"/connections/{gone['name']}/test")
    assert status == 200 and failed["success"] is False and failed["message"], failed
    status, logs = await as_["admin"]("GET", "/audit/logs?action=connections.test&outcome=failure&page_size=5")
    assert logs["data"][0]["request_payload_redacted"]["connection"] == gone["name"]


async def test_a_patch_changes_only_what_it_names(as_, db):
    status, patched = await as_["admin"]("PATCH", f"/connections/{db['name']}", {
        "tags": {"team": None, "tier": "gold"}, "settings": {"jit_max_duration": 5400}})
    assert status == 200, patched
    assert patched["tags"] == {"env": "prod", "tier": "gold"} and patched["settings"]["jit_max_duration"] == 5400
    assert patched["secret"]["envvar:PASS"] == "[REDACTED]" and patched["subtype"] == "postgres"
    assert (await as_["dev"]("GET", f"/connections/{db['name']}/test"))[1]["success"]  # the password stayed
    assert (await as_["dev"]("PATCH", f"/connections/{db['name']}", {"tags": {}}))[0] == 403
    status, tags = await as_["dev"]("GET", "/connection-tags")
    assert status == 200
    assert {(t["key"], t["value"]) for t in tags["items"]} >= {("env", "prod"), ("tier", "gold")}
    assert ("team", "data") not in {(t["key"], t["value"]) for t in tags["items"]}


async def test_a_setting_no_one_reads_is_refused_not_kept(as_, db, pg_target):
    """A misspelled key did nothing: ``reveiwers`` left the connection without the review its admin asked for, and
    the API answered 201. Each key of ``settings`` (and of its protocol's object) is one the gateway reads."""
    secret = {f"envvar:{key}": b64(value) for key, value in postgres_env(pg_target).items()}
    for settings, field in [({"reveiwers": ["dba"]}, "settings.reveiwers"),
                            ({"reviewers": ["dba"], "exec_reveiw": True}, "settings.exec_reveiw"),
                            ({"postgres": {"databses": ["*"]}}, "settings.postgres.databses"),
                            ({"mysql": {"local_infile": False}}, "settings.mysql")]:  # another protocol's
        status, refused = await as_["admin"]("POST", "/connections", {
            "name": f"typo-{uuid.uuid4().hex[:6]}", "type": "database", "subtype": "postgres",
            "secret": secret, "settings": settings})
        assert status == 422 and f"field '{field}" in refused["message"], (settings, refused)
        status, refused = await as_["admin"]("PATCH", f"/connections/{db['name']}", {"settings": settings})
        assert status == 422, refused
    status, made = await as_["admin"]("POST", "/connections", {
        "name": f"known-{uuid.uuid4().hex[:6]}", "type": "database", "subtype": "postgres",
        "secret": secret, "settings": {
            "reviewers": ["dba"], "min_approvals": 1, "exec_review": True, "jit_review": False,
            "jit_max_duration": 60, "force_approval_groups": ["admin"], "recording_mode": "strict",
            "postgres": {"databases": ["*"], "function_calls": []}}})
    assert status == 201, made
