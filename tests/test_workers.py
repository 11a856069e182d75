"""One ``gatewayd run`` with several workers (``[daemon] workers``): a supervisor and N gateways on shared ports.

A real ``gatewayd run`` subprocess with ``workers = 2`` on SQLite serves the module; real psql, ssh and curl
reach the session's PostgreSQL, sshd and HTTP target through it on one port each.  Every worker names itself
in its log lines (``worker``), which is how a test sees where a connection landed: it connects until both
workers have opened sessions.  The supervisor speaks sd_notify to the test's socket (READY=1 once every worker
is up).  Statements run over concurrent psql sessions are all recorded; a SIGKILLed worker is restarted while
the port keeps serving and without closing its sibling's sessions; SIGTERM stops every worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import aiohttp
import asyncpg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gatewayd.config import ConfigError, cpu_count, load_config
from proxies import rdp
from tests.apiclient import Api, PostgresApi, SshApi, admin_http, of_kind
from tests.conftest import BIN, ROOT, Daemon, accepts, free_port, wait_port
from tests.sshpeer import CLIENT_OPTIONS

WORKERS = 2
SHARED = ("postgres", "ssh", "http") + (() if rdp.missing_modules() else ("rdp",))  # RDP needs its extra
PATIENCE = 60.0  # how long a poll waits for something the daemon does on its own (a bound, not a measure)


# --------------------------------------------------------------------------- helpers


class Notifications:
    """A NOTIFY_SOCKET of the test's own: what the supervisor tells systemd."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(PATIENCE)

    def next(self) -> bytes:
        return self.sock.recv(4096)

    def close(self) -> None:
        self.sock.close()


def workers_daemon(root: Path, settings: dict[str, Any], notify: Notifications | None = None) -> Daemon:
    """A ``gatewayd run`` with ``workers = 2`` (not started), its log in JSON."""
    daemon = Daemon(root / "data", {"daemon.workers": WORKERS, "sessions.flush_interval": "100ms", **settings})
    if notify is not None:
        base = daemon.env
        daemon.env = lambda: {**base(), "NOTIFY_SOCKET": str(notify.path)}  # type: ignore[method-assign]
    return daemon


def entries(daemon: Daemon) -> list[dict[str, Any]]:
    """The daemon's log lines (supervisor and workers share the file), parsed."""
    found = []
    for line in daemon.log_text().splitlines():
        if line.startswith("{"):
            try:
                found.append(json.loads(line))
            except ValueError:  # a line being written
                pass
    return found


def sessions_by_worker(daemon: Daemon, connection: str) -> dict[str, int]:
    """session id -> the worker that opened it (None: a single process), for one connection."""
    return {e["session_id"]: e.get("worker") for e in entries(daemon)
            if e["message"] == "session opened" and e.get("connection") == connection}


def ready_pids(daemon: Daemon) -> dict[int, int]:
    """worker index -> pid of its latest incarnation that said READY=1 (the supervisor's lines)."""
    pids: dict[int, int] = {}
    for e in entries(daemon):
        if e["logger"] == "gatewayd.supervisor" and e["message"] == "worker ready":
            pids[e["worker"]] = e["pid"]
    return pids


async def until(what: str, check: Callable[[], Any], timeout: float = PATIENCE) -> Any:
    """Poll ``check`` until it returns something true; AssertionError naming ``what`` past ``timeout``."""
    deadline = time.monotonic() + timeout
    while not (found := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.05)
    return found


async def reach_every_worker(daemon: Daemon, connection: str, connect: Callable[[], Awaitable[None]],
                             tries: int = 40) -> int:
    """Connect (a new session each time) until sessions of ``connection`` were opened on every worker."""
    for attempt in range(1, tries + 1):
        await connect()
        if set(sessions_by_worker(daemon, connection).values()) >= set(range(WORKERS)):
            return attempt
    raise AssertionError(f"{tries} connections never reached every worker: {sessions_by_worker(daemon, connection)}")


