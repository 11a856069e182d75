"""The people's command line speaks only the public API: this is its HTTP client and its login file.

Nothing here imports the daemon's core; a command that fails raises ``ClientError`` with one line to
print and the exit code to leave with.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

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
    """Where the logins are kept: ``$GATEWAYD_CLIENT_CONFIG``, else ``$XDG_CONFIG_HOME/gatewayd/login.json``."""
    explicit = os.environ.get("GATEWAYD_CLIENT_CONFIG")
    if explicit:
        return Path(explicit)
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return base / "gatewayd" / "login.json"


PROFILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def _read_logins() -> dict[str, Any]:
    """The login file as ``{"default": NAME, "profiles": {NAME: {"url", "token"}}}`` (a file of one login, as
    written before profiles, is the profile ``default``)."""
    path = login_file()
    try:
        with open(path, "rb") as handle:
            _private_login_file(path, handle.fileno())
            saved = json.loads(handle.read())
    except FileNotFoundError:
        return {"default": "", "profiles": {}}
    except (OSError, ValueError) as exc:
        raise ClientError(f"cannot read the login file {path}: {exc}") from None
    if not isinstance(saved, dict):
        raise ClientError(f"cannot read the login file {path}: not a JSON object")
    if "profiles" not in saved:  # one login, as written before profiles
        return {"default": "default", "profiles": {"default": saved} if saved.get("url") else {}}
    profiles = {k: v for k, v in (saved.get("profiles") or {}).items() if isinstance(v, dict)}
    return {"default": str(saved.get("default") or ""), "profiles": profiles}


def _private_login_file(path: Path, fd: int) -> None:
    """A login file of another user (planted where ours should be) is refused: its gateway and token would be
    the ones used. One of ours readable by others (copied with the umask's 0644) is made 0600 again, and the
    person told that the tokens in it may have been read."""
    found = os.fstat(fd)
    if found.st_uid != os.getuid():
        raise ClientError(f"the login file {path} belongs to another user (uid {found.st_uid}): not used; "
                          "move it away and log in again")
    if found.st_mode & 0o077:
        os.fchmod(fd, 0o600)
        print(f"gatewayd: the login file {path} was readable by others ({oct(found.st_mode & 0o777)}): made 0600; "
              "if someone may have read it, `gatewayd logout` and log in again", file=sys.stderr)


def _write_logins(logins: dict[str, Any]) -> Path:
    """Write the logins with mode 0600 (created so, never widened for a moment), through a new file of a random
    name (O_EXCL): a name another local user set up beforehand, a symlink to a file of theirs, is never opened."""
    path = login_file()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(logins, handle, indent=1)
        os.replace(temporary, path)  # a symlink at ``path`` is replaced, not followed
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    return path


def normal_url(url: str) -> str:
    """A gateway URL as compared and kept: scheme and host in lower case, no trailing slash or ``/api``."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    parts = urllib.parse.urlsplit(url)
    path = parts.path.rstrip("/").removesuffix("/api")
    return urllib.parse.urlunsplit((parts.scheme.lower(), parts.netloc.lower(), path, "", ""))


def profile_for_url(url: str) -> str:
    """A profile name made of a URL's host and port (``localhost-8009``)."""
    netloc = urllib.parse.urlsplit(url).netloc.rsplit("@", 1)[-1]
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", netloc).strip("-.") or "default"
    return name[:64]


@dataclass(slots=True)
class Login:
    """A gateway's URL and the token to use there, kept under a profile name (several gateways, one file).

    Which profile a command uses: ``--profile``, else ``$GATEWAYD_PROFILE``, else the one whose URL is
    ``--url`` (or ``$GATEWAYD_URL``), else the default profile (the last one logged in to).
    """

    url: str
    token: str = ""
    profile: str = "default"

    @classmethod
    def load(cls, url: str | None = None, profile: str | None = None) -> "Login":
        logins = _read_logins()
        profiles = logins["profiles"]
        wanted = url or os.environ.get("GATEWAYD_URL") or ""
        name = profile or os.environ.get("GATEWAYD_PROFILE") or ""
        if name and not PROFILE_NAME.fullmatch(name):
            raise ClientError(f"--profile {name!r}: use letters, digits, '.', '_' and '-'", EXIT_USAGE)
        if not name and wanted:
            name = next((n for n, p in profiles.items() if normal_url(p.get("url", "")) == normal_url(wanted)), "")
        name = name or logins["default"] or "default"
        saved = profiles.get(name) or {}
        chosen = normal_url(wanted or saved.get("url") or DEFAULT_URL)
        token = saved.get("token", "") if normal_url(saved.get("url", "") or "-") == chosen else ""
        return cls(chosen, token, name)

    def save(self, make_default: bool = True) -> Path:
        logins = _read_logins()
        logins["profiles"][self.profile] = {"url": self.url, "token": self.token}
        if make_default or not logins["default"]:
            logins["default"] = self.profile
        return _write_logins(logins)

    def forget(self) -> bool:
        """Drop this profile's login; True when there was one."""
        logins = _read_logins()
        if logins["profiles"].pop(self.profile, None) is None:
            return False
        if logins["default"] == self.profile:
            logins["default"] = next(iter(logins["profiles"]), "")
        if logins["profiles"]:
            _write_logins(logins)
        else:
            login_file().unlink(missing_ok=True)
        return True

    @staticmethod
    def profiles() -> tuple[str, dict[str, dict[str, Any]]]:
        """The default profile's name and every profile (url, token)."""
        logins = _read_logins()
        return logins["default"], logins["profiles"]

    @staticmethod
    def use(name: str) -> None:
        """Make ``name`` the default profile."""
        logins = _read_logins()
        if name not in logins["profiles"]:
            known = ", ".join(sorted(logins["profiles"])) or "none yet: gatewayd login"
            raise ClientError(f"no profile {name!r} (profiles: {known})", EXIT_USAGE)
        logins["default"] = name
        _write_logins(logins)


@dataclass(slots=True)
class Answer:
    """One API answer: its status, its decoded JSON (or None) and its raw bytes."""

    status: int
    data: Any
    raw: bytes
    content_type: str


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is refused, not followed: urllib would send the token on to whatever host it names (and over
    plain HTTP from HTTPS), and a token is for its gateway's own URL only."""

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str, headers: Any,
                         newurl: str) -> urllib.request.Request | None:
        fp.close()
        raise ClientError(f"{req.get_method()} {req.full_url}: the answer is a redirect ({code}) to {newurl}, "
                          "not followed (the login is sent only to the gateway's own URL); if that is the "
                          "gateway's address, use it as --url")


