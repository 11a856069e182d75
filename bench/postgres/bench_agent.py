"""The agent path's cost per transaction: the gateway's and the agent's CPU, and the latency at ``-c 1``.

``bench_postgres.py --via-agent`` compares TPS, which on a shared machine says little.  This one
runs pgbench for a fixed count of transactions (``-t``) and reads the CPU time (user + system,
all threads, from /proc) that the gateway process and the agent process used for them, so a
change of the transport can be measured on a busy machine: per transaction, the gateway's CPU
through the agent, the agent's CPU, and the same gateway's CPU on its direct path (what the
agent path adds is the difference).  ``--baseline DIR`` starts a second gateway and agent from
another checkout (``PYTHONPATH=DIR``) and interleaves both in every round.

    .venv/bin/python bench/postgres/bench_agent.py [--rounds 3] [--transactions 3000]
        [--clients 1,16] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.postgres.bench_postgres import (cpu_seconds, figures, gateway_credential, median, pgbench,  # noqa: E402
                                           start_agent, start_gateway, transactions, tree_cpu_seconds)
from gatewayd.tls import generate_self_signed  # noqa: E402
from tests.conftest import wait_port  # noqa: E402
from tests.ports import free_port  # noqa: E402
from tests.pgpeer import PgCluster, unavailable_reason  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--transactions", type=int, default=3000, help="per run, all clients together")
    parser.add_argument("--clients", default="1,16")
    parser.add_argument("--scale", type=int, default=1)
    parser.add_argument("--baseline", default="", help="also the gateway and agent of the checkout in this directory")
    parser.add_argument("--floor", action="store_true", help="also two forwarders chained over TLS (a raw tunnel's floor)")
    parser.add_argument("--agent-workers", type=int, default=1,
                        help="the agent's --workers (carrier processes; its CPU counts them all)")
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason or shutil.which("pgbench") is None:
        print(f"cannot run: {reason or 'pgbench not found'}", file=sys.stderr)
        return 2
    trees: dict[str, dict[str, str]] = {"this": {}} | ({"baseline": {"PYTHONPATH": str(Path(args.baseline).resolve())}} if args.baseline else {})
    cluster = PgCluster(tls=False).start()
    daemons: list[Any] = []
    agents: list[subprocess.Popen[bytes]] = []
    forwarders: list[subprocess.Popen[bytes]] = []
    try:
        pgbench(cluster.port, "postgres", cluster.password, "-i", "-q", "-s", str(args.scale))
        # name -> (port, user, gateway pid, agent pid or None)
        targets: dict[str, tuple[int, str, int, int | None]] = {}
        for tree, env in trees.items():
            daemon, port = start_gateway(1, grpc=True, env=env)
            daemons.append(daemon)
            agent = start_agent(daemon, {**env, "GATEWAYD_AGENT_WORKERS": str(args.agent_workers)})
            agents.append(agent)
            assert daemon.process is not None
            targets[f"{tree} direct"] = (port, asyncio.run(gateway_credential(daemon, cluster)), daemon.process.pid,
                                         None)
            targets[f"{tree} agent"] = (port, asyncio.run(gateway_credential(daemon, cluster, "bench-agent",
                                                                              agent_id="bench")),
                                        daemon.process.pid, agent.pid)
        if args.floor:  # forwarder (the gateway's place) -TLS-> forwarder (the agent's place) -> PostgreSQL
            cert, key = (Path(tempfile.mkdtemp(prefix="bench-agent-")) / name for name in ("hop.crt", "hop.key"))
            generate_self_signed(cert, key, "bench")
            back, front = free_port(), free_port()
            script = str(Path(__file__).with_name("forwarder.py"))
            forwarders.append(subprocess.Popen([sys.executable, script, str(back), str(cluster.port),
                                                "--tls-in", str(cert), str(key)]))
            forwarders.append(subprocess.Popen([sys.executable, script, str(front), str(back), "--tls-out"]))
            for port in (back, front):
                wait_port(port, None, "forwarder")
            targets["tls chain"] = (front, "postgres", forwarders[1].pid, forwarders[0].pid)
            # the design in docs/agents.md: length-prefixed Frames over a TLS connection per stream, the pump as is
            back, front = free_port(), free_port()
            script = str(Path(__file__).with_name("tunnel_chain.py"))
            forwarders.append(subprocess.Popen([sys.executable, script, "back", str(back), str(cluster.port),
                                                str(cert), str(key)]))
            wait_port(back, None, "tunnel_chain back")
            forwarders.append(subprocess.Popen([sys.executable, script, "front", str(front), str(back)]))
            wait_port(front, None, "tunnel_chain front")
            targets["framed chain"] = (front, "postgres", forwarders[3].pid, forwarders[2].pid)
        print(f"{os.cpu_count()} CPUs; pgbench -S -M simple -t (total {args.transactions}); load "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        for clients in [int(c) for c in args.clients.split(",")]:
            each = max(1, args.transactions // clients)
            rows: dict[str, dict[str, list[float]]] = {name: {"gw": [], "agent": [], "ms": [], "tps": []}
                                                       for name in targets}
            for _ in range(args.rounds):
                for name, (port, user, gw_pid, agent_pid) in targets.items():
                    before = cpu_seconds(gw_pid), tree_cpu_seconds(agent_pid)
                    password = cluster.password if name.endswith("chain") else "any"
                    output = pgbench(port, user, password, "-S", "-M", "simple", "-n", "-c", str(clients),
                                     "-j", str(min(clients, 2)), "-t", str(each))
                    after = cpu_seconds(gw_pid), tree_cpu_seconds(agent_pid)
                    count = max(1, transactions(output))
                    tps, ms = figures(output)
                    row = rows[name]
                    row["gw"].append((after[0] - before[0]) / count * 1e6)
                    row["agent"].append((after[1] - before[1]) / count * 1e6)
                    row["ms"].append(ms)
                    row["tps"].append(tps)
            print(f"-c {clients} ({args.rounds} rounds, medians; load {os.getloadavg()[0]:.2f})")
            for name, row in rows.items():
                sides = ("front", "back") if name.endswith("chain") else ("gateway", "agent")
                print(f"  {name:<16} {sides[0]:>7} {median(row['gw']):6.0f} us  {sides[1]:>5} {median(row['agent']):6.0f} us"
                      f"  latency {median(row['ms']):.3f} ms  {median(row['tps']):8.0f} TPS"
                      f"   (gw {' '.join(f'{v:.0f}' for v in row['gw'])})")
            for tree in trees:
                direct, via = rows[f"{tree} direct"], rows[f"{tree} agent"]
                print(f"  {tree}: the agent path adds {median(via['gw']) - median(direct['gw']):+.0f} us gateway CPU,"
                      f" {(median(via['ms']) - median(direct['ms'])) * 1000:+.0f} us latency;"
                      f" TPS agent/direct {median(via['tps']) / median(direct['tps']):.2f}")
        return 0
    finally:
        for process in (*forwarders, *agents):
            process.terminate()
            process.wait(10)
        for daemon in daemons:
            daemon.stop()
        cluster.destroy()


if __name__ == "__main__":
    sys.exit(main())
