"""What a configuration key is (``Setting``) and how values are checked: the base every layer may use.

The keys themselves are declared where they belong -- the core's in
gatewayd.config, each protocol's in its description -- and loaded by
gatewayd.config; a protocol description names its settings with these types
without knowing the loader.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable


class ConfigError(Exception):
    """A configuration value that cannot be used; the message names the key."""


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}


def parse_duration(value: Any, key: str = "duration") -> float:
    """Seconds from ``"500ms"``, ``"10s"``, ``"30m"``, ``"12h"``, ``"2d"`` or a number."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a duration such as '10s', got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ConfigError(f"{key}: must not be negative")
        return float(value)
    match = _DURATION.match(str(value))
    if not match:
        raise ConfigError(f"{key}: expected a duration such as '10s' or '12h', got {value!r}")
    return float(match.group(1)) * _UNITS[match.group(2)]


def parse_listen(value: Any, key: str, allow_empty: bool = True) -> str:
    """Validate ``host:port`` (empty means disabled when allowed)."""
    if not isinstance(value, str):
        raise ConfigError(f"{key}: expected 'host:port', got {value!r}")
    if value == "":
        if allow_empty:
            return value
        raise ConfigError(f"{key}: must not be empty")
    host, sep, port = value.rpartition(":")
    if not sep or not host:
        raise ConfigError(f"{key}: expected 'host:port', got {value!r}")
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{key}: bad port {port!r} (0-65535)")
    return value


def split_listen(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host.strip("[]"), int(port)


@dataclass(slots=True, frozen=True)
class Setting:
    """One configuration key: its type check and its default; ``secret``: its value is never quoted in an error
    (a key, a password: the message goes to the terminal and the service's journal)."""

    kind: str
    default: Any
    check: Callable[[Any, str], Any] | None = None
    secret: bool = False

    def shown(self, value: Any) -> str:
        """``value`` as an error quotes it."""
        return "a value not shown (it is a secret)" if self.secret else repr(value)


def choice(*allowed: str) -> Callable[[Any, str], Any]:
    """A check that the value is one of ``allowed``."""

    def check(value: Any, key: str) -> Any:
        if value not in allowed:
            raise ConfigError(f"{key}: must be one of {', '.join(allowed)}, got {value!r}")
        return value

    return check


_DOMAIN = re.compile(r"^(?:[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?\.)*[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")


def domain_setting(value: Any, key: str) -> Any:
    """A DNS domain (``*.`` or a leading dot allowed and dropped), lowered; empty allowed."""
    domain = value.strip().lower().removeprefix("*.").strip(".")
    if domain and not _DOMAIN.match(domain):
        raise ConfigError(f"{key}: expected a domain such as 'apps.example.com', got {value!r}")
    return domain


def _not_negative(value: Any, key: str) -> Any:
    if value < 0:
        raise ConfigError(f"{key}: must not be negative")
    return value


def positive(value: Any, key: str) -> Any:
    if value <= 0:
        raise ConfigError(f"{key}: must be positive")
    return value
