"""The store contract: every backend passes this suite unchanged.

Backends come from one fixture, ``backend`` (``params`` ``"postgres"`` and ``"sqlite"``; a
PostgreSQL backend gets a fresh database of the session's store cluster per test). A ``Backend`` is one database: ``open()`` gives a
new, migrated handle on it, as another process would get; tests that need two processes (the
claim, the guard-rail generation) open two. Real databases, no mocks. A few checks read
the database itself (schema versions, that secrets are sealed) through ``store.db``, the
connector every ``SQLStore`` backend has.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gatewayd.crypto import SecretBox
from gatewayd.evidence import EventBatch, Sealer, batch_hash, pack_events, verify_recording
from gatewayd.guardrails import GuardRailService
from gatewayd.models import (
    CHAIN_GENESIS,
    AccessRequestRule,
    Agent,
    AIAnalyzerRule,
    AIProvider,
    AuditEntry,
    Connection,
    Credential,
    GuardRail,
    Node,
    Resource,
    Review,
    ReviewGroup,
    Session,
    SessionEvent,
    User,
    new_id,
)
from gatewayd.store import AuditFilter, Conflict, NotFound, SessionFilter, Store
from gatewayd.store import queries
from gatewayd.store.queries import sessions as session_queries
from gatewayd.store.sql import in_order, insert
from gatewayd.store.migrations import MIGRATIONS

NOW = "2026-01-02T03:04:05Z"


@dataclass
class Backend:
    """One database of a backend; ``open`` gives another migrated handle on it."""

    name: str
    make: Callable[[], Store]
    handles: list[Store] = field(default_factory=list)

    async def open(self) -> Store:
        store = self.make()
        await store.open()
        self.handles.append(store)
        return store


def _sqlite(tmp_path: Path, box: SecretBox) -> Callable[[], Store]:
    from gatewayd.store.sqlite import SQLiteStore

    return lambda: SQLiteStore(tmp_path / "contract" / "gatewayd.db", box)


async def _postgres(request, box: SecretBox) -> Callable[[], Store]:
    """A fresh database in the session's store cluster (tests/conftest.py pg_store)."""
    from gatewayd.store.postgres import PostgresStore
    from tests.conftest import new_store_database

    url = await new_store_database(request.getfixturevalue("pg_store"))
    return lambda: PostgresStore(url, box)


async def _sqlite_backend(request, box: SecretBox) -> Callable[[], Store]:
    return _sqlite(request.getfixturevalue("tmp_path"), box)


BACKENDS = {"sqlite": _sqlite_backend, "postgres": _postgres}


@pytest.fixture(params=sorted(BACKENDS))
async def backend(request) -> AsyncIterator[Backend]:
    box = SecretBox(os.urandom(32))
    found = Backend(request.param, await BACKENDS[request.param](request, box))
    yield found
    for store in reversed(found.handles):
        await store.close()


@pytest.fixture
async def store(backend: Backend) -> Store:
    return await backend.open()


# ---------------------------------------------------------------------------- helpers

async def an_org(store: Store) -> str:
    return (await store.default_org()).id


def a_session(org_id: str, *, status: str = "open", start: str = NOW, user: str = "sub-alice",
              connection: str = "pg", type: str = "database", **extra) -> Session:
    fields = {"tags": {"team": "a"}, "metadata": {"k": [1, 2]}, **extra}
    return Session(id=new_id(), org_id=org_id, user_id=user, user_email=f"{user}@example.com", user_name=user,
                   connection=connection, connection_id=f"id-{connection}", resource_name="res", type=type,
                   subtype="postgres", status=status, start_date=start, **fields)


def a_connection(org_id: str, name: str, resource: str = "res") -> Connection:
    return Connection(id=new_id(), org_id=org_id, name=name, resource_name=resource, type="database",
                      subtype="postgres", command=["psql"], secret={"HOST": "127.0.0.1", "PASS": "s3cret"},
                      tags={"env": "prod"}, settings={"x": 1}, created_at=NOW, updated_at=NOW)


def a_rail(org_id: str, name: str, connection_ids: list[str]) -> GuardRail:
    return GuardRail(id=new_id(), org_id=org_id, name=name, description="d", connection_ids=connection_ids,
                     input={"rules": [{"type": "deny_words_list", "words": ["drop"]}]}, output={},
                     created_at=NOW, updated_at=NOW)


def events(n: int, start: int = 0) -> list[SessionEvent]:
    return [SessionEvent(start + i, "io"[i % 2], f"event {start + i}".encode() + b"\x00\xff") for i in range(n)]


# ---------------------------------------------------------------------------- migrations

async def test_migrations_run_on_an_empty_database_and_reopening_is_idempotent(backend: Backend):
    store = await backend.open()
    versions = [r[0] for r in await store.db.fetch("SELECT version FROM schema_migrations ORDER BY version")]
    assert versions == [v for v, _ in MIGRATIONS]
    org = await an_org(store)
    session = a_session(org)
    await store.create_session(session)
    await store.close()
    backend.handles.remove(store)
    again = await backend.open()  # applies nothing twice, loses nothing
    assert [r[0] for r in await again.db.fetch("SELECT version FROM schema_migrations ORDER BY version")] == versions
    assert (await again.get_session(session.id)).metadata == {"k": [1, 2]}
    assert await again.guardrail_generation() == 0
    assert (await again.default_org()).id == org


