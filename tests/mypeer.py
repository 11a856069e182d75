"""A real MariaDB (Debian's ``mariadb-server``) for tests and benchmarks: a private datadir, TLS, a free port.

``mariadb-install-db`` makes the datadir (owned by the ``mysql`` user when
root), ``mariadbd`` serves it on 127.0.0.1 only with a self-signed
certificate, and the users are set up over its socket: ``root`` and ``app``
(``mysql_native_password``) with ``PASSWORD``, and a database ``app``.
``stop()`` ends the server by its pid.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from tests.ports import free_port

PASSWORD = "my-target-secret-7"
MARIADBD = shutil.which("mariadbd") or "/usr/sbin/mariadbd"
INSTALL_DB = shutil.which("mariadb-install-db") or "/usr/bin/mariadb-install-db"
CLIENT = shutil.which("mariadb") or "/usr/bin/mariadb"
CONNECTOR_J = Path("/usr/share/java/mariadb-java-client.jar")


def unavailable_reason() -> str | None:
    """Why a server cannot be started here, or None."""
    if not Path(MARIADBD).exists() or not Path(INSTALL_DB).exists():
        return "MariaDB server not installed (apt-get install mariadb-server mariadb-client, see test-peers.md)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("mysql")
        except KeyError:
            return "running as root and there is no 'mysql' user to run mariadbd as"
    return None


class MariaDB:
    """One throw-away MariaDB server."""

    def __init__(self, password: str = PASSWORD) -> None:
        self.password = password
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="gatewayd-my-"))
        self.data = self.dir / "data"
        self.socket = self.dir / "sock"
        self.process: subprocess.Popen[bytes] | None = None
        self.version = ""

    def _own(self, *paths: Path) -> None:
        if os.geteuid() == 0:
            entry = pwd.getpwnam("mysql")
            for path in paths:
                os.chown(path, entry.pw_uid, entry.pw_gid)

    def start(self) -> MariaDB:
        from gatewayd.tls import generate_self_signed

        generate_self_signed(self.dir / "server.crt", self.dir / "server.key", "my-target")
        self._own(self.dir, self.dir / "server.crt", self.dir / "server.key")
        user = ["--user=mysql"] if os.geteuid() == 0 else []
        subprocess.run([INSTALL_DB, f"--datadir={self.data}", *user, "--auth-root-authentication-method=normal",
                        "--skip-test-db", "--skip-name-resolve"], check=True, capture_output=True, timeout=120)
        self.process = subprocess.Popen(
            [MARIADBD, "--no-defaults", f"--datadir={self.data}", f"--port={self.port}", f"--socket={self.socket}",
             "--bind-address=127.0.0.1", *user, f"--pid-file={self.dir / 'pid'}", f"--log-error={self.dir / 'log'}",
             "--skip-log-bin", "--innodb-buffer-pool-size=16M", "--innodb-log-file-size=8M", "--skip-name-resolve",
             f"--ssl-cert={self.dir / 'server.crt'}", f"--ssl-key={self.dir / 'server.key'}", "--max-connections=200",
             "--max-allowed-packet=256M", "--local-infile=1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not self.socket.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                log = (self.dir / "log").read_text() if (self.dir / "log").exists() else ""
                raise RuntimeError(f"mariadbd did not start\n{log}")
            time.sleep(0.05)
        self.sql(f"ALTER USER root@localhost IDENTIFIED BY '{self.password}';"
                 "CREATE USER IF NOT EXISTS root@'127.0.0.1';"
                 f"ALTER USER root@'127.0.0.1' IDENTIFIED BY '{self.password}';"
                 "GRANT ALL ON *.* TO root@'127.0.0.1' WITH GRANT OPTION;"
                 "CREATE DATABASE app; CREATE DATABASE other;"
                 f"CREATE USER app@'127.0.0.1' IDENTIFIED BY '{self.password}';"
                 "GRANT ALL ON app.* TO app@'127.0.0.1'; GRANT ALL ON other.* TO app@'127.0.0.1';",
                 password="")
        self.version = self.sql("SELECT VERSION()").strip()
        return self

    def sql(self, statements: str, database: str = "", password: str | None = None) -> str:
        """Run ``statements`` as root over the socket; their output (tab-separated, no headers)."""
        secret = self.password if password is None else password
        result = subprocess.run([CLIENT, "--no-defaults", f"--socket={self.socket}", "-uroot",
                                 *([f"-p{secret}"] if secret else []), "-N", "-B", "-e", statements,
                                 *([database] if database else [])],
                                capture_output=True, text=True, timeout=60, check=False)
        if result.returncode != 0:
            raise RuntimeError(result.stderr)
        return result.stdout

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def root_cert(self) -> str:
        return (self.dir / "server.crt").read_text()
