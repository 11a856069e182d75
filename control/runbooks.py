"""Runbooks: repositories (configurations), rules, listing the templates a user may run, and running one.

A runbook runs as a one-time script (``control.reviews.start_script``): the same review, guard rails, AI
analysis, recording and audit as ``POST /sessions``. Its session's ``metadata.runbook`` names the repository,
the file, the commit and the parameters (secret ones as ``[REDACTED]``).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from control.http import (
    AUDIT_PAYLOAD,
    ApiError,
    Field,
    Param,
    RouteSet,
    Schema,
    array_of,
    json_body,
    ok,
    require_admin,
    services_of,
    user_of,
)
from control.reviews import start_script
from control.schemas import SCRIPT_RESULT_OUT, STRINGS, TEXT
from gatewayd import features
from gatewayd.audit import REDACTED
from gatewayd.models import Connection, RunbookRepository, RunbookRule, User, new_id, rfc3339, utcnow
from gatewayd.runbook_templates import LANGUAGES, ParameterError, render
from gatewayd.runbooks import (
    SECRET_FIELDS,
    Catalog,
    RunbookError,
    check_branch,
    check_folder,
    in_folders,
    locate,
    may_run,
    repository_id,
)
from gatewayd.store import Conflict

routes = RouteSet("Runbooks", audit="runbooks")

MAX_HOOK_TTL = 365 * 86400
REPOSITORY_FIELDS = {
    "git_url": Field("string", True, min_length=1, description="https://host/owner/repo, user@host:path, "
                                                               "ssh://..., or (the gateway's own organization) "
                                                               "a local path"),
    "branch": Field("string", description="the branch to read (default: the remote's default branch)"),
    "folder": Field("string", description="the folder of the repository holding the runbooks (default: all)"),
    "git_user": Field("string"), "ssh_user": Field("string"),
    **{name: Field("string", description="sealed at rest; never shown", secret=True) for name in SECRET_FIELDS},
    "ssh_known_hosts": Field("string", description="known_hosts lines of the git server (required over ssh)"),
    "git_hook_ttl": Field("integer", minimum=0, maximum=MAX_HOOK_TTL),
}
REPOSITORY = Schema("RunbookRepository", REPOSITORY_FIELDS)
REPOSITORY_OUT = Schema("RunbookRepositoryOut", {
    "id": TEXT, "repository": TEXT, "git_url": TEXT, "branch": TEXT, "folder": TEXT, "git_user": TEXT,
    "git_password": TEXT, "ssh_key": TEXT, "ssh_user": TEXT, "ssh_keypass": TEXT, "ssh_known_hosts": TEXT,
    "git_hook_ttl": Field("integer", True, minimum=0, maximum=MAX_HOOK_TTL), "created_at": TEXT, "updated_at": TEXT,
})
CONFIGURATION = Schema("RunbookConfigurationRequest", {
    "repositories": Field("array", True, items=REPOSITORY)})
CONFIGURATION_OUT = Schema("RunbookConfiguration", {
    "id": TEXT, "org_id": TEXT, "repositories": Field("array", True, items=REPOSITORY_OUT),
    "created_at": TEXT, "updated_at": TEXT})
RUNBOOK_OUT = Schema("Runbook", {
    "name": TEXT, "metadata": Field("object", True, description="the parameters: description, required, type, "
                                                                 "default, options, placeholder, order, pattern"),
    "connections": Field("array", items="string"), "error": Field("string", True, nullable=True),
    "repository": Field("string"),
})
REPOSITORY_LIST = Schema("RunbookRepositoryList", {
    "repository": TEXT, "commit": TEXT, "commit_author": TEXT, "commit_message": TEXT,
    "items": Field("array", True, items=RUNBOOK_OUT)})
LIST_OUT = Schema("RunbookListV2", {
    "errors": STRINGS, "repositories": Field("array", True, items=REPOSITORY_LIST),
    "items": Field("array", items=RUNBOOK_OUT), "commit": Field("string"), "commit_author": Field("string"),
    "commit_message": Field("string")})
TEMPLATES_OUT = Schema("RunbookList", {
    "items": Field("array", True, items=RUNBOOK_OUT), "commit": TEXT, "commit_author": TEXT,
    "commit_message": TEXT})
_EXEC_FIELDS = {
    "file_name": Field("string", True, min_length=1), "ref_hash": Field("string", description="a commit"),
    "parameters": Field("object", description="parameter name: value (strings)"),
    "env_vars": Field("object", description="not supported: refused unless empty"),
    "client_args": Field("array", items="string", description="not supported: refused unless empty"),
    "metadata": Field("object"), "jira_fields": Field("object", description="not supported: refused unless empty"),
    "session_batch_id": Field("string", nullable=True),
}
EXEC = Schema("RunbookExec", {"connection_name": Field("string", True), "repository": Field("string", True),
                              **_EXEC_FIELDS})
PLUGIN_EXEC = Schema("RunbookRequest", _EXEC_FIELDS)
RULE_FILE = Schema("RunbookRuleFile", {"repository": Field("string", True), "name": Field("string", True)})
RULE = Schema("RunbookRuleRequest", {
    "name": Field("string", True, min_length=1), "description": Field("string"),
    "runbooks": Field("array", True, items=RULE_FILE), "connections": Field("array", True, items="string"),
    "user_groups": Field("array", True, items="string")})
RULE_OUT = Schema("RunbookRule", {
    "id": TEXT, "org_id": TEXT, "name": TEXT, "description": TEXT,
    "runbooks": Field("array", True, items=RULE_FILE), "connections": STRINGS, "user_groups": STRINGS,
    "created_at": TEXT, "updated_at": TEXT})
LIST_QUERY = [
    Param("connection_name", description="only runbooks this connection may run"),
    Param("connection", description="the same (older name)"),
    Param("list_connections", description="true: each runbook names the connections it may run on",
          enum=("true", "false")),
    Param("remove_empty_connections", description="false: keep runbooks no connection may run",
          enum=("true", "false")),
    Param("refresh", description="true: fetch the repositories now", enum=("true", "false")),
]


def _error(exc: RunbookError) -> ApiError:
    return ApiError(exc.status, exc.message)


async def _enabled(request: web.Request) -> User:
    """The caller, when the runbooks feature is on for their organization (403 otherwise)."""
    user = user_of(request)
    if not await features.enabled(services_of(request).store, user.org_id, "runbooks"):
        raise ApiError(403, "access denied: the runbooks feature is disabled for this organization "
                            "(PUT /api/orgs/features)")
    return user


def _tenant(request: web.Request) -> bool:
    return services_of(request).tenancy.is_tenant(user_of(request).org_id)


# --------------------------------------------------------------------------- configurations


def repository_json(repo: RunbookRepository) -> dict[str, Any]:
    """An entry as the API shows it: every secret as ``[REDACTED]`` when one is stored (never its value)."""
    shown = {name: REDACTED if repo.credentials.get(name) else "" for name in SECRET_FIELDS}
    return {"id": repo.id, "repository": repo.repository, "git_url": repo.git_url, "branch": repo.branch,
            "folder": repo.folder, "git_user": repo.git_user, "ssh_user": repo.ssh_user,
            "ssh_known_hosts": repo.ssh_known_hosts, "git_hook_ttl": repo.git_hook_ttl,
            "created_at": repo.created_at, "updated_at": repo.updated_at, **shown}


def _build_repository(request: web.Request, body: dict[str, Any], existing: dict[str, RunbookRepository],
                      where: str = "") -> RunbookRepository:
    user = user_of(request)
    try:
        location = locate(body["git_url"], local_allowed=not _tenant(request))
        branch, folder = check_branch(body.get("branch") or ""), check_folder(body.get("folder") or "")
    except RunbookError as exc:
        raise ApiError(422, f"{where}{exc.message}") from None
    git_url = body["git_url"].strip()
    repo_id = repository_id(git_url + (f"#{branch}" if branch else ""))
    previous = existing.get(repo_id)
    credentials = {}
    for name in SECRET_FIELDS:
        value = body.get(name) or ""
        if value == REDACTED:
            if previous is None or not previous.credentials.get(name):
                raise ApiError(422, f"field '{where}{name}': {REDACTED} stands for the stored value, and there is none")
            value = previous.credentials[name]
        if value:
            credentials[name] = value
    if location.scheme == "ssh" and not (body.get("ssh_known_hosts") or "").strip():
        raise ApiError(422, f"field '{where}ssh_known_hosts': required over ssh: the git server's host key is "
                            "checked, never trusted on first use")
    now = rfc3339(utcnow())
    return RunbookRepository(
        id=repo_id, org_id=user.org_id, repository=location.name + (f"@{branch}" if branch else ""),
        git_url=git_url, branch=branch, folder=folder, git_user=body.get("git_user") or "",
        ssh_user=body.get("ssh_user") or "", ssh_known_hosts=body.get("ssh_known_hosts") or "",
        git_hook_ttl=body.get("git_hook_ttl") or 0, credentials=credentials,
        created_at=previous.created_at if previous else now, updated_at=now)


async def _existing(request: web.Request) -> dict[str, RunbookRepository]:
    repos = await services_of(request).store.list_runbook_repositories(user_of(request).org_id)
    return {r.id: r for r in repos}


def _configuration(org_id: str, repos: list[RunbookRepository]) -> dict[str, Any]:
    return {"id": org_id, "org_id": org_id, "repositories": [repository_json(r) for r in repos],
            "created_at": min((r.created_at for r in repos), default=""),
            "updated_at": max((r.updated_at for r in repos), default="")}


@routes.get("/runbooks/configurations", "The organization's runbook repositories (admins); 404 when none",
            response=CONFIGURATION_OUT)
async def get_configuration(request: web.Request) -> web.Response:
    admin = require_admin(request)
    repos = await services_of(request).store.list_runbook_repositories(admin.org_id)
    if not repos:
        raise ApiError(404, "runbook configuration not found")
    return ok(_configuration(admin.org_id, repos))


@routes.put("/runbooks/configurations", "Replace the organization's runbook repositories (admins)",
            body=CONFIGURATION, response=CONFIGURATION_OUT)
async def put_configuration(request: web.Request) -> web.Response:
    admin = require_admin(request)
    body = await json_body(request, CONFIGURATION)
    existing = await _existing(request)
    repos = [_build_repository(request, item, existing, f"repositories[{i}].")
             for i, item in enumerate(body["repositories"])]
    names = [r.repository for r in repos]
    if len(set(names)) != len(names):
        raise ApiError(400, "duplicate git repository URLs (and branches) are not allowed")
    services = services_of(request)
    await services.store.replace_runbook_repositories(admin.org_id, repos)
    for repo in [*existing.values(), *repos]:
        services.runbooks.forget(repo)
    return ok(_configuration(admin.org_id, repos))


@routes.post("/runbooks/configurations", "Add a runbook repository (admins)", body=REPOSITORY, status=201,
             response=REPOSITORY_OUT)
async def create_repository(request: web.Request) -> web.Response:
    require_admin(request)
    body = await json_body(request, REPOSITORY)
    repo = _build_repository(request, body, {})
    try:
        await services_of(request).store.save_runbook_repository(repo, create=True)
    except Conflict:
        raise ApiError(409, f"runbook repository {repo.repository!r} is configured already") from None
    return ok(repository_json(repo), status=201)


@routes.put("/runbooks/configurations/{id}", "Change a runbook repository (admins); the id is its URL's",
            body=REPOSITORY, response=REPOSITORY_OUT)
async def update_repository(request: web.Request) -> web.Response:
    require_admin(request)
    body = await json_body(request, REPOSITORY)
    existing = await _existing(request)
    key = request.match_info["id"]
    if key not in existing:
        raise ApiError(404, f"runbook repository {key!r} not found")
    repo = _build_repository(request, body, existing)
    if repo.id != key:
        raise ApiError(400, "git url in the path and body do not match")
    services = services_of(request)
    await services.store.save_runbook_repository(repo, create=False)
    services.runbooks.forget(repo)
    return ok(repository_json(repo))


@routes.delete("/runbooks/configurations/{id}", "Remove a runbook repository (admins)", status=204)
async def delete_repository(request: web.Request) -> web.Response:
    admin = require_admin(request)
    existing = await _existing(request)
    key = request.match_info["id"]
    services = services_of(request)
    if not await services.store.delete_runbook_repository(admin.org_id, key):
        raise ApiError(404, f"runbook repository {key!r} not found")
    services.runbooks.forget(existing[key])
    return web.Response(status=204)


# --------------------------------------------------------------------------- rules


def rule_json(rule: RunbookRule) -> dict[str, Any]:
    return {"id": rule.id, "org_id": rule.org_id, "name": rule.name, "description": rule.description,
            "runbooks": rule.runbooks, "connections": rule.connections, "user_groups": rule.user_groups,
            "created_at": rule.created_at, "updated_at": rule.updated_at}


def _build_rule(body: dict[str, Any], org_id: str, existing: RunbookRule | None) -> RunbookRule:
    now = rfc3339(utcnow())
    files = [{"repository": f["repository"], "name": f["name"]} for f in body["runbooks"]]
    return RunbookRule(
        id=existing.id if existing else new_id(), org_id=org_id, name=body["name"].strip(),
        description=body.get("description") or "", runbooks=list({(f["repository"], f["name"]): f
                                                                   for f in files}.values()),
        connections=list(dict.fromkeys(body["connections"])), user_groups=list(dict.fromkeys(body["user_groups"])),
        created_at=existing.created_at if existing else now, updated_at=now)


async def _rule(request: web.Request) -> RunbookRule:
    key = request.match_info["id"]
    rule = await services_of(request).store.get_runbook_rule(user_of(request).org_id, key)
    if rule is None:
        raise ApiError(404, "runbook rule not found")
    return rule


@routes.get("/runbooks/rules", "Runbook rules: which groups may run which runbooks on which connections",
            response=array_of(RULE_OUT))
async def list_rules(request: web.Request) -> web.Response:
    rules = await services_of(request).store.list_runbook_rules(user_of(request).org_id)
    return ok([rule_json(r) for r in rules])


@routes.get("/runbooks/rules/{id}", "A runbook rule (by id or name)", response=RULE_OUT)
async def get_rule(request: web.Request) -> web.Response:
    return ok(rule_json(await _rule(request)))


@routes.post("/runbooks/rules", "Create a runbook rule (admins)", body=RULE, status=201, response=RULE_OUT)
async def create_rule(request: web.Request) -> web.Response:
    admin = require_admin(request)
    rule = _build_rule(await json_body(request, RULE), admin.org_id, None)
    try:
        await services_of(request).store.save_runbook_rule(rule, create=True)
    except Conflict:
        raise ApiError(409, f"runbook rule {rule.name!r} already exists") from None
    return ok(rule_json(rule), status=201)


@routes.put("/runbooks/rules/{id}", "Replace a runbook rule (admins)", body=RULE, response=RULE_OUT)
async def update_rule(request: web.Request) -> web.Response:
    admin = require_admin(request)
    existing = await _rule(request)
    rule = _build_rule(await json_body(request, RULE), admin.org_id, existing)
    try:
        await services_of(request).store.save_runbook_rule(rule, create=False)
    except Conflict:
        raise ApiError(409, f"runbook rule {rule.name!r} already exists") from None
    return ok(rule_json(rule))


@routes.delete("/runbooks/rules/{id}", "Delete a runbook rule (admins)", status=204)
async def delete_rule(request: web.Request) -> web.Response:
    admin = require_admin(request)
    rule = await _rule(request)
    await services_of(request).store.delete_runbook_rule(admin.org_id, rule.id)
    return web.Response(status=204)


# --------------------------------------------------------------------------- listing


class Library:
    """What one caller may see and run: the organization's repositories, rules, connections that run scripts."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.services = services_of(request)
        self.user = user_of(request)

    async def load(self) -> "Library":
        store, org_id = self.services.store, self.user.org_id
        self.repositories = await store.list_runbook_repositories(org_id)
        self.rules = await store.list_runbook_rules(org_id)
        self.connections = [c for c in await store.list_connections(org_id)
                            if c.subtype in self.services.script_runners]
        self.folders: dict[str, list[str]] = {}  # the runbooks plugin's setting per connection: its folders
        plugin = await store.get_plugin(org_id, "runbooks")
        if plugin is not None:
            names = {c.id: c.name for c in self.connections}
            for link in await store.list_plugin_connections(org_id, plugin.id):
                if link.connection_id in names:
                    self.folders[names[link.connection_id]] = link.config
        return self

    def connections_for(self, repository: str, name: str, only: str | None = None) -> list[str]:
        """The connections the caller may run this runbook on."""
        return [c.name for c in self.connections
                if (only is None or c.name == only) and in_folders(name, self.folders.get(c.name, ()))
                and may_run(self.rules, self.user, repository, name, c.name)]

    async def catalogs(self, refresh: bool = False) -> tuple[list[tuple[RunbookRepository, Catalog]], list[str]]:
        """Each repository's runbooks at its branch's tip, and what could not be read (per repository)."""
        found, errors = [], []
        tenant = _tenant(self.request)
        for repo in self.repositories:
            try:
                found.append((repo, await self.services.runbooks.catalog(repo, refresh=refresh, tenant=tenant)))
            except RunbookError as exc:
                errors.append(f"{repo.repository}: {exc.message}")
        return found, errors

    def items(self, catalog: Catalog, only: str | None, list_connections: bool, remove_empty: bool,
              with_repository: bool = False) -> list[dict[str, Any]]:
        items = []
        for name, file in sorted(catalog.files.items()):
            allowed = self.connections_for(catalog.repository, name, only)
            if remove_empty and not allowed:
                continue
            item: dict[str, Any] = {
                "name": name, "error": file.error,
                "metadata": {p.name: p.as_json() for p in file.template.parameters.values()} if file.template else {}}
            if list_connections:
                item["connections"] = allowed
            if with_repository:
                item["repository"] = catalog.repository
            items.append(item)
        return items


