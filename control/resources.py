"""Resources: named targets whose roles become connections."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from control.connections import CONNECTION_OUT, build_connection, connection_json
from control.http import (
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
from control.schemas import OBJECT, TEXT
from gatewayd.models import Resource, new_id, rfc3339, utcnow
from gatewayd.store import Conflict

routes = RouteSet("Resources", audit="resources")

ROLE = Schema("Role", {
    "name": Field("string", True), "type": Field("string", True), "subtype": Field("string"),
    "agent_id": Field("string"), "command": Field("array", items="string"), "secret": Field("object"),
    "tags": Field("object"), "settings": Field("object"),
})
RESOURCE = Schema("Resource", {
    "name": Field("string", True), "type": Field("string", True), "subtype": Field("string"),
    "agent_id": Field("string"), "env_vars": Field("object"), "roles": Field("array", items=ROLE),
})


_RESOURCE_OUT_FIELDS = {"id": TEXT, "name": TEXT, "type": TEXT, "subtype": TEXT, "agent_id": TEXT,
                        "env_vars": OBJECT, "created_at": TEXT, "updated_at": TEXT}
RESOURCE_OUT = Schema("ResourceOut", _RESOURCE_OUT_FIELDS)
RESOURCE_ROLES_OUT = Schema("ResourceWithRoles", {**_RESOURCE_OUT_FIELDS,
                                                  "roles": Field("array", True, items=CONNECTION_OUT)})


def resource_json(res: Resource) -> dict[str, Any]:
    return {"id": res.id, "name": res.name, "type": res.type, "subtype": res.subtype, "agent_id": res.agent_id,
            "env_vars": res.env_vars, "created_at": res.created_at, "updated_at": res.updated_at}


async def _find(request: web.Request) -> Resource:
    name = request.match_info["name"]
    res = await services_of(request).store.get_resource(user_of(request).org_id, name)
    if res is None:
        raise ApiError(404, f"resource {name!r} not found")
    return res


def _roles(body: dict[str, Any], org_id: str, resource: str, existing: dict[str, Any]) -> list:
    roles = []
    seen = set()
    for index, role in enumerate(body.get("roles") or []):
        conn = build_connection(role, org_id, resource, existing.get(role["name"]), f"roles[{index}].")
        conn.agent_id = conn.agent_id or body.get("agent_id") or ""  # a role without its own agent: the resource's
        if conn.name in seen:
            raise ApiError(422, f"field 'roles[{index}].name': duplicate role {conn.name!r}")
        seen.add(conn.name)
        roles.append(conn)
    return roles


@routes.get("/resources", "List resources", response=array_of(RESOURCE_OUT))
async def list_resources(request: web.Request) -> web.Response:
    resources = await services_of(request).store.list_resources(user_of(request).org_id)
    return ok([resource_json(r) for r in resources])


@routes.post("/resources", "Create a resource and its roles (connections)", body=RESOURCE, status=201,
             response=RESOURCE_ROLES_OUT)
async def create(request: web.Request) -> web.Response:
    admin = require_admin(request)
    body = await json_body(request, RESOURCE)
    now = rfc3339(utcnow())
    name = body["name"].strip()
    if not name or "/" in name:
        raise ApiError(422, "field 'name': must be a non-empty name without '/'")
    res = Resource(id=new_id(), org_id=admin.org_id, name=name, type=body["type"],
                   subtype=body.get("subtype") or body["type"], agent_id=body.get("agent_id") or "",
                   env_vars=body.get("env_vars") or {}, created_at=now, updated_at=now)
    roles = _roles(body, admin.org_id, name, {})
    try:
        await services_of(request).store.create_resource(res, roles)
    except Conflict:
        raise ApiError(409, f"resource {name!r} or one of its roles already exists") from None
    data = resource_json(res)
    data["roles"] = [connection_json(c, admin) for c in roles]
    return ok(data, status=201)


@routes.get("/resources/{name}", "A resource with its roles", response=RESOURCE_ROLES_OUT)
async def get(request: web.Request) -> web.Response:
    res = await _find(request)
    user = user_of(request)
    data = resource_json(res)
    data["roles"] = [connection_json(c, user)
                     for c in await services_of(request).store.list_connections(user.org_id, res.name)]
    return ok(data)


@routes.put("/resources/{name}", "Update a resource; roles, when given, replace its connections", body=RESOURCE,
            response=RESOURCE_OUT)
async def update(request: web.Request) -> web.Response:
    admin = require_admin(request)
    res = await _find(request)
    body = await json_body(request, RESOURCE)
    if body["name"] != res.name:
        raise ApiError(422, "field 'name': renaming a resource is not supported")
    res.type = body["type"]
    res.subtype = body.get("subtype") or body["type"]
    previous_agent, res.agent_id = res.agent_id, body.get("agent_id") or ""
    res.env_vars = body.get("env_vars") or {}
    res.updated_at = rfc3339(utcnow())
    store = services_of(request).store
    roles = None
    if "roles" in body:
        existing = {c.name: c for c in await store.list_connections(admin.org_id, res.name)}
        for role in body["roles"]:
            if "secret" not in role and role["name"] in existing:
                role["secret"] = existing[role["name"]].secret
        roles = _roles(body, admin.org_id, res.name, existing)
    elif res.agent_id != previous_agent:  # the roles that followed the resource's agent follow it still
        roles = await store.list_connections(admin.org_id, res.name)
        for conn in roles:
            if conn.agent_id == previous_agent:
                conn.agent_id = res.agent_id
    try:
        await store.update_resource(res, roles)
    except Conflict:
        raise ApiError(409, "a role name is already used by another connection") from None
    services_of(request).guardrails.invalidate()
    return ok(resource_json(res))


@routes.delete("/resources/{name}", "Delete a resource and its connections", status=204)
async def delete(request: web.Request) -> web.Response:
    admin = require_admin(request)
    res = await _find(request)
    await services_of(request).store.delete_resource(admin.org_id, res.name)
    services_of(request).guardrails.invalidate()
    return web.Response(status=204)
