"""RDP proxy: pyrdp's man-in-the-middle on the daemon's loop, credentials injected, screens recorded as frames.

Needs the ``rdp`` extra (pyrdp's dependencies, Pillow) and pyrdp-mitm 2.1.0
installed without its pins (``make`` does both); ``available()`` tells without
importing pyrdp (which would install Twisted's default reactor).  Without them
the protocol still describes itself (its settings, its hints), as unavailable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gatewayd.config import Setting, positive
from gatewayd.languages import KEYSTROKES
from gatewayd.protocols import FRAMES, ClientCommand, ProtocolDescription, lazy_start
from proxies.rdp import compat

compat.apply()  # before anything imports pyrdp (Python 3.13 removed typing.io, which pyrdp imports)

if TYPE_CHECKING:
    from gatewayd.models import Connection

REQUIRED_MODULES = ("pyrdp", "rle", "twisted", "PIL", "spnego")



def access_hints(conn: Connection, secret: str, host: str, port: int, settings: dict[str, Any]) -> dict[str, str]:
    """An RDP client's words: the secret as user name and password."""
    return {"hostname": host, "port": str(port), "username": secret, "password": secret,
            "command": f"xfreerdp /v:{host}:{port} /u:{secret} /p:{secret}"}


DESCRIPTION = ProtocolDescription(
    name="rdp", subtype="rdp", session_type="custom", prefix="rdp", server_config_key="rdp_server_config",
    language=KEYSTROKES, title="RDP", presentation=FRAMES,
    client=ClientCommand(("xfreerdp",), ("/v:{hostname}:{port}", "/u:{username}", "/p:{password}")),
    default_port=13389, access_hints=access_hints,
    start=lazy_start("proxies.rdp.server"), required_modules=REQUIRED_MODULES,
    install_hint="RDP proxy unavailable: install the rdp extra (make does; by hand: pip install 'gatewayd[rdp]' "
                 "and pip install --no-deps pyrdp-mitm==2.1.0)",
    settings={"record_keyboard": Setting("bool", False),
              "frames_cap_bytes": Setting("int", 1024 * 1024 * 1024, positive),
              "frames_dir": Setting("str", ""),
              "startup_timeout": Setting("duration", "20s", positive)},
    check_settings=lambda settings: _check_settings(settings),
    connection_settings=("clipboard",),
)


def _check_settings(settings: dict[str, Any]) -> str | None:
    """``settings.rdp``: ``clipboard`` (a boolean: clipboard text passes, recorded)."""
    rdp = settings.get("rdp")
    if rdp is None:
        return None
    if not isinstance(rdp, dict):
        return "field 'settings.rdp': expected an object"
    if "clipboard" in rdp and not isinstance(rdp["clipboard"], bool):
        return "field 'settings.rdp.clipboard': expected true or false"
    return None


def clipboard_allowed(settings: dict[str, Any]) -> bool:
    """Whether the connection lets clipboard text pass (``settings.rdp.clipboard``; off by default)."""
    rdp = settings.get("rdp") if isinstance(settings, dict) else None
    return isinstance(rdp, dict) and rdp.get("clipboard") is True


def missing_modules() -> list[str]:
    """The modules of the ``rdp`` extra that are not installed."""
    return DESCRIPTION.missing_modules()


def available() -> bool:
    return DESCRIPTION.available()
