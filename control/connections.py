"""Connections (the roles of resources) and native-access credentials."""

from __future__ import annotations

import uuid
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from control.http import (
    AUDIT_ACTION,
    AUDIT_PAYLOAD,
    ApiError,
    Field,
    RouteSet,
    Schema,
    array_of,
    json_body,
    ok,
    require_admin,
    services_of,
    user_of,
)
from control.schemas import JIT_PENDING_OUT
from gatewayd import protocols
from gatewayd.access import credential_prefix
from gatewayd.audit import REDACTED
from gatewayd.config import split_listen
from gatewayd.models import AccessRequestRule, Connection, User, new_id, rfc3339, utcnow
from gatewayd.protocols import session_for
from gatewayd.reviews import JIT, NS, REVIEW_SETTINGS, check_review_settings, review_json, review_summary
from gatewayd.services import Services
from gatewayd.store import Conflict

routes = RouteSet("Connections", audit="connections")

CONNECTION_FIELDS = {
    "name": Field("string", True), "type": Field("string", True), "subtype": Field("string"),
    "resource_name": Field("string"), "agent_id": Field("string"), "command": Field("array", items="string"),
    "secret": Field("object"), "tags": Field("object"), "settings": Field("object"),
    "reviewers": Field("array", items="string", description="groups that review access (settings.reviewers)"),
}
CONNECTION = Schema("Connection", CONNECTION_FIELDS)
MAX_DURATION_SECONDS = 10 * 366 * 86400  # ten years: the longest access anyone may ask for or configure
CREDENTIALS = Schema("CredentialsRequest", {"access_duration_seconds": Field(
    "integer", minimum=1, maximum=MAX_DURATION_SECONDS,
    description="seconds; at most sessions.max_credential_duration, or the connection's longest jit access"),
    "reason": Field("string", nullable=True, description="why you ask (shown to the reviewers of a jit request)")})
DEFAULT_ACCESS_SECONDS = 3600
DEFAULT_JIT_SECONDS = 1800  # the spec's default jit access_duration (30 minutes)

_TEXT = Field("string", True)
_STRINGS = Field("array", True, items="string")
CONNECTION_OUT = Schema("ConnectionOut", {
    "id": _TEXT, "name": _TEXT, "type": _TEXT, "subtype": _TEXT, "resource_name": _TEXT, "agent_id": _TEXT,
    "command": _STRINGS, "tags": Field("object", True), "settings": Field("object", True), "reviewers": _STRINGS,
    "created_at": _TEXT, "updated_at": _TEXT, "secret": Field(
        "object", description="admins only: where the target is (HOST, PORT, USER, DB, ...); what logs in to it "
                              "(PASS, PRIVATE_KEY, ...) is never shown: [REDACTED], and sent back as such, kept"),
    "status": Field("string", description="online or offline: a connection served by an agent is online while "
                                          "its agent is connected; one the gateway reaches itself is online"),
    "review_policy": Field("object", schema=Schema("ReviewPolicy", {
        kind: Field("object", True, nullable=True, schema=Schema("ReviewNeeded", {
            "reviewers": _STRINGS, "min_approvals": Field("integer", True, minimum=1),
            "rule": Field("string", True, nullable=True)}), description=what)
        for kind, what in (("jit", "native access (credentials) needs this review; null: none"),
                           ("exec", "scripts need this review; null: none"))}),
        description="who reviews access, from the access request rules or the connection's settings"),
})
NATIVE_ACCESS = Schema("ConnectionCredentials", {
    name: Field("string") for name in ("hostname", "port", "username", "password", "database_name",
                                       "connection_string", "command", "proxy_token", "url", "origin", "header")})
CREDENTIALS_OUT = Schema("Credentials", {
    "id": _TEXT, "connection_name": _TEXT, "connection_type": _TEXT, "connection_subtype": _TEXT,
    "session_id": _TEXT, "review_id": Field("string"), "expire_at": _TEXT, "created_at": _TEXT,
    "has_review": Field("boolean", True), "connection_credentials": Field("object", True, schema=NATIVE_ACCESS),
})


def connection_status(services: Services, conn: Connection) -> str:
    """``online`` or ``offline``, from its agent's presence (a connection without an agent is online)."""
    if not conn.agent_id:
        return "online"
    return "online" if services.agents is not None and services.agents.online(conn.org_id, conn.agent_id) else "offline"


# Settings of a role secret an admin may read back: where the target is and how it is checked. Anything else (PASS,
# PRIVATE_KEY, a setting this list does not know yet) is withheld: no answer carries what logs in to a target.
SHOWN_TARGET_SETTINGS = frozenset({"HOST", "PORT", "USER", "DB", "SSLMODE", "INSECURE", "DOMAIN", "NLA", "HOST_KEY",
                                   "REMOTE_URL"})


