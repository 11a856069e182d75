"""Runbooks: templates and their parameters, a real git repository served over HTTP, and runs end to end.

The repository is a real one, served by ``git http-backend`` behind HTTP Basic authentication
(tests/gitpeer.py); the gateway is a real ``gatewayd run``; scripts run on the session's PostgreSQL
target through the same pipeline as ``POST /sessions``.
"""

from __future__ import annotations

import json
import uuid

import aiohttp
import pytest

from gatewayd.models import RunbookRepository, RunbookRule, User
from gatewayd.runbook_templates import ParameterError, TemplateError, parse, render
from gatewayd.runbooks import (
    SECRET_FIELDS,
    RunbookError,
    RunbookService,
    in_folders,
    locate,
    may_run,
    repository_id,
)
from tests.apiclient import Api, events, of_kind, postgres_env
from tests.conftest import Daemon
from tests.gitpeer import GitServer
from tests.pgpeer import unavailable_reason

FETCH = """-- fetch one customer
SELECT {{ .id | description "the customer's id" | required "say which customer" | type "number" | order "1" }}
       AS id, {{ .country | options "US" "BR" | default "US" | squote }} AS country,
       {{ .note | squote }} AS note;
"""
SECRET = """ALTER ROLE {{ .role | pattern "^[a-z_]+$" | required "role" }} PASSWORD {{ .password | type "password"
    | required "a password" | squote }};
SELECT {{ .password | squote }} AS echoed;
"""

# ----------------------------------------------------------------------------------------------- templates


def test_a_template_declares_its_parameters_as_hoops_runbooks_do():
    template = parse(FETCH)
    assert {name: p.as_json() for name, p in template.parameters.items()} == {
        "id": {"description": "the customer's id", "required": True, "type": "number", "order": 1},
        "country": {"description": "", "required": False, "type": "select", "default": "US",
                    "options": ["US", "BR"]},
        "note": {"description": "", "required": False, "type": "text"},
    }


def test_values_are_checked_against_their_declarations_before_anything_is_made():
    template = parse(FETCH)
    with pytest.raises(ParameterError) as refused:
        render(template, {"country": "FR", "colour": "red"}, "sql")
    assert refused.value.problems == {"colour": "the runbook has no such parameter"}
    with pytest.raises(ParameterError) as refused:
        render(template, {"id": "1; DROP TABLE x", "country": "FR"}, "sql")
    assert refused.value.problems == {"id": "expected a number", "country": "expected one of US, BR"}
    with pytest.raises(ParameterError) as refused:
        render(template, {}, "sql")
    assert refused.value.problems == {"id": "say which customer"}
    for kind, good, bad in (("email", "a@b.example", "not-mail"), ("date", "2025-02-28", "2025-02-30"),
                            ("time", "23:59", "24:00"), ("url", "https://x.example/a", "javascript:alert(1)")):
        typed = parse(f'{{{{ .v | type "{kind}" }}}}')
        assert render(typed, {"v": good}).script == good
        with pytest.raises(ParameterError):
            render(typed, {"v": bad})
    with pytest.raises(ParameterError) as refused:
        render(parse('{{ .v | type "text" }}'), {"v": "two\nlines"})
    assert refused.value.problems == {"v": "must be one line"}


def test_a_quoted_value_cannot_leave_its_quotes_in_the_connections_language():
    """hoop.dev's squote wraps the value as it is (``'it's'``): here a quote inside is escaped, the SQL way on a
    database, the shell way on a server."""
    template = parse("x {{ .v | squote }} {{ .v | dquote }}")
    sneaky = "o'clock\"; $(rm -rf /) `id`"
    assert render(template, {"v": sneaky}, "sql").script == \
        "x 'o''clock\"; $(rm -rf /) `id`' \"o'clock\"\"; $(rm -rf /) `id`\""
    shell = render(template, {"v": sneaky}, "shell").script
    assert shell == "x 'o'\\''clock\"; $(rm -rf /) `id`' \"o'clock\\\"; \\$(rm -rf /) \\`id\\`\""
    # a backslash: E'...' (its backslashes doubled), read the same whatever standard_conforming_strings says
    assert render(parse("{{ .v | squote }}"), {"v": "a\\' b"}, "sql").script == "E'a\\\\'' b'"
    with pytest.raises(ParameterError):  # a language gatewayd does not know: refused rather than guessed
        render(template, {"v": "it's"}, "")


