"""SSH proxy benchmark: ``cat`` and ``scp`` throughput and connect latency direct, through ProxyJump and gatewayd.

Target (issue 36): a 1 GB ``cat`` over an exec channel and an ``scp`` download
of the same file through the gateway -- recording on -- reach at least 0.9 of
the throughput of OpenSSH's ProxyJump (``ssh -J`` through a second sshd, the
usual bastion). Connect latency (``ssh ... true``, median of N) is printed for
all paths.

Everything is started here on free ports: the target sshd and the jump sshd
(``tests/sshpeer.py``, root needed for their dedicated user) and a real
``gatewayd run`` subprocess with the ssh listener (``--other NAME=DIR``: one
more running another checkout's code, e.g. a worktree of main, measured in the
same interleaved rounds). The clients are OpenSSH ``ssh`` and ``scp`` processes
with their output sent to /dev/null.

Beside MB/s it prints CPU seconds per GB: the gateway process's own (utime +
stime from /proc, its threads included), the client's (``ssh``/``scp`` and the
ProxyCommand ``ssh``: this process's reaped children) and the jump sshd's (its
session processes, polled). On a loaded machine the MB/s move with
the neighbours' load; the CPU per GB does not, and on a machine with free
cores it is what sets each path's ceiling (each process is one thread).

It is a benchmark, not a test: it exits 0 whether the target is met or not,
non-zero only when it could not measure.

    .venv/bin/python bench/ssh/bench_ssh.py [--megabytes 1024] [--runs 3] [--connects 10]
        [--transfers cat,scp] [--cap BYTES] [--other NAME=DIR ...] [--profile FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import aiohttp

from tests.apiclient import SshApi
from tests.conftest import Daemon, free_port
from tests.sshpeer import CLIENT_OPTIONS, SshTarget, unavailable_reason

TICKS = os.sysconf("SC_CLK_TCK")
TARGET_RATIO = 0.9


async def gateway_secret(daemon: Daemon, target: SshTarget) -> str:
    """A connection to the target (its host key checked) and a credential for it, through the API."""
    token = daemon.token("bench@example.com", groups="admin", name="Bench")
    async with aiohttp.ClientSession() as http:
        api = SshApi(daemon, http, target, token)
        secret, _ = await api.credential(await api.role(host_key=target.host_public_key), seconds=3600)
        return secret


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (its threads included), from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime (fields 14 and 15 of proc(5))


class DescendantsCPU(threading.Thread):
    """The CPU seconds of the processes started under ``pid`` while it runs (polled: sshd's session processes
    are not all reaped by the listener, so its cutime misses them)."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.before = set(self.descendants())
        self.last: dict[int, float] = {}
        self.done = threading.Event()
        self.start()

    def descendants(self) -> list[int]:
        found, todo = [], [self.pid]
        while todo:
            try:
                children = Path(f"/proc/{todo.pop()}/task").glob("*/children")
                pids = [int(c) for child in children for c in child.read_text().split()]
            except OSError:
                continue
            found += pids
            todo += pids
        return found

    def run(self) -> None:
        while not self.done.wait(0.05):
            for pid in self.descendants():
                if pid not in self.before:
                    try:
                        self.last[pid] = cpu_seconds(pid)
                    except OSError:
                        pass

    def stop(self) -> float:
        self.done.set()
        self.join()
        return sum(self.last.values())


def own_children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@dataclass(slots=True)
class Route:
    """One way to reach the target: the client command's prefix, and the process whose CPU is the path's middle."""

    name: str
    ssh: list[str]  # ssh options and destination, before the remote command
    scp: list[str]  # scp options, before the source
    source: str  # scp's user@host: prefix
    middle: int | None = None  # pid of the gateway process (own CPU) or the jump sshd (its session processes')
    middle_children: bool = False
    seconds: dict[str, list[float]] = field(default_factory=dict)
    middle_cpu: dict[str, list[float]] = field(default_factory=dict)
    client_cpu: dict[str, list[float]] = field(default_factory=dict)
    connects: list[float] = field(default_factory=list)


def timed(command: list[str]) -> float:
    started = time.perf_counter()
    result = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            timeout=900)
    elapsed = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:1])} failed ({result.returncode}): {result.stderr.decode()[-300:]}")
    return elapsed


