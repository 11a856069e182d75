"""End to end: curl and aiohttp through the HTTP proxy of a real gatewayd to a real aiohttp target app.

One target app (``tests/httppeer.py`` in its own process) and one ``gatewayd
run`` subprocess with the http listener serve the whole module; each test
makes its own connection (role) so guard rails never leak between tests.
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import json
import socketserver
import subprocess
import sys
import threading
import time
import uuid
import zlib
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from yarl import URL

from gatewayd.config import load_config
from gatewayd.daemon import Gateway
from gatewayd.models import Connection, new_id, rfc3339, utcnow
from proxies.http.server import start as start_http
from tests import clients
from tests.apiclient import Api, admin_http, b64, events
from tests.conftest import ROOT, Daemon, free_port, proxy_daemon, wait_port
from tests.httppeer import BLOCK, pattern_sha256

BIG = 200 * 1024 * 1024
MEMORY_BOUND_KB = 150 * 1024


def start_target() -> tuple[subprocess.Popen[bytes], int]:
    """The target app on a free port (another attempt if someone took the port meanwhile)."""
    for attempt in range(3):
        port = free_port()
        process = subprocess.Popen([sys.executable, "-m", "tests.httppeer", str(port)], cwd=ROOT)
        try:
            wait_port(port, process)
            return process, port
        except RuntimeError:
            process.kill()
            process.wait(10)
    raise RuntimeError("the target app did not start")


@pytest.fixture(scope="module")
def target():
    process, port = start_target()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(10)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    daemon = proxy_daemon(tmp_path_factory, "httpproxy", "http", {
        "http.record_body_bytes": 4096,
        "http.guard_body_bytes": 65536,
        "http.credential_recheck": "1s",
    }, wait=True)
    daemon.http_url = f"http://127.0.0.1:{daemon.proxy_port}"
    yield daemon
    assert daemon.stop() == 0


class HttpApi(Api):
    """The control API with http connections to the target app."""

    secret_field = "proxy_token"

    def __init__(self, daemon: Daemon, http: aiohttp.ClientSession, target: str) -> None:
        super().__init__(daemon, http)
        self.target = target

    async def role(self, remote_url: str | None = None) -> dict:
        return await self.connection("web", "httpproxy", "httpproxy", {"REMOTE_URL": remote_url or self.target})

    async def access(self, connection: dict, seconds: int = 600) -> dict:
        """The access hint of a fresh credential (``connection_credentials``) with its ``session_id``."""
        status, body = await self("POST", f"/connections/{connection['name']}/credentials",
                                  {"access_duration_seconds": seconds})
        assert status == 201, body
        return {**body["connection_credentials"], "session_id": body["session_id"]}

    async def audit(self, action: str) -> list[dict]:
        status, body = await self("GET", f"/audit/logs?action={action}&page_size=100")
        assert status == 200, body
        return body["data"]


@pytest.fixture(scope="module")
async def api(gateway, target):
    async with admin_http(gateway) as http:
        yield HttpApi(gateway, http, target)


@pytest.fixture(scope="module")
async def client():
    """A plain HTTP client with no cookie jar (each test says what it sends)."""
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False) as http:
        yield http


def has_event(kind: str, needle: str):
    return lambda session: any(k == kind and needle in text for k, text in events(session))


def curl(*args: str, stdin: Any = None, timeout: float = 300) -> subprocess.CompletedProcess[bytes]:
    return clients.curl(*args, stdin=stdin, timeout=timeout)


def header_value(pairs: list[list[str]], name: str) -> list[str]:
    return [v for k, v in pairs if k.lower() == name.lower()]


# --------------------------------------------------------------------------- credentials


async def test_header_credential_forwards_faithfully(api, gateway, client):
    connection = await api.role()
    secret, session_id = await api.credential(connection)
    for authorization in (secret, f"Bearer {secret}"):
        async with client.put(f"{gateway.http_url}/echo/a/b?x=1&y=%20z", data=b"payload",
                               headers={"Authorization": authorization, "X-Custom": "kept",
                                        "X-Forwarded-For": "10.9.9.9", "Connection": "keep-alive, X-Drop",
                                        "X-Drop": "hop"}) as response:
            assert response.status == 200
            seen = await response.json()
        assert seen["method"] == "PUT" and seen["path"] == "/echo/a/b" and seen["query"] == "x=1&y=%20z"
        assert seen["body"] == "payload"
        headers = seen["headers"]
        assert header_value(headers, "Authorization") == []
        assert header_value(headers, "X-Custom") == ["kept"]
        assert header_value(headers, "X-Drop") == []
        assert header_value(headers, "X-Forwarded-For") == ["10.9.9.9, 127.0.0.1"]
        assert header_value(headers, "X-Forwarded-Proto") == ["http"]
        assert header_value(headers, "X-Forwarded-Host") == [gateway.http_url.split("//")[1]]
        assert secret not in json.dumps(seen)
    for method in ("GET", "POST", "DELETE", "PATCH", "OPTIONS"):
        async with client.request(method, f"{gateway.http_url}/echo/m", headers={"Authorization": secret}) as response:
            assert response.status == 200
            assert (await response.json())["method"] == method
    async with client.head(f"{gateway.http_url}/json", headers={"Authorization": secret}) as response:
        assert response.status == 200 and response.content_length > 0
    # the one session of the credential holds them all, open, with the secret redacted
    session = await api.session(session_id, has_event("i", "HEAD /json"))
    assert session["status"] == "open" and session["type"] == "httpproxy"
    recorded = events(session)
    assert sum(1 for k, t in recorded if k == "i") == 8 and sum(1 for k, t in recorded if k == "o") == 8
    assert any(k == "i" and t.startswith("PUT /echo/a/b?x=1&y=%20z HTTP/1.1") and "Authorization: [REDACTED]" in t
               and t.endswith("payload") for k, t in recorded)
    assert any(k == "o" and t.startswith("HTTP/1.1 200 OK") and '"method": "PUT"' in t for k, t in recorded)
    assert secret not in json.dumps(recorded)
    logins = [e for e in await api.audit("httpproxy.login") if e["request_payload_redacted"]["credential_id"]
              and e["request_payload_redacted"]["connection"] == connection["name"]]
    assert [e["outcome"] for e in logins] == ["success"]  # the first login, not every request


async def test_cookie_credential_lets_the_targets_authorization_through(api, gateway, client):
    connection = await api.role()
    secret, _ = await api.credential(connection)
    async with client.get(f"{gateway.http_url}/echo", headers={
            "Cookie": f"theme=dark; gatewayd_proxy_token={secret}; lang=en",
            "Authorization": "Basic dXNlcjpwdw=="}) as response:
        assert response.status == 200
        seen = await response.json()
    assert header_value(seen["headers"], "Authorization") == ["Basic dXNlcjpwdw=="]
    assert header_value(seen["headers"], "Cookie") == ["theme=dark; lang=en"]
    async with client.get(f"{gateway.http_url}/echo", headers={"Cookie": f"gatewayd_proxy_token={secret}"}) as response:
        seen = await response.json()
    assert header_value(seen["headers"], "Cookie") == []


async def test_browser_flow_with_curl_cookie_jar(api, gateway, tmp_path):
    connection = await api.role()
    access = await api.access(connection)
    secret, session_id = access["proxy_token"], access["session_id"]
    port = gateway.proxy_port
    origin = access["origin"]  # the connection's own origin under http.apps_domain (default: localhost)
    assert origin.startswith("http://web-") and origin.endswith(f".localhost:{port}")
    assert access["url"] == f"{origin}/{secret}/"
    jar = tmp_path / "jar.txt"
    # the listener's shared address sends the link on to the connection's own address, secret and all
    first = curl("-D", "-", "-o", "/dev/null", "-c", str(jar), f"{gateway.http_url}/{secret}/echo/page?q=1")
    head = first.stdout.decode()
    assert head.startswith("HTTP/1.1 302"), head
    assert f"Location: {origin}/{secret}/echo/page?q=1\r\n" in head
    assert "set-cookie" not in head.lower()
    # there (curl resolves *.localhost to loopback as browsers do) the cookie is set for that host only
    second = curl("-D", "-", "-o", "/dev/null", "-c", str(jar), f"{origin}/{secret}/echo/page?q=1")
    head = second.stdout.decode()
    assert head.startswith("HTTP/1.1 302"), head
    assert "Location: /echo/page?q=1\r\n" in head
    cookie = next(line for line in head.splitlines() if line.lower().startswith("set-cookie:"))
    assert "HttpOnly" in cookie and "SameSite=Lax" in cookie and "Path=/" in cookie and "Domain" not in cookie
    assert "Secure" not in cookie  # plain http (http.public_scheme): a browser would drop a Secure cookie
    host = origin.split("//")[1].split(":")[0]
    assert f"#HttpOnly_{host}\tFALSE\t/\tFALSE" in jar.read_text()
    # the browser follows the redirects with its cookie, and goes on using it
    followed = curl("-L", "-b", str(jar), "-c", str(jar), f"{gateway.http_url}/{secret}/echo/page?q=1")
    seen = json.loads(followed.stdout)
    assert seen["path"] == "/echo/page" and seen["query"] == "q=1"
    assert header_value(seen["headers"], "Cookie") == []
    assert header_value(seen["headers"], "X-Forwarded-Host") == [f"{host}:{port}"]
    again = curl("-b", str(jar), f"{origin}/json")
    assert json.loads(again.stdout)["ok"] is True
    session = await api.session(session_id, has_event("i", "GET /json"))
    assert secret not in json.dumps(events(session))


async def test_a_credential_on_another_apps_address_is_refused_with_a_page(api, gateway, client):
    first, second = await api.role(), await api.role()
    mine, theirs = await api.access(first), await api.access(second)
    marker = uuid.uuid4().hex
    # the second credential sent to the first connection's address (header or cookie): refused, never forwarded
    for headers in ({"Authorization": theirs["proxy_token"]},
                    {"Cookie": f"gatewayd_proxy_token={theirs['proxy_token']}"}):
        async with client.get(f"{gateway.http_url}/echo/{marker}", headers={
                "Host": mine["origin"].split("//")[1], **headers}) as response:
            assert response.status == 403
            message = (await response.json())["message"]
        assert f'"{second["name"]}"' in message and theirs["origin"] in message
        assert theirs["proxy_token"] not in message
    async with client.get(f"{gateway.http_url}/echo/{marker}", headers={
            "Host": mine["origin"].split("//")[1], "Authorization": theirs["proxy_token"],
            "Accept": "text/html,application/xhtml+xml"}) as response:
        assert response.status == 403 and response.content_type == "text/html"
        page = await response.text()
    assert "<h1>Wrong address for this app</h1>" in page and f'href="{theirs["origin"]}/"' in page
    async with client.get(f"{api.target}/seen") as response:
        assert not [p for p in await response.json() if marker in p]
    await api.session(theirs["session_id"], has_event("e", "the address of another connection"))
    # a path link opened on the wrong address goes on to its own (nothing is set on the wrong one)
    async with client.get(f"{gateway.http_url}/{theirs['proxy_token']}/x?y=1", allow_redirects=False,
                          headers={"Host": mine["origin"].split("//")[1]}) as response:
        assert response.status == 302 and "Set-Cookie" not in response.headers
        assert response.headers["Location"] == f"{theirs['origin']}/{theirs['proxy_token']}/x?y=1"
    # and on its own address the credential works as a header too
    async with client.get(f"{gateway.http_url}/json", headers={
            "Host": mine["origin"].split("//")[1], "Authorization": mine["proxy_token"]}) as response:
        assert response.status == 200


async def test_behind_https_the_credential_cookie_is_secure_and_the_addresses_say_https(tmp_path_factory, target,
                                                                                         client):
    """With ``http.public_scheme = "https"`` (a TLS-terminating proxy in front of the listener) the credential cookie
    is ``Secure`` (it had no such flag: a browser sent it over plain http to the same host too), still HttpOnly and
    SameSite=Lax; the access hint, the redirects to an app's own address and ``X-Forwarded-Proto`` say https."""
    daemon = proxy_daemon(tmp_path_factory, "httpsecure", "http", {"http.public_scheme": "https"}, wait=True)
    try:
        async with admin_http(daemon) as http:
            api = HttpApi(daemon, http, target)
            access = await api.access(await api.role())
        secret, origin, port = access["proxy_token"], access["origin"], daemon.proxy_port
        assert origin.startswith("https://web-") and origin.endswith(f".localhost:{port}") and \
            access["url"] == f"{origin}/{secret}/", access
        listener, own_host = f"http://127.0.0.1:{port}", origin.split("//")[1]
        async with client.get(f"{listener}/{secret}/echo/x", allow_redirects=False) as response:
            assert response.status == 302 and response.headers["Location"] == f"{origin}/{secret}/echo/x"
        async with client.get(f"{listener}/{secret}/echo/x", allow_redirects=False,
                              headers={"Host": own_host}) as response:
            assert response.status == 302 and response.headers["Location"] == "/echo/x"
            cookie = response.headers["Set-Cookie"]
        attributes = [part.strip() for part in cookie.split(";")[1:]]
        assert {"Secure", "HttpOnly", "SameSite=Lax", "Path=/"} <= set(attributes), cookie
        async with client.get(f"{listener}/echo/y", headers={"Host": own_host,
                                                             "Cookie": f"gatewayd_proxy_token={secret}"}) as response:
            assert response.status == 200
            seen = await response.json()
        assert header_value(seen["headers"], "X-Forwarded-Proto") == ["https"]
    finally:
        assert daemon.stop() == 0


