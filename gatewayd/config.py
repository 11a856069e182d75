"""Daemon configuration: a TOML file, embedded defaults and GATEWAYD_* overrides.

Every key is declared once with its type and default: the core's in
``SETTINGS``, each protocol's (``[listeners] <name>`` and its own ``[<name>]``
section) in its registered description (gatewayd.protocols); ``all_settings()``
joins them.  The loader refuses unknown keys and bad values with a message
naming the key, and ``config.example.toml`` documents the same keys (a test
keeps them in step).
"""

from __future__ import annotations

import difflib
import os
import tomllib
from pathlib import Path
from typing import Any, Mapping

from gatewayd import balance, hotpath, protocols

# what a key is and how values are checked (gatewayd.settings), imported from here too
from gatewayd.settings import ConfigError as ConfigError
from gatewayd.settings import Setting as Setting
from gatewayd.settings import _not_negative
from gatewayd.settings import choice as choice
from gatewayd.settings import domain_setting as domain_setting
from gatewayd.settings import parse_duration as parse_duration
from gatewayd.settings import parse_listen as parse_listen
from gatewayd.settings import positive as positive
from gatewayd.settings import split_listen as split_listen

_positive = positive
_choice = choice


def _store_url(value: Any, key: str) -> Any:
    """A PostgreSQL URL (empty allowed); the message never quotes it: it may hold a password."""
    if value and not value.startswith(("postgresql://", "postgres://")):
        raise ConfigError(f"{key}: expected a URL such as 'postgresql://user:password@host:5432/gatewayd' "
                          "(the value is not shown: it may hold a password)")
    return value


def cpu_count() -> int:
    """The CPUs this process may run on (its affinity, e.g. a container's cpuset), at least 1."""
    if hasattr(os, "process_cpu_count"):  # Python 3.13
        return os.process_cpu_count() or 1
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def worker_count(value: Any, key: str) -> int:
    """``"auto"`` (one worker per CPU) or a whole number >= 1, as a number."""
    if value == "auto":
        return cpu_count()
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key}: expected \"auto\" or a number of worker processes >= 1, got {value!r}")
    return value


def _port(value: int, key: str) -> int:
    if not 0 <= value <= 65535:
        raise ConfigError(f"{key}: bad port {value} (0-65535)")
    return value


TUNNEL_OFFSET = 100  # the agents' tunnel listener's default port: grpc.listen's + this (8110)


def tunnel_port(config: Any) -> int | None:
    """The agents' tunnel listener's port (worker N's: this + N): ``grpc.tunnel_port``, else ``grpc.listen``'s
    port + TUNNEL_OFFSET (0, any free port, when gRPC's is 0); None without one (no gRPC server, or
    ``grpc.tunnel = false``: every stream goes over a gRPC Tunnel call)."""
    if not config["grpc.listen"] or not config["grpc.tunnel"]:
        return None
    if config["grpc.tunnel_port"]:
        return int(config["grpc.tunnel_port"])
    grpc_port = split_listen(config["grpc.listen"])[1]
    return grpc_port + TUNNEL_OFFSET if grpc_port else 0


def _check_tunnel_ports(values: dict[str, Any]) -> None:
    """The workers' tunnel ports (the first + N) neither overlap their gRPC ports (gRPC's + N) nor pass 65535."""
    first = tunnel_port(values)
    if not first:
        return
    workers = values["daemon.workers"]
    grpc_port = split_listen(values["grpc.listen"])[1]
    if first + workers - 1 > 65535:
        raise ConfigError(f"grpc.tunnel_port: {workers} worker(s) from port {first} pass 65535 "
                          "(set grpc.tunnel_port, or grpc.tunnel = false)")
    if grpc_port and first < grpc_port + workers and grpc_port < first + workers:
        raise ConfigError(f"grpc.tunnel_port: the workers' tunnel ports {first}-{first + workers - 1} overlap their "
                          f"gRPC ports {grpc_port}-{grpc_port + workers - 1}")


