"""The people's commands of ``gatewayd``: login, connections, connect, exec, sessions, reviews.

Each command is a function of its parsed arguments that returns an exit code; it talks to the
gateway only through ``Api`` (the public API), prints tables for people and JSON with ``--json``,
and fails with one line (``ClientError``) instead of a traceback.
"""

from __future__ import annotations

import argparse
import base64
import getpass
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
import webbrowser
from pathlib import Path
from typing import Any, Callable, Iterable, TextIO

from gatewayd.client.api import EXIT_FAILED, EXIT_LOGIN, EXIT_USAGE, Api, ClientError, Login

POLL = 1.0  # seconds between two looks at something that is waiting (a review, a running script)
LOGIN_WAIT = 300.0  # how long `login --oidc` waits for the browser


# --------------------------------------------------------------------------- output helpers


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str]], out: TextIO = sys.stdout) -> None:
    """A plain aligned table (``columns``: key, heading); an empty list says so."""
    if not rows:
        print("(none)", file=out)
        return
    cells = [[str(row.get(key, "") if row.get(key) is not None else "") for key, _ in columns] for row in rows]
    widths = [max(len(heading), *(len(line[i]) for line in cells)) for i, (_, heading) in enumerate(columns)]
    print("  ".join(h.upper().ljust(w) for (_, h), w in zip(columns, widths)).rstrip(), file=out)
    for line in cells:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip(), file=out)


def emit(args: argparse.Namespace, data: Any, rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> int:
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        table(rows, columns)
    return 0


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


def parse_duration(text: str) -> int:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        if text[-1:] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError:
        raise ClientError(f"--duration: expected e.g. 30m or 1h, got {text!r}", EXIT_USAGE) from None


# --------------------------------------------------------------------------- login


class _Callback(http.server.BaseHTTPRequestHandler):
    """The loopback page the identity provider's redirect lands on (the token comes as ?token=)."""

    token: str | None = None

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        token = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query).get("token", [""])[0]
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
    _Callback.token = None
    redirect = f"http://127.0.0.1:{server.server_port}/callback"
    url = api.call("GET", "/login", query={"redirect": redirect}, anonymous=True).data["login_url"]
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


def cmd_login(args: argparse.Namespace) -> int:
    login = Login.load(args.url)
    api = Api(login)
    if args.oidc:
        token = _oidc_login(api, not args.no_browser)
    else:
        email = args.email or input("e-mail: ")
        password = sys.stdin.readline().rstrip("\n") if args.password_stdin else getpass.getpass("password: ")
        body = {"email": email, "password": password, **({"org_id": args.org} if args.org else {})}
        answer = api.call("POST", "/localauth/login", body, anonymous=True, expect=(200, 401))
        if answer.status == 401:
            raise ClientError("wrong e-mail or password", EXIT_LOGIN)
        token = answer.data["token"]
    login.token = token
    me = Api(login).get("/userinfo")
    path = login.save()
    print(f"logged in to {login.url} as {me['email']} (saved in {path})", file=sys.stderr)
    return 0


def cmd_logout(args: argparse.Namespace) -> int:
    """Sign the saved token out at the gateway (refused from now on, wherever a copy of it is), then forget it."""
    login = Login.load()  # the saved login: the gateway that token is for
    note = ""
    if login.token:
        try:
            Api(login).call("POST", "/logout", expect=(204, 401))
        except ClientError as exc:  # unreachable: the local copy goes anyway, and the user is told the rest
            note = f" here; the gateway was not told ({exc}): the token stays valid until it expires"
    print(("logged out" + note) if Login.forget() else "was not logged in", file=sys.stderr)
    return 0


# --------------------------------------------------------------------------- connections and access


def _needs_review(connection: dict[str, Any]) -> str:
    reviewers = connection.get("reviewers") or (connection.get("settings") or {}).get("reviewers") or []
    return ",".join(reviewers) if reviewers else "no"


def cmd_connections(args: argparse.Namespace) -> int:
    connections = Api(Login.load(args.url)).get("/connections")
    rows = [{"name": c["name"], "type": c["type"], "subtype": c["subtype"], "review": _needs_review(c),
             "resource": c.get("resource_name", "")} for c in connections]
    return emit(args, connections, rows, [("name", "name"), ("subtype", "type"), ("review", "review by"),
                                          ("resource", "resource")])


