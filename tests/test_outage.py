"""Bad days with real clients: the store stopped, hung, or cut from one node; the whole gateway SIGKILLed.

Two ``gatewayd run`` nodes share a PostgreSQL store of this module's own (it is stopped with ``pg_ctl stop`` and
hung with SIGSTOP here, so it is not the suite's shared store cluster): node A reaches it directly, node B through
a TCP link the tests freeze (tests/tcpgate.py). The lease is short (4 s: a node that cannot renew it stops
serving after 2 s). Each test counts what the clients were answered (pgbench, an asyncpg writer, ssh lines)
against what the sessions recorded and the rows the target holds: nothing executed unrecorded, nothing recorded
lost, no session left open, and the recordings' verification tells the truth. Durations are printed, never
asserted.
"""

from __future__ import annotations

import asyncio
import base64
import html
import os
import re
import secrets
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import pytest

from tests.apiclient import Api, PostgresApi, SshApi, of_kind
from tests.conftest import Daemon, free_port, new_store_database, new_store_database_now, wait_port
from tests.pgpeer import PgCluster
from tests.sshpeer import CLIENT_OPTIONS
from tests.tcpgate import TcpGate

LEASE = 4.0
STORE_DOWN = "the gateway's store is unavailable"
FENCED = "could not renew its lease on the store"


def unavailable(text: str) -> bool:
    """A client was told the store is away: at once, or (a moment later) that its node stopped serving for it."""
    return STORE_DOWN in text or FENCED in text


def node(tmp_path_factory: pytest.TempPathFactory, name: str, settings: dict[str, Any],
         listeners: tuple[str, ...] = ("postgres", "ssh", "http")) -> Daemon:
    ports = {protocol: free_port() for protocol in listeners}
    daemon = Daemon(tmp_path_factory.mktemp(name) / "data", {
        "cluster.node_name": name, "cluster.lease": f"{LEASE:g}s", "store.timeout": "1s",
        "sessions.flush_interval": "100ms", "sessions.strict_bound": "1s", **settings,
        **{f"listeners.{protocol}": f"127.0.0.1:{port}" for protocol, port in ports.items()}})
    daemon.start(timeout=40)
    for protocol, port in ports.items():
        wait_port(port, daemon.process, f"{name}'s {protocol} listener")
    daemon.ports = ports
    return daemon


class Outage:
    """The module's store, its two nodes, the link of node B and an admin token minted while the store answers."""

    def __init__(self, store: PgCluster, gate: TcpGate, a: Daemon, b: Daemon) -> None:
        self.store, self.gate, self.a, self.b = store, gate, a, b
        self.token = a.token("admin@example.com", groups="admin", name="Ada Admin")

    def store_pids(self) -> list[int]:
        """The store's postmaster and every process it started."""
        postmaster = int((self.store.data / "postmaster.pid").read_text().split()[0])
        found = [postmaster]
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == postmaster:
                    found.append(int(entry.name))
        return found

    def fault(self, kind: str) -> None:
        if kind == "stop":
            self.store.stop()
        else:
            for pid in self.store_pids():
                os.kill(pid, signal.SIGSTOP)

    def repair(self, kind: str) -> None:
        if kind == "stop":
            self.store.ctl_start()
        else:
            for pid in self.store_pids():
                os.kill(pid, signal.SIGCONT)


@pytest.fixture(scope="module")
def outage(tmp_path_factory, pg_store):
    store = PgCluster(tls=False).start()
    url = new_store_database_now(store)
    gate = TcpGate(store.port).start()
    key = base64.b64encode(secrets.token_bytes(32)).decode()
    a = node(tmp_path_factory, "node-a", {"store.driver": "postgres", "store.url": url, "secrets.key": key})
    b = node(tmp_path_factory, "node-b", {"store.driver": "postgres", "secrets.key": key,
                                          "store.url": url.replace(f":{store.port}/", f":{gate.port}/")})
    yield Outage(store, gate, a, b)
    gate.thaw()
    for daemon in (b, a):
        daemon.stop()
    gate.stop()
    store.destroy()


