"""Instructions per small HTTP request of a whole ``gatewayd run`` under callgrind (every thread, user space).

A count that load on the machine does not move, for before/after comparisons of the HTTP data path. The
gateway runs under ``valgrind --tool=callgrind --instr-atstart=no`` in front of the test suite's target
app, with one credential and recording on (as ``bench_http.py``); a raw-socket client sends the same
``GET /json`` (wrk's shape: ``Host`` and ``Authorization`` only) one at a time over 4 keep-alive
connections. Counting is switched on after a warm-up, and two windows are dumped (400 and 2,000
requests); their difference over 1,600 is the figure, so start-up and dump costs cancel.

    .venv/bin/python bench/http/callgrind_http.py [--guardrails] [--pure] [--vary]

``--vary`` makes every request different (``GET /json?n=<counter>``), so nothing made of a request or an
answer before applies to the next: the figure for clients that do not repeat themselves. Needs valgrind. ``--pure`` runs the hot path from source (``GATEWAYD_PURE_PYTHON=1``).
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench" / "http")]

import bench_http  # noqa: E402

from tests.conftest import BIN, Daemon, free_port, wait_port  # noqa: E402

CONNECTIONS = 4


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--guardrails", action="store_true", help="attach bench_http's input and output rule")
    parser.add_argument("--pure", action="store_true", help="the hot path from source")
    parser.add_argument("--vary", action="store_true",
                        help="every request different (GET /json?n=<counter>): no two heads alike on a connection")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="gatewayd-callgrind-"))
    target_port = free_port()
    target = subprocess.Popen([sys.executable, "-m", "tests.httppeer", str(target_port)], cwd=ROOT,
                              stderr=subprocess.DEVNULL)
    http_port = free_port()
    daemon = Daemon(out / "data", {"listeners.http": f"127.0.0.1:{http_port}", "log.level": "warning",
                                   "sessions.recording_cap_bytes": 16 << 30})
    process = None
    try:
        wait_port(target_port, target)
        env = daemon.env()
        env["PYTHONPATH"] = str(ROOT)
        if args.pure:
            env["GATEWAYD_PURE_PYTHON"] = "1"
        process = subprocess.Popen(
            ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}/cg.%p",
             sys.executable, str(BIN / "gatewayd"), "run", "--config", str(daemon.config_path)],
            env=env, stdout=open(out / "log", "w"), stderr=subprocess.STDOUT, cwd=ROOT)
        daemon.process = process
        wait_port(daemon.api_port, process, "gatewayd", timeout=300)
        wait_port(http_port, process, "gatewayd", timeout=300)
        secret, _ = asyncio.run(bench_http.gateway_credential(daemon, f"http://127.0.0.1:{target_port}",
                                                              args.guardrails))
        after_path = f" HTTP/1.1\r\nHost: 127.0.0.1:{http_port}\r\nAuthorization: {secret}\r\n\r\n".encode()
        sockets = [socket.create_connection(("127.0.0.1", http_port)) for _ in range(CONNECTIONS)]
        sent = 0

        def exchange(sock: socket.socket) -> None:
            nonlocal sent
            sent += 1
            sock.sendall((b"GET /json?n=%d" % sent if args.vary else b"GET /json") + after_path)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = sock.recv(65536)
                if not chunk:
                    raise RuntimeError("the gateway closed the connection")
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"unexpected answer: {head[:200]!r}")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            while len(body) < length:
                chunk = sock.recv(65536)
                if not chunk:
                    raise RuntimeError("the gateway closed the connection in the middle of an answer")
                body += chunk

        def drive(count: int) -> None:
            for i in range(count):
                exchange(sockets[i % CONNECTIONS])

        def control(*flags: str) -> None:
            subprocess.run(["callgrind_control", *flags, str(process.pid)], check=True, capture_output=True)

        def window(count: int) -> int:
            control("-z")
            drive(count)
            control("-d")
            time.sleep(1)
            dump = max(glob.glob(f"{out}/cg.*"), key=os.path.getmtime)
            return max(int(line.split()[1]) for line in open(dump) if line.startswith(("summary:", "totals:")))

        drive(200)  # pools, caches, the credential's memo
        control("-i", "on")
        drive(100)
        small, large = window(400), window(2000)
        print(json.dumps({"instructions_per_request": round((large - small) / 1600), "guardrails": args.guardrails,
                          "pure": args.pure, "vary": args.vary, "dumps": str(out)}))
        return 0
    finally:
        if process is not None:
            process.terminate()
            process.wait(60)
        target.terminate()
        target.wait(10)


if __name__ == "__main__":
    sys.exit(main())
