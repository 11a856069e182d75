"""Finding sessions among a million: the filters of GET /api/sessions, timed on the store they run on.

Seeds a store (SQLite by default, or a PostgreSQL database with ``--url``) with N sessions (default
1,000,000) spread over 1,000 users, 50 connections, four protocols and one every 3 s back from now, each with
the text typed in it indexed (``session_search``, as the recorder stores it); then times ``list_sessions``
-- the query behind ``GET /api/sessions`` -- for each kind of search, first page of 20 with its total,
median and p95 of ``--runs`` runs after a warm-up. Prints a table; targets are printed as PASS/MISS, never
raised. Not a test: run it by hand (see bench/README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from gatewayd.crypto import SecretBox  # noqa: E402
from gatewayd.models import Session, new_id, rfc3339  # noqa: E402
from gatewayd.store import SessionFilter  # noqa: E402
from gatewayd.store.sql import columns, encode  # noqa: E402

TARGET_MS = 100.0  # a search's first page, with its total
PROTOCOLS = ("postgres", "ssh", "httpproxy", "rdp")
TYPES = {"postgres": "database", "ssh": "custom", "httpproxy": "httpproxy", "rdp": "custom"}
RARE = "needle-7f3a"


def typed(n: int, protocol: str, rng: random.Random) -> str:
    """What session ``n`` had typed in it: a statement, a command or a request line, and a rare word in a few."""
    if protocol == "postgres":
        text = f"select * from {rng.choice(('orders', 'customers', 'invoices', 'events'))} where id = {n};"
    elif protocol == "ssh":
        text = f"{rng.choice(('ls -la', 'tail -f /var/log/syslog', 'rm -rf /tmp/build', 'df -h'))} {n}\r"
    elif protocol == "httpproxy":
        text = f"GET /api/v1/{rng.choice(('things', 'users', 'reports'))}/{n} HTTP/1.1\r\nHost: app\r\n\r\n"
    else:
        text = ""
    return text + (f" {RARE}" if n % 100_000 == 7 else "")


def open_store(url: str | None, folder: Path, box: SecretBox) -> tuple[Any, str]:
    """The store a bench fills (not opened yet): the PostgreSQL database at ``url``, else a SQLite file in
    ``folder``; and its name."""
    if url:
        from gatewayd.store.postgres import PostgresStore

        return PostgresStore(url, box), "postgres"
    from gatewayd.store.sqlite import SQLiteStore

    return SQLiteStore(folder / "gatewayd.db", box), "sqlite"


async def seed(store, count: int) -> tuple[str, datetime]:
    from gatewayd.models import User

    org = (await store.default_org()).id
    now = datetime.now(timezone.utc)
    for u in range(1000):
        await store.save_user(User(id=new_id(), org_id=org, subject=f"sub-{u}", email=f"user{u}@example.com",
                                   name=f"User Number {u}", created_at=rfc3339(now), updated_at=rfc3339(now)))
    names = [n for n in columns(Session)]
    insert = f"INSERT INTO sessions ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})"
    rng = random.Random(34)
    started = time.monotonic()
    chunk = 20_000
    for first in range(0, count, chunk):
        sessions, texts = [], []
        for n in range(first, min(first + chunk, count)):
            protocol = PROTOCOLS[n % 4]
            user = rng.randrange(1000)
            moment = now - timedelta(seconds=3 * n)
            session = Session(id=new_id(), org_id=org, user_id=f"sub-{user}", user_email=f"user{user}@example.com",
                              user_name=f"User Number {user}", connection=f"conn-{n % 50}",
                              connection_id=f"cid-{n % 50}", resource_name="res", type=TYPES[protocol],
                              subtype=protocol, verb="connect", status="open" if n % 10_000 == 3 else "done",
                              start_date=rfc3339(moment), end_date=rfc3339(moment + timedelta(seconds=2)))
            sessions.append(tuple(encode(c, getattr(session, c)) for c in names))
            text = typed(n, protocol, rng)
            if text:
                texts.append((session.id, text))
        statements = [(insert, sessions)]
        for session_id, text in texts:  # as the recorder indexes them (the dialect's statements)
            statements += store.dialect.search_insert(session_id, text)
        await store._write(statements)
        done = min(first + chunk, count)
        rate = done / (time.monotonic() - started)
        print(f"\r  seeded {done:,} of {count:,} ({rate:,.0f}/s)", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return org, now


async def timed(store, query: SessionFilter, runs: int) -> tuple[float, float, int]:
    await store.list_sessions(query)  # warm-up
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        page = await store.list_sessions(query)
        times.append((time.perf_counter() - began) * 1000)
    times.sort()
    return statistics.median(times), times[int(len(times) * 0.95) - 1 if len(times) > 1 else 0], page.total


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--url", help="a PostgreSQL database to fill (empty); default: a temporary SQLite store")
    args = parser.parse_args()
    box = SecretBox(os.urandom(32))
    folder = tempfile.TemporaryDirectory(prefix="bench-search-")
    store, backend = open_store(args.url, Path(folder.name), box)
    await store.open()
    try:
        began = time.monotonic()
        org, now = await seed(store, args.sessions)
        print(f"{backend}: {args.sessions:,} sessions seeded in {time.monotonic() - began:.0f} s", file=sys.stderr)
        if backend == "postgres":
            await store.db.fetch("ANALYZE")
        window = (rfc3339(now - timedelta(hours=5, minutes=10)), rfc3339(now - timedelta(hours=5)))
        cases = [
            ("newest first, no filter", SessionFilter(org_id=org)),
            ("user: part of e-mail 'user42'", SessionFilter(org_id=org, user_search="user42")),
            ("user: part of name 'number 7'", SessionFilter(org_id=org, user_search="number 7")),
            ("protocol ssh", SessionFilter(org_id=org, protocol="ssh")),
            ("status open (rare)", SessionFilter(org_id=org, status="open")),
            ("a 10-minute window, 5 h back", SessionFilter(org_id=org, start_date=window[0], end_date=window[1])),
            (f"typed: '{RARE}' (10 sessions)", SessionFilter(org_id=org, text=RARE)),
            ("typed: 'rm -rf /tmp' (1 in 16)", SessionFilter(org_id=org, text="rm -rf /tmp")),
            ("typed: 'from orders' (1 in 16)", SessionFilter(org_id=org, text="from orders")),
            ("typed 'where id' + user 'user42'", SessionFilter(org_id=org, text="where id", user_search="user42")),
            ("typed 'from invoices' + window", SessionFilter(org_id=org, text="from invoices",
                                                            start_date=window[0], end_date=window[1])),
        ]
        rows = []
        for label, query in cases:
            median, p95, total = await timed(store, query, args.runs)
            rows.append((label, median, p95, total))
        print(f"\n{backend}, {args.sessions:,} sessions: list_sessions (GET /api/sessions), first page of 20 "
              f"with its total, {args.runs} runs")
        print(f"{'search':44} {'median ms':>10} {'p95 ms':>9} {'total':>9}  target {TARGET_MS:.0f} ms")
        for label, median, p95, total in rows:
            verdict = "PASS" if median <= TARGET_MS else "MISS"
            print(f"{label:44} {median:10.1f} {p95:9.1f} {total:9,}  {verdict}")
    finally:
        await store.close()
        folder.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
