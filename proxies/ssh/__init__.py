"""SSH proxy: asyncssh on both sides, shells and execs observed line by line (``lines``), SFTP and scp recorded."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gatewayd.config import Setting
from gatewayd.protocols import ProtocolDescription

if TYPE_CHECKING:
    from gatewayd.pipeline import ProxyContext
    from gatewayd.models import Connection
    from gatewayd.scripts import ScriptRunner


async def _start(context: ProxyContext, host: str, port: int) -> Any:
    from proxies.ssh.server import start

    return await start(context, host, port)


def _script_runner() -> ScriptRunner:
    from proxies.ssh.script import run_script

    return run_script


def access_hints(conn: Connection, secret: str, host: str, port: int, settings: dict[str, Any]) -> dict[str, str]:
    """ssh's words: the secret is the user name (and the password, for clients that ask for one)."""
    return {"hostname": host, "port": str(port), "username": secret, "password": secret,
            "command": f"ssh -p {port} {secret}@{host}"}


DESCRIPTION = ProtocolDescription(
    name="ssh", subtype="ssh", session_type="custom", prefix="ssh", server_config_key="ssh_server_config",
    default_port=12222, access_hints=access_hints, start=_start, load_script_runner=_script_runner,
    settings={"hosts_key": Setting("str", ""),
              "ciphers": Setting("list", ["aes128-gcm@openssh.com", "aes256-gcm@openssh.com"])},
)
