"""SSH proxy: asyncssh on both sides, shells and execs observed line by line (``lines``), SFTP and scp recorded."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gatewayd.config import Setting
from gatewayd.languages import SHELL_COMMANDS
from gatewayd.protocols import TERMINAL, ClientCommand, ProtocolDescription, lazy_script_runner, lazy_start

if TYPE_CHECKING:
    from gatewayd.models import Connection




def access_hints(conn: Connection, secret: str, host: str, port: int, settings: dict[str, Any]) -> dict[str, str]:
    """ssh's words: the secret is the user name (and the password, for clients that ask for one)."""
    return {"hostname": host, "port": str(port), "username": secret, "password": secret,
            "command": f"ssh -p {port} {secret}@{host}"}


DESCRIPTION = ProtocolDescription(
    name="ssh", subtype="ssh", session_type="custom", prefix="ssh", server_config_key="ssh_server_config",
    language=SHELL_COMMANDS, title="SSH", presentation=TERMINAL,
    # ssh(1) reads [options] destination [command]: the user's options go before the destination. The secret,
    # its user name, in a configuration file of its own (its first User wins; the user's and the system's
    # configuration follow), not in the process list
    client=ClientCommand(("ssh",), ("-F", "{file_config}", "-p", "{port}", "{hostname}"),
                         options_with_value="BbcDEeFIiJLlmOoPpQRSWw",  # its options that take an argument
                         files=(("config", "Host *\n  User {username}\nInclude ~/.ssh/config /etc/ssh/ssh_config\n"),)),
    compiled=("proxies.ssh.lines", "proxies.ssh.datapath", "proxies.ssh.gcm"),
    default_port=12222, access_hints=access_hints,
    start=lazy_start("proxies.ssh.server"),
    load_script_runner=lazy_script_runner("proxies.ssh.script"),
    settings={"hosts_key": Setting("str", "", secret=True),
              "ciphers": Setting("list", ["aes128-gcm@openssh.com", "aes256-gcm@openssh.com"])},
    forward_serve=lambda sock, secret: _forward_serve(sock, secret),
    connection_settings=("allow_port_forwarding",),
)


async def _forward_serve(sock: Any, secret: str) -> None:
    from proxies.ssh.server import serve_forwarded

    await serve_forwarded(sock, secret)
