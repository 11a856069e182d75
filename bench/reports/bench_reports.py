"""Session reports at a million sessions, on both stores: the rollup read by ``GET /reports/sessions`` against the
same figures computed from the sessions table, side by side in one run.

For each store (SQLite, and a throw-away PostgreSQL cluster from tests/pgpeer.py) the script:

1. opens a fresh, migrated store and inserts ``--sessions`` finished sessions (default 1,000,000) in batches of
   the store's own INSERT, spread over 90 days, 50 connections, 500 users, three protocols and both verbs;
2. builds the rollup from them the way an upgraded store does (``_backfill_rollup``, one statement) and times it;
3. times each report the API serves (``Store.session_report``: by connection, user, protocol, day; over the
   last 30 days and over all 90) and a page of ``Store.session_metrics``: median of ``--repeat`` runs;
4. times the same groupings computed from the sessions table (what a report would cost without the rollup);
5. times ``close_session`` on 1,000 more sessions (each close adds to the rollup in its transaction).

It prints the figures and the ratios; it is a benchmark, not a test (targets missed say MISS, exit 0).

    .venv/bin/python bench/reports/bench_reports.py [--sessions 1000000] [--stores sqlite,postgres]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Awaitable, Callable

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gatewayd.crypto import SecretBox  # noqa: E402
from gatewayd.evidence import EventBatch  # noqa: E402
from gatewayd.models import Session, new_id, rfc3339  # noqa: E402
from gatewayd.store.base import ReportFilter  # noqa: E402
from gatewayd.store.queries import SQLStore  # noqa: E402
from gatewayd.store.sql import insert  # noqa: E402

TARGET_MS = 100.0  # a report over 30 days of a million sessions: under this, median
BATCH = 10_000
DAYS, CONNECTIONS, USERS = 90, 50, 500
PROTOCOLS = (("postgres", "database"), ("ssh", "custom"), ("httpproxy", "httpproxy"))
GROUPS = ("connection", "user", "protocol", "day")
NAIVE = {"connection": "connection", "user": "user_email", "protocol": "subtype", "day": "substr(start_date, 1, 10)"}


def sessions(org_id: str, count: int, now: datetime, seed: int = 35) -> Any:
    """``count`` finished sessions, newest last, spread evenly over the last DAYS days."""
    rng = random.Random(seed)
    step = DAYS * 86400 / count
    for i in range(count):
        start = now - timedelta(seconds=DAYS * 86400 - i * step)
        subtype, kind = PROTOCOLS[i % len(PROTOCOLS)]
        user = f"user{rng.randrange(USERS)}"
        metrics = {}
        if i % 7 == 0:
            metrics["masked"] = rng.randrange(1, 20)
        if i % 11 == 0:
            metrics["blocked"] = 1
        yield Session(id=new_id(), org_id=org_id, user_id=user, user_email=f"{user}@example.com", user_name=user,
                      connection=f"conn{rng.randrange(CONNECTIONS)}", connection_id="c", resource_name="r",
                      type=kind, subtype=subtype, verb="exec" if i % 5 == 0 else "connect", status="done",
                      start_date=rfc3339(start) or "", end_date=rfc3339(start + timedelta(seconds=rng.randrange(1, 900))),
                      event_size=rng.randrange(100, 100_000), exit_code=0, metrics=metrics)


async def median_ms(call: Callable[[], Awaitable[Any]], repeat: int) -> float:
    await call()  # warm
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        await call()
        times.append((time.perf_counter() - began) * 1000)
    return statistics.median(times)


async def bench_store(name: str, store: SQLStore, count: int, repeat: int) -> dict[str, Any]:
    await store.open()
    org = (await store.default_org()).id
    now = datetime.now(timezone.utc)
    began = time.perf_counter()
    chunk: list[Any] = []
    for session in sessions(org, count, now):
        chunk.append(insert("sessions", session)[1])
        if len(chunk) == BATCH:
            await store._write([(insert("sessions", session)[0], chunk)])
            chunk = []
    if chunk:
        await store._write([(insert("sessions", session)[0], chunk)])
    seeded = time.perf_counter() - began
    if name == "postgres":
        await store.db.fetch("ANALYZE sessions")
    await store._write([("DELETE FROM session_rollup", ()),
                        ("UPDATE store_counters SET value = 0 WHERE name = 'session_rollup'", ())])
    began = time.perf_counter()
    await store.db.transact(store._backfill_rollup())
    backfill = time.perf_counter() - began
    rollup_rows = (await store.db.fetch("SELECT COUNT(*) FROM session_rollup"))[0][0]
    if name == "postgres":
        await store.db.fetch("ANALYZE session_rollup")

    today = now.date()
    ranges = {"30 days": (today - timedelta(days=29), today), "90 days": (today - timedelta(days=DAYS), today)}
    figures: dict[str, Any] = {"store": name, "sessions": count, "seed_s": seeded, "backfill_s": backfill,
                               "rollup_rows": rollup_rows, "reports": {}, "naive": {}}
    for label, (start, end) in ranges.items():
        for group in GROUPS:
            query = ReportFilter(org, start.isoformat(), end.isoformat(), group)
            figures["reports"][(label, group)] = await median_ms(lambda q=query: store.session_report(q), repeat)
            column = NAIVE[group]
            sql = (f"SELECT {column}, COUNT(*), SUM(event_size), SUM({store.dialect.json_int('metrics', 'masked')}), "
                   f"SUM({store.dialect.json_int('metrics', 'blocked')}), "
                   f"SUM({store.dialect.duration_ms('start_date', 'end_date')}) FROM sessions WHERE org_id = ? "
                   f"AND status = 'done' AND start_date >= ? AND start_date < ? GROUP BY {column}")
            params = (org, start.isoformat(), (end + timedelta(days=1)).isoformat())
            figures["naive"][(label, group)] = await median_ms(lambda s=sql, p=params: store.db.fetch(s, p),
                                                               max(3, repeat // 5))
    month = ((today - timedelta(days=29)).isoformat(), today.isoformat())
    for label, query in (("by user, one connection", ReportFilter(org, *month, "user", connection="conn7")),
                         ("by connection, one user", ReportFilter(org, *month, "connection",
                                                                   user_email="user7@example.com")),
                         ("by day, exec on postgres", ReportFilter(org, *month, "day", subtype="postgres",
                                                                    verb="exec"))):
        figures["reports"][("30 days", label)] = await median_ms(lambda q=query: store.session_report(q), repeat)
        filters = " AND ".join(f"{c} = ?" for c, v in (("connection", query.connection),
                                                       ("user_email", query.user_email),
                                                       ("subtype", query.subtype), ("verb", query.verb)) if v)
        values = tuple(v for v in (query.connection, query.user_email, query.subtype, query.verb) if v)
        column = NAIVE[query.group_by]
        sql = (f"SELECT {column}, COUNT(*), SUM(event_size) FROM sessions WHERE org_id = ? AND status = 'done' "
               f"AND start_date >= ? AND start_date < ? AND {filters} GROUP BY {column}")
        params = (org, month[0], (today + timedelta(days=1)).isoformat(), *values)
        figures["naive"][("30 days", label)] = await median_ms(lambda s=sql, p=params: store.db.fetch(s, p),
                                                               max(3, repeat // 5))
    page = ReportFilter(org, *month)
    figures["metrics_page_ms"] = await median_ms(lambda: store.session_metrics(page, 100, 0), repeat)

    closes = []
    for session in sessions(org, 1000, now, seed=36):
        session.status, session.end_date = "open", None
        await store.create_session(session)
        batch = EventBatch.of(session.id, 0, [], {"event_size": 10, "metrics": {"masked": 1}})
        began = time.perf_counter()
        await store.close_session(batch, end_date=rfc3339(now) or "", exit_code=0, seal=None)
        closes.append((time.perf_counter() - began) * 1000)
    figures["close_ms"] = statistics.median(closes)
    await store.close()
    return figures


def report(results: list[dict[str, Any]]) -> None:
    print(flush=True)
    print(f"\nhost: {platform.node()} {platform.machine()}, Python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs")
    for figures in results:
        print(f"\n== {figures['store']}: {figures['sessions']:,} finished sessions "
              f"(seeded in {figures['seed_s']:.1f} s; rollup built in {figures['backfill_s']:.1f} s, "
              f"{figures['rollup_rows']:,} rows)")
        print(f"{'report':<44}{'rollup ms':>12}{'sessions table ms':>20}{'ratio':>10}")
        for key, fast in figures["reports"].items():
            slow = figures["naive"][key]
            verdict = "" if key[0] != "30 days" else ("  ok" if fast < TARGET_MS else "  MISS")
            print(f"{key[1] + ', ' + key[0]:<44}{fast:>12.1f}{slow:>20.1f}{slow / fast:>9.1f}x{verdict}")
        print(f"GET /metrics/sessions page of 100: {figures['metrics_page_ms']:.1f} ms median")
        print(f"close_session with its rollup update: {figures['close_ms']:.2f} ms median")
    print(f"\ntarget: a 30-day report under {TARGET_MS:.0f} ms median", flush=True)


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    box = SecretBox(os.urandom(32))
    results = []
    for name in args.stores.split(","):
        if name == "sqlite":
            from gatewayd.store.sqlite import SQLiteStore

            folder = Path(tempfile.mkdtemp(prefix="gatewayd-bench-reports-"))
            try:
                results.append(await bench_store(name, SQLiteStore(folder / "gatewayd.db", box), args.sessions,
                                                 args.repeat))
                report(results[-1:])  # as soon as it is known: a long run's first half is not lost
            finally:
                shutil.rmtree(folder, ignore_errors=True)
        elif name == "postgres":
            from gatewayd.store.postgres import PostgresStore
            from tests.pgpeer import PgCluster

            cluster = PgCluster(tls=False).start()
            try:
                results.append(await bench_store(name, PostgresStore(cluster.dsn(), box), args.sessions, args.repeat))
                report(results[-1:])
            finally:
                cluster.destroy()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--stores", default="sqlite,postgres")
    args = parser.parse_args(argv)
    results = asyncio.run(main_async(args))
    print(json.dumps([{**r, "reports": {f"{k[1]} {k[0]}": v for k, v in r["reports"].items()},
                       "naive": {f"{k[1]} {k[0]}": v for k, v in r["naive"].items()}} for r in results]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
