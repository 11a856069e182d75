"""HTTP proxy benchmark: wrk direct, through nginx (reverse proxy) and through gatewayd, side by side.

Targets (from the issue), with recording on in the gateway:

- a small JSON endpoint: at least 0.5 of nginx's requests per second;
- a 1 MB download: at least 0.8 of nginx's throughput.

Everything is started here on free ports: the aiohttp target app of the test
suite (``tests/httppeer.py``, uvloop, one process), nginx with one worker
proxying to it over pooled keep-alive connections (a temporary prefix), and a
real ``gatewayd run`` subprocess with the http listener, one credential and
recording on. ``wrk`` drives each endpoint in turn. It is a benchmark, not a
test: it exits 0 whether the targets are met or not, non-zero only when it
could not measure (a missing tool, or a gateway session that recorded nothing).

    .venv/bin/python bench/http/bench_http.py [--seconds 5] [--rounds 3] [--connections 32] [--guardrails]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import aiohttp

from tests.conftest import Daemon, free_port, wait_port

DOWNLOAD = 1024 * 1024


class Nginx:
    """nginx as a plain reverse proxy (one worker, keep-alive upstream pool) in a temporary prefix."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="gatewayd-nginx-"))
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> "Nginx":
        d = self.dir
        user = "user root;\n" if os.geteuid() == 0 else ""
        (d / "nginx.conf").write_text(
            f"{user}worker_processes 1;\npid {d}/nginx.pid;\nerror_log {d}/error.log;\n"
            "events { worker_connections 4096; }\n"
            "http {\n  access_log off;\n"
            f"  client_body_temp_path {d}/body; proxy_temp_path {d}/proxy; fastcgi_temp_path {d}/fcgi;\n"
            f"  uwsgi_temp_path {d}/uwsgi; scgi_temp_path {d}/scgi;\n"
            f"  upstream target {{ server 127.0.0.1:{self.target_port}; keepalive 64; }}\n"
            f"  server {{\n    listen 127.0.0.1:{self.port};\n"
            "    location / {\n      proxy_pass http://target;\n      proxy_http_version 1.1;\n"
            "      proxy_set_header Connection \"\";\n      proxy_set_header Host $host;\n"
            "      proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;\n"
            "      proxy_set_header X-Forwarded-Proto $scheme;\n    }\n  }\n}\n")
        self.process = subprocess.Popen(["nginx", "-p", str(d), "-c", str(d / "nginx.conf"), "-g", "daemon off;"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port)
        return self

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def wrk(url: str, seconds: int, connections: int, header: str | None = None) -> tuple[float, float]:
    """(requests per second, MB per second) of one wrk run."""
    command = ["wrk", "-t", "1", "-c", str(connections), "-d", f"{seconds}s", "--latency"]
    if header:
        command += ["-H", header]
    out = subprocess.run([*command, url], capture_output=True, text=True, timeout=seconds * 4 + 60).stdout
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    transfer = re.search(r"Transfer/sec:\s+([\d.]+)(\w+)", out)
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)|Socket errors: .*", out)
    if rps is None or transfer is None:
        raise RuntimeError(f"wrk printed no figures:\n{out}")
    if errors:
        raise RuntimeError(f"wrk saw errors:\n{out}")
    unit = {"B": 1 / 1e6, "KB": 1 / 1024, "MB": 1, "GB": 1024}[transfer.group(2)]
    return float(rps.group(1)), float(transfer.group(1)) * unit


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its direct children (nginx's worker)."""
    ticks = os.sysconf("SC_CLK_TCK")
    pids = [pid]
    try:
        pids += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        pass
    total = 0.0
    for each in pids:
        try:
            fields = Path(f"/proc/{each}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks
    return total


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


async def gateway_credential(daemon: Daemon, target: str, guardrails: bool) -> tuple[str, str]:
    """(secret, session id) of a credential for an httpproxy role on the target."""
    token = daemon.token("bench@example.com", groups="admin")
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as http:
        async def call(method: str, path: str, body: object) -> dict:
            async with http.request(method, daemon.url + path, json=body) as response:
                answer = await response.json()
                if response.status >= 300:
                    raise RuntimeError(f"{method} {path}: {response.status} {answer}")
                return answer

        connection = await call("POST", "/connections", {"name": "bench-web", "type": "httpproxy",
                                                         "subtype": "httpproxy",
                                                         "secret": {"envvar:REMOTE_URL": b64(target)}})
        if guardrails:
            await call("POST", "/guardrails", {
                "name": "bench-rails", "connection_ids": [connection["id"]],
                "input": {"rules": [{"type": "deny_words_list", "words": ["drop table", "rm -rf"]}]},
                "output": {"rules": [{"type": "pattern_match", "pattern_regex": r"\b\d{3}-\d{2}-\d{4}\b"}]}})
        issued = await call("POST", "/connections/bench-web/credentials", {"access_duration_seconds": 3600})
        return issued["connection_credentials"]["proxy_token"], issued["session_id"]


async def recorded(daemon: Daemon, session_id: str) -> tuple[str, int]:
    """(status, bytes recorded) of the benchmark's session: proof the gateway column ran with recording on."""
    token = daemon.token("bench@example.com", groups="admin")
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as http:
        for _ in range(50):  # the recorder flushes every sessions.flush_interval
            async with http.get(f"{daemon.url}/sessions/{session_id}") as response:
                session = await response.json()
            if session.get("event_size"):
                break
            await asyncio.sleep(0.1)
        return session.get("status", "?"), int(session.get("event_size") or 0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved runs per column; the median is shown")
    parser.add_argument("--guardrails", action="store_true", help="attach an input and an output rule")
    args = parser.parse_args()
    missing = [tool for tool in ("wrk", "nginx") if shutil.which(tool) is None]
    if missing:
        print(f"cannot run: {', '.join(missing)} not installed (apt-get install {' '.join(missing)})",
              file=sys.stderr)
        return 2

    target_port = free_port()
    target = subprocess.Popen([sys.executable, "-m", "tests.httppeer", str(target_port)], cwd=ROOT,
                              stderr=subprocess.DEVNULL)  # wrk cutting connections at the end is noise
    nginx = Nginx(target_port)
    http_port = free_port()
    daemon = Daemon(Path(tempfile.mkdtemp(prefix="gatewayd-bench-http-")) / "data",
                    {"listeners.http": f"127.0.0.1:{http_port}", "log.level": "warning",
                     # recording stays on for the whole run (the default 64 MiB cap would end it early)
                     "sessions.recording_cap_bytes": 16 << 30})
    try:
        wait_port(target_port)
        nginx.start()
        daemon.start()
        wait_port(http_port)
        secret, session_id = asyncio.run(gateway_credential(daemon, f"http://127.0.0.1:{target_port}",
                                                            args.guardrails))
        print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
        print(f"wrk -t1 -c{args.connections} -d{args.seconds}s, median of {args.rounds} interleaved rounds; "
              f"gateway: recording on"
              f"{', 2 guard rails' if args.guardrails else ''}\n")
        endpoints = {
            "direct": (f"http://127.0.0.1:{target_port}", None),
            "nginx": (f"http://127.0.0.1:{nginx.port}", None),
            "gateway": (f"http://127.0.0.1:{http_port}", f"Authorization: {secret}"),
        }
        assert nginx.process is not None and daemon.process is not None
        proxies = {"nginx": nginx.process.pid, "gateway": daemon.process.pid}
        cpu: dict[tuple[str, str], list[float]] = {}
        paths = {"small JSON": "/json", "1 MB download": f"/download?size={DOWNLOAD}"}
        results: dict[tuple[str, str], tuple[float, float]] = {}
        for label, path in paths.items():
            runs: dict[str, list[tuple[float, float]]] = {name: [] for name in endpoints}
            for name, (base, header) in endpoints.items():
                wrk(base + path, 1, args.connections, header)  # warm-up (pools, caches)
            for _ in range(args.rounds):  # interleaved, so a burst of load elsewhere hits all three alike
                for name, (base, header) in endpoints.items():
                    before = cpu_seconds(proxies[name]) if name in proxies else 0.0
                    figures = wrk(base + path, args.seconds, args.connections, header)
                    runs[name].append(figures)
                    if name in proxies:  # the proxy's own CPU per request: load elsewhere barely moves it
                        spent = cpu_seconds(proxies[name]) - before
                        cpu.setdefault((label, name), []).append(spent * 1e6 / (figures[0] * args.seconds))
            for name, figures in runs.items():
                results[(label, name)] = sorted(figures)[len(figures) // 2]  # the median run
        print(f"{'endpoint':<16}{'direct':>16}{'nginx':>16}{'gateway':>16}{'gw/nginx':>10}{'target':>8}  verdict")
        ok = True
        for label, unit, index, goal in (("small JSON", "req/s", 0, 0.5), ("1 MB download", "MB/s", 1, 0.8)):
            row = [results[(label, name)][index] for name in endpoints]
            ratio = row[2] / row[1] if row[1] else 0.0
            verdict = "PASS" if ratio >= goal else "MISS"
            ok &= ratio >= goal
            print(f"{label:<16}" + "".join(f"{value:>10.1f} {unit:<5}" for value in row)
                  + f"{ratio:>10.2f}{goal:>8.2f}  {verdict}")
        print()
        for label in paths:
            nginx_us, gateway_us = (sorted(cpu[(label, n)])[len(cpu[(label, n)]) // 2] for n in proxies)
            print(f"CPU per request, {label}: nginx {nginx_us:.0f} us, gateway {gateway_us:.0f} us "
                  "(the proxy process alone; the gateway's includes its recording thread)")
        # the data-path issue's targets: CPU per small request at most twice nginx's, the download at 0.9 of it
        small_cpu = [sorted(cpu[("small JSON", n)])[len(cpu[("small JSON", n)]) // 2] for n in proxies]
        cpu_ratio = small_cpu[1] / small_cpu[0] if small_cpu[0] else 0.0
        download = results[("1 MB download", "gateway")][1] / (results[("1 MB download", "nginx")][1] or 1)
        print(f"data path: CPU per small request gateway/nginx {cpu_ratio:.2f} (target <= 2.0) "
              f"{'PASS' if cpu_ratio <= 2.0 else 'MISS'}; 1 MB download gateway/nginx {download:.2f} "
              f"(target >= 0.9) {'PASS' if download >= 0.9 else 'MISS'}")
        small = results[("small JSON", "gateway")][0] / results[("small JSON", "direct")][0]
        big = results[("1 MB download", "gateway")][1] / results[("1 MB download", "direct")][1]
        print(f"(gw/direct: small JSON {small:.2f}, 1 MB download {big:.2f})")
        status, size = asyncio.run(recorded(daemon, session_id))
        print(f"recorded session: {session_id} ({status}, {size / 1e6:.1f} MB of events recorded)")
        if not size or status != "open":
            print("the gateway's session recorded nothing or was closed: these figures are not valid",
                  file=sys.stderr)
            return 3
        print("all targets met" if ok else "some targets missed")
        return 0
    finally:
        daemon.stop()
        nginx.stop()
        target.terminate()
        target.wait(10)


if __name__ == "__main__":
    sys.exit(main())
