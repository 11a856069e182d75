"""The cross-protocol contract: every proxy admits, dials, ends and blocks the same way, in its own words.

One table of drivers, one per protocol, each a real client against a real
target through the gateway: ``line`` (tests/lineproxy.py, the reference
proxy, in process), ``postgres`` (asyncpg to a PostgreSQL 15), ``mysql`` (the
mariadb client to a MariaDB 10.11), ``ssh``
(OpenSSH ``ssh`` to an sshd), ``http`` (aiohttp to tests/httppeer.py) and
``rdp`` (xfreerdp to a FreeRDP shadow server).  A driver connects with a
secret, sends one input and reads the answer; it also knows how its
protocol says "refused", "unreachable", "ended" and "blocked".  The tests
below are the contract, written once:

1. an unknown and an expired secret are refused in the protocol's words and
   audited as a ``<subtype>.login`` failure;
2. an unreachable target is an error in the protocol's words and a closed
   session with one ``e`` event (the dialer's message) and exit code 254
   (HTTP, one session per credential, keeps it open: the documented option);
3. a kill through the API, an expiry and the user's deactivation (or deletion)
   end the session with the reason as the last ``e`` event and exit code 254,
   and disconnect the client;
4. a guard-rail block is answered in the protocol's words, recorded as ``i``
   (what was blocked) then ``e`` (the rule), and audited as ``guardrail.block``
   with that input.

Where a proxy diverges today its case is a strict xfail naming the
divergence: once the proxy is on the pipeline the case passes and the
marker must go.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import aiohttp
import asyncpg
import pytest

from control.app import make_app
from gatewayd.config import load_config
from gatewayd.daemon import Gateway
from tests import lineproxy, openapi_check
from tests.apiclient import Api, MySqlApi, PostgresApi, SshApi, admin_http, events
from tests.conftest import free_port, new_store_database_now, proxy_daemon
from tests.mypeer import unavailable_reason as my_unavailable
from tests.pgpeer import unavailable_reason as pg_unavailable
from tests.pgpeer import wait_for_backends
from tests.sshpeer import CLIENT_OPTIONS
from tests.sshpeer import unavailable_reason as ssh_unavailable
from tests.test_http_proxy import HttpApi

KILLED = "session killed by admin@example.com"
EXPIRED = "credential expired: the session was closed"
DEACTIVATED = "the user was deactivated by admin@example.com: the session was closed"
DELETED = "the user was deleted by admin@example.com: the session was closed"
UNKNOWN = "invalid credential: unknown secret"
EXPIRED_SECRET = "invalid credential: it has expired"
DENY = [{"type": "deny_words_list", "words": ["forbidden thing"]}]
BLOCKED = "validation error, match guard rails input rule, type=deny_words_list, words=[forbidden thing]"


def dialer_message(connection: dict) -> str:
    """What the gateway's Dialer says of a closed port: the one unreachable message (gatewayd/dialer.py)."""
    return f'could not connect to the target of connection "{connection["name"]}": connection refused'


@dataclass(slots=True)
class Answer:
    """What the client showed: its exit code, status or SQLSTATE (None when it has none) and its words."""

    code: int | str | None
    text: str


class Held:
    """A client holding a session open until the gateway ends it; ``ended`` is what it showed then."""

    def __init__(self, ended: Callable[[], Any], stop: Callable[[], Any]) -> None:
        self._ended, self._stop = ended, stop

    async def ended(self, timeout: float = 30) -> Answer:
        """What the client showed once disconnected; TimeoutError when it is still connected after ``timeout``."""
        try:
            return await asyncio.wait_for(self._ended(), timeout)
        finally:
            await self.stop()

    async def stop(self) -> None:
        result = self._stop()
        if asyncio.iscoroutine(result):
            await result


