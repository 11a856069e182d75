"""Webhooks (admins): the organization's endpoints, the event types, and the log of every delivery."""

from __future__ import annotations

from typing import Any

from aiohttp import web

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
)
from control.schemas import STRINGS, TEXT
from gatewayd.models import Delivery, WebhookEndpoint, new_id, rfc3339, utcnow
from gatewayd.webhooks import (
    DELIVERED,
    EVENT_TYPES,
    FAILED,
    PENDING,
    check_url,
    literal_refusal,
    new_secret,
    unreachable,
)

routes = RouteSet("Webhooks", audit="webhooks")

ENDPOINT = Schema("WebhookEndpointRequest", {
    "url": Field("string", True, min_length=1, description="an https URL"), "description": Field("string"),
    "event_types": Field("array", items=Field("string", enum=tuple(EVENT_TYPES)),
                         description="the events it wants (none: every one)"),
    "disabled": Field("boolean")})
_ENDPOINT_FIELDS = {
    "id": TEXT, "url": TEXT, "description": TEXT, "event_types": STRINGS, "disabled": Field("boolean", True),
    "created_at": TEXT, "updated_at": TEXT}
ENDPOINT_OUT = Schema("WebhookEndpoint", _ENDPOINT_FIELDS)
ENDPOINT_CREATED = Schema("WebhookEndpointCreated", {
    **_ENDPOINT_FIELDS, "secret": Field("string", True, description="whsec_...: signs its deliveries; shown once")})
EVENT_TYPE_OUT = Schema("WebhookEventType", {"name": TEXT, "description": TEXT})
_DELIVERY_FIELDS = {
    "id": TEXT, "endpoint_id": TEXT, "channel": Field("string", True, enum=("webhook", "slack")), "event_id": TEXT,
    "event_type": TEXT, "status": Field("string", True, enum=(PENDING, DELIVERED, FAILED)),
    "attempts": Field("integer", True, minimum=0), "last_status": Field("integer", True, nullable=True),
    "last_error": TEXT, "next_attempt_at": TEXT, "created_at": TEXT,
    "delivered_at": Field("string", True, nullable=True)}
DELIVERY_OUT = Schema("WebhookDelivery", _DELIVERY_FIELDS)
DELIVERY_FULL_OUT = Schema("WebhookDeliveryDetail", {**_DELIVERY_FIELDS, "payload": Field("object", True)})
DELIVERIES_OUT = Schema("WebhookDeliveryPage", {
    "data": Field("array", True, items=DELIVERY_OUT), "total": Field("integer", True, minimum=0),
    "has_next_page": Field("boolean", True)})
PING = Schema("WebhookTestMessage", {"endpoint_id": Field("string", description="one endpoint (default: every one)"),
                                     "data": Field("object")})


def endpoint_json(endpoint: WebhookEndpoint) -> dict[str, Any]:
    return {"id": endpoint.id, "url": endpoint.url, "description": endpoint.description,
            "event_types": endpoint.event_types, "disabled": endpoint.disabled, "created_at": endpoint.created_at,
            "updated_at": endpoint.updated_at}


def delivery_json(delivery: Delivery, with_payload: bool = False) -> dict[str, Any]:
    import json

    data = {name: getattr(delivery, name) for name in _DELIVERY_FIELDS}
    if with_payload:
        data["payload"] = json.loads(delivery.body)
    return data


def _checked_url(request: web.Request, url: str) -> str:
    """The endpoint's URL, else 422 (not an https URL) or, for a tenant's, 400 when its host is an IP address the
    tenant's webhooks may not reach (a name is checked on each address it resolves to at every delivery)."""
    services = services_of(request)
    problem = check_url(url.strip(), services.config["webhooks.allow_http"])
    if problem:
        raise ApiError(422, f"field 'url': {problem}")
    tenancy = services.tenancy
    if tenancy.is_tenant(require_admin(request).org_id) and (kind := literal_refusal(url.strip(),
                                                                                       tenancy.webhook_policy)):
        raise ApiError(400, f"field 'url': {unreachable(kind)}")
    return url.strip()


async def _endpoint(request: web.Request) -> WebhookEndpoint:
    admin = require_admin(request)
    key = request.match_info["id"]
    endpoint = await services_of(request).store.get_webhook_endpoint(admin.org_id, key)
    if endpoint is None:
        raise ApiError(404, f"webhook endpoint {key!r} not found")
    return endpoint


@routes.get("/webhooks/endpoints", "The organization's webhook endpoints", response=array_of(ENDPOINT_OUT))
async def list_endpoints(request: web.Request) -> web.Response:
    admin = require_admin(request)
    return ok([endpoint_json(e) for e in await services_of(request).store.list_webhook_endpoints(admin.org_id)])


@routes.post("/webhooks/endpoints", "Add an endpoint: its signing secret is shown in this answer only",
             body=ENDPOINT, status=201, response=ENDPOINT_CREATED)
