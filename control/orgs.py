"""Organization management: the organization's API key, its feature switches and its service accounts."""

from __future__ import annotations

from typing import Any

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
from control.schemas import STRINGS, TEXT
from control.users import end_sessions_of
from gatewayd import features
from gatewayd.apikeys import ORG, RESERVED_SUBJECT
from gatewayd.identity import org_subject
from gatewayd.models import User, new_id, rfc3339, utcnow
from gatewayd.store import Conflict

routes = RouteSet("Organization Management", audit="orgs")

KEY_OUT = Schema("OrgKey", {
    "id": TEXT, "key": Field("string", True, nullable=True,
                             description="the key itself: in the answer that made it only, else null"),
    "key_prefix": TEXT, "created_at": TEXT, "created_by": TEXT,
    "last_used_at": Field("string", True, nullable=True),
    "service_account": Field("string", True, description="the subject the key authenticates as"),
})
FEATURE = Schema("FeatureRequest", {
    "name": Field("string", True, enum=tuple(features.DEFAULTS)),
    "status": Field("string", True, enum=(features.ENABLED, features.DISABLED))})
FEATURE_OUT = Schema("Feature", {
    "name": TEXT, "status": Field("string", True, enum=(features.ENABLED, features.DISABLED)),
    "description": TEXT})
SERVICE_ACCOUNT_FIELDS = {
    "name": Field("string"), "status": Field("string", True, enum=("active", "inactive")),
    "groups": Field("array", items="string")}
SERVICE_ACCOUNT = Schema("ServiceAccountCreate", {
    "subject": Field("string", True, min_length=1, description="the identity provider's subject (its client "
                                                               "credentials' sub); immutable. In multi-tenant mode "
                                                               "it is kept as <org id>/<subject>, the sub the "
                                                               "client's tokens carry"),
    **SERVICE_ACCOUNT_FIELDS})
SERVICE_ACCOUNT_UPDATE = Schema("ServiceAccountUpdate", SERVICE_ACCOUNT_FIELDS)
SERVICE_ACCOUNT_OUT = Schema("ServiceAccount", {
    "id": TEXT, "org_id": TEXT, "subject": TEXT, "name": TEXT,
    "status": Field("string", True, enum=("active", "inactive")), "groups": STRINGS})


# --------------------------------------------------------------------------- the organization's key


def _key_json(key: Any, subject: str, secret: str | None = None) -> dict[str, Any]:
    return {"id": key.id, "key": secret, "key_prefix": key.prefix, "created_at": key.created_at,
            "created_by": key.created_by, "last_used_at": key.last_used_at, "service_account": subject}


async def _subject(request: web.Request, user_id: str) -> str:
    found = await services_of(request).store.get_user(id=user_id)
    return found.subject if found else ""


@routes.post("/orgs/keys", "Make the organization's API key (admins): shown in this answer only", status=201,
             response=KEY_OUT)
async def create_key(request: web.Request) -> web.Response:
    admin = require_admin(request)
    services = services_of(request)
    try:
        secret, key = await services.identity.keys.issue(admin.org_id, ORG, admin.email)
    except Conflict:
        raise ApiError(409, "organization token already exists: revoke it first (DELETE /api/orgs/keys)") from None
    request[AUDIT_PAYLOAD] = {"key_id": key.id, "key_prefix": key.prefix}
    return ok(_key_json(key, await _subject(request, key.user_id), secret), status=201)


@routes.get("/orgs/keys", "The organization's API key, without its secret (admins)", response=KEY_OUT)
async def get_key(request: web.Request) -> web.Response:
    admin = require_admin(request)
    keys = await services_of(request).store.api_keys_of(admin.org_id, ORG, "active")
    if not keys:
        raise ApiError(404, "organization token not found")
    return ok(_key_json(keys[0], await _subject(request, keys[0].user_id)))


@routes.delete("/orgs/keys", "Revoke the organization's API key (admins)", status=204)
async def revoke_key(request: web.Request) -> web.Response:
    admin = require_admin(request)
    store = services_of(request).store
    keys = await store.api_keys_of(admin.org_id, ORG, "active")
    if not keys:
        raise ApiError(404, "organization token not found")
    await store.revoke_api_keys(admin.org_id, ORG, rfc3339(utcnow()))
    request[AUDIT_PAYLOAD] = {"key_id": keys[0].id, "key_prefix": keys[0].prefix}
    return web.Response(status=204)