class Driver:
    """One protocol as the contract sees it; subclasses are the table below."""

    name: str
    login_action: str  # the audit action of its logins: "<connection subtype>.login"
    unknown_secret: str
    expiry_seconds = 4  # a credential that lives long enough to log in, then expires mid-session
    block_input: str | None = "forbidden thing"  # None: the protocol carries no text input to block
    session_per_credential = False  # HTTP: one session per credential, dialed per request (docs/http-proxy.md)

    def __init__(self, api: Api) -> None:
        self.api = api

    async def role(self, port: int | None = None) -> dict:
        """A connection to the real target, or to ``port`` (a closed one)."""
        raise NotImplementedError

    async def login(self, secret: str) -> Answer:
        """Connect with ``secret`` and leave at once."""
        raise NotImplementedError

    async def send(self, secret: str, text: str) -> Answer:
        """Connect, send one input, read the answer, leave."""
        raise NotImplementedError

    async def hold(self, secret: str) -> Held:
        """Connect and keep the session open until the gateway ends it."""
        raise NotImplementedError

    async def settled(self) -> None:
        """Until the client ``hold`` started is past its login (the session is open before the client has
        heard it is logged on); nothing to wait for where the session's opening says it already."""

    # how the protocol says it (assertions)

    def refused(self, answer: Answer, reason: str) -> None:
        raise NotImplementedError

    def unreachable(self, answer: Answer, message: str) -> None:
        raise NotImplementedError

    def ended(self, answer: Answer, reason: str) -> None:
        raise NotImplementedError

    def blocked(self, answer: Answer, message: str) -> None:
        raise NotImplementedError

    def recorded(self, sent: str) -> str:
        """The ``i`` event of a blocked input as the protocol records it."""
        return sent

    async def audit(self, action: str) -> list[dict]:
        status, body = await self.api("GET", f"/audit/logs?action={action}&page_size=100")
        assert status == 200, body
        return body["data"]


# --------------------------------------------------------------------------- the drivers


class LineDriver(Driver):
    """tests/lineproxy.py, the reference: one text line per message."""

    name = "line"
    login_action = "ssh.login"  # the reference proxy registers as the ssh listener on ssh connections
    unknown_secret = "ssh-" + "A" * 43

    def __init__(self, api: Api, port: int) -> None:
        super().__init__(api)
        self.port = port

    async def role(self, port: int | None = None) -> dict:
        env = {"HOST": "127.0.0.1", **({"PORT": str(port)} if port else {})}  # no PORT: it echoes
        return await self.api.connection("line", "custom", "ssh", env)

    async def _open(self, secret: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, str]:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        writer.write(f"{secret}\n".encode())
        return reader, writer, (await reader.readline()).decode()

    async def login(self, secret: str) -> Answer:
        _, writer, first = await self._open(secret)
        writer.close()
        return Answer(None, first)

    async def send(self, secret: str, text: str) -> Answer:
        reader, writer, first = await self._open(secret)
        assert first.startswith("session "), first
        writer.write(f"{text}\n".encode())
        answer = (await reader.readline()).decode()
        writer.close()
        return Answer(None, answer)

    async def hold(self, secret: str) -> Held:
        reader, writer, first = await self._open(secret)
        assert first.startswith("session "), first

        async def ended() -> Answer:
            return Answer(None, (await reader.read()).decode())

        return Held(ended, writer.close)

    def refused(self, answer: Answer, reason: str) -> None:
        assert answer.text == f"denied: {reason}\n", answer

    def unreachable(self, answer: Answer, message: str) -> None:
        assert answer.text == f"unreachable: {message}\n", answer

    def ended(self, answer: Answer, reason: str) -> None:
        assert answer.text == f"closed: {reason}\n", answer

    def blocked(self, answer: Answer, message: str) -> None:
        assert answer.text == f"blocked: {message}\n", answer

    def recorded(self, sent: str) -> str:
        return f"{sent}\n"


