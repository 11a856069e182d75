"""Shared fixtures: a real ``gatewayd run`` subprocess and tokens minted by the real CLI.

The host commands (``Daemon.cli``: tokens, local users, status) run the command's own ``main`` in a process
forked from one that has done its imports already (``gatewayd_command``, tests/clizygote.py): the same
program, without a second of start-up per call. tests/test_host_cli.py runs the command as a new process.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import pytest

import proxies  # noqa: F401  the test run's composition root: registers every protocol, as launcher.cli does
from gatewayd.hotpath import PURE_ENV
from tests.ports import free_port


def pytest_configure(config: pytest.Config) -> None:
    """The suite is a gate: its generated tests draw the same examples at every run (derandomized, no example
    database), so a run fails for a change, not for a draw. HYPOTHESIS_PROFILE=explore searches at random, as a
    longer run would. (Here, not at import: the benchmarks import this module's helpers without hypothesis.)"""
    from hypothesis import settings

    settings.register_profile("suite", derandomize=True)
    settings.register_profile("explore", derandomize=False)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))
    terminal_signals()


def terminal_signals() -> None:
    """Ctrl-C and Ctrl-\\ as a terminal delivers them, to this process and the commands the tests start.

    A shell starts a background job without job control (``make test &``, a CI runner's ``cmd &``) with SIGINT
    and SIGQUIT ignored, and an ignored signal stays ignored across fork and exec: a ``gatewayd`` command a
    test interrupts with SIGINT then never saw it (the people's CLI tests ran on for 60 s in such a run, with
    SigIgn 0x...06 in /proc). Handled signals are reset at exec, so the defaults here reach every command."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGQUIT) is signal.SIG_IGN:
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)


ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent



def accepts(port: int) -> bool:
    """Whether 127.0.0.1:``port`` accepts a connection now."""
    with socket.socket() as sock:
        sock.settimeout(5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def wait_port(port: int, process: subprocess.Popen[bytes] | None = None, what: str = "something",
              timeout: float = 20, interval: float = 0.05, host: str = "127.0.0.1") -> None:
    """Block until ``host``:``port`` accepts; RuntimeError if ``process`` exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}")
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(interval)
    raise RuntimeError(f"{what} is not listening on {port}")


class _CommandZygote:
    """tests/clizygote.py, started on first use and stopped when the test process exits."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.process: subprocess.Popen[bytes] | None = None
        self.dir = ""

    def socket_path(self) -> str:
        with self.lock:
            if self.process is None or self.process.poll() is not None:
                self.dir = tempfile.mkdtemp(prefix="gatewayd-cli-")
                env = self.environment()
                self.process = subprocess.Popen([sys.executable, "-m", "tests.clizygote", f"{self.dir}/sock"],
                                                cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                if self.process.stdout.readline() != b"ready\n":  # type: ignore[union-attr]
                    raise RuntimeError(f"tests.clizygote did not start ({self.process.wait(10)})")
                atexit.register(self.stop)
            return f"{self.dir}/sock"

    @staticmethod
    def environment() -> dict[str, str]:
        """The zygote's own environment, as ``Daemon.env`` passes it on (no GATEWAYD_* but GATEWAYD_PURE_PYTHON)."""
        return {k: v for k, v in os.environ.items() if not k.startswith("GATEWAYD_") or k == PURE_ENV}

    @staticmethod
    def serves(env: dict[str, str]) -> bool:
        """Whether a command with ``env`` imports what the zygote imported: the hot path is chosen at import
        (compiled, or from source with GATEWAYD_PURE_PYTHON), so a command asking otherwise runs as a process."""
        return env.get(PURE_ENV) == _CommandZygote.environment().get(PURE_ENV)

    def stop(self) -> None:
        if self.process is not None:
            self.process.stdin.close()  # type: ignore[union-attr]
            self.process.wait(10)
            shutil.rmtree(self.dir, ignore_errors=True)
            self.process = None


_ZYGOTE = _CommandZygote()


