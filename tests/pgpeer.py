"""A real PostgreSQL 15 cluster for tests and benchmarks: initdb in a temp dir, SCRAM, TLS, a free port.

As root, ``initdb`` runs as the ``postgres`` user (it refuses root) on a
directory that user owns; otherwise it runs as the current user.  The cluster
listens on 127.0.0.1 only and is stopped by ``stop()`` (``pg_ctl -m fast``).
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.ports import free_port

PG_BIN = Path(os.environ.get("GATEWAYD_PG_BIN", "/usr/lib/postgresql/15/bin"))
PASSWORD = "pg-target-secret-7"

# Extra roles and how pg_hba makes the target authenticate them (the default is SCRAM).
HBA_EXTRA = """\
host all md5user 127.0.0.1/32 md5
host all plainuser 127.0.0.1/32 password
"""



def unavailable_reason() -> str | None:
    """Why a cluster cannot be started here, or None."""
    if not (PG_BIN / "initdb").exists():
        return f"PostgreSQL server binaries not found in {PG_BIN} (install postgresql, see test-peers.md)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no 'postgres' user to run initdb as"
    return None


class PgCluster:
    """One throw-away PostgreSQL cluster."""

    def __init__(self, password: str = PASSWORD, tls: bool = True) -> None:
        self.password = password
        self.tls = tls
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="gatewayd-pg-"))
        self.data = self.dir / "data"
        self._as_postgres = os.geteuid() == 0

    def _run(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        command = [*(["runuser", "-u", "postgres", "--"] if self._as_postgres else []), *args]
        return subprocess.run(command, capture_output=True, text=True, check=check, timeout=timeout,
                              env={**os.environ, "LC_ALL": "C.UTF-8"})

    def start(self) -> PgCluster:
        pwfile = self.dir / "pwfile"
        pwfile.write_text(self.password + "\n")
        if self._as_postgres:
            entry = pwd.getpwnam("postgres")
            for path in (self.dir, pwfile):
                os.chown(path, entry.pw_uid, entry.pw_gid)
        from proxies.postgres.tls import generate_self_signed

        generate_self_signed(self.dir / "server.crt", self.dir / "server.key", "pg-target")  # for ssl = on
        if self._as_postgres:
            for path in (self.dir / "server.crt", self.dir / "server.key"):
                os.chown(path, entry.pw_uid, entry.pw_gid)
        self._run(str(PG_BIN / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth-host=scram-sha-256",
                  "--auth-local=scram-sha-256", f"--pwfile={pwfile}", "-E", "UTF8", "--no-sync")
        hba = self.data / "pg_hba.conf"
        hba.write_text(HBA_EXTRA + hba.read_text())
        self.ctl_start()
        return self

    def ctl_start(self) -> None:
        options = (f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.dir} -c fsync=off "
                   "-c synchronous_commit=off -c full_page_writes=off -c max_connections=100 "
                   f"-c ssl={'on' if self.tls else 'off'} -c ssl_cert_file={self.dir / 'server.crt'} "
                   f"-c ssl_key_file={self.dir / 'server.key'}")
        result = self._run(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-l", str(self.dir / "log"), "-w",
                           "-o", options, "start", check=False)
        if result.returncode != 0:
            log = (self.dir / "log").read_text() if (self.dir / "log").exists() else ""
            raise RuntimeError(f"pg_ctl start failed: {result.stderr}\n{log}")

    def stop(self, mode: str = "fast") -> None:
        self._run(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop", check=False)

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def root_cert(self) -> str:
        """The cluster's certificate (self-signed, for 127.0.0.1 and localhost), what a role's SSLROOTCERT trusts."""
        return (self.dir / "server.crt").read_text()

    def dsn(self, user: str = "postgres", password: str | None = None, database: str = "postgres") -> str:
        return f"postgresql://{user}:{password or self.password}@127.0.0.1:{self.port}/{database}"

    def env(self) -> dict[str, str]:
        """Environment for libpq tools connecting directly as postgres."""
        return {**os.environ, "PGHOST": "127.0.0.1", "PGPORT": str(self.port), "PGUSER": "postgres",
                "PGPASSWORD": self.password, "PGDATABASE": "postgres"}


async def wait_for_backends(dsn: str, query: str, running: bool, attempts: int = 200) -> None:
    """Until the target has (``running``) or has no longer a backend whose current query is ``query``,
    checked every 50 ms; AssertionError after ``attempts`` checks (10 s by default)."""
    import asyncio

    import asyncpg

    connection = await asyncpg.connect(dsn)
    try:
        for _ in range(attempts):
            count = await connection.fetchval("select count(*) from pg_stat_activity where query = $1 "
                                              "and state = 'active'", query)
            if bool(count) == running:
                return
            await asyncio.sleep(0.05)
    finally:
        await connection.close()
    raise AssertionError(f"the target {'never ran' if running else 'still runs'} {query!r}")