def pg_env(daemon: Daemon, secret: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env.update(PGHOST="127.0.0.1", PGPORT=str(daemon.ports["postgres"]), PGUSER=secret, PGDATABASE="postgres",
               PGSSLMODE="disable", PGPASSWORD="any", PGCONNECT_TIMEOUT="10")
    return env


async def psql(daemon: Daemon, secret: str, sql: str = "select 1", stdin: str | None = None) -> str:
    """psql through the gateway (``-c sql``, or the script on stdin); its output, asserting it succeeded."""
    args = ["psql", "-X", "-At", "-v", "ON_ERROR_STOP=1"] + ([] if stdin is not None else ["-c", sql])
    process = await asyncio.create_subprocess_exec(*args, env=pg_env(daemon, secret), stdin=asyncio.subprocess.PIPE,
                                                   stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(process.communicate(stdin.encode() if stdin is not None else None), 120)
    assert process.returncode == 0, err.decode()
    return out.decode()


async def run(*args: str) -> subprocess.CompletedProcess[bytes]:
    process = await asyncio.create_subprocess_exec(*args, stdin=asyncio.subprocess.DEVNULL,
                                                   stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(process.communicate(), 120)
    return subprocess.CompletedProcess(args, process.returncode or 0, out, err)


async def scrape(daemon: Daemon) -> dict[tuple[str, tuple], float]:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{daemon.ports['metrics']}/metrics") as response:
            assert response.status == 200
            text = await response.text()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def settled(daemon: Daemon) -> None:
    """Until no client connection is left from before: none in ``ss``, and none as the workers count them, which is
    what their balancers read (a session still closing after its client left counts: one the previous test left
    closing made its worker look busier, and a burst came 3/5)."""
    ports = [daemon.ports[name] for name in ("postgres", "ssh", "http")]
    await until("no client connection left from before", lambda: not connections_by_pid(*ports) or None)
    deadline = time.monotonic() + PATIENCE
    while sum(value for (name, _), value in (await scrape(daemon)).items() if name == "gatewayd_connections_open"):
        assert time.monotonic() < deadline, "the workers still count client connections"
        await asyncio.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# --------------------------------------------------------------------------- the module's gateway


@pytest.fixture(scope="module")
def notify(tmp_path_factory: pytest.TempPathFactory):
    sock = Notifications(tmp_path_factory.mktemp("notify") / "notify.sock")
    yield sock
    sock.close()


class ModuleGateway:
    """The module's ``workers = 2`` daemon, started again (fresh data dir and log) if a test stopped it."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory, notify: Notifications) -> None:
        self.tmp_path_factory, self.notify = tmp_path_factory, notify
        self.ports = {name: free_port() for name in ("postgres", "ssh", "http", "rdp", "metrics")}
        self.daemon: Daemon | None = None

    def running(self) -> Daemon:
        if self.daemon is None or self.daemon.process is None:
            ports = self.ports
            daemon = workers_daemon(self.tmp_path_factory.mktemp("workers"), {
                **{f"listeners.{name}": f"127.0.0.1:{ports[name]}" for name in ("postgres", "ssh", "http", "rdp")},
                "metrics.listen": f"127.0.0.1:{ports['metrics']}"}, self.notify)
            daemon.ports = ports
            daemon.start()
            assert self.notify.next() == b"READY=1", daemon.log_text()
            self.daemon = daemon
        return self.daemon


@pytest.fixture(scope="module")
def module_gateway(tmp_path_factory, notify, pg_target, ssh_target, http_target):
    holder = ModuleGateway(tmp_path_factory, notify)
    yield holder
    if holder.daemon is not None:
        holder.daemon.stop()


@pytest.fixture
def gateway(module_gateway):
    """The module's daemon, running (test_sigterm_stops_every_worker_cleanly stops it: any order works)."""
    return module_gateway.running()


@pytest.fixture
async def http(gateway):
    async with admin_http(gateway) as session:
        yield session


# --------------------------------------------------------------------------- the tests


async def test_every_worker_is_up_before_ready_and_serves_every_listener(gateway):
    pids = ready_pids(gateway)
    assert sorted(pids) == list(range(WORKERS)) and all(alive(pid) for pid in pids.values())
    # the log up to the supervisor's "worker ready" for the last of the first incarnations (logged before READY=1;
    # a worker restarted later by another test of the module starts after it)
    logged, ready, seen = entries(gateway), None, set()
    for index, entry in enumerate(logged):
        if entry["logger"] == "gatewayd.supervisor" and entry["message"] == "worker ready":
            seen.add(entry["worker"])
            if seen == set(range(WORKERS)):
                ready = index
                break
    assert ready is not None, seen
    started = [e for e in logged[:ready] if e["message"] == "gatewayd started"]
    assert sorted(e["worker"] for e in started) == list(range(WORKERS))
    # each worker bound every listener on the same address; none failed
    assert not [e for e in entries(gateway) if e["message"] == "listener failed to start"]
    assert {(e["listener"], e["worker"]) for e in entries(gateway) if e["message"] == "listener started"} >= {
        (name, worker) for name in SHARED for worker in range(WORKERS)}
    supervisor = next(e for e in entries(gateway) if e["message"] == "gatewayd supervisor started")
    assert supervisor["workers"] == WORKERS and "worker" not in supervisor


async def test_psql_ssh_and_curl_on_the_shared_ports_land_on_both_workers(gateway, http, pg_target, ssh_target,
                                                                           http_target):
    pg = PostgresApi(gateway, http, pg_target)
    role = await pg.role()
    secret, _ = await pg.credential(role)

    async def one_psql() -> None:
        assert await psql(gateway, secret, "select 40 + 2") == "42\n"

    tries = await reach_every_worker(gateway, role["name"], one_psql)
    print(f"psql: both workers reached after {tries} connections")

    ssh_api = SshApi(gateway, http, ssh_target)
    ssh_role = await ssh_api.role()
    ssh_secret, _ = await ssh_api.credential(ssh_role)

    async def one_ssh() -> None:
        done = await run("ssh", *CLIENT_OPTIONS, "-p", str(gateway.ports["ssh"]), f"{ssh_secret}@127.0.0.1",
                         "echo through-$((6*7))")
        assert done.returncode == 0 and done.stdout == b"through-42\n", done.stderr

    tries = await reach_every_worker(gateway, ssh_role["name"], one_ssh)
    print(f"ssh: both workers reached after {tries} connections")

    web = Api(gateway, http)
    web.secret_field = "proxy_token"
    web_role = await web.connection("web", "httpproxy", "httpproxy", {"REMOTE_URL": http_target})

    async def one_curl() -> None:  # a credential of its own (one session per credential), a new TCP connection
        web_secret, _ = await web.credential(web_role)
        done = await run("curl", "-sS", "-H", f"Authorization: {web_secret}", "-w", " %{http_code}",
                         f"http://127.0.0.1:{gateway.ports['http']}/json")
        assert done.returncode == 0 and done.stdout.endswith(b" 200"), done.stderr

    tries = await reach_every_worker(gateway, web_role["name"], one_curl)
    print(f"curl: both workers reached after {tries} connections")


async def test_one_http_credential_is_one_session_whichever_worker_its_connections_reach(gateway, http,
                                                                                           http_target):
    """Issue 34, item 5: with workers = 2 one credential's traffic was split over two sessions (2 + 2 exchanges
    of 4, no link between them). Thirty connections, each new (curl), land on both workers (the kernel spreads
    them: all on one is a chance of 2**-29); the worker that does not hold the session hands the connection to
    the one that does, and the one session records every exchange."""
    web = Api(gateway, http)
    web.secret_field = "proxy_token"
    role = await web.connection("webone", "httpproxy", "httpproxy", {"REMOTE_URL": http_target})
    secret, session_id = await web.credential(role)
    for n in range(30):
        done = await run("curl", "-sS", "-H", f"Authorization: {secret}", "-w", " %{http_code}",
                         f"http://127.0.0.1:{gateway.ports['http']}/json?n={n}")
        assert done.returncode == 0 and done.stdout.endswith(b" 200"), done.stderr
    status, page = await web("GET", f"/sessions?connection={role['name']}")
    assert [s["id"] for s in page["data"]] == [session_id], page["data"]
    session = await web.session(session_id, until=lambda s: len(of_kind(s, "i")) == 30)
    assert sorted(int(text.split("?n=", 1)[1].split(" ", 1)[0]) for text in of_kind(session, "i")) == list(range(30))
    assert len(set(sessions_by_worker(gateway, role["name"]).values())) == 1  # one session, opened once


async def test_statements_over_concurrent_psql_sessions_on_both_workers_are_all_recorded(gateway, http, pg_target):
    pg = PostgresApi(gateway, http, pg_target)
    role = await pg.role()
    secret, _ = await pg.credential(role)
    clients, statements = 4, 100
    sent: list[int] = []
    rounds = 0
    while set(sessions_by_worker(gateway, role["name"]).values()) != set(range(WORKERS)):
        rounds += 1
        assert rounds <= 10, "ten rounds of concurrent sessions never reached both workers"
        scripts = []
        for client in range(clients):
            numbers = [rounds * 1_000_000 + client * 1_000 + n for n in range(statements)]
            sent += numbers
            scripts.append("".join(f"select {n};\n" for n in numbers))
        outputs = await asyncio.gather(*(psql(gateway, secret, stdin=script) for script in scripts))
        for script, output in zip(scripts, outputs):
            assert output.split() == re.findall(r"select (\d+);", script)
    placed = sessions_by_worker(gateway, role["name"])
    recorded: list[int] = []
    for session_id in placed:
        session = await pg.done_session(session_id, timeout=PATIENCE)
        recorded += [int(n) for text in of_kind(session, "i") for n in re.findall(r"^select (\d+)", text)]
    per_worker = {w: sum(1 for s in placed.values() if s == w) for w in range(WORKERS)}
    print(f"{len(sent)} statements in {rounds} round(s) of {clients} concurrent psql; sessions per worker: "
          f"{per_worker}; recorded {len(recorded)}")
    assert sorted(recorded) == sorted(sent)


def connections_by_pid(*ports: int) -> dict[int, int]:
    """pid -> the established connections it holds on these local ports (``ss``: the accepted ends)."""
    held: dict[int, int] = {}
    for port in ports:
        listing = subprocess.run(["ss", "-Htnp", "state", "established", f"( sport = :{port} )"],
                                 capture_output=True, text=True, check=True).stdout
        for pid in re.findall(r"pid=(\d+)", listing):
            held[int(pid)] = held.get(int(pid), 0) + 1
    return held


async def test_a_burst_of_pooled_connections_is_spread_evenly_over_the_workers(gateway, http, pg_target):
    """16 PostgreSQL connections opened at once, as an application's pool or pgbench's clients open them: each
    worker serves 8 (twice). The kernel's hash of their addresses alone spread them as unevenly as 8/5/2/1 over
    4 workers; a worker holding more than its sibling hands the new connection to it (gatewayd/balance.py), and
    every connection answers and is recorded whichever worker serves it."""
    pg = PostgresApi(gateway, http, pg_target)
    role = await pg.role()
    secret, _ = await pg.credential(role)
    workers = set(ready_pids(gateway).values())
    for round in range(2):
        await settled(gateway)
        before = set(sessions_by_worker(gateway, role["name"]))
        pool = await asyncio.gather(*(asyncpg.connect(host="127.0.0.1", port=gateway.ports["postgres"], user=secret,
                                                      password="any", database="postgres", ssl=False)
                                      for _ in range(16)))
        try:
            answers = await asyncio.gather(*(c.fetchval("select $1::int", n) for n, c in enumerate(pool)))
            assert answers == list(range(16))
            held = connections_by_pid(gateway.ports["postgres"])
            assert set(held) <= workers and sorted(held.values()) == [8, 8], held
        finally:
            await asyncio.gather(*(c.close() for c in pool))
        opened = await until("16 sessions opened", lambda: len(set(sessions_by_worker(gateway, role["name"])) - before)
                             == 16 or None)
        assert opened
    for session_id in sessions_by_worker(gateway, role["name"]):
        session = await pg.done_session(session_id, timeout=PATIENCE)
        assert "select $1::int" in "".join(of_kind(session, "i"))


async def test_ssh_sessions_opened_at_once_are_spread_evenly_over_the_workers(gateway, http, ssh_target):
    """8 OpenSSH sessions opened at once, three times: each worker serves 4 (asyncssh serves a socket a sibling
    handed over as one it accepted), and each session runs its command and ends cleanly."""
    ssh_api = SshApi(gateway, http, ssh_target)
    role = await ssh_api.role()
    secret, _ = await ssh_api.credential(role)
    port = gateway.ports["ssh"]
    workers = set(ready_pids(gateway).values())
    for round in range(3):
        await settled(gateway)
        clients = [await asyncio.create_subprocess_exec(
            "ssh", *CLIENT_OPTIONS, "-p", str(port), f"{secret}@127.0.0.1", f"head -c 1 >/dev/null; echo done-{n}",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            for n in range(8)]
        try:
            held = await until("8 ssh sessions connected",
                               lambda: (h := connections_by_pid(port)) and sum(h.values()) == 8 and h or None)
            assert set(held) <= workers and sorted(held.values()) == [4, 4], held
        finally:
            outputs = await asyncio.gather(*(client.communicate(b"x") for client in clients))
        assert [out for out, _ in outputs] == [f"done-{n}\n".encode() for n in range(8)], [e for _, e in outputs]


async def test_every_worker_s_scrape_answers_for_the_whole_group(gateway, http, pg_target):
    pg = PostgresApi(gateway, http, pg_target)
    role = await pg.role()
    secret, _ = await pg.credential(role)
    await reach_every_worker(gateway, role["name"], lambda: psql(gateway, secret))
    key = ("gatewayd_connections_total", (("protocol", "postgres"),))
    answers = [(await scrape(gateway))[key] for _ in range(8)]  # the scrapes land on either worker, too
    # every answer counts both workers' connections: a worker counting alone would say less than the other
    assert len(set(answers)) == 1 and answers[0] >= len(sessions_by_worker(gateway, role["name"])), answers


async def running(api: Api, session_id: str, text: str) -> None:
    """Until the session's recording holds ``text`` as input (the statement reached the target)."""
    await api.session(session_id, until=lambda s: any(text in t for t in of_kind(s, "i")), timeout=PATIENCE)


@contextlib.asynccontextmanager
async def sleepers_on_every_worker(gateway: Daemon, connection: str,
                                   secret: str) -> AsyncIterator[dict[str, asyncio.subprocess.Process]]:
    """psql sessions through ``secret`` sleeping on the target, one at least on each worker: session id -> psql
    (its statement running on the target); those still running at the end are killed."""
    sleepers: dict[str, asyncio.subprocess.Process] = {}
    try:
        while set(sessions_by_worker(gateway, connection).values()) != set(range(WORKERS)):  # one on each
            assert len(sleepers) < 20, "20 connections never reached both workers"
            sleeper = await asyncio.create_subprocess_exec(
                "psql", "-X", "-At", "-c", "select pg_sleep(60)", env=pg_env(gateway, secret),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            opened = await until("the sleeper's session", lambda: set(sessions_by_worker(gateway, connection))
                                 - set(sleepers))
            sleepers[opened.pop()] = sleeper
        yield sleepers
    finally:
        for sleeper in sleepers.values():
            if sleeper.returncode is None:
                sleeper.kill()
                await sleeper.wait()


async def test_a_kill_through_the_api_reaches_the_worker_holding_the_session(gateway, http, pg_target):
    pg = PostgresApi(gateway, http, pg_target)
    role = await pg.role()
    secret, _ = await pg.credential(role)
    async with sleepers_on_every_worker(gateway, role["name"], secret) as sleepers:
        for session_id, worker in sessions_by_worker(gateway, role["name"]).items():
            await running(pg, session_id, "pg_sleep(60)")
            started = time.monotonic()
            status, body = await pg("POST", f"/sessions/{session_id}/kill")  # answered by either worker
            assert status == 200 and body["status"] == "done", body
            _, err = await asyncio.wait_for(sleepers[session_id].communicate(), PATIENCE)
            print(f"a kill through the API ended psql on worker {worker} in {time.monotonic() - started:.2f} s")
            assert sleepers[session_id].returncode != 0 and b"session killed by admin@example.com" in err, err


async def test_deactivating_a_user_ends_its_sessions_on_every_worker(gateway, http, pg_target):
    """One deactivation, answered by either worker, ends the user's psql sessions on both (the other worker's
    through the bus, confirmed before the answer), each with why."""
    pg = PostgresApi(gateway, http, pg_target)
    role = await pg.role()
    email, token = await pg.signed_in_user()
    secret, _ = await pg.credential(role, token=token)
    async with sleepers_on_every_worker(gateway, role["name"], secret) as sleepers:
        for session_id in sleepers:
            await running(pg, session_id, "pg_sleep(60)")
        status, body = await pg("PUT", f"/users/{email}", {"status": "inactive"})
        assert status == 200 and body["status"] == "inactive", body
        for session_id, sleeper in sleepers.items():
            _, err = await asyncio.wait_for(sleeper.communicate(), PATIENCE)
            assert sleeper.returncode != 0 and b"the user was deactivated by admin@example.com" in err, err
            status, session = await pg("GET", f"/sessions/{session_id}")
            assert status == 200 and session["status"] == "done" and session["exit_code"] == 254, session


def cancel_request(port: int, process_id: int, secret_key: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(struct.pack("!iiii", 16, 80877102, process_id, secret_key))
        sock.recv(1)  # the gateway closes the connection once it has passed the cancel on


async def test_a_cancel_request_reaches_the_worker_holding_the_query(gateway, http, pg_target):
    """CancelRequests come on connections of their own, which land on either worker."""
    pg = PostgresApi(gateway, http, pg_target)
    role = await pg.role()
    secret, _ = await pg.credential(role)
    held: dict[str, asyncpg.Connection] = {}
    try:
        while set(sessions_by_worker(gateway, role["name"]).values()) != set(range(WORKERS)):  # one on each
            assert len(held) < 40, "40 connections never reached both workers"
            connection = await asyncpg.connect(host="127.0.0.1", port=gateway.ports["postgres"], user=secret,
                                               password="any", database="postgres", timeout=30)
            opened = await until("the session's log line", lambda: set(sessions_by_worker(gateway, role["name"]))
                                 - set(held))
            held[opened.pop()] = connection
        placed = sessions_by_worker(gateway, role["name"])
        for round_ in range(4):  # 8 cancels on connections the kernel spreads: some cross to the other worker
            for session_id, connection in held.items():
                keys = connection._protocol  # the BackendKeyData the gateway handed out
                query = asyncio.create_task(connection.fetchval(f"select pg_sleep(60), 'round {round_}'"))
                await running(pg, session_id, f"'round {round_}'")
                await asyncio.to_thread(cancel_request, gateway.ports["postgres"], keys.backend_pid,
                                        keys.backend_secret)
                with pytest.raises(asyncpg.QueryCanceledError):
                    await asyncio.wait_for(query, PATIENCE)
                assert await connection.fetchval("select 'still-open'") == "still-open"
        print(f"8 cancels reached their sessions on workers {sorted(set(placed[s] for s in held))}")
    finally:
        for connection in held.values():
            connection.terminate()


async def test_rdp_shares_its_port_between_the_workers(gateway, http, rdp_peers):
    """Twisted's reactor serves RDP in each worker, on a socket made with SO_REUSEPORT and adopted."""
    api = Api(gateway, http)
    role = await api.connection("rdp", "custom", "rdp", {"HOST": "127.0.0.1", "PORT": str(rdp_peers.shadow_port),
                                                         "USER": "alice", "PASS": "Tgt-pass-7c1e9d"})
    secret, _ = await api.credential(role)

    async def logon() -> None:
        process = await asyncio.create_subprocess_exec(
            "xfreerdp", f"/v:127.0.0.1:{gateway.ports['rdp']}", "/cert:ignore", f"/u:{secret}", f"/p:{secret}",
            "/size:1024x768", "/bpp:16", "+auth-only", stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, env={"PATH": os.environ["PATH"], "HOME": str(rdp_peers.home),
                                                   "DISPLAY": f":{rdp_peers.client_display}"})
        out, _ = await asyncio.wait_for(process.communicate(), 120)
        assert process.returncode == 0, out.decode(errors="replace")

    tries = await reach_every_worker(gateway, role["name"], logon, tries=20)
    print(f"xfreerdp: both workers reached after {tries} logons")


async def test_a_sigkilled_worker_is_restarted_the_port_keeps_serving_and_only_its_sessions_are_closed(
        gateway, http, pg_target):
    pg = PostgresApi(gateway, http, pg_target)
    role = await pg.role()
    secret, _ = await pg.credential(role)
    held: list[asyncpg.Connection] = []
    try:
        while set(sessions_by_worker(gateway, role["name"]).values()) != set(range(WORKERS)):  # one on each
            assert len(held) < 40, "40 connections never reached both workers"
            held.append(await asyncpg.connect(host="127.0.0.1", port=gateway.ports["postgres"], user=secret,
                                              password="any", database="postgres", timeout=30))
            await until("the new session's log line", lambda: len(sessions_by_worker(gateway, role["name"]))
                        == len(held))
        placed = sessions_by_worker(gateway, role["name"])
        victim = 1
        pid = ready_pids(gateway)[victim]
        os.kill(pid, signal.SIGKILL)
        exited = await until("the supervisor saw the worker die", lambda: [
            e for e in entries(gateway) if e["message"] == "worker exited; restarting it" and e["pid"] == pid])
        assert exited[0]["signal"] == "SIGKILL" and exited[0]["worker"] == victim
        for _ in range(5):  # the survivor alone serves the port meanwhile
            assert await psql(gateway, secret, "select 7") == "7\n"
        new_pid = await until("the worker is back", lambda: ready_pids(gateway).get(victim) not in (None, pid)
                              and ready_pids(gateway)[victim])
        assert alive(new_pid) and not alive(pid)
        # the restarted worker closed the sessions its dead predecessor held, and only those
        for session_id, worker in placed.items():
            if worker == victim:
                session = await pg.done_session(session_id, timeout=PATIENCE)
                gap, closed = of_kind(session, "e")  # the journal replayed, what it may not have had is said
                assert gap.startswith("recording gap: the process that held the session") and f"/w{victim})" in gap
                assert closed == "session closed on gateway restart: the gateway stopped while it was open"
            else:
                status, body = await pg("GET", f"/sessions/{session_id}")
                assert status == 200 and body["status"] == "open", body
        survivors = [c for c, w in zip(held, placed.values()) if w != victim]
        assert [await c.fetchval("select 42") for c in survivors] == [42] * len(survivors)
        await reach_every_worker(gateway, role["name"], lambda: psql(gateway, secret))
    finally:
        for connection in held:
            connection.terminate()


async def test_sighup_reaches_every_worker(gateway):
    supervisor = gateway.process.pid
    before = len([e for e in entries(gateway) if e["message"] == "configuration reloaded"])
    os.kill(supervisor, signal.SIGHUP)
    reloaded = await until("every process reloaded its log settings", lambda: (
        found := [e for e in entries(gateway) if e["message"] == "configuration reloaded"][before:])
        and len(found) == WORKERS + 1 and found)
    assert sorted(str(e.get("worker", "supervisor")) for e in reloaded) == ["0", "1", "supervisor"]


async def test_sigterm_stops_every_worker_cleanly(gateway, notify):
    pids = ready_pids(gateway)
    assert gateway.stop(signal.SIGTERM) == 0
    assert notify.next() == b"STOPPING=1"
    assert not [pid for pid in pids.values() if alive(pid)]
    stopped = [e for e in entries(gateway) if e["message"] == "gatewayd stopped"]
    assert {e["worker"] for e in stopped} == set(range(WORKERS))
    assert entries(gateway)[-1]["message"] == "gatewayd supervisor stopped"
    assert entries(gateway)[-1]["exit_code"] == 0
    assert not [e for e in entries(gateway) if e["level"] == "error" and e["message"] != "worker exited; restarting it"]


async def test_a_second_sigterm_closes_every_worker_s_sessions_without_the_rest_of_their_grace(tmp_path, pg_target):
    """The first SIGTERM starts the group's stop, and its workers wait out a long grace for their live sessions;
    the second is passed on and every worker closes its sessions at once (57P01, recorded) and stops. The workers
    are in a process group of their own, so a terminal's Ctrl-C (sent to the supervisor's group) reaches the
    supervisor alone, which passes each stop on once: a single Ctrl-C keeps the grace."""
    port = free_port()
    daemon = workers_daemon(tmp_path, {"listeners.postgres": f"127.0.0.1:{port}", "sessions.shutdown_grace": "10m"})
    daemon.ports = {"postgres": port}
    daemon.start()
    try:
        pids = await until("every worker started", lambda: len(ready_pids(daemon)) == WORKERS and ready_pids(daemon))
        assert all(os.getpgid(pid) == pid for pid in pids.values())  # not the supervisor's group
        async with admin_http(daemon) as http:
            pg = PostgresApi(daemon, http, pg_target)
            role = await pg.role()
            secret, _ = await pg.credential(role)
            pool = await asyncio.gather(*(asyncpg.connect(host="127.0.0.1", port=port, user=secret, password="any",
                                                          database="postgres", ssl=False) for _ in range(4)))
            assert await asyncio.gather(*(c.fetchval("select $1::int", n) for n, c in enumerate(pool))) == [0, 1, 2, 3]
            sessions = await until("4 sessions opened", lambda: len(found := sessions_by_worker(daemon, role["name"]))
                                   == 4 and found)
            daemon.process.send_signal(signal.SIGTERM)
            await until("every worker's listener closed", lambda: not accepts(port))
            assert all(alive(pid) for pid in pids.values())  # waiting out the grace for the live sessions
            assert await asyncio.to_thread(daemon.stop, signal.SIGTERM) == 0  # the second; within stop's 20 s
            for connection in pool:  # closed by the gateway (FATAL 57P01 read while idle: asyncpg says closed)
                with pytest.raises((asyncpg.AdminShutdownError, asyncpg.InterfaceError)):
                    await connection.fetchval("select 1")
                connection.terminate()
        assert not [pid for pid in pids.values() if alive(pid)]
        hurried = [e for e in entries(daemon) if e["message"].startswith("stop signal again")]
        assert sorted(str(e.get("worker", "supervisor")) for e in hurried) == ["0", "1", "supervisor"], hurried
        daemon.start()
        async with admin_http(daemon) as http:
            pg = PostgresApi(daemon, http, pg_target)
            for session_id in sessions:
                session = await pg.done_session(session_id, timeout=PATIENCE)
                assert of_kind(session, "e")[-1] == "gateway shutting down: the session was closed", session
    finally:
        daemon.stop()


# --------------------------------------------------------------------------- start-up


def test_the_workers_setting():
    assert load_config(None, environ={})["daemon.workers"] == cpu_count()  # "auto"
    assert load_config(None, environ={"GATEWAYD_DAEMON_WORKERS": "3"})["daemon.workers"] == 3
    assert load_config(None, environ={"GATEWAYD_DAEMON_WORKERS": "auto"})["daemon.workers"] == cpu_count()
    assert load_config(None, environ={}, overrides={"daemon.workers": 1})["daemon.workers"] == 1
    for bad in (0, -2, "many", True, 1.5):
        with pytest.raises(ConfigError, match=r"^daemon\.workers: expected \"auto\" or a number"):
            load_config(None, environ={}, overrides={"daemon.workers": bad})


async def test_a_listener_on_port_0_is_refused_with_several_workers(tmp_path):
    daemon = workers_daemon(tmp_path, {"listeners.postgres": "127.0.0.1:0"})
    done = await run(str(BIN / "gatewayd"), "run", "--config", str(daemon.config_path))
    assert done.returncode == 2
    assert ("listeners.postgres: port 0 cannot be shared by 2 workers (each would get a port of its own): name a "
            "port, or set [daemon] workers = 1") in done.stderr.decode()


async def test_a_worker_that_cannot_start_stops_the_group_with_its_error(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        daemon = workers_daemon(tmp_path, {"api.listen": f"127.0.0.1:{port}", "log.format": "plain"})
        process = await asyncio.create_subprocess_exec(
            str(BIN / "gatewayd"), "run", "--config", str(daemon.config_path), env=daemon.env(), cwd=ROOT,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        _, err = await asyncio.wait_for(process.communicate(), 120)
    text = err.decode()
    assert process.returncode == 2, text
    assert f"api.listen: cannot listen on 127.0.0.1:{port}" in text
    assert "worker failed to start; stopping" in text and "gatewayd supervisor stopped exit_code=2" in text
    assert "Traceback" not in text


async def test_a_worker_that_keeps_failing_to_start_again_stops_the_group(tmp_path):
    """Running fine, then the configuration file is broken and a worker dies: its restarts fail (with back-off)
    until the supervisor gives up, stops the other worker gracefully and exits with the worker's status."""
    daemon = workers_daemon(tmp_path, {"daemon.restart_delay": "10ms"})
    daemon.start()
    try:
        pids = await until("every worker started", lambda: len(ready_pids(daemon)) == WORKERS and ready_pids(daemon))
        daemon.config_path.write_text(daemon.config_path.read_text() + "\n[nonsense]\nkey = 1\n")
        os.kill(pids[1], signal.SIGKILL)
        assert await asyncio.to_thread(daemon.process.wait, 120) == 2
    finally:
        daemon.stop()
    failures = [e for e in entries(daemon) if e["message"] in ("worker exited; restarting it",
                                                                  "worker keeps failing to start; stopping")]
    assert [e["worker"] for e in failures] == [1] * 6 and failures[-1]["failures"] == 5
    assert [e.get("exit_code") for e in failures[1:]] == [2] * 5  # the restarts: a configuration error each
    assert "nonsense.key: unknown setting" in daemon.log_text()
    assert [e["worker"] for e in entries(daemon) if e["message"] == "gatewayd stopped"] == [0]
    assert entries(daemon)[-1]["message"] == "gatewayd supervisor stopped" and entries(daemon)[-1]["exit_code"] == 2


async def test_workers_on_the_postgres_store_after_a_sigkilled_single_process_run(tmp_path, pg_store, pg_target):
    """A run of one process dies with a session open; the next run, with two workers on the same PostgreSQL
    store, closes it before they start (the previous run's name is the supervisor's, not a worker's: without
    the supervisor it would wait for the lease, ten minutes here); then both workers serve and record."""
    from tests.conftest import new_store_database, write_config

    port = free_port()
    settings = {"store.driver": "postgres", "store.url": await new_store_database(pg_store),
                "cluster.node_name": "gw-restart", "cluster.lease": "10m", "listeners.postgres": f"127.0.0.1:{port}",
                "sessions.flush_interval": "100ms"}
    single = Daemon(tmp_path / "data", settings).start()
    async with admin_http(single) as http:
        pg = PostgresApi(single, http, pg_target)
        role = await pg.role()
        secret, _ = await pg.credential(role)
        held = await asyncpg.connect(host="127.0.0.1", port=port, user=secret, password="any", database="postgres",
                                     timeout=30)
        (stale, _), = (await until("the session's log line", lambda: sessions_by_worker(single, role["name"]))).items()
    assert single.stop(signal.SIGKILL) == -signal.SIGKILL
    held.terminate()

    daemon = workers_daemon(tmp_path, settings)
    daemon.api_port, daemon.settings["api.listen"] = single.api_port, single.settings["api.listen"]
    write_config(daemon.config_path, daemon.settings)
    daemon.ports = {"postgres": port}
    daemon.start()
    try:
        await until("every worker started", lambda: len(ready_pids(daemon)) == WORKERS)
        async with admin_http(daemon) as http:
            pg = PostgresApi(daemon, http, pg_target)
            session = await pg.session(stale)
            assert session["status"] == "done" and session["exit_code"] == 254
            gap, closed = of_kind(session, "e")
            assert gap.startswith("recording gap: the process that held the session (gw-restart)")
            assert closed == "session closed on gateway restart: the gateway stopped while it was open"
            names = [e["node"] for e in entries(daemon) if e["message"] == "gatewayd started" and "worker" in e]
            assert sorted(names) == ["gw-restart/w0", "gw-restart/w1"]
            await reach_every_worker(daemon, role["name"], lambda: psql(daemon, secret, "select 'on pg'"))
            for session_id in set(sessions_by_worker(daemon, role["name"])) - {stale}:
                session = await pg.done_session(session_id, timeout=PATIENCE)
                assert of_kind(session, "i") == ["select 'on pg'"]
    finally:
        assert daemon.stop() == 0


# --------------------------------------------------------------------------- SQLite with several writers


HOLD_WRITE_LOCK = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
sys.stdin.readline()
db.execute("COMMIT")
"""


async def test_a_write_waits_for_another_process_holding_the_sqlite_write_lock(tmp_path, monkeypatch, caplog):
    """A sibling worker's long write transaction makes a store write wait again, not fail 'database is locked'."""
    from gatewayd.crypto import SecretBox
    from gatewayd.store.sqlite import SQLiteConnector, SQLiteStore

    monkeypatch.setattr(SQLiteConnector, "busy_timeout_ms", 50)
    monkeypatch.setattr(SQLiteConnector, "busy_retries", 10_000)
    store = SQLiteStore(tmp_path / "gatewayd.db", SecretBox(os.urandom(32)))
    await store.open()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_WRITE_LOCK, str(tmp_path / "gatewayd.db")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        with caplog.at_level("WARNING", logger="gatewayd.store"):
            write = asyncio.create_task(store.put_setting("workers.test", {"written": True}))
            await until("the write was refused the lock once", lambda: write.done() or any(
                "another process holds the write lock" in r.getMessage() for r in caplog.records))
            assert not write.done(), write.exception()
            holder.stdin.write("\n")
            holder.stdin.flush()
            assert holder.wait(30) == 0
            await write
        assert await store.get_setting("workers.test") == {"written": True}
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(10)
        await store.close()