def test_what_gatewayd_does_not_render_is_said_never_guessed():
    for text, reason in (("{{ if .x }}y{{ end }}", "start with a parameter"),
                         ("{{ .x | exec \"rm\" }}", "unknown function 'exec'"),
                         ("{{ .x | type \"colour\" }}", "type 'colour' is not one of"),
                         ("{{ .x | pattern \"(\" }}", "not a valid regular expression"),
                         ("{{ .x ", "unterminated action"),
                         ("{{ .x | type \"select\" }}", "needs options")):
        with pytest.raises(TemplateError) as refused:
            parse(text)
        assert reason in str(refused.value), (text, refused.value)


def test_secret_parameters_are_listed_in_every_form_the_script_carries_them():
    template = parse('{{ .pw | type "password" | squote }} {{ .pw | encodeb64 }} {{ .user }}')
    made = render(template, {"pw": "hunter2", "user": "ann"}, "sql")
    assert made.script == "'hunter2' aHVudGVyMg== ann"
    assert set(made.secrets) == {"hunter2", "'hunter2'", "aHVudGVyMg=="}
    assert made.shown_parameters(template) == {"pw": "[REDACTED]", "user": "ann"}


def test_runbook_rules_name_groups_runbooks_and_connections():
    ann = User(id="1", org_id="o", subject="ann", email="ann@x", groups=["dba"])
    rule = RunbookRule(id="r", org_id="o", name="dba", runbooks=[{"repository": "r1", "name": "a.runbook.sql"}],
                       connections=["pg"], user_groups=["dba"])
    assert may_run([], ann, "r1", "b.runbook.sql", "other")  # no rule: everyone
    assert may_run([rule], ann, "r1", "a.runbook.sql", "pg")
    assert not may_run([rule], ann, "r1", "b.runbook.sql", "pg")
    assert not may_run([rule], ann, "r1", "a.runbook.sql", "other")
    assert not may_run([rule], User(id="2", org_id="o", subject="bob", email="b@x", groups=["dev"]),
                       "r1", "a.runbook.sql", "pg")
    assert may_run([rule], User(id="3", org_id="o", subject="ada", email="a@x", groups=["admin"]),
                   "r1", "b.runbook.sql", "other")
    assert in_folders("ops/a.runbook.sql", ["ops"]) and not in_folders("opsx/a.runbook.sql", ["ops/"])


def test_repository_addresses_are_checked():
    assert locate("https://github.com/org/runbooks.git", local_allowed=False).name == "github.com/org/runbooks"
    assert locate("git@github.com:org/runbooks.git", local_allowed=False).name == "github.com/org/runbooks"
    assert locate("/srv/runbooks", local_allowed=True).name == "local/srv/runbooks"
    for url, reason in (("https://ann:pw@host/r", "credentials do not go in the URL"),
                        ("file:///etc", "expected an https, http or ssh URL"),
                        ("ext::sh -c id", "expected an https, http or ssh URL"),
                        ("/srv/runbooks", "local path is for the gateway's own organization")):
        with pytest.raises(RunbookError) as refused:
            locate(url, local_allowed=False)
        assert reason in refused.value.message


# ----------------------------------------------------------------------------------------------- git


@pytest.fixture(scope="module")
def git_server(tmp_path_factory):
    server = GitServer(tmp_path_factory.mktemp("git"), "rita", "git-pass-42").start()
    yield server
    server.stop()


def _repo(server: GitServer, name: str, password: str = "git-pass-42", **more) -> RunbookRepository:
    url = server.url(name)
    return RunbookRepository(id=repository_id(url), org_id="org-1", repository=locate(url, local_allowed=True).name,
                             git_url=url, git_user="rita", credentials={"git_password": password}, **more)