async def test_wrong_missing_and_expired_credentials(api, gateway, client, target):
    bogus = "httpproxy-" + "A" * 43
    for headers in ({"Authorization": bogus}, {"Cookie": f"gatewayd_proxy_token={bogus}"}, {}):
        async with client.get(f"{gateway.http_url}/json", headers=headers) as response:
            assert response.status == 401
            body = await response.json()
        assert "unknown secret" in body["message"] or "missing credential" in body["message"]
    async with client.get(f"{gateway.http_url}/{bogus}/json", allow_redirects=False) as response:
        assert response.status == 401 and "Set-Cookie" not in response.headers
    # a postgres credential is not an http one
    status, pg = await api("POST", "/connections", {"name": f"pg-{uuid.uuid4().hex[:6]}", "type": "database",
                                                    "subtype": "postgres", "secret": {}})
    assert status == 201
    status, issued = await api("POST", f"/connections/{pg['name']}/credentials", {"access_duration_seconds": 60})
    async with client.get(f"{gateway.http_url}/json",
                          headers={"Authorization": issued["connection_credentials"]["username"]}) as response:
        assert response.status == 401
    connection = await api.role()
    secret, session_id = await api.credential(connection, seconds=2)
    async with client.get(f"{gateway.http_url}/json", headers={"Authorization": secret}) as response:
        assert response.status == 200
    await api.session(session_id, lambda s: s["status"] == "done", timeout=15)
    async with client.get(f"{gateway.http_url}/json", headers={"Authorization": secret}) as response:
        assert response.status == 401
        assert "expired" in (await response.json())["message"]
    failures = [e for e in await api.audit("httpproxy.login") if e["outcome"] == "failure"]
    assert any("expired" in e["error_message"] for e in failures)
    assert any("unknown secret" in e["error_message"] for e in failures)


async def test_killed_session_refuses_and_cuts_streams(api, gateway, client, target):
    connection = await api.role()
    secret, session_id = await api.credential(connection)
    headers = {"Authorization": secret}
    async with client.get(f"{gateway.http_url}/sse-hold", headers=headers) as stream:
        assert await asyncio.wait_for(stream.content.readline(), 10) == b"data: first\n"
        status, body = await api("POST", f"/sessions/{session_id}/kill")
        assert status == 200, body
        with pytest.raises((aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError)):
            await asyncio.wait_for(stream.content.read(), 10)
    async with client.get(f"{target}/release") as response:
        assert response.status == 200
    async with client.get(f"{gateway.http_url}/json", headers=headers) as response:
        assert response.status == 401
        assert "session was closed" in (await response.json())["message"]
    session = await api.session(session_id, lambda s: s["status"] == "done")
    assert session["exit_code"] == 254
    assert any(k == "e" and "session killed by admin@example.com" in t for k, t in events(session))
    # the refusal of the still-valid credential is audited like any failed login (AccessService.refused)
    refusals = [e for e in await api.audit("httpproxy.login") if e["outcome"] == "failure"
                and e["request_payload_redacted"]["connection"] == connection["name"]]
    assert refusals and all("session was closed" in e["error_message"] for e in refusals)
    assert refusals[0]["actor_email"] == "admin@example.com"
    assert refusals[0]["request_payload_redacted"]["credential_id"]


# --------------------------------------------------------------------------- relaying


async def test_redirects_stay_on_the_gateway(api, gateway, client, target):
    connection = await api.role()
    secret, _ = await api.credential(connection)
    headers = {"Authorization": secret}
    cases = {f"{target}/json?a=1": f"{gateway.http_url}/json?a=1", "/json": "/json",
             "https://example.com/x": "https://example.com/x"}
    for to, expected in cases.items():
        async with client.get(f"{gateway.http_url}/redirect", params={"to": to}, headers=headers,
                              allow_redirects=False) as response:
            assert response.status == 302
            assert response.headers["Location"] == expected
    # under a base path: the prefix is added on the way in and removed from redirects
    based = await api.role(f"{target}/echo")
    secret, _ = await api.credential(based)
    async with client.get(f"{gateway.http_url}/sub?k=v", headers={"Authorization": secret}) as response:
        seen = await response.json()
    assert seen["path"] == "/echo/sub" and seen["query"] == "k=v"


async def test_link_headers_stay_on_the_gateway(api, gateway, client, target):
    connection = await api.role()
    secret, _ = await api.credential(connection)
    async with client.get(f"{gateway.http_url}/links", headers={"Authorization": secret}) as response:
        assert response.status == 200
        link = response.headers["Link"]
    assert link == (f'<{gateway.http_url}/style.css>; rel=preload; as=style, </next?p=2>; rel="next", '
                    f'<https://cdn.example/x.js>; rel=preload; title="a, <b>"')
    assert target.split("//")[1] not in link