SETTINGS: dict[str, Setting] = {
    "data_dir": Setting("str", "./gatewayd-data"),
    "daemon.workers": Setting("workers", "auto", worker_count),
    "daemon.restart_delay": Setting("duration", "250ms", _positive),
    "log.format": Setting("str", "plain", _choice("plain", "json")),
    "log.level": Setting("str", "info", _choice("debug", "info", "warning", "error")),
    "api.listen": Setting("listen", "127.0.0.1:8009", lambda v, k: parse_listen(v, k, False)),
    "api.public_url": Setting("str", ""),
    "api.max_body_bytes": Setting("int", 1048576, _positive),
    "api.idle_timeout": Setting("duration", "75s", _positive),
    "metrics.listen": Setting("listen", "127.0.0.1:9464", parse_listen),
    "grpc.listen": Setting("listen", "127.0.0.1:8010", parse_listen),
    "grpc.tls_cert": Setting("str", ""),
    "grpc.tls_key": Setting("str", ""),
    "grpc.node_url": Setting("str", ""),
    "grpc.keepalive": Setting("duration", "20s", _positive),
    "grpc.tunnel": Setting("bool", True),
    "grpc.tunnel_port": Setting("int", 0, lambda v, k: _port(v, k)),
    "store.driver": Setting("str", "sqlite", _choice("sqlite", "postgres")),
    "store.path": Setting("str", ""),
    "store.url": Setting("str", "", _store_url, secret=True),
    "store.timeout": Setting("duration", "4s", _positive),
    "store.count_cap": Setting("int", 10_000, _positive),
    "secrets.key": Setting("str", "", secret=True),
    "cluster.node_name": Setting("str", ""),
    "cluster.lease": Setting("duration", "30s", _positive),
    "auth.issuer": Setting("str", "local", _choice("local", "oidc")),
    "auth.token_ttl": Setting("duration", "12h"),
    "auth.multi_tenant": Setting("bool", False),
    "auth.admins_can_self_approve": Setting("bool", True),
    "console.idle_timeout": Setting("duration", "30m", _positive),
    "tenants.allow_private_targets": Setting("bool", False),
    "tenants.allow_private_webhooks": Setting("bool", False),
    "auth.oidc.issuer_url": Setting("str", ""),
    "auth.oidc.client_id": Setting("str", ""),
    "auth.oidc.client_secret": Setting("str", "", secret=True),
    "auth.oidc.audience": Setting("str", ""),
    "auth.oidc.scopes": Setting("list", ["openid", "profile", "email"]),
    "auth.oidc.groups_claim": Setting("str", "groups"),
    "auth.oidc.link_unverified_email": Setting("bool", False),
    "auth.oidc.redirect_url": Setting("str", ""),
    "auth.oidc.allowed_redirects": Setting("list", []),
    "auth.oidc.algorithms": Setting("list", ["RS256", "RS384", "RS512", "ES256", "ES384", "PS256", "EdDSA"]),
    "server.grpc_server_url": Setting("str", ""),
    "server.product_analytics": Setting("str", "inactive", _choice("active", "inactive")),
    "sessions.shutdown_grace": Setting("duration", "10s"),
    "sessions.recording_cap_bytes": Setting("int", 64 * 1024 * 1024, _positive),
    "sessions.flush_interval": Setting("duration", "1s"),
    "sessions.journal": Setting("bool", True),
    "sessions.journal_dir": Setting("str", ""),
    "sessions.journal_interval": Setting("duration", "50ms", _positive),
    "sessions.recording_mode": Setting("str", "async", _choice("async", "strict")),
    "sessions.strict_bound": Setting("duration", "5s", _positive),
    "sessions.max_credential_duration": Setting("duration", "48h"),
    "sessions.exec_wait": Setting("duration", "50s"),
    "throttle.login_failures": Setting("int", 10, _not_negative),
    "throttle.login_window": Setting("duration", "5m"),
    "throttle.credential_failures": Setting("int", 30, _not_negative),
    "throttle.credential_window": Setting("duration", "1m"),
    "integrations.aws.use_instance_role": Setting("bool", False),
    "integrations.aws.regions": Setting("list", []),
    "integrations.aws.assume_role_name": Setting("str", "OrganizationAccountAccessRole"),
    "integrations.aws.endpoint_url": Setting("str", ""),
    "integrations.aws.timeout": Setting("duration", "20s"),
    "proxy_manager.allowed_binds": Setting("list", []),
    "ai.timeout": Setting("duration", "15s", _positive),
    "ai.on_failure": Setting("str", "closed", _choice("closed", "open")),
    "ai.native_on_failure": Setting("str", "open", _choice("closed", "open")),
    "ai.max_pending": Setting("int", 64, _positive),
    "ai.max_input_chars": Setting("int", 32768, _positive),
    "runbooks.refresh_interval": Setting("duration", "5m"),
    "runbooks.git_timeout": Setting("duration", "60s", _positive),
    "webhooks.allow_http": Setting("bool", False),
    "webhooks.ca_file": Setting("str", ""),
    "webhooks.timeout": Setting("duration", "10s", _positive),
    "webhooks.max_attempts": Setting("int", 8, _positive),
    "webhooks.retry_base": Setting("duration", "5s", _positive),
    "webhooks.poll_interval": Setting("duration", "1s", _positive),
    "webhooks.cache_seconds": Setting("duration", "5s"),
    "webhooks.slack_api_url": Setting("str", "https://slack.com/api"),
}


