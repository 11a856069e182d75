"""The host's command line on a bad day (issue 12, item 14): a mistyped GATEWAYD_ variable, a command run
outside the data dir, a password prompt without a terminal. Real ``gatewayd`` subprocesses, a real daemon."""

from __future__ import annotations

import os
import subprocess
import sys

import aiohttp
import pytest

from gatewayd.config import ConfigError, load_config
from tests.conftest import BIN, Daemon, free_port


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAYD_")}
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory):
    daemon = Daemon(tmp_path_factory.mktemp("hostcli") / "data").start()
    yield daemon
    assert daemon.stop() == 0


def test_a_mistyped_variable_stops_the_daemon_like_a_mistyped_key(tmp_path):
    data = tmp_path / "data"
    env = clean_env(GATEWAYD_DATA_DIR=str(data), GATEWAYD_API_LISTEN=f"127.0.0.1:{free_port()}",
                    GATEWAYD_LISTENERS_POSTGRES="", GATEWAYD_LISTENERS_SSH="", GATEWAYD_LISTENERS_RDP="",
                    GATEWAYD_LISTENERS_HTTP="", GATEWAYD_LISTENER_POSTGRES="127.0.0.1:1")  # the typo: LISTENER
    try:
        result = subprocess.run([str(BIN / "gatewayd"), "run"], env=env, capture_output=True, text=True,
                                timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("gatewayd ran with an unknown GATEWAYD_ variable")
    assert result.returncode == 2, result.stderr
    assert "GATEWAYD_LISTENER_POSTGRES: unknown setting (did you mean GATEWAYD_LISTENERS_POSTGRES?)" in result.stderr
    assert "Traceback" not in result.stderr
    assert not data.exists()


def test_variables_that_are_not_settings_stay_accepted(tmp_path):
    environ = {"GATEWAYD_CONFIG": "/etc/gatewayd/config.toml", "GATEWAYD_DATA_DIR": str(tmp_path),
               "GATEWAYD_CLIENT_CONFIG": "/home/x/login.json", "GATEWAYD_URL": "https://gw.example",
               "GATEWAYD_AUTH_OIDC_LINK_UNVERIFIED_EMAIL": "false"}
    assert load_config(None, environ=environ).data_dir == tmp_path
    with pytest.raises(ConfigError, match="GATEWAYD_DATADIR: unknown setting"):
        load_config(None, environ={**environ, "GATEWAYD_DATADIR": "/x"})


def test_a_cli_command_outside_the_data_dir_makes_no_store(gw, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = subprocess.run([str(BIN / "gatewayd"), "token", "create", "--email", "ops@example.com",
                             "--groups", "admin"], env=clean_env(), cwd=elsewhere, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and not result.stdout, result
    looked = elsewhere / "gatewayd-data" / "gatewayd.db"
    assert f"no gateway store at {looked}" in result.stderr and "embedded defaults" in result.stderr
    assert "Traceback" not in result.stderr
    assert list(elsewhere.iterdir()) == [], "the command created a store"

    # GATEWAYD_DATA_DIR (as the systemd unit says) finds the daemon's store, and its token works there
    result = subprocess.run([str(BIN / "gatewayd"), "token", "create", "--email", "ops@example.com",
                             "--groups", "admin"], env=clean_env(GATEWAYD_DATA_DIR=str(gw.data_dir)),
                            cwd=elsewhere, capture_output=True, text=True, timeout=60, check=True)
    token = result.stdout.strip()

    async def userinfo() -> int:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{gw.url}/userinfo", headers={"Authorization": f"Bearer {token}"}) as response:
                return response.status

    import asyncio

    assert asyncio.run(userinfo()) == 200


def test_user_passwd_without_a_terminal_says_use_password_stdin(gw):
    result = subprocess.run([str(BIN / "gatewayd"), "user", "passwd", "--email", "ops@example.com",
                             "--config", str(gw.config_path)], env=gw.env(), stdin=subprocess.DEVNULL,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result
    assert "use --password-stdin" in result.stderr and "Traceback" not in result.stderr
    ok = gw.cli("user", "passwd", "--email", "ops@example.com", "--password-stdin", input="long enough pw\n")
    assert "password set" in ok.stderr


def test_python_m_gatewayd_reaches_the_same_checks(tmp_path):
    result = subprocess.run([sys.executable, "-m", "launcher", "token", "create", "--email", "a@example.com"],
                            env=clean_env(GATEWAYD_DATA_DIR=str(tmp_path / "none")), cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "no gateway store at" in result.stderr
    assert "$GATEWAYD_DATA_DIR" in result.stderr and not (tmp_path / "none").exists()


def test_the_store_is_private_in_a_data_dir_made_before(tmp_path):
    """The SQLite store (recordings, audit log) was created with the umask's 0644, and its -wal and -shm
    likewise: only a data dir the daemon made itself (0700) kept other local users out of it, not one made
    before its first start (0755 here, as `mkdir` makes it), nor a store.path elsewhere. Now the files are
    0600, and an existing readable one is taken back."""
    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    data.chmod(0o755)
    umask = os.umask(0o022)  # as a shell's: the daemon inherits it
    try:
        daemon = Daemon(data).start()
    finally:
        os.umask(umask)
    store = data / "gatewayd.db"
    try:
        assert store.stat().st_mode & 0o777 == 0o600
    finally:
        assert daemon.stop() == 0
    store.chmod(0o644)  # made by an earlier version
    daemon.start()
    try:
        daemon.cli("token", "create", "--email", "ops@example.com", "--groups", "admin")  # a write: the -wal
        files = [store, data / "gatewayd.db-wal", data / "gatewayd.db-shm"]
        assert {path.name: oct(path.stat().st_mode & 0o777) for path in files} == {
            path.name: oct(0o600) for path in files}
    finally:
        assert daemon.stop() == 0


def test_a_secret_setting_of_the_wrong_type_is_not_quoted_in_the_error(tmp_path):
    """`client_secret = 123456789` (a number: written without quotes) stopped the daemon with `expected a string,
    got 123456789`: the secret in the terminal and the service's journal. Now secret settings are named, their
    values not shown."""
    secret = "918273645546372819"
    for section, key, value in (("auth.oidc", "client_secret", secret), ("secrets", "key", f"[\"{secret}\"]"),
                                ("ssh", "hosts_key", f"{{ pem = \"{secret}\" }}")):
        config = tmp_path / f"{key}.toml"
        config.write_text(f"data_dir = \"{tmp_path / 'data'}\"\n[{section}]\n{key} = {value}\n")
        result = subprocess.run([str(BIN / "gatewayd"), "run", "--config", str(config)], env=clean_env(),
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and f"{section}.{key}: expected" in result.stderr, result.stderr
        assert secret not in result.stderr and "not shown" in result.stderr, result.stderr


def test_a_data_dir_made_before_is_made_private(tmp_path):
    """The data dir was made 0700 only when the daemon made it: one made before its first start (`mkdir`, 0755)
    stayed open, and every local user read what is kept there outside the store (the runbooks' clones, the
    names of the RDP frames' folders). Now it is taken back to 0700 at start."""
    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    data.chmod(0o755)
    daemon = Daemon(data).start()
    try:
        assert data.stat().st_mode & 0o777 == 0o700
    finally:
        assert daemon.stop() == 0
