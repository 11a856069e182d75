"""Plugins (hoop.dev's shapes): turn on ``webhooks``, ``slack`` or ``runbooks``, set their settings, per connection.

* ``webhooks``: while it is on, the organization's endpoints (``/webhooks/endpoints``) get its events;
* ``slack``: review requests and their outcome go to Slack: ``SLACK_WEBHOOK_URL`` (an incoming webhook), or
  ``SLACK_BOT_TOKEN`` with ``SLACK_CHANNEL`` (a connection's own setting names its channel instead);
* ``runbooks``: a connection's setting lists the folders whose runbooks it offers (none: every runbook).

Settings (``config.envvars``) are given base64-encoded, as hoop.dev takes them, sealed at rest and shown as
``[REDACTED]`` afterwards.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from aiohttp import web

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
from control.schemas import STRINGS, TEXT
from gatewayd.audit import REDACTED
from gatewayd.models import Plugin, PluginConnection, new_id, rfc3339, utcnow
from gatewayd.store import Conflict
from gatewayd.webhooks import check_url

routes = RouteSet("Plugins", audit="plugins")

SETTINGS = {"webhooks": (), "runbooks": (), "slack": ("SLACK_WEBHOOK_URL", "SLACK_BOT_TOKEN", "SLACK_CHANNEL")}
OTHER_PLUGINS = {
    "review": "reviews are asked by connections' reviewers and access request rules (/access-requests/rules)",
    "access_control": "connections are every member's: gatewayd has no per-group access control plugin",
    "audit": "every session is recorded and every change audited, always",
    "dlp": "masking rules do this (/datamasking-rules)",
    "indexer": "sessions are searched without an index plugin",
}
CONNECTION_LINK = Schema("PluginResourceConnection", {
    "id": Field("string", True, description="the connection's id (or name)"), "name": Field("string"),
    "config": Field("array", items="string")})
CONFIG = Schema("PluginConfig", {"envvars": Field("object", True, description="name: base64 value", secret=True)})
PLUGIN = Schema("PluginCreate", {
    "name": Field("string", True, description=", ".join(SETTINGS)), "connections": Field("array", items=CONNECTION_LINK),
    "config": Field("object", nullable=True, schema=CONFIG), "source": Field("string", nullable=True),
    "priority": Field("integer", minimum=0, maximum=0)})
PLUGIN_UPDATE = Schema("PluginUpdate", {
    "name": Field("string"), "connections": Field("array", True, items=CONNECTION_LINK),
    "source": Field("string", nullable=True), "priority": Field("integer", minimum=0, maximum=0)})
LINK = Schema("PluginConnectionRequest", {"config": Field("array", True, items="string")})
_LINK_OUT = Schema("PluginResourceConnectionOut", {"id": TEXT, "name": TEXT, "config": STRINGS})
PLUGIN_OUT = Schema("Plugin", {
    "id": TEXT, "name": TEXT, "connections": Field("array", True, items=_LINK_OUT),
    "config": Field("object", True, nullable=True, schema=Schema("PluginConfigOut", {
        "id": TEXT, "envvars": Field("object", True, description="every value [REDACTED]")})),
    "source": Field("string", True, nullable=True), "priority": Field("integer", True, minimum=0, maximum=0)})
LINK_OUT = Schema("PluginConnection", {"id": TEXT, "plugin_id": TEXT, "connection_id": TEXT, "config": STRINGS,
                                       "updated_at": TEXT})


def _known(name: str, missing: int = 404) -> None:
    if name in OTHER_PLUGINS:
        raise ApiError(422, f"plugin {name!r} is not one of gatewayd's: {OTHER_PLUGINS[name]}")
    if name not in SETTINGS:
        raise ApiError(missing, f"plugin {name!r} " + ("not found" if missing == 404 else
                                                      f"is not one of gatewayd's ({', '.join(SETTINGS)})"))


async def _json(request: web.Request, plugin: Plugin) -> dict[str, Any]:
    store = services_of(request).store
    names = {c.id: c.name for c in await store.list_connections(plugin.org_id)}
    links = await store.list_plugin_connections(plugin.org_id, plugin.id)
    return {"id": plugin.id, "name": plugin.name, "source": None, "priority": 0,
            "connections": [{"id": link.connection_id, "name": names.get(link.connection_id, ""),
                             "config": link.config} for link in links],
            "config": {"id": plugin.id, "envvars": {k: REDACTED for k in plugin.config}} if plugin.config else None}


def _settings(name: str, envvars: dict[str, Any], previous: dict[str, str]) -> dict[str, str]:
    """The plugin's settings from base64 values (``[REDACTED]``: the stored one), checked."""
    allowed = SETTINGS[name]
    settings: dict[str, str] = {}
    for key, value in envvars.items():
        if key not in allowed:
            hint = " (runbook repositories are set with /api/runbooks/configurations)" if name == "runbooks" else ""
            raise ApiError(422, f"field 'config.envvars.{key}': plugin {name!r} has "
                                f"{'no settings' if not allowed else 'only ' + ', '.join(allowed)}{hint}")
        if not isinstance(value, str):
            raise ApiError(422, f"field 'config.envvars.{key}': expected a base64 string")
        if value == REDACTED:
            if key not in previous:
                raise ApiError(422, f"field 'config.envvars.{key}': {REDACTED} stands for the stored value, "
                                    "and there is none")
            settings[key] = previous[key]
            continue
        try:
            settings[key] = base64.b64decode(value, validate=True).decode()
        except (binascii.Error, ValueError, UnicodeDecodeError):
            raise ApiError(422, f"field 'config.envvars.{key}': expected base64 of UTF-8 text") from None
    if name == "slack" and settings:
        if settings.get("SLACK_WEBHOOK_URL") and (problem := check_url(settings["SLACK_WEBHOOK_URL"], False)):
            raise ApiError(422, f"field 'config.envvars.SLACK_WEBHOOK_URL': {problem}")
        if not settings.get("SLACK_WEBHOOK_URL") and not settings.get("SLACK_BOT_TOKEN"):
            raise ApiError(422, "field 'config.envvars': slack needs SLACK_WEBHOOK_URL (an incoming webhook) or "
                                "SLACK_BOT_TOKEN (with SLACK_CHANNEL, or a channel per connection)")
    return settings


