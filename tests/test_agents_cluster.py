"""Several gateways: an agent told of one node connects to every node, and each node dials through it.

Two real ``gatewayd run`` nodes share one PostgreSQL store (and one gRPC certificate); the agent
is given node A's URL only. A's ``Welcome`` names B (the node registry), so the agent holds a
connection to each, and a psql session arriving at B reaches the target through the agent.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
import subprocess
import uuid

import aiohttp
import pytest

from gatewayd.tls import generate_self_signed
from tests.apiclient import Api, b64
from tests.conftest import Daemon, free_port, new_store_database_now, wait_port
from tests.ports import free_ports
from tests.test_agents_netns import AgentProcess, until_agent


def start_node(tmp_path_factory, name: str, shared: dict[str, str]) -> Daemon:
    pg_port, grpc_port = free_port(), free_port()
    daemon = Daemon(tmp_path_factory.mktemp(name) / "data", {
        **shared, "cluster.node_name": name, "cluster.lease": "3s", "sessions.flush_interval": "100ms",
        "grpc.listen": f"127.0.0.1:{grpc_port}", "listeners.postgres": f"127.0.0.1:{pg_port}"})
    daemon.start(timeout=40)
    wait_port(pg_port, daemon.process, f"{name}'s postgres listener")
    daemon.pg_port = pg_port
    return daemon


@pytest.fixture(scope="module")
def nodes(tmp_path_factory, pg_store):
    tls = tmp_path_factory.mktemp("grpc-tls")
    generate_self_signed(tls / "grpc.crt", tls / "grpc.key")  # one certificate for the gateway's every node
    shared = {"store.driver": "postgres", "store.url": new_store_database_now(pg_store),
              "secrets.key": base64.b64encode(secrets.token_bytes(32)).decode(),
              "grpc.tls_cert": str(tls / "grpc.crt"), "grpc.tls_key": str(tls / "grpc.key")}
    a = start_node(tmp_path_factory, "node-a", shared)
    b = start_node(tmp_path_factory, "node-b", shared)
    yield a, b
    for node in (b, a):
        node.stop()


async def test_an_agent_told_of_one_node_serves_sessions_arriving_at_the_other(nodes, pg_target, tmp_path):
    a, b = nodes
    token = a.token("admin@example.com", groups="admin")
    async with aiohttp.ClientSession() as http:
        api_a, api_b = Api(a, http, token), Api(b, http, token)
        code, created = await api_a("POST", "/agents", {"name": "vpc"})
        assert code == 201, created
        url_a = created["command"].split("--url ")[1].split()[0]
        assert url_a == f"grpcs://{a.settings['grpc.listen']}"
        fingerprint = subprocess.run(["openssl", "x509", "-noout", "-fingerprint", "-sha256", "-in",
                                      a.settings["grpc.tls_cert"]], capture_output=True, text=True,
                                     check=True).stdout.split("=", 1)[1].strip()
        agent = AgentProcess(f"gatewayd agent --url {url_a} --token {created['token']} --tls-fingerprint "
                             f"{fingerprint}", tmp_path / "agent.log", None).start()
        try:
            await until_agent(api_a, "vpc", "online", connections=1)
            await until_agent(api_b, "vpc", "online", connections=1)  # told of B by A, it connected there too
            code, connection = await api_a("POST", "/connections", {
                "name": f"pg-{uuid.uuid4().hex[:8]}", "type": "database", "subtype": "postgres", "agent_id": "vpc",
                "secret": {f"envvar:{k}": b64(v) for k, v in {
                    "HOST": "127.0.0.1", "PORT": str(pg_target.port), "USER": "postgres",
                    "PASS": pg_target.password, "DB": "postgres",
                    "SSLROOTCERT": pg_target.root_cert()}.items()}})  # verify-full through an agent
            assert code == 201, connection
            for node, api in ((b, api_b), (a, api_a)):
                code, access = await api("POST", f"/connections/{connection['name']}/credentials",
                                         {"access_duration_seconds": 600})
                secret = access["connection_credentials"]["username"]
                result = subprocess.run(
                    ["psql", f"postgres://{secret}:any@127.0.0.1:{node.pg_port}/postgres?sslmode=disable", "-X",
                     "-At", "-c", "select 'served through the agent'"], capture_output=True, text=True, timeout=60)
                assert result.stdout.strip() == "served through the agent", result.stderr
        finally:
            agent.stop()


async def test_every_worker_of_a_node_is_a_node_the_agent_serves(tmp_path_factory, pg_target, tmp_path):
    """With workers, each worker serves gRPC on a port of its own; an agent told of one reaches them all."""
    from tests.test_workers import reach_every_worker, workers_daemon

    grpc_port, pg_port = free_ports(2), free_port()  # gRPC: a port per worker, the first's + its index
    daemon = workers_daemon(tmp_path_factory.mktemp("agent-workers"), {
        "grpc.listen": f"127.0.0.1:{grpc_port}", "listeners.postgres": f"127.0.0.1:{pg_port}",
        "log.format": "json"})
    daemon.start(timeout=60)
    wait_port(pg_port, daemon.process, "the postgres listener")
    wait_port(grpc_port + 1, daemon.process, "worker 1's gRPC server")
    daemon.ports = {"postgres": pg_port}
    agent = None
    try:
        token = daemon.token("admin@example.com", groups="admin")
        async with aiohttp.ClientSession() as http:
            api = Api(daemon, http, token)
            code, created = await api("POST", "/agents", {"name": "vpc"})
            assert code == 201, created
            assert f"--url grpcs://127.0.0.1:{grpc_port} " in created["command"]
            agent = AgentProcess(created["command"], tmp_path / "agent.log", None).start()
            code, connection = await api("POST", "/connections", {
                "name": f"pg-{uuid.uuid4().hex[:8]}", "type": "database", "subtype": "postgres", "agent_id": "vpc",
                "secret": {f"envvar:{k}": b64(v) for k, v in {
                    "HOST": "127.0.0.1", "PORT": str(pg_target.port), "USER": "postgres",
                    "PASS": pg_target.password, "DB": "postgres",
                    "SSLROOTCERT": pg_target.root_cert()}.items()}})  # verify-full through an agent
            assert code == 201, connection
            await until_agent(api, "vpc", "online", connections=1)

            async def through_the_agent() -> None:
                code, access = await api("POST", f"/connections/{connection['name']}/credentials",
                                         {"access_duration_seconds": 600})
                assert code == 201, access
                secret = access["connection_credentials"]["username"]
                for _ in range(100):  # until the worker this connection lands on has the agent's link too
                    result = subprocess.run(
                        ["psql", f"postgres://{secret}:any@127.0.0.1:{pg_port}/postgres?sslmode=disable", "-X",
                         "-At", "-c", "select 'served through the agent'"], capture_output=True, text=True,
                        timeout=60)
                    if result.returncode == 0 or "offline" not in result.stderr:
                        break
                    await asyncio.sleep(0.1)  # the agent learns of worker 1 from worker 0's Welcome
                assert result.stdout.strip() == "served through the agent", result.stderr

            await reach_every_worker(daemon, connection["name"], through_the_agent)
    finally:
        if agent is not None:
            agent.stop()
        daemon.stop()
