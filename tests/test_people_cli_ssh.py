"""The people's command line with SSH: ``gatewayd connect`` launches the real ssh through the gateway
to a real sshd, and ``gatewayd sessions replay`` plays that recording back in the terminal."""

from __future__ import annotations

import json

import aiohttp
import pytest

from tests.apiclient import SshApi
from tests.conftest import proxy_daemon
from tests.sshpeer import SshTarget, unavailable_reason
from tests.test_people_cli import Person

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")

SSH_OPTIONS = ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes",
               "-o", "LogLevel=ERROR"]


@pytest.fixture(scope="module")
def target():
    peer = SshTarget().start()
    yield peer
    peer.destroy()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    daemon = proxy_daemon(tmp_path_factory, "peoplessh", "ssh", wait=True)
    daemon.cli("user", "passwd", "--email", "ada@example.com", "--groups", "admin", "--password-stdin",
               input="ada's long passphrase\n")
    yield daemon
    assert daemon.stop() == 0


async def test_connect_runs_ssh_and_replay_plays_the_recording(gateway, target, tmp_path):
    async with aiohttp.ClientSession() as http:
        admin = SshApi(gateway, http, target, gateway.token("ada@example.com", groups="admin"))
        connection = await admin.role()
    ada = Person(gateway, tmp_path, "ada@example.com")
    ada.login_file.parent.mkdir(parents=True, exist_ok=True)
    done = ada.run("login", "--url", gateway.url.removesuffix("/api"), "--email", "ada@example.com",
                   "--password-stdin", input="ada's long passphrase\n")
    assert done.returncode == 0, done.stderr
    # options for ssh go before the destination, the remote command after it; its exit status comes back
    ran = ada.run("connect", connection["name"], "--", *SSH_OPTIONS,
                  "echo replayed-text-1; sleep 0.3; echo replayed-text-2; exit 7")
    assert ran.returncode == 7 and ran.stdout.splitlines() == ["replayed-text-1", "replayed-text-2"], ran

    sessions = json.loads(ada.run("sessions", "--connection", connection["name"], "--json").stdout)["data"]
    session_id = next(s["id"] for s in sessions if s["status"] == "done" and s["exit_code"] == 7)
    replay = ada.run("sessions", "replay", session_id, "--speed", "20")
    assert replay.returncode == 0, replay.stderr
    assert replay.stdout.replace("\r\n", "\n").splitlines()[-2:] == ["replayed-text-1", "replayed-text-2"]
    exported = ada.run("sessions", "export", session_id, "--format", "asciicast")
    header, *events = exported.stdout.splitlines()
    assert json.loads(header)["version"] == 2
    moments = [moment for moment, kind, text in map(json.loads, events) if kind == "o" and "replayed-text" in text]
    assert len(moments) == 2 and moments[1] > moments[0]  # the recording keeps the pause between them
