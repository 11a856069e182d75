"""The people's commands of ``gatewayd``: login, profiles, whoami, connections, connect, exec, sessions, reviews.

Each command is a function of its parsed arguments that returns an exit code; it talks to the
gateway only through ``Api`` (the public API), prints tables for people and JSON with ``--output json``
(or ``--json``), and fails with one line (``ClientError``) instead of a traceback.
"""

from __future__ import annotations

import argparse
import base64
import getpass
import hmac
import http.server
import json
import os
import re
import shlex
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import webbrowser
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, TextIO

from gatewayd.client.api import (
    EXIT_FAILED,
    EXIT_LOGIN,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    Api,
    ClientError,
    Login,
    normal_url,
    profile_for_url,
)

POLL = 1.0  # seconds between two looks at a review that is waiting
LOGIN_WAIT = 300.0  # how long `login --oidc` waits for the browser
SHORT = 8  # characters of an id shown in tables (the API takes them back where they are unambiguous)


# --------------------------------------------------------------------------- output helpers


def _colour_on(stream: TextIO) -> bool:
    return stream.isatty() and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"


COLOURS = {"open": "33", "live": "33", "done": "32", "APPROVED": "32", "EXECUTED": "32", "PENDING": "33",
           "REJECTED": "31", "REVOKED": "31", "issued": "2", "failed": "31"}


CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # C0 but tab and line break, DEL, C1
LINE_BREAKS = re.compile(r"[\t\n]")


def printable(text: object, one_line: bool = False) -> str:
    """Text from the gateway as a terminal shows it: its control characters written out (``\\x1b``), so that a
    value another person typed (a review's reason, a script, a name, a statement) or a hostile gateway's
    answer cannot move the cursor, retitle the window or set the clipboard (OSC 52) of whoever reads it;
    ``one_line``: tabs and line breaks too (a table cell, an error line)."""
    shown = CONTROL.sub(lambda found: f"\\x{ord(found.group()):02x}", str(text))
    return LINE_BREAKS.sub(lambda found: repr(found.group())[1:-1], shown) if one_line else shown


# a terminal's string commands -- OSC (title, clipboard: OSC 52, hyperlinks), DCS, SOS, PM, APC -- up to their end or
# the end of the text, in their 7-bit (ESC ] ...) and 8-bit (0x9d ...) forms
TERMINAL_STRINGS = re.compile(r"(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?")


def replayable(text: str) -> str:
    """A recorded terminal's output as a replay writes it to the reader's terminal: its colours and cursor
    moves kept, its string commands dropped -- what was typed or printed in a session (by its user, or its
    target) must not set the auditor's clipboard or window title, nor send the auditor's terminal commands."""
    return TERMINAL_STRINGS.sub("", text)


def paint(text: str, key: str | None = None, stream: TextIO | None = None) -> str:
    """``text`` in its status colour on a terminal (never when piped, nor with $NO_COLOR)."""
    code = COLOURS.get(key or text)
    return f"\033[{code}m{text}\033[0m" if code and _colour_on(stream or sys.stdout) else text


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str]], out: TextIO = sys.stdout,
          colour: tuple[str, ...] = ("status",)) -> None:
    """A plain aligned table (``columns``: key, heading); an empty list says so."""
    if not rows:
        print("(none)", file=out)
        return
    cells = [[printable(row.get(key, "") if row.get(key) is not None else "", one_line=True) for key, _ in columns]
             for row in rows]
    widths = [max(len(heading), *(len(line[i]) for line in cells)) for i, (_, heading) in enumerate(columns)]
    print("  ".join(h.upper().ljust(w) for (_, h), w in zip(columns, widths)).rstrip(), file=out)
    for line in cells:
        shown = [paint(c.ljust(w), c, out) if key in colour else c.ljust(w)
                 for (key, _), c, w in zip(columns, line, widths)]
        print("  ".join(shown).rstrip(), file=out)


def as_json(args: argparse.Namespace) -> bool:
    return getattr(args, "output", "table") == "json" or getattr(args, "json", False)


def emit(args: argparse.Namespace, data: Any, rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> int:
    if as_json(args):
        print(json.dumps(data, indent=2))
    else:
        table(rows, columns)
    return 0


def paged(text: str) -> None:
    """Print ``text``, through ``$PAGER`` (``less -FRX``) when it is longer than a terminal screen."""
    if not sys.stdout.isatty() or text.count("\n") < shutil.get_terminal_size().lines - 1:
        sys.stdout.write(text)
        return
    pager = shlex.split(os.environ.get("PAGER") or "less -FRX")
    if not pager or shutil.which(pager[0]) is None:
        sys.stdout.write(text)
        return
    subprocess.run(pager, input=text, text=True, check=False)


class Status:
    """A live status line on a terminal (one line per change elsewhere), for long waits."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.last = ""

    def show(self, text: str) -> None:
        if text == self.last:
            return
        self.last = text
        if self.tty:
            sys.stderr.write("\r\033[K" + text)
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def done(self) -> None:
        if self.tty and self.last:
            sys.stderr.write("\n")


UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str, what: str = "--duration") -> int:
    try:
        if text[-1:] in UNITS:
            return int(float(text[:-1]) * UNITS[text[-1]])
        return int(text)
    except ValueError:
        raise ClientError(f"{what}: expected e.g. 30m or 1h, got {text!r}", EXIT_USAGE) from None


def human(seconds: float) -> str:
    """``172800`` as ``48h``, ``5400`` as ``1h30m``, ``90`` as ``1m30s``."""
    seconds = int(seconds)
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size and not (unit == "d" and seconds % 86400):
            parts.append(f"{seconds // size}{unit}")
            seconds %= size
    return "".join(parts) or "0s"


def short(identifier: str | None) -> str:
    return (identifier or "")[:SHORT]


def moment(text: str, what: str) -> str:
    """A time as the API takes it: RFC 3339, or ``YYYY-MM-DD[ HH:MM]`` (UTC), or ``30m``/``2h``/``1d`` ago."""
    text = text.strip()
    if re.fullmatch(r"\d+(\.\d+)?[smhd]", text):
        return datetime.fromtimestamp(time.time() - parse_duration(text, what), timezone.utc).strftime(
            "%Y-%m-%dT%H:%M:%SZ")
    match = re.fullmatch(r"(\d{4}-\d{2}-\d{2})(?:[ T](\d{2}:\d{2})(:\d{2})?)?(Z|[+-]\d{2}:\d{2})?", text)
    if not match:
        raise ClientError(f"{what}: expected 2025-01-31, '2025-01-31 14:05' (UTC), RFC 3339 or 2h (ago), "
                          f"got {text!r}", EXIT_USAGE)
    day, clock, secs, zone = match.groups()
    if not clock:
        return day
    return f"{day}T{clock}{secs or ':00'}{zone or 'Z'}"


# --------------------------------------------------------------------------- login, profiles, whoami


class _Callback(http.server.BaseHTTPRequestHandler):
    """The loopback page the identity provider's redirect lands on (the token comes as ?token=, beside the
    ``state`` this login put in its redirect). Any local user, or a web page the browser shows, can reach a
    loopback port: an answer without this login's state is not taken, so nobody else's token is saved as
    the person's login."""

    token: str | None = None
    state: str = ""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        asked = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(asked.query)
        token = query.get("token", [""])[0]
        if asked.path != "/callback" or not hmac.compare_digest(query.get("state", [""])[0], type(self).state):
            token = ""
        if token:
            type(self).token = token
        self.send_response(200 if token else 400)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.end_headers()
        self.wfile.write(b"Logged in: you may close this page and go back to the terminal.\n" if token
                         else b"No token in this answer: try `gatewayd login` again.\n")

    def log_message(self, *args: Any) -> None:
        pass


