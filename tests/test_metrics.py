"""Operations: ``/api/readyz`` and the Prometheus endpoint of a real ``gatewayd run``.

Real psql, ssh and curl go through the daemon's proxies to real targets; then ``/metrics`` is scraped
(on its own ``[metrics] listen`` address) and the counters must have moved: sessions opened and closed
and connections per protocol, refused logins, a guard-rail block, recorded bytes, the flusher's lag and store latency.
Readiness answers 200 or 503 and nothing more (it is public); the operator's log names what is not ready (a
listener whose port was taken, the store that went away).
Multi-process mode (``PROMETHEUS_MULTIPROC_DIR``) merges what other processes counted.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import subprocess
import sys
import time

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests import clients
from tests.apiclient import Api, PostgresApi, SshApi, admin_http
from tests.conftest import ROOT, Daemon, free_port, wait_port
from tests.sshpeer import CLIENT_OPTIONS


class Samples(dict):
    """One scrape: (sample name, sorted labels) -> value."""

    def get_value(self, name: str, **labels: str) -> float:
        return self.get((name, tuple(sorted(labels.items()))), 0.0)


async def scrape(daemon: Daemon) -> Samples:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{daemon.metrics_port}/metrics") as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/plain")
            text = await response.text()
    samples = Samples()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


async def scrape_until(daemon: Daemon, checks: dict, timeout: float = 30) -> Samples:
    """The first scrape that passes every check (what -> predicate): flushes and closes are asynchronous."""
    deadline = time.monotonic() + timeout
    while True:
        samples = await scrape(daemon)
        missing = [what for what, check in checks.items() if not check(samples)]
        if not missing:
            return samples
        if time.monotonic() > deadline:
            raise AssertionError(f"the metrics never showed {', '.join(missing)}: "
                                 f"{ {k: v for k, v in samples.items() if k[0].startswith('gatewayd_')} }")
        await asyncio.sleep(0.1)


def start_daemon(tmp_path_factory: pytest.TempPathFactory, name: str, settings: dict,
                 env: dict[str, str] | None = None) -> Daemon:
    daemon = Daemon(tmp_path_factory.mktemp(name) / "data", {
        "metrics.listen": f"127.0.0.1:{free_port()}", "sessions.flush_interval": "100ms", **settings})
    daemon.metrics_port = int(daemon.settings["metrics.listen"].rsplit(":", 1)[1])
    if env:
        base = daemon.env
        daemon.env = lambda: {**base(), **env}  # type: ignore[method-assign]
    daemon.start()
    wait_port(daemon.metrics_port, daemon.process, "the metrics listener")
    return daemon


@pytest.fixture(scope="module")
def http_peer(http_target):
    """The session's HTTP target (conftest)."""
    return http_target


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, pg_target, ssh_target, http_peer):
    ports = {name: free_port() for name in ("postgres", "ssh", "http")}
    daemon = start_daemon(tmp_path_factory, "metrics", {
        f"listeners.{name}": f"127.0.0.1:{port}" for name, port in ports.items()})
    for name, port in ports.items():
        wait_port(port, daemon.process, f"the {name} listener")
    daemon.ports = ports
    yield daemon
    assert daemon.stop() == 0


def psql(daemon: Daemon, secret: str, sql: str) -> subprocess.CompletedProcess[str]:
    return clients.psql(daemon.ports["postgres"], secret, "-At", "-c", sql)


def curl(url: str, secret: str) -> subprocess.CompletedProcess[str]:
    return clients.curl("-o", "/dev/null", "-w", "%{http_code}", "-H", f"Authorization: {secret}", url, text=True,
                        timeout=60)


