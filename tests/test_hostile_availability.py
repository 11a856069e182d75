"""Hostile input against availability: a login flood, password guessing, wrong connection secrets,
malformed HTTP and a huge declared body. A real ``gatewayd run`` (postgres and http listeners) in
front of a real PostgreSQL, real psql and plain sockets; the daemon must keep serving everyone else.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time

import aiohttp
import pytest

from tests import clients
from tests.apiclient import Api, admin_http, postgres_env
from tests.conftest import Daemon, free_port, proxy_daemon, wait_port
from tests.pgpeer import unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")

PASSWORD = "a long and right passphrase"


@pytest.fixture(scope="module")
def cluster(pg_target):
    """The session's PostgreSQL target (conftest): started once for every module."""
    return pg_target


def start(tmp_path_factory, name: str, **settings) -> Daemon:
    daemon = proxy_daemon(tmp_path_factory, name, "postgres", settings, wait=True)
    daemon.cli("user", "passwd", "--email", "victim@example.com", "--password-stdin", input=PASSWORD + "\n")
    return daemon


def psql(daemon: Daemon, secret: str, sql: str = "select 1") -> subprocess.CompletedProcess[str]:
    return clients.psql(daemon.proxy_port, secret, "-Atc", sql, timeout=120, PGCONNECT_TIMEOUT="30")


async def login(http: aiohttp.ClientSession, daemon: Daemon, email: str, password: str):
    async with http.post(f"{daemon.url}/localauth/login", json={"email": email, "password": password}) as response:
        return response.status, await response.json(), response.headers


async def test_a_login_flood_does_not_stall_the_proxies(tmp_path_factory, cluster):
    daemon = start(tmp_path_factory, "flood", **{"throttle.login_failures": 0})  # the flood really hashes
    try:
        async with admin_http(daemon) as http:
            connection = await Api(daemon, http).connection("pg", "database", "postgres", postgres_env(cluster))
            secret, _ = await Api(daemon, http).credential(connection)
        started = time.monotonic()
        assert psql(daemon, secret).stdout.strip() == "1"
        quiet = time.monotonic() - started
        stop = asyncio.Event()

        async def attacker(http: aiohttp.ClientSession) -> int:
            tries = 0
            while not stop.is_set():
                status, _, _ = await login(http, daemon, "victim@example.com", f"guess {tries}")
                assert status == 401
                tries += 1
            return tries

        async with aiohttp.ClientSession() as http:
            attackers = [asyncio.create_task(attacker(http)) for _ in range(16)]
            await asyncio.sleep(1)  # the flood is on
            started = time.monotonic()
            answer = await asyncio.to_thread(psql, daemon, secret)
            flooded = time.monotonic() - started
            started = time.monotonic()
            async with http.get(f"{daemon.url}/healthz") as health:
                assert health.status == 200
            healthz = time.monotonic() - started
            stop.set()
            tries = sum(await asyncio.gather(*attackers))
        assert answer.returncode == 0 and answer.stdout.strip() == "1", answer.stderr
        print(f"\npsql select 1: {quiet * 1000:.0f} ms quiet, {flooded * 1000:.0f} ms during a flood of "
              f"{tries} wrong passwords from 16 clients; /healthz {healthz * 1000:.0f} ms")
    finally:
        assert daemon.stop() == 0


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    daemon = start(tmp_path_factory, "guarded", **{
        "throttle.login_failures": 5, "throttle.login_window": "3s",
        "throttle.credential_failures": 4, "throttle.credential_window": "60s"})
    yield daemon
    assert daemon.stop() == 0


async def audit(daemon: Daemon, action: str) -> list[dict]:
    async with admin_http(daemon) as http:
        status, body = await Api(daemon, http)("GET", f"/audit/logs?action={action}&page_size=100")
    assert status == 200
    return body["data"]


async def test_password_guessing_is_throttled_per_account_and_audited_once(guarded):
    async with aiohttp.ClientSession() as http:
        statuses = [(await login(http, guarded, "victim@example.com", f"guess {n}"))[0] for n in range(5)]
        assert statuses == [401] * 5
        status, body, headers = await login(http, guarded, "victim@example.com", PASSWORD)
        assert status == 429 and 1 <= int(headers["Retry-After"]) <= 3 and "too many refused logins" in body["message"]
        for n in range(5):  # more tries while throttled: refused without a look at the password
            assert (await login(http, guarded, "victim@example.com", PASSWORD))[0] == 429
        # an unknown e-mail is refused like a wrong password (the same scrypt work against a decoy hash)
        started = time.monotonic()
        assert (await login(http, guarded, "nobody@example.com", "whatever"))[0] == 429  # the address is blocked
        unknown = time.monotonic() - started
        throttled = [e for e in await audit(guarded, "auth.throttle")]
        assert len(throttled) == 1 and throttled[0]["client_ip"] == "127.0.0.1"
        account, address = sorted(throttled[0]["request_payload_redacted"]["throttled"])
        assert account == f"account:{throttled[0]['org_id']}:victim@example.com"  # per organization and e-mail
        assert address == "address:127.0.0.1"
        await asyncio.sleep(3.1)  # the window passes: the right password works again
        status, body, _ = await login(http, guarded, "victim@example.com", PASSWORD)
        assert status == 200 and body["token"]
        started = time.monotonic()
        assert (await login(http, guarded, "nobody@example.com", "whatever"))[0] == 401
        print(f"\nunknown e-mail: {(time.monotonic() - started) * 1000:.1f} ms (refused while throttled: "
              f"{unknown * 1000:.1f} ms)")


