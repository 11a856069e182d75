"""Configuration: defaults, the example file, overrides and errors that name the key."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from gatewayd.config import ConfigError, all_settings, load_config, parse_duration

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "config.example.toml"


def test_example_file_documents_every_key_with_its_default():
    text = EXAMPLE.read_text()
    defaults = load_config(None, environ={})
    assert load_config(EXAMPLE, environ={}).as_dict() == defaults.as_dict()
    for key in all_settings():
        section, _, name = key.rpartition(".")
        if section:
            assert f"[{section}]" in text, f"section of {key} missing"
        assert re.search(rf"^{re.escape(name)} = ", text, re.M), f"{key} missing from config.example.toml"


def test_embedded_defaults_match_the_decisions():
    config = load_config(None, environ={})
    assert config["api.listen"] == "127.0.0.1:8009"
    assert config["listeners.postgres"] == "127.0.0.1:15432"
    assert config["listeners.ssh"] == "127.0.0.1:12222"
    assert config["listeners.rdp"] == "127.0.0.1:13389"
    assert config["listeners.http"] == "127.0.0.1:18888"
    assert config["auth.issuer"] == "local"
    assert config["store.driver"] == "sqlite"
    assert config.data_dir == Path("./gatewayd-data")


def test_environment_overrides_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[api]\nlisten = "127.0.0.1:9000"\n')
    config = load_config(path, environ={"GATEWAYD_API_LISTEN": "127.0.0.1:9100", "GATEWAYD_DATA_DIR": "/x",
                                        "GATEWAYD_SESSIONS_SHUTDOWN_GRACE": "250ms",
                                        "GATEWAYD_AUTH_OIDC_SCOPES": "openid, email"})
    assert config["api.listen"] == "127.0.0.1:9100"
    assert config.data_dir == Path("/x")
    assert config["sessions.shutdown_grace"] == 0.25
    assert config["auth.oidc.scopes"] == ["openid", "email"]


@pytest.mark.parametrize("content, key", [
    ('[api]\nlisten = "127.0.0.1:99999"\n', "api.listen"),
    ('[api]\nlisten = "nocolon"\n', "api.listen"),
    ('[listeners]\npostgres = "127.0.0.1:http"\n', "listeners.postgres"),
    ('[api]\nlisten_typo = "x"\n', "api.listen_typo"),
    ('bogus = 1\n', "bogus"),
    ('[log]\nformat = "xml"\n', "log.format"),
    ('[sessions]\nrecording_cap_bytes = "big"\n', "sessions.recording_cap_bytes"),
    ('[sessions]\nshutdown_grace = "soon"\n', "sessions.shutdown_grace"),
    ('[auth]\nissuer = "oidc"\n', "auth.oidc.issuer_url"),
    ('[http]\napps_domain = "http://apps.example.com"\n', "http.apps_domain"),
    ('[http]\napps_domain = "apps.example.com:8080"\n', "http.apps_domain"),
    ('[http]\npublic_scheme = "wss"\n', "http.public_scheme"),
])
def test_bad_values_name_the_key(tmp_path, content, key):
    path = tmp_path / "bad.toml"
    path.write_text(content)
    with pytest.raises(ConfigError) as err:
        load_config(path, environ={})
    assert str(err.value).startswith(key)


def test_the_http_apps_domain_is_normalized():
    for given, kept in (("*.Apps.Example.com", "apps.example.com"), (".localhost", "localhost"), ("", "")):
        assert load_config(None, environ={"GATEWAYD_HTTP_APPS_DOMAIN": given})["http.apps_domain"] == kept


def test_unreadable_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml", environ={})
    broken = tmp_path / "broken.toml"
    broken.write_text("[api\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(broken, environ={})


def test_durations():
    assert parse_duration("500ms") == 0.5
    assert parse_duration("12h") == 43200
    assert parse_duration("2d") == 172800
    assert parse_duration(3) == 3.0
    with pytest.raises(ConfigError):
        parse_duration("-1s")


def test_cli_exits_non_zero_naming_the_key(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[listeners]\nssh = "127.0.0.1:70000"\n')
    result = subprocess.run([sys.executable, "-m", "launcher", "run", "--config", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "listeners.ssh" in result.stderr and "70000" in result.stderr


def test_cli_version():
    from gatewayd import __version__

    result = subprocess.run([sys.executable, "-m", "launcher", "version"], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == __version__


def test_cli_says_which_address_is_taken(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {"GATEWAYD_DATA_DIR": str(tmp_path / "data"), "GATEWAYD_API_LISTEN": f"127.0.0.1:{port}",
               "GATEWAYD_LISTENERS_POSTGRES": "", "PATH": "/usr/bin:/bin"}
        result = subprocess.run([sys.executable, "-m", "launcher", "run"], capture_output=True, text=True,
                                timeout=60, env=env)
    assert result.returncode == 2
    assert f"api.listen: cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_postgres_store_is_named_by_a_url_and_the_url_is_never_shown(tmp_path):
    path = tmp_path / "pg.toml"
    path.write_text('[store]\ndriver = "postgres"\nurl = "postgresql://gw:file-secret@db.example:5432/gw"\n')
    assert load_config(path, environ={})["store.url"] == "postgresql://gw:file-secret@db.example:5432/gw"
    from_env = load_config(path, environ={"GATEWAYD_STORE_URL": "postgres://gw:env-secret@db2/gw"})
    assert (from_env["store.driver"], from_env["store.url"]) == ("postgres", "postgres://gw:env-secret@db2/gw")
    with pytest.raises(ConfigError, match=r"^store\.url: required when store\.driver = 'postgres'"):
        load_config(None, environ={"GATEWAYD_STORE_DRIVER": "postgres"})
    with pytest.raises(ConfigError, match=r"^store\.url: expected a URL") as err:
        load_config(path, environ={"GATEWAYD_STORE_URL": "mysql://gw:env-secret@db2/gw"})
    assert "env-secret" not in str(err.value)
    assert load_config(None, environ={})["store.driver"] == "sqlite"  # the embedded default stays


def test_cli_says_the_postgres_store_cannot_be_opened_without_its_password(tmp_path):
    import socket

    from tests.conftest import free_port

    with socket.socket() as closed:  # nothing listens on this port
        closed.bind(("127.0.0.1", 0))
        url = f"postgresql://gw:pa%24%24-hunter2@127.0.0.1:{closed.getsockname()[1]}/gw"
        env = {"GATEWAYD_DATA_DIR": str(tmp_path / "data"), "GATEWAYD_API_LISTEN": f"127.0.0.1:{free_port()}",
               "GATEWAYD_LISTENERS_POSTGRES": "", "GATEWAYD_LISTENERS_SSH": "", "GATEWAYD_LISTENERS_RDP": "",
               "GATEWAYD_LISTENERS_HTTP": "", "GATEWAYD_STORE_DRIVER": "postgres", "GATEWAYD_STORE_URL": url,
               "PATH": "/usr/bin:/bin"}
        for command in (["run"], ["token", "create", "--email", "a@example.com"]):
            result = subprocess.run([sys.executable, "-m", "launcher", *command], capture_output=True, text=True,
                                    timeout=60, env=env)
            assert result.returncode == 1, result.stderr
            assert "store error: cannot open the PostgreSQL store postgresql://gw:***@127.0.0.1" in result.stderr
            assert "hunter2" not in result.stderr and "pa$$" not in result.stderr
            assert "Traceback" not in result.stderr


def test_a_store_url_s_password_is_redacted_in_every_spelling():
    from gatewayd.store.postgres import _scrub, redact

    assert redact("postgresql://gw:p%40ss@db:5432/gw?sslmode=require") == \
        "postgresql://gw:***@db:5432/gw?sslmode=require"
    assert redact("postgresql://gw@db/gw?sslmode=require&PASSWORD=q%26w") == \
        "postgresql://gw@db/gw?sslmode=require&PASSWORD=***"
    assert redact("postgresql://gw@db/gw") == "postgresql://gw@db/gw"
    said = _scrub("failed for postgresql://gw:p%40ss@db/gw?password=q%26w (p@ss, q&w)",
                  "postgresql://gw:p%40ss@db/gw?password=q%26w")
    assert said == "failed for postgresql://gw:***@db/gw?password=*** (***, ***)"


def test_the_people_s_command_line_variables_and_the_console_idle_timeout_are_settings_of_their_own():
    """Issue 34: $GATEWAYD_PROFILE (a shell's default profile) must not stop a daemon or a host command as an
    unknown GATEWAYD_ variable; [console] idle_timeout has a default and an environment override."""
    config = load_config(None, environ={"GATEWAYD_PROFILE": "staging", "GATEWAYD_DEBUG": "1",
                                        "GATEWAYD_CONSOLE_IDLE_TIMEOUT": "5m"})
    assert config["console.idle_timeout"] == 300
    assert load_config(None, environ={})["console.idle_timeout"] == 1800
    with pytest.raises(ConfigError):
        load_config(None, environ={"GATEWAYD_CONSOLE_IDLE_TIMEOUT": "0s"})


def test_the_agents_tunnel_port_follows_grpc_s_and_never_overlaps_the_workers_grpc_ports():
    from gatewayd.config import tunnel_port

    assert tunnel_port(load_config(None, environ={"GATEWAYD_DAEMON_WORKERS": "1"})) == 8110  # grpc.listen's + 100
    assert tunnel_port(load_config(None, environ={"GATEWAYD_GRPC_LISTEN": "0.0.0.0:9000"})) == 9100
    assert tunnel_port(load_config(None, environ={"GATEWAYD_GRPC_LISTEN": "127.0.0.1:0"})) == 0  # any free port
    assert tunnel_port(load_config(None, environ={"GATEWAYD_GRPC_TUNNEL_PORT": "7000"})) == 7000
    assert tunnel_port(load_config(None, environ={"GATEWAYD_GRPC_TUNNEL": "false"})) is None
    assert tunnel_port(load_config(None, environ={"GATEWAYD_GRPC_LISTEN": ""})) is None
    with pytest.raises(ConfigError, match=r"tunnel ports 8012-8015 overlap their gRPC ports 8010-8013"):
        load_config(None, environ={"GATEWAYD_DAEMON_WORKERS": "4", "GATEWAYD_GRPC_TUNNEL_PORT": "8012"})
    assert load_config(None, environ={"GATEWAYD_DAEMON_WORKERS": "4", "GATEWAYD_GRPC_TUNNEL_PORT": "8014"})
    with pytest.raises(ConfigError, match="grpc.tunnel_port: bad port"):
        load_config(None, environ={"GATEWAYD_GRPC_TUNNEL_PORT": "70000"})
    with pytest.raises(ConfigError, match="pass 65535"):
        load_config(None, environ={"GATEWAYD_GRPC_LISTEN": "127.0.0.1:65500", "GATEWAYD_DAEMON_WORKERS": "1"})
