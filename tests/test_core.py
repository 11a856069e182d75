"""Core services in-process: recording batches, access refusals, multi-tenant signup."""

from __future__ import annotations

import asyncio
import base64
import threading

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gatewayd.access import AccessDenied
from gatewayd.config import load_config
from gatewayd.daemon import Gateway
from gatewayd.models import Connection, User, new_id, rfc3339, utcnow
from gatewayd.recording import HIGH_WATER
from gatewayd.store import AuditFilter
from tests.conftest import core_gateway, free_port


@pytest.fixture
async def core(tmp_path, store_settings):
    """The core services on each store backend."""
    async with core_gateway(tmp_path, store_settings) as gateway:
        yield gateway


async def a_connection(core: Gateway, subtype: str = "postgres") -> Connection:
    org = await core.store.default_org()
    conn = Connection(id=new_id(), org_id=org.id, name=f"c-{new_id()[:6]}", resource_name="r", type="database",
                      subtype=subtype, secret={"envvar:PASS": "c2VjcmV0"})
    await core.store.create_connection(conn)
    return conn


async def test_recorder_flushes_on_its_interval_and_keeps_order(core):
    user = await core.identity.ensure_local_user("rec@example.com")
    live = await core.sessions.open(user, await a_connection(core))
    for n in range(50):
        live.recorder.input(f"q{n}")
        live.recorder.output(f"r{n}")
    await asyncio.sleep(0.4)  # no close yet: the flusher alone must have written them
    events = await core.store.read_events(live.id)
    assert [e.data.decode() for e in events] == [x for n in range(50) for x in (f"q{n}", f"r{n}")]
    assert (await core.store.get_session(live.id)).event_size == sum(len(e.data) for e in events)
    await live.close(exit_code=3)
    session = await core.store.get_session(live.id)
    assert session.status == "done" and session.exit_code == 3 and session.end_date


async def test_a_session_whose_task_is_cancelled_as_it_closes_is_sealed_and_its_sealing_recorded(core):
    """The listeners' stop cancels the proxies' tasks; a session that was closing then (its client had left) had its
    end cut short, between the seal and its entry in the audit chain, and ``verify`` said the seal was not in the
    audit log. The end goes on as the session manager's task, and its shutdown waits for it."""
    user = await core.identity.ensure_local_user("closing@example.com")
    live = await core.sessions.open(user, await a_connection(core))
    live.recorder.input(b"select 1")
    closing = asyncio.create_task(live.close(exit_code=0))
    await asyncio.sleep(0)
    await asyncio.sleep(0)  # inside its end now
    assert not live.finished.is_set()
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    await core.sessions.shutdown(0)  # what the gateway's stop does next
    assert live.finished.is_set()
    session = await core.store.get_session(live.id)
    assert session.status == "done" and session.exit_code == 0 and session.seal, session
    assert [s["seal"] for s in await core.store.sealings(live.id)] == [session.seal]
    result = await core.recording.verify(session)
    assert result.verified and result.sealed, result


async def test_events_go_in_as_multi_row_inserts_in_order_up_to_the_cap(core):
    """Every chunk size of the store's multi-row INSERT (256, 64, 16, 4, 1), two sessions in one batch, the cap."""
    user = await core.identity.ensure_local_user("chunks@example.com")
    conn = await a_connection(core)
    first, second = await core.sessions.open(user, conn), await core.sessions.open(user, conn)
    second.recorder.cap = 2000
    for n in range(345):  # 256 + 64 + 16 + 4 + 4 + 1
        first.recorder.input(f"q{n}")
    for n in range(500):  # 5 bytes each: the cap of 2000 cuts it at 400 events
        second.recorder.output(f"r{n:04d}")
    await core.recording.flush()
    for n in range(345, 352):  # a second flush goes on after the first's last sequence number
        first.recorder.input(f"q{n}")
    await first.close(exit_code=0)
    await second.close(exit_code=0)
    events = await core.store.read_events(first.id)
    assert [e.data.decode() for e in events] == [f"q{n}" for n in range(352)]
    assert {e.kind for e in events} == {"i"}
    offsets = [e.offset_ms for e in events]
    assert offsets == sorted(offsets)
    capped = await core.store.read_events(second.id)
    assert [e.data.decode() for e in capped[:-1]] == [f"r{n:04d}" for n in range(400)]
    assert capped[-1].kind == "e" and b"recording truncated" in capped[-1].data
    assert sum(len(e.data) for e in capped[:-1]) <= 2000
    assert (await core.store.get_session(second.id)).metrics.get("truncated") is True


