"""The composition root: the one module that wires the API and the protocol proxies to the core."""

from __future__ import annotations

import asyncio
import logging
import signal

from gatewayd.config import Config
from gatewayd.daemon import Gateway, ListenerFactory
from gatewayd.scripts import ScriptRunner

log = logging.getLogger("gatewayd")


def listener_factories() -> dict[str, ListenerFactory]:
    """The start function of every protocol proxy present in this installation."""
    from proxies import available_listeners

    return available_listeners()


def script_runners() -> dict[str, ScriptRunner]:
    """The one-time script runner of every proxy that has one, by connection subtype."""
    from proxies import available_script_runners

    return available_script_runners()


def build_gateway(config: Config) -> Gateway:
    from control.app import make_app

    return Gateway(config, app_factory=make_app, listener_factories=listener_factories(),
                   script_runners=script_runners())


async def run(config: Config) -> None:
    """Run until SIGTERM or SIGINT, then stop in order."""
    gateway = build_gateway(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, gateway.request_stop)
    try:
        await gateway.start()
    except BaseException:
        await gateway.stop()
        raise
    try:
        await gateway.wait_stopped()
    finally:
        await gateway.stop()