async def _connection(request: web.Request, name: str) -> Connection:
    connection = await services_of(request).store.get_connection(user_of(request).org_id, name)
    if connection is None:
        raise ApiError(404, f"connection {name!r} not found")
    return connection


@routes.get("/runbooks", "The runbooks of every repository the caller may run, by repository", query=LIST_QUERY,
            response=LIST_OUT)
async def list_runbooks(request: web.Request) -> web.Response:
    await _enabled(request)
    library = await Library(request).load()
    if not library.repositories:
        raise ApiError(404, "runbook configuration not found")
    q = request.query
    only = q.get("connection_name") or q.get("connection") or None
    if only is not None:
        await _connection(request, only)
    catalogs, errors = await library.catalogs(refresh=q.get("refresh") == "true")
    listed = [{"repository": c.repository, "commit": c.commit, "commit_author": c.author,
               "commit_message": c.message,
               "items": library.items(c, only, q.get("list_connections") == "true",
                                      q.get("remove_empty_connections") != "false")} for _, c in catalogs]
    answer: dict[str, Any] = {"errors": errors, "repositories": listed,
                              "items": [item for r in listed for item in r["items"]]}
    if listed:
        answer.update(commit=listed[0]["commit"], commit_author=listed[0]["commit_author"],
                      commit_message=listed[0]["commit_message"])
    return ok(answer)