async def test_drain_bounds_pending_memory(core):
    user = await core.identity.ensure_local_user("big@example.com")
    live = await core.sessions.open(user, await a_connection(core))
    chunk = b"x" * 65536
    peak = 0
    for _ in range(400):  # 25 MiB through one recorder
        live.recorder.output(chunk)
        peak = max(peak, live.recorder.pending_bytes)
        await live.recorder.drain()
    assert peak <= HIGH_WATER + len(chunk)
    await live.close(exit_code=0)
    assert (await core.store.get_session(live.id)).event_size == 400 * len(chunk)


async def test_access_refusals_say_why_and_are_audited(core):
    user = await core.identity.ensure_local_user("acc@example.com")
    conn = await a_connection(core)
    issued = await core.access.issue(user, conn, 60)
    grant = await core.access.resolve(issued.secret, "postgres", "10.1.2.3")
    assert grant.user.id == user.id and grant.connection.id == conn.id
    assert grant.connection.secret == {"envvar:PASS": "c2VjcmV0"} and grant.connection.target()["PASS"] == "secret"
    with pytest.raises(AccessDenied, match="not for a ssh connection"):
        await core.access.resolve(issued.secret, "ssh")
    await core.store.revoke_credentials(session_id=issued.credential.session_id, revoked_at=rfc3339(utcnow()))
    with pytest.raises(AccessDenied, match="revoked"):
        await core.access.resolve(issued.secret, "postgres")
    again = await core.access.issue(user, conn, 60)
    user.status = "inactive"
    await core.store.save_user(user)
    with pytest.raises(AccessDenied, match="inactive"):
        await core.access.resolve(again.secret, "postgres")
    with pytest.raises(AccessDenied, match="unknown secret"):
        await core.access.resolve("", "postgres")
    page = await core.store.list_audit(AuditFilter(action="postgres.login"))
    assert [e.outcome for e in reversed(page.items)] == ["success", "failure", "failure", "failure"]
    wrong_protocol = await core.store.list_audit(AuditFilter(action="ssh.login"))
    assert [e.error_message for e in wrong_protocol.items] == ["invalid credential: it is not for a ssh connection"]
    assert page.items[-1].client_ip == "10.1.2.3"
    assert all(issued.secret not in str(e) for e in page.items)


async def test_multi_tenant_signup(tmp_path):
    from control.app import make_app

    config = load_config(None, environ={}, overrides={
        "data_dir": str(tmp_path / "mt"), "api.listen": f"127.0.0.1:{free_port()}", "auth.multi_tenant": True,
        "listeners.postgres": "", "listeners.ssh": "", "listeners.rdp": "", "listeners.http": "",
        "listeners.mysql": ""})
    gateway = Gateway(config, app_factory=make_app)
    await gateway.start()
    try:
        newcomer = User(id=new_id(), org_id=None, subject="oidc|123", email="new@example.com", name="New")
        await gateway.store.save_user(newcomer)
        token = gateway.identity.issue_token(newcomer)
        base = f"http://{config['api.listen']}/api"
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as http:
            async with http.get(f"{base}/sessions") as r:
                assert r.status == 403 and "sign up" in (await r.json())["message"]
            async with http.post(f"{base}/signup", json={"profile_name": "N"}) as r:
                assert r.status == 400 and (await r.json())["message"] == "field 'org_name' is required"
            async with http.post(f"{base}/signup", json={"org_name": "Acme", "profile_name": "Nova",
                                                         "profile_picture": "https://x/p.png"}) as r:
                body = await r.json()
                assert r.status == 201 and body["org_name"] == "Acme" and body["profile_name"] == "Nova"
                assert body["profile_picture"] == "https://x/p.png" and body["org_id"]
            async with http.post(f"{base}/signup", json={"org_name": "Again"}) as r:
                assert r.status == 409
            async with http.get(f"{base}/userinfo") as r:
                me = await r.json()
                assert me["org_id"] == body["org_id"] and me["org_name"] == "Acme" and me["is_admin"]
                assert me["tenancy_type"] == "multitenant"
            async with http.get(f"{base}/sessions") as r:
                assert r.status == 200 and (await r.json())["total"] == 0
    finally:
        await gateway.stop()


async def test_guard_rail_cache_and_cached_follow_invalidate(core):
    """``cached`` and ``rules_for`` share one cache; a load that raced a change is not kept."""
    conn = await a_connection(core)
    service = core.guardrails
    assert service.cached(conn.id) is None
    rules = await service.rules_for(conn)
    assert service.cached(conn.id) is rules
    service.invalidate()
    assert service.cached(conn.id) is None  # a proxy holding only cached() falls back to rules_for
    real = service.store.list_guardrails

    async def changed_meanwhile(org_id, connection_id):
        found = await real(org_id, connection_id)
        service.invalidate()  # an API change lands while this load awaits the store
        return found

    service.store.list_guardrails = changed_meanwhile
    try:
        await service.rules_for(conn)
    finally:
        service.store.list_guardrails = real
    assert service.cached(conn.id) is None


