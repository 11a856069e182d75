"""PostgreSQL proxy benchmark: pgbench direct, through pgbouncer and through gatewayd, side by side.

Target (from the issue): ``pgbench -S -T 10 -c 4`` through the gateway -- with
two input guard rails and recording on -- reaches at least 0.6 of the direct
TPS (pgbouncer in transaction pooling reaches about 0.71 on a 2-core machine).

``--via-agent`` adds a ``gateway+agent`` column: the same gateway reaching the cluster through a
``gatewayd agent`` on this machine (gRPC over TLS on loopback), its ratio to the direct gateway path
(``agent/gw``) and, at ``-c 1``, the latency the agent adds per transaction.

Also printed: ``-M extended`` and ``-M prepared``, the ``-c 1`` latency
overhead, and ``forwarder`` -- ``forwarder.py``, a uvloop byte forwarder that
looks at nothing: the floor of any asyncio proxy on this machine, so the
``gw/fwd`` ratio is what the gateway's own work (codec, guard rails,
recording) costs.  Under each run, ``proxy CPU per transaction`` is the CPU time
(user + system, all threads) each proxy process used divided by the
transactions it carried: unlike TPS it hardly moves when other work shares the
machine, so it is the figure to compare changes with.  ``--rounds N`` repeats
every run N times, interleaved, and prints medians.

Everything is started here on free ports: a PostgreSQL 15 cluster
(``tests/pgpeer.py``), ``pgbouncer`` when installed (as the ``postgres``
user: it refuses root), and a real ``gatewayd run`` subprocess.  It is a
benchmark, not a test: it exits 0 whether the target is met or not, non-zero
only when it could not measure.

``--rules`` adds a ``gateway+rules`` column: the same gateway, a second
connection that also carries the statement-kind rules (``statement_kinds``
denying DropStmt/TruncateStmt/GrantStmt, ``require_where`` on delete and
update) and a masking rule (card numbers and e-mail addresses, by pattern),
and prints the CPU per transaction they add.  The masking rule's cost per row
of 10 cells alone: ``bench_masking.py``.

``--workers 1,2,4`` starts one gateway per count of ``[daemon] workers`` and
runs each beside the others (columns ``gw 1w``, ``gw 2w``...); its CPU per
transaction is the supervisor's and all its workers'.  The ratio columns then
compare the gateway with the most workers, and ``Nw/1w`` each count's TPS
with the fewest workers' (the issue's target: 4 workers at least 3x 1 worker
at ``-c 16`` on 8 cores or more, and at least pgbouncer's TPS).

``--from-source`` adds ``gw source``: the same gateway with its hot path run from the Python source
(``GATEWAYD_PURE_PYTHON=1``), so a compiled and a source gateway are measured in the same rounds.

``--baseline DIR`` adds ``baseline``: the gateway of another checkout of the project (``git worktree add DIR
<commit>``, its hot path built there), run with ``PYTHONPATH=DIR``, so a change's before and after are measured
in the same rounds. ``--runs latency`` (or ``simple,extended,prepared,latency``) runs only those rows.

    .venv/bin/python bench/postgres/bench_postgres.py [--seconds 10] [--clients 4] [--scale 10] [--rounds 1]
        [--rules] [--workers 1] [--from-source] [--baseline DIR] [--runs simple,extended,prepared,latency]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import platform
import pwd
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import aiohttp

from tests.conftest import Daemon, free_port
from tests.ports import free_ports
from tests.pgpeer import PgCluster, unavailable_reason


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


class Pgbouncer:
    """pgbouncer in transaction pooling in front of the cluster (run as ``postgres`` when root)."""

    def __init__(self, cluster: PgCluster) -> None:
        self.cluster = cluster
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="gatewayd-pgbouncer-"))
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> Pgbouncer:
        (self.dir / "userlist.txt").write_text(f'"postgres" "{self.cluster.password}"\n')
        (self.dir / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"postgres = host=127.0.0.1 port={self.cluster.port} dbname=postgres\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\nunix_socket_dir =\n"
            f"auth_type = scram-sha-256\nauth_file = {self.dir / 'userlist.txt'}\n"
            "pool_mode = transaction\nmax_client_conn = 100\ndefault_pool_size = 20\n"
            f"logfile = {self.dir / 'pgbouncer.log'}\n")
        command = ["pgbouncer", str(self.dir / "pgbouncer.ini")]
        if os.geteuid() == 0:
            entry = pwd.getpwnam("postgres")
            for path in (self.dir, *self.dir.iterdir()):
                os.chown(path, entry.pw_uid, entry.pw_gid)
            command = ["runuser", "-u", "postgres", "--", *command]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(100):
            try:
                import socket

                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("pgbouncer did not start: " + (self.dir / "pgbouncer.log").read_text(errors="replace"))

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def pgbench(port: int, user: str, password: str, *args: str, timeout: float = 600) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env.update(PGPASSWORD=password, PGSSLMODE="disable")
    result = subprocess.run(["pgbench", "-h", "127.0.0.1", "-p", str(port), "-U", user, *args, "postgres"],
                            capture_output=True, text=True, env=env, timeout=timeout, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"pgbench {' '.join(args)} failed:\n{result.stderr}")
    return result.stdout


def figures(output: str) -> tuple[float, float]:
    """(TPS, average latency in ms) from pgbench's report; a report without them (no transaction ended within
    the run) is an error that shows the report."""
    tps, latency = re.search(r"tps = ([\d.]+)", output), re.search(r"latency average = ([\d.]+) ms", output)
    if tps is None or latency is None:
        raise RuntimeError(f"pgbench reported no throughput:\n{output}")
    return float(tps.group(1)), float(latency.group(1))


def transactions(output: str) -> int:
    return int(re.search(r"actually processed: (\d+)", output).group(1))  # type: ignore[union-attr]


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU time of a process and its threads (0 when unknown)."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int | None) -> float:
    """``cpu_seconds`` of a process and of every live process under it (a supervisor and its workers)."""
    if pid is None:
        return 0.0
    total, pending = 0.0, [pid]
    while pending:
        current = pending.pop()
        total += cpu_seconds(current)
        try:
            tasks = [task.name for task in Path(f"/proc/{current}/task").iterdir()]
        except OSError:
            continue
        for task in tasks:
            try:
                pending += [int(child) for child in Path(f"/proc/{current}/task/{task}/children").read_text().split()]
            except OSError:
                pass
    return total


def start_gateway(workers: int, grpc: bool = False, env: dict[str, str] | None = None) -> tuple[Daemon, int]:
    """A ``gatewayd run`` with ``workers`` workers, once every worker is ready (sd_notify); it and its pg port.

    ``grpc``: with its gRPC server for agents (``--via-agent``); ``env``: more environment."""
    port = free_port()
    # worker N listens on the gRPC and tunnel ports + N: a run of free ports each, none handed out again after
    ports = {"grpc.listen": f"127.0.0.1:{free_ports(workers)}", "grpc.tunnel_port": free_ports(workers)} if grpc \
        else {"grpc.listen": ""}
    daemon = Daemon(Path(tempfile.mkdtemp(prefix="gatewayd-bench-")) / "data",
                    {"listeners.postgres": f"127.0.0.1:{port}", "log.level": "warning", "daemon.workers": workers,
                     **ports})
    daemon.extra_env.update(env or {})
    path = daemon.data_dir.parent / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(str(path))
        notify.settimeout(120)
        base = daemon.env
        daemon.env = lambda: {**base(), "NOTIFY_SOCKET": str(path)}  # type: ignore[method-assign]
        daemon.start()
        if notify.recv(256) != b"READY=1":
            raise RuntimeError(f"gatewayd with {workers} workers did not get ready:\n{daemon.log_text()}")
    return daemon, port


def child_pid(pid: int) -> int | None:
    """The first child of a process (pgbouncer under runuser)."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return None
    return int(children[0]) if children else None


