"""The people's command line end to end: the real ``gatewayd`` CLI as a subprocess against a real
daemon (postgres listener) and a real PostgreSQL, with a real psql launched by ``gatewayd connect``.

Each person has their own login file (``GATEWAYD_CLIENT_CONFIG``); the tests check exit codes, that a
failure is one line (never a traceback), and what the API then shows.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import signal
import stat
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from gatewayd.client.commands import play
from tests.apiclient import Api, postgres_env
from tests.conftest import BIN, ROOT, Daemon, free_port, gatewayd_command, proxy_daemon
from tests.pgpeer import unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")

PASSWORDS = {"ada@example.com": "ada's long passphrase", "rita@example.com": "rita's long passphrase",
             "dora@example.com": "dora's long passphrase"}


@pytest.fixture(scope="module")
def cluster(pg_target):
    """The session's PostgreSQL target (conftest): started once for every module."""
    return pg_target


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    daemon = proxy_daemon(tmp_path_factory, "peoplecli", "postgres", {"sessions.exec_wait": "2s"})
    daemon.cli("user", "passwd", "--email", "ada@example.com", "--groups", "admin,dba", "--password-stdin",
               input=PASSWORDS["ada@example.com"] + "\n")
    daemon.cli("user", "passwd", "--email", "rita@example.com", "--groups", "dev", "--password-stdin",
               input=PASSWORDS["rita@example.com"] + "\n")
    daemon.cli("user", "passwd", "--email", "dora@example.com", "--groups", "dba", "--password-stdin",
               input=PASSWORDS["dora@example.com"] + "\n")
    yield daemon
    assert daemon.stop() == 0