@pytest.fixture(scope="module")
def datasette(tmp_path_factory):
    """datasette (a real web app) serving a small SQLite file: its pages send ``Link: http://127.0.0.1:PORT/...``
    without the brackets RFC 8288 asks for."""
    program = Path(sys.executable).parent / "datasette"
    if not program.exists():
        pytest.skip("datasette is not installed (pip install -e '.[test]')")
    folder = tmp_path_factory.mktemp("datasette")
    import sqlite3

    with sqlite3.connect(folder / "fixtures.db") as db:
        db.execute("create table facts (id integer primary key, fact text)")
        db.execute("insert into facts (fact) values ('the gateway keeps its targets to itself')")
    for attempt in range(3):
        port = free_port()
        process = subprocess.Popen([str(program), "serve", str(folder / "fixtures.db"), "-h", "127.0.0.1", "-p",
                                    str(port)], cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_port(port, process, "datasette")
            break
        except RuntimeError:
            process.kill()
            process.wait(10)
    else:
        raise RuntimeError("datasette did not start")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(10)


async def test_no_header_of_a_real_app_names_the_target(api, gateway, client, datasette):
    """Issue 31, item 10: with the credential sent as Authorization, datasette's Link header (no brackets) reached
    the client with the target's own address in it."""
    connection = await api.role(datasette)
    secret, _ = await api.credential(connection)
    address = datasette.split("//")[1]
    async with aiohttp.ClientSession() as direct:  # what datasette itself sends
        async with direct.get(f"{datasette}/fixtures/facts") as response:
            assert address in response.headers["Link"] and not response.headers["Link"].startswith("<")
    for path in ("/fixtures/facts", "/fixtures", "/fixtures/facts/1", "/fixtures/facts.json", "/-/versions"):
        async with client.get(f"{gateway.http_url}{path}", headers={"Authorization": f"Bearer {secret}"},
                              allow_redirects=False) as response:
            assert response.status < 400, (path, response.status)
            heads = [f"{k.decode('latin-1')}: {v.decode('latin-1')}" for k, v in response.raw_headers]
            assert not [h for h in heads if address in h], (path, heads)
            if path == "/fixtures/facts":
                assert response.headers["Link"].startswith(f"{gateway.http_url}/fixtures/facts.json;"), heads


async def test_websocket_echo_both_ways(api, gateway, client):
    connection = await api.role()
    secret, session_id = await api.credential(connection)
    async with client.ws_connect(f"{gateway.http_url}/ws", headers={"Authorization": secret},
                                 protocols=("chat",)) as ws:
        assert ws.protocol == "chat"
        await ws.send_str("hello")
        assert (await ws.receive_str(timeout=10)) == "echo: hello"
        await ws.send_bytes(b"\x01\x02\x03")
        assert (await ws.receive_bytes(timeout=10)) == b"\x03\x02\x01"
    session = await api.session(session_id, has_event("o", "echo: hello"))
    recorded = events(session)
    assert ("i", "hello") in recorded and ("o", "echo: hello") in recorded


async def test_websocket_messages_are_recorded_up_to_record_body_bytes(api, gateway, client):
    """Each message is recorded as a body is, cut at ``http.record_body_bytes`` (4096 here) with the same note (before,
    whole: a few 16 MiB messages filled the recording's cap); the rules still read it whole."""
    connection = await api.role()
    secret, session_id = await api.credential(connection)
    await api.guardrail(connection, input_rules=[{"type": "deny_words_list", "words": ["rm -rf"]}])
    text = "x" * 9000 + " tail-of-text"
    async with client.ws_connect(f"{gateway.http_url}/ws", headers={"Authorization": secret}) as ws:
        await ws.send_str(text)
        assert (await ws.receive_str(timeout=10)) == "echo: " + text  # sent whole
        await ws.send_bytes(b"\x00\x01" * 5000)
        assert (await ws.receive_bytes(timeout=10)) == b"\x01\x00" * 5000
        await ws.send_str("y" * 9000 + " rm -rf /")  # read whole by the rules, past what is recorded
        message = await ws.receive(timeout=10)
        assert message.type == aiohttp.WSMsgType.CLOSE and message.data == 1008
    session = await api.session(session_id, has_event("e", "words=[rm -rf]"))
    recorded = [(kind, text) for kind, text in events(session) if kind in "io" and not text.startswith("GET ")
                and not text.startswith("HTTP/")]
    assert [kind for kind, _ in recorded] == ["i", "o", "i", "o", "i"], recorded
    notes = ["[body: 4096 of 9013 bytes recorded]", "[body: 4096 of 9019 bytes recorded]",
             "[body: 4096 of 10000 bytes recorded]", "[body: 4096 of 10000 bytes recorded]",
             "[body: 4096 of 9009 bytes recorded]"]
    for (kind, data), note in zip(recorded, notes):
        assert len(data) < 4096 + 200 and data.endswith(note), (kind, data[-80:])
    assert "tail-of-text" not in json.dumps(recorded)


async def test_server_sent_events_stream_as_they_come(api, gateway, client, target):
    connection = await api.role()
    secret, _ = await api.credential(connection)
    async with client.get(f"{gateway.http_url}/sse-hold", headers={"Authorization": secret}) as stream:
        assert stream.headers["Content-Type"] == "text/event-stream"
        # the first event arrives while the target still holds the response open: nothing is buffered
        assert await asyncio.wait_for(stream.content.readline(), 10) == b"data: first\n"
        async with client.get(f"{target}/release") as response:
            assert response.status == 200
        assert (await asyncio.wait_for(stream.content.read(), 10)) == b"\ndata: second\n\n"
    async with client.get(f"{gateway.http_url}/sse?n=50", headers={"Authorization": secret}) as stream:
        text = await stream.text()
    assert text.count("data: event") == 50


async def test_compressed_bodies_pass_as_they_are(api, gateway, client):
    import gzip

    connection = await api.role()
    secret, _ = await api.credential(connection)
    packed = gzip.compress(b"squeeze me " * 100)
    async with client.post(f"{gateway.http_url}/upload", data=packed,
                           headers={"Authorization": secret, "Content-Encoding": "gzip"}) as response:
        assert (await response.json())["sha256"] == hashlib.sha256(packed).hexdigest()


# --------------------------------------------------------------------------- big transfers


def _peak_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


class RssSampler:
    """Samples a process's resident memory while a transfer runs (VmRSS, every 50 ms)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak_kb = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    self.peak_kb = max(self.peak_kb, int(line.split()[1]))
            self._stop.wait(0.05)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def test_200mb_download_and_upload_with_curl_in_bounded_memory(api, gateway, tmp_path):
    connection = await api.role()
    secret, session_id = await api.credential(connection)
    pid = gateway.process.pid
    with RssSampler(pid) as sampler:
        for chunked in ("", "&chunked=1"):
            done = await asyncio.to_thread(curl, "-H", f"Authorization: {secret}", "-o", "-",
                                           f"{gateway.http_url}/download?size={BIG}{chunked}")
            assert done.returncode == 0, done.stderr
            assert len(done.stdout) == BIG
            assert hashlib.sha256(done.stdout).hexdigest() == pattern_sha256(BIG)
            del done

        def upload() -> dict:
            # curl reads stdin and sends it chunked: the gateway cannot know the size in advance
            process = subprocess.Popen(["curl", "-sS", "-T", "-", "-H", f"Authorization: {secret}",
                                        f"{gateway.http_url}/upload"],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            assert process.stdin is not None
            for _ in range(BIG // len(BLOCK)):
                process.stdin.write(BLOCK)
            process.stdin.close()
            out, err = process.stdout.read(), process.stderr.read()  # type: ignore[union-attr]
            assert process.wait(60) == 0, err
            return json.loads(out)

        answer = await asyncio.to_thread(upload)
    assert answer == {"sha256": pattern_sha256(BIG), "size": BIG, "chunked": True}
    print(f"gateway RSS during 3 x {BIG >> 20} MB transfers: peak {sampler.peak_kb} kB")
    assert sampler.peak_kb < MEMORY_BOUND_KB, f"gateway RSS reached {sampler.peak_kb} kB"
    assert _peak_kb(pid) < MEMORY_BOUND_KB
    session = await api.session(session_id, has_event("o", '"chunked": true'))
    recorded = events(session)
    download = next(t for k, t in recorded if k == "o" and "application/octet-stream" in t)
    assert f"[body: 4096 of {BIG} bytes recorded]" in download
    uploaded = next(t for k, t in recorded if k == "i" and t.startswith("PUT /upload"))
    assert "[body: 4096 of a size not known yet (streamed) recorded]" in uploaded


# --------------------------------------------------------------------------- guard rails


async def test_input_guard_rails_block_before_the_target(api, gateway, client, target):
    connection = await api.role()
    secret, session_id = await api.credential(connection)
    await api.guardrail(connection, input_rules=[{"type": "deny_words_list", "words": ["drop table"]},
                                                 {"type": "pattern_match", "pattern_regex": r"ssn=\d{3}"}])
    marker = uuid.uuid4().hex
    headers = {"Authorization": secret}
    async with client.get(f"{gateway.http_url}/echo/{marker}?ssn=123", headers=headers) as response:
        assert response.status == 403
        assert response.headers["X-Gateway-Guardrails"] == "blocked"
        assert "pattern=ssn=\\d{3}" in (await response.json())["message"]
    async with client.post(f"{gateway.http_url}/echo/{marker}", json={"q": "DROP   TABLE users"},
                           headers=headers) as response:
        assert response.status == 403
        assert (await response.json())["message"].endswith("words=[drop table]")
    async with client.get(f"{gateway.http_url}/echo/{marker}/fine", headers=headers) as response:
        assert response.status == 200
    async with client.get(f"{target}/seen") as response:
        seen = [p for p in await response.json() if marker in p]
    assert seen == [f"/echo/{marker}/fine"]  # the blocked requests never reached the target
    session = await api.session(session_id, has_event("e", "words=[drop table]"))
    assert session["status"] == "open"
    blocks = await api.audit("guardrail.block")
    assert any(b["request_payload_redacted"]["session_id"] == session_id for b in blocks)


async def test_output_guard_rails_block_text_responses(api, gateway, client):
    connection = await api.role()
    secret, session_id = await api.credential(connection)
    await api.guardrail(connection, output_rules=[{"type": "deny_words_list", "words": ["top secret"]}])
    headers = {"Authorization": secret}
    async with client.get(f"{gateway.http_url}/text", params={"say": "this is TOP SECRET"},
                          headers=headers) as response:
        assert response.status == 403
        assert response.headers["X-Gateway-Guardrails"] == "blocked"
        assert "top secret" in (await response.json())["message"]
    async with client.get(f"{gateway.http_url}/text", params={"say": "harmless"}, headers=headers) as response:
        assert response.status == 200 and await response.text() == "harmless"
    # binary bodies are not text: they pass (the rule would match the bytes otherwise)
    async with client.get(f"{gateway.http_url}/download?size=1000", headers=headers) as response:
        assert response.status == 200
    await api.session(session_id, has_event("e", "words=[top secret]"))


# --------------------------------------------------------------------------- failures


async def test_target_down_is_a_502_and_an_error_event(api, gateway, client):
    connection = await api.role(f"http://user:hunter2@127.0.0.1:{free_port()}")
    secret, session_id = await api.credential(connection)
    async with client.get(f"{gateway.http_url}/json", headers={"Authorization": secret}) as response:
        assert response.status == 502
        message = (await response.json())["message"]
    assert message == f'could not connect to the target of connection "{connection["name"]}": connection refused'
    assert "hunter2" not in message
    session = await api.session(session_id, has_event("e", "could not connect to the target"))
    assert "hunter2" not in json.dumps(events(session))
    # a REMOTE_URL the gateway cannot use
    broken = await api.role("ftp://files.internal/")
    secret, session_id = await api.credential(broken)
    async with client.get(f"{gateway.http_url}/json", headers={"Authorization": secret}) as response:
        assert response.status == 502
        assert "misconfigured" in (await response.json())["message"]
    await api.session(session_id, lambda s: s["status"] == "done" and has_event("e", "REMOTE_URL")(s))
    # the gateway keeps serving others
    other = await api.role()
    secret, _ = await api.credential(other)
    async with client.get(f"{gateway.http_url}/json", headers={"Authorization": secret}) as response:
        assert response.status == 200


async def test_a_shutting_down_gateway_answers_503_and_claims_no_session(tmp_path, client):
    """A listener on an in-process core (it needs only its ProxyContext): no session is opened while it closes."""
    config = load_config(None, environ={}, overrides={"data_dir": str(tmp_path / "data")})
    core = Gateway(config)
    await core.open_core()
    await core.recording.start()
    port = free_port()
    listener = await start_http(core.proxy_context("http"), "127.0.0.1", port)  # nothing else of the daemon
    try:
        org = await core.store.default_org()
        user = await core.identity.ensure_local_user("ann@example.com", "Ann", ["admin"])
        connection = Connection(id=new_id(), org_id=org.id, name="web", resource_name="web", type="httpproxy",
                                subtype="httpproxy", secret={"envvar:REMOTE_URL": b64(f"http://127.0.0.1:{free_port()}")},
                                created_at=rfc3339(utcnow()), updated_at=rfc3339(utcnow()))
        await core.store.create_connection(connection)
        issued = await core.access.issue(user, connection, 600)
        await core.sessions.shutdown(0)
        async with client.get(f"http://127.0.0.1:{port}/json", headers={"Authorization": issued.secret}) as response:
            assert response.status == 503
            assert "shutting down" in (await response.json())["message"]
        session = await core.store.get_session(issued.credential.session_id)
        assert session.status == "ready"
    finally:
        await listener.close()
        await core.recording.stop()
        await core.close_core()


async def test_listener_stops_and_starts_live(api, gateway, client):
    before = await api.role()
    kept_secret, kept_session = await api.credential(before)
    async with client.get(f"{gateway.http_url}/echo/before", headers={"Authorization": kept_secret}) as response:
        assert response.status == 200
    status, document = await api("GET", "/serverconfig/misc")
    assert status == 200
    address = document["http_proxy_server_config"]["listen_address"]
    document["http_proxy_server_config"]["listen_address"] = ""
    status, body = await api("PUT", "/serverconfig/misc", document)
    assert status == 200, body
    with pytest.raises(aiohttp.ClientConnectorError):
        async with client.get(f"{gateway.http_url}/json"):
            pass
    document["http_proxy_server_config"]["listen_address"] = address
    status, body = await api("PUT", "/serverconfig/misc", document)
    assert status == 200, body
    connection = await api.role()
    secret, _ = await api.credential(connection)
    async with client.get(f"{gateway.http_url}/json", headers={"Authorization": secret}) as response:
        assert response.status == 200
    # a credential in use before the restart goes on recording into its one session
    async with client.get(f"{gateway.http_url}/echo/after", headers={"Authorization": kept_secret}) as response:
        assert response.status == 200
    session = await api.session(kept_session, has_event("i", "GET /echo/after"))
    assert session["status"] == "open" and has_event("i", "GET /echo/before")(session)


async def test_a_kill_after_a_listener_restart_still_ends_the_credential(api, gateway, client):
    """The restarted listener takes over the live session: a kill reaches it, and the credential is refused."""
    connection = await api.role()
    secret, session_id = await api.credential(connection)
    headers = {"Authorization": secret}
    async with client.get(f"{gateway.http_url}/echo/before", headers=headers) as response:
        assert response.status == 200
    status, document = await api("GET", "/serverconfig/misc")
    address = document["http_proxy_server_config"]["listen_address"]
    for listen in ("", address):  # stopped, then started again
        document["http_proxy_server_config"]["listen_address"] = listen
        status, body = await api("PUT", "/serverconfig/misc", document)
        assert status == 200, body
    async with client.get(f"{gateway.http_url}/echo/after", headers=headers) as response:
        assert response.status == 200
    status, body = await api("POST", f"/sessions/{session_id}/kill")
    assert status == 200, body
    async with client.get(f"{gateway.http_url}/echo/killed", headers=headers) as response:
        assert response.status == 401
        assert "session killed by admin@example.com" in (await response.json())["message"]
    session = await api.session(session_id, lambda s: s["status"] == "done")
    assert not has_event("i", "/echo/killed")(session)


async def test_raw_targets_eof_bodies_and_silently_closed_connections(api, gateway, client):
    """A target that ends bodies by closing, or closes a kept-alive connection without saying so."""
    served: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        served.append(head)
        if head.startswith(b"GET /eof"):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nbody until the end")
        elif head.startswith(b"GET /odd"):  # a Latin-1 header byte on an answer that streams (no length)
            writer.write(b"HTTP/1.1 200 OK\r\nX-Odd: caf\xe9\r\n\r\nstreamed")
        else:  # keep-alive by the look of it, then gone
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        connection = await api.role(f"http://127.0.0.1:{port}")
        secret, _ = await api.credential(connection)
        headers = {"Authorization": secret}
        async with client.get(f"{gateway.http_url}/eof", headers=headers) as response:
            assert response.status == 200 and await response.text() == "body until the end"
        for _ in range(5):
            async with client.get(f"{gateway.http_url}/again", headers=headers) as response:
                assert response.status == 200 and await response.text() == "ok"
        assert len(served) == 6
        assert served[0].startswith(b"GET /eof HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n" % port)
        async with client.get(f"{gateway.http_url}/odd", headers=headers) as response:
            assert response.status == 200 and await response.read() == b"streamed"
            assert (b"X-Odd", b"caf\xe9") in response.raw_headers  # passed on as sent, not dropped
    finally:
        server.close()


GUARD_BYTES = 65536  # the gateway fixture's http.guard_body_bytes


async def test_guard_rails_read_a_bounded_prefix_of_long_text_bodies(api, gateway, client, target):
    """Rules read the first http.guard_body_bytes of a text body; beyond, it streams unchecked (documented)."""
    connection = await api.role()
    secret, session_id = await api.credential(connection)
    await api.guardrail(connection, input_rules=[{"type": "deny_words_list", "words": ["forbidden"]}],
                        output_rules=[{"type": "deny_words_list", "words": ["classified"]}])
    headers = {"Authorization": secret, "Content-Type": "text/plain"}

    async def upload(at: int) -> int:
        async def body():
            data = b"." * at + b"forbidden" + b"." * 100_000
            for start in range(0, len(data), 10_000):  # a chunked, streamed upload
                yield data[start:start + 10_000]

        async with client.post(f"{gateway.http_url}/upload", data=body(), headers=headers) as response:
            return response.status

    assert await upload(GUARD_BYTES - 20_000) == 403
    assert await upload(GUARD_BYTES + 20_000) == 200
    for at, expected in ((40_000, 403), (GUARD_BYTES + 300_000, 200)):
        async with client.get(f"{gateway.http_url}/big-text",
                              params={"size": "400000", "needle": "classified", "at": str(at)},
                              headers={"Authorization": secret}) as response:
            assert response.status == expected
            if expected == 200:
                assert len(await response.read()) == 400_000
    # a binary body is not text the rules read: under input rules it is refused, not forwarded unread
    async with client.post(f"{gateway.http_url}/upload", data=b"harmless",
                           headers={"Authorization": secret, "Content-Type": "application/octet-stream"}) as response:
        assert response.status == 403


async def test_websocket_messages_go_through_guard_rails(api, gateway, client):
    connection = await api.role()
    secret, session_id = await api.credential(connection)
    await api.guardrail(connection, input_rules=[{"type": "deny_words_list", "words": ["rm -rf"]}])
    async with client.ws_connect(f"{gateway.http_url}/ws", headers={"Authorization": secret}) as ws:
        await ws.send_str("ls")
        assert (await ws.receive_str(timeout=10)) == "echo: ls"
        await ws.send_str("rm   -rf /")
        message = await ws.receive(timeout=10)
        assert message.type == aiohttp.WSMsgType.CLOSE and message.data == 1008
        assert "rm -rf" in message.extra
    session = await api.session(session_id, has_event("e", "words=[rm -rf]"))
    recorded = events(session)
    blocked = recorded.index(("i", "rm   -rf /"))  # the blocked message is on the record, then its block
    assert recorded[blocked + 1][0] == "e" and recorded[blocked + 1][1].endswith("words=[rm -rf]")


async def test_websocket_input_rules_read_a_match_over_several_messages(api, gateway, client):
    """A web terminal sends each keystroke as a message of its own: input rules read each message with the end of
    the ones before (before, each was read alone, and ``rm -rf /`` typed key by key reached the target)."""
    connection = await api.role()
    secret, session_id = await api.credential(connection)
    await api.guardrail(connection, input_rules=[{"type": "deny_words_list", "words": ["rm -rf"]}])
    async with client.ws_connect(f"{gateway.http_url}/ws", headers={"Authorization": secret}) as ws:
        for key in "ls\rrm -r":
            await ws.send_str(key)
            assert (await ws.receive_str(timeout=10)) == f"echo: {key}"
        await ws.send_str("f")
        message = await ws.receive(timeout=10)
        assert message.type == aiohttp.WSMsgType.CLOSE and message.data == 1008, message
    session = await api.session(session_id, has_event("e", "words=[rm -rf]"))
    recorded = events(session)
    assert recorded[recorded.index(("i", "f")) + 1][0] == "e"


async def test_a_rule_attached_while_a_websocket_is_open_applies_to_its_next_message(api, gateway, client):
    """A websocket's messages are read by the rules of the moment, as requests are (before, by those of its upgrade
    request: a web terminal opened before a rule was attached went on unchecked and unmasked for as long as it
    stayed open)."""
    connection = await api.role()
    secret, session_id = await api.credential(connection)
    async with client.ws_connect(f"{gateway.http_url}/ws", headers={"Authorization": secret}) as ws:
        await ws.send_str("4111 1111 1111 1111 rm -rf /")
        assert (await ws.receive_str(timeout=10)) == "echo: 4111 1111 1111 1111 rm -rf /"
        await api.guardrail(connection, input_rules=[{"type": "deny_words_list", "words": ["rm -rf"]}],
                            output_rules=[{"type": "mask", "patterns": ["card_number"]}])
        await ws.send_str("4111 1111 1111 1111")
        assert (await ws.receive_str(timeout=10)) == "echo: ****"
        await ws.send_str("rm -rf /")
        message = await ws.receive(timeout=10)
        assert message.type == aiohttp.WSMsgType.CLOSE and message.data == 1008, message
    await api.session(session_id, has_event("e", "words=[rm -rf]"))


async def test_binary_websocket_messages_are_read_as_text_or_refused(api, gateway, client):
    """A binary message is read as a text message is when it is UTF-8, and under input rules one that is not is
    refused, never forwarded unread (before, binary frames passed every rule: ``rm -rf /`` sent as one reached
    the target, and the target's card number in one passed a mask rule)."""
    connection = await api.role()
    secret, session_id = await api.credential(connection)
    await api.guardrail(connection, input_rules=[{"type": "deny_words_list", "words": ["rm -rf"]}],
                        output_rules=[{"type": "mask", "patterns": ["card_number"]}])
    card = "4111 1111 1111 1111"
    for sent, why in ((b"rm -rf /", "words=[rm -rf]"), (b"\xff\x00\x01", "not UTF-8 text")):
        async with client.ws_connect(f"{gateway.http_url}/ws", headers={"Authorization": secret}) as ws:
            await ws.send_bytes(card[::-1].encode())  # the target sends it back reversed: the card number
            assert (await ws.receive_bytes(timeout=10)) == b"****"
            await ws.send_bytes(sent)
            message = await ws.receive(timeout=10)
            assert message.type == aiohttp.WSMsgType.CLOSE and message.data == 1008, message
        await api.session(session_id, has_event("e", why))
    recorded = events(await api.session(session_id))
    for sent in ("rm -rf /", "\ufffd\x00\x01"):  # each refused message on the record, then its block
        assert recorded[recorded.index(("i", sent)) + 1][0] == "e"
    assert not [t for _, t in recorded if card in t], recorded
    blocks = [b for b in await api.audit("guardrail.block") if b["request_payload_redacted"]["session_id"] == session_id]
    assert len(blocks) == 2


async def test_a_binary_websocket_message_of_the_target_that_is_not_text_is_withheld_under_a_mask(api, gateway,
                                                                                                 client):
    """The target's binary message that is not UTF-8 cannot be read by a mask rule: withheld, the websocket closed
    with 1008 and an ``e`` event (before, it passed unread: a card number followed by one byte that is not UTF-8
    reached the client, and the recording, in clear)."""
    connection = await api.role()
    secret, session_id = await api.credential(connection)
    await api.guardrail(connection, output_rules=[{"type": "mask", "patterns": ["card_number"]}])
    card = b"4111 1111 1111 1111"
    async with client.ws_connect(f"{gateway.http_url}/ws", headers={"Authorization": secret}) as ws:
        await ws.send_bytes((card + b" \xff")[::-1])  # the target sends it back reversed: the card, then \xff
        message = await ws.receive(timeout=10)
        assert message.type == aiohttp.WSMsgType.CLOSE and message.data == 1008, message
    await api.session(session_id, has_event("e", "not UTF-8 text"))
    assert not [t for _, t in events(await api.session(session_id)) if "4111 1111" in t]


async def test_a_websocket_message_over_the_limit_closes_it_with_1009(api, gateway, client):
    """A message is read whole, inflated when compressed: one over ``http.websocket_message_bytes`` (16 MiB by
    default) closes the websocket with 1009 and an ``e`` event (before, there was no bound: 64 KiB on the wire,
    compressed, made the worker hold 64 MiB, and a few of them ran it out of memory with every session on it)."""
    connection = await api.role()
    secret, session_id = await api.credential(connection)
    async with client.ws_connect(f"{gateway.http_url}/ws", headers={"Authorization": secret}, compress=15) as ws:
        await ws.send_bytes(b"\x01" * 1024 * 1024, compress=15)  # under the limit: relayed
        assert (await ws.receive_bytes(timeout=30)) == b"\x01" * 1024 * 1024
        await ws.send_bytes(b"\x00" * 64 * 1024 * 1024, compress=15)
        message = await ws.receive(timeout=30)
        assert message.type == aiohttp.WSMsgType.CLOSE and message.data == 1009, message
    await api.session(session_id, has_event("e", "over http.websocket_message_bytes"))


async def test_dot_segments_cannot_leave_the_base_path(api, gateway, client, target):
    connection = await api.role(f"{target}/echo")
    secret, _ = await api.credential(connection)
    marker = uuid.uuid4().hex
    for path in ("/../json", "/a/../../json", "/%2e%2e/json", "/a/%2E%2E/%2e%2e/json", "/..;/json",
                 "/%2e%2e;/json", "/%252e%252e/json", "/..%00/json", "/.%2e/json", "/a/./json"):
        done = await asyncio.to_thread(curl, "--path-as-is", "-o", "/dev/null", "-w", "%{http_code}",
                                       "-H", f"Authorization: {secret}", f"{gateway.http_url}{path}?m={marker}")
        assert done.stdout == b"400", path
    async with client.get(f"{target}/seen") as response:
        assert not [p for p in await response.json() if marker in p]  # none of them reached the target


async def test_a_revoked_credential_is_refused_at_its_next_check(api, gateway, client):
    import sqlite3

    connection = await api.role()
    secret, session_id = await api.credential(connection)
    headers = {"Authorization": secret}
    async with client.get(f"{gateway.http_url}/json", headers=headers) as response:
        assert response.status == 200
    # revoked behind the proxy's back (as a review revocation does): the cached grant is re-checked
    with sqlite3.connect(gateway.data_dir / "gatewayd.db", timeout=10) as db:
        db.execute("UPDATE credentials SET revoked_at = ? WHERE secret_hash = ?",
                   ("2026-01-01T00:00:00.000000Z", hashlib.sha256(secret.encode()).hexdigest()))
    deadline = time.monotonic() + 15
    while True:
        async with client.get(f"{gateway.http_url}/json", headers=headers) as response:
            if response.status == 401:
                assert "revoked" in (await response.json())["message"]
                break
            assert response.status == 200
        assert time.monotonic() < deadline, "the revocation was never noticed"
        await asyncio.sleep(0.2)
    session = await api.session(session_id, lambda s: s["status"] == "done")
    assert any(k == "e" and "revoked" in t for k, t in events(session))


async def test_a_client_breaking_off_an_upload_is_recorded_and_others_go_on(api, gateway, client):
    connection = await api.role()
    secret, session_id = await api.credential(connection)
    host, port = gateway.http_url.split("//")[1].split(":")
    for sent in (1000, 200_000):  # inside the recorded prefix, and while streaming to the target
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"POST /upload HTTP/1.1\r\nHost: gw\r\nAuthorization: {secret}\r\n"
                     f"Content-Length: 1000000\r\n\r\n".encode() + b"x" * sent)
        await writer.drain()
        await asyncio.sleep(0.3)
        writer.close()
    await api.session(session_id, lambda s: sum(k == "e" and "broke off the request body" in t
                                                for k, t in events(s)) == 2)
    async with client.get(f"{gateway.http_url}/json", headers={"Authorization": secret}) as response:
        assert response.status == 200
    assert "Error handling request" not in gateway.log_text()


