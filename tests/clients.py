"""The real clients the suite drives, one helper each: how a test starts psql against a gateway's port.

A test module says only what differs (its flags, its statements); the environment (no PG* variable of the
machine leaks in, a gateway credential as the user, any password, no TLS unless asked), the timeouts and
the capture are decided here once.
"""

from __future__ import annotations

import os
import subprocess
from typing import Any


def psql_env(port: int, secret: str, *, database: str = "postgres", sslmode: str = "disable",
             user: str | None = None, password: str | None = None, **more: str) -> dict[str, str]:
    """psql's environment for a credential on ``port``: the machine's own PG* variables left out."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env.update(PGHOST="127.0.0.1", PGPORT=str(port), PGUSER=user or secret, PGDATABASE=database,
               PGSSLMODE=sslmode, PGPASSWORD=password or "any", PGCONNECT_TIMEOUT="10")
    env.update(more)
    return env


def psql(port: int, secret: str, *args: str | bytes, stdin: str | bytes | None = None, timeout: float = 60,
         text: bool = True, env: dict[str, str] | None = None, **settings: Any) -> subprocess.CompletedProcess[Any]:
    """``psql -X ARGS`` as ``secret`` on ``port`` (``settings``: psql_env's), never raising on its exit status."""
    return subprocess.run(["psql", "-X", *args], capture_output=True, text=text, input=stdin, timeout=timeout,
                          env={**psql_env(port, secret, **settings), **(env or {})}, check=False)


def ssh(port: int, secret: str, *args: str, tty: bool = False, stdin: bytes | None = None, timeout: float = 60,
        text: bool = False, options: list[str] | None = None) -> subprocess.CompletedProcess[Any]:
    """OpenSSH ``ssh`` as ``secret`` (the user name: no prompt) to the gateway's SSH port, running ``args``;
    without ``stdin`` its input is empty. ``options``: instead of the suite's client options."""
    from tests.sshpeer import CLIENT_OPTIONS

    command = ["ssh", *(CLIENT_OPTIONS if options is None else options), *(["-tt"] if tty else []), "-p", str(port),
               f"{secret}@127.0.0.1", *args]
    return subprocess.run(command, input=stdin, capture_output=True, timeout=timeout, text=text, check=False,
                          stdin=None if stdin is not None else subprocess.DEVNULL)


def curl(*args: str, stdin: Any = None, timeout: float = 300, text: bool = False) -> subprocess.CompletedProcess[Any]:
    """``curl -sS ARGS``, never raising on its exit status."""
    return subprocess.run(["curl", "-sS", *args], stdin=stdin, capture_output=True, timeout=timeout, text=text,
                          check=False)
