"""Users and groups (admin only)."""

from __future__ import annotations

import dataclasses

from aiohttp import web

from control.auth import USER_OUT, user_json
from control.http import (
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
from gatewayd.crypto import MIN_PASSWORD_LENGTH
from gatewayd.identity import org_subject
from gatewayd.models import ADMIN_GROUP, User, email_problem, new_id
from gatewayd.store import Conflict

routes = RouteSet("User Management", audit="users")

USER_FIELDS = {
    "email": Field("string", True), "name": Field("string"), "status": Field("string", enum=("active", "inactive")),
    "groups": Field("array", items="string"),
    "password": Field("string", min_length=MIN_PASSWORD_LENGTH,
                      description="a local password; setting it signs the user out everywhere (existing tokens "
                                  "are revoked)"),
    "slack_id": Field("string"),
    "picture": Field("string"),
}
USER_CREATE = Schema("UserCreate", USER_FIELDS)
USER_UPDATE = Schema("UserUpdate", {**USER_FIELDS, "email": Field("string")})
GROUP_CREATE = Schema("GroupCreate", {"name": Field("string", True)})


async def _find(request: web.Request) -> User:
    services = services_of(request)
    key = request.match_info["id"]
    org_id = require_admin(request).org_id
    for user in (await services.store.get_user(id=key), await services.store.get_user(email=key, org_id=org_id),
                 await services.store.get_user(subject=key)):
        if user is not None and user.org_id == org_id:
            return user
    raise ApiError(404, f"user {key!r} not found")


def local_subject(multi_tenant: bool, org_id: str | None, email: str) -> str:
    """The subject of a user an admin creates by e-mail: the e-mail (single-tenant mode: one organization, and a
    sign-in may claim it, see Identity); in multi-tenant mode, the e-mail within its organization, so that an
    organization holding an e-mail neither blocks another from holding it too nor tells that it does, and
    never stands in the way of a provider whose subjects are e-mails."""
    return org_subject(multi_tenant, org_id, email.lower())


def _check_email(body: dict) -> None:
    if body.get("email") is not None and (problem := email_problem(body["email"])):
        raise ApiError(422, f"field 'email': {problem}")


def _guard_operator(request: web.Request, user: User) -> None:
    """An operator's account (password, e-mail, status, deletion) is changed by operators only: an organization
    admin who could reset it would log in as the operator."""
    if user.operator and not services_of(request).identity.is_operator(user_of(request)):
        raise ApiError(403, f"access denied: {user.email} is an operator of the gateway; only an operator may "
                            "change or delete that account")


async def _keep_an_admin(request: web.Request, user: User, after: User | None) -> None:
    """409 when ``user`` is the last active admin of its organization and ``after`` (None: deleted) is not."""
    if not (user.is_admin and user.status == "active") or (after and after.is_admin and after.status == "active"):
        return
    others = [u for u in await services_of(request).store.list_users(user.org_id or "")
              if u.id != user.id and u.is_admin and u.status == "active" and not u.service_account]
    if not others:
        what = "delete" if after is None else "deactivate or demote"
        raise ApiError(409, f"cannot {what} {user.email}: the last active admin of the organization "
                            "(make another user an admin first)")


async def _apply(request: web.Request, user: User, body: dict) -> None:
    """Copy the body's fields onto ``user``; a new password is hashed off the event loop."""
    for name in ("email", "name", "status", "slack_id", "picture"):
        if body.get(name) is not None:
            setattr(user, name, body[name])
    if body.get("groups") is not None:
        user.grant_groups(body["groups"])
    if body.get("password"):
        user.password_hash = await services_of(request).identity.passwords.hash(body["password"])


async def end_sessions_of(request: web.Request, user: User, what: str) -> None:
    """End every live session of ``user`` (deactivated or deleted: ``what``) in its organization, on every node, as
    a kill does: the reason is each session's last ``e`` event, and the call's audit entry names it (NotConfirmed
    when a node holding one does not confirm it ended it)."""
    reason = f"the user was {what} by {user_of(request).email}: the session was closed"
    request[AUDIT_PAYLOAD] = {**(request.get(AUDIT_PAYLOAD) or {}), "user": user.email, "sessions_ended": reason}
    await services_of(request).sessions.end(reason, user=user)


@routes.get("/users", "List the organization's users", response=array_of(USER_OUT))
async def list_users(request: web.Request) -> web.Response:
    admin = require_admin(request)
    users = await services_of(request).store.list_users(admin.org_id)
    return ok([user_json(u) for u in users if not u.service_account])  # those are in /serviceaccounts


@routes.post("/users", "Create a user", body=USER_CREATE, status=201, response=USER_OUT)
async def create(request: web.Request) -> web.Response:
    admin = require_admin(request)
    body = await json_body(request, USER_CREATE)
    _check_email(body)
    services = services_of(request)
    store = services.store
    if await store.get_user(email=body["email"], org_id=admin.org_id):  # this organization's only: no oracle
        raise ApiError(409, f"a user with email {body['email']!r} already exists")
    user = User(id=new_id(), org_id=admin.org_id, subject=local_subject(services.config["auth.multi_tenant"], admin.org_id, body["email"]),
                email=body["email"])
    await _apply(request, user, body)
    try:
        await store.save_user(user)
    except Conflict:
        raise ApiError(409, f"a user with email {body['email']!r} already exists") from None
    return ok(user_json(user), status=201)


@routes.get("/users/groups", "List groups", response=array_of("string"))
async def list_groups(request: web.Request) -> web.Response:
    admin = require_admin(request)
    return ok(await services_of(request).store.list_groups(admin.org_id))


@routes.post("/users/groups", "Create a group", body=GROUP_CREATE, status=201,
             response=Schema("Group", {"name": Field("string", True)}))
async def create_group(request: web.Request) -> web.Response:
    admin = require_admin(request)
    body = await json_body(request, GROUP_CREATE)
    name = body["name"].strip()
    if not name:
        raise ApiError(400, "field 'name' is required")
    try:
        await services_of(request).store.create_group(admin.org_id, name)
    except Conflict:
        raise ApiError(409, f"group {name!r} already exists") from None
    return ok({"name": name}, status=201)


@routes.delete("/users/groups/{name}", "Delete a group and its memberships", status=204)
async def delete_group(request: web.Request) -> web.Response:
    admin = require_admin(request)
    from gatewayd.store import NotFound

    if request.match_info["name"] == ADMIN_GROUP:
        raise ApiError(409, "the admin group cannot be deleted: it would demote every admin of the organization")
    try:
        await services_of(request).store.delete_group(admin.org_id, request.match_info["name"])
    except NotFound:
        raise ApiError(404, f"group {request.match_info['name']!r} not found") from None
    return web.Response(status=204)


@routes.get("/users/{id}", "A user by id, email or subject", response=USER_OUT)
async def get(request: web.Request) -> web.Response:
    return ok(user_json(await _find(request)))


@routes.put("/users/{id}", "Update a user (status, groups, password...)", body=USER_UPDATE, response=USER_OUT)
async def update(request: web.Request) -> web.Response:
    user = await _find(request)
    body = await json_body(request, USER_UPDATE)
    _guard_operator(request, user)
    _check_email(body)
    before = dataclasses.replace(user, groups=list(user.groups))
    await _apply(request, user, body)
    await _keep_an_admin(request, before, user)
    services = services_of(request)
    try:
        await services.store.save_user(user)
    except Conflict:
        raise ApiError(409, f"a user with email {user.email!r} already exists") from None
    if body.get("password"):  # whoever knew the old password may hold a token: it ends with it
        await services.identity.revoke_tokens_of(user)
    if before.status == "active" and user.status != "active":  # cut off at once, not at the next sign-in
        await end_sessions_of(request, user, "deactivated")
    return ok(user_json(user))


@routes.delete("/users/{id}", "Delete a user", status=204)
async def delete(request: web.Request) -> web.Response:
    user = await _find(request)
    _guard_operator(request, user)
    await _keep_an_admin(request, user, None)
    await services_of(request).store.delete_user(user.id)
    await end_sessions_of(request, user, "deleted")
    return web.Response(status=204)