def gatewayd_command(argv: list[str], env: dict[str, str], input: str | None = None, check: bool = True,
                     timeout: float = 60, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(argv, capture_output=True, text=True, ...)`` for a ``gatewayd`` host command, ~1 s faster.

    The command's ``launcher.cli.main`` runs in a child forked from tests/clizygote.py, which has done the
    imports a new process would do (most of that second); argv, environment, working directory, stdin,
    stdout, stderr and exit status are the command's own. ``TESTS_CLI_FORK=0`` runs a real process instead, and
    so does a command whose environment asks for another hot path than the zygote's (``_CommandZygote.serves``).
    """
    if os.environ.get("TESTS_CLI_FORK") == "0" or not _ZYGOTE.serves(env):
        return subprocess.run(argv, env=env, capture_output=True, text=True, input=input, check=check,
                              timeout=timeout, cwd=cwd)
    with tempfile.TemporaryDirectory(prefix="gatewayd-call-") as scratch:
        stdin = os.devnull
        if input is not None:
            stdin = f"{scratch}/stdin"
            Path(stdin).write_text(input)
        out, err = Path(scratch, "stdout"), Path(scratch, "stderr")
        out.touch()
        err.touch()
        request = {"argv": argv, "env": env, "cwd": str(cwd), "stdin": stdin, "stdout": str(out), "stderr": str(err)}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(timeout)
            conn.connect(_ZYGOTE.socket_path())
            conn.sendall(json.dumps(request).encode() + b"\n")
            answers = conn.makefile("r")
            pid = 0
            try:
                for line in answers:
                    word, _, value = line.partition(" ")
                    if word == "pid":
                        pid = int(value)
                    elif word == "exit":
                        returncode = int(value)
                        break
                else:  # the child died without answering: killed by a signal
                    returncode = -1
            except TimeoutError:
                if pid:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                raise subprocess.TimeoutExpired(argv, timeout, out.read_text(errors="replace"),
                                                err.read_text(errors="replace")) from None
        done = subprocess.CompletedProcess(argv, returncode, out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))
    if check:
        done.check_returncode()
    return done


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_config(path: Path, settings: dict[str, Any]) -> Path:
    """A TOML file from dotted keys, e.g. ``{"auth.oidc.client_id": "x"}``."""
    tables: dict[str, dict[str, Any]] = {}
    for key, value in settings.items():
        table, _, name = key.rpartition(".")
        tables.setdefault(table, {})[name] = value
    lines = [f"{k} = {toml_value(v)}" for k, v in tables.pop("", {}).items()]
    for table, values in tables.items():
        lines.append(f"\n[{table}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


class Daemon:
    """``gatewayd run`` as a subprocess on free ports, with its own data dir."""

    def __init__(self, data_dir: Path, settings: dict[str, Any] | None = None) -> None:
        self.data_dir = data_dir
        self.api_port = free_port()
        self.settings = {
            "data_dir": str(data_dir),
            "api.listen": f"127.0.0.1:{self.api_port}",
            "log.format": "json",
            "sessions.shutdown_grace": "1s",
            # no proxy is bound unless a test asks for it
            "listeners.postgres": "", "listeners.ssh": "", "listeners.rdp": "", "listeners.http": "", "listeners.mysql": "",
            "metrics.listen": "",  # no Prometheus listener on its fixed default port either
            "daemon.workers": 1,  # one process, as the tests expect (tests/test_workers.py runs several)
            "grpc.listen": "",  # nor a gRPC server for agents
            **(settings or {}),
        }
        self.config_path = write_config(data_dir.parent / f"{data_dir.name}.toml", self.settings)
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir.parent / f"{data_dir.name}.log"
        self.extra_env: dict[str, str] = {}  # more environment for the process (e.g. GATEWAYD_PURE_PYTHON)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}/api"

    def env(self) -> dict[str, str]:
        # GATEWAYD_PURE_PYTHON passes: `GATEWAYD_PURE_PYTHON=1 make test` runs every daemon from source
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAYD_") or k == PURE_ENV}
        env["GATEWAYD_CONFIG"] = str(self.config_path)
        return {**env, **self.extra_env}

    def start(self, timeout: float = 20) -> "Daemon":
        self._until_the_api_port_is_free()
        self.log = open(self.log_path, "ab")
        self.process = subprocess.Popen([str(BIN / "gatewayd"), "run", "--config", str(self.config_path)],
                                        stdout=self.log, stderr=subprocess.STDOUT, env=self.env(), cwd=ROOT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"gatewayd exited with {self.process.returncode}:\n{self.log_text()}")
            try:
                with socket.create_connection(("127.0.0.1", self.api_port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"gatewayd did not start:\n{self.log_text()}")

    def _until_the_api_port_is_free(self, timeout: float = 15) -> None:
        """A restart waits until no process of an earlier run listens on the API port: one SIGKILLed is gone only
        once the kernel has ended it, and until then a connection to it would pass for the new run's start."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.api_port), timeout=0.2):
                    pass
            except OSError:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"something still listens on the API port {self.api_port} after {timeout:g} s")
            time.sleep(0.05)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:  # killed, not left behind; the failure shows where it stood
            self.process.kill()
            self.process.wait()
            self.process = None
            self.log.close()
            raise AssertionError(f"gatewayd did not stop within {timeout:g} s of signal {sig}; its log ends:\n"
                                 + "\n".join(self.log_text().splitlines()[-40:])) from None
        self.process = None
        self.log.close()
        return code

    def cli(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``gatewayd ARGS --config …`` on this daemon's store (run by ``gatewayd_command``)."""
        return gatewayd_command([str(BIN / "gatewayd"), *args, "--config", str(self.config_path)], env=self.env(),
                                input=input, check=check, timeout=60)

    def token(self, email: str, groups: str | None = None, name: str | None = None, ttl: str | None = None) -> str:
        args = ["token", "create", "--email", email]
        if groups is not None:
            args += ["--groups", groups]
        if name:
            args += ["--name", name]
        if ttl:
            args += ["--ttl", ttl]
        return self.cli(*args).stdout.strip()


HOT_PATH_RUNS = {"as built": {}, "from source": {PURE_ENV: "1"}}  # a daemon's environment for each


def hot_path_logged(daemon: Daemon, env: dict[str, str]) -> None:
    """The daemon started with ``env`` logged the hot path it runs, and it is the one ``env`` asks for
    (else the daemon is stopped and AssertionError raised)."""
    from gatewayd import hotpath

    pure = bool(env.get(PURE_ENV)) or hotpath.pure_wanted()
    kinds = dict.fromkeys(hotpath.modules(), hotpath.runs(pure))  # the modules run one way, together
    deadline = time.monotonic() + 60  # the API answers before the listeners are up and the line is written
    while not (started := [json.loads(line) for line in daemon.log_text().splitlines()
                           if '"gatewayd started"' in line]) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert started, daemon.log_text()
        logged = started[-1]["hot_path"]
        if "=" in logged:  # the modules it loaded run differently: the log names each
            assert all(kinds[name] == kind for name, _, kind in (item.partition("=") for item in logged.split(", ")))
        else:  # those it loaded (a daemon without an HTTP listener loads no HTTP module) all run this way
            assert logged in set(kinds.values()), started[-1]
    except AssertionError:
        daemon.stop()  # a module fixture that fails here never reaches its teardown: not left running
        raise


def proxy_daemon(tmp_path_factory: pytest.TempPathFactory, name: str, listener: str,
                 settings: dict[str, Any] | None = None, wait: bool = False,
                 env: dict[str, str] | None = None) -> Daemon:
    """A started daemon whose ``listener`` proxy is on a free port (``daemon.proxy_port``), flushing every 100ms.

    ``wait``: also wait until the proxy's port accepts, not only the API's.  ``env``: more environment.
    """
    port = free_port()
    daemon = Daemon(tmp_path_factory.mktemp(name) / "data", {
        f"listeners.{listener}": f"127.0.0.1:{port}",
        "sessions.flush_interval": "100ms",
        **(settings or {}),
    })
    daemon.extra_env.update(env or {})
    daemon.start()
    daemon.proxy_port = port
    if wait:
        wait_port(port, daemon.process, "gatewayd")
    return daemon


@contextlib.asynccontextmanager
async def core_gateway(tmp_path: Path, settings: dict[str, Any] | None = None) -> AsyncIterator[Any]:
    """The core services of a Gateway in process (store, recording; no listeners), closed at the end.

    ``settings``: more configuration (``store_settings`` gives the store's)."""
    from gatewayd.config import load_config
    from gatewayd.daemon import Gateway

    gateway = Gateway(load_config(None, environ={}, overrides={
        "data_dir": str(tmp_path / "data"), "sessions.flush_interval": "100ms", **(settings or {})}))
    await gateway.open_core()
    try:
        await gateway.recording.start()
        try:
            yield gateway
        finally:
            await gateway.recording.stop()
    finally:
        await gateway.close_core()


async def issued_in_core(core: Any, name: str, kind: str, env: dict[str, str], email: str = "ann@example.com") -> Any:
    """A ``kind`` connection (``httpproxy``, or a ``custom`` subtype: ``ssh``, ``rdp``...) made in ``core``'s store
    with ``env`` as its secret, and a credential of an admin ``email`` for it (``AccessService.issue``'s answer)."""
    import base64

    from gatewayd.models import Connection, new_id, rfc3339, utcnow

    org = await core.store.default_org()
    user = await core.identity.ensure_local_user(email, email.split("@")[0].title(), ["admin"])
    now = rfc3339(utcnow())
    connection = Connection(id=new_id(), org_id=org.id, name=name, resource_name=name,
                            type="httpproxy" if kind == "httpproxy" else "custom", subtype=kind,
                            secret={f"envvar:{k}": base64.b64encode(v.encode()).decode() for k, v in env.items()},
                            created_at=now, updated_at=now)
    await core.store.create_connection(connection)
    return await core.access.issue(user, connection, 600)


@pytest.fixture(scope="session")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One real daemon for the API suites (session-scoped: started once)."""
    gw = Daemon(tmp_path_factory.mktemp("daemon") / "data").start()
    yield gw
    gw.stop()


@pytest.fixture(scope="session")
def admin_token(daemon: Daemon) -> str:
    return daemon.token("admin@example.com", groups="admin", name="Ada Admin")


@pytest.fixture(scope="session")
def user_token(daemon: Daemon) -> str:
    return daemon.token("user@example.com", groups="", name="Uma User")


@pytest.fixture(scope="session")
def auditor_token(daemon: Daemon) -> str:
    return daemon.token("auditor@example.com", groups="auditor", name="Audrey Auditor")


@pytest.fixture(scope="session")
def rdp_peers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The RDP desktop, shadow servers and observer of tests/rdppeer.py, started once for every module using them.

    Missing peers fail the run as root (scripts/install-peers.sh installs them) and skip otherwise.
    """
    from tests.rdppeer import start_peers, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        if os.geteuid() == 0 and "pyrdp-mitm" not in reason:
            pytest.fail(reason)
        pytest.skip(reason)
    found = start_peers(tmp_path_factory.mktemp("rdp-peers"))
    yield found
    found.stop()


@pytest.fixture(scope="session")
def pg_target() -> Iterator[Any]:
    """A PostgreSQL 15 cluster (tests/pgpeer.py) shared by the modules that only need one."""
    from tests.pgpeer import PgCluster

    cluster = PgCluster().start()
    yield cluster
    cluster.destroy()


@pytest.fixture(scope="session")
def pg_store() -> Iterator[Any]:
    """A PostgreSQL 15 cluster for the gateway's own store (not a target): tests make a database each in it.

    Missing server binaries fail the run as root (scripts/install-peers.sh installs them) and skip otherwise."""
    from tests.pgpeer import PgCluster, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        if os.geteuid() == 0:
            pytest.fail(reason)
        pytest.skip(reason)
    cluster = PgCluster(tls=False).start()
    yield cluster
    cluster.destroy()


@pytest.fixture(params=["sqlite", "postgres"])
async def store_settings(request) -> dict[str, Any]:
    """The configuration of each store backend: the embedded SQLite, or a fresh database of ``pg_store``."""
    if request.param == "sqlite":
        return {"store.driver": "sqlite"}
    return {"store.driver": "postgres", "store.url": await new_store_database(request.getfixturevalue("pg_store"))}


async def new_store_database(cluster: Any, options: str = "") -> str:
    """A fresh, empty database in ``cluster`` (CREATE DATABASE from template0: cheap); its URL.

    ``options``: more of CREATE DATABASE (a locale)."""
    import asyncpg

    import uuid

    name = f"gw_{uuid.uuid4().hex}"
    conn = await asyncpg.connect(cluster.dsn())
    try:
        await conn.execute(f'CREATE DATABASE "{name}" TEMPLATE template0 {options}')
    finally:
        await conn.close()
    return cluster.dsn(database=name)


def new_store_database_now(cluster: Any, options: str = "") -> str:
    """``new_store_database`` for a synchronous fixture: run in a thread of its own, so it works also when the
    fixture is first asked for by an async test (``request.getfixturevalue``), whose loop is running here."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, new_store_database(cluster, options)).result()


@pytest.fixture(scope="session")
def ssh_target() -> Iterator[Any]:
    """An OpenSSH sshd (tests/sshpeer.py) shared by the modules that only need one.

    It needs root (a dedicated OS user): the run fails without it as root, and skips otherwise."""
    from tests.sshpeer import SshTarget, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        if os.geteuid() == 0:
            pytest.fail(reason)
        pytest.skip(reason)
    peer = SshTarget().start()
    yield peer
    peer.destroy()


@pytest.fixture(scope="session")
def http_target() -> Iterator[str]:
    """The URL of the aiohttp target app (tests/httppeer.py) shared by the modules that only need one."""
    from tests.test_http_proxy import start_target

    process, port = start_target()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(10)


@pytest.fixture(scope="session")
def mysql_target() -> Iterator[Any]:
    """A MariaDB server (tests/mypeer.py) shared by the modules that need one.

    Missing server binaries fail the run as root (scripts/install-peers.sh installs them) and skip otherwise."""
    from tests.mypeer import MariaDB, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        if os.geteuid() == 0:
            pytest.fail(reason)
        pytest.skip(reason)
    server = MariaDB().start()
    yield server
    server.destroy()