async def test_a_repository_is_fetched_with_its_credentials_and_read_once_per_commit(git_server, tmp_path):
    tree = git_server.repository("fetching")
    first = git_server.commit(tree, {"ops/fetch.runbook.sql": FETCH, "ops/broken.runbook.sql": "{{ if .x }}",
                                     "README.md": "not a runbook", "other/skip.runbook.sh": "echo hi"}, "first")
    service = RunbookService(tmp_path / "data", refresh_interval=3600)
    repo = _repo(git_server, "fetching", folder="ops")
    catalog = await service.catalog(repo)
    assert (catalog.commit, catalog.author, catalog.message) == (first, "Rita Runbook <rita@example.com>", "first")
    assert sorted(catalog.files) == ["ops/broken.runbook.sql", "ops/fetch.runbook.sql"]  # the folder's runbooks
    assert catalog.files["ops/broken.runbook.sql"].error and catalog.files["ops/fetch.runbook.sql"].template
    assert git_server.requests and all(who in ("rita", "refused") for _, _, who in git_server.requests)
    fetched = len(git_server.requests)

    second = git_server.commit(tree, {"ops/fetch.runbook.sql": None, "ops/new.runbook.sql": "SELECT 2"}, "second")
    assert (await service.catalog(repo)).commit == first  # within refresh_interval: no fetch
    assert len(git_server.requests) == fetched
    refreshed = await service.catalog(repo, refresh=True)
    assert refreshed.commit == second and sorted(refreshed.files) == ["ops/broken.runbook.sql", "ops/new.runbook.sql"]
    pinned = await service.at_commit(repo, first[:12])  # an older commit, by its short hash, as it was
    assert pinned.commit == first and "ops/fetch.runbook.sql" in pinned.files
    with pytest.raises(RunbookError) as missing:
        await service.at_commit(repo, "0" * 40)
    assert missing.value.status == 404

    # the password is handed to git only for the command: nowhere in the clone or its configuration
    clone_files = [p for p in (tmp_path / "data" / "runbooks").rglob("*") if p.is_file()]
    assert clone_files and not any(b"git-pass-42" in p.read_bytes() for p in clone_files)


async def test_a_wrong_password_is_said_and_nothing_is_listed(git_server, tmp_path):
    git_server.commit(git_server.repository("locked"), {"a.runbook.sql": "SELECT 1"})
    service = RunbookService(tmp_path / "data")
    with pytest.raises(RunbookError) as refused:
        await service.catalog(_repo(git_server, "locked", password="wrong"))
    assert refused.value.status == 502 and "Authentication failed" in refused.value.message
    assert "wrong" not in refused.value.message


async def test_a_tenants_repository_must_be_reached_over_https_at_an_allowed_address(git_server, tmp_path):
    service = RunbookService(tmp_path / "data")
    with pytest.raises(RunbookError) as refused:
        await service.catalog(_repo(git_server, "locked"), tenant=True)
    assert "https or ssh" in refused.value.message
    repo = _repo(git_server, "locked")
    repo.git_url = "https://localhost/locked.git"
    with pytest.raises(RunbookError) as refused:
        await service.catalog(repo, tenant=True)
    assert "loopback" in refused.value.message


# ----------------------------------------------------------------------------------------------- the API

pg_only = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    daemon = Daemon(tmp_path_factory.mktemp("runbooks") / "data", {"sessions.exec_wait": "20s"}).start()
    daemon.tokens = {"admin": daemon.token("ada@example.com", groups="admin", name="Ada Admin"),
                     "dba": daemon.token("dora@example.com", groups="dba", name="Dora DBA"),
                     "dev": daemon.token("dev@example.com", groups="dev", name="Dev Eloper")}
    yield daemon
    assert daemon.stop() == 0
    assert "git-pass-42" not in daemon.log_text()


@pytest.fixture(scope="module")
async def as_(gateway):
    async with aiohttp.ClientSession() as http:
        yield {who: Api(gateway, http, token) for who, token in gateway.tokens.items()}


