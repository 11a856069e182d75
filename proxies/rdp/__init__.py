"""RDP proxy: pyrdp's man-in-the-middle on the daemon's loop, credentials injected, screens recorded as frames.

Needs the ``rdp`` extra (pyrdp's dependencies, Pillow) and pyrdp-mitm 2.1.0
installed without its pins (``make`` does both); ``available()`` tells without
importing pyrdp (which would install Twisted's default reactor).
"""

from __future__ import annotations

import importlib.util

from proxies.rdp import compat

compat.apply()  # before anything imports pyrdp (Python 3.13 removed typing.io, which pyrdp imports)

REQUIRED_MODULES = ("pyrdp", "rle", "twisted", "PIL")


def missing_modules() -> list[str]:
    """The modules of the ``rdp`` extra that are not installed."""
    return [name for name in REQUIRED_MODULES if importlib.util.find_spec(name) is None]


def available() -> bool:
    return not missing_modules()
