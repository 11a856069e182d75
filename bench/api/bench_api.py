"""Control-API benchmark: session listing over a large store, and credential issuing throughput.

Targets (from the issue):

* ``GET /api/sessions?limit=100`` with 100,000 sessions stored: median under 20 ms;
* ``POST /api/connections/{name}/credentials``: over 500 per second.

The script seeds a fresh data dir through the store interface (before the daemon
starts), runs a real ``gatewayd run`` subprocess, mints an admin token with the real
CLI, then measures with one keep-alive aiohttp client and prints the figures.
It is a benchmark, not a test: it exits 0 whether targets are met or not (it exits
non-zero only when it could not measure, e.g. the daemon did not start or a
response was wrong).

Run with the project's interpreter (the daemon is started from the same venv)::

    .venv/bin/python bench/api/bench_api.py [--sessions 100000] [--seconds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import platform
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from gatewayd.config import load_config  # noqa: E402
from gatewayd.daemon import Gateway  # noqa: E402
from gatewayd.models import Connection, new_id, rfc3339  # noqa: E402
from gatewayd.sessions import session_for  # noqa: E402
from gatewayd.store.sqlite import SQLiteStore  # noqa: E402
from gatewayd.store.base import COUNT_CAP  # noqa: E402
from tests.conftest import Daemon  # noqa: E402

LIST_TARGET_MS = 20.0
CREDENTIALS_TARGET_PER_S = 500.0
CONCURRENCY = 8
WARMUP = 20
ROLE = "bench-pg"
# seeded sessions are spread over these users and connections (name, subtype)
SEED_USERS = 5
SEED_CONNECTIONS = [("seed-pg-a", "postgres"), ("seed-pg-b", "postgres"), ("seed-ssh", "ssh"),
                    ("seed-rdp", "rdp"), ("seed-http", "httpproxy")]
ONE_BY_ONE_SAMPLE = 1000  # sessions inserted through store.create_session to measure its rate
ONE_BY_ONE_BUDGET_S = 60.0  # above this projected time the rest is inserted in batches
BATCH = 10_000


# ---------------------------------------------------------------- seeding
@dataclass
class Seeded:
    sessions: int
    per_connection: dict[str, int]
    one_by_one_rate: float  # sessions per second through store.create_session
    bulk: bool
    seconds: float


async def seed(config_path: Path, environ: dict[str, str], count: int) -> Seeded:
    """``count`` finished sessions over a few users and connections, newest first by start_date."""
    config = load_config(config_path, environ=environ)
    gateway = Gateway(config)
    await gateway.open_core()
    started = time.perf_counter()
    try:
        store = gateway.store
        org = await store.default_org()
        users = [await gateway.identity.ensure_local_user(f"bench-user-{i}@example.com", f"Bench User {i}", [])
                 for i in range(SEED_USERS)]
        conns = [Connection(id=new_id(), org_id=org.id, name=name, resource_name=f"{name}-resource",
                            type="database" if subtype == "postgres" else "custom", subtype=subtype,
                            tags={"env": "bench", "team": f"team-{i}"})
                 for i, (name, subtype) in enumerate(SEED_CONNECTIONS)]
        now = datetime.now(timezone.utc)
        per_connection: dict[str, int] = {}

        def make(i: int) -> Any:
            user, conn = users[i % len(users)], conns[(i // len(users)) % len(conns)]
            per_connection[conn.name] = per_connection.get(conn.name, 0) + 1
            begin = now - timedelta(seconds=30 * (count - i))  # one every 30 s, the last one newest
            verb = "exec" if i % 10 == 0 else "connect"
            session = session_for(user, conn, verb=verb, status="done",
                                  script="select count(*) from orders where created_at > now() - interval '1 day'"
                                  if verb == "exec" else None,
                                  metadata={"client": "psql", "pid": i},
                                  session_batch_id=new_id())
            session.start_date = rfc3339(begin)
            session.end_date = rfc3339(begin + timedelta(seconds=5 + i % 300))
            session.event_size = 512 + i % 4096
            session.exit_code = 0
            session.metrics = {"event_size": session.event_size, "data_masking": False}
            return session

        sample = min(ONE_BY_ONE_SAMPLE, count)
        t0 = time.perf_counter()
        for i in range(sample):
            await store.create_session(make(i))
        rate = sample / max(time.perf_counter() - t0, 1e-9)
        rest = count - sample
        bulk = rest / rate > ONE_BY_ONE_BUDGET_S
        if bulk and isinstance(store, SQLiteStore):
            # the same INSERT create_session runs, many rows per transaction
            i = sample
            while i < count:
                chunk = [SQLiteStore._insert("sessions", make(j)) for j in range(i, min(i + BATCH, count))]
                await store._write([(chunk[0][0], [params for _, params in chunk])])
                i += len(chunk)
        else:
            bulk = False
            for i in range(sample, count):
                await store.create_session(make(i))
        return Seeded(count, per_connection, rate, bulk, time.perf_counter() - started)
    finally:
        await gateway.close_core()


# ---------------------------------------------------------------- measuring
@dataclass
class Result:
    name: str
    latencies_ms: list[float] = field(default_factory=list)
    count: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)  # HTTP status -> responses, warm-up included

    @property
    def median(self) -> float:
        return statistics.median(self.latencies_ms) if self.latencies_ms else float("nan")

    @property
    def p95(self) -> float:
        if len(self.latencies_ms) < 2:
            return self.median
        return statistics.quantiles(self.latencies_ms, n=20, method="inclusive")[-1]

    @property
    def rate(self) -> float:
        return self.count / self.seconds if self.seconds else 0.0


async def bench_list(http: aiohttp.ClientSession, url: str, name: str, requests: int,
                     expect_total: int | None, expect_items: int) -> Result:
    result = Result(name)
    for n in range(WARMUP + requests):
        t0 = time.perf_counter()
        async with http.get(url) as resp:
            body = await resp.read()
            elapsed = (time.perf_counter() - t0) * 1000
            status = resp.status
        if n >= WARMUP:
            result.latencies_ms.append(elapsed)
            result.count += 1
        if status != 200:
            result.errors.append(f"HTTP {status}: {body[:200]!r}")
            continue
        if n in (0, WARMUP):  # decoding is the client's cost: check the shape on a few responses only
            page = await resp.json()
            if expect_total is not None:  # counted up to the store's cap (store.count_cap, the default here)
                counted = (min(expect_total, COUNT_CAP), expect_total <= COUNT_CAP)
                if (page["total"], page["total_exact"]) != counted:
                    result.errors.append(f"total {page['total']} (exact: {page['total_exact']}) != {counted}")
            if len(page["data"]) != expect_items:
                result.errors.append(f"{len(page['data'])} items != {expect_items}")
    return result


async def bench_credentials(http: aiohttp.ClientSession, url: str, seconds: float, concurrency: int) -> Result:
    result = Result(f"POST /api/connections/{ROLE}/credentials (x{concurrency})")
    payload = {"access_duration_seconds": 600}
    statuses = result.statuses

    async def post(record: bool) -> None:
        t0 = time.perf_counter()
        async with http.post(url, json=payload) as resp:
            body = await resp.json(content_type=None)
            elapsed = (time.perf_counter() - t0) * 1000
        statuses[resp.status] = statuses.get(resp.status, 0) + 1
        if resp.status != 201 or not body.get("session_id") or not body.get("connection_credentials"):
            result.errors.append(f"HTTP {resp.status}: {str(body)[:200]}")
        if record:
            result.latencies_ms.append(elapsed)
            result.count += 1

    await asyncio.gather(*(post(False) for _ in range(WARMUP)))
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        while time.perf_counter() < deadline:
            await post(True)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    result.seconds = time.perf_counter() - t0
    return result


async def measure(daemon: Daemon, token: str, seeded: Seeded, args: argparse.Namespace) -> list[tuple[Result, str]]:
    headers = {"Authorization": f"Bearer {token}"}
    connector = aiohttp.TCPConnector(limit=args.concurrency, keepalive_timeout=60)
    async with aiohttp.ClientSession(headers=headers, connector=connector) as http:
        role_secret = {"envvar:HOST": base64.b64encode(b"127.0.0.1").decode()}
        resource = {"name": "bench-db", "type": "database", "subtype": "postgres",
                    "roles": [{"name": ROLE, "type": "database", "subtype": "postgres", "secret": role_secret}]}
        async with http.post(f"{daemon.url}/resources", json=resource) as resp:
            if resp.status != 201:
                raise RuntimeError(f"POST /api/resources: HTTP {resp.status}: {await resp.text()}")

        n = seeded.sessions
        filter_name = SEED_CONNECTIONS[0][0]
        results: list[tuple[Result, str]] = []
        plans = [
            ("GET /api/sessions?limit=100", "/sessions?limit=100", n, "issue"),
            ("GET /api/sessions?limit=100&offset=<half>", f"/sessions?limit=100&offset={n // 2}", n, "same bar"),
            (f"GET /api/sessions?limit=100&connection={filter_name}",
             f"/sessions?limit=100&connection={filter_name}", seeded.per_connection[filter_name], "same bar"),
        ]
        for name, path, total, kind in plans:
            items = max(0, min(100, total - (n // 2 if "offset" in path else 0)))
            print(f"  measuring {name} ({WARMUP} warm-up + {args.requests} requests)...", flush=True)
            results.append((await bench_list(http, daemon.url + path, name, args.requests, total, items), kind))

        print(f"  measuring POST /api/connections/{ROLE}/credentials "
              f"(concurrency {args.concurrency}, {args.seconds:g} s)...", flush=True)
        cred = await bench_credentials(http, f"{daemon.url}/connections/{ROLE}/credentials", args.seconds,
                                       args.concurrency)
        results.append((cred, "issue"))

        # every issued credential opened one "ready" session (the seeded ones are done)
        async with http.get(f"{daemon.url}/sessions?limit=1&status=ready") as resp:
            total_after = (await resp.json())["total"]
        issued = cred.statuses.get(201, 0)
        if total_after != min(issued, COUNT_CAP):
            cred.errors.append(f"ready sessions after issuing: {total_after} != {issued}")
    return results


# ---------------------------------------------------------------- report
def report(results: list[tuple[Result, str]], seeded: Seeded, args: argparse.Namespace) -> None:
    print()
    print(f"gatewayd control API, {seeded.sessions:,} sessions stored "
          f"(python {platform.python_version()}, sqlite {sqlite3.sqlite_version}, {os.cpu_count()} CPUs, "
          f"client and daemon on the same host)")
    rows = [("measurement", "median", "p95", "rate", "target", "verdict")]
    for result, kind in results:
        if result.seconds:  # throughput line
            figure, target = result.rate, CREDENTIALS_TARGET_PER_S
            verdict = "PASS" if figure > target else "MISS"
            rows.append((result.name, f"{result.median:.2f} ms", f"{result.p95:.2f} ms", f"{figure:,.0f}/s",
                         f"> {target:.0f}/s", verdict))
        else:
            target = LIST_TARGET_MS
            verdict = "PASS" if result.median < target else "MISS"
            label = f"< {target:.0f} ms median" + ("" if kind == "issue" else " (*)")
            rows.append((result.name, f"{result.median:.2f} ms", f"{result.p95:.2f} ms",
                         f"{1000 / result.median:,.0f}/s seq", label, verdict))
        if result.errors:
            rows[-1] = rows[-1][:-1] + (rows[-1][-1] + f" ({len(result.errors)} bad responses)",)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    line = "  ".join("-" * w for w in widths)
    for k, row in enumerate(rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if k == 0:
            print(line)
    print(line)
    print("(*) the issue sets the 20 ms target for the first page; deeper and filtered pages are held to the same bar")
    print(f"    for comparison. GET lines: {args.requests} sequential requests after {WARMUP} warm-ups, keep-alive; "
          f"POST: {args.concurrency} concurrent clients for {args.seconds:g} s after {WARMUP} warm-ups.")
    cred = results[-1][0]
    statuses = ", ".join(f"HTTP {k}: {v}" for k, v in sorted(cred.statuses.items()))
    print(f"    credentials: {cred.count} issued in {cred.seconds:.2f} s; all statuses incl. warm-up: {statuses}")
    how = (f"batched executemany of create_session's INSERT (one-by-one create_session ran at "
           f"{seeded.one_by_one_rate:,.0f}/s: {seeded.sessions / seeded.one_by_one_rate:,.0f} s projected)"
           if seeded.bulk else f"store.create_session one by one ({seeded.one_by_one_rate:,.0f}/s)")
    print(f"    seeding: {seeded.seconds:.1f} s, {how}")
    bad = [(r.name, e) for r, _ in results for e in r.errors]
    for name, error in bad[:10]:
        print(f"ERROR {name}: {error}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=100_000, help="sessions to seed (default 100000)")
    parser.add_argument("--seconds", type=float, default=5.0, help="duration of the credentials run (default 5)")
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY,
                        help=f"concurrent clients of the credentials run (default {CONCURRENCY})")
    parser.add_argument("--requests", type=int, default=200, help="measured requests per GET line (default 200)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary data dir and daemon log")
    args = parser.parse_args(argv)
    if args.sessions < 2 * len(SEED_CONNECTIONS) * SEED_USERS:
        parser.error(f"--sessions: at least {2 * len(SEED_CONNECTIONS) * SEED_USERS}")
    try:
        import uvloop
    except ImportError:
        uvloop = None  # type: ignore[assignment]
    run = uvloop.run if uvloop is not None else asyncio.run

    workdir = Path(tempfile.mkdtemp(prefix="gatewayd-bench-api-"))
    daemon = Daemon(workdir / "data")
    try:
        print(f"seeding {args.sessions:,} sessions into {daemon.data_dir} ...", flush=True)
        seeded = run(seed(daemon.config_path, daemon.env(), args.sessions))
        print(f"  done in {seeded.seconds:.1f} s", flush=True)
        print("starting gatewayd run ...", flush=True)
        t0 = time.perf_counter()
        daemon.start(timeout=120)
        print(f"  listening on {daemon.url} after {time.perf_counter() - t0:.1f} s", flush=True)
        token = daemon.token("bench-admin@example.com", groups="admin", name="Bench Admin")
        results = run(measure(daemon, token, seeded, args))
        report(results, seeded, args)
        failed = any(r.errors for r, _ in results)
    finally:
        code = daemon.stop()
        if code not in (0, None):
            print(f"gatewayd exited with {code}; log: {daemon.log_path}")
        if args.keep:
            print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
