"""The API at scale (issue 36): the session list and the audit log's pages among a million rows each.

Seeds a store (a PostgreSQL database with ``--url``, else a temporary SQLite store) with N sessions (default
1,000,000: 1,000 users, 50 connections, four protocols, one every 3 s back from now, one in 100 with a review:
most approved, a few rejected) and N audit entries (200 actors, 12 actions, one in 10 a failure, one every 3 s);
PostgreSQL is filled with COPY, SQLite with large batched INSERTs. Then times ``list_sessions`` -- the query
behind ``GET /api/sessions`` -- at ``limit=100`` for each filter the API takes and a few combinations, and
``list_audit`` -- behind ``GET /api/audit/logs`` -- at ``page_size=100`` with and without its filters: median and
p95 of ``--runs`` rounds after a warm-up (each case once a round), and the time of each statement of the slowest run; with ``--api``, the
same requests through a ``gatewayd run`` on the store (which ends the seeded open sessions as no node's: a
later run finds none open). ``--explain`` prints the
plan of every statement of the cases over the target (PostgreSQL: ``EXPLAIN ANALYZE``). Targets are printed as
PASS/MISS, never raised. Not a test: run it by hand (see bench/README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import random
import statistics
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Awaitable, Callable
from urllib.parse import urlencode

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from gatewayd.crypto import SecretBox  # noqa: E402
from gatewayd.models import AuditEntry, Session, User, new_id, rfc3339  # noqa: E402
from gatewayd.store import AuditFilter, SessionFilter  # noqa: E402
from gatewayd.store.sql import columns, encode  # noqa: E402

from bench_search import open_store  # noqa: E402  (this script's folder is on the path)

TARGET_MS = 20.0  # a page of 100 with its total
PROTOCOLS = ("postgres", "ssh", "httpproxy", "rdp")
TYPES = {"postgres": "database", "ssh": "custom", "httpproxy": "httpproxy", "rdp": "custom"}
ACTIONS = ("postgres.login", "ssh.login", "rdp.login", "httpproxy.login", "guardrail.block", "sessions.get",
           "connections.update", "credentials.create", "reviews.approve", "auth.local_login", "users.update",
           "session.seal")
RESOURCES = {"postgres.login": "connections", "ssh.login": "connections", "rdp.login": "connections",
             "httpproxy.login": "connections", "guardrail.block": "guardrails", "sessions.get": "sessions",
             "connections.update": "connections", "credentials.create": "credentials", "reviews.approve": "reviews",
             "auth.local_login": "auth", "users.update": "users", "session.seal": "sessions"}
CHUNK = 50_000
BENCH_KEY = base64.b64encode(b"bench-scale: not a secret, 32 B.").decode()  # the daemon's secrets.key (--api)


def session_rows(org: str, now: datetime, first: int, last: int, rng: random.Random,
                 reviews: list[tuple[str, str, str]]) -> list[tuple[Any, ...]]:
    """Sessions ``first`` to ``last`` (newest first, 3 s apart) as stored rows; a review for one in 100."""
    names = columns(Session)
    rows = []
    for n in range(first, last):
        protocol = PROTOCOLS[n % 4]
        user = rng.randrange(1000)
        moment = now - timedelta(seconds=3 * n)
        review_id = new_id() if n % 100 == 11 else None
        session = Session(id=new_id(), org_id=org, user_id=f"sub-{user}", user_email=f"user{user}@example.com",
                          user_name=f"User Number {user}", connection=f"conn-{n % 50}", connection_id=f"cid-{n % 50}",
                          resource_name="res", type=TYPES[protocol], subtype=protocol, verb="connect",
                          status="open" if n % 10_000 == 3 else "done", start_date=rfc3339(moment),
                          end_date=rfc3339(moment + timedelta(seconds=2)), review_id=review_id)
        if review_id:
            reviews.append((review_id, session.id, "REJECTED" if n % 10_000 == 11 else "APPROVED"))
        rows.append(tuple(encode(c, getattr(session, c)) for c in names))
    return rows


def audit_rows(org: str, now: datetime, first: int, last: int, rng: random.Random) -> list[tuple[Any, ...]]:
    """Audit entries ``first`` to ``last`` (newest first, 3 s apart) as stored rows (the chain's hashes left
    out: the lists do not read them)."""
    names = columns(AuditEntry)
    rows = []
    for n in range(first, last):
        actor = rng.randrange(200)
        action = ACTIONS[rng.randrange(len(ACTIONS))]
        entry = AuditEntry(id=new_id(), org_id=org, created_at=rfc3339(now - timedelta(seconds=3 * n)),
                           actor_subject=f"sub-{actor}", actor_email=f"user{actor}@example.com",
                           actor_name=f"User Number {actor}", resource_type=RESOURCES[action], action=action,
                           outcome="failure" if rng.random() < 0.1 else "success", http_method="POST",
                           http_path="/api/things", http_status=200, client_ip="127.0.0.1",
                           request_payload_redacted={"n": n}, prev_hash="x", hash="y")
        rows.append(tuple(encode(c, getattr(entry, c)) for c in names))
    return rows


async def seed(store: Any, url: str | None, count: int, audit_count: int) -> tuple[str, datetime]:
    """Fill the store: COPY into PostgreSQL, batched INSERTs into SQLite (rows oldest last, as they come)."""
    org = (await store.default_org()).id
    now = datetime.now(timezone.utc).replace(microsecond=0)
    for u in range(1000):  # the users the sessions name: a user filter looks their e-mails and names up
        await store.save_user(User(id=new_id(), org_id=org, subject=f"sub-{u}", email=f"user{u}@example.com",
                                   name=f"User Number {u}", created_at=rfc3339(now), updated_at=rfc3339(now)))
    rng = random.Random(36)
    copy = None
    if url:
        import asyncpg

        copy = await asyncpg.connect(url)
    review_cols = ("id", "org_id", "session_id", "connection_id", "type", "status", "owner_id", "created_at")
    try:
        for table, total, make in (
                ("sessions", count, lambda a, b, reviews: session_rows(org, now, a, b, rng, reviews)),
                ("audit_logs", audit_count, lambda a, b, reviews: audit_rows(org, now, a, b, rng))):
            names = columns(Session if table == "sessions" else AuditEntry)
            started = time.monotonic()
            for first in range(0, total, CHUNK):
                reviews: list[tuple[str, str, str]] = []
                rows = make(first, min(first + CHUNK, total), reviews)
                review_rows = [(rid, org, sid, "cid-0", "onetime", status, "sub-0", rfc3339(now))
                               for rid, sid, status in reviews]
                if copy is not None:
                    await copy.copy_records_to_table(table, records=rows, columns=names)
                    if review_rows:
                        await copy.copy_records_to_table("reviews", records=review_rows, columns=review_cols)
                else:
                    marks = ", ".join("?" * len(names))
                    statements = [(f"INSERT INTO {table} ({', '.join(names)}) VALUES ({marks})", rows)]
                    if review_rows:
                        statements.append((f"INSERT INTO reviews ({', '.join(review_cols)}) VALUES "
                                           f"({', '.join('?' * len(review_cols))})", review_rows))
                    await store._write(statements)
                done = min(first + CHUNK, total)
                print(f"\r  {table}: {done:,} of {total:,} ({done / (time.monotonic() - started):,.0f}/s)",
                      end="", file=sys.stderr, flush=True)
            print(file=sys.stderr)
        if copy is not None:
            await copy.execute("VACUUM ANALYZE")
        else:
            await store.db.fetch("ANALYZE", ())
    finally:
        if copy is not None:
            await copy.close()
    return org, now


class Recorder:
    """Wraps the store's ``db.fetch``: each statement of a call with its time."""

    def __init__(self, db: Any) -> None:
        self.db, self.fetch = db, db.fetch
        self.calls: list[tuple[str, tuple[Any, ...], float]] = []
        db.fetch = self._fetch

    async def _fetch(self, sql: str, params: Any = (), **kw: Any) -> Any:
        began = time.perf_counter()
        try:
            return await self.fetch(sql, params, **kw)
        finally:
            self.calls.append((sql, tuple(params), (time.perf_counter() - began) * 1000))


