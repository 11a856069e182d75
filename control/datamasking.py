"""hoop's data masking rules (``/api/datamasking-rules``) on top of the guard rails' masking engine.

A data masking rule names entity types (hoop's Presidio names: ``EMAIL_ADDRESS``,
``CREDIT_CARD``...), custom entity types (a regex or a deny list) and the
connections it applies to.  It is stored as a guard rail of its own
(``datamasking:<name>``, hidden from ``/api/guardrails``) whose output side holds
the ``mask`` rules it compiles to, with the rule as written beside them: the
sessions of its connections mask through the same policy chain as any guard rail.

``POST /api/sessions/{id}/unmasked`` gives an admin the clear text that a
``mask`` rule with ``record_clear`` kept, sealed, beside a session's recording
(a POST: every reading is on the audit log).
"""

from __future__ import annotations

import base64
import math
from typing import Any

import re2
from aiohttp import web

from control.http import (ApiError, Field, RouteSet, Schema, array_of, json_body, off_loop, ok, require_admin,
                          services_of, user_of)
from control.schemas import STRINGS, TEXT
from gatewayd import protocols
from gatewayd.guardrails import DATAMASKING_KEY, DATAMASKING_PREFIX, RuleError, check_language, validate_guardrail
from gatewayd.models import GuardRail, new_id, rfc3339, utcnow
from gatewayd.policy import CLEAR_SUFFIX
from gatewayd.store import Conflict

routes = RouteSet("Data Masking", audit="datamasking")

# hoop's (Presidio's) entity type names -> the built-in detectors (gatewayd.masking)
ENTITY_TYPES = {"CREDIT_CARD": "card_number", "EMAIL_ADDRESS": "email", "IBAN_CODE": "iban", "US_SSN": "us_ssn",
                "UK_NINO": "uk_nino", "FR_NIR": "fr_nir"}

SUPPORTED = Schema("DataMaskingSupportedEntities", {
    "name": Field("string", True), "entity_types": Field("array", True, items="string"),
})
CUSTOM = Schema("DataMaskingCustomEntity", {
    "name": Field("string", True), "regex": Field("string"), "deny_list": Field("array", items="string"),
    "score": Field("number"),
})
RULE_IN = Schema("DataMaskingRuleIn", {
    "name": Field("string", True), "description": Field("string"), "connection_ids": Field("array", items="string"),
    "supported_entity_types": Field("array", items=SUPPORTED), "custom_entity_types": Field("array", items=CUSTOM),
    "score_threshold": Field("number", nullable=True),
})
RULE_OUT = Schema("DataMaskingRule", {
    "id": TEXT, "name": TEXT, "description": TEXT, "connection_ids": STRINGS,
    "supported_entity_types": Field("array", True, items=SUPPORTED),
    "custom_entity_types": Field("array", True, items=CUSTOM),
    "score_threshold": Field("number", True, nullable=True), "updated_at": TEXT,
})


