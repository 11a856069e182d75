"""The aiohttp application under ``/api``: middlewares (errors, auth, audit) and every API area."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from control import (
    agents,
    ai,
    audit_logs,
    auth,
    catalog,
    connections,
    datamasking,
    guardrails,
    health,
    integrations,
    openapi,
    orgs,
    plugins,
    protocols,
    proxymanager,
    rdp_frames,
    reports,
    resources,
    reviews,
    runbooks,
    search,
    serverauth,
    serverconfig,
    sessions,
    users,
    webhooks,
)
from control.console import add_console
from control.http import (
    AUDIT_ACTION,
    AUDIT_ACTOR_HINT,
    AUDIT_ORG,
    AUDIT_PAYLOAD,
    AUTH_FAILURE,
    BEARER,
    ERROR_MESSAGE,
    ROUTES,
    SERVICES,
    USER,
    ApiError,
    RouteDoc,
    check_parameters,
    services_of,
)
from gatewayd.cluster import NotConfirmed
from gatewayd.identity import AuthError
from gatewayd.logs import REQUEST_ID, request_id_from
from gatewayd.services import Services
from gatewayd.sessions import CONFIRMATIONS
from gatewayd.store import StoreUnavailable

log = logging.getLogger("gatewayd.api")

AREAS = (health, auth, users, serverconfig, serverauth, orgs, resources, connections, catalog, agents, guardrails,
         datamasking, protocols, sessions, rdp_frames, reviews, runbooks, plugins, webhooks, reports, ai, proxymanager,
         audit_logs, integrations, search, openapi)
MUTATING = {"POST", "PUT", "PATCH", "DELETE"}
ROUTE_DOC = web.AppKey("route_doc_by_handler", dict)
REQUEST_ID_KEY = web.RequestKey("request_id", str)
REQUEST_ID_HEADER = "X-Request-Id"
BEARER_CHALLENGE = 'Bearer realm="gatewayd"'  # RFC 6750: every 401 of the API says how to authenticate
STORE_DOWN = "the gateway's store is unavailable: try again later"


def _route_doc(request: web.Request) -> RouteDoc | None:
    return request.app[ROUTE_DOC].get(getattr(request.match_info, "handler", None))


@web.middleware
async def request_log_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """A request id for every call (the caller's ``X-Request-Id`` or a new one), on each of its log lines;
    one log line for every call that fails."""
    request_id = request_id_from(request.headers.get(REQUEST_ID_HEADER))
    request[REQUEST_ID_KEY] = request_id
    token = REQUEST_ID.set(request_id)
    try:
        response = await handler(request)
        if response.status >= 400:
            user = request.get(USER)
            log.log(logging.WARNING if response.status >= 500 else logging.INFO, "api call failed", extra={
                "method": request.method, "path": request.path, "status": response.status,
                "user": user.email if user else "", "client": request.remote or "",
                "reason": request.get(AUTH_FAILURE) or request.get(ERROR_MESSAGE, "")})
        return response
    finally:
        REQUEST_ID.reset(token)


async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """``X-Request-Id`` on every answer, streamed ones included (set before the head is sent)."""
    request_id = request.get(REQUEST_ID_KEY)
    if request_id:
        response.headers[REQUEST_ID_HEADER] = request_id


@web.middleware
async def body_size_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """A body declared larger than ``api.max_body_bytes`` is refused from its header, before any of it
    is read (aiohttp would wait for the bytes to arrive first)."""
    limit = request.app[SERVICES].config["api.max_body_bytes"]
    if request.content_length is not None and request.content_length > limit:
        request[ERROR_MESSAGE] = f"request body too large: at most {limit} bytes"
        response = web.json_response({"message": request[ERROR_MESSAGE]}, status=413)
        response.force_close()
        return response
    return await handler(request)


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every error leaves as ``{"message": ...}``. A control action the call started (a rule changed) is awaited
    until every node it concerns confirms it, before the call answers (gatewayd.sessions.CONFIRMATIONS)."""
    waiting: list[asyncio.Task[None]] = []
    token = CONFIRMATIONS.set(waiting)
    try:
        response = await handler(request)
        for outcome in await asyncio.gather(*waiting, return_exceptions=True):
            if isinstance(outcome, BaseException):
                raise outcome
        return response
    except NotConfirmed as exc:  # done, but not known to be in force everywhere: the caller must know
        log.error("a control action was not confirmed by every node", extra={"path": request.path,
                                                                               "nodes": ",".join(exc.nodes)})
        request[ERROR_MESSAGE] = str(exc)
        return web.json_response({"message": str(exc)}, status=503)
    except ApiError as exc:
        request[ERROR_MESSAGE] = exc.message
        headers = exc.headers
        if exc.status == 401 and "WWW-Authenticate" not in headers:  # RFC 7235: a 401 names its scheme
            headers = {**headers, "WWW-Authenticate": BEARER_CHALLENGE}
        return web.json_response({"message": exc.message}, status=exc.status, headers=headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = {404: "not found", 405: "method not allowed", 413: "request body too large"}.get(
            exc.status, exc.reason.lower())
        request[ERROR_MESSAGE] = message
        return web.json_response({"message": message}, status=exc.status, headers={
            k: v for k, v in exc.headers.items() if k.lower() == "allow"})
    except StoreUnavailable as exc:  # the store does not answer (within store.timeout): say so, come back later
        log.error("the store did not answer an API call", extra={"path": request.path, "error": str(exc)})
        request[ERROR_MESSAGE] = STORE_DOWN
        return web.json_response({"message": STORE_DOWN}, status=503, headers={"Retry-After": "5"})
    except (HttpProcessingError, ConnectionResetError) as exc:  # a body that broke off or does not parse
        message = f"malformed request: {type(exc).__name__}"  # the client's fault: no traceback, no echo
        request[ERROR_MESSAGE] = message
        return web.json_response({"message": message}, status=400)
    except Exception:
        log.exception("unhandled API error", extra={"path": request.path, "method": request.method})
        request[ERROR_MESSAGE] = "internal server error"
        return web.json_response({"message": "internal server error"}, status=500)
    finally:
        CONFIRMATIONS.reset(token)


@web.middleware
async def auth_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Bearer token → active user on ``request[USER]``, except on public routes."""
    doc = _route_doc(request)
    if doc is None or doc.public:
        return await handler(request)
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if not header and request.headers.get("Api-Key"):  # hoop.dev's header for API keys
        scheme, token = "bearer", request.headers["Api-Key"]
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "access denied")
    try:
        user = await services_of(request).identity.authenticate(token.strip())
    except AuthError as exc:
        request[AUTH_FAILURE] = str(exc)
        raise ApiError(401, "access denied") from None
    request[USER], request[BEARER] = user, token.strip()
    if not user.org_id and doc.path not in ("/signup", "/userinfo"):
        raise ApiError(403, "access denied: sign up to an organization first (POST /api/signup)")
    return await handler(request)


@web.middleware
async def parameters_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """The route's query and path parameters, checked against its declaration (types, bounds, enums)."""
    doc = _route_doc(request)
    if doc is not None:
        check_parameters(request, doc)
    return await handler(request)


@web.middleware
async def audit_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """One audit entry per mutating call, and one per refusal (401/403) of any call."""
    response = await handler(request)
    doc = _route_doc(request)
    status = response.status
    if request.method not in MUTATING and status not in (401, 403):
        return response
    if doc is None and status == 404:
        return response
    services = services_of(request)
    user = request.get(USER)
    org_id = user.org_id if user and user.org_id else request.get(AUDIT_ORG) or (await services.store.default_org()).id
    action = request.get(AUDIT_ACTION) or (
        f"{doc.audit}.{doc.handler.__name__}" if doc else f"{request.method.lower()} {request.path}")
    await services.audit.record(
        org_id=org_id, actor=user, action=action, resource_type=doc.audit if doc else "api",
        outcome="success" if status < 400 else "failure",
        error_message=(request.get(AUTH_FAILURE) or request.get(ERROR_MESSAGE, "")) if status >= 400 else "",
        http_method=request.method, http_path=request.path, http_status=status,
        client_ip=request.remote or "", payload=request.get(AUDIT_PAYLOAD),
        actor_hint=request.get(AUDIT_ACTOR_HINT, ""),
    )
    return response


def make_app(services: Services) -> web.Application:
    """The root application; every API route lives under ``/api``, the web console at ``/``."""
    api = web.Application(middlewares=[audit_middleware, error_middleware, auth_middleware, parameters_middleware],
                          client_max_size=services.config["api.max_body_bytes"])
    api[SERVICES] = services
    docs: list[RouteDoc] = []
    for area in AREAS:
        for doc in area.routes.routes:
            api.router.add_route(doc.method, doc.path, doc.handler)
            docs.append(doc)
    api[ROUTES] = docs
    api[ROUTE_DOC] = {doc.handler: doc for doc in docs}

    root = web.Application(middlewares=[request_log_middleware, body_size_middleware, error_middleware],
                           client_max_size=services.config["api.max_body_bytes"])
    root[SERVICES] = services
    root.on_response_prepare.append(_echo_request_id)
    root.add_subapp("/api", api)
    add_console(root)
    return root
