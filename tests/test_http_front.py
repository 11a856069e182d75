"""The HTTP proxy's front end on the wire: plain requests on its own protocol, everything else handed to aiohttp.

A raw socket client talks to a real ``gatewayd run`` in front of the real
target app (``tests/httppeer.py``), so each test chooses exactly how the bytes
arrive: pipelined, a head split over two writes, a body, HTTP/1.0, garbage,
a request sent while the previous answer still streams.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import subprocess
import sys

import aiohttp
import pytest

from tests.apiclient import Api, admin_http, events
from tests.conftest import ROOT, free_port, proxy_daemon, wait_port
from tests.httppeer import pattern_sha256


@pytest.fixture(scope="module")
def target():
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "tests.httppeer", str(port)], cwd=ROOT)
    try:
        wait_port(port, process)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(10)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    daemon = proxy_daemon(tmp_path_factory, "httpfront", "http", wait=True)
    yield daemon
    assert daemon.stop() == 0


class HttpApi(Api):
    secret_field = "proxy_token"

    async def session_events(self, session_id: str, needle: str) -> dict:
        """The session with its event stream, once an input event holds ``needle``."""
        return await self.session(session_id, lambda s: any(k == "i" and needle in t for k, t in events(s)))


@pytest.fixture(scope="module")
async def credential(gateway, target):
    """(secret, session id, api) of one credential on the target app."""
    async with admin_http(gateway) as http:
        api = HttpApi(gateway, http)
        role = await api.connection("front", "httpproxy", "httpproxy", {"REMOTE_URL": target})
        secret, session_id = await api.credential(role)
        yield secret, session_id, api


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """(status, headers by lowered name, body) of one response: Content-Length, chunked, or up to EOF."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
    status_line, *lines = head[:-4].split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
            if size == 0:
                await reader.readuntil(b"\r\n")  # the empty line after the last chunk
                break
            body += (await reader.readexactly(size + 2))[:-2]
    else:
        body = await reader.read()
    return int(status_line.split()[1]), headers, body


def request(method: str, path: str, secret: str, body: bytes = b"", version: str = "1.1") -> bytes:
    head = f"{method} {path} HTTP/{version}\r\nHost: gw.test\r\nAuthorization: {secret}\r\n"
    if body:
        head += f"Content-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


async def connect(gateway) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", gateway.proxy_port, limit=1 << 22)


async def test_pipelined_requests_are_answered_in_order(gateway, credential):
    secret = credential[0]
    reader, writer = await connect(gateway)
    writer.write(request("GET", "/echo/first", secret) + request("GET", "/echo/second", secret))
    first = await read_response(reader)
    second = await read_response(reader)
    assert (first[0], json.loads(first[2])["path"]) == (200, "/echo/first")
    assert (second[0], json.loads(second[2])["path"]) == (200, "/echo/second")
    writer.close()


async def test_a_head_split_over_two_writes_is_answered(gateway, credential):
    secret = credential[0]
    reader, writer = await connect(gateway)
    data = request("GET", "/echo/split?x=1", secret)
    writer.write(data[:20])
    await writer.drain()
    await asyncio.sleep(0.05)  # two segments, so the gateway reads two pieces
    writer.write(data[20:])
    status, _, body = await read_response(reader)
    assert status == 200 and json.loads(body)["path"] == "/echo/split"
    writer.close()


async def test_plain_body_plain_on_one_connection(gateway, credential):
    """A plain GET, a POST with a body (the connection goes to aiohttp), another GET: all answered."""
    secret, session_id, api = credential
    reader, writer = await connect(gateway)
    writer.write(request("GET", "/json", secret))
    status, headers, body = await read_response(reader)
    assert status == 200 and headers["content-type"] == "application/json" and json.loads(body)
    assert "date" in headers and "server" in headers
    writer.write(request("POST", "/echo/posted", secret, b"hello front"))
    status, _, body = await read_response(reader)
    assert status == 200 and json.loads(body)["body"] == "hello front"
    writer.write(request("GET", "/echo/after", secret))
    status, _, body = await read_response(reader)
    assert status == 200 and json.loads(body)["path"] == "/echo/after"
    writer.close()
    session = await api.session_events(session_id, "GET /echo/after")
    texts = [text for kind, text in events(session) if kind == "i"]
    assert any(t.startswith("GET /json HTTP/1.1") for t in texts)
    assert any(t.startswith("POST /echo/posted HTTP/1.1") and "hello front" in t for t in texts)
    assert all(secret not in text for _, text in events(session))


