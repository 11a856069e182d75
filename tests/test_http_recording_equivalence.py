"""What an auditor sees of HTTP sessions stays byte for byte the same: a fixed workload against a golden file.

A fixed sequence of requests (aiohttp and curl, through a real gatewayd to the
aiohttp target app) on four connections -- no rules, an input and an output
guard rail, a mask rule, a target that is down -- and everything the control
API shows of their sessions: the recorded ``i``/``o``/``e`` events (utf8 and
base64 event streams), the answers to ``?format=csv|json`` and the asciicast
export, and the ``guardrail.block`` audit entries. They are compared with
``tests/golden/http_recording.json``, written from the proxy as it was before
the data-path work of issue 16 (``GATEWAYD_WRITE_GOLDEN=1`` writes it anew, on
purpose only). Only what varies from run to run is normalised: ports,
``Date`` values, the target's ``Server`` (its aiohttp version), websocket keys,
ids and times.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, AsyncIterator

import aiohttp
import pytest

from tests import clients
from tests.apiclient import admin_http
from tests.conftest import HOT_PATH_RUNS, free_port, hot_path_logged, proxy_daemon
from tests.httppeer import gzip_bytes
from tests.test_http_proxy import HttpApi

GOLDEN = Path(__file__).parent / "golden" / "http_recording.json"
RECORD_CAP = 1024
UA = {"User-Agent": "golden-client/1"}


@pytest.fixture(scope="module", params=list(HOT_PATH_RUNS))
def gateway(request, tmp_path_factory):
    """Once on the hot path as built (compiled after make), once from the Python source (gatewayd/hotpath.py)."""
    env = HOT_PATH_RUNS[request.param]
    daemon = proxy_daemon(tmp_path_factory, "httpgolden", "http", {
        "http.record_body_bytes": RECORD_CAP,
        "http.guard_body_bytes": 65536,
    }, wait=True, env=env)
    hot_path_logged(daemon, env)
    daemon.http_url = f"http://127.0.0.1:{daemon.proxy_port}"
    yield daemon
    assert daemon.stop() == 0


@pytest.fixture(scope="module")
async def api(gateway, http_target):
    async with admin_http(gateway) as http:
        api = HttpApi(gateway, http, http_target)
        api.session_timeout = 120  # a deadline for the recording to be stored, generous on a loaded machine
        yield api


async def named_role(api: HttpApi, name: str, remote_url: str | None = None) -> dict:
    """A connection with a fixed name (names appear in recorded messages)."""
    status, created = await api("POST", "/connections", {
        "name": name, "type": "httpproxy", "subtype": "httpproxy",
        "secret": {"envvar:REMOTE_URL": base64.b64encode((remote_url or api.target).encode()).decode()}})
    assert status == 201, created
    return created


def curl(*args: str) -> bytes:
    done = clients.curl("-A", "golden-curl/1", "-H", "Accept: */*", *args, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


async def chunks(data: bytes, size: int) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start:start + size]


async def plain_workload(url: str, secret: str) -> list[Any]:
    """Requests without rules: the front end's plain path, aiohttp's path (bodies), streams, a websocket."""
    auth = {"Authorization": secret, **UA}
    seen: list[Any] = []
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False) as client:
        async def call(method: str, path: str, **kwargs: Any) -> None:
            headers = {**auth, **kwargs.pop("headers", {})}
            async with client.request(method, url + path, headers=headers, allow_redirects=False,
                                      **kwargs) as response:
                body = await response.read()
                seen.append([method, path, response.status, len(body)])

        await call("GET", "/json")
        await call("GET", "/json?again=1", headers={"X-Trace": "a, b", "Cookie": "theme=dark"})
        await call("HEAD", "/json")
        await call("GET", "/echo/a/b?x=1&y=%20z", headers={"Authorization": f"Bearer {secret}"})
        await call("POST", "/echo/form", data=b"name=ada&note=hello", headers={
            "Content-Type": "application/x-www-form-urlencoded"})
        await call("PUT", "/echo/json", json={"q": "select 1", "n": [1, 2, 3]})
        await call("POST", "/upload", data=chunks(bytes(range(256)) * 4096, 16384),
                   headers={"Content-Type": "application/octet-stream"})  # chunked, streamed past the record cap
        await call("POST", "/upload", data=gzip_bytes(b"squeeze me " * 100),
                   headers={"Content-Encoding": "gzip"})
        await call("GET", "/pii/gzip")  # a gzip body passes as it came
        await call("GET", "/download?size=3000&chunked=1")  # chunked, whole in the record
        await call("GET", "/download?size=100000&chunked=1")  # chunked, past the record cap
        await call("GET", "/download?size=70000")  # over the small-body limit: streamed with its length
        await call("GET", "/text?say=plain%20text")
        await call("GET", "/sse?n=3")
        await call("GET", "/redirect?to=/json")
        await call("GET", "/links")
        await call("GET", "/no/such/page")  # the target's 404
        await call("DELETE", "/echo/x", headers={"Connection": "close"})
        await call("GET", "/echo/..%2f..%2fetc")
        async with client.ws_connect(url + "/ws", headers=auth, protocols=("chat",)) as ws:
            await ws.send_str("hello")
            seen.append(await ws.receive_str(timeout=120))
            await ws.send_bytes(b"\x01\x02\x03")
            seen.append(list(await ws.receive_bytes(timeout=120)))
        await call("GET", "/json?last=1")
    seen.append(len(curl("-H", f"Authorization: {secret}", f"{url}/json?curl=1")))
    seen.append(len(curl("-H", f"Authorization: {secret}", "-d", "curl=posted", f"{url}/echo/curl")))
    return seen


async def rails_workload(url: str, secret: str) -> list[Any]:
    """Requests read by an input and an output guard rail: some pass, some are blocked."""
    auth = {"Authorization": secret, **UA}
    seen: list[Any] = []
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False) as client:
        async def call(method: str, path: str, **kwargs: Any) -> None:
            async with client.request(method, url + path, headers=auth, **kwargs) as response:
                seen.append([method, path, response.status, response.headers.get("X-Gateway-Guardrails"),
                             (await response.read()).decode("utf-8", "replace")[:200]])

        await call("GET", "/json")
        await call("GET", "/echo/fine?ssn=12")
        await call("GET", "/echo/blocked?ssn=123")  # input pattern in the request line
        await call("POST", "/echo/body", json={"q": "DROP   TABLE users"})  # input words in the body
        await call("POST", "/echo/body", json={"q": "select 1"})
        await call("GET", "/text?say=this%20is%20TOP%20SECRET")  # output words: 403, nothing sent
        await call("GET", "/text?say=harmless")
        await call("GET", "/download?size=1000")  # binary: the output rule does not read it
        async with client.ws_connect(url + "/ws", headers=auth, protocols=("chat",)) as ws:
            await ws.send_str("hello")
            seen.append(await ws.receive_str(timeout=120))
            await ws.send_str("please drop table t")
            closing = await ws.receive(timeout=120)
            seen.append([closing.type.name, closing.data, closing.extra])
        await call("GET", "/json?last=1")
    return seen


async def repeated_workload(api: HttpApi, connection: dict, url: str, secret: str) -> list[Any]:
    """The same requests again on one keep-alive connection, then a rule change between two of them: what the
    gateway remembers of a connection's last request and answer never outlives the rules it was made under."""
    auth = {"Authorization": secret, **UA}
    seen: list[Any] = []
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False,
                                     connector=aiohttp.TCPConnector(limit=1)) as client:
        async def call(method: str, path: str) -> None:
            async with client.request(method, url + path, headers=auth) as response:
                seen.append([method, path, response.status, response.headers.get("X-Gateway-Guardrails"),
                             (await response.read()).decode("utf-8", "replace")[:200]])

        for method, path in (("GET", "/json"), ("HEAD", "/json"), ("GET", "/text?say=loud"),
                             ("GET", "/text?say=quiet")):
            for _ in range(3):  # the same request three times in a row
                await call(method, path)
        await api.guardrail(connection, input_rules=[{"type": "deny_words_list", "words": ["loud"]}],
                            output_rules=[{"type": "deny_words_list", "words": ["quiet"]}])
        for method, path in (("GET", "/text?say=quiet"), ("GET", "/json"), ("GET", "/text?say=loud")):
            for _ in range(2):  # the first: the request just before the change again, now blocked on its way back
                await call(method, path)
        await call("GET", "/json?last=1")
    return seen


