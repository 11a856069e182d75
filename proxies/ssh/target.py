"""The gateway as an SSH client of the target: the role's settings and the connection.

``connect_target`` logs in with the role's ``USER`` and ``PASS`` or
``PRIVATE_KEY`` and verifies the target's key against ``HOST_KEY`` when it is
set. The password goes only to a target whose key is pinned (``HOST_KEY``):
without it a key login is made, and a password-only role is refused before
anything is dialed -- through an agent always, directly unless the role allows
it (``ALLOW_UNVERIFIED_PASSWORD``). A key login sends no secret (its signature
is bound to the session). Every failure is a ``TargetError`` whose message names the connection
and is safe to show the client: never the target's address, user, password
or key.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from dataclasses import dataclass
from typing import Any, Callable

import asyncssh

from gatewayd.dialer import DialError, Dialer, direct, through_agent
from gatewayd.models import flag, target_port

CONNECT_TIMEOUT = 15.0
SIGNAL_GRACE = 2.0  # after SIGTERM, how long a command the gateway ends may take to exit before SIGKILL
WINDOW = 8 << 20  # per-channel receive window, both sides of the gateway
MAX_PACKET = 32768  # OpenSSH's own channel packet size
# AES-GCM first: its AEAD runs in OpenSSL in one call per packet (the fastest asyncssh cipher here).
ENCRYPTION = ["aes128-gcm@openssh.com", "aes256-gcm@openssh.com", "chacha20-poly1305@openssh.com",
              "aes128-ctr", "aes192-ctr", "aes256-ctr"]


class TargetError(Exception):
    """The target could not be reached or refused the gateway; ``str()`` is client-safe."""


@dataclass(slots=True)
class TargetSettings:
    """Where and as whom the gateway logs in, decoded from a role's secret."""

    host: str
    port: int
    user: str
    password: str = ""
    private_key: str = ""
    host_key: str = ""
    unverified_password: bool = False  # a direct connection may log in with the password without HOST_KEY

    @classmethod
    def from_role(cls, target: dict[str, str]) -> TargetSettings:
        return cls(host=(target.get("HOST") or "").strip(), port=target_port(target, 22),
                   user=(target.get("USER") or "root").strip(), password=target.get("PASS") or "",
                   private_key=target.get("PRIVATE_KEY") or "", host_key=(target.get("HOST_KEY") or "").strip(),
                   unverified_password=flag(target.get("ALLOW_UNVERIFIED_PASSWORD")))

    def options(self, name: str, agent: bool = False) -> dict[str, Any]:
        """Keyword arguments of ``asyncssh.connect``; raises TargetError on unusable settings. ``agent``: the target
        is reached through an agent (the password goes only to a pinned host key, whatever the role allows)."""
        if not self.host:
            raise TargetError(f'connection "{name}" has no HOST')
        if not 0 < self.port < 65536:  # a typo is told, not replaced by 22
            raise TargetError(f'connection "{name}": its PORT is not a port number')
        password = self.password if self.host_key or (self.unverified_password and not agent) else ""
        if self.password and not password and not self.private_key:
            raise TargetError(
                f'connection "{name}": its password is sent only to a target whose key is pinned (HOST_KEY)'
                + ("" if agent else ", or where the connection allows it (ALLOW_UNVERIFIED_PASSWORD)"))
        options: dict[str, Any] = {
            "host": self.host, "port": self.port, "username": self.user, "agent_path": None,
            "client_keys": [], "password": password or None, "preferred_auth": "publickey,password",
            "known_hosts": None, "compression_algs": None, "encryption_algs": ENCRYPTION,
            "login_timeout": CONNECT_TIMEOUT, "config": [], "ignore_encrypted": True,
        }
        if self.private_key:
            try:
                options["client_keys"] = [asyncssh.import_private_key(self.private_key)]
            except (asyncssh.KeyImportError, ValueError):
                raise TargetError(f'connection "{name}": its PRIVATE_KEY is not a readable private key') from None
        if self.host_key:
            options["known_hosts"] = (_host_keys(self.host_key, name), [], [])
        if not self.private_key and not self.password:
            raise TargetError(f'connection "{name}" has neither PASS nor PRIVATE_KEY')
        return options