def _wait_review(api: Api, review_id: str, what: str) -> dict[str, Any]:
    status = Status()
    try:
        while True:
            review = api.get(f"/reviews/{review_id}")
            state = review["status"]
            status.show(f"{what}: review {review_id} is {state}")
            if state not in ("PENDING",):
                return review
            time.sleep(POLL)
    finally:
        status.done()


def _credentials(api: Api, name: str, seconds: int) -> dict[str, Any]:
    answer = api.call("POST", f"/connections/{urllib.parse.quote(name, safe='')}/credentials",
                      {"access_duration_seconds": seconds}, expect=(201, 202))
    if answer.status == 201:
        return answer.data
    review = _wait_review(api, answer.data["review_id"], f"access to {name}")
    if review["status"] != "APPROVED":
        raise ClientError(f"access to {name} was not granted: the review is {review['status']}")
    return api.call("POST", f"/connections/{urllib.parse.quote(name, safe='')}/credentials/"
                            f"{answer.data['session_id']}", expect=(201,)).data


def client_command(subtype: str, access: dict[str, Any]) -> tuple[list[str], dict[str, str], str]:
    """(argv, extra environment, what to print) of the native client for a credential."""
    if subtype == "postgres":
        env = {"PGHOST": access["hostname"], "PGPORT": access["port"], "PGUSER": access["username"],
               "PGPASSWORD": access["password"], "PGDATABASE": access["database_name"], "PGSSLMODE": "prefer"}
        return ["psql"], env, f"psql \"{access['connection_string']}\""
    if subtype == "mysql":  # the mysql or mariadb client (Debian's mariadb-client ships both names)
        program = "mysql" if shutil.which("mysql") or not shutil.which("mariadb") else "mariadb"
        argv = [program, "-h", access["hostname"], "-P", access["port"], "-u", access["username"]]
        database = access.get("database_name") or ""
        return (argv + ([database] if database else []), {"MYSQL_PWD": access["password"]},
                access.get("command", ""))
    if subtype == "ssh":
        return (["ssh", "-p", access["port"], f"{access['username']}@{access['hostname']}"], {},
                access.get("command", ""))
    if subtype == "rdp":
        return (["xfreerdp", f"/v:{access['hostname']}:{access['port']}", f"/u:{access['username']}",
                  f"/p:{access['password']}"], {}, access.get("command", ""))
    return [], {}, access.get("url", "")


SSH_OPTIONS_WITH_VALUE = set("BbcDEeFIiJLlmOoPpQRSWw")  # ssh(1) options that take an argument


def with_client_args(argv: list[str], extra: list[str]) -> list[str]:
    """The client's command line with the user's arguments: for ssh, its options go before the
    destination and the rest (the remote command) after it, as ssh(1) reads them."""
    if argv[:1] != ["ssh"]:
        return argv + extra
    options, index = [], 0
    while index < len(extra) and extra[index].startswith("-") and extra[index] != "--":
        token = extra[index]
        options.append(token)
        if len(token) == 2 and token[1] in SSH_OPTIONS_WITH_VALUE and index + 1 < len(extra):
            options.append(extra[index + 1])
            index += 1
        index += 1
    command = extra[index + 1:] if extra[index:index + 1] == ["--"] else extra[index:]
    return argv[:-1] + options + argv[-1:] + command


def cmd_connect(args: argparse.Namespace) -> int:
    api = Api(Login.load(args.url))
    credentials = _credentials(api, args.name, parse_duration(args.duration))
    access = credentials.get("connection_credentials") or {}
    subtype = credentials.get("connection_subtype") or credentials.get("connection_type") or ""
    argv, env, shown = client_command(subtype, access)
    if args.print or not argv and not access.get("url"):
        print(shown)
        for key in ("connection_string", "url", "header"):
            if access.get(key) and access[key] != shown:
                print(f"{key}: {access[key]}")
        print(f"valid until {credentials.get('expire_at', '?')}", file=sys.stderr)
        return 0
    if not argv:  # an HTTP connection: the browser
        print(f"opening {shown}", file=sys.stderr)
        if not webbrowser.open(shown):
            print(shown)
        return 0
    if shutil.which(argv[0]) is None:
        raise ClientError(f"{argv[0]} is not installed here; connect with: {shown}")
    return subprocess.call(with_client_args(argv, list(args.client_args)), env={**os.environ, **env})