async def test_a_request_body_that_stalls_is_answered_and_recorded_at_the_idle_timeout(tmp_path_factory, target):
    """A client that sends part of its body and then nothing held the request (and its connection to the target)
    for as long as it liked: with ``http.idle_timeout`` it is answered 400 and the session records why -- inside
    the prefix the rules and the recording read, and while streaming the rest to the target."""
    daemon = proxy_daemon(tmp_path_factory, "httpidle", "http", {"http.idle_timeout": "2s",
                                                                 "http.record_body_bytes": 1024}, wait=True)
    try:
        async with admin_http(daemon) as http:
            api = HttpApi(daemon, http, target)
            secret, session_id = await api.credential(await api.role())
            for sent in (500, 200_000):
                reader, writer = await asyncio.open_connection("127.0.0.1", daemon.proxy_port)
                writer.write(f"POST /upload HTTP/1.1\r\nHost: gw\r\nAuthorization: {secret}\r\n"
                             f"Content-Length: 1000000\r\n\r\n".encode() + b"x" * sent)
                await writer.drain()
                answer = await asyncio.wait_for(reader.read(4096), 60)  # (before: never, while the socket stayed)
                writer.close()
                assert answer.startswith(b"HTTP/1.1 400") and b"http.idle_timeout" in answer, (sent, answer[:300])
            await api.session(session_id, lambda s: sum(k == "e" and "http.idle_timeout" in t
                                                        for k, t in events(s)) == 2)
    finally:
        assert daemon.stop() == 0