async def masked_workload(url: str, secret: str) -> list[Any]:
    auth = {"Authorization": secret, **UA}
    seen: list[Any] = []
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False) as client:
        for path in ("/pii/json", "/pii/text", "/pii/chunked", "/pii/gzip", "/json?last=1"):
            async with client.get(url + path, headers=auth) as response:
                seen.append([path, response.status, (await response.read()).decode("utf-8", "replace")])
    return seen


async def down_workload(url: str, secret: str) -> list[Any]:
    auth = {"Authorization": secret, **UA}
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as client:
        async with client.get(url + "/json", headers=auth) as response:
            return [response.status, await response.json()]


class Normaliser:
    """Replaces what varies between runs (ports, dates, versions, keys, ids) with fixed names."""

    def __init__(self, replacements: dict[str, str]) -> None:
        self.replacements = replacements

    def __call__(self, text: str) -> str:
        for value, name in self.replacements.items():
            text = text.replace(value, name)
        text = re.sub(r"(?im)^(Date): [^\r\n]*", r"\1: <date>", text)
        text = re.sub(r"(?im)^(Server): [^\r\n]*", r"\1: <server>", text)
        text = re.sub(r"(?im)^(Sec-WebSocket-(?:Key|Accept)): [^\r\n]*", r"\1: <key>", text)
        return text

    def deep(self, value: Any) -> Any:
        if isinstance(value, str):
            return self(value)
        if isinstance(value, list):
            return [self.deep(v) for v in value]
        if isinstance(value, dict):
            return {k: self.deep(v) for k, v in value.items()}
        return value