class PostgresDriver(Driver):
    """asyncpg: refusals and ends are ErrorResponses with a SQLSTATE; the input is a simple-protocol query."""

    name = "postgres"
    login_action = "postgres.login"
    unknown_secret = "pg-" + "A" * 43
    block_input = "select 'forbidden thing'"

    def __init__(self, api: PostgresApi, port: int) -> None:
        super().__init__(api)
        self.port = port

    async def role(self, port: int | None = None) -> dict:
        return await self.api.role(port=port)  # type: ignore[attr-defined]

    async def _connect(self, secret: str) -> asyncpg.Connection:
        return await asyncpg.connect(host="127.0.0.1", port=self.port, user=secret, password="any",
                                     database="postgres", timeout=30, command_timeout=120, ssl=False)

    @staticmethod
    def _error(exc: asyncpg.PostgresError) -> Answer:
        return Answer(exc.sqlstate, f"{exc.severity} {exc.sqlstate} {exc.args[0] if exc.args else exc}")

    async def login(self, secret: str) -> Answer:
        try:
            connection = await self._connect(secret)
        except asyncpg.PostgresError as exc:
            return self._error(exc)
        await connection.close()
        return Answer(None, "connected")

    async def send(self, secret: str, text: str) -> Answer:
        connection = await self._connect(secret)
        try:
            return Answer(None, await connection.execute(text))  # no arguments: the simple query protocol
        except asyncpg.PostgresError as exc:
            return self._error(exc)
        finally:
            await connection.close()

    async def hold(self, secret: str) -> Held:
        """psql, which shows the FATAL's SQLSTATE as it is disconnected (asyncpg reports its own 08003)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env.update(PGHOST="127.0.0.1", PGPORT=str(self.port), PGUSER=secret, PGPASSWORD="any",
                   PGDATABASE="postgres", PGSSLMODE="disable", PGCONNECT_TIMEOUT="30")
        process = await asyncio.create_subprocess_exec(
            "psql", "-X", "-v", "VERBOSITY=verbose", "-c", "select pg_sleep(600)", env=env,
            stdin=subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)

        async def ended() -> Answer:
            out, err = await process.communicate()
            text = (out + err).decode(errors="replace")
            fatal = re.search(r"FATAL:  (\w{5}): (.*)", text)
            return Answer(fatal[1], f"FATAL {fatal[1]} {fatal[2]}") if fatal else Answer(process.returncode, text)

        def stop() -> None:
            if process.returncode is None:
                process.kill()

        return Held(ended, stop)

    async def settled(self) -> None:
        """psql's query runs on the target: psql is logged on (a FATAL before that reads as a failed login)."""
        await wait_for_backends(self.api.cluster.dsn(), "select pg_sleep(600)", running=True)  # type: ignore[attr-defined]

    def refused(self, answer: Answer, reason: str) -> None:
        assert answer.code == "28P01" and answer.text == f"FATAL 28P01 {reason}", answer

    def unreachable(self, answer: Answer, message: str) -> None:
        assert answer.code == "08001" and answer.text == f"FATAL 08001 {message}", answer

    def ended(self, answer: Answer, reason: str) -> None:
        assert answer.code == "57P01" and answer.text == f"FATAL 57P01 {reason}", answer

    def blocked(self, answer: Answer, message: str) -> None:
        assert answer.code == "42501" and answer.text == f"ERROR 42501 {message}", answer


class MySqlDriver(Driver):
    """The mariadb client with the secret as user name; refusals and ends are ERR packets with a code and SQLSTATE."""

    name = "mysql"
    login_action = "mysql.login"
    unknown_secret = "my-" + "A" * 43
    block_input = "select 'forbidden thing'"

    def __init__(self, api: MySqlApi, port: int) -> None:
        super().__init__(api)
        self.port = port

    async def role(self, port: int | None = None) -> dict:
        return await self.api.role(port=port)  # type: ignore[attr-defined]

    async def _client(self, secret: str, sql: str) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            "mariadb", "--no-defaults", "-h", "127.0.0.1", "-P", str(self.port), "-u", secret, "--password=any",
            "--skip-ssl", "--connect-timeout=30", "-e", sql, "app",
            stdin=subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)

    @staticmethod
    async def _result(process: asyncio.subprocess.Process) -> Answer:
        out, err = await process.communicate()
        text = (out + err).decode(errors="replace")
        error = re.search(r"ERROR (\d+) \((\w{5})\)(?: at line \d+)?: (.*)", text)
        return Answer(f"{error[1]} {error[2]}", error[3].strip()) if error else Answer(process.returncode, text)

    async def login(self, secret: str) -> Answer:
        return await self._result(await self._client(secret, "do 1"))

    async def send(self, secret: str, text: str) -> Answer:
        return await self._result(await self._client(secret, text))

    async def hold(self, secret: str) -> Held:
        process = await self._client(secret, "select sleep(600)")

        def stop() -> None:
            if process.returncode is None:
                process.kill()

        return Held(lambda: self._result(process), stop)

    async def settled(self) -> None:
        """The client's statement runs on the target: it is logged on."""
        server = self.api.server  # type: ignore[attr-defined]
        for _ in range(400):
            if server.sql("SELECT COUNT(*) FROM information_schema.processlist "
                          "WHERE info = 'select sleep(600)'").strip() != "0":
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the target never ran the held statement")

    def refused(self, answer: Answer, reason: str) -> None:
        assert answer.code == "1045 28000" and answer.text == reason, answer

    def unreachable(self, answer: Answer, message: str) -> None:
        assert answer.code == "1105 HY000" and answer.text == message, answer

    def ended(self, answer: Answer, reason: str) -> None:
        assert answer.code == "1927 70100" and answer.text == reason, answer

    def blocked(self, answer: Answer, message: str) -> None:
        assert answer.code == "1227 42000" and answer.text == message, answer