@pytest.fixture(scope="module")
async def library(git_server, as_, pg_target):
    """A runbook repository configured through the API, and a postgres connection of the session's target."""
    tree = git_server.repository("library")
    commit = git_server.commit(tree, {"db/fetch.runbook.sql": FETCH, "db/secret.runbook.sql": SECRET,
                                      "db/drop.runbook.sql": "DROP TABLE {{ .table | required \"which\" }};"})
    status, body = await as_["admin"]("PUT", "/runbooks/configurations", {"repositories": [{
        "git_url": git_server.url("library"), "git_user": "rita", "git_password": "git-pass-42", "folder": "db"}]})
    assert status == 200, body
    connection = await as_["admin"].connection("rbpg", "database", "postgres", postgres_env(pg_target))
    return {"tree": tree, "commit": commit, "repository": body["repositories"][0]["repository"],
            "connection": connection, "id": body["repositories"][0]["id"]}


async def test_every_secret_of_a_repository_is_redacted_in_the_audit_log_as_in_the_answer(as_):
    """The audit log kept ``ssh_keypass`` in clear (its redaction went by name endings, and that name has none of
    them) while the answer showed ``[REDACTED]``: both now go by the fields the API declares secret."""
    sent = {"git_url": "https://git.example.com/team/keys.git", "ssh_user": "git", "git_password": "git-pw-77",
            "ssh_key": "-----BEGIN OPENSSH PRIVATE KEY-----", "ssh_keypass": "key-pass-phrase-77"}
    status, made = await as_["admin"]("POST", "/runbooks/configurations", sent)
    assert status == 201 and [made[name] for name in SECRET_FIELDS] == ["[REDACTED]"] * 3, made
    try:
        status, logs = await as_["admin"]("GET", "/audit/logs?action=runbooks.create_repository&page_size=5")
        assert status == 200 and logs["data"][0]["request_payload_redacted"] == {
            **sent, **{name: "[REDACTED]" for name in SECRET_FIELDS}}, logs["data"][0]
        assert not any(sent[name] in json.dumps(logs) for name in SECRET_FIELDS)
    finally:
        assert (await as_["admin"]("DELETE", f"/runbooks/configurations/{made['id']}"))[0] == 204


@pg_only
async def test_the_configuration_keeps_the_password_sealed_and_never_shows_it(as_, library, gateway):
    status, body = await as_["admin"]("GET", "/runbooks/configurations")
    assert status == 200, body
    [repo] = body["repositories"]
    assert repo["git_password"] == "[REDACTED]" and repo["git_url"].endswith("/library.git")
    assert repo["repository"] == library["repository"] and repo["folder"] == "db"
    raw = b"".join(p.read_bytes() for p in gateway.data_dir.glob("*.db*"))
    assert b"git-pass-42" not in raw  # sealed in the store
    assert (await as_["dev"]("GET", "/runbooks/configurations"))[0] == 403
    status, listed = await as_["admin"]("GET", "/audit/logs?resource_type=runbooks&page_size=100")
    assert status == 200 and "git-pass-42" not in json.dumps(listed)
    # sent back as shown, the stored password stays
    status, kept = await as_["admin"]("PUT", f"/runbooks/configurations/{library['id']}", {
        key: repo[key] for key in ("git_url", "git_user", "git_password", "folder")})
    assert status == 200 and kept["git_password"] == "[REDACTED]", kept
    assert (await as_["admin"]("GET", "/runbooks?refresh=true"))[0] == 200


@pg_only
async def test_users_list_the_runbooks_with_their_form_fields(as_, library):
    status, body = await as_["dev"]("GET", "/runbooks?list_connections=true")
    assert status == 200, body
    [repo] = body["repositories"]
    assert repo["commit"] == library["commit"] and repo["commit_author"] == "Rita Runbook <rita@example.com>"
    items = {item["name"]: item for item in repo["items"]}
    assert set(items) == {"db/fetch.runbook.sql", "db/secret.runbook.sql", "db/drop.runbook.sql"}
    assert items["db/fetch.runbook.sql"]["metadata"]["id"]["type"] == "number"
    assert library["connection"]["name"] in items["db/fetch.runbook.sql"]["connections"]
    status, old = await as_["dev"]("GET", f"/plugins/runbooks/connections/{library['connection']['name']}/templates")
    assert status == 200 and {i["name"] for i in old["items"]} == set(items), old


