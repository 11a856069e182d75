"""The protocols this gateway serves, as their descriptions say (gatewayd.protocols): what the CLI and the
web console read instead of naming protocols themselves (filters, viewers, export formats, client commands)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from control.http import Field, RouteSet, Schema, array_of, ok
from gatewayd import protocols
from gatewayd.languages import HTTP, NONE, SHELL, SQL
from gatewayd.protocols import PRESENTATIONS, ProtocolDescription

routes = RouteSet("Protocols")

CLIENT = Schema("ClientCommand", {
    "programs": Field("array", True, items="string", description="the first one installed runs"),
    "args": Field("array", True, items="string",
                  description="its arguments: {hint} names an access hint of the credential; an argument that comes "
                              "out empty is left out"),
    "env": Field("object", True, schema=Schema("ClientEnvironment", {}, additional=True),
                 description="environment variables, as templates like args"),
    "shown": Field("string", True, description="what to print instead of running it (a template)"),
    "options_with_value": Field("string", True, description="non-empty: the user's options go before the last "
                                                            "argument (these letters take a value), the rest after"),
    "files": Field("object", True, schema=Schema("ClientFiles", {}, additional=True),
                   description="files the CLI writes for the client (name: a template like args), readable by their "
                               "owner only, removed when it exits; {file_<name>} in args or env is one's path"),
})
PROTOCOL = Schema("Protocol", {
    "name": Field("string", True, description="its listener and configuration section"),
    "subtype": Field("string", True, description="the connection subtype it serves (a session's connection_subtype)"),
    "session_type": Field("string", True),
    "title": Field("string", True, description="how people call it"),
    "language": Field("object", True, schema=Schema("ProtocolLanguage", {
        "name": Field("string", True), "family": Field("string", True, enum=(SQL, SHELL, HTTP, NONE)),
        "title": Field("string", True), "dialect": Field("string", True, nullable=True)})),
    "presentation": Field("string", True, enum=PRESENTATIONS, description="how its recordings are shown"),
    "exports": Field("array", True, items="string", description="the formats its sessions export to"),
    "client": Field("object", True, nullable=True, schema=CLIENT,
                    description="the native client `gatewayd connect` starts; null: the credential's url in a "
                                "browser"),
})


def protocol_json(description: ProtocolDescription) -> dict[str, Any]:
    language = description.language
    return {"name": description.name, "subtype": description.subtype, "session_type": description.session_type,
            "title": description.title,
            "language": {"name": language.name, "family": language.family, "title": language.title,
                         "dialect": language.dialect.name if language.dialect is not None else None},
            "presentation": description.presentation, "exports": list(description.exports),
            "client": description.client.as_json() if description.client is not None else None}


@routes.get("/protocols", "The protocols this gateway serves: language, how recordings show, exports, client",
            response=array_of(PROTOCOL))
async def list_protocols(request: web.Request) -> web.Response:
    return ok([protocol_json(description) for description in protocols.registered()])