class SshDriver(Driver):
    """OpenSSH ``ssh`` with the secret as user name; the input is an exec command."""

    name = "ssh"
    login_action = "ssh.login"
    unknown_secret = "ssh-" + "A" * 43
    block_input = "echo forbidden thing"

    def __init__(self, api: SshApi, port: int) -> None:
        super().__init__(api)
        self.port = port

    async def role(self, port: int | None = None) -> dict:
        return await self.api.role(port=port)  # type: ignore[attr-defined]

    async def _ssh(self, secret: str, command: str) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            "ssh", *CLIENT_OPTIONS, "-p", str(self.port), f"{secret}@127.0.0.1", command,
            stdin=subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)

    @staticmethod
    async def _result(process: asyncio.subprocess.Process) -> Answer:
        out, err = await process.communicate()
        return Answer(process.returncode, (out + err).decode(errors="replace"))

    async def login(self, secret: str) -> Answer:
        return await self._result(await self._ssh(secret, "true"))

    async def send(self, secret: str, text: str) -> Answer:
        return await self._result(await self._ssh(secret, text))

    async def hold(self, secret: str) -> Held:
        self.held = f"sleep 600.{os.getpid()}{free_port()}"  # this hold's own command, found by ``settled``
        process = await self._ssh(secret, self.held)

        def stop() -> None:
            if process.returncode is None:
                process.kill()

        return Held(lambda: self._result(process), stop)

    async def settled(self) -> None:
        """The held command runs on the target. The session is open at the login, before ssh opens its channel:
        a kill in between finds no channel to tell why, disconnects with the reason, and ssh exits 255 (CI, 28 Nov)."""
        wanted = self.held.replace(" ", "\0").encode() + b"\0"
        for _ in range(600):
            for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
                with contextlib.suppress(OSError):
                    if cmdline.read_bytes() == wanted:
                        return
            await asyncio.sleep(0.05)
        raise AssertionError(f"{self.held!r} never ran on the target")

    def refused(self, answer: Answer, reason: str) -> None:
        assert answer.code == 255 and "Permission denied" in answer.text, answer  # ssh names no reason

    def unreachable(self, answer: Answer, message: str) -> None:
        assert answer.code == 254 and answer.text.strip() == message, answer

    def ended(self, answer: Answer, reason: str) -> None:
        assert answer.code == 254 and reason in answer.text, answer

    def blocked(self, answer: Answer, message: str) -> None:
        assert answer.code == 254 and answer.text.strip() == message, answer


