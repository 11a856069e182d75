"""Agents end to end, with real network isolation: the targets live in a network namespace of their own.

The fixture makes a namespace and a veth pair; a real PostgreSQL, a real sshd and the aiohttp
target app listen on the namespace's own 127.0.0.1, which the gateway's namespace cannot reach.
``gatewayd agent`` runs inside the namespace with a route to the gateway's gRPC address only.
psql, asyncpg, ssh, scp, curl and a websocket reach the targets through the gateway and the agent;
guard rails still block and recordings are complete (they stay on the gateway); killing the
agent ends its sessions with an ``e`` event naming it, and its restart serves again; another
organization's agent cannot serve these connections. Peers start once for the module.

Needs root (``ip netns add``); skipped with the reason where namespaces cannot be made.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shlex
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import aiohttp
import asyncpg
import pytest

from tests import clients
from tests.apiclient import Api, b64, events, of_kind
from tests.conftest import BIN, ROOT, Daemon, free_port, wait_port
from tests.sshpeer import CLIENT_OPTIONS


PRIVATE_NAME = "targets.private.internal"  # resolves inside the namespace only
DROP_RULE = [{"type": "deny_words_list", "words": ["drop table"]}]


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, check=check, timeout=30)


@pytest.fixture(scope="module")
def netns() -> Iterator[dict[str, str]]:
    """A network namespace joined to ours by a veth pair: {name, host_ip (ours), ns_ip (its)}."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (ip netns add)")
    tag = secrets.token_hex(3)
    name, outside, inside = f"gwa-{tag}", f"vga{tag}", f"vgb{tag}"
    subnet = f"10.{200 + int(tag[:2], 16) % 50}.{int(tag[2:4], 16)}"
    probe = _run("ip", "netns", "add", name, check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a network namespace here: {probe.stderr.strip()}")
    etc = Path("/etc/netns") / name  # `ip netns exec` mounts its files over /etc: a name only the network knows
    try:
        etc.mkdir(parents=True)
        (etc / "hosts").write_text(f"127.0.0.1 localhost\n127.0.0.1 {PRIVATE_NAME}\n")
        _run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
        _run("ip", "link", "set", inside, "netns", name)
        _run("ip", "addr", "add", f"{subnet}.1/30", "dev", outside)
        _run("ip", "link", "set", outside, "up")
        _run("ip", "netns", "exec", name, "ip", "addr", "add", f"{subnet}.2/30", "dev", inside)
        _run("ip", "netns", "exec", name, "ip", "link", "set", inside, "up")
        _run("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
        yield {"name": name, "host_ip": f"{subnet}.1", "ns_ip": f"{subnet}.2", "link": outside}
    finally:
        _run("ip", "netns", "del", name, check=False)
        _run("ip", "link", "del", outside, check=False)
        shutil.rmtree(etc, ignore_errors=True)


def _held(ports: list[int]) -> list[socket.socket] | None:
    """Each port bound (not listening) on our 127.0.0.1, or None when one is in use here already."""
    held: list[socket.socket] = []
    for port in ports:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past a TIME_WAIT, never past a listener
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            sock.close()
            for other in held:
                other.close()
            return None
        held.append(sock)
    return held


@pytest.fixture(scope="module")
def peers(netns, tmp_path_factory) -> Iterator[dict[str, Any]]:
    """PostgreSQL, sshd and the HTTP target app inside the namespace (tests/netnspeers.py).

    Their ports are picked inside the namespace, where our own listeners are not seen: each is held, bound, on our
    127.0.0.1 while they run, so that no listener of ours takes the same number meanwhile (a daemon of this
    worker did, and our 127.0.0.1 then answered on the target's port); peers whose ports are in use here are
    started again."""
    for attempt in range(3):
        out = tmp_path_factory.mktemp("netns-peers") / "peers.json"
        process = subprocess.Popen(["ip", "netns", "exec", netns["name"], str(BIN / "python"), "-m",
                                    "tests.netnspeers", str(out)], cwd=ROOT, stdin=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while not out.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError("the peers in the namespace did not start")
            time.sleep(0.1)
        found = json.loads(out.read_text())
        held = _held([found["pg_port"], found["ssh_port"], found["http_port"]])
        if held is not None:
            break
        process.stdin.close()
        process.wait(60)
    else:
        raise RuntimeError("the namespace's peers got ports in use here three times")
    try:
        yield found
    finally:
        process.stdin.close()
        process.wait(60)
        for sock in held:
            sock.close()


@pytest.fixture(scope="module")
def gateway(netns, tmp_path_factory) -> Iterator[Daemon]:
    """gatewayd with its gRPC server on our end of the veth pair, its proxies on our 127.0.0.1."""
    ports = {name: free_port() for name in ("postgres", "ssh", "http")}
    daemon = Daemon(tmp_path_factory.mktemp("agents") / "data", {
        "grpc.listen": f"{netns['host_ip']}:{free_port()}", "sessions.flush_interval": "100ms",
        "grpc.keepalive": "1s",  # a cut network is found within seconds (the network-cut test)
        **{f"listeners.{name}": f"127.0.0.1:{port}" for name, port in ports.items()}}).start()
    for port in ports.values():
        wait_port(port, daemon.process, "gatewayd")
    daemon.ports = ports
    yield daemon
    daemon.stop()


class AgentProcess:
    """``gatewayd agent`` started from the command the API answered, inside the namespace (or not)."""

    def __init__(self, command: str, log: Path, netns: str | None) -> None:
        words = shlex.split(command)
        self.env = {**os.environ}
        while words and "=" in words[0] and words[0] != "gatewayd":  # NAME=value: the command's environment
            name, _, value = words.pop(0).partition("=")
            self.env[name] = value
        self.argv = [*(["ip", "netns", "exec", netns] if netns else []), str(BIN / "gatewayd"), *words[1:]]
        self.log_path = log
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> "AgentProcess":
        self.process = subprocess.Popen(self.argv, stdout=open(self.log_path, "ab"), stderr=subprocess.STDOUT,
                                        env=self.env)
        return self

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(20)

    def wait_exit(self, timeout: float = 30) -> int:
        return self.process.wait(timeout)


@pytest.fixture(scope="module")
async def api(gateway) -> Any:
    token = gateway.token("admin@example.com", groups="admin", name="Ada Admin")
    async with aiohttp.ClientSession() as http:
        yield Api(gateway, http, token)


async def until_agent(api: Api, name: str, status: str, connections: int | None = None, token: str | None = None,
                      timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        code, body = await api("GET", f"/agents/{name}", token=token)
        assert code == 200, body
        if body["status"] == status and (connections is None or body["connections"] == connections):
            return body
        assert time.monotonic() < deadline, f"agent {name} is {body['status']} with {body['connections']} links"
        await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
async def agent(api, netns, peers, tmp_path_factory) -> Any:
    """The agent "vpc" of the default organization, running inside the namespace."""
    code, created = await api("POST", "/agents", {"name": "vpc", "mode": "standard"})
    assert code == 201, created
    process = AgentProcess(created["command"] + " --keepalive 1", tmp_path_factory.mktemp("agent") / "agent.log",
                           netns["name"]).start()
    await until_agent(api, "vpc", "online")
    process.record = created
    yield process
    process.stop()


async def pg_connection(api: Api, peers: dict, agent_id: str = "vpc", token: str | None = None,
                        sslmode: str = "verify-full") -> dict:
    """``sslmode``: verify-full, the default through an agent; "disable": no TLS to the target (SCRAM still
    proves both ends), the proxy then sits on the agent's tunnel connection itself."""
    tls = {"SSLROOTCERT": peers["pg_root_cert"]} if sslmode == "verify-full" else {"SSLMODE": sslmode}
    body = {"name": f"pg-{uuid.uuid4().hex[:8]}", "type": "database", "subtype": "postgres", "agent_id": agent_id,
            "secret": {f"envvar:{k}": b64(v) for k, v in {
                "HOST": "127.0.0.1", "PORT": str(peers["pg_port"]), "USER": "postgres",
                "PASS": peers["pg_password"], "DB": "postgres", **tls}.items()}}
    code, created = await api("POST", "/connections", body, token=token)
    assert code == 201, created
    return created


async def credential(api: Api, connection: dict, field: str, token: str | None = None) -> tuple[str, str]:
    code, body = await api("POST", f"/connections/{connection['name']}/credentials",
                           {"access_duration_seconds": 600}, token=token)
    assert code == 201, body
    return body["connection_credentials"][field], body["session_id"]


def psql(gateway: Daemon, secret: str, *commands: str) -> subprocess.CompletedProcess[str]:
    return clients.psql(gateway.ports["postgres"], secret, "-At", *[part for c in commands for part in ("-c", c)])


# ---------------------------------------------------------------------------------------------- the isolation


def test_the_targets_are_out_of_the_gateway_s_reach(peers, netns):
    """Not on the namespace's end of the link; on our 127.0.0.1 nothing listens on their ports (the fixture
    could bind each of them here)."""
    for host in ("127.0.0.1", netns["ns_ip"]):
        for port in (peers["pg_port"], peers["ssh_port"], peers["http_port"]):
            with pytest.raises(OSError):
                socket.create_connection((host, port), timeout=5).close()


async def test_an_offline_agent_is_refused_at_once_in_the_protocol_s_words(api, gateway, peers):
    code, created = await api("POST", "/agents", {"name": "never-started"})
    assert code == 201 and created["status"] == "offline"
    connection = await pg_connection(api, peers, "never-started")
    code, shown = await api("GET", f"/connections/{connection['name']}")
    assert shown["status"] == "offline"
    secret, session_id = await credential(api, connection, "username")
    result = psql(gateway, secret, "select 1")
    assert result.returncode != 0 and 'agent "never-started" is offline' in result.stderr, result.stderr
    session = await api.done_session(session_id)
    assert session["exit_code"] == 254 and any('agent "never-started" is offline' in e for e in of_kind(session, "e"))

    body = {"name": f"ssh-{uuid.uuid4().hex[:8]}", "type": "custom", "subtype": "ssh", "agent_id": "never-started",
            "secret": {f"envvar:{k}": b64(v) for k, v in {"HOST": "127.0.0.1", "PORT": "22", "USER": "x",
                                                          "PASS": "y", "HOST_KEY": peers["ssh_host_key"]}.items()}}
    code, ssh_connection = await api("POST", "/connections", body)
    assert code == 201, ssh_connection
    secret, _ = await credential(api, ssh_connection, "username")
    result = subprocess.run(["ssh", *CLIENT_OPTIONS, "-p", str(gateway.ports["ssh"]), f"{secret}@127.0.0.1", "true"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 254 and 'agent "never-started" is offline' in result.stderr, result.stderr


# ---------------------------------------------------------------------------------------------- every protocol


async def test_psql_through_the_agent_with_guard_rails_and_a_complete_recording(api, gateway, peers, agent):
    connection = await pg_connection(api, peers)
    code, shown = await api("GET", f"/connections/{connection['name']}")
    assert shown["status"] == "online" and shown["agent_id"] == "vpc"
    await api.guardrail(connection, DROP_RULE)
    secret, session_id = await credential(api, connection, "username")
    result = psql(gateway, secret, "select 'reached ' || inet_server_port()", "drop table nothing")
    assert f"reached {peers['pg_port']}" in result.stdout, result.stderr
    assert "validation error, match guard rails input rule" in result.stderr
    session = await api.done_session(session_id)
    assert "select 'reached ' || inet_server_port()" in of_kind(session, "i")
    assert any(f"reached {peers['pg_port']}" in text for text in of_kind(session, "o"))
    assert any("match guard rails" in text for text in of_kind(session, "e"))
    # by default over the tunnel listener beside the gRPC port (its port + 100), which the agent reached
    assert "agent tunnel listener started" in gateway.log_text()
    assert "goes over gRPC" not in agent.log_path.read_text()


async def test_a_target_the_agent_cannot_reach_is_said_in_the_agent_s_words(api, gateway, peers, agent):
    taken = {peers["pg_port"], peers["ssh_port"], peers["http_port"]}  # the namespace's own listeners
    dead = dict(peers, pg_port=next(port for port in iter(free_port, None) if port not in taken))
    connection = await pg_connection(api, dead)
    secret, session_id = await credential(api, connection, "username")
    result = psql(gateway, secret, "select 1")
    assert 'through agent "vpc": connection refused' in result.stderr, result.stderr
    assert str(dead["pg_port"]) not in result.stderr  # the address is not told
    code, shown = await api("GET", "/agents/vpc")
    assert shown["status"] == "online"  # one stream failed; the agent's link stands


async def test_a_one_time_script_runs_through_the_agent(api, gateway, peers, agent):
    connection = await pg_connection(api, peers)
    code, answer = await api("POST", "/sessions", {"connection": connection["name"],
                                                   "script": "select 'script at ' || inet_server_port()"})
    assert code in (200, 201) and f"script at {peers['pg_port']}" in answer["output"], answer


async def test_ssh_and_scp_through_the_agent(api, gateway, peers, agent, netns, tmp_path):
    body = {"name": f"ssh-{uuid.uuid4().hex[:8]}", "type": "custom", "subtype": "ssh", "agent_id": "vpc",
            "secret": {f"envvar:{k}": b64(v) for k, v in {
                "HOST": PRIVATE_NAME, "PORT": str(peers["ssh_port"]), "USER": peers["ssh_user"],
                "PRIVATE_KEY": peers["ssh_key"], "HOST_KEY": peers["ssh_host_key"]}.items()}}
    code, connection = await api("POST", "/connections", body)
    assert code == 201, connection
    secret, session_id = await credential(api, connection, "username")
    ssh = ["ssh", *CLIENT_OPTIONS, "-p", str(gateway.ports["ssh"]), f"{secret}@127.0.0.1"]
    result = subprocess.run([*ssh, "ip -4 -o addr show"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert netns["ns_ip"] in result.stdout  # the command ran in the namespace
    session = await api.done_session(session_id)
    assert any(netns["ns_ip"] in text for text in of_kind(session, "o"))

    secret, _ = await credential(api, connection, "username")
    payload = secrets.token_bytes(300_000)
    local = tmp_path / "up.bin"
    local.write_bytes(payload)
    remote = f"/tmp/agent-scp-{uuid.uuid4().hex[:8]}"
    result = subprocess.run(["scp", *CLIENT_OPTIONS, "-P", str(gateway.ports["ssh"]), str(local),
                             f"{secret}@127.0.0.1:{remote}"], capture_output=True, text=True, timeout=60,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr
    secret, _ = await credential(api, connection, "username")
    result = subprocess.run([*ssh[:-1], f"{secret}@127.0.0.1", f"sha256sum {remote} && rm {remote}"],
                            capture_output=True, text=True, timeout=60)
    import hashlib

    assert hashlib.sha256(payload).hexdigest() in result.stdout, result.stderr


async def test_curl_and_a_websocket_through_the_agent(api, gateway, peers, agent):
    body = {"name": f"web-{uuid.uuid4().hex[:8]}", "type": "httpproxy", "subtype": "httpproxy", "agent_id": "vpc",
            "secret": {"envvar:REMOTE_URL": b64(f"http://{PRIVATE_NAME}:{peers['http_port']}")}}
    code, connection = await api("POST", "/connections", body)
    assert code == 201, connection
    secret, session_id = await credential(api, connection, "proxy_token")
    url = f"http://127.0.0.1:{gateway.ports['http']}"
    result = subprocess.run(["curl", "-sS", "-H", f"Authorization: {secret}", f"{url}/text?say=from-the-namespace"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "from-the-namespace" in result.stdout, result.stdout + result.stderr
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(f"{url}/ws", headers={"Authorization": secret}) as ws:
            await ws.send_str("echo through the agent")
            message = await ws.receive(timeout=30)
            assert "echo through the agent" in message.data
    await api.session(session_id, until=lambda s: any("from-the-namespace" in t for t in of_kind(s, "o"))
                      and any("echo through the agent" in t for t in of_kind(s, "i")))


# ---------------------------------------------------------------------------------------------- losing the agent


@pytest.mark.parametrize("sslmode", ["verify-full", "disable"])
async def test_killing_the_agent_ends_its_session_naming_it_and_a_restart_serves_again(api, gateway, peers, agent,
                                                                                        sslmode):
    connection = await pg_connection(api, peers, sslmode=sslmode)
    secret, session_id = await credential(api, connection, "username")
    client = await asyncpg.connect(host="127.0.0.1", port=gateway.ports["postgres"], user=secret, password="any",
                                   database="postgres", ssl=False)
    try:
        assert await client.fetchval("select 21 * 2") == 42
        agent.kill()
        session = await api.done_session(session_id, timeout=30)
        assert session["exit_code"] == 254
        assert any('agent "vpc" went offline' in text for text in of_kind(session, "e")), events(session)
        with pytest.raises((asyncpg.PostgresError, ConnectionError, asyncpg.InterfaceError)):
            await client.fetchval("select 1")
    finally:
        client.terminate()
    await until_agent(api, "vpc", "offline")
    code, shown = await api("GET", f"/connections/{connection['name']}")
    assert shown["status"] == "offline"
    secret, _ = await credential(api, connection, "username")
    assert 'agent "vpc" is offline' in psql(gateway, secret, "select 1").stderr

    agent.start()
    await until_agent(api, "vpc", "online")
    secret, _ = await credential(api, connection, "username")
    result = psql(gateway, secret, "select 'back again'")
    assert result.stdout.strip() == "back again", result.stderr
    code, page = await api("GET", "/audit/logs?resource_type=agents&page_size=100")
    actions = [(e["action"], e["outcome"]) for e in page["data"]]
    assert ("agent.disconnect", "failure") in actions and actions.count(("agent.connect", "success")) >= 2


async def test_a_network_cut_ends_the_agent_s_sessions_and_it_comes_back_after(api, gateway, peers, agent, netns):
    connection = await pg_connection(api, peers)
    secret, session_id = await credential(api, connection, "username")
    client = await asyncpg.connect(host="127.0.0.1", port=gateway.ports["postgres"], user=secret, password="any",
                                   database="postgres", ssl=False)
    try:
        assert await client.fetchval("select 1") == 1
        _run("ip", "link", "set", netns["link"], "down")  # the cable is cut; both processes live on
        try:
            await until_agent(api, "vpc", "offline", timeout=60)  # the gateway's keepalive found it
            session = await api.done_session(session_id, timeout=30)
            assert any('agent "vpc" went offline' in text for text in of_kind(session, "e")), events(session)
        finally:
            _run("ip", "link", "set", netns["link"], "up")
    finally:
        client.terminate()
    await until_agent(api, "vpc", "online", timeout=90)  # the agent's backoff found the gateway again
    assert agent.process.poll() is None
    secret, _ = await credential(api, connection, "username")
    assert psql(gateway, secret, "select 'after the cut'").stdout.strip() == "after the cut"


# ---------------------------------------------------------------------------------------------- organizations


async def other_org_admin(gateway: Daemon) -> str:
    """A bearer token of an admin of a second organization of the same gateway (its store, as a host command)."""
    from gatewayd.config import load_config
    from gatewayd.daemon import Gateway
    from gatewayd.models import User, new_id

    core = Gateway(load_config(str(gateway.config_path), environ={}))
    await core.open_core()
    try:
        org = await core.store.create_org(f"other-{uuid.uuid4().hex[:6]}")
        email = f"boss@{org.name}.example.com"
        user = User(id=new_id(), org_id=org.id, subject=email, email=email, name="Other Admin", groups=["admin"])
        await core.store.save_user(user)
        return core.identity.issue_token(user, 3600)
    finally:
        await core.close_core()


async def test_another_organization_s_agent_cannot_serve_these_connections(api, gateway, peers, agent, netns,
                                                                          tmp_path):
    other = await other_org_admin(gateway)
    code, theirs = await api("POST", "/agents", {"name": "vpc"}, token=other)  # the same name, their organization
    assert code == 201, theirs
    intruder = AgentProcess(theirs["command"], tmp_path / "intruder.log", netns["name"]).start()
    try:
        await until_agent(api, "vpc", "online", token=other)
        ours = await pg_connection(api, peers)
        agent.stop()  # ours is offline; theirs, of the same name, is online
        await until_agent(api, "vpc", "offline")
        secret, _ = await credential(api, ours, "username")
        result = psql(gateway, secret, "select 1")
        assert 'agent "vpc" is offline' in result.stderr, result.stderr
        # their connection naming our agent by id finds no agent of theirs
        code, mine = await api("GET", "/agents/vpc")
        connection = await pg_connection(api, peers, agent_id=mine["id"], token=other)
        secret, _ = await credential(api, connection, "username", token=other)
        result = psql(gateway, secret, "select 1")
        assert f'no agent "{mine["id"]}" in this organization' in result.stderr, result.stderr
    finally:
        intruder.stop()
        agent.start()
        await until_agent(api, "vpc", "online")