async def test_http10_request_is_answered_and_closed(gateway, credential):
    reader, writer = await connect(gateway)
    writer.write(request("GET", "/json", credential[0], version="1.0"))
    status, _, body = await read_response(reader)
    assert status == 200 and json.loads(body)
    assert await reader.read() == b""  # closed after the answer
    writer.close()


async def test_garbage_gets_aiohttps_400_and_the_gateway_serves_on(gateway, credential):
    reader, writer = await connect(gateway)
    writer.write(b"NOT HTTP AT ALL\r\n\r\n")
    status, _, _ = await read_response(reader)
    assert status == 400
    writer.close()
    reader, writer = await connect(gateway)
    writer.write(request("GET", "/json", credential[0]))
    assert (await read_response(reader))[0] == 200
    writer.close()


async def test_streamed_answers_with_and_without_length_keep_the_connection(gateway, credential):
    secret = credential[0]
    reader, writer = await connect(gateway)
    for path, size in (("/download?size=300000", 300000), ("/download?size=200001&chunked=1", 200001)):
        writer.write(request("GET", path, secret))
        status, headers, body = await read_response(reader)
        assert status == 200 and len(body) == size
        assert hashlib.sha256(body).hexdigest() == pattern_sha256(size)
        assert ("content-length" in headers) == ("chunked" not in path)
    writer.write(request("HEAD", "/download?size=5000", secret))
    head = await reader.readuntil(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0] and b"Content-Length: 5000" in head
    writer.write(request("GET", "/json", secret))
    assert (await read_response(reader))[0] == 200  # nothing of the HEAD's body was left on the wire
    writer.close()


async def test_a_request_sent_while_an_answer_streams_waits_its_turn(gateway, credential):
    secret = credential[0]
    reader, writer = await connect(gateway)
    writer.write(request("GET", "/sse-hold", secret))
    head = await reader.readuntil(b"\r\n\r\n")
    assert b"text/event-stream" in head
    assert b"data: first" in await reader.readuntil(b"data: first\n\n\r\n")
    writer.write(request("GET", "/echo/next", secret))  # the next request, sent early
    await writer.drain()
    other_reader, other_writer = await connect(gateway)
    other_writer.write(request("GET", "/release", secret))
    assert (await read_response(other_reader))[0] == 200
    other_writer.close()
    rest = await reader.readuntil(b"0\r\n\r\n")
    assert b"data: second" in rest
    status, _, body = await read_response(reader)
    assert status == 200 and json.loads(body)["path"] == "/echo/next"
    writer.close()


async def test_refusals_on_the_plain_path(gateway, credential):
    reader, writer = await connect(gateway)
    writer.write(b"GET /json HTTP/1.1\r\nHost: gw.test\r\n\r\n")
    status, headers, body = await read_response(reader)
    assert status == 401 and "missing credential" in json.loads(body)["message"]
    writer.write(b"GET /" + credential[0].encode() + b"/json?a=1 HTTP/1.1\r\nHost: gw.test\r\n\r\n")
    status, headers, body = await read_response(reader)
    app_host, _, rest = headers["location"].removeprefix("http://").partition("/")
    assert status == 302 and re.fullmatch(r"front-[0-9a-f]{8}-[0-9a-f]{8}\.localhost", app_host)
    assert rest == f"{credential[0]}/json?a=1" and "set-cookie" not in headers
    writer.write(b"GET /" + credential[0].encode() + b"/json?a=1 HTTP/1.1\r\nHost: " + app_host.encode()
                 + b"\r\nAccept: text/html\r\n\r\n")
    status, headers, body = await read_response(reader)
    assert status == 302 and headers["location"] == "/json?a=1" and "HttpOnly" in headers["set-cookie"]
    writer.write(b"GET /json HTTP/1.1\r\nHost: other-1.localhost\r\nAuthorization: " + credential[0].encode()
                 + b"\r\nAccept: text/html\r\n\r\n")
    status, headers, body = await read_response(reader)
    assert status == 403 and headers["content-type"].startswith("text/html") and b"<h1>" in body
    writer.close()