class HttpDriver(Driver):
    """aiohttp with the secret in ``Authorization``; the input is a request head; a session is a credential's."""

    name = "http"
    login_action = "httpproxy.login"
    unknown_secret = "httpproxy-" + "A" * 43
    session_per_credential = True

    def __init__(self, api: HttpApi, url: str, client: aiohttp.ClientSession) -> None:
        super().__init__(api)
        self.url = url
        self.client = client

    async def role(self, port: int | None = None) -> dict:
        return await self.api.role(f"http://127.0.0.1:{port}" if port else None)  # type: ignore[attr-defined]

    async def _get(self, secret: str, path: str, **headers: str) -> Answer:
        async with self.client.get(self.url + path, headers={"Authorization": secret, **headers}) as response:
            body = await response.text()
            with contextlib.suppress(ValueError, KeyError, TypeError):  # a JSON error page: its message
                body = (await response.json(content_type=None))["message"]
            return Answer(response.status, body)

    async def login(self, secret: str) -> Answer:
        return await self._get(secret, "/json")

    async def send(self, secret: str, text: str) -> Answer:
        return await self._get(secret, "/echo/contract", **{"X-Note": text})

    async def hold(self, secret: str) -> Held:
        response = await self.client.get(self.url + "/sse-hold", headers={"Authorization": secret})
        assert response.status == 200, response.status
        assert await response.content.readline() == b"data: first\n"

        async def ended() -> Answer:
            try:
                rest = await response.content.read()
            except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as exc:
                return Answer(None, f"cut: {type(exc).__name__}")
            return Answer(None, f"the stream ended normally: {rest!r}")

        async def stop() -> None:
            response.close()
            async with self.client.get(self.api.target + "/release"):  # type: ignore[attr-defined]
                pass

        return Held(ended, stop)

    def refused(self, answer: Answer, reason: str) -> None:
        assert answer.code == 401 and reason in answer.text, answer

    def unreachable(self, answer: Answer, message: str) -> None:
        assert answer.code == 502 and answer.text == message, answer

    def ended(self, answer: Answer, reason: str) -> None:
        assert answer.text.startswith("cut: "), answer  # a stream cannot say why: the next request does

    def blocked(self, answer: Answer, message: str) -> None:
        assert answer.code == 403 and answer.text == message, answer

    def recorded(self, sent: str) -> str:
        return f"X-Note: {sent}"  # a line of the recorded request head (checked with ``in``)


class RdpDriver(Driver):
    """xfreerdp with the secret as user name and password; RDP has no text input for guard rails to read."""

    name = "rdp"
    login_action = "rdp.login"
    unknown_secret = "rdp-" + base64.urlsafe_b64encode(b"\x01" * 32).decode().rstrip("=")
    expiry_seconds = 8  # xfreerdp's logon through the gateway takes seconds on a busy machine
    block_input = None

    def __init__(self, api: Api, port: int, peers: Any) -> None:
        super().__init__(api)
        self.port = port
        self.peers = peers

    async def role(self, port: int | None = None) -> dict:
        return await self.api.connection("rdp", "custom", "rdp", {
            "HOST": "127.0.0.1", "PORT": str(port or self.peers.shadow_port), "USER": "alice", "PASS": "Tgt-pass-1"})

    async def _xfreerdp(self, secret: str, *extra: str) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            "xfreerdp", f"/v:127.0.0.1:{self.port}", "/cert:ignore", f"/u:{secret}", f"/p:{secret}",
            "/size:1024x768", "/bpp:16", *extra, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            env={"PATH": os.environ["PATH"], "HOME": str(self.peers.home), "DISPLAY": f":{self.peers.client_display}"})

    @staticmethod
    async def _result(process: asyncio.subprocess.Process) -> Answer:
        out, _ = await process.communicate()
        return Answer(process.returncode, out.decode(errors="replace"))

    async def login(self, secret: str) -> Answer:
        return await self._result(await self._xfreerdp(secret, "+auth-only"))

    async def hold(self, secret: str) -> Held:
        process = await self._xfreerdp(secret)

        def stop() -> None:
            if process.returncode is None:
                process.kill()

        return Held(lambda: self._result(process), stop)

    def refused(self, answer: Answer, reason: str) -> None:
        assert answer.code != 0 and "ERRCONNECT_CONNECT_TRANSPORT_FAILED" in answer.text, answer

    def unreachable(self, answer: Answer, message: str) -> None:
        assert answer.code != 0 and "ERRCONNECT" in answer.text, answer

    def ended(self, answer: Answer, reason: str) -> None:
        assert answer.code is not None, answer  # the client left (xfreerdp cannot show why)