def _oidc_login(api: Api, open_browser: bool) -> str:
    server = http.server.HTTPServer(("127.0.0.1", 0), _Callback)
    _Callback.token, _Callback.state = None, secrets.token_urlsafe(24)
    redirect = f"http://127.0.0.1:{server.server_port}/callback?state={_Callback.state}"
    try:
        url = api.call("GET", "/login", query={"redirect": redirect}, anonymous=True).data["login_url"]
    except ClientError as exc:
        server.server_close()
        if "redirect: not an allowed address" in str(exc):  # a gateway from before the loopback's state
            raise ClientError(f"the gateway at {api.login.url} is older than this client: it refuses a login "
                              "redirect with a state; upgrade it, or log in with --email") from None
        raise
    print(f"Open this address to log in (waiting for the browser):\n  {url}", file=sys.stderr)
    if open_browser:
        webbrowser.open(url)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    deadline = time.monotonic() + LOGIN_WAIT
    try:
        while _Callback.token is None:
            if time.monotonic() > deadline:
                raise ClientError("no login came back from the browser in time", EXIT_LOGIN)
            time.sleep(0.1)
    finally:
        server.shutdown()
    return _Callback.token


def _ask(prompt: str, secret: bool = False) -> str:
    """A line typed at the terminal; a clear error (never a traceback) when there is no terminal to ask."""
    if not sys.stdin.isatty():
        what = "password" if secret else "e-mail"
        hint = "--password-stdin and pipe the password in" if secret else "--email"
        raise ClientError(f"no terminal to ask for your {what}: use {hint}", EXIT_USAGE)
    try:
        return getpass.getpass(prompt) if secret else input(prompt)
    except EOFError:
        raise ClientError("nothing was typed: login cancelled", EXIT_USAGE) from None


def _login_target(args: argparse.Namespace) -> Login:
    """The profile a login writes: ``--profile``, else the one of ``--url``, else a new one named after a new URL."""
    login = Login.load(args.url, args.profile)
    if args.url and not args.profile and not os.environ.get("GATEWAYD_PROFILE"):
        default, profiles = Login.profiles()
        taken = profiles.get(login.profile)
        if taken and normal_url(taken.get("url", "")) != normal_url(args.url):
            login.profile = profile_for_url(normal_url(args.url))  # another gateway: a profile of its own
    return login


def cmd_login(args: argparse.Namespace) -> int:
    login = _login_target(args)
    api = Api(login)
    if args.oidc:
        token = _oidc_login(api, not args.no_browser)
    else:
        email = args.email or _ask("e-mail: ")
        if args.password_stdin:
            password = sys.stdin.readline().rstrip("\n")
            if not password:
                raise ClientError("--password-stdin: no password on standard input", EXIT_USAGE)
        else:
            password = _ask("password: ", secret=True)
        body = {"email": email, "password": password, **({"org_id": args.org} if args.org else {})}
        answer = api.call("POST", "/localauth/login", body, anonymous=True, expect=(200, 401))
        if answer.status == 401:
            raise ClientError("wrong e-mail or password", EXIT_LOGIN)
        token = answer.data["token"]
    login.token = token
    me = Api(login).get("/userinfo")
    path = login.save(make_default=not os.environ.get("GATEWAYD_PROFILE"))
    if as_json(args):
        print(json.dumps({"url": login.url, "profile": login.profile, "email": me["email"], "file": str(path)}))
    print(printable(f"logged in to {login.url} as {me['email']} (profile {login.profile}, saved in {path})"),
          file=sys.stderr)
    return 0


def cmd_logout(args: argparse.Namespace) -> int:
    """Sign the saved token out at the gateway (refused from now on, wherever a copy of it is), then forget it."""
    login = Login.load(args.url, args.profile)  # the saved login: the gateway that token is for
    note = ""
    if login.token:
        try:
            Api(login).call("POST", "/logout", expect=(204, 401))
        except ClientError as exc:  # unreachable: the local copy goes anyway, and the user is told the rest
            note = f" here; the gateway was not told ({exc}): the token stays valid until it expires"
    forgotten = login.forget()
    if as_json(args):
        print(json.dumps({"profile": login.profile, "logged_out": forgotten}))
    print(("logged out" + note) if forgotten else "was not logged in", file=sys.stderr)
    return 0