async def _links(request: web.Request, plugin: Plugin, items: list[dict[str, Any]]) -> list[PluginConnection]:
    store = services_of(request).store
    links = {}
    for index, item in enumerate(items):
        connection = await store.get_connection(plugin.org_id, item["id"]) or (
            await store.get_connection(plugin.org_id, item["name"]) if item.get("name") else None)
        if connection is None:
            raise ApiError(422, f"field 'connections[{index}].id': connection {item['id']!r} not found")
        links[connection.id] = PluginConnection(id=new_id(), org_id=plugin.org_id, plugin_id=plugin.id,
                                                connection_id=connection.id, config=list(item.get("config") or []),
                                                updated_at=rfc3339(utcnow()) or "")
    return list(links.values())


async def _plugin(request: web.Request) -> Plugin:
    name = request.match_info["name"]
    _known(name)
    plugin = await services_of(request).store.get_plugin(user_of(request).org_id, name)
    if plugin is None:
        raise ApiError(404, f"plugin {name!r} not found")
    return plugin


@routes.get("/plugins", "The organization's plugins", response=array_of(PLUGIN_OUT))
async def list_plugins(request: web.Request) -> web.Response:
    plugins = await services_of(request).store.list_plugins(user_of(request).org_id)
    return ok([await _json(request, p) for p in plugins])


@routes.post("/plugins", "Turn a plugin on (admins)", body=PLUGIN, status=201, response=PLUGIN_OUT)
async def create_plugin(request: web.Request) -> web.Response:
    admin = require_admin(request)
    body = await json_body(request, PLUGIN)
    _known(body["name"], 422)
    now = rfc3339(utcnow()) or ""
    plugin = Plugin(id=new_id(), org_id=admin.org_id, name=body["name"], created_at=now, updated_at=now)
    plugin.config = _settings(plugin.name, (body.get("config") or {}).get("envvars") or {}, {})
    links = await _links(request, plugin, body.get("connections") or [])
    services = services_of(request)
    try:
        await services.store.save_plugin(plugin, create=True)
    except Conflict:
        raise ApiError(409, f"plugin {plugin.name!r} is on already") from None
    await services.store.replace_plugin_connections(admin.org_id, plugin.id, links)
    services.notifier.changed(admin.org_id)
    return ok(await _json(request, plugin), status=201)


