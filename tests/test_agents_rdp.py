"""RDP through an agent: xfreerdp logs on through the gateway and a ``gatewayd agent``; offline is an ``e`` event.

The agent runs beside the gateway here (the private-network cases are tests/test_agents_netns.py);
what this proves is that the RDP proxy's dial (pyrdp adopting the socket the dialer hands out: one
end of a socketpair for an agent) goes through the agent.
"""

from __future__ import annotations

import uuid
from typing import Any, Iterator

import aiohttp
import pytest

from tests.apiclient import Api, b64, of_kind
from tests.conftest import Daemon, free_port, wait_port
from tests.rdppeer import Peers
from tests.test_agents_netns import AgentProcess, until_agent
from tests.test_rdp_proxy import TARGET_PASSWORD, TARGET_USER, xfreerdp


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, rdp_peers: Peers) -> Iterator[Daemon]:
    rdp_port = free_port()
    daemon = Daemon(tmp_path_factory.mktemp("agents-rdp") / "data", {
        "grpc.listen": f"127.0.0.1:{free_port()}", "listeners.rdp": f"127.0.0.1:{rdp_port}",
        "sessions.flush_interval": "100ms"}).start()
    wait_port(rdp_port, daemon.process, "gatewayd")
    daemon.rdp_port = rdp_port
    yield daemon
    daemon.stop()


@pytest.fixture(scope="module")
async def api(gateway) -> Any:
    async with aiohttp.ClientSession() as http:
        yield Api(gateway, http, gateway.token("admin@example.com", groups="admin"))


async def rdp_role(api: Api, port: int, agent: str) -> dict:
    code, connection = await api("POST", "/connections", {
        "name": f"rdp-{uuid.uuid4().hex[:8]}", "type": "custom", "subtype": "rdp", "agent_id": agent,
        "secret": {f"envvar:{k}": b64(v) for k, v in {"HOST": "127.0.0.1", "PORT": str(port), "USER": TARGET_USER,
                                                       "PASS": TARGET_PASSWORD}.items()}})
    assert code == 201, connection
    return connection


async def test_xfreerdp_logs_on_through_the_agent_and_offline_is_an_e_event(api, gateway, rdp_peers, tmp_path):
    code, created = await api("POST", "/agents", {"name": "desk"})
    assert code == 201, created
    connection = await rdp_role(api, rdp_peers.observer_port, "desk")
    secret, session_id = await api.credential(connection)
    code, output = await xfreerdp(rdp_peers, gateway.rdp_port, secret, "+auth-only")
    assert code != 0
    session = await api.done_session(session_id, timeout=30)
    assert any('agent "desk" is offline' in text for text in of_kind(session, "e")), session

    agent = AgentProcess(created["command"], tmp_path / "agent.log", None).start()
    try:
        await until_agent(api, "desk", "online")
        secret, session_id = await api.credential(connection)
        code, output = await xfreerdp(rdp_peers, gateway.rdp_port, secret, "+auth-only")
        assert code == 0, output
        session = await api.done_session(session_id, timeout=30)
        assert session["exit_code"] == 0, session
    finally:
        agent.stop()