async def test_a_target_that_stalls_mid_answer_is_broken_off_at_the_target_idle_timeout(tmp_path_factory):
    """A target that sends its head and part of its body, then nothing, held the client and the connection for
    ever: with ``http.target_idle_timeout`` the answer is broken off (a streamed body ends early, a small one not
    yet begun is a 502), with an ``e`` event; an event stream may stay quiet longer (it is not bound)."""
    from aiohttp import web

    hold = asyncio.Event()  # set when the test ends: the target's stalled handlers return

    async def stall(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        if request.query.get("length"):
            response.content_length = int(request.query["length"])
        await response.prepare(request)
        await response.write(b"first part\n")
        await hold.wait()
        return response

    async def quiet_events(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: one\n\n")
        await asyncio.sleep(2.5)  # past the timeout: an event stream is quiet by design
        await response.write(b"data: two\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/stall", stall)
    app.router.add_get("/quiet-events", quiet_events)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    daemon = proxy_daemon(tmp_path_factory, "httpstall", "http", {"http.target_idle_timeout": "1s"}, wait=True)
    try:
        async with admin_http(daemon) as http, aiohttp.ClientSession() as client:
            api = HttpApi(daemon, http, f"http://127.0.0.1:{port}")
            secret, session_id = await api.credential(await api.role())
            url, headers = f"http://127.0.0.1:{daemon.proxy_port}", {"Authorization": secret}
            for query in ("", "?length=1000000"):  # chunked, and framed by its length
                async with client.get(f"{url}/stall{query}", headers=headers) as response:
                    assert response.status == 200
                    assert await asyncio.wait_for(response.content.readline(), 10) == b"first part\n"
                    with pytest.raises(aiohttp.ClientPayloadError):  # (before: waited for ever)
                        await asyncio.wait_for(response.content.read(), 30)
            async with client.get(f"{url}/stall?length=100", headers=headers) as response:  # a small one, whole
                assert response.status == 502, await response.text()
                assert "http.target_idle_timeout" in (await asyncio.wait_for(response.json(), 30))["message"]
            async with client.get(f"{url}/quiet-events", headers=headers) as response:
                assert await asyncio.wait_for(response.read(), 30) == b"data: one\n\ndata: two\n\n"
            session = await api.session(session_id, lambda s: sum(
                k == "e" and "no byte of its body for 1 s: http.target_idle_timeout" in t for k, t in events(s)) == 3)
            recorded = events(session)
            assert sum(k == "o" and "first part" in t and "[body: 11 of " in t for k, t in recorded) == 2, recorded
    finally:
        hold.set()
        assert daemon.stop() == 0
        await runner.cleanup()


async def test_https_targets_verified_unless_insecure(api, gateway, client, tmp_path):
    import ssl

    from aiohttp import web

    from proxies.postgres.tls import generate_self_signed

    generate_self_signed(tmp_path / "t.crt", tmp_path / "t.key", common_name="127.0.0.1")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tmp_path / "t.crt", tmp_path / "t.key")
    app = web.Application()

    async def hello(request: web.Request) -> web.Response:
        return web.json_response({"tls": request.secure, "forwarded": request.headers.get("X-Forwarded-Proto")})

    app.router.add_get("/hello", hello)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=context).start()
    try:
        url = f"https://127.0.0.1:{port}"
        status, insecure = await api("POST", "/connections", {
            "name": f"web-{uuid.uuid4().hex[:8]}", "type": "httpproxy", "subtype": "httpproxy",
            "secret": {"envvar:REMOTE_URL": b64(url), "envvar:INSECURE": b64("true")}})
        assert status == 201, insecure
        secret, _ = await api.credential(insecure)
        async with client.get(f"{gateway.http_url}/hello", headers={"Authorization": secret}) as response:
            assert response.status == 200
            assert await response.json() == {"tls": True, "forwarded": "http"}
        verified = await api.role(url)  # a self-signed certificate is refused without INSECURE
        secret, session_id = await api.credential(verified)
        async with client.get(f"{gateway.http_url}/hello", headers={"Authorization": secret}) as response:
            assert response.status == 502
            assert "certificate" in (await response.json())["message"].lower()
    finally:
        await runner.cleanup()


