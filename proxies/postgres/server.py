"""The PostgreSQL listener: thin asyncio I/O around the codec, the relay state and the core.

One ``ClientConnection`` per accepted socket:

1. start-up -- SSLRequest (TLS terminated here), GSSENCRequest (declined),
   CancelRequest (mapped to the target's backend), StartupMessage;
2. the credential -- the start-up ``user`` is the secret, or any user with
   the secret as the (cleartext) password; the session pipeline admits it,
   refusals are ``FATAL 28P01``;
3. the target -- the pipeline dials it with ``upstream.connect_target`` and
   the role's settings, then opens the session; a failure is ``FATAL 08001``
   (the pipeline has closed the session with an ``e`` event);
4. the relay -- ``session.RelaySession`` takes both transports over and
   forwards raw frames in batches with flow control, asking ``relay`` what to
   block and inject (``relay`` reports to the session's policy chain); when it
   ends, the client is told why (FATAL) and the session is closed with its
   exit code.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import ssl
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from gatewayd import balance, metrics
from gatewayd.access import looks_like_secret
from gatewayd.guardrails import AUDIT_INPUT_CHARS, GuardVerdict
from gatewayd.pipeline import BLOCKED_EXIT_CODE, AccessDenied, GatewayClosing, ProxyContext, TargetUnreachable
from gatewayd.tasks import BackgroundTasks
from proxies.postgres import tls
from proxies.postgres.catalog import MEMORY_TOPIC, Catalog, Column, merged, read_catalog
from proxies.postgres.computed import Mentions
from proxies.postgres.codec import (
    CancelRequest,
    FrontendReader,
    GSSENCRequest,
    Message,
    ParameterStatus,
    PasswordMessage,
    ProtocolError,
    SSLRequest,
    StartupMessage,
    decode_backend,
    encode_authentication_cleartext_password,
    encode_authentication_ok,
    encode_backend_key_data,
    encode_error_response,
    encode_negotiate_protocol_version,
    encode_ready_for_query,
)
from proxies.postgres.fastpath import allowed_functions
from proxies.postgres.reading import SessionReading
from proxies.postgres.relay import ClientSide, Pending, ServerSide, WaitingClientSide
from proxies.postgres.rowmask import MASK_ROW_BYTES, mask_frames
from proxies.postgres.session import CLIENT, TARGET, RelaySession
from proxies.postgres.stream import FrameStream
from proxies.postgres.upstream import (
    TargetLink,
    TargetSettings,
    UpstreamError,
    connect_target,
    send_cancel,
    end_on_target,
    settings_sql,
    startup_settings,
    terminate,
)

if TYPE_CHECKING:
    from gatewayd.access import AccessGrant
    from gatewayd.dialer import Dialer
    from gatewayd.models import Connection
    from gatewayd.pipeline import SessionRun
    from gatewayd.policy import SessionPolicy

log = logging.getLogger("gatewayd.postgres")

STARTUP_TIMEOUT = 60.0  # start-up and credential exchange, per client


class Statements(deque):  # type: ignore[type-arg]
    """The relay's requests waiting for the target's answer (``relay.Pending``), noting since when (wall clock) the
    target has been busy with them: a cancel is sent only for a statement that was running when it was asked."""

    __slots__ = ("held", "since")

    def __init__(self) -> None:
        super().__init__()
        self.since = 0.0
        # the relay's ``cancel_held``: a cancel asked while the gateway holds a statement for its verdict
        self.held: Callable[[float], bool] | None = None

    def append(self, item: Any) -> None:
        if not self:
            self.since = time.time()
        super().append(item)


@dataclass(slots=True, frozen=True)
class CancelTarget:
    """Where a CancelRequest for one of the gateway's backend keys goes."""

    host: str
    port: int
    process_id: int
    secret_key: bytes
    dialer: Dialer | None = None  # the session's (its agent's, for a connection behind one)
    running: Statements | None = None  # what the session waits on the target for


