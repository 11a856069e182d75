"""End to end: OpenSSH ssh, scp and sftp through the SSH proxy of a real gatewayd to a real sshd.

One sshd (key and password logins for a dedicated user) and one ``gatewayd
run`` subprocess with the ssh listener serve the whole module; each test
makes its own connection (role) so guard rails and settings never leak
between tests.
"""

from __future__ import annotations

import asyncio
import base64
import fcntl
import hashlib
import json
import os
import pty
import select
import signal
import socket
import struct
import subprocess
import termios
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import Daemon, free_port
from tests.sshpeer import CLIENT_OPTIONS, SshTarget, unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def target():
    peer = SshTarget().start()
    yield peer
    peer.destroy()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    daemon = Daemon(tmp_path_factory.mktemp("sshproxy") / "data", {
        "listeners.ssh": f"127.0.0.1:{free_port()}",
        "sessions.flush_interval": "100ms",
    }).start()
    daemon.ssh_port = int(daemon.settings["listeners.ssh"].rsplit(":", 1)[1])
    yield daemon
    assert daemon.stop() == 0


class Api:
    """The control API as an admin, plus helpers to make ssh roles and credentials."""

    def __init__(self, daemon: Daemon, target: SshTarget, http: aiohttp.ClientSession) -> None:
        self.daemon = daemon
        self.target = target
        self.http = http

    async def __call__(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        async with self.http.request(method, self.daemon.url + path, json=body) as response:
            text = await response.text()
            try:
                return response.status, json.loads(text) if text else None
            except ValueError:
                return response.status, text

    async def role(self, *, password: bool = False, key: str | None = None, port: int | None = None,
                   host_key: str | None = None, settings: dict | None = None) -> dict:
        """A new ssh connection to the target (key login unless ``password``), with a unique name."""
        secret = {"envvar:HOST": b64("127.0.0.1"), "envvar:PORT": b64(str(port or self.target.port)),
                  "envvar:USER": b64(self.target.user)}
        if password:
            secret["envvar:PASS"] = b64(self.target.password)
        else:
            secret["envvar:PRIVATE_KEY"] = b64(key or self.target.private_key_text)
        if host_key is not None:
            secret["envvar:HOST_KEY"] = b64(host_key)
        name = f"ssh-{uuid.uuid4().hex[:8]}"
        status, body = await self("POST", "/connections", {"name": name, "type": "custom", "subtype": "ssh",
                                                          "secret": secret, "settings": settings or {}})
        assert status == 201, body
        return body

    async def credential(self, connection: dict, seconds: int = 600) -> tuple[str, str]:
        """(secret, session id) of a fresh credential."""
        status, body = await self("POST", f"/connections/{connection['name']}/credentials",
                                  {"access_duration_seconds": seconds})
        assert status == 201, body
        return body["connection_credentials"]["username"], body["session_id"]

    async def guardrail(self, connection: dict, input_rules: list | None = None, output_rules: list | None = None):
        status, body = await self("POST", "/guardrails", {
            "name": f"rail-{uuid.uuid4().hex[:8]}", "connection_ids": [connection["id"]],
            "input": {"rules": input_rules or []}, "output": {"rules": output_rules or []}})
        assert status == 201, body
        return body

    async def done_session(self, session_id: str, timeout: float = 20) -> dict:
        """The session once it is ``done``, with its event stream."""
        deadline = time.monotonic() + timeout
        while True:
            status, body = await self("GET", f"/sessions/{session_id}?expand=event_stream")
            assert status == 200, body
            if body["status"] == "done":
                return body
            if time.monotonic() > deadline:
                raise AssertionError(f"session {session_id} is still {body['status']}")
            await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
async def api(gateway, target):
    token = gateway.token("admin@example.com", groups="admin", name="Ada Admin")
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as http:
        yield Api(gateway, target, http)


def events(session: dict) -> list[tuple[str, str]]:
    return [(kind, base64.b64decode(data).decode("utf-8", "replace")) for _, kind, data in session["event_stream"]]


def of_kind(session: dict, kind: str) -> list[str]:
    return [text for k, text in events(session) if k == kind]


def ssh_args(gateway: Daemon, secret: str, *args: str, user: str | None = None, batch: bool = True) -> list[str]:
    options = CLIENT_OPTIONS if batch else CLIENT_OPTIONS[2:]  # without BatchMode=yes: password prompts allowed
    return ["ssh", *options, "-p", str(gateway.ssh_port), f"{user or secret}@127.0.0.1", *args]


def ssh(gateway: Daemon, secret: str, *args: str, stdin: bytes | None = None,
        timeout: float = 60) -> subprocess.CompletedProcess[bytes]:
    """OpenSSH ``ssh`` through the gateway, the secret as user name (no prompt)."""
    return subprocess.run(ssh_args(gateway, secret, *args), input=stdin, capture_output=True, timeout=timeout,
                          stdin=None if stdin is not None else subprocess.DEVNULL)


def on_target(target: SshTarget, command: str) -> str:
    result = target.ssh(command)
    assert result.returncode == 0, result.stderr
    return result.stdout.decode()


# --------------------------------------------------------------------------- exec


async def test_exec_output_stderr_exit_code_and_recording(gateway, api, target):
    role = await api.role()
    secret, session_id = await api.credential(role)
    result = ssh(gateway, secret, "echo out-$((40+2)); echo err-line >&2; exit 7")
    assert result.returncode == 7, result.stderr
    assert result.stdout == b"out-42\n"
    assert result.stderr == b"err-line\n"
    session = await api.done_session(session_id)
    assert session["exit_code"] == 7 and session["type"] == "custom" and session["connection_subtype"] == "ssh"
    assert events(session) == [("i", "echo out-$((40+2)); echo err-line >&2; exit 7"), ("o", "out-42\n"),
                               ("e", "err-line\n")]

    # stdin goes through and is recorded as input; exit 0
    secret, session_id = await api.credential(role)
    result = ssh(gateway, secret, "tr a-z A-Z", stdin=b"hello through the gateway\n")
    assert result.returncode == 0 and result.stdout == b"HELLO THROUGH THE GATEWAY\n"
    session = await api.done_session(session_id)
    assert session["exit_code"] == 0
    assert "".join(of_kind(session, "i")) == "tr a-z A-Zhello through the gateway\n"
    assert "".join(of_kind(session, "o")) == "HELLO THROUGH THE GATEWAY\n"


async def test_exit_signal_is_propagated(gateway, api, target):
    role = await api.role()
    direct = target.ssh("kill -TERM $$")
    secret, session_id = await api.credential(role)
    result = ssh(gateway, secret, "kill -TERM $$")
    assert result.returncode == direct.returncode == 255
    assert b"signal" not in direct.stderr or b"signal" in result.stderr
    session = await api.done_session(session_id)
    assert session["exit_code"] == 128 + signal.SIGTERM


async def test_password_login_environment_and_password_role(gateway, api, target, tmp_path):
    """Any user name with the secret as password; the role logs in to the target with PASS; env requests."""
    role = await api.role(password=True)
    secret, session_id = await api.credential(role)
    askpass = tmp_path / "askpass.sh"
    askpass.write_text(f"#!/bin/sh\necho '{secret}'\n")
    askpass.chmod(0o700)
    env = {**os.environ, "SSH_ASKPASS": str(askpass), "SSH_ASKPASS_REQUIRE": "force", "DISPLAY": ":0",
           "GATEWAYD_GREETING": "hello env"}
    args = ssh_args(gateway, secret, "echo \"$USER:$GATEWAYD_GREETING\"", user="anybody", batch=False)
    result = subprocess.run(["setsid", *args[:1], "-o", "SendEnv=GATEWAYD_GREETING", "-o",
                             "PubkeyAuthentication=no", *args[1:]], capture_output=True, env=env,
                            stdin=subprocess.DEVNULL, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{target.user}:hello env\n".encode()
    session = await api.done_session(session_id)
    assert session["exit_code"] == 0

    # a wrong password is refused like any wrong password
    askpass.write_text("#!/bin/sh\necho 'ssh-not-a-valid-secret'\n")
    result = subprocess.run(["setsid", *args[:1], "-o", "PubkeyAuthentication=no", "-o", "NumberOfPasswordPrompts=1",
                             *args[1:]], capture_output=True, env=env, stdin=subprocess.DEVNULL, timeout=60)
    assert result.returncode == 255 and b"Permission denied" in result.stderr