async def _templates(request: web.Request, only: str | None) -> web.Response:
    await _enabled(request)
    library = await Library(request).load()
    if not library.repositories:
        raise ApiError(404, "plugin runbooks not found")
    catalogs, errors = await library.catalogs()
    if errors and not catalogs:
        raise ApiError(422, f"failed listing runbooks, reason={'; '.join(errors)}")
    items = [item for _, c in catalogs for item in library.items(c, only, True, True, with_repository=True)]
    first = catalogs[0][1] if catalogs else None
    return ok({"items": items, "commit": first.commit if first else "",
               "commit_author": first.author if first else "", "commit_message": first.message if first else ""})


@routes.get("/plugins/runbooks/templates", "The runbooks the caller may run (hoop.dev's first listing)",
            response=TEMPLATES_OUT)
async def list_templates(request: web.Request) -> web.Response:
    return await _templates(request, None)


@routes.get("/plugins/runbooks/connections/{name}/templates", "The runbooks the caller may run on a connection",
            response=TEMPLATES_OUT)
async def list_connection_templates(request: web.Request) -> web.Response:
    connection = await _connection(request, request.match_info["name"])
    return await _templates(request, connection.name)


# --------------------------------------------------------------------------- running


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for name, what in (("env_vars", "environment variables"), ("client_args", "client arguments"),
                       ("jira_fields", "Jira issues")):
        if body.get(name):
            raise ApiError(422, f"field '{name}': gatewayd's script runners take no {what}: leave it empty")