# A key's process id: a marker bit above any server's process id (Linux's pid_max is at most 2^22; other systems
# stay lower), then the slot of the node that issued it, then random bits. It never names a real server process,
# so pg_cancel_backend / pg_terminate_backend of it (a client passing conn.info.backend_pid) fail, never hitting
# another session's backend; and a CancelRequest reaching another node or worker says where the session lives.
KEY_MARKER = 1 << 30
SLOT_SHIFT = 19
SLOT_MASK = 0x7FF  # 2047 nodes
CANCEL_TOPIC = "postgres.cancel"  # the bus topic: a CancelRequest that reached another node than the session's


class CancelKeys:
    """The BackendKeyData the gateway handed out, mapped to the target backends'.

    A key's process id carries the slot of the node that issued it (``slot_of``): a CancelRequest
    reaching another node or worker is sent on the bus to the one holding the session.
    """

    def __init__(self) -> None:
        self._keys: dict[tuple[int, bytes], CancelTarget] = {}

    def issue(self, target: CancelTarget, slot: int = 0) -> tuple[int, bytes]:
        while True:
            low = secrets.randbelow((1 << SLOT_SHIFT) - 1) + 1
            key = (KEY_MARKER | ((slot & SLOT_MASK) << SLOT_SHIFT) | low, secrets.token_bytes(4))
            if key not in self._keys:
                self._keys[key] = target
                return key

    @staticmethod
    def slot_of(process_id: int) -> int:
        return (process_id >> SLOT_SHIFT) & SLOT_MASK if process_id & KEY_MARKER else -1

    def pop(self, key: tuple[int, bytes]) -> None:
        self._keys.pop(key, None)

    def get(self, process_id: int, secret_key: bytes) -> CancelTarget | None:
        return self._keys.get((process_id, bytes(secret_key)))


# Keys outlive a listener restart: sessions opened through the old listener stay cancellable.
CANCEL_KEYS = CancelKeys()
_CANCEL_ROUTES: set[int] = set()  # the clusters whose cancel topic a listener of this process answers already


DATABASES_SETTING = "settings.postgres.databases"
# start-up settings drivers send for themselves, harmless: neither recorded nor read by the input rules (lower case)
ROUTINE_SETTINGS = frozenset({"application_name", "client_encoding", "datestyle", "timezone", "extra_float_digits",
                              "intervalstyle"})


def database_allowed(settings: dict[str, Any], database: str, own: str) -> bool:
    """Whether a client may name ``database`` in its start-up packet: the role's own (``own``), or one the
    connection lists in ``settings.postgres.databases`` (``"*"``: any)."""
    if database == own:
        return True
    postgres = settings.get("postgres") if isinstance(settings, dict) else None
    allowed = postgres.get("databases") if isinstance(postgres, dict) else None
    return isinstance(allowed, list) and ("*" in allowed or database in allowed)


def fatal(sqlstate: str, message: str) -> bytes:
    return encode_error_response("FATAL", sqlstate, message)


