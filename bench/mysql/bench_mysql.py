"""MySQL proxy benchmark: sysbench point selects direct, through a byte forwarder and through gatewayd, side by side.

``sysbench oltp_point_select`` (one primary-key SELECT per event, autocommit)
against three endpoints in one run, each run interleaved:

* ``direct`` -- straight to a MariaDB started here (tests/mypeer.py);
* ``forwarder`` -- ``bench/postgres/forwarder.py``, a uvloop byte forwarder that inspects nothing (the floor
  of any asyncio proxy on this machine);
* ``gateway`` -- ``gatewayd run`` with the mysql listener, recording on (and with ``--rules`` two input guard
  rails: deny words and statement kinds, plus a masking rule).

Rows: ``ps`` (sysbench's server-side prepared statements: COM_STMT_PREPARE/EXECUTE, binary rows), ``text``
(``--db-ps-mode=disable``: COM_QUERY, text rows), both at ``--clients`` threads, and ``c1`` (one thread, text):
its mean latency.  Under each run, the CPU time (user + system) each proxy process spent per query: it hardly
moves when other work shares the machine, so it is the figure to compare changes with.  A benchmark, not a
test: it exits 0 whatever the figures, non-zero only when it could not measure.

    .venv/bin/python bench/mysql/bench_mysql.py [--seconds 10] [--clients 4] [--rows 10000] [--rules] [--rounds 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.apiclient import MySqlApi, admin_http  # noqa: E402
from tests.conftest import Daemon, wait_port  # noqa: E402
from tests.mypeer import MariaDB  # noqa: E402
from tests.ports import free_port  # noqa: E402

RULES_IN = [{"type": "deny_words_list", "words": ["drop table", "grant all"]},
            {"type": "statement_kinds", "deny": ["DropStmt", "TruncateStmt", "GrantStmt"]}]
RULES_OUT = [{"type": "mask", "patterns": ["card_number", "email"]}]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sysbench(port: int, user: str, password: str, seconds: int, threads: int, rows: int, *extra: str,
             command: str = "run") -> str:
    done = subprocess.run(["sysbench", "oltp_point_select", "--db-driver=mysql", "--mysql-host=127.0.0.1",
                           f"--mysql-port={port}", f"--mysql-user={user}", f"--mysql-password={password}",
                           "--mysql-db=app", "--mysql-ssl=off", "--tables=1", f"--table_size={rows}",
                           f"--time={seconds}", f"--threads={threads}", "--skip_trx=on", *extra, command],
                          capture_output=True, text=True, timeout=seconds + 120, check=False)
    if done.returncode != 0:
        raise SystemExit(f"sysbench {command} failed on port {port}:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def figures(output: str) -> tuple[float, float]:
    """(queries per second, mean latency in ms) of a sysbench run."""
    qps = float(re.search(r"queries:\s+\d+\s+\(([\d.]+) per sec", output).group(1))  # type: ignore[union-attr]
    latency = float(re.search(r"avg:\s+([\d.]+)", output).group(1))  # type: ignore[union-attr]
    return qps, latency


async def gateway_credential(daemon: Daemon, server: MariaDB, rules: bool) -> str:
    async with admin_http(daemon) as http:
        api = MySqlApi(daemon, http, server)
        role = await api.role()
        if rules:
            await api.guardrail(role, input_rules=RULES_IN, output_rules=RULES_OUT)
        secret, _ = await api.credential(role, seconds=3600)
        return secret


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rows", type=int, default=10000)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--rules", action="store_true", help="guard rails and a masking rule on the gateway")
    args = parser.parse_args()
    if shutil.which("sysbench") is None:
        print("sysbench is not installed (apt-get install sysbench)", file=sys.stderr)
        return 2
    server = MariaDB().start()
    work = Path(tempfile.mkdtemp(prefix="gatewayd-bench-mysql-"))
    processes: list[subprocess.Popen[bytes]] = []
    daemon = None
    try:
        sysbench(server.port, "root", server.password, 1, 1, args.rows, command="prepare")
        forward_port = free_port()
        forwarder = subprocess.Popen([sys.executable, str(ROOT / "bench/postgres/forwarder.py"), str(forward_port),
                                      str(server.port)])
        processes.append(forwarder)
        wait_port(forward_port, forwarder, "the forwarder")
        gateway_port = free_port()
        daemon = Daemon(work / "data", {"listeners.mysql": f"127.0.0.1:{gateway_port}"})
        daemon.start()
        wait_port(gateway_port, daemon.process, "gatewayd")
        secret = asyncio.run(gateway_credential(daemon, server, args.rules))
        endpoints = {"direct": (server.port, "root", server.password, None),
                     "forwarder": (forward_port, "root", server.password, forwarder.pid),
                     "gateway": (gateway_port, secret, "any", daemon.process.pid)}  # type: ignore[union-attr]
        runs = {"ps": (args.clients, ()), "text": (args.clients, ("--db-ps-mode=disable",)),
                "c1": (1, ("--db-ps-mode=disable",))}
        results: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
        for _ in range(args.rounds):
            for run, (threads, extra) in runs.items():
                for name, (port, user, password, pid) in endpoints.items():
                    before = cpu_seconds(pid) if pid else 0.0
                    qps, latency = figures(sysbench(port, user, password, args.seconds, threads, args.rows, *extra))
                    spent = cpu_seconds(pid) - before if pid else 0.0
                    queries = qps * args.seconds
                    results.setdefault((run, name), []).append((qps, latency, spent / queries * 1e6 if pid else 0))
        print(f"sysbench oltp_point_select, {args.seconds} s a run, {args.rows} rows, {args.rounds} round(s)"
              f"{', gateway with guard rails and a mask rule' if args.rules else ''}; MariaDB {server.version}")
        print(f"{'run':6} {'direct qps':>11} {'fwd qps':>9} {'gw qps':>9} {'gw/direct':>9} {'gw/fwd':>7} "
              f"{'lat direct':>10} {'lat gw':>8} {'CPU fwd':>8} {'CPU gw':>8}")
        for run in runs:
            med = {name: [statistics.median(v[i] for v in results[(run, name)]) for i in range(3)]
                   for name in endpoints}
            direct, fwd, gw = med["direct"], med["forwarder"], med["gateway"]
            print(f"{run:6} {direct[0]:11.0f} {fwd[0]:9.0f} {gw[0]:9.0f} {gw[0] / direct[0]:9.2f} "
                  f"{gw[0] / fwd[0]:7.2f} {direct[1]:8.3f}ms {gw[1]:6.3f}ms {fwd[2]:6.1f}µs {gw[2]:6.1f}µs")
        print("CPU: user + system time of the proxy process per query (the forwarder's and the gateway's)")
        return 0
    finally:
        for process in processes:
            process.kill()
            process.wait(10)
        if daemon is not None:
            daemon.stop()
        server.destroy()
        shutil.rmtree(work, ignore_errors=True)
        time.sleep(0)


if __name__ == "__main__":
    sys.exit(main())