async def test_sessions_refusals_blocks_and_bytes_move_the_counters(gateway, pg_target, ssh_target, http_peer):
    before = await scrape(gateway)
    async with admin_http(gateway) as http:
        pg = PostgresApi(gateway, http, pg_target)
        connection = await pg.role()
        await pg.guardrail(connection, input_rules=[{"type": "deny_words_list", "words": ["forbidden_word"]}])
        secret, session_id = await pg.credential(connection)
        result = await asyncio.to_thread(psql, gateway, secret, "select 'metrics-' || 42")
        assert result.returncode == 0 and result.stdout.strip() == "metrics-42", result.stderr
        await pg.done_session(session_id)
        secret, blocked_id = await pg.credential(connection)
        result = await asyncio.to_thread(psql, gateway, secret, "select 'forbidden_word'")
        assert "forbidden_word" in result.stderr, result.stderr
        await pg.done_session(blocked_id)
        refused = await asyncio.to_thread(psql, gateway, "pg-" + "A" * 43, "select 1")
        assert refused.returncode != 0

        ssh = SshApi(gateway, http, ssh_target)
        secret, ssh_session = await ssh.credential(await ssh.role())
        result = await asyncio.to_thread(subprocess.run, [
            "ssh", *CLIENT_OPTIONS, "-p", str(gateway.ports["ssh"]), f"{secret}@127.0.0.1", "echo relayed-by-ssh"],
            capture_output=True, text=True, timeout=60)
        assert result.returncode == 0 and "relayed-by-ssh" in result.stdout, result.stderr
        await ssh.done_session(ssh_session)

        web = Api(gateway, http)
        web.secret_field = "proxy_token"
        secret, _ = await web.credential(await web.connection("web", "httpproxy", "httpproxy",
                                                              {"REMOTE_URL": http_peer}))
        proxy = f"http://127.0.0.1:{gateway.ports['http']}/json"
        assert (await asyncio.to_thread(curl, proxy, secret)).stdout == "200"
        assert (await asyncio.to_thread(curl, proxy, "httpproxy-" + "B" * 43)).stdout == "401"

    def moved(name: str, by: float = 1, **labels: str):
        return lambda now: now.get_value(name, **labels) - before.get_value(name, **labels) >= by

    checks = {
        "two postgres sessions opened": moved("gatewayd_sessions_opened_total", 2, protocol="postgres"),
        "two postgres sessions closed": moved("gatewayd_sessions_closed_total", 2, protocol="postgres"),
        "an ssh session opened and closed": lambda now: moved("gatewayd_sessions_opened_total", protocol="ssh")(now)
        and moved("gatewayd_sessions_closed_total", protocol="ssh")(now),
        "the http session open (one per credential)": moved("gatewayd_sessions_open", protocol="http"),
        "three postgres connections (one refused)": moved("gatewayd_connections_total", 3, protocol="postgres"),
        "an ssh connection": moved("gatewayd_connections_total", protocol="ssh"),
        "two http connections (one refused)": moved("gatewayd_connections_total", 2, protocol="http"),
        "a refused postgres login": moved("gatewayd_logins_refused_total", protocol="postgres"),
        "a refused http request": moved("gatewayd_logins_refused_total", protocol="http"),
        "an input block": moved("gatewayd_guardrail_blocks_total", direction="input"),
        "postgres input recorded": moved("gatewayd_recorded_bytes_total", len("select 'metrics-' || 42"),
                                         protocol="postgres", direction="input"),
        "ssh output recorded": moved("gatewayd_recorded_bytes_total", len("relayed-by-ssh"), protocol="ssh",
                                     direction="output"),
        # the target's output packet taken in by the data path (proxies/ssh/datapath.py), and sent to the client
        "ssh data packets on the gateway's data path": lambda now: moved(
            "gatewayd_ssh_datapath_packets_total", direction="in")(now) and moved(
            "gatewayd_ssh_datapath_packets_total", direction="out")(now),
        "a refusal recorded as an error event": moved("gatewayd_recorded_bytes_total", protocol="postgres",
                                                      direction="error"),
        "flushes timed": moved("gatewayd_store_write_seconds_count", operation="append"),
        "closes timed": moved("gatewayd_store_write_seconds_count", 3, operation="close"),
        "flush lag observed": moved("gatewayd_recording_flush_lag_seconds_count"),
    }
    after = await scrape_until(gateway, checks)
    assert after.get_value("gatewayd_sessions_open", protocol="postgres") == 0
    assert after.get_value("gatewayd_sessions_open", protocol="ssh") == 0
    await scrape_until(gateway, {"every postgres, ssh and http connection closed": lambda now: now.get_value(
        "gatewayd_connections_open", protocol="postgres") == now.get_value(
        "gatewayd_connections_open", protocol="ssh") == now.get_value(
        "gatewayd_connections_open", protocol="http") == 0})
    assert after.get_value("gatewayd_recording_flush_failures_total") == 0
    assert not any(name == "gatewayd_logins_refused_total" and dict(labels).get("protocol") == "ssh"
                   and value > before.get_value(name, **dict(labels)) for (name, labels), value in after.items())