class PostgresListener:
    """A started PostgreSQL listener; ``close`` stops accepting (sessions in progress go on)."""

    def __init__(self, context: ProxyContext, tls_context: ssl.SSLContext | None) -> None:
        self.pipeline = context.pipeline
        self.settings = context.settings
        self.tls_context = tls_context
        self.server: asyncio.base_events.Server | None = None
        self.cancel_keys = CANCEL_KEYS
        self.cluster = context.cluster
        self.connections = BackgroundTasks("postgres listener")
        self.mask_row_bytes = int(context.settings.get("mask_row_bytes", MASK_ROW_BYTES))
        if self.cluster is not None and id(self.cluster) not in _CANCEL_ROUTES:  # once per process, not per listener
            _CANCEL_ROUTES.add(id(self.cluster))
            self.cluster.on(CANCEL_TOPIC, self._on_cancel)

    async def _on_cancel(self, message: dict[str, Any]) -> None:
        """A CancelRequest another node received for a session of this one (it waits for this to confirm)."""
        if self.cluster is None or message.get("slot") != self.cluster.slot:
            return
        try:
            await self.cancel_here(int(message["process_id"]), bytes.fromhex(str(message["secret_key"])),
                                   float(message["at"]))
        except (KeyError, ValueError, TypeError):
            log.warning("a malformed cancel message was ignored")

    async def cancel_here(self, process_id: int, secret_key: bytes, at: float) -> None:
        """Cancel the statement of a session held by this process that was running at ``at`` (when the client
        asked), and return once the target has the cancel. Unknown keys are ignored, as PostgreSQL does; so is
        a cancel for a statement that ended meanwhile: it never reaches a later one."""
        target = self.cancel_keys.get(process_id, secret_key)
        if target is None:
            return
        running = target.running
        if running is not None and (not running or running.since > at):
            if running.held is not None and running.held(at):
                log.info("a cancel came for a statement the gateway held for its verdict: answered as cancelled")
                return
            log.info("a cancel came for a statement that has ended: not sent on")
            return
        await send_cancel(target.host, target.port, target.process_id, target.secret_key,
                          dialer=target.dialer or self.pipeline.dialer)

    def accept(self, stream: FrameStream) -> None:
        """A client connected: its connection runs as a task of its own."""
        self.connections.spawn(self.handle(stream))

    async def handle(self, stream: FrameStream) -> None:
        connection = ClientConnection(self, stream)
        metrics.connection_opened("postgres")
        try:
            await connection.run()
        except Exception:
            log.exception("postgres connection failed", extra={"client_ip": connection.client_ip})
        finally:
            connection.stream.close()
            metrics.connection_closed("postgres")

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()  # the listening socket closes now; connections go on


async def start(context: ProxyContext, host: str, port: int) -> PostgresListener:
    """Listener factory registered as ``postgres``."""
    settings = context.settings
    tls_context = await asyncio.to_thread(tls.server_context, context.data_dir, settings["tls_cert"],
                                          settings["tls_key"])
    listener = PostgresListener(context, tls_context)
    listener.server = await balance.create_server(
        "postgres", lambda: FrameStream(FrontendReader(), listener.accept), host, port, reuse_port=context.reuse_port)
    return listener