_OPENER = urllib.request.build_opener(_NoRedirect)


class Api:
    """The control API at ``login.url`` as the logged-in person."""

    def __init__(self, login: Login, timeout: float = TIMEOUT) -> None:
        self.login = login
        self.timeout = timeout

    def _request(self, method: str, path: str, body: Any, query: dict[str, Any] | None, anonymous: bool,
                 headers: dict[str, str] | None) -> urllib.request.Request:
        url = f"{self.login.url}/api{path}"
        if query:
            url += "?" + urllib.parse.urlencode({k: v for k, v in query.items() if v not in (None, "")})
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
        if data is not None:
            request.add_header("Content-Type", "application/json")
        if not anonymous:
            if not self.login.token:
                raise ClientError(f"not logged in to {self.login.url}: run `gatewayd login{self._named()}`",
                                  EXIT_LOGIN)
            request.add_header("Authorization", f"Bearer {self.login.token}")
        return request

    def _named(self) -> str:
        return "" if self.login.profile == "default" else f" --profile {self.login.profile}"

    def _unreachable(self, exc: BaseException) -> ClientError:
        reason = getattr(exc, "reason", exc)
        return ClientError(f"cannot reach the gateway at {self.login.url}: {reason}", EXIT_UNREACHABLE)

    def call(self, method: str, path: str, body: Any = None, query: dict[str, Any] | None = None,
             expect: tuple[int, ...] = (200, 201, 204), anonymous: bool = False,
             headers: dict[str, str] | None = None) -> Answer:
        """Call ``/api<path>``; an unexpected status is a ClientError carrying the API's message."""
        request = self._request(method, path, body, query, anonymous, headers)
        try:
            with _OPENER.open(request, timeout=self.timeout) as response:
                answer = self._answer(response.status, response.read(), response.headers.get("Content-Type", ""))
        except urllib.error.HTTPError as error:
            answer = self._answer(error.code, error.read(), error.headers.get("Content-Type", ""))
        except (urllib.error.URLError, socket.timeout, ConnectionError) as exc:
            raise self._unreachable(exc) from None
        if answer.status in expect:
            return answer
        raise self._refused(method, path, answer, anonymous)

    def _refused(self, method: str, path: str, answer: Answer, anonymous: bool) -> ClientError:
        message = answer.data.get("message") if isinstance(answer.data, dict) else ""
        if answer.status == 401 and not anonymous:
            return ClientError(f"the gateway refused your login ({message or 'access denied'}): it may have "
                               f"expired; run `gatewayd login{self._named()}`", EXIT_LOGIN)
        return ClientError(f"{method} /api{path}: {answer.status} "
                           f"{message or answer.raw[:200].decode('utf-8', 'replace')}")

    def stream(self, path: str, query: dict[str, Any] | None = None) -> Iterator[tuple[str, Any]]:
        """The server-sent events of ``GET /api<path>`` as (event, decoded JSON data), as they come."""
        request = self._request("GET", path, None, query, False, {"Accept": "text/event-stream"})
        try:
            response = _OPENER.open(request, timeout=self.timeout)
        except urllib.error.HTTPError as error:
            answer = self._answer(error.code, error.read(), error.headers.get("Content-Type", ""))
            raise self._refused("GET", path, answer, False) from None
        except (urllib.error.URLError, socket.timeout, ConnectionError) as exc:
            raise self._unreachable(exc) from None
        with response:
            event, data = "message", list[str]()
            try:
                for raw in response:
                    line = raw.decode("utf-8").rstrip("\r\n")
                    if not line:
                        if data:
                            yield event, json.loads("\n".join(data))
                        event, data = "message", []
                    elif line.startswith("event:"):
                        event = line[6:].strip()
                    elif line.startswith("data:"):
                        data.append(line[5:].lstrip())
            except (socket.timeout, ConnectionError, OSError) as exc:
                raise ClientError(f"the gateway at {self.login.url} stopped answering: {exc}",
                                  EXIT_UNREACHABLE) from None

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