# --------------------------------------------------------------------------- features


def _features_json(statuses: dict[str, str]) -> list[dict[str, str]]:
    return [{"name": name, "status": status, "description": features.DESCRIPTIONS[name]}
            for name, status in statuses.items()]


@routes.get("/orgs/features", "The organization's feature switches", response=array_of(FEATURE_OUT))
async def list_features(request: web.Request) -> web.Response:
    return ok(_features_json(await features.statuses(services_of(request).store, user_of(request).org_id)))


@routes.put("/orgs/features", "Switch a feature on or off for the organization (admins)", body=FEATURE,
            response=array_of(FEATURE_OUT))
async def update_feature(request: web.Request) -> web.Response:
    admin = require_admin(request)
    body = await json_body(request, FEATURE)
    request[AUDIT_ACTION] = f"feature.{'enable' if body['status'] == features.ENABLED else 'disable'}"
    statuses = await features.set_status(services_of(request).store, admin.org_id, body["name"], body["status"])
    return ok(_features_json(statuses))


# --------------------------------------------------------------------------- service accounts


def _account_json(user: User) -> dict[str, Any]:
    return {"id": user.id, "org_id": user.org_id, "subject": user.subject, "name": user.name,
            "status": user.status, "groups": user.groups}


@routes.get("/serviceaccounts", "The organization's service accounts", response=array_of(SERVICE_ACCOUNT_OUT))
async def list_service_accounts(request: web.Request) -> web.Response:
    admin = require_admin(request)
    users = await services_of(request).store.list_users(admin.org_id)
    return ok([_account_json(u) for u in users if u.service_account])


@routes.post("/serviceaccounts", "Create a service account (admins): an identity provider's client, by subject",
             body=SERVICE_ACCOUNT, status=201, response=SERVICE_ACCOUNT_OUT)
async def create_service_account(request: web.Request) -> web.Response:
    admin = require_admin(request)
    body = await json_body(request, SERVICE_ACCOUNT)
    given = subject = body["subject"].strip()
    if not subject or subject.startswith(RESERVED_SUBJECT) or any(c.isspace() for c in subject):
        raise ApiError(422, f"field 'subject': expected the identity provider's subject, without spaces, "
                            f"not starting with {RESERVED_SUBJECT}")
    services = services_of(request)
    store = services.store
    subject = org_subject(services.config["auth.multi_tenant"], admin.org_id, subject)
    if await store.get_user(subject=subject) is not None:  # in multi-tenant mode: of this organization only
        raise ApiError(409, f"subject {subject!r} is taken")
    user = User(id=new_id(), org_id=admin.org_id, subject=subject, name=body.get("name") or given,
                email=f"{new_id()}@serviceaccount.invalid", status=body["status"], service_account=True)
    user.grant_groups(body.get("groups") or [])
    try:
        await store.save_user(user)
    except Conflict:
        raise ApiError(409, f"subject {subject!r} is taken") from None
    return ok(_account_json(user), status=201)


@routes.put("/serviceaccounts/{subject}", "Change a service account's name, status or groups (admins)",
            body=SERVICE_ACCOUNT_UPDATE, response=SERVICE_ACCOUNT_OUT)
async def update_service_account(request: web.Request) -> web.Response:
    admin = require_admin(request)
    body = await json_body(request, SERVICE_ACCOUNT_UPDATE)
    services = services_of(request)
    store = services.store
    key = request.match_info["subject"]
    user = (await store.get_user(subject=org_subject(services.config["auth.multi_tenant"], admin.org_id, key))
            or await store.get_user(subject=key) or await store.get_user(id=key))
    if user is None or user.org_id != admin.org_id or not user.service_account:
        raise ApiError(404, f"service account {key!r} not found")
    if user.operator and not services_of(request).identity.is_operator(admin):
        raise ApiError(403, "access denied: the server API key's account is changed by operators only")
    if body.get("name"):
        user.name = body["name"]
    was_active, user.status = user.status == "active", body["status"]
    if body.get("groups") is not None:
        user.grant_groups(body["groups"])
    await store.save_user(user)
    if was_active and user.status != "active":  # its live sessions end, as a person's do
        await end_sessions_of(request, user, "deactivated")
    return ok(_account_json(user))
