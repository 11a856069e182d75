"""The daemon's lifecycle with a proxy plugged in: live listeners, sessions, kill, expiry, cap, shutdown."""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys

import aiohttp
import pytest

from control.app import make_app
from gatewayd.config import load_config
from gatewayd.daemon import Gateway
from tests import lineproxy
from tests.conftest import ROOT, free_port


async def make_gateway(tmp_path, **overrides) -> Gateway:
    config = load_config(None, environ={}, overrides={
        "data_dir": str(tmp_path / "data"), "api.listen": f"127.0.0.1:{free_port()}",
        "listeners.postgres": "", "listeners.rdp": "", "listeners.http": "",
        "listeners.ssh": f"127.0.0.1:{free_port()}", "sessions.flush_interval": "200ms", **overrides})
    gateway = Gateway(config, app_factory=make_app, listener_factories={"ssh": lineproxy.start})
    await gateway.start()
    return gateway


class Api:
    """Tiny JSON client for the in-process gateway."""

    def __init__(self, gateway: Gateway, http: aiohttp.ClientSession, token: str) -> None:
        self.base = f"http://{gateway.config['api.listen']}/api"
        self.http = http
        self.token = token

    async def __call__(self, method: str, path: str, body=None, token: str | None = None):
        headers = {"Authorization": f"Bearer {token or self.token}"}
        async with self.http.request(method, self.base + path, json=body, headers=headers) as response:
            data = await response.json(content_type=None) if response.status != 204 else None
            return response.status, data


@pytest.fixture
async def env(tmp_path):
    gateway = await make_gateway(tmp_path)
    admin = await gateway.identity.ensure_local_user("admin@example.com", "Admin", ["admin"])
    async with aiohttp.ClientSession() as http:
        api = Api(gateway, http, gateway.identity.issue_token(admin))
        status, _ = await api("POST", "/connections", {
            "name": "line", "type": "custom", "subtype": "ssh",
            "secret": {"envvar:HOST": base64.b64encode(b"127.0.0.1").decode()}})
        assert status == 201
        yield gateway, api
        await gateway.stop()


async def credential(api: Api, seconds: int = 600) -> dict:
    status, body = await api("POST", "/connections/line/credentials", {"access_duration_seconds": seconds})
    assert status == 201, body
    return body


async def connect(gateway: Gateway, secret: str, address: str | None = None):
    host, port = (address or gateway.server_config["ssh_server_config"]["listen_address"]).rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(secret.encode() + b"\n")
    first = (await asyncio.wait_for(reader.readline(), 5)).decode()
    return reader, writer, first


async def wait_done(api: Api, session_id: str) -> dict:
    for _ in range(100):
        status, body = await api("GET", f"/sessions/{session_id}?expand=event_stream")
        if body["status"] == "done":
            return body
        await asyncio.sleep(0.05)
    raise AssertionError(f"session {session_id} never finished: {body}")


def decoded(events: list) -> list[tuple[str, str]]:
    return [(kind, base64.b64decode(data).decode()) for _, kind, data in events]


async def test_session_is_recorded_and_done_when_the_client_leaves(env):
    gateway, api = env
    cred = await credential(api)
    reader, writer, first = await connect(gateway, cred["connection_credentials"]["password"])
    session_id = first.split()[1]
    assert session_id == cred["session_id"]  # the first connection claims the issued session
    writer.write(b"hello\nworld\n")
    assert await reader.readline() == b"echo: hello\n"
    assert await reader.readline() == b"echo: world\n"
    writer.close()
    body = await wait_done(api, session_id)
    assert decoded(body["event_stream"]) == [("i", "hello\n"), ("o", "echo: hello\n"),
                                             ("i", "world\n"), ("o", "echo: world\n")]
    offsets = [e[0] for e in body["event_stream"]]
    assert all(isinstance(o, int) for o in offsets) and offsets == sorted(offsets)
    assert body["exit_code"] == 0 and body["end_date"] and body["verb"] == "connect"
    assert body["event_size"] == len("hello\necho: hello\nworld\necho: world\n")
    status, text = await api("GET", f"/sessions/{session_id}?event_stream=utf8")
    assert text["event_stream"] == ["echo: hello\necho: world\n"]

    # a second connection with the same credential is a new session of the same batch
    reader, writer, first = await connect(gateway, cred["connection_credentials"]["password"])
    second = first.split()[1]
    assert second != session_id
    writer.close()
    assert (await wait_done(api, second))["session_batch_id"] == cred["id"]