async def test_header_bytes_that_are_not_utf8_pass_and_are_recorded(gateway, credential):
    """A Latin-1 header value (no UTF-8) reaches the target as sent, on the plain path and with a body."""
    secret, session_id, api = credential
    reader, writer = await connect(gateway)
    odd = b"X-Odd: caf\xe9\r\n"
    for path, body in (("/echo/odd-plain", b""), ("/echo/odd-body", b"hi")):
        head = request("GET", path, secret, body)
        writer.write(head.replace(b"\r\n", b"\r\n" + odd, 1))
        status, _, answer = await read_response(reader)
        assert status == 200, answer
        assert ["X-Odd", "caf\udce9"] in json.loads(answer)["headers"]  # the target's parser saw byte 0xe9
    writer.close()
    session = await api.session_events(session_id, "GET /echo/odd-body")
    assert any(text.startswith("GET /echo/odd-plain") and "X-Odd: caf" in text
               for kind, text in events(session) if kind == "i")


async def test_guard_rails_and_recording_alike_on_the_plain_and_the_aiohttp_path(gateway, credential, target):
    """The same requests, once whole (the front end) and once split (aiohttp): blocked, answered, recorded alike."""
    api = credential[2]
    role = await api.connection("front-rules", "httpproxy", "httpproxy", {"REMOTE_URL": target})
    await api.guardrail(role, input_rules=[{"type": "deny_words_list", "words": ["forbidden"]}],
                        output_rules=[{"type": "deny_words_list", "words": ["top secret"]}])
    secret, session_id = await api.credential(role)
    answers: dict[str, list[tuple[int, dict[str, str], bytes]]] = {}
    for way in ("plain", "split"):
        reader, writer = await connect(gateway)
        answers[way] = []
        for path in (f"/echo/{way}/forbidden", f"/text?say=top+secret+{way}", f"/echo/{way}/fine"):
            data = request("GET", path, secret)
            if way == "split":  # a head over two reads: aiohttp serves the connection from here on
                writer.write(data[:20])
                await writer.drain()
                await asyncio.sleep(0.05)
                data = data[20:]
            writer.write(data)
            answers[way].append(await read_response(reader))
        writer.close()
    for way, (input_block, output_block, fine) in answers.items():
        for status, headers, body in (input_block, output_block):
            assert status == 403 and headers["x-gateway-guardrails"] == "blocked", (way, body)
        assert json.loads(input_block[2])["message"].endswith("words=[forbidden]")
        assert "top secret" in json.loads(output_block[2])["message"]
        assert fine[0] == 200 and json.loads(fine[2])["path"] == f"/echo/{way}/fine"
    async with aiohttp.ClientSession() as http, http.get(f"{target}/seen") as response:
        seen = [p for p in await response.json() if "/forbidden" in p and ("/plain/" in p or "/split/" in p)]
    assert seen == []  # neither path let the blocked request reach the target
    session = await api.session_events(session_id, "GET /echo/split/fine")
    recorded = events(session)
    for way in ("plain", "split"):
        assert any(k == "i" and t.startswith(f"GET /echo/{way}/forbidden HTTP/1.1") for k, t in recorded)
        assert any(k == "i" and t.startswith(f"GET /text?say=top+secret+{way} HTTP/1.1") for k, t in recorded)
        assert any(k == "o" and t.startswith("HTTP/1.1 200") and f'"/echo/{way}/fine"' in t for k, t in recorded)
    assert sum(1 for k, t in recorded if k == "e" and "words=[forbidden]" in t) == 2
    assert sum(1 for k, t in recorded if k == "e" and "top secret" in t) == 2
    assert all(secret not in text for _, text in recorded)