# --------------------------------------------------------------------------- the gateways and peers


@pytest.fixture(scope="module")
async def line_gateway(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Gateway]:
    """The reference proxy in an in-process gateway with the real control API."""
    data = tmp_path_factory.mktemp("contract-line") / "data"
    config = load_config(None, environ={}, overrides={
        "data_dir": str(data), "api.listen": f"127.0.0.1:{free_port()}", "listeners.postgres": "",
        "listeners.rdp": "", "listeners.http": "", "listeners.mysql": "", "listeners.ssh": f"127.0.0.1:{free_port()}",
        "sessions.flush_interval": "100ms", "throttle.credential_failures": 0})
    gateway = Gateway(config, app_factory=make_app, listener_factories={"ssh": lineproxy.start})
    await gateway.start()
    admin = await gateway.identity.ensure_local_user("admin@example.com", "Admin", ["admin"])
    gateway.admin_token = gateway.identity.issue_token(admin)
    url = f"http://{config['api.listen']}/api"
    async with aiohttp.ClientSession() as client, client.get(f"{url}/openapi.json") as response:
        # loaded here, on the loop: Api's schema check would fetch it with a blocking call on the gateway's own loop
        openapi_check._BY_DAEMON[url] = openapi_check.ResponseSchemas(await response.json())
    yield gateway
    await gateway.stop()


class InProcess:
    """What ``Api`` needs of a daemon, for the in-process gateway."""

    def __init__(self, gateway: Gateway) -> None:
        self.url = f"http://{gateway.config['api.listen']}/api"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, pg_store: Any) -> Any:
    """One ``gatewayd run`` with the postgres, ssh, http and rdp listeners, on the PostgreSQL store.

    The proxies' own end-to-end modules run on the embedded SQLite store; here every proxy's contract
    runs on the PostgreSQL store (and the line proxy's, in process, on SQLite): each store carries
    every protocol's sessions, kills, expiries and blocks without running the whole suite twice.
    """
    ports = {name: free_port() for name in ("ssh", "http", "rdp", "mysql")}
    daemon = proxy_daemon(tmp_path_factory, "contract", "postgres", {
        **{f"listeners.{name}": f"127.0.0.1:{port}" for name, port in ports.items()},
        "throttle.credential_failures": 0,  # every refusal here is on purpose: none may be throttled
        "store.driver": "postgres", "store.url": new_store_database_now(pg_store),
    }, wait=True)
    daemon.ports = {"postgres": daemon.proxy_port, **ports}
    yield daemon
    assert daemon.stop() == 0


@pytest.fixture(scope="module")
async def http(gateway: Any) -> AsyncIterator[aiohttp.ClientSession]:
    """The admin's API client of the daemon."""
    async with admin_http(gateway) as session:
        yield session


PROTOCOLS = ["line", "postgres", "ssh", "http", "rdp", "mysql"]


@pytest.fixture
def proto(request: pytest.FixtureRequest) -> Driver:
    """The driver of one protocol, its gateway and real target started once for the module or session."""
    name = request.param
    if name == "line":
        gateway = request.getfixturevalue("line_gateway")
        api = Api(InProcess(gateway), request.getfixturevalue("line_http"), gateway.admin_token)  # type: ignore
        _, port = gateway.server_config["ssh_server_config"]["listen_address"].rsplit(":", 1)
        return LineDriver(api, int(port))
    reason = {"postgres": pg_unavailable, "ssh": ssh_unavailable, "mysql": my_unavailable}.get(name, lambda: None)()
    if reason:
        pytest.skip(reason)
    daemon = request.getfixturevalue("gateway")
    http = request.getfixturevalue("http")
    if name == "postgres":
        return PostgresDriver(PostgresApi(daemon, http, request.getfixturevalue("pg_target")), daemon.ports[name])
    if name == "mysql":
        return MySqlDriver(MySqlApi(daemon, http, request.getfixturevalue("mysql_target")), daemon.ports[name])
    if name == "ssh":
        return SshDriver(SshApi(daemon, http, request.getfixturevalue("ssh_target")), daemon.ports[name])
    if name == "http":
        return HttpDriver(HttpApi(daemon, http, request.getfixturevalue("http_target")),
                          f"http://127.0.0.1:{daemon.ports[name]}", request.getfixturevalue("plain_http"))
    return RdpDriver(Api(daemon, http), daemon.ports[name], request.getfixturevalue("rdp_peers"))