def _token_expiry(token: str) -> str:
    """When a JWT says it expires (read, not verified: the gateway verifies), or ''."""
    try:
        payload = token.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        return datetime.fromtimestamp(int(claims["exp"]), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    except (IndexError, KeyError, ValueError, TypeError):
        return ""


def cmd_whoami(args: argparse.Namespace) -> int:
    login = Login.load(args.url, args.profile)
    me = Api(login).get("/userinfo")
    expires = _token_expiry(login.token)
    if as_json(args):
        print(json.dumps({"profile": login.profile, "url": login.url, "token_expires_at": expires or None, **me},
                         indent=2))
        return 0
    roles = [r for r, on in (("admin", me.get("is_admin")), ("auditor", me.get("is_auditor"))) if on]
    lines = [f"{me['email']}{' (' + me['name'] + ')' if me.get('name') else ''} at {login.url} (profile {login.profile})",
             f"groups: {', '.join(me.get('groups') or []) or 'none'}" + (f"; {', '.join(roles)}" if roles else "")]
    if me.get("org_id"):
        lines.append(f"organization: {me.get('org_name') or ''} {me['org_id']}".replace("  ", " "))
    if expires:
        lines.append(f"login valid until {expires}")
    print(printable("\n".join(lines)))
    return 0


def cmd_profiles(args: argparse.Namespace) -> int:
    if getattr(args, "use", None):
        Login.use(args.use)
        print(f"default profile: {args.use}", file=sys.stderr)
        return 0
    default, profiles = Login.profiles()
    rows = [{"name": ("* " if name == default else "  ") + name, "url": p.get("url", ""),
             "login": "yes" if p.get("token") else "no", "expires": _token_expiry(p.get("token", ""))}
            for name, p in sorted(profiles.items())]
    data = {"default": default, "profiles": {n: {"url": p.get("url", ""), "logged_in": bool(p.get("token")),
                                                 "token_expires_at": _token_expiry(p.get("token", "")) or None}
                                             for n, p in profiles.items()}}
    return emit(args, data, rows, [("name", "profile"), ("url", "gateway"), ("login", "logged in"),
                                   ("expires", "until")])


# --------------------------------------------------------------------------- connections and access


def review_by(connection: dict[str, Any]) -> str:
    """Who reviews access to a connection, as the API says (its access request rules or its settings)."""
    policy = connection.get("review_policy")
    if policy is None:  # an older gateway: the connection's own settings only
        reviewers = connection.get("reviewers") or (connection.get("settings") or {}).get("reviewers") or []
        return ",".join(reviewers) if reviewers else "no"
    needs = {kind: ",".join(p["reviewers"]) for kind, p in policy.items() if p}
    if not needs:
        return "no"
    if len(set(needs.values())) == 1 and len(needs) == 2:
        return next(iter(needs.values()))
    return " ".join(f"{groups} ({'access' if kind == 'jit' else 'scripts'})" for kind, groups in needs.items())


def cmd_connections(args: argparse.Namespace) -> int:
    connections = Api(Login.load(args.url, args.profile)).get("/connections")
    rows = [{"name": c["name"], "type": c["type"], "subtype": c["subtype"], "review": review_by(c),
             "resource": c.get("resource_name", "")} for c in connections]
    return emit(args, connections, rows, [("name", "name"), ("subtype", "type"), ("review", "review by"),
                                          ("resource", "resource")])


def _wait_review(api: Api, review_id: str, what: str, again: str) -> dict[str, Any]:
    """Wait until a review is decided; interrupted (Ctrl-C, the gateway gone), say how to pick it up again."""
    status = Status()
    try:
        while True:
            review = api.get(f"/reviews/{review_id}")
            state = review["status"]
            status.show(printable(f"{what}: review {review_id} is {state}", one_line=True))
            if state not in ("PENDING",):
                return review
            time.sleep(POLL)
    except KeyboardInterrupt:
        status.done()
        print(f"gatewayd: the request stays open (review {short(review_id)}): {again}", file=sys.stderr)
        raise
    except ClientError as exc:
        if exc.exit_code == EXIT_UNREACHABLE:
            raise ClientError(f"{exc}; the request stays open (review {short(review_id)}): {again}",
                              EXIT_UNREACHABLE) from None
        raise
    finally:
        status.done()


def _duration_refused(exc: ClientError, asked: int) -> ClientError:
    """The API's bounds of access_duration_seconds said in the units the person typed."""
    found = re.search(r"between 1 and (\d+)", str(exc))
    if "access_duration_seconds" in str(exc) and found:
        return ClientError(f"--duration {human(asked)} is longer than this gateway allows for this connection "
                           f"(at most {human(int(found.group(1)))})", EXIT_USAGE)
    return exc


def _credentials(api: Api, name: str, seconds: int, reason: str) -> dict[str, Any]:
    quoted = urllib.parse.quote(name, safe="")
    body: dict[str, Any] = {"access_duration_seconds": seconds, **({"reason": reason} if reason else {})}
    try:
        answer = api.call("POST", f"/connections/{quoted}/credentials", body, expect=(201, 202))
    except ClientError as exc:
        raise _duration_refused(exc, seconds) from None
    if answer.status == 201:
        return answer.data
    review = _wait_review(api, answer.data["review_id"], f"access to {name}",
                          f"run `gatewayd connect {name}` again to pick it up")
    if review["status"] != "APPROVED":
        raise ClientError(f"access to {name} was not granted: the review is {review['status']}")
    return api.call("POST", f"/connections/{quoted}/credentials/{answer.data['session_id']}", expect=(201,)).data


HINT = re.compile(r"\{(\w+)\}")  # an access hint named in a client template: {hostname}, {port}...


def _filled(template: str, access: dict[str, Any]) -> str:
    return HINT.sub(lambda found: str(access.get(found.group(1)) or ""), template)


FILE_NAME = re.compile(r"[A-Za-z0-9_]{1,64}")


def client_command(client: dict[str, Any] | None, access: dict[str, Any],
                   folder: Path | None = None) -> tuple[list[str], dict[str, str], str]:
    """(argv, extra environment, what to print) of the native client for a credential: its protocol's client
    template (GET /api/protocols) filled with the credential's access hints; none: the url, for a browser.
    ``folder``: a private folder where the client's files are written (``{file_<name>}``: one's path)."""
    if client is None:
        return [], {}, access.get("url", "")
    if folder is not None:
        access = {**access, **client_files(client.get("files") or {}, access, folder)}
    programs = client["programs"]
    program = next((name for name in programs if shutil.which(name)), programs[0])
    argv = [program] + [arg for arg in (_filled(template, access) for template in client["args"]) if arg]
    return argv, {key: _filled(value, access) for key, value in client["env"].items()}, _filled(client["shown"], access)


def client_files(files: dict[str, str], access: dict[str, Any], folder: Path) -> dict[str, str]:
    """Write a client's files (filled templates) in ``folder``, each created 0600 (O_EXCL); their paths as
    access hints (``file_<name>``)."""
    paths = {}
    for name, template in files.items():
        if not FILE_NAME.fullmatch(name):
            raise ClientError(f"the gateway names a client file {name!r}: not a plain name, not written")
        path = folder / name
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as handle:
            handle.write(_filled(template, access))
        paths[f"file_{name}"] = str(path)
    return paths


def with_client_args(argv: list[str], extra: list[str], options_with_value: str = "") -> list[str]:
    """The client's command line with the user's arguments; a client that reads ``[options] destination
    [command]`` (``options_with_value``: its options that take a value, ssh's) gets the options before the
    destination and the rest (the remote command) after it."""
    if not options_with_value:
        return argv + extra
    options, index = [], 0
    while index < len(extra) and extra[index].startswith("-") and extra[index] != "--":
        token = extra[index]
        options.append(token)
        if len(token) == 2 and token[1] in options_with_value and index + 1 < len(extra):
            options.append(extra[index + 1])
            index += 1
        index += 1
    command = extra[index + 1:] if extra[index:index + 1] == ["--"] else extra[index:]
    return argv[:-1] + options + argv[-1:] + command


def cmd_connect(args: argparse.Namespace) -> int:
    api = Api(Login.load(args.url, args.profile))
    credentials = _credentials(api, args.name, parse_duration(args.duration), args.reason or "")
    access = credentials.get("connection_credentials") or {}
    subtype = credentials.get("connection_subtype") or credentials.get("connection_type") or ""
    client = (gateway_protocols(api).get(subtype) or {}).get("client")
    argv, env, shown = client_command(client, access)
    if as_json(args):
        print(json.dumps(credentials, indent=2))
        return 0
    if args.print or not argv and not access.get("url"):
        print(printable(shown))
        for key in ("connection_string", "url", "header"):
            if access.get(key) and access[key] != shown:
                print(printable(f"{key}: {access[key]}"))
        print(printable(f"valid until {credentials.get('expire_at', '?')}"), file=sys.stderr)
        return 0
    if not argv:  # an HTTP connection: the browser
        print(f"opening {shown}", file=sys.stderr)
        if not webbrowser.open(shown):
            print(shown)
        return 0
    if shutil.which(argv[0]) is None:
        raise ClientError(f"{argv[0]} is not installed here; connect with: {shown}")
    options_with_value = client["options_with_value"] if client else ""
    with tempfile.TemporaryDirectory(prefix="gatewayd-connect-") as folder:  # 0700, removed when the client ends
        argv, env, _ = client_command(client, access, Path(folder))
        return subprocess.call(with_client_args(argv, list(args.client_args), options_with_value),
                               env={**os.environ, **env})


# --------------------------------------------------------------------------- following a session


def _text(event: dict[str, Any]) -> str:
    return base64.b64decode(event["payload"]).decode("utf-8", "replace")


def follow_output(api: Api, session_id: str, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Write a session's output as it is recorded (``o`` to ``out``, ``e`` to ``err``); its exit code once it ends."""
    for event, data in api.stream(f"/sessions/{session_id}/stream"):
        if event == "event" and data["type"] in "oe":
            stream = out if data["type"] == "o" else err
            stream.write(_text(data))
            stream.flush()
        elif event == "end":
            code = data.get("exit_code")
            return int(code) if code is not None else EXIT_FAILED
    raise ClientError(f"the gateway stopped before session {short(session_id)} ended: "
                      f"`gatewayd sessions replay --follow {short(session_id)}` follows it on", EXIT_UNREACHABLE)


# --------------------------------------------------------------------------- one-time scripts


def _run_reviewed(api: Api, review: dict[str, Any]) -> int:
    """A reviewed script: wait for its decision, run it once approved, follow its output; its exit code."""
    review_id, session_id = review["id"], str(review.get("session_id") or review.get("session") or "")
    again = f"run it once approved with `gatewayd exec --review {short(review_id)}`"
    if review["status"] == "PENDING":
        review = _wait_review(api, review_id, "script", again)
    if review["status"] in ("PROCESSING", "EXECUTED"):  # it ran, or runs: its output
        return follow_output(api, session_id)
    if review["status"] != "APPROVED":
        raise ClientError(f"the script was not run: its review is {review['status']}")
    answer = api.call("POST", f"/sessions/{session_id}/exec", expect=(200, 201, 202),
                      headers={"Prefer": "respond-async"})
    return _script_result(api, answer.data)


def _script_result(api: Api, result: dict[str, Any]) -> int:
    if result.get("output_status") == "running":
        return follow_output(api, result["session_id"])
    sys.stdout.write(result.get("output") or "")
    code = result.get("exit_code")
    return int(code) if code is not None else EXIT_FAILED


def cmd_exec(args: argparse.Namespace) -> int:
    api = Api(Login.load(args.url, args.profile))
    if args.review:
        if args.name or args.file is not None or args.command is not None:
            raise ClientError("--review ID runs the script of that review: give no connection or script",
                              EXIT_USAGE)
        review = api.get(f"/reviews/{urllib.parse.quote(args.review, safe='')}")
        if review.get("type") != "onetime":
            raise ClientError(f"review {short(review['id'])} is an access request, not a script: "
                              f"`gatewayd connect {review['review_connection']['name']}` uses it", EXIT_USAGE)
        return _run_reviewed(api, review)
    if not args.name:
        raise ClientError("give the connection: gatewayd exec NAME -c TEXT (or --review ID)", EXIT_USAGE)
    if (args.file is None) == (args.command is None):
        raise ClientError("give the script with -f FILE or -c TEXT (one of them)", EXIT_USAGE)
    script = args.command if args.command is not None else (
        sys.stdin.read() if args.file == "-" else Path(args.file).read_text())
    body = {"connection": args.name, "script": script, **({"reason": args.reason} if args.reason else {})}
    answer = api.call("POST", "/sessions", body, expect=(200, 201, 202), headers={"Prefer": "respond-async"})
    result = answer.data
    if result.get("has_review") and result.get("review_id") and not result.get("output_status"):
        print(printable(f"the script needs a review: {short(result['review_id'])} "
                        f"(by {', '.join(g['group'] for g in result['review']['review_groups_data'])})"),
              file=sys.stderr)
        review = {**result["review"], "session_id": result["session_id"]}
        return _run_reviewed(api, review)
    return _script_result(api, result)


# --------------------------------------------------------------------------- the gateway's protocols


def gateway_protocols(api: Api) -> dict[str, dict[str, Any]]:
    """The gateway's protocols by subtype (GET /api/protocols): each one's title, how its sessions are shown
    and exported, its client. The commands name no protocol: a gateway's new protocol needs no new client."""
    answer = api.call("GET", "/protocols", expect=(200, 404))
    if answer.status == 404:
        raise ClientError(f"the gateway at {api.login.url} does not list its protocols (GET /api/protocols): it "
                          "is older than this client; upgrade it, or use the client of its version")
    return {protocol["subtype"]: protocol for protocol in answer.data}


def shown_as(api: Api, subtype: str) -> str:
    """How the gateway shows the sessions of ``subtype``: statements, terminal, frames, exchanges or text."""
    return str((gateway_protocols(api).get(subtype) or {}).get("presentation") or "text")


# --------------------------------------------------------------------------- sessions


def shown_status(session: dict[str, Any]) -> str:
    """A session's status for people: a credential issued and not used yet is ``issued``, not live."""
    if session.get("status") == "ready":
        return "issued" if session.get("verb") == "connect" else "waiting"
    return session.get("status", "")


def cmd_sessions(args: argparse.Namespace) -> int:
    api = Api(Login.load(args.url, args.profile))
    kind, protocol = args.type, args.protocol
    if kind or protocol:  # the gateway says which protocols there are
        known = gateway_protocols(api)
        if protocol and protocol not in known:
            raise ClientError(f"--protocol {protocol}: this gateway serves {', '.join(known)}", EXIT_USAGE)
        if kind in known and not protocol:  # `--type ssh`: what people mean is the protocol
            kind, protocol = None, kind
    query = {"connection": args.connection, "user": args.user, "type": kind, "protocol": protocol,
             "status": "ready" if args.status == "issued" else args.status, "search": args.search,
             "start_date": moment(args.since, "--since") if args.since else None,
             "end_date": moment(args.until, "--until") if args.until else None,
             "limit": args.limit, "offset": args.offset}
    page = api.get("/sessions", **query)
    items = page["data"] if isinstance(page, dict) else page
    rows = [{"id": short(s["id"]), "user": s["user"], "connection": s["connection"],
             "protocol": s.get("connection_subtype") or s["type"], "verb": s["verb"], "status": shown_status(s),
             "start": (s["start_date"] or "")[:19].replace("T", " "), "exit": s.get("exit_code")} for s in items]
    code = emit(args, page, rows, [("start", "started"), ("id", "session"), ("user", "user"),
                                   ("connection", "connection"), ("protocol", "protocol"), ("verb", "verb"),
                                   ("status", "status"), ("exit", "exit")])
    if not as_json(args) and isinstance(page, dict) and page.get("has_next_page"):
        total = f"{page['total']}{'' if page.get('total_exact', True) else '+'}"
        print(f"{len(items)} of {total}: --offset {args.offset + len(items)} for more", file=sys.stderr)
    return code


def _events(session: dict[str, Any]) -> Iterable[tuple[int, str, str]]:
    for offset, kind, data in session.get("event_stream") or []:
        yield offset, kind, base64.b64decode(data).decode("utf-8", "replace")


MARKS = {"i": ">", "o": "<", "e": "!"}


def cmd_session_show(args: argparse.Namespace) -> int:
    api = Api(Login.load(args.url, args.profile))
    session = api.get(f"/sessions/{urllib.parse.quote(args.id, safe='')}", expand="event_stream")
    if as_json(args):
        print(json.dumps(session, indent=2))
        return 0
    sid = session["id"]
    lines = [f"session {sid}: {session['user']} on {session['connection']} ({session['connection_subtype']}, "
             f"{session['verb']}), {shown_status(session)}, exit {session.get('exit_code')}, "
             f"from {session['start_date']}\n"]
    if (session.get("script") or {}).get("data"):
        lines.append(f"\nscript:\n{session['script']['data'].rstrip()}\n")
    presentation = shown_as(api, session["connection_subtype"])
    if presentation == "statements":  # SQL sessions: statement by statement
        for row in api.get(f"/sessions/{sid}", format="json")["statements"]:
            lines.append(f"\n[{row['offset_ms'] / 1000:.3f}s] {row['statement'].rstrip()}\n")
            for part in (row["output"], row["error"]):
                if part:
                    lines.append(part.rstrip() + "\n")
    elif presentation != "terminal":
        lines += [f"[{offset / 1000:.3f}s] {MARKS.get(kind, kind)} {text.rstrip()}\n"
                  for offset, kind, text in _events(session)]
    text = printable("".join(lines))
    if presentation == "terminal":  # a terminal's output as it was, as `sessions replay` plays it
        text += replayable(api.get(f"/sessions/{sid}", event_stream="utf8")["event_stream"][0])
    paged(text)
    return 0


def play(cast: str, speed: float, idle_limit: float, out: TextIO, sleep: Callable[[float], None] = time.sleep) -> int:
    """Write an asciicast's output events at their own pace (``speed`` times faster, idle gaps capped)."""
    lines = cast.splitlines()
    if not lines:
        return 0
    previous = 0.0
    for line in lines[1:]:
        moment_, kind, text = json.loads(line)
        if kind != "o":
            continue
        sleep(min(max(moment_ - previous, 0.0), idle_limit) / speed)
        previous = moment_
        out.write(replayable(text))
        out.flush()
    return 0


def follow_session(api: Api, session_id: str, out: TextIO = sys.stdout) -> int:
    """Print a session as it happens: a terminal's output as it is, other protocols an event a line; the
    history first, then each event as it is recorded, until the session ends (or Ctrl-C)."""
    terminal = None
    for event, data in api.stream(f"/sessions/{session_id}/stream"):
        if event == "session" and terminal is None:
            terminal = shown_as(api, data.get("connection_subtype") or "") == "terminal"
            print(printable(f"following session {data['id']} of {data['user']} on {data['connection']} "
                            f"({shown_status(data)}); Ctrl-C stops following", one_line=True), file=sys.stderr)
        elif event == "event":
            if terminal:
                if data["type"] in "oe":
                    out.write(replayable(_text(data)))
            else:
                out.write(printable(f"[{data['offset_ms'] / 1000:.3f}s] {MARKS.get(data['type'], data['type'])} "
                                    f"{_text(data).rstrip()}") + "\n")
            out.flush()
        elif event == "frames":
            out.write(f"[frames] {data['total_frames']} recorded\n")
            out.flush()
        elif event == "end":
            print(f"\nsession {short(session_id)} ended (exit {data.get('exit_code')})", file=sys.stderr)
            return 0
    raise ClientError(f"the gateway stopped while following session {short(session_id)}", EXIT_UNREACHABLE)


def cmd_session_replay(args: argparse.Namespace) -> int:
    if args.speed <= 0:
        raise ClientError("--speed: must be positive", EXIT_USAGE)
    api = Api(Login.load(args.url, args.profile))
    if args.follow:
        return follow_session(api, args.id)
    answer = api.call("GET", f"/sessions/{urllib.parse.quote(args.id, safe='')}",
                      query={"event_stream": "asciicast"})
    return play(answer.raw.decode("utf-8"), args.speed, args.idle_limit, sys.stdout)


EXPORTS = ("csv", "json", "asciicast", "png-frames", "text")  # what this client can write (the gateway says which fit)


def cmd_session_export(args: argparse.Namespace) -> int:
    api = Api(Login.load(args.url, args.profile))
    session = api.get(f"/sessions/{urllib.parse.quote(args.id, safe='')}")
    sid, subtype = session["id"], session.get("connection_subtype") or ""
    known = gateway_protocols(api)
    fits = known[subtype]["exports"] if subtype in known else ["text"]
    if args.format not in fits:
        takes = [subtype for subtype, p in known.items() if args.format in p["exports"]]
        raise ClientError(f"--format {args.format} exports {' and '.join(takes) or 'no'} sessions; session "
                          f"{short(sid)} is {subtype}: use --format {' or '.join(fits)}", EXIT_USAGE)
    if args.format == "png-frames":
        folder = Path(args.output or f"session-{sid}-frames")
        folder.mkdir(parents=True, exist_ok=True)
        offset, written = 0, 0
        while True:
            page = api.get(f"/sessions/{sid}/rdp-frames", offset=offset, limit=100)
            frames = page.get("items") or page.get("data") or page.get("frames") or []
            for frame in frames:
                index = frame["index"]
                png = api.call("GET", f"/sessions/{sid}/rdp-frames/{index}.png").raw
                (folder / f"frame-{index:06d}.png").write_bytes(png)
                written += 1
            if len(frames) < 100:
                break
            offset += len(frames)
        print(f"{written} frames written to {folder}", file=sys.stderr)
        return 0
    query = {"asciicast": {"event_stream": "asciicast"}, "csv": {"format": "csv"}, "json": {"format": "json"},
             "text": {"event_stream": "utf8"}}[args.format]
    answer = api.call("GET", f"/sessions/{sid}", query=query)
    raw = answer.data["event_stream"][0].encode() if args.format == "text" else answer.raw
    if args.output:
        Path(args.output).write_bytes(raw)
        print(f"written to {args.output}", file=sys.stderr)
    else:
        sys.stdout.buffer.write(raw)
    return 0


# --------------------------------------------------------------------------- reviews


def _asked(review: dict[str, Any]) -> str:
    """What a review is about, in a few words: the script's first line, or access for how long."""
    if review["type"] == "jit":
        return f"access for {human((review.get('access_duration') or 0) // 1_000_000_000)}"
    lines = (review.get("input") or "").strip().splitlines()
    first = lines[0] if lines else ""
    more = f" (+{len(lines) - 1} lines)" if len(lines) > 1 else ""
    return (first[:50] + "…" if len(first) > 50 else first) + more


def cmd_reviews(args: argparse.Namespace) -> int:
    api = Api(Login.load(args.url, args.profile))
    status = "" if (args.status or "").lower() == "all" else args.status
    reviews = api.get("/reviews", status=status)
    rows = [{"id": short(r["id"]), "type": r["type"], "status": r["status"],
             "connection": (r.get("review_connection") or {}).get("name", ""),
             "owner": (r.get("review_owner") or {}).get("email", ""), "what": _asked(r),
             "why": r.get("reason") or "", "created": (r["created_at"] or "")[:16].replace("T", " ")}
            for r in reviews]
    return emit(args, reviews, rows, [("created", "created"), ("id", "review"), ("status", "status"),
                                      ("connection", "connection"), ("owner", "asked by"), ("what", "what"),
                                      ("why", "why")])


def cmd_review_show(args: argparse.Namespace) -> int:
    api = Api(Login.load(args.url, args.profile))
    review = api.get(f"/reviews/{urllib.parse.quote(args.id, safe='')}")
    if as_json(args):
        print(json.dumps(review, indent=2))
        return 0
    owner = review.get("review_owner") or {}
    status = paint(printable(review["status"], one_line=True))  # the colour is ours: painted once it is printable
    lines = [f"connection: {review['review_connection']['name']}",
             f"asked by:   {owner.get('email', '')}{' (' + owner['name'] + ')' if owner.get('name') else ''} "
             f"on {review['created_at']}",
             f"why:        {review.get('reason') or '(no reason given)'}"]
    if review["type"] == "jit":
        lines.append(f"asks:       access for {human((review.get('access_duration') or 0) // 1_000_000_000)}")
    groups = [f"{g['group']}: {g['status'] or 'waiting'}"
              + (f" by {g['reviewed_by']['email']}" if g.get("reviewed_by") else "")
              for g in review["review_groups_data"]]
    lines.append(f"reviewers:  {'; '.join(groups)} (approvals needed: {review['min_approvals']})")
    if review.get("time_window"):
        window = review["time_window"]["configuration"]
        lines.append(f"window:     {window['start_time']}-{window['end_time']} UTC")
    if review.get("ai_analysis"):
        ai = review["ai_analysis"]
        lines.append(f"AI:         {ai.get('risk_level', '')} {ai.get('title', '')}: {ai.get('explanation', '')}")
    if review["type"] != "jit":
        lines += ["script:", *("  " + line for line in (review.get("input") or "").rstrip().splitlines())]
    decide = f"gatewayd reviews approve {short(review['id'])}"
    if review["status"] == "PENDING":
        lines.append(f"\ndecide: `{decide}` or `gatewayd reviews reject {short(review['id'])}`")
    paged(printable(f"review {review['id']} ({review['type']}): ", one_line=True) + status + "\n"
          + printable("\n".join(lines) + "\n"))
    return 0


def cmd_review_decide(args: argparse.Namespace) -> int:
    api = Api(Login.load(args.url, args.profile))
    body: dict[str, Any] = {"status": {"approve": "APPROVED", "reject": "REJECTED", "revoke": "REVOKED"}[args.decision]}
    if getattr(args, "force", False):
        body["force_review"] = True
    if getattr(args, "window", None):
        start, _, end = args.window.partition("-")
        body["time_window"] = {"type": "time_range", "configuration": {"start_time": start, "end_time": end}}
    review = api.call("PUT", f"/reviews/{urllib.parse.quote(args.id, safe='')}", body).data
    if as_json(args):
        print(json.dumps(review, indent=2))
    else:
        print(f"review {printable(review['id'], one_line=True)}: {paint(printable(review['status'], one_line=True))}")
    return 0


# --------------------------------------------------------------------------- shell completion


def _commands(parser: argparse.ArgumentParser) -> tuple[list[str], dict[str, argparse.ArgumentParser]]:
    """A parser's options and its subcommands' parsers."""
    options = [o for action in parser._actions for o in action.option_strings
               if o.startswith("--") and action.help is not argparse.SUPPRESS]
    children: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            children.update(action.choices)
    return options, children


def _words(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """Every command path (space-separated) and the words that may follow it."""
    options, children = _commands(parser)
    found = {" ".join(path): sorted(children) + options}
    for name, child in children.items():
        found.update(_words(child, path + (name,)))
    return found


def completion_script(shell: str, parser: argparse.ArgumentParser) -> str:
    """A completion script for bash or zsh: subcommands and options of every command, connection names."""
    words = _words(parser)
    cases = "\n".join(f"    {json.dumps(path)}) echo {shlex.quote(' '.join(w))} ;;" for path, w in words.items())
    body = f"""_gatewayd_words() {{
  case "$1" in
{cases}
  esac
}}
_gatewayd_complete() {{
  local cur="${{COMP_WORDS[COMP_CWORD]}}" path="" word next
  for word in "${{COMP_WORDS[@]:1:COMP_CWORD-1}}"; do  # the subcommands typed so far (not options, not values)
    case " $(_gatewayd_words "$path") " in *" $word "*) [ "${{word#-}}" = "$word" ] && path="${{path:+$path }}$word" ;; esac
  done
  local words="$(_gatewayd_words "$path")"
  case "$path" in
    connect|exec) [ "${{cur#-}}" = "$cur" ] && words="$words $(gatewayd connections --output json 2>/dev/null \\
      | python3 -c 'import json,sys; print(" ".join(c["name"] for c in json.load(sys.stdin)))' 2>/dev/null)" ;;
  esac
  COMPREPLY=($(compgen -W "$words" -- "$cur"))
}}
"""
    if shell == "bash":
        return "# gatewayd completion for bash: source <(gatewayd completion bash)\n" + body + \
            "complete -F _gatewayd_complete gatewayd\n"
    return ("#compdef gatewayd\n# gatewayd completion for zsh: source <(gatewayd completion zsh)\n"
            "autoload -U +X bashcompinit && bashcompinit\n" + body + "complete -F _gatewayd_complete gatewayd\n")


# --------------------------------------------------------------------------- the parser


class Help(argparse.RawDescriptionHelpFormatter):
    """Descriptions and examples as written (their lines kept)."""


def command(sub: Any, name: str, summary: str, examples: str = "", **kw: Any) -> argparse.ArgumentParser:
    """A subcommand with its one-line summary (in the list) and its description and examples (in its --help)."""
    epilog = "examples:\n" + "\n".join(f"  {line}" for line in examples.strip().splitlines()) if examples else None
    return sub.add_parser(name, help=summary, description=summary[:1].upper() + summary[1:] + ".", epilog=epilog,
                          formatter_class=Help, **kw)


def common(parser: argparse.ArgumentParser, formats: bool = True) -> None:
    """The options every people's command takes: which gateway, and how to print."""
    parser.add_argument("--url", help="the gateway (default: your profile's, or $GATEWAYD_URL)")
    parser.add_argument("--profile", help="which saved login to use (default: $GATEWAYD_PROFILE, or the last "
                                          "one logged in to; see `gatewayd profiles`)")
    if formats:
        parser.add_argument("--output", choices=("table", "json"), default="table",
                            help="table for people (default) or the API's JSON")
        parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # --output json, as before


def register(sub: Any, sessions: argparse.ArgumentParser, sessions_sub: Any) -> None:
    """Add the people's commands to the ``gatewayd`` parser (``sessions`` exists already: extend it)."""
    login = command(sub, "login", "log in to a gateway (local password, or --oidc in the browser)", """
gatewayd login --url http://gateway.example:8009 --email ada@example.com
echo "$PASSWORD" | gatewayd login --email ada@example.com --password-stdin
gatewayd login --profile staging --url https://staging.example:8009 --oidc""")
    common(login)
    login.add_argument("--email")
    login.add_argument("--password-stdin", action="store_true", help="read the password from standard input")
    login.add_argument("--org", help="the organization of your account, when it is not the default one "
                                     "(multi-tenant gateways: your organization's id)")
    login.add_argument("--oidc", action="store_true", help="log in with the identity provider, in the browser")
    login.add_argument("--no-browser", action="store_true", help="only print the address to open")
    login.set_defaults(func=people(cmd_login))

    logout = command(sub, "logout", "sign the saved login out at the gateway and forget it",
                     "gatewayd logout\ngatewayd logout --profile staging")
    common(logout)
    logout.set_defaults(func=people(cmd_logout))

    whoami = command(sub, "whoami", "who you are at the gateway: e-mail, groups, organization, login expiry",
                     "gatewayd whoami\ngatewayd whoami --profile staging --output json")
    common(whoami)
    whoami.set_defaults(func=people(cmd_whoami))

    profiles = command(sub, "profiles", "your saved logins, one per gateway (* marks the default)",
                       "gatewayd profiles\ngatewayd profiles --use staging")
    common(profiles)
    profiles.add_argument("--use", metavar="NAME", help="make NAME the default profile")
    profiles.set_defaults(func=people(cmd_profiles))

    connections = command(sub, "connections", "the connections you can use, and who reviews access to them",
                          "gatewayd connections\ngatewayd connections --output json")
    common(connections)
    connections.set_defaults(func=people(cmd_connections))

    connect = command(sub, "connect", "get access to a connection and start its client (psql, ssh, xfreerdp, "
                                      "the browser); arguments after -- go to the client", """
gatewayd connect pg-prod
gatewayd connect pg-prod --duration 30m --reason "INC-1234: check the orders table"
gatewayd connect web-host -- -L 8080:localhost:80
gatewayd connect pg-prod --print          # the command and connection string only""")
    common(connect)
    connect.add_argument("name")
    connect.add_argument("--duration", default="1h", help="how long the access lasts (e.g. 30m, 1h)")
    connect.add_argument("--reason", help="why you ask (the reviewers see it)")
    connect.add_argument("--print", action="store_true", help="only print the command and connection string")
    connect.set_defaults(func=people(cmd_connect), client_args=[])  # what follows "--" (see split_client_args)

    run = command(sub, "exec", "run a one-time script on a connection, its output as it runs (waits for its "
                               "review first); exits with the script's exit code", """
gatewayd exec pg-prod -c "select count(*) from orders"
gatewayd exec pg-prod -f migration.sql --reason "CHG-77: add the index"
gatewayd exec --review 5f0afc22          # run an approved script later (inside its window)""")
    common(run)
    run.add_argument("name", nargs="?")
    run.add_argument("-f", "--file", help="the script's file (- for standard input)")
    run.add_argument("-c", "--command", help="the script's text")
    run.add_argument("--reason", help="why you ask (the reviewers see it)")
    run.add_argument("--review", metavar="ID", help="run the script of this review (an approved one, or follow it "
                                                    "if it runs or ran)")
    run.set_defaults(func=people(cmd_exec))

    sessions.description = "Recorded sessions, newest first, with filters; show, replay (--follow), export, verify."
    sessions.formatter_class = Help
    sessions.epilog = """examples:
  gatewayd sessions --user dev --protocol ssh --since 2h
  gatewayd sessions --search "drop table" --since "2025-01-31 09:00" --until "2025-01-31 18:30"
  gatewayd sessions show 5f0afc22
  gatewayd sessions replay --follow 5f0afc22"""
    common(sessions)
    sessions.add_argument("--connection", help="a connection's name")
    sessions.add_argument("--user", help="part of a user's e-mail or name (any case), or their subject")
    sessions.add_argument("--type", help="database, custom, httpproxy, ... (or a protocol: ssh, postgres, mysql...)")
    sessions.add_argument("--protocol", help="a connection subtype the gateway serves: postgres, mysql, ssh, rdp, "
                                             "httpproxy... (GET /api/protocols lists them)")
    sessions.add_argument("--status", choices=("open", "done", "issued"),
                          help="issued: a credential handed out and not used yet")
    sessions.add_argument("--search", help="text inside the recordings: a statement, a command, a URL")
    sessions.add_argument("--since", help="started at or after: 2025-01-31, '2025-01-31 14:05' (UTC), 2h (ago)")
    sessions.add_argument("--until", help="started at or before (same forms)")
    sessions.add_argument("--limit", type=int, default=20)
    sessions.add_argument("--offset", type=int, default=0)
    sessions.set_defaults(func=people(cmd_sessions))
    show = command(sessions_sub, "show", "what happened: the statements, a transcript or the requests",
                   "gatewayd sessions show 5f0afc22")
    common(show)
    show.add_argument("id", help="a session id, or its first characters")
    show.set_defaults(func=people(cmd_session_show))
    replay = command(sessions_sub, "replay", "replay a terminal session at its own pace, or --follow a "
                                             "session (any protocol) as it happens",
                     "gatewayd sessions replay 5f0afc22 --speed 4\ngatewayd sessions replay --follow 5f0afc22")
    common(replay)
    replay.add_argument("id", help="a session id, or its first characters")
    replay.add_argument("--follow", action="store_true", help="show the session live until it ends (Ctrl-C stops)")
    replay.add_argument("--speed", type=float, default=1.0, help="2 plays twice as fast")
    replay.add_argument("--idle-limit", type=float, default=2.0, help="longest pause, in seconds")
    replay.set_defaults(func=people(cmd_session_replay))
    export = command(sessions_sub, "export", "a session's recording as a file: csv or json (SQL statements: "
                                             "PostgreSQL, MySQL), asciicast (a terminal: SSH), png-frames (RDP), "
                                             "text (any)",
                     "gatewayd sessions export 5f0afc22 --format csv -o statements.csv\n"
                     "gatewayd sessions export 9c1d --format asciicast -o shell.cast")
    common(export, formats=False)  # its --output is the file; --format says what is in it
    export.add_argument("id", help="a session id, or its first characters")
    export.add_argument("--format", required=True, choices=EXPORTS)
    export.add_argument("-o", "--output", help="file (folder for png-frames); default: standard output")
    export.set_defaults(func=people(cmd_session_export))

    reviews = command(sub, "reviews", "reviews waiting for you (show, approve, reject, revoke)", """
gatewayd reviews
gatewayd reviews --status all
gatewayd reviews show 5f0afc22
gatewayd reviews approve 5f0afc22 --window 22:00-23:30""")
    common(reviews)
    reviews.add_argument("--status", default="PENDING", help="PENDING (default), APPROVED, ... or all")
    reviews.set_defaults(func=people(cmd_reviews))
    decisions = reviews.add_subparsers(dest="review_command")
    show_review = command(decisions, "show", "a review in full: the script or access asked, who asks and why, "
                                             "who decided", "gatewayd reviews show 5f0afc22")
    common(show_review)
    show_review.add_argument("id", help="a review id, or its first characters")
    show_review.set_defaults(func=people(cmd_review_show))
    for decision in ("approve", "reject", "revoke"):
        decide = command(decisions, decision, f"{decision} a review", f"gatewayd reviews {decision} 5f0afc22")
        common(decide)
        decide.add_argument("id", help="a review id, or its first characters")
        if decision == "approve":
            decide.add_argument("--force", action="store_true", help="force approval (force approval groups)")
            decide.add_argument("--window", help="only inside HH:MM-HH:MM (UTC)")
        decide.set_defaults(func=people(cmd_review_decide), decision=decision)


def register_completion(sub: Any, root: argparse.ArgumentParser) -> None:
    """``gatewayd completion bash|zsh``: the script of the whole command line (added last: it lists them all)."""
    completion = command(sub, "completion", "print a shell completion script (bash or zsh)",
                         "source <(gatewayd completion bash)     # in ~/.bashrc\n"
                         "source <(gatewayd completion zsh)      # in ~/.zshrc")
    completion.add_argument("shell", choices=("bash", "zsh"))
    completion.set_defaults(func=lambda args: print(completion_script(args.shell, root), end="") or 0)


def split_client_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """``gatewayd connect NAME [options] -- ARGS``: (the gatewayd part, the native client's ARGS)."""
    if "connect" in argv and "--" in argv and argv.index("connect") < argv.index("--"):
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1:]
    return argv, []


def people(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A people's command as run by ``gatewayd``: its exit code, or one line and a non-zero code."""

    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except ClientError as exc:
            print(f"gatewayd: {printable(exc, one_line=True)}", file=sys.stderr)
            return exc.exit_code
        except (OSError, ValueError) as exc:
            print(f"gatewayd: {printable(exc, one_line=True)}", file=sys.stderr)
            return EXIT_FAILED
        except KeyboardInterrupt:
            return 130

    return run