async def test_openssh_bulk_both_ways_goes_through_the_ssh_data_path(gateway, ssh_target):
    """proxies/ssh/datapath.py with OpenSSH on both sides of the gateway: 2 MB of ``seq`` down and 2 MiB up (its
    SHA-256 taken by the target), the client renewing its keys every 512 KiB; every byte arrives both ways, and the
    node's counters show the data path carried the bulk of the 32 KiB packets, in and out (not asyncssh's)."""
    before = await scrape(gateway)
    async with admin_http(gateway) as http:
        ssh = SshApi(gateway, http, ssh_target)
        secret, session = await ssh.credential(await ssh.role())
        command = ["ssh", *CLIENT_OPTIONS, "-o", "RekeyLimit=512K", "-p", str(gateway.ports["ssh"]),
                   f"{secret}@127.0.0.1"]
        down = await asyncio.to_thread(subprocess.run, [*command, "seq 1 300000"], capture_output=True,
                                       timeout=120)
        assert down.returncode == 0 and down.stdout == "".join(f"{n}\n" for n in range(1, 300001)).encode(), \
            down.stderr[-2000:]
        await ssh.done_session(session)
        secret, session = await ssh.credential(await ssh.role())
        command[-1] = f"{secret}@127.0.0.1"
        sent = os.urandom(2 << 20)
        up = await asyncio.to_thread(subprocess.run, [*command, "sha256sum"], input=sent, capture_output=True,
                                     timeout=120)
        assert up.returncode == 0 and up.stdout.split()[0].decode() == hashlib.sha256(sent).hexdigest(), \
            up.stderr[-2000:]
        await ssh.done_session(session)
    packets = (len(down.stdout) + len(sent)) // 32768  # each way: taken in on one connection, sent on the other
    await scrape_until(gateway, {"most of the bulk's packets on the data path, both ways": lambda now: all(
        now.get_value("gatewayd_ssh_datapath_packets_total", direction=direction)
        - before.get_value("gatewayd_ssh_datapath_packets_total", direction=direction) >= packets // 2
        for direction in ("in", "out"))})


async def test_readyz_says_ready_and_nothing_more(gateway):
    async with aiohttp.ClientSession() as http:
        api = Api(gateway, http)
        status, body = await api("GET", "/readyz")  # checked against the OpenAPI document
        assert (status, body) == (200, {"status": "ready"})
        assert await api("GET", "/healthz") == (200, {"status": "ok"})  # liveness unchanged


