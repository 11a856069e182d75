"""The composition root: the one module that wires the API and the protocol proxies to the core.

It lives outside the core package (``gatewayd`` imports neither ``proxies`` nor
``control``; tests/test_layers.py keeps it so).  Importing ``proxies``
registers every protocol's description (gatewayd.protocols); the gateway gets
the listener factory and script runner of each one that is installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
from typing import Iterator

import proxies
from control.app import make_app
from gatewayd import logs
from gatewayd.config import Config, ConfigError, load_config
from gatewayd.daemon import Gateway, ListenerFactory
from gatewayd.scripts import ScriptRunner

log = logging.getLogger("gatewayd")

STOP_MARGIN = 30.0  # seconds past the sessions' shutdown grace a stop gets to flush and close (then it exits: 1)
STOP_OVERDUE_EXIT = 1


def listener_factories() -> dict[str, ListenerFactory]:
    """The start function of every registered protocol proxy present in this installation."""
    return proxies.available_listeners()


def script_runners() -> dict[str, ScriptRunner]:
    """The one-time script runner of every proxy that has one, by connection subtype."""
    return proxies.available_script_runners()


def build_gateway(config: Config, worker_index: int | None = None) -> Gateway:
    """The gateway with the API and every installed proxy; ``worker_index``: a supervisor's worker (None: alone)."""
    return Gateway(config, app_factory=make_app, listener_factories=listener_factories(),
                   script_runners=script_runners(), worker_index=worker_index)


RELOADABLE = ("log.format", "log.level")


def reload_config(config: Config) -> None:
    """SIGHUP: read the configuration again and apply what is safe to change live (the log settings).

    Everything else needs a restart; a changed key is named in the log, a bad file is logged and ignored
    (the daemon keeps running on what it has).
    """
    try:
        fresh = load_config(config.source)
    except ConfigError as exc:
        log.error("configuration not reloaded", extra={"reason": str(exc)})
        return
    logs.configure(fresh["log.format"], fresh["log.level"])
    old, new = config.as_dict(), fresh.as_dict()
    pending = sorted(key for key in new if key not in RELOADABLE and new[key] != old.get(key))
    # a warning, so that it shows whatever level was just set
    log.warning("configuration reloaded", extra={"applied": ",".join(RELOADABLE),
                                                 "restart_needed_for": ",".join(pending) or "-"})


@contextlib.contextmanager
def stop_watchdog(limit: float) -> Iterator[None]:
    """A stop still running after ``limit`` seconds (a close that hangs, a blocked event loop) ends the process
    with status 1 and an error in the log, as the supervisor ends a worker that does not stop. A thread: it
    fires even when the event loop is blocked."""
    timer = threading.Timer(limit, _stop_overdue, (limit,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _stop_overdue(limit: float) -> None:
    log.error("gatewayd did not stop in time: exiting now", extra={"limit_s": limit})
    for handler in logging.getLogger().handlers + log.handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    os._exit(STOP_OVERDUE_EXIT)


async def run(config: Config, worker_index: int | None = None) -> None:
    """Run until SIGTERM or SIGINT, then stop in order, within the sessions' grace and ``STOP_MARGIN``
    (``stop_watchdog``); a second SIGTERM or SIGINT closes the sessions without the rest of their grace. SIGHUP
    reloads the log settings."""
    gateway = build_gateway(config, worker_index)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, gateway.request_stop)
    loop.add_signal_handler(signal.SIGHUP, reload_config, config)
    limit = config["sessions.shutdown_grace"] + STOP_MARGIN
    try:
        await gateway.start()
    except BaseException:
        with stop_watchdog(limit):
            await gateway.stop()
        raise
    try:
        await gateway.wait_stopped()
    finally:
        with stop_watchdog(limit):
            await gateway.stop()