async def timed(calls: list[Callable[[], Awaitable[Any]]], recorder: Recorder | None,
                runs: int) -> list[tuple[float, float, Any, list[tuple[str, tuple[Any, ...], float]]]]:
    """Each call's median and p95 (ms) of ``runs`` rounds after a warm-up round, its last answer and the
    statements of its slowest run. Every call runs once a round, so that a burst of load on a shared machine
    falls on all of them alike rather than on whichever ran then."""
    answers = [await call() for call in calls]  # warm-up
    times: list[list[float]] = [[] for _ in calls]
    slowest: list[list[tuple[str, tuple[Any, ...], float]]] = [[] for _ in calls]
    for _ in range(runs):
        for n, call in enumerate(calls):
            if recorder is not None:
                recorder.calls = []
            began = time.perf_counter()
            answers[n] = await call()
            took = (time.perf_counter() - began) * 1000
            if recorder is not None and (not times[n] or took > max(times[n])):
                slowest[n] = list(recorder.calls)
            times[n].append(took)
    found = []
    for n, taken in enumerate(times):
        taken.sort()
        found.append((statistics.median(taken), taken[max(0, int(len(taken) * 0.95) - 1)], answers[n], slowest[n]))
    return found


async def explain(store: Any, recorder: Recorder, sql: str, params: tuple[Any, ...], backend: str) -> str:
    fetch = recorder.fetch
    if backend == "postgres":
        rows = await fetch("EXPLAIN (ANALYZE, BUFFERS) " + sql, params)
    else:
        rows = await fetch("EXPLAIN QUERY PLAN " + sql, params)
        return "\n".join(f"    {r[3]}" for r in rows)
    return "\n".join(f"    {r[0]}" for r in rows)


