"""End to end: a jit review on an HTTP proxy connection; revoking it cuts a live stream and refuses the secret.

One aiohttp target app (``tests/httppeer.py``) and one ``gatewayd run`` with the
http listener serve the module; skipped when the HTTP proxy is not present.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import subprocess
import sys
import time
import uuid
from typing import Any

import aiohttp
import pytest

from tests.conftest import ROOT, Daemon, free_port

pytestmark = pytest.mark.skipif(importlib.util.find_spec("proxies.http.server") is None, reason="no HTTP proxy")


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def wait_port(port: int, timeout: float = 20) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            assert time.monotonic() < deadline, f"nothing listens on {port}"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def target():
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "tests.httppeer", str(port)], cwd=ROOT)
    try:
        wait_port(port)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:  # a held SSE handler may keep it from stopping gracefully
            process.kill()
            process.wait(5)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    port = free_port()
    daemon = Daemon(tmp_path_factory.mktemp("reviews-http") / "data", {
        "listeners.http": f"127.0.0.1:{port}", "sessions.flush_interval": "100ms"}).start()
    daemon.http_url = f"http://127.0.0.1:{port}"
    wait_port(port)
    daemon.tokens = {"admin": daemon.token("ada@example.com", groups="admin"),
                     "rita": daemon.token("rita@example.com", groups="dev"),
                     "dora": daemon.token("dora@example.com", groups="dba")}
    yield daemon
    assert daemon.stop() == 0


async def test_jit_on_http_revocation_cuts_the_live_stream(gateway, target):
    async with aiohttp.ClientSession() as http:
        async def api(who: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
            async with http.request(method, gateway.url + path, json=body,
                                    headers={"Authorization": f"Bearer {gateway.tokens[who]}"}) as response:
                text = await response.text()
                return response.status, json.loads(text) if text else None

        status, conn = await api("admin", "POST", "/connections", {
            "name": f"web-{uuid.uuid4().hex[:6]}", "type": "httpproxy", "subtype": "httpproxy",
            "secret": {"envvar:REMOTE_URL": b64(target)}, "settings": {"reviewers": ["dba"]}})
        assert status == 201, conn
        status, body = await api("rita", "POST", f"/connections/{conn['name']}/credentials", {})
        assert status == 202, body
        session_id, review_id = body["session_id"], body["review_id"]
        status, body = await api("dora", "PUT", f"/reviews/{review_id}", {"status": "APPROVED"})
        assert status == 200 and body["status"] == "APPROVED"
        status, body = await api("rita", "POST", f"/connections/{conn['name']}/credentials/{session_id}")
        assert status == 201, body
        secret = body["connection_credentials"]["proxy_token"]

        async with aiohttp.ClientSession(headers={"Authorization": secret}) as proxy:
            async with proxy.get(gateway.http_url + "/json") as response:
                assert response.status == 200
            async with proxy.get(gateway.http_url + "/sse-hold") as stream:
                assert stream.status == 200
                assert (await stream.content.readline()).startswith(b"data")
                status, body = await api("dora", "PUT", f"/sessions/{session_id}/review", {"status": "REVOKED"})
                assert status == 200 and body["status"] == "REVOKED"
                with pytest.raises((aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError,
                                    aiohttp.ClientConnectionError, asyncio.TimeoutError)):
                    async with asyncio.timeout(5):
                        while True:
                            line = await stream.content.readline()
                            if not line:
                                raise aiohttp.ClientConnectionError("stream ended")
            async with proxy.get(gateway.http_url + "/json") as response:
                assert response.status == 401
        async with http.get(target + "/release") as response:  # let the target's held handler finish
            assert response.status == 200

        deadline = time.monotonic() + 10
        while True:
            status, session = await api("admin", "GET", f"/sessions/{session_id}?expand=event_stream")
            if session["status"] == "done" or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert session["status"] == "done"
        errors = [base64.b64decode(d).decode() for _, k, d in session["event_stream"] if k == "e"]
        assert any("just-in-time access revoked by dora@example.com" in e for e in errors), errors