def _setting_name(key: str) -> str:
    return key.split(":", 1)[1] if key.startswith("envvar:") else key


def shown_secret(conn: Connection) -> dict[str, str]:
    """The role secret as an admin reads it: the settings of ``SHOWN_TARGET_SETTINGS`` as stored (base64), every
    other value ``[REDACTED]`` (a ``REMOTE_URL`` with a password in it too)."""
    target = conn.target()
    shown = {}
    for key, value in conn.secret.items():
        name = _setting_name(key)
        visible = name in SHOWN_TARGET_SETTINGS and not (name == "REMOTE_URL" and "@" in urlsplit(target[name]).netloc)
        shown[key] = value if visible else REDACTED
    return shown


def _kept_secret(secret: dict[str, str], existing: Connection | None, where: str) -> dict[str, str]:
    """``secret`` with each ``[REDACTED]`` value (what an answer showed in place of a stored one) replaced by the
    stored value, so that a connection read and sent back unchanged keeps its password or key."""
    kept = dict(secret)
    for key, value in secret.items():
        if value != REDACTED:
            continue
        if existing is None or key not in existing.secret:
            raise ApiError(422, f"field '{where}.{key}': {REDACTED} stands for the stored value, and there is none")
        kept[key] = existing.secret[key]
    return kept


def connection_json(conn: Connection, viewer: User, services: Services | None = None,
                    rules: list[AccessRequestRule] | None = None) -> dict[str, Any]:
    """A connection as the API shows it; with ``gateway``, its ``status`` too; with the organization's access
    request ``rules``, its ``review_policy`` (who reviews what, from the rules or its settings)."""
    data: dict[str, Any] = {
        "id": conn.id, "name": conn.name, "type": conn.type, "subtype": conn.subtype,
        "resource_name": conn.resource_name, "agent_id": conn.agent_id, "command": conn.command,
        "tags": conn.tags, "settings": conn.settings, "reviewers": list(conn.settings.get("reviewers") or []),
        "created_at": conn.created_at, "updated_at": conn.updated_at,
    }
    if rules is not None:
        data["review_policy"] = review_summary(conn, rules)
    if viewer.is_admin:
        data["secret"] = shown_secret(conn)
    if services is not None:
        data["status"] = connection_status(services, conn)
    return data


def check_secret(secret: Any, where: str) -> dict[str, str]:
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in secret.items()):
        raise ApiError(422, f"field '{where}': keys and values must be strings (\"envvar:KEY\": base64)")
    return dict(secret)


CONNECTION_SETTINGS = (*REVIEW_SETTINGS, "recording_mode")  # a connection's ``settings`` of any protocol


def unknown_setting(settings: dict[str, Any], description: protocols.ProtocolDescription | None) -> str | None:
    """Why ``settings`` has a key no one reads, or None: ``CONNECTION_SETTINGS`` and the protocol's own object
    (``settings.<name>``, its ``connection_settings``). A misspelled key did nothing, silently: ``reveiwers`` left
    the connection without the review its admin asked for."""
    own = {description.name: description.connection_settings} if description is not None else {}
    for key, value in settings.items():
        if key in CONNECTION_SETTINGS:
            continue
        if key not in own:
            known = ", ".join([*CONNECTION_SETTINGS, *own])
            return f"field 'settings.{key}': not a setting of this connection (its settings: {known})"
        for inner in value if isinstance(value, dict) else ():
            if inner not in own[key]:
                return (f"field 'settings.{key}.{inner}': not a setting of this connection "
                        f"(settings.{key} has: {', '.join(own[key]) or 'none'})")
    return None


def build_connection(body: dict[str, Any], org_id: str, resource_name: str, existing: Connection | None,
                     where: str = "") -> Connection:
    """A connection record from an API body, keeping id and creation time of the one it replaces."""
    now = rfc3339(utcnow())
    name = body["name"].strip()
    if not name or "/" in name:
        raise ApiError(422, f"field '{where}name': must be a non-empty name without '/'")
    settings = dict(body.get("settings") or (existing.settings if existing else {}))
    if body.get("reviewers") is not None:
        settings["reviewers"] = list(body["reviewers"])
    problem = check_review_settings(settings)
    if settings.get("recording_mode") not in (None, "async", "strict"):
        problem = "field 'settings.recording_mode': expected \"async\" or \"strict\""
    description = protocols.by_subtype(body.get("subtype") or body["type"])
    if problem is None:
        problem = unknown_setting(settings, description)
    if problem is None and description is not None and description.check_settings is not None:
        problem = description.check_settings(settings)
    if problem:
        raise ApiError(422, problem.replace("field '", f"field '{where}", 1))
    return Connection(
        id=existing.id if existing else new_id(), org_id=org_id, name=name, resource_name=resource_name,
        type=body["type"], subtype=body.get("subtype") or body["type"], agent_id=body.get("agent_id") or "",
        command=list(body.get("command") or []),
        secret=_kept_secret(check_secret(body.get("secret") or {}, f"{where}secret"), existing, f"{where}secret"),
        tags={str(k): str(v) for k, v in (body.get("tags") or {}).items()},
        settings=settings,
        created_at=existing.created_at if existing else now, updated_at=now,
    )