def pg_env(daemon: Daemon, secret: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env.update(PGHOST="127.0.0.1", PGPORT=str(daemon.ports["postgres"]), PGUSER=secret, PGDATABASE="postgres",
               PGSSLMODE="disable", PGPASSWORD="any", PGCONNECT_TIMEOUT="20")
    return env


def pgbench(daemon: Daemon, secret: str, table: str, script_dir: Path, clients: int = 1,
            seconds: int = 60) -> subprocess.Popen[str]:
    """pgbench inserting one row per transaction into ``table`` through ``daemon`` (simple protocol)."""
    script = script_dir / f"{table}.sql"
    script.write_text(f"insert into {table} (src) values ('pgbench');\n")
    return subprocess.Popen(["pgbench", "-n", "-f", str(script), "-c", str(clients), "-T", str(seconds)],
                            env=pg_env(daemon, secret), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def processed(output: str) -> int:
    """pgbench's count of transactions answered (it prints it after a client aborted too)."""
    found = re.search(r"number of transactions actually processed: (\d+)", output)
    assert found, output
    return int(found.group(1))


async def target_rows(pg_target: PgCluster, table: str, src: str = "pgbench") -> int:
    """Rows ``src`` (pgbench, or another writer) inserted into ``table`` on the target."""
    conn = await asyncpg.connect(pg_target.dsn())
    try:
        return await conn.fetchval(f"select count(*) from {table} where src = $1", src)
    finally:
        await conn.close()


async def batch_of(api: Api, session_id: str) -> list[dict]:
    """Every session of a credential's batch (pgbench's clients each open one), done, with their events."""
    first = await api.done_session(session_id, timeout=60)
    status, page = await api("GET", f"/sessions?connection={first['connection']}&limit=100")
    assert status == 200, page
    ids = [s["id"] for s in page["data"] if s["session_batch_id"] == first["session_batch_id"]]
    return [await api.done_session(sid, timeout=60) for sid in ids]


async def running_in_batch(api: Api, session_id: str) -> str:
    """The id of a session of the credential's batch that is open (pgbench's client, not its first connection)."""
    first = await api.session(session_id)

    async def found() -> str | None:
        status, page = await api("GET", f"/sessions?connection={first['connection']}&status=open&limit=100")
        assert status == 200, page
        return next((s["id"] for s in page["data"] if s["session_batch_id"] == first["session_batch_id"]), None)

    return await until("an open session of the batch", found)


def recorded(sessions: list[dict], text: str) -> int:
    return sum(1 for s in sessions for statement in of_kind(s, "i") if statement.strip().startswith(text))


async def until(what: str, check: Any, timeout: float = 60, interval: float = 0.1) -> Any:
    """Poll ``check()`` (sync or async) until it is truthy (a bound, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if asyncio.iscoroutine(found):
            found = await found
        if found:
            return found
        assert time.monotonic() < deadline, f"{what}: never happened"
        await asyncio.sleep(interval)


async def new_session(daemon: Daemon, secret: str) -> asyncpg.Connection:
    """A session opened as soon as the node serves again (it refuses with 57P03 until it renews its lease)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return await asyncpg.connect(host="127.0.0.1", port=daemon.ports["postgres"], user=secret,
                                         password="any", database="postgres", ssl=False, timeout=20)
        except (asyncpg.CannotConnectNowError, asyncpg.PostgresConnectionError, OSError) as exc:
            assert time.monotonic() < deadline, f"{daemon.settings['cluster.node_name']} never served again: {exc}"
            await asyncio.sleep(0.2)


async def during(outage: Outage, fault: str, http: aiohttp.ClientSession, guarded: asyncpg.Connection,
                 late_secret: str, ssh_secret: str, web_secret: str) -> None:
    """What clients are told while the store is away (the store is repaired by the caller, whatever happens)."""
    a, b = outage.a, outage.b
    with pytest.raises(asyncpg.InsufficientPrivilegeError):  # the rules in force need no store: blocked
        await guarded.execute("select 'outage_forbidden'")
    started = time.monotonic()
    refused = await asyncio.to_thread(subprocess.run, ["psql", "-X", "-c", "select 1"], env=pg_env(a, late_secret),
                                      capture_output=True, text=True, timeout=60)
    print(f"[{fault}] a new psql was refused in {time.monotonic() - started:.2f} s: {refused.stderr.strip()}")
    assert refused.returncode != 0 and unavailable(refused.stderr), refused.stderr
    started = time.monotonic()
    denied = await asyncio.to_thread(subprocess.run, ["ssh", *CLIENT_OPTIONS, "-p", str(a.ports["ssh"]),
                                                      f"{ssh_secret}@127.0.0.1", "true"],
                                     capture_output=True, text=True, timeout=60)
    print(f"[{fault}] a new ssh was told in {time.monotonic() - started:.2f} s: {denied.stderr.strip()}")
    assert denied.returncode != 0 and unavailable(denied.stderr), denied.stderr
    started = time.monotonic()
    page = await asyncio.to_thread(subprocess.run, [
        "curl", "-sS", "-H", "Accept: text/html", "-H", f"Authorization: {web_secret}", "-w", "\n%{http_code}",
        f"http://127.0.0.1:{a.ports['http']}/"], capture_output=True, text=True, timeout=60)
    print(f"[{fault}] a browser's request through the HTTP proxy got {page.stdout[-3:]} in "
          f"{time.monotonic() - started:.2f} s")
    assert page.stdout.endswith("\n503") and "<html" in page.stdout.lower(), page.stdout
    assert unavailable(html.unescape(page.stdout)), page.stdout
    started = time.monotonic()
    status, body = await Api(a, http)("GET", "/connections")
    print(f"[{fault}] the API answered {status} in {time.monotonic() - started:.2f} s")
    assert status == 503 and body["message"].startswith(STORE_DOWN), body
    for daemon in (a, b):
        started = time.monotonic()
        async with http.get(f"{daemon.url}/readyz") as response:
            ready = response.status
        print(f"[{fault}] readyz of {daemon.settings['cluster.node_name']}: {ready} in "
              f"{time.monotonic() - started:.2f} s")
        assert ready == 503

    async def fenced_on_a() -> bool:  # node A ends its sessions too (its own lease, its own moment)
        try:
            await guarded.fetchval("select 1")
        except asyncpg.exceptions._base.InternalClientError:
            # the FATAL came between two statements: asyncpg reads it idle and says only that it is busy; the reason
            # is checked in the session's recording after the outage
            return True
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as exc:
            assert FENCED in str(exc) or guarded.is_closed(), exc
            return True
        return False

    await until("node A fenced its session", fenced_on_a, timeout=30, interval=0.2)
    guarded.terminate()


@pytest.mark.parametrize("fault", ["stop", "hang"])
async def test_a_store_stopped_or_hung_loses_nothing_says_so_and_kills_nothing_after(
        outage, fault, pg_target, ssh_target, http_target, tmp_path):
    a, b = outage.a, outage.b
    table = f"rows_{fault}_{uuid.uuid4().hex[:6]}"
    admin = await asyncpg.connect(pg_target.dsn())
    await admin.execute(f"create table {table} (id serial primary key, src text)")
    await admin.close()
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {outage.token}"}) as http:
        api, ssh_api = PostgresApi(a, http, pg_target), SshApi(a, http, ssh_target)
        role = await api.role()
        await api.guardrail(role, input_rules=[{"type": "deny_words_list", "words": ["outage_forbidden"]}])
        bench_secret, bench_session = await api.credential(role)
        guarded_secret, guarded_session = await api.credential(role)
        late_secret, _ = await api.credential(role)
        ssh_secret, ssh_session = await ssh_api.credential(await ssh_api.role())
        web = await api.connection("web", "httpproxy", "httpproxy", {"REMOTE_URL": http_target})
        status, issued = await api("POST", f"/connections/{web['name']}/credentials", {})
        assert status == 201, issued
        web_secret = issued["connection_credentials"]["proxy_token"]
        for daemon in (a, b):  # both serve (a run that failed during its outage may leave them fenced a while)
            await (await new_session(daemon, late_secret)).close()

        bench = pgbench(b, bench_secret, table, tmp_path)
        shell = subprocess.Popen(["ssh", *CLIENT_OPTIONS, "-p", str(b.ports["ssh"]), f"{ssh_secret}@127.0.0.1",
                                  "for i in $(seq 1 2000); do echo line $i; sleep 0.02; done"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        guarded = await asyncpg.connect(host="127.0.0.1", port=a.ports["postgres"], user=guarded_secret,
                                        password="any", database="postgres", ssl=False)
        await until("pgbench writes", lambda: target_rows(pg_target, table))
        await ssh_api.session(ssh_session, until=lambda s: any("line" in t for t in of_kind(s, "o")), timeout=30)

        began = time.monotonic()
        outage.fault(fault)
        print(f"\n[{fault}] the store is {'stopped' if fault == 'stop' else 'hung (SIGSTOP)'}")
        try:
            await during(outage, fault, http, guarded, late_secret, ssh_secret, web_secret)
            bench_out, bench_err = await asyncio.to_thread(bench.communicate, timeout=60)
            ssh_out, ssh_err = await asyncio.to_thread(shell.communicate, timeout=60)
            assert FENCED in bench_err, bench_err
            assert FENCED in ssh_err, ssh_err
            print(f"[{fault}] pgbench and ssh through node B were told: {ssh_err.strip()}")
            while time.monotonic() - began < LEASE * 1.25:  # an outage longer than the lease
                await asyncio.sleep(0.1)
        finally:
            outage.repair(fault)
        print(f"[{fault}] the store is back after {time.monotonic() - began:.2f} s")

        # the sessions that end after the outage are not taken for lost nodes' (no mass kill)
        fresh = [await new_session(daemon, late_secret) for daemon in (a, b)]
        resumed = time.monotonic()
        while time.monotonic() - resumed < LEASE * 1.5:
            assert [await conn.fetchval("select 'alive'") for conn in fresh] == ["alive", "alive"]
            await asyncio.sleep(0.5)
        for conn in fresh:
            await conn.close()
        status = a.cli("status", "--all").stdout
        assert not [line for line in status.splitlines() if " lost " in line], status

        # nothing lost, nothing unrecorded, nothing left open
        sessions = await batch_of(api, bench_session)
        answered, rows = processed(bench_out), await target_rows(pg_target, table)
        stored = recorded(sessions, f"insert into {table}")
        print(f"[{fault}] pgbench: {answered} answered, {rows} rows on the target, {stored} recorded")
        assert answered <= rows <= stored <= answered + 1
        for session in sessions:
            if not recorded([session], f"insert into {table}"):
                continue  # pgbench's own first connection, before its clients
            assert FENCED in of_kind(session, "e")[-1]
            result = await api("GET", f"/sessions/{session['id']}/verify")
            assert result[0] == 200 and result[1]["verified"] and result[1]["sealed"], result
        lines = ssh_out.count("line ")
        ssh_done = await ssh_api.done_session(ssh_session, timeout=60)
        kept = "".join(of_kind(ssh_done, "o")).count("line ")
        print(f"[{fault}] ssh: {lines} lines shown to the client, {kept} recorded")
        assert lines <= kept
        assert FENCED in of_kind(ssh_done, "e")[-1]
        blocked = await api.done_session(guarded_session, timeout=60)
        assert any("outage_forbidden" in e for e in of_kind(blocked, "e"))
        assert FENCED in of_kind(blocked, "e")[-1]  # node A ended it when it could not renew its lease
        status, audit = await api("GET", "/audit/logs?action=guardrail.block&page_size=100")
        assert status == 200
        assert [e for e in audit["data"] if (e.get("request_payload_redacted") or {}).get("session_id")
                == guarded_session], "the block written while the store was away is in the audit log"


async def test_a_node_cut_from_the_store_stops_serving_and_its_recording_arrives_when_the_link_returns(
        outage, pg_target, tmp_path):
    a, b, gate = outage.a, outage.b, outage.gate
    table = f"rows_cut_{uuid.uuid4().hex[:6]}"
    admin = await asyncpg.connect(pg_target.dsn())
    await admin.execute(f"create table {table} (id serial primary key, src text)")
    await admin.close()
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {outage.token}"}) as http:
        api = PostgresApi(a, http, pg_target)
        role = await api.role()
        status, refused = await api("POST", "/connections", {
            "name": f"pg-strict-{uuid.uuid4().hex[:6]}", "type": "database", "subtype": "postgres",
            "secret": {}, "settings": {"recording_mode": "sometimes"}})
        assert status == 422 and "recording_mode" in refused["message"], refused
        strict_role = await api.role(settings={"recording_mode": "strict"})
        bench_secret, bench_session = await api.credential(role)
        writer_secret, writer_session = await api.credential(role)
        strict_secret, strict_session = await api.credential(strict_role)
        bench = pgbench(b, bench_secret, table, tmp_path)
        writer = await asyncpg.connect(host="127.0.0.1", port=a.ports["postgres"], user=writer_secret,
                                       password="any", database="postgres", ssl=False)
        strict = await asyncpg.connect(host="127.0.0.1", port=b.ports["postgres"], user=strict_secret,
                                       password="any", database="postgres", ssl=False)
        await until("pgbench writes", lambda: target_rows(pg_target, table))
        client_session = await running_in_batch(api, bench_session)

        gate.freeze()
        began = time.monotonic()
        print("\nnode B's link to the store is frozen")
        try:
            strict_answered = 0
            try:
                while True:  # a strict session ends once the store lags behind it strict_bound (1 s, < the fence)
                    await strict.execute(f"insert into {table} (src) values ('strict')")
                    strict_answered += 1
            except asyncpg.exceptions._base.InternalClientError as exc:
                # the FATAL came between two statements: asyncpg reads it idle and says only that it is busy;
                # the reason is checked in the recording below
                ended: Exception = exc
            except asyncpg.PostgresError as exc:  # the FATAL as a statement's answer: it names the reason
                assert "strict recording" in str(exc) or isinstance(exc, asyncpg.ConnectionDoesNotExistError), exc
                ended = exc
            print(f"the strict session through B ended {time.monotonic() - began:.2f} s into the cut: "
                  f"{type(ended).__name__}: {ended}")
            assert bench.poll() is None  # the async one (pgbench) runs on until the fence
            strict.terminate()
            status, body = await api("POST", f"/sessions/{client_session}/kill")
            print(f"a kill of B's session through A answered {status} after {time.monotonic() - began:.2f} s: "
                  f"{body}")
            assert status == 503 and "node-b" in body["message"], body  # never 200 while it may run
            bench_out, bench_err = await asyncio.to_thread(bench.communicate, timeout=60)
            assert "node node-b could not renew its lease on the store" in bench_err, bench_err
            answered_a = 0
            rule = await api.guardrail(role, input_rules=[{"type": "deny_words_list", "words": ["cut_forbidden"]}])
            with pytest.raises(asyncpg.InsufficientPrivilegeError):  # answered 201: in force for the next one
                await writer.execute("select 'cut_forbidden'")
            for _ in range(20):  # A goes on serving and recording
                await writer.execute(f"insert into {table} (src) values ('a')")
                answered_a += 1
            await writer.close()
            # node A closed it: B is lost (a read of A's past store.timeout, 1 s here, is answered 503 "try again
            # later", as documented: the full suite under load once saw one here)
            await api.done_session(client_session, timeout=LEASE * 4, busy_store=True)
        finally:
            gate.thaw()
        print(f"the link is back after {time.monotonic() - began:.2f} s")

        async def late_kept() -> bool:
            _, verified = await api("GET", f"/sessions/{client_session}/verify")
            return any("stored after the session was closed" in p for p in verified["problems"])

        await until("B stored what it recorded after A closed its session", late_kept, timeout=60)
        sessions = await batch_of(api, bench_session)
        answered, rows = processed(bench_out), await target_rows(pg_target, table)
        stored = recorded(sessions, f"insert into {table}")
        print(f"pgbench through B: {answered} answered, {rows} rows on the target, {stored} recorded")
        assert answered <= rows <= stored <= answered + 1
        _, verified = await api("GET", f"/sessions/{client_session}/verify")
        print(f"verify: {verified['problems']}")
        assert not verified["verified"] and any(p.startswith("event ") and "recording gap" in p
                                                for p in verified["problems"])
        strict_done = await api.done_session(strict_session, timeout=LEASE * 4)
        strict_rows = await target_rows(pg_target, table, "strict")
        assert strict_answered <= strict_rows <= recorded([strict_done], f"insert into {table}") <= strict_answered + 1
        assert any("strict recording" in e for e in of_kind(strict_done, "e"))
        writer_done = await api.done_session(writer_session)
        assert recorded([writer_done], f"insert into {table}") == answered_a == \
            await target_rows(pg_target, table, "a")
        assert any("cut_forbidden" in e for e in of_kind(writer_done, "e"))
        status, _ = await api("DELETE", f"/guardrails/{rule['id']}")
        assert status == 204


@pytest.mark.parametrize("driver", ["sqlite", "postgres"])
async def test_sigkill_of_the_whole_gateway_replays_its_journal(request, driver, tmp_path_factory, pg_target,
                                                                tmp_path):
    """Every process of a two-worker gateway SIGKILLed under pgbench: the restart replays the journals and
    closes the sessions; what was lost (executed on the target, not in any recording) is printed."""
    settings: dict[str, Any] = {"daemon.workers": 2, "sessions.flush_interval": "1s"}  # the default: the store lags
    if driver == "postgres":
        settings.update({"store.driver": "postgres",
                         "store.url": await new_store_database(request.getfixturevalue("pg_store"))})
    daemon = node(tmp_path_factory, f"killed-{driver}", settings, listeners=("postgres",))
    table = f"rows_kill_{driver}_{uuid.uuid4().hex[:6]}"
    admin = await asyncpg.connect(pg_target.dsn())
    await admin.execute(f"create table {table} (id serial primary key, src text)")
    await admin.close()
    token = daemon.token("admin@example.com", groups="admin")
    try:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as http:
            api = PostgresApi(daemon, http, pg_target)
            secret, session_id = await api.credential(await api.role())
            bench = pgbench(daemon, secret, table, tmp_path, clients=4)
            await until("pgbench writes", lambda: target_rows(pg_target, table))
            await asyncio.sleep(1.5)
            supervisor = daemon.process.pid
            # the supervisor frozen first: it can neither start a worker again nor SIGTERM them meanwhile (a worker
            # it restarted between the kills outlived the group and held the ports of the next run)
            os.kill(supervisor, signal.SIGSTOP)
            workers = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and
                       _parent(p) == supervisor]
            for pid in workers + [supervisor]:
                os.kill(pid, signal.SIGKILL)
            daemon.process.wait(10)
            daemon.stop()
            bench_out, _ = await asyncio.to_thread(bench.communicate, timeout=60)
            daemon.start(timeout=40)
            wait_port(daemon.ports["postgres"], daemon.process, "the restarted gateway")
            sessions = await batch_of(api, session_id)
            answered, rows = processed(bench_out), await target_rows(pg_target, table)
            stored = recorded(sessions, f"insert into {table}")
            print(f"\nSIGKILL of the whole gateway ({driver} store, journal on): {answered} statements answered, "
                  f"{rows} rows on the target, {stored} recorded after the restart: "
                  f"{max(rows - stored, 0)} executed and not recorded")
            assert all(s["status"] == "done" for s in sessions)
    finally:
        daemon.stop()


def _parent(proc: Path) -> int:
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1
