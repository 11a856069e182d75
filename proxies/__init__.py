"""Protocol proxies: one package per protocol, each with a pure codec and a thin asyncio server.

Each package declares its ``ProtocolDescription`` (gatewayd.protocols); importing
this package registers them, one line per protocol.  The core, the API and the
configuration know the protocols only through the registry.
"""

from __future__ import annotations

import logging
from typing import Any

from gatewayd.protocols import register, registered
from proxies import http, mysql, postgres, rdp, ssh

register(postgres.DESCRIPTION)
register(ssh.DESCRIPTION)
register(rdp.DESCRIPTION)
register(http.DESCRIPTION)
register(mysql.DESCRIPTION)


def available_listeners() -> dict[str, Any]:
    """The listener factory of every registered protocol whose modules are installed, by listener name."""
    listeners = {}
    for description in registered():
        if description.available():
            listeners[description.name] = description.start
        else:
            logging.getLogger(f"gatewayd.{description.name}").warning(
                description.install_hint or f"{description.name} proxy unavailable: modules missing",
                extra={"missing": ", ".join(description.missing_modules())})
    return listeners


def available_script_runners() -> dict[str, Any]:
    """One-time script runners (``gatewayd.scripts.ScriptRunner``) by connection subtype."""
    runners = {}
    for description in registered():
        if description.load_script_runner is not None and description.available():
            runners[description.subtype] = description.script_runner()
    return runners
