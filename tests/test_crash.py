"""Crash and signal behaviour of real processes."""

from __future__ import annotations

import base64
import signal
import subprocess
import sys

import aiohttp

from tests.conftest import ROOT, Daemon


async def test_sigkilled_process_sessions_are_closed_on_restart_with_journaled_events_replayed(tmp_path):
    """What the dead process journaled and never stored reaches the store at the next start (once), before the
    session is closed; the close says what may still be missing (a gap), so verify does not call it intact."""
    gw = Daemon(tmp_path / "data")
    writer = subprocess.Popen([sys.executable, str(ROOT / "tests" / "crash_writer.py"), str(gw.config_path)],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT, env=gw.env())
    session_id = writer.stdout.readline().strip()
    assert session_id, "crash writer did not start"
    writer.send_signal(signal.SIGKILL)
    writer.wait(10)

    gw.start()
    try:
        token = gw.token("admin@example.com", groups="admin")
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as http:
            async with http.get(f"{gw.url}/sessions/{session_id}?expand=event_stream") as response:
                session = await response.json()
            async with http.get(f"{gw.url}/sessions/{session_id}/verify") as response:
                verified = await response.json()
        assert session["status"] == "done" and session["end_date"] and session["exit_code"] == 254
        events = [(kind, base64.b64decode(data)) for _, kind, data in session["event_stream"]]
        assert events[:3] == [("i", b"before the crash\n"), ("o", b"flushed output\n"), ("i", b"never flushed\n")]
        assert events[3][0] == "e" and events[3][1].startswith(b"recording gap: the process that held the session")
        assert events[4:] == [("e", b"session closed on gateway restart: the gateway stopped while it was open")]
        assert verified["sealed"] and not verified["verified"]
        assert verified["problems"] == [f"event 3: {events[3][1].decode()}"], verified
        log = gw.log_text()
        assert "closed sessions left open by a previous run" in log
        assert '"message": "replayed the journal of a process that stopped"' in log
        assert len(list((gw.data_dir / "journal").iterdir())) == 1  # the dead run's journal went: this run's is left
    finally:
        assert gw.stop() == 0


def test_sigterm_stops_cleanly_and_logs_without_secrets(tmp_path):
    gw = Daemon(tmp_path / "data").start()
    token = gw.token("admin@example.com", groups="admin")
    assert gw.stop(signal.SIGTERM) == 0
    log = gw.log_text()
    assert '"message": "gatewayd stopped"' in log
    assert token not in log and token.split(".")[1] not in log
    # SIGINT behaves the same
    gw.start()
    assert gw.stop(signal.SIGINT) == 0


def test_cli_token_create_prints_one_token(tmp_path):
    gw = Daemon(tmp_path / "data").start()  # the CLI works on the store the daemon made; it never makes one
    assert gw.stop() == 0
    result = gw.cli("token", "create", "--email", "ops@example.com", "--groups", "admin,auditor", "--ttl", "5m")
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].count(".") == 2
    import jwt

    claims = jwt.decode(lines[0], options={"verify_signature": False})
    assert claims["email"] == "ops@example.com" and claims["exp"] - claims["iat"] == 300
    bad = gw.cli("token", "create", "--email", "ops@example.com", "--ttl", "soon", check=False)
    assert bad.returncode == 2 and "--ttl" in bad.stderr


def test_sd_notify_ready_and_stopping(tmp_path):
    import socket

    path = tmp_path / "notify.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(path))
    listener.settimeout(20)
    gw = Daemon(tmp_path / "data")
    original_env = gw.env
    gw.env = lambda: {**original_env(), "NOTIFY_SOCKET": str(path)}
    try:
        gw.start()
        assert listener.recv(256) == b"READY=1"
        assert gw.stop() == 0
        assert listener.recv(256) == b"STOPPING=1"
    finally:
        listener.close()


def test_an_unreachable_notify_socket_is_logged_and_the_daemon_runs_on(tmp_path):
    """A NOTIFY_SOCKET nobody listens on (a supervisor gone, a stale variable) costs a warning, not the daemon."""
    gw = Daemon(tmp_path / "data")
    original_env = gw.env
    gw.env = lambda: {**original_env(), "NOTIFY_SOCKET": str(tmp_path / "nobody.sock")}
    gw.start()  # the API answers
    assert gw.stop() == 0
    log = gw.log_text()
    assert log.count('"message": "sd_notify failed", "notification": "READY=1"') == 1
    assert '"notification": "STOPPING=1"' in log and "Traceback" not in log