# --------------------------------------------------------------------------- one-time scripts


def _follow(api: Api, session_id: str, out: TextIO) -> int:
    """Print a running script's output as it is recorded; its exit code once it is done."""
    shown = 0
    status = Status()
    while True:
        session = api.get(f"/sessions/{session_id}", event_stream="utf8")
        text = (session.get("event_stream") or [""])[0]
        if len(text) > shown:
            out.write(text[shown:])
            out.flush()
            shown = len(text)
        if session["status"] == "done":
            status.done()
            return int(session["exit_code"] if session["exit_code"] is not None else EXIT_FAILED)
        status.show(f"session {session_id} is running")
        time.sleep(POLL)


def cmd_exec(args: argparse.Namespace) -> int:
    if (args.file is None) == (args.command is None):
        raise ClientError("give the script with -f FILE or -c TEXT (one of them)", EXIT_USAGE)
    script = args.command if args.command is not None else (
        sys.stdin.read() if args.file == "-" else Path(args.file).read_text())
    api = Api(Login.load(args.url))
    answer = api.call("POST", "/sessions", {"connection": args.name, "script": script}, expect=(200, 201, 202))
    result = answer.data
    if result.get("review_id") and result.get("has_review") and answer.status == 202 and not result.get("output_status"):
        review = _wait_review(api, result["review_id"], "script")
        if review["status"] != "APPROVED":
            raise ClientError(f"the script was not run: its review is {review['status']}")
        answer = api.call("POST", f"/sessions/{result['session_id']}/exec", expect=(200, 201, 202))
        result = answer.data
    if result.get("output_status") == "running":
        return _follow(api, result["session_id"], sys.stdout)
    sys.stdout.write(result.get("output") or "")
    code = result.get("exit_code")
    return int(code) if code is not None else EXIT_FAILED


# --------------------------------------------------------------------------- sessions


def cmd_sessions(args: argparse.Namespace) -> int:
    api = Api(Login.load(args.url))
    page = api.get("/sessions", connection=args.connection, user=args.user, type=args.type, limit=args.limit)
    items = page["data"] if isinstance(page, dict) else page
    rows = [{"id": s["id"], "user": s["user"], "connection": s["connection"], "verb": s["verb"],
             "status": s["status"], "start": s["start_date"], "exit": s.get("exit_code")} for s in items]
    return emit(args, page, rows, [("start", "started"), ("id", "session"), ("user", "user"),
                                   ("connection", "connection"), ("verb", "verb"), ("status", "status"),
                                   ("exit", "exit")])


def _events(session: dict[str, Any]) -> Iterable[tuple[int, str, str]]:
    for offset, kind, data in session.get("event_stream") or []:
        yield offset, kind, base64.b64decode(data).decode("utf-8", "replace")


def cmd_session_show(args: argparse.Namespace) -> int:
    api = Api(Login.load(args.url))
    session = api.get(f"/sessions/{args.id}", expand="event_stream")
    if args.json:
        print(json.dumps(session, indent=2))
        return 0
    print(f"session {session['id']}: {session['user']} on {session['connection']} ({session['connection_subtype']}, "
          f"{session['verb']}), {session['status']}, exit {session.get('exit_code')}, from {session['start_date']}")
    subtype = session["connection_subtype"]
    if subtype in ("postgres", "mysql"):  # SQL sessions: statement by statement
        for row in api.get(f"/sessions/{args.id}", format="json")["statements"]:
            print(f"\n[{row['offset_ms'] / 1000:.3f}s] {row['statement'].rstrip()}")
            if row["output"]:
                print(row["output"].rstrip())
            if row["error"]:
                print(row["error"].rstrip())
    elif subtype == "ssh":
        sys.stdout.write(api.get(f"/sessions/{args.id}", event_stream="utf8")["event_stream"][0])
    else:
        marks = {"i": ">", "o": "<", "e": "!"}
        for offset, kind, text in _events(session):
            print(f"[{offset / 1000:.3f}s] {marks.get(kind, kind)} {text.rstrip()}")
    return 0


