"""The people's command line speaks only the public API: this is its HTTP client and its login file.

Nothing here imports the daemon's core; a command that fails raises ``ClientError`` with one line to
print and the exit code to leave with.
"""

from __future__ import annotations

import json
import os
import socket
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8009"
TIMEOUT = 60.0

# exit codes of the people's commands (a script's own exit code passes through `exec`)
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_LOGIN = 4


class ClientError(Exception):
    """A command that cannot go on: ``str()`` is the one line shown, ``exit_code`` the status."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def login_file() -> Path:
    """Where the login is kept: ``$GATEWAYD_CLIENT_CONFIG``, else ``$XDG_CONFIG_HOME/gatewayd/login.json``."""
    explicit = os.environ.get("GATEWAYD_CLIENT_CONFIG")
    if explicit:
        return Path(explicit)
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return base / "gatewayd" / "login.json"


@dataclass(slots=True)
class Login:
    """The gateway's URL and the token to use there."""

    url: str
    token: str = ""

    @classmethod
    def load(cls, url: str | None = None) -> "Login":
        path = login_file()
        try:
            saved = json.loads(path.read_text())
        except FileNotFoundError:
            saved = {}
        except (OSError, ValueError) as exc:
            raise ClientError(f"cannot read the login file {path}: {exc}") from None
        chosen = (url or os.environ.get("GATEWAYD_URL") or saved.get("url") or DEFAULT_URL).rstrip("/")
        token = saved.get("token", "") if saved.get("url", "").rstrip("/") == chosen else ""
        return cls(chosen, token)

    def save(self) -> Path:
        """Write the login with mode 0600 (created so, never widened for a moment)."""
        path = login_file()
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        temporary = path.with_suffix(".tmp")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump({"url": self.url, "token": self.token}, handle)
        os.chmod(temporary, 0o600)
        os.replace(temporary, path)
        return path

    @staticmethod
    def forget() -> bool:
        try:
            login_file().unlink()
        except FileNotFoundError:
            return False
        return True


@dataclass(slots=True)
class Answer:
    """One API answer: its status, its decoded JSON (or None) and its raw bytes."""

    status: int
    data: Any
    raw: bytes
    content_type: str


class Api:
    """The control API at ``login.url`` as the logged-in person."""

    def __init__(self, login: Login, timeout: float = TIMEOUT) -> None:
        self.login = login
        self.timeout = timeout

    def call(self, method: str, path: str, body: Any = None, query: dict[str, Any] | None = None,
             expect: tuple[int, ...] = (200, 201, 204), anonymous: bool = False) -> Answer:
        """Call ``/api<path>``; an unexpected status is a ClientError carrying the API's message."""
        url = f"{self.login.url}/api{path}"
        if query:
            url += "?" + urllib.parse.urlencode({k: v for k, v in query.items() if v not in (None, "")})
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(url, data=data, method=method)
        if data is not None:
            request.add_header("Content-Type", "application/json")
        if not anonymous:
            if not self.login.token:
                raise ClientError(f"not logged in to {self.login.url}: run `gatewayd login`", EXIT_LOGIN)
            request.add_header("Authorization", f"Bearer {self.login.token}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                answer = self._answer(response.status, response.read(), response.headers.get("Content-Type", ""))
        except urllib.error.HTTPError as error:
            answer = self._answer(error.code, error.read(), error.headers.get("Content-Type", ""))
        except (urllib.error.URLError, socket.timeout, ConnectionError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ClientError(f"cannot reach the gateway at {self.login.url}: {reason}", EXIT_UNREACHABLE) from None
        if answer.status in expect:
            return answer
        message = answer.data.get("message") if isinstance(answer.data, dict) else ""
        if answer.status == 401 and not anonymous:
            raise ClientError(f"the gateway refused your login ({message or 'access denied'}): it may have "
                              "expired; run `gatewayd login`", EXIT_LOGIN)
        raise ClientError(f"{method} /api{path}: {answer.status} {message or answer.raw[:200].decode('utf-8', 'replace')}")

    @staticmethod
    def _answer(status: int, raw: bytes, content_type: str) -> Answer:
        data = None
        if "json" in content_type and raw:
            try:
                data = json.loads(raw)
            except ValueError:
                data = None
        return Answer(status, data, raw, content_type)

    def get(self, path: str, **query: Any) -> Any:
        return self.call("GET", path, query=query).data