async def through_api(settings: dict[str, Any], folder: Path, cases: list[tuple[str, str, dict[str, str]]],
                      runs: int) -> list[tuple[str, str, float, float]]:
    """The same cases as HTTP requests to a ``gatewayd run`` on the same store (one worker, an admin's token):
    median and p95 (ms) of each, the answer read whole."""
    import aiohttp

    from tests.conftest import Daemon

    (folder / "daemon").mkdir()
    daemon = Daemon(folder / "daemon" / "data", settings).start(timeout=120)
    try:
        token = daemon.token("bench-admin@example.com", groups="admin")
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as http:
            async def get(address: str) -> None:
                async with http.get(address) as response:
                    body = await response.read()
                    if response.status != 200:
                        raise RuntimeError(f"{address}: {response.status} {body[:200]!r}")

            calls = []
            for kind, label, params in cases:
                route, size = ("/sessions", {"limit": "100"}) if kind == "sessions" else ("/audit/logs",
                                                                                          {"page_size": "100"})
                address = f"{daemon.url}{route}?{urlencode({**size, **params})}"
                calls.append(lambda address=address: get(address))
            timings = await timed(calls, None, runs)
        return [(kind, label, median, p95) for (kind, label, _), (median, p95, _, _) in zip(cases, timings)]
    finally:
        daemon.stop()


# the API's query parameters and the store's filter fields they become (control/sessions.py, control/audit_logs.py)
SESSION_FIELDS = {"user": "user_search", "connection": "connection", "protocol": "protocol", "type": "type",
                  "status": "status", "review.status": "review_status", "start_date": "start_date",
                  "end_date": "end_date"}


