"""Two ``gatewayd run`` nodes on one PostgreSQL store behave as one gateway (real psql, asyncpg, ssh).

Node A and node B are separate processes with their own data dirs, ports and names, sharing the
store and the secrets key. What is asked through A reaches what B holds: credentials, kills,
guard-rail changes, server-config changes and PostgreSQL cancels; B SIGKILLed has its sessions
closed by A after the lease. Durations are printed, never asserted.
"""

from __future__ import annotations

import asyncio
import base64
import os
import secrets
import signal
import socket
import struct
import subprocess
import time

import asyncpg
import pytest

from tests import clients
from tests.apiclient import Api, PostgresApi, SshApi, admin_http, events, of_kind, postgres_env
from tests.conftest import Daemon, free_port, new_store_database_now, wait_port
from tests.sshpeer import CLIENT_OPTIONS

LEASE = "3s"


def start_node(tmp_path_factory, name: str, store: dict[str, str], key: str) -> Daemon:
    ports = {protocol: free_port() for protocol in ("postgres", "ssh")}
    daemon = Daemon(tmp_path_factory.mktemp(name) / "data", {
        **store, "secrets.key": key,
        "cluster.node_name": name, "cluster.lease": LEASE, "sessions.flush_interval": "100ms",
        **{f"listeners.{protocol}": f"127.0.0.1:{port}" for protocol, port in ports.items()}})
    daemon.start(timeout=40)
    for protocol, port in ports.items():
        wait_port(port, daemon.process, f"{name}'s {protocol} listener")
    daemon.ports = ports
    return daemon


@pytest.fixture(scope="module")
def nodes(tmp_path_factory, pg_store, pg_target, ssh_target):
    store = {"store.driver": "postgres", "store.url": new_store_database_now(pg_store)}
    key = base64.b64encode(secrets.token_bytes(32)).decode()
    a = start_node(tmp_path_factory, "node-a", store, key)
    b = start_node(tmp_path_factory, "node-b", store, key)
    yield a, b
    for node in (b, a):
        if node.process is not None:
            node.stop()


@pytest.fixture(scope="module")
def sqlite_nodes(tmp_path_factory, pg_target):
    """Two processes on one SQLite store (the workers of one host, without their supervisor): the table bus."""
    shared = tmp_path_factory.mktemp("shared-sqlite") / "data"
    key = base64.b64encode(secrets.token_bytes(32)).decode()
    a = start_node(tmp_path_factory, "worker-a", {"data_dir": str(shared)}, key)
    b = start_node(tmp_path_factory, "worker-b", {"data_dir": str(shared)}, key)
    yield a, b
    for node in (b, a):
        node.stop()


def psql_env(node: Daemon, secret: str) -> dict[str, str]:
    return clients.psql_env(node.ports["postgres"], secret)


def psql(node: Daemon, secret: str, sql: str) -> subprocess.CompletedProcess[str]:
    return clients.psql(node.ports["postgres"], secret, "-At", "-c", sql)