def mask_rules(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``mask`` output rules a data masking rule compiles to; ApiError 400 names what is wrong."""
    patterns: list[str] = []
    for index, group in enumerate(body.get("supported_entity_types") or []):
        for entity in group["entity_types"]:
            if entity not in ENTITY_TYPES:
                raise ApiError(400, f"field 'supported_entity_types[{index}].entity_types': unknown entity type "
                                    f"{entity!r}: one of {', '.join(ENTITY_TYPES)}")
            patterns.append(ENTITY_TYPES[entity])
    threshold = body.get("score_threshold")
    if threshold is not None and (not math.isfinite(threshold) or not 0 <= threshold <= 1):
        raise ApiError(400, "field 'score_threshold': expected a number from 0 to 1")
    rules: list[dict[str, Any]] = []
    if patterns:
        rules.append({"type": "mask", "patterns": list(dict.fromkeys(patterns))})
    for index, custom in enumerate(body.get("custom_entity_types") or []):
        where = f"field 'custom_entity_types[{index}]'"
        score = custom.get("score")
        if score is not None and (not math.isfinite(score) or not 0 <= score <= 1):
            raise ApiError(400, f"{where}.score: expected a number from 0 to 1")
        if threshold is not None and score is not None and score < threshold:
            continue  # below the rule's threshold: not reported, as Presidio would not
        alternatives = []
        if custom.get("regex"):
            alternatives.append(custom["regex"])
        words = [w for w in custom.get("deny_list") or [] if w]
        if words:
            alternatives.append("|".join(re2.escape(w) for w in words))
        if not alternatives:
            raise ApiError(400, f"{where}: a custom entity type needs 'regex' or 'deny_list'")
        rules.append({"type": "mask", "pattern_regex": "|".join(f"(?:{a})" for a in alternatives)})
    if not patterns and not body.get("custom_entity_types"):
        raise ApiError(400, "a data masking rule needs 'supported_entity_types' or 'custom_entity_types'")
    try:
        validate_guardrail({"rules": []}, {"rules": rules})
    except RuleError as exc:
        raise ApiError(400, f"field 'custom_entity_types': {exc}") from None
    return rules


def rule_json(rail: GuardRail) -> dict[str, Any]:
    written = rail.output.get(DATAMASKING_KEY) or {}
    return {"id": rail.id, "name": rail.name[len(DATAMASKING_PREFIX):], "description": rail.description,
            "connection_ids": rail.connection_ids,
            "supported_entity_types": written.get("supported_entity_types") or [],
            "custom_entity_types": written.get("custom_entity_types") or [],
            "score_threshold": written.get("score_threshold"), "updated_at": rail.updated_at}


async def _checked(request: web.Request, org_id: str) -> tuple[dict[str, Any], list[dict[str, Any]], list[str]]:
    body = await json_body(request, RULE_IN)
    if not body["name"].strip():
        raise ApiError(400, "field 'name' is required")
    rules = mask_rules(body)
    store = services_of(request).store
    ids = []
    for conn_id in body.get("connection_ids") or []:
        connection = await store.get_connection(org_id, conn_id)
        if connection is None:
            raise ApiError(422, f"field 'connection_ids': connection {conn_id!r} not found")
        refusal = check_language({"rules": []}, {"rules": rules}, protocols.language_of(connection.subtype))
        if refusal:  # an RDP connection: nothing its proxy sends can be masked
            raise ApiError(422, f"field 'connection_ids': connection {connection.name!r} cannot apply {refusal}")
        ids.append(connection.id)
    return body, rules, ids


def _output(body: dict[str, Any], rules: list[dict[str, Any]]) -> dict[str, Any]:
    written = {key: body.get(key) for key in ("supported_entity_types", "custom_entity_types", "score_threshold")}
    return {"rules": rules, DATAMASKING_KEY: written}


async def _find(request: web.Request) -> GuardRail:
    rule_id = request.match_info["id"]
    store = services_of(request).store
    org_id = user_of(request).org_id
    rail = await store.get_guardrail(org_id, rule_id)
    if rail is None or not rail.name.startswith(DATAMASKING_PREFIX):
        rail = await store.get_guardrail(org_id, DATAMASKING_PREFIX + rule_id)
    if rail is None or not rail.name.startswith(DATAMASKING_PREFIX):
        raise ApiError(404, f"data masking rule {rule_id!r} not found")
    return rail


@routes.get("/datamasking-rules", "List data masking rules", response=array_of(RULE_OUT))
async def list_rules(request: web.Request) -> web.Response:
    rails = await services_of(request).store.list_guardrails(user_of(request).org_id)
    return ok([rule_json(r) for r in rails if r.name.startswith(DATAMASKING_PREFIX)])


@routes.post("/datamasking-rules", "Create a data masking rule", body=RULE_IN, status=201, response=RULE_OUT)
async def create(request: web.Request) -> web.Response:
    admin = require_admin(request)
    body, rules, ids = await _checked(request, admin.org_id)
    now = rfc3339(utcnow())
    rail = GuardRail(id=new_id(), org_id=admin.org_id, name=DATAMASKING_PREFIX + body["name"].strip(),
                     description=body.get("description") or "", attributes=[], connection_ids=ids,
                     input={"rules": []}, output=_output(body, rules), created_at=now, updated_at=now)
    try:
        await services_of(request).store.save_guardrail(rail, create=True)
    except Conflict:
        raise ApiError(409, f"data masking rule {body['name'].strip()!r} already exists") from None
    services_of(request).guardrails.invalidate()
    return ok(rule_json(rail), status=201)


@routes.get("/datamasking-rules/{id}", "A data masking rule", response=RULE_OUT)
async def get(request: web.Request) -> web.Response:
    return ok(rule_json(await _find(request)))


@routes.put("/datamasking-rules/{id}", "Replace a data masking rule", body=RULE_IN, response=RULE_OUT)
async def update(request: web.Request) -> web.Response:
    admin = require_admin(request)
    rail = await _find(request)
    body, rules, ids = await _checked(request, admin.org_id)
    rail.name = DATAMASKING_PREFIX + body["name"].strip()
    rail.description = body.get("description") or ""
    rail.connection_ids = ids
    rail.output = _output(body, rules)
    rail.version += 1
    rail.updated_at = rfc3339(utcnow())
    try:
        await services_of(request).store.save_guardrail(rail, create=False)
    except Conflict:
        raise ApiError(409, f"data masking rule {body['name'].strip()!r} already exists") from None
    services_of(request).guardrails.invalidate()
    return ok(rule_json(rail))


@routes.delete("/datamasking-rules/{id}", "Delete a data masking rule", status=204)
async def delete(request: web.Request) -> web.Response:
    admin = require_admin(request)
    rail = await _find(request)
    await services_of(request).store.delete_guardrail(admin.org_id, rail.id)
    services_of(request).guardrails.invalidate()
    return web.Response(status=204)


UNMASKED_OUT = Schema("UnmaskedOutput", {
    "session_id": TEXT,
    "event_stream": Field("array", True, items=Field("array"),
                          description="[offset_ms, 'o', base64 of the clear text] per masked row or text"),
})


@routes.post("/sessions/{id}/unmasked", "The clear text masked in a session, as a record_clear mask rule kept it "
             "(admins; audited)", response=UNMASKED_OUT, audit="sessions")
async def unmasked(request: web.Request) -> web.Response:
    admin = require_admin(request)
    session_id = request.match_info["id"]
    store = services_of(request).store
    session = await store.get_session(session_id)
    if session is None or session.org_id != admin.org_id:
        raise ApiError(404, f"session {session_id!r} not found")
    side = session_id + CLEAR_SUFFIX
    box = getattr(store, "box")
    events = await store.read_events(side)
    return await off_loop(lambda: ok({"session_id": session_id, "event_stream": [
        [e.offset_ms, e.kind, base64.b64encode(box.open(e.data, side.encode())).decode()] for e in events]}))