def _host_keys(text: str, name: str) -> list[asyncssh.SSHKey]:
    """``HOST_KEY``: public keys in OpenSSH format, one a line; known_hosts lines (host first) too."""
    keys = []
    for line in text.splitlines():
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if not fields[0].startswith(("ssh-", "ecdsa-", "sk-")) and len(fields) > 1:
            fields = fields[1:]  # a known_hosts line: drop the host pattern
        try:
            keys.append(asyncssh.import_public_key(" ".join(fields[:2])))
        except (asyncssh.KeyImportError, ValueError):
            raise TargetError(f'connection "{name}": its HOST_KEY is not a readable public key') from None
    if not keys:
        raise TargetError(f'connection "{name}": its HOST_KEY is empty')
    return keys


def signal_exit_code(name: str) -> int:
    """The exit code of a command the signal ``name`` (``TERM``) ended, as a shell tells it: 128 + its number."""
    number = getattr(signal.Signals, f"SIG{name}", None)
    return 128 + (number.value if number is not None else 0)


async def end_command(chan: asyncssh.SSHClientChannel[Any]) -> str | None:
    """End the command that runs without a pty on the target's session channel ``chan``, as the gateway ends its
    session (a kill, an expiry, a guard rail, the shutdown); what happened, for the recording (None: the command had
    ended by itself, its exit status came: nothing to signal).

    Closing the channel alone only closes the command's pipes (sshd sends a hangup with a pty only): the ``signal``
    request TERM (OpenSSH's sshd sends it to the command's process group), up to ``SIGNAL_GRACE`` for the channel to
    close, then KILL and the close (sshd handles the requests in order: the KILL lands before the close). A target
    that honours neither is closed as before, ``SIGNAL_GRACE`` later.
    """
    if chan.get_exit_status() is not None:
        chan.close()
        return None
    try:
        chan.send_signal("TERM")
    except OSError:  # the channel (or the whole connection) is gone already: nothing is left to signal
        chan.close()
        return "the command's channel on the target was already closed: no signal could be sent"
    try:
        async with asyncio.timeout(SIGNAL_GRACE):
            await chan.wait_closed()
        return "the gateway sent SIGTERM to the command on the target: it ended"
    except TimeoutError:
        with contextlib.suppress(OSError):  # lost meanwhile: the close below is all there is left to do
            chan.send_signal("KILL")
        chan.close()
        return (f"the command on the target did not end within {SIGNAL_GRACE:g} s of SIGTERM: the gateway sent "
                "SIGKILL and closed the channel")


async def connect_target(settings: TargetSettings, name: str, client_factory: Callable[[], asyncssh.SSHClient]
                         | None = None, dialer: Dialer = direct) -> asyncssh.SSHClientConnection:
    """Log in to the target of connection ``name`` over a socket from ``dialer``; ``client_factory`` watches it."""
    options = settings.options(name, through_agent(dialer))
    if client_factory is not None:
        options["client_factory"] = client_factory
    prefix = f'could not connect to the target of connection "{name}"'
    try:
        async with asyncio.timeout(CONNECT_TIMEOUT):
            sock = await dialer.open_socket(settings.host, settings.port, connection=name, timeout=CONNECT_TIMEOUT)
            try:
                return await asyncssh.connect(sock=sock, **options)
            except BaseException:
                sock.close()
                raise
    except DialError as exc:
        raise TargetError(exc.message) from None
    except asyncssh.HostKeyNotVerifiable:
        raise TargetError(f"{prefix}: its host key does not match the connection's HOST_KEY") from None
    except asyncssh.PermissionDenied:
        raise TargetError(f"{prefix}: the target refused the connection's credentials") from None
    except asyncssh.DisconnectError as exc:
        raise TargetError(f"{prefix}: {exc.reason or 'disconnected'}") from None
    except TimeoutError:
        raise TargetError(f"{prefix}: timed out") from None
    except ConnectionRefusedError:
        raise TargetError(f"{prefix}: connection refused") from None
    except OSError as exc:
        raise TargetError(f"{prefix}: {exc.strerror or type(exc).__name__}") from None
