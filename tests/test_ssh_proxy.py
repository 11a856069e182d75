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
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests import clients
from tests.apiclient import SshApi, admin_http, b64, events, of_kind
from tests.conftest import Daemon, free_port, proxy_daemon
from tests.sshpeer import CLIENT_OPTIONS, SshTarget, group_alive, unavailable_reason, until_gone

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def target():
    peer = SshTarget().start()
    yield peer
    peer.destroy()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    # CBC last: only a client that asks for it gets it (the SSH_MSG_IGNORE test); every other test gets GCM
    daemon = proxy_daemon(tmp_path_factory, "sshproxy", "ssh", settings={"ssh.ciphers": [
        "aes128-gcm@openssh.com", "aes256-gcm@openssh.com", "aes128-cbc"]})
    daemon.ssh_port = daemon.proxy_port
    yield daemon
    assert daemon.stop() == 0


@pytest.fixture(scope="module")
async def api(gateway, target):
    async with admin_http(gateway) as http:
        yield SshApi(gateway, http, target)


def ssh_args(gateway: Daemon, secret: str, *args: str, user: str | None = None, batch: bool = True) -> list[str]:
    options = CLIENT_OPTIONS if batch else CLIENT_OPTIONS[2:]  # without BatchMode=yes: password prompts allowed
    return ["ssh", *options, "-p", str(gateway.ssh_port), f"{user or secret}@127.0.0.1", *args]


def ssh(gateway: Daemon, secret: str, *args: str, stdin: bytes | None = None,
        timeout: float = 60) -> subprocess.CompletedProcess[bytes]:
    """OpenSSH ``ssh`` through the gateway, the secret as user name (no prompt)."""
    return clients.ssh(gateway.ssh_port, secret, *args, stdin=stdin, timeout=timeout)


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


async def test_testing_the_connection_logs_in_to_the_target_as_a_session_would(gateway, api):
    """``GET /connections/{name}/test`` dials with the script runner's ``dial`` and releases it with its ``stop``."""
    role = await api.role()
    assert await api("GET", f"/connections/{role['name']}/test") == (200, {"success": True, "message": ""})
    down = await api.role(port=free_port())
    status, answer = await api("GET", f"/connections/{down['name']}/test")
    assert status == 200 and answer == {
        "success": False, "message": f'could not connect to the target of connection "{down["name"]}": connection refused'}


async def test_the_private_key_is_never_shown_and_a_connection_sent_back_as_read_keeps_it(gateway, api, target):
    """Issue 31, item 10: POST /connections echoed the private key. The answer withholds it; the console's edit
    (GET, then PUT what it read) keeps the stored key, and sshd still takes it."""
    role = await api.role()
    status, read = await api("GET", f"/connections/{role['name']}")
    for answer in (role, read):
        assert answer["secret"]["envvar:PRIVATE_KEY"] == "[REDACTED]", answer["secret"]
        assert "PRIVATE KEY" not in json.dumps(answer) and b64(target.private_key_text) not in json.dumps(answer)
    status, updated = await api("PUT", f"/connections/{role['name']}", {
        **{key: read[key] for key in ("name", "type", "subtype", "secret")}, "tags": {"edited": "yes"}})
    assert status == 200 and updated["tags"] == {"edited": "yes"}, updated
    secret, _ = await api.credential(role)
    result = ssh(gateway, secret, "echo still-the-key")
    assert result.returncode == 0 and result.stdout == b"still-the-key\n", result.stderr


async def test_exit_signal_is_propagated(gateway, api, target):
    role = await api.role()
    direct = target.ssh("kill -TERM $$")
    secret, session_id = await api.credential(role)
    result = ssh(gateway, secret, "kill -TERM $$")
    assert result.returncode == direct.returncode == 255
    assert b"signal" not in direct.stderr or b"signal" in result.stderr
    session = await api.done_session(session_id)
    assert session["exit_code"] == 128 + signal.SIGTERM


async def test_signal_requests_and_eof_reach_the_target(gateway, api):
    """OpenSSH's client sends no ``signal`` requests; asyncssh's does: TERM ends the remote command."""
    import asyncssh

    role = await api.role()
    secret, session_id = await api.credential(role)
    async with asyncssh.connect("127.0.0.1", gateway.ssh_port, username=secret, known_hosts=None,
                                agent_path=None, client_keys=[]) as conn:
        process = await conn.create_process("echo started; exec sleep 60")
        assert await asyncio.wait_for(process.stdout.readline(), 20) == "started\n"
        process.send_signal("TERM")
        result = await asyncio.wait_for(process.wait(), 20)
        assert result.exit_signal is not None and result.exit_signal[0] == "TERM"

        process = await conn.create_process("wc -c")
        process.stdin.write("twelve bytes")
        process.stdin.write_eof()
        result = await asyncio.wait_for(process.wait(), 20)
        assert result.exit_status == 0 and result.stdout.strip() == "12"
    session = await api.done_session(session_id)
    assert session["exit_code"] == 0  # the last channel's


async def test_password_login_environment_and_password_role(gateway, api, target, tmp_path):
    """Any user name with the secret as password; the role logs in to the target with PASS (its host key pinned:
    the password goes to no other, issue 31); env requests."""
    refused = await api.role(password=True)
    secret, session_id = await api.credential(refused)
    result = ssh(gateway, secret, "true")
    assert result.returncode == 254 and b"its password is sent only to a target whose key is pinned (HOST_KEY), or " \
        b"where the connection allows it (ALLOW_UNVERIFIED_PASSWORD)" in result.stderr, result.stderr
    relaxed = await api.role(password=True, env_more={"ALLOW_UNVERIFIED_PASSWORD": "true"})
    secret, session_id = await api.credential(relaxed)
    assert ssh(gateway, secret, "true").returncode == 0
    role = await api.role(password=True, host_key=target.host_public_key)
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


# --------------------------------------------------------------------------- interactive shell with a pty