async def test_output_rules_cut_an_event_stream(api, gateway, client):
    connection = await api.role()
    secret, session_id = await api.credential(connection)
    await api.guardrail(connection, output_rules=[{"type": "pattern_match", "pattern_regex": r"event 2\b"}])
    received = b""
    async with client.get(f"{gateway.http_url}/sse?n=5", headers={"Authorization": secret}) as stream:
        assert stream.status == 200  # the head went out before the matching event arrived
        try:
            async for chunk in stream.content.iter_any():
                received += chunk
        except aiohttp.ClientPayloadError:
            pass
    assert b"event 2" not in received and b"event 4" not in received
    session = await api.session(session_id, has_event("e", "output blocked mid-stream"))
    assert any(k == "e" and "pattern=event 2" in t for k, t in events(session))


async def test_head_and_expect_continue_with_curl(api, gateway, tmp_path):
    """HEAD (the target app even sends a body after its head: dropped) and a curl upload that waits for 100."""
    connection = await api.role()
    secret, _ = await api.credential(connection)
    head = await asyncio.to_thread(curl, "-I", "-H", f"Authorization: {secret}",
                                   f"{gateway.http_url}/download?size=5000000")
    assert head.returncode == 0 and b"HTTP/1.1 200" in head.stdout
    assert b"Content-Length: 5000000" in head.stdout
    # curl asks "Expect: 100-continue" before a 2 MB body and waits for the gateway's go-ahead
    payload = tmp_path / "payload.bin"
    payload.write_bytes(BLOCK * 32)
    sent = await asyncio.to_thread(curl, "-v", "-H", f"Authorization: {secret}", "-H",
                                   "Content-Type: application/x-blob", "--data-binary", f"@{payload}",
                                   f"{gateway.http_url}/upload")
    assert b"Expect: 100-continue" in sent.stderr and b"HTTP/1.1 100 Continue" in sent.stderr
    assert json.loads(sent.stdout)["sha256"] == hashlib.sha256(BLOCK * 32).hexdigest()


# --------------------------------------------------------------------------- what output rules and masks read