async def _run(request: web.Request, body: dict[str, Any], connection: Connection, repo: RunbookRepository,
               catalog: Catalog, library: Library) -> web.Response:
    name = body["file_name"]
    file = catalog.files.get(name)
    if file is None:
        raise ApiError(404, f"runbook file {name} not found on git repo")
    if not library.connections_for(catalog.repository, name, connection.name):
        raise ApiError(403, "access denied: user is not allowed to run this runbook on this connection")
    if file.template is None:
        raise ApiError(422, f"runbook {name} cannot be rendered: {file.error}")
    values = body.get("parameters") or {}
    try:
        rendered = render(file.template, values, LANGUAGES.get(connection.subtype, ""))
    except ParameterError as exc:
        raise ApiError(422, "parameters: " + "; ".join(f"{k}: {v}" for k, v in exc.problems.items())) from None
    described = {"repository": catalog.repository, "name": name, "commit": catalog.commit,
                 "parameters": rendered.shown_parameters(file.template)}
    request[AUDIT_PAYLOAD] = {"connection": connection.name, "runbook": described}
    metadata = {**(body.get("metadata") or {}), "runbook": described}
    return await start_script(request, connection, rendered.script, metadata=metadata,
                              batch_id=body.get("session_batch_id") or None, secrets=rendered.secrets,
                              audit={"runbook": described})


