"""Guard rail rules: create, read, update, delete; validated so traffic never meets a bad rule."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from control.http import (
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
from control.schemas import OBJECT, STRINGS, TEXT
from gatewayd import protocols
from gatewayd.guardrails import DATAMASKING_PREFIX, RuleError, check_language, pattern_problem, validate_guardrail
from gatewayd.models import GuardRail, new_id, rfc3339, utcnow
from gatewayd.store import Conflict

routes = RouteSet("Guard Rails", audit="guardrails")

RULE = Schema("GuardRailRule", {
    "type": Field("string", True), "words": Field("array", items="string"), "pattern_regex": Field("string"),
    "name": Field("string"), "description": Field("string"), "message": Field("string"),
    "deny": Field("array", items="string"), "statements": Field("array", items="string"),
    "patterns": Field("array", items="string", description="mask: built-in detectors"),
    "columns": Field("array", items="string", description="mask: column names (or JSON keys) masked whole"),
    "style": Field("string", description="mask: fixed, last4 or hash"),
    "record_clear": Field("boolean", description="mask: also keep the clear text, sealed, for admins "
                                                 "(POST /sessions/{id}/unmasked)"),
})
RULES = Schema("GuardRailRules", {"rules": Field("array", items=RULE), "name": Field("string"),
                                  "description": Field("string")})
GUARDRAIL = Schema("GuardRail", {
    "name": Field("string", True), "description": Field("string"), "attributes": Field("array", items="string"),
    "connection_ids": Field("array", items="string"), "input": Field("object", schema=RULES),
    "output": Field("object", schema=RULES),
})


GUARDRAIL_OUT = Schema("GuardRailOut", {
    "id": TEXT, "name": TEXT, "description": TEXT, "attributes": STRINGS, "connection_ids": STRINGS,
    "input": OBJECT, "output": OBJECT, "created_at": TEXT, "updated_at": TEXT})


def guardrail_json(rule: GuardRail) -> dict[str, Any]:
    return {"id": rule.id, "name": rule.name, "description": rule.description, "attributes": rule.attributes,
            "connection_ids": rule.connection_ids, "input": rule.input, "output": rule.output,
            "created_at": rule.created_at, "updated_at": rule.updated_at}


async def _checked(request: web.Request, org_id: str) -> dict[str, Any]:
    body = await json_body(request, GUARDRAIL)
    if not body["name"].strip():
        raise ApiError(400, "field 'name' is required")
    if body["name"].strip().startswith(DATAMASKING_PREFIX):
        raise ApiError(400, f"field 'name': {DATAMASKING_PREFIX!r} names data masking rules (/api/datamasking-rules)")
    body.setdefault("input", {"rules": []})
    body.setdefault("output", {"rules": []})
    try:
        validate_guardrail(body["input"], body["output"])
    except RuleError as exc:
        raise ApiError(400, str(exc)) from None
    store = services_of(request).store
    for conn_id in body.get("connection_ids") or []:
        connection = await store.get_connection(org_id, conn_id)
        if connection is None:
            raise ApiError(422, f"field 'connection_ids': connection {conn_id!r} not found")
        refusal = check_language(body["input"], body["output"], protocols.language_of(connection.subtype))
        if refusal:  # never a silent fallback: a rule its connection's language cannot evaluate is refused
            raise ApiError(422, f"field 'connection_ids': connection {connection.name!r} cannot apply {refusal}")
    return body


async def _find(request: web.Request) -> GuardRail:
    rule_id = request.match_info["id"]
    rule = await services_of(request).store.get_guardrail(user_of(request).org_id, rule_id)
    if rule is None or rule.name.startswith(DATAMASKING_PREFIX):  # a data masking rule: /api/datamasking-rules
        raise ApiError(404, f"guard rail {rule_id!r} not found")
    return rule


@routes.get("/guardrails", "List guard rail rules", response=array_of(GUARDRAIL_OUT))
async def list_guardrails(request: web.Request) -> web.Response:
    rules = await services_of(request).store.list_guardrails(user_of(request).org_id)
    return ok([guardrail_json(r) for r in rules if not r.name.startswith(DATAMASKING_PREFIX)])


@routes.post("/guardrails", "Create a guard rail rule", body=GUARDRAIL, status=201, response=GUARDRAIL_OUT)
async def create(request: web.Request) -> web.Response:
    admin = require_admin(request)
    body = await _checked(request, admin.org_id)
    now = rfc3339(utcnow())
    store = services_of(request).store
    conn_ids = [(await store.get_connection(admin.org_id, c)).id for c in body.get("connection_ids") or []]
    rule = GuardRail(id=new_id(), org_id=admin.org_id, name=body["name"].strip(),
                     description=body.get("description") or "", attributes=body.get("attributes") or [],
                     connection_ids=conn_ids, input=body["input"], output=body["output"],
                     created_at=now, updated_at=now)
    try:
        await store.save_guardrail(rule, create=True)
    except Conflict:
        raise ApiError(409, f"guard rail {rule.name!r} already exists") from None
    services_of(request).guardrails.invalidate()
    return ok(guardrail_json(rule), status=201)


@routes.get("/guardrails/patterns/check", "Whether a regular expression is one a rule may hold (RE2 syntax, no "
            "construct RE2 lacks): the check a save makes, for an editor to make as the pattern is typed",
            query=[Param("pattern", description="the regular expression")],
            response=Schema("PatternCheck", {"valid": Field("boolean", True), "message": TEXT}))
async def check_pattern(request: web.Request) -> web.Response:
    pattern = request.query.get("pattern", "")
    problem = "a pattern is required" if not pattern else pattern_problem(pattern)
    return ok({"valid": problem is None, "message": problem or ""})


@routes.get("/guardrails/{id}", "A guard rail rule", response=GUARDRAIL_OUT)
async def get(request: web.Request) -> web.Response:
    return ok(guardrail_json(await _find(request)))


@routes.put("/guardrails/{id}", "Replace a guard rail rule and its connection list", body=GUARDRAIL,
            response=GUARDRAIL_OUT)
async def update(request: web.Request) -> web.Response:
    admin = require_admin(request)
    rule = await _find(request)
    body = await _checked(request, admin.org_id)
    store = services_of(request).store
    rule.name = body["name"].strip()
    rule.description = body.get("description") or ""
    rule.attributes = body.get("attributes") or []
    rule.connection_ids = [(await store.get_connection(admin.org_id, c)).id for c in body.get("connection_ids") or []]
    rule.input, rule.output = body["input"], body["output"]
    rule.version += 1
    rule.updated_at = rfc3339(utcnow())
    try:
        await store.save_guardrail(rule, create=False)
    except Conflict:
        raise ApiError(409, f"guard rail {rule.name!r} already exists") from None
    services_of(request).guardrails.invalidate()
    return ok(guardrail_json(rule))


@routes.delete("/guardrails/{id}", "Delete a guard rail rule", status=204)
async def delete(request: web.Request) -> web.Response:
    admin = require_admin(request)
    rule = await _find(request)
    await services_of(request).store.delete_guardrail(admin.org_id, rule.id)
    services_of(request).guardrails.invalidate()
    return web.Response(status=204)
