"""The people's command line with SSH: ``gatewayd connect`` launches the real ssh through the gateway
to a real sshd, and ``gatewayd sessions replay`` plays that recording back in the terminal."""

from __future__ import annotations

import json
import queue
import subprocess
import threading
import uuid
from pathlib import Path

import aiohttp
import pytest

from tests.apiclient import SshApi
from tests.conftest import proxy_daemon
from tests.sshpeer import SshTarget, unavailable_reason
from tests.test_people_cli import Person, client_processes

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

    session_id = (await ada.done_session(connection["name"], exit_code=7))["id"]
    replay = ada.run("sessions", "replay", session_id, "--speed", "20")
    assert replay.returncode == 0, replay.stderr
    assert replay.stdout.replace("\r\n", "\n").splitlines()[-2:] == ["replayed-text-1", "replayed-text-2"]
    exported = ada.run("sessions", "export", session_id, "--format", "asciicast")
    header, *events = exported.stdout.splitlines()
    assert json.loads(header)["version"] == 2
    moments = [moment for moment, kind, text in map(json.loads, events) if kind == "o" and "replayed-text" in text]
    assert len(moments) == 2 and moments[1] > moments[0]  # the recording keeps the pause between them


# ------------------------------------------------------------------ issue 34: live output, live sessions


class Lines:
    """A process's output pipe read line by line in a thread, so that a test waits for a line without blocking."""

    def __init__(self, pipe) -> None:
        self.queue: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, args=(pipe,), daemon=True).start()

    def _read(self, pipe) -> None:
        for line in pipe:
            self.queue.put(line)
        self.queue.put(None)

    def until(self, needle: str, guard: float = 60) -> str:
        """The lines up to one holding ``needle`` (``guard``: a hang guard, not a timing)."""
        while True:
            try:
                line = self.queue.get(timeout=guard)
            except queue.Empty:
                raise AssertionError(f"{needle!r} never came; so far: {''.join(self.seen)!r}") from None
            if line is None:
                raise AssertionError(f"the output ended before {needle!r}: {''.join(self.seen)!r}")
            self.seen.append(line)
            if needle in line:
                return "".join(self.seen)

    def rest(self) -> str:
        while (line := self.queue.get(timeout=60)) is not None:
            self.seen.append(line)
        return "".join(self.seen)


@pytest.fixture(scope="module")
def slow_flush(tmp_path_factory):
    """A gateway that stores recordings only once a minute unless someone watches, and answers an exec only after
    ten minutes: what a person sees of a running session comes from following it."""
    daemon = proxy_daemon(tmp_path_factory, "peoplelive", "ssh", {"sessions.flush_interval": "60s",
                                                                  "sessions.exec_wait": "600s"}, wait=True)
    daemon.cli("user", "passwd", "--email", "ada@example.com", "--groups", "admin", "--password-stdin",
               input="ada's long passphrase\n")
    yield daemon
    assert daemon.stop() == 0


def gate() -> Path:
    """A file the target's user can see (/tmp): a command waits for it to exist, the test makes it."""
    return Path("/tmp") / f"gatewayd-test-gate-{uuid.uuid4().hex}"


async def test_exec_prints_the_output_as_the_script_runs(slow_flush, target, tmp_path):
    """Issue 34, item 6: `exec` printed nothing until the script ended (here the API answers after 600 s)."""
    async with aiohttp.ClientSession() as http:
        connection = await SshApi(slow_flush, http, target, slow_flush.token("ada@example.com", groups="admin")).role()
    ada = Person(slow_flush, tmp_path, "ada@example.com")
    ada.login()
    go = gate()
    script = f"echo step-one; while [ ! -e {go} ]; do sleep 0.05; done; echo step-two; exit 3"
    running = ada.start("exec", connection["name"], "-c", script)
    try:
        out = Lines(running.stdout)
        assert out.until("step-one") == "step-one\n"  # printed while the script still waits for the gate
        assert running.poll() is None
        go.touch()
        assert out.rest() == "step-one\nstep-two\n"
        assert running.wait(60) == 3, running.stderr.read()
    finally:
        go.unlink(missing_ok=True)
        if running.poll() is None:
            running.kill()


