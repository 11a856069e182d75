"""Finding and following sessions through the API (issue 34 and issue 35's item 5): the session search of
GET /sessions, GET /search, download links, the result as a text stream, metadata, and the event stream --
against a real daemon whose sessions real psql clients made through its PostgreSQL listener."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from typing import Any

import aiohttp
import pytest

from tests.apiclient import Api, postgres_env
from tests.conftest import proxy_daemon
from tests.pgpeer import unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    daemon = proxy_daemon(tmp_path_factory, "sessionroutes", "postgres", wait=True)
    yield daemon
    assert daemon.stop() == 0


def psql(gateway, secret: str, database: str = "postgres", **kw: Any) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    return subprocess.Popen(
        ["psql", "-X", "-At", f"postgres://{secret}:any@127.0.0.1:{gateway.proxy_port}/{database}?sslmode=disable"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **kw)


@pytest.fixture(scope="module")
async def world(gateway, pg_target):
    async with aiohttp.ClientSession() as http:
        ada = Api(gateway, http, gateway.token("ada@example.com", groups="admin", name="Ada Admin"))
        rita_token = gateway.token("rita.dev@example.com", groups="dev", name="Rita Developer")
        rita = Api(gateway, http, rita_token)
        pg = await ada.connection("orders-db", "database", "postgres", postgres_env(pg_target))
        secret, session_id = await ada.credential(pg, token=rita_token)
        done = psql(gateway, secret)
        out, err = done.communicate("select 'typed-' || 'by-rita' as said;\nselect 6 * 7;\n", timeout=60)
        assert done.returncode == 0 and "typed-by-rita" in out, err
        await ada.done_session(session_id)
        yield {"ada": ada, "rita": rita, "pg": pg, "session": session_id, "rita_token": rita_token}


async def test_the_session_list_finds_by_part_of_a_user_protocol_status_and_text(world):
    ada, session = world["ada"], world["session"]

    async def found(query: str) -> list[str]:
        status, page = await ada("GET", f"/sessions?{query}")
        assert status == 200, page
        return [s["id"] for s in page["data"]]

    assert session in await found("user=RITA.DEV")  # part of the e-mail, any case (was: the exact subject only)
    assert session in await found("user=developer")  # part of the name
    assert session not in await found("user=ada")
    assert session in await found("search=AS%20SAID")  # what was typed, any case
    assert session not in await found("search=typed-by-rita")  # ... not what was answered
    assert await found("search=as%20said&protocol=ssh") == []
    assert session in await found("protocol=postgres&status=done")
    status, body = await ada("GET", "/sessions?search=ab")
    assert status == 422 and "at least 3 characters" in body["message"]
    status, body = await ada("GET", "/sessions?status=sleeping")
    assert status == 422


async def test_search_finds_connections_and_sessions_by_name(world):
    ada, rita, session = world["ada"], world["rita"], world["session"]
    status, found = await ada("GET", "/search?term=ORDERS")
    assert status == 200, found
    assert [c["name"] for c in found["connections"]] == [world["pg"]["name"]]
    assert found["connections"][0]["status"] == "online" and found["runbooks"] == [] and found["errors"] == []
    assert session in [s["id"] for s in found["sessions"]]
    status, found = await ada("GET", f"/search?term={session[:8]}")  # the start of an id
    assert [s["id"] for s in found["sessions"]] == [session]
    status, mine = await rita("GET", "/search?term=ada")  # a regular user finds only their own sessions
    assert status == 200 and mine["sessions"] == []
    status, body = await ada("GET", "/search")
    assert status == 400 and body == {"message": "term parameter is required"}


async def test_a_download_link_works_once_without_a_token_and_only_for_who_may_download(gateway, world):
    ada, rita, session = world["ada"], world["rita"], world["session"]
    status, link = await rita("GET", f"/sessions/{session}?extension=txt&newline=1&events=i")
    assert status == 200 and set(link) == {"download_url", "expire_at"}, link
    assert link["download_url"].startswith(f"{gateway.url}/sessions/{session}/download?token=")
    async with aiohttp.ClientSession() as anonymous:  # a browser's download: no bearer token
        async with anonymous.get(link["download_url"]) as answer:
            assert answer.status == 200
            assert answer.headers["Content-Type"] == "application/octet-stream"
            assert "attachment" in answer.headers["Content-Disposition"] and session in \
                answer.headers["Content-Disposition"]
            text = await answer.text()
        assert text == "select 'typed-' || 'by-rita' as said;\nselect 6 * 7;\n"
        async with anonymous.get(link["download_url"]) as again:  # once
            assert again.status == 404
        async with anonymous.get(f"{gateway.url}/sessions/{session}/download?token=guessed") as guessed:
            assert guessed.status == 404
        status, link = await ada("GET", f"/sessions/{session}?extension=json")
        async with anonymous.get(link["download_url"]) as answer:
            events = json.loads(await answer.read())
        assert {e["type"] for e in events} <= {"o", "e"} and any("typed-by-rita" in e["stream"] for e in events)
        status, link = await ada("GET", f"/sessions/{session}?extension=csv")
        async with anonymous.get(link["download_url"]) as answer:
            assert (await answer.text()).startswith("offset_ms,statement,output,error")
        status, link = await ada("GET", f"/sessions/{session}?extension=txt&blob-type=session_input")
        assert "/download/input?token=" in link["download_url"]
        async with anonymous.get(link["download_url"]) as answer:
            assert "select 6 * 7;" in await answer.text()
    other = Api(gateway, rita.http, gateway.token("olga@example.com", groups="dba"))
    status, body = await other("GET", f"/sessions/{session}?extension=txt")
    assert status == 403
    status, body = await ada("GET", f"/sessions/{session}?extension=../x")
    assert status == 422


async def test_metadata_is_replaced_by_the_sessions_owner_only(world):
    ada, rita, session = world["ada"], world["rita"], world["session"]
    status, _ = await rita("PATCH", f"/sessions/{session}/metadata", {"metadata": {"ticket": "INC-42"}})
    assert status == 204
    status, got = await ada("GET", f"/sessions/{session}")
    assert got["metadata"] == {"ticket": "INC-42"}
    status, body = await ada("PATCH", f"/sessions/{session}/metadata", {"metadata": {}})
    assert status == 404  # as hoop.dev does: the owner's sessions only
    status, body = await rita("PATCH", f"/sessions/{session}/metadata", {"metadata": "nope"})
    assert status == 422


async def test_the_result_stream_and_the_event_stream_follow_a_running_session(gateway, world):
    """The result as text, and the events as server-sent events, come while psql is still connected."""
    ada = world["ada"]
    secret, session_id = await ada.credential(world["pg"], token=world["rita_token"])
    client = psql(gateway, secret)
    try:
        client.stdin.write("select 'first-' || 'result';\n")
        client.stdin.flush()
        assert client.stdout.readline() == "first-result\n"
        headers = ada.headers
        async with ada.http.get(f"{gateway.url}/sessions/{session_id}/result/stream?newline=1",
                                headers=headers) as text_stream, \
                ada.http.get(f"{gateway.url}/sessions/{session_id}/stream", headers=headers) as events:
            assert text_stream.status == 200 and events.status == 200
            assert events.headers["Content-Type"].startswith("text/event-stream")
            assert "first-result" in await read_text(text_stream, "first-result")
            seen = await read_events(events, until=lambda e: "first-result" in e.get("payload_text", ""))
            assert seen[0][0] == "session" and seen[0][1]["status"] == "open"
            client.stdin.write("select 'second-' || 'result';\n")
            client.stdin.flush()
            assert client.stdout.readline() == "second-result\n"
            assert "second-result" in await read_text(text_stream, "second-result")
            await read_events(events, until=lambda e: "second-result" in e.get("payload_text", ""))
            client.stdin.close()
            assert client.wait(60) == 0
            ended = await read_events(events, until=lambda e: e.get("event") == "end")
            assert ended[-1][1]["status"] == "done"
            assert (await text_stream.content.read()) is not None  # the text stream ends with the session
        status, watched = await ada("GET", "/audit/logs?action=session.watch")
        assert any(e["request_payload_redacted"]["session_id"] == session_id for e in watched["data"])
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()


async def test_a_stream_ends_when_its_token_is_signed_out(gateway, world):
    """A stream outlives its first check: a token signed out (a deactivation, an expiry, a lost group alike) ends
    the streams it opened within a few seconds, before what the session does next reaches them (both streams
    went on for as long as the session lasted)."""
    ada = world["ada"]
    secret, session_id = await ada.credential(world["pg"], token=world["rita_token"])
    watcher = gateway.token("rita.dev@example.com", groups="dev")  # the session's owner, on another device
    client = psql(gateway, secret)
    try:
        client.stdin.write("select 'before-' || 'signout';\n")
        client.stdin.flush()
        assert client.stdout.readline() == "before-signout\n"
        headers = {"Authorization": f"Bearer {watcher}"}
        async with ada.http.get(f"{gateway.url}/sessions/{session_id}/result/stream?newline=1",
                                headers=headers) as text_stream, \
                ada.http.get(f"{gateway.url}/sessions/{session_id}/stream", headers=headers) as events:
            assert text_stream.status == 200 and events.status == 200
            await read_text(text_stream, "before-signout")
            await read_events(events, until=lambda e: "before-signout" in e.get("payload_text", ""))
            assert await ada("POST", "/logout", token=watcher) == (204, None)
            for stream in (text_stream, events):  # each ends by itself, the session still open
                rest = await asyncio.wait_for(stream.content.read(), 12)
                assert b"after-signout" not in rest, rest
            client.stdin.write("select 'after-' || 'signout';\n")
            client.stdin.flush()
            assert client.stdout.readline() == "after-signout\n"
        status, again = await ada("GET", f"/sessions/{session_id}/stream", token=watcher)
        assert status == 401, again
        status, watched = await ada("GET", "/audit/logs?action=session.watch&page_size=100")
        ended = [e for e in watched["data"] if e["outcome"] == "failure"
                 and e["request_payload_redacted"]["session_id"] == session_id]
        assert len(ended) == 2 and all("token is refused" in e["error_message"] for e in ended), ended
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()


async def read_text(response: aiohttp.ClientResponse, needle: str) -> str:
    seen = ""
    while needle not in seen:
        line = await asyncio.wait_for(response.content.readline(), 30)
        assert line, f"the stream ended before {needle!r}: {seen!r}"
        seen += line.decode()
    return seen


async def read_events(response: aiohttp.ClientResponse, until) -> list[tuple[str, dict]]:
    """Server-sent events until one ``until`` accepts (its dict has ``event`` and, for recorded events, the decoded
    ``payload_text``)."""
    import base64

    seen: list[tuple[str, dict]] = []
    name, data = "message", []
    while True:
        raw = await asyncio.wait_for(response.content.readline(), 30)
        assert raw, f"the stream ended: {seen}"
        line = raw.decode().rstrip("\n")
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())
        elif not line and data:
            body = json.loads("\n".join(data))
            if name == "event":
                body["payload_text"] = base64.b64decode(body["payload"]).decode("utf-8", "replace")
            seen.append((name, body))
            if until({**body, "event": name}):
                return seen
            name, data = "message", []