async def auditor_view(api: HttpApi, session_id: str, last: str, normal: Normaliser) -> dict[str, Any]:
    """Everything the API shows of a session's recording, once the event after the input ``last`` (the workload's
    last request) is stored: its answer or its error."""
    def ended(session: dict) -> bool:
        texts = [base64.b64decode(data).decode("utf-8", "replace") for _, _, data in session["event_stream"]]
        return any(last in text for text in texts[:-1])

    await api.session(session_id, ended)
    session = await api.session(session_id)  # read again: the session row may have been read before the last flush
    raw = [(kind, base64.b64decode(data)) for _, kind, data in session["event_stream"]]
    assert session["event_size"] == sum(len(d) for _, d in raw)  # nothing recorded that the stream does not hold
    view: dict[str, Any] = {
        "events": [[kind, normal(data.decode("utf-8", "backslashreplace"))] for kind, data in raw],
        "offsets_increase": all(a[0] <= b[0] for a, b in zip(session["event_stream"], session["event_stream"][1:])),
        "metrics": normal.deep({k: v for k, v in (session.get("metrics") or {}).items() if k != "event_size"}),
    }
    status, utf8 = await api("GET", f"/sessions/{session_id}?event_stream=utf8")
    assert status == 200
    view["event_stream=utf8"] = normal(utf8["event_stream"][0])
    status, b64 = await api("GET", f"/sessions/{session_id}?event_stream=base64")
    assert status == 200
    view["event_stream=base64 (sha256)"] = hashlib.sha256(
        normal(base64.b64decode(b64["event_stream"][0]).decode("utf-8", "backslashreplace")).encode()).hexdigest()
    for query in ("format=csv", "format=json", "event_stream=asciicast"):
        status, body = await api("GET", f"/sessions/{session_id}?{query}")
        view[query] = [status, normal.deep(body)]
    return view