async def test_replay_follow_shows_a_live_ssh_session_until_it_ends(slow_flush, target, tmp_path):
    """Issue 34, item 6 and "live sessions": `sessions replay --follow` shows a running session as it happens (the
    gateway stores this session's recording every 60 s unless someone watches it), and says when it ends."""
    async with aiohttp.ClientSession() as http:
        admin = SshApi(slow_flush, http, target, slow_flush.token("ada@example.com", groups="admin"))
        connection = await admin.role()
        status, body = await admin("POST", f"/connections/{connection['name']}/credentials",
                                   {"access_duration_seconds": 600})
        assert status == 201, body
    secret, session_id = body["connection_credentials"]["username"], body["session_id"]
    go = gate()
    held = subprocess.Popen(["ssh", *SSH_OPTIONS, "-p", str(slow_flush.proxy_port), f"{secret}@127.0.0.1",
                             f"echo live-one; while [ ! -e {go} ]; do sleep 0.05; done; echo live-two"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    ada = Person(slow_flush, tmp_path, "ada@example.com")
    ada.login()
    follower = None
    try:
        assert held.stdout.readline() == "live-one\n"
        follower = ada.start("sessions", "replay", "--follow", session_id[:8])  # a short id will do
        out = Lines(follower.stdout)
        out.until("live-one")
        assert held.poll() is None and follower.poll() is None  # the session runs, and is followed
        go.touch()
        assert "live-two" in out.rest()
        assert follower.wait(60) == 0
        err = follower.stderr.read()
        assert f"following session {session_id}" in err and "ended (exit 0)" in err, err
    finally:
        go.unlink(missing_ok=True)
        for process in (held, follower):
            if process is not None and process.poll() is None:
                process.kill()


async def test_connect_keeps_the_secret_out_of_the_process_list(gateway, target, tmp_path):
    """`connect` ran `ssh -p PORT SECRET@HOST`: for as long as the session lasted, any local user read the
    credential in `ps` and could open sessions with it. Now the user name is in a configuration file of its
    own, 0600 in a private folder, and that folder is gone once ssh ends."""
    async with aiohttp.ClientSession() as http:
        admin = SshApi(gateway, http, target, gateway.token("ada@example.com", groups="admin"))
        connection = await admin.role()
    ada = Person(gateway, tmp_path, "ada@example.com")
    ada.login()
    go = gate()
    running = ada.start("connect", connection["name"], "--", *SSH_OPTIONS,
                        f"echo in-session; while [ ! -e {go} ]; do sleep 0.05; done; echo done-here")
    try:
        out = Lines(running.stdout)
        out.until("in-session")  # ssh runs, logged in through the gateway
        [ssh] = client_processes(running.pid).values()
        assert ssh[0] == "ssh" and not [arg for arg in ssh if "ssh-" in arg], ssh  # no secret (ssh-<random>)
        config = Path(ssh[ssh.index("-F") + 1])
        assert config.stat().st_mode & 0o777 == 0o600 and config.parent.stat().st_mode & 0o777 == 0o700
        go.touch()
        assert "done-here" in out.rest()
        assert running.wait(60) == 0, running.stderr.read()
        assert not config.parent.exists()
    finally:
        go.unlink(missing_ok=True)
        if running.poll() is None:
            running.kill()


async def test_replay_and_show_keep_colours_and_drop_what_would_command_the_readers_terminal(gateway, target,
                                                                                            tmp_path):
    """A session's output was replayed to the auditor's terminal byte for byte: a user (or the target) printing
    OSC 52 set the auditor's clipboard, and a title the window's. Now `replay` and `sessions show` drop the
    terminal's string commands (OSC, DCS, APC...) and keep its colours and cursor moves."""
    async with aiohttp.ClientSession() as http:
        admin = SshApi(gateway, http, target, gateway.token("ada@example.com", groups="admin"))
        connection = await admin.role()
    ada = Person(gateway, tmp_path, "ada@example.com")
    ada.login()
    planted = r"printf 'seen\033]52;c;cm0gLXJmIH4K\007\033]0;owned\033\\\033[31mred\033[0m\n'"
    ran = ada.run("connect", connection["name"], "--", *SSH_OPTIONS, planted)
    assert ran.returncode == 0 and "\x1b]52;" in ran.stdout, ran  # the session itself is the user's own terminal
    session_id = (await ada.done_session(connection["name"], exit_code=0))["id"]
    for words in (("sessions", "replay", session_id, "--speed", "20"), ("sessions", "show", session_id[:8])):
        shown = ada.run(*words)
        assert shown.returncode == 0 and "seen" in shown.stdout and "\x1b[31mred\x1b[0m" in shown.stdout, shown
        assert "\x1b]" not in shown.stdout and "owned" not in shown.stdout and "cm0g" not in shown.stdout, shown