async def test_readyz_is_503_when_a_listener_could_not_start_and_only_the_log_says_where(tmp_path_factory):
    """Issue 31, item 10: an unauthenticated caller learned the listeners' addresses (and the store's errors)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        daemon = start_daemon(tmp_path_factory, "notready", {"listeners.ssh": f"127.0.0.1:{port}"})
        try:
            async with aiohttp.ClientSession() as http:
                api = Api(daemon, http)
                said = f"ssh listener on 127.0.0.1:{port} failed"
                deadline = time.monotonic() + 30
                while said not in daemon.log_text():  # the daemon is still starting it
                    status, body = await api("GET", "/readyz")
                    assert (status, body) == (503, {"status": "not ready", "message": "not ready"}), body
                    assert time.monotonic() < deadline, daemon.log_text()
                    await asyncio.sleep(0.05)
                async with http.get(f"{daemon.url}/readyz") as response:
                    text = await response.text()
                assert response.status == 503 and str(port) not in text and "127.0.0.1" not in text, text
                assert await api("GET", "/healthz") == (200, {"status": "ok"})  # still alive
            lines = [line for line in daemon.log_text().splitlines() if '"not ready"' in line and said in line]
            assert len(lines) == 1, daemon.log_text()  # once per change, not once per probe
        finally:
            assert daemon.stop() == 0


WORKER = """
import sys
from gatewayd import metrics
for _ in range(int(sys.argv[1])):
    metrics.login_refused("rdp")
"""


async def test_multiprocess_mode_merges_every_process(tmp_path_factory, tmp_path):
    """With PROMETHEUS_MULTIPROC_DIR, what another process (a worker) counted is in this node's scrape."""
    shared = tmp_path / "prometheus"
    shared.mkdir()
    env = {"PROMETHEUS_MULTIPROC_DIR": str(shared)}
    daemon = start_daemon(tmp_path_factory, "multiproc", {}, env)
    try:
        worker = subprocess.run([sys.executable, "-c", WORKER, "3"], env={**os.environ, **env}, cwd=ROOT,
                                capture_output=True, text=True, timeout=60)
        assert worker.returncode == 0, worker.stderr
        samples = await scrape(daemon)
        assert samples.get_value("gatewayd_logins_refused_total", protocol="rdp") == 3
        async with aiohttp.ClientSession() as http:  # and the daemon's own counts are merged in too
            async with http.get(f"{daemon.url}/readyz") as response:
                assert response.status == 200
        assert any(path.name.startswith("counter_") for path in shared.iterdir())
    finally:
        assert daemon.stop() == 0


async def test_readyz_is_503_when_the_store_does_not_answer(tmp_path, caplog):
    """The API of a gateway whose store went away (closed under it): not ready; the log names the store, the
    answer does not (its error may name the store's address or role)."""
    from aiohttp.test_utils import TestServer

    from control.app import make_app
    from tests.conftest import core_gateway

    async with core_gateway(tmp_path) as gateway:
        gateway.server_config = {}  # no listener asked for
        async with TestServer(make_app(gateway.services())) as server, aiohttp.ClientSession() as http:
            async with http.get(server.make_url("/api/readyz")) as response:
                assert response.status == 200, await response.text()
            await gateway.store.close()
            with caplog.at_level("INFO", logger="gatewayd.health"):
                async with http.get(server.make_url("/api/readyz")) as response:
                    body = await response.json()
            assert (response.status, body) == (503, {"status": "not ready", "message": "not ready"})
            assert any(r.getMessage() == "not ready" and r.reason.startswith("store unreachable")
                       for r in caplog.records), caplog.records


def sample(name: str, **labels: str) -> float:
    """A value of this process's own registry (the in-process gateway's)."""
    from gatewayd import metrics

    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for found in family.samples:
            if found.name == name and found.labels == labels:
                return found.value
    return 0.0


async def test_a_flush_the_store_refuses_is_counted_and_kept(tmp_path):
    from tests.conftest import core_gateway

    async with core_gateway(tmp_path) as gateway:
        recorder = await gateway.recording.recorder("metrics-flush-failure")
        await gateway.store.close()  # the store goes away under the flusher
        # recorded once it is gone: the service's own flusher (every 100 ms) cannot store it first while the
        # store closes, and nothing is pending for it to try before the flush here (which takes its lock at once)
        failures = sample("gatewayd_recording_flush_failures_total")
        recorder.input(b"select 1")
        assert await gateway.recording.flush() is False
        assert sample("gatewayd_recording_flush_failures_total") == failures + 1
        [kept] = recorder.unstored  # kept for the next try, as it was
        assert (kept.first_seq, [e.data for e in kept.events]) == (0, [b"select 1"])