@pg_only
async def test_a_runbook_runs_through_the_pipeline_and_its_session_names_it(as_, library):
    status, result = await as_["dev"]("POST", "/runbooks/exec", {
        "connection_name": library["connection"]["name"], "repository": library["repository"],
        "file_name": "db/fetch.runbook.sql", "parameters": {"id": "42", "note": "o'clock"}})
    assert status == 200, result
    assert result["exit_code"] == 0 and "42" in result["output"] and "o'clock" in result["output"], result
    session = await as_["admin"].done_session(result["session_id"])
    assert session["verb"] == "exec" and session["user"] == "dev@example.com"
    assert session["metadata"]["runbook"] == {
        "repository": library["repository"], "name": "db/fetch.runbook.sql", "commit": library["commit"],
        "parameters": {"id": "42", "country": "US", "note": "o'clock"}}
    assert "'o''clock'" in session["script"]["data"] and "'o''clock'" in of_kind(session, "i")[0]
    status, entries = await as_["admin"]("GET", "/audit/logs?action=session.exec&page_size=5")
    assert entries["data"][0]["request_payload_redacted"]["runbook"]["name"] == "db/fetch.runbook.sql"

    status, refused = await as_["dev"]("POST", "/runbooks/exec", {
        "connection_name": library["connection"]["name"], "repository": library["repository"],
        "file_name": "db/fetch.runbook.sql", "parameters": {"id": "1 OR 1=1"}})
    assert status == 422 and refused["message"] == "parameters: id: expected a number", refused


@pg_only
async def test_secret_parameters_run_but_are_never_recorded_nor_audited(as_, library, gateway, pg_target):
    role = "runbook_victim"
    status, made = await as_["admin"]("POST", "/sessions", {"connection": library["connection"]["name"],
                                                           "script": f"CREATE ROLE {role} LOGIN"})
    assert status == 200 and made["exit_code"] == 0, made
    status, result = await as_["dev"]("POST", "/runbooks/exec", {
        "connection_name": library["connection"]["name"], "repository": library["repository"],
        "file_name": "db/secret.runbook.sql", "parameters": {"role": role, "password": "Sup3r-S3cret!"}})
    assert status == 200 and result["exit_code"] == 0, result
    assert "Sup3r-S3cret!" not in result["output"] and "[REDACTED]" in result["output"]
    session = await as_["admin"].done_session(result["session_id"])
    recorded = json.dumps(session) + "".join(text for _, text in events(session))
    where = recorded.find("Sup3r-S3cret!")
    assert where < 0, recorded[max(0, where - 600):where + 100]
    assert "PASSWORD [REDACTED]" in session["script"]["data"]
    assert session["metadata"]["runbook"]["parameters"] == {"role": role, "password": "[REDACTED]"}
    # the role really got that password: the target accepts it
    import asyncpg

    conn = await asyncpg.connect(host="127.0.0.1", port=pg_target.port, user=role, password="Sup3r-S3cret!",
                                 database="postgres")
    await conn.close()
    status, logs = await as_["admin"]("GET", "/audit/logs?page_size=100")
    assert "Sup3r-S3cret!" not in json.dumps(logs)
    raw = b"".join(p.read_bytes() for p in gateway.data_dir.glob("*.db*"))
    assert b"Sup3r-S3cret!" not in raw


@pg_only
async def test_a_guard_rail_blocks_a_runbook_as_any_script(as_, library):
    rail = await as_["admin"].guardrail(library["connection"], [{"type": "deny_words_list", "words": ["drop"]}])
    try:
        status, result = await as_["dev"]("POST", "/runbooks/exec", {
            "connection_name": library["connection"]["name"], "repository": library["repository"],
            "file_name": "db/drop.runbook.sql", "parameters": {"table": "customers"}})
        assert status == 200 and result["exit_code"] == 254 and "guard rails" in result["output"], result
        session = await as_["admin"].done_session(result["session_id"])
        assert session["metadata"]["runbook"]["name"] == "db/drop.runbook.sql"
    finally:
        assert (await as_["admin"]("DELETE", f"/guardrails/{rail['id']}"))[0] == 204