def all_settings() -> dict[str, Setting]:
    """The core's settings, then each registered protocol's listener and own section."""
    table = dict(SETTINGS)
    for description in protocols.registered():
        table[f"listeners.{description.name}"] = Setting("listen", description.default_listen, parse_listen)
        for name, setting in description.settings.items():
            table[f"{description.name}.{name}"] = setting
    return table


# GATEWAYD_* variables that are not settings: the configuration file, and the people's command line (its
# login file, the gateway it talks to). Any other GATEWAYD_* variable is a typo and stops the daemon.
# GATEWAYD_WORKER_INDEX is set by `gatewayd run`'s supervisor on the workers it starts (launcher.supervisor);
# GATEWAYD_PURE_PYTHON runs the hot path from its Python source (gatewayd.hotpath); GATEWAYD_BALANCE_DIR is the
# supervisor's directory where its workers spread new connections among them (gatewayd.balance).
WORKER_INDEX_VARIABLE = "GATEWAYD_WORKER_INDEX"
# GATEWAYD_PROFILE picks the people's command line's saved login, GATEWAYD_DEBUG shows a command's traceback.
OTHER_VARIABLES = frozenset({"GATEWAYD_CONFIG", "GATEWAYD_CLIENT_CONFIG", "GATEWAYD_URL", "GATEWAYD_AGENT_TOKEN",
                             "GATEWAYD_TOKEN", "GATEWAYD_PROFILE", "GATEWAYD_DEBUG", WORKER_INDEX_VARIABLE,
                             balance.DIRECTORY_ENV, hotpath.PURE_ENV})


def _env_name(key: str) -> str:
    return "GATEWAYD_" + key.replace(".", "_").upper()


def _coerce(key: str, setting: Setting, value: Any, from_env: bool) -> Any:
    kind = setting.kind
    if kind == "str" or kind == "listen":
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {setting.shown(value)}")
    elif kind == "int":
        if from_env:
            try:
                value = int(value)
            except ValueError:
                raise ConfigError(f"{key}: expected an integer, got {setting.shown(value)}") from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {setting.shown(value)}")
    elif kind == "bool":
        if from_env:
            value = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}.get(
                str(value).lower(), value
            )
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {setting.shown(value)}")
    elif kind == "list":
        if from_env:
            value = [item.strip() for item in str(value).split(",") if item.strip()]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{key}: expected a list of strings, got {setting.shown(value)}")
    elif kind == "duration":
        value = parse_duration(value, key)
    if setting.check is not None:
        value = setting.check(value, key)
    return value


