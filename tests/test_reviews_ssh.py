"""End to end: a jit review on an SSH connection, used by real OpenSSH ssh, closed by its revocation.

One sshd target (``tests/sshpeer.py``) and one ``gatewayd run`` with the ssh
listener serve the module; skipped when either the sshd peer or the SSH proxy
is not available here.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import subprocess
import time

import aiohttp
import pytest

from tests.apiclient import SshApi
from tests.conftest import Daemon, proxy_daemon
from tests.sshpeer import CLIENT_OPTIONS, SshTarget, unavailable_reason

_REASON = unavailable_reason() or (None if importlib.util.find_spec("proxies.ssh.server") else "no SSH proxy")
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


@pytest.fixture(scope="module")
def target():
    peer = SshTarget().start()
    yield peer
    peer.destroy()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    daemon = proxy_daemon(tmp_path_factory, "reviews-ssh", "ssh")
    daemon.ssh_port = daemon.proxy_port
    daemon.tokens = {"admin": daemon.token("ada@example.com", groups="admin"),
                     "rita": daemon.token("rita@example.com", groups="dev"),
                     "dora": daemon.token("dora@example.com", groups="dba")}
    yield daemon
    assert daemon.stop() == 0


@pytest.fixture(scope="module")
async def as_(gateway, target):
    async with aiohttp.ClientSession() as http:
        yield {who: SshApi(gateway, http, target, token) for who, token in gateway.tokens.items()}


def ssh_args(gateway: Daemon, secret: str, *command: str) -> list[str]:
    return ["ssh", *CLIENT_OPTIONS, "-p", str(gateway.ssh_port), f"{secret}@127.0.0.1", *command]


async def test_jit_on_ssh_with_real_ssh_and_revocation(as_, gateway, target):
    conn = await as_["admin"].role(reviewers=["dba"])
    assert conn["reviewers"] == ["dba"]
    status, body = await as_["rita"]("POST", f"/connections/{conn['name']}/credentials", {})
    assert status == 202 and body["has_review"] is True, body
    session_id, review_id = body["session_id"], body["review_id"]
    path = f"/connections/{conn['name']}/credentials/{session_id}"
    status, body = await as_["rita"]("POST", path)
    assert status == 202
    status, body = await as_["dora"]("PUT", f"/reviews/{review_id}", {"status": "APPROVED"})
    assert status == 200 and body["status"] == "APPROVED", body
    status, body = await as_["rita"]("POST", path)
    assert status == 201, body
    user_secret = body["connection_credentials"]["username"]

    result = subprocess.run(ssh_args(gateway, user_secret, "echo", "jit-ok"), capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0 and result.stdout.strip() == "jit-ok", result.stderr

    process = subprocess.Popen(ssh_args(gateway, user_secret, "echo started; sleep 30"), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "started"
        status, body = await as_["dora"]("PUT", f"/reviews/{review_id}", {"status": "REVOKED"})
        assert status == 200 and body["status"] == "REVOKED", body
        # no clock in the assertion: the gateway's exit code and reason prove the revocation ended it, not sleep
        await asyncio.to_thread(process.wait, 60)
    finally:
        if process.poll() is None:
            process.kill()
        _, stderr = process.communicate()
    assert process.returncode == 254, stderr
    assert "just-in-time access revoked by dora@example.com" in stderr

    status, page = await as_["admin"]("GET", f"/sessions?connection={conn['name']}&limit=100")
    ids = [s["id"] for s in page["data"]]
    assert len(ids) >= 1 and all(s["review"]["id"] == review_id for s in page["data"])
    reasons = []
    for sid in ids:
        deadline = time.monotonic() + 10
        while True:
            status, session = await as_["admin"]("GET", f"/sessions/{sid}?expand=event_stream")
            if session["status"] == "done" or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        reasons += [base64.b64decode(d).decode() for _, k, d in session["event_stream"] if k == "e"]
    assert any("just-in-time access revoked by dora@example.com" in r for r in reasons), reasons
    result = subprocess.run(ssh_args(gateway, user_secret, "true"), capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode != 0
    status, body = await as_["rita"]("POST", path)
    assert status == 410


async def test_reviewed_ssh_command_runs_after_approval(as_, gateway, target):
    conn = await as_["admin"].role(settings={"reviewers": ["dba"], "jit_review": False})
    status, body = await as_["rita"]("POST", "/sessions", {"connection": conn["name"],
                                                           "script": "echo reviewed-$((6 * 7)); exit 3"})
    assert status == 202 and body["review"]["status"] == "PENDING", body
    session_id, review_id = body["session_id"], body["review_id"]
    status, body = await as_["dora"]("PUT", f"/reviews/{review_id}", {"status": "APPROVED"})
    assert status == 200 and body["status"] == "APPROVED"
    status, body = await as_["rita"]("POST", f"/sessions/{session_id}/exec")
    assert status == 200, body
    assert "reviewed-42" in body["output"] and body["exit_code"] == 3 and body["output_status"] == "failed"
    status, session = await as_["rita"]("GET", f"/sessions/{session_id}")
    assert session["verb"] == "exec" and session["review"]["status"] == "EXECUTED"
    # jit_review false: native access needs no review on this connection
    status, body = await as_["rita"]("POST", f"/connections/{conn['name']}/credentials", {})
    assert status == 201 and body["has_review"] is False