async def _exec_body(request: web.Request, schema: Schema) -> dict[str, Any]:
    """The body, kept for the audit log with every parameter's value hidden until the template says which are
    secret (a refusal before then is audited without them)."""
    body = await json_body(request, schema)
    shown = dict(body)
    if isinstance(body.get("parameters"), dict):
        shown["parameters"] = {k: REDACTED for k in body["parameters"]}
    request[AUDIT_PAYLOAD] = shown
    _refuse_unsupported(body)
    return body


@routes.post("/runbooks/exec", "Run a runbook on a connection (as POST /sessions: 202 when it needs a review)",
             body=EXEC, response=SCRIPT_RESULT_OUT, other_responses={202: SCRIPT_RESULT_OUT})
async def exec_runbook(request: web.Request) -> web.Response:
    await _enabled(request)
    body = await _exec_body(request, EXEC)
    connection = await _connection(request, body["connection_name"])
    library = await Library(request).load()
    wanted = body["repository"]
    repo = next((r for r in library.repositories if wanted in (r.repository, r.id, r.git_url)), None)
    if repo is None:
        raise ApiError(404, f"runbook repository {wanted} not found")
    catalog = await _catalog(request, repo, body.get("ref_hash"))
    return await _run(request, body, connection, repo, catalog, library)