def _flatten(table: dict[str, Any], settings: dict[str, Setting], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for name, value in table.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict) and key not in settings:
            flat.update(_flatten(value, settings, key + "."))
        else:
            flat[key] = value
    return flat


class Config:
    """Resolved settings; read with ``config["api.listen"]`` or the helpers below."""

    def __init__(self, values: dict[str, Any], source: str | None = None) -> None:
        self._values = values
        self.source = source

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def get(self, key: str, default: Any = None) -> Any:
        """A key that may be absent (a protocol's, when it is not registered)."""
        return self._values.get(key, default)

    def as_dict(self) -> dict[str, Any]:
        return dict(self._values)

    def section(self, name: str) -> dict[str, Any]:
        """The keys of ``[name]`` without their section (``section("ssh")["ciphers"]``)."""
        prefix = f"{name}."
        return {key[len(prefix):]: value for key, value in self._values.items() if key.startswith(prefix)}

    @property
    def data_dir(self) -> Path:
        return Path(self._values["data_dir"]).expanduser()

    @property
    def store_path(self) -> Path:
        path = self._values["store.path"]
        return Path(path).expanduser() if path else self.data_dir / "gatewayd.db"

    @property
    def journal_dir(self) -> Path | None:
        """Where this host's processes keep their journals (gatewayd.journal); None when it is turned off."""
        if not self._values["sessions.journal"]:
            return None
        path = self._values["sessions.journal_dir"]
        return Path(path).expanduser() if path else self.data_dir / "journal"

    @property
    def public_url(self) -> str:
        url = self._values["api.public_url"]
        if url:
            return url.rstrip("/")
        host, port = split_listen(self._values["api.listen"])
        return f"http://{host}:{port}"


def load_config(
    path: str | os.PathLike[str] | None = None,
    environ: dict[str, str] | None = None,
    overrides: dict[str, Any] | None = None,
) -> Config:
    """Defaults, then the TOML file, then GATEWAYD_* variables, then ``overrides``."""
    env: Mapping[str, str] = os.environ if environ is None else environ
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as handle:
                raw = tomllib.load(handle)
        except OSError as exc:
            raise ConfigError(f"config file {path}: cannot read it ({exc.strerror})") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path}: not valid TOML ({exc})") from None
    settings = all_settings()
    values = {key: _coerce(key, s, s.default, False) for key, s in settings.items()}
    for key, value in _flatten(raw, settings).items():
        setting = settings.get(key)
        if setting is None:
            raise ConfigError(f"{key}: unknown setting")
        values[key] = _coerce(key, setting, value, False)
    for key, setting in settings.items():
        env_value = env.get(_env_name(key))
        if env_value is not None:
            values[key] = _coerce(key, setting, env_value, True)
    known = {_env_name(key) for key in settings} | OTHER_VARIABLES
    for name in sorted(env):
        if name.startswith("GATEWAYD_") and name not in known:
            close = difflib.get_close_matches(name, sorted(known), 1)
            raise ConfigError(f"environment variable {name}: unknown setting"
                              + (f" (did you mean {close[0]}?)" if close else ""))
    for key, value in (overrides or {}).items():
        if key not in settings:
            raise ConfigError(f"{key}: unknown setting")
        values[key] = _coerce(key, settings[key], value, False)
    if values["store.driver"] == "postgres" and not values["store.url"]:
        raise ConfigError("store.url: required when store.driver = 'postgres' (or GATEWAYD_STORE_URL)")
    _check_tunnel_ports(values)
    if values["auth.issuer"] == "oidc":
        for key in ("auth.oidc.issuer_url", "auth.oidc.client_id"):
            if not values[key]:
                raise ConfigError(f"{key}: required when auth.issuer = 'oidc'")
    return Config(values, str(path) if path else None)
