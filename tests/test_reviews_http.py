"""End to end: a jit review on an HTTP proxy connection; revoking it cuts a live stream and refuses the secret.

One aiohttp target app (``tests/httppeer.py``) and one ``gatewayd run`` with the
http listener serve the module; skipped when the HTTP proxy is not present.
"""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys

import aiohttp
import pytest

from tests.apiclient import Api, of_kind
from tests.conftest import ROOT, free_port, proxy_daemon, wait_port

pytestmark = pytest.mark.skipif(importlib.util.find_spec("proxies.http.server") is None, reason="no HTTP proxy")


@pytest.fixture(scope="module")
def target():
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "tests.httppeer", str(port)], cwd=ROOT)
    try:
        wait_port(port, process, "the target app")
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
    daemon = proxy_daemon(tmp_path_factory, "reviews-http", "http", wait=True)
    daemon.http_url = f"http://127.0.0.1:{daemon.proxy_port}"
    daemon.tokens = {"admin": daemon.token("ada@example.com", groups="admin"),
                     "rita": daemon.token("rita@example.com", groups="dev"),
                     "dora": daemon.token("dora@example.com", groups="dba")}
    yield daemon
    assert daemon.stop() == 0


async def test_jit_on_http_revocation_cuts_the_live_stream(gateway, target):
    async with aiohttp.ClientSession() as http:
        as_ = {who: Api(gateway, http, token) for who, token in gateway.tokens.items()}
        conn = await as_["admin"].connection("web", "httpproxy", "httpproxy", {"REMOTE_URL": target},
                                             {"reviewers": ["dba"]})
        status, body = await as_["rita"]("POST", f"/connections/{conn['name']}/credentials", {})
        assert status == 202, body
        session_id, review_id = body["session_id"], body["review_id"]
        status, body = await as_["dora"]("PUT", f"/reviews/{review_id}", {"status": "APPROVED"})
        assert status == 200 and body["status"] == "APPROVED"
        status, body = await as_["rita"]("POST", f"/connections/{conn['name']}/credentials/{session_id}")
        assert status == 201, body
        secret = body["connection_credentials"]["proxy_token"]

        async with aiohttp.ClientSession(headers={"Authorization": secret}) as proxy:
            async with proxy.get(gateway.http_url + "/json") as response:
                assert response.status == 200
            async with proxy.get(gateway.http_url + "/sse-hold") as stream:
                assert stream.status == 200
                assert (await stream.content.readline()).startswith(b"data")
                status, body = await as_["dora"]("PUT", f"/sessions/{session_id}/review", {"status": "REVOKED"})
                assert status == 200 and body["status"] == "REVOKED"
                # cut (or ended) within the timeout: a stream still held after it fails the test
                with pytest.raises((aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError,
                                    aiohttp.ClientConnectionError)):
                    async with asyncio.timeout(10):
                        while True:
                            line = await stream.content.readline()
                            if not line:
                                raise aiohttp.ClientConnectionError("stream ended")
            async with proxy.get(gateway.http_url + "/json") as response:
                assert response.status == 401
        async with http.get(target + "/release") as response:  # let the target's held handler finish
            assert response.status == 200

        session = await as_["admin"].done_session(session_id, 10)
        assert session["status"] == "done"
        errors = of_kind(session, "e")
        assert any("just-in-time access revoked by dora@example.com" in e for e in errors), errors
