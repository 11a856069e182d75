"""Twisted's reactor on the daemon's asyncio loop (pyrdp runs on Twisted).

The reactor is one per process: the first RDP listener installs Twisted's
asyncio reactor on the running loop and starts it without a loop of its own;
later listeners reuse it. Nothing may import ``twisted.internet.reactor``
(pyrdp does, at import) before ``ensure_reactor`` ran.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any


class ReactorError(RuntimeError):
    """Twisted's reactor cannot run on this loop."""


def ensure_reactor() -> Any:
    """The running reactor, bound to the running asyncio loop."""
    loop = asyncio.get_running_loop()
    if "twisted.internet.reactor" not in sys.modules:
        from twisted.internet import asyncioreactor

        asyncioreactor.install(loop)
    from twisted.internet import reactor

    if getattr(reactor, "_asyncioEventloop", None) is not loop:
        raise ReactorError("Twisted's reactor was installed before the RDP proxy and is not on the daemon's "
                           "event loop (was pyrdp imported early?)")
    if not reactor.running:
        reactor.startRunning(installSignalHandlers=False)
    return reactor