def test_target_port_defaults_and_refuses_typos():
    from gatewayd.models import target_port

    assert target_port({}, 5432) == 5432
    assert target_port({"PORT": " 2222 "}, 22) == 2222
    assert [target_port({"PORT": bad}, 22) for bad in ("54x32", "0", "65536", "-1")] == [0, 0, 0, 0]


async def test_two_processes_claim_a_credential_s_issued_session_once(tmp_path, store_settings):
    """Two gateways on one store (as two processes): one connection claims the issued session, the other
    gets a session of its own; the claim is the store's, not an in-memory set's."""
    from gatewayd.models import Credential
    from gatewayd.protocols import session_for

    async with core_gateway(tmp_path, store_settings) as one, core_gateway(tmp_path, store_settings) as two:
        conn = await a_connection(one)
        org = await one.store.default_org()
        user = User(id=new_id(), org_id=org.id, subject="sub-claim", email="claim@example.com")
        issued = session_for(user, conn, status="ready")
        now = rfc3339(utcnow())
        cred = Credential(id=new_id(), org_id=org.id, user_id=user.subject, connection_id=conn.id,
                          connection_name=conn.name, secret_hash=new_id(), session_id=issued.id,
                          expire_at="2999-01-01T00:00:00Z", created_at=now)
        await one.store.create_credential(cred, issued)
        lives = await asyncio.gather(one.sessions.open(user, conn, credential=cred),
                                     two.sessions.open(user, conn, credential=cred))
        assert sorted(live.id == issued.id for live in lives) == [False, True]
        for live in lives:
            await live.close(exit_code=0)
        assert (await one.store.get_session(issued.id)).status == "done"


async def test_killing_a_session_no_process_runs_records_the_request_and_closes_it(core):
    from gatewayd.models import Credential
    from gatewayd.protocols import session_for

    conn = await a_connection(core)
    org = await core.store.default_org()
    user = User(id=new_id(), org_id=org.id, subject="sub-kill", email="kill@example.com")
    issued = session_for(user, conn, status="ready")
    cred = Credential(id=new_id(), org_id=org.id, user_id=user.subject, connection_id=conn.id,
                      connection_name=conn.name, secret_hash=new_id(), session_id=issued.id,
                      expire_at="2999-01-01T00:00:00Z", created_at=rfc3339(utcnow()))
    await core.store.create_credential(cred, issued)
    assert await core.sessions.kill(issued.id, "killed by admin@example.com") is True
    stored = await core.store.get_session(issued.id)
    assert (stored.status, stored.exit_code, stored.kill_reason) == ("done", 254, "killed by admin@example.com")
    assert [e.data for e in await core.store.read_events(issued.id, "e")] == [b"killed by admin@example.com"]
    assert await core.sessions.kill(issued.id, "again") is False
    live = await core.sessions.open(user, conn, credential=cred)  # the killed session is never claimed
    assert live.id != issued.id
    await live.close(exit_code=0)