class ClientConnection:
    """One client from its start-up packet to the end of its session."""

    def __init__(self, listener: PostgresListener, stream: FrameStream) -> None:
        self.listener = listener
        self.pipeline = listener.pipeline
        self.stream = stream
        transport = stream.transport
        peer = transport.get_extra_info("peername")
        self.client_ip = peer[0] if isinstance(peer, tuple) else ""
        self.frontend: FrontendReader = stream.reader  # type: ignore[assignment]
        self.link: TargetLink | None = None
        self.killed: str | None = None
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    # -- helpers

    def send_fatal(self, sqlstate: str, message: str) -> None:
        """Tell the client why it is being disconnected, and close."""
        try:
            self.stream.write(fatal(sqlstate, message))
        except (OSError, RuntimeError):
            pass
        self.stream.close()

    async def _next_client_message(self) -> Message | None:
        return await self.stream.next_message()

    # -- start-up

    async def run(self) -> None:
        try:
            async with asyncio.timeout(STARTUP_TIMEOUT):
                startup = await self._startup()
                if startup is None:
                    return
                secret = await self._secret(startup)
                if secret is None:
                    return
                grant = await self.pipeline.admit(secret, "postgres", self.client_ip)
        except AccessDenied as exc:
            self.send_fatal("28P01", str(exc))
            return
        except GatewayClosing as exc:  # the store does not answer, or this node is fenced: come back later
            self.send_fatal("57P03", str(exc))
            return
        except ProtocolError as exc:
            self.send_fatal(exc.sqlstate, exc.message)
            return
        except TimeoutError:
            self.send_fatal("08P01", "start-up timed out")
            return
        except (OSError, ssl.SSLError, asyncio.IncompleteReadError):  # gone, or a failed TLS handshake
            return
        await self._connect_and_relay(startup, grant)

    async def _startup(self) -> StartupMessage | None:
        """Answer SSL/GSSENC requests and cancel requests until the StartupMessage."""
        while True:
            message = await self._next_client_message()
            if message is None:
                return None
            if isinstance(message, GSSENCRequest):
                self.stream.write(b"N")
            elif isinstance(message, SSLRequest):
                if self.listener.tls_context is None or self.stream.transport.get_extra_info("sslcontext") is not None:
                    self.stream.write(b"N")
                    continue
                if self.frontend.buffered:  # plaintext queued behind the request: CVE-2021-23214
                    raise ProtocolError("unencrypted data after SSL request")
                self.stream.write(b"S")
                await self.stream.start_tls(self.listener.tls_context, server_side=True)
            elif isinstance(message, CancelRequest):
                await self._cancel(message)
                return None
            elif isinstance(message, StartupMessage):
                parameters = message.parameters
                options = [k for k in parameters if k.startswith("_pq_.")]
                if message.minor > 0 or options:
                    self.stream.write(encode_negotiate_protocol_version(0, options))
                return message

    async def _cancel(self, request: CancelRequest) -> None:
        """A CancelRequest: its connection closes once the target has the cancel (the client then knows it is
        in force, as with PostgreSQL itself), or when the node holding the session did not confirm in time."""
        at = time.time()
        cluster, slot = self.listener.cluster, CancelKeys.slot_of(request.process_id)
        if slot < 0:
            return  # not a key this gateway hands out
        if cluster is not None and slot not in (0, cluster.slot):  # the session lives on another node or worker
            holder = await cluster.node_of_slot(slot)
            if holder is None:
                return  # no node holds that slot now: the key is unknown, ignored as PostgreSQL does
            missing = await cluster.request(CANCEL_TOPIC, [holder], slot=slot, process_id=request.process_id,
                                            secret_key=bytes(request.secret_key).hex(), at=at)
            if missing:
                log.warning("a cancel was not confirmed by the node holding its session",
                            extra={"nodes": ",".join(missing)})
            return
        await self.listener.cancel_here(request.process_id, bytes(request.secret_key), at)

    async def _secret(self, startup: StartupMessage) -> str | None:
        """The credential secret: the start-up user, or else the password we ask for."""
        user = startup.user or ""
        if looks_like_secret(user):
            return user
        self.stream.write(encode_authentication_cleartext_password())
        message = await self._next_client_message()
        if message is None:
            return None
        if not isinstance(message, PasswordMessage):
            raise ProtocolError(f"expected a password message, got {type(message).__name__}")
        return message.password

    # -- target and session

    async def _connect_and_relay(self, startup: StartupMessage, grant: AccessGrant) -> None:
        connection = grant.connection
        parameters = startup.parameters
        database = parameters.get("database")
        if not database or database == parameters.get("user"):
            database = None  # libpq sends the user name when none is given: take the role's DB
        settings = TargetSettings.from_role(connection.target(), database)
        if database is not None and not database_allowed(connection.settings, database,
                                                         TargetSettings.from_role(connection.target()).database):
            reason = (f'database "{database}" is not reachable through connection "{connection.name}" '
                      f"(its database is the role's; the connection may allow others: {DATABASES_SETTING})")
            await self.pipeline.refuse(grant, "postgres", reason, self.client_ip)
            self.send_fatal("42501", reason)
            return

        async def dial(dialer: Dialer) -> TargetLink:
            return await connect_target(settings, parameters, connection.name, dialer=dialer)

        try:
            run = await self.pipeline.start(grant, self.client_ip, dial=dial, unreachable=(UpstreamError,),
                                            drop=terminate, on_kill=self._kill)
        except TargetUnreachable as exc:
            cause = exc.cause
            self.send_fatal(cause.sqlstate if isinstance(cause, UpstreamError) else "08001", exc.message)
            return
        except GatewayClosing as exc:
            self.send_fatal("57P03", str(exc))
            return
        self.link = link = run.target
        cluster = self.listener.cluster
        pending = Statements()
        key = self.listener.cancel_keys.issue(CancelTarget(settings.host, settings.port, link.process_id,
                                                           link.secret_key, self.pipeline.dialer_for(connection),
                                                           pending), cluster.slot if cluster else 0)
        async with run:
            verdict = await self._settings_verdict(run.policy, parameters)
            if verdict is not None:
                self.listener.cancel_keys.pop(key)
                terminate(link)
                await run.policy.blocked(verdict)
                self.send_fatal("42501", verdict.message)
                await run.close(exit_code=BLOCKED_EXIT_CODE)
                return
            try:
                startup = mask_frames(run.policy, link.startup_frames)  # a setting made from data, masked too
                self.stream.write(b"".join([encode_authentication_ok(), *startup, encode_backend_key_data(*key),
                                            encode_ready_for_query(link.status)]))
                exit_code, error = await self._relay(link, run, settings, connection, pending)
            finally:
                self.listener.cancel_keys.pop(key)
                terminate(link)
            await run.close(exit_code=exit_code, error=error)

    @staticmethod
    async def _settings_verdict(policy: SessionPolicy, parameters: dict[str, str]) -> GuardVerdict | None:
        """The client's start-up settings (its parameters, ``options``' ``-c``) but those drivers set for themselves,
        recorded and read by the input rules as the ``SET`` statements they amount to, before any statement runs
        under them. The verdict that refuses the session, or None."""
        settings, unreadable = startup_settings(parameters)
        text = settings_sql([(name, value) for name, value in settings if name.lower() not in ROUTINE_SETTINGS])
        if unreadable is not None:
            text = f"{text}{'; ' if text else ''}-- start-up options: {parameters.get('options', '')}"
        if not text:
            return None
        if unreadable is not None and policy.checks_input:
            policy.record_input(text)
            return GuardVerdict(False, f"validation error, the gateway cannot read the start-up settings the way the "
                                       f"server will: {unreadable}", "input", "reading", "", text[:AUDIT_INPUT_CHARS])
        if policy.needs_wait(text):
            await policy.decide(text)
        return policy.input(text)

    def _kill(self, reason: str) -> None:
        """The gateway ends the session (kill, expiry, shutdown): FATAL 57P01, both sockets close, and the
        query the target may still be running is cancelled."""
        self.killed = reason
        self.send_fatal("57P01", reason)
        if self.link is not None:
            end_on_target(self.link)

    # -- relay

    @staticmethod
    def _column_names(policy: SessionPolicy) -> tuple[str, ...]:
        return tuple(policy.masker.columns) if policy.masker is not None else ()

    async def _catalog(self, policy: SessionPolicy, settings: TargetSettings, connection: Connection,
                       learned: dict[tuple[int, int], str] | None = None) -> Catalog | None:
        """What the target's catalog says for the session's mask rules (catalog.py): where the columns they name
        are -- by name, and by the identity they had when a session last saw them (renamed since, they stay
        masked) -- and the database's types; an empty Catalog without mask rules; None when the catalog cannot
        be read (every value of a result is then masked whole, user types withheld: fail closed).  What was
        found by name, and ``learned`` by the relay, is remembered for the next sessions."""
        masker = policy.masker
        if masker is None:
            return Catalog()
        names = self._column_names(policy)
        memory: dict[str, list[Column]] = {}
        remembered: list[Column] = []
        if names:
            memory = await self.pipeline.recall(connection, MEMORY_TOPIC) or {}
            remembered = [(int(r), int(a), str(c)) for r, a, c in memory.get(settings.database, ())]
        try:  # what was learned is looked up by identity too (renamed since, its table's row type still holds it)
            found = await read_catalog(settings, connection.name, self.pipeline.dialer_for(connection), names,
                                       [*remembered, *((r, a, c) for (r, a), c in (learned or {}).items())])
        except UpstreamError as exc:
            log.warning("the target's catalog could not be read for the mask rules: results are masked whole",
                        extra={"connection": connection.name, "error": exc.message})
            return None
        if names:
            update = merged(remembered, {**(learned or {}), **found.sources})
            if update is not None:
                memory[settings.database] = update
                await self.pipeline.remember(connection, MEMORY_TOPIC, memory)
        return found

    async def _relay(self, link: TargetLink, run: SessionRun[TargetLink], settings: TargetSettings,
                     connection: Connection, pending: Statements) -> tuple[int, str | None]:
        """Relay until one side goes away; the session's exit code and error."""
        policy, name = run.policy, connection.name
        columns: dict[str, tuple[int, ...]] = {}
        server = ServerSide(policy, pending, columns)
        server.row_limit = self.listener.mask_row_bytes

        mentions = Mentions()  # the client side's: what a statement names, with what the catalog says is built in

        def adopt(catalog: Catalog | None) -> None:
            if catalog is not None and catalog.shapes is not None:
                server.set_types(catalog.shapes)  # first: the columns masked are worked out again with them
            server.set_sources(None if catalog is None else {**catalog.sources, **catalog.views},
                               self._column_names(policy), None if catalog is None else catalog.holders,
                               frozenset() if catalog is None else catalog.computed,
                               0 if catalog is None else catalog.newest)
            mentions.learn(None if catalog is None else catalog.builtins)

        adopt(await self._catalog(policy, settings, connection))
        looking: list[asyncio.Task[None]] = []  # the catalog read again (one at a time; once more if asked meanwhile)
        again = [False]

        async def look_again() -> None:
            while True:
                again[0] = False
                adopt(await self._catalog(policy, settings, connection, dict(server.learned)))
                if not again[0]:
                    return

        def wanted() -> None:
            """The relay met a type the catalog did not say, or a rule's column under a new identity."""
            if looking and not looking[0].done():
                again[0] = True
                return
            looking[:] = [self.pipeline.tasks.spawn(look_again())]

        server.catalog_wanted = wanted
        reload = run.live.reload_rules
        if reload is not None:  # rules changed mid-session: column names the catalog was not asked about, asked now
            async def reload_and_look_up() -> None:
                await reload()
                if policy.masker is not None and (not set(self._column_names(policy)) <= server.sources_for
                                                  or not server.shapes.complete):
                    adopt(await self._catalog(policy, settings, connection, dict(server.learned)))
            run.live.reload_rules = reload_and_look_up
        reading = SessionReading()
        for frame in link.startup_frames:  # the settings the target started with (its start-up ParameterStatus)
            message = decode_backend(frame)
            if isinstance(message, ParameterStatus):
                reading.observe(message.name, message.value)
        server.reading = reading
        client = (WaitingClientSide if policy.waits else ClientSide)(policy, pending, columns, reading,
                                                                      allowed_functions(connection.settings))
        client.limit = self.listener.settings.get("max_statement_bytes") or client.limit
        client.mentions = mentions
        relay = RelaySession(self.stream.transport, link.transport, self.frontend, link.backend, client, server,
                             policy)
        pending.held = relay.cancel_held
        self.stream.release()
        link.stream.release()
        relay.start()  # what start-up had read beyond its last message is in the readers: processed first
        if self.stream.closed:
            relay.finish(CLIENT)
        elif link.stream.closed:
            relay.finish(TARGET)
        side, error = await relay.wait()
        server.flush_output()
        if self.killed is not None:
            return BLOCKED_EXIT_CODE, None
        if error is not None:
            if side == CLIENT:
                message = f"protocol violation: {error.message}"
                self.send_fatal(error.sqlstate, message)
            else:
                message = f'the target of connection "{name}" sent malformed data: {error.message}'
                self.send_fatal("08P01", message)
            return BLOCKED_EXIT_CODE, message
        if side == CLIENT:
            return 0, None
        message = f'the target of connection "{name}" closed the connection unexpectedly'
        if not server.target_fatal:
            self.send_fatal("08006", message)
        else:
            self.stream.close()
        return BLOCKED_EXIT_CODE, message
