"""The SSH listener: an asyncssh server for clients, an asyncssh client to the target, the core in between.

One ``GatewayConnection`` per client SSH connection:

1. the credential -- the SSH user name is the secret (no prompt), or any user
   name with the secret as the password; refusals look like a wrong password
   and are audited by ``gateway.access``;
2. the target -- ``target.connect_target`` logs in with the role's settings
   while the client finishes authenticating; a failure is told on the
   client's first channel (stderr, exit 254) and the session is closed with
   an ``e`` event;
3. channels -- each ``session`` channel (exec, shell with or without pty,
   the ``sftp`` subsystem) is mirrored by a channel to the target
   (``SessionRelay``); ``direct-tcpip`` (``ssh -L``) is relayed when the
   connection's ``settings.ssh.allow_port_forwarding`` is true and refused
   otherwise (``ForwardRelay``); agent and X11 forwarding are refused, and
   so is remote forwarding (``ssh -R``), with an ``e`` event and an audit entry;
4. the end -- the session is closed when the client goes away (even while
   the target login is still running), with the last exit status; once a
   connection carries more than one session channel (OpenSSH multiplexing),
   each channel's end is an ``e`` event naming what it ran; a kill or the
   credential's expiry tells every channel why on stderr and closes the
   connection.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from typing import TYPE_CHECKING, Any, Coroutine

import asyncssh

from gatewayd.access import AccessDenied, looks_like_secret
from gatewayd.guardrails import GuardVerdict
from gatewayd.sessions import BLOCKED_EXIT_CODE
from proxies.ssh.lines import Chunk, OutputWatch, ShellInput
from proxies.ssh.sftp import SftpObserver, status_packet
from proxies.ssh.target import MAX_PACKET, WINDOW, TargetError, TargetSettings, connect_target, signal_exit_code

if TYPE_CHECKING:
    from gatewayd.access import AccessGrant
    from gatewayd.daemon import Gateway
    from gatewayd.guardrails import RuleSet
    from gatewayd.sessions import LiveSession

log = logging.getLogger("gatewayd.ssh")

STDERR = asyncssh.EXTENDED_DATA_STDERR
LOGIN_TIMEOUT = 60.0
CLOSE_GRACE = 5.0  # after a kill, how long channels may take to flush the message before the disconnect


_TASKS: set[asyncio.Task[Any]] = set()  # tasks started from asyncssh's callbacks, until they are done


def _background(coroutine: Coroutine[Any, Any, Any]) -> None:
    """Run ``coroutine`` as a task held until it is done (the event loop keeps only a weak reference)."""
    task = asyncio.ensure_future(coroutine)
    _TASKS.add(task)
    task.add_done_callback(_TASKS.discard)


def allows_port_forwarding(settings: dict[str, Any]) -> bool:
    """The per-connection switch for ``ssh -L``: ``settings.ssh.allow_port_forwarding`` (default false)."""
    ssh = settings.get("ssh") if isinstance(settings, dict) else None
    return isinstance(ssh, dict) and ssh.get("allow_port_forwarding") is True


class SSHListener:
    """A started SSH listener; ``close`` stops accepting (connections in progress go on)."""

    def __init__(self, acceptor: asyncssh.SSHAcceptor) -> None:
        self.acceptor = acceptor

    async def close(self) -> None:
        self.acceptor.close()


async def host_key(gateway: Gateway) -> asyncssh.SSHKey:
    """The listener's host key: ``serverconfig/misc`` ``ssh_server_config.hosts_key`` (base64 of PEM).

    An empty one means the key the gateway generated on its first start.
    """
    encoded = gateway.server_config.get("ssh_server_config", {}).get("hosts_key") or ""
    try:
        pem = base64.b64decode(encoded, validate=True) if encoded else await gateway.host_key_pem()
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


async def start(gateway: Gateway, host: str, port: int) -> SSHListener:
    """Listener factory registered as ``ssh``."""
    hide_user_names()
    if not log.isEnabledFor(logging.DEBUG):
        # asyncssh logs every connection, channel and command at INFO: the session recording is the record
        logging.getLogger("asyncssh").setLevel(logging.WARNING)
    acceptor = await asyncssh.listen(
        host, port, server_factory=lambda: GatewayConnection(gateway), server_host_keys=[await host_key(gateway)],
        reuse_address=True, login_timeout=LOGIN_TIMEOUT, encoding=None, line_editor=False,
        agent_forwarding=False, x11_forwarding=False, allow_scp=False, compression_algs=None,
        encryption_algs=list(gateway.config["ssh.ciphers"]),
        window=WINDOW, max_pktsize=MAX_PACKET, keepalive_interval=60)
    return SSHListener(acceptor)


class TargetWatch(asyncssh.SSHClient):
    """Tells the client connection when the target's connection drops."""

    def __init__(self, owner: GatewayConnection) -> None:
        self.owner = owner

    def connection_lost(self, exc: Exception | None) -> None:
        self.owner.target_lost()


