"""Agents: register one (its token shown once), list, show, delete (disconnects it), rotate its token."""

from __future__ import annotations

import shlex
from typing import Any

from aiohttp import web

from control.http import ApiError, Field, RouteSet, Schema, array_of, json_body, ok, require_admin, services_of, \
    user_of
from control.schemas import TEXT
from gatewayd.agent.registry import TOKEN_PREFIX
from gatewayd.crypto import hash_secret, new_credential_secret
from gatewayd.models import Agent, new_id, rfc3339, utcnow
from gatewayd.services import Services
from gatewayd.store import Conflict

routes = RouteSet("Agents", audit="agents")

MODES = ("standard", "embedded")
AGENT = Schema("AgentRequest", {
    "name": Field("string", True),
    "mode": Field("string", enum=MODES, description="standard (default) or embedded; both serve the same way"),
})
AGENT_OUT = Schema("Agent", {
    "id": TEXT, "name": TEXT, "mode": TEXT,
    "status": Field("string", True, description="online while a gateway node holds its connection"),
    "connections": Field("integer", True, description="its live connections to this node (2 or more: its token "
                                                      "may be in use by another process)"),
    "hostname": TEXT, "version": TEXT, "connected_at": TEXT, "disconnected_at": TEXT,
    "created_at": TEXT, "updated_at": TEXT,
})
AGENT_TOKEN_OUT = Schema("AgentWithToken", {
    **AGENT_OUT.fields,
    "token": Field("string", True, description="shown once: only its hash is stored"),
    "command": Field("string", True, description="the command that starts the agent, ready to paste"),
})


def agent_json(services: Services, agent: Agent) -> dict[str, Any]:
    links = services.agents.links.get(agent.id, []) if services.agents is not None else []
    return {"id": agent.id, "name": agent.name, "mode": agent.mode, "status": "online" if links else "offline",
            "connections": len(links), "hostname": agent.hostname if links else agent.hostname,
            "version": agent.version, "connected_at": agent.connected_at, "disconnected_at": agent.disconnected_at,
            "created_at": agent.created_at, "updated_at": agent.updated_at}


def start_command(services: Services, token: str) -> str:
    """``GATEWAYD_AGENT_TOKEN=... gatewayd agent --url ...``, with the certificate's fingerprint when the gateway
    made its own. The token goes in the agent's environment, not its arguments, which every local user can read
    (``ps``)."""
    words = ["gatewayd", "agent", "--url", services.node.grpc_url()]
    if services.node.grpc is not None and not services.config["grpc.tls_cert"] and services.node.grpc.fingerprint:
        words += ["--tls-fingerprint", services.node.grpc.fingerprint]
    return f"GATEWAYD_AGENT_TOKEN={shlex.quote(token)} " + " ".join(shlex.quote(word) for word in words)


def _with_token(services: Services, agent: Agent, token: str) -> dict[str, Any]:
    return {**agent_json(services, agent), "token": token, "command": start_command(services, token)}


async def _find(request: web.Request) -> Agent:
    key = request.match_info["name"]
    agent = await services_of(request).store.get_agent(user_of(request).org_id, key)
    if agent is None:
        raise ApiError(404, f"agent {key!r} not found")
    return agent


@routes.post("/agents", "Register an agent: its token is shown once, with the command that starts it",
             body=AGENT, status=201, response=AGENT_TOKEN_OUT)
async def create(request: web.Request) -> web.Response:
    admin = require_admin(request)
    body = await json_body(request, AGENT)
    name = body["name"].strip()
    if not name or "/" in name or len(name) > 128:
        raise ApiError(422, "field 'name': a non-empty name without '/', at most 128 characters")
    token = new_credential_secret(TOKEN_PREFIX)
    now = rfc3339(utcnow())
    agent = Agent(id=new_id(), org_id=admin.org_id, name=name, mode=body.get("mode") or "standard",
                  token_hash=hash_secret(token), created_at=now, updated_at=now)
    try:
        await services_of(request).store.create_agent(agent)
    except Conflict:
        raise ApiError(409, f"agent {name!r} already exists") from None
    return ok(_with_token(services_of(request), agent, token), status=201)


@routes.get("/agents", "List the organization's agents and their presence", response=array_of(AGENT_OUT))
async def list_agents(request: web.Request) -> web.Response:
    services = services_of(request)
    return ok([agent_json(services, a) for a in await services.store.list_agents(user_of(request).org_id)])


@routes.get("/agents/{name}", "An agent, by name or id", response=AGENT_OUT)
async def get(request: web.Request) -> web.Response:
    return ok(agent_json(services_of(request), await _find(request)))


@routes.delete("/agents/{name}", "Delete an agent: it is disconnected and its token refused from now on",
               status=204)
async def delete(request: web.Request) -> web.Response:
    admin = require_admin(request)
    agent = await _find(request)
    services = services_of(request)
    await services.store.delete_agent(admin.org_id, agent.id)
    await services.agents.drop_everywhere(agent, f'agent "{agent.name}" was deleted')
    return web.Response(status=204)


@routes.post("/agents/{name}/token", "Rotate an agent's token: the old one is refused and its connections end",
             status=200, response=AGENT_TOKEN_OUT)
async def rotate(request: web.Request) -> web.Response:
    require_admin(request)
    agent = await _find(request)
    services = services_of(request)
    token = new_credential_secret(TOKEN_PREFIX)
    agent.token_hash, agent.updated_at = hash_secret(token), rfc3339(utcnow())
    await services.store.save_agent(agent)
    await services.agents.drop_everywhere(agent, f'the token of agent "{agent.name}" was rotated')
    return ok(_with_token(services, agent, token))