@pytest.fixture(scope="module")
async def line_http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture(scope="module")
async def plain_http() -> AsyncIterator[aiohttp.ClientSession]:
    """A client with no cookie jar: it sends only what a driver says."""
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
        yield session


def protocols(**divergent: str) -> list[Any]:
    """Every protocol; one that ``divergent`` names (protocol=what differs today) is a strict xfail."""
    return [pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=divergent[name]))
            if name in divergent else name for name in PROTOCOLS]


# --------------------------------------------------------------------------- 1. refusals


@pytest.mark.parametrize("proto", protocols(), indirect=True)
async def test_unknown_and_expired_secrets_are_refused_in_the_protocols_words_and_audited(proto: Driver) -> None:
    role = await proto.role()
    proto.refused(await proto.login(proto.unknown_secret), UNKNOWN)
    expired, session_id = await proto.api.credential(role, seconds=1)
    await asyncio.sleep(1.5)  # past its expiry (not a timing assertion)
    proto.refused(await proto.login(expired), EXPIRED_SECRET)

    failures = [e for e in await proto.audit(proto.login_action) if e["outcome"] == "failure"]
    assert any(e["error_message"] == UNKNOWN for e in failures), failures
    [entry] = [e for e in failures if e["request_payload_redacted"]["connection"] == role["name"]]
    assert entry["error_message"] == EXPIRED_SECRET and entry["actor_email"] == "admin@example.com", entry
    assert entry["client_ip"] == "127.0.0.1" and entry["resource_type"] == "connection", entry
    assert set(entry["request_payload_redacted"]) == {"connection", "credential_id"}, entry
    assert not any(secret in str(e) for e in failures for secret in (expired, proto.unknown_secret))
    status, session = await proto.api("GET", f"/sessions/{session_id}")
    assert status == 200 and session["status"] == "ready", session  # a refused secret opens no session


# --------------------------------------------------------------------------- 2. unreachable target


@pytest.mark.parametrize("proto", protocols(), indirect=True)
async def test_an_unreachable_target_is_an_error_in_the_protocols_words_an_e_event_and_254(proto: Driver) -> None:
    role = await proto.role(port=free_port())  # nothing listens there
    secret, session_id = await proto.api.credential(role)
    answer = await proto.login(secret)
    if proto.session_per_credential:  # the documented exception: the session stays open for the next request
        session = await proto.api.session(session_id, until=lambda s: any(k == "e" for k, _ in events(s)))
        assert session["status"] == "open", session
        assert [k for k, _ in events(session)] == ["i", "e"], events(session)  # the request, then why it failed
        assert events(session)[-1] == ("e", dialer_message(role)), events(session)
    else:
        session = await proto.api.done_session(session_id)
        assert session["exit_code"] == 254, session
        assert events(session) == [("e", dialer_message(role))], events(session)
    proto.unreachable(answer, dialer_message(role))


# --------------------------------------------------------------------------- 3. kill and expiry


@pytest.mark.parametrize("proto", protocols(), indirect=True)
async def test_a_kill_through_the_api_ends_the_session_with_its_reason_and_254(proto: Driver) -> None:
    role = await proto.role()
    secret, session_id = await proto.api.credential(role)
    held = await proto.hold(secret)
    try:
        await proto.api.session(session_id, until=lambda s: s["status"] == "open", timeout=60)
        await proto.settled()
        status, body = await proto.api("POST", f"/sessions/{session_id}/kill")
        assert status == 200 and body["exit_code"] == 254, body
        proto.ended(await held.ended(), KILLED)
    finally:
        await held.stop()
    session = await proto.api.done_session(session_id)
    assert session["exit_code"] == 254 and events(session)[-1] == ("e", KILLED), events(session)