def sleeping_psql(node: Daemon, secret: str, seconds: int = 60) -> subprocess.Popen[str]:
    """psql held in ``select pg_sleep(seconds)`` through ``node``."""
    return subprocess.Popen(["psql", "-X", "-At", "-c", f"select pg_sleep({seconds})"], env=psql_env(node, secret),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


async def connect(node: Daemon, secret: str) -> asyncpg.Connection:
    return await asyncpg.connect(host="127.0.0.1", port=node.ports["postgres"], user=secret, password="any",
                                 database="postgres", ssl=False, statement_cache_size=0)


async def open_session(api: Api, session_id: str, texts: str = "") -> dict:
    """The session once it is open (and has recorded ``texts`` as input, when given)."""
    return await api.session(session_id, until=lambda s: s["status"] == "open" and (
        not texts or any(texts in text for text in of_kind(s, "i"))), timeout=30)


async def test_a_credential_issued_by_a_works_on_b_and_status_lists_both(nodes, pg_target):
    a, b = nodes
    async with admin_http(a) as http:
        api = PostgresApi(a, http, pg_target)
        connection = await api.role()
        secret, session_id = await api.credential(connection)
        result = await asyncio.to_thread(psql, b, secret, "select 'through-b-' || 7")
        assert result.returncode == 0 and result.stdout.strip() == "through-b-7", result.stderr
        done = await api.done_session(session_id)
        assert ("i", "select 'through-b-' || 7") in events(done)
        assert any("through-b-7" in text for text in of_kind(done, "o"))
    status = a.cli("status")
    lines = status.stdout.splitlines()
    assert any(line.startswith("node-a ") and " up " in line for line in lines), status.stdout
    assert any(line.startswith("node-b ") and " up " in line for line in lines), status.stdout
    assert "2 nodes up" in status.stdout


async def test_two_first_connections_at_once_on_two_nodes_claim_one_session(nodes, pg_target):
    a, b = nodes
    async with admin_http(a) as http:
        api = PostgresApi(a, http, pg_target)
        secret, session_id = await api.credential(await api.role())
        results = await asyncio.gather(*(asyncio.to_thread(psql, node, secret, "select pg_sleep(0.5), 'claimed'")
                                         for node in (a, b)))
        assert all(r.returncode == 0 for r in results), [r.stderr for r in results]
        status, page = await api("GET", f"/sessions?connection={(await api.session(session_id))['connection']}")
        assert status == 200
        batch = [s for s in page["data"] if s["session_batch_id"] == (await api.session(session_id))["session_batch_id"]]
        assert len(batch) == 2 and session_id in {s["id"] for s in batch}  # one claimed, one more in the batch


async def test_a_kill_through_a_ends_a_psql_session_held_by_b_on_one_sqlite_store(sqlite_nodes, pg_target):
    a, b = sqlite_nodes
    async with admin_http(a) as http:
        api = PostgresApi(a, http, pg_target)
        secret, session_id = await api.credential(await api.role())
        sleeper = sleeping_psql(b, secret, 60)
        await open_session(api, session_id, "pg_sleep(60)")
        started = time.monotonic()
        status, body = await api("POST", f"/sessions/{session_id}/kill")
        assert status == 200 and body["status"] == "done", body
        _, stderr = await asyncio.to_thread(sleeper.communicate, timeout=30)
        print(f"kill through process A ended psql on process B (one SQLite store) in {time.monotonic() - started:.2f} s")
        assert sleeper.returncode != 0 and "session killed by admin@example.com" in stderr, stderr


async def test_a_kill_through_a_ends_psql_and_ssh_sessions_held_by_b(nodes, pg_target, ssh_target):
    a, b = nodes
    async with admin_http(a) as http:
        api = PostgresApi(a, http, pg_target)
        secret, session_id = await api.credential(await api.role())
        sleeper = sleeping_psql(b, secret, 60)
        await open_session(api, session_id, "pg_sleep(60)")
        started = time.monotonic()
        status, body = await api("POST", f"/sessions/{session_id}/kill")
        assert status == 200, body
        _, stderr = await asyncio.to_thread(sleeper.communicate, timeout=30)
        print(f"kill through node A ended psql on node B in {time.monotonic() - started:.2f} s")
        assert sleeper.returncode != 0 and "session killed by admin@example.com" in stderr, stderr
        assert body["status"] == "done"  # the answer waited for B to store the end
        done = await api.done_session(session_id)
        assert of_kind(done, "e")[-1] == "session killed by admin@example.com"

        ssh = SshApi(a, http, ssh_target)
        secret, session_id = await ssh.credential(await ssh.role())
        shell = subprocess.Popen(["ssh", *CLIENT_OPTIONS, "-p", str(b.ports["ssh"]), f"{secret}@127.0.0.1",
                                  "echo ready; sleep 60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        await ssh.session(session_id, until=lambda s: any("ready" in t for t in of_kind(s, "o")), timeout=30)
        started = time.monotonic()
        status, body = await ssh("POST", f"/sessions/{session_id}/kill")
        assert status == 200, body
        await asyncio.to_thread(shell.communicate, timeout=30)
        print(f"kill through node A ended ssh on node B in {time.monotonic() - started:.2f} s")
        assert shell.returncode != 0
        assert of_kind(await ssh.done_session(session_id), "e")[-1] == "session killed by admin@example.com"


async def test_a_review_revoked_through_a_ends_the_jit_session_held_by_b(nodes, pg_target):
    a, b = nodes
    rita, dora = a.token("rita@example.com", groups="dev"), a.token("dora@example.com", groups="dba")
    async with admin_http(a) as http:
        admin = PostgresApi(a, http, pg_target)
        connection = await admin.connection("pg", "database", "postgres", postgres_env(pg_target), {"reviewers": ["dba"]})
        status, answer = await admin("POST", f"/connections/{connection['name']}/credentials", {}, token=rita)
        assert status == 202, answer
        session_id, review_id = answer["session_id"], answer["review_id"]
        status, body = await admin("PUT", f"/reviews/{review_id}", {"status": "APPROVED"}, token=dora)
        assert status == 200 and body["status"] == "APPROVED", body
        status, body = await admin("POST", f"/connections/{connection['name']}/credentials/{session_id}", token=rita)
        assert status == 201, body
        sleeper = sleeping_psql(b, body["connection_credentials"]["username"], 60)
        await open_session(admin, session_id, "pg_sleep(60)")
        started = time.monotonic()
        status, body = await admin("PUT", f"/sessions/{session_id}/review", {"status": "REVOKED"}, token=dora)
        assert status == 200 and body["status"] == "REVOKED", body
        _, stderr = await asyncio.to_thread(sleeper.communicate, timeout=30)
        print(f"a review revoked through node A ended psql on node B in {time.monotonic() - started:.2f} s")
        assert sleeper.returncode != 0 and "revoked" in stderr, stderr
        done = await admin.done_session(session_id)
        assert any("just-in-time access revoked by dora@example.com" in e for e in of_kind(done, "e"))


async def test_a_guard_rail_added_through_a_blocks_a_live_session_on_b(nodes, pg_target):
    a, b = nodes
    async with admin_http(a) as http:
        api = PostgresApi(a, http, pg_target)
        connection = await api.role()
        secret, session_id = await api.credential(connection)
        conn = await connect(b, secret)
        try:
            assert await conn.fetchval("select 'cluster_forbidden_word'") == "cluster_forbidden_word"
            await api.guardrail(connection, input_rules=[{"type": "deny_words_list", "words": ["cluster_forbidden_word"]}])
            started, blocked = time.monotonic(), None
            while time.monotonic() - started < 20:
                try:
                    await conn.fetchval("select 'cluster_forbidden_word'")
                except asyncpg.PostgresError as exc:
                    blocked = exc
                    break
                await asyncio.sleep(0.05)
            print(f"a rule added through node A blocked on node B's live session after {time.monotonic() - started:.2f} s")
            assert blocked is not None and "cluster_forbidden_word" in str(blocked), blocked
            assert await conn.fetchval("select 'allowed'") == "allowed"
        finally:
            await conn.close()
        done = await api.done_session(session_id)
        assert any("cluster_forbidden_word" in e for e in of_kind(done, "e"))


async def test_a_connection_deleted_through_a_ends_its_sessions_on_b(nodes, pg_target):
    a, b = nodes
    async with admin_http(a) as http:
        api = PostgresApi(a, http, pg_target)
        connection = await api.role()
        secret, session_id = await api.credential(connection)
        conn = await connect(b, secret)
        try:
            assert await conn.fetchval("select 1") == 1
            status, _ = await api("DELETE", f"/connections/{connection['name']}")
            assert status == 204
            done = await api.done_session(session_id, timeout=20)
        finally:
            conn.terminate()
        assert of_kind(done, "e")[-1] == (f"the connection {connection['name']} was deleted by admin@example.com: "
                                          "the session was closed")


def cancel_request(port: int, process_id: int, secret_key: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(struct.pack("!iiii", 16, 80877102, process_id, secret_key))
        sock.recv(1)  # the gateway closes the connection once it has passed the cancel on


@pytest.mark.parametrize("store", ["postgres", "sqlite"])
async def test_a_cancel_request_sent_to_the_other_node_cancels_the_query(request, store, pg_target):
    a, b = request.getfixturevalue("nodes" if store == "postgres" else "sqlite_nodes")
    async with admin_http(a) as http:
        api = PostgresApi(a, http, pg_target)
        secret, session_id = await api.credential(await api.role())
        conn = await connect(b, secret)
        try:
            protocol = conn._protocol  # the BackendKeyData the gateway handed out
            query = asyncio.create_task(conn.fetchval("select pg_sleep(60)"))
            await open_session(api, session_id, "pg_sleep(60)")
            started = time.monotonic()
            await asyncio.to_thread(cancel_request, a.ports["postgres"], protocol.backend_pid, protocol.backend_secret)
            with pytest.raises(asyncpg.QueryCanceledError):
                await asyncio.wait_for(query, 30)
            print(f"a CancelRequest sent to node A cancelled node B's query in {time.monotonic() - started:.2f} s")
            assert await conn.fetchval("select 'still-open'") == "still-open"  # the session goes on
        finally:
            await conn.close()


@pytest.mark.parametrize("store", ["postgres", "sqlite"])
async def test_a_cancel_through_the_other_node_answers_once_in_force_and_never_reaches_the_next_statement(
        request, store, pg_target):
    """The CancelRequest's connection closes only once the target has the cancel (or it was dropped: the statement
    it was for had ended), so a client that goes on after it never sees its next statement cancelled."""
    a, b = request.getfixturevalue("nodes" if store == "postgres" else "sqlite_nodes")
    async with admin_http(a) as http:
        api = PostgresApi(a, http, pg_target)
        secret, session_id = await api.credential(await api.role())
        conn = await connect(b, secret)
        watcher = await asyncpg.connect(pg_target.dsn())
        outcomes = []
        try:
            protocol = conn._protocol
            for attempt in range(8):
                text = f"select 'first {attempt}', pg_sleep(0.15)"
                first = asyncio.create_task(conn.fetchval(text))
                for _ in range(500):  # until the target runs it (or it ran already: a busy machine may miss it)
                    if first.done() or await watcher.fetchval(
                            "select count(*) from pg_stat_activity where query = $1 and state = 'active'", text):
                        break
                    await asyncio.sleep(0.02)
                await asyncio.to_thread(cancel_request, a.ports["postgres"], protocol.backend_pid,
                                        protocol.backend_secret)
                try:
                    outcomes.append(await first)
                except asyncpg.QueryCanceledError:
                    outcomes.append("cancelled")
                # the next statement, sent once the cancel's connection closed: never the one cancelled
                assert await conn.fetchval(f"select 'next {attempt}', pg_sleep(0.15)") == f"next {attempt}"
        finally:
            await conn.close()
            await watcher.close()
        print(f"first statements: {outcomes.count('cancelled')} cancelled, the others ended before the cancel came")


async def test_the_process_id_handed_out_never_names_a_server_process(nodes, pg_target):
    """Above any pid_max (Linux allows 2^22): pg_terminate_backend(conn.info.backend_pid) ends nobody."""
    a, b = nodes
    async with admin_http(a) as http:
        api = PostgresApi(a, http, pg_target)
        secret, _ = await api.credential(await api.role())
        conn = await connect(b, secret)
        admin = await asyncpg.connect(pg_target.dsn())
        try:
            handed = conn.get_server_pid()
            assert handed >= 1 << 30 and handed != await conn.fetchval("select pg_backend_pid()")
            assert await admin.fetchval("select pg_terminate_backend($1)", handed) is False
            assert await conn.fetchval("select 'alive'") == "alive"
        finally:
            await admin.close()
            await conn.close()


async def test_a_node_killed_has_its_sessions_closed_by_the_other_after_the_lease(nodes, pg_target):
    a, b = nodes
    async with admin_http(a) as http:
        api = PostgresApi(a, http, pg_target)
        secret, session_id = await api.credential(await api.role())
        sleeper = sleeping_psql(b, secret, 120)
        try:
            await open_session(api, session_id, "pg_sleep(120)")
            started = time.monotonic()
            b.stop(signal.SIGKILL)
            done = await api.done_session(session_id, timeout=60)
            print(f"node B SIGKILLed: its session closed by node A after {time.monotonic() - started:.2f} s "
                  f"(lease {LEASE})")
        finally:
            sleeper.kill()
            sleeper.wait()
        last = of_kind(done, "e")[-1]
        assert last.startswith("node node-b stopped answering (no heartbeat for 3 s)") and "node-a" in last, last
        assert done["exit_code"] == 254
    status = a.cli("status", "--all")
    assert any(line.startswith("node-b ") and " lost " in line for line in status.stdout.splitlines()), status.stdout


async def test_a_node_paused_past_its_lease_records_no_sealing_of_the_session_the_other_closed(nodes, pg_target):
    """Node B paused (SIGSTOP) past its lease: A declares it lost and closes and seals its session. B, resumed, ends
    the session too, its close meeting A's: what B recorded since is kept after A's close, and the audit chain
    records one sealing, A's. Before, B recorded the seal it had made as a second ``session.seal`` entry, one the
    session never had, and ``verify`` said the session was sealed twice, as after an intruder's second close."""
    a, b = nodes
    if b.process is None:  # SIGKILLed by the test before: a restart is a new node that joins the cluster
        b.start(timeout=40)
        wait_port(b.ports["postgres"], b.process, "node-b's postgres listener")
    async with admin_http(a) as http:
        api = PostgresApi(a, http, pg_target)
        secret, session_id = await api.credential(await api.role())
        conn = await connect(b, secret)
        await conn.execute("select 'before the pause'")
        await open_session(api, session_id, "before the pause")
        os.kill(b.process.pid, signal.SIGSTOP)
        try:
            done = await api.done_session(session_id, timeout=60)  # closed by A: B is lost
        finally:
            os.kill(b.process.pid, signal.SIGCONT)
        assert "node node-b stopped answering" in of_kind(done, "e")[-1], of_kind(done, "e")

        async def ended_on_b() -> bool:  # B learns it at its next beat, or fences, and ends the session itself
            _, result = await api("GET", f"/sessions/{session_id}/verify")
            return any("stored after the session was closed" in p for p in result["problems"])

        deadline = time.monotonic() + 60
        while not await ended_on_b():
            assert time.monotonic() < deadline, "node B never ended the session"
            await asyncio.sleep(0.2)
        conn.terminate()
        await asyncio.sleep(1.0)  # whatever B records after its close has reached the store
        status, page = await api("GET", "/audit/logs?action=session.seal&page_size=100")
        assert status == 200, page
        sealings = [e for e in page["data"]
                    if (e.get("request_payload_redacted") or {}).get("session_id") == session_id]
        assert [e["outcome"] for e in sealings] == ["success"], sealings
        _, result = await api("GET", f"/sessions/{session_id}/verify")
        assert result["sealed"] and not any("sealed 2 times" in p or "not the one the audit log recorded" in p
                                            for p in result["problems"]), result


async def test_serverconfig_changed_through_a_is_what_b_serves(nodes):
    """Last: the document is the cluster's, listen addresses included (two nodes on one host would then share ports)."""
    a, b = nodes
    if b.process is None:  # SIGKILLed by the test before: a restart is a new node that joins the cluster
        b.start(timeout=40)
    async with admin_http(a) as http:
        through_a, through_b = Api(a, http), Api(b, http)
        status, before = await through_b("GET", "/serverconfig/misc")
        assert status == 200
        wanted = "grpcs://gateway.example.com:8443"
        status, body = await through_a("PUT", "/serverconfig/misc", {"grpc_server_url": wanted})
        assert status == 200, body
        started = time.monotonic()
        while time.monotonic() - started < 20:
            status, seen = await through_b("GET", "/serverconfig/misc")
            if seen["grpc_server_url"] == wanted:
                break
            await asyncio.sleep(0.05)
        print(f"PUT /serverconfig/misc through node A seen by node B after {time.monotonic() - started:.2f} s")
        assert seen["grpc_server_url"] == wanted and before["grpc_server_url"] != wanted