def median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


STATEMENT_RULES = [{"type": "statement_kinds", "deny": ["DropStmt", "TruncateStmt", "GrantStmt"]},
                   {"type": "require_where", "statements": ["delete", "update"]}]
MASK_RULE = {"type": "mask", "patterns": ["card_number", "email"]}


async def gateway_credential(daemon: Daemon, cluster: PgCluster, name: str = "bench",
                             statement_rules: bool = False, agent_id: str = "") -> str:
    """A role to the cluster with two input guard rails (and the statement and masking rules), and a credential."""
    token = daemon.token("bench@example.com", groups="admin")
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as http:
        secret = {"envvar:HOST": b64("127.0.0.1"), "envvar:PORT": b64(str(cluster.port)),
                  "envvar:USER": b64("postgres"), "envvar:PASS": b64(cluster.password), "envvar:DB": b64("postgres"),
                  "envvar:SSLMODE": b64("disable")}  # like the direct and pgbouncer runs
        async with http.post(daemon.url + "/connections", json={
                "name": name, "type": "database", "subtype": "postgres", "secret": secret,
                "agent_id": agent_id}) as response:
            connection = await response.json()
            assert response.status == 201, connection
        rails = [("no-drop", {"type": "deny_words_list", "words": ["drop table", "truncate"]}),
                 ("no-bulk-delete", {"type": "pattern_match", "pattern_regex": r"(?i)delete\s+from\s+\w+\s*;?\s*$"})]
        if statement_rules:
            rails += [(f"statement-rule-{i}", rule) for i, rule in enumerate(STATEMENT_RULES)]
            rails.append(("mask", MASK_RULE))
        for rail, rule in rails:
            output = rule["type"] == "mask"
            async with http.post(daemon.url + "/guardrails", json={
                    "name": f"{name}-{rail}", "connection_ids": [connection["id"]],
                    "input": {"rules": [] if output else [rule]},
                    "output": {"rules": [rule] if output else []}}) as response:
                assert response.status == 201, await response.text()
        async with http.post(daemon.url + f"/connections/{name}/credentials",
                             json={"access_duration_seconds": 7200}) as response:
            body = await response.json()
            assert response.status == 201, body
        return body["connection_credentials"]["username"]