async def test_repeated_plain_requests_skip_the_handler_and_are_recorded_alike(tmp_path, http_target):
    """After a connection's first request, plain requests with a fresh credential are served by ``fast``
    (no handler, no task): each answered and recorded as the first one was, a 404 and a HEAD included."""
    from proxies.http.server import start as start_http
    from tests.conftest import core_gateway, issued_in_core

    async with core_gateway(tmp_path) as core:
        port = free_port()
        listener = await start_http(core.proxy_context("http"), "127.0.0.1", port)
        handled: list[str] = []
        handle = listener.front.handler

        async def counting(request):  # the task path's entry
            handled.append(request.raw_path)
            return await handle(request)

        listener.front.handler = counting
        try:
            issued = await issued_in_core(core, "web", "httpproxy", {"REMOTE_URL": http_target})
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            answers = []
            # a HEAD last: a target connection that answered one is not used again (see TargetProtocol)
            for method, path in [("GET", "/json")] * 4 + [("GET", "/missing")] * 2 + [("HEAD", "/json")]:
                writer.write(request(method, path, issued.secret))
                if method == "HEAD":
                    head = await reader.readuntil(b"\r\n\r\n")
                    answers.append((int(head.split()[1]), b""))
                else:
                    status, _, body = await read_response(reader)
                    answers.append((status, body))
            writer.close()
            assert [status for status, _ in answers] == [200] * 4 + [404] * 2 + [200]
            assert len({body for _, body in answers[:4]}) == 1 and json.loads(answers[0][1])["ok"] is True
            assert handled == ["/json"]  # the first request resolved the credential; the rest never needed a task
            await core.recording.flush()
            recorded = await core.store.read_events(issued.credential.session_id)
            inputs = [e.data for e in recorded if e.kind == "i"]
            outputs = [e.data for e in recorded if e.kind == "o"]
            assert len(inputs) == len(outputs) == 7 and len(set(inputs[:4])) == 1
            assert all(issued.secret.encode() not in e.data for e in recorded)
            dated = [re.sub(rb"Date: [^\r]*", b"Date: -", o) for o in outputs]
            assert len(set(dated[:4])) == 1 and dated[0].endswith(answers[0][1])
            assert dated[4] == dated[5] and dated[4].startswith(b"HTTP/1.1 404 Not Found\r\n")
            assert dated[6].startswith(b"HTTP/1.1 200 OK\r\n") and dated[6].endswith(b"\r\n\r\n")
        finally:
            await listener.close()


async def test_the_same_request_and_answer_bytes_again_are_not_parsed_again_and_a_byte_apart_are(
        gateway, credential):
    """The front end takes a plain request that repeats the last one's bytes as the message parsed then, and the
    target's protocol an answer that repeats the last one's head (as long) as that head with the new body. A
    request or an answer one byte apart (same length) is parsed anew: each answer is the target's own, and
    recorded as such."""
    secret, session_id, api = credential
    reader, writer = await connect(gateway)
    paths = ["/echo/aaaa", "/echo/aaaa", "/echo/bbbb", "/echo/aaaa", "/echo/aaaaa", "/echo/aaaa"]
    answered = []
    try:
        for path in paths:
            writer.write(request("GET", path, secret))
            async with asyncio.timeout(60):  # a wrong framing would leave the client waiting: a failure, not a hang
                status, headers, body = await read_response(reader)
            assert status == 200, body
            answered.append(json.loads(body)["path"])
    finally:
        writer.close()
    assert answered == paths  # /echo/bbbb's request and answer are the same length as /echo/aaaa's
    async with asyncio.timeout(30):  # the last request's events may land a flush after the marker's
        while True:
            session = await api.session_events(session_id, "/echo/aaaaa")
            recorded = [(kind, text) for kind, text in events(session)]
            inputs = [text.split(" ")[1] for kind, text in recorded if kind == "i" and "/echo/" in text]
            outputs = [json.loads(text.partition("\r\n\r\n")[2])["path"] for kind, text in recorded
                       if kind == "o" and '"/echo/' in text]
            if len(inputs) >= 6 and inputs[-1] == paths[-1] and len(outputs) >= 6 and outputs[-1] == paths[-1]:
                break
            await asyncio.sleep(0.2)
    assert inputs[-6:] == paths and outputs[-6:] == paths