def session_filter(org: str, params: dict[str, str]) -> SessionFilter:
    fields = {SESSION_FIELDS[k]: v for k, v in params.items() if k != "offset"}
    return SessionFilter(org_id=org, limit=100, offset=int(params.get("offset", 0)), **fields)


def audit_filter(org: str, params: dict[str, str]) -> AuditFilter:
    fields = {k: v for k, v in params.items() if k != "page"}
    return AuditFilter(org_id=org, page_size=100, page=int(params.get("page", 1)), **fields)


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=1_000_000)
    parser.add_argument("--audit", type=int, help="audit entries (default: as many as sessions)")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--explain", action="store_true", help="the plans of the cases over the target")
    parser.add_argument("--url", help="a PostgreSQL database to fill (empty); default: a temporary SQLite store")
    parser.add_argument("--postgres", action="store_true", help="start a PostgreSQL of the bench's own for the run "
                        "(tests/pgpeer.py, as the suite starts one) and fill it: the lent machine's step "
                        "(bench/device_issue36.sh with API=1)")
    parser.add_argument("--api", action="store_true", help="then the same requests through a gatewayd run on the "
                        "store (GET /api/sessions, GET /api/audit/logs)")
    parser.add_argument("--seeded", action="store_true", help="the database at --url is filled already (by a "
                        "run of this bench with the same counts): time only")
    args = parser.parse_args()
    if args.postgres:
        from tests.pgpeer import PgCluster

        cluster = PgCluster(tls=False).start()
        args.url, args.seeded = cluster.dsn(), False
        try:
            return await measure(args)
        finally:
            cluster.destroy()
    return await measure(args)