async def create_endpoint(request: web.Request) -> web.Response:
    admin = require_admin(request)
    body = await json_body(request, ENDPOINT)
    now = rfc3339(utcnow()) or ""
    endpoint = WebhookEndpoint(id=new_id(), org_id=admin.org_id, url=_checked_url(request, body["url"]),
                               secret=new_secret(), description=body.get("description") or "",
                               event_types=list(dict.fromkeys(body.get("event_types") or [])),
                               disabled=bool(body.get("disabled")), created_at=now, updated_at=now)
    services = services_of(request)
    await services.store.save_webhook_endpoint(endpoint, create=True)
    services.notifier.changed(admin.org_id)
    return ok({**endpoint_json(endpoint), "secret": endpoint.secret}, status=201)


@routes.get("/webhooks/endpoints/{id}", "A webhook endpoint", response=ENDPOINT_OUT)
async def get_endpoint(request: web.Request) -> web.Response:
    return ok(endpoint_json(await _endpoint(request)))


@routes.put("/webhooks/endpoints/{id}", "Change an endpoint (its secret stays)", body=ENDPOINT,
            response=ENDPOINT_OUT)
async def update_endpoint(request: web.Request) -> web.Response:
    endpoint = await _endpoint(request)
    body = await json_body(request, ENDPOINT)
    endpoint.url = _checked_url(request, body["url"])
    endpoint.description = body.get("description") or ""
    endpoint.event_types = list(dict.fromkeys(body.get("event_types") or []))
    endpoint.disabled = bool(body.get("disabled"))
    endpoint.updated_at = rfc3339(utcnow()) or ""
    services = services_of(request)
    await services.store.save_webhook_endpoint(endpoint, create=False)
    services.notifier.changed(endpoint.org_id)
    return ok(endpoint_json(endpoint))


@routes.delete("/webhooks/endpoints/{id}", "Remove an endpoint (what is still pending for it fails)", status=204)
async def delete_endpoint(request: web.Request) -> web.Response:
    endpoint = await _endpoint(request)
    services = services_of(request)
    await services.store.delete_webhook_endpoint(endpoint.org_id, endpoint.id)
    services.notifier.changed(endpoint.org_id)
    return web.Response(status=204)


@routes.get("/webhooks/eventtypes", "The events endpoints may receive", response=array_of(EVENT_TYPE_OUT))
async def list_event_types(request: web.Request) -> web.Response:
    require_admin(request)
    return ok([{"name": name, "description": text} for name, text in EVENT_TYPES.items()])


@routes.get("/webhooks/eventtypes/{name}", "One event type", response=EVENT_TYPE_OUT)
async def get_event_type(request: web.Request) -> web.Response:
    require_admin(request)
    name = request.match_info["name"]
    if name not in EVENT_TYPES:
        raise ApiError(404, f"event type {name!r} not found")
    return ok({"name": name, "description": EVENT_TYPES[name]})


@routes.get("/webhooks/messages", "The delivery log, newest first", query=[
    Param("endpoint_id"), Param("status", enum=(PENDING, DELIVERED, FAILED)),
    Param("event_type", enum=tuple(EVENT_TYPES)),
    Param("limit", "integer", "per page (default 50, at most 100)", minimum=1, maximum=100),
    Param("offset", "integer", minimum=0, maximum=INT64_MAX)], response=DELIVERIES_OUT)
async def list_messages(request: web.Request) -> web.Response:
    admin = require_admin(request)
    limit, offset = query_int(request, "limit", 50), query_int(request, "offset", 0)
    q = request.query
    page = await services_of(request).store.list_deliveries(
        admin.org_id, endpoint_id=q.get("endpoint_id") or None, status=q.get("status") or None,
        event_type=q.get("event_type") or None, limit=limit, offset=offset)
    return ok({"data": [delivery_json(d) for d in page.items], "total": page.total,
               "has_next_page": offset + len(page.items) < page.total})


@routes.get("/webhooks/messages/{id}", "One delivery with the event it carries", response=DELIVERY_FULL_OUT)
async def get_message(request: web.Request) -> web.Response:
    admin = require_admin(request)
    key = request.match_info["id"]
    delivery = await services_of(request).store.get_delivery(admin.org_id, key)
    if delivery is None:
        raise ApiError(404, f"webhook message {key!r} not found")
    return ok(delivery_json(delivery, True))


@routes.post("/webhooks/messages", "Send a test event (ping) to the endpoints", body=PING, status=202,
             response=array_of(DELIVERY_OUT))
async def send_message(request: web.Request) -> web.Response:
    admin = require_admin(request)
    body = await json_body(request, PING)
    services = services_of(request)
    endpoint_id = body.get("endpoint_id") or None
    if endpoint_id is not None and await services.store.get_webhook_endpoint(admin.org_id, endpoint_id) is None:
        raise ApiError(404, f"webhook endpoint {endpoint_id!r} not found")
    if await services.store.get_plugin(admin.org_id, "webhooks") is None:
        raise ApiError(409, "the webhooks plugin is off: turn it on first (POST /api/plugins {\"name\": \"webhooks\"})")
    deliveries = await services.notifier.ping(admin.org_id, endpoint_id, body.get("data") or {})
    return ok([delivery_json(d) for d in deliveries], status=202)