class RawTarget:
    """A target answering each path with the bytes a test gave it (answers aiohttp would not send: a reason with
    data, two codings, a charset), in threads (curl blocks the test's loop); it keeps the request heads it read."""

    def __init__(self) -> None:
        self.answers: dict[str, bytes] = {}
        self.heads: list[bytes] = []
        outer = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                while True:  # keep-alive: the gateway pools its connections
                    head = b""
                    while not head.endswith(b"\r\n\r\n"):
                        line = self.rfile.readline()
                        if not line:
                            return
                        head += line
                    outer.heads.append(head)
                    path = head.split(b" ", 2)[1].decode().partition("?")[0]
                    self.wfile.write(outer.answers.get(path, b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"))

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def answer(self, status: str, headers: list[tuple[str, str]], body: bytes) -> str:
        """A fresh path answered ``HTTP/1.1 <status>``, these headers and ``body`` (with its length)."""
        path = f"/raw-{uuid.uuid4().hex[:8]}"
        lines = [f"HTTP/1.1 {status}"] + [f"{k}: {v}" for k, v in headers] + [f"Content-Length: {len(body)}"]
        self.answers[path] = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
        return path


@pytest.fixture(scope="module")
def raw_target():
    target = RawTarget()
    yield target
    target.server.shutdown()
    target.server.server_close()


PII = {"card": "4111 1111 1111 1111", "email": "jane.doe@example.com", "ssn": "078-05-1120"}
PII_RULE = {"type": "mask", "patterns": ["card_number", "email", "us_ssn"]}
DENY_TOP_SECRET = {"type": "deny_words_list", "words": ["top secret"]}


async def ruled(api: HttpApi, raw_target: RawTarget, *rules: dict) -> tuple[str, str]:
    """(secret, session id) of a credential to ``raw_target`` under these output rules."""
    connection = await api.role(raw_target.url)
    await api.guardrail(connection, output_rules=list(rules))
    return await api.credential(connection)


def fetched(gateway, secret: str, path: str, *args: str) -> tuple[str, bytes]:
    """curl through the gateway: the head as the client got it, and the body."""
    done = curl("-sS", "-D", "-", "-H", f"Authorization: {secret}", *args, f"{gateway.http_url}{path}")
    assert done.returncode == 0, done.stderr
    head, _, body = done.stdout.partition(b"\r\n\r\n")
    return head.decode("latin-1"), body


def clear_in(text: str) -> list[str]:
    return [value for value in PII.values() if value in text]


async def test_mask_rules_mask_the_status_line_and_every_header_and_output_rules_read_them(api, gateway,
                                                                                            raw_target):
    """The target names data in its reason phrase and headers: masked for the client and in the recording
    (before, they passed in clear); output rules read the head too (before, a denied word there passed)."""
    path = raw_target.answer(f"200 card {PII['card']}", [
        ("Content-Type", "application/json"), ("X-Card", PII["card"]), ("X-SSN", PII["ssn"]),
        ("Location", f"/profile?email={PII['email']}"), ("Set-Cookie", f"who={PII['email']}; Path=/")],
        b'{"ok": true}')
    secret, session_id = await ruled(api, raw_target, PII_RULE)
    head, body = fetched(gateway, secret, path)
    assert head.startswith("HTTP/1.1 200 card ****") and not clear_in(head), head
    assert "Location: /profile?email=****" in head and body == b'{"ok": true}'
    session = await api.session(session_id, has_event("o", "X-Card"))
    recorded = "\n".join(t for k, t in events(session) if k == "o")
    assert "X-Card: ****" in recorded and not clear_in(recorded), recorded

    noted = raw_target.answer("200 OK", [("Content-Type", "text/plain"), ("X-Note", "top secret")], b"fine")
    secret, session_id = await ruled(api, raw_target, DENY_TOP_SECRET)
    for _ in range(2):  # the second one on the fast path's memo of the first
        head, body = fetched(gateway, secret, noted)
        assert head.startswith("HTTP/1.1 403") and b"top secret" in body and "X-Note" not in head, head
    await api.session(session_id, has_event("e", "words=[top secret]"))


async def test_output_rules_and_masks_read_compressed_answers_decoded_or_withhold_them(api, gateway, raw_target):
    """Under output rules the target is asked for ``identity``, and what comes compressed anyway is decoded
    before it is read (before, a denied word in a gzip or deflate body passed unread); what cannot be decoded
    is withheld; every coding of every Content-Encoding header is undone (before, a body gzipped twice
    was decoded once and sent unlabelled, its card number in it)."""
    text = b"this is TOP SECRET material\n"
    secret, session_id = await ruled(api, raw_target, DENY_TOP_SECRET)
    for coding, packed in (("gzip", gzip.compress(text)), ("deflate", zlib.compress(text)),
                           ("gzip, gzip", gzip.compress(gzip.compress(text)))):
        path = raw_target.answer("200 OK", [("Content-Type", "text/plain"), ("Content-Encoding", coding)], packed)
        head, body = fetched(gateway, secret, path, "--compressed")
        assert head.startswith("HTTP/1.1 403") and b"TOP SECRET" not in body, (coding, head)
    assert b"accept-encoding: identity" in raw_target.heads[-1].lower()
    # nor in byte ranges, a piece of the denied words each, which no rule would read together
    path = raw_target.answer("200 OK", [("Content-Type", "text/plain")], text)
    head, body = fetched(gateway, secret, path, "-r", "8-13")
    assert head.startswith("HTTP/1.1 403") and b"range:" not in raw_target.heads[-1].lower(), head
    for coding, packed in (("br", b"\x0b\x02\x80fine\x03"), ("gzip", b"\x1f\x8b not gzip at all")):
        path = raw_target.answer("200 OK", [("Content-Type", "text/plain"), ("Content-Encoding", coding)], packed)
        head, body = fetched(gateway, secret, path)
        assert head.startswith("HTTP/1.1 502") and b"response withheld" in body, (coding, head)
    await api.session(session_id, has_event("e", "response withheld: a body in Content-Encoding 'br'"))
    assert any("response withheld" in (entry["error_message"] or "") for entry in await api.audit("guardrail.block"))

    secret, session_id = await ruled(api, raw_target, PII_RULE)
    twice = gzip.compress(gzip.compress(json.dumps({"card": PII["card"]}).encode()))
    path = raw_target.answer("200 OK", [("Content-Type", "application/json"), ("Content-Encoding", "gzip"),
                                        ("Content-Encoding", "gzip")], twice)
    head, body = fetched(gateway, secret, path)
    assert "content-encoding" not in head.lower() and json.loads(body) == {"card": "****"}, head


@pytest.mark.parametrize("content_type", [None, "application/x-javascript", "application/csv", "image/svg+xml",
                                          "application/jsonl", "application/x-json", "multipart/mixed; boundary=x"])
async def test_output_rules_and_masks_read_every_answer_but_a_known_binary_type(api, gateway, raw_target,
                                                                              content_type):
    """Only known binary types go unread (before, a body of a type not listed as text, or of none, passed a
    card number, an e-mail and a denied word)."""
    headers = [("Content-Type", content_type)] if content_type else []
    path = raw_target.answer("200 OK", headers, f"card {PII['card']} mail {PII['email']} top secret\n".encode())
    secret, _ = await ruled(api, raw_target, PII_RULE)
    _, body = fetched(gateway, secret, path)
    assert body == b"card **** mail **** top secret\n"
    secret, _ = await ruled(api, raw_target, DENY_TOP_SECRET)
    head, _ = fetched(gateway, secret, path)
    assert head.startswith("HTTP/1.1 403"), head
    png = raw_target.answer("200 OK", [("Content-Type", "image/png")], b"\x89PNG top secret")
    assert fetched(gateway, secret, png)[1] == b"\x89PNG top secret"  # binary: not read, as documented


async def test_a_rule_by_key_masks_json_lines_and_json_behind_an_xssi_prefix(api, gateway, raw_target):
    """A rule by key reads NDJSON / JSON lines line by line and JSON behind ``)]}',`` (before, each passed its
    ``ssn`` in clear); a body declared JSON that still does not parse is withheld (it could hold the key)."""
    secret, _ = await ruled(api, raw_target, {"type": "mask", "columns": ["ssn"]})
    lines = b'{"ssn": "secret-ssn-777", "n": 1}\n{"ssn": "secret-ssn-777", "n": 2}\n'
    for content_type in ("application/x-ndjson", "application/json"):
        path = raw_target.answer("200 OK", [("Content-Type", content_type)], lines)
        assert fetched(gateway, secret, path)[1] == b'{"ssn":"****","n":1}\n{"ssn":"****","n":2}\n'
    path = raw_target.answer("200 OK", [("Content-Type", "application/json")], b")]}',\n{\"ssn\": \"secret-ssn-777\"}")
    assert fetched(gateway, secret, path)[1] == b")]}',\n{\"ssn\":\"****\"}"
    path = raw_target.answer("200 OK", [("Content-Type", "application/json")], b"{'ssn': 'secret-ssn-777'}")
    head, body = fetched(gateway, secret, path)
    assert head.startswith("HTTP/1.1 502") and b"secret-ssn-777" not in body, head


async def test_a_rule_by_key_masks_a_json_event_spread_over_several_data_lines(api, gateway, raw_target):
    """An event's ``data:`` lines joined by "\\n" are one payload (the SSE spec): JSON pretty-printed over several
    lines is masked by key as a whole (before, each line was masked alone as text, none parsed, and the ``ssn``
    on a line of its own passed in clear); an event that is not JSON is masked as text."""
    pretty = json.dumps({"customer": {"name": "Jane", "ssn": "secret-ssn-777"}, "card": PII["card"]}, indent=2)
    stream = ("id: 7\r\n" + "".join(f"data: {line}\r\n" for line in pretty.split("\n")) + "\r\n"
              + f"event: note\ndata: paid with\ndata: {PII['card']}\n\ndata: [DONE]\n\n").encode()
    path = raw_target.answer("200 OK", [("Content-Type", "text/event-stream")], stream)
    secret, session_id = await ruled(api, raw_target, {"type": "mask", "columns": ["ssn"],
                                                       "patterns": ["card_number"]})
    head, body = fetched(gateway, secret, path, "-N")
    assert head.startswith("HTTP/1.1 200") and b"secret-ssn-777" not in body and not clear_in(body.decode()), body
    assert body.startswith(b"id: 7\r\ndata: ") and b"\r\n\r\nevent: note\n" in body, body  # line ends kept
    first, second, done, end = body.replace(b"\r\n", b"\n").split(b"\n\n")
    assert first.split(b"\n")[0] == b"id: 7" and end == b"", body
    data = b"\n".join(line[6:] for line in first.split(b"\n")[1:])
    assert json.loads(data) == {"customer": {"name": "Jane", "ssn": "****"}, "card": "****"}, body
    assert second == b"event: note\ndata: paid with\ndata: ****" and done == b"data: [DONE]", body
    session = await api.session(session_id, has_event("o", "[DONE]"))
    recorded = json.dumps(events(session))
    assert "secret-ssn-777" not in recorded and not clear_in(recorded)


async def test_a_utf16_answer_is_masked_and_checked_in_its_charset(api, gateway, raw_target):
    """A body is read in its declared charset (before, UTF-16 passed masks and output rules unread), masked and
    written in it again; a charset the gateway cannot decode is withheld."""
    text = f"card {PII['card']} mail {PII['email']}, top secret\n"
    path = raw_target.answer("200 OK", [("Content-Type", "text/plain; charset=utf-16")], text.encode("utf-16"))
    secret, _ = await ruled(api, raw_target, PII_RULE)
    assert fetched(gateway, secret, path)[1].decode("utf-16") == "card **** mail ****, top secret\n"
    unknown = raw_target.answer("200 OK", [("Content-Type", "text/plain; charset=x-unheard-of")], b"plain")
    assert fetched(gateway, secret, unknown)[0].startswith("HTTP/1.1 502")
    secret, _ = await ruled(api, raw_target, DENY_TOP_SECRET)
    assert fetched(gateway, secret, path)[0].startswith("HTTP/1.1 403")


# --------------------------------------------------------------------------- the target connection pool


def _answer(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body)


async def test_an_answer_nobody_asked_for_never_reaches_the_next_request(api, gateway, client):
    """A target that answers one request twice (in the same write, in part, or later while the connection is
    idle): the pooled connection goes, and the next request -- another user's -- gets its own answer."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1]
                if path == b"/twice":
                    writer.write(_answer(b"answer for A") + _answer(b"A-PRIVATE-EXTRA"))
                elif path == b"/partial":  # the start of a second answer, its rest a little later
                    writer.write(_answer(b"answer for A") + b"HTTP/1.1 200 OK\r\nContent-Length: 14\r\n")
                    await writer.drain()
                    await asyncio.sleep(0.3)
                    writer.write(b"\r\nA-PRIVATE-LATE")
                elif path == b"/later":  # a second answer while the connection is idle in the pool
                    writer.write(_answer(b"answer for A"))
                    await writer.drain()
                    await asyncio.sleep(0.2)
                    writer.write(_answer(b"A-PRIVATE-IDLE"))
                else:
                    writer.write(_answer(b"ok " + path))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        secret_a, _ = await api.credential(await api.role(f"http://127.0.0.1:{port}"))
        secret_b, session_b = await api.credential(await api.role(f"http://127.0.0.1:{port}"))

        async def get(secret: str, path: str) -> bytes:
            async with client.get(f"{gateway.http_url}{path}", headers={"Authorization": secret}) as response:
                assert response.status == 200
                return await response.read()

        assert await get(secret_b, "/warm") == b"ok /warm"  # B's credential and policy at hand: its fast path
        for extra in ("/twice", "/partial", "/later"):
            assert await get(secret_a, extra) == b"answer for A"
            if extra == "/later":
                await asyncio.sleep(0.5)  # the unasked answer arrives while the connection is idle
            for n in (1, 2):
                assert await get(secret_b, f"/b{n}{extra}") == f"ok /b{n}{extra}".encode(), extra
        session = await api.session(session_b, has_event("o", "ok /b2/later"))
        assert "A-PRIVATE" not in json.dumps(events(session))
    finally:
        server.close()


async def test_absolute_and_asterisk_forms_and_connect_are_refused(api, gateway, client, target):
    """``GET http://other-host/...`` would let the target route by another host, past a rule on the path."""
    connection = await api.role()
    secret, session_id = await api.credential(connection)
    await api.guardrail(connection, input_rules=[{"type": "pattern_match", "pattern_regex": r"^GET /echo/admin"}])
    marker = uuid.uuid4().hex
    auth = ("-H", f"Authorization: {secret}")
    for method, request_target, status in (
            ("GET", f"/echo/admin/{marker}", "403"),
            ("GET", f"http://other-vhost.internal/echo/admin/{marker}", "400"),
            ("GET", f"HTTP://127.0.0.1/echo/admin/{marker}", "400"),
            ("OPTIONS", "*", "400"),
            ("CONNECT", f"127.0.0.1:{target.rsplit(':', 1)[1]}", "405")):
        done = await asyncio.to_thread(curl, "-X", method, "--request-target", request_target, "-o", "/dev/null",
                                       "-w", "%{http_code}", *auth, f"{gateway.http_url}/")
        assert done.stdout == status.encode(), (method, request_target, done)
    async with client.get(f"{target}/seen") as response:
        assert not [p for p in await response.json() if marker in p or p == "*"]
    session = await api.session(session_id, has_event("e", "CONNECT is refused"))
    assert any(k == "e" and "absolute-form request target" in t for k, t in events(session))


@pytest.fixture(scope="module")
def stdlib_target():
    """Python's http.server (HTTP/1.1 keep-alive): like many simple servers, it never reads a GET's body.
    Yields its URL and the request lines it ran."""
    import http.server

    ran: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):  # noqa: N802
            ran.append(self.requestline)
            body = f"path={self.path}".encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_POST = do_DELETE = do_GET  # noqa: N815 (the body is never read)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", ran
    server.shutdown()
    server.server_close()


async def test_a_body_the_input_rules_cannot_read_is_refused(api, gateway, client, stdlib_target, target):
    """A GET whose body is a second request: a target that never reads a GET's body runs it, unread by the
    rules; so a body on GET/HEAD/DELETE/OPTIONS, and one of no type or a type the rules do not read, is refused."""
    url, ran = stdlib_target
    connection = await api.role(url)
    secret, session_id = await api.credential(connection)
    await api.guardrail(connection, input_rules=[{"type": "pattern_match", "pattern_regex": "^GET /admin"}])
    marker = uuid.uuid4().hex
    smuggled = f"GET /admin/{marker} HTTP/1.1\r\nHost: t\r\n\r\n"
    auth = ("-H", f"Authorization: {secret}")
    done = await asyncio.to_thread(curl, "-X", "GET", "-H", "Content-Type:", "--data-binary", smuggled, *auth,
                                   f"{gateway.http_url}/x-{marker}")
    assert b"validation error, the gateway cannot read this request" in done.stdout
    assert b"a body on a GET request" in done.stdout
    after = await asyncio.to_thread(curl, *auth, f"{gateway.http_url}/y-{marker}")  # the next on that connection
    assert after.stdout == f"path=/y-{marker}".encode()
    assert not [line for line in ran if "/admin" in line]
    for content_type, says in (("", "without a Content-Type"), ("application/octet-stream", "octet-stream"),
                               ("multipart/form-data; boundary=x", "multipart/form-data")):
        done = await asyncio.to_thread(curl, "-H", f"Content-Type: {content_type}", "--data-binary", "hello", *auth,
                                       "-w", "\n%{http_code}", f"{gateway.http_url}/p-{marker}")
        assert done.stdout.endswith(b"\n403") and says.encode() in done.stdout, (content_type, done.stdout)
    assert not [line for line in ran if f"/p-{marker}" in line]
    done = await asyncio.to_thread(curl, "-H", "Content-Type: text/plain", "--data-binary", "hello", *auth,
                                   f"{gateway.http_url}/p-{marker}")
    assert done.stdout == f"path=/p-{marker}".encode()  # a text body is read by the rules, and passes
    session = await api.session(session_id, has_event("e", "multipart/form-data"))
    refused = [t for k, t in events(session) if k == "i" and t.startswith("GET /x-")]
    assert refused and "[body: 0 of" in refused[0]  # on the record, its body unread
    blocks = [b for b in await api.audit("guardrail.block") if b["request_payload_redacted"]["session_id"] == session_id]
    assert len(blocks) == 4


async def test_input_rules_read_a_form_posted_as_multipart_and_refuse_only_its_binary_parts(api, gateway, target,
                                                                                             tmp_path):
    """A form posted as ``multipart/form-data`` is read part by part (before, refused whole under input rules):
    its text fields and text or JSON files (UTF-8) pass the rules or are blocked by them; a part the rules cannot
    read (a binary file, a text file that is not UTF-8) is refused, never forwarded unread."""
    connection = await api.role()
    secret, session_id = await api.credential(connection)
    await api.guardrail(connection, input_rules=[{"type": "deny_words_list", "words": ["rm -rf"]}])
    marker = uuid.uuid4().hex
    (tmp_path / "notes.txt").write_text("a text file\n")
    (tmp_path / "query.json").write_text('{"run": "\\u0072m -rf /"}')  # read as the target decodes it
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00 rm -rf")
    (tmp_path / "latin.txt").write_bytes(b"caf\xe9")

    def post(*fields: str) -> tuple[int, bytes]:
        form = [arg for field in fields for arg in ("-F", field)]
        done = curl("-sS", "-H", f"Authorization: {secret}", *form, "-w", "\n%{http_code}",
                    f"{gateway.http_url}/echo/form-{marker}")
        body, _, code = done.stdout.rpartition(b"\n")
        return int(code), body

    status, body = post("who=jane", f"notes=@{tmp_path / 'notes.txt'};type=text/plain",
                        f"data=@{tmp_path / 'query.json'};type=application/json;filename=fine.json")
    assert status == 403 and b"rm -rf" in body, body  # the JSON file's escape, decoded
    status, body = post("who=jane", f"notes=@{tmp_path / 'notes.txt'};type=text/plain")
    assert status == 200, body  # (before: 403, multipart/form-data refused whole)
    seen = json.loads(body)
    assert seen["path"] == f"/echo/form-{marker}" and "a text file" in seen["body"] and "jane" in seen["body"]
    status, body = post("cmd=please rm   -rf /")
    assert status == 403 and b"rm -rf" in body, body
    for field, says in ((f"picture=@{tmp_path / 'image.png'};type=image/png", b"'image/png'"),
                        (f"notes=@{tmp_path / 'latin.txt'};type=text/plain", b"not UTF-8")):
        status, body = post("who=jane", field)
        assert status == 403 and b"validation error, the gateway cannot read this request" in body, body
        assert says in body, body
    session = await api.session(session_id, has_event("e", "not UTF-8"))
    recorded = events(session)
    assert sum(k == "i" and f"POST /echo/form-{marker}" in t for k, t in recorded) == 5
    assert sum(k == "o" and t.startswith("HTTP/1.1 200") for k, t in recorded) == 1


async def test_input_rules_read_what_the_target_decodes(api, gateway, client, target):
    """A rule on the plain spelling catches it percent-encoded in the path, in a form, as a JSON escape, in a
    gzip body; a charset or an encoding the gateway does not decode is refused; the recording keeps the bytes."""
    connection = await api.role()
    secret, session_id = await api.credential(connection)
    await api.guardrail(connection, input_rules=[{"type": "deny_words_list", "words": ["drop table"]},
                                                 {"type": "pattern_match", "pattern_regex": "^GET /echo/admin"}])
    marker = uuid.uuid4().hex
    headers = {"Authorization": secret}
    plain = b'{"q": "drop table users"}'
    form = "application/x-www-form-urlencoded"
    for body, kind, extra in (
            (b"q=drop+table+users", form, {}), (b"q=drop%20table%20users", form, {}),
            (b'{"q": "drop\\u0020table users"}', "application/json", {}),
            (gzip.compress(plain), "application/json", {"Content-Encoding": "gzip"}),
            (zlib.compress(plain), "application/json", {"Content-Encoding": "deflate"}),
            ('{"q": "drop table users"}'.encode("utf-16"), "application/json; charset=utf-16", {}),
            (plain, "application/json", {"Content-Encoding": "br"})):
        async with client.post(f"{gateway.http_url}/echo/{marker}", data=body,
                               headers={**headers, "Content-Type": kind, **extra}) as response:
            assert response.status == 403, (body, kind, extra)
    for path in (f"/%65cho/admin/{marker}", f"/echo/%61dmin/{marker}", f"/echo/x?{marker}=drop+table",
                 f"/echo/x?{marker}=drop%20table"):
        async with client.get(URL(f"{gateway.http_url}{path}", encoded=True), headers=headers) as response:
            assert response.status == 403, path
    async with client.post(f"{gateway.http_url}/echo/{marker}/fine", data=b"q=fine+words",
                           headers={**headers, "Content-Type": form}) as response:
        assert response.status == 200 and (await response.json())["body"] == "q=fine+words"
    async with client.get(f"{target}/seen") as response:
        assert [p for p in await response.json() if marker in p] == [f"/echo/{marker}/fine"]
    session = await api.session(session_id, has_event("i", "q=fine+words"))
    recorded = [t for k, t in events(session) if k == "i"]
    assert any(t.endswith("q=drop%20table%20users") for t in recorded)  # as it was sent, not as it was read


async def test_the_gateways_secret_never_reaches_the_target_nor_the_records(api, gateway, client, target):
    """A credential put in the query string, the Referer, a header or a cookie of the app's own is not sent on
    (a target echoes it in its pages and errors, and that answer is recorded); nor is it in the recording."""
    connection = await api.role()
    secret, session_id = await api.credential(connection)
    await api.guardrail(connection, input_rules=[{"type": "deny_words_list", "words": ["never said"]}])
    async with client.post(URL(f"{gateway.http_url}/echo/q?t={secret}&keep=1&also={secret}x", encoded=True),
                           data=b"fine",
                           headers={"Authorization": secret, "Referer": f"http://gw/echo?t={secret}",
                                    "X-Other": f"Bearer {secret}", "Cookie": f"a=1; b={secret}",
                                    "Content-Type": "text/plain"}) as response:
        assert response.status == 200
        seen = await response.json()
    assert seen["query"] == "keep=1"
    assert header_value(seen["headers"], "Cookie") == ["a=1"]
    assert header_value(seen["headers"], "Referer") == [] and header_value(seen["headers"], "X-Other") == []
    assert secret not in json.dumps({k: v for k, v in seen.items() if k != "body"})
    async with client.post(f"{gateway.http_url}/echo/body", data=f"token={secret}".encode(),  # echoed back
                           headers={"Authorization": secret, "Content-Type": "text/plain"}) as response:
        assert response.status == 200 and (await response.json())["body"] == f"token={secret}"
    async with client.post(f"{gateway.http_url}/upload", data=f"token={secret}".encode(),  # answers a digest
                           headers={"Authorization": secret, "Content-Type": "text/plain"}) as response:
        assert response.status == 200
    session = await api.session(session_id, has_event("i", "POST /upload"))
    assert any(k == "o" and '"token=[REDACTED]"' in t for k, t in events(session))  # the echo, recorded
    assert secret not in json.dumps(events(session))
    assert any(k == "i" and t.endswith("token=[REDACTED]") for k, t in events(session))
    assert secret not in gateway.log_text()
