"""``gatewayd run`` with ``[daemon] workers`` above 1: one supervisor process and N gateway workers.

The supervisor does, once, what every start would otherwise race to do on the shared store (migrations, the
generated keys, closing what a dead earlier run of its name left open: ``Gateway.prepare``), then starts the
workers (each a node of its own for gatewayd.cluster, ``<name>/w<i>``):
fresh interpreters running ``gatewayd run`` with ``GATEWAYD_WORKER_INDEX`` set, each a whole gateway on its
own event loop whose listeners (the API, metrics and every protocol) bind with SO_REUSEPORT, so the kernel
spreads the connections over them.  It speaks sd_notify to systemd for the whole group: each worker's
``NOTIFY_SOCKET`` is the supervisor's own socket, which tells the senders apart by their credentials (pid), and
``READY=1`` goes up once every worker said it.  A worker that dies is restarted with a back-off; one that dies
before it is ready on the first start, or too many times in a row afterwards, stops the whole group with an
error exit.  SIGTERM/SIGINT stop every worker gracefully (their own shutdown grace) and wait for them; SIGHUP
reloads the supervisor's log settings and is passed on to each worker.  Metrics: a fresh
``PROMETHEUS_MULTIPROC_DIR`` per run, and ``gatewayd.metrics.process_exited`` for each worker gone.
docs/workers.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import struct
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from gatewayd import balance, logs, metrics
from gatewayd.config import WORKER_INDEX_VARIABLE, Config, ConfigError, split_listen
from gatewayd.daemon import sd_notify
from gatewayd.services import listen_addresses
from gatewayd.tasks import BackgroundTasks
from launcher.root import STOP_MARGIN, build_gateway, reload_config

log = logging.getLogger("gatewayd.supervisor")

START_FAILURES = 5  # a worker that dies before it is ready this many times in a row stops the group
_UCRED = struct.Struct("iII")  # SCM_CREDENTIALS: pid, uid, gid


def worker_index() -> int | None:
    """This process's worker index when a supervisor started it, else None."""
    value = os.environ.get(WORKER_INDEX_VARIABLE)
    if value is None:
        return None
    if not value.isdigit():
        raise ConfigError(f"environment variable {WORKER_INDEX_VARIABLE}: expected a worker number, got {value!r}")
    return int(value)


def become_worker(index: int) -> None:
    """Set up a worker process: every log line names it, and it stops (SIGTERM) when its supervisor dies."""
    logs.WORKER = index
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the supervisor died before the line above: nothing would stop this worker
        raise SystemExit(1)


def supervise(config: Config, count: int, config_path: str | None) -> int:
    """Run ``count`` workers until SIGTERM or SIGINT; the exit status of the group."""
    from gatewayd.cli import run_loop

    command = [sys.executable, "-m", "launcher", "run"] + (["--config", config_path] if config_path else [])
    return run_loop(Supervisor(config, count, command).run())


async def prepare(config: Config, count: int) -> None:
    """Migrate the store and make its keys once, close what a dead run left open (``Gateway.prepare``).

    ConfigError for a port 0: each worker would bind a port of its own."""
    gateway = build_gateway(config)
    try:
        await gateway.open_core()
        await gateway.prepare()
        addresses = listen_addresses(gateway.server_config)
    finally:
        await gateway.close_core()
    wanted = {"api.listen": config["api.listen"], "metrics.listen": config["metrics.listen"]}
    for name, address in addresses.items():
        key = f"listeners.{name}"
        wanted[key if config.get(key) == address else f"{name} listen_address (PUT /api/serverconfig/misc)"] = address
    for key, address in wanted.items():
        if address and split_listen(address)[1] == 0:
            raise ConfigError(f"{key}: port 0 cannot be shared by {count} workers (each would get a port of its "
                              "own): name a port, or set [daemon] workers = 1")


@dataclass(slots=True)
class Worker:
    """One worker slot: the process now filling it, whether it said READY=1, its failed starts in a row."""

    index: int
    process: asyncio.subprocess.Process | None = None
    ready: bool = False
    failures: int = 0
    started: float = 0.0
    restart: asyncio.TimerHandle | None = field(default=None, repr=False)