async def find_connection(request: web.Request) -> Connection:
    key = request.match_info["name"]
    conn = await services_of(request).store.get_connection(user_of(request).org_id, key)
    if conn is None:
        raise ApiError(404, f"connection {key!r} not found")
    return conn


@routes.get("/connections", "List connections", response=array_of(CONNECTION_OUT))
async def list_connections(request: web.Request) -> web.Response:
    user = user_of(request)
    store = services_of(request).store
    conns, rules = await store.list_connections(user.org_id), await store.list_access_rules(user.org_id)
    return ok([connection_json(c, user, services_of(request), rules) for c in conns])


@routes.post("/connections", "Create a connection", body=CONNECTION, status=201, response=CONNECTION_OUT)
async def create(request: web.Request) -> web.Response:
    admin = require_admin(request)
    body = await json_body(request, CONNECTION)
    conn = build_connection(body, admin.org_id, body.get("resource_name") or body["name"], None)
    try:
        await services_of(request).store.create_connection(conn)
    except Conflict:
        raise ApiError(409, f"connection {conn.name!r} already exists") from None
    return ok(connection_json(conn, admin, services_of(request)), status=201)


@routes.get("/connections/{name}", "A connection by name or id", response=CONNECTION_OUT)
async def get(request: web.Request) -> web.Response:
    rules = await services_of(request).store.list_access_rules(user_of(request).org_id)
    return ok(connection_json(await find_connection(request), user_of(request), services_of(request), rules))


@routes.put("/connections/{name}", "Replace a connection", body=CONNECTION, response=CONNECTION_OUT)
async def update(request: web.Request) -> web.Response:
    admin = require_admin(request)
    existing = await find_connection(request)
    body = await json_body(request, CONNECTION)
    if "secret" not in body:
        body["secret"] = existing.secret  # an update without a secret keeps the stored one
    conn = build_connection(body, admin.org_id, body.get("resource_name") or existing.resource_name, existing)
    services = services_of(request)
    try:
        await services.store.update_connection(conn)
    except Conflict:
        raise ApiError(409, f"connection {conn.name!r} already exists") from None
    await services.sessions.connection_changed(conn.id)  # its live sessions, on every node, take the change
    return ok(connection_json(conn, admin, services))


PATCH = Schema("ConnectionPatch", {
    **{name: Field(spec.type, items=spec.items, description=spec.description)
       for name, spec in CONNECTION_FIELDS.items()},
    "secret": Field("object", description="merged into the stored one: a key set to null is removed"),
    "tags": Field("object", description="merged into the stored ones: a key set to null is removed"),
    "settings": Field("object", description="merged into the stored ones: a key set to null is removed"),
})


