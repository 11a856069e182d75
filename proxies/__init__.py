"""Protocol proxies: one package per protocol, each with a pure codec and a thin asyncio server.

``available_listeners`` maps a listener name (postgres, ssh, rdp, http) to the
start function of the proxies present in this installation.
"""

from __future__ import annotations

import logging
from typing import Any


def available_listeners() -> dict[str, Any]:
    from proxies.http.server import start as start_http
    from proxies.postgres.server import start as start_postgres
    from proxies.ssh.server import start as start_ssh

    listeners = {"postgres": start_postgres, "http": start_http, "ssh": start_ssh}
    from proxies import rdp

    if rdp.available():
        from proxies.rdp.server import start as start_rdp

        listeners["rdp"] = start_rdp
    else:
        logging.getLogger("gatewayd.rdp").warning(
            "RDP proxy unavailable: install the rdp extra (make does; by hand: pip install 'gatewayd[rdp]' "
            "and pip install --no-deps pyrdp-mitm==2.1.0)",
            extra={"missing": ", ".join(rdp.missing_modules())})
    return listeners


def available_script_runners() -> dict[str, Any]:
    """One-time script runners (``gatewayd.scripts.ScriptRunner``) by connection subtype."""
    from proxies.postgres.script import run_script as run_postgres
    from proxies.ssh.script import run_script as run_ssh

    return {"postgres": run_postgres, "ssh": run_ssh}
