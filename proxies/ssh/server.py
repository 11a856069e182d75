"""The SSH listener: an asyncssh server for clients, an asyncssh client to the target, the core in between.

One ``GatewayConnection`` per client SSH connection:

1. the credential -- the SSH user name is the secret (no prompt), or any user
   name with the secret as the password; the session pipeline admits it,
   refusals look like a wrong password (the pipeline audits them);
2. the target -- while the client finishes authenticating, the pipeline dials
   the target with ``target.connect_target`` (the role's settings), then opens
   the session; a failure is told on the client's first channel (stderr,
   exit 254), the pipeline having closed the session with an ``e`` event;
3. channels -- each ``session`` channel (exec, shell with or without pty,
   the ``sftp`` subsystem) is mirrored by a channel to the target
   (``SessionRelay``), what passes reported to the session's policy chain
   (guard rails, recording, audit of blocks; under a mask rule, stdout and
   stderr held to their line ends and masked, file downloads refused);
   ``direct-tcpip`` (``ssh -L``) is relayed when the connection's
   ``settings.ssh.allow_port_forwarding`` is true and the connection has no
   rules that would have to read it, and refused otherwise (``ForwardRelay``); agent and X11 forwarding
   (``refuse_forwarding_requests``) are refused, and so are remote forwarding (``ssh -R``) and forwarding to a
   unix socket, with an ``e`` event and an audit entry;
4. the end -- the session is closed when the client goes away (even while
   the target login is still running), with the last exit status; once a
   connection carries more than one session channel (OpenSSH multiplexing),
   each channel's end is an ``e`` event naming what it ran; a kill or the
   credential's expiry tells every channel why on stderr and closes the
   connection.  A channel the gateway ends (a kill, an expiry, the shutdown,
   an output rule) whose command runs without a pty is signalled before its
   close (``target.end_command``: TERM, a bounded grace, KILL), as closing it
   would only close the command's pipes; one with a pty gets sshd's hangup.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import logging
import re
import shlex
import socket
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Coroutine, Mapping, Sequence

import asyncssh
from asyncssh.misc import map_handler_name

from gatewayd import balance, metrics
from gatewayd.access import looks_like_secret
from gatewayd.audit import REDACTED
from gatewayd.guardrails import AUDIT_INPUT_CHARS, GuardVerdict
from gatewayd.logs import scrub
from gatewayd.masking import LineHold
from gatewayd.pipeline import (
    BLOCKED_EXIT_CODE,
    AccessDenied,
    GatewayClosing,
    ProxyContext,
    SessionPipeline,
    SessionRun,
    TargetUnreachable,
)
from gatewayd.tasks import BackgroundTasks, Withdrawable, until_empty
from proxies.ssh import gcm
from proxies.ssh.lines import Chunk, Line, OutputWatch, ShellInput, download, stdin_protocol
from proxies.ssh.packets import as_the_gateway_relays_it, as_the_gateway_runs_it
from proxies.ssh.sftp import SftpObserver, Unreadable, status_packet
from proxies.ssh.target import (
    ENCRYPTION,
    MAX_PACKET,
    WINDOW,
    TargetError,
    TargetSettings,
    connect_target,
    end_command,
    signal_exit_code,
)

if TYPE_CHECKING:
    from gatewayd.access import AccessGrant
    from gatewayd.dialer import Dialer
    from gatewayd.policy import SessionPolicy

log = logging.getLogger("gatewayd.ssh")

STDERR = asyncssh.EXTENDED_DATA_STDERR
LOGIN_TIMEOUT = 60.0
CLOSE_GRACE = 5.0  # after a kill, how long channels may take to flush the message before the disconnect
HOLD_IDLE = 5.0  # under a mask rule, an unfinished output line waits this long for more (exec, no pty)
HOLD_IDLE_PTY = 0.1  # the same with a pty: echoed keystrokes and prompts must show at once


INTERRUPT = b"\x03"  # ^C, the terminal's interrupt key
HOLDING_READ_CAP = 64 * 1024  # with a pty, what a user may type ahead while a line waits for its verdict
LINE_CANCELLED = "the line was cancelled with Ctrl-C while it waited for its verdict: it did not run"
FORWARD_UNREADABLE = ("has guard rails, mask rules or an analysis, and a forwarded stream cannot be checked, masked or "
                      "recorded")
UNMASKABLE_DOWNLOAD = "a file download cannot be masked: refused under this connection's mask rules"
UNREADABLE_DOWNLOAD = ("a file download that may be compressed cannot be checked: refused under this connection's "
                       "output rules")
_SECRET_NAME = re.compile(r"PASS|PWD|SECRET|TOKEN|KEY|CRED|AUTH|COOKIE", re.IGNORECASE)  # an env value not recorded


def allows_port_forwarding(settings: dict[str, Any]) -> bool:
    """The per-connection switch for ``ssh -L``: ``settings.ssh.allow_port_forwarding`` (default false)."""
    ssh = settings.get("ssh") if isinstance(settings, dict) else None
    return isinstance(ssh, dict) and ssh.get("allow_port_forwarding") is True


class SSHListener:
    """A started SSH listener; ``close`` stops accepting (connections in progress go on).

    ``tasks`` holds what its connections start from asyncssh's callbacks (a target login, a session's
    close, a block's audit entry) until it is done.
    """

    def __init__(self, acceptor: asyncssh.SSHAcceptor | balance.BalancedServer, tasks: BackgroundTasks,
                 pipeline: SessionPipeline, options: dict[str, Any]) -> None:
        self.acceptor = acceptor
        self.tasks = tasks
        self.pipeline = pipeline
        self.options = options  # asyncssh's server options, for a connection served off the listening socket

    async def close(self) -> None:
        global RUNNING
        self.acceptor.close()
        if RUNNING is self:
            RUNNING = None

    async def serve(self, sock: socket.socket, secret: str) -> None:
        """One client on an already-connected socket, logged in with ``secret`` (the proxy manager's forwarding):
        its own user name and password are not asked for. Returns when the connection ends."""
        ciphers = self.options["encryption_algs"]
        conn = await asyncssh.run_server(
            sock, server_factory=lambda: GatewayConnection(self.pipeline, self.tasks, ciphers, secret), **self.options)
        await conn.wait_closed()


RUNNING: SSHListener | None = None  # the listener started last (the proxy manager hands it forwarded clients)


async def serve_forwarded(sock: socket.socket, secret: str) -> None:
    """A proxy manager's local ssh client, served by the running listener as the credential ``secret``."""
    if RUNNING is None:
        raise ValueError("the gateway's ssh listener is stopped")
    await RUNNING.serve(sock, secret)


async def host_key(context: ProxyContext) -> asyncssh.SSHKey:
    """The listener's host key: ``serverconfig/misc`` ``ssh_server_config.hosts_key`` (base64 of PEM).

    An empty one means the key the gateway generated on its first start (``context.host_key``).
    """
    encoded = context.server_config.get("hosts_key") or ""
    if not encoded and context.host_key is None:
        raise ValueError("the SSH listener has no host key (ssh_server_config.hosts_key is empty)")
    try:
        pem = base64.b64decode(encoded, validate=True) if encoded else await context.host_key()  # type: ignore[misc]
        return asyncssh.import_private_key(pem)
    except (ValueError, asyncssh.KeyImportError):
        raise ValueError("ssh_server_config.hosts_key is not base64 of a PEM/OpenSSH private key") from None


class HideUserNames(logging.Filter):
    """asyncssh logs the SSH user name ("auth for user %s"), which here may be the credential's secret."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.args and "for user" in str(record.msg):
            record.args = ("(hidden)",) * len(record.args) if isinstance(record.args, tuple) else None
        return True


def hide_user_names() -> None:
    """Install ``HideUserNames`` on asyncssh's logger (once)."""
    logger = logging.getLogger("asyncssh")
    if not any(isinstance(f, HideUserNames) for f in logger.filters):
        logger.addFilter(HideUserNames())


async def start(context: ProxyContext, host: str, port: int) -> SSHListener:
    """Listener factory registered as ``ssh``."""
    hide_user_names()
    if gcm.install():  # AES-GCM packets without asyncssh's per-packet rebuilding and copies (gcm.py)
        log.info("ssh: AES-GCM packets by the gateway's GatewayGCM")
    else:
        log.info("ssh: asyncssh's own AES-GCM packets kept (its cipher table is not the one gcm.py knows)")
    if not log.isEnabledFor(logging.DEBUG):
        # asyncssh logs every connection, channel and command at INFO: the session recording is the record
        logging.getLogger("asyncssh").setLevel(logging.WARNING)
    pipeline = context.pipeline
    tasks = BackgroundTasks("ssh listener")
    key = await host_key(context)
    options: dict[str, Any] = dict(
        server_host_keys=[key], login_timeout=LOGIN_TIMEOUT, encoding=None, line_editor=False,
        agent_forwarding=False, x11_forwarding=False, allow_scp=False, compression_algs=None,
        encryption_algs=list(context.settings["ciphers"]), window=WINDOW, max_pktsize=MAX_PACKET,
        keepalive_interval=60)
    ciphers = options["encryption_algs"]

    def connection() -> GatewayConnection:
        return GatewayConnection(pipeline, tasks, ciphers)

    async def serve(sock: socket.socket) -> None:  # one accepted here or handed here by a sibling worker
        await asyncssh.run_server(sock, server_factory=connection, **options)

    acceptor: asyncssh.SSHAcceptor | balance.BalancedServer
    if balance.balanced(context.reuse_port):  # a worker: new connections spread evenly (gatewayd/balance.py)
        acceptor = await balance.listen("ssh", serve, host, port)
    else:
        acceptor = await asyncssh.listen(host, port, server_factory=connection, reuse_address=True,
                                         reuse_port=context.reuse_port or None, **options)
    global RUNNING
    RUNNING = SSHListener(acceptor, tasks, pipeline, options)
    return RUNNING


class TargetWatch(asyncssh.SSHClient):
    """Gathers the target connection's writes; tells the client connection when it drops."""

    def __init__(self, owner: GatewayConnection) -> None:
        self.owner = owner

    def connection_made(self, conn: asyncssh.SSHClientConnection) -> None:
        as_the_gateway_runs_it(conn, ENCRYPTION)

    def connection_lost(self, exc: Exception | None) -> None:
        self.owner.target_lost()


class GatewayConnection(asyncssh.SSHServer):
    """One client SSH connection: its credential, its session run (the target connection) and channels."""

    def __init__(self, pipeline: SessionPipeline, tasks: BackgroundTasks, ciphers: Sequence[str],
                 preset: str | None = None) -> None:
        self.pipeline = pipeline
        self.tasks = tasks
        self.ciphers = ciphers  # what the listener offers clients (ssh.ciphers)
        self.preset = preset  # the credential of a proxy manager's forwarded client: its own login is not asked
        self.conn: asyncssh.SSHServerConnection | None = None
        self.client_ip = ""
        self.grant: AccessGrant | None = None
        self.ready: asyncio.Task[None] | None = None
        self.failure: str | None = None
        self.run: SessionRun[asyncssh.SSHClientConnection] | None = None
        self.target: asyncssh.SSHClientConnection | None = None
        self.channels: set[SessionRelay] = set()
        self.opened = 0  # session channels relayed so far
        self.first_end: str | None = None  # how the first one ended, recorded once a second one opens
        self.exit_code: int | None = None
        self.gone = False
        self.cut_short = False
        self.ending: str | None = None
        self.stopping: set[asyncio.Task[None]] = set()  # commands the gateway is ending on the target (end_command)

    # -- asyncssh server callbacks

    def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
        self.conn = conn
        as_the_gateway_runs_it(conn, self.ciphers)  # reads, writes and packets as proxies/ssh/packets.py says
        metrics.connection_opened("ssh")
        peer = conn.get_extra_info("peername")
        self.client_ip = peer[0] if isinstance(peer, tuple) else ""

    def connection_lost(self, exc: Exception | None) -> None:
        metrics.connection_closed("ssh")
        self.gone = True
        if self.ready is None or self.ready.done():
            self.tasks.spawn(self._finish())
        # else the target login is still running: _open finishes the job when it is done

    async def begin_auth(self, username: str) -> bool:
        """No authentication needed when the user name is a valid secret (or the forwarding's credential is)."""
        if self.preset is not None:
            return not await self._login(self.preset)
        if looks_like_secret(username) and await self._login(username):
            return False
        return True

    def password_auth_supported(self) -> bool:
        return True

    async def validate_password(self, username: str, password: str) -> bool:
        return self.preset is None and await self._login(password)

    def public_key_auth_supported(self) -> bool:
        return False

    def kbdint_auth_supported(self) -> bool:
        return False

    def session_requested(self) -> Any:
        return self._session()

    def connection_requested(self, dest_host: str, dest_port: int, orig_host: str, orig_port: int) -> Any:
        return self._forward(dest_host, dest_port, orig_host, orig_port)

    def unix_connection_requested(self, dest_path: str) -> Any:
        return self._refuse_unix(dest_path)

    def server_requested(self, listen_host: str, listen_port: int) -> Any:
        return self._refuse_remote(f"{listen_host}:{listen_port}")

    def unix_server_requested(self, listen_path: str) -> Any:
        return self._refuse_remote(listen_path)

    # -- login and target

    async def _login(self, secret: str) -> bool:
        if self.grant is not None:
            return True
        try:
            self.grant = await self.pipeline.admit(secret, "ssh", self.client_ip)
        except AccessDenied:
            return False
        except GatewayClosing as exc:  # the store does not answer, or this node is fenced: said, then disconnected
            self._unavailable(str(exc))
            return False
        self.ready = self.tasks.spawn(self._open_guarded())
        return True

    def _unavailable(self, message: str) -> None:
        """Tell the client why before the disconnect: a banner (shown by OpenSSH before it authenticates) and
        the disconnect's own reason."""
        conn = self.conn
        if conn is None:
            return
        with contextlib.suppress(Exception):
            conn.send_auth_banner(f"gatewayd: {message}\r\n")
        conn.disconnect(asyncssh.DISC_SERVICE_NOT_AVAILABLE, message[:200])

    async def _open_guarded(self) -> None:
        try:
            await self._open()
        except Exception:  # a store or session failure must not leave the client hanging
            log.exception("ssh session could not be opened", extra={"client_ip": self.client_ip})
            self.failure = "the gateway could not open the session (internal error)"
            if self.target is not None:
                self.target.close()
            if self.run is not None:
                await self.run.close(exit_code=BLOCKED_EXIT_CODE, error=self.failure)

    async def _open(self) -> None:
        """Log in to the target, then open the session (the pipeline's order; a failed target is a closed session)."""
        grant = self.grant
        assert grant is not None
        connection = grant.connection

        async def dial(dialer: Dialer) -> asyncssh.SSHClientConnection:
            settings = TargetSettings.from_role(connection.target())
            # held at once: an error (or a kill) before ``start`` returns closes it
            self.target = await connect_target(settings, connection.name, lambda: TargetWatch(self), dialer=dialer)
            return self.target

        try:
            self.run = run = await self.pipeline.start(grant, self.client_ip, dial=dial, unreachable=(TargetError,),
                                                       drop=lambda target: target.close(), on_kill=self._kill)
        except TargetUnreachable as exc:  # the pipeline closed the session with its e event and 254
            self.failure = exc.message
            return
        except GatewayClosing as exc:
            self.failure = str(exc)
            return
        if self.gone or run.ended:  # the client left (connection_lost left this to us) or a kill came meanwhile
            await self._finish()

    async def _ready(self) -> bool:
        if self.ready is None:
            self.failure = self.failure or "not authenticated"
            return False
        await asyncio.shield(self.ready)
        return self.failure is None and self.run is not None and not self.run.ended

    def target_lost(self) -> None:
        """The target's connection dropped: channels are closing; end the client connection too."""
        run = self.run
        if self.ending is None and not self.gone and run is not None:
            self.ending = f'the target of connection "{run.live.connection.name}" closed the connection'
            run.policy.error(self.ending)
            asyncio.get_running_loop().call_later(CLOSE_GRACE, self._disconnect)

    # -- session channels

    async def _session(self) -> asyncssh.SSHServerSession[bytes]:
        if not await self._ready():
            return RefusedSession(self.failure or self.ending or "the session is closed")
        relay = SessionRelay(self)
        self.channels.add(relay)
        self.opened += 1
        if self.opened == 2 and self.first_end is not None:
            relay.policy.error(self.first_end)
        return relay

    def channel_ended(self, line: str) -> None:
        """A session channel ended (``exit 3 of the channel that ran: ...``): an ``e`` event once multiplexed."""
        if self.opened > 1 and self.run is not None:
            self.run.policy.error(line)
        else:
            self.first_end = line  # a single-channel session records no such line: its exit_code says it

    # -- port forwarding

    async def _forward(self, dest_host: str, dest_port: int, orig_host: str,
                       orig_port: int) -> asyncssh.SSHTCPSession[bytes]:
        if not await self._ready():
            raise asyncssh.ChannelOpenError(asyncssh.OPEN_CONNECT_FAILED, self.failure or "the session is closed")
        run = self.run
        assert run is not None and self.target is not None
        policy, connection = run.policy, run.live.connection
        where = f"{dest_host}:{dest_port}"
        if not allows_port_forwarding(connection.settings):
            message = (f'port forwarding to {where} refused: connection "{connection.name}" does not allow it '
                       "(settings.ssh.allow_port_forwarding)")
            policy.error(message)
            await self._audit("failure", message, where)
            raise asyncssh.ChannelOpenError(asyncssh.OPEN_ADMINISTRATIVELY_PROHIBITED, message)
        if not policy.rules.empty:  # a forwarded stream is opaque: what cannot be read is refused, not passed
            message = f'port forwarding to {where} refused: connection "{connection.name}" {FORWARD_UNREADABLE}'
            policy.error(message)
            await self._audit("failure", message, where)
            raise asyncssh.ChannelOpenError(asyncssh.OPEN_ADMINISTRATIVELY_PROHIBITED, message)
        relay = ForwardRelay(policy, where)
        try:
            await self.target.create_connection(relay.upstream_session, dest_host, dest_port, orig_host, orig_port,
                                                window=WINDOW, max_pktsize=MAX_PACKET)
        except asyncssh.ChannelOpenError as exc:
            message = f"port forwarding to {where} failed: the target answered: {exc.reason}"
            policy.error(message)
            raise asyncssh.ChannelOpenError(exc.code, message) from None
        policy.error(f"port forwarding to {where} opened")
        await self._audit("success", "", where)
        return relay

    async def _refuse_unix(self, where: str) -> asyncssh.SSHUNIXSession[bytes]:
        """Forwarding to a unix socket on the target (``ssh -L port:/path``) is not offered: refused as a refused
        ``-L`` is, with an ``e`` event and an ``ssh.port_forward`` audit entry."""
        if not await self._ready():
            raise asyncssh.ChannelOpenError(asyncssh.OPEN_CONNECT_FAILED, self.failure or "the session is closed")
        message = f"port forwarding to {where} refused: the gateway does not offer unix socket forwarding"
        assert self.run is not None
        self.run.policy.error(message)
        await self._audit("failure", message, where)
        raise asyncssh.ChannelOpenError(asyncssh.OPEN_ADMINISTRATIVELY_PROHIBITED, message)

    async def _refuse_remote(self, where: str) -> bool:
        """Remote forwarding (``ssh -R``) is not offered: an ``e`` event and an ``ssh.port_forward`` audit entry."""
        if not await self._ready():
            return False
        message = f"remote port forwarding from {where} refused: the gateway does not offer it"
        assert self.run is not None
        self.run.policy.error(message)
        await self._audit("failure", message, where)
        return False

    async def _audit(self, outcome: str, message: str, where: str) -> None:
        """An ``ssh.port_forward`` audit entry about this session, naming the destination."""
        assert self.run is not None
        await self.pipeline.audit(self.run.live, "ssh.port_forward", message, outcome=outcome,
                                  client_ip=self.client_ip, destination=where)

    # -- the end

    async def _kill(self, reason: str) -> None:
        """The gateway ends the session (kill, expiry, shutdown): every channel is told why, the commands running
        without a pty are signalled (bounded: ``end_command``), then the target is closed and the client
        disconnected."""
        self.ending = reason
        told = bool(self.channels)
        for relay in list(self.channels):
            relay.end(reason)
        await self._stopped()
        if self.target is not None:
            self.target.close()
        if not told:
            self._disconnect()
        else:
            asyncio.get_running_loop().call_later(CLOSE_GRACE, self._disconnect)

    def stop_command(self, ending: Coroutine[Any, Any, None]) -> None:
        """Run ``ending`` (a channel's ``end_command``); the target is closed only after it."""
        task = self.tasks.spawn(ending)
        self.stopping.add(task)
        task.add_done_callback(self.stopping.discard)

    async def _stopped(self) -> None:
        """Until the commands the gateway is ending on the target have ended or been killed (each bounded)."""
        await until_empty(self.stopping)

    def channel_closed(self, relay: SessionRelay) -> None:
        self.channels.discard(relay)
        if self.ending is not None and not self.channels:
            # the client leaves by itself once its channels closed (OpenSSH then exits with the channel's 254): a
            # disconnect sent at once can reach it first, and it exits 255 before printing why; one that stays is
            # disconnected after the grace
            asyncio.get_running_loop().call_later(CLOSE_GRACE, self._disconnect)

    def _disconnect(self) -> None:
        if self.conn is not None and not self.gone:
            self.conn.disconnect(asyncssh.DISC_BY_APPLICATION, self.ending or "session closed")

    async def _finish(self) -> None:
        """The client went away (or the session ended before it could start): close the target and the session."""
        await self._stopped()  # a command the gateway ends keeps its grace, whenever its client leaves
        if self.target is not None:
            self.target.close()
        run = self.run
        if run is None or run.ended:
            return
        error = "the client disconnected with a channel still open" if self.cut_short else None
        await run.close(exit_code=self.exit_code, error=error)


# the channel requests for forwarding that the gateway does not offer: what is refused, and its audit action
FORWARDING_REQUESTS = {"auth-agent-req@openssh.com": ("agent", "ssh.agent_forward"),
                       "x11-req": ("X11", "ssh.x11_forward")}


def refuse_forwarding_requests(chan: asyncssh.SSHServerChannel[bytes], refused: Callable[[str], None]) -> None:
    """Refuse agent and X11 forwarding on ``chan``, telling ``refused`` the request's name.

    asyncssh refuses them itself (the listener's options turn both off), but in the channel's own request handlers
    (``_process_<request>_request``, looked up by name on the channel when the request comes), which no session
    callback hears: the refusal left no trace. Those handlers are replaced on the instance; the client gets the
    same failure as before. The request's contents (an X11 cookie) are not read."""
    for request in FORWARDING_REQUESTS:
        def handler(packet: object, request: str = request) -> bool:
            refused(request)
            return False
        setattr(chan, f"_process_{map_handler_name(request)}_request", handler)


class RefusedSession(asyncssh.SSHServerSession):  # type: ignore[type-arg]
    """A session channel that can only say why there is no target: message on stderr, exit 254."""

    def __init__(self, message: str) -> None:
        self.message = message
        self.chan: asyncssh.SSHServerChannel[bytes] | None = None

    def connection_made(self, chan: asyncssh.SSHServerChannel[bytes]) -> None:  # type: ignore[override]
        self.chan = chan

    def pty_requested(self, term_type: str, term_size: Any, term_modes: Any) -> bool:
        return True

    def shell_requested(self) -> bool:
        return True

    def exec_requested(self, command: str) -> bool:
        return True

    def subsystem_requested(self, subsystem: str) -> bool:
        return True

    def session_started(self) -> None:
        assert self.chan is not None
        self.chan.write_stderr(f"{self.message}\n".encode())
        self.chan.exit(BLOCKED_EXIT_CODE)


class _Upstream(asyncssh.SSHClientSession):  # type: ignore[type-arg]
    """The target's side of a session channel: hands everything to its ``SessionRelay``."""

    def __init__(self, relay: SessionRelay) -> None:
        self.relay = relay

    def connection_made(self, chan: asyncssh.SSHClientChannel[bytes]) -> None:  # type: ignore[override]
        as_the_gateway_relays_it(chan)

    def data_received(self, data: bytes, datatype: int | None) -> None:  # type: ignore[override]
        self.relay.from_target(data, datatype)

    def eof_received(self) -> bool:
        relay = self.relay
        if relay.ended:  # the gateway ended the channel: the client hears nothing more from the target
            return True
        relay.flush_held()  # the target's output is over: an unfinished last line goes now
        if relay.client_eof:
            # the client is done sending: hold the EOF and send it with the exit status and close, back to back
            # as sshd does; a multiplexing client that has seen both EOFs closes the channel at once, and an
            # exit status that comes after that is lost
            relay.held_eof = True
        elif not relay.client_closed:
            relay.chan.write_eof()
        return True

    def exit_status_received(self, status: int) -> None:
        self.relay.exit_status = status

    def exit_signal_received(self, signal: str, core_dumped: bool, msg: str, lang: str) -> None:
        self.relay.exit_signal = (signal, core_dumped, msg, lang)

    def connection_lost(self, exc: Exception | None) -> None:
        self.relay.target_closed()

    def pause_writing(self) -> None:
        self.relay.target_full = True
        self.relay.sync_reading()

    def resume_writing(self) -> None:
        self.relay.target_full = False
        self.relay.sync_reading()


class SessionRelay(asyncssh.SSHServerSession):  # type: ignore[type-arg]
    """One client ``session`` channel mirrored to a channel on the target, reported to the session's policy chain."""

    def __init__(self, owner: GatewayConnection) -> None:
        assert owner.run is not None and owner.target is not None
        self.owner = owner
        self.policy: SessionPolicy = owner.run.policy
        self.name = owner.run.live.connection.name
        self.tasks = owner.tasks
        self.target = owner.target
        self.chan: asyncssh.SSHServerChannel[bytes] = None  # type: ignore[assignment]
        self.upchan: asyncssh.SSHClientChannel[bytes] | None = None
        self.kind = ""
        self.command = ""
        self.download: str | None = None  # an exec that is a file protocol's download (``lines.download``)
        self.pty = False
        self.shell: ShellInput | None = None  # the input rules' line reader (``follow_rules``)
        self.reads_lines = False  # a shell, or an exec whose input is not a file protocol (``stdin_protocol``)
        self.sftp: SftpObserver | None = None
        self.pending: deque[bytes] = deque()  # client data waiting for the target's channel, or for a held line's verdict
        self.pending_eof = False
        self.holding = False  # a shell line's Enter waits for its verdict (an AI rule in sync mode)
        self.deciding = Withdrawable()  # that verdict's decision, which a Ctrl-C withdraws (the line does not run)
        self.client_eof = False  # the client sent EOF: it sends nothing more on this channel
        self.held_eof = False  # the target's EOF, sent to the client with the exit status
        self.injections: list[bytes] = []  # SFTP answers of the gateway waiting for a packet boundary
        self.exit_status: int | None = None
        self.exit_signal: tuple[str, bool, str, str] | None = None
        self.active = False  # a command, shell or subsystem is running
        self.ended = False
        self.draining = False  # waiting for the recording to flush
        self.client_full = False  # the client channel's send buffer is full: stop reading the target
        self.target_full = False  # the target channel's send buffer is full: stop reading the client
        self.client_closed = False
        self.stopping = False  # the gateway is ending the target's command (end_command): it closes the channel
        self.watch: OutputWatch | None = None  # None: no output rules
        # under a mask rule, stdout and stderr are held to their line ends (a match is never split between two
        # chunks); None: no mask rule, bytes pass as they come
        self.held: tuple[LineHold, LineHold] | None = None
        self.hold_timer: asyncio.TimerHandle | None = None
        self.forwarding_refused: set[str] = set()  # the forwarding requests already on the record
        self.follow_rules()

    def follow_rules(self) -> None:
        """Read what the session's rules read now: they may come while the channel is open (``policy.adopt``), and
        apply from the next bytes on. Without rules nothing is assembled or decoded; readers once made stay."""
        policy = self.policy
        if self.shell is None and self.reads_lines and policy.checks_input:
            self.shell = ShellInput(self.pty)
        if self.watch is None and policy.checks_output:
            self.watch = OutputWatch(policy)
        if self.held is None and policy.masker is not None:
            self.held = (LineHold(), LineHold())

    # -- client side callbacks

    def connection_made(self, chan: asyncssh.SSHServerChannel[bytes]) -> None:  # type: ignore[override]
        self.chan = chan
        as_the_gateway_relays_it(chan)
        refuse_forwarding_requests(chan, self._refuse_forwarding)

    def pty_requested(self, term_type: str, term_size: tuple[int, int, int, int], term_modes: Any) -> bool:
        self.pty = True
        self.policy.describe("terminal", {"type": term_type, "width": term_size[0], "height": term_size[1]})
        return True

    def shell_requested(self) -> bool:
        self.kind = "shell"
        # without input rules there is nothing to check: no per-byte line assembly, keystrokes pass as they come
        self.reads_lines = True
        self.follow_rules()
        return self._start(None, None)

    def exec_requested(self, command: str) -> bool:
        """The command is checked whole; what the client sends it is read as a shell's input is (``ssh -t host
        bash``, ``ssh host sh < script`` are shells), unless the command is a file protocol's (``stdin_protocol``):
        sftp-server's is read as the sftp subsystem's, scp's, rsync's and git's pass as data."""
        self.kind = "exec"
        self.command = command
        self.download = download(command)
        protocol = stdin_protocol(command)
        if protocol == "sftp":
            self.sftp = SftpObserver()
        self.reads_lines = protocol is None
        self.follow_rules()
        return self._start(command, None)

    def subsystem_requested(self, subsystem: str) -> bool:
        if subsystem != "sftp":  # refused on the record, as a refused forward is
            self._refused(f'subsystem "{subsystem[:100]}" refused: the gateway relays only sftp', "ssh.subsystem",
                          subsystem=subsystem[:100])
            return False
        self.kind = "sftp"
        self.sftp = SftpObserver()
        return self._start(None, subsystem)

    def _refuse_forwarding(self, request: str) -> None:
        """An agent or X11 forwarding request (``ssh -A``, ``ssh -X``), refused: on the record once per channel."""
        if request not in self.forwarding_refused:
            self.forwarding_refused.add(request)
            what, action = FORWARDING_REQUESTS[request]
            self._refused(f"{what} forwarding refused: the gateway does not offer it", action)

    def _refused(self, message: str, action: str, **payload: Any) -> None:
        """A channel request the gateway refuses: an ``e`` event and a failure audit entry ``action``."""
        self.policy.error(message)
        owner = self.owner
        assert owner.run is not None
        self.tasks.spawn(owner.pipeline.audit(owner.run.live, action, message, outcome="failure",
                                              client_ip=owner.client_ip, **payload))

    def data_received(self, data: bytes, datatype: int | None) -> None:  # type: ignore[override]
        if self.upchan is None or self.holding:
            self.pending.append(data)
            if self.holding and self.pty and INTERRUPT in data:
                self.deciding.withdraw()  # Ctrl-C: the held line is cancelled (``_decide_line``)
            if not (self.holding and self._reads_while_holding()):
                self.chan.pause_reading()
            return
        self.to_target(data)
        self._check_drain()

    def eof_received(self) -> bool:
        self.client_eof = True
        if self.upchan is None or self.holding:
            self.pending_eof = True
        else:
            self._eof_to_target()
        return True

    def signal_received(self, signal: str) -> None:
        if signal == "INT" and self.holding:  # PuTTY's "Interrupt", asyncssh's send_signal: as a Ctrl-C typed
            self.deciding.withdraw()
        if self.upchan is not None:
            self.upchan.send_signal(signal)

    def break_received(self, msec: int) -> bool:
        if self.upchan is not None:
            self.upchan.send_break(msec)
            return True
        return False

    def terminal_size_changed(self, width: int, height: int, pixwidth: int, pixheight: int) -> None:
        if self.upchan is not None:
            self.upchan.change_terminal_size(width, height, pixwidth, pixheight)

    def pause_writing(self) -> None:
        self.client_full = True
        self.sync_reading()

    def resume_writing(self) -> None:
        self.client_full = False
        self.sync_reading()

    def sync_reading(self) -> None:
        """Flow control: read each side only while the other can take more and the recording keeps up."""
        if self.upchan is None or self.ended:  # ended: what the target still sends is dropped, never held
            return
        if self.client_full or self.draining:
            self.upchan.pause_reading()
        else:
            self.upchan.resume_reading()
        if self.target_full or self.draining or (self.holding and not self._reads_while_holding()):
            self.chan.pause_reading()
        else:
            self.chan.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.client_closed = True
        self._drop_held()
        if self.active and not self.ended:
            self.owner.cut_short = True  # the client went away while the target was still at work
            self._ended_as("no exit status")
        if self.upchan is not None and not self.stopping:  # OpenSSH's own behaviour, as with a direct ssh
            self.upchan.close()
        self.owner.channel_closed(self)

    # -- opening the target's channel

    def _start(self, command: str | None, subsystem: str | None) -> bool:
        self.active = True
        self.tasks.spawn(self._open_target(command, subsystem))
        return True

    async def _open_target(self, command: str | None, subsystem: str | None) -> None:
        chan = self.chan
        env = chan.get_environment_bytes()
        if env and (verdict := self._environment(env)):
            await self._refuse(verdict)
            return
        if command is not None and self.policy.needs_wait(command):  # an AI rule in sync mode: its verdict first
            await self.policy.decide(command)
        if command is not None and (verdict := self.policy.input(command)):  # recorded, then checked
            await self._refuse(verdict)
            return
        if command is not None and (verdict := self._unreadable_download()):
            await self._refuse(verdict)
            return
        options: dict[str, Any] = {"command": command, "subsystem": subsystem, "env": env,
                                   "encoding": None, "window": WINDOW, "max_pktsize": MAX_PACKET}
        if self.pty:
            options.update(term_type=chan.get_terminal_type(), term_size=chan.get_terminal_size(),
                           term_modes=chan.get_terminal_modes())
        try:
            self.upchan, _ = await self.target.create_session(lambda: _Upstream(self), **options)
        except (asyncssh.ChannelOpenError, asyncssh.Error, OSError) as exc:
            if self.ended:  # killed (or expired) while the channel was being opened: the kill's reason stays the last
                return
            reason = getattr(exc, "reason", "") or str(exc) or type(exc).__name__
            message = f'the target of connection "{self.name}" refused the channel: {reason}'
            self.policy.error(message)
            self.end(message)
            return
        if self.ended:  # ended while its command was starting there
            self._stop_target(True)
            return
        pending, self.pending = self.pending, deque()
        for data in pending:
            self.to_target(data)
        if self.pending_eof and not self.holding:  # else the held line's verdict sends it
            self.pending_eof = False
            self._eof_to_target()
        self.sync_reading()

    def _environment(self, env: Mapping[bytes, bytes]) -> GuardVerdict | None:
        """The variables the client asked to set, all passed on (the target's ``AcceptEnv`` decides): one ``i``
        line ``env NAME=value ...`` as the rules read it, recorded with a secret-looking name's value redacted,
        gateway credentials scrubbed and the mask rules applied; the verdict that refuses the channel, or None."""
        pairs = {name.decode("utf-8", "replace"): value.decode("utf-8", "replace") for name, value in env.items()}
        said = "env " + " ".join(shlex.quote(f"{name}={value}") for name, value in pairs.items())
        shown = "env " + " ".join(f"{shlex.quote(name)}={REDACTED}" if _SECRET_NAME.search(name)
                                  else shlex.quote(f"{name}={value}") for name, value in pairs.items())
        policy = self.policy
        shown = policy.mask_output(scrub(shown))
        policy.record_input(shown)
        verdict = policy.check_input(said)
        return None if verdict is None else dataclasses.replace(verdict, text=shown[:AUDIT_INPUT_CHARS])

    def _unreadable_download(self) -> GuardVerdict | None:
        """The verdict on this exec when it is a file protocol's download (``download``) the session's rules cannot
        apply to, or None: checked before it starts, and at each chunk it sends (rules may come meanwhile).

        Under a mask rule every one is refused: the file goes out in sized blocks or compressed, so masking it
        would break the transfer or miss the values, and passing it would leak. Under output rules a compressed
        one (rsync's sender, git's pack or archive) is refused: the rules could not read it."""
        kind = self.download
        if kind is None:
            return None
        text = self.command[:AUDIT_INPUT_CHARS]
        if self.policy.masker is not None:
            return GuardVerdict(False, UNMASKABLE_DOWNLOAD, "output", "mask", text=text)
        if kind == "compressed" and self.policy.checks_output:
            return GuardVerdict(False, UNREADABLE_DOWNLOAD, "output", "unreadable", text=text)
        return None

    async def _refuse(self, verdict: GuardVerdict) -> None:
        """An exec the input rules block: message on stderr, exit 254, the target never sees it."""
        self.owner.exit_code = BLOCKED_EXIT_CODE
        self.end(verdict.message)
        await self.policy.blocked(verdict)

    # -- client to target

    def to_target(self, data: bytes) -> None:
        if self.holding:  # behind a shell line waiting for its verdict
            self.pending.append(data)
            return
        upchan = self.upchan
        assert upchan is not None
        if self.sftp is not None:
            self._sftp_to_target(self.sftp, upchan, data)
            return
        policy = self.policy
        policy.record_input(data)  # keystrokes as typed; the rules read the lines they make up
        self.follow_rules()
        if self.shell is None:
            upchan.write(data)
            return
        self._shell_to_target(upchan, self.shell.feed(data))

    def _shell_to_target(self, upchan: asyncssh.SSHClientChannel[bytes], pieces: list[Chunk | Line]) -> None:
        policy = self.policy
        for at, piece in enumerate(pieces):
            if isinstance(piece, Chunk):
                upchan.write(piece.data)
                continue
            if policy.waits and policy.needs_wait(piece.text):  # hold the Enter, and what follows, for the verdict
                self.holding = True
                self.deciding.hold()
                self.sync_reading()
                self.tasks.spawn(self._decide_line(piece.text, pieces[at:]))
                return
            verdict = policy.check_input(piece.text) if piece.text.strip() else None
            if verdict is None:
                upchan.write(piece.allowed)
            else:
                upchan.write(piece.refused)
                self._tell(verdict.message)
                self.tasks.spawn(policy.blocked(verdict))

    async def _decide_line(self, text: str, pieces: list[Chunk | Line]) -> None:
        """A held shell line's verdict; then the line and what the client sent meanwhile go on, in order. A
        Ctrl-C typed meanwhile (``data_received``) cancels the line: it is erased as a refused line is, never run."""
        try:
            await self.deciding.run(self.policy.decide(text))
        finally:
            self.holding = False
            upchan = self.upchan
            if upchan is not None and not self.ended:
                if self.deciding.withdrawn:
                    line, pieces = pieces[0], pieces[1:]
                    upchan.write(line.refused)  # type: ignore[union-attr]
                    self.policy.error(f"{LINE_CANCELLED}: {text}")
                    self._tell(LINE_CANCELLED)
                self._shell_to_target(upchan, pieces)
                while self.pending and not self.holding:
                    self.to_target(self.pending.popleft())
                if self.pending_eof and not self.holding:
                    self.pending_eof = False
                    self._eof_to_target()
                self.sync_reading()

    def _reads_while_holding(self) -> bool:
        """With a pty, what the user types while a line waits for its verdict is still read (queued, up to
        ``HOLDING_READ_CAP``), so that a Ctrl-C in it cancels the line; without one the channel waits unread."""
        return self.pty and self.shell is not None and sum(map(len, self.pending)) < HOLDING_READ_CAP

    def _sftp_to_target(self, sftp: SftpObserver, upchan: asyncssh.SSHClientChannel[bytes], data: bytes) -> None:
        """SFTP requests: recorded as lines; the input rules may refuse an operation (permission denied)."""
        policy = self.policy
        for piece in sftp.client(data):
            if isinstance(piece, bytes):
                upchan.write(piece)
            elif isinstance(piece, Unreadable):  # what follows cannot be checked or recorded: not passed (fail closed)
                message = f"sftp: the client's stream cannot be followed ({piece.reason}): the channel is closed"
                policy.error(message)
                self.end(message)
                return
            elif isinstance(piece, tuple):
                self._record(*piece)
            elif piece.deferred:  # recorded later, with what the target answers (put and get sizes)
                verdict = next(filter(None, map(policy.check_input, piece.lines)), None)
                if verdict is None and policy.masker is not None and piece.line.startswith("get "):
                    self._record_lines(piece.lines)
                    self._refuse_unmaskable(sftp, piece.request_id)
                elif verdict is None:
                    upchan.write(piece.raw)
                else:
                    self._record_lines(piece.lines)
                    self._refuse_sftp(sftp, piece.request_id, verdict)
            elif verdict := policy.input(piece.line):
                self._refuse_sftp(sftp, piece.request_id, verdict)
            else:
                upchan.write(piece.raw)

    def _record_lines(self, lines: tuple[str, ...]) -> None:
        """A refused open's lines (``get /f``, and ``put /f`` when it was for reading and writing too)."""
        for line in lines:
            self.policy.record_input(line)

    def _refuse_sftp(self, sftp: SftpObserver, request_id: int, verdict: GuardVerdict) -> None:
        """An SFTP request the input rules block: a permission-denied status, the reason on stderr, the block."""
        sftp.refused(request_id)
        self._to_client_at_boundary(status_packet(request_id, verdict.message))
        self._tell(verdict.message)  # sftp clients show a status code only: the reason goes to stderr
        self.tasks.spawn(self.policy.blocked(verdict))

    def _refuse_unmaskable(self, sftp: SftpObserver, request_id: int) -> None:
        """Under a mask rule a file download is refused: its bytes cannot be masked without changing the file."""
        message = UNMASKABLE_DOWNLOAD
        sftp.refused(request_id)
        self._to_client_at_boundary(status_packet(request_id, message))
        self._tell(message)
        self.tasks.spawn(self.policy.blocked(GuardVerdict(False, message, "output", "mask")))  # e event, audit entry

    def _record(self, kind: str, line: str) -> None:
        """One of the SFTP observer's records (``i`` an operation, ``o`` an answer, ``e`` a failure)."""
        if kind == "i":
            self.policy.record_input(line)
        elif kind == "o":
            self.policy.record_output(line)
        else:
            self.policy.error(line)

    def _to_client_at_boundary(self, packet: bytes) -> None:
        """Answer the client between two of the target's SFTP packets."""
        self.injections.append(packet)
        if self.sftp is not None and self.sftp.server_at_boundary:
            self._flush_injections()

    def _flush_injections(self) -> None:
        injections, self.injections = self.injections, []
        if not self.client_closed:
            self.chan.writelines(injections)

    def _eof_to_target(self) -> None:
        upchan = self.upchan
        assert upchan is not None
        if self.shell is not None:
            for piece in self.shell.feed_eof():
                verdict = self.policy.check_input(piece.text) if piece.text.strip() else None
                if verdict is None:
                    upchan.write(piece.allowed)  # type: ignore[union-attr]
                else:
                    self._tell(verdict.message)
                    self.tasks.spawn(self.policy.blocked(verdict))
        upchan.write_eof()

    def _tell(self, message: str) -> None:
        """A gateway message on the terminal (pty) or stderr."""
        text = f"\r\n{message}\r\n".encode() if self.pty else f"{message}\n".encode()
        if self.client_closed:
            return
        try:
            if self.pty:
                self.chan.write(text)
            else:
                self.chan.write_stderr(text)
        except OSError:  # the client channel already sent EOF
            pass

    # -- target to client

    def from_target(self, data: bytes, datatype: int | None) -> None:
        if self.ended:
            return
        if self.sftp is not None and datatype is None:
            if self.policy.masker is not None and self.sftp.reading:
                # a mask rule came while a file was open for reading (opened under one, it is refused): not passed
                self._block(GuardVerdict(False, UNMASKABLE_DOWNLOAD, "output", "mask"))
                return
            for kind, line in self.sftp.server(data):
                self._record(kind, line)
            self.chan.write(data)
            if self.injections and self.sftp.server_at_boundary:
                self._flush_injections()
            return
        policy = self.policy
        self.follow_rules()
        if self.download is not None and (verdict := self._unreadable_download()) is not None:
            self._block(verdict)  # rules came while a download ran: its next bytes could not be read either
            return
        if self.watch is not None:  # no decoding at all without output rules
            verdict = self.watch.check(data, 1 if datatype == STDERR else 0)
            if verdict is not None and not verdict.allowed:
                self._block(verdict)
                return
        if self.held is not None:
            self._hold(data, 1 if datatype == STDERR else 0)
        elif datatype == STDERR:
            policy.error(data)  # the target's stderr is on the record as e events
            self.chan.write_stderr(data)
        else:
            policy.record_output(data)
            self.chan.write(data)
        self._check_drain()

    def _block(self, verdict: GuardVerdict) -> None:
        """What the target sent is refused by ``verdict``: not passed, the channel closed, the block recorded."""
        self.owner.exit_code = BLOCKED_EXIT_CODE
        self.end(verdict.message)
        self.tasks.spawn(self.policy.blocked(verdict))

    def _hold(self, data: bytes, stream: int) -> None:
        """Under a mask rule: the complete lines are masked and sent, an unfinished one waits (``HOLD_IDLE``)."""
        held = self.held
        assert held is not None
        ready, context = held[stream].take(data)
        if ready:
            self._send_masked(ready, stream, context)
        if self.hold_timer is not None:
            self.hold_timer.cancel()
            self.hold_timer = None
        if held[0].pending or held[1].pending:
            self.hold_timer = asyncio.get_running_loop().call_later(HOLD_IDLE_PTY if self.pty else HOLD_IDLE,
                                                                    self._idle_flush)

    def _send_masked(self, data: bytes, stream: int, context: bytes) -> None:
        """Output masked (after ``context``, its line's start already sent), recorded (stdout ``o``, stderr
        ``e``) and sent as masked."""
        policy = self.policy
        masked = policy.mask_bytes(data, context)
        if stream:
            policy.error(masked)
            self.chan.write_stderr(masked)
        else:
            policy.record_output(masked)
            self.chan.write(masked)

    def _idle_flush(self) -> None:
        self.hold_timer = None
        if not self.ended and not self.client_closed:
            self.flush_held()

    def flush_held(self) -> None:
        """The target's output ended or paused: unfinished lines are masked and sent as they are."""
        held = self.held
        if held is None:
            return
        if self.hold_timer is not None:
            self.hold_timer.cancel()
            self.hold_timer = None
        for stream in (0, 1):
            data, context = held[stream].give_up()
            if data and not self.client_closed:
                self._send_masked(data, stream, context)

    def _drop_held(self) -> None:
        """The channel ends from the gateway's side: what is held is not sent."""
        if self.held is not None:
            for hold in self.held:
                hold.give_up()
            if self.hold_timer is not None:
                self.hold_timer.cancel()
                self.hold_timer = None

    def _check_drain(self) -> None:
        if self.policy.needs_drain and not self.draining and self.upchan is not None:
            self.draining = True
            self.sync_reading()
            self.tasks.spawn(self._drain())

    async def _drain(self) -> None:
        try:
            await self.policy.drain()
        finally:
            self.draining = False
            self.sync_reading()

    def target_closed(self) -> None:
        """The target's channel closed: pass its exit status or signal on."""
        self.active = False
        if self.ended:
            return
        self.flush_held()
        self.ended = True
        chan = self.chan
        if self.client_closed:
            return
        if self.held_eof and (self.exit_signal is not None or self.exit_status is not None):
            chan.write_eof()
        if self.exit_signal is not None:
            signal, core_dumped, msg, lang = self.exit_signal
            self.owner.exit_code = signal_exit_code(signal)
            self._ended_as(f"signal {signal}")
            chan.exit_with_signal(signal, core_dumped, msg, lang)
        elif self.exit_status is not None:
            self.owner.exit_code = self.exit_status
            self._ended_as(f"exit {self.exit_status}")
            chan.exit(self.exit_status)
        else:  # the target went away (or closed the channel) without saying how it ended
            message = f'the target of connection "{self.name}" closed the channel without an exit status'
            self.policy.error(message)
            self.ended = False
            self.end(message)

    def end(self, message: str) -> None:
        """The gateway closes this channel: ``message`` on stderr, exit 254, the target's channel closed (its
        command signalled first: ``_stop_target``)."""
        running, self.active = self.active, False
        self._drop_held()
        if self.ended:
            return
        self.ended = True
        self.owner.exit_code = BLOCKED_EXIT_CODE
        self._ended_as(f"exit {BLOCKED_EXIT_CODE}")
        if self.upchan is not None:
            self._stop_target(running)
        if not self.client_closed:
            self._tell(message)
            self.chan.exit(BLOCKED_EXIT_CODE)

    def _stop_target(self, running: bool) -> None:
        """Close the target's channel as the gateway ends it. A command still ``running`` there without a pty is
        signalled first (``end_command``; the outcome is an ``e`` event): the close alone would leave it running.
        With a pty, sshd hangs it up as the channel closes; the sftp subsystem ends with its pipes (and sshd
        refuses signals to subsystems)."""
        upchan = self.upchan
        assert upchan is not None
        if not running or self.pty or self.kind not in ("exec", "shell"):
            upchan.close()
            return
        self.stopping = True
        upchan.resume_reading()  # what it still sends is dropped: a full window does not hold its close back
        self.owner.stop_command(self._end_command(upchan))

    async def _end_command(self, upchan: asyncssh.SSHClientChannel[bytes]) -> None:
        if (note := await end_command(upchan)) is not None:
            self.policy.error(note)

    def _ended_as(self, outcome: str) -> None:
        """Tell the connection how this channel ended and what it ran (``exit 3 of the channel that ran: ...``)."""
        if self.kind == "exec":
            self.owner.channel_ended(f"{outcome} of the channel that ran: {self.command}")
        elif self.kind:
            self.owner.channel_ended(f"{outcome} of the {self.kind} channel")


class _ForwardUpstream(asyncssh.SSHTCPSession):  # type: ignore[type-arg]
    """The target's side of a forwarded TCP connection."""

    def __init__(self, relay: ForwardRelay) -> None:
        self.relay = relay

    def connection_made(self, chan: asyncssh.SSHTCPChannel[bytes]) -> None:  # type: ignore[override]
        self.relay.upchan = chan
        as_the_gateway_relays_it(chan)

    def data_received(self, data: bytes, datatype: int | None) -> None:  # type: ignore[override]
        if not self.relay.policy.rules.empty:
            self.relay.ruled_out()
            return
        self.relay.received += len(data)
        if self.relay.chan is not None:
            self.relay.chan.write(data)
        else:
            self.relay.early.append(data)

    def eof_received(self) -> bool:
        if self.relay.chan is not None:
            self.relay.chan.write_eof()
        return True

    def pause_writing(self) -> None:
        if self.relay.chan is not None:
            self.relay.chan.pause_reading()

    def resume_writing(self) -> None:
        if self.relay.chan is not None:
            self.relay.chan.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.relay.closed()


class ForwardRelay(asyncssh.SSHTCPSession):  # type: ignore[type-arg]
    """A ``direct-tcpip`` channel (``ssh -L``) relayed to the same destination through the target.

    The bytes are not recorded; the session gets an ``e`` event with the byte counts when it closes. Opened only
    on a connection without rules; once the connection has some (a rule attached while the forward is open), its
    next bytes either way are dropped and the forward is closed.
    """

    def __init__(self, policy: SessionPolicy, where: str) -> None:
        self.policy = policy
        self.where = where
        self.chan: asyncssh.SSHTCPChannel[bytes] | None = None
        self.upchan: asyncssh.SSHTCPChannel[bytes] | None = None
        self.early: list[bytes] = []
        self.sent = 0
        self.received = 0
        self.done = False

    def upstream_session(self) -> _ForwardUpstream:
        return _ForwardUpstream(self)

    def connection_made(self, chan: asyncssh.SSHTCPChannel[bytes]) -> None:  # type: ignore[override]
        self.chan = chan
        as_the_gateway_relays_it(chan)
        for data in self.early:
            chan.write(data)
        self.early.clear()

    def data_received(self, data: bytes, datatype: int | None) -> None:  # type: ignore[override]
        if not self.policy.rules.empty:
            self.ruled_out()
            return
        self.sent += len(data)
        if self.upchan is not None:
            self.upchan.write(data)

    def eof_received(self) -> bool:
        if self.upchan is not None:
            self.upchan.write_eof()
        return True

    def pause_writing(self) -> None:
        if self.upchan is not None:
            self.upchan.pause_reading()

    def resume_writing(self) -> None:
        if self.upchan is not None:
            self.upchan.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed()

    def ruled_out(self) -> None:
        """The connection has rules now, which cannot read this stream: it ends, its last bytes not passed."""
        if not self.done:
            self.policy.error(f"port forwarding to {self.where} ended: its connection now {FORWARD_UNREADABLE}")
        self.closed()

    def closed(self) -> None:
        if self.done:
            return
        self.done = True
        for chan in (self.chan, self.upchan):
            if chan is not None:
                chan.close()
        self.policy.error(f"port forwarding to {self.where} closed: {self.sent} bytes sent, "
                                 f"{self.received} bytes received")