async def test_wrong_and_expired_secrets_are_refused_and_audited(env):
    gateway, api = env
    _, _, answer = await connect(gateway, "ssh-" + "A" * 43)
    assert answer == "denied: invalid credential: unknown secret\n"
    cred = await credential(api, seconds=1)
    await asyncio.sleep(1.2)
    _, _, answer = await connect(gateway, cred["connection_credentials"]["password"])
    assert answer == "denied: invalid credential: it has expired\n"
    status, logs = await api("GET", "/audit/logs?action=ssh.login&outcome=failure")
    assert status == 200 and logs["pages"]["total"] == 2
    messages = {e["error_message"] for e in logs["data"]}
    assert messages == {"invalid credential: unknown secret", "invalid credential: it has expired"}
    assert all("ssh-" not in str(e["request_payload_redacted"]) for e in logs["data"])


async def test_guard_rail_block_is_an_e_event_and_an_audit_entry(env):
    gateway, api = env
    status, conn = await api("GET", "/connections/line")
    status, _ = await api("POST", "/guardrails", {
        "name": "no-drop", "connection_ids": [conn["id"]],
        "input": {"rules": [{"type": "deny_words_list", "words": ["drop table"]}]},
        "output": {"rules": [{"type": "pattern_match", "pattern_regex": "top-secret"}]}})
    assert status == 201
    cred = await credential(api)
    reader, writer, first = await connect(gateway, cred["connection_credentials"]["password"])
    writer.write(b"DROP  TABLE users\ntop-secret\nfine\n")
    assert await reader.readline() == (b"blocked: validation error, match guard rails input rule, "
                                       b"type=deny_words_list, words=[drop table]\n")
    assert await reader.readline() == (b"blocked: validation error, match guard rails output rule, "
                                       b"type=pattern_match, pattern=top-secret\n")
    assert await reader.readline() == b"echo: fine\n"
    writer.close()
    body = await wait_done(api, first.split()[1])
    kinds = decoded(body["event_stream"])
    blocked = kinds.index(("i", "DROP  TABLE users\n"))  # a blocked line is recorded, then its block
    assert kinds[blocked + 1] == ("e", "validation error, match guard rails input rule, type=deny_words_list, "
                                       "words=[drop table]")
    assert [k for k, _ in kinds].count("e") == 2
    status, logs = await api("GET", "/audit/logs?action=guardrail.block")
    assert logs["pages"]["total"] == 2 and {e["outcome"] for e in logs["data"]} == {"failure"}


async def test_kill_through_the_api_closes_the_connection(env):
    gateway, api = env
    cred = await credential(api)
    reader, writer, first = await connect(gateway, cred["connection_credentials"]["password"])
    session_id = first.split()[1]
    status, body = await api("POST", f"/sessions/{session_id}/kill")
    assert status == 200 and body["status"] == "done" and body["exit_code"] == 254
    assert await asyncio.wait_for(reader.readline(), 5) == b"closed: session killed by admin@example.com\n"
    assert await asyncio.wait_for(reader.read(), 5) == b""
    body = await wait_done(api, session_id)
    assert decoded(body["event_stream"])[-1] == ("e", "session killed by admin@example.com")
    status, again = await api("POST", f"/sessions/{session_id}/kill")
    assert status == 409 and again == {"message": "the session is already done"}