def _merged(stored: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """``stored`` with ``changes`` applied key by key (JSON merge patch, one level): null removes a key."""
    merged = dict(stored)
    for key, value in changes.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    return merged


@routes.patch("/connections/{name}", "Change some fields of a connection (secret, tags and settings merged)",
              body=PATCH, response=CONNECTION_OUT)
async def patch(request: web.Request) -> web.Response:
    admin = require_admin(request)
    existing = await find_connection(request)
    changes = await json_body(request, PATCH)
    body: dict[str, Any] = {
        "name": existing.name, "type": existing.type, "subtype": existing.subtype, "agent_id": existing.agent_id,
        "command": existing.command, "resource_name": existing.resource_name}
    body.update({k: v for k, v in changes.items() if k not in ("secret", "tags", "settings")})
    body["secret"] = _merged(existing.secret, changes.get("secret") or {})
    body["tags"] = _merged(existing.tags, changes.get("tags") or {})
    body["settings"] = _merged(existing.settings, changes.get("settings") or {})
    conn = build_connection(body, admin.org_id, body.get("resource_name") or existing.resource_name, existing)
    services = services_of(request)
    try:
        await services.store.update_connection(conn)
    except Conflict:
        raise ApiError(409, f"connection {conn.name!r} already exists") from None
    await services.sessions.connection_changed(conn.id)
    return ok(connection_json(conn, admin, services))


TAG_OUT = Schema("ConnectionTag", {"id": _TEXT, "key": _TEXT, "value": _TEXT, "created_at": _TEXT,
                                   "updated_at": _TEXT})


@routes.get("/connection-tags", "Every tag (key and value) the organization's connections carry",
            response=Schema("ConnectionTagList", {"items": Field("array", True, items=TAG_OUT)}))
async def list_tags(request: web.Request) -> web.Response:
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for conn in await services_of(request).store.list_connections(user_of(request).org_id):
        for key, value in conn.tags.items():
            tag = found.setdefault((key, value), {
                "id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"connection-tag:{key}={value}")), "key": key,
                "value": value, "created_at": conn.created_at, "updated_at": conn.updated_at})
            tag["created_at"] = min(tag["created_at"], conn.created_at)
            tag["updated_at"] = max(tag["updated_at"], conn.updated_at)
    return ok({"items": [found[k] for k in sorted(found)]})


@routes.delete("/connections/{name}", "Delete a connection", status=204)
async def delete(request: web.Request) -> web.Response:
    admin = require_admin(request)
    conn = await find_connection(request)
    services = services_of(request)
    await services.store.delete_connection(admin.org_id, conn.id)
    services.guardrails.invalidate(announce=False)
    await services.sessions.connection_changed(conn.id, deleted_by=admin.email)  # its live sessions end
    return web.Response(status=204)


def native_access(services: Services, conn: Connection, secret: str) -> dict[str, Any]:
    """What the user types to reach ``conn`` through the gateway with ``secret``, in its protocol's words."""
    description = protocols.by_subtype(conn.subtype)
    if description is None:
        raise ApiError(400, f"connection subtype {conn.subtype!r} has no native access")
    address = services.node.server_config.get(description.server_config_key, {}).get("listen_address", "")
    host, port = split_listen(address) if address else ("", 0)
    if host in ("", "0.0.0.0", "::"):
        host = services.config.public_url.split("://", 1)[-1].rsplit(":", 1)[0]
    return description.access_hints(conn, secret, host, port, services.config.section(description.name))


@routes.post("/connections/{name}/credentials", "Short-lived credentials for native access", body=CREDENTIALS,
             status=201, audit="credentials", response=CREDENTIALS_OUT, other_responses={202: JIT_PENDING_OUT})
async def create_credentials(request: web.Request) -> web.Response:
    user = user_of(request)
    conn = await find_connection(request)
    body = await json_body(request, CREDENTIALS)
    services = services_of(request)
    try:
        credential_prefix(conn)
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None
    policy = await services.reviews.policy(conn, JIT)
    if policy is not None:  # just-in-time: a review first, credentials once it is approved
        duration = body.get("access_duration_seconds", DEFAULT_JIT_SECONDS)
        if not 1 <= duration <= policy.max_duration_seconds:
            raise ApiError(422, f"field 'access_duration_seconds': must be between 1 and "
                                f"{policy.max_duration_seconds} (the connection's longest jit access)")
        session = session_for(user, conn, status="ready")
        # one open request per person and connection: asking again (a Ctrl-C, a second click) gets it back
        review = await services.reviews.request(policy, user, conn, session, JIT, duration * NS,
                                               reason=body.get("reason") or "")
        request[AUDIT_ACTION] = "review.request"
        request[AUDIT_PAYLOAD] = {**body, "connection": conn.name, "session_id": review.session_id,
                                  "review_id": review.id, "type": JIT, "reviewers": policy.reviewers}
        return ok({"session_id": review.session_id, "review_id": review.id, "has_review": True,
                   "connection_name": conn.name, "connection_type": conn.type,
                   "connection_subtype": conn.subtype, "review": review_json(review)}, status=202)
    maximum = int(services.config["sessions.max_credential_duration"])
    duration = body.get("access_duration_seconds", DEFAULT_ACCESS_SECONDS)
    if not 1 <= duration <= maximum:
        raise ApiError(422, f"field 'access_duration_seconds': must be between 1 and {maximum}")
    issued = await services.access.issue(user, conn, duration)
    cred = issued.credential
    return ok({
        "id": cred.id, "connection_name": conn.name, "connection_type": conn.type,
        "connection_subtype": conn.subtype, "session_id": cred.session_id, "expire_at": cred.expire_at,
        "created_at": cred.created_at, "has_review": False,
        "connection_credentials": native_access(services, conn, issued.secret),
    }, status=201)
