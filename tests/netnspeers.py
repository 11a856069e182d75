"""Real targets inside a network namespace: ``ip netns exec NS python -m tests.netnspeers OUT.json``.

Starts a PostgreSQL cluster (tests/pgpeer.py), an OpenSSH sshd (tests/sshpeer.py) and the aiohttp
target app (tests/httppeer.py), each on the namespace's own 127.0.0.1, which nothing outside
the namespace can reach. Writes what the tests need to OUT.json, then waits until its standard
input closes and stops them all.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, free_port, wait_port
from tests.pgpeer import PgCluster
from tests.sshpeer import SshTarget


def main(out: Path) -> None:
    pg = PgCluster().start()
    ssh = SshTarget().start()
    http_port = free_port()
    http = subprocess.Popen([sys.executable, "-m", "tests.httppeer", str(http_port)], cwd=ROOT)
    try:
        wait_port(http_port, http, "the HTTP target")
        temporary = out.with_suffix(".tmp")
        temporary.write_text(json.dumps({
            "pg_port": pg.port, "pg_password": pg.password, "pg_root_cert": pg.root_cert(), "ssh_port": ssh.port, "ssh_user": ssh.user,
            "ssh_key": ssh.private_key_text, "ssh_host_key": ssh.host_public_key, "http_port": http_port}))
        temporary.rename(out)
        sys.stdin.read()  # until the test closes our standard input
    finally:
        http.terminate()
        http.wait(10)
        ssh.destroy()
        pg.destroy()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