async def _catalog(request: web.Request, repo: RunbookRepository, ref: str | None) -> Catalog:
    runbooks, tenant = services_of(request).runbooks, _tenant(request)
    try:
        if ref:
            return await runbooks.at_commit(repo, ref, tenant=tenant)
        return await runbooks.catalog(repo, tenant=tenant)
    except RunbookError as exc:
        raise _error(exc) from None


@routes.post("/plugins/runbooks/connections/{name}/exec", "Run a runbook on this connection (hoop.dev's first "
             "form: the runbook is found in whichever repository has it)", body=PLUGIN_EXEC,
             response=SCRIPT_RESULT_OUT, other_responses={202: SCRIPT_RESULT_OUT})
async def exec_connection_runbook(request: web.Request) -> web.Response:
    await _enabled(request)
    connection = await _connection(request, request.match_info["name"])
    body = await _exec_body(request, PLUGIN_EXEC)
    library = await Library(request).load()
    if not library.repositories:
        raise ApiError(404, "plugin runbooks not found")
    holders = []
    for repo in library.repositories:
        try:
            catalog = await _catalog(request, repo, body.get("ref_hash"))
        except ApiError:
            continue
        if body["file_name"] in catalog.files:
            holders.append((repo, catalog))
    if not holders:
        raise ApiError(404, f"runbook file {body['file_name']} not found")
    if len(holders) > 1:
        raise ApiError(409, f"runbook file {body['file_name']} is in several repositories "
                            f"({', '.join(c.repository for _, c in holders)}): name one with POST /api/runbooks/exec")
    repo, catalog = holders[0]
    return await _run(request, body, connection, repo, catalog, library)