class Supervisor:
    """Starts, watches, restarts and stops the workers of one ``gatewayd run``."""

    def __init__(self, config: Config, count: int, command: list[str]) -> None:
        self.config = config
        self.command = command
        self.workers = [Worker(index) for index in range(count)]
        self.events: asyncio.Queue[tuple[str, Worker | None, int]] = asyncio.Queue()
        self.by_pid: dict[int, Worker] = {}
        self.watchers = BackgroundTasks("supervisor")  # one task a worker process, until it exits
        self.notify: socket.socket | None = None
        self.run_dir: Path | None = None
        self.stopping = False  # a stop signal came (``_on_stop_signal``) or the group is stopping

    async def run(self) -> int:
        await prepare(self.config, len(self.workers))
        with tempfile.TemporaryDirectory(prefix="gatewayd-run-") as run_dir:
            self.run_dir = Path(run_dir)
            metrics_dir = self.run_dir / "metrics"
            metrics_dir.mkdir()
            os.environ[metrics.MULTIPROC_ENV] = str(metrics_dir)  # the workers inherit it; process_exited reads it
            balance.prepare(self.run_dir / "balance", len(self.workers))
            os.environ[balance.DIRECTORY_ENV] = str(self.run_dir / "balance")  # the workers' loads and sockets
            loop = asyncio.get_running_loop()
            self.notify = self._notify_socket(self.run_dir / "notify.sock")
            loop.add_reader(self.notify.fileno(), self._on_notify)
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._on_stop_signal)
            loop.add_signal_handler(signal.SIGHUP, self._reload)
            log.info("gatewayd supervisor started", extra={"workers": len(self.workers), "supervisor_pid": os.getpid()})
            try:
                return await self._supervise()
            finally:
                for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                    loop.remove_signal_handler(sig)
                loop.remove_reader(self.notify.fileno())
                self.notify.close()

    @staticmethod
    def _notify_socket(path: Path) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)  # each datagram says which pid sent it
        sock.bind(str(path))
        sock.setblocking(False)
        return sock

    def _on_notify(self) -> None:
        """sd_notify datagrams from the workers: READY=1 marks the sender's slot ready."""
        assert self.notify is not None
        while True:
            try:
                data, ancillary, _, _ = self.notify.recvmsg(4096, socket.CMSG_SPACE(_UCRED.size))
            except (BlockingIOError, InterruptedError):
                return
            pid = 0
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(payload) >= _UCRED.size:
                    pid = _UCRED.unpack_from(payload)[0]
            worker = self.by_pid.get(pid)
            if worker is not None and b"READY=1" in data.split(b"\n"):
                self.events.put_nowait(("ready", worker, pid))

    def _on_stop_signal(self) -> None:
        """SIGTERM / SIGINT: stop the group. Again while stopping: passed on, so each worker closes its sessions
        without the rest of their grace (the workers are in a process group of their own: a terminal's Ctrl-C
        reaches the supervisor alone, which passes each stop on once)."""
        if not self.stopping:
            self.stopping = True
            self.events.put_nowait(("stop", None, 0))
            return
        log.warning("stop signal again: passed on to the workers, which close their sessions now")
        for worker in self.workers:
            if worker.process is not None and worker.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.process.send_signal(signal.SIGTERM)

    def _reload(self) -> None:
        reload_config(self.config)
        for worker in self.workers:
            if worker.process is not None and worker.process.returncode is None:
                worker.process.send_signal(signal.SIGHUP)

    async def _spawn(self, worker: Worker) -> None:
        assert self.run_dir is not None
        worker.restart = None
        env = dict(os.environ)
        env[WORKER_INDEX_VARIABLE] = str(worker.index)
        env["NOTIFY_SOCKET"] = str(self.run_dir / "notify.sock")
        process = await asyncio.create_subprocess_exec(*self.command, env=env, stdin=asyncio.subprocess.DEVNULL,
                                                       start_new_session=True)  # signals come from the supervisor only
        worker.process, worker.ready, worker.started = process, False, time.monotonic()
        self.by_pid[process.pid] = worker
        log.info("worker started", extra={"worker": worker.index, "pid": process.pid})
        self.watchers.spawn(self._watch(worker, process))

    async def _watch(self, worker: Worker, process: asyncio.subprocess.Process) -> None:
        await process.wait()
        self.events.put_nowait(("exited", worker, process.pid))

    async def _supervise(self) -> int:
        for worker in self.workers:
            await self._spawn(worker)
        announced = False
        while True:
            kind, worker, pid = await self.events.get()
            if kind == "stop":
                return await self._stop_all(0)
            assert worker is not None
            if kind == "restart":
                await self._spawn(worker)
            elif kind == "ready" and worker.process is not None and worker.process.pid == pid:
                worker.ready, worker.failures = True, 0
                log.info("worker ready", extra={"worker": worker.index, "pid": pid})
                if not announced and all(w.ready for w in self.workers):
                    announced = True
                    sd_notify("READY=1")
                    log.info("gatewayd workers ready", extra={
                        "workers": len(self.workers), "pids": ",".join(str(w.process.pid) for w in self.workers
                                                                       if w.process is not None)})
            elif kind == "exited":
                code = await self._exited(worker, pid, announced)
                if code is not None:
                    return code

    async def _exited(self, worker: Worker, pid: int, announced: bool) -> int | None:
        """A worker process ended on its own: restart it later, or the group's exit status when it must stop."""
        self.by_pid.pop(pid, None)
        metrics.process_exited(pid)
        process, was_ready = worker.process, worker.ready
        worker.process, worker.ready = None, False
        returncode = process.returncode if process is not None and process.returncode is not None else 1
        how = {"exit_code": returncode} if returncode >= 0 else {"signal": signal.Signals(-returncode).name}
        status = returncode if returncode > 0 else 1  # a worker killed by a signal, or one that gave up
        if not announced:  # the first start: the same configuration would fail the same way again
            log.error("worker failed to start; stopping", extra={"worker": worker.index, "pid": pid, **how})
            return await self._stop_all(status)
        if not was_ready:
            worker.failures += 1
        if worker.failures >= START_FAILURES:
            log.error("worker keeps failing to start; stopping",
                      extra={"worker": worker.index, "pid": pid, "failures": worker.failures, **how})
            return await self._stop_all(status)
        delay = min(30.0, self.config["daemon.restart_delay"] * 2 ** worker.failures)
        log.error("worker exited; restarting it", extra={"worker": worker.index, "pid": pid, "restart_in": delay,
                                                         "uptime": round(time.monotonic() - worker.started, 1),
                                                         **how})
        worker.restart = asyncio.get_running_loop().call_later(delay, self.events.put_nowait,
                                                               ("restart", worker, 0))
        return None

    async def _stop_all(self, status: int) -> int:
        """SIGTERM every worker, wait for their graceful stop (SIGKILL past grace + margin); ``status``."""
        self.stopping = True
        sd_notify("STOPPING=1")
        log.info("gatewayd supervisor stopping")
        live = []
        for worker in self.workers:
            if worker.restart is not None:
                worker.restart.cancel()
            if worker.process is not None and worker.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.process.send_signal(signal.SIGTERM)
                live.append(worker.process)
        if live:
            waiting = asyncio.gather(*(p.wait() for p in live))
            try:
                async with asyncio.timeout(self.config["sessions.shutdown_grace"] + STOP_MARGIN):
                    await asyncio.shield(waiting)
            except TimeoutError:
                for process in live:
                    if process.returncode is None:
                        log.error("worker did not stop in time; killing it", extra={"pid": process.pid})
                        with contextlib.suppress(ProcessLookupError):
                            process.kill()
                await waiting
        for process in live:
            metrics.process_exited(process.pid)
        await self.watchers.wait()
        log.info("gatewayd supervisor stopped", extra={"exit_code": status})
        return status