async def test_a_repeated_answer_head_split_over_reads_or_of_another_length_is_parsed(tmp_path):
    """A target whose answers repeat one head: the same head with a new body of the same length is that answer;
    one that arrives over two reads, or whose length differs, goes through aiohttp's parser, and every body is
    the target's own."""
    from proxies.http.server import start as start_http
    from tests.conftest import core_gateway, issued_in_core

    served = 0

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            path = head.split()[1].decode()
            served += 1
            body = f"{served:05d}".encode() if path != "/longer" else f"{served:07d}".encode()
            kind = b"b" if path == "/other" else b"a"  # a head one byte apart, as long
            whole = b"HTTP/1.1 200 OK\r\nX-Kind: %b\r\nContent-Length: %d\r\n\r\n%b" % (kind, len(body), body)
            if path == "/split":  # the head and half the body, then the rest
                writer.write(whole[:-3])
                await writer.drain()
                await asyncio.sleep(0.05)
                writer.write(whole[-3:])
            else:
                writer.write(whole)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    target = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    async with core_gateway(tmp_path) as core:
        port = free_port()
        listener = await start_http(core.proxy_context("http"), "127.0.0.1", port)
        try:
            issued = await issued_in_core(core, "same-head", "httpproxy", {"REMOTE_URL": target}, "bo@example.com")
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            paths = ["/a", "/a", "/a", "/other", "/a", "/split", "/a", "/longer", "/a", "/a"]
            bodies, kinds = [], []
            for path in paths:
                writer.write(request("GET", path, issued.secret))
                async with asyncio.timeout(60):  # a wrong framing would leave the client waiting: fail, not hang
                    status, headers, body = await read_response(reader)
                assert status == 200, body
                bodies.append(body)
                kinds.append(headers["x-kind"])
            writer.close()
            assert kinds == ["b" if path == "/other" else "a" for path in paths]
            assert bodies == [f"{n:05d}".encode() if path != "/longer" else f"{n:07d}".encode()
                              for n, path in enumerate(paths, 1)]
            await core.recording.flush()
            outputs = [e.data for e in await core.store.read_events(issued.credential.session_id) if e.kind == "o"]
            assert [o.partition(b"\r\n\r\n")[2] for o in outputs] == bodies
        finally:
            await listener.close()
            server.close()


async def test_a_download_the_client_reads_slowly_leaves_its_target_connection_fit_for_the_next_request(
        gateway, credential):
    """A client slower than the target pauses the target's connection and resumes it (aiohttp's resume feeds the
    protocol no bytes, which is no answer); that pooled connection then serves the next request."""
    secret = credential[0]
    reader, writer = await connect(gateway)
    size = 16 << 20
    try:
        for _ in range(2):
            writer.write(request("GET", f"/download?size={size}", secret))
            async with asyncio.timeout(120):
                head = await reader.readuntil(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200"), head
                await asyncio.sleep(0.5)  # the gateway's buffers fill: it pauses the target's connection
                got = 0
                while got < size:
                    got += len(await reader.read(min(1 << 16, size - got)))
                    await asyncio.sleep(0)
            writer.write(request("GET", "/json", secret))
            async with asyncio.timeout(60):
                status, _, body = await read_response(reader)
            assert status == 200 and json.loads(body)["ok"] is True, body
    finally:
        writer.close()