def play(cast: str, speed: float, idle_limit: float, out: TextIO, sleep: Callable[[float], None] = time.sleep) -> int:
    """Write an asciicast's output events at their own pace (``speed`` times faster, idle gaps capped)."""
    lines = cast.splitlines()
    if not lines:
        return 0
    previous = 0.0
    for line in lines[1:]:
        moment, kind, text = json.loads(line)
        if kind != "o":
            continue
        sleep(min(max(moment - previous, 0.0), idle_limit) / speed)
        previous = moment
        out.write(text)
        out.flush()
    return 0


def cmd_session_replay(args: argparse.Namespace) -> int:
    if args.speed <= 0:
        raise ClientError("--speed: must be positive", EXIT_USAGE)
    api = Api(Login.load(args.url))
    answer = api.call("GET", f"/sessions/{args.id}", query={"event_stream": "asciicast"})
    return play(answer.raw.decode("utf-8"), args.speed, args.idle_limit, sys.stdout)


def cmd_session_export(args: argparse.Namespace) -> int:
    api = Api(Login.load(args.url))
    if args.format == "png-frames":
        folder = Path(args.output or f"session-{args.id}-frames")
        folder.mkdir(parents=True, exist_ok=True)
        offset, written = 0, 0
        while True:
            page = api.get(f"/sessions/{args.id}/rdp-frames", offset=offset, limit=100)
            frames = page.get("items") or page.get("data") or page.get("frames") or []
            for frame in frames:
                index = frame["index"]
                png = api.call("GET", f"/sessions/{args.id}/rdp-frames/{index}.png").raw
                (folder / f"frame-{index:06d}.png").write_bytes(png)
                written += 1
            if len(frames) < 100:
                break
            offset += len(frames)
        print(f"{written} frames written to {folder}", file=sys.stderr)
        return 0
    query = {"asciicast": {"event_stream": "asciicast"}, "csv": {"format": "csv"}}.get(args.format, {"format": "json"})
    answer = api.call("GET", f"/sessions/{args.id}", query=query)
    if args.output:
        Path(args.output).write_bytes(answer.raw)
        print(f"written to {args.output}", file=sys.stderr)
    else:
        sys.stdout.buffer.write(answer.raw)
    return 0


# --------------------------------------------------------------------------- reviews


def cmd_reviews(args: argparse.Namespace) -> int:
    api = Api(Login.load(args.url))
    reviews = api.get("/reviews", status=args.status)
    rows = [{"id": r["id"], "type": r["type"], "status": r["status"],
             "connection": (r.get("review_connection") or {}).get("name", ""),
             "owner": (r.get("review_owner") or {}).get("email", ""), "created": r["created_at"]} for r in reviews]
    return emit(args, reviews, rows, [("created", "created"), ("id", "review"), ("type", "type"),
                                      ("status", "status"), ("connection", "connection"), ("owner", "asked by")])


def cmd_review_decide(args: argparse.Namespace) -> int:
    api = Api(Login.load(args.url))
    body: dict[str, Any] = {"status": {"approve": "APPROVED", "reject": "REJECTED", "revoke": "REVOKED"}[args.decision]}
    if getattr(args, "force", False):
        body["force_review"] = True
    if getattr(args, "window", None):
        start, _, end = args.window.partition("-")
        body["time_window"] = {"type": "time_range", "configuration": {"start_time": start, "end_time": end}}
    review = api.call("PUT", f"/reviews/{args.id}", body).data
    print(f"review {review['id']}: {review['status']}")
    return 0


# --------------------------------------------------------------------------- the parser


def _common(parser: argparse.ArgumentParser, listing: bool = False) -> None:
    parser.add_argument("--url", help="the gateway (default: the one you logged in to, or $GATEWAYD_URL)")
    if listing:
        parser.add_argument("--json", action="store_true", help="the API's JSON instead of a table")