async def measure(args: argparse.Namespace) -> int:
    """Seed (unless ``--seeded``), time the lists in the store and, with ``--api``, through a daemon."""
    audit_count = args.sessions if args.audit is None else args.audit
    box = SecretBox(os.urandom(32))
    folder = tempfile.TemporaryDirectory(prefix="bench-scale-")
    store, backend = open_store(args.url, Path(folder.name), box)
    await store.open()
    try:
        began = time.monotonic()
        if args.seeded:
            org = (await store.default_org()).id
            newest = (await store.db.fetch("SELECT max(start_date) FROM sessions", ()))[0][0]
            now = datetime.fromisoformat(newest.replace("Z", "+00:00"))
        else:
            org, now = await seed(store, args.url, args.sessions, audit_count)
            print(f"{backend}: {args.sessions:,} sessions and {audit_count:,} audit entries seeded in "
                  f"{time.monotonic() - began:.0f} s", file=sys.stderr)
        recorder = Recorder(store.db)
        day = timedelta(days=1)
        window = (rfc3339(now - timedelta(hours=5, minutes=10)), rfc3339(now - timedelta(hours=5)))
        week = (rfc3339(now - 14 * day), rfc3339(now - 7 * day))
        sessions: list[tuple[str, dict[str, str]]] = [
            ("no filter", {}),
            ("user 'user42' (part of an e-mail)", {"user": "user42"}),
            ("user 'sub-42' (a subject)", {"user": "sub-42"}),
            ("connection conn-7", {"connection": "conn-7"}),
            ("protocol ssh", {"protocol": "ssh"}),
            ("type database", {"type": "database"}),
            ("status done (nearly all)", {"status": "done"}),
            ("status open (100 of them)", {"status": "open"}),  # a daemon (--api) ends them: see the docstring
            ("a 10-minute window, 5 h back", {"start_date": window[0], "end_date": window[1]}),
            ("a week's window, 7 days back", {"start_date": week[0], "end_date": week[1]}),
            ("review status APPROVED (1 in 100)", {"review.status": "APPROVED"}),
            ("review status REJECTED (100)", {"review.status": "REJECTED"}),
            ("protocol ssh + user 'user42'", {"protocol": "ssh", "user": "user42"}),
            ("connection conn-7 + status open", {"connection": "conn-7", "status": "open"}),
            ("type custom + week window", {"type": "custom", "start_date": week[0], "end_date": week[1]}),
            ("protocol rdp, offset 10,000", {"protocol": "rdp", "offset": "10000"}),
        ]
        audits: list[tuple[str, dict[str, str]]] = [
            ("no filter", {}),
            ("actor user7@example.com", {"actor": "user7@example.com"}),
            ("actor sub-7", {"actor": "sub-7"}),
            ("action ssh.login (1 in 12)", {"action": "ssh.login"}),
            ("outcome failure (1 in 10)", {"outcome": "failure"}),
            ("resource_type connections", {"resource_type": "connections"}),
            ("a 10-minute window, 5 h back", {"created_after": window[0], "created_before": window[1]}),
            ("a week's window, 7 days back", {"created_after": week[0], "created_before": week[1]}),
            ("action ssh.login + failure", {"action": "ssh.login", "outcome": "failure"}),
            ("actor sub-7 + action + failure", {"actor": "sub-7", "action": "ssh.login", "outcome": "failure"}),
            ("page 101 (offset 10,000)", {"page": "101"}),
        ]
        labels, calls = [], []
        for kind, cases, method in (("sessions", sessions, store.list_sessions), ("audit", audits, store.list_audit)):
            for label, params in cases:
                query = session_filter(org, params) if kind == "sessions" else audit_filter(org, params)
                labels.append((kind, label))
                calls.append(lambda method=method, query=query: method(query))
        rows = [(kind, label, *timing) for (kind, label), timing in zip(labels, await timed(calls, recorder, args.runs))]
        load = os.getloadavg()
        print(f"\n{backend}, {args.sessions:,} sessions, {audit_count:,} audit entries: list_sessions (GET "
              f"/api/sessions, limit=100) and list_audit (GET /api/audit/logs, page_size=100) with the total, "
              f"{args.runs} runs; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
        print(f"{'list':8} {'filter':36} {'median ms':>10} {'p95 ms':>9} {'total':>10}  statements of the slowest "
              f"run, each (ms; a list's run at once)  target {TARGET_MS:.0f} ms")
        for kind, label, median, p95, page, slowest in rows:
            verdict = "PASS" if median <= TARGET_MS else "MISS"
            total = f"{page.total:,}{'' if page.total_exact else '+'}"
            parts = ", ".join(f"{t:.1f}" for _, _, t in slowest)
            print(f"{kind:8} {label:36} {median:10.1f} {p95:9.1f} {total:>10}  {verdict}  [{parts}]")
        if args.api:
            # a key of the bench's own, so that a later run's daemon opens what an earlier one sealed in the store
            settings: dict[str, Any] = {"secrets.key": BENCH_KEY, **(
                {"store.driver": "postgres", "store.url": args.url} if args.url else
                {"store.path": str(Path(folder.name) / "gatewayd.db")})}
            requests = [("sessions", label, params) for label, params in sessions]
            requests += [("audit", label, params) for label, params in audits]
            answers = await through_api(settings, Path(folder.name), requests, args.runs)
            load = os.getloadavg()
            print(f"\nthe same through the API (gatewayd run, one worker, HTTP on loopback, the answer read whole); "
                  f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
            print(f"{'route':8} {'filter':36} {'median ms':>10} {'p95 ms':>9}")
            for kind, label, median, p95 in answers:
                print(f"{kind:8} {label:36} {median:10.1f} {p95:9.1f}  {'PASS' if median <= TARGET_MS else 'MISS'}")
        if args.explain:
            for kind, label, median, p95, page, slowest in rows:
                if median <= TARGET_MS:
                    continue
                print(f"\n== {kind}: {label} ({median:.1f} ms)")
                for sql, values, took in slowest:
                    print(f"  -- {took:.1f} ms: {sql}  {values}")
                    print(await explain(store, recorder, sql, values, backend))
    finally:
        await store.close()
        folder.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