async def test_wrong_connection_secrets_are_throttled_per_address_in_the_protocols_words(guarded, cluster):
    async with admin_http(guarded) as http:
        connection = await Api(guarded, http).connection("pg", "database", "postgres", postgres_env(cluster))
        secret, _ = await Api(guarded, http).credential(connection)
    for n in range(4):
        refused = await asyncio.to_thread(psql, guarded, "pg-" + f"{n:02d}" + "A" * 41)
        assert refused.returncode != 0 and "invalid credential" in refused.stderr, refused.stderr
    blocked = await asyncio.to_thread(psql, guarded, secret)  # even a right secret, from this address, for now
    assert blocked.returncode != 0 and "too many refused credentials from this address" in blocked.stderr
    for _ in range(3):
        await asyncio.to_thread(psql, guarded, "pg-" + "B" * 43)
    failures = [e for e in await audit(guarded, "postgres.login") if e["outcome"] == "failure"]
    assert len(failures) == 4  # one per refused secret before the throttle, none per try after
    throttles = await audit(guarded, "postgres.throttle")
    assert len(throttles) == 1 and throttles[0]["client_ip"] == "127.0.0.1"


def exchange(port: int, data: bytes, close_write: bool = False) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        if close_write:
            sock.shutdown(socket.SHUT_WR)
        try:
            return sock.recv(4096)
        except socket.timeout:
            return b""


def test_malformed_http_is_one_short_line_and_a_huge_body_is_refused_from_its_header(tmp_path_factory):
    http_port = free_port()
    daemon = Daemon(tmp_path_factory.mktemp("junk") / "data", {"listeners.http": f"127.0.0.1:{http_port}"})
    daemon.start()
    wait_port(http_port, daemon.process, "the http listener")
    try:
        port = daemon.api_port
        junk = [b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
                b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03\x00\x01\r\n\r\n",
                b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
                b"GET / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"]
        for data in junk:  # the API and the HTTP listener alike
            assert exchange(port, data).startswith(b"HTTP/1.0 400")
            assert exchange(http_port, data).startswith(b"HTTP/1.0 400")
        # a body declared far larger than api.max_body_bytes: 413 at once, before a byte of it is sent
        answer = exchange(port, b"POST /api/localauth/login HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                                b"\r\nContent-Length: 999999999999\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 413") and b"request body too large" in answer
        # a body that breaks off: a 400 for whoever still listens, no traceback
        exchange(port, b"POST /api/localauth/login HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"em",
                 close_write=True)
        time.sleep(0.5)
        log = daemon.log_text()
        assert "Traceback" not in log and "aiohttp.http_exceptions" not in log, log[-3000:]
        brief = [line for line in log.splitlines() if "malformed HTTP request refused" in line]
        assert len(junk) <= len(brief) <= 2 * len(junk), log[-3000:]  # at most one short line a request
        assert all('"level": "info"' in line for line in brief)
        assert all("aaaaaaaa" not in line for line in brief)  # the client's bytes are not echoed into the log
    finally:
        assert daemon.stop() == 0


def test_a_head_that_never_ends_is_cut_at_the_idle_timeout(tmp_path_factory):
    """A client that sends part of a request head and then nothing, or one byte at a time, holds its socket no
    longer than ``http.idle_timeout`` (``api.idle_timeout`` on the API's and the metrics' port). Before, an hour:
    aiohttp's default, and a few thousand such connections from one unauthenticated client used up the worker's
    descriptors for everyone."""
    http_port, metrics_port = free_port(), free_port()
    daemon = Daemon(tmp_path_factory.mktemp("slow") / "data", {"listeners.http": f"127.0.0.1:{http_port}",
                                                                "http.idle_timeout": "2s", "api.idle_timeout": "2s",
                                                                "metrics.listen": f"127.0.0.1:{metrics_port}"})
    daemon.start()
    wait_port(http_port, daemon.process, "the http listener")
    wait_port(metrics_port, daemon.process, "the metrics listener")

    def held(first: bytes, trickle: bool, port: int = http_port) -> float:
        """Seconds until the gateway closed the connection (at most 20)."""
        with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
            started = time.monotonic()
            sock.sendall(first)
            while time.monotonic() - started < 20:
                try:
                    if trickle:
                        sock.sendall(b"x")
                    if sock.recv(4096) == b"":
                        break
                except socket.timeout:
                    continue
                except OSError:
                    break
            return time.monotonic() - started

    from concurrent.futures import ThreadPoolExecutor

    try:
        tries = [(first, trickle, port)
                 for first, trickle in ((b"GET / HTTP/1.1\r\nHost: x\r\n", False),
                                        (b"GET / HTTP/1.1\r\nX-Slow: ", True), (b"", False))
                 for port in (http_port, daemon.api_port, metrics_port)]  # the API's and metrics': api.idle_timeout
        with ThreadPoolExecutor(len(tries)) as pool:  # all at once: each waits out the timeout
            seconds = list(pool.map(lambda attempt: held(*attempt), tries))
        assert all(s < 8 for s in seconds), list(zip(tries, seconds))
        assert exchange(http_port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.1 401")
    finally:
        assert daemon.stop() == 0