class Terminal:
    """OpenSSH ``ssh -tt`` in a real pseudo-terminal: keystrokes in, screen text out, resizable."""

    def __init__(self, command: list[str], rows: int = 30, cols: int = 100) -> None:
        self.master, slave = pty.openpty()
        self.resize(rows, cols)
        env = {**os.environ, "TERM": "xterm-256color"}
        self.process = subprocess.Popen(command, stdin=slave, stdout=slave, stderr=slave, env=env,
                                        start_new_session=True, preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
        os.close(slave)
        self.screen = b""
        self.position = 0

    def resize(self, rows: int, cols: int) -> None:
        fcntl.ioctl(self.master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        if hasattr(self, "process"):
            self.process.send_signal(signal.SIGWINCH)

    def at_prompt(self) -> None:
        """Wait for bash's prompt (``gw> ``): readline reads the keys from then on, not the terminal's canonical
        mode."""
        self.type("PS1='gw> '; echo ready-$((1+1))\r")
        self.expect("ready-2")
        self.expect("gw> ")

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    def expect(self, needle: str, timeout: float = 20) -> str:
        """Read until ``needle`` shows up on the screen; everything since the last expect."""
        deadline = time.monotonic() + timeout
        start = self.position
        while needle.encode() not in self.screen[start:]:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"{needle!r} never showed up; screen: {self.screen[start:]!r}")
            ready, _, _ = select.select([self.master], [], [], remaining)
            if ready:
                try:
                    chunk = os.read(self.master, 65536)
                except OSError:
                    chunk = b""
                if not chunk:
                    raise AssertionError(f"terminal closed before {needle!r}; screen: {self.screen[start:]!r}")
                self.screen += chunk
        found = self.screen.index(needle.encode(), start) + len(needle)
        self.position = found
        return self.screen[start:found].decode("utf-8", "replace")

    def wait(self, timeout: float = 20) -> int:
        deadline = time.monotonic() + timeout
        while self.process.poll() is None and time.monotonic() < deadline:
            ready, _, _ = select.select([self.master], [], [], 0.1)
            if ready:
                try:
                    self.screen += os.read(self.master, 65536)
                except OSError:
                    pass
        code = self.process.wait(1)
        os.close(self.master)
        return code


async def test_environment_requests_are_recorded_and_read_by_the_input_rules(gateway, api, target):
    """``SetEnv``/``SendEnv`` variables pass on, recorded as an ``i`` line (names, values but secret-looking names'
    and gateway credentials, masked) and read by the input rules: one they block refuses the channel, as a blocked
    command does (they were passed on unrecorded and unread: ``ssh -o SetEnv='X=touch /f' host 'eval "$X"'``)."""
    role = await api.role()
    await api.guardrail(role, input_rules=[{"type": "deny_words_list", "words": ["touch"]}],
                        output_rules=[{"type": "mask", "patterns": ["email"]}])
    secret, session_id = await api.credential(role)

    def with_env(variables: str, command: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(["ssh", *CLIENT_OPTIONS, "-o", f"SetEnv={variables}", "-p", str(gateway.ssh_port),
                               f"{secret}@127.0.0.1", command], capture_output=True, stdin=subprocess.DEVNULL, timeout=60)

    result = with_env(f"GATEWAYD_GREETING=hello GATEWAYD_TOKEN=t0k LC_MAIL=jane.doe@example.com LC_NOTE={secret}",
                      'echo "$GATEWAYD_GREETING $GATEWAYD_TOKEN ${#LC_NOTE}"')
    assert (result.returncode, result.stdout) == (0, b"hello t0k 47\n"), result.stderr
    session = await api.done_session(session_id)
    assert of_kind(session, "i")[0] == \
        "env GATEWAYD_GREETING=hello GATEWAYD_TOKEN=[REDACTED] LC_MAIL=**** LC_NOTE=[REDACTED]"
    assert secret not in json.dumps(events(session)) and "jane.doe" not in json.dumps(events(session))

    marker = f"/tmp/gatewayd-never-{uuid.uuid4().hex[:8]}"
    secret, session_id = await api.credential(role)
    result = with_env(f'"LC_RUN=touch {marker}"', 'eval "$LC_RUN"')
    message = "validation error, match guard rails input rule, type=deny_words_list, words=[touch]"
    assert (result.returncode, result.stderr.decode().strip()) == (254, message)
    assert "No such file" in target.ssh(f"ls {marker}").stderr.decode()
    session = await api.done_session(session_id)
    assert events(session) == [("i", f"env 'LC_RUN=touch {marker}'"), ("e", message)]


async def test_pty_shell_terminal_resize_signals_and_input_rules(gateway, api, target, tmp_path):
    role = await api.role()
    await api.guardrail(role, input_rules=[{"type": "deny_words_list", "words": ["touch"]}])
    secret, session_id = await api.credential(role)
    marker = f"/tmp/gatewayd-blocked-{uuid.uuid4().hex[:8]}"
    term = Terminal(ssh_args(gateway, secret, "-tt"), rows=30, cols=100)
    term.type("PS1='gw$ '; echo TERM=$TERM; stty size\r")
    screen = term.expect("30 100")
    assert "TERM=xterm-256color" in screen

    # a window-size change reaches the target's pty
    term.resize(40, 120)
    for attempt in range(40):  # the window change travels on its own: ask until the pty has it
        term.type("stty size\r")
        try:
            term.expect("40 120", timeout=0.5)
            break
        except AssertionError:
            if attempt == 39:
                raise

    # ^C interrupts the remote foreground program (through the pty), the shell goes on
    term.type("sleep 600; echo not-interrupted\r")
    time.sleep(0.5)
    term.type("\x03")
    term.type("echo after-$((20+1))\r")
    screen = term.expect("after-21")
    assert "\nnot-interrupted" not in screen

    # a typed line the input rules block is not run; the user sees why
    term.type(f"touch {marker}\r")
    screen = term.expect("words=[touch]")
    assert "validation error, match guard rails input rule" in screen
    term.type("echo still-$((1+1))\r")
    term.expect("still-2")

    # backspace editing is applied to the checked line: "tooch" corrected into "touch" is caught too
    term.type(f"tooch\x7f\x7f\x7fuch {marker}\r")
    term.expect("words=[touch]")
    term.type("exit 3\r")
    assert term.wait() == 3
    assert not Path(marker).exists() and "No such file" in target.ssh(f"ls {marker}").stderr.decode()

    session = await api.done_session(session_id)
    assert session["exit_code"] == 3
    assert session["metrics"]["terminal"] == {"type": "xterm-256color", "width": 100, "height": 30}
    output = "".join(of_kind(session, "o"))
    assert "after-21" in output and "still-2" in output
    typed = "".join(of_kind(session, "i"))
    assert "stty size\r" in typed and f"touch {marker}\r" in typed
    assert of_kind(session, "e").count(
        "validation error, match guard rails input rule, type=deny_words_list, words=[touch]") == 2
    status, logs = await api("GET", "/audit/logs?action=guardrail.block")
    assert status == 200 and any(entry["request_payload_redacted"].get("session_id") == session_id
                                 for entry in logs["data"])

    # the asciicast export replays the terminal
    status, text = await api("GET", f"/sessions/{session_id}?event_stream=asciicast")
    assert status == 200, text
    lines = text.splitlines()
    header = json.loads(lines[0])
    assert header["version"] == 2 and header["width"] == 100 and header["height"] == 30
    assert header["env"]["TERM"] == "xterm-256color"
    frames = [json.loads(line) for line in lines[1:]]
    assert all(isinstance(t, float) and kind in ("o", "i") for t, kind, _ in frames)
    assert [t for t, _, _ in frames] == sorted(t for t, _, _ in frames)
    replay = "".join(data for _, kind, data in frames if kind == "o")
    assert "after-21" in replay and "words=[touch]" in replay
    assert "".join(data for _, kind, data in frames if kind == "i") == typed
    player = Path(sys.executable).parent / "asciinema"  # the test extra installs asciinema 2.x
    if player.exists():
        cast = tmp_path / "session.cast"
        cast.write_text(text)
        played = subprocess.run([str(player), "play", "-s", "1000", "-i", "0.01", str(cast)],
                                stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
        assert played.returncode == 0, played.stderr
        assert played.stdout.decode() == replay


async def test_rules_attached_while_a_shell_is_open_apply_to_its_next_line_and_output(gateway, api, target):
    """A guard rail or mask rule attached to the connection is in force once the API answers, in the channels
    already open too (a shell or exec opened without rules went on reading nothing: its lines ran, its output
    went out clear)."""
    role = await api.role()
    secret, session_id = await api.credential(role)
    marker = f"/tmp/gatewayd-never-{uuid.uuid4().hex[:8]}"
    term = Terminal(ssh_args(gateway, secret, "-tt"))
    term.at_prompt()
    await api.guardrail(role, input_rules=[{"type": "deny_words_list", "words": ["touch"]}],
                        output_rules=[{"type": "mask", "patterns": ["card_number"]}])
    term.type(f"touch {marker}\r")
    term.expect("words=[touch]")
    term.type("printf '%s%s\\n' 41111111 11111111; echo done-$((1+1))\r")
    screen = term.expect("done-2")
    term.type("exit 3\r")
    assert term.wait() == 3
    assert "****" in screen and "4111111111111111" not in term.screen.decode(errors="replace")
    assert "No such file" in target.ssh(f"ls {marker}").stderr.decode()
    session = await api.done_session(session_id)
    assert "4111111111111111" not in json.dumps(events(session))


async def touch_refused_shell(gateway: Daemon, api: Any) -> tuple[dict, str, str, Terminal]:
    """A connection whose rules refuse ``touch``, a shell through it at its prompt: (role, session id, a path
    ``touch`` must never make, the terminal)."""
    role = await api.role()
    await api.guardrail(role, input_rules=[{"type": "deny_words_list", "words": ["touch"]}])
    secret, session_id = await api.credential(role)
    term = Terminal(ssh_args(gateway, secret, "-tt"))
    term.at_prompt()
    return role, session_id, f"/tmp/gatewayd-never-{uuid.uuid4().hex[:8]}", term


async def test_a_guarded_line_edited_at_a_moved_cursor_or_continued_is_read_as_bash_runs_it(gateway, api, target):
    """``ouch x``, Home, ``t``; a ``^V``-quoted ``^U``; ``tou\\`` then ``ch x``: bash runs ``touch``, the rules read
    it (they read ``ouch xt``, an empty line and ``ch x``, and the lines ran); a refused line leaves nothing behind
    on the target's line, so the next command runs as typed."""
    role, session_id, marker, term = await touch_refused_shell(gateway, api)
    for number, keys in enumerate((f"ouch {marker}\x1b[Ht\r", f"touch {marker}; \x16\x15\r", f"tou\\\rch {marker}\r")):
        for key in keys:  # one key per packet, as typed
            term.type(key)
            time.sleep(0.005)
        term.expect("words=[touch]")
        term.type(f"echo after-$(({number}+10))\r")
        term.expect(f"after-{number + 10}\r\n")
    term.type("exit 3\r")
    assert term.wait() == 3
    assert "No such file" in target.ssh(f"ls {marker}*").stderr.decode()
    session = await api.done_session(session_id)
    assert len(of_kind(session, "e")) == 3

    # without a pty too: the refused line's newline ends what the shell was continuing (``tou`` alone runs)
    secret, session_id = await api.credential(role)
    result = ssh(gateway, secret, "-T", stdin=f"echo first\ntou\\\nch {marker}\necho second\n".encode())
    assert result.stdout == b"first\nsecond\n" and b"words=[touch]" in result.stderr, result.stderr
    assert "No such file" in target.ssh(f"ls {marker}*").stderr.decode()


async def test_a_deny_word_spelled_as_bash_reads_it_is_refused_in_a_shell_line_and_an_exec(gateway, api, target):
    """Quotes, a backslash, ``$'...'`` and ``$IFS`` spell ``touch`` for bash and not as typed: the rules read the
    line as bash reads its words too (each of these ran ``touch`` through the gateway); the recording and the audit
    entry keep what was typed, and ordinary quoting passes."""
    role, session_id, marker, term = await touch_refused_shell(gateway, api)
    message = "validation error, match guard rails input rule, type=deny_words_list, words=[touch]"
    spellings = [f"bash -c $'tou\\x63h {marker}'", f"'to''uch' {marker}", f'to"uch" {marker}', f"tou\\ch {marker}",
                 f"$'\\x74ouch' {marker}", f"touch {marker}"]
    for number, line in enumerate(spellings):  # typed into a shell with a pty
        term.type(line + "\r")
        term.expect("words=[touch]")
        term.type(f"echo after-$(({number}+10))\r")
        term.expect(f"after-{number + 10}\r\n")
    term.type("exit 3\r")
    assert term.wait() == 3
    session = await api.done_session(session_id)
    assert of_kind(session, "e") == [message] * len(spellings)
    for line in spellings:  # as the command of an exec
        secret, session_id = await api.credential(role)
        result = ssh(gateway, secret, line)
        assert (result.returncode, result.stderr.decode().strip()) == (254, message), line
        session = await api.done_session(session_id)
        assert events(session) == [("i", line), ("e", message)]
    status, logs = await api("GET", "/audit/logs?action=guardrail.block")
    assert status == 200 and [e["request_payload_redacted"]["input"] for e in logs["data"]
                              if e["request_payload_redacted"].get("session_id") == session_id] == [spellings[-1]]

    # $IFS read as a space, for a rule on two words: in an exec and in a shell without a pty
    name = f"gatewayd-never-{uuid.uuid4().hex[:8]}"
    spaced = await api.role()
    await api.guardrail(spaced, input_rules=[{"type": "deny_words_list", "words": [f"touch {name}"]}])
    ifs = [f"touch${{IFS}}{name}", f"touch$IFS'{name}'", f"touch${{IFS:0:1}}{name}"]
    for line in ifs:
        secret, _ = await api.credential(spaced)
        result = ssh(gateway, secret, line)
        assert result.returncode == 254 and f"words=[touch {name}]" in result.stderr.decode(), line
    secret, _ = await api.credential(spaced)
    result = ssh(gateway, secret, "-T", stdin=("\n".join(["echo first", *ifs, "echo second"]) + "\n").encode())
    assert result.stdout == b"first\nsecond\n" and result.stderr.decode().count(f"words=[touch {name}]") == 3
    assert "No such file" in target.ssh(f"ls {marker} {name}").stderr.decode()

    # what bash reads as no deny word passes
    on_target(target, 'mkdir -p "my dir"')
    secret, _ = await api.credential(role)
    result = ssh(gateway, secret, "ls -la \"my dir\" && echo 'it''s'")
    assert result.returncode == 0 and result.stdout.endswith(b"\nits\n"), result.stderr


async def test_a_refused_line_of_a_bracketed_paste_never_runs(gateway, api, target):
    """bash asks the terminal to bracket what is pasted; inside, ^U is text: the refused line stayed in the buffer
    (with ^U at its end) and ran with the paste at the next Enter. Now the paste is ended, the buffer erased and the
    paste begun again: what was pasted before the refused line never runs, what comes after runs at the Enter."""
    role, session_id, marker, term = await touch_refused_shell(gateway, api)
    term.type(f"\x1b[200~echo before-$((1+1))\rtouch {marker}\recho after-$((2+3))\r\x1b[201~")
    term.expect("words=[touch]")
    term.type("\r")
    screen = term.expect("after-5\r\n")
    term.type("exit 3\r")
    assert term.wait() == 3
    assert "before-2" not in screen and "No such file" in target.ssh(f"ls {marker}*").stderr.decode()


async def test_shell_without_pty_blocks_lines_before_they_reach_the_target(gateway, api, target):
    role = await api.role()
    await api.guardrail(role, input_rules=[{"type": "pattern_match", "pattern_regex": r"rm\s+-rf"}])
    secret, session_id = await api.credential(role)
    marker = f"/tmp/gatewayd-kept-{uuid.uuid4().hex[:8]}"
    on_target(target, f"touch {marker}")
    script = f"echo first\nrm -rf {marker}\necho second\nexit 4\n".encode()
    result = ssh(gateway, secret, "-T", stdin=script)
    assert result.returncode == 4
    assert result.stdout == b"first\nsecond\n"
    assert b"validation error, match guard rails input rule, type=pattern_match" in result.stderr
    assert on_target(target, f"ls {marker}").strip() == marker
    session = await api.done_session(session_id)
    assert session["exit_code"] == 4
    status, body = await api("GET", f"/sessions/{session_id}?event_stream=asciicast")
    assert status == 200 and json.loads(body.splitlines()[0])["width"] == 80  # no pty: the default size

    # only ssh sessions render as asciicast
    status, database = await api("POST", "/connections", {"name": f"pg-{uuid.uuid4().hex[:8]}", "type": "database",
                                                          "subtype": "postgres", "secret": {}})
    assert status == 201, database
    _, other_session = await api.credential(database)
    status, body = await api("GET", f"/sessions/{other_session}?event_stream=asciicast")
    assert status == 422 and body["message"] == "query parameter 'event_stream': asciicast renders ssh sessions only"


async def test_an_exec_reads_its_input_as_a_shell_does_under_input_rules(gateway, api, target, tmp_path):
    """``ssh host sh < script`` and ``ssh -t host bash`` are shells: the input rules read their lines (they read the
    command alone, and every line passed); sftp-server run as a command is read as the sftp subsystem; a legacy
    scp upload passes as data (its file is not lines to hold)."""
    role = await api.role()
    await api.guardrail(role, input_rules=[{"type": "pattern_match", "pattern_regex": r"touch|get \S*secret"}])
    message = r"validation error, match guard rails input rule, type=pattern_match, pattern=touch|get \S*secret"
    marker = f"/tmp/gatewayd-never-{uuid.uuid4().hex[:8]}"

    # without a pty: whole lines, a blocked one never reaches the target, the others run
    secret, session_id = await api.credential(role)
    result = ssh(gateway, secret, "sh", stdin=f"echo first\ntouch {marker}\necho second\n".encode())
    assert (result.returncode, result.stdout, result.stderr.decode()) == (0, b"first\nsecond\n", message + "\n")
    session = await api.done_session(session_id)
    assert of_kind(session, "e") == [message]

    # with a pty: the Enter of a blocked line is held, the line erased on the target
    secret, session_id = await api.credential(role)
    term = Terminal(ssh_args(gateway, secret, "-tt", "bash --norc"))
    term.at_prompt()
    term.type(f"touch {marker}\r")
    term.expect(message)
    term.type("exit 3\r")
    assert term.wait() == 3
    assert "No such file" in target.ssh(f"ls {marker}").stderr.decode()

    # sftp-server as the command (sftp -s PATH): its operations are read as the sftp subsystem's
    directory = f"/tmp/gatewayd-sftp-{uuid.uuid4().hex[:8]}"
    on_target(target, f"mkdir {directory} && echo top > {directory}/secret.txt && echo ok > {directory}/plain.txt")
    secret, session_id = await api.credential(role)
    batch = tmp_path / "batch"
    batch.write_text(f"-get {directory}/secret.txt {tmp_path}/secret.txt\nget {directory}/plain.txt {tmp_path}/p\n")
    result = subprocess.run(["sftp", *CLIENT_OPTIONS, "-s", "/usr/lib/openssh/sftp-server", "-P",
                             str(gateway.ssh_port), "-b", str(batch), f"{secret}@127.0.0.1"], capture_output=True,
                            stdin=subprocess.DEVNULL, timeout=120)
    assert result.returncode == 0 and message in result.stderr.decode(), result.stderr
    assert not (tmp_path / "secret.txt").exists() and (tmp_path / "p").read_text() == "ok\n"
    session = await api.done_session(session_id)
    assert of_kind(session, "i") == ["/usr/lib/openssh/sftp-server", f"get {directory}/secret.txt",
                                     f"get {directory}/plain.txt 3 bytes"]

    # scp -O's upload (scp -t): its data passes, a last line without its newline included
    secret, session_id = await api.credential(role)
    (tmp_path / "up.bin").write_bytes(b"a line that says touch\n" + os.urandom(5000).replace(b"\n", b"-"))
    result = subprocess.run(["scp", "-O", *CLIENT_OPTIONS, "-P", str(gateway.ssh_port), str(tmp_path / "up.bin"),
                             f"{secret}@127.0.0.1:{directory}/up.bin"], capture_output=True, stdin=subprocess.DEVNULL,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert on_target(target, f"sha256sum < {directory}/up.bin").split()[0] == sha256(tmp_path / "up.bin")
    on_target(target, f"rm -r {directory}")


async def test_shell_without_pty_or_input_rules_passes_every_byte(gateway, api):
    """No input rules: no line assembly; a last line without its newline runs too; input recorded as sent."""
    role = await api.role()
    secret, session_id = await api.credential(role)
    script = b"echo one\r\necho two-$((1+1))\nexit 5"
    result = ssh(gateway, secret, "-T", stdin=script)
    assert (result.returncode, result.stdout) == (5, b"one\r\ntwo-2\n"), result.stderr  # no pty: CR is data
    session = await api.done_session(session_id)
    assert session["exit_code"] == 5 and "".join(of_kind(session, "i")) == script.decode()


# --------------------------------------------------------------------------- guard rails on exec


async def test_exec_input_rule_blocks_before_the_target_and_output_rule_closes_the_channel(gateway, api, target):
    role = await api.role()
    await api.guardrail(role, input_rules=[{"type": "deny_words_list", "words": ["shutdown", "touch"]}],
                        output_rules=[{"type": "pattern_match", "pattern_regex": r"tok-[0-9]{6}"}])
    marker = f"/tmp/gatewayd-never-{uuid.uuid4().hex[:8]}"
    secret, session_id = await api.credential(role)
    result = ssh(gateway, secret, f"touch {marker}")
    assert result.returncode == 254
    assert result.stdout == b""
    assert result.stderr.decode().strip() == \
        "validation error, match guard rails input rule, type=deny_words_list, words=[touch]"
    assert "No such file" in target.ssh(f"ls {marker}").stderr.decode()
    session = await api.done_session(session_id)
    assert session["exit_code"] == 254
    assert events(session) == [("i", f"touch {marker}"), (
        "e", "validation error, match guard rails input rule, type=deny_words_list, words=[touch]")]

    secret, session_id = await api.credential(role)
    result = ssh(gateway, secret, "echo visible; sleep 0.5; echo the key is tok-$((123000+456)); sleep 5; echo never")
    assert result.returncode == 254
    assert result.stdout == b"visible\n"
    assert b"validation error, match guard rails output rule, type=pattern_match, pattern=tok-[0-9]{6}" \
        in result.stderr
    session = await api.done_session(session_id)
    assert session["exit_code"] == 254
    assert "tok-123456" not in json.dumps(events(session))
    # the command the block ended is signalled on the target (its close alone would leave ``sleep 5`` running there)
    assert of_kind(session, "e") == ["validation error, match guard rails output rule, type=pattern_match, "
                                     "pattern=tok-[0-9]{6}", SIGNALLED]
    status, logs = await api("GET", "/audit/logs?action=guardrail.block")
    blocked = [e for e in logs["data"] if e["request_payload_redacted"].get("session_id") == session_id]
    assert status == 200 and len(blocked) == 1 and blocked[0]["outcome"] == "failure"

    # a match written in two pieces (two channel data messages) is caught too
    secret, session_id = await api.credential(role)
    result = ssh(gateway, secret, "printf 'key tok-123'; sleep 0.5; printf '456 end\\n'; sleep 5; echo never")
    assert result.returncode == 254 and result.stdout == b"key tok-123"
    assert b"pattern=tok-[0-9]{6}" in result.stderr


# --------------------------------------------------------------------------- scp and sftp


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def scp(gateway: Daemon, secret: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["scp", *CLIENT_OPTIONS, "-P", str(gateway.ssh_port), *args], capture_output=True,
                          stdin=subprocess.DEVNULL, timeout=timeout)


async def test_scp_100_mb_both_ways(gateway, api, target, tmp_path):
    role = await api.role(host_key=target.host_public_key)  # the target's key is verified too
    local = tmp_path / "upload.bin"
    with open(local, "wb") as handle:
        handle.write(os.urandom(100 << 20))
    remote = f"/tmp/gatewayd-scp-{uuid.uuid4().hex[:8]}.bin"
    secret, session_id = await api.credential(role)
    result = scp(gateway, secret, str(local), f"{secret}@127.0.0.1:{remote}")
    assert result.returncode == 0, result.stderr
    assert on_target(target, f"sha256sum {remote}").split()[0] == sha256(local)
    session = await api.done_session(session_id)
    assert session["exit_code"] == 0
    assert f"put {remote} {100 << 20} bytes" in of_kind(session, "i")  # scp speaks SFTP (OpenSSH 9)

    back = tmp_path / "download.bin"
    secret, session_id = await api.credential(role)
    result = scp(gateway, secret, f"{secret}@127.0.0.1:{remote}", str(back))
    assert result.returncode == 0, result.stderr
    assert sha256(back) == sha256(local)
    session = await api.done_session(session_id)
    assert f"get {remote} {100 << 20} bytes" in of_kind(session, "i")

    # the legacy scp protocol (scp -O) is an exec channel: "scp -t" / "scp -f" on the target
    small = tmp_path / "small.txt"
    small.write_text("legacy scp\n" * 1000)
    secret, session_id = await api.credential(role)
    result = scp(gateway, secret, "-O", str(small), f"{secret}@127.0.0.1:{remote}.txt")
    assert result.returncode == 0, result.stderr
    result = scp(gateway, secret, "-O", f"{secret}@127.0.0.1:{remote}.txt", str(tmp_path / "small-back.txt"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "small-back.txt").read_text() == small.read_text()
    on_target(target, f"rm -f {remote} {remote}.txt")
    local.unlink()
    back.unlink()


async def test_sftp_batch_operations_are_recorded_as_lines(gateway, api, target, tmp_path):
    role = await api.role()
    secret, session_id = await api.credential(role)
    directory = f"/tmp/gatewayd-sftp-{uuid.uuid4().hex[:8]}"
    local = tmp_path / "file.bin"
    local.write_bytes(os.urandom(1 << 20))
    batch = tmp_path / "batch"
    batch.write_text(f"mkdir {directory}\nput {local} {directory}/file.bin\nls -l {directory}\n"
                     f"get {directory}/file.bin {tmp_path}/back.bin\nrename {directory}/file.bin {directory}/b.bin\n"
                     f"-rm {directory}/missing\nrm {directory}/b.bin\nrmdir {directory}\n")
    result = subprocess.run(["sftp", *CLIENT_OPTIONS, "-P", str(gateway.ssh_port), "-b", str(batch),
                             f"{secret}@127.0.0.1"], capture_output=True, stdin=subprocess.DEVNULL, timeout=120)
    assert result.returncode == 0, result.stderr
    assert b"file.bin" in result.stdout  # the ls listing
    assert (tmp_path / "back.bin").read_bytes() == local.read_bytes()
    session = await api.done_session(session_id)
    assert session["exit_code"] == 0 or session["exit_code"] is None
    lines = of_kind(session, "i")
    assert lines == [f"mkdir {directory}", f"put {directory}/file.bin 1048576 bytes", f"ls {directory}/",
                     f"get {directory}/file.bin 1048576 bytes",
                     f"rename {directory}/file.bin {directory}/b.bin", f"rm {directory}/missing",
                     f"rm {directory}/b.bin", f"rmdir {directory}"]
    assert of_kind(session, "e") == [f"failed: rm {directory}/missing: No such file"]
    assert "No such file" in target.ssh(f"ls {directory}").stderr.decode()


async def test_sftp_operations_refused_by_input_rules(gateway, api, target, tmp_path):
    role = await api.role()
    await api.guardrail(role, input_rules=[{"type": "pattern_match", "pattern_regex": r"(get|rm) \S*secret"}])
    directory = f"/tmp/gatewayd-sftp-{uuid.uuid4().hex[:8]}"
    on_target(target, f"mkdir {directory} && echo top > {directory}/secret.txt && echo ok > {directory}/plain.txt")
    secret, session_id = await api.credential(role)
    batch = tmp_path / "batch"
    batch.write_text(f"-get {directory}/secret.txt {tmp_path}/secret.txt\n-rm {directory}/secret.txt\n"
                     f"get {directory}/plain.txt {tmp_path}/plain.txt\n")
    result = subprocess.run(["sftp", *CLIENT_OPTIONS, "-P", str(gateway.ssh_port), "-b", str(batch),
                             f"{secret}@127.0.0.1"], capture_output=True, stdin=subprocess.DEVNULL, timeout=120)
    assert result.returncode == 0, result.stderr
    message = r"validation error, match guard rails input rule, type=pattern_match, pattern=(get|rm) \S*secret"
    assert result.stderr.decode().count("Permission denied") == 2  # the status the gateway answered
    assert result.stderr.decode().count(message) == 2  # and why, on stderr
    assert not (tmp_path / "secret.txt").exists() and (tmp_path / "plain.txt").read_text() == "ok\n"
    assert on_target(target, f"cat {directory}/secret.txt") == "top\n"  # never removed
    session = await api.done_session(session_id)
    assert of_kind(session, "i") == [f"get {directory}/secret.txt", f"rm {directory}/secret.txt",
                                     f"get {directory}/plain.txt 3 bytes"]
    assert of_kind(session, "e") == [message, message]

    # an open for reading and writing reads the file: the rules read it as a get and a put (it was a put only)
    import asyncssh

    secret, session_id = await api.credential(role)
    async with asyncssh.connect("127.0.0.1", gateway.ssh_port, username=secret, known_hosts=None, agent_path=None,
                                client_keys=[]) as conn, conn.start_sftp_client() as sftp:
        with pytest.raises(asyncssh.SFTPPermissionDenied, match=r"pattern=\(get\|rm\)"):
            async with sftp.open(f"{directory}/secret.txt", asyncssh.FXF_READ | asyncssh.FXF_WRITE) as handle:
                await handle.read()
        async with sftp.open(f"{directory}/plain.txt", asyncssh.FXF_READ | asyncssh.FXF_WRITE) as handle:
            assert await handle.read() == "ok\n"
            await handle.write("more\n")
    session = await api.done_session(session_id)
    assert of_kind(session, "i") == [f"get {directory}/secret.txt", f"put {directory}/secret.txt",
                                     f"get {directory}/plain.txt 3 bytes", f"put {directory}/plain.txt 5 bytes"]
    assert on_target(target, f"cat {directory}/plain.txt") == "ok\nmore\n"
    on_target(target, f"rm -r {directory}")


async def test_sftp_hard_links_and_attribute_changes_by_handle_or_link_are_read_and_recorded(gateway, api, target):
    """hardlink@openssh.com (sftp's ``ln``), lsetstat@openssh.com and FSETSTAT (a chmod on an open file) are
    operations as their plain kin are: ``link a b`` and ``setstat /path`` (they passed unread and unrecorded)."""
    import asyncssh

    role = await api.role()
    await api.guardrail(role, input_rules=[{"type": "pattern_match", "pattern_regex": r"(link|setstat) \S*secret"}])
    message = r"validation error, match guard rails input rule, type=pattern_match, pattern=(link|setstat) \S*secret"
    directory = f"/tmp/gatewayd-sftp-{uuid.uuid4().hex[:8]}"
    on_target(target, f"mkdir {directory} && echo top > {directory}/secret.txt && chmod 640 {directory}/secret.txt "
                      f"&& echo ok > {directory}/plain.txt")
    secret, session_id = await api.credential(role)
    async with asyncssh.connect("127.0.0.1", gateway.ssh_port, username=secret, known_hosts=None, agent_path=None,
                                client_keys=[]) as conn, conn.start_sftp_client() as sftp:
        with pytest.raises(asyncssh.SFTPPermissionDenied, match=re.escape(message)):
            await sftp.link(f"{directory}/secret.txt", f"{directory}/copy")
        with pytest.raises(asyncssh.SFTPPermissionDenied):
            await sftp.chmod(f"{directory}/secret.txt", 0o644, follow_symlinks=False)
        async with sftp.open(f"{directory}/secret.txt", "a") as handle:
            with pytest.raises(asyncssh.SFTPPermissionDenied):
                await handle.chmod(0o644)
        await sftp.link(f"{directory}/plain.txt", f"{directory}/plain-link")
    session = await api.done_session(session_id)
    assert of_kind(session, "i") == [
        f"link {directory}/secret.txt {directory}/copy", f"setstat {directory}/secret.txt",
        f"setstat {directory}/secret.txt", f"put {directory}/secret.txt 0 bytes",
        f"link {directory}/plain.txt {directory}/plain-link"]
    assert of_kind(session, "e") == [message] * 3
    assert on_target(target, f"stat -c '%a %h' {directory}/secret.txt {directory}/plain.txt") == "640 1\n644 2\n"
    on_target(target, f"rm -r {directory}")


async def test_an_sftp_stream_the_gateway_cannot_follow_ends_the_channel_unpassed(gateway, api, target):
    """A packet of length 0 stopped the observer, which passed the rest unread; sftp-server takes the next bytes as
    the packet, and ran the remove they held (past a rule on ``rm``) before giving up on the stream."""
    import asyncssh

    role = await api.role()
    await api.guardrail(role, input_rules=[{"type": "pattern_match", "pattern_regex": r"rm \S*secret"}])
    directory = f"/tmp/gatewayd-sftp-{uuid.uuid4().hex[:8]}"
    on_target(target, f"mkdir {directory} && echo top > {directory}/secret.txt")
    secret, session_id = await api.credential(role)
    remove = bytes([13]) + struct.pack(">I", 6) + struct.pack(">I", len(f"{directory}/secret.txt")) + \
        f"{directory}/secret.txt".encode()
    async with asyncssh.connect("127.0.0.1", gateway.ssh_port, username=secret, known_hosts=None, agent_path=None,
                                client_keys=[]) as conn:
        stdin, stdout, stderr = await conn.open_session(subsystem="sftp", encoding=None)
        stdin.write(struct.pack(">IBI", 5, 1, 3))  # INIT, version 3
        assert (await asyncio.wait_for(stdout.read(5), 20))[4] == 2  # VERSION
        stdin.write(b"\0\0\0\0" + remove)
        said = await asyncio.wait_for(stderr.read(), 20)
    reason = "sftp: the client's stream cannot be followed (packet length 0): the channel is closed"
    assert said.decode().strip() == reason
    assert on_target(target, f"cat {directory}/secret.txt && rm -r {directory}") == "top\n"
    session = await api.done_session(session_id)
    assert of_kind(session, "e") == [reason] and session["exit_code"] == 254


# --------------------------------------------------------------------------- port forwarding


class EchoServer:
    """A TCP server in a thread that answers every connection with what it received, upper-cased: its first line
    and the end, or each line until the client leaves (``keep_open``)."""

    def __init__(self, keep_open: bool = False) -> None:
        self.keep_open = keep_open
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0  # the connections the forwards opened to it
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            with client:
                data = b""
                while chunk := client.recv(65536):
                    data += chunk
                    if data.endswith(b"\n"):
                        if not self.keep_open:
                            break
                        client.sendall(data.upper())
                        data = b""
                client.sendall(data.upper())

    def close(self) -> None:
        self.sock.close()


def forward(gateway: Daemon, secret: str, local_port: int, remote_port: int) -> subprocess.Popen[bytes]:
    args = ssh_args(gateway, secret, "-N", "-L", f"127.0.0.1:{local_port}:127.0.0.1:{remote_port}")
    args[1:1] = ["-o", "LogLevel=INFO"]  # "open failed" is an INFO message; the first value of an option wins
    return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def tunnel(local_port: int, timeout: float = 20) -> socket.socket:
    """A connection to the local end of ``ssh -L``, once the client listens there."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return socket.create_connection(("127.0.0.1", local_port), timeout=timeout)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


async def refused_forward(gateway: Daemon, api: Any, secret: str, session_id: str, echo: EchoServer,
                          says: bytes, message: str) -> None:
    """``ssh -L`` to ``echo`` is refused: nothing comes through, the client says ``says``, and the session's one
    ``e`` event and an ``ssh.port_forward`` failure entry are ``message``."""
    answer, stderr = forwarded(gateway, secret, echo, b"drop table t; ann@example.com\n")
    assert answer == b""
    assert b"administratively prohibited" in stderr and says in stderr
    session = await api.done_session(session_id)
    assert of_kind(session, "e") == [message]
    status, logs = await api("GET", "/audit/logs?action=ssh.port_forward&outcome=failure")
    assert status == 200 and any(e["error_message"] == message for e in logs["data"])


def forwarded(gateway: Daemon, secret: str, echo: EchoServer, payload: bytes) -> tuple[bytes, bytes]:
    """``payload`` sent through ``ssh -L`` to ``echo``: what came back, and what the ssh client said."""
    local_port = free_port()
    client = forward(gateway, secret, local_port, echo.port)
    try:
        answer = through(local_port, payload)
    finally:
        client.kill()
        _, stderr = client.communicate(timeout=10)
    return answer, stderr


def through(local_port: int, payload: bytes, timeout: float = 20) -> bytes:
    """Send ``payload`` through the local end of ``ssh -L``; what comes back ("" when refused)."""
    with tunnel(local_port, timeout) as sock:
        sock.sendall(payload)
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except ConnectionResetError:
            pass
        return data


async def test_local_port_forwarding_allowed_per_connection_and_refused_by_default(gateway, api, target):
    echo = EchoServer()
    try:
        allowed = await api.role(settings={"ssh": {"allow_port_forwarding": True}})
        secret, session_id = await api.credential(allowed)
        assert forwarded(gateway, secret, echo, b"through the tunnel\n")[0] == b"THROUGH THE TUNNEL\n"
        session = await api.done_session(session_id)
        assert of_kind(session, "e") == [
            f"port forwarding to 127.0.0.1:{echo.port} opened",
            f"port forwarding to 127.0.0.1:{echo.port} closed: 19 bytes sent, 19 bytes received"]

        refused = await api.role()
        secret, session_id = await api.credential(refused)
        await refused_forward(gateway, api, secret, session_id, echo, b"does not allow it",
                              f'port forwarding to 127.0.0.1:{echo.port} refused: connection "{refused["name"]}" does '
                              "not allow it (settings.ssh.allow_port_forwarding)")
    finally:
        echo.close()


async def test_forwarding_to_a_unix_socket_is_refused_on_the_record(gateway, api):
    """``ssh -L port:/path`` (direct-streamlocal) is not offered, even where TCP forwarding is allowed: refused as a
    refused ``-L`` is, with an ``e`` event and an ``ssh.port_forward`` failure entry (it was refused unrecorded)."""
    import asyncssh

    role = await api.role(settings={"ssh": {"allow_port_forwarding": True}})
    secret, session_id = await api.credential(role)
    message = "port forwarding to /run/sshd.pid refused: the gateway does not offer unix socket forwarding"
    async with asyncssh.connect("127.0.0.1", gateway.ssh_port, username=secret, known_hosts=None, agent_path=None,
                                client_keys=[]) as conn:
        with pytest.raises(asyncssh.ChannelOpenError, match=message):
            await conn.open_unix_connection("/run/sshd.pid")
    session = await api.done_session(session_id)
    assert of_kind(session, "e") == [message]
    status, logs = await api("GET", "/audit/logs?action=ssh.port_forward&outcome=failure")
    assert status == 200 and any(e["error_message"] == message for e in logs["data"])


@pytest.mark.parametrize("rules", [
    {"input_rules": [{"type": "deny_words_list", "words": ["drop"]}]},
    {"output_rules": [{"type": "mask", "patterns": ["email"]}]},
], ids=["guard rail", "mask rule"])
async def test_port_forwarding_is_refused_on_a_connection_whose_rules_could_not_read_it(gateway, api, target, rules):
    """A forwarded stream is not checked, masked or recorded: allowed on the connection, it is still refused once
    the connection has rules (they would be passed by, not applied)."""
    echo = EchoServer()
    try:
        connection = await api.role(settings={"ssh": {"allow_port_forwarding": True}})
        await api.guardrail(connection, **rules)
        secret, session_id = await api.credential(connection)
        await refused_forward(gateway, api, secret, session_id, echo, b"cannot be checked, masked or recorded",
                              f'port forwarding to 127.0.0.1:{echo.port} refused: connection "{connection["name"]}" '
                              "has guard rails, mask rules or an analysis, and a forwarded stream cannot be checked, "
                              "masked or recorded")
        assert echo.accepted == 0  # nothing was opened on the target's side
    finally:
        echo.close()


async def test_a_forward_open_when_its_connection_gets_a_rule_ends_without_passing_another_byte(gateway, api, target):
    """A rule attached while a forward is open: the forward's next bytes are not passed, and it ends (recorded)."""
    echo = EchoServer(keep_open=True)
    try:
        connection = await api.role(settings={"ssh": {"allow_port_forwarding": True}})
        secret, session_id = await api.credential(connection)
        local_port = free_port()
        client = forward(gateway, secret, local_port, echo.port)
        try:
            deadline = time.monotonic() + 20
            with await asyncio.to_thread(tunnel, local_port) as sock:
                await asyncio.to_thread(sock.sendall, b"before\n")
                assert await asyncio.to_thread(sock.recv, 100) == b"BEFORE\n"
                await api.guardrail(connection, input_rules=[{"type": "deny_words_list", "words": ["drop"]}])
                answers = []
                while (time.monotonic() < deadline + 20
                       and (answer := await asyncio.to_thread(lambda: (sock.sendall(b"drop\n"), sock.recv(100))[1]))):
                    answers.append(answer)  # until the session adopts the rule
                    await asyncio.sleep(0.1)
            assert answer == b"", "the forward was never closed"
        finally:
            client.kill()
            client.wait(10)
        session = await api.done_session(session_id)
        ended = of_kind(session, "e")
        assert ended[0] == f"port forwarding to 127.0.0.1:{echo.port} opened"
        assert ended[1] == (f"port forwarding to 127.0.0.1:{echo.port} ended: its connection now has guard rails, "
                            "mask rules or an analysis, and a forwarded stream cannot be checked, masked or recorded")
        sent = len(b"before\n") + len(b"drop\n") * len(answers)  # what passed before the rule: all answered
        assert ended[2] == (f"port forwarding to 127.0.0.1:{echo.port} closed: {sent} bytes sent, {sent} bytes "
                            "received")
    finally:
        echo.close()


# --------------------------------------------------------------------------- OpenSSH multiplexing


class Master:
    """An OpenSSH ``ControlMaster`` through the gateway: later ssh and scp runs share its one connection."""

    def __init__(self, gateway: Daemon, secret: str) -> None:
        self.gateway = gateway
        self.secret = secret
        self.dir = Path(tempfile.mkdtemp(prefix="gwmux-"))  # a unix socket path must stay short
        self.options = ["-o", f"ControlPath={self.dir / 'cm'}"]
        self.process = subprocess.Popen(["ssh", "-M", "-N", *self.options, *ssh_args(gateway, secret)[1:]],
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while self.control("check").returncode != 0:
            assert self.process.poll() is None, self.process.communicate()[1]
            assert time.monotonic() < deadline, "the master never came up"
            time.sleep(0.05)

    def control(self, command: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(["ssh", "-O", command, *self.options, *ssh_args(self.gateway, self.secret)[1:]],
                              capture_output=True, stdin=subprocess.DEVNULL, timeout=60)

    def ssh_args(self, *args: str) -> list[str]:
        return ["ssh", *self.options, *ssh_args(self.gateway, self.secret, *args)[1:]]

    def ssh(self, command: str, stdin: Path | None = None) -> subprocess.CompletedProcess[bytes]:
        with open(stdin or os.devnull, "rb") as handle:
            return subprocess.run(self.ssh_args(command), stdin=handle, capture_output=True, timeout=60)

    def scp(self, *args: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(["scp", *self.options, *CLIENT_OPTIONS, "-P", str(self.gateway.ssh_port), *args],
                              capture_output=True, stdin=subprocess.DEVNULL, timeout=60)

    def close(self) -> None:
        self.control("exit")
        try:
            self.process.wait(20)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            shutil.rmtree(self.dir, ignore_errors=True)


async def test_multiplexed_commands_and_scp_keep_their_exit_status(gateway, api, target, tmp_path):
    """The target's eof, exit-status and close reach a multiplexing client in that order, every time.

    The client has sent its EOF first (stdin from a file): had the gateway passed the target's EOF on before the
    exit status, the master would answer it with CLOSE and the status would be lost (exit 255) in some runs.
    """
    role = await api.role()
    secret, session_id = await api.credential(role)
    payload = tmp_path / "payload.bin"
    payload.write_bytes(os.urandom(64 << 10))
    remote = f"/tmp/gatewayd-mux-{uuid.uuid4().hex[:8]}.bin"
    master = Master(gateway, secret)
    try:
        runs = [master.ssh("cat >/dev/null; exit 3", stdin=payload) for _ in range(30)]
        assert [run.returncode for run in runs] == [3] * 30, [run.stderr for run in runs if run.returncode != 3]
        copies = [master.scp(str(payload), f"{secret}@127.0.0.1:{remote}") for _ in range(20)]
        assert [copy.returncode for copy in copies] == [0] * 20, [c.stderr for c in copies if c.returncode]
    finally:
        master.close()
    assert on_target(target, f"sha256sum < {remote}; rm {remote}").split()[0] == sha256(payload)
    session = await api.done_session(session_id)
    assert session["exit_code"] == 0  # the last channel's: an scp
    ended = of_kind(session, "e")
    assert ended.count("exit 3 of the channel that ran: cat >/dev/null; exit 3") == 30
    assert ended.count("exit 0 of the sftp channel") == 20


async def test_multiplexed_channels_each_record_their_command_and_exit(gateway, api):
    """One session, several channels: each channel's end names its command, in the order they ended."""
    role = await api.role()
    secret, session_id = await api.credential(role)
    master = Master(gateway, secret)
    try:
        assert master.ssh("echo first").returncode == 0
        slow = subprocess.Popen(master.ssh_args("echo ready; cat; exit 3"), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert slow.stdout is not None and slow.stdout.readline() == b"ready\n"  # its channel is open
        assert master.ssh("echo second; exit 5").returncode == 5
        out, err = slow.communicate(b"to the slow one\n", timeout=60)
        assert slow.returncode == 3 and out == b"to the slow one\n", err
        assert master.ssh("kill -TERM $$").returncode == 255
    finally:
        master.close()
    session = await api.done_session(session_id)
    assert session["exit_code"] == 128 + signal.SIGTERM  # still the last channel's
    assert of_kind(session, "e") == ["exit 0 of the channel that ran: echo first",
                                     "exit 5 of the channel that ran: echo second; exit 5",
                                     "exit 3 of the channel that ran: echo ready; cat; exit 3",
                                     "signal TERM of the channel that ran: kill -TERM $$"]


# --------------------------------------------------------------------------- clients that leave at once, paramiko


def connections_to(port: int) -> int:
    """Established TCP connections to ``port`` on this machine (/proc/net/tcp, the clients' side)."""
    count = 0
    with open("/proc/net/tcp") as handle:
        next(handle)
        for line in handle:
            fields = line.split()
            if fields[3] == "01" and int(fields[2].split(":")[1], 16) == port:
                count += 1
    return count


async def no_connections_to(port: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while connections_to(port):
        assert time.monotonic() < deadline, f"{connections_to(port)} connection(s) to port {port} remain"
        await asyncio.sleep(0.05)


class HeldDoor:
    """A TCP door to a target that holds each connection until ``release`` is set, then passes bytes both ways."""

    def __init__(self, target_port: int, release: asyncio.Event) -> None:
        self.target_port = target_port
        self.release = release
        self.passed = 0
        self.server: asyncio.Server | None = None
        self.port = 0

    @classmethod
    async def open(cls, target_port: int, release: asyncio.Event) -> HeldDoor:
        door = cls(target_port, release)
        door.server = await asyncio.start_server(door._serve, "127.0.0.1", 0)
        door.port = door.server.sockets[0].getsockname()[1]
        return door

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self.release.wait()
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self.passed += 1

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            finally:
                sink.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer), return_exceptions=True)

    def close(self) -> None:
        assert self.server is not None
        self.server.close()


async def test_a_client_leaving_right_after_login_closes_its_session_and_the_target_connection(gateway, api):
    """``ssh -R`` with ExitOnForwardFailure, and a paramiko transport closed right after authentication."""
    import paramiko

    own = SshTarget().start()  # a target of this test's own: every connection to it is the gateway's for this test
    try:
        role = await api.role(port=own.port, key=own.private_key_text)
        secret, session_id = await api.credential(role)
        result = subprocess.run(ssh_args(gateway, secret, "-o", "ExitOnForwardFailure=yes", "-N", "-R",
                                         "127.0.0.1:0:127.0.0.1:80"), capture_output=True, stdin=subprocess.DEVNULL,
                                timeout=60)
        assert result.returncode == 255 and b"remote port forwarding failed" in result.stderr, result.stderr
        session = await api.done_session(session_id)
        message = "remote port forwarding from 127.0.0.1:0 refused: the gateway does not offer it"
        assert session["end_date"] and of_kind(session, "e") == [message]
        status, logs = await api("GET", "/audit/logs?action=ssh.port_forward&outcome=failure")
        assert status == 200 and any(e["error_message"] == message and e["request_payload_redacted"]["session_id"]
                                     == session_id for e in logs["data"])
        await no_connections_to(own.port)

        # the target login is held until the client has left: the race of a client that leaves at once, every time
        left = asyncio.Event()
        door = await HeldDoor.open(own.port, left)
        held = await api.role(port=door.port, key=own.private_key_text)
        secret, session_id = await api.credential(held)

        def log_in_and_leave() -> None:
            transport = paramiko.Transport(("127.0.0.1", gateway.ssh_port))
            try:
                transport.connect()
                transport.auth_password("anyone", secret)
                transport.sock.shutdown(socket.SHUT_RDWR)  # the socket closes at once, as a client that crashed
            finally:
                transport.close()

        await asyncio.to_thread(log_in_and_leave)
        left.set()
        session = await api.done_session(session_id)
        assert session["end_date"] and session["exit_code"] is None
        await no_connections_to(own.port)
        await no_connections_to(door.port)
        assert door.passed == 1  # the gateway did log in to the target, after the client had left
        door.close()
    finally:
        own.destroy()


async def test_paramiko_logs_in_with_the_secret_as_password(gateway, api):
    """paramiko never tries the ``none`` method: the secret as user name alone is not enough (README)."""
    import paramiko

    role = await api.role()
    secret, session_id = await api.credential(role)

    def run() -> tuple[bytes, int]:
        client = paramiko.SSHClient()
        client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
        try:
            with pytest.raises(paramiko.SSHException, match="No authentication methods available"):
                client.connect("127.0.0.1", gateway.ssh_port, username=secret, look_for_keys=False,
                               allow_agent=False, timeout=30)
        finally:
            client.close()
        client = paramiko.SSHClient()
        client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
        try:
            client.connect("127.0.0.1", gateway.ssh_port, username="anyone", password=secret, look_for_keys=False,
                           allow_agent=False, timeout=30)
            _, stdout, _ = client.exec_command("echo via-paramiko-$((6*7)); exit 4", timeout=30)
            return stdout.read(), stdout.channel.recv_exit_status()
        finally:
            client.close()

    assert await asyncio.to_thread(run) == (b"via-paramiko-42\n", 4)
    session = await api.done_session(session_id)
    assert session["exit_code"] == 4


# --------------------------------------------------------------------------- credentials


async def test_unknown_and_expired_secrets_are_refused_and_audited(gateway, api):
    role = await api.role()
    unknown = "ssh-" + "A" * 43
    result = ssh(gateway, unknown, "true")
    assert result.returncode == 255 and b"Permission denied" in result.stderr
    result = ssh(gateway, "someone", "true")
    assert result.returncode == 255 and b"Permission denied" in result.stderr

    secret, _ = await api.credential(role, seconds=1)
    await asyncio.sleep(1.2)
    result = ssh(gateway, secret, "true")
    assert result.returncode == 255 and b"Permission denied" in result.stderr
    status, logs = await api("GET", "/audit/logs?action=ssh.login&outcome=failure")
    messages = [e["error_message"] for e in logs["data"]]
    assert status == 200 and "invalid credential: unknown secret" in messages
    assert "invalid credential: it has expired" in messages
    assert secret not in json.dumps(logs) and unknown not in json.dumps(logs)


async def test_a_credential_expiring_mid_session_closes_it_with_a_message(gateway, api):
    role = await api.role()
    secret, session_id = await api.credential(role, seconds=2)
    result = ssh(gateway, secret, "echo started; sleep 60; echo never")
    assert result.returncode == 254
    assert result.stdout == b"started\n"
    assert b"credential expired: the session was closed" in result.stderr
    session = await api.done_session(session_id)
    assert session["exit_code"] == 254
    # the expiry ended ``sleep 60`` on the target too (no pty: the channel's close alone would not)
    assert of_kind(session, "e")[-2:] == [SIGNALLED, "credential expired: the session was closed"]


async def test_kill_through_the_api_ends_a_pty_session_with_the_reason_on_the_terminal(gateway, api):
    role = await api.role()
    secret, session_id = await api.credential(role)
    term = Terminal(ssh_args(gateway, secret, "-tt"))
    term.type("echo ready-$((3*3))\r")
    term.expect("ready-9")
    status, body = await api("POST", f"/sessions/{session_id}/kill")
    assert status == 200, body
    term.expect("session killed by admin@example.com")
    assert term.wait() == 254
    session = await api.done_session(session_id)
    assert session["exit_code"] == 254 and "session killed by admin@example.com" in of_kind(session, "e")


SIGNALLED = "the gateway sent SIGTERM to the command on the target: it ended"
FORCED = ("the command on the target did not end within 2 s of SIGTERM: the gateway sent SIGKILL and closed the "
          "channel")


async def test_a_kill_ends_the_command_of_an_exec_without_a_pty_on_the_target(gateway, api):
    """Closing the target's channel of an exec (or a shell) without a pty only closes the command's pipes (sshd sends
    a hangup with a pty only): killed sessions left their commands running there. The kill signals them: TERM, and
    KILL for one that ignores TERM."""
    role = await api.role()
    loop = "for i in $(seq 600); do sleep 0.1; done"  # ends by itself within a minute if the gateway leaves it
    # name: (the exec's command, or None for a shell without a pty, what its stdin says)
    runs = {"polite": (f"echo pid=$$; {loop}", None), "stubborn": (f"trap '' TERM; echo pid=$$; {loop}", None),
            "shell": (None, f"echo pid=$$; {loop}\n".encode())}
    held: dict[str, tuple[str, subprocess.Popen[bytes], int]] = {}
    try:
        for name, (command, typed) in runs.items():
            secret, session_id = await api.credential(role)
            client = subprocess.Popen(ssh_args(gateway, secret, "-T", *([command] if command else [])),
                                      stdin=subprocess.DEVNULL if typed is None else subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            assert client.stdout is not None
            if typed is not None:
                assert client.stdin is not None
                client.stdin.write(typed)
                client.stdin.flush()  # and stdin stays open: the shell waits for more
            line = client.stdout.readline()
            assert line.startswith(b"pid="), (line, client.stderr.read() if client.poll() is not None else b"")
            held[name] = (session_id, client, int(line[4:]))
        assert all(group_alive(pid) for _, _, pid in held.values())
        answers = await asyncio.gather(*(api("POST", f"/sessions/{session_id}/kill")
                                         for session_id, _, _ in held.values()))
        assert [status for status, _ in answers] == [200] * len(runs), answers
        await until_gone(*(pid for _, _, pid in held.values()))
        for name, note in (("polite", SIGNALLED), ("stubborn", FORCED), ("shell", SIGNALLED)):
            session_id, client, _ = held[name]
            assert client.wait(30) == 254
            assert b"session killed by admin@example.com" in client.stderr.read()
            session = await api.done_session(session_id)
            assert session["exit_code"] == 254
            assert of_kind(session, "e")[-2:] == [note, "session killed by admin@example.com"], of_kind(session, "e")
    finally:
        for _, client, pid in held.values():
            if client.poll() is None:
                client.kill()
                client.wait()
            if group_alive(pid):
                os.killpg(pid, signal.SIGKILL)


async def test_the_daemons_shutdown_ends_the_command_of_an_exec_without_a_pty_on_the_target(tmp_path_factory, target):
    """The shutdown ends the sessions still open after its grace (none here) as a kill does: their commands too."""
    daemon = proxy_daemon(tmp_path_factory, "sshstop", "ssh", {"sessions.shutdown_grace": "0s"}, wait=True)
    client, pid = None, 0
    try:
        async with admin_http(daemon) as http:
            api = SshApi(daemon, http, target)
            secret, _ = await api.credential(await api.role())
        daemon.ssh_port = daemon.proxy_port
        client = subprocess.Popen(ssh_args(daemon, secret, "echo pid=$$; for i in $(seq 600); do sleep 0.1; done"),
                                  stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        line = client.stdout.readline()
        assert line.startswith(b"pid="), line
        pid = int(line[4:])
        assert daemon.stop() == 0
        await until_gone(pid)
        assert client.wait(30) == 254
        assert b"gateway shutting down: the session was closed" in client.stderr.read()
    finally:
        if client is not None and client.poll() is None:
            client.kill()
            client.wait()
        if pid and group_alive(pid):
            os.killpg(pid, signal.SIGKILL)
        if daemon.process is not None and daemon.process.poll() is None:
            daemon.stop()


# --------------------------------------------------------------------------- failures


async def test_target_down_or_refusing_the_key_is_a_clear_message_and_a_closed_session(gateway, api, target, tmp_path):
    down = await api.role(port=free_port())
    secret, session_id = await api.credential(down)
    result = ssh(gateway, secret, "true")
    expected = f'could not connect to the target of connection "{down["name"]}": connection refused'
    assert result.returncode == 254 and result.stderr.decode().strip() == expected
    session = await api.done_session(session_id)
    assert session["exit_code"] == 254 and of_kind(session, "e") == [expected]

    from tests.sshpeer import keygen
    stranger = keygen(tmp_path / "stranger").read_text()
    wrong_key = await api.role(key=stranger)
    secret, session_id = await api.credential(wrong_key)
    result = scp(gateway, secret, f"{secret}@127.0.0.1:/etc/hostname", str(tmp_path / "x"))
    assert result.returncode != 0
    expected = (f'could not connect to the target of connection "{wrong_key["name"]}": '
                "the target refused the connection's credentials")
    assert expected.encode() in result.stderr
    session = await api.done_session(session_id)
    assert session["exit_code"] == 254 and of_kind(session, "e") == [expected]
    assert stranger not in json.dumps(session)

    other_host_key = (tmp_path / "stranger.pub").read_text()
    wrong_host = await api.role(host_key=other_host_key)
    secret, session_id = await api.credential(wrong_host)
    result = ssh(gateway, secret, "true")
    assert result.returncode == 254 and b"its host key does not match the connection's HOST_KEY" in result.stderr


async def test_target_dying_mid_session_is_told_to_the_client(gateway, api):
    role = await api.role()
    secret, session_id = await api.credential(role)
    # $PPID of the command is sshd's process for this connection
    result = ssh(gateway, secret, "echo before; sleep 0.5; kill -9 $PPID; sleep 5; echo never")
    assert result.returncode == 254 and result.stdout == b"before\n"
    message = f'the target of connection "{role["name"]}" closed the channel without an exit status'
    assert message.encode() in result.stderr
    session = await api.done_session(session_id)
    assert session["exit_code"] == 254 and message in of_kind(session, "e")


async def test_client_disconnecting_mid_transfer_closes_and_records_the_session(gateway, api):
    role = await api.role()
    secret, session_id = await api.credential(role)
    client = subprocess.Popen(ssh_args(gateway, secret, "cat /dev/zero"), stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert client.stdout is not None
    received = 0
    while received < (8 << 20):
        received += len(client.stdout.read1(1 << 20))
    client.kill()
    client.wait(10)
    session = await api.done_session(session_id)
    assert session["status"] == "done"
    assert "the client disconnected with a channel still open" in of_kind(session, "e")
    assert session["event_size"] >= 8 << 20

    # the daemon keeps serving others
    secret, _ = await api.credential(role)
    assert ssh(gateway, secret, "echo alive").stdout == b"alive\n"


# --------------------------------------------------------------------------- gathered writes


class _CountedTransport:
    """A real transport that counts the send calls made on it (``writelines`` of a ``GatheredTransport``)."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.calls = 0
        self.writes = 0  # the writes gathered into those calls

    def writelines(self, lines: list[bytes]) -> None:
        self.calls += 1
        self.writes += len(lines)
        self.transport.writelines(lines)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


async def test_ssh_writes_of_one_loop_turn_leave_in_one_send_call_and_every_byte_arrives_in_order(target):
    """proxies/ssh/writes.py, on the target connection as the gateway makes it: a 4 MiB upload (asyncssh writes
    an SSH_MSG_IGNORE before each 32 KiB data packet) goes out in far fewer send calls than packets, intact."""
    import asyncssh

    from proxies.ssh.target import TargetSettings, connect_target
    from proxies.ssh.writes import GatheredTransport, gather_writes

    class Gathering(asyncssh.SSHClient):
        def connection_made(self, conn: asyncssh.SSHClientConnection) -> None:
            nonlocal counted
            gather_writes(conn)
            gathered = conn._transport  # type: ignore[attr-defined]
            assert isinstance(gathered, GatheredTransport)
            counted = gathered.transport = _CountedTransport(gathered.transport)  # type: ignore[assignment]

    counted: _CountedTransport | None = None
    settings = TargetSettings(host="127.0.0.1", port=target.port, user=target.user,
                              private_key=target.private_key_text, host_key=target.host_public_key)
    conn = await connect_target(settings, "gathered", Gathering)
    try:
        payload = os.urandom(4 << 20)
        result = await conn.run("sha256sum", input=payload, encoding=None, check=True)
        assert result.stdout.split()[0].decode() == hashlib.sha256(payload).hexdigest()
        echoed = await conn.run("cat", input=payload, encoding=None, check=True)  # both ways, in order
        assert echoed.stdout == payload
    finally:
        conn.close()
        await conn.wait_closed()
    assert counted is not None
    assert counted.writes >= 2 * 2 * (4 << 20) // 32768  # an ignore and a data packet per 32 KiB, two uploads
    assert counted.calls * 3 < counted.writes, (counted.calls, counted.writes)


async def test_openssh_gets_no_ssh_msg_ignore_before_each_packet_unless_it_chose_cbc(gateway, api):
    """proxies/ssh/writes.py skip_ignore_packets, seen by OpenSSH's own client (``-vvv`` logs each
    SSH_MSG_IGNORE it takes in): a 2 MiB ``cat`` through the gateway (asyncssh put one before each of its 32 KiB
    data packets) brings none with GCM, and still one before each data packet with CBC, the mode they counter."""
    role = await api.role()
    received = {}
    for cipher in ("aes128-gcm@openssh.com", "aes128-cbc"):
        secret, _ = await api.credential(role)
        done = clients.ssh(gateway.ssh_port, secret, "head -c 2097152 /dev/zero", options=[
            *CLIENT_OPTIONS, "-vvv", "-o", f"Ciphers={cipher}"])
        assert done.returncode == 0 and len(done.stdout) == 2 << 20, done.stderr[-2000:]
        assert f"cipher: {cipher}".encode() in done.stderr
        received[cipher] = done.stderr.count(b"Received SSH2_MSG_IGNORE")
    assert received["aes128-gcm@openssh.com"] == 0, received
    assert received["aes128-cbc"] >= (2 << 20) // 32768, received


async def test_openssh_reads_the_gateways_gcm_packets_across_key_renewals(gateway, api):
    """proxies/ssh/gcm.py GatewayGCM, seen by OpenSSH: ``seq`` output (about 2.9 MB) through the gateway with each
    GCM cipher, the client renewing the keys after 256 KiB (each renewal a new cipher state on both sides): every
    byte arrives, in order (one wrong IV or tag and OpenSSH drops the connection with a MAC error)."""
    role = await api.role()
    expected = "".join(f"{n}\n" for n in range(1, 400001)).encode()
    for cipher in ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com"):
        secret, _ = await api.credential(role)
        done = clients.ssh(gateway.ssh_port, secret, "seq 1 400000", options=[
            *CLIENT_OPTIONS, "-v", "-o", f"Ciphers={cipher}", "-o", "RekeyLimit=256K"])
        assert done.returncode == 0 and done.stdout == expected, done.stderr[-2000:]
        assert f"cipher: {cipher}".encode() in done.stderr
        # the first keys and at least one renewal while the data flowed (asyncssh holds its data during one)
        assert done.stderr.count(b"SSH2_MSG_NEWKEYS received") >= 2, done.stderr[-2000:]
    # and the packets were the gateway's own GCM, not asyncssh's (which OpenSSH reads as well)
    assert "AES-GCM packets by the gateway's GatewayGCM" in gateway.log_text()


async def test_no_packet_log_line_is_built_for_the_gateways_connections_and_channels(target, caplog):
    """proxies/ssh/packets.py unlogged_packets: asyncssh builds a log line for every packet, and writes it at its
    debug level 3 (packet dumps, with passwords and data). Turned on here to see them: a connection and channel
    as asyncssh makes them log their packets; the gateway's log none (the level is never turned on in gatewayd,
    so the lines were built for nothing)."""
    import logging

    import asyncssh

    from proxies.ssh.packets import unlogged_packets
    from proxies.ssh.target import TargetSettings, connect_target

    class Client(asyncssh.SSHClient):
        def __init__(self, quiet: bool) -> None:
            self.quiet = quiet

        def connection_made(self, conn: asyncssh.SSHClientConnection) -> None:
            if self.quiet:
                unlogged_packets(conn)

    class Session(asyncssh.SSHClientSession):  # type: ignore[type-arg]
        def __init__(self, quiet: bool) -> None:
            self.quiet, self.received = quiet, 0

        def connection_made(self, chan) -> None:  # type: ignore[no-untyped-def]
            if self.quiet:
                unlogged_packets(chan)

        def data_received(self, data: bytes, datatype: object) -> None:
            self.received += len(data)

    settings = TargetSettings(host="127.0.0.1", port=target.port, user=target.user,
                              private_key=target.private_key_text, host_key=target.host_public_key)
    dumped = {}
    asyncssh.set_debug_level(3)
    try:
        for quiet in (False, True):
            conn = await connect_target(settings, "quiet", lambda: Client(quiet))
            caplog.clear()
            try:
                with caplog.at_level(logging.DEBUG, logger="asyncssh"):
                    chan, session = await conn.create_session(lambda: Session(quiet), "head -c 1048576 /dev/zero",
                                                              encoding=None)
                    await chan.wait_closed()
            finally:
                conn.close()
                await conn.wait_closed()
            assert session.received == 1 << 20
            dumps = [r.getMessage() for r in caplog.records if hasattr(r, "packet")]  # a dump carries its packet
            dumped[quiet] = (len(dumps), sum("MSG_CHANNEL_DATA" in dump for dump in dumps))
    finally:
        asyncssh.set_debug_level(1)
    assert dumped[False][1] >= (1 << 20) // 32768, dumped  # the check can see them...
    # ...and the gateway's connection and channel build none: only the channel's open, sent before it is handed over
    assert dumped[True] == (1, 0), dumped


async def test_a_gathered_transport_sends_what_it_holds_before_it_closes_or_aborts():
    """Nothing written is lost or reordered by a close or an abort in the same turn of the loop."""
    from proxies.ssh.writes import GatheredTransport

    loop = asyncio.get_running_loop()
    for end in ("close", "abort"):
        ours, theirs = socket.socketpair()
        transport, _ = await loop.create_connection(asyncio.Protocol, sock=ours)
        gathered = GatheredTransport(transport, loop)  # type: ignore[arg-type]
        for piece in (b"one ", b"two ", b"three"):
            gathered.write(piece)
        assert gathered.pending  # held until the turn ends...
        getattr(gathered, end)()  # ...or until the transport closes
        theirs.setblocking(False)
        received = b""
        while chunk := await asyncio.wait_for(loop.sock_recv(theirs, 1024), 10):
            received += chunk
        theirs.close()
        assert received == b"one two three", end


async def test_asyncssh_is_handed_a_socket_read_in_pieces_and_every_byte_arrives_in_order(target):
    """proxies/ssh/reads.py, on the target connection as the gateway makes it: a 4 MiB download arrives in socket
    reads of up to 256 KiB, which asyncssh is handed in pieces of READ_PIECE at most (so it never copies a whole
    read's rest per packet), and every byte arrives, in order."""
    import asyncssh

    from proxies.ssh.reads import READ_PIECE, SplitReads, split_reads
    from proxies.ssh.target import TargetSettings, connect_target

    pieces: list[int] = []

    class Splitting(asyncssh.SSHClient):
        def connection_made(self, conn: asyncssh.SSHClientConnection) -> None:
            split_reads(conn)
            transport = conn._transport  # type: ignore[attr-defined]
            assert isinstance(transport.get_protocol(), SplitReads)
            handed = conn.data_received  # what SplitReads calls, looked up on each call

            def counted(data: bytes, datatype: object = None) -> None:
                pieces.append(len(data))
                handed(data)
            conn.data_received = counted  # type: ignore[method-assign]

            # reads larger than a piece even on a busy machine, where a reader kept up would take each packet
            # as it comes: the socket is left unread for moments, so that the kernel holds more than a piece
            loop = asyncio.get_running_loop()

            def rest() -> None:
                if not transport.is_closing():
                    transport.pause_reading()
                    loop.call_later(0.02, read)

            def read() -> None:
                if not transport.is_closing():
                    transport.resume_reading()
                    loop.call_later(0.005, rest)
            loop.call_soon(rest)

    settings = TargetSettings(host="127.0.0.1", port=target.port, user=target.user,
                              private_key=target.private_key_text, host_key=target.host_public_key)
    conn = await connect_target(settings, "split", Splitting)
    try:
        payload = os.urandom(4 << 20)
        echoed = await conn.run("cat", input=payload, encoding=None, check=True)
        assert echoed.stdout == payload
    finally:
        conn.close()
        await conn.wait_closed()
    assert sum(pieces) > len(payload)  # everything the connection read went through SplitReads
    assert max(pieces) <= READ_PIECE, max(pieces)
    assert pieces.count(READ_PIECE) >= 8, pieces[:40]  # reads larger than a piece came, and were split


# --------------------------------------------------------------------------- one-time scripts


@pytest.fixture(scope="module")
async def core(tmp_path_factory):
    """An in-process gateway core (store, sessions, recording, guard rails) to call the script runner with."""
    from tests.conftest import core_gateway

    async with core_gateway(tmp_path_factory.mktemp("sshscript"), {
            "api.listen": f"127.0.0.1:{free_port()}", "listeners.postgres": "", "listeners.ssh": "",
            "listeners.rdp": "", "listeners.http": "", "listeners.mysql": ""}) as gateway:
        yield gateway


async def script_session(core, target: SshTarget, rules: dict | None = None, port: int | None = None):
    from gatewayd.models import Connection, GuardRail, new_id

    user = await core.identity.ensure_local_user("scripter@example.com", "Scripter", [])
    connection = Connection(
        id=new_id(), org_id=user.org_id, name=f"ssh-script-{uuid.uuid4().hex[:8]}", resource_name="scripts",
        type="custom", subtype="ssh",
        secret={"envvar:HOST": b64("127.0.0.1"), "envvar:PORT": b64(str(port or target.port)),
                "envvar:USER": b64(target.user), "envvar:PRIVATE_KEY": b64(target.private_key_text)})
    await core.store.create_connection(connection)
    if rules:
        await core.store.save_guardrail(GuardRail(id=new_id(), org_id=user.org_id, name=f"rail-{connection.name}",
                                                  connection_ids=[connection.id], **rules), create=True)
        core.guardrails.invalidate()
    return ScriptSession(user, connection)


@dataclass
class ScriptSession:
    """A connection to run one script on, and (once started) its job."""

    user: Any
    connection: Any
    job: Any = None

    @property
    def id(self) -> str:
        return self.job.session_id

    @property
    def done(self) -> asyncio.Event:
        return self.job.live.done


async def run_script(core, live: ScriptSession, script: str):
    """The SSH runner, as the API runs it: through the review service and the session pipeline."""
    from proxies.ssh.script import run_script as runner

    core.reviews.runners["ssh"] = runner
    live.job = await core.reviews.run_script(live.user, live.connection, script)
    return await live.job.result


async def recorded(core, live) -> list[tuple[str, str]]:
    await live.job.result  # the session is closed with the script's exit code
    return [(e.kind, e.data.decode()) for e in await core.store.read_events(live.id)]


async def test_script_runner_runs_one_exec_with_guard_rails_and_recording(core, target):
    from proxies import available_script_runners
    from proxies.ssh.script import run_script as runner

    assert available_script_runners()["ssh"] is runner
    live = await script_session(core, target)
    result = await run_script(core, live, "echo out-$((2*21)); echo err >&2; exit 3")
    assert (result.output, result.exit_code, result.output_status) == ("out-42\nerr\n", 3, "failed")
    assert await recorded(core, live) == [("i", "echo out-$((2*21)); echo err >&2; exit 3"), ("o", "out-42\n"),
                                          ("e", "err\n")]

    rules = {"input": {"rules": [{"type": "deny_words_list", "words": ["reboot"]}]},
             "output": {"rules": [{"type": "pattern_match", "pattern_regex": "secret-[0-9]+"}]}}
    live = await script_session(core, target, rules)
    result = await run_script(core, live, "sudo reboot")
    message = "validation error, match guard rails input rule, type=deny_words_list, words=[reboot]"
    assert (result.output, result.exit_code) == (message, 254)
    assert await recorded(core, live) == [("i", "sudo reboot"), ("e", message)]

    # an output rule's match ends the command on the target as a kill does (the close alone would leave it running)
    live = await script_session(core, target, rules)
    pidfile = Path(f"/tmp/gw-script-{uuid.uuid4().hex}-pid")
    command = f"echo $$ > {pidfile}; echo secret-$((6*7)); for i in $(seq 200); do sleep 0.1; done"
    try:
        result = await run_script(core, live, command)
        message = "validation error, match guard rails output rule, type=pattern_match, pattern=secret-[0-9]+"
        assert (result.output, result.exit_code) == (message, 254)
        assert await recorded(core, live) == [("i", command), ("e", message), ("e", SIGNALLED)]
        await until_gone(int(pidfile.read_text()))
    finally:
        pidfile.unlink(missing_ok=True)

    live = await script_session(core, target, port=free_port())
    result = await run_script(core, live, "true")
    assert result.exit_code == 254 and "connection refused" in result.output

    # a command ended by a signal: 128 + its number, as through native exec
    live = await script_session(core, target)
    result = await run_script(core, live, "kill -TERM $$")
    assert result.exit_code == 128 + signal.SIGTERM
    assert await recorded(core, live) == [("i", "kill -TERM $$"), ("e", "the command was terminated by signal TERM")]


async def test_killing_a_script_session_stops_the_command_on_the_target(core, target):
    """The command is signalled (closing the connection alone only closed its pipes: it ran on for its 20 s)."""
    live = await script_session(core, target)
    started = Path(f"/tmp/gw-script-{uuid.uuid4().hex}-started")
    task = asyncio.ensure_future(run_script(core, live, f"echo $$ > {started}.tmp; mv {started}.tmp {started}; "
                                                        "for i in $(seq 200); do sleep 0.1; done"))
    try:
        async with asyncio.timeout(15):
            while not started.exists():
                await asyncio.sleep(0.05)
        pid = int(started.read_text())
        assert group_alive(pid)
        await core.sessions.kill(live.id, "killed by an admin")
        await until_gone(pid)
        result = await asyncio.wait_for(task, 15)
        assert (result.output, result.exit_code) == ("killed by an admin", 254)
        assert live.done.is_set()
        assert (await recorded(core, live))[-2:] == [("e", SIGNALLED), ("e", "killed by an admin")]
    finally:
        if started.exists() and group_alive(pid := int(started.read_text())):
            os.killpg(pid, signal.SIGKILL)
        started.unlink(missing_ok=True)


# --------------------------------------------------------------------------- agent, X11, live configuration


async def test_a_subsystem_other_than_sftp_is_refused_on_the_record(gateway, api):
    """``ssh -s host netconf``: refused, and the session and the audit log say so (it was refused unrecorded)."""
    role = await api.role()
    secret, session_id = await api.credential(role)
    result = ssh(gateway, secret, "-s", "netconf")
    assert result.returncode == 255 and b"subsystem" in result.stderr, result.stderr
    session = await api.done_session(session_id)
    message = 'subsystem "netconf" refused: the gateway relays only sftp'
    assert events(session) == [("e", message)]
    status, logs = await api("GET", "/audit/logs?action=ssh.subsystem&outcome=failure")
    assert status == 200 and any(e["error_message"] == message
                                 and e["request_payload_redacted"]["session_id"] == session_id
                                 for e in logs["data"]), logs["data"][:3]


async def test_agent_and_x11_forwarding_are_refused(gateway, api, target, tmp_path):
    agent = subprocess.run(["ssh-agent", "-s", "-a", str(tmp_path / "agent.sock")], capture_output=True, text=True,
                           check=True)
    pid = int(agent.stdout.split("SSH_AGENT_PID=")[1].split(";")[0])
    try:
        env = {**os.environ, "SSH_AUTH_SOCK": str(tmp_path / "agent.sock"), "DISPLAY": ":99"}
        command = 'echo "agent=[$SSH_AUTH_SOCK] display=[$DISPLAY]"'
        direct = subprocess.run(["ssh", "-o", "ForwardAgent=yes", *CLIENT_OPTIONS, "-i", str(target.client_key),
                                 "-p", str(target.port), f"{target.user}@127.0.0.1", command], env=env,
                                capture_output=True, stdin=subprocess.DEVNULL, timeout=60)
        assert direct.returncode == 0 and b"agent=[/tmp/ssh-" in direct.stdout  # the target would allow it
        role = await api.role()
        secret, session_id = await api.credential(role)
        result = subprocess.run(["ssh", "-v", "-o", "ForwardAgent=yes", "-o", "ForwardX11=yes",
                                 *ssh_args(gateway, secret, command)[1:]], env=env, capture_output=True,
                                stdin=subprocess.DEVNULL, timeout=60)
        assert result.returncode == 0, result.stderr
        assert result.stdout == b"agent=[] display=[]\n"
        # both requests were sent (auth-agent-req@openssh.com, x11-req), and each refusal is on the record
        assert b"Requesting authentication agent forwarding" in result.stderr, result.stderr
        assert b"Requesting X11 forwarding" in result.stderr, result.stderr
        agent_refused = "agent forwarding refused: the gateway does not offer it"
        x11_refused = "X11 forwarding refused: the gateway does not offer it"
        session = await api.done_session(session_id)
        assert sorted(of_kind(session, "e")) == [x11_refused, agent_refused], events(session)
        for action, message in (("ssh.agent_forward", agent_refused), ("ssh.x11_forward", x11_refused)):
            status, logs = await api("GET", f"/audit/logs?action={action}&outcome=failure")
            assert status == 200 and [e["request_payload_redacted"]["session_id"] for e in logs["data"]
                                      if e["error_message"] == message] == [session_id], logs["data"][:3]
        assert "MIT-MAGIC-COOKIE" not in json.dumps(logs["data"]) + json.dumps(events(session))
    finally:
        os.kill(pid, signal.SIGTERM)


async def test_listener_restarts_live_on_a_new_address_and_host_key(gateway, api, target):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    role = await api.role()
    status, original = await api("GET", "/serverconfig/misc")
    assert status == 200
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                            serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    port = free_port()
    try:
        status, body = await api("PUT", "/serverconfig/misc", {"ssh_server_config": {
            "listen_address": f"127.0.0.1:{port}", "hosts_key": base64.b64encode(pem).decode()}})
        assert status == 200, body
        scan = subprocess.run(["ssh-keyscan", "-t", "ed25519", "-p", str(port), "127.0.0.1"], capture_output=True,
                              timeout=30)
        assert public.split()[1] in scan.stdout
        secret, _ = await api.credential(role)
        moved = subprocess.run(["ssh", *CLIENT_OPTIONS, "-p", str(port), f"{secret}@127.0.0.1", "echo moved"],
                               capture_output=True, stdin=subprocess.DEVNULL, timeout=60)
        assert moved.stdout == b"moved\n", moved.stderr
        assert b"Connection refused" in ssh(gateway, secret, "true").stderr  # the old address is closed

        # a new host key alone restarts the listener too
        other = Ed25519PrivateKey.generate()
        status, body = await api("PUT", "/serverconfig/misc", {"ssh_server_config": {
            "listen_address": f"127.0.0.1:{port}", "hosts_key": base64.b64encode(other.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                serialization.NoEncryption())).decode()}})
        assert status == 200, body
        scan = subprocess.run(["ssh-keyscan", "-t", "ed25519", "-p", str(port), "127.0.0.1"], capture_output=True,
                              timeout=30)
        assert other.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                               serialization.PublicFormat.OpenSSH).split()[1] in scan.stdout

        status, body = await api("PUT", "/serverconfig/misc", {"ssh_server_config": {"listen_address": ""}})
        assert status == 200
        status, info = await api("GET", "/serverinfo")
        assert info["listeners"]["ssh"]["status"] == "stopped"
    finally:
        status, body = await api("PUT", "/serverconfig/misc", {"ssh_server_config": original["ssh_server_config"]})
        assert status == 200, body
    secret, _ = await api.credential(role)
    assert ssh(gateway, secret, "echo back").stdout == b"back\n"


# --------------------------------------------------------------------------- the narrow interface


async def test_the_listener_needs_nothing_but_its_proxy_context(tmp_path, target):
    """An in-process core hands the SSH proxy only its ProxyContext: a real ssh exec runs, recorded and closed."""
    from gatewayd.config import load_config
    from gatewayd.daemon import Gateway
    from gatewayd.models import Connection, new_id, rfc3339, utcnow
    from proxies.ssh.server import start

    core = Gateway(load_config(None, environ={}, overrides={"data_dir": str(tmp_path / "data"),
                                                              "sessions.flush_interval": "100ms"}))
    await core.open_core()
    await core.recording.start()
    listener = None
    try:
        org = await core.store.default_org()
        user = await core.identity.ensure_local_user("ann@example.com", "Ann", ["admin"])
        env = {"HOST": "127.0.0.1", "PORT": str(target.port), "USER": target.user,
               "PRIVATE_KEY": target.private_key_text}
        connection = Connection(id=new_id(), org_id=org.id, name="narrow", resource_name="narrow", type="custom",
                                subtype="ssh", secret={f"envvar:{k}": b64(v) for k, v in env.items()},
                                created_at=rfc3339(utcnow()), updated_at=rfc3339(utcnow()))
        await core.store.create_connection(connection)
        issued = await core.access.issue(user, connection, 600)
        port = free_port()
        listener = await start(core.proxy_context("ssh"), "127.0.0.1", port)
        command = ["ssh", *CLIENT_OPTIONS, "-p", str(port), f"{issued.secret}@127.0.0.1", "echo narrow-$((6*7))"]
        result = await asyncio.to_thread(subprocess.run, command, capture_output=True, stdin=subprocess.DEVNULL,
                                         timeout=60)
        assert result.returncode == 0 and result.stdout == b"narrow-42\n", result.stderr
        session_id = issued.credential.session_id
        async with asyncio.timeout(60):  # a guard against a hang, not a measure
            while (session := await core.store.get_session(session_id)).status != "done":
                await asyncio.sleep(0.05)
        assert session.exit_code == 0
        await core.recording.flush()
        assert [(e.kind, e.data) for e in await core.store.read_events(session_id)] == [
            ("i", b"echo narrow-$((6*7))"), ("o", b"narrow-42\n")]
    finally:
        if listener is not None:
            await listener.close()
            await listener.tasks.wait()
        await core.recording.stop()
        await core.close_core()