@pg_only
async def test_a_reviewed_runbook_waits_for_its_approval_then_runs_its_commit(as_, library, git_server, pg_target):
    connection = await as_["admin"].connection("rbreview", "database", "postgres", postgres_env(pg_target),
                                                {"reviewers": ["dba"]})
    status, pending = await as_["dev"]("POST", "/runbooks/exec", {
        "connection_name": connection["name"], "repository": library["repository"],
        "file_name": "db/secret.runbook.sql", "parameters": {"role": "reviewed_role", "password": "Rev13wed-pw"}})
    assert status == 202 and pending["has_review"], pending
    status, review = await as_["dba"]("GET", f"/reviews/{pending['review_id']}")
    assert status == 200 and "[REDACTED]" in review["input"] and "Rev13wed-pw" not in json.dumps(review)
    git_server.commit(library["tree"], {"db/secret.runbook.sql": "SELECT 'changed since'"}, "changed")
    assert (await as_["dba"]("PUT", f"/reviews/{pending['review_id']}", {"status": "APPROVED"}))[0] == 200
    status, ran = await as_["dev"]("POST", f"/sessions/{pending['session_id']}/exec")
    assert status == 200 and ran["exit_code"] == 1, ran  # the role does not exist: the reviewed script ran
    assert "reviewed_role" in ran["output"] and "Rev13wed-pw" not in ran["output"]
    session = await as_["admin"].done_session(pending["session_id"])
    assert session["metadata"]["runbook"]["commit"] == library["commit"]
    assert "Rev13wed-pw" not in json.dumps(session) + "".join(t for _, t in events(session))


@pg_only
async def test_rules_and_the_feature_switch_decide_who_runs_runbooks(as_, library):
    status, rule = await as_["admin"]("POST", "/runbooks/rules", {
        "name": "dbas-fetch", "runbooks": [{"repository": library["repository"], "name": "db/fetch.runbook.sql"}],
        "connections": [library["connection"]["name"]], "user_groups": ["dba"]})
    assert status == 201, rule
    try:
        body = {"connection_name": library["connection"]["name"], "repository": library["repository"],
                "file_name": "db/fetch.runbook.sql", "parameters": {"id": "7"}}
        status, refused = await as_["dev"]("POST", "/runbooks/exec", body)
        assert status == 403, refused
        status, listed = await as_["dev"]("GET", "/runbooks")
        assert status == 200 and listed["repositories"][0]["items"] == []
        assert (await as_["dba"]("POST", "/runbooks/exec", body))[0] == 200
        status, entries = await as_["admin"]("GET", "/audit/logs?outcome=failure&resource_type=runbooks&page_size=5")
        assert entries["data"][0]["http_status"] == 403 and entries["data"][0]["actor_email"] == "dev@example.com"
        assert entries["data"][0]["request_payload_redacted"]["parameters"] == {"id": "[REDACTED]"}

        assert (await as_["admin"]("PUT", "/orgs/features", {"name": "runbooks", "status": "disabled"}))[0] == 200
        try:
            status, off = await as_["dba"]("POST", "/runbooks/exec", body)
            assert status == 403 and "disabled" in off["message"]
            assert (await as_["dba"]("GET", "/runbooks"))[0] == 403
        finally:
            await as_["admin"]("PUT", "/orgs/features", {"name": "runbooks", "status": "enabled"})
    finally:
        assert (await as_["admin"]("DELETE", f"/runbooks/rules/{rule['id']}"))[0] == 204



