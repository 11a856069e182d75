"""Agents: the API (token once, rotation, delete), the gRPC channel's refusals and audit, flow control per stream.

A real gatewayd with its gRPC server on 127.0.0.1 and real ``gatewayd agent`` processes (on the
host's own network: tests/test_agents_netns.py has the private network). The HTTP target app
is reached through the agent; a connection whose agent is offline answers 502.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shlex
import shutil
import socket
import sqlite3
import ssl
import struct
import subprocess
import sys
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import aiohttp
import grpc
import pytest

from gatewayd.agent import agent_pb2 as pb
from gatewayd.agent import agent_pb2_grpc as pb_grpc
from gatewayd.agent.channel import open_channel
from gatewayd.crypto import hash_secret
from gatewayd.tls import generate_self_signed
from tests.apiclient import Api, b64
from tests.conftest import ROOT, Daemon, free_port, wait_port
from tests.test_agents_netns import AgentProcess, until_agent


def test_the_committed_stubs_are_those_of_agent_proto(tmp_path):
    """``make proto`` was run after the last edit of agent.proto."""
    (tmp_path / "gatewayd" / "agent").mkdir(parents=True)
    shutil.copy(ROOT / "gatewayd" / "agent" / "agent.proto", tmp_path / "gatewayd" / "agent")
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.", "--grpc_python_out=.",
                    "gatewayd/agent/agent.proto"], cwd=tmp_path, check=True, capture_output=True)
    for name in ("agent_pb2.py", "agent_pb2_grpc.py"):
        assert (tmp_path / "gatewayd" / "agent" / name).read_text() == \
            (ROOT / "gatewayd" / "agent" / name).read_text(), f"{name} is stale: run make proto"


ALLOWED_BIND = "192.0.2.10"  # an address beside loopback the operator lets proxy managers listen on (TEST-NET-1)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory) -> Iterator[Daemon]:
    http_port, pg_port, ssh_port, tunnel_port = free_port(), free_port(), free_port(), free_port()
    daemon = Daemon(tmp_path_factory.mktemp("agents-api") / "data", {
        "grpc.listen": f"127.0.0.1:{free_port()}", "grpc.tunnel_port": tunnel_port,
        "listeners.http": f"127.0.0.1:{http_port}",
        "listeners.postgres": f"127.0.0.1:{pg_port}", "listeners.ssh": f"127.0.0.1:{ssh_port}",
        "sessions.flush_interval": "100ms", "proxy_manager.allowed_binds": [ALLOWED_BIND],
        # the refusals these tests make on purpose, all from 127.0.0.1, must not throttle a later test's (the
        # throttle's own tests have a gateway of their own: throttled_gateway)
        "throttle.credential_failures": 1000}).start()
    wait_port(http_port, daemon.process, "gatewayd")
    wait_port(ssh_port, daemon.process, "gatewayd's ssh listener")
    daemon.http_port, daemon.pg_port, daemon.ssh_port, daemon.tunnel_port = http_port, pg_port, ssh_port, tunnel_port
    yield daemon
    daemon.stop()


@pytest.fixture(scope="module")
async def api(gateway) -> Any:
    token = gateway.token("admin@example.com", groups="admin", name="Ada Admin")
    async with aiohttp.ClientSession() as http:
        yield Api(gateway, http, token)


def grpc_of(created: dict) -> tuple[str, str]:
    """The gRPC URL and the certificate's fingerprint an agent's start command names (shell-quoted where needed)."""
    words = shlex.split(created["command"])
    return words[words.index("--url") + 1], words[words.index("--tls-fingerprint") + 1]


async def new_agent(api: Api, name: str | None = None) -> dict:
    code, created = await api("POST", "/agents", {"name": name or f"agent-{uuid.uuid4().hex[:8]}"})
    assert code == 201, created
    return created


def start(created: dict, tmp_path: Path, command: str | None = None) -> AgentProcess:
    return AgentProcess(command or created["command"], tmp_path / f"agent-{uuid.uuid4().hex[:6]}.log", None).start()


async def audit(api: Api, action: str) -> list[dict]:
    code, page = await api("GET", f"/audit/logs?action={action}&page_size=100")
    assert code == 200, page
    return page["data"]


async def test_register_list_show_and_the_token_shown_once(api, gateway):
    created = await new_agent(api, "lab")
    assert created["token"].startswith("agt-") and created["status"] == "offline"
    # the token goes in the agent's environment: a process's arguments are every local user's to read (ps)
    assert created["command"].startswith(f"GATEWAYD_AGENT_TOKEN={created['token']} gatewayd agent --url grpcs://")
    assert "--token" not in created["command"] and "--tls-fingerprint" in created["command"]
    code, shown = await api("GET", "/agents/lab")
    assert code == 200 and "token" not in shown and shown["id"] == created["id"]
    assert (await api("GET", f"/agents/{created['id']}"))[1]["name"] == "lab"
    assert "lab" in [a["name"] for a in (await api("GET", "/agents"))[1]]
    assert (await api("POST", "/agents", {"name": "lab"}))[0] == 409
    assert (await api("POST", "/agents", {"name": "x", "mode": "weird"}))[0] == 422
    assert (await api("GET", "/agents/nope"))[0] == 404
    user = gateway.token("user@example.com", groups="")
    assert (await api("POST", "/agents", {"name": "mine"}, token=user))[0] == 403
    assert created["token"] not in gateway.log_text()  # never logged; only its hash is stored
    audited = await audit(api, "agents.create")
    assert audited and created["token"] not in str(audited)


async def test_an_unknown_token_is_refused_and_audited(gateway, api, tmp_path):
    url = f"grpcs://127.0.0.1:{gateway.settings['grpc.listen'].rsplit(':', 1)[1]}"
    created = await new_agent(api)
    fingerprint = created["command"].rsplit("--tls-fingerprint ", 1)[1]
    forged = AgentProcess(f"gatewayd agent --url {url} --token agt-forged --tls-fingerprint {fingerprint}",
                          tmp_path / "forged.log", None).start()
    assert forged.wait_exit() == 3  # the process says so and stops
    assert "refused this agent's token" in (tmp_path / "forged.log").read_text()
    refusals = await audit(api, "agent.refused")
    assert refusals and refusals[0]["outcome"] == "failure" and "agt-forged" not in str(refusals[0])


async def test_an_agent_cannot_open_a_stream_towards_the_gateway(gateway, api, tmp_path):
    created = await new_agent(api)
    agent = start(created, tmp_path)
    try:
        await until_agent(api, created["name"], "online")  # the token reached it, from the command's environment
        assert created["token"] not in Path(f"/proc/{agent.process.pid}/cmdline").read_text()
        url = created["command"].split("--url ")[1].split()[0]
        channel = await open_channel(url, created["command"].rsplit("--tls-fingerprint ", 1)[1])
        try:
            call = pb_grpc.AgentGatewayStub(channel).Tunnel(
                metadata=(("authorization", f"Bearer {created['token']}"),))
            # refused before a byte of it is read (no stream was asked of this agent): the call ends on the
            # gateway's word without the agent sending anything; a frame written into a refused call reports its own
            # failed write (INTERNAL), not the refusal, so the status is read first
            async with asyncio.timeout(30):  # a gateway that let the call stand would leave it open: a failure
                code = await call.code()
            assert code == grpc.StatusCode.PERMISSION_DENIED
            assert "only the gateway opens streams" in await call.details()
            with pytest.raises((grpc.aio.AioRpcError, asyncio.InvalidStateError)):
                await call.write(pb.Frame(stream_id="made-up-by-the-agent", connected=True))
        finally:
            await channel.close()
        refusals = [e for e in await audit(api, "agent.stream_refused") if created["name"] in e["actor_email"]]
        assert refusals and refusals[0]["outcome"] == "failure" and "only the gateway opens streams" in \
            refusals[0]["error_message"]
    finally:
        agent.stop()


async def test_an_agent_gone_while_its_arrival_is_still_being_recorded_leaves_no_live_connection(gateway, api):
    """The agent's control channel cancelled after its hello while the gateway still records its arrival (the
    store's write lock held here, as a slow disk would): the link goes with the channel, it is not left counting
    as a live connection for good (a terminated agent once read "online with 1 links" from then on)."""
    created = await new_agent(api)
    url = created["command"].split("--url ")[1].split()[0]
    channel = await open_channel(url, created["command"].rsplit("--tls-fingerprint ", 1)[1])
    store = sqlite3.connect(gateway.data_dir / "gatewayd.db", isolation_level=None)
    try:
        store.execute("BEGIN IMMEDIATE")  # the gateway's writes wait for this lock
        try:
            call = pb_grpc.AgentGatewayStub(channel).Connect(
                metadata=(("authorization", f"Bearer {created['token']}"),))
            await call.write(pb.AgentMessage(hello=pb.Hello(version="test", hostname="gone")))
            await until_agent(api, created["name"], "online", connections=1)  # counted, its arrival not yet stored
            call.cancel()
            gone = await until_agent(api, created["name"], "offline", timeout=8)  # the lock is still held
            assert gone["connections"] == 0
        finally:
            store.execute("ROLLBACK")
    finally:
        store.close()
        await channel.close()
    for _ in range(100):  # its disconnect is audited once the lock is let go
        disconnects = [e for e in await audit(api, "agent.disconnect") if created["name"] in e["actor_email"]]
        if disconnects:
            break
        await asyncio.sleep(0.05)
    assert disconnects and "lost" in disconnects[0]["error_message"]


async def test_an_agent_s_answer_that_it_cannot_reach_a_target_is_read_before_it_lets_go_of_the_stream():
    """The agent says on a Tunnel of its own that the target refused, then waits for the gateway to end the call:
    a cancel sent before that raced the answer, and a gateway slow to read it (a busy loop) lost it, so psql
    waited out its 10 s dial instead of hearing "connection refused" (tests/test_agents_netns.py flaked so).
    The gateway here is a gRPC server of the same service that reads the stream half a second late."""
    from gatewayd.agent.runner import AgentProcess as Agent

    read: list[pb.Frame] = []
    ended = asyncio.Event()

    class LateGateway(pb_grpc.AgentGatewayServicer):
        async def Tunnel(self, request_iterator, context):  # noqa: N802
            try:
                await asyncio.sleep(0.5)
                first = await context.read()
                if first is not grpc.aio.EOF:
                    read.append(first)
            finally:
                ended.set()

    server = grpc.aio.server()
    pb_grpc.add_AgentGatewayServicer_to_server(LateGateway(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        agent = Agent(url=f"grpc://127.0.0.1:{port}", token="agt-test")
        dead = free_port()  # nothing listens there: refused at once
        await agent.serve(pb_grpc.AgentGatewayStub(channel),
                          pb.Open(stream_id="s-1", host="127.0.0.1", port=dead, connection="pg-x", timeout=5))
        await asyncio.wait_for(ended.wait(), 10)
        assert [(frame.stream_id, frame.connected, frame.error) for frame in read] == \
            [("s-1", False, "connection refused")]
    finally:
        await channel.close()
        await server.stop(None)


async def test_two_live_connections_of_one_agent_are_reported_and_audited(gateway, api, tmp_path):
    created = await new_agent(api)
    first, second = start(created, tmp_path), None
    try:
        await until_agent(api, created["name"], "online", connections=1)
        second = start(created, tmp_path)  # the same token from a second process
        await until_agent(api, created["name"], "online", connections=2)
        duplicates = [e for e in await audit(api, "agent.duplicate")
                      if e["request_payload_redacted"].get("agent") == created["name"]]
        assert duplicates and "may be in use by another process" in duplicates[0]["error_message"]
        assert "agent connected twice" in gateway.log_text()
    finally:
        first.stop()
        if second is not None:
            second.stop()


async def test_delete_disconnects_the_agent_and_refuses_its_token(gateway, api, tmp_path):
    created = await new_agent(api)
    agent = start(created, tmp_path)
    await until_agent(api, created["name"], "online")
    assert (await api("DELETE", f"/agents/{created['name']}"))[0] == 204
    assert agent.wait_exit() == 3  # disconnected, then its token refused
    assert (await api("GET", f"/agents/{created['name']}"))[0] == 404
    again = start(created, tmp_path)
    assert again.wait_exit() == 3


async def test_token_rotation_ends_the_old_token_s_connection(gateway, api, tmp_path):
    created = await new_agent(api)
    old = start(created, tmp_path)
    await until_agent(api, created["name"], "online")
    code, rotated = await api("POST", f"/agents/{created['name']}/token")
    assert code == 200 and rotated["token"] != created["token"] and rotated["id"] == created["id"]
    assert old.wait_exit() == 3
    new = start(rotated, tmp_path)
    try:
        await until_agent(api, created["name"], "online")
    finally:
        new.stop()
    await until_agent(api, created["name"], "offline")


async def test_a_token_rotated_while_its_agent_says_hello_serves_nothing_and_stays_rotated(gateway, api, tmp_path):
    """A control channel opened with the token, its hello held back while an admin rotates the token (a stolen
    token's holder can wait so): the hello is refused, not taken as a link of the agent, and the new token
    stays the agent's (the arrival's presence once stored the old token's hash back, undoing the rotation)."""
    created = await new_agent(api)
    url = created["command"].split("--url ")[1].split()[0]
    channel = await open_channel(url, created["command"].rsplit("--tls-fingerprint ", 1)[1])
    try:
        call = pb_grpc.AgentGatewayStub(channel).Connect(metadata=(("authorization", f"Bearer {created['token']}"),))
        await asyncio.sleep(0.5)  # the gateway has looked the token up and waits for the hello
        code, rotated = await api("POST", f"/agents/{created['name']}/token")
        assert code == 200
        await call.write(pb.AgentMessage(hello=pb.Hello(version="test", hostname="stolen")))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async with asyncio.timeout(10):
                while (message := await call.read()) is not grpc.aio.EOF:
                    assert not message.HasField("welcome"), "the channel was served"
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        await channel.close()
    await until_agent(api, created["name"], "offline", connections=0)
    assert [e for e in await audit(api, "agent.refused") if created["name"] in e["actor_email"]]
    stored = sqlite3.connect(gateway.data_dir / "gatewayd.db")
    try:
        (token_hash,) = stored.execute("SELECT token_hash FROM agents WHERE id = ?", (created["id"],)).fetchone()
    finally:
        stored.close()
    assert token_hash == hash_secret(rotated["token"])
    new = start(rotated, tmp_path)
    try:
        await until_agent(api, created["name"], "online", connections=1)
    finally:
        new.stop()


async def test_the_agent_never_follows_a_node_of_the_gateway_whose_url_would_drop_tls(gateway, api, tmp_path):
    """A node registered with a plain ``grpc://`` URL (a careless ``grpc.node_url``), said to the agent in Welcome:
    the agent, given a ``grpcs://`` URL, does not connect to it (it once did, sending its token and the streams
    there in clear) and keeps serving the node it trusts, as it does beside a node's URL that does not parse. The
    plain node here is a gRPC server that records the metadata it is sent."""
    heard: list[tuple] = []

    class PlainNode(pb_grpc.AgentGatewayServicer):
        async def Connect(self, request_iterator, context):  # noqa: N802
            heard.append(tuple(context.invocation_metadata() or ()))

    server = grpc.aio.server()
    pb_grpc.add_AgentGatewayServicer_to_server(PlainNode(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    created = await new_agent(api)
    node_id, now = str(uuid.uuid4()), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    store = sqlite3.connect(gateway.data_dir / "gatewayd.db", isolation_level=None)
    for at, url in ((0, f"grpc://127.0.0.1:{port}"), (1, "grpcs://127.0.0.1:no-port")):  # the second: not a URL
        store.execute("INSERT INTO nodes (id, name, slot, host, pid, listeners, status, started_at, heartbeat_at) "
                      "VALUES (?, 'plain', ?, 'plain', 1, ?, 'up', ?, ?)",
                      (f"{node_id}-{at}", 9 + at, f'{{"grpc": "{url}"}}', now, now))
    agent = start(created, tmp_path)
    try:
        await until_agent(api, created["name"], "online", connections=1)
        await asyncio.sleep(3)  # the agent's connections to the nodes of its Welcome are made within this
        assert heard == []
        assert agent.process.poll() is None
        said = [line for line in agent.log_path.read_text().splitlines() if f"grpc://127.0.0.1:{port}" in line]
        assert len(said) == 1 and "not followed" in said[0]
    finally:
        agent.stop()
        store.execute("DELETE FROM nodes WHERE id LIKE ?", (f"{node_id}-%",))
        store.close()
        await server.stop(None)


async def test_a_peer_whose_certificate_is_not_the_pinned_one_is_said_and_retried_while_the_first_serves(
        gateway, api, tmp_path):
    """A node said to the agent in Welcome whose TLS certificate is not the one the agent pins (a node set up with
    another certificate): its connection once ended unseen, with no log line and no retry, the agent serving the
    first node only with nothing to tell anyone why. It is logged, as a JSON line that names the node's URL and
    carries no token, and retried with backoff like the first node's failures, the agent serving on meanwhile.
    (The gateway never sees it: the agent drops the connection after the handshake, before a call.)"""
    generate_self_signed(tmp_path / "other.crt", tmp_path / "other.key")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tmp_path / "other.crt", tmp_path / "other.key")
    handshakes = 0

    async def handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal handshakes
        handshakes += 1
        writer.close()

    server = await asyncio.start_server(handshake, "127.0.0.1", 0, ssl=context)
    peer = f"grpcs://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    created = await new_agent(api)
    node_id, now = str(uuid.uuid4()), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    store = sqlite3.connect(gateway.data_dir / "gatewayd.db", isolation_level=None)
    store.execute("INSERT INTO nodes (id, name, slot, host, pid, listeners, status, started_at, heartbeat_at) "
                  "VALUES (?, 'other-cert', 11, 'other', 1, ?, 'up', ?, ?)", (node_id, f'{{"grpc": "{peer}"}}', now, now))
    agent = start(created, tmp_path, created["command"] + " --log-format json")
    try:
        await until_agent(api, created["name"], "online", connections=1)
        deadline = time.monotonic() + 15
        while True:
            said = [json.loads(line) for line in agent.log_path.read_text().splitlines()
                    if line.startswith("{") and peer in line]
            if len(said) >= 2:  # said, and tried again
                break
            assert time.monotonic() < deadline, f"the peer's failure was said {len(said)} times ({handshakes} tries)"
            await asyncio.sleep(0.1)
        assert all(entry["url"] == peer and "not the pinned one" in entry["reason"] for entry in said), said
        assert created["token"] not in agent.log_path.read_text()
        assert agent.process.poll() is None
        await until_agent(api, created["name"], "online", connections=1)  # the first node's link serves on
    finally:
        agent.stop()
        store.execute("DELETE FROM nodes WHERE id = ?", (node_id,))
        store.close()
        server.close()


async def test_a_hello_that_names_its_host_in_megabytes_is_refused_and_stored_nowhere(gateway, api):
    """What a hello says of the agent (hostname, version) goes to the store, the audit log and the log at each
    connect: one of megabytes is refused (``agent.refused``), not copied into each (a token's holder could grow
    them by megabytes a reconnect)."""
    created = await new_agent(api)
    url = created["command"].split("--url ")[1].split()[0]
    channel = await open_channel(url, created["command"].rsplit("--tls-fingerprint ", 1)[1])
    try:
        call = pb_grpc.AgentGatewayStub(channel).Connect(metadata=(("authorization", f"Bearer {created['token']}"),))
        await call.write(pb.AgentMessage(hello=pb.Hello(version="test", hostname="h" * 3_000_000)))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async with asyncio.timeout(10):
                while (message := await call.read()) is not grpc.aio.EOF:
                    assert not message.HasField("welcome"), "the hello was taken"
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "at most 255 characters" in refused.value.details()
    finally:
        await channel.close()
    code, shown = await api("GET", f"/agents/{created['name']}")
    assert code == 200 and shown["hostname"] == "" and shown["status"] == "offline"
    assert [e for e in await audit(api, "agent.refused") if created["name"] in e["actor_email"]]
    assert "h" * 1000 not in gateway.log_text()


async def test_the_agent_reconnects_after_a_gateway_restart(gateway, api, tmp_path):
    created = await new_agent(api)
    agent = start(created, tmp_path)
    try:
        await until_agent(api, created["name"], "online")
        gateway.stop()
        gateway.start()  # same ports, same store: the agent's backoff finds it again
        wait_port(gateway.http_port, gateway.process, "gatewayd")
        await until_agent(api, created["name"], "online")
        assert agent.process.poll() is None
    finally:
        agent.stop()


@dataclass
class InProcess:
    """A gateway in this process with its gRPC server (tunnel listener off), and its admin's API."""
    gateway: Any
    http: aiohttp.ClientSession
    token: str
    org_id: str

    async def post(self, path: str, body: dict) -> dict:
        async with self.http.post(f"http://{self.gateway.config['api.listen']}/api{path}", json=body,
                                  headers={"Authorization": f"Bearer {self.token}"}) as answer:
            assert answer.status == 201, await answer.text()
            return await answer.json()


@asynccontextmanager
async def in_process(tmp_path: Path) -> Any:
    from control.app import make_app
    from gatewayd.config import load_config
    from gatewayd.daemon import Gateway

    config = load_config(None, environ={}, overrides={
        "data_dir": str(tmp_path / "data"), "api.listen": f"127.0.0.1:{free_port()}",
        "listeners.postgres": "", "listeners.rdp": "", "listeners.http": "", "listeners.ssh": "",
        "grpc.listen": f"127.0.0.1:{free_port()}", "grpc.tunnel": False})
    gateway = Gateway(config, app_factory=make_app)
    await gateway.start()
    try:
        admin = await gateway.identity.ensure_local_user("admin@example.com", "Admin", ["admin"])
        async with aiohttp.ClientSession() as http:
            yield InProcess(gateway, http, gateway.identity.issue_token(admin), admin.org_id)
    finally:
        await gateway.stop()


async def test_the_grpc_server_stopped_under_a_connected_agent_has_stored_its_departure_when_it_returns(tmp_path):
    """A gateway stopping while an agent is connected: its control call is cancelled at the gRPC server's grace,
    and the departure that leaves behind (audit, "offline" in the store) is done when the server's stop returns,
    before the daemon goes on to close its store (it once ran on after that: "no active connection" in the log,
    the agent left "online")."""
    async with in_process(tmp_path) as here:
        created = await here.post("/agents", {"name": "stopping"})
        url = created["command"].split("--url ")[1].split()[0]
        channel = await open_channel(url, created["command"].rsplit("--tls-fingerprint ", 1)[1])
        try:
            call = pb_grpc.AgentGatewayStub(channel).Connect(
                metadata=(("authorization", f"Bearer {created['token']}"),))
            await call.write(pb.AgentMessage(hello=pb.Hello(version="test", hostname="stopping")))
            for _ in range(200):
                stored = await here.gateway.store.get_agent(here.org_id, created["id"])
                if stored is not None and stored.status == "online":
                    break
                await asyncio.sleep(0.05)
            [link] = here.gateway.agents.links[created["id"]]
            await here.gateway.grpc.stop()
            assert link.lost is not None and link.lost.done()
            stored = await here.gateway.store.get_agent(here.org_id, created["id"])
            assert stored is not None and stored.status == "offline"
        finally:
            await channel.close()


async def test_the_grpc_server_stopped_under_a_proxy_manager_has_revoked_its_credentials_when_it_returns(tmp_path):
    """The same for a proxy manager holding an open port: the credential it was given for it is revoked when the
    server's stop returns (it once ran on after that, and the store closed under it: the credential stayed good
    for its whole duration)."""
    async with in_process(tmp_path) as here:
        connection = await here.post("/connections", {
            "name": "pg-held", "type": "database", "subtype": "postgres",
            "secret": {f"envvar:{k}": b64(v) for k, v in {"HOST": "127.0.0.1", "PORT": "5432", "USER": "postgres",
                                                           "PASS": "x", "DB": "postgres"}.items()}})
        url = here.gateway.grpc_url()
        channel = await open_channel(url, here.gateway.grpc.fingerprint)
        try:
            call = pb_grpc.AgentGatewayStub(channel).Manage(metadata=(("authorization", f"Bearer {here.token}"),))
            await call.write(pb.ManagerMessage(hello=pb.ManagerHello(version="test", hostname="stopping")))

            async def answer() -> str:
                command = await call.read()
                await call.write(pb.ManagerMessage(result=pb.ListenResult(listen_id=command.listen.listen_id,
                                                                          ok=True)))
                return command.listen.secret

            for _ in range(200):
                if here.gateway.proxy_manager.links:
                    break
                await asyncio.sleep(0.05)
            secret, _ = await asyncio.gather(answer(), here.post("/proxymanager/connect", {
                "connection_name": connection["name"], "port": free_port(), "bind": "127.0.0.1"}))
            held = await here.gateway.store.get_credential(hash_secret(secret))
            assert held is not None and held.revoked_at is None
            await here.gateway.grpc.stop()
            held = await here.gateway.store.get_credential(hash_secret(secret))
            assert held is not None and held.revoked_at is not None
        finally:
            await channel.close()


def rss_mib(pid: int) -> float:
    """A process's resident memory (MiB)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def tunnel_connections(port: int) -> int:
    """The connections the gateway's tunnel listener on ``port`` holds now (``ss``: the accepted ends)."""
    listing = subprocess.run(["ss", "-Htn", "state", "established", f"( sport = :{port} )"], capture_output=True,
                             text=True, check=True).stdout
    return len(listing.splitlines())


async def test_a_slow_stream_does_not_stall_the_others(gateway, api, http_target, tmp_path):
    """One download through the agent that nobody reads; another through the same agent completes meanwhile. Each
    stream is a TLS connection of its own to the tunnel listener: TCP's flow control is its own."""
    created = await new_agent(api)
    agent = start(created, tmp_path)
    try:
        await until_agent(api, created["name"], "online")
        code, connection = await api("POST", "/connections", {
            "name": f"web-{uuid.uuid4().hex[:8]}", "type": "httpproxy", "subtype": "httpproxy",
            "agent_id": created["id"], "secret": {"envvar:REMOTE_URL": b64(http_target)}})
        assert code == 201, connection
        code, access = await api("POST", f"/connections/{connection['name']}/credentials",
                                 {"access_duration_seconds": 600})
        secret = access["connection_credentials"]["proxy_token"]
        rss = rss_mib(gateway.process.pid), rss_mib(agent.process.pid)
        stalled = socket.create_connection(("127.0.0.1", gateway.http_port))
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.sendall(f"GET /download?size={512 * 1024 * 1024} HTTP/1.1\r\nHost: x\r\n"
                        f"Authorization: {secret}\r\n\r\n".encode())
        assert stalled.recv(16).startswith(b"HTTP/1.1 200")  # it flows, then nobody reads it
        assert tunnel_connections(gateway.tunnel_port) >= 1  # on a TLS connection of its own to the tunnel listener
        try:
            size = 20 * 1024 * 1024
            result = subprocess.run(["curl", "-sS", "-o", str(tmp_path / "d.bin"), "-w", "%{http_code}",
                                     "-H", f"Authorization: {secret}",
                                     f"http://127.0.0.1:{gateway.http_port}/download?size={size}"],
                                    capture_output=True, text=True, timeout=120)
            assert result.stdout == "200", result.stderr
            from tests.httppeer import pattern

            assert hashlib.sha256((tmp_path / "d.bin").read_bytes()).digest() == hashlib.sha256(pattern(size)).digest()
            # and the stalled one's bytes wait at its source: neither end buffers them (their flow control holds)
            assert rss_mib(gateway.process.pid) - rss[0] < 64 and rss_mib(agent.process.pid) - rss[1] < 64
        finally:
            stalled.close()
    finally:
        agent.stop()
    await until_agent(api, created["name"], "offline")  # its sessions ended with it; a new one is refused
    code, access = await api("POST", f"/connections/{connection['name']}/credentials", {"access_duration_seconds": 60})
    secret = access["connection_credentials"]["proxy_token"]
    result = subprocess.run(["curl", "-sS", "-w", "%{http_code}", "-H", f"Authorization: {secret}",
                             f"http://127.0.0.1:{gateway.http_port}/json"], capture_output=True, text=True, timeout=60)
    assert result.stdout.endswith("502") and f'agent \\"{created["name"]}\\" is offline' in result.stdout


# ---------------------------------------------------------------------------------------------- proxy manager


async def start_manager(api: Any, user: str, url: str, fingerprint: str, tmp_path: Path) -> AgentProcess:
    """``gatewayd proxy-manager`` with the user's token, once the gateway sees it connected."""
    manager = AgentProcess(f"GATEWAYD_TOKEN={user} gatewayd proxy-manager --url {url} --tls-fingerprint {fingerprint}",
                           tmp_path / "manager.log", None).start()
    deadline = time.monotonic() + 30
    while (await api("GET", "/proxymanager/status", token=user))[1]["status"] != "connected":
        if time.monotonic() > deadline:
            manager.stop()
            raise AssertionError((tmp_path / "manager.log").read_text())
        await asyncio.sleep(0.05)
    return manager


def own_address() -> str:
    """This machine's address toward the outside (no packet is sent), or a documentation address without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("198.51.100.1", 9))
            return probe.getsockname()[0]
        except OSError:
            return "198.51.100.7"


async def test_the_proxy_manager_listens_on_loopback_unless_the_operator_allows_an_address(gateway, api):
    """Checked before the user's proxy manager is asked anything: an address the operator allows gets as far as
    'no proxy manager connected' (409), any other than loopback is a 422."""
    user = gateway.token("binder@example.com", groups="")
    connection = await api.connection("pm-bind", "database", "postgres", {"HOST": "127.0.0.1", "PORT": "5432"})
    for bind, expected in (("127.0.0.1", 409), ("::1", 409), ("localhost", 409), ("127.0.0.5", 409),
                           (ALLOWED_BIND, 409), ("0.0.0.0", 422), ("::", 422), ("192.0.2.11", 422), ("127.1", 422)):
        code, answer = await api("POST", "/proxymanager/connect",
                                 {"connection_name": connection["name"], "port": 4000, "bind": bind}, token=user)
        assert code == expected, (bind, answer)


async def test_the_proxy_manager_opens_a_local_port_that_psql_uses_with_the_user_s_own_credential(
        gateway, api, pg_target, tmp_path):
    created = await new_agent(api)  # its start command says the gRPC URL and the certificate's fingerprint
    url = created["command"].split("--url ")[1].split()[0]
    fingerprint = created["command"].rsplit("--tls-fingerprint ", 1)[1]
    user = gateway.token("dev@example.com", groups="", name="Dev")
    code, connection = await api("POST", "/connections", {
        "name": f"pg-{uuid.uuid4().hex[:8]}", "type": "database", "subtype": "postgres",
        "secret": {f"envvar:{k}": b64(v) for k, v in {"HOST": "127.0.0.1", "PORT": str(pg_target.port),
                                                       "USER": "postgres", "PASS": pg_target.password,
                                                       "DB": "postgres"}.items()}})
    assert code == 201, connection
    assert (await api("GET", "/proxymanager/status", token=user))[1]["status"] == "disconnected"
    code, refused = await api("POST", "/proxymanager/connect", {"connection_name": connection["name"], "port": 1},
                              token=user)
    assert code == 409 and "gatewayd proxy-manager" in refused["message"]
    manager = await start_manager(api, user, url, fingerprint, tmp_path)
    try:
        port = free_port()
        # issue 31, item 9: a port on every address let anyone on the network in as this user
        for everywhere in ("0.0.0.0", "::", ""):
            code, refused = await api("POST", "/proxymanager/connect", {
                "connection_name": connection["name"], "port": port, "bind": everywhere or own_address()},
                token=user)
            assert code == 422 and "loopback" in refused["message"], (everywhere, refused)
        assert (await api("GET", "/proxymanager/status", token=user))[1]["forwardings"] == []
        with socket.socket() as probe:  # nothing listens there: the proxy manager was never asked
            assert probe.connect_ex(("127.0.0.1", port)) != 0
        code, opened = await api("POST", "/proxymanager/connect",
                                 {"connection_name": connection["name"], "port": port}, token=user)
        assert code == 201, opened
        assert (opened["connection_name"], opened["port"]) == (connection["name"], port)
        code, status = await api("GET", "/proxymanager/status", token=user)
        assert status["forwardings"] == [opened] and status["forwardings"][0]["since"]
        result = subprocess.run(["psql", f"host=127.0.0.1 port={port} user=whoever dbname=whoever",
                                 "-X", "-At", "-c", "select 'via the proxy manager as ' || current_user"],
                                capture_output=True, text=True, timeout=60)
        assert result.stdout.strip() == "via the proxy manager as postgres", result.stderr
        code, sessions = await api("GET", f"/sessions?connection={connection['name']}")
        assert sessions["data"] and sessions["data"][0]["user"] == "dev@example.com"
        assert revoked(gateway, connection["name"]) == [False]
        code, status = await api("POST", "/proxymanager/disconnect", {"connection_name": connection["name"]},
                                 token=user)
        assert code == 200 and status["forwardings"] == []
        assert revoked(gateway, connection["name"]) == [True]  # the secret the proxy manager held is dead
        deadline = time.monotonic() + 30
        while True:  # the local port closes once the proxy manager hears of it
            try:
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
            except OSError:
                break
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        code, opened = await api("POST", "/proxymanager/connect",
                                 {"connection_name": connection["name"], "port": free_port()}, token=user)
        assert code == 201, opened
        assert revoked(gateway, connection["name"]) == [True, False]
    finally:
        manager.stop()
    deadline = time.monotonic() + 30
    while revoked(gateway, connection["name"]) != [True, True]:  # the proxy manager gone, its ports with it
        assert time.monotonic() < deadline, revoked(gateway, connection["name"])
        await asyncio.sleep(0.05)


async def manager_call(api: Api, method: str, token: str) -> tuple[grpc.aio.Channel, Any]:
    """A raw ``Manage`` or ``Forward`` call to the gateway with ``token`` (and its channel, to close)."""
    created = await new_agent(api)  # its start command says the gRPC URL and the certificate's fingerprint
    channel = await open_channel(created["command"].split("--url ")[1].split()[0],
                                 created["command"].rsplit("--tls-fingerprint ", 1)[1])
    return channel, getattr(pb_grpc.AgentGatewayStub(channel), method)(metadata=(("authorization", f"Bearer {token}"),))


async def refused(call: Any, timeout: float = 10) -> grpc.aio.AioRpcError:
    """The status a call ends with, having read nothing but the gateway's refusal."""
    with pytest.raises(grpc.aio.AioRpcError) as ended:
        async with asyncio.timeout(timeout):
            while (message := await call.read()) is not grpc.aio.EOF:
                raise AssertionError(f"the call was served: {message}")
    return ended.value


async def test_a_proxy_manager_s_hello_naming_its_host_in_megabytes_is_refused_shown_nowhere_and_audited(
        gateway, api):
    """A proxy manager's hostname is kept and shown (``GET /proxymanager/status``) and logged: one of megabytes once
    was. It is bounded as an agent's is, the refusal audited."""
    user = gateway.token("bighost@example.com", groups="")
    channel, call = await manager_call(api, "Manage", user)
    try:
        await call.write(pb.ManagerMessage(hello=pb.ManagerHello(version="test", hostname="h" * 3_000_000)))
        status = await refused(call)
        assert status.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 255 characters" in status.details()
    finally:
        await channel.close()
    assert (await api("GET", "/proxymanager/status", token=user))[1]["status"] == "disconnected"
    entries = [e for e in await audit(api, "proxymanager.refused") if e["actor_email"] == "bighost@example.com"]
    assert entries and entries[0]["outcome"] == "failure" and "h" * 1000 not in str(entries)
    assert "h" * 1000 not in gateway.log_text()


async def test_a_manage_call_that_never_says_hello_is_ended_and_audited(gateway, api):
    """A ``Manage`` call that sends nothing was held for ever; it is given the agents' hello limit (15 s)."""
    user = gateway.token("mute@example.com", groups="")
    channel, call = await manager_call(api, "Manage", user)
    try:
        status = await refused(call, timeout=30)
        assert status.code() == grpc.StatusCode.INVALID_ARGUMENT and "says hello first" in status.details()
    finally:
        await channel.close()
    assert [e for e in await audit(api, "proxymanager.refused") if e["actor_email"] == "mute@example.com"]


async def test_a_refused_forward_call_is_audited_as_an_agent_s_refused_stream_is(gateway, api):
    """``Forward`` calls naming no open port of the user's, or with a token that is no user's, left no trace: each is
    an audit entry now (and counted against the address, as the agents' refusals are)."""
    user = gateway.token("forwarder@example.com", groups="")
    for token, code in ((user, grpc.StatusCode.NOT_FOUND), ("not-a-token", grpc.StatusCode.UNAUTHENTICATED)):
        channel, call = await manager_call(api, "Forward", token)
        try:
            if token == user:  # (a token refused is refused before a frame is read: a write would fail on its own)
                await call.write(pb.Frame(stream_id="someone-else-s-port"))
            assert (await refused(call)).code() == code
        finally:
            await channel.close()
    entries = await audit(api, "proxymanager.forward_refused")
    assert [e for e in entries if e["actor_email"] == "forwarder@example.com" and e["outcome"] == "failure"]
    assert [e for e in entries if "unknown token" in e["actor_email"]]
    assert "not-a-token" not in str(entries)


async def test_a_proxy_manager_s_answer_that_it_could_not_open_a_port_is_repeated_bounded(gateway, api):
    """The proxy manager's error for a port it could not open goes into the API's answer, the audit entry of the
    connect and the log: one of megabytes once went whole into each (a user's process could grow the audit log by
    megabytes a request). It is cut to 255 characters, as an agent's words are."""
    user = gateway.token("wordy@example.com", groups="")
    connection = await api.connection("pm-wordy", "database", "postgres", {"HOST": "127.0.0.1", "PORT": "5432"})
    channel, call = await manager_call(api, "Manage", user)
    try:
        await call.write(pb.ManagerMessage(hello=pb.ManagerHello(version="test", hostname="wordy")))
        deadline = time.monotonic() + 30
        while (await api("GET", "/proxymanager/status", token=user))[1]["status"] != "connected":
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)

        async def answer() -> None:
            command = await call.read()
            await call.write(pb.ManagerMessage(result=pb.ListenResult(
                listen_id=command.listen.listen_id, ok=False, error="E" * 3_000_000)))

        _, (code, body) = await asyncio.gather(answer(), api("POST", "/proxymanager/connect", {
            "connection_name": connection["name"], "port": free_port()}, token=user))
    finally:
        await channel.close()
    assert code == 502 and "could not open port" in body["message"] and len(body["message"]) < 400, len(str(body))
    entries = [e for e in await audit(api, "proxymanager.connect") if e["actor_email"] == "wordy@example.com"]
    assert entries and "E" * 256 not in str(entries)
    assert "E" * 256 not in gateway.log_text()


async def test_a_forwarding_s_refused_clients_are_refused_at_their_forward_as_their_own_address(pg_target, tmp_path):
    """A forwarded client's bytes reach the gateway's own PostgreSQL listener from the gateway's loopback: a forwarding
    whose credential had expired, its client retried (a pool reconnecting), was refused there, audited from
    127.0.0.1 and counted against that address, so a few of one user's locked every proxy manager user, and every
    client on the gateway's host, out for the throttle's window. The credential is checked at the Forward, as the
    proxy manager's own address (here ::1, the gateway's gRPC server listening there)."""
    pg_port = free_port()
    async with throttled_gateway(tmp_path, "::1", **{"listeners.postgres": f"127.0.0.1:{pg_port}"}) as (
            daemon, api, created, _):
        wait_port(pg_port, daemon.process, "the postgres listener")
        connection = await api.connection("pm-expiring", "database", "postgres", {
            "HOST": "127.0.0.1", "PORT": str(pg_target.port), "USER": "postgres", "PASS": pg_target.password,
            "DB": "postgres"})
        user = daemon.token("expiring@example.com", groups="")
        manager = await start_manager(api, user, *grpc_of(created), tmp_path)
        try:
            port = free_port()
            code, opened = await api("POST", "/proxymanager/connect", {
                "connection_name": connection["name"], "port": port, "access_duration_seconds": 1}, token=user)
            assert code == 201, opened
            await asyncio.sleep(1.5)  # its credential has expired
            for _ in range(5):  # past the throttle's 3
                result = subprocess.run(["psql", f"host=127.0.0.1 port={port} user=x dbname=x", "-X", "-Atc", "select 1"],
                                        capture_output=True, text=True, timeout=60)
                assert result.returncode != 0
        finally:
            manager.stop()
        assert "has expired" in (tmp_path / "manager.log").read_text()  # the gateway's word, in the user's log
        refusals = [e for e in await audit(api, "postgres.login") if e["outcome"] == "failure"]
        assert refusals and {e["client_ip"] for e in refusals} == {"::1"}
        code, access = await api("POST", f"/connections/{connection['name']}/credentials",
                                 {"access_duration_seconds": 600})
        assert code == 201, access
        result = subprocess.run(["psql", f"postgres://{access['connection_credentials']['username']}:x@127.0.0.1:"
                                 f"{pg_port}/postgres?sslmode=disable", "-X", "-Atc", "select 'the loopback is let in'"],
                                capture_output=True, text=True, timeout=60)
        assert result.stdout.strip() == "the loopback is let in", result.stderr


async def test_local_clients_of_a_forwarded_port_that_say_nothing_hold_nothing_of_the_gateway(gateway, api, tmp_path):
    """Each local client of a proxy manager's port is a Forward call at the gateway and a socket pair there, waiting
    for its PostgreSQL start-up: one that never sent it held both for ever, so any process on the user's machine
    (no token needed: the port is open) could take the gateway's file descriptors. It is given 10 s, as a tunnel's
    first frame is."""
    created = await new_agent(api)
    user = gateway.token("idler@example.com", groups="")
    connection = await api.connection("pm-idle", "database", "postgres", {"HOST": "127.0.0.1", "PORT": "5432"})
    manager = await start_manager(api, user, *grpc_of(created), tmp_path)
    idle: list[socket.socket] = []
    try:
        port = free_port()
        code, opened = await api("POST", "/proxymanager/connect", {"connection_name": connection["name"],
                                                                  "port": port}, token=user)
        assert code == 201, opened
        before = len(os.listdir(f"/proc/{gateway.process.pid}/fd"))
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
        deadline = time.monotonic() + 30
        while len(os.listdir(f"/proc/{gateway.process.pid}/fd")) < before + 40:  # a socket pair each
            assert time.monotonic() < deadline, "the idle clients never reached the gateway"
            await asyncio.sleep(0.1)
        while (held := len(os.listdir(f"/proc/{gateway.process.pid}/fd"))) > before:
            assert time.monotonic() < deadline, f"the gateway holds {held - before} sockets of idle clients past 10 s"
            await asyncio.sleep(0.2)
        for sock in idle:  # closed by the proxy manager once its Forward ended
            sock.settimeout(10)
            assert sock.recv(1) == b""
    finally:
        for sock in idle:
            sock.close()
        manager.stop()


async def test_a_hostname_with_a_line_break_cannot_forge_a_line_of_the_plain_log(tmp_path):
    """A proxy manager's hello (any user's) or an agent's names its host, logged at each connect: in the plain log
    (the default format) a line break in it began a line of the hostname's own, written as the gateway's."""
    async with throttled_gateway(tmp_path, **{"log.format": "plain"}) as (daemon, api, created, channel):
        forged = "2026-01-01T00:00:00.000Z error   gatewayd.grpc: forged by the hello"
        user = daemon.token("forger@example.com", groups="")
        call = pb_grpc.AgentGatewayStub(channel).Manage(metadata=(("authorization", f"Bearer {user}"),))
        await call.write(pb.ManagerMessage(hello=pb.ManagerHello(version="test", hostname=f"laptop\n{forged}")))
        deadline = time.monotonic() + 30
        while (await api("GET", "/proxymanager/status", token=user))[1]["status"] != "connected":
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        call.cancel()
        said = [line for line in daemon.log_text().splitlines() if "forged by the hello" in line]
        assert said and not any(line.startswith(forged) for line in said), said
        assert "hostname=laptop\\n2026-01-01" in said[0]


def revoked(gateway: Daemon, connection_name: str) -> list[bool]:
    """Whether each credential issued for ``connection_name`` (oldest first) is revoked, as the store says."""
    with sqlite3.connect(gateway.data_dir / "gatewayd.db") as db:
        return [bool(at) for at, in db.execute("SELECT revoked_at FROM credentials WHERE connection_name = ? "
                                                "ORDER BY created_at, rowid", (connection_name,))]


async def test_the_proxy_manager_forwards_ssh_logged_in_with_the_user_s_credential(gateway, api, ssh_target,
                                                                                   tmp_path):
    """ssh's login is encrypted end to end: the gateway's SSH proxy serves the forwarded client itself, as the
    forwarding's credential, whatever user name and password the local client has."""
    from tests.sshpeer import CLIENT_OPTIONS

    created = await new_agent(api)
    url = created["command"].split("--url ")[1].split()[0]
    fingerprint = created["command"].rsplit("--tls-fingerprint ", 1)[1]
    user = gateway.token("sshdev@example.com", groups="", name="Dev")
    code, connection = await api("POST", "/connections", {
        "name": f"ssh-{uuid.uuid4().hex[:8]}", "type": "custom", "subtype": "ssh",
        "secret": {f"envvar:{k}": b64(v) for k, v in {"HOST": "127.0.0.1", "PORT": str(ssh_target.port),
                                                       "USER": ssh_target.user,
                                                       "PRIVATE_KEY": ssh_target.private_key_text}.items()}})
    assert code == 201, connection
    manager = await start_manager(api, user, url, fingerprint, tmp_path)
    try:
        port = free_port()
        code, opened = await api("POST", "/proxymanager/connect",
                                 {"connection_name": connection["name"], "port": port}, token=user)
        assert code == 201, opened
        result = subprocess.run(["ssh", *CLIENT_OPTIONS, "-p", str(port), "whoever@127.0.0.1",
                                 "echo via the proxy manager as $(whoami)"],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == f"via the proxy manager as {ssh_target.user}"
        code, sessions = await api("GET", f"/sessions?connection={connection['name']}&expand=event_stream")
        [session] = sessions["data"]
        assert session["user"] == "sshdev@example.com" and session["status"] in ("open", "done")
    finally:
        manager.stop()


async def test_a_second_grpc_server_on_the_same_address_is_refused(tmp_path):
    """grpc binds with SO_REUSEPORT by default: two processes would share the agents between them, silently."""
    from gatewayd.agent.server import AgentService, GrpcServer

    first = GrpcServer(AgentService(None, None, None))  # type: ignore[arg-type]
    await first.start("127.0.0.1", 0, tmp_path)
    try:
        with pytest.raises(OSError, match="cannot listen"):
            await GrpcServer(AgentService(None, None, None)).start("127.0.0.1", first.port, tmp_path)  # type: ignore[arg-type]
    finally:
        await first.stop()


@asynccontextmanager
async def throttled_gateway(tmp_path: Path, grpc_host: str = "127.0.0.1", **settings: Any) -> Any:
    """A gateway of its own that throttles an address after 3 refusals, its admin API, an agent of it and a gRPC
    channel to it (the agent's certificate pinned); its gRPC server on ``grpc_host`` (``::1``: a client's address
    other than the loopback the gateway's own connections come from)."""
    grpc_port = free_port()
    daemon = Daemon(tmp_path / "data", {"grpc.listen": f"[{grpc_host}]:{grpc_port}" if ":" in grpc_host else
                                        f"{grpc_host}:{grpc_port}", "throttle.credential_failures": 3,
                                        **settings}).start()
    daemon.tunnel_port = grpc_port + 100  # the default: beside the gRPC port
    try:
        wait_port(grpc_port, daemon.process, "the gRPC listener", host=grpc_host)
        async with aiohttp.ClientSession() as http:
            api = Api(daemon, http, daemon.token("admin@example.com", groups="admin"))
            created = await new_agent(api)
            channel = await open_channel(*grpc_of(created))
            try:
                yield daemon, api, created, channel
            finally:
                await channel.close()
    finally:
        daemon.stop()


async def test_a_flood_of_refused_tokens_from_one_address_is_throttled_and_audited_once(tmp_path):
    """Forged agent tokens from one address: each refused and audited up to the proxies' limit of refused
    credentials per address, then refused at once (RESOURCE_EXHAUSTED: no token lookup, no entry each) with one
    ``agent.throttle`` entry; the audit log does not grow with the flood."""
    async with throttled_gateway(tmp_path) as (daemon, api, created, channel):
        codes = []
        for n in range(6):
            call = pb_grpc.AgentGatewayStub(channel).Connect(metadata=(("authorization", f"Bearer agt-forged-{n}"),))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call.read()
            codes.append(refused.value.code())
        assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 3 + [grpc.StatusCode.RESOURCE_EXHAUSTED] * 3
        assert len(await audit(api, "agent.refused")) == 3
        throttled = await audit(api, "agent.throttle")
        assert len(throttled) == 1 and "too many refused calls from 127.0.0.1" in throttled[0]["error_message"]
        assert "agt-forged" not in str(await audit(api, "agent.refused") + throttled)


async def test_a_refusal_from_an_ipv6_address_is_audited_and_throttled_as_that_address(tmp_path):
    """gRPC names an IPv6 peer ``ipv6:%5B::1%5D:port``: the refusals of such a client were audited, logged and
    throttled as ``%5B::1%5D``, an address no search for ``::1`` finds."""
    async with throttled_gateway(tmp_path, "::1") as (daemon, api, created, channel):
        call = pb_grpc.AgentGatewayStub(channel).Connect(metadata=(("authorization", "Bearer agt-forged"),))
        with pytest.raises(grpc.aio.AioRpcError):
            await call.read()
        assert [e["client_ip"] for e in await audit(api, "agent.refused")] == ["::1"]


async def test_calls_that_send_nothing_are_closed_at_once_and_a_flood_of_them_writes_no_row_each(tmp_path):
    """Tunnel calls that send nothing -- no token, a forged one, an agent's own token for a stream the gateway did
    not ask for -- are refused before the gateway reads anything of them (they were held open for as long as their
    client kept them, 20,000 of them 111 MiB), and each refusal is counted against its address before anything is
    written: the calls of a flood that were admitted before its throttle began end without a row each (they
    wrote one each when they ended). A message that does not parse ends its call with INVALID_ARGUMENT and one
    info line, not UNKNOWN and an error-level traceback."""
    async with throttled_gateway(tmp_path) as (daemon, api, created, channel):
        stub = pb_grpc.AgentGatewayStub(channel)
        junk = channel.stream_stream("/gatewayd.agent.v1.AgentGateway/Connect", request_serializer=lambda raw: raw,
                                     response_deserializer=lambda raw: raw)(
            metadata=(("authorization", f"Bearer {created['token']}"),))
        await junk.write(b"\xff\xff\xff\xff")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await junk.read()
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
        assert "does not parse" in refused.value.details()

        tokens = ["", "Bearer agt-forged", f"Bearer {created['token']}"]
        calls = [stub.Tunnel(metadata=(("authorization", tokens[n % 3]),)) for n in range(300)]

        async def refusal(call: Any) -> grpc.StatusCode:
            try:
                await call.read()
            except grpc.aio.AioRpcError as error:
                return error.code()
            return grpc.StatusCode.OK

        try:  # nothing is written on these calls: the gateway must end them itself
            codes = await asyncio.wait_for(asyncio.gather(*(refusal(call) for call in calls)), 20)
        finally:
            for call in calls:
                call.cancel()
        assert set(codes) <= {grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
        assert len(await audit(api, "agent.stream_refused")) <= 3
        assert len(await audit(api, "agent.throttle")) == 1
        log = daemon.log_text()
        assert "malformed gRPC message" in log and "DecodeError" not in log and "Traceback" not in log


async def test_a_flood_of_refused_tunnel_connections_is_throttled_with_the_calls(tmp_path):
    """The tunnel listener (on its default port, gRPC's + 100) counts its refusals against the address with the
    gRPC calls': junk first records are refused and audited up to the limit, then the address's connections are
    turned away as they are accepted, before a TLS handshake (no audit entry each), with one ``agent.throttle``
    entry; its gRPC calls are refused too."""
    import ssl

    async with throttled_gateway(tmp_path) as (daemon, api, created, channel):
        said = []
        for _ in range(3):
            junk = await tunnel(daemon, created)
            junk.writer.write(struct.pack(">I", 2) + b"\xff\xff")
            said.append(await refusal(junk))
        assert said == ["the tunnel's first record does not parse"] * 3
        for _ in range(2):
            with pytest.raises((ConnectionError, ssl.SSLError, asyncio.IncompleteReadError)):
                await tunnel(daemon, created)  # closed before the server's hello
        call = pb_grpc.AgentGatewayStub(channel).Tunnel(metadata=(("authorization", f"Bearer {created['token']}"),))
        async with asyncio.timeout(30):  # refused before a byte is read; a call left standing would be a failure
            assert await call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, await call.details()
        assert len(await audit(api, "agent.stream_refused")) == 3
        assert len(await audit(api, "agent.throttle")) == 1


# ------------------------------------------------------------------------ an agent that answers as the target


class Impostor:
    """An agent that answers the gateway's dials as the target itself: a real gRPC client of the agent protocol,
    holding its own agent token (Connect, hello, then a Tunnel per Open) that relays each tunnel to its own
    server, where ``serve`` plays the target."""

    def __init__(self, created: dict, serve: Any) -> None:
        self.url = created["command"].split("--url ")[1].split()[0]
        self.fingerprint = created["command"].rsplit("--tls-fingerprint ", 1)[1]
        self.metadata = (("authorization", f"Bearer {created['token']}"),)
        self.serve = serve
        self.opens: list[pb.Open] = []
        self.tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> "Impostor":
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        self.channel = await open_channel(self.url, self.fingerprint)
        self.stub = pb_grpc.AgentGatewayStub(self.channel)
        self.control = self.stub.Connect(metadata=self.metadata)
        await self.control.write(pb.AgentMessage(hello=pb.Hello(version="impostor", hostname="impostor")))
        self.tasks.append(asyncio.ensure_future(self._opens()))
        return self

    async def __aexit__(self, *exc: Any) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.channel.close()
        self.server.close()

    async def _opens(self) -> None:
        while (message := await self.control.read()) is not grpc.aio.EOF:
            if message.HasField("open"):
                self.opens.append(message.open)
                self.tasks.append(asyncio.ensure_future(self._tunnel(message.open)))

    async def _tunnel(self, opened: pb.Open) -> None:
        from gatewayd.agent.pump import pump

        call = self.stub.Tunnel(metadata=self.metadata)
        await call.write(pb.Frame(stream_id=opened.stream_id, connected=True))
        reader, writer = await asyncio.open_connection("127.0.0.1", self.server.sockets[0].getsockname()[1])
        try:
            await pump(reader, writer, call.read, call.write)
        except Exception:
            pass
        finally:
            writer.close()


def pg_impostor(method: int, received: list[bytes], tls: Any = None) -> Any:
    """A PostgreSQL target that accepts TLS with its own certificate (``tls``, an SSLContext) or declines it, then
    asks for a password (``method``: 3 cleartext, 5 MD5); what the gateway sends after its start-up goes to
    ``received`` (a PasswordMessage ends the exchange: the secret has left)."""
    import struct

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            (length,) = struct.unpack(">i", await reader.readexactly(4))
            if await reader.readexactly(length - 4) == struct.pack(">i", 80877103):  # SSLRequest
                if tls is not None:
                    writer.write(b"S")
                    await writer.drain()
                    await writer.start_tls(tls)
                else:
                    writer.write(b"N")
                (length,) = struct.unpack(">i", await reader.readexactly(4))
                await reader.readexactly(length - 4)  # the start-up message
            writer.write(b"R" + struct.pack(">ii", 8, 3) if method == 3 else b"R" + struct.pack(">ii", 12, 5) + b"salt")
            await writer.drain()
            kind = await reader.readexactly(1)
            (length,) = struct.unpack(">i", await reader.readexactly(4))
            received.append(kind + await reader.readexactly(length - 4))
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass  # the gateway hung up (ssl.SSLError is an OSError)
        finally:
            writer.close()

    return serve


async def test_an_agent_answering_as_the_target_never_gets_the_password(gateway, api, tmp_path):
    """Issue 31: an agent's token holder answered the gateway's dial itself, declined TLS, asked for a cleartext
    password and got the connection's password. Through an agent the target is verified before a secret leaves:
    SSLMODE is verify-full unless the role says otherwise, a cleartext or MD5 password goes only over TLS that
    verified the target (whatever the role allows), and an SSH password only to a pinned HOST_KEY (refused before
    anything is dialed)."""
    import ssl

    from gatewayd.tls import generate_self_signed

    generate_self_signed(tmp_path / "impostor.crt", tmp_path / "impostor.key", "impostor")
    impostor_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    impostor_tls.load_cert_chain(tmp_path / "impostor.crt", tmp_path / "impostor.key")
    password = f"pg-secret-{uuid.uuid4().hex}"
    created = await new_agent(api)
    received: list[bytes] = []
    cases = [  # (role's SSLMODE and its allowance, the impostor's TLS, what it asks for, what the client hears)
        ({}, None, 3, "the target does not accept TLS (SSLMODE=verify-full)"),
        ({}, impostor_tls, 3, "TLS failed"),
        ({"SSLMODE": "prefer", "ALLOW_UNVERIFIED_PASSWORD": "true"}, None, 3,
         "asks for a cleartext password over a link the gateway has not verified"),
        ({"SSLMODE": "require", "ALLOW_UNVERIFIED_PASSWORD": "true"}, impostor_tls, 3,
         "asks for a cleartext password over a link the gateway has not verified"),
        ({"SSLMODE": "disable"}, None, 5, "asks for an MD5 password over a link the gateway has not verified"),
    ]
    for settings, tls, method, heard in cases:
        async with Impostor(created, pg_impostor(method, received, tls)) as impostor:
            await until_agent(api, created["name"], "online")
            code, connection = await api("POST", "/connections", {
                "name": f"pg-{uuid.uuid4().hex[:8]}", "type": "database", "subtype": "postgres",
                "agent_id": created["name"], "secret": {f"envvar:{k}": b64(v) for k, v in {
                    "HOST": "10.9.8.7", "PORT": "5432", "USER": "postgres", "PASS": password, "DB": "postgres",
                    **settings}.items()}})
            assert code == 201, connection
            code, issued = await api("POST", f"/connections/{connection['name']}/credentials",
                                     {"access_duration_seconds": 600})
            assert code == 201, issued
            secret = issued["connection_credentials"]["username"]
            result = await asyncio.to_thread(subprocess.run, [
                "psql", f"postgres://{secret}:any@127.0.0.1:{gateway.pg_port}/postgres?sslmode=disable", "-X", "-At",
                "-c", "select 1"], capture_output=True, text=True, timeout=60)
            assert len(impostor.opens) == 1, (settings, impostor.opens)  # the gateway did dial through it
        assert result.returncode != 0 and heard in result.stderr, (settings, result.stderr)
        assert password not in result.stderr
        assert not [message for message in received if message[:1] == b"p"], (settings, received)
        await until_agent(api, created["name"], "offline")

    async with Impostor(created, pg_impostor(3, received)) as impostor:  # an SSH password without HOST_KEY
        await until_agent(api, created["name"], "online")
        code, connection = await api("POST", "/connections", {
            "name": f"ssh-{uuid.uuid4().hex[:8]}", "type": "custom", "subtype": "ssh", "agent_id": created["name"],
            "secret": {f"envvar:{k}": b64(v) for k, v in {"HOST": "10.9.8.7", "USER": "root", "PASS": password,
                                                          "ALLOW_UNVERIFIED_PASSWORD": "true"}.items()}})
        assert code == 201, connection
        code, issued = await api("POST", f"/connections/{connection['name']}/credentials",
                                 {"access_duration_seconds": 600})
        from tests.sshpeer import CLIENT_OPTIONS

        result = await asyncio.to_thread(subprocess.run, [
            "ssh", *CLIENT_OPTIONS, "-p", str(gateway.ssh_port),
            f"{issued['connection_credentials']['username']}@127.0.0.1", "true"],
            capture_output=True, text=True, timeout=60)
        assert result.returncode == 254 and "only to a target whose key is pinned (HOST_KEY)" in result.stderr, \
            result.stderr
        assert impostor.opens == []  # refused before anything was dialed


# ------------------------------------------------------------------------------------------ the tunnel listener


class TunnelAgent:
    """A real client of the agent protocol holding an agent's token: its control channel (Connect, hello) over gRPC,
    the Opens it is sent kept for the test, which answers them over the tunnel listener (or not)."""

    def __init__(self, created: dict) -> None:
        self.url = created["command"].split("--url ")[1].split()[0]
        self.fingerprint = created["command"].rsplit("--tls-fingerprint ", 1)[1]
        self.token = created["token"]
        self.opens: asyncio.Queue[pb.Open] = asyncio.Queue()

    async def __aenter__(self) -> "TunnelAgent":
        self.channel = await open_channel(self.url, self.fingerprint)
        self.control = pb_grpc.AgentGatewayStub(self.channel).Connect(
            metadata=(("authorization", f"Bearer {self.token}"),))
        await self.control.write(pb.AgentMessage(hello=pb.Hello(version="test", hostname="tunnel-agent")))
        self.reading = asyncio.ensure_future(self._opens())
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.reading.cancel()
        await asyncio.gather(self.reading, return_exceptions=True)
        await self.channel.close()

    async def _opens(self) -> None:
        while (message := await self.control.read()) is not grpc.aio.EOF:
            if message.HasField("open"):
                self.opens.put_nowait(message.open)


class Tunnel:
    """A TLS connection to the gateway's tunnel listener, its certificate pinned as the agent's command says: records
    written and read as the agent protocol says (a 4-byte length, then a message)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def to(cls, gateway: Daemon, created: dict) -> "Tunnel":
        from gatewayd.agent.channel import TunnelDialer, check_pinned

        fingerprint = created["command"].rsplit("--tls-fingerprint ", 1)[1]
        dialer = TunnelDialer.of(created["command"].split("--url ")[1].split()[0], fingerprint)
        reader, writer = await asyncio.open_connection("127.0.0.1", gateway.tunnel_port, ssl=dialer.context)
        check_pinned(writer.get_extra_info("ssl_object").getpeercert(binary_form=True), fingerprint)
        return cls(reader, writer)

    async def write(self, message: Any) -> None:
        from gatewayd.agent.pump import record

        self.writer.write(record(message))
        await self.writer.drain()

    async def read(self) -> Any:
        try:
            (length,) = struct.unpack(">I", await self.reader.readexactly(4))
            return pb.Frame.FromString(await self.reader.readexactly(length))
        except asyncio.IncompleteReadError:
            return grpc.aio.EOF


async def tunnel(gateway: Daemon, created: dict) -> Tunnel:
    return await Tunnel.to(gateway, created)


async def refusal(records: Tunnel) -> str:
    """What the tunnel listener says before it closes the connection (its error frame), the end awaited."""
    async with asyncio.timeout(30):  # a listener that kept the connection would leave the test waiting: a failure
        said = await records.read()
        assert said is not grpc.aio.EOF, "the tunnel listener closed without saying why"
        assert await records.reader.read() == b""  # then it closes
    records.writer.close()
    return said.error


async def target_through(api: Api, created: dict, pg_target: Any, sslmode: str = "verify-full") -> dict:
    """A PostgreSQL connection to ``pg_target`` through agent ``created`` (verified against its root certificate, the
    default through an agent; ``sslmode="disable"``: no TLS to the target, the proxy on the tunnel's own end)."""
    tls = {"SSLROOTCERT": pg_target.root_cert()} if sslmode == "verify-full" else {"SSLMODE": sslmode}
    code, connection = await api("POST", "/connections", {
        "name": f"pg-{uuid.uuid4().hex[:8]}", "type": "database", "subtype": "postgres", "agent_id": created["id"],
        "secret": {f"envvar:{k}": b64(v) for k, v in {
            "HOST": "127.0.0.1", "PORT": str(pg_target.port), "USER": "postgres", "PASS": pg_target.password,
            "DB": "postgres", **tls}.items()}})
    assert code == 201, connection
    return connection


async def answered_by_test(api: Api, created: dict, sslmode: str = "") -> dict:
    """A PostgreSQL connection through agent ``created`` to an address nobody serves: the test answers its Opens
    (``sslmode``: the role's SSLMODE, else the default, verify-full)."""
    mode = {"SSLMODE": sslmode} if sslmode else {}
    code, connection = await api("POST", "/connections", {
        "name": f"pg-{uuid.uuid4().hex[:8]}", "type": "database", "subtype": "postgres", "agent_id": created["id"],
        "secret": {f"envvar:{k}": b64(v) for k, v in {"HOST": "10.9.8.7", "PORT": "5432", "USER": "postgres",
                                                      "PASS": "x", "DB": "postgres", **mode}.items()}})
    assert code == 201, connection
    return connection


def unix_sockets(pid: int) -> int:
    """The Unix-domain sockets process ``pid`` holds (a socketpair's two ends count two)."""
    inodes = {line.split()[6] for line in Path("/proc/net/unix").read_text().splitlines()[1:]}
    held = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in inodes:
            held += 1
    return held


def psql_through(gateway: Daemon, api: Api, connection: dict) -> asyncio.Future[subprocess.CompletedProcess[str]]:
    """``psql -c 'select 1'`` through the gateway to ``connection`` with a fresh credential, running meanwhile."""
    async def run() -> subprocess.CompletedProcess[str]:
        code, access = await api("POST", f"/connections/{connection['name']}/credentials",
                                 {"access_duration_seconds": 600})
        assert code in (200, 201), access
        return await asyncio.to_thread(subprocess.run, [
            "psql", f"postgres://{access['connection_credentials']['username']}:any@127.0.0.1:{gateway.pg_port}/"
                    "postgres?sslmode=disable", "-X", "-At", "-c", "select 1"], capture_output=True, text=True,
            timeout=60)
    return asyncio.ensure_future(run())


async def carried(gateway: Daemon, agent: "TunnelAgent", created: dict) -> tuple["Tunnel", pb.Open]:
    """The next Open the test's agent is sent, answered ``connected`` on a tunnel connection of its own, and the
    stream carried: the proxy's first bytes for the target (its SSLRequest, or its StartupMessage without TLS) read
    from it."""
    async with asyncio.timeout(30):
        opened = await agent.opens.get()
        stream = await tunnel(gateway, created)
        await stream.write(pb.TunnelStart(token=created["token"], first=pb.Frame(stream_id=opened.stream_id,
                                                                                 connected=True)))
        asked = await stream.read()
        assert asked is not grpc.aio.EOF and asked.data, asked
    return stream, opened


@dataclass
class CarriedSession:
    """A psql session through the test's own agent (``TunnelAgent``), its stream carried on a tunnel connection."""

    created: dict  # the agent, as the API answered its creation
    agent: "TunnelAgent"
    connection: dict
    psql: asyncio.Future[subprocess.CompletedProcess[str]]
    stream: "Tunnel"
    opened: pb.Open


@asynccontextmanager
async def carried_session(gateway: Daemon, api: Api, sslmode: str = "") -> Any:
    """A new agent answered by the test, a psql through it whose Open the test answers ``connected`` on a tunnel
    connection (``carried``); the agent's control channel lasts as long as the block."""
    created = await new_agent(api)
    async with TunnelAgent(created) as agent:
        await until_agent(api, created["name"], "online", connections=1)
        connection = await answered_by_test(api, created, sslmode)
        psql = psql_through(gateway, api, connection)
        stream, opened = await carried(gateway, agent, created)
        yield CarriedSession(created, agent, connection, psql, stream, opened)


async def refused_entries(api: Api, reason: str) -> list[dict]:
    return [e for e in await audit(api, "agent.stream_refused") if reason in e["error_message"]]


@pytest.mark.parametrize("sslmode", ["verify-full", "disable"])
async def test_psql_through_a_real_agent_rides_the_tunnel_listener(gateway, api, pg_target, tmp_path, sslmode):
    """The Open names the tunnel listener's port; the agent carries the session's bytes over a TLS connection of
    its own to it, which lasts as long as the session. With TLS to the target (verify-full, the default) the proxy
    is given one end of a socketpair (``loop.start_tls`` takes only a socket's transport); without it the proxy's
    protocol sits on the tunnel connection's own end (two Unix sockets fewer, no hop between). Either way a large
    answer and a large upload cross intact (frames of at most 64 KiB, flow control both ways), and the session's
    end ends the target's backend."""
    import asyncpg

    created = await new_agent(api)
    agent = start(created, tmp_path)
    try:
        await until_agent(api, created["name"], "online")
        connection = await target_through(api, created, pg_target, sslmode)
        code, access = await api("POST", f"/connections/{connection['name']}/credentials",
                                 {"access_duration_seconds": 600})
        before = tunnel_connections(gateway.tunnel_port)
        unix_before = unix_sockets(gateway.process.pid)
        client = await asyncpg.connect(host="127.0.0.1", port=gateway.pg_port, ssl=False, database="postgres",
                                       user=access["connection_credentials"]["username"], password="any")
        try:
            assert await client.fetchval("select 'through the tunnel'") == "through the tunnel"
            assert tunnel_connections(gateway.tunnel_port) == before + 1, \
                agent.log_path.read_text()[-3000:]  # a fallback to gRPC says why in the agent's log
            assert unix_sockets(gateway.process.pid) - unix_before == (2 if sslmode == "verify-full" else 0)
            assert await keepalive_timers(f"( dport = :{gateway.tunnel_port} )")  # the agent's ends (keep_alive)
            backend = await client.fetchval("select pg_backend_pid()")
            rows = await client.fetch("select i, repeat(md5(i::text), 40) as pad from generate_series(1, 5000) i")
            assert len(rows) == 5000 and rows[-1]["pad"] == hashlib.md5(b"5000").hexdigest() * 40  # ~6.5 MB back
            await client.execute("create temporary table landed (i int, pad text)")
            await client.copy_records_to_table("landed", records=[(i, "y" * 1000) for i in range(4000)])
            assert await client.fetchval("select count(*) from landed where length(pad) = 1000") == 4000
        finally:
            await client.close()
        direct = await asyncpg.connect(host="127.0.0.1", port=pg_target.port, user="postgres",
                                       password=pg_target.password, database="postgres", ssl=False)
        try:
            for _ in range(200):  # the gateway's close reached the target through the agent
                if not await direct.fetchval("select count(*) from pg_stat_activity where pid = $1", backend):
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the target's backend outlived the session")
        finally:
            await direct.close()
    finally:
        agent.stop()


@pytest.mark.parametrize("workers", [1, 2])  # 2: a carrier finds the port closed and hands the stream back
async def test_an_agent_that_cannot_reach_the_tunnel_port_carries_its_streams_over_grpc(gateway, api, pg_target,
                                                                                          tmp_path, workers):
    """A load balancer that forwards only the gRPC port (here a forwarder on 127.0.0.2, where nothing listens on
    the tunnel port): the agent, told of the port, cannot reach it on its URL's host, says so in its log once, and
    carries the streams over Tunnel calls (the next ones at once, without trying the port again for a while): psql
    works all the same."""
    async def forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream = await asyncio.open_connection("127.0.0.1", grpc_port)

        async def copy(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                sink.close()

        await asyncio.gather(copy(reader, upstream), copy(upstream_reader, writer))

    grpc_port = int(gateway.settings["grpc.listen"].rsplit(":", 1)[1])
    balancer = await asyncio.start_server(forward, "127.0.0.2", 0)
    created = await new_agent(api)
    url = created["command"].split("--url ")[1].split()[0]
    agent = start(created, tmp_path, created["command"].replace(
        url, f"grpcs://127.0.0.2:{balancer.sockets[0].getsockname()[1]}") + f" --workers {workers}")
    try:
        await until_agent(api, created["name"], "online")
        connection = await target_through(api, created, pg_target)
        for _ in range(2):
            result = await psql_through(gateway, api, connection)
            assert result.stdout.strip() == "1", result.stderr
        # tried once: the second stream went over gRPC at once (no second wait for a port that does not answer)
        assert agent.log_path.read_text().count("cannot reach the gateway's tunnel port: streams go over gRPC") == 1
    finally:
        agent.stop()
        balancer.close()


async def dial_waiting(gateway: Any, api: Any, created: dict, agent: Any) -> tuple[dict, Any, Any]:
    """psql through a connection the agent ``created`` serves, its dial waiting for the agent's answer: (the
    connection, psql's task, the agent's order to open the stream)."""
    await until_agent(api, created["name"], "online")
    connection = await answered_by_test(api, created)
    psql = psql_through(gateway, api, connection)
    async with asyncio.timeout(30):
        return connection, psql, await agent.opens.get()


async def test_the_tunnel_listener_refuses_what_it_did_not_ask_for_and_audits_it(gateway, api, pg_target):
    """While a dial waits for the agent's answer: a first record naming a stream id the gateway never gave, and one
    holding another agent's token with the right stream id, are each refused (an error frame, the connection
    closed, an ``agent.stream_refused`` entry naming who); the dial still takes the agent's own answer after."""
    created, other = await new_agent(api), await new_agent(api)
    async with TunnelAgent(created) as agent:
        connection, psql, opened = await dial_waiting(gateway, api, created, agent)
        assert opened.tunnel_port == gateway.tunnel_port and opened.host == "10.9.8.7"

        made_up = await tunnel(gateway, created)
        await made_up.write(pb.TunnelStart(token=created["token"], first=pb.Frame(stream_id="made-up",
                                                                                  connected=True)))
        assert "only the gateway opens streams" in await refusal(made_up)
        stolen_id = await tunnel(gateway, created)
        await stolen_id.write(pb.TunnelStart(token=other["token"], first=pb.Frame(stream_id=opened.stream_id,
                                                                                  connected=True)))
        assert "only the gateway opens streams" in await refusal(stolen_id)

        answer = await tunnel(gateway, created)  # the agent's own answer: the target refused
        await answer.write(pb.TunnelStart(token=created["token"], first=pb.Frame(
            stream_id=opened.stream_id, error="connection refused")))
        result = await psql
        answer.writer.close()
    assert result.returncode != 0 and f'through agent "{created["name"]}": connection refused' in result.stderr, \
        result.stderr
    actors = [e["actor_email"] for e in await refused_entries(api, "only the gateway opens streams")]
    assert f"agent {created['name']}" in actors and f"agent {other['name']}" in actors
    assert not [e for e in await audit(api, "agent.stream_refused")
                if created["token"] in str(e) or other["token"] in str(e)]


async def test_an_agent_s_answer_to_a_dial_is_said_to_the_client_logged_and_recorded_bounded(gateway, api):
    """An agent's answer that it could not reach the target, over a Tunnel call (whose messages may be megabytes):
    its words reach psql, the log and the session's recording cut to 255 characters, not whole (they once went
    whole into each, a recording growing by megabytes a dial)."""
    created = await new_agent(api)
    async with TunnelAgent(created) as agent:
        connection, psql, opened = await dial_waiting(gateway, api, created, agent)
        call = pb_grpc.AgentGatewayStub(agent.channel).Tunnel(metadata=(("authorization", f"Bearer {agent.token}"),))
        await call.write(pb.Frame(stream_id=opened.stream_id, error="no route to host " + "x" * 3_000_000))
        result = await psql
        call.cancel()
    assert result.returncode != 0 and f'through agent "{created["name"]}": no route to host xxx' in result.stderr
    assert "x" * 300 not in result.stderr and "x" * 300 not in gateway.log_text()
    code, sessions = await api("GET", f"/sessions?connection={connection['name']}")
    assert code == 200 and sessions["data"], sessions
    code, session = await api("GET", f"/sessions/{sessions['data'][0]['id']}?expand=event_stream")
    assert code == 200 and "x" * 300 not in str(session)


@pytest.mark.parametrize("sslmode", ["", "disable"])  # the proxy on a socketpair / on the tunnel
async def test_a_target_that_fails_at_the_agent_ends_its_stream_only_and_the_gateway_acknowledges(gateway, api, sslmode):
    """On a tunnel connection, the agent's error frame (its target's socket failed) ends that stream: the gateway
    closes the proxy's end (psql hears it), answers ``eof`` (the acknowledgement) and closes the connection; the
    agent's link stays up."""
    async with carried_session(gateway, api, sslmode) as session:
        created, psql, stream = session.created, session.psql, session.stream
        async with asyncio.timeout(30):
            await stream.write(pb.Frame(error="the connection failed (ConnectionResetError)"))
            after = []
            while (frame := await stream.read()) is not grpc.aio.EOF:
                after.append(frame)
        stream.writer.close()
        result = await psql
        assert result.returncode != 0 and "closed" in result.stderr, result.stderr
        assert [(f.data, f.eof, f.error) for f in after] == [(b"", True, "")]  # the acknowledgement, then the end
        assert (await until_agent(api, created["name"], "online", connections=1))["status"] == "online"
    assert not [e for e in await audit(api, "agent.disconnect") if created["name"] in e["actor_email"]
                and "broke off" in e["error_message"]]


async def keepalive_timers(selection: str) -> bool:
    """Whether every established TCP connection ``ss`` selects (at least one) shows a keepalive timer once its data
    is acknowledged (until then ``ss`` shows the retransmission timer in its place); False after 10 s."""
    for _ in range(100):
        shown = subprocess.run(["ss", "-Htno", "state", "established", selection], capture_output=True, text=True,
                               check=True).stdout.splitlines()
        if shown and all("timer:(keepalive" in line for line in shown):
            return True
        await asyncio.sleep(0.1)
    return False


@pytest.mark.parametrize("sslmode", ["", "disable"])  # the proxy on a socketpair / on the tunnel
async def test_a_tunnel_connection_cut_without_its_end_ends_its_stream_only_and_the_agent_stays(gateway, api, sslmode):
    """A tunnel connection reset under a live session (a NAT or firewall that forgot it) is one TCP connection, not
    the agent: that session's client hears its end, the agent's link stays up (no ``broke off`` disconnect) and
    serves the next session on the same control channel."""
    async with carried_session(gateway, api, sslmode) as session:
        created, agent, connection = session.created, session.agent, session.connection
        first, stream, opened = session.psql, session.stream, session.opened
        local = stream.writer.get_extra_info("sockname")
        assert await keepalive_timers(f"( sport = :{gateway.tunnel_port} and dport = :{local[1]} )")  # keep_alive
        sock = stream.writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        stream.writer.transport.abort()  # a reset: no eof, no error frame
        result = await first
        assert result.returncode != 0 and "closed" in result.stderr, result.stderr

        second = psql_through(gateway, api, connection)  # the same control channel is sent the next Open: the link stayed
        async with asyncio.timeout(30):
            again = await agent.opens.get()
        assert again.stream_id != opened.stream_id
        refused = await tunnel(gateway, created)
        await refused.write(pb.TunnelStart(token=created["token"], first=pb.Frame(stream_id=again.stream_id,
                                                                                  connected=False,
                                                                                  error="connection refused")))
        result = await second
        assert f'through agent "{created["name"]}": connection refused' in result.stderr, result.stderr
        refused.writer.close()
        assert (await until_agent(api, created["name"], "online", connections=1))["status"] == "online"
    assert not [e for e in await audit(api, "agent.disconnect") if created["name"] in e["actor_email"]
                and "broke off" in e["error_message"]]


async def test_the_tunnel_listener_refuses_junk_an_oversized_record_and_silence_without_waiting_on_them(
        gateway, api):
    """A first record that does not parse, a length prefix past the bound (refused without waiting for its bytes),
    a client that says nothing after its TLS handshake (refused after a bounded wait), one that does not even
    shake hands (dropped after the same bound) and one that closes after its handshake: each connection ends, the
    first three with an error frame, all but the one without a handshake with an ``agent.stream_refused``
    entry."""
    created = await new_agent(api)
    junk = await tunnel(gateway, created)
    junk.writer.write(struct.pack(">I", 4) + b"\xff\xff\xff\xff")
    oversized = await tunnel(gateway, created)
    oversized.writer.write(struct.pack(">I", 2**31))  # and not one byte of it
    silent = await tunnel(gateway, created)
    bare = await asyncio.open_connection("127.0.0.1", gateway.tunnel_port)  # no TLS handshake either
    gone = await tunnel(gateway, created)
    gone.writer.close()  # at once, after its handshake
    await gone.writer.wait_closed()

    async def dropped() -> bytes:
        async with asyncio.timeout(30):
            return await bare[0].read()

    said = await asyncio.gather(refusal(junk), refusal(oversized), refusal(silent), dropped())
    bare[1].close()
    assert said[0] == "the tunnel's first record does not parse"
    assert said[1].startswith("the tunnel's first record is too long")
    assert said[2].startswith("the tunnel's first record did not come within")
    assert said[3] == b""
    for reason in [*said[:3], "the tunnel connection ended before its first record"]:
        [entry] = await refused_entries(api, reason)
        assert entry["outcome"] == "failure" and entry["actor_email"] == "agent (unknown token)"
    assert "Traceback" not in gateway.log_text()


async def test_with_the_tunnel_listener_off_streams_go_over_grpc_tunnel_calls(pg_target, tmp_path):
    """``grpc.tunnel = false``: no listener, the Open names no port, and a real agent carries psql over a Tunnel
    call as before."""
    grpc_port, pg_port = free_port(), free_port()
    daemon = Daemon(tmp_path / "data", {"grpc.listen": f"127.0.0.1:{grpc_port}", "grpc.tunnel": False,
                                        "listeners.postgres": f"127.0.0.1:{pg_port}"}).start()
    try:
        wait_port(pg_port, daemon.process, "gatewayd")
        async with aiohttp.ClientSession() as http:
            api = Api(daemon, http, daemon.token("admin@example.com", groups="admin"))
            created = await new_agent(api)
            async with TunnelAgent(created) as agent:  # what an Open says, read by an agent of the protocol's own
                await until_agent(api, created["name"], "online")
                code, connection = await api("POST", "/connections", {
                    "name": "pg-off", "type": "database", "subtype": "postgres", "agent_id": created["id"],
                    "secret": {f"envvar:{k}": b64(v) for k, v in {
                        "HOST": "127.0.0.1", "PORT": str(pg_target.port), "USER": "postgres",
                        "PASS": pg_target.password, "DB": "postgres", "SSLROOTCERT": pg_target.root_cert()}.items()}})
                assert code == 201, connection
                code, access = await api("POST", "/connections/pg-off/credentials", {"access_duration_seconds": 600})
                secret = access["connection_credentials"]["username"]
                url = f"postgres://{secret}:any@127.0.0.1:{pg_port}/postgres?sslmode=disable"
                psql = asyncio.ensure_future(asyncio.to_thread(
                    subprocess.run, ["psql", url, "-X", "-At", "-c", "select 1"], capture_output=True, text=True,
                    timeout=60))
                async with asyncio.timeout(30):
                    opened = await agent.opens.get()
                assert opened.tunnel_port == 0
            await psql  # the agent gone, the dial fails at once
            await until_agent(api, created["name"], "offline")
            agent_process = start(created, tmp_path)
            try:
                await until_agent(api, created["name"], "online")
                result = await asyncio.to_thread(subprocess.run, ["psql", url, "-X", "-At", "-c",
                                                                  "select 'over a Tunnel call'"],
                                                 capture_output=True, text=True, timeout=60)
                assert result.stdout.strip() == "over a Tunnel call", result.stderr
            finally:
                agent_process.stop()
        assert "agent tunnel listener started" not in daemon.log_text()
    finally:
        daemon.stop()


# ---------------------------------------------------------------------------------------------- carrier processes


def tunnel_owners(port: int) -> list[int]:
    """The process id owning each connection to the tunnel listener on ``port`` (``ss -p``: the agents' ends)."""
    listing = subprocess.run(["ss", "-Htnp", "state", "established", f"( dport = :{port} )"], capture_output=True,
                             text=True, check=True).stdout
    return [int(line.split("pid=")[1].split(",")[0]) for line in listing.splitlines() if "pid=" in line]


def children(pid: int) -> set[int]:
    """The live child processes of ``pid`` (their parent id in /proc/N/stat; zombies left out)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.add(int(stat.parent.name))
    return found


async def test_an_agent_with_carriers_spreads_its_streams_over_processes_and_outlives_one(gateway, api, pg_target,
                                                                                          tmp_path):
    """``--workers 2``: the main process dials, two carrier processes carry the bytes (each session's tunnel
    connection is a carrier's, not the main process's, and both carry some). A carrier killed under a session ends
    that session only; it is started again and serves the next ones; the agent's stop ends its carriers."""
    import asyncpg

    created = await new_agent(api)
    agent = start(created, tmp_path, created["command"] + " --workers 2")
    clients: list[Any] = []
    try:
        await until_agent(api, created["name"], "online")
        connection = await target_through(api, created, pg_target, "disable")

        async def session() -> Any:
            code, access = await api("POST", f"/connections/{connection['name']}/credentials",
                                     {"access_duration_seconds": 600})
            return await asyncpg.connect(host="127.0.0.1", port=gateway.pg_port, ssl=False, database="postgres",
                                         user=access["connection_credentials"]["username"], password="any")

        for _ in range(4):
            clients.append(await session())
        for index, client in enumerate(clients):
            assert await client.fetchval("select $1::int * 2", index) == index * 2
        carriers = children(agent.process.pid)
        owners = tunnel_owners(gateway.tunnel_port)
        for pid in carriers:  # the token reached them over their socket only
            assert created["token"].encode() not in Path(f"/proc/{pid}/environ").read_bytes()
            assert created["token"].encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        assert len(carriers) == 2 and agent.process.pid not in owners, (carriers, owners)
        assert set(owners) == carriers and all(owners.count(pid) == 2 for pid in carriers), (carriers, owners)

        victim = max(carriers)
        os.kill(victim, 9)
        survivors, lost = [], 0
        for client in clients:
            try:
                survivors.append(await client.fetchval("select 'still here'"))
            except (asyncpg.PostgresError, ConnectionError, asyncpg.InterfaceError, OSError):
                lost += 1
        assert lost == 2 and survivors == ["still here", "still here"], (lost, survivors)
        async with asyncio.timeout(30):  # started again
            while len(children(agent.process.pid) - {victim}) < 2:
                await asyncio.sleep(0.1)
        later = [await session() for _ in range(2)]
        clients.extend(later)
        assert [await c.fetchval("select 'after'") for c in later] == ["after", "after"]
        assert "a carrier process ended" in agent.log_path.read_text()
    finally:
        for client in clients:
            client.terminate()
        carriers = children(agent.process.pid) if agent.process.poll() is None else set()
        agent.stop()
    async with asyncio.timeout(30):  # the main process's stop ended them
        while any(Path(f"/proc/{pid}").exists() for pid in carriers):
            await asyncio.sleep(0.1)


def test_a_workers_value_that_is_not_a_number_of_processes_is_refused_before_anything_starts():
    for argv, env in ((["--workers", "-1"], {}), ([], {"GATEWAYD_AGENT_WORKERS": "many"})):
        result = subprocess.run([str(Path(sys.executable).with_name("gatewayd")), "agent", "--url",
                                 "grpcs://127.0.0.1:1", *argv], capture_output=True, text=True, timeout=60,
                                env={**os.environ, "GATEWAYD_AGENT_TOKEN": "agt-x", **env})
        assert result.returncode != 0 and "--workers (or $GATEWAYD_AGENT_WORKERS)" in result.stderr, result.stderr


async def test_a_carrier_that_dies_at_its_start_is_started_again_later_and_later(monkeypatch):
    """A carrier that cannot start (here: a log level it refuses, so it exits as it starts) is not started again
    every second for good: each young death doubles the wait, up to the bound; ``stop`` ends the retries."""
    from gatewayd.agent import carriers as module

    monkeypatch.setattr(module, "RESTART_FIRST", 0.05)
    monkeypatch.setattr(module, "RESTART_MAX", 0.2)
    pool = module.Carriers(1, "agt-x", "", "", lambda *_: None, log_level="no-such-level")
    await pool.start()
    waits, dead = [], set()
    try:
        async with asyncio.timeout(60):
            while len(waits) < 5:  # the wait chosen after each death, one per process
                carrier = pool.carriers[0]
                if carrier is not None and not carrier.alive and carrier.process.pid not in dead:
                    dead.add(carrier.process.pid)
                    waits.append(pool.waits[0])
                await asyncio.sleep(0.01)
    finally:
        await pool.stop()
    assert waits == [0.05, 0.1, 0.2, 0.2, 0.2], waits
