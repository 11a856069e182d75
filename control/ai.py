"""AI session analysis: the organization's provider, the analyzer rules, and the rule of a connection."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from yarl import URL

from control.http import (
    INT64_MAX,
    ApiError,
    Field,
    Param,
    RouteSet,
    Schema,
    array_of,
    json_body,
    ok,
    query_int,
    require_admin,
    services_of,
    user_of,
)
from gatewayd.analysis import ACTIONS, FAILURE_POLICIES, NATIVE_ASYNC, NATIVE_MODES, PROVIDERS, RISK_KEYS, rule_for
from gatewayd.analysis.providers import required_api_url
from gatewayd.analysis.verdict import DEFAULT_RISK_EVALUATION
from gatewayd.models import AIAnalyzerRule, AIProvider, new_id, rfc3339, utcnow
from gatewayd.store import Conflict

routes = RouteSet("AI", audit="ai_session_analyzer")

PROVIDER = Schema("AIProvider", {
    "provider": Field("string", True, enum=PROVIDERS), "model": Field("string", True),
    "api_url": Field("string", nullable=True, description="required for azure-openai and custom"),
    "api_key": Field("string", nullable=True, description="stored encrypted; omit to keep the stored key (only "
                                                          "while provider and api_url stay the same)"),
})
RISK_EVALUATION = Schema("AIRiskEvaluation", {key: Field("string", enum=ACTIONS) for key in RISK_KEYS.values()})
RULE = Schema("AISessionAnalyzerRule", {
    "name": Field("string", True), "description": Field("string", nullable=True),
    "connection_names": Field("array", items="string"),
    "risk_evaluation": Field("object", True, schema=RISK_EVALUATION,
                             description="low/medium/high_risk_action: allow_execution or block_execution"),
    "on_failure": Field("string", nullable=True, enum=FAILURE_POLICIES,
                        description="when the provider fails: closed blocks, open lets the built-in rules decide"),
    "timeout": Field("number", nullable=True, description="seconds the provider may take"),
    "native_mode": Field("string", nullable=True, enum=NATIVE_MODES,
                         description="native sessions' statements and commands: async (default) is analysed in "
                                     "the background; sync waits for the verdict, at most timeout, then on_failure"),
})
MAX_RULE_TIMEOUT = 600

_TEXT = Field("string", True)
PROVIDER_OUT = Schema("AIProviderOut", {
    "id": _TEXT, "provider": Field("string", True, enum=PROVIDERS), "api_url": Field("string", True, nullable=True),
    "api_key": Field("string", True, description="masked"), "model": _TEXT, "created_at": _TEXT,
    "updated_at": _TEXT})
RULE_OUT = Schema("AISessionAnalyzerRuleOut", {
    "id": _TEXT, "name": _TEXT, "description": _TEXT, "connection_names": array_of("string"),
    "risk_evaluation": Field("object", True, schema=RISK_EVALUATION),
    "on_failure": Field("string", True, nullable=True, enum=FAILURE_POLICIES),
    "timeout": Field("number", True, nullable=True), "native_mode": Field("string", True, enum=NATIVE_MODES),
    "created_at": _TEXT, "updated_at": _TEXT})


def masked(key: str) -> str:
    """An API key as the API shows it: its last four characters at most, never the whole."""
    if not key:
        return ""
    return "****" + key[-4:] if len(key) >= 16 else "****"


def provider_json(provider: AIProvider) -> dict[str, Any]:
    return {"id": provider.id, "provider": provider.provider, "api_url": provider.api_url or None,
            "api_key": masked(provider.api_key), "model": provider.model, "created_at": provider.created_at,
            "updated_at": provider.updated_at}


def rule_json(rule: AIAnalyzerRule) -> dict[str, Any]:
    return {"id": rule.id, "name": rule.name, "description": rule.description,
            "connection_names": rule.connection_names,
            "risk_evaluation": {key: rule.risk_evaluation.get(key) or DEFAULT_RISK_EVALUATION[key]
                                for key in RISK_KEYS.values()},
            "on_failure": rule.on_failure, "timeout": rule.timeout, "native_mode": rule.native_mode,
            "created_at": rule.created_at, "updated_at": rule.updated_at}


# --------------------------------------------------------------------------- provider


def _api_url(value: Any, provider: str) -> str:
    url = (value or "").strip()
    if not url:
        if required_api_url(provider):
            raise ApiError(422, f"field 'api_url' is required for provider {provider}")
        return ""
    parsed = URL(url)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ApiError(422, "field 'api_url': expected an http:// or https:// URL")
    return url


@routes.get("/ai/session-analyzer/providers", "The organization's AI provider (its key masked); 404 when none",
            response=PROVIDER_OUT)
async def get_provider(request: web.Request) -> web.Response:
    admin = require_admin(request)
    provider = await services_of(request).store.get_ai_provider(admin.org_id)
    if provider is None:
        raise ApiError(404, "no AI provider is configured: set one with PUT /api/ai/session-analyzer/providers")
    return ok(provider_json(provider))


async def _save_provider(request: web.Request) -> web.Response:
    admin = require_admin(request)
    body = await json_body(request, PROVIDER)
    store = services_of(request).store
    existing = await store.get_ai_provider(admin.org_id)
    model = body["model"].strip()
    if not model:
        raise ApiError(422, "field 'model': must not be empty")
    api_url = _api_url(body.get("api_url"), body["provider"])
    key = (body.get("api_key") or "").strip()
    if not key:
        if existing is None:
            raise ApiError(400, "field 'api_key' is required")
        if (existing.provider, existing.api_url) != (body["provider"], api_url):
            # the stored key goes only where it was given for: a new address or kind could be anyone's server
            raise ApiError(400, "field 'api_key' is required when 'provider' or 'api_url' changes: the stored key is "
                                "sent only to the provider it was given for")
        key = existing.api_key
    now = rfc3339(utcnow())
    provider = AIProvider(id=existing.id if existing else new_id(), org_id=admin.org_id,
                          provider=body["provider"], model=model, api_url=api_url,
                          api_key=key, created_at=existing.created_at if existing else now, updated_at=now)
    await store.save_ai_provider(provider)
    return ok(provider_json(provider))


@routes.put("/ai/session-analyzer/providers", "Set the organization's AI provider (one per organization)",
            body=PROVIDER, response=PROVIDER_OUT)
async def put_provider(request: web.Request) -> web.Response:
    return await _save_provider(request)


@routes.post("/ai/session-analyzer/providers", "Set the organization's AI provider (as PUT)", body=PROVIDER,
             response=PROVIDER_OUT)
async def post_provider(request: web.Request) -> web.Response:
    return await _save_provider(request)


@routes.delete("/ai/session-analyzer/providers", "Remove the organization's AI provider (the built-in rules "
               "analyse alone)", status=204)
async def delete_provider(request: web.Request) -> web.Response:
    admin = require_admin(request)
    if not await services_of(request).store.delete_ai_provider(admin.org_id):
        raise ApiError(404, "no AI provider is configured")
    return web.Response(status=204)


# --------------------------------------------------------------------------- rules


async def _rule_from(request: web.Request, org_id: str, existing: AIAnalyzerRule | None) -> AIAnalyzerRule:
    body = await json_body(request, RULE)
    name = body["name"].strip()
    if not name or "/" in name:
        raise ApiError(422, "field 'name': must be a non-empty name without '/'")
    names = list(dict.fromkeys(n.strip() for n in body.get("connection_names") or [] if n.strip()))
    timeout = body.get("timeout")
    if timeout is not None and not 0 < timeout <= MAX_RULE_TIMEOUT:
        raise ApiError(422, f"field 'timeout': seconds, more than 0 and at most {MAX_RULE_TIMEOUT}")
    rules = await services_of(request).store.list_ai_rules(org_id)
    for other in rules:
        if existing is not None and other.id == existing.id:
            continue
        if other.name == name:
            raise ApiError(409, f"AI session analyzer rule {name!r} already exists")
        shared = sorted(set(names) & set(other.connection_names))
        if shared:
            raise ApiError(409, f"connection {shared[0]!r} is already analysed by rule {other.name!r}: "
                                "a connection has one rule")
    now = rfc3339(utcnow())
    evaluation = body["risk_evaluation"]
    return AIAnalyzerRule(
        id=existing.id if existing else new_id(), org_id=org_id, name=name,
        description=body.get("description") or "", connection_names=names,
        risk_evaluation={key: evaluation.get(key) or DEFAULT_RISK_EVALUATION[key] for key in RISK_KEYS.values()},
        on_failure=body.get("on_failure"), timeout=float(timeout) if timeout is not None else None,
        native_mode=body.get("native_mode") or NATIVE_ASYNC, created_at=existing.created_at if existing else now,
        updated_at=now)


async def _find_rule(request: web.Request) -> AIAnalyzerRule:
    name = request.match_info["name"]
    rule = await services_of(request).store.get_ai_rule(user_of(request).org_id, name)
    if rule is None:
        raise ApiError(404, f"AI session analyzer rule {name!r} not found")
    return rule


@routes.get("/ai/session-analyzer/rules", "AI session analyzer rules, by name", query=[
    Param("connection_names", description="only rules naming one of these (repeatable)"),
    Param("page", "integer", minimum=1, maximum=INT64_MAX),
    Param("page_size", "integer", description="0 (default): all, else at most 100", minimum=0, maximum=INT64_MAX)],
    response=Schema("AISessionAnalyzerRules", {
        "pages": Field("object", True, schema=Schema("AIRulePages", {
            "total": Field("integer", True, minimum=0), "page": Field("integer", True, minimum=1),
            "size": Field("integer", True, minimum=0, maximum=100)})),
        "data": Field("array", True, items=RULE_OUT)}))
async def list_rules(request: web.Request) -> web.Response:
    rules = await services_of(request).store.list_ai_rules(user_of(request).org_id)
    wanted = set(request.query.getall("connection_names", []))
    if wanted:
        rules = [r for r in rules if wanted & set(r.connection_names)]
    page, size = query_int(request, "page", 1), query_int(request, "page_size", 0)
    if page < 1 or not 0 <= size:
        raise ApiError(422, "query parameters 'page' and 'page_size': page 1 or more, page_size 0 or more")
    size = min(size, 100)
    shown = rules[(page - 1) * size:page * size] if size else rules
    return ok({"pages": {"total": len(rules), "page": page, "size": size}, "data": [rule_json(r) for r in shown]})


@routes.post("/ai/session-analyzer/rules", "Create an AI session analyzer rule", body=RULE, status=201,
             response=RULE_OUT)
async def create_rule(request: web.Request) -> web.Response:
    admin = require_admin(request)
    rule = await _rule_from(request, admin.org_id, None)
    try:
        await services_of(request).store.save_ai_rule(rule, create=True)
    except Conflict:
        raise ApiError(409, f"AI session analyzer rule {rule.name!r} already exists") from None
    services_of(request).analysis.invalidate()
    return ok(rule_json(rule), status=201)


@routes.get("/ai/session-analyzer/rules/{name}", "An AI session analyzer rule", response=RULE_OUT)
async def get_rule(request: web.Request) -> web.Response:
    return ok(rule_json(await _find_rule(request)))


@routes.put("/ai/session-analyzer/rules/{name}", "Replace an AI session analyzer rule", body=RULE,
            response=RULE_OUT)
async def update_rule(request: web.Request) -> web.Response:
    admin = require_admin(request)
    existing = await _find_rule(request)
    rule = await _rule_from(request, admin.org_id, existing)
    try:
        await services_of(request).store.save_ai_rule(rule, create=False)
    except Conflict:
        raise ApiError(409, f"AI session analyzer rule {rule.name!r} already exists") from None
    services_of(request).analysis.invalidate()
    return ok(rule_json(rule))


@routes.delete("/ai/session-analyzer/rules/{name}", "Delete an AI session analyzer rule", status=204)
async def delete_rule(request: web.Request) -> web.Response:
    admin = require_admin(request)
    rule = await _find_rule(request)
    await services_of(request).store.delete_ai_rule(admin.org_id, rule.id)
    services_of(request).analysis.invalidate()
    return web.Response(status=204)


@routes.get("/connections/{name}/ai-session-analyzer-rule", "The AI session analyzer rule of a connection",
            response=RULE_OUT)
async def connection_rule(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    store = services_of(request).store
    org_id = user_of(request).org_id
    connection = await store.get_connection(org_id, name)
    if connection is None:
        raise ApiError(404, f"connection {name!r} not found")
    rule = rule_for(await store.list_ai_rules(org_id), connection)
    if rule is None:
        raise ApiError(404, f"no AI session analyzer rule names connection {connection.name!r}")
    return ok(rule_json(rule))
