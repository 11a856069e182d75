"""Proxy manager: open a connection on a local port of the user's own ``gatewayd proxy-manager``, close it, status."""

from __future__ import annotations

import ipaddress

from aiohttp import web

from control.connections import DEFAULT_ACCESS_SECONDS
from control.http import ApiError, Field, RouteSet, Schema, json_body, ok, services_of, user_of
from control.schemas import TEXT
from gatewayd.agent.manager import ManagerError
from gatewayd.reviews import JIT

routes = RouteSet("Proxy Manager", audit="proxymanager")

CONNECT = Schema("ProxyManagerConnect", {
    "connection_name": Field("string", True),
    "port": Field("integer", True, minimum=1, maximum=65535, description="the local port to open"),
    "bind": Field("string", description="the local address (default 127.0.0.1): a loopback address, or one the "
                                        "gateway's operator allows ([proxy_manager] allowed_binds)"),
    "access_duration_seconds": Field("integer", minimum=1, description="the credential's lifetime (default 3600)"),
})
DISCONNECT = Schema("ProxyManagerDisconnect", {
    "connection_name": Field("string", description="the connection to close; none: every one"),
})
FORWARDING = Schema("ProxyManagerForwarding", {
    "connection_name": TEXT, "connection_subtype": TEXT, "port": Field("integer", True), "bind": TEXT,
    "since": TEXT})
STATUS = Schema("ProxyManagerStatus", {
    "status": Field("string", True, description="connected while your proxy manager holds its channel"),
    "hostname": TEXT, "connected_at": TEXT,
    "forwardings": Field("array", True, items=FORWARDING),
})


def _error(exc: ManagerError) -> ApiError:
    return ApiError(exc.status, exc.message)


def _loopback(address: str) -> bool:
    if address.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(address: str, allowed: list[str]) -> str:
    """The address a proxy manager may listen on: loopback, or one the operator allows; else 422. A port on any
    other address takes whoever reaches the user's machine in as that user, with no login of their own."""
    if _loopback(address) or address in allowed:
        return address
    raise ApiError(422, f"field 'bind': {address!r} is not a loopback address, and a port there would let anyone "
                        "who reaches your machine in as you; the gateway's operator may allow it "
                        "([proxy_manager] allowed_binds)")


@routes.post("/proxymanager/connect", "Open a connection on a local port of your proxy manager", body=CONNECT,
             status=201, response=FORWARDING)
async def connect(request: web.Request) -> web.Response:
    user = user_of(request)
    body = await json_body(request, CONNECT)
    services = services_of(request)
    connection = await services.store.get_connection(user.org_id, body["connection_name"])
    if connection is None:
        raise ApiError(404, f"connection {body['connection_name']!r} not found")
    if await services.reviews.policy(connection, JIT) is not None:
        raise ApiError(422, "this connection needs a just-in-time review first: ask through "
                            f"POST /api/connections/{connection.name}/credentials")
    bind = check_bind((body.get("bind") or "127.0.0.1").strip(), services.config["proxy_manager.allowed_binds"])
    duration = body.get("access_duration_seconds", DEFAULT_ACCESS_SECONDS)
    if duration > int(services.config["sessions.max_credential_duration"]):
        raise ApiError(422, "field 'access_duration_seconds': above sessions.max_credential_duration")
    try:
        forwarding = await services.proxy_manager.connect(user, connection, body["port"], bind, duration)
    except ManagerError as exc:
        raise _error(exc) from None
    return ok(forwarding.json(), status=201)


@routes.post("/proxymanager/disconnect", "Close a connection's local port (or all of them)", body=DISCONNECT,
             response=STATUS)
async def disconnect(request: web.Request) -> web.Response:
    user = user_of(request)
    body = await json_body(request, DISCONNECT)
    services = services_of(request)
    try:
        await services.proxy_manager.disconnect(user, body.get("connection_name"))
    except ManagerError as exc:
        raise _error(exc) from None
    return ok(services.proxy_manager.status(user))


@routes.get("/proxymanager/status", "Your proxy manager: connected or not, which connection on which port since when",
            response=STATUS)
async def status(request: web.Request) -> web.Response:
    return ok(services_of(request).proxy_manager.status(user_of(request)))