def start_agent(daemon: Daemon, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """The agent "bench" registered through the API and started from the command it answered; once it is online.

    ``env``: more environment (``PYTHONPATH`` of another checkout)."""
    token = daemon.token("bench@example.com", groups="admin")

    async def register() -> str:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as http:
            async with http.post(daemon.url + "/agents", json={"name": "bench"}) as response:
                body = await response.json()
                assert response.status == 201, body
                return body["command"]

    words = shlex.split(asyncio.run(register()))  # NAME=value ... gatewayd agent --url ...
    assignments = dict(word.split("=", 1) for word in words if "=" in word and not word.startswith("-"))
    command = words[len(assignments):]
    process = subprocess.Popen([str(Path(sys.executable).with_name("gatewayd")), *command[1:], "--log-level", "warning"],
                               env={**os.environ, **assignments, **(env or {})})

    async def online() -> bool:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as http:
            async with http.get(daemon.url + "/agents/bench") as response:
                return (await response.json())["status"] == "online"

    deadline = time.monotonic() + 30
    while not asyncio.run(online()) or linked(daemon, process.pid) < int(daemon.settings.get("daemon.workers") or 1):
        if time.monotonic() > deadline or process.poll() is not None:
            raise RuntimeError("the agent did not come online (on every worker)")
        time.sleep(0.1)
    return process


def linked(daemon: Daemon, pid: int) -> int:
    """To how many of the gateway's workers the agent ``pid`` holds its gRPC link (worker N listens on the gRPC
    port + N, and an agent learns the others from the first's Welcome)."""
    grpc_port = int(str(daemon.settings["grpc.listen"]).rsplit(":", 1)[1])
    workers = int(daemon.settings.get("daemon.workers") or 1)
    listing = subprocess.run(["ss", "-Htnp", "state", "established", f"( dport >= :{grpc_port} and dport < :"
                              f"{grpc_port + workers} )"], capture_output=True, text=True).stdout
    return len({line.split()[3].rsplit(":", 1)[1] for line in listing.splitlines() if f"pid={pid}," in line})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--scale", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every target this many times, interleaved; medians are printed (steadier ratios "
                             "on a machine that is busy with other work)")
    parser.add_argument("--via-agent", action="store_true",
                        help="also run 'gateway+agent': the same gateway reaching the cluster through a `gatewayd agent` "
                             "(gRPC over TLS on loopback), and print the latency it adds")
    parser.add_argument("--rules", action="store_true",
                        help="also run 'gateway+rules': the same gateway with statement-kind rules (statement_kinds, "
                             "require_where) and a masking rule added, and print the proxy CPU per transaction they add")
    parser.add_argument("--from-source", action="store_true",
                        help="also run 'gw source': the same gateway with its hot path from the Python source "
                             "(GATEWAYD_PURE_PYTHON=1; the 'gateway' column runs it as make compiled it)")
    parser.add_argument("--baseline", default="",
                        help="also run 'baseline': the gateway of the checkout in this directory (PYTHONPATH=DIR)")
    parser.add_argument("--runs", default="simple,extended,prepared,latency",
                        help="which rows to run, comma-separated: simple, extended, prepared, latency")
    parser.add_argument("--workers", default="1",
                        help="comma-separated [daemon] workers counts, e.g. 1,2,4: one gateway each, run side by side")
    args = parser.parse_args()
    try:
        counts = sorted({int(count) for count in args.workers.split(",") if count.strip()})
    except ValueError:
        parser.error(f"--workers: expected counts such as 1,2,4, got {args.workers!r}")
    if not counts or counts[0] < 1:
        parser.error("--workers: counts of at least 1")
    wanted = {run.strip() for run in args.runs.split(",") if run.strip()}
    if not wanted or wanted - {"simple", "extended", "prepared", "latency"}:
        parser.error(f"--runs: some of simple, extended, prepared, latency, got {args.runs!r}")
    baseline = Path(args.baseline).resolve() if args.baseline else None
    if baseline is not None and not (baseline / "gatewayd" / "__init__.py").is_file():
        parser.error(f"--baseline: {baseline} is not a checkout of gatewayd")
    reason = unavailable_reason()
    if reason or shutil.which("pgbench") is None:
        print(f"cannot run: {reason or 'pgbench not found'}", file=sys.stderr)
        return 2
    cluster = PgCluster(tls=False).start()
    bouncer: Pgbouncer | None = None
    forwarder: subprocess.Popen[bytes] | None = None
    daemons: list[Daemon] = []
    # one gateway per workers count: "gateway" alone, else "gw <n>w"; the ratios use the one with the most
    gateways = {("gateway" if len(counts) == 1 else f"gw {count}w"): count for count in counts}
    gateway = list(gateways)[-1]
    agent: subprocess.Popen[bytes] | None = None
    try:
        print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
        pgbench(cluster.port, "postgres", cluster.password, "-i", "-q", "-s", str(args.scale))
        # name -> (port, user, password, pid whose CPU time, with its children's, is the proxy's)
        targets: dict[str, tuple[int, str, str, int | None]] = {
            "direct": (cluster.port, "postgres", cluster.password, None)}
        for index, (name, count) in enumerate(gateways.items()):
            daemon, gateway_port = start_gateway(count, grpc=args.via_agent and index == 0)
            daemons.append(daemon)
            secret = asyncio.run(gateway_credential(daemon, cluster))
            targets[name] = (gateway_port, secret, "any", daemon.process.pid if daemon.process else None)
        first = targets[list(gateways)[0]]
        if args.via_agent:  # through the gateway with the fewest workers
            agent = start_agent(daemons[0])
            via = asyncio.run(gateway_credential(daemons[0], cluster, "bench-agent", agent_id="bench"))
            targets["gateway+agent"] = (first[0], via, "any", first[3])
        if args.from_source:  # the same gateway once more, its hot path run from the Python source
            source, source_port = start_gateway(counts[0], env={"GATEWAYD_PURE_PYTHON": "1"})
            daemons.append(source)
            targets["gw source"] = (source_port, asyncio.run(gateway_credential(source, cluster)), "any",
                                    source.process.pid if source.process else None)
        if baseline is not None:  # another checkout's gateway, in the same rounds
            base, base_port = start_gateway(counts[0], env={"PYTHONPATH": str(baseline)})
            daemons.append(base)
            targets["baseline"] = (base_port, asyncio.run(gateway_credential(base, cluster)), "any",
                                   base.process.pid if base.process else None)
        if args.rules:  # on the gateway with the fewest workers
            ruled = asyncio.run(gateway_credential(daemons[0], cluster, "bench-rules", statement_rules=True))
            targets["gateway+rules"] = (first[0], ruled, "any", first[3])
        forwarder_port = free_port()
        forwarder = subprocess.Popen([sys.executable, str(Path(__file__).with_name("forwarder.py")),
                                      str(forwarder_port), str(cluster.port)])
        targets["forwarder"] = (forwarder_port, "postgres", cluster.password, forwarder.pid)
        time.sleep(0.5)
        if shutil.which("pgbouncer"):
            bouncer = Pgbouncer(cluster).start()
            assert bouncer.process is not None
            bouncer_pid = child_pid(bouncer.process.pid) if os.geteuid() == 0 else bouncer.process.pid
            targets["pgbouncer"] = (bouncer.port, "postgres", cluster.password, bouncer_pid)
        else:
            print("pgbouncer not installed: its column is skipped (apt-get install pgbouncer)")
        runs = [run for key, run in (("simple", ("-S -M simple", ["-S", "-M", "simple"], args.clients)),
                                     ("extended", ("-S -M extended", ["-S", "-M", "extended"], args.clients)),
                                     ("prepared", ("-S -M prepared", ["-S", "-M", "prepared"], args.clients)),
                                     ("latency", ("-S -c 1 (latency)", ["-S", "-M", "simple"], 1)))
                if key in wanted]
        order = [name for name in ("direct", "pgbouncer", "forwarder", *gateways, "gw source", "baseline",
                                   "gateway+agent", "gateway+rules")
                 if name in targets]
        scaling = list(gateways)[1:]  # an Nw/1w column each
        rounds = max(1, args.rounds)
        print(f"pgbench -T {args.seconds} -j 2, scale {args.scale}; gateway: 2 input guard rails, recording on"
              + (f", {counts[0]} worker(s)" if len(counts) == 1 and counts[0] > 1 else "")
              + (f"; gw/...: {gateway}" if len(counts) > 1 else "")
              + (f"; {rounds} interleaved rounds, medians" if rounds > 1 else "") + "\n")
        print(f"{'run':<20}" + "".join(f"{name + ' TPS':>{max(16, len(name) + 6)}}" for name in order)
              + f"{'gw/direct':>11}{'bouncer/direct':>16}{'gw/fwd':>8}{'gw/bouncer':>12}"
              + "".join(f"{f'{gateways[n]}w/{counts[0]}w':>8}" for n in scaling)
              + (f"{'agent/gw':>10}" if "gateway+agent" in targets else ""))
        for label, extra, clients in runs:
            tps: dict[str, list[float]] = {}
            latency: dict[str, list[float]] = {}
            cpu: dict[str, list[float]] = {}  # proxy CPU microseconds per transaction
            ratios: dict[str, list[float]] = {"gw/direct": [], "bouncer/direct": [], "gw/fwd": [], "gw/bouncer": [],
                                              "agent/gw": [], **{name: [] for name in scaling}}
            for _ in range(rounds):
                for name in order:
                    port, user, password, pid = targets[name]
                    if name == "pgbouncer" and "prepared" in label:
                        continue  # named prepared statements need pgbouncer 1.21+ in transaction pooling
                    before = tree_cpu_seconds(pid)
                    output = pgbench(port, user, password, *extra, "-n", "-c", str(clients), "-j",
                                     str(min(clients, 2)), "-T", str(args.seconds))
                    used = tree_cpu_seconds(pid) - before
                    try:
                        result = figures(output)
                    except RuntimeError as exc:
                        raise RuntimeError(f"{name}, {label}, -c {clients}: {exc}") from None
                    tps.setdefault(name, []).append(result[0])
                    latency.setdefault(name, []).append(result[1])
                    if pid is not None and used > 0:
                        cpu.setdefault(name, []).append(used / max(1, transactions(output)) * 1e6)
                ratios["gw/direct"].append(tps[gateway][-1] / tps["direct"][-1])
                ratios["gw/fwd"].append(tps[gateway][-1] / tps["forwarder"][-1])
                if "gateway+agent" in tps:
                    ratios["agent/gw"].append(tps["gateway+agent"][-1] / tps[list(gateways)[0]][-1])
                if "pgbouncer" in tps and len(tps["pgbouncer"]) == len(tps["direct"]):
                    ratios["bouncer/direct"].append(tps["pgbouncer"][-1] / tps["direct"][-1])
                    ratios["gw/bouncer"].append(tps[gateway][-1] / tps["pgbouncer"][-1])
                for name in scaling:
                    ratios[name].append(tps[name][-1] / tps[list(gateways)[0]][-1])
            line = f"{label:<20}" + "".join(f"{median(tps[n]):>{max(16, len(n) + 6)},.0f}" if n in tps
                                            else f"{'-':>{max(16, len(n) + 6)}}" for n in order)
            line += "".join(f"{median(ratios[k]):>{w}.2f}" if ratios[k] else f"{'-':>{w}}"
                            for k, w in (("gw/direct", 11), ("bouncer/direct", 16), ("gw/fwd", 8), ("gw/bouncer", 12),
                                         *((name, 8) for name in scaling)))
            if "gateway+agent" in targets:
                line += f"{median(ratios['agent/gw']):>10.2f}"
            print(line, flush=True)
            if cpu:
                print(f"{'':<20}proxy CPU per transaction: "
                      + ", ".join(f"{n} {median(cpu[n]):.0f} us" for n in order if n in cpu))
                if "gateway+rules" in cpu and list(gateways)[0] in cpu:
                    print(f"{'':<20}statement-kind and masking rules add "
                          f"{median(cpu['gateway+rules']) - median(cpu[list(gateways)[0]]):+.1f} us CPU per transaction")
            if clients == 1:
                direct_ms, gateway_ms = median(latency["direct"]), median(latency[gateway])
                print(f"{'':<20}latency: direct {direct_ms:.3f} ms, gateway {gateway_ms:.3f} ms"
                      f" (+{(gateway_ms - direct_ms) * 1000:.0f} us per transaction)")
                if "forwarder" in latency:  # the extra hop alone: what is the gateway's own is above it
                    forwarder_ms = median(latency["forwarder"])
                    print(f"{'':<20}forwarder {forwarder_ms:.3f} ms (+{(forwarder_ms - direct_ms) * 1000:.0f} us):"
                          f" the gateway's own work adds {(gateway_ms - forwarder_ms) * 1000:+.0f} us over the hop")
                if "baseline" in latency:
                    baseline_ms = median(latency["baseline"])
                    print(f"{'':<20}baseline {baseline_ms:.3f} ms (+{(baseline_ms - direct_ms) * 1000:.0f} us over"
                          f" direct): this checkout's gateway {(gateway_ms - baseline_ms) * 1000:+.0f} us against it")
                if "gateway+agent" in latency:
                    agent_ms = median(latency["gateway+agent"])
                    print(f"{'':<20}through the agent: {agent_ms:.3f} ms"
                          f" (+{(agent_ms - gateway_ms) * 1000:.0f} us per transaction over the direct gateway path)")
        return 0
    finally:
        if agent is not None:
            agent.terminate()
            agent.wait(10)
        for daemon in daemons:
            daemon.stop()
        if forwarder is not None:
            forwarder.terminate()
            forwarder.wait(10)
        if bouncer is not None:
            bouncer.stop()
        cluster.destroy()


if __name__ == "__main__":
    sys.exit(main())
