"""What the operator sees in the daemon's log at the default level: one structured line per session
opened and closed, refused login, guard-rail block and failed API call, each API line carrying the
request id echoed in ``X-Request-Id``; SIGHUP reloads the log settings instead of killing the daemon.

A real ``gatewayd run`` (JSON log format, default level) with its HTTP listener in front of the real
target app of ``tests/httppeer.py``, driven by a plain HTTP client.
"""

from __future__ import annotations

import json
import signal
import time

import aiohttp
import pytest

from tests.apiclient import Api, admin_http
from tests.conftest import Daemon, proxy_daemon
from tests.test_http_proxy import target  # noqa: F401 (the target app fixture, one per module)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    daemon = proxy_daemon(tmp_path_factory, "oplogs", "http", {"log.level": "info"}, wait=True)
    daemon.http_url = f"http://127.0.0.1:{daemon.proxy_port}"
    yield daemon
    assert daemon.stop() == 0


def log_lines(daemon: Daemon) -> list[dict]:
    """The daemon's log so far, one JSON object a line (every line must be JSON in this format)."""
    return [json.loads(line) for line in daemon.log_text().splitlines() if line.strip()]


def wait_for_line(daemon: Daemon, predicate, what: str) -> dict:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        for line in log_lines(daemon):
            if predicate(line):
                return line
        time.sleep(0.05)
    raise AssertionError(f"no log line {what}:\n{daemon.log_text()[-4000:]}")


async def test_sessions_refusals_blocks_and_failed_calls_are_logged(gateway, target):
    async with admin_http(gateway) as http:
        api = Api(gateway, http)
        api.secret_field = "proxy_token"
        connection = await api.connection("logged", "httpproxy", "httpproxy", {"REMOTE_URL": target})
        await api.guardrail(connection, input_rules=[{"type": "deny_words_list", "words": ["forbidden"]}])
        secret, session_id = await api.credential(connection)
        async with aiohttp.ClientSession() as client:
            async with client.get(f"{gateway.http_url}/json", headers={"Authorization": secret}) as response:
                assert response.status == 200
            async with client.get(f"{gateway.http_url}/text?say=forbidden",
                                  headers={"Authorization": secret}) as response:
                assert response.status == 403
            async with client.get(f"{gateway.http_url}/json",
                                  headers={"Authorization": "httpproxy-" + "B" * 43}) as response:
                assert response.status == 401
            async with client.get(f"{gateway.url}/connections/no-such-connection", headers={
                    "Authorization": http.headers["Authorization"], "X-Request-Id": "op-check-1"}) as response:
                assert response.status == 404
                assert response.headers["X-Request-Id"] == "op-check-1"
            async with client.get(f"{gateway.url}/healthz") as response:  # a new id when none is sent
                assert len(response.headers["X-Request-Id"]) == 32
            async with client.get(f"{gateway.url}/healthz", headers={"X-Request-Id": "x" * 500}) as response:
                assert response.headers["X-Request-Id"] != "x" * 500  # never echo an attacker-sized value
        status, _ = await api("POST", f"/sessions/{session_id}/kill")
        assert status == 200

    opened = wait_for_line(gateway, lambda l: l["message"] == "session opened" and l.get("session_id") == session_id,
                           "for the session opening")
    assert opened["connection"] == connection["name"] and opened["user"] == "admin@example.com"
    assert opened["client"] == "127.0.0.1" and opened["level"] == "info"
    block = wait_for_line(gateway, lambda l: l.get("action") == "guardrail.block", "for the guard-rail block")
    assert block["session_id"] == session_id and block["client"] == "127.0.0.1" and "forbidden" in block["reason"]
    refused = wait_for_line(gateway, lambda l: l.get("action") == "httpproxy.login", "for the refused login")
    assert refused["outcome"] == "failure" and refused["reason"] == "invalid credential: unknown secret"
    assert refused["client"] == "127.0.0.1"
    failed = wait_for_line(gateway, lambda l: l["message"] == "api call failed" and l.get("status") == 404,
                           "for the failed API call")
    assert failed["request_id"] == "op-check-1" and failed["path"] == "/api/connections/no-such-connection"
    assert failed["user"] == "admin@example.com" and failed["client"] == "127.0.0.1"
    closed = wait_for_line(gateway, lambda l: l["message"] == "session closed" and l.get("session_id") == session_id,
                           "for the session closing")
    assert closed["outcome"] == "error" and closed["exit_code"] == 254 and "killed" in closed["reason"]
    text = gateway.log_text()
    assert secret not in text and "B" * 43 not in text


async def test_sighup_reloads_the_log_settings_and_keeps_serving(gateway):
    gateway.config_path.write_text(gateway.config_path.read_text().replace('level = "info"', 'level = "warning"'))
    gateway.process.send_signal(signal.SIGHUP)
    reloaded = wait_for_line(gateway, lambda l: l["message"] == "configuration reloaded", "for the reload")
    assert reloaded["applied"] == "log.format,log.level"
    async with aiohttp.ClientSession() as client:
        async with client.get(f"{gateway.url}/healthz") as response:
            assert response.status == 200
        before = len(log_lines(gateway))
        async with client.get(f"{gateway.url}/connections") as response:  # a 401: info, now below the level
            assert response.status == 401
    assert gateway.process.poll() is None
    assert len(log_lines(gateway)) == before

    gateway.config_path.write_text(gateway.config_path.read_text() + "\nnot toml at all [\n")
    gateway.process.send_signal(signal.SIGHUP)
    bad = wait_for_line(gateway, lambda l: l["message"] == "configuration not reloaded", "for the refused reload")
    assert "not valid TOML" in bad["reason"]
    async with aiohttp.ClientSession() as client:
        async with client.get(f"{gateway.url}/healthz") as response:
            assert response.status == 200