def register(sub: Any, sessions: argparse.ArgumentParser, sessions_sub: Any) -> None:
    """Add the people's commands to the ``gatewayd`` parser (``sessions`` exists already: extend it)."""
    login = sub.add_parser("login", help="log in to a gateway (local password, or --oidc in the browser)")
    _common(login)
    login.add_argument("--email")
    login.add_argument("--password-stdin", action="store_true", help="read the password from standard input")
    login.add_argument("--org", help="the organization of your account, when it is not the default one "
                                     "(multi-tenant gateways: your organization's id)")
    login.add_argument("--oidc", action="store_true", help="log in with the identity provider, in the browser")
    login.add_argument("--no-browser", action="store_true", help="only print the address to open")
    login.set_defaults(func=_people(cmd_login))

    logout = sub.add_parser("logout", help="sign the saved login out at the gateway and forget it")
    logout.set_defaults(func=_people(cmd_logout))

    connections = sub.add_parser("connections", help="the connections you can use")
    _common(connections, listing=True)
    connections.set_defaults(func=_people(cmd_connections))

    connect = sub.add_parser("connect", help="get access to a connection and start its client (psql, ssh, "
                                             "xfreerdp, the browser); arguments after -- go to the client")
    _common(connect)
    connect.add_argument("name")
    connect.add_argument("--duration", default="1h", help="how long the access lasts (e.g. 30m, 1h)")
    connect.add_argument("--print", action="store_true", help="only print the command and connection string")
    connect.set_defaults(func=_people(cmd_connect), client_args=[])  # what follows "--" (see split_client_args)

    run = sub.add_parser("exec", help="run a one-time script on a connection (waits for its review); "
                                      "exits with the script's exit code")
    _common(run)
    run.add_argument("name")
    run.add_argument("-f", "--file", help="the script's file (- for standard input)")
    run.add_argument("-c", "--command", help="the script's text")
    run.set_defaults(func=_people(cmd_exec))

    _common(sessions, listing=True)
    sessions.add_argument("--connection")
    sessions.add_argument("--user", help="a user's subject id")
    sessions.add_argument("--type")
    sessions.add_argument("--limit", type=int, default=20)
    sessions.set_defaults(func=_people(cmd_sessions))
    show = sessions_sub.add_parser("show", help="what happened: statements, a transcript or the requests")
    _common(show, listing=True)
    show.add_argument("id")
    show.set_defaults(func=_people(cmd_session_show))
    replay = sessions_sub.add_parser("replay", help="replay a terminal session at its own pace")
    _common(replay)
    replay.add_argument("id")
    replay.add_argument("--speed", type=float, default=1.0, help="2 plays twice as fast")
    replay.add_argument("--idle-limit", type=float, default=2.0, help="longest pause, in seconds")
    replay.set_defaults(func=_people(cmd_session_replay))
    export = sessions_sub.add_parser("export", help="a session's recording as a file")
    _common(export)
    export.add_argument("id")
    export.add_argument("--format", required=True, choices=("csv", "json", "asciicast", "png-frames"))
    export.add_argument("-o", "--output", help="file (folder for png-frames); default: standard output")
    export.set_defaults(func=_people(cmd_session_export))

    reviews = sub.add_parser("reviews", help="reviews waiting for you (approve, reject, revoke)")
    _common(reviews, listing=True)
    reviews.add_argument("--status", default="PENDING", help="PENDING (default), APPROVED, ... or '' for all")
    reviews.set_defaults(func=_people(cmd_reviews))
    decisions = reviews.add_subparsers(dest="review_command")
    for decision in ("approve", "reject", "revoke"):
        command = decisions.add_parser(decision, help=f"{decision} a review")
        _common(command)
        command.add_argument("id")
        if decision == "approve":
            command.add_argument("--force", action="store_true", help="force approval (force approval groups)")
            command.add_argument("--window", help="only inside HH:MM-HH:MM (UTC)")
        command.set_defaults(func=_people(cmd_review_decide), decision=decision)


def split_client_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """``gatewayd connect NAME [options] -- ARGS``: (the gatewayd part, the native client's ARGS)."""
    if "connect" in argv and "--" in argv and argv.index("connect") < argv.index("--"):
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1:]
    return argv, []


def _people(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A people's command as run by ``gatewayd``: its exit code, or one line and a non-zero code."""

    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except ClientError as exc:
            print(f"gatewayd: {exc}", file=sys.stderr)
            return exc.exit_code
        except (OSError, ValueError) as exc:
            print(f"gatewayd: {exc}", file=sys.stderr)
            return EXIT_FAILED
        except KeyboardInterrupt:
            return 130

    return run