def test_a_daemon_and_its_host_commands_on_a_postgres_store(tmp_path, pg_store):
    """``gatewayd run`` on a PostgreSQL store: a token minted by the host command (no SQLite file anywhere)
    works on the API; the start line names the store with its password as ***."""
    import json
    import urllib.request

    from tests.conftest import Daemon, new_store_database_now

    url = new_store_database_now(pg_store)
    daemon = Daemon(tmp_path / "data", {"store.driver": "postgres", "store.url": url}).start()
    try:
        token = daemon.token("pg-store@example.com", groups="admin")
        request = urllib.request.Request(f"{daemon.url}/userinfo", headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert json.loads(response.read())["email"] == "pg-store@example.com"
    finally:
        assert daemon.stop() == 0
    assert not (tmp_path / "data" / "gatewayd.db").exists()
    log = daemon.log_text()
    assert pg_store.password not in log
    started = next(json.loads(line) for line in log.splitlines() if "gatewayd started" in line)
    assert started["store"] == f"the PostgreSQL store {url.replace(pg_store.password, '***')}"


async def test_a_recording_is_unpacked_and_rendered_off_the_event_loop(core, monkeypatch):
    """Reading a session's recording through the API (its events, as text, as csv/json statements, verified):
    the events are unpacked and the answers rendered in threads, never on the loop every proxy is served on."""
    from aiohttp.test_utils import TestServer

    import control.sessions
    import gatewayd.store.queries.sessions
    from control.app import make_app

    ran_on: dict[str, set[int]] = {}

    def spy(module: object, name: str) -> None:
        real = getattr(module, name)

        def watched(*args, **kwargs):
            ran_on.setdefault(name, set()).add(threading.get_ident())
            return real(*args, **kwargs)
        monkeypatch.setattr(module, name, watched)

    spy(gatewayd.store.queries.sessions, "unpack_events")
    spy(control.sessions, "session_json")
    spy(control.sessions, "statements_of")
    user = await core.identity.ensure_local_user("reader@example.com", groups=["admin"])
    live = await core.sessions.open(user, await a_connection(core))
    for n in range(3000):
        live.recorder.input(f"SELECT {n};")
        live.recorder.output(f"?column?\n{n}\n")
    await live.close(exit_code=0)
    loop_thread = threading.get_ident()
    headers = {"Authorization": f"Bearer {core.identity.issue_token(user)}"}
    async with TestServer(make_app(core.services())) as server, aiohttp.ClientSession(headers=headers) as http:
        last = {"expand=event_stream": base64.b64encode(b"SELECT 2999;"), "event_stream=utf8": b"\\n2999\\n",
                "format=csv": b"SELECT 2999;", "format=json": b"SELECT 2999;"}
        for query, expected in last.items():
            async with http.get(server.make_url(f"/api/sessions/{live.id}?{query}")) as response:
                assert response.status == 200, await response.text()
                body = await response.read()
            assert expected in body, query
        async with http.get(server.make_url(f"/api/sessions/{live.id}/verify")) as response:
            assert response.status == 200 and (await response.json())["verified"] is True
    assert set(ran_on) == {"unpack_events", "session_json", "statements_of"}
    assert all(loop_thread not in threads for threads in ran_on.values()), ran_on


JSON_KEYS = st.one_of(st.text(st.characters(codec=None), max_size=4), st.integers(), st.booleans(), st.none())
JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
              st.text(st.characters(codec=None), max_size=6)),  # lone surrogates too (codec=None)
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(JSON_KEYS, inner, max_size=4)),
    max_leaves=20)


@settings(max_examples=400, deadline=None)
@given(JSON_VALUES)
def test_an_answer_reads_as_the_stdlib_writes_it_whatever_it_holds(data):
    """``ok`` (orjson, the stdlib where orjson refuses) answers what the stdlib's encoder answered before it: the
    same value read back, for integers past 64 bits, keys that are not strings and strings with lone surrogates."""
    import json

    from control.http import ok

    answer = ok(data)
    assert answer.headers["Content-Type"] == "application/json; charset=utf-8"
    assert json.loads(answer.body) == json.loads(json.dumps(data, separators=(",", ":")))


def test_an_answer_with_what_orjson_refuses_is_the_stdlibs():
    """The cases orjson refuses, each alone (the property above finds them only by chance)."""
    import json

    from control.http import ok

    for data in ({"total": 2 ** 70}, {"text": "\ud800 half a pair"}, {"nested": [{"n": -(2 ** 64)}]}):
        assert ok(data).body == json.dumps(data, separators=(",", ":")).encode()
    assert json.loads(ok({1: "a", None: "b"}).body) == {"1": "a", "null": "b"}


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=5), st.one_of(st.none(), st.integers(), st.text(max_size=8)), max_size=4),
       st.text(max_size=5),
       st.one_of(st.text(max_size=2500), st.lists(st.text(max_size=2500), max_size=3),
                 st.lists(st.one_of(st.text(max_size=4), st.lists(st.integers(), max_size=3)), max_size=4500)),
       st.integers(min_value=1, max_value=7))
def test_an_answer_encoded_in_slices_reads_as_the_answer_encoded_whole(rest, key, long, slice_size):
    """``ok_in_slices`` (an answer's long list or string encoded a slice at a time, off the event loop) gives the
    JSON ``ok`` gives, whatever the slices cut through: escapes, characters beyond the BMP, empty values."""
    import json

    import control.http
    from control.http import ok, ok_in_slices

    data = {**rest, key: long}
    saved = control.http.SLICE
    control.http.SLICE = slice_size  # small slices: many cuts, through every kind of character
    try:
        sliced = ok_in_slices(data, key)
    finally:
        control.http.SLICE = saved
    assert sliced.headers["Content-Type"] == ok(data).headers["Content-Type"] == "application/json; charset=utf-8"
    assert json.loads(sliced.body) == json.loads(ok(data).text) == data