class GatewayConnection(asyncssh.SSHServer):
    """One client SSH connection: its credential, its target connection, its session and channels."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.conn: asyncssh.SSHServerConnection | None = None
        self.client_ip = ""
        self.grant: AccessGrant | None = None
        self.ready: asyncio.Future[None] | None = None
        self.failure: str | None = None
        self.target: asyncssh.SSHClientConnection | None = None
        self.live: LiveSession | None = None
        self.rules: RuleSet | None = None
        self.channels: set[SessionRelay] = set()
        self.opened = 0  # session channels relayed so far
        self.first_end: str | None = None  # how the first one ended, recorded once a second one opens
        self.exit_code: int | None = None
        self.gone = False
        self.cut_short = False
        self.ending: str | None = None

    # -- asyncssh server callbacks

    def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
        self.conn = conn
        peer = conn.get_extra_info("peername")
        self.client_ip = peer[0] if isinstance(peer, tuple) else ""

    def connection_lost(self, exc: Exception | None) -> None:
        self.gone = True
        if self.ready is None or self.ready.done():
            _background(self._finish())
        # else the target login is still running: _open finishes the job when it is done

    async def begin_auth(self, username: str) -> bool:
        """No authentication needed when the user name is a valid secret."""
        if looks_like_secret(username) and await self._login(username):
            return False
        return True

    def password_auth_supported(self) -> bool:
        return True

    async def validate_password(self, username: str, password: str) -> bool:
        return await self._login(password)

    def public_key_auth_supported(self) -> bool:
        return False

    def kbdint_auth_supported(self) -> bool:
        return False

    def session_requested(self) -> Any:
        return self._session()

    def connection_requested(self, dest_host: str, dest_port: int, orig_host: str, orig_port: int) -> Any:
        return self._forward(dest_host, dest_port, orig_host, orig_port)

    def server_requested(self, listen_host: str, listen_port: int) -> Any:
        return self._refuse_remote(f"{listen_host}:{listen_port}")

    def unix_server_requested(self, listen_path: str) -> Any:
        return self._refuse_remote(listen_path)

    # -- login and target

    async def _login(self, secret: str) -> bool:
        if self.grant is not None:
            return True
        try:
            self.grant = await self.gateway.access.resolve(secret, "ssh", self.client_ip)
        except AccessDenied:
            return False
        self.ready = asyncio.ensure_future(self._open_guarded())
        return True

    async def _open_guarded(self) -> None:
        try:
            await self._open()
        except Exception:  # a store or session failure must not leave the client hanging
            log.exception("ssh session could not be opened", extra={"client_ip": self.client_ip})
            self.failure = "the gateway could not open the session (internal error)"
            if self.target is not None:
                self.target.close()
            if self.live is not None:
                await self.live.close(exit_code=BLOCKED_EXIT_CODE, error=self.failure)

    async def _open(self) -> None:
        """Log in to the target, then open the session (a failed target is a closed session with an ``e``)."""
        grant = self.grant
        assert grant is not None
        connection = grant.connection
        sessions = self.gateway.sessions
        try:
            settings = TargetSettings.from_role(connection.target())
            self.target = await connect_target(settings, connection.name, lambda: TargetWatch(self),
                                               dialer=self.gateway.dialer)
        except TargetError as exc:
            self.failure = str(exc)
            log.info("ssh target unreachable", extra={"connection": connection.name, "error": self.failure})
            live = await sessions.open(grant.user, connection, credential=grant.credential, client_ip=self.client_ip)
            await live.close(exit_code=BLOCKED_EXIT_CODE, error=self.failure)
            return
        try:
            self.live = await sessions.open(grant.user, connection, credential=grant.credential, client_ip=self.client_ip)
        except RuntimeError as exc:
            self.failure = str(exc)
            self.target.close()
            return
        self.live.on_kill(self._kill)
        self.rules = await self.gateway.guardrails.rules_for(connection.org_id, connection.id, live=self.live)
        if self.gone:  # the client left while the target login ran (connection_lost left this to us)
            await self._finish()

    async def _ready(self) -> bool:
        if self.ready is None:
            self.failure = self.failure or "not authenticated"
            return False
        await asyncio.shield(self.ready)
        return self.failure is None and self.live is not None and not self.live.done.is_set()

    def target_lost(self) -> None:
        """The target's connection dropped: channels are closing; end the client connection too."""
        if self.ending is None and not self.gone and self.live is not None:
            name = self.live.connection.name
            self.ending = f'the target of connection "{name}" closed the connection'
            self.live.recorder.error(self.ending)
            asyncio.get_running_loop().call_later(CLOSE_GRACE, self._disconnect)

    # -- session channels

    async def _session(self) -> asyncssh.SSHServerSession[bytes]:
        if not await self._ready():
            return RefusedSession(self.failure or self.ending or "the session is closed")
        relay = SessionRelay(self)
        self.channels.add(relay)
        self.opened += 1
        if self.opened == 2 and self.first_end is not None:
            relay.recorder.error(self.first_end)
        return relay

    def channel_ended(self, line: str) -> None:
        """A session channel ended (``exit 3 of the channel that ran: ...``): an ``e`` event once multiplexed."""
        if self.opened > 1 and self.live is not None:
            self.live.recorder.error(line)
        else:
            self.first_end = line  # a single-channel session records no such line: its exit_code says it

    # -- port forwarding

    async def _forward(self, dest_host: str, dest_port: int, orig_host: str,
                       orig_port: int) -> asyncssh.SSHTCPSession[bytes]:
        if not await self._ready():
            raise asyncssh.ChannelOpenError(asyncssh.OPEN_CONNECT_FAILED, self.failure or "the session is closed")
        live = self.live
        assert live is not None and self.target is not None
        where = f"{dest_host}:{dest_port}"
        name = live.connection.name
        if not allows_port_forwarding(live.connection.settings):
            message = (f'port forwarding to {where} refused: connection "{name}" does not allow it '
                       "(settings.ssh.allow_port_forwarding)")
            live.recorder.error(message)
            await self._audit("ssh.port_forward", "failure", message, where)
            raise asyncssh.ChannelOpenError(asyncssh.OPEN_ADMINISTRATIVELY_PROHIBITED, message)
        relay = ForwardRelay(live, where)
        try:
            await self.target.create_connection(relay.upstream_session, dest_host, dest_port, orig_host, orig_port,
                                                window=WINDOW, max_pktsize=MAX_PACKET)
        except asyncssh.ChannelOpenError as exc:
            message = f"port forwarding to {where} failed: the target answered: {exc.reason}"
            live.recorder.error(message)
            raise asyncssh.ChannelOpenError(exc.code, message) from None
        live.recorder.error(f"port forwarding to {where} opened")
        await self._audit("ssh.port_forward", "success", "", where)
        return relay

    async def _refuse_remote(self, where: str) -> bool:
        """Remote forwarding (``ssh -R``) is not offered: an ``e`` event and an ``ssh.port_forward`` audit entry."""
        if not await self._ready():
            return False
        message = f"remote port forwarding from {where} refused: the gateway does not offer it"
        assert self.live is not None
        self.live.recorder.error(message)
        await self._audit("ssh.port_forward", "failure", message, where)
        return False

    async def _audit(self, action: str, outcome: str, message: str, where: str) -> None:
        live = self.live
        assert live is not None
        await self.gateway.audit.record(
            org_id=live.session.org_id, actor=live.user, action=action, resource_type="session", outcome=outcome,
            error_message=message, client_ip=self.client_ip,
            payload={"session_id": live.id, "connection": live.connection.name, "destination": where})

    # -- the end

    def _kill(self, reason: str) -> None:
        """The gateway ends the session (kill, expiry, shutdown): every channel is told why, then the disconnect."""
        self.ending = reason
        for relay in list(self.channels):
            relay.end(reason)
        if self.target is not None:
            self.target.close()
        if not self.channels:
            self._disconnect()
        else:
            asyncio.get_running_loop().call_later(CLOSE_GRACE, self._disconnect)

    def channel_closed(self, relay: SessionRelay) -> None:
        self.channels.discard(relay)
        if self.ending is not None and not self.channels:
            self._disconnect()

    def _disconnect(self) -> None:
        if self.conn is not None and not self.gone:
            self.conn.disconnect(asyncssh.DISC_BY_APPLICATION, self.ending or "session closed")

    async def _finish(self) -> None:
        """The client went away: close the target and the session."""
        if self.target is not None:
            self.target.close()
        live = self.live
        if live is None or live.done.is_set():
            return
        error = "the client disconnected with a channel still open" if self.cut_short else None
        await live.close(exit_code=self.exit_code, error=error)


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

    def data_received(self, data: bytes, datatype: int | None) -> None:  # type: ignore[override]
        self.relay.from_target(data, datatype)

    def eof_received(self) -> bool:
        relay = self.relay
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
    """One client ``session`` channel mirrored to a channel on the target, through rules and recorder."""

    def __init__(self, owner: GatewayConnection) -> None:
        assert owner.live is not None and owner.target is not None and owner.rules is not None
        self.owner = owner
        self.live = owner.live
        self.recorder = owner.live.recorder
        self.rules = owner.rules
        self.target = owner.target
        self.chan: asyncssh.SSHServerChannel[bytes] = None  # type: ignore[assignment]
        self.upchan: asyncssh.SSHClientChannel[bytes] | None = None
        self.kind = ""
        self.command = ""
        self.pty = False
        self.shell: ShellInput | None = None
        self.sftp: SftpObserver | None = None
        self.pending: list[bytes] = []
        self.pending_eof = False
        self.client_eof = False  # the client sent EOF: it sends nothing more on this channel
        self.held_eof = False  # the target's EOF, sent to the client with the exit status
        self.injections: list[bytes] = []  # SFTP answers of the gateway waiting for a packet boundary
        self.exit_status: int | None = None
        self.exit_signal: tuple[str, bool, str, str] | None = None
        self.active = False  # a command, shell or subsystem is running
        self.ended = False
        self.draining = False  # waiting for the recorder to flush
        self.client_full = False  # the client channel's send buffer is full: stop reading the target
        self.target_full = False  # the target channel's send buffer is full: stop reading the client
        self.client_closed = False
        self.watch = OutputWatch(owner.rules) if owner.rules.output_rules else None  # None: no output rules

    # -- client side callbacks

    def connection_made(self, chan: asyncssh.SSHServerChannel[bytes]) -> None:  # type: ignore[override]
        self.chan = chan

    def pty_requested(self, term_type: str, term_size: tuple[int, int, int, int], term_modes: Any) -> bool:
        self.pty = True
        metrics = self.recorder.metrics
        if "terminal" not in metrics:
            metrics["terminal"] = {"type": term_type, "width": term_size[0], "height": term_size[1]}
        return True

    def shell_requested(self) -> bool:
        self.kind = "shell"
        # without input rules there is nothing to check: no per-byte line assembly, keystrokes pass as they come
        self.shell = ShellInput(self.pty) if self.rules.input_rules else None
        return self._start(None, None)

    def exec_requested(self, command: str) -> bool:
        self.kind = "exec"
        self.command = command
        return self._start(command, None)

    def subsystem_requested(self, subsystem: str) -> bool:
        if subsystem != "sftp":
            return False
        self.kind = "sftp"
        self.sftp = SftpObserver()
        return self._start(None, subsystem)

    def data_received(self, data: bytes, datatype: int | None) -> None:  # type: ignore[override]
        if self.upchan is None:
            self.pending.append(data)
            self.chan.pause_reading()
            return
        self.to_target(data)
        self._check_drain()

    def eof_received(self) -> bool:
        self.client_eof = True
        if self.upchan is None:
            self.pending_eof = True
        else:
            self._eof_to_target()
        return True

    def signal_received(self, signal: str) -> None:
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
        """Flow control: read each side only while the other can take more and the recorder keeps up."""
        if self.upchan is None:
            return
        if self.client_full or self.draining:
            self.upchan.pause_reading()
        else:
            self.upchan.resume_reading()
        if self.target_full or self.draining:
            self.chan.pause_reading()
        else:
            self.chan.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.client_closed = True
        if self.active and not self.ended:
            self.owner.cut_short = True  # the client went away while the target was still at work
            self._ended_as("no exit status")
        if self.upchan is not None:
            self.upchan.close()
        self.owner.channel_closed(self)

    # -- opening the target's channel

    def _start(self, command: str | None, subsystem: str | None) -> bool:
        self.active = True
        _background(self._open_target(command, subsystem))
        return True

    async def _open_target(self, command: str | None, subsystem: str | None) -> None:
        chan = self.chan
        if command is not None:
            self.recorder.input(command)
            verdict = self.rules.check_input(command)
            if not verdict.allowed:
                await self._refuse(verdict)
                return
        options: dict[str, Any] = {"command": command, "subsystem": subsystem, "env": chan.get_environment(),
                                   "encoding": None, "window": WINDOW, "max_pktsize": MAX_PACKET}
        if self.pty:
            options.update(term_type=chan.get_terminal_type(), term_size=chan.get_terminal_size(),
                           term_modes=chan.get_terminal_modes())
        try:
            self.upchan, _ = await self.target.create_session(lambda: _Upstream(self), **options)
        except (asyncssh.ChannelOpenError, asyncssh.Error, OSError) as exc:
            reason = getattr(exc, "reason", "") or str(exc) or type(exc).__name__
            message = f'the target of connection "{self.live.connection.name}" refused the channel: {reason}'
            self.recorder.error(message)
            self.end(message)
            return
        if self.ended:
            self.upchan.close()
            return
        pending, self.pending = self.pending, []
        for data in pending:
            self.to_target(data)
        if self.pending_eof:
            self._eof_to_target()
        self.sync_reading()

    async def _refuse(self, verdict: GuardVerdict) -> None:
        """An exec the input rules block: message on stderr, exit 254, the target never sees it."""
        self.owner.exit_code = BLOCKED_EXIT_CODE
        self.end(verdict.message)
        await self.live.blocked(verdict, self.owner.client_ip)

    # -- client to target

    def to_target(self, data: bytes) -> None:
        upchan = self.upchan
        assert upchan is not None
        if self.sftp is not None:
            self._sftp_to_target(self.sftp, upchan, data)
            return
        self.recorder.input(data)
        if self.shell is None:
            upchan.write(data)
            return
        for piece in self.shell.feed(data):
            if isinstance(piece, Chunk):
                upchan.write(piece.data)
                continue
            verdict = self.rules.check_input(piece.text) if piece.text.strip() else GuardVerdict(True)
            if verdict.allowed:
                upchan.write(piece.allowed)
            else:
                upchan.write(piece.refused)
                self._tell(verdict.message)
                _background(self.live.blocked(verdict, self.owner.client_ip))

    def _sftp_to_target(self, sftp: SftpObserver, upchan: asyncssh.SSHClientChannel[bytes], data: bytes) -> None:
        """SFTP requests: recorded as lines; the input rules may refuse an operation (permission denied)."""
        recorder = self.recorder
        for piece in sftp.client(data):
            if isinstance(piece, bytes):
                upchan.write(piece)
            elif isinstance(piece, tuple):
                recorder.record(*piece)
            else:
                verdict = self.rules.check_input(piece.line) if self.rules.input_rules else GuardVerdict(True)
                if verdict.allowed:
                    upchan.write(piece.raw)
                    if not piece.deferred:
                        recorder.input(piece.line)
                    continue
                recorder.input(piece.line)
                sftp.refused(piece.request_id)
                self._to_client_at_boundary(status_packet(piece.request_id, verdict.message))
                self._tell(verdict.message)  # sftp clients show a status code only: the reason goes to stderr
                _background(self.live.blocked(verdict, self.owner.client_ip))

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
                verdict = self.rules.check_input(piece.text) if piece.text.strip() else GuardVerdict(True)
                if verdict.allowed:
                    upchan.write(piece.allowed)  # type: ignore[union-attr]
                else:
                    self._tell(verdict.message)
                    _background(self.live.blocked(verdict, self.owner.client_ip))
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
            for kind, line in self.sftp.server(data):
                self.recorder.record(kind, line)
            self.chan.write(data)
            if self.injections and self.sftp.server_at_boundary:
                self._flush_injections()
            return
        if self.watch is not None:  # no decoding at all without output rules
            verdict = self.watch.check(data, 1 if datatype == STDERR else 0)
            if not verdict.allowed:
                self.owner.exit_code = BLOCKED_EXIT_CODE
                self.end(verdict.message)
                _background(self.live.blocked(verdict, self.owner.client_ip))
                return
        recorder = self.recorder
        if datatype == STDERR:
            recorder.error(data)
            self.chan.write_stderr(data)
        else:
            recorder.output(data)
            self.chan.write(data)
        self._check_drain()

    def _check_drain(self) -> None:
        if self.recorder.needs_drain and not self.draining and self.upchan is not None:
            self.draining = True
            self.sync_reading()
            _background(self._drain())

    async def _drain(self) -> None:
        try:
            await self.recorder.drain()
        finally:
            self.draining = False
            self.sync_reading()

    def target_closed(self) -> None:
        """The target's channel closed: pass its exit status or signal on."""
        self.active = False
        if self.ended:
            return
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
            name = self.live.connection.name
            message = f'the target of connection "{name}" closed the channel without an exit status'
            self.recorder.error(message)
            self.ended = False
            self.end(message)

    def end(self, message: str) -> None:
        """The gateway closes this channel: ``message`` on stderr, exit 254, the target's channel closed."""
        self.active = False
        if self.ended:
            return
        self.ended = True
        self.owner.exit_code = BLOCKED_EXIT_CODE
        self._ended_as(f"exit {BLOCKED_EXIT_CODE}")
        if self.upchan is not None:
            self.upchan.close()
        if not self.client_closed:
            self._tell(message)
            self.chan.exit(BLOCKED_EXIT_CODE)

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

    def data_received(self, data: bytes, datatype: int | None) -> None:  # type: ignore[override]
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

    The bytes are not recorded; the session gets an ``e`` event with the byte counts when it closes.
    """

    def __init__(self, live: LiveSession, where: str) -> None:
        self.live = live
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
        for data in self.early:
            chan.write(data)
        self.early.clear()

    def data_received(self, data: bytes, datatype: int | None) -> None:  # type: ignore[override]
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

    def closed(self) -> None:
        if self.done:
            return
        self.done = True
        for chan in (self.chan, self.upchan):
            if chan is not None:
                chan.close()
        self.live.recorder.error(f"port forwarding to {self.where} closed: {self.sent} bytes sent, "
                                 f"{self.received} bytes received")