async def test_a_store_of_the_previous_version_is_migrated_with_its_data(backend: Backend, monkeypatch):
    monkeypatch.setattr(queries, "MIGRATIONS", [m for m in MIGRATIONS if m[0] < 7])
    old = await backend.open()
    org = await an_org(old)
    await old.db.transact(in_order([(
        "INSERT INTO sessions (id, org_id, user_id, user_email, connection, connection_id, type, subtype, verb, "
        "status, start_date) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        ("s-old", org, "u", "u@example.com", "pg", "c", "database", "postgres", "connect", "ready", NOW))]))
    await old.close()
    backend.handles.remove(old)
    monkeypatch.setattr(queries, "MIGRATIONS", MIGRATIONS)
    store = await backend.open()
    session = await store.get_session("s-old")
    assert session.status == "ready" and session.claimed_at is None and session.kill_requested_at is None
    assert (await store.claim_session("s-old", NOW)).status == "open"
    assert await store.guardrail_generation() == 0


# ---------------------------------------------------------------------------- people

async def test_users_and_groups_round_trip(store: Store):
    org = await an_org(store)
    alice = await store.save_user(User(id=new_id(), org_id=org, subject="sub-a", email="Alice@Example.com",
                                       name="Alice", groups=["dba", "admin"], operator=True,
                                       granted_groups=["dba", "admin"], federated=True))
    bob = await store.save_user(User(id=new_id(), org_id=org, subject="sub-b", email="bob@example.com",
                                     groups=["dba"], granted_groups=["dba"]))
    got = await store.get_user(email="alice@example.COM")
    assert (got.id, got.groups, got.operator, got.federated, got.granted_groups) == \
        (alice.id, ["admin", "dba"], True, True, ["dba", "admin"])
    assert (await store.get_user(subject="sub-b")).id == bob.id
    assert (await store.get_user(id=bob.id)).operator is False
    assert [u.email for u in await store.list_users(org)] == ["Alice@Example.com", "bob@example.com"]
    assert await store.list_groups(org) == ["admin", "dba"]
    alice.name, alice.groups = "Alice A", ["admin"]
    await store.save_user(alice)
    assert ((await store.get_user(id=alice.id)).name, (await store.get_user(id=alice.id)).groups) == \
        ("Alice A", ["admin"])
    with pytest.raises(Conflict):
        await store.save_user(User(id=new_id(), org_id=org, subject="sub-a", email="other@example.com"))
    await store.delete_group(org, "dba")
    assert (await store.get_user(id=bob.id)).groups == []
    assert (await store.get_user(id=bob.id)).granted_groups == []
    assert (await store.get_user(id=alice.id)).granted_groups == ["admin"]
    with pytest.raises(NotFound):
        await store.delete_group(org, "dba")
    await store.create_group(org, "ops")
    with pytest.raises(Conflict):
        await store.create_group(org, "ops")
    await store.delete_user(bob.id)
    assert await store.get_user(id=bob.id) is None
    other = await store.create_org("second")
    assert (await store.get_org(other.id)).name == "second"
    assert await store.list_users(other.id) == []


async def test_resources_and_connections_round_trip_with_sealed_secrets(store: Store):
    org = await an_org(store)
    res = Resource(id=new_id(), org_id=org, name="res", type="database", subtype="postgres",
                   env_vars={"A": "1"}, created_at=NOW, updated_at=NOW)
    b, a = a_connection(org, "b-role"), a_connection(org, "A-role")
    await store.create_resource(res, [b, a])
    assert (await store.get_resource(org, "res")).env_vars == {"A": "1"}
    got = await store.get_connection(org, a.id)
    assert got == a  # the secret comes back in clear, every field as written
    assert (await store.get_connection(org, "b-role")).id == b.id
    assert [c.name for c in await store.list_connections(org)] == ["A-role", "b-role"]  # by code point
    raw = await store.db.fetch("SELECT secret FROM connections WHERE id = ?", (a.id,))
    assert b"s3cret" not in bytes(raw[0][0])
    with pytest.raises(Conflict):
        await store.create_connection(a_connection(org, "A-role"))
    a.settings = {"x": 2}
    await store.update_connection(a)
    assert (await store.get_connection(org, a.id)).settings == {"x": 2}
    res.env_vars = {}
    c = a_connection(org, "c-role")
    await store.update_resource(res, [c])
    assert [x.name for x in await store.list_connections(org, "res")] == ["c-role"]
    await store.create_resource(Resource(id=new_id(), org_id=org, name="other", type="database",
                                         subtype="postgres", created_at=NOW, updated_at=NOW),
                                [a_connection(org, "d-role", "other")])
    assert [r.name for r in await store.list_resources(org)] == ["other", "res"]
    await store.delete_connection(org, "d-role")
    assert await store.list_connections(org, "other") == []
    await store.delete_resource(org, "res")
    assert await store.get_resource(org, "res") is None and await store.get_connection(org, c.id) is None


async def test_credentials_are_stored_with_their_session_and_revoked_once(store: Store):
    org = await an_org(store)
    session = a_session(org, status="ready")
    cred = Credential(id=new_id(), org_id=org, user_id="u", connection_id="c", connection_name="pg",
                      secret_hash="h1", session_id=session.id, expire_at=NOW, created_at=NOW, review_id="r1")
    await store.create_credential(cred, session)
    assert await store.get_credential("h1") == cred
    assert (await store.get_session(session.id)).status == "ready"
    with pytest.raises(Conflict):  # nothing half stored: the second session is not there either
        await store.create_credential(Credential(**{**vars_of(cred), "id": new_id()}), a_session(org, user="zed"))
    assert (await store.list_sessions(SessionFilter(org_id=org, user_id="zed"))).total == 0
    second = Credential(**{**vars_of(cred), "id": new_id(), "secret_hash": "h2"})
    await store.create_credential(second, None)
    assert await store.revoke_credentials(session_id=session.id, revoked_at=NOW) == 2
    assert await store.revoke_credentials(review_id="r1", revoked_at=NOW) == 0
    assert (await store.get_credential("h2")).revoked_at == NOW


def vars_of(record) -> dict:
    from dataclasses import fields

    return {f.name: getattr(record, f.name) for f in fields(record)}


# ---------------------------------------------------------------------------- guard rails

async def test_guardrails_round_trip_and_every_change_bumps_the_generation(store: Store):
    org = await an_org(store)
    start = await store.guardrail_generation()
    zeta, alpha = a_rail(org, "zeta", ["c1", "c2"]), a_rail(org, "Alpha", ["c2"])
    await store.save_guardrail(zeta, create=True)
    assert await store.guardrail_generation() == start + 1
    await store.save_guardrail(alpha, create=True)
    assert await store.get_guardrail(org, zeta.id) == zeta
    assert (await store.get_guardrail(org, "Alpha")).id == alpha.id
    assert [r.name for r in await store.list_guardrails(org)] == ["Alpha", "zeta"]
    assert [r.name for r in await store.list_guardrails(org, "c1")] == ["zeta"]
    assert [r.name for r in await store.list_guardrails(org, "c2")] == ["Alpha", "zeta"]
    with pytest.raises(Conflict):
        await store.save_guardrail(a_rail(org, "zeta", []), create=True)
    assert await store.guardrail_generation() == start + 2  # a refused change bumps nothing
    zeta.connection_ids, zeta.version, zeta.output = ["c3"], 2, {"rules": []}
    await store.save_guardrail(zeta, create=False)
    assert await store.guardrail_generation() == start + 3
    assert await store.get_guardrail(org, zeta.id) == zeta
    await store.delete_guardrail(org, zeta.id)
    assert await store.guardrail_generation() == start + 4
    assert await store.get_guardrail(org, zeta.id) is None and await store.list_guardrails(org, "c3") == []


async def test_a_rule_changed_through_another_handle_reaches_the_rule_cache(backend: Backend):
    mine, theirs = await backend.open(), await backend.open()  # two processes on one database
    org = await an_org(mine)
    service = GuardRailService(mine)
    c1 = Connection(id="c1", org_id=org, name="c1", resource_name="c1", type="database", subtype="postgres")
    assert (await service.rules_for(c1)).empty
    rail = a_rail(org, "no-drop", ["c1"])
    await theirs.save_guardrail(rail, create=True)  # no invalidate() in this process
    assert not (await service.rules_for(c1)).check_input("drop table t").allowed
    await theirs.delete_guardrail(org, rail.id)
    assert (await service.rules_for(c1)).empty


# ---------------------------------------------------------------------------- sessions

async def test_sessions_list_newest_first_with_filters_and_pages(store: Store):
    org = await an_org(store)
    made = [a_session(org, start=f"2026-01-0{d}T00:00:00Z", user=u, connection=c, type=t, status=s)
            for d, u, c, t, s in [(1, "ann", "pg", "database", "done"), (2, "bob", "pg", "database", "open"),
                                  (3, "ann", "ssh", "application", "done"), (4, "ann", "pg", "database", "open"),
                                  (5, "bob", "ssh", "application", "ready")]]
    twin = a_session(org, start=made[3].start_date, user="cy")  # same start: ordered by id
    for s in [*made, twin]:
        await store.create_session(s)
    await store.create_session(a_session((await store.create_org("other")).id))

    async def ids(**query) -> tuple[list[str], int]:
        page = await store.list_sessions(SessionFilter(org_id=org, **query))
        return [s.id for s in page.items], page.total

    newest = [made[4].id, *sorted([made[3].id, twin.id]), made[2].id, made[1].id, made[0].id]
    assert await ids() == (newest, 6)
    assert await ids(limit=2, offset=1) == (newest[1:3], 6)
    assert await ids(user_id="ann") == ([made[3].id, made[2].id, made[0].id], 3)
    assert await ids(only_user_id="bob", connection="ssh") == ([made[4].id], 1)
    assert (await ids(type="application"))[1] == 2 and (await ids(status="open"))[1] == 3
    assert await ids(start_date="2026-01-02T00:00:00Z", end_date="2026-01-03T00:00:00Z") == \
        ([made[2].id, made[1].id], 2)
    full = (await store.list_sessions(SessionFilter(org_id=org, user_id="bob", status="ready"))).items[0]
    assert full == made[4]
    # reviews filter the listing too
    review = Review(id=new_id(), org_id=org, session_id=made[0].id, connection_id="c", type="onetime",
                    status="APPROVED", owner_id="ann", created_at=NOW,
                    groups=[ReviewGroup(id=new_id(), review_id="", group_name="dba", status="APPROVED",
                                        reviewed_by_email="Boss@example.com")])
    await store.create_review(review)
    reviewed = a_session(org, start=NOW, review_id=review.id)
    await store.create_session(reviewed)
    assert await ids(review_status="APPROVED") == ([reviewed.id], 1)
    assert await ids(review_approver="boss@EXAMPLE.com") == ([reviewed.id], 1)
    assert (await store.sessions_with_status("ready")) == [made[4]]


async def test_sessions_are_found_by_part_of_a_user_protocol_and_what_was_typed(store: Store):
    """Issue 34, search: the same answers on both stores (SQLite FTS5 trigrams, PostgreSQL pg_trgm)."""
    org = await an_org(store)
    for subject, email, name in (("sub-dev", "Dev.Ops@example.com", "Devon Ops"), ("sub-ann", "ann@example.com",
                                                                                     "Ann Lee")):
        await store.save_user(User(id=new_id(), org_id=org, subject=subject, email=email, name=name,
                                   created_at=NOW, updated_at=NOW))
    typed = {"sub-dev": ["SELECT * FROM Orders WHERE id = 7;", "GET /api/v1/invoices?year=2025 HTTP/1.1"],
             "sub-ann": ["rm -rf /tmp/build_42", "select 100% of_it"]}
    made = {}
    for n, (subject, lines) in enumerate(typed.items()):
        session = a_session(org, user=subject, start=f"2026-02-0{n + 1}T10:0{n}:00Z")
        if subject == "sub-ann":
            session.subtype = "ssh"
        await store.create_session(session)
        made[subject] = session.id
        batch = [SessionEvent(i, "i", line.encode()) for i, line in enumerate(lines)]
        batch.append(SessionEvent(9, "o", b"only-in-the-output"))
        await store.append_events([EventBatch.of(session.id, 0, batch, {}, CHAIN_GENESIS, "h")])

    async def ids(**query) -> set[str]:
        return {s.id for s in (await store.list_sessions(SessionFilter(org_id=org, **query))).items}

    assert await ids(user_search="DEV.OPS") == {made["sub-dev"]}  # part of an e-mail, any case
    assert await ids(user_search="lee") == {made["sub-ann"]}  # part of a name
    assert await ids(user_search="sub-ann") == {made["sub-ann"]}  # the subject itself
    assert await ids(user_search="%") == set() and await ids(user_search="_") == set()  # no wildcard
    assert await ids(protocol="ssh") == {made["sub-ann"]}
    assert await ids(text="from orders") == {made["sub-dev"]}  # a statement, any case
    assert await ids(text="/api/v1/invoices") == {made["sub-dev"]}  # a URL
    assert await ids(text="rm -rf /tmp") == {made["sub-ann"]}  # a command
    assert await ids(text="100% of") == {made["sub-ann"]} and await ids(text="build_4") == {made["sub-ann"]}
    assert await ids(text="only-in-the-output") == set()  # what was typed, not what was answered
    assert await ids(text="orders", user_search="ann") == set()
    assert await ids(text="orders", start_date="2026-02-01T10:00:00Z", end_date="2026-02-01T10:00:59Z") == \
        {made["sub-dev"]}
    assert await ids(text="orders", start_date="2026-02-01T10:01:00Z") == set()  # to the minute
    with pytest.raises(ValueError):
        await ids(text="or")


async def test_a_user_filter_matching_several_users_pages_them_in_one_order(store: Store, monkeypatch):
    """Issue 36: a user filter that matches a few users has its page merged from each user's newest sessions
    (sessions.USER_ARMS); one that matches more is read as one list. Either way every page is the slice of all
    the matches, newest first (equal start times in id order), with the other filters applied and counted."""
    from gatewayd.store.queries import sessions as queries

    org = await an_org(store)
    for n in range(4):
        await store.save_user(User(id=new_id(), org_id=org, subject=f"sub-{n}", email=f"ops{n}@example.com",
                                   name=f"Ops {n}", created_at=NOW, updated_at=NOW))
    await store.save_user(User(id=new_id(), org_id=org, subject="sub-x", email="x@example.com", name="X",
                               created_at=NOW, updated_at=NOW))
    made = []
    for n in range(23):  # start times repeat across users, so that the ids settle the order
        session = a_session(org, user=f"sub-{n % 5}" if n % 5 < 4 else "sub-x", start=f"2026-03-0{1 + n % 4}T00:00:00Z",
                            connection="pg" if n % 3 else "ssh")
        await store.create_session(session)
        made.append(session)
    store.count_cap = 100

    def expected(keep) -> list[str]:
        found = sorted((s for s in made if keep(s)), key=lambda s: s.id)
        return [s.id for s in sorted(found, key=lambda s: s.start_date, reverse=True)]

    async def pages(size: int, **query) -> tuple[list[str], list[int]]:
        seen, totals = [], []
        for offset in range(0, 30, size):
            page = await store.list_sessions(SessionFilter(org_id=org, limit=size, offset=offset, **query))
            seen += [s.id for s in page.items]
            totals.append(page.total)
        return seen, totals

    for arms in (queries.USER_ARMS, 2):  # merged, then (more users than arms) one list
        monkeypatch.setattr(queries, "USER_ARMS", arms)
        ops = expected(lambda s: s.user_id != "sub-x")
        for size in (1, 3, 7, 25):
            seen, totals = await pages(size, user_search="ops")
            assert seen == ops and set(totals) == {len(ops)}
        seen, _ = await pages(4, user_search="OPS", connection="pg")
        assert seen == expected(lambda s: s.user_id != "sub-x" and s.connection == "pg")
        seen, _ = await pages(5, user_search="sub-x")  # the subject itself, and no other user
        assert seen == expected(lambda s: s.user_id == "sub-x")
        seen, totals = await pages(2, user_search="ops", only_user_id="sub-1")  # a user who is not an auditor
        assert seen == expected(lambda s: s.user_id == "sub-1") and set(totals) == {len(seen)}
    store.count_cap = 3  # past the cap the page is read as one list, the same slice
    seen, totals = await pages(4, user_search="ops")
    assert seen == expected(lambda s: s.user_id != "sub-x") and set(totals) == {3}


async def test_a_session_page_carries_its_sessions_reviews_read_in_its_own_statement(store: Store, monkeypatch):
    """Issue 36: ``list_sessions(reviews=True)`` returns the page's sessions' reviews (``Page.reviews``), each as
    ``get_review`` reads it, groups' parts and JSON fields included; one review two sessions share (a just-in-time
    one) once; none of sessions off the page; and the page itself as without them, through the merged user page
    too; never another organization's. Without ``reviews`` it reads none."""
    from gatewayd.store.queries import sessions as queries

    org = await an_org(store)
    for n in range(2):
        await store.save_user(User(id=new_id(), org_id=org, subject=f"sub-r{n}", email=f"rev{n}@example.com",
                                   name=f"Rev {n}", created_at=NOW, updated_at=NOW))
    sessions, reviews = [], []
    for n in range(7):
        session = a_session(org, user=f"sub-r{n % 2}", start=f"2026-05-0{n + 1}T00:00:00Z")
        if n % 3 != 2:  # sessions 2 and 5 have none
            rid = new_id()
            review = Review(id=rid, org_id=org, session_id=session.id, connection_id="c", type="onetime",
                            status="APPROVED" if n % 2 else "PENDING", owner_id=session.user_id, created_at=NOW,
                            access_duration=60_000_000_000, force_approval_groups=["sec"],
                            time_window={"type": "time_range", "n": n},
                            groups=[ReviewGroup(id=new_id(), review_id=rid, group_name=g)
                                    for g in ("dba", "sec")[:1 + n % 2]])
            session.review_id = rid
            await store.create_review(review, session)
            reviews.append(review)
        else:
            await store.create_session(session)
        sessions.append(session)
    shared = a_session(org, user="sub-r0", start="2026-05-08T00:00:00Z", review_id=reviews[0].id)  # jit: one review
    await store.create_session(shared)
    sessions.append(shared)
    by_id = {r.id: r for r in reviews}

    async def check(limit: int, offset: int, **query) -> None:
        plain = await store.list_sessions(SessionFilter(org_id=org, limit=limit, offset=offset, **query))
        page = await store.list_sessions(SessionFilter(org_id=org, limit=limit, offset=offset, **query), reviews=True)
        assert plain.reviews == {}
        assert (page.items, page.total, page.more) == (plain.items, plain.total, plain.more)
        assert page.reviews == {s.review_id: by_id[s.review_id] for s in page.items if s.review_id in by_id}
        for review_id, review in page.reviews.items():
            assert review == await store.get_review(review_id)

    await check(3, 0)  # the shared review's newer session, and sessions with none
    await check(3, 3)
    await check(10, 0)
    page = await store.list_sessions(SessionFilter(org_id=org, limit=10), reviews=True)
    assert len(page.reviews) == len(reviews) and len(page.items) == 8
    assert sorted(len(r.groups) for r in page.reviews.values()) == [1, 1, 1, 2, 2]
    await check(2, 1, review_status="APPROVED")
    elsewhere = (await store.create_org("elsewhere")).id  # a session naming another organization's review
    foreign = Review(id=new_id(), org_id=elsewhere, session_id=new_id(), connection_id="c", type="onetime",
                     status="APPROVED", owner_id="x", created_at=NOW,
                     groups=[ReviewGroup(id=new_id(), review_id="", group_name="dba", status="APPROVED",
                                         reviewed_by_email="rev0@example.com")])
    await store.create_review(foreign)
    await store.create_session(a_session(org, user="sub-r1", start="2026-05-09T00:00:00Z", review_id=foreign.id))
    page = await store.list_sessions(SessionFilter(org_id=org, limit=1), reviews=True)
    assert page.items[0].review_id == foreign.id and page.reviews == {}
    for query in ({"review_status": "APPROVED"}, {"review_approver": "rev0@example.com"}):  # nor do its filters
        found = await store.list_sessions(SessionFilter(org_id=org, limit=50, **query))
        assert foreign.id not in {s.review_id for s in found.items} and found.total == len(found.items), query
    for arms in (queries.USER_ARMS, 1):  # the page merged from each user's newest sessions, then one list
        monkeypatch.setattr(queries, "USER_ARMS", arms)
        await check(3, 0, user_search="rev")
        await check(3, 1, user_search="rev")


async def test_a_common_text_is_found_newest_first_and_counted_up_to_a_cap(store: Store, monkeypatch):
    """A text with more matches than the probe reads: the sessions newest first, the total a lower bound past the
    cap (the same path on both stores; the probe and cap made small here)."""
    org = await an_org(store)
    made = []
    for n in range(4):
        session = a_session(org, start=f"2026-03-0{n + 1}T00:00:00Z")
        await store.create_session(session)
        await store.append_events([EventBatch.of(session.id, 0, [SessionEvent(0, "i", b"select now()")], {},
                                                 CHAIN_GENESIS, "h")])
        made.append(session.id)
    monkeypatch.setattr(session_queries, "TEXT_PROBE", 1)
    monkeypatch.setattr(session_queries, "TEXT_COUNT_CAP", 2)
    page = await store.list_sessions(SessionFilter(org_id=org, text="now()"))
    assert [s.id for s in page.items] == made[::-1] and (page.total, page.total_exact) == (2, False)
    page = await store.list_sessions(SessionFilter(org_id=org, text="now()", limit=2, offset=1))
    assert [s.id for s in page.items] == made[2:0:-1]
    monkeypatch.setattr(session_queries, "TEXT_COUNT_CAP", 10)
    page = await store.list_sessions(SessionFilter(org_id=org, text="NOW()"))
    assert (page.total, page.total_exact) == (4, True)


async def test_the_lists_count_up_to_the_store_cap_and_page_past_it(store: Store):
    """Issue 36: the session list and the audit log count their matches up to ``count_cap`` (10,000 by default;
    3 here): past it the total is the cap and says so, the pages still reach every row by offset, and whether
    one follows is known from the rows, not from the total; under the cap the total stays exact."""
    org = await an_org(store)
    store.count_cap = 3
    made = [a_session(org, start=f"2026-04-0{n + 1}T00:00:00Z", connection="pg" if n < 2 else "ssh")
            for n in range(5)]
    for session in made:
        await store.create_session(session)
    newest = [s.id for s in reversed(made)]
    seen, more = [], []
    for offset in (0, 2, 4):
        page = await store.list_sessions(SessionFilter(org_id=org, limit=2, offset=offset))
        assert (page.total, page.total_exact) == (3, False)
        seen += [s.id for s in page.items]
        more.append(page.more)
    assert seen == newest and more == [True, True, False]
    page = await store.list_sessions(SessionFilter(org_id=org, connection="pg"))
    assert ([s.id for s in page.items], page.total, page.total_exact, page.more) == (newest[3:], 2, True, False)
    page = await store.list_sessions(SessionFilter(org_id=org, connection="ssh", limit=2))
    assert (page.total, page.total_exact, page.more) == (3, True, True)  # exactly the cap: exact

    def entry(n: int, subject: str, email: str, action: str = "a") -> AuditEntry:
        return AuditEntry(id=new_id(), org_id=org, created_at=f"2026-04-0{n}T00:00:00Z", actor_subject=subject,
                          actor_email=email, actor_name="", resource_type="r", action=action, outcome="success")

    # an actor is a subject or an e-mail: Ann's subject is her e-mail at one provider, sub-ann at another
    written = [entry(1, "ann@example.com", "ann@example.com"), entry(2, "sub-bob", "bob@example.com", "b"),
               entry(3, "sub-ann", "Ann@Example.com"), entry(3, "ann@example.com", "x@example.com"),
               entry(4, "sub-bob", "bob@example.com", "b"), entry(5, "sub-bob", "bob@example.com", "b")]
    for e in written:
        await store.append_audit(e)
    newest = [e.id for e in reversed(written)]  # the same second: the last written first
    seen, more = [], []
    for number in (1, 2, 3):
        page = await store.list_audit(AuditFilter(org_id=org, page=number, page_size=2))
        assert (page.total, page.total_exact) == (3, False)
        seen += [e.id for e in page.items]
        more.append(page.more)
    assert seen == newest and more == [True, True, False]
    page = await store.list_audit(AuditFilter(org_id=org, action="a"))
    assert (page.total, page.total_exact, page.more) == (3, True, False)
    ann = [written[3].id, written[2].id, written[0].id]  # each entry once, newest first, from both arms
    page = await store.list_audit(AuditFilter(org_id=org, actor="ann@example.com"))
    assert ([e.id for e in page.items], page.total, page.total_exact) == (ann, 3, True)
    page = await store.list_audit(AuditFilter(org_id=org, actor="ANN@example.com"))  # the e-mail in any case only
    assert ([e.id for e in page.items], page.total) == ([written[2].id, written[0].id], 2)
    pages = [await store.list_audit(AuditFilter(org_id=org, actor="ann@example.com", page=n, page_size=1))
             for n in (1, 2, 3, 4)]
    assert [e.id for p in pages for e in p.items] == ann and [p.more for p in pages] == [True, True, False, False]
    # past the cap (3), an actor's pages are sorted by the database: the same entries, the same order
    deep = [await store.list_audit(AuditFilter(org_id=org, actor="ann@example.com", page=n, page_size=2))
            for n in (1, 2)]
    assert [e.id for p in deep for e in p.items] == ann and [p.more for p in deep] == [True, False]
    page = await store.list_audit(AuditFilter(org_id=org, actor="sub-bob"))
    assert (page.total, page.total_exact) == (3, True)
    written.append(entry(6, "sub-bob", "bob@example.com", "b"))
    await store.append_audit(written[-1])
    page = await store.list_audit(AuditFilter(org_id=org, actor="sub-bob", action="b", page_size=3))
    assert (page.total, page.total_exact, page.more) == (3, False, True)


async def test_short_ids_events_after_a_point_open_requests_and_metadata(store: Store):
    """Issue 34: the start of an id names one session or review; a watcher reads events after the last it saw; one
    PENDING review per request key; a session's metadata is replaced."""
    org = await an_org(store)
    first, second = a_session(org), a_session(org)
    second.id = first.id[:8] + "0" * 28 if first.id[8] != "0" else first.id[:8] + "1" * 28
    for session in (first, second):
        await store.create_session(session)
    assert await store.ids_with_prefix("sessions", org, first.id[:8]) == sorted([first.id, second.id])
    assert await store.ids_with_prefix("sessions", org, first.id[:13]) == [first.id]
    assert await store.ids_with_prefix("sessions", (await store.create_org("elsewhere")).id, first.id[:8]) == []
    await store.append_events([EventBatch.of(first.id, 0, events(5), {}, CHAIN_GENESIS, "h1"),
                               EventBatch.of(first.id, 5, events(4, 5), {}, "h1", "h2")])
    assert [seq for seq, _ in await store.read_events_after(first.id, -1)] == list(range(9))
    assert [seq for seq, _ in await store.read_events_after(first.id, 6)] == [7, 8]
    assert await store.read_events_after(first.id, 8) == []
    assert await store.sessions_by_ids([first.id, "nope"]) == {first.id: first}

    def review(status: str = "PENDING") -> Review:
        return Review(id=new_id(), org_id=org, session_id=first.id, connection_id="c", type="jit", status=status,
                      owner_id="u", created_at=NOW, request_key="k1",
                      groups=[ReviewGroup(id=new_id(), review_id="", group_name="dba")])

    pending = review()
    await store.create_review(pending)
    with pytest.raises(Conflict):  # one PENDING per request key, whichever process asks
        await store.create_review(review())
    assert (await store.open_review_for("k1")).id == pending.id
    await store.transition_review(pending.id, "PENDING", "REJECTED", NOW)
    assert await store.open_review_for("k1") is None
    await store.create_review(review())  # the key is free again once the request is decided
    assert await store.set_session_metadata(first.id, {"ticket": "INC-1"})
    assert (await store.get_session(first.id)).metadata == {"ticket": "INC-1"}
    assert not await store.set_session_metadata("nope", {})


async def test_events_go_in_bulk_and_read_back_in_order(store: Store):
    org = await an_org(store)
    session = a_session(org)
    await store.create_session(session)
    first, second = events(341), events(7, start=341)
    await store.append_events([
        EventBatch.of(session.id, 0, first, {"event_size": 100, "metrics": {"a": 1}, "chain_head": "h1"},
                   CHAIN_GENESIS, "h1"),
        EventBatch.of(session.id, 341, second, {"event_size": 120, "chain_head": "h2"}, "h1", "h2"),
    ])
    assert await store.read_events(session.id) == first + second
    assert await store.read_events(session.id, "o") == [e for e in first + second if e.kind == "o"]
    links, numbered = await store.read_event_chain(session.id)
    assert [(x.first_seq, x.count, x.previous_hash, x.hash) for x in links] == \
        [(0, 341, CHAIN_GENESIS, "h1"), (341, 7, "h1", "h2")]
    assert numbered == list(enumerate(first + second))
    assert await store.last_event_seq(session.id) == (348, 347)
    assert await store.last_event_seq("none") == (0, 0)
    stored = await store.get_session(session.id)
    assert (stored.event_size, stored.metrics, stored.chain_head, stored.status) == (120, {"a": 1}, "h2", "open")
    with pytest.raises(ValueError):  # a recording flush writes its progress, not the session's state
        await store.append_events([EventBatch.of(session.id, 348, [], {"status": "done"})])
    # a batch sent again (a write whose outcome was unknown) is stored once
    again = EventBatch.of(session.id, 341, second, {"event_size": 120, "chain_head": "h2"}, "h1", "h2")
    assert await store.append_events([again]) == set()
    # other events under numbers stored already: the session diverged, nothing of it is written
    other = a_session(org)
    await store.create_session(other)
    assert await store.append_events([EventBatch.of(session.id, 0, events(1), {"event_size": 1}, "x", "y"),
                                      EventBatch.of(session.id, 348, events(2), {"event_size": 2}, "y", "z"),
                                      EventBatch.of(other.id, 0, events(2), {"event_size": 9}, CHAIN_GENESIS, "o")]
                                     ) == {session.id}
    assert len(await store.read_events(session.id)) == 348 and (await store.get_session(session.id)).event_size == 120
    assert len(await store.read_events(other.id)) == 2 and (await store.get_session(other.id)).event_size == 9


async def test_a_recording_stored_an_event_a_row_reads_verifies_and_goes_on_in_packed_batches(store: Store):
    """Recordings stored before batches held their events (one ``session_events`` row each) read back in order
    with the packed batches written since, verify as one chain, and a recorder resumes after their last."""
    org = await an_org(store)
    session = a_session(org)
    await store.create_session(session)
    old, new = events(3), events(2, start=3)
    old_hash = batch_hash(CHAIN_GENESIS, session.id, 0, old)
    await store.db.transact(in_order(
        [("INSERT INTO session_events (session_id, seq, offset_ms, kind, data) VALUES (?, ?, ?, ?, ?)",
          (session.id, seq, e.offset_ms, e.kind, e.data)) for seq, e in enumerate(old)]
        + [("INSERT INTO session_event_batches (session_id, first_seq, count, prev_hash, hash) VALUES (?, ?, ?, ?, ?)",
            (session.id, 0, 3, CHAIN_GENESIS, old_hash))]))
    assert await store.last_event_seq(session.id) == (3, 2)
    new_hash = batch_hash(old_hash, session.id, 3, new)
    await store.append_events([EventBatch.of(session.id, 3, new, {"chain_head": new_hash}, old_hash, new_hash)])
    assert await store.read_events(session.id) == old + new
    assert await store.read_events(session.id, "o") == [e for e in old + new if e.kind == "o"]
    links, numbered = await store.read_event_chain(session.id)
    assert numbered == list(enumerate(old + new)) and [link.count for link in links] == [3, 2]
    session.chain_head = new_hash
    assert verify_recording(session, links, numbered, Sealer(Ed25519PrivateKey.generate())).verified
    assert await store.last_event_seq(session.id) == (5, 4)
    await store.db.transact(in_order([(  # an intruder cuts the last batch short
        "UPDATE session_event_batches SET events = ? WHERE session_id = ? AND first_seq = ?",
        (pack_events(3, new)[:-1], session.id, 3))]))
    assert await store.last_event_seq(session.id) == (5, 0)  # a resumed recorder never reuses a number


async def test_close_stores_the_last_events_and_the_end_together(store: Store):
    org = await an_org(store)
    session = a_session(org)
    await store.create_session(session)
    last = [EventBatch.of(session.id, 0, events(3), {"event_size": 30, "chain_head": "h"}, CHAIN_GENESIS, "h")]
    assert await store.close_session(last, end_date=NOW, exit_code=254, seal="sig") is True
    stored = await store.get_session(session.id)
    assert (stored.status, stored.end_date, stored.exit_code, stored.seal, stored.event_size, stored.chain_head) \
        == ("done", NOW, 254, "sig", 30, "h")
    assert await store.read_events(session.id) == events(3)
    assert await store.claim_session(session.id, NOW) is None  # done: nobody claims it
    # the same close again (its first outcome was unknown): stored once, still true
    assert await store.close_session(last, end_date=NOW, exit_code=254, seal="sig") is True
    assert await store.read_events(session.id) == events(3)
    # another end of a session closed already (by another process): nothing written, false
    late = [EventBatch.of(session.id, 3, events(1), {"event_size": 40, "chain_head": "i"}, "h", "i")]
    assert await store.close_session(late, end_date="2030-01-01T00:00:00Z", exit_code=0, seal="other") is False
    stored = await store.get_session(session.id)
    assert (stored.end_date, stored.seal, stored.event_size, stored.chain_head) == (NOW, "sig", 30, "h")
    empty = a_session(org)
    await store.create_session(empty)
    assert await store.close_session([EventBatch.of(empty.id, 0, [], {})], end_date=NOW, exit_code=None, seal=None)
    assert (await store.get_session(empty.id)).status == "done"


async def test_events_kept_after_a_close_by_another_process_follow_the_sealed_recording(store: Store):
    """What the process that held a session recorded while another one closed it goes after the close, numbered
    apart (LATE_BASE), once whatever the number of times it is sent, and verification names it."""
    org = await an_org(store)
    session = a_session(org)
    await store.create_session(session)
    sealer = Sealer(Ed25519PrivateKey.generate())
    mine = events(2)
    head = batch_hash(CHAIN_GENESIS, session.id, 0, mine)
    await store.append_events([EventBatch.of(session.id, 0, mine, {"event_size": 20, "chain_head": head},
                                             CHAIN_GENESIS, head)])
    assert await store.chain_tail(session.id) == (2, head)
    closer = [SessionEvent(9, "e", b"node b stopped answering")]
    sealed = batch_hash(head, session.id, 2, closer)
    seal = sealer.seal(session, sealed, 3, 44, 254, NOW)
    assert await store.close_session([EventBatch.of(session.id, 2, closer, {"event_size": 44, "chain_head": sealed},
                                                    head, sealed)], end_date=NOW, exit_code=254, seal=seal)
    held = list(enumerate(events(4, start=2), 2))  # what the holder recorded from its event 2 on
    assert await store.append_late(session.id, held[:2], "kept late") == 2
    assert await store.append_late(session.id, held, "kept late") == 2  # the first two are there already
    assert await store.append_late(session.id, held, "kept late") == 0
    assert await store.chain_tail(session.id) == (3, sealed)  # late links are not the recording's tail
    assert await store.last_event_seq(session.id) == (3, 9)
    read = await store.read_events(session.id)
    assert read == mine + closer + [SessionEvent(held[0][1].offset_ms, "e", b"kept late")] + [e for _, e in held]
    links, numbered = await store.read_event_chain(session.id)
    stored = await store.get_session(session.id)
    result = verify_recording(stored, links, numbered, sealer, [{"seal": seal, "sealed_at": NOW}])
    assert not result.verified and result.sealed
    assert result.problems == ["5 events were stored after the session was closed by another process (kept by the "
                               "process that held it, in memory or in its journal): they are not covered by the "
                               "seal"], result


async def test_events_the_recording_has_already_are_not_kept_again_after_a_close(store: Store):
    """The holder's batch went in before another process closed the session, but the holder never had the answer
    (its link was cut): it sends it again among what it keeps after the close; those events are not stored twice."""
    org = await an_org(store)
    session = a_session(org)
    await store.create_session(session)
    mine = events(2)
    head = batch_hash(CHAIN_GENESIS, session.id, 0, mine)
    await store.append_events([EventBatch.of(session.id, 0, mine, {"event_size": 20, "chain_head": head},
                                             CHAIN_GENESIS, head)])  # stored; the holder does not know it
    closer = [SessionEvent(9, "e", b"node b stopped answering")]
    sealed = batch_hash(head, session.id, 2, closer)
    assert await store.close_session([EventBatch.of(session.id, 2, closer, {"event_size": 44, "chain_head": sealed},
                                                    head, sealed)], end_date=NOW, exit_code=254, seal=None)
    unanswered = list(enumerate(mine)) + list(enumerate(events(3, start=2), 2))  # all it holds, from event 0
    assert await store.append_late(session.id, unanswered, "kept late") == 3
    assert await store.append_late(session.id, unanswered, "kept late") == 0
    read = await store.read_events(session.id)
    assert read == mine + closer + [SessionEvent(unanswered[2][1].offset_ms, "e", b"kept late")] + \
        [e for _, e in unanswered[2:]]


async def test_exactly_one_of_concurrent_claims_wins(backend: Backend):
    one, two = await backend.open(), await backend.open()  # as two processes would
    org = await an_org(one)
    issued = [a_session(org, status="ready") for _ in range(8)] + \
        [a_session(org, status="open") for _ in range(4)]  # open: jit credentials handed out, not ended
    for s in issued:
        await one.create_session(s)
    for s in issued:
        won = await asyncio.gather(one.claim_session(s.id, "2026-02-01T00:00:00Z"),
                                   two.claim_session(s.id, "2026-02-01T00:00:01Z"),
                                   one.claim_session(s.id, "2026-02-01T00:00:02Z"))
        winners = [w for w in won if w is not None]
        assert len(winners) == 1, won
        claimed = winners[0]
        assert claimed.id == s.id and claimed.status == "open" and claimed.claimed_at
        assert claimed.start_date.startswith("2026-02-01") and claimed.metadata == s.metadata
        assert await two.get_session(s.id) == claimed
        assert await two.claim_session(s.id, NOW) is None  # and once claimed, never again


def a_node(name: str, beat: str = NOW, pid: int = 4242) -> Node:
    return Node(id=new_id(), name=name, slot=0, host="host-1", pid=pid, started_at=NOW, heartbeat_at=beat,
                listeners={"postgres": "0.0.0.0:15432"})


async def test_nodes_get_distinct_slots_at_once_and_reuse_those_freed(backend: Backend):
    one, two = await backend.open(), await backend.open()  # as two processes would
    nodes = [a_node(f"n{i}") for i in range(6)]
    await asyncio.gather(*((one if i % 2 else two).register_node(n) for i, n in enumerate(nodes)))
    assert sorted(n.slot for n in nodes) == [1, 2, 3, 4, 5, 6]
    stored = {n.id: n for n in await two.list_nodes()}
    assert stored[nodes[0].id] == nodes[0] and stored[nodes[0].id].listeners == {"postgres": "0.0.0.0:15432"}
    freed = nodes[2].slot
    assert await one.stop_node(nodes[2].id, NOW, reason="stopped") is True
    assert await one.stop_node(nodes[2].id, NOW) is False  # once
    late = a_node("late")
    await two.register_node(late)
    assert late.slot == freed
    assert {n.id for n in await one.list_nodes(up_only=True)} == {n.id for n in nodes if n is not nodes[2]} | {late.id}


async def test_a_node_is_declared_lost_exactly_once_and_only_when_its_lease_ran_out(backend: Backend):
    one, two = await backend.open(), await backend.open()
    node = a_node("quiet", beat="2026-01-01T00:00:00.000000Z")
    await one.register_node(node)
    assert await one.stop_node(node.id, NOW, status="lost", heartbeat_before="2025-12-31T00:00:00.000000Z") is False
    assert await one.node_heartbeat(node.id, "2026-01-01T00:00:10.000000Z") is True
    won = await asyncio.gather(*(handle.stop_node(node.id, NOW, status="lost", reason="lease",
                                                  heartbeat_before="2026-01-01T00:01:00.000000Z")
                                 for handle in (one, two, one, two)))
    assert won.count(True) == 1
    [lost] = [n for n in await two.list_nodes() if n.id == node.id]
    assert (lost.status, lost.stop_reason, lost.stopped_at) == ("lost", "lease", NOW)
    assert await one.node_heartbeat(node.id, NOW) is False  # a node declared lost learns it at its next beat


async def test_the_store_tells_its_own_time_the_clock_of_the_leases(store: Store):
    from datetime import timedelta

    from gatewayd.models import utcnow

    told = await store.clock()
    assert told.tzinfo is not None and abs(told - utcnow()) < timedelta(seconds=5)  # the same host here
    assert await store.clock() >= told


async def test_open_sessions_by_holder_and_those_no_node_up_holds(store: Store):
    org = await an_org(store)
    up, gone = a_node("up"), a_node("gone")
    for node in (up, gone):
        await store.register_node(node)
    await store.stop_node(gone.id, NOW, status="lost")
    held, orphaned, legacy = a_session(org, node_id=up.id, user="sub-bob"), a_session(org, node_id=gone.id), \
        a_session(org)
    ended = a_session(org, status="done", node_id=gone.id)
    ready = a_session(org, status="ready")
    for s in (held, orphaned, legacy, ended, ready):
        await store.create_session(s)
    assert [s.id for s in await store.open_sessions_of([gone.id])] == [orphaned.id]
    assert await store.open_session_holders(connection_id="id-pg") == {up.id, gone.id}  # ended: not counted
    assert await store.open_session_holders(review_id="none") == set()
    assert await store.open_session_holders(user=(org, "sub-alice")) == {gone.id}
    assert await store.open_session_holders(user=(org, "sub-bob")) == {up.id}
    assert await store.open_session_holders(user=("another-org", "sub-bob")) == set()  # a user is of its organization
    assert {s.id for s in await store.open_sessions_unheld()} == {orphaned.id, legacy.id}
    counts = await store.open_sessions_by_node()
    assert counts[up.id] == 1 and counts[gone.id] == 1 and counts[None] == 1
    claimed = await store.claim_session(ready.id, NOW, up.id)
    assert claimed.node_id == up.id and (await store.open_sessions_by_node())[up.id] == 2
    assert await store.forget_nodes("2030-01-01T00:00:00Z") == 0  # it still holds an open session
    await store.request_kill(orphaned.id, "x", NOW)
    await store.close_session([EventBatch.of(orphaned.id, 0, [], {})], end_date=NOW, exit_code=254, seal=None)
    assert await store.forget_nodes("2030-01-01T00:00:00Z") == 1
    assert [n.id for n in await store.list_nodes()] == [up.id]


async def test_the_bus_table_keeps_order_across_handles_and_prunes_old_messages(backend: Backend):
    one, two = await backend.open(), await backend.open()
    start = await two.bus_last()
    sent = await asyncio.gather(*((one if i % 2 else two).bus_publish("t", f'{{"n": {i}}}', f"o{i % 2}", NOW)
                                  for i in range(10)))
    assert sorted(sent) == list(range(start + 1, start + 11))
    read = await one.bus_read(start)
    assert [r[0] for r in read] == sorted(sent) and {r[2] for r in read} == {f'{{"n": {i}}}' for i in range(10)}
    assert await one.bus_read(start, limit=3) == read[:3]
    assert await two.bus_prune("2030-01-01T00:00:00Z") == 9  # the last one stays: numbering never restarts
    assert await one.bus_last() == start + 10
    assert (await two.bus_publish("t", "{}", "o", NOW)) == start + 11


async def test_a_review_transition_happens_once(backend: Backend):
    one, two = await backend.open(), await backend.open()
    org = await an_org(one)
    review = Review(id=new_id(), org_id=org, session_id=new_id(), connection_id="c", type="jit", status="APPROVED",
                    owner_id="ann", created_at=NOW, access_duration=60_000_000_000)
    await one.create_review(review)
    won = await asyncio.gather(*(h.transition_review(review.id, "APPROVED", "REVOKED", NOW) for h in (one, two, one)))
    assert won.count(True) == 1
    assert (await two.get_review(review.id)).status == "REVOKED"
    assert await one.transition_review(review.id, "APPROVED", "REVOKED", NOW) is False


async def test_a_review_saved_as_read_is_saved_once(backend: Backend):
    """Two processes that read the same review and decide on it: the first save holds, the second stores nothing."""
    one, two = await backend.open(), await backend.open()
    org = await an_org(one)
    rid = new_id()
    review = Review(id=rid, org_id=org, session_id=new_id(), connection_id="c", type="jit", status="PENDING",
                    owner_id="ann", created_at=NOW, updated_at=NOW,
                    groups=[ReviewGroup(id=new_id(), review_id=rid, group_name=g) for g in ("dba", "sec")])
    await one.create_review(review)
    rejected, approved = await one.get_review(rid), await two.get_review(rid)
    rejected.status, rejected.updated_at, rejected.groups[0].status = "REJECTED", "2030-01-01T00:00:01Z", "REJECTED"
    approved.status, approved.updated_at, approved.groups[1].status = "APPROVED", "2030-01-01T00:00:02Z", "APPROVED"
    assert await one.save_review(rejected, was=("PENDING", NOW)) is True
    assert await two.save_review(approved, was=("PENDING", NOW)) is False
    stored = await two.get_review(rid)
    assert stored.status == "REJECTED" and [g.status for g in stored.groups] == ["REJECTED", None]
    assert await two.save_review(approved) is True  # without ``was``: saved as it is


async def test_what_cannot_be_claimed(store: Store):
    org = await an_org(store)
    done = a_session(org, status="done", end_date=NOW)
    ended = a_session(org, status="open", end_date=NOW)
    for s in (done, ended):
        await store.create_session(s)
    assert await store.claim_session(done.id, NOW) is None
    assert await store.claim_session(ended.id, NOW) is None
    assert await store.claim_session("no-such-session", NOW) is None
    assert (await store.get_session(done.id)).claimed_at is None


async def test_start_moves_a_ready_session_to_open_without_claiming_it(store: Store):
    org = await an_org(store)
    ready = a_session(org, status="ready")
    await store.create_session(ready)
    assert await store.start_session(ready.id, "2026-03-01T00:00:00Z") is True
    started = await store.get_session(ready.id)
    assert (started.status, started.start_date, started.claimed_at) == ("open", "2026-03-01T00:00:00Z", None)
    assert await store.start_session(ready.id, NOW) is False  # open already
    assert (await store.claim_session(ready.id, NOW)).status == "open"  # still claimable once


async def test_request_kill_marks_the_row_and_stops_a_claim(store: Store):
    org = await an_org(store)
    ready, live, done = a_session(org, status="ready"), a_session(org), a_session(org, status="done")
    for s in (ready, live, done):
        await store.create_session(s)
    killed = await store.request_kill(ready.id, "revoked by an admin", NOW)
    assert (killed.id, killed.kill_reason, killed.kill_requested_at, killed.status) == \
        (ready.id, "revoked by an admin", NOW, "ready")
    again = await store.request_kill(ready.id, "second reason", "2027-01-01T00:00:00Z")
    assert (again.kill_reason, again.kill_requested_at) == ("revoked by an admin", NOW)  # the first one stays
    assert await store.claim_session(ready.id, NOW) is None
    assert await store.start_session(ready.id, NOW) is False
    assert (await store.request_kill(live.id, "why", NOW)).status == "open"
    assert await store.request_kill(done.id, "why", NOW) is None
    assert await store.request_kill("no-such-session", "why", NOW) is None


async def test_ai_analysis_is_stored_and_may_depend_on_the_status(store: Store):
    org = await an_org(store)
    ready, running = a_session(org, status="ready"), a_session(org)
    for s in (ready, running):
        await store.create_session(s)
    verdict = {"risk_level": "high", "blocked": True}
    assert await store.set_ai_analysis(ready.id, verdict, status="ready") is True
    assert await store.set_ai_analysis(running.id, verdict, status="ready") is False
    assert (await store.get_session(running.id)).ai_analysis is None
    assert await store.set_ai_analysis(running.id, verdict) is True
    assert (await store.get_session(ready.id)).ai_analysis == verdict
    assert (await store.get_session(running.id)).ai_analysis == verdict


# ---------------------------------------------------------------------------- reviews and rules

async def test_reviews_round_trip_and_list_what_one_may_see(store: Store):
    org = await an_org(store)

    def review(owner: str, status: str, created: str, groups: list[str], forced: list[str] = ()) -> Review:
        rid = new_id()
        return Review(id=rid, org_id=org, session_id=new_id(), connection_id="c", type="jit", status=status,
                      owner_id=owner, created_at=created, access_duration=60_000_000_000,
                      force_approval_groups=list(forced), time_window={"type": "time_range"},
                      groups=[ReviewGroup(id=new_id(), review_id=rid, group_name=g) for g in groups])

    mine = review("ann", "PENDING", "2026-01-01T00:00:00Z", ["dba", "sec"])
    theirs = review("bob", "PENDING", "2026-01-02T00:00:00Z", ["sec"])
    forced = review("bob", "APPROVED", "2026-01-03T00:00:00Z", [], forced=["dba"])
    session = a_session(org, status="ready", verb="exec", script="select 1")
    mine.session_id = session.id
    await store.create_review(mine, session)
    for r in (theirs, forced):
        await store.create_review(r)
    assert await store.get_review(mine.id) == mine
    assert (await store.get_session(session.id)).script == "select 1"
    assert await store.get_review_by_session(session.id) == mine

    async def listed(**kw) -> tuple[list[str], int]:
        page = await store.list_reviews(org, **kw)
        return [r.id for r in page.items], page.total

    assert await listed() == ([forced.id, theirs.id, mine.id], 3)
    assert await listed(limit=1, offset=1) == ([theirs.id], 3)
    assert await listed(status="PENDING", type="jit") == ([theirs.id, mine.id], 2)
    assert await listed(visible_to=("ann", [])) == ([mine.id], 1)
    assert await listed(visible_to=("cy", ["dba"])) == ([forced.id, mine.id], 2)
    assert await listed(visible_to=("cy", ["sec", "ops"])) == ([theirs.id, mine.id], 2)
    mine.status, mine.revoke_at, mine.updated_at = "APPROVED", NOW, NOW
    mine.groups[0].status, mine.groups[0].reviewed_by_email = "APPROVED", "boss@example.com"
    mine.groups = mine.groups[:1]
    await store.save_review(mine)
    assert await store.get_review(mine.id) == mine
    assert {r.id for r in await store.reviews_with_status("APPROVED")} == {mine.id, forced.id}
    assert await store.reviews_with_status("APPROVED", "onetime") == []


async def test_access_rules_ai_rules_and_the_ai_provider(store: Store):
    org = await an_org(store)
    rule = AccessRequestRule(id=new_id(), org_id=org, name="prod", access_type="jit", connection_names=["pg"],
                             reviewers_groups=["dba"], min_approvals=2, created_at=NOW, updated_at=NOW)
    await store.save_access_rule(rule, create=True)
    with pytest.raises(Conflict):
        await store.save_access_rule(AccessRequestRule(id=new_id(), org_id=org, name="prod", access_type="jit"),
                                     create=True)
    rule.description = "changed"
    await store.save_access_rule(rule, create=False)
    assert await store.get_access_rule(org, rule.id) == rule
    await store.save_access_rule(AccessRequestRule(id=new_id(), org_id=org, name="Dev", access_type="command"),
                                 create=True)
    assert [r.name for r in await store.list_access_rules(org)] == ["Dev", "prod"]
    await store.delete_access_rule(org, "prod")
    assert await store.get_access_rule(org, "prod") is None

    ai = AIAnalyzerRule(id=new_id(), org_id=org, name="watch", connection_names=["pg"],
                        risk_evaluation={"high_risk_action": "block"}, on_failure="closed", timeout=2.5,
                        created_at=NOW, updated_at=NOW)
    await store.save_ai_rule(ai, create=True)
    assert await store.get_ai_rule(org, "watch") == ai
    ai.timeout, ai.native_mode = None, "sync"
    await store.save_ai_rule(ai, create=False)
    assert [(r.timeout, r.native_mode) for r in await store.list_ai_rules(org)] == [(None, "sync")]
    await store.delete_ai_rule(org, ai.id)
    assert await store.list_ai_rules(org) == []

    assert await store.get_ai_provider(org) is None
    provider = AIProvider(id=new_id(), org_id=org, provider="openai", model="m1", api_key="sk-secret",
                          created_at=NOW, updated_at=NOW)
    await store.save_ai_provider(provider)
    await store.save_ai_provider(AIProvider(id=new_id(), org_id=org, provider="anthropic", model="m2",
                                            api_key="sk-other", created_at=NOW, updated_at="later"))
    got = await store.get_ai_provider(org)
    assert (got.id, got.provider, got.model, got.api_key, got.updated_at) == \
        (provider.id, "anthropic", "m2", "sk-other", "later")  # one per org: upserted in place
    raw = await store.db.fetch("SELECT api_key FROM ai_providers WHERE org_id = ?", (org,))
    assert b"sk-other" not in bytes(raw[0][0])
    assert await store.delete_ai_provider(org) is True
    assert await store.delete_ai_provider(org) is False


async def test_agents_round_trip_found_by_name_id_or_token_hash_within_their_org(store: Store):
    org, other = await an_org(store), (await store.create_org("other")).id
    agent = Agent(id=new_id(), org_id=org, name="vpc-a", mode="standard", token_hash="h1", created_at=NOW,
                  updated_at=NOW)
    await store.create_agent(agent)
    with pytest.raises(Conflict):  # one name per organization
        await store.create_agent(Agent(id=new_id(), org_id=org, name="vpc-a", token_hash="h2", created_at=NOW,
                                       updated_at=NOW))
    with pytest.raises(Conflict):  # a token hash is one agent's
        await store.create_agent(Agent(id=new_id(), org_id=other, name="x", token_hash="h1", created_at=NOW,
                                       updated_at=NOW))
    await store.create_agent(Agent(id=new_id(), org_id=other, name="vpc-a", token_hash="h3", created_at=NOW,
                                   updated_at=NOW))
    await store.create_agent(Agent(id=new_id(), org_id=org, name="Lab", token_hash="h4", created_at=NOW,
                                   updated_at=NOW))
    assert await store.get_agent(org, "vpc-a") == agent == await store.get_agent(org, agent.id)
    assert await store.get_agent(other, agent.id) is None  # never another organization's
    assert await store.agent_by_token("h1") == agent and await store.agent_by_token("nope") is None
    assert [a.name for a in await store.list_agents(org)] == ["Lab", "vpc-a"]
    agent.token_hash, agent.status, agent.hostname, agent.connected_at = "h5", "online", "box", NOW
    await store.save_agent(agent)
    assert await store.agent_by_token("h1") is None and await store.agent_by_token("h5") == agent
    stale = Agent(id=agent.id, org_id=org, name="vpc-a", token_hash="h1", status="online", hostname="stolen")
    assert await store.save_agent_presence(stale, ("status", "hostname")) is False  # a rotated token's copy
    assert await store.get_agent(org, agent.id) == agent
    agent.status, agent.hostname = "offline", "box2"
    assert await store.save_agent_presence(agent, ("status", "hostname")) is True
    assert await store.get_agent(org, agent.id) == agent
    assert await store.delete_agent(org, "vpc-a") is True and await store.delete_agent(org, "vpc-a") is False
    assert await store.get_agent(org, agent.id) is None
    assert [a.name for a in await store.list_agents(other)] == ["vpc-a"]


# ---------------------------------------------------------------------------- audit, settings, keys

async def test_the_audit_log_chains_per_org_and_filters(store: Store):
    org = await an_org(store)
    other = (await store.create_org("other")).id

    def entry(org_id: str, action: str, when: str, outcome: str = "success") -> AuditEntry:
        return AuditEntry(id=new_id(), org_id=org_id, created_at=when, actor_subject="sub-a",
                          actor_email="Ann@example.com", actor_name="Ann", resource_type="session", action=action,
                          outcome=outcome, request_payload_redacted={"k": "v"})

    written = [entry(org, "a", "2026-01-01T00:00:00Z"), entry(other, "x", "2026-01-01T00:00:01Z"),
               entry(org, "b", "2026-01-02T00:00:00Z", "failure"), entry(org, "c", "2026-01-02T00:00:00Z")]
    for e in written:
        await store.append_audit(e)
    await store.append_audit(written[2])  # sent again (kept through an outage): stored once
    chain = await store.audit_chain(org)
    assert [c["action"] for c in chain] == ["a", "b", "c"]
    assert chain[0]["prev_hash"] == CHAIN_GENESIS
    assert [c["prev_hash"] for c in chain[1:]] == [c["hash"] for c in chain[:-1]]
    assert (await store.audit_chain(other))[0]["prev_hash"] == CHAIN_GENESIS
    page = await store.list_audit(AuditFilter(org_id=org))
    assert ([e.action for e in page.items], page.total) == (["c", "b", "a"], 3)  # newest, then last written
    assert page.items[0].request_payload_redacted == {"k": "v"} and page.items[0].hash == chain[2]["hash"]
    assert [e.action for e in (await store.list_audit(AuditFilter(org_id=org, page=2, page_size=2))).items] == ["a"]
    assert (await store.list_audit(AuditFilter(actor="ann@EXAMPLE.com"))).total == 4
    assert [e.action for e in (await store.list_audit(AuditFilter(org_id=org, outcome="failure"))).items] == ["b"]
    assert (await store.list_audit(AuditFilter(created_after="2026-01-01T00:00:01Z",
                                               created_before="2026-01-01T23:00:00Z"))).total == 1


async def test_audit_appends_from_two_handles_never_fork_the_chain(backend: Backend):
    one, two = await backend.open(), await backend.open()
    org = await an_org(one)
    await asyncio.gather(*(s.append_audit(AuditEntry(
        id=new_id(), org_id=org, created_at=NOW, actor_subject="s", actor_email="e", actor_name="n",
        resource_type="r", action=str(i), outcome="success")) for i, s in enumerate([one, two] * 10)))
    chain = await one.audit_chain(org)
    assert len(chain) == 20
    assert [c["prev_hash"] for c in chain] == [CHAIN_GENESIS] + [c["hash"] for c in chain[:-1]]


async def test_short_lived_keys_are_taken_once_and_pruned_by_prefix_and_age(backend: Backend):
    one, two = await backend.open(), await backend.open()
    await one.put_key("oidc-login:a", b"pending-a")
    await one.put_key("other-key", b"kept")
    taken = await asyncio.gather(one.delete_key("oidc-login:a"), two.delete_key("oidc-login:a"))
    assert sorted(taken) == [False, True]
    await one.put_key("oidc-login:b", b"pending-b")
    assert await two.prune_keys("oidc-login:", "2000-01-01T00:00:00Z") == 0  # none that old
    assert await two.prune_keys("oidc-login:", "2999-01-01T00:00:00Z") == 1
    assert await one.get_key("oidc-login:b") is None and await one.get_key("other-key") == b"kept"


async def test_settings_and_keys_are_upserted(store: Store):
    assert await store.get_setting("listeners") is None
    await store.put_setting("listeners", {"postgres": 15432})
    await store.put_setting("listeners", {"postgres": 25432, "ssh": [1, 2]})
    assert await store.get_setting("listeners") == {"postgres": 25432, "ssh": [1, 2]}
    assert await store.get_key("host") is None
    await store.put_key("host", b"\x00material")
    await store.put_key("host", b"\x01other")
    assert await store.get_key("host") == b"\x01other"
    assert await store.delete_key("host") is True
    assert await store.delete_key("host") is False and await store.get_key("host") is None


# ---------------------------------------------------------------------------- backend specifics

async def test_sqlite_without_returning_claims_and_kills_the_same_way(tmp_path):
    """An SQLite older than 3.35 has no RETURNING: the UPDATE and a SELECT in one write transaction."""
    from gatewayd.store.sqlite import SQLiteStore

    store = SQLiteStore(tmp_path / "old.db", SecretBox(os.urandom(32)))
    store.dialect.returning = False
    await store.open()
    try:
        org = await an_org(store)
        ready = a_session(org, status="ready")
        await store.create_session(ready)
        won = await asyncio.gather(*(store.claim_session(ready.id, NOW) for _ in range(3)))
        assert [w is not None for w in won].count(True) == 1
        assert (await store.request_kill(ready.id, "why", NOW)).kill_reason == "why"
        assert await store.set_ai_analysis(ready.id, {"a": 1}, status="ready") is False
    finally:
        await store.close()


async def test_sessions_listed_have_json_fields_of_their_own(store: Store):
    """The empty maps and lists of stored JSON fields are made without the json module (sql.loads): each session
    read has its own, so that a change to one's tags is never another's."""
    org = await an_org(store)
    for n in range(3):
        await store.create_session(a_session(org, start=f"2026-04-0{n + 1}T00:00:00Z", tags={}, metadata={}))
    tagged = a_session(org, start="2026-04-05T00:00:00Z")
    tagged.tags, tagged.ai_analysis = {"team": "db"}, {"risk": "low", "notes": []}
    await store.create_session(tagged)
    page = await store.list_sessions(SessionFilter(org_id=org))
    first, second, third = page.items[1:]
    assert (first.tags, first.metadata, first.ai_analysis) == ({}, {}, None)
    first.tags["team"] = "changed"
    first.metrics["bytes"] = 1
    assert second.tags == {} and second.metrics == {} and third.tags == {}
    again = await store.list_sessions(SessionFilter(org_id=org))
    assert all(s.tags == {} and s.metrics == {} for s in again.items[1:])
    assert (again.items[0].tags, again.items[0].ai_analysis) == ({"team": "db"}, {"risk": "low", "notes": []})


def test_stored_json_is_read_as_json_whatever_its_shape():
    from gatewayd.store.sql import loads

    made = [loads("{}"), loads("{}"), loads("[]"), loads("[]")]
    assert made == [{}, {}, [], []] and len({id(value) for value in made}) == 4  # fresh objects
    assert loads("null") is None and loads(b"{}") == {} and loads(' {"a": [1, null]} ') == {"a": [1, None]}
    assert loads('"{}"') == "{}" and loads("0") == 0 and loads("[{}]") == [{}]
    with pytest.raises(ValueError):
        loads("{")


def test_a_record_is_built_from_any_shape_of_row_as_its_fields_say():
    """``build`` / ``built`` / ``joined`` (a maker made once per query shape): the fields in any order of columns,
    a column missing (its default), columns the record lacks (left out), ``extra`` over the row's own value, JSON
    columns read (NULL stays None), and a joined record under its prefix, where a NULL id means none."""
    import sqlite3

    from gatewayd.models import Review, Session
    from gatewayd.store.sql import build, built, columns, encode, joined

    db = sqlite3.connect(":memory:")
    db.row_factory = sqlite3.Row
    session = Session(id="s1", org_id="o", user_id="u", user_email="e", user_name="n", connection="c",
                      connection_id="ci", resource_name="r", type="database", subtype="postgres", tags={"t": "1"},
                      metrics={"bytes": 2}, ai_analysis=None, exit_code=3)
    names = list(reversed(columns(Session)))  # another order than the fields'
    names.remove("verb")  # a column the query did not select: the field's default
    db.execute(f"CREATE TABLE s ({', '.join(names)}, other)")
    db.execute(f"INSERT INTO s VALUES ({', '.join('?' * (len(names) + 1))})",
               [encode(name, getattr(session, name)) for name in names] + ["not a field"])
    row = db.execute("SELECT * FROM s").fetchone()
    assert build(Session, row) == session
    assert built(Session, [row, row]) == [session, session]
    assert build(Session, row, status="done", exit_code=None) == Session(**{**vars_of(session), "status": "done",
                                                                          "exit_code": None})
    review = Review(id="r1", org_id="o", session_id="s1", connection_id="ci", type="onetime", status="APPROVED",
                    owner_id="u", created_at="2026-11-29T00:00:00Z")
    rows = db.execute("SELECT 1 AS id, ? AS rv_id, ? AS rv_org_id, ? AS rv_session_id, ? AS rv_connection_id, "
                      "? AS rv_type, ? AS rv_status, ? AS rv_owner_id, ? AS rv_created_at "
                      "UNION ALL SELECT 2, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL",
                      ("r1", "o", "s1", "ci", "onetime", "APPROVED", "u", "2026-11-29T00:00:00Z")).fetchall()
    assert list(joined(Review, rows, "rv_")) == [review]


def vars_of(record: Any) -> dict[str, Any]:
    from gatewayd.store.sql import columns

    return {name: getattr(record, name) for name in columns(type(record))}


async def test_postgres_plans_every_statement_for_its_values(pg_store):
    """asyncpg prepares every statement; PostgreSQL may then keep one generic plan for it after five runs, which
    for a list filtered by a rare or a common value reads the wrong index (an audit page filtered by outcome:
    8 ms, then 40 ms at a million entries). The store's connections plan each run for its values."""
    from gatewayd.store.postgres import PostgresStore
    from tests.conftest import new_store_database

    store = PostgresStore(await new_store_database(pg_store), SecretBox(os.urandom(32)))
    await store.open()
    try:
        org = await an_org(store)
        await store.create_session(a_session(org))
        for run in range(24):  # each statement at least six times on each of the pool's connections
            status = ("open", "done", "ready")[run % 3]
            await store.list_sessions(SessionFilter(org_id=org, status=status))
            await store.list_audit(AuditFilter(org_id=org, outcome="failure" if status == "open" else "success"))
        pool = store.db._open_pool()
        held = [await pool.acquire() for _ in range(pool.get_size())]  # every connection the pool opened
        try:
            planned, modes = [], set()
            for connection in held:
                planned += await connection.fetch(
                    "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE cardinality(parameter_types) "
                    "> 0 AND (statement LIKE '%FROM sessions WHERE%' OR statement LIKE '%FROM audit_logs WHERE%')")
                modes.add(await connection.fetchval("SHOW plan_cache_mode"))
        finally:
            for connection in held:
                await pool.release(connection)
        assert sum(p["custom_plans"] for p in planned) >= 4 * 24
        assert [p["generic_plans"] for p in planned] == [0] * len(planned)
        assert modes == {"force_custom_plan"}
    finally:
        await store.close()


async def test_a_postgres_store_call_is_its_statements_alone(pg_store):
    """A pooled connection given back is not reset with a statement of its own (asyncpg's default sent four after
    every call: a round trip each time), and it is clean all the same: a transaction that failed half-way is rolled
    back before the next call, which sees none of its writes."""
    from gatewayd.store.postgres import PostgresStore
    from tests.conftest import new_store_database

    store = PostgresStore(await new_store_database(pg_store), SecretBox(os.urandom(32)))
    await store.open()
    try:
        org = await an_org(store)
        await asyncio.gather(*(store.db.fetch("SELECT pg_sleep(0.05)") for _ in range(3)))  # three connections
        pool, sent = store.db._open_pool(), []
        held = [await pool.acquire() for _ in range(pool.get_size())]
        for connection in held:
            connection.add_query_logger(lambda record: sent.append(record.query))
            await pool.release(connection)
        for n in range(12):
            assert (await store.db.fetch("SELECT ?::int", (n,)))[0][0] == n
        assert sent == ["SELECT $1::int"] * 12

        doomed = a_session(org)

        def fails_half_way():
            yield insert("sessions", doomed)
            yield "SELECT 1 / 0", ()

        with pytest.raises(Exception, match="division by zero"):
            await store.db.transact(fails_half_way())
        for _ in range(len(held) * 2):  # every connection, whichever the pool hands out
            assert await store.get_session(doomed.id) is None
        held = [await pool.acquire() for _ in range(pool.get_size())]
        try:
            assert [connection.is_in_transaction() for connection in held] == [False] * len(held)
        finally:
            for connection in held:
                await pool.release(connection)
    finally:
        await store.close()


def test_numbered_placeholders_for_a_dollar_dialect():
    from gatewayd.store.sql import numbered

    assert numbered("UPDATE t SET a = ? WHERE b IN (?, ?)") == "UPDATE t SET a = $1 WHERE b IN ($2, $3)"


async def test_postgres_store_errors_never_show_the_url_s_password(pg_store):
    from gatewayd.store import StoreError
    from gatewayd.store.postgres import PostgresStore

    url = pg_store.dsn(password="wrong-hunter2")
    store = PostgresStore(url, SecretBox(os.urandom(32)))
    with pytest.raises(StoreError) as err:
        await store.open()
    message = str(err.value)
    assert "password authentication failed" in message and ":***@127.0.0.1" in message
    assert "hunter2" not in message and err.value.__cause__ is None and err.value.__suppress_context__


async def test_a_postgres_write_completes_when_its_caller_is_cancelled(pg_store):
    """As the SQLite writer thread does: a transaction under way is committed, not rolled back, when the task
    that awaits it is cancelled (a recording flush cancelled at shutdown loses nothing)."""
    from gatewayd.store.postgres import PostgresStore
    from tests.conftest import new_store_database

    url, box = await new_store_database(pg_store), SecretBox(os.urandom(32))
    store = PostgresStore(url, box)
    await store.open()
    org = await an_org(store)
    session = a_session(org)
    under_way = asyncio.Event()

    def work():
        under_way.set()
        yield "SELECT pg_sleep(0.2)", ()  # the caller is cancelled while this runs
        yield insert("sessions", session)

    caller = asyncio.create_task(store.db.transact(work()))
    await under_way.wait()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    await store.close()  # waits for the transactions under way
    again = PostgresStore(url, box)
    await again.open()
    try:
        assert await again.get_session(session.id) == session
    finally:
        await again.close()


async def test_postgres_orders_text_by_code_point_whatever_the_database_locale(pg_store):
    """A database made with a linguistic locale (ICU en-US sorts "a" before "B") lists as SQLite does."""
    from gatewayd.store.postgres import PostgresStore
    from tests.conftest import new_store_database

    url = await new_store_database(pg_store, "LOCALE_PROVIDER icu ICU_LOCALE 'en-US' LOCALE 'C.UTF-8'")
    store = PostgresStore(url, SecretBox(os.urandom(32)))
    await store.open()
    try:
        assert [r[0] for r in await store.db.fetch("SELECT x FROM (VALUES ('a'), ('B')) v(x) ORDER BY x")] == \
            ["a", "B"]  # the database's own order
        org = await an_org(store)
        await store.create_resource(Resource(id=new_id(), org_id=org, name="res", type="database", subtype="postgres",
                                             created_at=NOW, updated_at=NOW),
                                    [a_connection(org, "a-role"), a_connection(org, "B-role")])
        assert [c.name for c in await store.list_connections(org)] == ["B-role", "a-role"]
        for name in ("b-rail", "A-rail"):
            await store.save_guardrail(a_rail(org, name, ["c1"]), create=True)
        assert [r.name for r in await store.list_guardrails(org, "c1")] == ["A-rail", "b-rail"]
        assert [r[0] for r in await store.db.fetch("SELECT name FROM connections WHERE name > ? ORDER BY name",
                                                   ("Z",))] == ["a-role"]  # comparisons too, not only ORDER BY
    finally:
        await store.close()


def test_postgres_ddl_rewrites_types_and_never_a_literal():
    import re

    from gatewayd.store.postgres import PostgresDialect

    literals = re.compile(r"'[^']*'")
    for version, script in MIGRATIONS:
        if callable(script):  # a dialect's own statements (the text index): written for PostgreSQL already
            assert all("row_order BIGINT GENERATED ALWAYS AS IDENTITY" in s for s in script(PostgresDialect())
                       if s.startswith("CREATE TABLE")), version
            continue
        translated = PostgresDialect().ddl(script)
        assert literals.findall(translated) == literals.findall(script), version
        assert not re.search(r"\b(BLOB|REAL|INTEGER)\b", translated), version
        assert translated.count("row_order BIGINT GENERATED ALWAYS AS IDENTITY") == script.count("CREATE TABLE ")


# ---------------------------------------------------------------------------- tamper evidence, as an intruder edits

async def sealing_gateway(store: Store):
    """The gateway's own services on ``store``: its key loaded, the audit chain keyed with it."""
    from gatewayd.audit import AuditLog
    from gatewayd.recording import RecordingService
    from gatewayd.sessions import SessionManager

    sealer = await Sealer.load(store)
    store.audit_key = sealer.audit_key
    recording = RecordingService(store, cap=1 << 20, flush_interval=60, sealer=sealer)
    return SessionManager(store, recording, AuditLog(store)), recording


async def sealed_session(store: Store, manager, recording, batches: int = 3, **fields) -> Session:
    """A session recorded in ``batches`` flushes and closed as a live one is: sealed, its sealing audited (by the
    recording service, through ``manager``, once the store took the close)."""
    session = a_session(await an_org(store), script="select secret from vault", verb="exec", **fields)
    await store.create_session(session)
    recorder = await recording.recorder(session.id, started=0.0)
    for n in range(batches):
        recorder.input(f"statement {n}\n")
        recorder.output(f"answer {n}\n")
        await recording.flush()
    await recording.close(recorder, session, end_date=NOW, exit_code=0)
    return await store.get_session(session.id)


async def intrude(store: Store, *statements: tuple[str, tuple]) -> None:
    await store.db.transact(in_order(list(statements)))


async def test_a_sealed_session_set_open_again_is_not_sealed_again_and_verification_tells(store: Store):
    """Issue 31: remove events from a sealed recording, re-hash the chain, set the session open and drop its seal:
    the sweep of sessions left open sealed the cut recording and ``verify`` said intact. Its sealing is in the
    audit chain now: the sweep leaves it as it is (a failure entry says why) and ``verify`` says the seal was
    removed."""
    manager, recording = await sealing_gateway(store)
    session = await sealed_session(store, manager, recording)
    result = await recording.verify(session)
    assert result.verified and result.sealed and result.links == 3, result.problems
    links, numbered = await store.read_event_chain(session.id)
    kept = [event for seq, event in numbered if seq < links[1].first_seq]  # the last two batches cut
    head = batch_hash(CHAIN_GENESIS, session.id, 0, kept)
    await intrude(store,
                  ("DELETE FROM session_event_batches WHERE session_id = ? AND first_seq > 0", (session.id,)),
                  ("UPDATE session_event_batches SET count = ?, hash = ?, events = ? WHERE session_id = ?",
                   (len(kept), head, pack_events(0, kept), session.id)),
                  ("UPDATE sessions SET status = 'open', seal = NULL, end_date = NULL, exit_code = NULL, chain_head = ?, "
                   "event_size = ? WHERE id = ?", (head, sum(len(e.data) for e in kept), session.id)))
    assert await manager.close_orphans(Node(id="", name="", slot=0, host="", pid=0, started_at=NOW,
                                            heartbeat_at=NOW), "left open by a previous run") == 1
    found = await store.get_session(session.id)
    assert (found.status, found.seal) == ("open", None)  # never sealed again
    refusals = (await store.list_audit(AuditFilter(org_id=session.org_id, action="session.seal",
                                                   outcome="failure"))).items
    assert len(refusals) == 1 and "is not sealed again" in refusals[0].error_message
    assert len(await store.sealings(session.id)) == 1
    result = await recording.verify(found)
    assert not result.verified and any("but has no seal now: the seal was removed" in p for p in result.problems)
    assert (await manager.audit.verify(session.org_id)).verified  # the audit chain itself is whole


async def test_a_sealed_session_s_identity_changed_in_the_store_is_told(store: Store):
    """Issue 31: the seal did not cover who, what and when: a sealed session's user, connection, start, verb or
    script changed in the store left ``verify`` at intact."""
    manager, recording = await sealing_gateway(store)
    session = await sealed_session(store, manager, recording, batches=1)
    for column, value in (("user_id", "sub-mallory"), ("user_email", "mallory@example.com"), ("connection", "other"),
                          ("connection_id", "id-other"), ("start_date", "2025-01-01T00:00:00Z"), ("verb", "connect"),
                          ("script", "select 1")):
        original = getattr(session, column)
        await intrude(store, (f"UPDATE sessions SET {column} = ? WHERE id = ?", (value, session.id)))
        result = await recording.verify(await store.get_session(session.id))
        assert not result.verified and any(p.startswith("the seal does not match") for p in result.problems), column
        await intrude(store, (f"UPDATE sessions SET {column} = ? WHERE id = ?", (original, session.id)))
    assert (await recording.verify(await store.get_session(session.id))).verified


async def test_an_audit_log_stripped_or_re_hashed_in_the_store_does_not_verify(store: Store):
    """Issue 31: ``audit verify`` said intact after every hash was blanked (0 links, 7479 entries), and new entries
    chained from the start again. Its links are keyed now: blanked or re-computed without the key, none verifies."""
    from gatewayd.evidence import audit_hash

    manager, _ = await sealing_gateway(store)
    org = await an_org(store)
    for number in range(4):
        await manager.audit.record(org_id=org, actor=None, action=f"test.{number}", resource_type="test",
                                   outcome="success", payload={"n": number})
    assert (await manager.audit.verify(org)).verified
    await intrude(store, ("UPDATE audit_logs SET hash = '', prev_hash = '' WHERE org_id = ?", (org,)))
    result = await manager.audit.verify(org)
    assert not result.verified and result.links == 0 and "none of its 4 entries verifies" in result.problems[-1]
    previous, rehashed = CHAIN_GENESIS, []  # the whole chain re-computed as the store's code would without the key
    for row in await store.audit_chain(org):
        row["prev_hash"] = previous
        row["hash"] = previous = audit_hash(previous, row)
        rehashed.append(("UPDATE audit_logs SET prev_hash = ?, hash = ? WHERE id = ?",
                         (row["prev_hash"], row["hash"], row["id"])))
    await intrude(store, *rehashed)
    result = await manager.audit.verify(org)
    assert not result.verified and "none of its 4 entries verifies" in result.problems[-1]


# ---------------------------------------------------------------------------- issue 35: runbooks, keys, plugins,
# webhooks, reports

async def test_runbook_repositories_keep_their_credentials_sealed_and_rules_round_trip(store: Store):
    from gatewayd.models import RunbookRepository, RunbookRule

    org = await an_org(store)
    repo = RunbookRepository(id="r1", org_id=org, repository="git.example/ops", git_url="https://git.example/ops",
                             branch="main", folder="db", git_user="rita", credentials={"git_password": "pw-7x"},
                             created_at=NOW, updated_at=NOW)
    await store.save_runbook_repository(repo, create=True)
    with pytest.raises(Conflict):
        await store.save_runbook_repository(repo, create=True)
    assert await store.list_runbook_repositories(org) == [repo]
    raw = await store.db.fetch("SELECT credentials FROM runbook_repositories")
    assert b"pw-7x" not in bytes(raw[0][0])
    other = RunbookRepository(id="r2", org_id=org, repository="git.example/b", git_url="https://git.example/b",
                              created_at=NOW, updated_at=NOW)
    await store.replace_runbook_repositories(org, [other])
    assert [r.id for r in await store.list_runbook_repositories(org)] == ["r2"]
    assert await store.delete_runbook_repository(org, "r2") and not await store.delete_runbook_repository(org, "r2")
    rule = RunbookRule(id=new_id(), org_id=org, name="dba", runbooks=[{"repository": "r", "name": "a.runbook.sql"}],
                       connections=["pg"], user_groups=["dba"], created_at=NOW, updated_at=NOW)
    await store.save_runbook_rule(rule, create=True)
    assert await store.get_runbook_rule(org, "dba") == rule == await store.get_runbook_rule(org, rule.id)
    assert await store.list_runbook_rules(org) == [rule] and await store.get_runbook_rule("other", rule.id) is None
    assert await store.delete_runbook_rule(org, rule.id) and await store.list_runbook_rules(org) == []


async def test_one_active_api_key_per_kind_and_a_pending_one_promoted_atomically(store: Store):
    from gatewayd.models import ApiKey

    org = await an_org(store)

    def key(status: str, secret_hash: str) -> ApiKey:
        return ApiKey(id=new_id(), org_id=org, kind="server", key_hash=secret_hash, prefix=secret_hash[:4],
                      user_id="u", status=status, created_at=NOW)

    first = key("active", "hash-1")
    await store.create_api_key(first)
    with pytest.raises(Conflict):
        await store.create_api_key(key("active", "hash-2"))
    await store.create_api_key(key("pending", "hash-3"))
    await store.create_api_key(key("pending", "hash-4"), replace_pending=True)  # the earlier pending one goes
    assert await store.get_api_key("hash-3") is None
    assert not await store.promote_api_key(org, "server", "hash-1", NOW)  # not a pending one
    assert await store.promote_api_key(org, "server", "hash-4", NOW)
    assert (await store.get_api_key("hash-1")).status == "revoked" and (await store.get_api_key("hash-4")).status \
        == "active"
    await store.touch_api_key(first.id, NOW)
    assert (await store.get_api_key("hash-1")).last_used_at == NOW
    assert await store.revoke_api_keys(org, "server", NOW) == 1 and await store.api_keys_of(org, "server", "active") \
        == []


async def test_plugins_keep_settings_sealed_and_their_connections(store: Store):
    from gatewayd.models import Plugin, PluginConnection

    org = await an_org(store)
    plugin = Plugin(id=new_id(), org_id=org, name="slack", config={"SLACK_BOT_TOKEN": "xoxb-secret"},
                    created_at=NOW, updated_at=NOW)
    await store.save_plugin(plugin, create=True)
    with pytest.raises(Conflict):
        await store.save_plugin(Plugin(id=new_id(), org_id=org, name="slack", created_at=NOW, updated_at=NOW),
                                create=True)
    assert b"xoxb-secret" not in bytes((await store.db.fetch("SELECT config FROM plugins"))[0][0])
    link = PluginConnection(id=new_id(), org_id=org, plugin_id=plugin.id, connection_id="c1", config=["C1"],
                            updated_at=NOW)
    await store.replace_plugin_connections(org, plugin.id, [link])
    plugin.config = {"SLACK_WEBHOOK_URL": "https://hooks.example/x"}
    await store.save_plugin(plugin, create=False)  # its connections stay
    assert (await store.get_plugin(org, "slack")).config == plugin.config
    assert await store.list_plugin_connections(org, plugin.id) == [link]
    await store.save_plugin_connection(PluginConnection(id=new_id(), org_id=org, plugin_id=plugin.id,
                                                        connection_id="c1", config=["C2"], updated_at=NOW))
    assert [lk.config for lk in await store.list_plugin_connections(org)] == [["C2"]]
    assert await store.delete_plugin_connection(org, plugin.id, "c1")
    assert await store.delete_plugin(org, "slack") and await store.list_plugins(org) == []


async def test_each_due_delivery_is_claimed_by_one_handle(backend: Backend):
    from gatewayd.models import Delivery, WebhookEndpoint

    first, second = await backend.open(), await backend.open()
    org = await an_org(first)
    endpoint = WebhookEndpoint(id="e1", org_id=org, url="https://x.example/h", secret="whsec_abc", created_at=NOW,
                               updated_at=NOW, event_types=["ping"])
    await first.save_webhook_endpoint(endpoint, create=True)
    assert await second.get_webhook_endpoint(org, "e1") == endpoint
    assert b"whsec_abc" not in bytes((await first.db.fetch("SELECT secret FROM webhook_endpoints"))[0][0])
    due = [Delivery(id=f"d{i}", org_id=org, endpoint_id="e1", channel="webhook", event_id=f"evt{i}",
                    event_type="ping", body="{}", status="pending", next_attempt_at=NOW, created_at=NOW)
           for i in range(30)]
    later = Delivery(id="later", org_id=org, endpoint_id="e1", channel="webhook", event_id="x", event_type="ping",
                     body="{}", status="pending", next_attempt_at="2099-01-01T00:00:00Z", created_at=NOW)
    await first.add_deliveries(due + [later])
    claimed = await asyncio.gather(*(s.claim_deliveries(NOW, "2030-01-01T00:00:00Z", 20) for s in (first, second)))
    ids = [d.id for batch in claimed for d in batch]
    assert sorted(ids) == sorted(d.id for d in due) and all(d.attempts == 1 for b in claimed for d in b)
    assert await first.claim_deliveries(NOW, "2030-01-01T00:00:00Z", 20) == []  # held
    done = claimed[0][0]
    done.status, done.last_status, done.delivered_at = "delivered", 200, NOW
    await first.finish_delivery(done)
    page = await second.list_deliveries(org, status="delivered")
    assert page.total == 1 and page.items[0].id == done.id and page.items[0].claimed_until is None
    assert (await second.get_delivery(org, "later")).status == "pending"
    assert await first.delete_webhook_endpoint(org, "e1") and await first.list_webhook_endpoints(org) == []


async def test_closed_sessions_are_counted_once_per_day_connection_user_and_protocol(backend: Backend, monkeypatch):
    from gatewayd.store.base import ReportFilter

    # sessions that ended before the rollup existed are counted when it is made
    monkeypatch.setattr(queries, "MIGRATIONS", [m for m in MIGRATIONS if m[0] < 16])
    old = await backend.open()
    org = await an_org(old)
    await old.db.transact(in_order([(
        "INSERT INTO sessions (id, org_id, user_id, user_email, connection, connection_id, type, subtype, verb, "
        "status, start_date, end_date, event_size, metrics) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        ("s-earlier", org, "sub-alice", "sub-alice@example.com", "pg", "id-pg", "database", "postgres", "connect",
         "done", "2026-01-01T10:00:00.000000Z", "2026-01-01T10:00:30.000000Z", 100, '{"masked": 2}'))]))
    await old.close()
    backend.handles.remove(old)
    monkeypatch.setattr(queries, "MIGRATIONS", MIGRATIONS)
    store = await backend.open()
    await backend.open()  # a second process opening: nothing is counted twice
    for start, end, connection, user, metrics in (
            ("2026-01-01T11:00:00.000000Z", "2026-01-01T11:01:00.000000Z", "pg", "sub-bob", {"blocked": 1}),
            ("2026-01-02T09:00:00.000000Z", "2026-01-02T09:00:10.500000Z", "ssh", "sub-alice", {})):
        session = a_session(org, start=start, connection=connection, user=user)
        await store.create_session(session)
        batch = EventBatch.of(session.id, 0, [], {"event_size": 10, "metrics": metrics})
        await store.close_session([batch], end_date=end, exit_code=0, seal=None)
        await store.close_session([EventBatch.of(session.id, 0, [], {})], end_date=end, exit_code=0, seal=None)
    await store.create_session(a_session(org, start="2026-01-01T12:00:00.000000Z"))  # still open: not counted

    everything = ReportFilter(org, "2026-01-01", "2026-01-02")
    by_connection = await store.session_report(everything)
    assert by_connection == [
        {"resource": "pg", "sessions": 2, "duration_ms": 90000, "bytes": 110, "blocks": 1, "masked": 2,
         "masked_sessions": 1},
        {"resource": "ssh", "sessions": 1, "duration_ms": 10500, "bytes": 10, "blocks": 0, "masked": 0,
         "masked_sessions": 0}]
    by_day = await store.session_report(ReportFilter(org, "2026-01-01", "2026-01-02", group_by="day"))
    assert [(r["resource"], r["sessions"]) for r in by_day] == [("2026-01-01", 2), ("2026-01-02", 1)]
    by_user = await store.session_report(ReportFilter(org, "2026-01-02", "2026-01-02", group_by="user"))
    assert [(r["resource"], r["sessions"]) for r in by_user] == [("sub-alice@example.com", 1)]
    assert await store.session_report(ReportFilter("another-org", "2026-01-01", "2026-01-02")) == []
    only_pg = await store.session_report(ReportFilter(org, "2026-01-01", "2026-01-02", group_by="protocol",
                                                      connection="pg"))
    assert only_pg == [{**by_connection[0], "resource": "postgres"}]
    listed = await store.session_metrics(ReportFilter(org, "2026-01-01", "2026-01-01"), 10, 0)
    assert listed.total == 2 and [m["count_masked"] for m in listed.items] == [0, 2]
    assert listed.items[0]["blocks"] == 1 and listed.items[1]["bytes"] == 100


async def test_sqlite_reads_the_rare_session_filters_from_their_indexes(tmp_path):
    """Issue 36, migration 20: SQLite has no statistics of a value's share, so its plans are checked here. A
    connection's open sessions are counted and paged from the connection's index alone (the status is in it: it
    read every session of the connection from the table, 150 ms at a million); a review status pages the reviewed
    sessions (``sessions_reviewed``), not every session."""
    from gatewayd.store.sqlite import SQLiteStore

    store = SQLiteStore(tmp_path / "plans.db", SecretBox(os.urandom(32)))
    await store.open()
    try:
        org = await an_org(store)
        statements: list[tuple[str, tuple]] = []
        fetch = store.db.fetch

        async def recording(sql: str, params=(), **kw):
            statements.append((sql, tuple(params)))
            return await fetch(sql, params, **kw)

        async def plans(**query) -> list[str]:
            statements.clear()
            store.db.fetch = recording
            try:
                await store.list_sessions(SessionFilter(org_id=org, **query), reviews=True)
            finally:
                store.db.fetch = fetch
            found = []
            for sql, params in statements:
                if "FROM sessions" in sql and "review_groups" not in sql:
                    found.append(" / ".join(r[3] for r in await fetch("EXPLAIN QUERY PLAN " + sql, params)))
            return found

        for plan in await plans(connection="pg", status="open"):  # the count, then the page's ids and rows
            scans = [step for step in plan.split(" / ") if "SEARCH sessions" in step and "(id=?)" not in step]
            assert scans and all("COVERING INDEX sessions_by_connection" in step for step in scans), plan
        page = (await plans(review_status="APPROVED"))[-1]
        assert "sessions_reviewed" in page, page
    finally:
        await store.close()