@pytest.mark.parametrize("proto", protocols(), indirect=True)
async def test_an_expiring_credential_ends_the_session_with_its_reason_and_254(proto: Driver) -> None:
    role = await proto.role()
    secret, session_id = await proto.api.credential(role, seconds=proto.expiry_seconds)
    held = await proto.hold(secret)
    proto.ended(await held.ended(), EXPIRED)
    session = await proto.api.done_session(session_id)
    assert session["exit_code"] == 254 and events(session)[-1] == ("e", EXPIRED), events(session)


async def cut_off(proto: Driver, method: str, body: Any, reason: str) -> None:
    """A user holds a session; an admin changes the user (``method`` on /users/{email}, with ``body``): the session
    ends as a kill does, with ``reason`` as its last ``e`` event and 254, and the call's audit entry says so."""
    role = await proto.role()
    email, token = await proto.api.signed_in_user()
    secret, session_id = await proto.api.credential(role, token=token)
    held = await proto.hold(secret)
    try:
        await proto.api.session(session_id, until=lambda s: s["status"] == "open", timeout=60)
        await proto.settled()
        status, answer = await proto.api(method, f"/users/{email}", body)
        assert status in (200, 204), answer
        proto.ended(await held.ended(), reason)
    finally:
        await held.stop()
    session = await proto.api.done_session(session_id)
    assert session["exit_code"] == 254 and events(session)[-1] == ("e", reason), events(session)
    action = "users.update" if method == "PUT" else "users.delete"
    [entry] = [e for e in await proto.audit(action) if (e["request_payload_redacted"] or {}).get("user") == email]
    assert entry["outcome"] == "success" and entry["request_payload_redacted"]["sessions_ended"] == reason, entry


@pytest.mark.parametrize("proto", protocols(), indirect=True)
async def test_deactivating_a_user_ends_its_sessions_with_the_reason_and_254(proto: Driver) -> None:
    await cut_off(proto, "PUT", {"status": "inactive"}, DEACTIVATED)


@pytest.mark.parametrize("proto", ["line", "postgres"], indirect=True)
async def test_deleting_a_user_ends_its_sessions_with_the_reason_and_254(proto: Driver) -> None:
    await cut_off(proto, "DELETE", None, DELETED)


# --------------------------------------------------------------------------- 4. guard-rail block


@pytest.mark.parametrize("proto", protocols(), indirect=True)
async def test_a_blocked_input_is_answered_recorded_then_blocked_and_audited(proto: Driver) -> None:
    if proto.block_input is None:
        pytest.skip(f"{proto.name} carries no text input for guard rails to read (RDP sends key scan codes and "
                    "bitmaps; keys are recorded only with rdp.record_keyboard and no rule reads them)")
    role = await proto.role()
    rail = await proto.api.guardrail(role, input_rules=DENY)
    secret, session_id = await proto.api.credential(role)
    proto.blocked(await proto.send(secret, proto.block_input), BLOCKED)

    session = await proto.api.session(session_id, until=lambda s: any(k == "e" for k, _ in events(s)))
    (kind, sent), block = events(session)[:2]
    assert kind == "i" and proto.recorded(proto.block_input) in sent, events(session)
    assert block == ("e", BLOCKED), events(session)
    blocks = [e for e in await proto.audit("guardrail.block")
              if e["request_payload_redacted"].get("session_id") == session_id]
    assert len(blocks) == 1 and blocks[0]["outcome"] == "failure" and blocks[0]["error_message"] == BLOCKED
    assert blocks[0]["actor_email"] == "admin@example.com" and blocks[0]["client_ip"] == "127.0.0.1", blocks
    assert blocks[0]["request_payload_redacted"] == {
        "session_id": session_id, "connection": role["name"], "guardrail": rail["name"], "direction": "input",
        "rule_type": "deny_words_list", "input": blocks[0]["request_payload_redacted"]["input"]}, blocks
    assert blocks[0]["request_payload_redacted"]["input"].rstrip("\r\n") == sent.rstrip("\r\n")
    assert secret not in str(blocks[0])