class Person:
    """One person at a terminal: the CLI with their own login file."""

    def __init__(self, gateway: Daemon, folder: Path, email: str) -> None:
        self.gateway = gateway
        self.email = email
        self.login_file = folder / f"{email}.json"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("GATEWAYD_", "PG"))}
        env["GATEWAYD_CLIENT_CONFIG"] = str(self.login_file)
        return env

    def run(self, *args: str, input: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return gatewayd_command([str(BIN / "gatewayd"), *args], env=self.env(), cwd=ROOT, input=input, check=False,
                                timeout=timeout)

    def start(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen([str(BIN / "gatewayd"), *args], env=self.env(), cwd=ROOT, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def write_login(self, saved: dict) -> None:
        """The login file, with ``saved`` in it, private as the CLI keeps it (0600)."""
        self.login_file.touch(mode=0o600)
        self.login_file.write_text(json.dumps(saved))

    def saved_token(self, profile: str | None = None) -> str:
        """The token the login file keeps for ``profile`` (default: the default profile)."""
        saved = json.loads(self.login_file.read_text())
        return saved["profiles"][profile or saved["default"]]["token"]

    async def done_session(self, connection: str, **fields: object) -> dict:
        """This person's first session on ``connection`` listed done with ``fields``: a client exits when the
        gateway ends its channel, and the gateway closes the session just after (bounded: one never closed
        fails the test)."""
        for _ in range(100):
            listed = json.loads(self.run("sessions", "--connection", connection, "--json").stdout)["data"]
            found = [s for s in listed if s["status"] == "done" and fields.items() <= s.items()]
            if found:
                return found[0]
            await asyncio.sleep(0.1)
        raise AssertionError(f"no session done with {fields}: {listed}")

    def login(self) -> None:
        done = self.run("login", "--url", self.gateway.url.removesuffix("/api"), "--email", self.email,
                        "--password-stdin", input=PASSWORDS[self.email] + "\n")
        assert done.returncode == 0, done.stderr


def client_processes(parent: int) -> dict[int, list[str]]:
    """The command lines of ``parent``'s child processes, as every local user reads them (/proc, ps)."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                found[int(entry.name)] = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return found


def one_line_failure(done: subprocess.CompletedProcess[str], code: int, needle: str) -> None:
    assert done.returncode == code, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith("gatewayd: ") and needle in done.stderr, done.stderr


@pytest.fixture(scope="module")
def people(gateway, tmp_path_factory):
    folder = tmp_path_factory.mktemp("logins")
    ada, rita = Person(gateway, folder, "ada@example.com"), Person(gateway, folder, "rita@example.com")
    ada.login()
    rita.login()
    return ada, rita


@pytest.fixture(scope="module")
async def connections(gateway, cluster, people):
    async with aiohttp.ClientSession() as http:
        admin = Api(gateway, http, gateway.token("ada@example.com", groups="admin,dba"))
        plain = await admin.connection("pg", "database", "postgres", postgres_env(cluster))
        reviewed = await admin.connection("pgrev", "database", "postgres", postgres_env(cluster),
                                          {"reviewers": ["dba"], "jit_review": False})
        yield plain["name"], reviewed["name"]


def test_login_keeps_a_private_token_and_failures_are_one_line(gateway, people, tmp_path):
    ada, _ = people
    assert stat.S_IMODE(ada.login_file.stat().st_mode) == 0o600
    assert ada.saved_token()
    stranger = Person(gateway, tmp_path, "ada@example.com")
    done = stranger.run("login", "--url", gateway.url.removesuffix("/api"), "--email", "ada@example.com",
                        "--password-stdin", input="not the password\n")
    one_line_failure(done, 4, "wrong e-mail or password")
    assert not stranger.login_file.exists()
    one_line_failure(stranger.run("connections"), 4, "not logged in")
    dead = f"http://127.0.0.1:{free_port()}"
    one_line_failure(stranger.run("login", "--url", dead, "--email", "ada@example.com", "--password-stdin",
                                  input="whatever\n"), 3, "cannot reach the gateway")
    stranger.write_login({"url": dead, "token": "a-token"})
    one_line_failure(stranger.run("sessions"), 3, f"cannot reach the gateway at {dead}")

    expired = Person(gateway, tmp_path, "short@example.com")
    expired.write_login({"url": gateway.url.removesuffix("/api"),
                         "token": gateway.token("short@example.com", ttl="1s")})
    token = json.loads(expired.login_file.read_text())["token"]
    for _ in range(100):  # until the gateway refuses it (its second has passed)
        try:
            urllib.request.urlopen(urllib.request.Request(gateway.url + "/userinfo",
                                                          headers={"Authorization": f"Bearer {token}"}), timeout=10)
        except urllib.error.HTTPError as refused:
            assert refused.code == 401
            break
        time.sleep(0.1)
    one_line_failure(expired.run("connections"), 4, "gatewayd login")
    assert expired.run("logout").returncode == 0 and not expired.login_file.exists()


async def test_logout_signs_the_token_out_at_the_gateway(gateway, tmp_path):
    """Issue 31, item 8: ``gatewayd logout`` only forgot the file; a copy of the token went on working."""
    leaver = Person(gateway, tmp_path, "rita@example.com")
    leaver.login()
    token = leaver.saved_token()
    async with aiohttp.ClientSession() as http:
        api = Api(gateway, http, token)
        assert (await api("GET", "/userinfo"))[0] == 200
        done = leaver.run("logout")
        assert done.returncode == 0 and done.stderr.strip() == "logged out", done.stderr
        assert not leaver.login_file.exists()
        assert await api("GET", "/userinfo") == (401, {"message": "access denied"})


async def test_connections_connect_with_real_psql_and_sessions(gateway, people, connections):
    ada, rita = people
    plain, reviewed = connections
    listed = rita.run("connections", "--json")
    assert listed.returncode == 0, listed.stderr
    assert {plain, reviewed} <= {c["name"] for c in json.loads(listed.stdout)}
    table = rita.run("connections").stdout
    assert table.splitlines()[0].split()[:3] == ["NAME", "TYPE", "REVIEW"] and reviewed in table and "dba" in table

    printed = rita.run("connect", plain, "--print", "--duration", "10m")
    assert printed.returncode == 0 and printed.stdout.startswith('psql "postgres://pg-'), printed

    connected = rita.run("connect", plain, "--", "-At", "-c", "select 6 * 7 as answer")
    assert connected.returncode == 0, connected.stderr
    assert connected.stdout.strip() == "42"

    used = await rita.done_session(plain, verb="connect")
    shown = rita.run("sessions", "show", used["id"])
    assert shown.returncode == 0 and "select 6 * 7 as answer" in shown.stdout and "42" in shown.stdout, shown
    exported = rita.run("sessions", "export", used["id"], "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(exported.stdout)))
    assert any("select 6 * 7" in r["statement"] and "42" in r["output"] for r in rows), rows


async def test_exec_exit_codes_and_a_reviewed_script_approved_from_the_cli(gateway, people, connections):
    ada, rita = people
    plain, reviewed = connections
    done = rita.run("exec", plain, "-c", "select 'from a script' as said")
    assert done.returncode == 0 and "from a script" in done.stdout, done
    failed = rita.run("exec", plain, "-c", "select 1/0")
    assert failed.returncode != 0 and "division by zero" in failed.stdout + failed.stderr

    waiting = rita.start("exec", reviewed, "-c", "select 'approved by dora' as note")
    deadline = time.monotonic() + 60
    pending: list = []
    while not pending and time.monotonic() < deadline:
        listed = ada.run("reviews", "--json")
        pending = [r for r in json.loads(listed.stdout) if r["review_owner"]["email"] == "rita@example.com"]
        time.sleep(0.2)
    assert pending, "the script's review never showed up in ada's queue"
    listed = ada.run("reviews").stdout  # issue 34, item 2: the table says what is asked, by its short id
    assert pending[0]["id"][:8] in listed and "select 'approved by dora' as note" in listed, listed
    decided = ada.run("reviews", "approve", pending[0]["id"][:8])
    assert decided.returncode == 0 and "APPROVED" in decided.stdout, decided
    out, err = waiting.communicate(timeout=120)
    assert waiting.returncode == 0 and "approved by dora" in out, (out, err)
    assert f"review {pending[0]['id']}" in err  # the live status line said what it waited for

    rejected = rita.start("exec", reviewed, "-c", "select 'never' as note")
    pending = []
    while not pending and time.monotonic() < deadline + 60:
        pending = [r for r in json.loads(ada.run("reviews", "--json").stdout)
                   if r["review_owner"]["email"] == "rita@example.com"]
        time.sleep(0.2)
    assert ada.run("reviews", "reject", pending[0]["id"]).returncode == 0
    out, err = rejected.communicate(timeout=120)
    assert rejected.returncode == 1 and "REJECTED" in err and "never" not in out


def test_replay_writes_the_output_at_its_own_pace():
    cast = "\n".join([json.dumps({"version": 2, "width": 80, "height": 24}), json.dumps([0.5, "o", "$ ls\r\n"]),
                      json.dumps([0.6, "i", "ls\r"]), json.dumps([5.0, "o", "a  b\r\n"])])
    out, pauses = io.StringIO(), []
    play(cast, speed=2.0, idle_limit=3.0, out=out, sleep=pauses.append)
    assert out.getvalue() == "$ ls\r\na  b\r\n"
    assert pauses == [0.25, 1.5]  # 0.5 s at twice the speed; a 4.5 s gap capped at 3 s, then halved


# ------------------------------------------------------------------ issue 34: reviews you can see and act on


def wait_for(look, what: str, guard: float = 60):
    """``look()``'s first true answer (``guard``: a hang guard, not a timing)."""
    deadline = time.monotonic() + guard
    while time.monotonic() < deadline:
        found = look()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"{what} never happened")


def interrupted(process: subprocess.Popen[str]) -> tuple[str, str]:
    """Ctrl-C to a command that waits, and what it printed. One that has not ended within the hang guard is
    described from /proc (its state and its signals: pending, blocked, ignored, caught; this process's too),
    then killed, so that the failure says where it stood (it told of a suite started as a background job,
    SIGINT ignored: conftest.terminal_signals)."""
    process.send_signal(signal.SIGINT)
    try:
        return process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        fields = ("State", "Threads", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")
        theirs = [line for line in Path(f"/proc/{process.pid}/status").read_text().splitlines()
                  if line.startswith(fields)]
        wchan = Path(f"/proc/{process.pid}/wchan").read_text()
        ours = [line for line in Path("/proc/self/status").read_text().splitlines()
                if line.startswith(("SigBlk", "SigIgn"))]
        process.kill()
        _, err = process.communicate()
        raise AssertionError(f"no end within 60 s of SIGINT: {theirs}, waiting in {wchan!r}; the test process: "
                             f"{ours}; its stderr: {err!r}") from None


def pending_of(person: Person, owner: str, connection: str) -> list[dict]:
    listed = person.run("reviews", "--output", "json")
    assert listed.returncode == 0, listed.stderr
    return [r for r in json.loads(listed.stdout)
            if r["review_owner"]["email"] == owner and r["review_connection"]["name"] == connection]


async def test_connections_say_who_reviews_access_from_an_access_request_rule(gateway, cluster, people):
    """Item 1: a connection reviewed through an access request rule said `REVIEW BY no`."""
    ada, rita = people
    async with aiohttp.ClientSession() as http:
        admin = Api(gateway, http, gateway.token("ada@example.com", groups="admin,dba"))
        ruled = await admin.connection("pgrule", "database", "postgres", postgres_env(cluster))
        status, rule = await admin("POST", "/access-requests/rules", {
            "name": f"rule-{ruled['name']}", "access_type": "jit", "connection_names": [ruled["name"]],
            "reviewers_groups": ["security"]})
        assert status == 201, rule
    table = rita.run("connections").stdout
    row = next(line for line in table.splitlines() if line.startswith(ruled["name"] + " "))
    assert "security (access)" in row, table
    listed = json.loads(rita.run("connections", "--output", "json").stdout)
    policy = next(c for c in listed if c["name"] == ruled["name"])["review_policy"]
    assert policy == {"jit": {"reviewers": ["security"], "min_approvals": 1, "rule": rule["name"]}, "exec": None}


async def test_asking_again_gets_the_open_request_and_an_interrupted_exec_runs_later(gateway, people, connections):
    """Item 3: Ctrl-C during `connect` or `exec` left a request pending and the next ask filed another; an
    interrupted `exec` had no way to run its script once approved. Item 2: the reviewer saw no script, no reason,
    and a short id was a 404; item 8: a reviewer got a 403 on the session of the script they approved."""
    ada, rita = people
    _, reviewed = connections
    dora = Person(gateway, rita.login_file.parent, "dora@example.com")
    dora.login()
    script = "select 'ran later' as outcome"
    asking = rita.start("exec", reviewed, "-c", script, "--reason", "INC-42: count the late orders")
    first = wait_for(lambda: pending_of(dora, "rita@example.com", reviewed), "the review in dora's queue")
    out, err = interrupted(asking)  # Ctrl-C while it waits for the review
    assert asking.returncode == 130 and "Traceback" not in err, err
    short = first[0]["id"][:8]
    assert f"gatewayd exec --review {short}" in err, err

    async with aiohttp.ClientSession() as http:  # asking the same again answers the same request
        status, again = await Api(gateway, http, rita.saved_token())("POST", "/sessions",
                                                                      {"connection": reviewed, "script": script})
    assert status == 202 and (again["review_id"], again["session_id"]) == (first[0]["id"], first[0]["session_id"])
    assert pending_of(dora, "rita@example.com", reviewed) == first  # not a second one

    table = dora.run("reviews").stdout  # the reviewer sees what and why, by short id
    assert short in table and script in table and "INC-42: count the late orders" in table, table
    shown = dora.run("reviews", "show", short)
    assert shown.returncode == 0, shown.stderr
    for needle in (first[0]["id"], reviewed, "rita@example.com", "INC-42: count the late orders", script, "PENDING"):
        assert needle in shown.stdout, (needle, shown.stdout)
    decided = dora.run("reviews", "approve", short)
    assert decided.returncode == 0 and "APPROVED" in decided.stdout, decided

    ran = rita.run("exec", "--review", short)  # the approved script, run later
    assert ran.returncode == 0 and "ran later" in ran.stdout, ran
    session_id = first[0]["session_id"]
    seen = dora.run("sessions", "show", session_id[:8])  # the reviewer reads the session of what they approved
    assert seen.returncode == 0 and "ran later" in seen.stdout, seen
    twice = rita.run("exec", "--review", short)  # ran already: its output again, not a second run
    assert twice.returncode == 0 and "ran later" in twice.stdout, twice
    async with aiohttp.ClientSession() as http:
        status, session = await Api(gateway, http, gateway.token("ada@example.com", groups="admin,dba"))(
            "GET", f"/sessions/{session_id}")
    assert session["review"]["status"] == "EXECUTED"


async def test_a_jit_request_asked_twice_is_one_request(gateway, cluster, people):
    """Item 3: each `connect` to a just-in-time connection filed a new review while one was pending."""
    ada, rita = people
    async with aiohttp.ClientSession() as http:
        admin = Api(gateway, http, gateway.token("ada@example.com", groups="admin,dba"))
        jit = await admin.connection("pgjit", "database", "postgres", postgres_env(cluster), {"reviewers": ["dba"]})
    asking = rita.start("connect", jit["name"], "--print", "--reason", "look at a lock")
    first = wait_for(lambda: pending_of(ada, "rita@example.com", jit["name"]), "the jit review")
    out, err = interrupted(asking)
    assert asking.returncode == 130 and f"gatewayd connect {jit['name']}" in err, err
    asking = rita.start("connect", jit["name"], "--print")
    try:
        wait_for(lambda: f"review {first[0]['id']}" in (asking.stderr.readline() or ""), "the wait for the same review")
        assert pending_of(ada, "rita@example.com", jit["name"]) == first
        assert ada.run("reviews", "approve", first[0]["id"][:8]).returncode == 0
        out, err = asking.communicate(timeout=60)
        assert asking.returncode == 0 and out.startswith('psql "postgres://pg-'), (out, err)
    finally:
        if asking.poll() is None:
            asking.kill()


def test_an_issued_credential_not_used_yet_is_not_a_live_session(people, connections):
    """Item 4: issued-but-unused credentials looked like live sessions ("ready", the same dot as "open")."""
    _, rita = people
    plain, _ = connections
    printed = rita.run("connect", plain, "--print", "--output", "json")  # a credential, not used
    assert printed.returncode == 0, printed.stderr
    issued = json.loads(printed.stdout)["session_id"]
    table = rita.run("sessions", "--connection", plain).stdout
    row = next(line for line in table.splitlines() if issued[:8] in line)
    assert row.split()[-1] == "issued" or " issued" in row, row
    found = json.loads(rita.run("sessions", "--status", "issued", "--output", "json").stdout)["data"]
    assert issued in [s["id"] for s in found] and all(s["status"] == "ready" for s in found)


# ------------------------------------------------------------------ issue 34, item 9: the CLI for every day


def test_profiles_keep_several_gateways_and_whoami_says_which(gateway, tmp_path):
    """One login at a time: logging in to http://localhost:PORT forgot the login to http://127.0.0.1:PORT."""
    ada = Person(gateway, tmp_path, "ada@example.com")
    numeric = gateway.url.removesuffix("/api")
    named = numeric.replace("127.0.0.1", "localhost")
    assert ada.run("login", "--url", numeric, "--email", ada.email, "--password-stdin",
                   input=PASSWORDS[ada.email] + "\n").returncode == 0
    done = ada.run("login", "--url", named, "--profile", "local", "--email", ada.email, "--password-stdin",
                   input=PASSWORDS[ada.email] + "\n")
    assert done.returncode == 0 and "profile local" in done.stderr, done.stderr
    listed = json.loads(ada.run("profiles", "--output", "json").stdout)
    assert listed["default"] == "local" and set(listed["profiles"]) == {"default", "local"}
    assert listed["profiles"]["default"]["logged_in"] and listed["profiles"]["local"]["logged_in"]
    assert ada.run("whoami", "--profile", "default").stdout.startswith(f"ada@example.com at {numeric} ")
    env = {**ada.env(), "GATEWAYD_PROFILE": "default"}
    picked = gatewayd_command([str(BIN / "gatewayd"), "whoami", "--output", "json"], env=env, cwd=ROOT, check=False)
    me = json.loads(picked.stdout)
    assert me["profile"] == "default" and me["url"] == numeric and me["email"] == ada.email
    assert "admin" in me["groups"] and me["token_expires_at"]
    by_url = ada.run("whoami", "--url", numeric)  # the profile whose gateway that is
    assert by_url.returncode == 0 and "(profile default)" in by_url.stdout, by_url
    assert ada.run("profiles", "--use", "default").returncode == 0
    assert json.loads(ada.run("profiles", "--output", "json").stdout)["default"] == "default"
    assert ada.run("logout", "--profile", "local").returncode == 0
    assert set(json.loads(ada.run("profiles", "--output", "json").stdout)["profiles"]) == {"default"}


PEOPLE_COMMANDS = [("login",), ("logout",), ("whoami",), ("profiles",), ("connections",), ("connect",), ("exec",),
                   ("sessions",), ("sessions", "show"), ("sessions", "replay"), ("sessions", "export"),
                   ("reviews",), ("reviews", "show"), ("reviews", "approve"), ("reviews", "reject"),
                   ("reviews", "revoke"), ("status",), ("version",), ("completion",)]


@pytest.fixture(scope="module")
def rita_session(people, connections) -> str:
    """A session of rita's on the plain connection (a credential issued with `connect --print`)."""
    _, rita = people
    printed = rita.run("connect", connections[0], "--print", "--output", "json")
    assert printed.returncode == 0, printed.stderr
    return json.loads(printed.stdout)["session_id"]


def test_every_command_has_help_with_examples_and_answers_json(gateway, people, connections, rita_session):
    ada, rita = people
    session = rita_session
    for words in PEOPLE_COMMANDS:
        shown = ada.run(*words, "--help")
        assert shown.returncode == 0 and "examples:" in shown.stdout, (words, shown.stdout)
        assert shown.stdout.count("\n") > 5, words
    for words in (("whoami",), ("profiles",), ("connections",), ("sessions",), ("reviews", "--status", "all"),
                  ("sessions", "show", session[:8]), ("version",), ("status",)):
        done = rita.run(*words, "--output", "json")
        assert done.returncode == 0, (words, done.stderr)
        json.loads(done.stdout)  # JSON, whole


def test_failures_are_one_line_and_say_what_to_do(gateway, people, connections, rita_session, tmp_path):
    """Item 9: `login < /dev/null` ended in a traceback; `--type ssh` found nothing; exports fit some protocols
    without saying so; `--duration 100h` was refused in seconds."""
    ada, rita = people
    plain, _ = connections
    nobody = Person(gateway, tmp_path, "nobody@example.com")
    one_line_failure(nobody.run("login", "--url", gateway.url.removesuffix("/api"), input=""), 2,
                     "no terminal to ask for your e-mail: use --email")
    one_line_failure(nobody.run("login", "--url", gateway.url.removesuffix("/api"), "--email", "a@b.c", input=""), 2,
                     "no terminal to ask for your password")
    session = rita_session
    one_line_failure(rita.run("sessions", "export", session[:8], "--format", "asciicast"), 2,
                     "--format asciicast exports ssh sessions; session")
    one_line_failure(rita.run("connect", plain, "--duration", "100h", "--print"), 2,
                     "--duration 100h is longer than this gateway allows for this connection (at most 2d)")
    one_line_failure(rita.run("sessions", "show", "ffffffff"), 1, "not found")
    by_type = json.loads(rita.run("sessions", "--type", "postgres", "--output", "json").stdout)["data"]
    assert by_type and all(s["connection_subtype"] == "postgres" for s in by_type)  # the protocol people meant
    away = rita.run("status")  # a person's machine: no store here, the gateway's readiness through its API
    assert away.returncode == 0 and "ready" in away.stdout and "Traceback" not in away.stderr, away


def test_bash_completion_completes_commands_options_and_connection_names(gateway, people, connections, tmp_path):
    ada, _ = people
    plain, reviewed = connections
    script = tmp_path / "gatewayd.bash"
    script.write_text(ada.run("completion", "bash").stdout)
    probe = f"""source {script}
complete_words() {{ COMP_WORDS=("$@"); COMP_CWORD=$(( $# - 1 )); _gatewayd_complete; echo "${{COMPREPLY[*]}}"; }}
complete_words gatewayd rev
complete_words gatewayd reviews ap
complete_words gatewayd sessions --since 2h --pro
complete_words gatewayd connect pg
"""
    env = {**ada.env(), "PATH": f"{BIN}:{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, env=env, timeout=60)
    lines = done.stdout.splitlines()
    assert lines[0] == "reviews" and lines[1] == "approve" and set(lines[2].split()) == {"--protocol", "--profile"}, \
        (lines, done.stderr)
    assert {plain, reviewed} <= set(lines[3].split()), lines
    zsh = ada.run("completion", "zsh").stdout
    assert zsh.startswith("#compdef gatewayd") and "bashcompinit" in zsh


async def test_a_gateway_older_than_the_client_is_said_to_be_so(gateway, people, tmp_path):
    """The CLI asks the gateway which protocols it serves (GET /api/protocols); a gateway from before that
    route -- here the real one behind a forwarder that answers that route as an older gateway does, 404 -- is
    said to be older, in one line, instead of the CLI guessing protocol names of its own."""
    from aiohttp import web

    ada, _ = people
    target = gateway.url.removesuffix("/api")

    async def forward(request: web.Request) -> web.Response:
        if request.path == "/api/protocols":
            return web.json_response({"message": "not found"}, status=404)
        async with aiohttp.ClientSession() as http, http.request(
                request.method, target + request.path_qs, headers={"Authorization": request.headers.get(
                    "Authorization", "")}, data=await request.read()) as answer:
            return web.Response(body=await answer.read(), status=answer.status,
                                content_type=answer.content_type)

    app = web.Application()
    app.router.add_route("*", "/{path:.*}", forward)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        older = f"http://127.0.0.1:{port}"
        saved = json.loads(ada.login_file.read_text())
        saved["profiles"]["older"] = {"url": older, "token": ada.saved_token()}
        ada.login_file.write_text(json.dumps(saved))
        listed = await asyncio.to_thread(ada.run, "sessions", "--profile", "older", "--json")
        assert listed.returncode == 0, listed.stderr  # what needs no protocol still works through it
        one_line_failure(await asyncio.to_thread(ada.run, "sessions", "--profile", "older", "--protocol", "postgres"),
                         1, "does not list its protocols (GET /api/protocols): it is older than this client")
    finally:
        saved = json.loads(ada.login_file.read_text())
        saved["profiles"].pop("older", None)
        ada.login_file.write_text(json.dumps(saved))
        await runner.cleanup()


async def test_a_redirect_is_refused_and_the_token_never_reaches_the_host_it_names(gateway, people):
    """urllib follows a redirect with the request's headers: a gateway URL answering 307 to another host got
    the person's token sent there. Now the CLI refuses the redirect in one line, and the other host sees none."""
    from aiohttp import web

    ada, _ = people
    seen: list[str] = []
    sink_port, redirecting_port = free_port(), free_port()

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect(f"http://127.0.0.1:{sink_port}{request.path_qs}")

    async def sink(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization", ""))
        return web.json_response({"email": "someone@elsewhere.example"})

    runners = []
    for port, handler in ((redirecting_port, redirect), (sink_port, sink)):
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
    saved = json.loads(ada.login_file.read_text())
    saved["profiles"]["moved"] = {"url": f"http://127.0.0.1:{redirecting_port}", "token": ada.saved_token()}
    ada.login_file.write_text(json.dumps(saved))
    try:
        for words in (("whoami",), ("sessions", "replay", "--follow", "ffffffff")):
            done = await asyncio.to_thread(ada.run, *words, "--profile", "moved")
            one_line_failure(done, 1, f"the answer is a redirect (307) to http://127.0.0.1:{sink_port}/api/")
        assert seen == []
    finally:
        saved = json.loads(ada.login_file.read_text())
        saved["profiles"].pop("moved", None)
        ada.login_file.write_text(json.dumps(saved))
        for runner in runners:
            await runner.cleanup()


async def test_control_characters_from_others_reach_no_terminal(gateway, people, connections):
    """A reason, a script or a message the gateway relays was printed as it came: rita's reason with OSC 52
    (set the clipboard) and a clear-screen ran in the reviewer's terminal on `gatewayd reviews`. Now each
    control character is written out (\\x1b) in tables, `reviews show`, `sessions show` and error lines."""
    ada, rita = people
    _, reviewed = connections
    evil = "INC-7\x1b]52;c;cm0gLXJmIH4K\x07\x1b[2J\rfix"
    async with aiohttp.ClientSession() as http:
        status, asked = await Api(gateway, http, rita.saved_token())(
            "POST", "/sessions", {"connection": reviewed, "script": f"select 1 -- {evil}", "reason": evil})
    assert status == 202, asked
    review = asked["review_id"][:8]
    try:
        for words in (("reviews",), ("reviews", "show", review), ("sessions", "show", asked["session_id"][:8])):
            shown = ada.run(*words)
            assert shown.returncode == 0, (words, shown.stderr)
            assert "INC-7\\x1b]52;c;cm0gLXJmIH4K\\x07\\x1b[2J\\x0dfix" in shown.stdout, (words, shown.stdout)
            assert not {"\x1b", "\x07", "\r"} & set(shown.stdout), (words, shown.stdout)
    finally:
        assert ada.run("reviews", "reject", review).returncode == 0

    from aiohttp import web

    async def hostile(request: web.Request) -> web.Response:  # a gateway whose refusals carry escapes
        return web.json_response({"message": evil}, status=403)

    app = web.Application()
    app.router.add_route("*", "/{path:.*}", hostile)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        saved = json.loads(ada.login_file.read_text())
        saved["profiles"]["hostile"] = {"url": f"http://127.0.0.1:{port}", "token": "t"}
        ada.login_file.write_text(json.dumps(saved))
        refused = await asyncio.to_thread(ada.run, "whoami", "--profile", "hostile")
        one_line_failure(refused, 1, "403 INC-7\\x1b]52;c;cm0gLXJmIH4K\\x07\\x1b[2J\\x0dfix")
    finally:
        saved = json.loads(ada.login_file.read_text())
        saved["profiles"].pop("hostile", None)
        ada.login_file.write_text(json.dumps(saved))
        await runner.cleanup()


def test_a_login_never_writes_through_a_name_another_user_set_up(gateway, tmp_path):
    """The login file was written through ``<name>.tmp``, opened without O_EXCL: in a folder others may write to,
    a symlink planted under that name to a file of theirs got the token (and the login file became that
    symlink). Now the file is written through a new file of a random name, and the planted one stays empty."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    planted = shared / "theirs"
    planted.touch(mode=0o666)
    ada = Person(gateway, shared, "ada@example.com")
    (shared / f"{ada.login_file.stem}.tmp").symlink_to(planted)
    ada.login()
    assert planted.read_text() == ""
    assert not ada.login_file.is_symlink() and stat.S_IMODE(ada.login_file.stat().st_mode) == 0o600
    assert ada.saved_token() and sorted(p.name for p in shared.iterdir()) == sorted(
        [ada.login_file.name, f"{ada.login_file.stem}.tmp", "theirs"])


def test_a_login_file_others_can_read_is_made_private_and_anothers_is_refused(gateway, tmp_path):
    """The login file was read whatever its mode and owner: one copied with the umask's 0644 went on showing
    its tokens to every local user, and one another user planted where ours is looked for decided which
    gateway and token every command used. Now ours is made 0600 again, with a word, and another's refused."""
    ada = Person(gateway, tmp_path, "ada@example.com")
    ada.login()
    ada.login_file.chmod(0o644)
    done = ada.run("whoami")
    assert done.returncode == 0 and "was readable by others (0o644): made 0600" in done.stderr, done
    assert stat.S_IMODE(ada.login_file.stat().st_mode) == 0o600
    assert ada.run("whoami").stderr == ""  # said once
    if os.geteuid() == 0:  # another user's file: only root can make one here
        os.chown(ada.login_file, 65534, -1)
        one_line_failure(ada.run("whoami"), 1, "belongs to another user (uid 65534): not used")