def measure(path: Route, transfer: str, command: list[str]) -> None:
    """One round of one transfer: wall time, the client's CPU and the middle's CPU."""
    sessions = DescendantsCPU(path.middle) if path.middle and path.middle_children else None
    middle = cpu_seconds(path.middle) if path.middle and not sessions else 0.0
    client = own_children_cpu()
    elapsed = timed(command)
    path.client_cpu.setdefault(transfer, []).append(own_children_cpu() - client)
    if sessions:
        path.middle_cpu.setdefault(transfer, []).append(sessions.stop())
    elif path.middle:
        path.middle_cpu.setdefault(transfer, []).append(cpu_seconds(path.middle) - middle)
    path.seconds.setdefault(transfer, []).append(elapsed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=1024, help="size of the file (MiB)")
    parser.add_argument("--runs", type=int, default=3, help="rounds per path and transfer (best and median shown)")
    parser.add_argument("--connects", type=int, default=10, help="connect-plus-true runs per path (median)")
    parser.add_argument("--transfers", default="cat,scp", help="which of cat, scp (SFTP, OpenSSH's default), "
                        "scp-O (the legacy scp protocol: an exec of 'scp -f')")
    parser.add_argument("--cap", type=int, default=0, help="the gateway's sessions.recording_cap_bytes "
                        "(default: the default config's, 64 MiB)")
    parser.add_argument("--other", action="append", default=[], metavar="NAME=DIR",
                        help="another checkout's code (e.g. a worktree of main) run as one more gateway, "
                        "'gateway-NAME', in the same rounds (repeatable)")
    parser.add_argument("--profile", type=Path, help="after the rounds, one more gateway cat sampled with "
                        "py-spy (on PATH; --native, 250 Hz) into this file (collapsed stacks, py-spy's raw format)")
    parser.add_argument("--no-direct", action="store_true", help="leave the direct path out")
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    transfers = [t for t in args.transfers.split(",") if t]
    if not set(transfers) <= {"cat", "scp", "scp-O"}:
        parser.error("--transfers: cat, scp, scp-O")

    work = Path(tempfile.mkdtemp(prefix="gatewayd-bench-ssh-"))
    work.chmod(0o755)  # sshd reads the authorized keys as the target user
    target = SshTarget(work / "target").start()
    jump = SshTarget(work / "jump", client_key=target.client_key).start(password=target.password)
    settings: dict[str, object] = {"listeners.ssh": f"127.0.0.1:{free_port()}"}
    if args.cap:
        settings["sessions.recording_cap_bytes"] = args.cap
    daemons = {"gateway": Daemon(work / "data", settings)}
    for other in args.other:
        name, _, directory = other.partition("=")
        if not name or not (Path(directory) / "gatewayd").is_dir():
            parser.error(f"--other {other}: NAME=DIR, DIR a checkout of gatewayd")
        daemon = Daemon(work / f"other-{name}", {**settings, "listeners.ssh": f"127.0.0.1:{free_port()}"})
        daemon.extra_env["PYTHONPATH"] = str(Path(directory).resolve())  # before the venv's editable install
        daemons[f"gateway-{name}"] = daemon
    payload = f"/tmp/gatewayd-bench-ssh-{args.megabytes}m"
    try:
        for daemon in daemons.values():
            daemon.start()
        make = target.ssh(f"head -c {args.megabytes}M /dev/urandom > {payload}", timeout=600)
        assert make.returncode == 0, make.stderr

        key = ["-i", str(target.client_key)]
        user = f"{target.user}@127.0.0.1"
        jump_command = (f"ProxyCommand=ssh {' '.join(CLIENT_OPTIONS)} -i {target.client_key} "
                        f"-p {jump.port} -W %h:%p {user}")
        paths = [] if args.no_direct else [
            Route("direct", [*CLIENT_OPTIONS, *key, "-p", str(target.port), user],
                  [*CLIENT_OPTIONS, *key, "-P", str(target.port)], f"{user}:")]
        assert jump.process is not None
        paths.append(Route("proxyjump", [*CLIENT_OPTIONS, *key, "-o", jump_command, "-p", str(target.port), user],
                           [*CLIENT_OPTIONS, *key, "-o", jump_command, "-P", str(target.port)], f"{user}:",
                           middle=jump.process.pid, middle_children=True))
        for name, daemon in daemons.items():
            port = daemon.settings["listeners.ssh"].rsplit(":", 1)[1]  # type: ignore[union-attr]
            secret = asyncio.run(gateway_secret(daemon, target))
            assert daemon.process is not None
            paths.append(Route(name, [*CLIENT_OPTIONS, "-p", port, f"{secret}@127.0.0.1"],
                               [*CLIENT_OPTIONS, "-P", port], f"{secret}@127.0.0.1:", middle=daemon.process.pid))
        cap = f"cap {args.cap} bytes" if args.cap else "default cap, 64 MiB"
        print(f"ssh throughput: {', '.join(transfers)} of {args.megabytes} MiB ({args.runs} interleaved rounds), "
              f"connect+true latency (median of {args.connects}); recording on ({cap}); "
              f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        for path in paths:
            timed(["ssh", *path.ssh, "true"])  # warm-up
        # Interleaved rounds (direct, proxyjump, gateway, direct, ...): on a shared machine the load
        # changes from minute to minute, and each path gets the same share of it.
        for _ in range(args.runs):
            for transfer in transfers:
                for path in paths:
                    if transfer == "cat":
                        command = ["ssh", *path.ssh, f"cat {payload}"]
                    else:
                        command = ["scp", *(["-O"] if transfer == "scp-O" else []), "-q", *path.scp,
                                   f"{path.source}{payload}", "/dev/null"]
                    measure(path, transfer, command)
        for _ in range(args.connects):
            for path in paths:
                path.connects.append(timed(["ssh", *path.ssh, "true"]))
        report(paths, transfers, args.megabytes)
        if args.profile:
            profile(next(path for path in paths if path.name == "gateway"), payload, args.profile)
    finally:
        target.ssh(f"rm -f {payload}")
        for daemon in daemons.values():
            daemon.stop()
        jump.destroy()
        target.destroy()
    return 0


def profile(path: Route, payload: str, out: Path) -> None:
    """One more cat through the gateway, sampled by py-spy (its native frames too: OpenSSL, the kernel calls)."""
    assert path.middle is not None
    spy = subprocess.Popen(["py-spy", "record", "--native", "--rate", "250", "--format", "raw",
                            "--output", str(out), "--pid", str(path.middle)], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE)
    time.sleep(1.0)  # py-spy attaches
    measure(path, "profiled", ["ssh", *path.ssh, f"cat {payload}"])
    spy.send_signal(2)
    if spy.wait(60):
        print(f"py-spy failed: {spy.stderr.read().decode()[-300:]}")  # type: ignore[union-attr]
    print(f"profile of one more gateway cat ({path.middle_cpu['profiled'][0]:.1f} s of gateway CPU): {out}")


def report(paths: list[Route], transfers: list[str], megabytes: int) -> None:
    gigabytes = megabytes / 1024
    mb = megabytes * (1 << 20) / 1e6
    by_name = {path.name: path for path in paths}
    print(f"load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for transfer in transfers:
        print(f"{transfer}:")
        for path in paths:
            seconds = path.seconds[transfer]
            middle = path.middle_cpu.get(transfer)
            middle_text = (f"{'gateway' if path.name.startswith('gateway') else 'jump sshd'} CPU "
                           f"{statistics.median(middle) / gigabytes:5.2f} s/GB (min {min(middle) / gigabytes:5.2f})"
                           if middle else " " * 37)
            print(f"  {path.name:11s} best {mb / min(seconds):7.1f} MB/s  median {mb / statistics.median(seconds):7.1f}"
                  f" MB/s   {middle_text}   client CPU {statistics.median(path.client_cpu[transfer]) / gigabytes:5.2f} "
                  f"s/GB   connect+true {statistics.median(path.connects) * 1000:6.1f} ms")
        jump = by_name["proxyjump"].seconds[transfer]
        for name in by_name:
            if not name.startswith("gateway"):
                continue
            own = by_name[name].seconds[transfer]
            ratio = min(jump) / min(own)
            print(f"  {name}/proxyjump {ratio:.2f} best, {statistics.median(jump) / statistics.median(own):.2f} median "
                  f"(target >= {TARGET_RATIO}: {'OK' if ratio >= TARGET_RATIO else 'MISS'})")


if __name__ == "__main__":
    sys.exit(main())
