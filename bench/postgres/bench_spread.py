"""How a ``gatewayd run`` with N workers spreads connections opened at once over its workers.

Opens ``--connections`` TCP connections to the PostgreSQL listener at once (as a pool or pgbench's clients do),
reads with ``ss`` which worker process holds each, prints the per-worker counts (busiest first), closes them and
does it again (``--rounds``). ``--workers`` takes several counts. ``--other NAME=DIR`` runs the same against the
gateway of another checkout (``PYTHONPATH=DIR``), for a before and after in one sitting. Needs no PostgreSQL: the
connections never send a start-up packet, so only the spread is measured (bench_postgres.py --workers measures
what it does to throughput).

    .venv/bin/python bench/postgres/bench_spread.py --workers 4,8 --connections 16,64 [--other before=DIR]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def spread(workers: int, connections: int, rounds: int) -> list[str]:
    """One gateway of this tree (or ``PYTHONPATH``'s): each round's per-worker counts."""
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_postgres import start_gateway  # noqa: E402  (the daemon and its readiness, as the benchmark runs it)

    daemon, port = start_gateway(workers)
    rows = []
    try:
        for _ in range(rounds):
            socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(connections)]
            time.sleep(0.5)
            listing = subprocess.run(["ss", "-Htnp", "state", "established", f"( sport = :{port} )"],
                                     capture_output=True, text=True, check=True).stdout
            held = collections.Counter(re.findall(r"pid=(\d+)", listing))
            counts = sorted(held.values(), reverse=True) + [0] * (workers - len(held))
            rows.append("/".join(map(str, counts)))
            for sock in socks:
                sock.close()
            time.sleep(0.5)
    finally:
        daemon.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="4", help="comma-separated worker counts")
    parser.add_argument("--connections", default="16", help="comma-separated connection counts")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--other", action="append", default=[], help="NAME=DIR: another checkout's gateway too")
    parser.add_argument("--only", help=argparse.SUPPRESS)  # one run, in a child (this tree or another's)
    args = parser.parse_args()
    if args.only:
        workers, connections = map(int, args.only.split(","))
        print(", ".join(spread(workers, connections, args.rounds)))
        return
    trees = [("this tree", str(ROOT))] + [tuple(other.split("=", 1)) for other in args.other]
    for workers in (int(w) for w in args.workers.split(",")):
        for connections in (int(c) for c in args.connections.split(",")):
            for name, tree in trees:
                env = {**os.environ, "PYTHONPATH": tree}
                out = subprocess.run([sys.executable, __file__, "--only", f"{workers},{connections}", "--rounds",
                                      str(args.rounds)], env=env, cwd=tree, capture_output=True, text=True)
                result = out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() \
                    else f"failed: {out.stderr.strip()[-300:]}"
                print(f"{workers} workers, {connections} connections at once, {name}: {result}", flush=True)


if __name__ == "__main__":
    main()
