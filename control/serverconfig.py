"""Server information and the live server configuration (listener addresses, SSH host key)."""

from __future__ import annotations

import base64
import binascii
import time

from aiohttp import web
from cryptography.hazmat.primitives import serialization

from control.http import ApiError, Field, RouteSet, Schema, json_body, ok, require_operator, services_of, user_of
from gatewayd import protocols

routes = RouteSet("Server Management", audit="serverconfig")

LISTEN = Schema("ListenConfig", {"listen_address": Field("string", True)})
SSH_LISTEN = Schema("SSHServerConfig", {"listen_address": Field("string", True), "hosts_key": Field("string")})


def listener_keys() -> tuple[str, ...]:
    """The serverconfig part of every registered protocol (``http_proxy_server_config``, ...), sorted."""
    return tuple(sorted(description.server_config_key for description in protocols.registered()))


def misc_schema() -> Schema:
    """The PUT body: a listener part per registered protocol (SSH's with its host key)."""
    fields: dict[str, Field] = {"grpc_server_url": Field("string")}
    for key in listener_keys():
        fields[key] = Field("object", schema=SSH_LISTEN if key == "ssh_server_config" else LISTEN)
    fields["product_analytics"] = Field("string", enum=("active", "inactive"))
    return Schema("ServerMiscConfig", fields)


MISC = misc_schema()  # as registered when the API module is imported (the OpenAPI document); put_misc asks again
_TEXT = Field("string", True)
SERVERINFO_OUT = Schema("ServerInfo", {
    "version": _TEXT, "gateway_commit": _TEXT,
    "tenancy_type": Field("string", True, enum=("multitenant", "selfhosted")),
    "auth_method": _TEXT, "api_url": _TEXT, "grpc_url": _TEXT, "has_idp_audience": Field("boolean", True),
    "has_idp_custom_scopes": Field("boolean", True), "product_analytics": _TEXT,
    "uptime_seconds": Field("integer", True, minimum=0),
    "listeners": Field("object", description="per protocol: listen_address, status, error (admins only)"),
})
MISC_OUT = Schema("ServerMiscDocument", {}, additional=True)


def _check_listen(value: str, key: str) -> None:
    if value == "":
        return
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ApiError(400, f"{key}.listen_address: expected 'host:port' or '' to stop it, got {value!r}")


def _check_host_key(encoded: str) -> None:
    try:
        pem = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, "ssh_server_config.hosts_key: expected base64 of a PEM private key") from None
    for loader in (serialization.load_ssh_private_key, serialization.load_pem_private_key):
        try:
            loader(pem, None)
            return
        except (ValueError, TypeError):
            continue
    raise ApiError(400, "ssh_server_config.hosts_key: not an unencrypted PEM or OpenSSH private key")


@routes.get("/serverinfo", "Current server information", response=SERVERINFO_OUT)
async def serverinfo(request: web.Request) -> web.Response:
    services = services_of(request)
    config = services.config
    user = user_of(request)
    info = {
        "version": services.node.version,
        "gateway_commit": "",
        "tenancy_type": "multitenant" if config["auth.multi_tenant"] else "selfhosted",
        "auth_method": services.identity.config["auth.issuer"],
        "api_url": f"{config.public_url}/api",
        "grpc_url": services.node.server_config.get("grpc_server_url", ""),
        "has_idp_audience": bool(config["auth.oidc.audience"]),
        "has_idp_custom_scopes": config["auth.oidc.scopes"] != ["openid", "profile", "email"],
        "product_analytics": services.node.server_config.get("product_analytics", "inactive"),
        "uptime_seconds": int(time.time() - services.node.started_at),
    }
    if services.identity.is_operator(user):
        info["listeners"] = services.node.listeners.summary()
    return ok(info)


@routes.get("/serverconfig/misc", "Listener addresses, SSH host key and analytics setting (operator)",
            response=MISC_OUT)
async def get_misc(request: web.Request) -> web.Response:
    require_operator(request)
    return ok(services_of(request).node.server_config)


@routes.put("/serverconfig/misc", "Persist the configuration and start, restart or stop listeners live (operator)",
            body=MISC, response=MISC_OUT)
async def put_misc(request: web.Request) -> web.Response:
    require_operator(request)
    body = await json_body(request, misc_schema())
    services = services_of(request)
    document = {k: (dict(v) if isinstance(v, dict) else v) for k, v in services.node.server_config.items()}
    for key in listener_keys():
        if key in body:
            _check_listen(body[key]["listen_address"], key)
            document[key] = {**document.get(key, {}), **body[key]}
    if body.get("ssh_server_config", {}).get("hosts_key"):
        _check_host_key(body["ssh_server_config"]["hosts_key"])
    for key in ("grpc_server_url", "product_analytics"):
        if key in body:
            document[key] = body[key]
    await services.node.update_server_config(document)
    failed = {name: s["error"] for name, s in services.node.listeners.summary().items()
              if s["listen_address"] and s["status"] == "error"}
    if failed:
        detail = "; ".join(f"{name}: {error}" for name, error in failed.items())
        raise ApiError(409, f"configuration saved, but some listeners did not start: {detail}")
    return ok(document)