@routes.get("/plugins/{name}", "A plugin", response=PLUGIN_OUT)
async def get_plugin(request: web.Request) -> web.Response:
    return ok(await _json(request, await _plugin(request)))


@routes.put("/plugins/{name}", "Set a plugin's connections (admins)", body=PLUGIN_UPDATE, response=PLUGIN_OUT)
async def update_plugin(request: web.Request) -> web.Response:
    admin = require_admin(request)
    plugin = await _plugin(request)
    body = await json_body(request, PLUGIN_UPDATE)
    if body.get("name") not in (None, plugin.name):
        raise ApiError(400, "field 'name': a plugin's name does not change")
    links = await _links(request, plugin, body["connections"])
    await services_of(request).store.replace_plugin_connections(admin.org_id, plugin.id, links)
    return ok(await _json(request, plugin))


@routes.put("/plugins/{name}/config", "Set a plugin's settings (admins): base64 values, sealed at rest",
            body=CONFIG, response=PLUGIN_OUT)
async def configure_plugin(request: web.Request) -> web.Response:
    admin = require_admin(request)
    plugin = await _plugin(request)
    body = await json_body(request, CONFIG)
    plugin.config = _settings(plugin.name, body["envvars"], plugin.config)
    plugin.updated_at = rfc3339(utcnow()) or ""
    services = services_of(request)
    await services.store.save_plugin(plugin, create=False)
    services.notifier.changed(admin.org_id)
    return ok(await _json(request, plugin))


@routes.delete("/plugins/{name}", "Turn a plugin off (admins): its settings and connections are forgotten",
               status=204)
async def delete_plugin(request: web.Request) -> web.Response:
    admin = require_admin(request)
    plugin = await _plugin(request)
    services = services_of(request)
    await services.store.delete_plugin(admin.org_id, plugin.name)
    services.notifier.changed(admin.org_id)
    return web.Response(status=204)


async def _connection_id(request: web.Request) -> str:
    key = request.match_info["id"]
    connection = await services_of(request).store.get_connection(user_of(request).org_id, key)
    if connection is None:
        raise ApiError(404, f"connection {key!r} not found")
    return connection.id


def _link_json(link: PluginConnection) -> dict[str, Any]:
    return {"id": link.id, "plugin_id": link.plugin_id, "connection_id": link.connection_id, "config": link.config,
            "updated_at": link.updated_at}


@routes.put("/plugins/{name}/conn/{id}", "Set a plugin's settings for one connection (admins)", body=LINK,
            response=LINK_OUT)
async def put_plugin_connection(request: web.Request) -> web.Response:
    require_admin(request)
    plugin = await _plugin(request)
    body = await json_body(request, LINK)
    link = PluginConnection(id=new_id(), org_id=plugin.org_id, plugin_id=plugin.id,
                            connection_id=await _connection_id(request), config=list(body["config"]),
                            updated_at=rfc3339(utcnow()) or "")
    await services_of(request).store.save_plugin_connection(link)
    return ok(_link_json(link))


@routes.get("/plugins/{name}/conn/{id}", "A plugin's settings for one connection", response=LINK_OUT)
async def get_plugin_connection(request: web.Request) -> web.Response:
    plugin = await _plugin(request)
    connection_id = await _connection_id(request)
    for link in await services_of(request).store.list_plugin_connections(plugin.org_id, plugin.id):
        if link.connection_id == connection_id:
            return ok(_link_json(link))
    raise ApiError(404, "the plugin has no settings for this connection")


@routes.delete("/plugins/{name}/conn/{id}", "Remove a plugin's settings for one connection (admins)", status=204)
async def delete_plugin_connection(request: web.Request) -> web.Response:
    admin = require_admin(request)
    plugin = await _plugin(request)
    if not await services_of(request).store.delete_plugin_connection(admin.org_id, plugin.id,
                                                                    await _connection_id(request)):
        raise ApiError(404, "the plugin has no settings for this connection")
    return web.Response(status=204)
