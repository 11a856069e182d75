"""SSH proxy benchmark: exec throughput and connect latency direct, through ProxyJump and through gatewayd.

Target (from the issue): ``cat`` of a 200 MB file over an exec channel through
the gateway -- recording on -- reaches at least 0.5 of the throughput of
OpenSSH's ProxyJump (``ssh -J`` through a second sshd, the usual bastion).
Connect latency (``ssh ... true``, median of N) is printed for all three.

Everything is started here on free ports: the target sshd and the jump sshd
(``tests/sshpeer.py``, root needed for their dedicated user) and a real
``gatewayd run`` subprocess with the ssh listener. The clients are OpenSSH
``ssh`` processes with their output sent to /dev/null. It is a benchmark,
not a test: it exits 0 whether the target is met or not, non-zero only when
it could not measure.

    .venv/bin/python bench/ssh/bench_ssh.py [--megabytes 200] [--runs 3] [--connects 10]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import aiohttp

from tests.apiclient import SshApi
from tests.conftest import Daemon, free_port
from tests.sshpeer import CLIENT_OPTIONS, SshTarget, unavailable_reason


async def gateway_secret(daemon: Daemon, target: SshTarget) -> str:
    """A connection to the target (its host key checked) and a credential for it, through the API."""
    token = daemon.token("bench@example.com", groups="admin", name="Bench")
    async with aiohttp.ClientSession() as http:
        api = SshApi(daemon, http, target, token)
        secret, _ = await api.credential(await api.role(host_key=target.host_public_key), seconds=3600)
        return secret


def timed(command: list[str]) -> float:
    started = time.perf_counter()
    result = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            timeout=600)
    elapsed = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:1])} failed ({result.returncode}): {result.stderr.decode()[-300:]}")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=200)
    parser.add_argument("--runs", type=int, default=5, help="throughput runs per path (best and median shown)")
    parser.add_argument("--connects", type=int, default=10, help="connect-plus-true runs per path (median)")
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2

    work = Path(tempfile.mkdtemp(prefix="gatewayd-bench-ssh-"))
    work.chmod(0o755)  # sshd reads the authorized keys as the target user
    target = SshTarget(work / "target").start()
    jump = SshTarget(work / "jump", client_key=target.client_key).start(password=target.password)
    daemon = Daemon(work / "data", {"listeners.ssh": f"127.0.0.1:{free_port()}"}).start()
    try:
        gateway_port = int(daemon.settings["listeners.ssh"].rsplit(":", 1)[1])
        secret = asyncio.run(gateway_secret(daemon, target))
        payload = f"/tmp/gatewayd-bench-ssh-{args.megabytes}m"
        make = target.ssh(f"head -c {args.megabytes}M /dev/urandom > {payload}", timeout=300)
        assert make.returncode == 0, make.stderr

        key = ["-i", str(target.client_key)]
        user = f"{target.user}@127.0.0.1"
        paths = {
            "direct": ["ssh", *CLIENT_OPTIONS, *key, "-p", str(target.port), user],
            "proxyjump": ["ssh", *CLIENT_OPTIONS, *key, "-o",
                          f"ProxyCommand=ssh {' '.join(CLIENT_OPTIONS)} -i {target.client_key} "
                          f"-p {jump.port} -W %h:%p {user}", "-p", str(target.port), user],
            "gateway": ["ssh", *CLIENT_OPTIONS, "-p", str(gateway_port), f"{secret}@127.0.0.1"],
        }
        print(f"ssh exec throughput: cat of {args.megabytes} MB ({args.runs} interleaved runs), connect+true latency "
              f"(median of {args.connects}); recording on (default cap, 64 MiB)")
        # Interleaved rounds (direct, proxyjump, gateway, direct, ...): on a shared machine the load
        # changes from minute to minute, and each path gets the same share of it.
        seconds: dict[str, list[float]] = {name: [] for name in paths}
        connects: dict[str, list[float]] = {name: [] for name in paths}
        for command in paths.values():
            timed([*command, "true"])  # warm-up
        for _ in range(args.runs):
            for name, command in paths.items():
                seconds[name].append(timed([*command, f"cat {payload}"]))
        for _ in range(args.connects):
            for name, command in paths.items():
                connects[name].append(timed([*command, "true"]))
        throughput = {name: args.megabytes / min(values) for name, values in seconds.items()}
        median = {name: args.megabytes / statistics.median(values) for name, values in seconds.items()}
        latency = {name: statistics.median(values) * 1000 for name, values in connects.items()}
        for name in paths:
            print(f"  {name:10s} best {throughput[name]:7.1f} MB/s  median {median[name]:7.1f} MB/s   "
                  f"connect+true {latency[name]:7.1f} ms")
        ratio = throughput["gateway"] / throughput["proxyjump"]
        print(f"gateway/proxyjump throughput {ratio:.2f} (best; median "
              f"{median['gateway'] / median['proxyjump']:.2f}) (target >= 0.50: {'OK' if ratio >= 0.5 else 'MISS'}); "
              f"gateway/direct {throughput['gateway'] / throughput['direct']:.2f}; "
              f"proxyjump/direct {throughput['proxyjump'] / throughput['direct']:.2f}")
        print(f"connect latency: gateway {latency['gateway']:.1f} ms, proxyjump {latency['proxyjump']:.1f} ms, "
              f"direct {latency['direct']:.1f} ms (gateway/proxyjump {latency['gateway'] / latency['proxyjump']:.2f})")
        target.ssh(f"rm -f {payload}")
    finally:
        daemon.stop()
        jump.destroy()
        target.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