def audit_view(entries: list[dict], session_id: str, normal: Normaliser) -> list[Any]:
    """The guardrail.block entries of a session, without ids and times, oldest first."""
    kept = []
    for entry in entries:
        payload = dict(entry["request_payload_redacted"])
        if payload.get("session_id") != session_id:
            continue
        payload.pop("session_id")
        kept.append({"outcome": entry["outcome"], "action": entry["action"],
                     "payload": normal.deep({k: v for k, v in payload.items()
                                             if k not in ("connection_id", "credential_id", "user_id")})})
    return sorted(kept, key=lambda e: json.dumps(e, sort_keys=True))


async def test_what_an_auditor_sees_matches_the_golden_file(api, gateway):
    http_target = api.target
    gw_port = str(gateway.proxy_port)
    target_port = http_target.rsplit(":", 1)[1]
    dead = free_port()
    normal = Normaliser({f":{gw_port}": ":<gateway-port>", f":{target_port}": ":<target-port>",
                         f":{dead}": ":<dead-port>"})
    url = gateway.http_url
    result: dict[str, Any] = {}

    plain = await named_role(api, "golden-plain")
    secret, session_id = await api.credential(plain)
    normal.replacements[secret] = "<secret>"
    normal.replacements[session_id] = "<session>"
    result["plain_client"] = normal.deep(await plain_workload(url, secret))
    result["plain"] = await auditor_view(api, session_id, "curl=posted", normal)

    rails = await named_role(api, "golden-rails")
    rail = await api.guardrail(rails, input_rules=[{"type": "deny_words_list", "words": ["drop table"]},
                                            {"type": "pattern_match", "pattern_regex": r"ssn=\d{3}"}],
                        output_rules=[{"type": "deny_words_list", "words": ["top secret"]}])
    normal.replacements[rail["name"]] = "<rail>"
    secret, rails_session = await api.credential(rails)
    normal.replacements[secret] = "<secret>"
    normal.replacements[rails_session] = "<session>"
    result["rails_client"] = normal.deep(await rails_workload(url, secret))
    result["rails"] = await auditor_view(api, rails_session, "last=1", normal)
    result["rails_audit"] = audit_view(await api.audit("guardrail.block"), rails_session, normal)

    again = await named_role(api, "golden-again")
    secret, again_session = await api.credential(again)
    normal.replacements[secret] = "<secret>"
    normal.replacements[again_session] = "<session>"
    result["again_client"] = normal.deep(await repeated_workload(api, again, url, secret))
    result["again"] = await auditor_view(api, again_session, "last=1", normal)

    masked = await named_role(api, "golden-masked")
    await api.guardrail(masked, output_rules=[{"type": "mask", "patterns": ["card_number", "email"]},
                                              {"type": "mask", "columns": ["ssn"], "style": "last4"}])
    secret, masked_session = await api.credential(masked)
    normal.replacements[secret] = "<secret>"
    normal.replacements[masked_session] = "<session>"
    result["masked_client"] = normal.deep(await masked_workload(url, secret))
    result["masked"] = await auditor_view(api, masked_session, "last=1", normal)

    down = await named_role(api, "golden-down", f"http://127.0.0.1:{dead}")
    secret, down_session = await api.credential(down)
    normal.replacements[secret] = "<secret>"
    result["down_client"] = normal.deep(await down_workload(url, secret))
    result["down"] = await auditor_view(api, down_session, "GET /json", normal)

    text = json.dumps(result, indent=1, ensure_ascii=False, sort_keys=True) + "\n"
    if os.environ.get("GATEWAYD_WRITE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(text)
    elif os.environ.get("GATEWAYD_GOLDEN_DIFF"):  # where to write this run's view, to diff it with the golden file
        Path(os.environ["GATEWAYD_GOLDEN_DIFF"]).write_text(text)
    golden = json.loads(GOLDEN.read_text())
    for key in sorted(set(golden) | set(result)):  # one section at a time: a failure names what changed
        assert result.get(key) == golden.get(key), key