@pg_only
async def test_the_command_line_lists_shows_and_runs_runbooks(gateway, library, tmp_path):
    import asyncio
    import os

    from tests.conftest import BIN, gatewayd_command

    login = tmp_path / "login.json"
    login.write_text(json.dumps({"url": gateway.url.removesuffix("/api"), "token": gateway.tokens["dev"]}))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("GATEWAYD_")},
           "GATEWAYD_CLIENT_CONFIG": str(login)}

    def cli(*args: str, input: str | None = None):
        return gatewayd_command([str(BIN / "gatewayd"), *args], env, input=input, check=False)

    listed = await asyncio.to_thread(cli, "runbooks")
    assert listed.returncode == 0 and "db/fetch.runbook.sql" in listed.stdout and "id*" in listed.stdout, listed
    shown = await asyncio.to_thread(cli, "runbooks", "show", "db/fetch.runbook.sql")
    assert shown.returncode == 0 and "id (number, required): the customer's id" in shown.stdout, shown
    name = library["connection"]["name"]
    ran = await asyncio.to_thread(cli, "runbooks", "run", "db/fetch.runbook.sql", "--connection", name, "-p", "id=42")
    assert ran.returncode == 0 and "42" in ran.stdout, ran
    refused = await asyncio.to_thread(cli, "runbooks", "run", "db/fetch.runbook.sql", "--connection", name,
                                      "-p", "id=forty-two")
    assert refused.returncode != 0 and refused.stderr.strip().splitlines()[-1] == \
        "gatewayd: POST /api/runbooks/exec: 422 parameters: id: expected a number", refused
    secret = await asyncio.to_thread(cli, "runbooks", "run", "db/secret.runbook.sql", "--connection", name,
                                     "-p", "role=runbook_victim", "--secret", "password", input="Cl1-S3cret!\n")
    assert "Cl1-S3cret!" not in secret.stdout and "[REDACTED]" in secret.stdout, secret


@pg_only
async def test_a_rejected_runbook_forgets_the_script_its_secrets_made(as_, library, gateway, pg_target):
    connection = await as_["admin"].connection("rbreject", "database", "postgres", postgres_env(pg_target),
                                                {"reviewers": ["dba"]})
    status, pending = await as_["dev"]("POST", "/runbooks/exec", {
        "connection_name": connection["name"], "repository": library["repository"],
        "file_name": "db/secret.runbook.sql", "parameters": {"role": "nobody", "password": "Rej3cted-pw"}})
    assert status == 202, pending
    import sqlite3

    def sealed_scripts() -> int:
        with sqlite3.connect(gateway.data_dir / "gatewayd.db") as db:
            return db.execute("SELECT COUNT(*) FROM signing_keys WHERE name = ?",
                              (f"script:{pending['session_id']}",)).fetchone()[0]

    assert sealed_scripts() == 1
    assert (await as_["dba"]("PUT", f"/reviews/{pending['review_id']}", {"status": "REJECTED"}))[0] == 200
    assert sealed_scripts() == 0


@pg_only
async def test_a_password_stays_in_its_quotes_on_a_role_that_reads_backslash_escapes(as_, library, git_server,
                                                                                      pg_target):
    """With ``standard_conforming_strings`` off (the role's setting) a backslash escapes a quote: a password with
    ``\\'`` left its quotes and ran a statement that the recording, the reviewers and the answer showed only as
    ``[REDACTED]``. A value with a backslash is now quoted ``E'...'``, which reads the same either way. (Last in
    the module: it moves the repository's tip.)"""
    role = f"scs_off_{uuid.uuid4().hex[:8]}"
    status, made = await as_["admin"]("POST", "/sessions", {"connection": library["connection"]["name"], "script":
                                      f"CREATE ROLE {role} LOGIN PASSWORD 'scs-pw'; "
                                      f"ALTER ROLE {role} SET standard_conforming_strings = off"})
    assert status == 200 and made["exit_code"] == 0, made
    connection = await as_["admin"].connection("rbscs", "database", "postgres",
                                               postgres_env(pg_target, user=role, password="scs-pw"))
    git_server.commit(library["tree"], {"db/echo.runbook.sql":
                                        'SELECT {{ .password | type "password" | squote }} AS echoed;'}, "echo")
    assert (await as_["admin"]("GET", "/runbooks?refresh=true"))[0] == 200
    password = "pw\\' ; SELECT 40000 + 2 AS leaked; --"
    status, result = await as_["dev"]("POST", "/runbooks/exec", {
        "connection_name": connection["name"], "repository": library["repository"],
        "file_name": "db/echo.runbook.sql", "parameters": {"password": password}})
    assert status == 200 and result["exit_code"] == 0, result
    assert "leaked" not in result["output"] and "40002" not in result["output"], result["output"]
    session = await as_["admin"].done_session(result["session_id"])
    assert "40002" not in "".join(text for _, text in events(session))