async def test_credential_expiring_mid_session_ends_it(env):
    gateway, api = env
    cred = await credential(api, seconds=1)
    reader, writer, first = await connect(gateway, cred["connection_credentials"]["password"])
    assert await asyncio.wait_for(reader.readline(), 5) == b"closed: credential expired: the session was closed\n"
    body = await wait_done(api, first.split()[1])
    assert decoded(body["event_stream"])[-1] == ("e", "credential expired: the session was closed")


async def test_listeners_start_restart_and_stop_live(env):
    gateway, api = env
    status, misc = await api("GET", "/serverconfig/misc")
    old = misc["ssh_server_config"]["listen_address"]
    new = f"127.0.0.1:{free_port()}"
    cred = await credential(api)
    reader, writer, _ = await connect(gateway, cred["connection_credentials"]["password"], old)

    misc["ssh_server_config"]["listen_address"] = new
    status, saved = await api("PUT", "/serverconfig/misc", misc)
    assert status == 200 and saved["ssh_server_config"]["listen_address"] == new
    _, _, answer = await connect(gateway, cred["connection_credentials"]["password"], new)
    assert answer.startswith("session ")
    with pytest.raises(OSError):
        await connect(gateway, "x", old)
    writer.write(b"still here\n")  # a restart does not cut sessions in progress
    assert await reader.readline() == b"echo: still here\n"

    misc["ssh_server_config"]["listen_address"] = ""
    status, _ = await api("PUT", "/serverconfig/misc", misc)
    assert status == 200
    with pytest.raises(OSError):
        await connect(gateway, "x", new)
    status, info = await api("GET", "/serverinfo")
    assert info["listeners"]["ssh"]["status"] == "stopped"

    misc["ssh_server_config"]["listen_address"] = "no-port-here"
    status, error = await api("PUT", "/serverconfig/misc", misc)
    assert status == 400 and "listen_address" in error["message"]
    misc["ssh_server_config"]["listen_address"] = new
    status, _ = await api("PUT", "/serverconfig/misc", misc)
    _, _, answer = await connect(gateway, cred["connection_credentials"]["password"], new)
    assert answer.startswith("session ")
    # a port that is taken answers 409 and says which listener failed
    misc["ssh_server_config"]["listen_address"] = f"127.0.0.1:{gateway.config['api.listen'].rsplit(':', 1)[1]}"
    status, error = await api("PUT", "/serverconfig/misc", misc)
    assert status == 409 and "ssh" in error["message"]
    writer.close()


async def test_recording_cap_truncates_but_traffic_flows(tmp_path):
    gateway = await make_gateway(tmp_path, **{"sessions.recording_cap_bytes": 64})
    try:
        admin = await gateway.identity.ensure_local_user("a@example.com", "A", ["admin"])
        async with aiohttp.ClientSession() as http:
            api = Api(gateway, http, gateway.identity.issue_token(admin))
            await api("POST", "/connections", {"name": "line", "type": "custom", "subtype": "ssh"})
            cred = await credential(api)
            reader, writer, first = await connect(gateway, cred["connection_credentials"]["password"])
            for n in range(20):
                writer.write(f"line number {n}\n".encode())
                assert await reader.readline() == f"echo: line number {n}\n".encode()
            writer.close()
            body = await wait_done(api, first.split()[1])
            assert body["metrics"]["truncated"] is True
            events = decoded(body["event_stream"])
            assert events[-1][0] == "e" and "recording cap of 64 bytes" in events[-1][1]
            assert sum(len(text) for kind, text in events if kind != "e") <= 64
    finally:
        await gateway.stop()


async def test_shutdown_gives_grace_then_closes_and_flushes(tmp_path):
    gateway = await make_gateway(tmp_path, **{"sessions.shutdown_grace": "300ms", "sessions.flush_interval": "1h"})
    admin = await gateway.identity.ensure_local_user("a@example.com", "A", ["admin"])
    async with aiohttp.ClientSession() as http:
        api = Api(gateway, http, gateway.identity.issue_token(admin))
        await api("POST", "/connections", {"name": "line", "type": "custom", "subtype": "ssh"})
        cred = await credential(api)
        reader, writer, first = await connect(gateway, cred["connection_credentials"]["password"])
        writer.write(b"unflushed\n")
        assert await reader.readline() == b"echo: unflushed\n"
    session_id = first.split()[1]
    await gateway.stop()
    assert await asyncio.wait_for(reader.readline(), 5) == b"closed: gateway shutting down: the session was closed\n"

    again = await make_gateway(tmp_path)
    try:
        session = await again.store.get_session(session_id)
        events = [(e.kind, e.data) for e in await again.store.read_events(session_id)]
        assert session.status == "done" and session.exit_code == 254
        assert events == [("i", b"unflushed\n"), ("o", b"echo: unflushed\n"),
                          ("e", b"gateway shutting down: the session was closed")]
    finally:
        await again.stop()


async def test_a_session_naming_another_organizations_review_shows_and_decides_none(env):
    """No tenant above another: a session whose review id names another organization's review (no gateway writes
    one; a store edited by hand can hold one) shows no review, in its list or alone, and deciding on its review is
    a 404, never a decision on the other organization's review."""
    from gatewayd.models import Review, new_id
    from tests.test_store_contract import NOW, a_session

    gateway, api = env
    org = await gateway.store.default_org()
    elsewhere = (await gateway.store.create_org("elsewhere")).id
    foreign = Review(id=new_id(), org_id=elsewhere, session_id=new_id(), connection_id="c", type="onetime",
                     status="PENDING", owner_id="x", created_at=NOW)
    await gateway.store.create_review(foreign)
    session = a_session(org.id, review_id=foreign.id)
    await gateway.store.create_session(session)
    status, page = await api("GET", "/sessions?limit=1")
    assert status == 200 and page["data"][0]["id"] == session.id and page["data"][0]["review"] is None, page
    status, shown = await api("GET", f"/sessions/{session.id}")
    assert status == 200 and shown["review"] is None, shown
    status, answer = await api("PUT", f"/sessions/{session.id}/review", {"status": "APPROVED"})
    assert status == 404 and "has no review" in answer["message"], answer
    assert (await gateway.store.get_review(foreign.id)).status == "PENDING"


def test_a_stop_that_runs_past_its_limit_ends_the_process_with_an_error():
    """The stop's watchdog (launcher.root.stop_watchdog) fires from its own thread, so a stop whose event loop is
    blocked (here: a stop that sleeps on the loop) still ends the process: status 1 and an error in the log."""
    script = ("import asyncio, time\n"
              "from gatewayd import logs\n"
              "from launcher.root import stop_watchdog\n"
              "logs.configure('json', 'info')\n"
              "async def stop():\n"
              "    with stop_watchdog(0.5):\n"
              "        time.sleep(60)  # the loop blocked\n"
              "asyncio.run(stop())\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert done.returncode == 1, done
    lines = [json.loads(line) for line in (done.stdout + done.stderr).splitlines() if line.startswith("{")]
    assert [(e["level"], e["message"], e["limit_s"]) for e in lines] == [
        ("error", "gatewayd did not stop in time: exiting now", 0.5)], done


def test_a_stop_within_its_limit_is_left_alone():
    script = ("import asyncio\n"
              "from launcher.root import stop_watchdog\n"
              "async def stop():\n"
              "    with stop_watchdog(0.5):\n"
              "        await asyncio.sleep(0.1)\n"
              "    await asyncio.sleep(1)  # past the limit, after the stop: nothing fires\n"
              "asyncio.run(stop())\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert done.returncode == 0 and "did not stop" not in done.stderr + done.stdout, done
